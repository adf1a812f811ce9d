/* kernels.h - compute backends: one op API, a CPU implementation (OpenBLAS
 * and C loops, the readable reference) and a CUDA one (cuBLAS and kernels)
 * built when the toolkit is found. The element-wise bodies both run are in
 * ops_inline.h.
 *
 * Pointers passed to ops are backend memory (stk_dev_alloc); on the CPU
 * that is host memory. Tensors are float32, NCHW, row-major. Ops are
 * asynchronous on CUDA (queued on the backend's compute stream; stk_upload
 * on its copy stream): stk_sync waits for the compute stream. Every op
 * returns 0 or a negative STK_E* code with err (when non-NULL) naming the
 * op and the cause. */
#ifndef STK_KERNELS_H
#define STK_KERNELS_H

#include "common/common.h"
#include "kernels/ops_inline.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- devices ---------------------------------------------------------- */

/* True when this build contains the CUDA backend. */
bool stk_cuda_built(void);

/* Number of usable CUDA devices. Returns STK_ENODEV with a reason when this
 * machine has none (no CUDA in this build, no device, no NVIDIA driver),
 * STK_EIO when a GPU is there but CUDA fails (say, a driver too old). */
int stk_cuda_device_count(int *count, stk_err *err);

/* Selects device and runs a fill kernel and a host round trip on n floats,
 * checking every element: the smallest proof that kernels execute. */
int stk_cuda_selftest(int device, int n, stk_err *err);

/* ---- backends ----------------------------------------------------------- */

typedef enum stk_device_kind { STK_DEV_CPU = 0, STK_DEV_CUDA = 1 } stk_device_kind;

typedef struct stk_backend stk_backend;

/* CPU: compute threads, GEMMs included (0 = one per CPU this process may
 * run on); results do not depend on the count. CUDA: selects
 * device before any other CUDA call, creates a stream and a cuBLAS handle;
 * fails at once with a clear message where there is no GPU. */
int stk_backend_create(stk_device_kind kind, int device, int threads,
                       stk_backend **out, stk_err *err);
void stk_backend_destroy(stk_backend *be); /* NULL is a no-op */
stk_device_kind stk_backend_kind(const stk_backend *be);
const char *stk_backend_name(const stk_backend *be); /* "cpu", "cuda:0" */
int stk_backend_threads(const stk_backend *be); /* CPU compute threads; CUDA: 1 */

/* CUDA: the backend's cudaStream_t, for libraries that queue work behind
 * it (NCCL); NULL on the CPU. */
void *stk_backend_stream(stk_backend *be);

/* Samples per piece when a convolution of n samples is computed in pieces
 * that touch `per_sample` bytes of scratch each: the CPU keeps a piece
 * within about 1 MiB (in cache), CUDA takes the whole batch. */
int stk_conv_chunk(const stk_backend *be, size_t per_sample, int n);

/* Range r of stk_backend_ranges, its ops queued on `view`. */
typedef int (*stk_range_fn)(void *arg, int r, stk_backend *view,
                            stk_err *err);

/* Runs fn for each r in [0, n) (n at most stk_backend_threads) at once, on
 * be's threads, each range with a view of be whose ops run on the thread
 * that calls them alone: work cut into a few large ranges (a
 * convolution's pieces in halves of the batch) instead of every op cut
 * across the threads, so that a range's data stays in its thread's cache.
 * Returns the error of the lowest failing r, 0 when all succeed. With one
 * thread, or on a GPU, the ranges run in turn on be itself. One call at a
 * time per backend (the thread driving it), like every op. */
int stk_backend_ranges(stk_backend *be, int n, stk_range_fn fn, void *arg,
                       stk_err *err);

/* Whether stk_gemm (and each GEMM of stk_gemm_batched) with alpha 1 and
 * beta 1 adds the product to C with one rounding per element: then
 * C += A B has the same floats as the product computed with beta 0 and
 * added to C later by stk_axpy, so that a sum of products can be cut
 * across ranges without changing its floats. */
bool stk_gemm_adds_once(const stk_backend *be, bool ta, bool tb, int m,
                        int n, int k);

/* ---- memory --------------------------------------------------------------- */

