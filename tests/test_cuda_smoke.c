/* test_cuda_smoke - the CUDA layer runs a kernel on every device; skips
 * (exit 77) with the reason where there is no CUDA build or no GPU. */
#include "kernels/kernels.h"

#include <stdio.h>

int main(void)
{
    stk_err err = {0};
    int n = 0;
    int rc = stk_cuda_device_count(&n, &err);
    if (rc == STK_ENODEV) {
        printf("SKIP: %s\n", err.msg);
        return 77;
    }
    if (rc) { /* a GPU is there but CUDA does not work: that is a failure */
        printf("FAIL: %s\n", err.msg);
        return 1;
    }
    for (int d = 0; d < n; d++) {
        if (stk_cuda_selftest(d, 1 << 20, &err)) {
            printf("FAIL: device %d: %s\n", d, err.msg);
            return 1;
        }
        printf("ok: device %d ran a kernel and a round trip\n", d);
    }
    return 0;
}
