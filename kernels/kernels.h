/* kernels.h - compute backends. For now: finding CUDA devices and proving
 * that the CUDA layer is built, linked and (where a GPU exists) runs. The
 * op interface (GEMM, element-wise, conv helpers) joins this header with the
 * trainer. */
#ifndef STK_KERNELS_H
#define STK_KERNELS_H

#include "common/common.h"

#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* True when this build contains the CUDA backend. */
bool stk_cuda_built(void);

/* Number of usable CUDA devices. Returns STK_ENODEV with a reason when this
 * machine has none (no CUDA in this build, no device, no NVIDIA driver),
 * STK_EIO when a GPU is there but CUDA fails (say, a driver too old). */
int stk_cuda_device_count(int *count, stk_err *err);

/* Selects device and runs a fill kernel and a host round trip on n floats,
 * checking every element: the smallest proof that kernels execute. */
int stk_cuda_selftest(int device, int n, stk_err *err);

#ifdef __cplusplus
}
#endif

#endif