void *stk_dev_alloc(stk_backend *be, size_t bytes, stk_err *err);
void stk_dev_free(stk_backend *be, void *p);
/* Page-locked host memory on CUDA (cudaHostAlloc), aligned memory on CPU:
 * what the loader's batch ring is made of (stk_host_alloc in loader.h). */
void *stk_pinned_alloc(stk_backend *be, size_t bytes);
void stk_pinned_free(stk_backend *be, void *p);
int stk_copy_to_dev(stk_backend *be, void *dst, const void *src, size_t n,
                    stk_err *err);
int stk_copy_to_host(stk_backend *be, void *dst, const void *src, size_t n,
                     stk_err *err);
int stk_memzero(stk_backend *be, void *p, size_t n, stk_err *err);
int stk_sync(stk_backend *be, stk_err *err);

/* ---- the copy stream and events ---------------------------------------- */

/* CUDA keeps two streams per backend: compute, where every op runs, and
 * copy, where stk_upload runs, so that the next batch's upload overlaps
 * this one's compute. An event marks the point one stream has reached
 * when it is recorded; the other stream, or the host, can wait for it.
 * On the CPU ops are done when they return: stk_upload is a memcpy and an
 * event is complete once recorded. Events belong to their backend. */
typedef enum stk_stream_id { STK_STREAM_COMPUTE = 0, STK_STREAM_COPY = 1 } stk_stream_id;
typedef struct stk_event stk_event;

int stk_event_create(stk_backend *be, stk_event **out, stk_err *err);
void stk_event_destroy(stk_backend *be, stk_event *ev); /* NULL is a no-op */
/* Marks the work queued on stream s so far. */
int stk_event_record(stk_backend *be, stk_event *ev, stk_stream_id s,
                     stk_err *err);
/* Work queued on s from now on starts after ev's work is done (the host
 * does not wait). An event never recorded is complete. */
int stk_stream_wait(stk_backend *be, stk_stream_id s, stk_event *ev,
                    stk_err *err);
/* *done: whether ev's work is complete, without waiting. */
int stk_event_query(stk_backend *be, stk_event *ev, bool *done, stk_err *err);
/* The host waits for ev's work; also reports its asynchronous failure. */
int stk_event_wait(stk_backend *be, stk_event *ev, stk_err *err);
/* n bytes from host src (page-locked: stk_pinned_alloc) to device dst on
 * the copy stream. src belongs to the copy until an event recorded on the
 * copy stream after it completes. */
int stk_upload(stk_backend *be, void *dst, const void *src, size_t n,
               stk_err *err);

/* ---- GEMM --------------------------------------------------------------- */

/* Row-major C[m,n] = alpha * op(A) op(B) + beta * C, op(X) = X or X^T;
 * lda, ldb, ldc are row strides of A, B, C as stored. */
int stk_gemm(stk_backend *be, bool ta, bool tb, int m, int n, int k,
             float alpha, const float *a, int lda, const float *b, int ldb,
             float beta, float *c, int ldc, stk_err *err);

/* count independent GEMMs of one shape: for i < count, C_i = alpha
 * op(A_i) op(B_i) + beta C_i with X_i = X + i * stride_x (a stride may be
 * 0: a shared A or B; the C_i may lie one below the other or side by side
 * in the rows of one C, never overlapping). The CPU runs each as one
 * OpenBLAS call on one thread, or as panels when the batch is small (the
 * same floats for any thread count), CUDA as one cublasSgemmStridedBatched. */
int stk_gemm_batched(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                     float alpha, const float *a, int lda, size_t stride_a,
                     const float *b, int ldb, size_t stride_b, float beta,
                     float *c, int ldc, size_t stride_c, int count,
                     stk_err *err);

/* ---- ops ---------------------------------------------------------------- */

int stk_relu_fwd(stk_backend *be, const float *x, float *y, size_t n,
                 stk_err *err);
/* dx = dy where y > 0 (y is the forward output); dx may alias dy. */
int stk_relu_bwd(stk_backend *be, const float *y, const float *dy, float *dx,
                 size_t n, stk_err *err);

/* y[r, c, i] += b[c] for y of shape [rows, cols, inner]. */
int stk_bias_add(stk_backend *be, float *y, const float *b, int rows, int cols,
                 int inner, stk_err *err);
