// cuda_ops.cu - the CUDA backend: the op table of backend_impl.h over
// cuBLAS (GEMM) and grid-stride kernels that call the element-wise bodies of
// ops_inline.h, so the GPU runs the arithmetic the CPU tests check (cpu.c is
// the reference; names and semantics here mirror it).
//
// State lives in the backend (be->impl): one non-blocking stream for the
// ops, a second for stk_upload (batches copy while kernels run), a cuBLAS
// handle bound to the first, and a small device scratch buffer that grows
// for the reductions (cross-entropy, sum of squares, the batchnorm and bias
// gradient's partial sums) and holds the batchnorm passes' per-channel
// coefficients and the input transform's per-sample draws (read by kernels
// queued behind; the buffer is only replaced after a stream sync). Every
// op is queued on the stream; only xent and sumsq wait, because they return
// a host value, and a reduction whose scratch must grow (once per new,
// larger shape: the batchnorm sums reserve what their backward will need).
// One backend is driven by one host thread at a time (the scratch is shared);
// each op selects the backend's device first, so a thread that never called
// cudaSetDevice still works on the right GPU.
//
// Every CUDA runtime and cuBLAS call is checked; failures come back as
// STK_EIO (STK_ENOMEM for allocations) with a message naming the op and the
// call. Nothing here prints or exits.
#include "backend_impl.h"

#include <climits>
#include <cstdlib>
#include <cublas_v2.h>
#include <cuda_runtime.h>

static constexpr unsigned THREADS = 256;   // per block, every kernel
static constexpr size_t MAX_BLOCKS = 4096; // grid-stride loops cover the rest

// Device scratch: a result header, then an array from ARRAY_OFFSET on.
static constexpr size_t ARRAY_OFFSET = 256;
// Its first size at least: the small reductions (bias_grad's partial sums
// in the first backward, xent's rows) then never grow it, a stream sync and
// a cudaFree (which waits for every stream) in the middle of a step.
static constexpr size_t SCRATCH_MIN = 64 << 10;

typedef struct reduce_result {
    double sum;       // the reduction's total
    unsigned bad_row; // xent: first row with a label out of range, or ~0u
} reduce_result;

typedef struct cuda_impl {
    cudaStream_t stream;
    cudaStream_t copy; // stk_upload's: batches upload while compute runs
    cublasHandle_t blas;
    void *scratch; // reduce_result + array; idle between calls
    size_t scratch_bytes;
} cuda_impl;

static cuda_impl *impl(stk_backend *be)
{
    return (cuda_impl *)be->impl;
}

// ---- error checking -------------------------------------------------------

// 0, or a failure naming op and call. A failed runtime call also sets the
// thread's "last error"; it is cleared here, once reported, so that it does
// not resurface as the launch error of a later kernel.
static int cuda_check(cudaError_t e, const char *op, const char *call,
                      stk_err *err)
{
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return stk_fail(err, e == cudaErrorMemoryAllocation ? STK_ENOMEM : STK_EIO,
                    "%s: %s: %s (%s)", op, call, cudaGetErrorString(e),
                    cudaGetErrorName(e));
}

static int blas_check(cublasStatus_t s, const char *op, const char *call,
                      stk_err *err)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return 0;
    (void)cudaGetLastError(); // a failed internal launch: not the next op's
    return stk_fail(err,
                    s == CUBLAS_STATUS_ALLOC_FAILED ? STK_ENOMEM : STK_EIO,
                    "%s: %s: %s (%s)", op, call, cublasGetStatusString(s),
                    cublasGetStatusName(s));
}

// Returns from the calling op (which has err in scope) when fn fails.
#define CUDA_TRY(op, fn, args)                                                \
    do {                                                                      \
        int rc_ = cuda_check(fn args, op, #fn, err);                          \
        if (rc_)                                                              \
            return rc_;                                                       \
    } while (0)

// For the void entry points (free, destroy): nothing to report to, so the
// error is only cleared from the thread's last-error slot.
static void cuda_quiet(cudaError_t e)
{
    if (e != cudaSuccess)
        (void)cudaGetLastError();
}

// The runtime's current device is per host thread: every entry point selects
// ours first, so that a thread that never chose one does not create a
// context on GPU 0 (and kernels and cuBLAS go to the stream's device).
static int use_device(stk_backend *be, const char *op, stk_err *err)
{
    return cuda_check(cudaSetDevice(be->device), op, "cudaSetDevice", err);
}

// ---- launching -------------------------------------------------------------

static unsigned grid_for(size_t n)
{
    size_t blocks = (n + THREADS - 1) / THREADS;
    return (unsigned)(blocks < MAX_BLOCKS ? blocks : MAX_BLOCKS);
}

// Grid-stride loops: for (i = first_index(); i < n; i += index_step()).
static __device__ size_t first_index()
{
    return (size_t)blockIdx.x * blockDim.x + threadIdx.x;
}

static __device__ size_t index_step()
{
    return (size_t)gridDim.x * blockDim.x;
}

// Reports a failed kernel launch (bad configuration, no image for this GPU).
static int launched(const char *op, stk_err *err)
{
    return cuda_check(cudaGetLastError(), op, "kernel launch", err);
}

// Launches kernel over n elements on the backend's stream (nothing when n is
// 0) and reports a launch failure naming op.
template <typename... P, typename... A>
static int launch(stk_backend *be, const char *op, size_t n, stk_err *err,
                  void (*kernel)(P...), A... args)
{
    if (n == 0)
        return 0;
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    kernel<<<grid_for(n), THREADS, 0, impl(be)->stream>>>(args...);
    return launched(op, err);
}

static_assert((THREADS & (THREADS - 1)) == 0, "block_sum halves THREADS");

// Sum of v over the block (blockDim.x == THREADS), in a fixed order so that
// results repeat run to run; every thread gets the total. All threads of
// the block call it, as often as they like (the last barrier lets the next
// call overwrite part).
static __device__ double block_sum(double v)
{
    __shared__ double part[THREADS];
    part[threadIdx.x] = v;
    __syncthreads();
    for (unsigned s = THREADS / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s)
            part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    double total = part[0];
    __syncthreads();
    return total;
}

// ---- backend state ---------------------------------------------------------

// Releases what init created, in reverse; for a partly built impl too.
static void impl_release(cuda_impl *cu)
{
    if (!cu)
        return;
    if (cu->stream)
        cuda_quiet(cudaStreamSynchronize(cu->stream));
    if (cu->copy)
        cuda_quiet(cudaStreamSynchronize(cu->copy));
    if (cu->blas) // void, nothing to report to; it syncs the device itself
        (void)cublasDestroy(cu->blas);
    if (cu->scratch)
        cuda_quiet(cudaFree(cu->scratch));
    if (cu->stream)
        cuda_quiet(cudaStreamDestroy(cu->stream));
    if (cu->copy)
        cuda_quiet(cudaStreamDestroy(cu->copy));
    free(cu);
}

static void cuda_destroy(stk_backend *be)
{
    cuda_quiet(cudaSetDevice(be->device));
    impl_release(impl(be));
    be->impl = NULL;
}

// Makes the scratch at least bytes long. Kernels queued earlier (the
// batchnorm passes') may still read the old buffer: the sync lets them
// finish before it is freed.
static int scratch_reserve(stk_backend *be, size_t bytes, const char *op,
                           stk_err *err)
{
    cuda_impl *cu = impl(be);
    if (cu->scratch_bytes >= bytes)
        return 0;
    if (cu->scratch) {
        CUDA_TRY(op, cudaStreamSynchronize, (cu->stream));
        CUDA_TRY(op, cudaFree, (cu->scratch));
        cu->scratch = NULL;
        cu->scratch_bytes = 0;
    }
    bytes = bytes > SCRATCH_MIN ? bytes : SCRATCH_MIN;
    void *p = NULL;
    CUDA_TRY(op, cudaMalloc, (&p, bytes));
    cu->scratch = p;
    cu->scratch_bytes = bytes;
    // the result header is copied back whole: no byte of it uninitialised
    // (its padding, or bad_row where a reduction does not set it)
    CUDA_TRY(op, cudaMemsetAsync, (p, 0, ARRAY_OFFSET, cu->stream));
    return 0;
}

static reduce_result *scratch_result(stk_backend *be)
{
    return (reduce_result *)impl(be)->scratch;
}

template <typename T> static T *scratch_array(stk_backend *be)
{
    return (T *)((char *)impl(be)->scratch + ARRAY_OFFSET);
}

// Copies the result header to the host and waits for the stream.
static int fetch_result(stk_backend *be, reduce_result *out, const char *op,
                        stk_err *err)
{
    cudaStream_t s = impl(be)->stream;
    CUDA_TRY(
        op, cudaMemcpyAsync,
        (out, scratch_result(be), sizeof *out, cudaMemcpyDeviceToHost, s));
    CUDA_TRY(op, cudaStreamSynchronize, (s));
    return 0;
}

// ---- memory ----------------------------------------------------------------

static void *cuda_alloc(stk_backend *be, size_t bytes, stk_err *err)
{
    void *p = NULL;
    if (use_device(be, "cuda alloc", err))
        return NULL;
    cudaError_t e = cudaMalloc(&p, bytes ? bytes : 1); // like cpu: never NULL
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        stk_fail(err, e == cudaErrorMemoryAllocation ? STK_ENOMEM : STK_EIO,
                 "cuda alloc: cudaMalloc of %zu bytes on device %d: %s (%s)",
                 bytes, be->device, cudaGetErrorString(e),
                 cudaGetErrorName(e));
        return NULL;
    }
    return p;
}

