/* cuda_none.c - the CUDA entry points of a build without the toolkit. */
#include "kernels.h"

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
