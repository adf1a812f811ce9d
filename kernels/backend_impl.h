/* backend_impl.h - private: the table each backend fills. The public
 * functions in backend.c check arguments once and dispatch here. */
#ifndef STK_BACKEND_IMPL_H
#define STK_BACKEND_IMPL_H

#include "kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct backend_ops {
    void (*destroy)(stk_backend *be);
    void *(*alloc)(stk_backend *be, size_t bytes, stk_err *err);
    void (*free)(stk_backend *be, void *p);
    void *(*host_alloc)(stk_backend *be, size_t bytes);
    void (*host_free)(stk_backend *be, void *p);
    int (*copy)(stk_backend *be, void *dst, const void *src, size_t n,
                int to_dev, stk_err *err);
    int (*memzero)(stk_backend *be, void *p, size_t n, stk_err *err);
    int (*sync)(stk_backend *be, stk_err *err);
    int (*event_create)(stk_backend *be, stk_event **out, stk_err *err);
    void (*event_destroy)(stk_backend *be, stk_event *ev);
    int (*event_record)(stk_backend *be, stk_event *ev, stk_stream_id s,
                        stk_err *err);
    int (*stream_wait)(stk_backend *be, stk_stream_id s, stk_event *ev,
                       stk_err *err);
    int (*event_query)(stk_backend *be, stk_event *ev, bool *done,
                       stk_err *err);
    int (*event_wait)(stk_backend *be, stk_event *ev, stk_err *err);
    int (*upload)(stk_backend *be, void *dst, const void *src, size_t n,
                  stk_err *err);
    int (*gemm)(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                float alpha, const float *a, int lda, const float *b, int ldb,
                float beta, float *c, int ldc, stk_err *err);
    int (*gemm_batched)(stk_backend *be, bool ta, bool tb, int m, int n,
                        int k, float alpha, const float *a, int lda,
                        size_t sa, const float *b, int ldb, size_t sb,
                        float beta, float *c, int ldc, size_t sc, int count,
                        stk_err *err);
    int (*relu_fwd)(stk_backend *be, const float *x, float *y, size_t n,
                    stk_err *err);
    int (*relu_bwd)(stk_backend *be, const float *y, const float *dy,
                    float *dx, size_t n, stk_err *err);
    int (*bias_add)(stk_backend *be, float *y, const float *b, int rows,
                    int cols, int inner, stk_err *err);
    int (*bias_grad)(stk_backend *be, const float *dy, float *db, int rows,
                     int cols, int inner, stk_err *err);
    int (*im2col)(stk_backend *be, const float *x, const stk_conv_shape *s,
                  int n, float *col, stk_err *err);
    int (*col2im)(stk_backend *be, const float *col, const stk_conv_shape *s,
                  int n, float *dx, stk_err *err);
    int (*swap01)(stk_backend *be, const float *src, float *dst, size_t a,
                  size_t b, size_t inner, stk_err *err);
    int (*wino_filter)(stk_backend *be, const float *w, int cout, int c,
                       float *u, stk_err *err);
    int (*wino_filter_grad)(stk_backend *be, const float *du, int cout, int c,
                            float *dw, stk_err *err);
    int (*wino_input)(stk_backend *be, const float *x, const stk_conv_shape *s,
                      int n, float *v, stk_err *err);
    int (*wino_input_grad)(stk_backend *be, float *dv, const stk_conv_shape *s,
                           int n, float *dx, stk_err *err);
    int (*wino_output)(stk_backend *be, const float *m, const float *bias,
                       const stk_conv_shape *s, int cout, int n, float *y,
                       stk_err *err);
    int (*wino_output_grad)(stk_backend *be, const float *dy,
                            const stk_conv_shape *s, int cout, int n,
                            float *dm, stk_err *err);
    int (*maxpool_fwd)(stk_backend *be, const float *x, int planes, int h,
                       int w, int k, int st, float *y, int32_t *arg,
                       stk_err *err);
    int (*maxpool_bwd)(stk_backend *be, const float *dy, const int32_t *arg,
                       int planes, int h, int w, int k, int st, float *dx,
                       stk_err *err);
    int (*avgpool_fwd)(stk_backend *be, const float *x, int planes, int h,
                       int w, int kh, int kw, int sh, int sw, float *y,
                       stk_err *err);
    int (*avgpool_bwd)(stk_backend *be, const float *dy, int planes, int h,
                       int w, int kh, int kw, int sh, int sw, float *dx,
                       stk_err *err);
    int (*add)(stk_backend *be, const float *a, const float *b, float *y,
               size_t n, stk_err *err);
    int (*copy_dev)(stk_backend *be, float *dst, const float *src, size_t n,
                    stk_err *err);
    int (*bn_sums)(stk_backend *be, const float *x, int n, int c, int hw,
                   const float *shift, double scale, float *sums,
                   stk_err *err);
    int (*bn_apply)(stk_backend *be, const float *x, const float *res,
                    float *y, int n, int c, int hw, const float *mean,
                    const float *var, float eps, const float *gamma,
                    const float *beta, bool relu, stk_err *err);
    int (*bn_grad_sums)(stk_backend *be, const float *dy, const float *x,
                        int n, int c, int hw, const float *mean,
                        const float *var, float eps, const float *gamma,
                        const float *beta, bool relu, float *sums,
                        stk_err *err);
    int (*bn_input_grad)(stk_backend *be, const float *dy, const float *x,
                         int n, int c, int hw, const float *mean,
                         const float *var, float eps, const float *gamma,
                         const float *beta, bool relu, const float *sums,
                         float inv_count, float *dx, stk_err *err);
    int (*bn_running)(stk_backend *be, float *run_mean, float *run_var,
                      const float *mean, const float *var, int c,
                      float momentum, float unbias, stk_err *err);
    int (*dropout)(stk_backend *be, float *x, size_t n, size_t first,
                   size_t group, float p, stk_philox_key key, uint64_t stream,
                   stk_err *err);
    int (*xent)(stk_backend *be, const float *logits, const int32_t *labels,
                int n, int c, float smoothing, float *loss, float *dlogits,
                stk_err *err);
    int (*xent_metrics)(stk_backend *be, const float *logits,
                        const int32_t *labels, int n, int c, float smoothing,
                        float *dlogits, stk_metrics *m, stk_err *err);
    int (*count_hits)(stk_backend *be, const float *logits,
                      const int32_t *labels, int n, int c, stk_metrics *m,
                      stk_err *err);
    int (*metrics_step)(stk_backend *be, stk_metrics *m, int n, uint64_t step,
                        uint64_t epoch, stk_err *err);
    int (*grad_norm)(stk_backend *be, float *g, size_t n, float clip,
                     uint64_t step, uint64_t epoch, stk_metrics *m,
                     stk_err *err);
    int (*transform)(stk_backend *be, const uint8_t *x, const uint64_t *ids,
                     int n, const stk_transform *t, float *y, stk_err *err);
    int (*axpy)(stk_backend *be, size_t n, float alpha, const float *x,
                float *y, stk_err *err);
    int (*scale)(stk_backend *be, size_t n, float alpha, float *x,
                 stk_err *err);
    int (*sumsq)(stk_backend *be, const float *x, size_t n, double *out,
                 stk_err *err);
    int (*sgd)(stk_backend *be, float *w, const float *g, float *buf, size_t n,
               const stk_sgd_cfg *cfg, stk_err *err);
    int (*adamw)(stk_backend *be, float *w, const float *g, float *m, float *v,
                 size_t n, const stk_adamw_cfg *cfg, stk_err *err);
} backend_ops;