// Frees wait for the stream first: queued work may still use the memory
// (after a failed step), and cudaFree's own synchronisation is not promised.
static void cuda_free(stk_backend *be, void *p)
{
    cuda_quiet(cudaSetDevice(be->device));
    cuda_quiet(cudaStreamSynchronize(impl(be)->stream));
    cuda_quiet(cudaStreamSynchronize(impl(be)->copy)); // an upload's target
    cuda_quiet(cudaFree(p));
}

static void *cuda_host_alloc(stk_backend *be, size_t bytes)
{
    void *p = NULL;
    if (use_device(be, "cuda host_alloc", NULL))
        return NULL;
    cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cuda_host_free(stk_backend *be, void *p)
{
    cuda_quiet(cudaSetDevice(be->device));
    cuda_quiet(cudaStreamSynchronize(impl(be)->stream));
    cuda_quiet(cudaStreamSynchronize(impl(be)->copy)); // an upload's source
    cuda_quiet(cudaFreeHost(p));
}

// Queued on the stream, after the ops before it. The host side may be
// pageable or page-locked; either way it belongs to the copy until stk_sync
// (the runtime may return before a page-locked copy is done).
static int cuda_copy(stk_backend *be, void *dst, const void *src, size_t n,
                     int to_dev, stk_err *err)
{
    if (n == 0)
        return 0;
    const char *op = to_dev ? "cuda copy to device" : "cuda copy to host";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaMemcpyAsync,
             (dst, src, n,
              to_dev ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
              impl(be)->stream));
    return 0;
}

static int cuda_memzero(stk_backend *be, void *p, size_t n, stk_err *err)
{
    if (n == 0)
        return 0;
    int rc = use_device(be, "cuda memzero", err);
    if (rc)
        return rc;
    CUDA_TRY("cuda memzero", cudaMemsetAsync, (p, 0, n, impl(be)->stream));
    return 0;
}

// Waits for everything queued; also reports a failure of an earlier
// asynchronous kernel or copy.
static int cuda_sync(stk_backend *be, stk_err *err)
{
    int rc = use_device(be, "cuda sync", err);
    if (rc)
        return rc;
    CUDA_TRY("cuda sync", cudaStreamSynchronize, (impl(be)->stream));
    return 0;
}

// ---- the copy stream and events ---------------------------------------------

// A stk_event is the cudaEvent_t itself (timing off: the cheapest kind).
static cudaEvent_t cuda_event(stk_event *ev)
{
    return (cudaEvent_t)(void *)ev;
}

static cudaStream_t stream_of(stk_backend *be, stk_stream_id s)
{
    return s == STK_STREAM_COPY ? impl(be)->copy : impl(be)->stream;
}

static int cuda_event_create(stk_backend *be, stk_event **out, stk_err *err)
{
    const char *op = "cuda event_create";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    cudaEvent_t e = NULL;
    CUDA_TRY(op, cudaEventCreateWithFlags, (&e, cudaEventDisableTiming));
    *out = (stk_event *)(void *)e;
    return 0;
}

static void cuda_event_destroy(stk_backend *be, stk_event *ev)
{
    cuda_quiet(cudaSetDevice(be->device));
    cuda_quiet(cudaEventDestroy(cuda_event(ev)));
}

static int cuda_event_record(stk_backend *be, stk_event *ev, stk_stream_id s,
                             stk_err *err)
{
    const char *op = "cuda event_record";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaEventRecord, (cuda_event(ev), stream_of(be, s)));
    return 0;
}

static int cuda_stream_wait(stk_backend *be, stk_stream_id s, stk_event *ev,
                            stk_err *err)
{
    const char *op = "cuda stream_wait";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaStreamWaitEvent, (stream_of(be, s), cuda_event(ev), 0));
    return 0;
}

// cudaErrorNotReady is the answer "not yet", not a failure; it is cleared
// from the thread's last error (as PyTorch does) so that no later launch
// check reports it. Every launch is checked as it is queued, so nothing
// else is lost, and a kernel's failure is sticky: it comes back anyway.
static int cuda_event_query(stk_backend *be, stk_event *ev, bool *done,
                            stk_err *err)
{
    const char *op = "cuda event_query";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    cudaError_t e = cudaEventQuery(cuda_event(ev));
    *done = e == cudaSuccess;
    if (e != cudaErrorNotReady)
        return cuda_check(e, op, "cudaEventQuery", err);
    (void)cudaGetLastError();
    return 0;
}

static int cuda_event_wait(stk_backend *be, stk_event *ev, stk_err *err)
{
    const char *op = "cuda event_wait";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaEventSynchronize, (cuda_event(ev)));
    return 0;
}

// From page-locked host memory the copy is asynchronous: it runs on the
// copy engine beside the compute stream's kernels.
static int cuda_upload(stk_backend *be, void *dst, const void *src, size_t n,
                       stk_err *err)
{
    const char *op = "cuda upload";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaMemcpyAsync,
             (dst, src, n, cudaMemcpyHostToDevice, impl(be)->copy));
    return 0;
}

// ---- GEMM ------------------------------------------------------------------

// k = 0: C = beta C, as BLAS defines it (beta 0 writes zeros without
// reading C), for count matrices m x n of row stride ldc, sc apart. cuBLAS's
// documentation does not say what it does with k = 0, and the API lets a
// caller pass a row stride of 0 then (cuBLAS wants 1 or more): such a
// GEMM never reaches cuBLAS.
static __global__ void gemm_scale_kernel(float *c, float beta, size_t n,
                                         size_t ldc, size_t per, size_t sc,
                                         size_t total)
{
    for (size_t i = first_index(); i < total; i += index_step()) {
        float *x = c + i / per * sc + i % per / n * ldc + i % n;
        *x = beta == 0.0f ? 0.0f : beta * *x;
    }
}

static int gemm_scale(stk_backend *be, const char *op, int m, int n,
                      float beta, float *c, int ldc, size_t sc, int count,
                      stk_err *err)
{
    size_t per = (size_t)m * n;
    return launch(be, op, per * count, err, gemm_scale_kernel, c, beta,
                  (size_t)n, (size_t)ldc, per, sc, per * count);
}

// Row-major C = alpha op(A) op(B) + beta C. cuBLAS is column-major, and a
// row-major matrix read column-major is its transpose, so compute
// C^T = op(B)^T op(A)^T: B first with tb's op, A second with ta's op, sizes
// n x m by k. The handle keeps the default math mode (no TF32), so results
// stay within float rounding of the CPU's.
static int cuda_gemm(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                     float alpha, const float *a, int lda, const float *b,
                     int ldb, float beta, float *c, int ldc, stk_err *err)
{
    if (k == 0)
        return gemm_scale(be, "cuda gemm", m, n, beta, c, ldc, 0, 1, err);
    int rc = use_device(be, "cuda gemm", err);
    if (rc)
        return rc;
    return blas_check(cublasSgemm(impl(be)->blas,
                                  tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                                  &alpha, b, ldb, a, lda, &beta, c, ldc),
                      "cuda gemm", "cublasSgemm", err);
}