/* db[c] += sum over r, i of dy[r, c, i]. */
int stk_bias_grad(stk_backend *be, const float *dy, float *db, int rows,
                  int cols, int inner, stk_err *err);

/* Columns of n samples x [n, c, h, w]: col[c*kh*kw, n*oh*ow]. */
int stk_im2col(stk_backend *be, const float *x, const stk_conv_shape *s,
               int n, float *col, stk_err *err);
/* dx[n, c, h, w] = sum of the col entries that read each pixel
 * (overwrites). */
int stk_col2im(stk_backend *be, const float *col, const stk_conv_shape *s,
               int n, float *dx, stk_err *err);
/* dst[b, a, inner] = src[a, b, inner] (dst must not alias src). */
int stk_swap01(stk_backend *be, const float *src, float *dst, size_t a,
               size_t b, size_t inner, stk_err *err);

/* Winograd F(2x2, 3x3) (ops_inline.h): a 3x3 convolution of stride 1 as
 * transforms around STK_WINO_P = 16 GEMMs (stk_gemm_batched), one per
 * point p:
 *   forward    M_p [cout, T] = U_p [cout, c] V_p [c, T]
 *   weights    dU_p [cout, c] (+)= dM_p V_p^T
 *   input      dV_p [c, T] = U_p^T dM_p
 * with T = n * tiles (stk_wino_tiles) and arrays U [16][cout, c],
 * V [16][c, T], M [16][cout, T]: point p's matrix starts p *
 * stk_wino_stride(rows * cols) floats in (a padded stride), so each array
 * takes STK_WINO_P * stk_wino_stride(rows * cols) floats. A column is
 * sample * tiles + tile. stk_wino_fits says whether the model uses it. */
bool stk_wino_fits(const stk_conv_shape *s, int cout);
/* u = G w G^T for w [cout, c, 3, 3]. */
int stk_wino_filter(stk_backend *be, const float *w, int cout, int c, float *u,
                    stk_err *err);
/* dw [cout, c, 3, 3] += G^T du G. */
int stk_wino_filter_grad(stk_backend *be, const float *du, int cout, int c,
                         float *dw, stk_err *err);
/* v = B^T d B for every tile of the n samples x [n, c, h, w]. */
int stk_wino_input(stk_backend *be, const float *x, const stk_conv_shape *s,
                   int n, float *v, stk_err *err);
/* dx [n, c, h, w] = the adjoint of stk_wino_input applied to dv
 * (overwrites dx; dv is scratch: CUDA leaves the tiles' pixel gradients
 * in it). */
int stk_wino_input_grad(stk_backend *be, float *dv, const stk_conv_shape *s,
                        int n, float *dx, stk_err *err);
/* y [n, cout, oh, ow] = A^T m A + bias[cout] (bias NULL: none). */
int stk_wino_output(stk_backend *be, const float *m, const float *bias,
                    const stk_conv_shape *s, int cout, int n, float *y,
                    stk_err *err);
/* dm = A dy A^T for dy [n, cout, oh, ow]. */
int stk_wino_output_grad(stk_backend *be, const float *dy,
                         const stk_conv_shape *s, int cout, int n, float *dm,
                         stk_err *err);

/* k x k max-pool with stride st over planes [planes, h, w]; arg keeps the
 * winner's index within its plane for the backward pass. */
int stk_maxpool_fwd(stk_backend *be, const float *x, int planes, int h, int w,
                    int k, int st, float *y, int32_t *arg, stk_err *err);
/* dx (planes*h*w, overwritten) gets dy at each winner, summed where
 * windows overlap (stk_maxpool_grad1: the same floats on every backend). */
int stk_maxpool_bwd(stk_backend *be, const float *dy, const int32_t *arg,
                    int planes, int h, int w, int k, int st, float *dx,
                    stk_err *err);

/* Average pool: kh x kw windows with strides sh, sw, no padding,
 * over planes [planes, h, w] (global average pooling: kh = h, kw = w). */
int stk_avgpool_fwd(stk_backend *be, const float *x, int planes, int h, int w,
                    int kh, int kw, int sh, int sw, float *y, stk_err *err);
