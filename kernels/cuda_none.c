/* cuda_none.c - the CUDA entry points of a build without the toolkit. */
#include "backend_impl.h"

bool stk_cuda_built(void) { return false; }

int stk_cuda_device_count(int *count, stk_err *err)
{
    *count = 0;
    return stk_fail(err, STK_ENODEV,
                    "this stoke was built without CUDA (-DSTK_CUDA=OFF or no "
                    "toolkit found)");
}

int stk_cuda_selftest(int device, int n, stk_err *err)
{
    (void)device;
    (void)n;
    return stk_fail(err, STK_ENODEV, "this stoke was built without CUDA");
}

int stk_cuda_backend_init(stk_backend *be, int device, stk_err *err)
{
    (void)be;
    (void)device;
    return stk_fail(err, STK_ENODEV,
                    "--device cuda: this stoke was built without CUDA "
                    "(rebuild where the CUDA toolkit is installed)");
}

void *stk_cuda_stream(stk_backend *be)
{
    (void)be;
    return NULL;
}