// Batch of GEMMs of one shape, with the same row-major mapping as
// cuda_gemm; the strides are those of A, B and C as the caller stores them.
static int cuda_gemm_batched(stk_backend *be, bool ta, bool tb, int m, int n,
                             int k, float alpha, const float *a, int lda,
                             size_t sa, const float *b, int ldb, size_t sb,
                             float beta, float *c, int ldc, size_t sc,
                             int count, stk_err *err)
{
    if (k == 0)
        return gemm_scale(be, "cuda gemm_batched", m, n, beta, c, ldc, sc,
                          count, err);
    int rc = use_device(be, "cuda gemm_batched", err);
    if (rc)
        return rc;
    return blas_check(
        cublasSgemmStridedBatched(impl(be)->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  ta ? CUBLAS_OP_T : CUBLAS_OP_N, n, m, k,
                                  &alpha, b, ldb, (long long)sb, a, lda,
                                  (long long)sa, &beta, c, ldc, (long long)sc,
                                  count),
        "cuda gemm_batched", "cublasSgemmStridedBatched", err);
}

// ---- element-wise ops ------------------------------------------------------

static __global__ void relu_fwd_kernel(const float *x, float *y, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        y[i] = stk_relu1(x[i]);
}

static int cuda_relu_fwd(stk_backend *be, const float *x, float *y, size_t n,
                         stk_err *err)
{
    return launch(be, "cuda relu_fwd", n, err, relu_fwd_kernel, x, y, n);
}

static __global__ void relu_bwd_kernel(const float *y, const float *dy,
                                       float *dx, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        dx[i] = stk_relu_grad1(y[i], dy[i]);
}

static int cuda_relu_bwd(stk_backend *be, const float *y, const float *dy,
                         float *dx, size_t n, stk_err *err)
{
    return launch(be, "cuda relu_bwd", n, err, relu_bwd_kernel, y, dy, dx, n);
}

static __global__ void bias_add_kernel(float *y, const float *b, size_t cols,
                                       size_t inner, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        y[i] += b[i / inner % cols];
}

static int cuda_bias_add(stk_backend *be, float *y, const float *b, int rows,
                         int cols, int inner, stk_err *err)
{
    if (rows <= 0 || cols <= 0 || inner <= 0)
        return 0;
    size_t n = (size_t)rows * cols * inner;
    return launch(be, "cuda bias_add", n, err, bias_add_kernel, y, b,
                  (size_t)cols, (size_t)inner, n);
}

// ---- convolution and pooling -----------------------------------------------

static __global__ void im2col_kernel(const float *x, stk_conv_shape s, int n,
                                     float *col, size_t total)
{
    for (size_t j = first_index(); j < total; j += index_step())
        col[j] = stk_im2col1(x, &s, n, j);
}

static int cuda_im2col(stk_backend *be, const float *x,
                       const stk_conv_shape *s, int n, float *col,
                       stk_err *err)
{
    size_t total = (size_t)s->c * s->kh * s->kw * s->oh * s->ow * (size_t)n;
    return launch(be, "cuda im2col", total, err, im2col_kernel, x, *s, n, col,
                  total);
}

static __global__ void col2im_kernel(const float *col, stk_conv_shape s, int n,
                                     float *dx, size_t total)
{
    for (size_t i = first_index(); i < total; i += index_step())
        dx[i] = stk_col2im1(col, &s, n, i);
}

static int cuda_col2im(stk_backend *be, const float *col,
                       const stk_conv_shape *s, int n, float *dx, stk_err *err)
{
    size_t total = (size_t)s->c * s->h * s->w * (size_t)n;
    return launch(be, "cuda col2im", total, err, col2im_kernel, col, *s, n, dx,
                  total);
}

static __global__ void swap01_kernel(const float *src, float *dst, size_t a,
                                     size_t b, size_t inner, size_t total)
{
    for (size_t j = first_index(); j < total; j += index_step())
        dst[j] = stk_swap01_1(src, a, b, inner, j);
}

static int cuda_swap01(stk_backend *be, const float *src, float *dst, size_t a,
                       size_t b, size_t inner, stk_err *err)
{
    size_t total = a * b * inner;
    return launch(be, "cuda swap01", total, err, swap01_kernel, src, dst, a, b,
                  inner, total);
}

// ---- Winograd F(2x2, 3x3): one thread per filter, tile or pixel ---------

static __global__ void wino_filter_kernel(const float *w, float *u, size_t n)
{
    for (size_t f = first_index(); f < n; f += index_step())
        stk_wino_filter_n(w + f * 9, 1, u + f, stk_wino_stride(n));
}

static int cuda_wino_filter(stk_backend *be, const float *w, int cout, int c,
                            float *u, stk_err *err)
{
    size_t n = (size_t)cout * c;
    return launch(be, "cuda wino_filter", n, err, wino_filter_kernel, w, u, n);
}

static __global__ void wino_filter_grad_kernel(const float *du, float *dw,
                                               size_t n)
{
    for (size_t f = first_index(); f < n; f += index_step())
        stk_wino_filter_grad_n(du + f, stk_wino_stride(n), 1, dw + f * 9);
}

static int cuda_wino_filter_grad(stk_backend *be, const float *du, int cout,
                                 int c, float *dw, stk_err *err)
{
    size_t n = (size_t)cout * c;
    return launch(be, "cuda wino_filter_grad", n, err, wino_filter_grad_kernel,
                  du, dw, n);
}

// Tile columns of n samples: thread i takes channel i / nt, column i % nt,
// whose point 0 sits at index i of a [16][ch, nt] array (point stride
// stk_wino_stride(ch * nt)).
static size_t wino_columns(const stk_conv_shape *s, int n)
{
    int th, tw;
    return (size_t)stk_wino_tiles(s, &th, &tw) * n;
}

static __global__ void wino_input_kernel(const float *x, stk_conv_shape s,
                                         float *v, size_t nt)
{
    size_t total = nt * s.c;
    for (size_t i = first_index(); i < total; i += index_step())
        stk_wino_input1(x, &s, (int)(i / nt), i % nt, v + i,
                        stk_wino_stride(total));
}

static int cuda_wino_input(stk_backend *be, const float *x,
                           const stk_conv_shape *s, int n, float *v,
                           stk_err *err)
{
    size_t nt = wino_columns(s, n);
    return launch(be, "cuda wino_input", nt * s->c, err, wino_input_kernel, x,
                  *s, v, nt);
}

static __global__ void wino_input_tiles_kernel(float *dv, size_t total)
{
    for (size_t i = first_index(); i < total; i += index_step())
        stk_wino_input_grad_n(dv + i, stk_wino_stride(total), 1);
}

static __global__ void wino_gather_kernel(const float *dd, stk_conv_shape s,
                                          float *dx, size_t n)
{
    int th, tw;
    size_t tiles = (size_t)stk_wino_tiles(&s, &th, &tw);
    size_t nt = n * tiles, plane = (size_t)s.h * s.w, total = plane * s.c * n;
    for (size_t i = first_index(); i < total; i += index_step()) {
        size_t q = i / plane, px = i % plane;
        dx[i] = stk_wino_gather1(dd + q % s.c * nt + q / s.c * tiles,
                                 stk_wino_stride(s.c * nt), &s, (int)(px / s.w),
                                 (int)(px % s.w));
    }
}

// The tiles' pixel gradients in place, then a gather per pixel (no atomics;
// the CPU's scatter adds in the same order).
static int cuda_wino_input_grad(stk_backend *be, float *dv,
                                const stk_conv_shape *s, int n, float *dx,
                                stk_err *err)
{
    size_t total = wino_columns(s, n) * s->c;
    int rc = launch(be, "cuda wino_input_grad", total, err,
                    wino_input_tiles_kernel, dv, total);
    size_t pixels = (size_t)s->h * s->w * s->c * n;
    return rc ? rc
              : launch(be, "cuda wino_input_grad", pixels, err,
                       wino_gather_kernel, (const float *)dv, *s, dx,
                       (size_t)n);
}