/* dx (planes*h*w, overwritten): each pixel gets dy / (kh*kw) from every
 * window that holds it, added in window order (CUDA gathers, the CPU
 * scatters plane by plane: the same floats, whatever the thread count). */
int stk_avgpool_bwd(stk_backend *be, const float *dy, int planes, int h,
                    int w, int kh, int kw, int sh, int sw, float *dx,
                    stk_err *err);

/* y = a + b over n floats (the residual add); y may alias a or b. */
int stk_add(stk_backend *be, const float *a, const float *b, float *y,
            size_t n, stk_err *err);
/* dst = src, n floats of backend memory (they must not overlap). */
int stk_copy_dev(stk_backend *be, float *dst, const float *src, size_t n,
                 stk_err *err);

/* ---- batch normalisation ------------------------------------------------ */

/* Over x [n, c, hw] per channel (hw = 1: BatchNorm1d after a linear layer),
 * as PyTorch's BatchNorm2d/1d. Sums accumulate in double, in an order that
 * does not depend on the CPU's thread count (CUDA adds in another fixed
 * order: its sums repeat run to run and differ from the CPU's in the last
 * bits). The element-wise passes compute their per-channel factors in
 * double, rounded to float once (ops_inline.h, stk_bn_*_coef_of), and are
 * the same floats on both backends.
 *
 * Training: mean = stk_bn_sums(shift NULL, scale 1/(n*hw)), then
 * var = stk_bn_sums(shift mean, same scale) (biased, two passes); a
 * data-parallel group with SyncBatchNorm all-reduces each of them (scale
 * 1/(world*n*hw)) before it is used. */
/* sums[ch] = scale * sum over n, hw of x (shift NULL) or of
 * (x - shift[ch])^2, rounded to float once. */
int stk_bn_sums(stk_backend *be, const float *x, int n, int c, int hw,
                const float *shift, double scale, float *sums, stk_err *err);
/* y = (x - mean[ch]) / sqrt(var[ch] + eps) * gamma[ch] + beta[ch], and
 * then max(y, 0) when relu (a batchnorm with its ReLU in one pass),
 * computed as (x - mean) * k + beta with k = gamma / sqrt(var + eps). y
 * may alias x. */
int stk_bn_apply(stk_backend *be, const float *x, float *y, int n, int c,
                 int hw, const float *mean, const float *var, float eps,
                 const float *gamma, const float *beta, bool relu,
                 stk_err *err);
/* stk_bn_apply with the residual res (the batch's shape) added before the
 * ReLU: y = max(bn(x) + res, 0), or bn(x) + res without relu, the floats
 * of stk_bn_apply, stk_add and the ReLU run in turn (a residual block's
 * tail in one pass). y may alias x or res. */
int stk_bn_apply_add(stk_backend *be, const float *x, const float *res,
                     float *y, int n, int c, int hw, const float *mean,
                     const float *var, float eps, const float *gamma,
                     const float *beta, bool relu, stk_err *err);
/* Backward reductions per channel, into sums[2c] (overwritten):
 * sums[ch] = sum of g (beta's gradient) and sums[c + ch] = sum of
 * g * (x - mean[ch]) / sqrt(var[ch] + eps) (gamma's), where g = dy, or,
 * with relu (the batchnorm's fused ReLU), dy where the ReLU's output is
 * above 0. That output is recomputed from x, gamma and beta as
 * stk_bn_apply made it (the same floats), not read (gamma and beta may be
 * NULL without relu). */
int stk_bn_grad_sums(stk_backend *be, const float *dy, const float *x, int n,
                     int c, int hw, const float *mean, const float *var,
                     float eps, const float *gamma, const float *beta,
                     bool relu, float *sums, stk_err *err);
/* Training-mode input gradient, the batch statistics' part included:
 * dx = gamma/sqrt(var + eps) * (g - inv_count * sums[ch]
 *      - xhat * inv_count * sums[c + ch]),
 * xhat = (x - mean)/sqrt(var + eps), g as above, inv_count = 1/(n*hw)
 * (0: the statistics are constants, evaluation mode's backward)
 * (SyncBatchNorm: sums all-reduced, 1/(world*n*hw)). dx may alias dy. */