struct stk_backend {
    const backend_ops *ops;
    stk_device_kind kind;
    int device;
    char name[16];
    void *impl; /* the backend's own state (CUDA: stream, cuBLAS handle) */
};

extern const backend_ops stk_cpu_ops;
/* Makes be a CPU backend computing on `threads` threads (pool.c). */
int stk_cpu_backend_init(stk_backend *be, int threads, stk_err *err);
/* A CPU backend's compute threads. */
int stk_cpu_threads(const stk_backend *be);
/* stk_backend_ranges on a CPU backend of 1 < n <= its threads (each
 * range on its own view). */
int stk_cpu_ranges(stk_backend *be, int n, stk_range_fn fn, void *arg,
                   stk_err *err);
/* The address of element x of p, x outside p's array included (the
 * vector loops' masked-off lanes, prefetches past an array's end), formed
 * in integers: pointer arithmetic outside an array is undefined in C. */
static inline uintptr_t stk_addr_at(const float *p, ptrdiff_t x)
{
    return (uintptr_t)p + (uintptr_t)(x * (ptrdiff_t)sizeof(float));
}
/* The CPU's convolution piece, in bytes. 1 MiB: on a 1 MiB L2, 512 KiB
 * pieces made the cnn 1.8% faster at 1 thread but 12% slower at 2 (10
 * pairs of runs), whose threads share a piece; the piece must not follow
 * the thread count, or the results would (the Winograd weight gradient
 * adds up over pieces). */
enum { STK_CPU_PIECE_BYTES = 1 << 20 };

/* ---- the CPU backend's thread pool (pool.c) ---------------------------- */

typedef struct stk_pool stk_pool;
/* Called with a contiguous range [begin, end) of the loop's indices. */
typedef void (*stk_pool_fn)(void *arg, size_t begin, size_t end);

/* threads counts the caller: 1 starts no thread. */
stk_pool *stk_pool_create(int threads, stk_err *err);
void stk_pool_destroy(stk_pool *p); /* NULL is a no-op */
int stk_pool_threads(const stk_pool *p);
/* Runs fn over [0, n) split into at most one contiguous range per thread,
 * each at least `grain` long, each run by whichever thread claims it first
 * (the caller too), and returns when all are done. One loop at a time: the
 * pool belongs to the thread driving its backend. */
void stk_pool_for(stk_pool *p, size_t n, size_t grain, stk_pool_fn fn,
                  void *arg);
/* Fills be for CUDA device `device`; defined in cuda_ops.cu, or in
 * cuda_none.c where it reports that CUDA is not built. */
int stk_cuda_backend_init(stk_backend *be, int device, stk_err *err);
void *stk_cuda_stream(stk_backend *be); /* its cudaStream_t */

#ifdef __cplusplus
}
#endif

#endif