static __global__ void wino_output_kernel(const float *m, const float *bias,
                                          stk_conv_shape s, int cout, float *y,
                                          size_t nt)
{
    size_t total = nt * cout;
    for (size_t i = first_index(); i < total; i += index_step()) {
        int co = (int)(i / nt);
        stk_wino_output1(m + i, stk_wino_stride(total), bias ? bias[co] : 0.0f,
                         &s, co, cout, i % nt, y);
    }
}

static int cuda_wino_output(stk_backend *be, const float *m, const float *bias,
                            const stk_conv_shape *s, int cout, int n, float *y,
                            stk_err *err)
{
    size_t nt = wino_columns(s, n);
    return launch(be, "cuda wino_output", nt * cout, err, wino_output_kernel, m,
                  bias, *s, cout, y, nt);
}

static __global__ void wino_output_grad_kernel(const float *dy,
                                               stk_conv_shape s, int cout,
                                               float *dm, size_t nt)
{
    size_t total = nt * cout;
    for (size_t i = first_index(); i < total; i += index_step())
        stk_wino_output_grad1(dy, &s, (int)(i / nt), cout, i % nt, dm + i,
                              stk_wino_stride(total));
}

static int cuda_wino_output_grad(stk_backend *be, const float *dy,
                                 const stk_conv_shape *s, int cout, int n,
                                 float *dm, stk_err *err)
{
    size_t nt = wino_columns(s, n);
    return launch(be, "cuda wino_output_grad", nt * cout, err,
                  wino_output_grad_kernel, dy, *s, cout, dm, nt);
}

static __global__ void maxpool_fwd_kernel(const float *x, int h, int w, int k,
                                          int st, int oh, int ow, float *y,
                                          int32_t *arg, size_t n)
{
    for (size_t j = first_index(); j < n; j += index_step())
        y[j] = stk_maxpool1(x, h, w, k, st, oh, ow, j, &arg[j]);
}

static int cuda_maxpool_fwd(stk_backend *be, const float *x, int planes, int h,
                            int w, int k, int st, float *y, int32_t *arg,
                            stk_err *err)
{
    if (planes <= 0)
        return 0;
    int oh = (h - k) / st + 1, ow = (w - k) / st + 1;
    size_t n = (size_t)planes * oh * ow;
    return launch(be, "cuda maxpool_fwd", n, err, maxpool_fwd_kernel, x, h, w,
                  k, st, oh, ow, y, arg, n);
}

// One thread per input element gathers from the windows holding it
// (stk_maxpool_grad1): no atomics, the CPU's floats also where windows
// overlap.
static __global__ void maxpool_bwd_kernel(const float *dy, const int32_t *arg,
                                          int h, int w, int k, int st,
                                          float *dx, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        dx[i] = stk_maxpool_grad1(dy, arg, h, w, k, st, i);
}

static int cuda_maxpool_bwd(stk_backend *be, const float *dy,
                            const int32_t *arg, int planes, int h, int w,
                            int k, int st, float *dx, stk_err *err)
{
    if (planes <= 0)
        return 0;
    size_t n = (size_t)planes * h * w;
    return launch(be, "cuda maxpool_bwd", n, err, maxpool_bwd_kernel, dy, arg,
                  h, w, k, st, dx, n);
}

// ---- average pool ----------------------------------------------------------

static __global__ void avgpool_fwd_kernel(const float *x, int h, int w, int kh,
                                          int kw, int sh, int sw, int oh,
                                          int ow, float *y, size_t n)
{
    for (size_t j = first_index(); j < n; j += index_step())
        y[j] = stk_avgpool1(x, h, w, kh, kw, sh, sw, oh, ow, j);
}

static int cuda_avgpool_fwd(stk_backend *be, const float *x, int planes, int h,
                            int w, int kh, int kw, int sh, int sw, float *y,
                            stk_err *err)
{
    int oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
    size_t n = (size_t)planes * oh * ow;
    return launch(be, "cuda avgpool_fwd", n, err, avgpool_fwd_kernel, x, h, w,
                  kh, kw, sh, sw, oh, ow, y, n);
}

// One thread per input element gathers from its windows
// (stk_avgpool_grad1): no atomics, the CPU's floats.
static __global__ void avgpool_bwd_kernel(const float *dy, int h, int w,
                                          int kh, int kw, int sh, int sw,
                                          float *dx, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        dx[i] = stk_avgpool_grad1(dy, h, w, kh, kw, sh, sw, i);
}

static int cuda_avgpool_bwd(stk_backend *be, const float *dy, int planes,
                            int h, int w, int kh, int kw, int sh, int sw,
                            float *dx, stk_err *err)
{
    size_t n = (size_t)planes * h * w;
    return launch(be, "cuda avgpool_bwd", n, err, avgpool_bwd_kernel, dy, h, w,
                  kh, kw, sh, sw, dx, n);
}

// ---- residual add and device copies ---------------------------------------

static __global__ void add_kernel(const float *a, const float *b, float *y,
                                  size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step())
        y[i] = stk_add1(a[i], b[i]);
}

static int cuda_add(stk_backend *be, const float *a, const float *b, float *y,
                    size_t n, stk_err *err)
{
    return launch(be, "cuda add", n, err, add_kernel, a, b, y, n);
}

static int cuda_copy_dev(stk_backend *be, float *dst, const float *src,
                         size_t n, stk_err *err)
{
    const char *op = "cuda device copy";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    CUDA_TRY(op, cudaMemcpyAsync,
             (dst, src, n * sizeof *dst, cudaMemcpyDeviceToDevice,
              impl(be)->stream));
    return 0;
}

// ---- batch normalisation ---------------------------------------------------

// The per-channel reductions, in two passes (stk_bn_parts): a block per
// (channel, range of samples) adds its range into partial[block] (thread t
// takes elements t, t + THREADS, ... of the range, block_sum adds the
// threads in a fixed tree), then a thread per channel adds the ranges in
// order. Every run gives the same floats (not the CPU's: another order).

// Block b's channel, its first sample and its range's element count.
typedef struct bn_range {
    int ch, r0;
    unsigned count;
} bn_range;

static __device__ bn_range bn_range_of(size_t b, int n, int hw, int parts)
{
    bn_range g;
    int r1;
    g.ch = (int)(b / parts);
    stk_bn_part(n, parts, (int)(b % parts), &g.r0, &r1);
    g.count = (unsigned)(r1 - g.r0) * (unsigned)hw;
    return g;
}

// A thread's walk through range g of x [n, c, hw]: elements t, t + THREADS,
// ... of the range, as an offset into x, stepped without a division per
// element (one division per thread, at the start).
typedef struct bn_walk {
    unsigned f, i;           // element of the range, its position in hw
    size_t at;               // its offset in x
} bn_walk;

static __device__ bn_walk bn_walk_start(bn_range g, int c, int hw)
{
    unsigned r = threadIdx.x / (unsigned)hw, i = threadIdx.x % (unsigned)hw;
    return {threadIdx.x, i, ((size_t)(g.r0 + r) * c + g.ch) * hw + i};
}

// Moves w on by THREADS elements: THREADS / hw samples and THREADS % hw
// positions, carrying one more sample when the position wraps.
static __device__ void bn_walk_next(bn_walk *w, int c, int hw)
{
    unsigned dr = THREADS / (unsigned)hw, di = THREADS % (unsigned)hw;
    size_t sample = (size_t)c * hw;
    w->f += THREADS;
    w->i += di;
    w->at += dr * sample + di;
    if (w->i >= (unsigned)hw) {
        w->i -= hw;
        w->at += sample - hw;
    }
}

static __global__ void bn_sums_kernel(const float *x, int n, int c, int hw,
                                      const float *shift, int parts,
                                      double *partial)
{
    for (size_t b = blockIdx.x; b < (size_t)c * parts; b += gridDim.x) {
        bn_range g = bn_range_of(b, n, hw, parts);
        float s = shift ? shift[g.ch] : 0.0f;
        double acc = 0.0;
        for (bn_walk w = bn_walk_start(g, c, hw); w.f < g.count;
             bn_walk_next(&w, c, hw)) {
            float v = x[w.at];
            acc += shift ? stk_bn_sq1(v, s) : (double)v;
        }
        acc = block_sum(acc);
        if (threadIdx.x == 0)
            partial[b] = acc;
    }
}

