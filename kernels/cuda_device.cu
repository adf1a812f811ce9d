// cuda_device.cu - device discovery and a self-test kernel. Every CUDA call
// is checked; errors come back as STK_E* codes with the call's text.
#include "kernels.h"

#include <climits>
#include <cuda_runtime.h>
#include <unistd.h>

#define CUDA_TRY(call, what)                                                   \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            (void)cudaGetLastError(); /* not the next launch's error */        \
            rc = stk_fail(err, STK_EIO, "%s: %s (%s)", what,                   \
                          cudaGetErrorString(e_), cudaGetErrorName(e_));       \
            goto out;                                                          \
        }                                                                      \
    } while (0)

// Frees and reports the first failure without hiding an earlier one.
#define CUDA_FREE(call, what)                                                  \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess && !rc)                                          \
            rc = stk_fail(err, STK_EIO, "%s: %s", what,                        \
                          cudaGetErrorString(e_));                             \
    } while (0)

extern "C" bool stk_cuda_built(void) { return true; }

extern "C" int stk_cuda_device_count(int *count, stk_err *err)
{
    *count = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    // No device, or a driver too old with no NVIDIA device node at all:
    // this machine has no GPU. Anything else is a broken GPU setup.
    bool absent = e == cudaErrorNoDevice ||
                  (e == cudaErrorInsufficientDriver &&
                   access("/dev/nvidiactl", F_OK) != 0);
    if (e != cudaSuccess)
        (void)cudaGetLastError(); /* reported here, not by a later launch */
    if (e != cudaSuccess)
        return stk_fail(err, absent ? STK_ENODEV : STK_EIO,
                        "%s: %s (%s)",
                        absent ? "no CUDA device" : "CUDA is broken here",
                        cudaGetErrorString(e), cudaGetErrorName(e));
    if (n == 0)
        return stk_fail(err, STK_ENODEV, "no CUDA device found");
    *count = n;
    return 0;
}

__global__ void fill_index(float *x, int n, float scale)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = scale * (float)i;
}

extern "C" int stk_cuda_selftest(int device, int n, stk_err *err)
{
    int rc = 0;
    float *dev = NULL, *host = NULL;
    if (n <= 0 || n > INT_MAX - 255)
        return stk_fail(err, STK_EINVAL, "selftest size %d out of range", n);
    CUDA_TRY(cudaSetDevice(device), "cudaSetDevice");
    CUDA_TRY(cudaMalloc((void **)&dev, (size_t)n * sizeof(float)),
             "cudaMalloc");
    CUDA_TRY(cudaMallocHost((void **)&host, (size_t)n * sizeof(float)),
             "cudaMallocHost");
    fill_index<<<(n + 255) / 256 < 1024 ? (n + 255) / 256 : 1024, 256>>>(
        dev, n, 0.5f);
    CUDA_TRY(cudaGetLastError(), "fill_index launch");
    CUDA_TRY(cudaMemcpy(host, dev, (size_t)n * sizeof(float),
                        cudaMemcpyDeviceToHost),
             "cudaMemcpy");
    for (int i = 0; i < n; i++)
        if (host[i] != 0.5f * (float)i) {
            rc = stk_fail(err, STK_EIO,
                          "device %d: element %d is %g, expected %g", device,
                          i, host[i], 0.5f * (float)i);
            break;
        }
out:
    if (dev)
        CUDA_FREE(cudaFree(dev), "cudaFree");
    if (host)
        CUDA_FREE(cudaFreeHost(host), "cudaFreeHost");
    return rc;
}