int stk_bn_input_grad(stk_backend *be, const float *dy, const float *x, int n,
                      int c, int hw, const float *mean, const float *var,
                      float eps, const float *gamma, const float *beta,
                      bool relu, const float *sums, float inv_count, float *dx,
                      stk_err *err);
/* PyTorch's running statistics update over c channels:
 * run_mean = momentum * mean + (1 - momentum) * run_mean,
 * run_var = momentum * var * unbias + (1 - momentum) * run_var,
 * unbias = count / (count - 1) for the unbiased variance. */
int stk_bn_running(stk_backend *be, float *run_mean, float *run_var,
                   const float *mean, const float *var, int c, float momentum,
                   float unbias, stk_err *err);

/* In place: x[i] *= stk_dropout_scale1(key, stream, first + i, group, p)
 * for i < n, x being element `first` (a multiple of group: a piece of the
 * batch) of the layer's tensor. The same call on the gradient is the
 * backward pass. */
int stk_dropout(stk_backend *be, float *x, size_t n, size_t first,
                size_t group, float p, stk_philox_key key, uint64_t stream,
                stk_err *err);

/* Mean softmax cross-entropy of logits [n, c] with label smoothing in
 * [0, 1] (PyTorch's label_smoothing; 0: none): *loss (host) and dlogits
 * (device, may be NULL). The one op whose floats differ between backends
 * in the last bits: expf and logf are the platform's (glibc's on the CPU,
 * CUDA's within 2 ulp on the GPU). A label out of range is STK_ERANGE;
 * dlogits is then unspecified. */
int stk_xent(stk_backend *be, const float *logits, const int32_t *labels,
             int n, int c, float smoothing, float *loss, float *dlogits,
             stk_err *err);

/* ---- training metrics on the device (stk_metrics, ops_inline.h) -------- */

/* stk_xent with its mean loss added (times n) to m->step_loss instead of
 * returned: nothing waits. A label out of range is recorded in m (bad_row,
 * bad_label, the first one only) instead of failing; the loss is then not
 * added and dlogits is unspecified. */
int stk_xent_metrics(stk_backend *be, const float *logits,
                     const int32_t *labels, int n, int c, float smoothing,
                     float *dlogits, stk_metrics *m, stk_err *err);
/* m->step_hits += the rows whose first largest logit is at their label. */
int stk_count_hits(stk_backend *be, const float *logits, const int32_t *labels,
                   int n, int c, stk_metrics *m, stk_err *err);
/* Closes step `step` (0-based) of `epoch`, n samples: stk_metrics_close. */
int stk_metrics_step(stk_backend *be, stk_metrics *m, int n, uint64_t step,
                     uint64_t epoch, stk_err *err);
/* The norm of g (stk_sumsq's sum) checked into m, and g scaled to norm
 * clip where it is larger (clip > 0): stk_metrics_norm, on the device. */
int stk_grad_norm(stk_backend *be, float *g, size_t n, float clip,
                  uint64_t step, uint64_t epoch, stk_metrics *m, stk_err *err);

/* uint8 batch [n, c, h, w] -> normalised float, with the transform's random
 * crop and flip keyed by sample_ids (n entries, device memory). */
int stk_transform_batch(stk_backend *be, const uint8_t *x,
                        const uint64_t *sample_ids, int n,
                        const stk_transform *t, float *y, stk_err *err);

/* y += alpha * x */
int stk_axpy(stk_backend *be, size_t n, float alpha, const float *x, float *y,
             stk_err *err);
/* x *= alpha */
int stk_scale(stk_backend *be, size_t n, float alpha, float *x, stk_err *err);
/* *out (host) = sum of x[i]^2, accumulated in double */
int stk_sumsq(stk_backend *be, const float *x, size_t n, double *out,
              stk_err *err);

/* One optimizer step over n parameters (buffers are device memory). */
int stk_sgd_step(stk_backend *be, float *w, const float *g, float *buf,
                 size_t n, const stk_sgd_cfg *cfg, stk_err *err);
int stk_adamw_step(stk_backend *be, float *w, const float *g, float *m,
                   float *v, size_t n, const stk_adamw_cfg *cfg,
                   stk_err *err);

#ifdef __cplusplus
}
#endif

#endif