// sums[ch] = the ranges' total times scale; with add, sums[ch] += it
// (bias_grad accumulates into its gradient, as the CPU).
static __global__ void bn_sums_total_kernel(const double *partial, int c,
                                            int parts, double scale, bool add,
                                            float *sums)
{
    for (size_t ch = first_index(); ch < (size_t)c; ch += index_step()) {
        double s = 0.0;
        for (int p = 0; p < parts; p++)
            s += partial[ch * parts + p];
        float total = (float)(s * scale);
        sums[ch] = add ? sums[ch] + total : total;
    }
}

static __global__ void bn_fwd_coef_kernel(const float *mean, const float *var,
                                          float eps, const float *gamma,
                                          const float *beta, int c,
                                          stk_bn_fwd_coef *k)
{
    for (size_t ch = first_index(); ch < (size_t)c; ch += index_step())
        k[ch] =
            stk_bn_fwd_coef_of(mean[ch], var[ch], eps, gamma[ch], beta[ch]);
}

// partial: c * parts sums of g, then c * parts of g * (x - mean). f: each
// channel's forward coefficients (a fused ReLU), or NULL.
static __global__ void bn_grad_sums_kernel(const float *dy, const float *x,
                                           int n, int c, int hw,
                                           const float *mean,
                                           const stk_bn_fwd_coef *f, int parts,
                                           double *partial)
{
    size_t blocks = (size_t)c * parts;
    for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
        bn_range g = bn_range_of(b, n, hw, parts);
        float m = mean[g.ch];
        const stk_bn_fwd_coef *fc = f ? &f[g.ch] : NULL;
        double sg = 0.0, sgx = 0.0;
        for (bn_walk w = bn_walk_start(g, c, hw); w.f < g.count;
             bn_walk_next(&w, c, hw)) {
            size_t i = w.at;
            float gi = stk_bn_g1(dy[i], x[i], fc);
            sg += gi;
            sgx += stk_bn_gx1(gi, x[i], m);
        }
        sg = block_sum(sg);
        sgx = block_sum(sgx);
        if (threadIdx.x == 0) {
            partial[b] = sg;
            partial[blocks + b] = sgx;
        }
    }
}

static __global__ void bn_grad_total_kernel(const double *partial, int c,
                                            int parts, const float *var,
                                            float eps, float *sums)
{
    size_t blocks = (size_t)c * parts;
    for (size_t ch = first_index(); ch < (size_t)c; ch += index_step()) {
        double sg = 0.0, sgx = 0.0;
        for (int p = 0; p < parts; p++) {
            sg += partial[ch * parts + p];
            sgx += partial[blocks + ch * parts + p];
        }
        sums[ch] = (float)sg;
        sums[c + ch] = (float)(sgx * stk_bn_invstd(var[ch], eps));
    }
}

// Launches kernel with one block per item, up to MAX_BLOCKS (the kernel
// strides over the rest), on the device the caller selected.
template <typename... P, typename... A>
static int launch_blocks(stk_backend *be, const char *op, size_t items,
                         stk_err *err, void (*kernel)(P...), A... args)
{
    unsigned blocks = (unsigned)(items < MAX_BLOCKS ? items : MAX_BLOCKS);
    if (!blocks) /* a grid of 0 blocks is cudaErrorInvalidConfiguration */
        return 0;
    kernel<<<blocks, THREADS, 0, impl(be)->stream>>>(args...);
    return launched(op, err);
}

// The blocks of 2 doubles that c channels' forward coefficients take
// after the batchnorm's partials.
static size_t bn_coef_slots(int c)
{
    size_t slot = 2 * sizeof(double);
    return ((size_t)c * sizeof(stk_bn_fwd_coef) + slot - 1) / slot;
}

// Selects the device and makes room for `per_block` doubles per (channel,
// range) block in the scratch; *partial points there.
static int bn_partials(stk_backend *be, const char *op, size_t blocks,
                       int per_block, double **partial, stk_err *err)
{
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(
            be, ARRAY_OFFSET + blocks * per_block * sizeof(double), op, err);
    if (!rc)
        *partial = scratch_array<double>(be);
    return rc;
}

static int cuda_bn_sums(stk_backend *be, const float *x, int n, int c, int hw,
                        const float *shift, double scale, float *sums,
                        stk_err *err)
{
    const char *op = "cuda bn_sums";
    int parts = stk_bn_parts(n, hw);
    size_t blocks = (size_t)c * parts;
    double *partial = NULL;
    /* room for 2 doubles per block although the sums use 1, and for the
     * channels' forward coefficients: what the backward's bn_grad_sums
     * needs for the same shape (and more than bn_apply's and
     * bn_input_grad's coefficients), so the first training step's backward
     * never grows the scratch (a stream sync and a cudaFree, which waits
     * for every stream, DDP's NCCL one included) */
    int rc = bn_partials(be, op, blocks + bn_coef_slots(c), 2, &partial, err);
    if (!rc)
        rc = launch_blocks(be, op, blocks, err, bn_sums_kernel, x, n, c, hw,
                           shift, parts, partial);
    return rc ? rc
              : launch(be, op, (size_t)c, err, bn_sums_total_kernel,
                       (const double *)partial, c, parts, scale, false, sums);
}

static int cuda_bn_grad_sums(stk_backend *be, const float *dy, const float *x,
                             int n, int c, int hw, const float *mean,
                             const float *var, float eps, const float *gamma,
                             const float *beta, bool relu, float *sums,
                             stk_err *err)
{
    const char *op = "cuda bn_grad_sums";
    int parts = stk_bn_parts(n, hw);
    size_t blocks = (size_t)c * parts;
    double *partial = NULL;
    /* the partials, then (with relu) the channels' forward coefficients */
    int rc = bn_partials(be, op, blocks + bn_coef_slots(c), 2, &partial, err);
    stk_bn_fwd_coef *f = NULL;
    if (!rc && relu) {
        f = (stk_bn_fwd_coef *)(partial + 2 * blocks);
        rc = launch(be, op, (size_t)c, err, bn_fwd_coef_kernel, mean, var, eps,
                    gamma, beta, c, f);
    }
    if (!rc)
        rc = launch_blocks(be, op, blocks, err, bn_grad_sums_kernel, dy, x, n,
                           c, hw, mean, (const stk_bn_fwd_coef *)f, parts,
                           partial);
    return rc ? rc
              : launch(be, op, (size_t)c, err, bn_grad_total_kernel,
                       (const double *)partial, c, parts, var, eps, sums);
}

// The bias gradient db[ch] += sum of dy [rows, cols, inner] over rows and
// inner: the batchnorm's two passes (a block per (channel, range of rows)
// then the ranges in order per channel), so the floats repeat run to run.
static int cuda_bias_grad(stk_backend *be, const float *dy, float *db,
                          int rows, int cols, int inner, stk_err *err)
{
    if (rows <= 0 || cols <= 0 || inner <= 0)
        return 0; // an empty sum adds nothing (as on the CPU)
    const char *op = "cuda bias_grad";
    int parts = stk_bn_parts(rows, inner);
    size_t blocks = (size_t)cols * parts;
    double *partial = NULL;
    int rc = bn_partials(be, op, blocks, 1, &partial, err);
    if (!rc)
        rc = launch_blocks(be, op, blocks, err, bn_sums_kernel, dy, rows, cols,
                           inner, (const float *)NULL, parts, partial);
    return rc ? rc
              : launch(be, op, (size_t)cols, err, bn_sums_total_kernel,
                       (const double *)partial, cols, parts, 1.0, true, db);
}

// The element-wise passes take their per-channel coefficients (computed in
// double, ops_inline.h) from an array in the scratch that a first kernel
// fills, c threads' work instead of a square root per element. The scratch
// is reused by the next op only behind this one on the stream, and grows
// only after a stream sync (scratch_reserve).
// The channel of element i of a tensor [*, c, hw] of n elements: in 32
// bits where n allows (a 64-bit division takes many instructions on the GPU).
static __device__ size_t bn_channel(size_t i, int c, int hw, size_t n)
{
    if (n <= UINT_MAX)
        return (unsigned)i / (unsigned)hw % (unsigned)c;
    return i / hw % c;
}

/* res: the residual added before the ReLU (stk_bn_add1), or NULL. */
static __global__ void bn_apply_kernel(const float *x, const float *res,
                                       float *y, int c, int hw,
                                       const stk_bn_fwd_coef *k, int relu,
                                       size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step()) {
        stk_bn_fwd_coef f = k[bn_channel(i, c, hw, n)];
        y[i] = res ? stk_bn_add1(x[i], res[i], f, relu)
                   : stk_bn_apply1(x[i], f, relu);
    }
}

