// cuda_device.cu - device discovery and a self-test kernel. Every CUDA call
// is checked; errors come back as STK_E* codes with the call's text.
#include "kernels.h"

#include <cuda_runtime.h>

#define CUDA_TRY(call, what)                                                   \
    do {                                                                       \
        cudaError_t e_ = (call);                                               \
        if (e_ != cudaSuccess) {                                               \
            rc = stk_fail(err, STK_ENODEV, "%s: %s (%s)", what,                \
                          cudaGetErrorString(e_), cudaGetErrorName(e_));       \
            goto out;                                                          \
        }                                                                      \
    } while (0)

extern "C" bool stk_cuda_built(void) { return true; }

extern "C" int stk_cuda_device_count(int *count, stk_err *err)
{
    *count = 0;
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess)
        return stk_fail(err, STK_ENODEV, "no CUDA device: %s (%s)",
                        cudaGetErrorString(e), cudaGetErrorName(e));
    if (n == 0)
        return stk_fail(err, STK_ENODEV, "no CUDA device found");
    *count = n;
    return 0;
}

__global__ void fill_index(float *x, int n, float scale)
{
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += gridDim.x * blockDim.x)
        x[i] = scale * (float)i;
}

extern "C" int stk_cuda_selftest(int device, int n, stk_err *err)
{
    int rc = 0;
    float *dev = NULL, *host = NULL;
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
        cudaFree(dev);
    if (host)
        cudaFreeHost(host);
    return rc;
}