static int cuda_bn_apply(stk_backend *be, const float *x, const float *res,
                         float *y, int n, int c, int hw, const float *mean,
                         const float *var, float eps, const float *gamma,
                         const float *beta, bool relu, stk_err *err)
{
    const char *op = "cuda bn_apply";
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(
            be, ARRAY_OFFSET + (size_t)c * sizeof(stk_bn_fwd_coef), op, err);
    if (rc)
        return rc;
    stk_bn_fwd_coef *k = scratch_array<stk_bn_fwd_coef>(be);
    rc = launch(be, op, (size_t)c, err, bn_fwd_coef_kernel, mean, var, eps,
                gamma, beta, c, k);
    size_t total = (size_t)n * c * hw;
    return rc ? rc
              : launch(be, op, total, err, bn_apply_kernel, x, res, y, c, hw,
                       (const stk_bn_fwd_coef *)k, (int)relu, total);
}

static __global__ void bn_bwd_coef_kernel(const float *mean, const float *var,
                                          float eps, const float *gamma,
                                          const float *sums, float inv_count,
                                          int c, stk_bn_bwd_coef *k)
{
    for (size_t ch = first_index(); ch < (size_t)c; ch += index_step())
        k[ch] = stk_bn_bwd_coef_of(mean[ch], var[ch], eps, gamma[ch], sums[ch],
                                   sums[c + ch], inv_count);
}

// f: each channel's forward coefficients (a fused ReLU), or NULL.
static __global__ void bn_input_grad_kernel(const float *dy, const float *x,
                                            int c, int hw,
                                            const stk_bn_bwd_coef *k,
                                            const stk_bn_fwd_coef *f,
                                            float *dx, size_t n)
{
    for (size_t i = first_index(); i < n; i += index_step()) {
        size_t ch = bn_channel(i, c, hw, n);
        dx[i] = stk_bn_dx1(stk_bn_g1(dy[i], x[i], f ? &f[ch] : NULL), x[i],
                           k[ch]);
    }
}

static int cuda_bn_input_grad(stk_backend *be, const float *dy, const float *x,
                              int n, int c, int hw, const float *mean,
                              const float *var, float eps, const float *gamma,
                              const float *beta, bool relu, const float *sums,
                              float inv_count, float *dx, stk_err *err)
{
    const char *op = "cuda bn_input_grad";
    /* the backward coefficients, then (with relu) the forward ones */
    size_t kb = (size_t)c * sizeof(stk_bn_bwd_coef),
           fb = relu ? (size_t)c * sizeof(stk_bn_fwd_coef) : 0;
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(be, ARRAY_OFFSET + kb + fb, op, err);
    if (rc)
        return rc;
    stk_bn_bwd_coef *k = scratch_array<stk_bn_bwd_coef>(be);
    stk_bn_fwd_coef *f =
        relu ? (stk_bn_fwd_coef *)((char *)k + kb) : (stk_bn_fwd_coef *)NULL;
    rc = launch(be, op, (size_t)c, err, bn_bwd_coef_kernel, mean, var, eps,
                gamma, sums, inv_count, c, k);
    if (!rc && relu)
        rc = launch(be, op, (size_t)c, err, bn_fwd_coef_kernel, mean, var, eps,
                    gamma, beta, c, f);
    size_t total = (size_t)n * c * hw;
    return rc ? rc
              : launch(be, op, total, err, bn_input_grad_kernel, dy, x, c, hw,
                       (const stk_bn_bwd_coef *)k,
                       (const stk_bn_fwd_coef *)f, dx, total);
}

static __global__ void bn_running_kernel(float *run_mean, float *run_var,
                                         const float *mean, const float *var,
                                         int c, float momentum, float unbias)
{
    for (size_t ch = first_index(); ch < (size_t)c; ch += index_step()) {
        run_mean[ch] = stk_bn_running1(run_mean[ch], mean[ch], momentum);
        run_var[ch] =
            stk_bn_running1(run_var[ch], (double)var[ch] * unbias, momentum);
    }
}

static int cuda_bn_running(stk_backend *be, float *run_mean, float *run_var,
                           const float *mean, const float *var, int c,
                           float momentum, float unbias, stk_err *err)
{
    return launch(be, "cuda bn_running", (size_t)c, err, bn_running_kernel,
                  run_mean, run_var, mean, var, c, momentum, unbias);
}

static __global__ void dropout_kernel(float *x, size_t n, size_t first,
                                      size_t group, float p,
                                      stk_philox_key key, uint64_t rng_stream)
{
    for (size_t i = first_index(); i < n; i += index_step())
        x[i] *= stk_dropout_scale1(key, rng_stream, first + i, group, p);
}

static int cuda_dropout(stk_backend *be, float *x, size_t n, size_t first,
                        size_t group, float p, stk_philox_key key,
                        uint64_t stream, stk_err *err)
{
    return launch(be, "cuda dropout", n, err, dropout_kernel, x, n, first,
                  group, p, key, stream);
}

// ---- softmax cross-entropy -------------------------------------------------

// Row losses into loss[r] (and dlogits rows, when not NULL). A label out of
// range flags its row instead (the smallest such row wins) and is not read.
static __global__ void xent_rows_kernel(const float *logits,
                                        const int32_t *labels, int n, int c,
                                        float smoothing, float *dlogits,
                                        float *loss,
                                        unsigned *bad_row)
{
    for (size_t r = first_index(); r < (size_t)n; r += index_step()) {
        if (labels[r] < 0 || labels[r] >= c) {
            atomicMin(bad_row, (unsigned)r);
            loss[r] = 0.0f;
            continue;
        }
        loss[r] = stk_xent_row(logits, labels, n, c, smoothing, (int)r,
                               dlogits);
    }
}

// One block: out->sum = sum of v[0..n) in double.
template <typename T>
static __global__ void sum_kernel(const T *v, size_t n, reduce_result *out)
{
    double s = 0.0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x)
        s += (double)v[i];
    s = block_sum(s);
    if (threadIdx.x == 0)
        out->sum = s;
}

// Each row's loss (and dlogits) into the scratch array, the first bad
// label's row into res->bad_row (~0u: none): what both cross-entropies
// reduce.
static int xent_rows(stk_backend *be, const char *op, const float *logits,
                     const int32_t *labels, int n, int c, float smoothing,
                     float *dlogits, stk_err *err)
{
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(be, ARRAY_OFFSET + (size_t)n * sizeof(float), op,
                             err);
    if (rc)
        return rc;
    cudaStream_t s = impl(be)->stream;
    reduce_result *res = scratch_result(be);
    CUDA_TRY(op, cudaMemsetAsync,
             (&res->bad_row, 0xff, sizeof res->bad_row, s));
    rc = launch(be, op, (size_t)n, err, xent_rows_kernel, logits, labels, n, c,
                smoothing, dlogits, scratch_array<float>(be), &res->bad_row);
    return rc;
}

// Row losses on the device, their sum in one block, then the mean and the
// label check on the host. On STK_ERANGE dlogits is unspecified.
static int cuda_xent(stk_backend *be, const float *logits,
                     const int32_t *labels, int n, int c, float smoothing,
                     float *loss, float *dlogits, stk_err *err)
{
    const char *op = "cuda xent";
    int rc = xent_rows(be, op, logits, labels, n, c, smoothing, dlogits, err);
    if (rc)
        return rc;
    cudaStream_t s = impl(be)->stream;
    reduce_result *res = scratch_result(be);
    float *row_loss = scratch_array<float>(be);
    sum_kernel<float><<<1, THREADS, 0, s>>>(row_loss, (size_t)n, res);
    if ((rc = launched(op, err)))
        return rc;
    reduce_result host;
    if ((rc = fetch_result(be, &host, op, err)))
        return rc;
    if (host.bad_row != UINT_MAX) {
        int32_t label = 0;
        CUDA_TRY(op, cudaMemcpyAsync,
                 (&label, labels + host.bad_row, sizeof label,
                  cudaMemcpyDeviceToHost, s));
        CUDA_TRY(op, cudaStreamSynchronize, (s));
        return stk_fail(err, STK_ERANGE,
                        "cross-entropy: label %d of row %u is not in 0..%d",
                        (int)label, host.bad_row, c - 1);
    }
    *loss = (float)(host.sum / n);
    return 0;
}

// ---- input transform -------------------------------------------------------

// Two passes, so that each sample's Philox draw runs once (not once per
// pixel): a thread per sample writes its crop offset and flip (as the CPU,
// stk_transform_draw) to the scratch, then a block per (sample, THREADS
// positions of its plane) writes them, each thread one position through
// every channel (stk_transform_px, the CPU's body).
static __global__ void transform_draw_kernel(const uint64_t *ids, int n,
                                             stk_transform t, int4 *draws)
{
    for (size_t s = first_index(); s < (size_t)n; s += index_step()) {
        int dy, dx, mirror;
        stk_transform_draw(&t, ids[s], &dy, &dx, &mirror);
        draws[s] = make_int4(dy, dx, mirror, 0);
    }
}

static __global__ void transform_kernel(const uint8_t *x, const int4 *draws,
                                        stk_transform t, unsigned chunks,
                                        size_t blocks, float *y)
{
    unsigned w = (unsigned)t.w, plane = (unsigned)t.h * w;
    size_t per = (size_t)plane * t.c;
    for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
        size_t s = b / chunks; // a division per block, not per element
        unsigned p = (unsigned)(b % chunks) * THREADS + threadIdx.x;
        if (p >= plane)
            continue;
        int4 d = draws[s];
        const uint8_t *img = x + s * per;
        float *out = y + s * per + p;
        for (int c = 0; c < t.c; c++)
            out[(size_t)c * plane] = stk_transform_px(
                img, &t, c, (int)(p / w), (int)(p % w), d.x, d.y, d.z);
    }
}

static int cuda_transform(stk_backend *be, const uint8_t *x,
                          const uint64_t *ids, int n, const stk_transform *t,
                          float *y, stk_err *err)
{
    const char *op = "cuda transform";
    size_t plane = (size_t)t->h * t->w;
    if (n <= 0 || plane * t->c == 0)
        return 0;
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(be, ARRAY_OFFSET + (size_t)n * sizeof(int4), op,
                             err);
    if (rc)
        return rc;
    int4 *draws = scratch_array<int4>(be);
    unsigned chunks = (unsigned)((plane + THREADS - 1) / THREADS);
    size_t blocks = (size_t)n * chunks;
    rc = launch(be, op, (size_t)n, err, transform_draw_kernel, ids, n, *t,
                draws);
    return rc ? rc
              : launch_blocks(be, op, blocks, err, transform_kernel, x,
                              (const int4 *)draws, *t, chunks, blocks, y);
}

// ---- vector ops and reductions ---------------------------------------------

static __global__ void axpy_kernel(size_t n, float alpha, const float *x,
                                   float *y)
{
    for (size_t i = first_index(); i < n; i += index_step())
        y[i] += alpha * x[i];
}

static int cuda_axpy(stk_backend *be, size_t n, float alpha, const float *x,
                     float *y, stk_err *err)
{
    return launch(be, "cuda axpy", n, err, axpy_kernel, n, alpha, x, y);
}

static __global__ void scale_kernel(size_t n, float alpha, float *x)
{
    for (size_t i = first_index(); i < n; i += index_step())
        x[i] *= alpha;
}

static int cuda_scale(stk_backend *be, size_t n, float alpha, float *x,
                      stk_err *err)
{
    return launch(be, "cuda scale", n, err, scale_kernel, n, alpha, x);
}

// Pass one: each block's sum of squares into partial[blockIdx.x].
static __global__ void sumsq_partial_kernel(const float *x, size_t n,
                                            double *partial)
{
    double s = 0.0;
    for (size_t i = first_index(); i < n; i += index_step())
        s += (double)x[i] * x[i];
    s = block_sum(s);
    if (threadIdx.x == 0)
        partial[blockIdx.x] = s;
}

// The first pass of a sum of squares: one double per block of a grid fixed
// by n (`blocks`) into the scratch array, for the sum or the norm to finish.
static int sumsq_partials(stk_backend *be, const char *op, const float *x,
                          size_t n, unsigned blocks, stk_err *err)
{
    int rc = use_device(be, op, err);
    if (!rc)
        rc = scratch_reserve(be, ARRAY_OFFSET + blocks * sizeof(double), op,
                             err);
    if (rc)
        return rc;
    sumsq_partial_kernel<<<blocks, THREADS, 0, impl(be)->stream>>>(
        x, n, scratch_array<double>(be));
    return launched(op, err);
}

// Two passes with a grid fixed by n, so the sum repeats exactly run to run.
static int cuda_sumsq(stk_backend *be, const float *x, size_t n, double *out,
                      stk_err *err)
{
    const char *op = "cuda sumsq";
    *out = 0.0;
    if (n == 0)
        return 0;
    unsigned blocks = grid_for(n);
    int rc = sumsq_partials(be, op, x, n, blocks, err);
    if (rc)
        return rc;
    cudaStream_t s = impl(be)->stream;
    sum_kernel<double><<<1, THREADS, 0, s>>>(scratch_array<double>(be), blocks,
                                             scratch_result(be));
    if ((rc = launched(op, err)))
        return rc;
    reduce_result host;
    if ((rc = fetch_result(be, &host, op, err)))
        return rc;
    *out = host.sum;
    return 0;
}

// ---- training metrics (stk_metrics: ops_inline.h) -------------------------

// One block: the row losses' sum (sum_kernel's order, so the same double as
// cuda_xent's), added to m unless a row was flagged.
static __global__ void xent_metrics_kernel(const float *row_loss, int n,
                                           const int32_t *labels,
                                           const reduce_result *res,
                                           stk_metrics *m)
{
    double s = 0.0;
    for (size_t i = threadIdx.x; i < (size_t)n; i += blockDim.x)
        s += (double)row_loss[i];
    s = block_sum(s);
    if (threadIdx.x != 0)
        return;
    if (res->bad_row == UINT_MAX) {
        stk_metrics_add_loss(m, s, n);
    } else if (m->bad_row == 0) {
        m->bad_row = (double)res->bad_row + 1;
        m->bad_label = labels[res->bad_row];
    }
}

static int cuda_xent_metrics(stk_backend *be, const float *logits,
                             const int32_t *labels, int n, int c,
                             float smoothing, float *dlogits, stk_metrics *m,
                             stk_err *err)
{
    const char *op = "cuda xent_metrics";
    int rc = xent_rows(be, op, logits, labels, n, c, smoothing, dlogits, err);
    if (rc)
        return rc;
    cudaStream_t s = impl(be)->stream;
    reduce_result *res = scratch_result(be);
    float *row_loss = scratch_array<float>(be);
    xent_metrics_kernel<<<1, THREADS, 0, s>>>(row_loss, n, labels, res, m);
    return launched(op, err);
}

// Each block counts its rows' hits; one atomic add per block (counts in a
// double are exact, so the order does not matter).
static __global__ void count_hits_kernel(const float *logits,
                                         const int32_t *labels, int n, int c,
                                         stk_metrics *m)
{
    double hits = 0.0;
    for (size_t r = first_index(); r < (size_t)n; r += index_step())
        hits += stk_argmax_row(logits, c, (int)r) == labels[r];
    hits = block_sum(hits);
    if (threadIdx.x == 0 && hits > 0)
        atomicAdd(&m->step_hits, hits);
}

static int cuda_count_hits(stk_backend *be, const float *logits,
                           const int32_t *labels, int n, int c, stk_metrics *m,
                           stk_err *err)
{
    return launch(be, "cuda count_hits", (size_t)n, err, count_hits_kernel,
                  logits, labels, n, c, m);
}

static __global__ void metrics_step_kernel(stk_metrics *m, int n,
                                           uint64_t step, uint64_t epoch)
{
    stk_metrics_close(m, n, step, epoch);
}

static int cuda_metrics_step(stk_backend *be, stk_metrics *m, int n,
                             uint64_t step, uint64_t epoch, stk_err *err)
{
    const char *op = "cuda metrics_step";
    int rc = use_device(be, op, err);
    if (rc)
        return rc;
    metrics_step_kernel<<<1, 1, 0, impl(be)->stream>>>(m, n, step, epoch);
    return launched(op, err);
}

// One block: the partial sums of squares added as sum_kernel adds them (so
// the same double as cuda_sumsq's), then the norm's check and clip factor.
static __global__ void grad_norm_kernel(const double *partial, size_t blocks,
                                        float clip, uint64_t step,
                                        uint64_t epoch, stk_metrics *m)
{
    double s = 0.0;
    for (size_t i = threadIdx.x; i < blocks; i += blockDim.x)
        s += partial[i];
    s = block_sum(s);
    if (threadIdx.x == 0)
        stk_metrics_norm(m, s, clip, step, epoch);
}

static __global__ void clip_kernel(size_t n, const stk_metrics *m, float *g)
{
    float f = (float)m->scale;
    if (f == 1.0f)
        return;
    for (size_t i = first_index(); i < n; i += index_step())
        g[i] *= f;
}

static int cuda_grad_norm(stk_backend *be, float *g, size_t n, float clip,
                          uint64_t step, uint64_t epoch, stk_metrics *m,
                          stk_err *err)
{
    const char *op = "cuda grad_norm";
    unsigned blocks = grid_for(n ? n : 1);
    int rc = sumsq_partials(be, op, g, n, blocks, err);
    if (rc)
        return rc;
    cudaStream_t s = impl(be)->stream;
    grad_norm_kernel<<<1, THREADS, 0, s>>>(scratch_array<double>(be), blocks,
                                           clip, step, epoch, m);
    if ((rc = launched(op, err)))
        return rc;
    return clip > 0 ? launch(be, op, n, err, clip_kernel, n, (const stk_metrics *)m, g)
                    : 0;
}

// ---- optimizers ------------------------------------------------------------

static __global__ void sgd_kernel(float *w, const float *g, float *buf,
                                  size_t n, stk_sgd_cfg cfg)
{
    if (stk_update_refused(cfg.guard))
        return;
    for (size_t i = first_index(); i < n; i += index_step())
        stk_sgd1(w, g, buf, i, &cfg);
}

static int cuda_sgd(stk_backend *be, float *w, const float *g, float *buf,
                    size_t n, const stk_sgd_cfg *cfg, stk_err *err)
{
    return launch(be, "cuda sgd", n, err, sgd_kernel, w, g, buf, n, *cfg);
}

static __global__ void adamw_kernel(float *w, const float *g, float *m,
                                    float *v, size_t n, stk_adamw_cfg cfg)
{
    if (stk_update_refused(cfg.guard))
        return;
    for (size_t i = first_index(); i < n; i += index_step())
        stk_adamw1(w, g, m, v, i, &cfg);
}

static int cuda_adamw(stk_backend *be, float *w, const float *g, float *m,
                      float *v, size_t n, const stk_adamw_cfg *cfg,
                      stk_err *err)
{
    return launch(be, "cuda adamw", n, err, adamw_kernel, w, g, m, v, n, *cfg);
}

// ---- the table and init ----------------------------------------------------

// The table, filled by member name so that it cannot drift out of order
// (constexpr: built at compile time, no initialisation order to worry about).
static constexpr backend_ops cuda_ops_table()
{
    backend_ops o = {};
    o.destroy = cuda_destroy;
    o.alloc = cuda_alloc;
    o.free = cuda_free;
    o.host_alloc = cuda_host_alloc;
    o.host_free = cuda_host_free;
    o.copy = cuda_copy;
    o.memzero = cuda_memzero;
    o.sync = cuda_sync;
    o.event_create = cuda_event_create;
    o.event_destroy = cuda_event_destroy;
    o.event_record = cuda_event_record;
    o.stream_wait = cuda_stream_wait;
    o.event_query = cuda_event_query;
    o.event_wait = cuda_event_wait;
    o.upload = cuda_upload;
    o.gemm = cuda_gemm;
    o.gemm_batched = cuda_gemm_batched;
    o.relu_fwd = cuda_relu_fwd;
    o.relu_bwd = cuda_relu_bwd;
    o.bias_add = cuda_bias_add;
    o.bias_grad = cuda_bias_grad;
    o.im2col = cuda_im2col;
    o.col2im = cuda_col2im;
    o.swap01 = cuda_swap01;
    o.wino_filter = cuda_wino_filter;
    o.wino_filter_grad = cuda_wino_filter_grad;
    o.wino_input = cuda_wino_input;
    o.wino_input_grad = cuda_wino_input_grad;
    o.wino_output = cuda_wino_output;
    o.wino_output_grad = cuda_wino_output_grad;
    o.maxpool_fwd = cuda_maxpool_fwd;
    o.maxpool_bwd = cuda_maxpool_bwd;
    o.avgpool_fwd = cuda_avgpool_fwd;
    o.avgpool_bwd = cuda_avgpool_bwd;
    o.add = cuda_add;
    o.copy_dev = cuda_copy_dev;
    o.bn_sums = cuda_bn_sums;
    o.bn_apply = cuda_bn_apply;
    o.bn_grad_sums = cuda_bn_grad_sums;
    o.bn_input_grad = cuda_bn_input_grad;
    o.bn_running = cuda_bn_running;
    o.dropout = cuda_dropout;
    o.xent = cuda_xent;
    o.xent_metrics = cuda_xent_metrics;
    o.count_hits = cuda_count_hits;
    o.metrics_step = cuda_metrics_step;
    o.grad_norm = cuda_grad_norm;
    o.transform = cuda_transform;
    o.axpy = cuda_axpy;
    o.scale = cuda_scale;
    o.sumsq = cuda_sumsq;
    o.sgd = cuda_sgd;
    o.adamw = cuda_adamw;
    return o;
}

static constexpr backend_ops cuda_ops = cuda_ops_table();

// Why cudaSetDevice failed, in the words of --device: no GPU here, no such
// device number, or a GPU that CUDA cannot use.
static int explain_set_device(int device, cudaError_t e, stk_err *err)
{
    (void)cudaGetLastError();
    int count = 0;
    stk_err why = {0, {0}};
    int rc = stk_cuda_device_count(&count, &why);
    if (rc == STK_ENODEV) // why.msg says "no CUDA device ..."
        return stk_fail(err, STK_ENODEV, "--device cuda: %s", why.msg);
    if (rc == 0 && (device < 0 || device >= count))
        return stk_fail(err, STK_ENODEV,
                        "--device cuda:%d: no such device (this machine has "
                        "%d, numbered from 0)",
                        device, count);
    return stk_fail(err, STK_EIO, "--device cuda:%d: cudaSetDevice: %s (%s)",
                    device, cudaGetErrorString(e), cudaGetErrorName(e));
}

static int impl_create(cuda_impl *cu, stk_err *err)
{
    const char *op = "--device cuda: backend init";
    cudaStream_t s = NULL; // handles are kept only once valid
    CUDA_TRY(op, cudaStreamCreateWithFlags, (&s, cudaStreamNonBlocking));
    cu->stream = s;
    CUDA_TRY(op, cudaStreamCreateWithFlags, (&s, cudaStreamNonBlocking));
    cu->copy = s;
    cublasHandle_t h = NULL;
    int rc = blas_check(cublasCreate(&h), op, "cublasCreate", err);
    if (rc)
        return rc;
    cu->blas = h;
    rc = blas_check(cublasSetStream(cu->blas, cu->stream), op,
                    "cublasSetStream", err);
    if (!rc)
        rc = blas_check(cublasSetMathMode(cu->blas, CUBLAS_DEFAULT_MATH), op,
                        "cublasSetMathMode", err);
    return rc;
}

// Selects the device before any other CUDA call (so nothing lands on GPU 0
// by accident), then creates the stream and the cuBLAS handle bound to it.
extern "C" int stk_cuda_backend_init(stk_backend *be, int device, stk_err *err)
{
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess)
        return explain_set_device(device, e, err);
    cuda_impl *cu = (cuda_impl *)calloc(1, sizeof *cu);
    if (!cu)
        return stk_fail(err, STK_ENOMEM, "--device cuda: out of memory");
    int rc = impl_create(cu, err);
    if (rc) {
        impl_release(cu);
        return rc;
    }
    be->impl = cu;
    be->ops = &cuda_ops;
    return 0;
}

extern "C" void *stk_cuda_stream(stk_backend *be)
{
    return impl(be)->stream;
}
