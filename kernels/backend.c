/* backend.c - creating backends and dispatching the op API to them. */
#include "backend_impl.h"
#include "cpu_gemm.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int stk_backend_create(stk_device_kind kind, int device, int threads,
                       stk_backend **out, stk_err *err)
{
    *out = NULL;
    stk_backend *be = calloc(1, sizeof *be);
    if (!be)
        return stk_fail(err, STK_ENOMEM, "backend: out of memory");
    be->kind = kind;
    be->device = device;
    int rc = 0;
    if (kind == STK_DEV_CPU) {
        snprintf(be->name, sizeof be->name, "cpu");
        rc = stk_cpu_backend_init(be, threads, err);
    } else {
        snprintf(be->name, sizeof be->name, "cuda:%d", device);
        rc = stk_cuda_backend_init(be, device, err);
    }
    if (rc) {
        free(be);
        return rc;
    }
    *out = be;
    return 0;
}

void stk_backend_destroy(stk_backend *be)
{
    if (!be)
        return;
    if (be->ops)
        be->ops->destroy(be);
    free(be);
}

void *stk_backend_stream(stk_backend *be)
{
    return be->kind == STK_DEV_CUDA ? stk_cuda_stream(be) : NULL;
}

int stk_conv_chunk(const stk_backend *be, size_t per_sample, int n)
{
    if (be->kind != STK_DEV_CPU || n < 1)
        return n;
    size_t k = per_sample ? STK_CPU_PIECE_BYTES / per_sample : (size_t)n;
    return k < 1 ? 1 : k > (size_t)n ? n : (int)k;
}

int stk_backend_ranges(stk_backend *be, int n, stk_range_fn fn, void *arg,
                       stk_err *err)
{
    if (be->kind == STK_DEV_CPU && n > 1 && n <= stk_cpu_threads(be))
        return stk_cpu_ranges(be, n, fn, arg, err);
    int rc = 0;
    for (int r = 0; r < n && !rc; r++)
        rc = fn(arg, r, be, err);
    return rc;
}

bool stk_gemm_adds_once(const stk_backend *be, bool ta, bool tb, int m,
                        int n, int k)
{
    /* OpenBLAS adds a long K's blocks to C one by one; stoke's own tiles
     * sum K first */
    return be->kind == STK_DEV_CPU && stk_small_gemm_wins(ta, tb, m, n, k);
}

stk_device_kind stk_backend_kind(const stk_backend *be) { return be->kind; }
const char *stk_backend_name(const stk_backend *be) { return be->name; }

int stk_backend_threads(const stk_backend *be)
{
    return be->kind == STK_DEV_CPU ? stk_cpu_threads(be) : 1;
}

void *stk_dev_alloc(stk_backend *be, size_t bytes, stk_err *err)
{
    return be->ops->alloc(be, bytes, err);
}

void stk_dev_free(stk_backend *be, void *p)
{
    if (p)
        be->ops->free(be, p);
}

void *stk_pinned_alloc(stk_backend *be, size_t bytes)
{
    return be->ops->host_alloc(be, bytes);
}

void stk_pinned_free(stk_backend *be, void *p)
{
    if (p)
        be->ops->host_free(be, p);
}

int stk_copy_to_dev(stk_backend *be, void *dst, const void *src, size_t n,
                    stk_err *err)
{
    return be->ops->copy(be, dst, src, n, 1, err);
}

int stk_copy_to_host(stk_backend *be, void *dst, const void *src, size_t n,
                     stk_err *err)
{
    return be->ops->copy(be, dst, src, n, 0, err);
}

int stk_memzero(stk_backend *be, void *p, size_t n, stk_err *err)
{
    return be->ops->memzero(be, p, n, err);
}

int stk_sync(stk_backend *be, stk_err *err) { return be->ops->sync(be, err); }

int stk_event_create(stk_backend *be, stk_event **out, stk_err *err)
{
    *out = NULL;
    return be->ops->event_create(be, out, err);
}

void stk_event_destroy(stk_backend *be, stk_event *ev)
{
    if (ev)
        be->ops->event_destroy(be, ev);
}

int stk_event_record(stk_backend *be, stk_event *ev, stk_stream_id s,
                     stk_err *err)
{
    return be->ops->event_record(be, ev, s, err);
}

int stk_stream_wait(stk_backend *be, stk_stream_id s, stk_event *ev,
                    stk_err *err)
{
    return be->ops->stream_wait(be, s, ev, err);
}

int stk_event_query(stk_backend *be, stk_event *ev, bool *done, stk_err *err)
{
    return be->ops->event_query(be, ev, done, err);
}

int stk_event_wait(stk_backend *be, stk_event *ev, stk_err *err)
{
    return be->ops->event_wait(be, ev, err);
}

int stk_upload(stk_backend *be, void *dst, const void *src, size_t n,
               stk_err *err)
{
    return n ? be->ops->upload(be, dst, src, n, err) : 0;
}

static int check_gemm(bool ta, bool tb, int m, int n, int k, int lda,
                      int ldb, int ldc, stk_err *err)
{
    if (m < 0 || n < 0 || k < 0 || lda < (ta ? m : k) ||
        ldb < (tb ? k : n) || ldc < n)
        return stk_fail(err, STK_EINVAL,
                        "gemm: bad shape m=%d n=%d k=%d lda=%d ldb=%d ldc=%d",
                        m, n, k, lda, ldb, ldc);
    return 0;
}

int stk_gemm(stk_backend *be, bool ta, bool tb, int m, int n, int k,
             float alpha, const float *a, int lda, const float *b, int ldb,
             float beta, float *c, int ldc, stk_err *err)
{
    int rc = check_gemm(ta, tb, m, n, k, lda, ldb, ldc, err);
    if (rc || !m || !n)
        return rc;
    return be->ops->gemm(be, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                         ldc, err);
}

int stk_gemm_batched(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                     float alpha, const float *a, int lda, size_t stride_a,
                     const float *b, int ldb, size_t stride_b, float beta,
                     float *c, int ldc, size_t stride_c, int count,
                     stk_err *err)
{
    int rc = check_gemm(ta, tb, m, n, k, lda, ldb, ldc, err);
    if (!rc && count < 0)
        rc = stk_fail(err, STK_EINVAL, "gemm: a batch of %d", count);
    /* the C_i must not overlap (the CPU writes them in parallel): one
     * below the other, or side by side within each row of C */
    if (!rc && count > 1 && m > 0 && n > 0 &&
        stride_c < (size_t)(m - 1) * ldc + n &&
        (stride_c < (size_t)n || (size_t)(ldc - n) / (size_t)(count - 1) < stride_c))
        rc = stk_fail(err, STK_EINVAL,
                      "gemm: C matrices %zu floats apart overlap (m=%d n=%d "
                      "ldc=%d)",
                      stride_c, m, n, ldc);
    if (rc || !m || !n || !count)
        return rc;
    return be->ops->gemm_batched(be, ta, tb, m, n, k, alpha, a, lda, stride_a,
                                 b, ldb, stride_b, beta, c, ldc, stride_c,
                                 count, err);
}

int stk_relu_fwd(stk_backend *be, const float *x, float *y, size_t n,
                 stk_err *err)
{
    return be->ops->relu_fwd(be, x, y, n, err);
}

int stk_relu_bwd(stk_backend *be, const float *y, const float *dy, float *dx,
                 size_t n, stk_err *err)
{
    return be->ops->relu_bwd(be, y, dy, dx, n, err);
}

int stk_bias_add(stk_backend *be, float *y, const float *b, int rows, int cols,
                 int inner, stk_err *err)
{
    return be->ops->bias_add(be, y, b, rows, cols, inner, err);
}

int stk_bias_grad(stk_backend *be, const float *dy, float *db, int rows,
                  int cols, int inner, stk_err *err)
{
    return be->ops->bias_grad(be, dy, db, rows, cols, inner, err);
}

static int check_conv(const stk_conv_shape *s, stk_err *err)
{
    if (s->c < 1 || s->kh < 1 || s->kw < 1 || s->sh < 1 || s->sw < 1 ||
        s->ph < 0 || s->pw < 0 ||
        s->oh != (s->h + 2 * s->ph - s->kh) / s->sh + 1 ||
        s->ow != (s->w + 2 * s->pw - s->kw) / s->sw + 1 || s->oh < 1 ||
        s->ow < 1)
        return stk_fail(err, STK_EINVAL,
                        "conv: inconsistent shape (in %dx%dx%d, kernel "
                        "%dx%d, stride %dx%d, pad %dx%d, out %dx%d)",
                        s->c, s->h, s->w, s->kh, s->kw, s->sh, s->sw, s->ph,
                        s->pw, s->oh, s->ow);
    return 0;
}

int stk_im2col(stk_backend *be, const float *x, const stk_conv_shape *s,
               int n, float *col, stk_err *err)
{
    int rc = check_conv(s, err);
    if (!rc && n < 1)
        rc = stk_fail(err, STK_EINVAL, "im2col: %d samples", n);
    return rc ? rc : be->ops->im2col(be, x, s, n, col, err);
}

int stk_col2im(stk_backend *be, const float *col, const stk_conv_shape *s,
               int n, float *dx, stk_err *err)
{
    int rc = check_conv(s, err);
    if (!rc && n < 1)
        rc = stk_fail(err, STK_EINVAL, "col2im: %d samples", n);
    return rc ? rc : be->ops->col2im(be, col, s, n, dx, err);
}

bool stk_wino_fits(const stk_conv_shape *s, int cout)
{
    /* below 8 channels the 36 GEMMs are too thin to pay for the transforms */
    return s->kh == 3 && s->kw == 3 && s->sh == 1 && s->sw == 1 &&
           s->c >= 8 && cout >= 8 && !check_conv(s, NULL);
}

static int check_wino(const stk_conv_shape *s, int cout, int n, stk_err *err)
{
    int rc = check_conv(s, err);
    if (!rc && (s->kh != 3 || s->kw != 3 || s->sh != 1 || s->sw != 1))
        rc = stk_fail(err, STK_EINVAL,
                      "winograd: a %dx%d kernel of stride %dx%d (3x3, "
                      "stride 1 expected)",
                      s->kh, s->kw, s->sh, s->sw);
    if (!rc && (cout < 1 || n < 1))
        rc = stk_fail(err, STK_EINVAL, "winograd: %d samples, %d outputs", n,
                      cout);
    return rc;
}

int stk_wino_filter(stk_backend *be, const float *w, int cout, int c, float *u,
                    stk_err *err)
{
    if (cout < 1 || c < 1)
        return stk_fail(err, STK_EINVAL, "winograd: %d x %d filters", cout, c);
    return be->ops->wino_filter(be, w, cout, c, u, err);
}

int stk_wino_filter_grad(stk_backend *be, const float *du, int cout, int c,
                         float *dw, stk_err *err)
{
    if (cout < 1 || c < 1)
        return stk_fail(err, STK_EINVAL, "winograd: %d x %d filters", cout, c);
    return be->ops->wino_filter_grad(be, du, cout, c, dw, err);
}

int stk_wino_input(stk_backend *be, const float *x, const stk_conv_shape *s,
                   int n, float *v, stk_err *err)
{
    int rc = check_wino(s, 1, n, err);
    return rc ? rc : be->ops->wino_input(be, x, s, n, v, err);
}

int stk_wino_input_grad(stk_backend *be, float *dv, const stk_conv_shape *s,
                        int n, float *dx, stk_err *err)
{
    int rc = check_wino(s, 1, n, err);
    return rc ? rc : be->ops->wino_input_grad(be, dv, s, n, dx, err);
}

int stk_wino_output(stk_backend *be, const float *m, const float *bias,
                    const stk_conv_shape *s, int cout, int n, float *y,
                    stk_err *err)
{
    int rc = check_wino(s, cout, n, err);
    return rc ? rc : be->ops->wino_output(be, m, bias, s, cout, n, y, err);
}

int stk_wino_output_grad(stk_backend *be, const float *dy,
                         const stk_conv_shape *s, int cout, int n, float *dm,
                         stk_err *err)
{
    int rc = check_wino(s, cout, n, err);
    return rc ? rc : be->ops->wino_output_grad(be, dy, s, cout, n, dm, err);
}

int stk_swap01(stk_backend *be, const float *src, float *dst, size_t a,
               size_t b, size_t inner, stk_err *err)
{
    if (src == dst)
        return stk_fail(err, STK_EINVAL, "swap01: dst aliases src");
    return be->ops->swap01(be, src, dst, a, b, inner, err);
}

int stk_maxpool_fwd(stk_backend *be, const float *x, int planes, int h, int w,
                    int k, int st, float *y, int32_t *arg, stk_err *err)
{
    if (k < 1 || st < 1 || h < k || w < k)
        return stk_fail(err, STK_EINVAL,
                        "max-pool: kernel %d stride %d does not fit %dx%d", k,
                        st, h, w);
    return be->ops->maxpool_fwd(be, x, planes, h, w, k, st, y, arg, err);
}

int stk_maxpool_bwd(stk_backend *be, const float *dy, const int32_t *arg,
                    int planes, int h, int w, int k, int st, float *dx,
                    stk_err *err)
{
    if (k < 1 || st < 1 || h < k || w < k)
        return stk_fail(err, STK_EINVAL,
                        "max-pool: kernel %d stride %d does not fit %dx%d", k,
                        st, h, w);
    return be->ops->maxpool_bwd(be, dy, arg, planes, h, w, k, st, dx, err);
}

/* 0, or a failure naming the first NULL of the k pointers, whose names are
 * the space-separated words of names. */
static int check_ptrs(const char *op, const char *names,
                      const void *const *ptrs, int k, stk_err *err)
{
    for (int i = 0; i < k; i++, names += strcspn(names, " ") + 1)
        if (!ptrs[i])
            return stk_fail(err, STK_EINVAL, "%s: %.*s is NULL", op,
                            (int)strcspn(names, " "), names);
    return 0;
}

#define CHECK_PTRS(op, names, ...)                                            \
    check_ptrs(                                                               \
        op, names, (const void *const[]){__VA_ARGS__},                        \
        (int)(sizeof((const void *[]){__VA_ARGS__}) / sizeof(const void *)),  \
        err)

static int check_avgpool(int planes, int h, int w, int kh, int kw, int sh,
                         int sw, stk_err *err)
{
    if (planes < 1 || kh < 1 || kw < 1 || sh < 1 || sw < 1 || h < kh || w < kw)
        return stk_fail(err, STK_EINVAL,
                        "avg-pool: a %dx%d kernel of stride %dx%d over %d "
                        "planes of %dx%d (a kernel within the plane, sizes "
                        "and strides >= 1 expected)",
                        kh, kw, sh, sw, planes, h, w);
    return 0;
}

int stk_avgpool_fwd(stk_backend *be, const float *x, int planes, int h, int w,
                    int kh, int kw, int sh, int sw, float *y, stk_err *err)
{
    int rc = check_avgpool(planes, h, w, kh, kw, sh, sw, err);
    if (!rc)
        rc = CHECK_PTRS("avg-pool", "x y", x, y);
    return rc ? rc
              : be->ops->avgpool_fwd(be, x, planes, h, w, kh, kw, sh, sw, y,
                                     err);
}

int stk_avgpool_bwd(stk_backend *be, const float *dy, int planes, int h, int w,
                    int kh, int kw, int sh, int sw, float *dx, stk_err *err)
{
    int rc = check_avgpool(planes, h, w, kh, kw, sh, sw, err);
    if (!rc)
        rc = CHECK_PTRS("avg-pool backward", "dy dx", dy, dx);
    return rc ? rc
              : be->ops->avgpool_bwd(be, dy, planes, h, w, kh, kw, sh, sw, dx,
                                     err);
}

int stk_add(stk_backend *be, const float *a, const float *b, float *y,
            size_t n, stk_err *err)
{
    if (n == 0)
        return 0;
    int rc = CHECK_PTRS("add", "a b y", a, b, y);
    return rc ? rc : be->ops->add(be, a, b, y, n, err);
}

int stk_copy_dev(stk_backend *be, float *dst, const float *src, size_t n,
                 stk_err *err)
{
    if (n == 0)
        return 0;
    int rc = CHECK_PTRS("device copy", "dst src", dst, src);
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src, bytes = n * sizeof *dst;
    if (!rc && d < s + bytes && s < d + bytes)
        rc = stk_fail(err, STK_EINVAL,
                      "device copy: dst and src overlap (%zu floats)", n);
    return rc ? rc : be->ops->copy_dev(be, dst, src, n, err);
}

/* The shape every batchnorm op checks. */
static int check_bn(const char *op, int n, int c, int hw, stk_err *err)
{
    if (n < 1 || c < 1 || hw < 1)
        return stk_fail(err, STK_EINVAL,
                        "%s: a batch of %d x %d channels x %d (each >= 1 "
                        "expected)",
                        op, n, c, hw);
    return 0;
}

static int check_eps(const char *op, float eps, stk_err *err)
{
    if (!(eps > 0.0f) || isinf(eps))
        return stk_fail(err, STK_EINVAL,
                        "%s: eps %g (a finite number > 0 expected)", op,
                        (double)eps);
    return 0;
}

int stk_bn_sums(stk_backend *be, const float *x, int n, int c, int hw,
                const float *shift, double scale, float *sums, stk_err *err)
{
    const char *op = "batchnorm sums";
    int rc = check_bn(op, n, c, hw, err);
    if (!rc && !(scale > 0.0 && isfinite(scale)))
        rc =
            stk_fail(err, STK_EINVAL,
                     "%s: scale %g (a finite number > 0 expected)", op, scale);
    if (!rc)
        rc = CHECK_PTRS(op, "x sums", x, sums);
    return rc ? rc
              : be->ops->bn_sums(be, x, n, c, hw, shift, scale, sums, err);
}

static int bn_apply_op(stk_backend *be, const char *op, const float *x,
                       const float *res, float *y, int n, int c, int hw,
                       const float *mean, const float *var, float eps,
                       const float *gamma, const float *beta, bool relu,
                       stk_err *err)
{
    int rc = check_bn(op, n, c, hw, err);
    if (!rc)
        rc = check_eps(op, eps, err);
    if (!rc)
        rc = CHECK_PTRS(op, "x y mean var gamma beta", x, y, mean, var, gamma,
                        beta);
    return rc ? rc
              : be->ops->bn_apply(be, x, res, y, n, c, hw, mean, var, eps,
                                  gamma, beta, relu, err);
}

int stk_bn_apply(stk_backend *be, const float *x, float *y, int n, int c,
                 int hw, const float *mean, const float *var, float eps,
                 const float *gamma, const float *beta, bool relu,
                 stk_err *err)
{
    return bn_apply_op(be, "batchnorm apply", x, NULL, y, n, c, hw, mean, var,
                       eps, gamma, beta, relu, err);
}

int stk_bn_apply_add(stk_backend *be, const float *x, const float *res,
                     float *y, int n, int c, int hw, const float *mean,
                     const float *var, float eps, const float *gamma,
                     const float *beta, bool relu, stk_err *err)
{
    const char *op = "batchnorm apply and add";
    int rc = CHECK_PTRS(op, "res", res);
    return rc ? rc
              : bn_apply_op(be, op, x, res, y, n, c, hw, mean, var, eps,
                            gamma, beta, relu, err);
}

int stk_bn_grad_sums(stk_backend *be, const float *dy, const float *x, int n,
                     int c, int hw, const float *mean, const float *var,
                     float eps, const float *gamma, const float *beta,
                     bool relu, float *sums, stk_err *err)
{
    const char *op = "batchnorm grad sums";
    int rc = check_bn(op, n, c, hw, err);
    if (!rc)
        rc = check_eps(op, eps, err);
    if (!rc)
        rc = CHECK_PTRS(op, "dy x mean var sums", dy, x, mean, var, sums);
    if (!rc && relu) /* the fused ReLU's output is recomputed from them */
        rc = CHECK_PTRS(op, "gamma beta", gamma, beta);
    return rc ? rc
              : be->ops->bn_grad_sums(be, dy, x, n, c, hw, mean, var, eps,
                                      gamma, beta, relu, sums, err);
}

int stk_bn_input_grad(stk_backend *be, const float *dy, const float *x, int n,
                      int c, int hw, const float *mean, const float *var,
                      float eps, const float *gamma, const float *beta,
                      bool relu, const float *sums, float inv_count, float *dx,
                      stk_err *err)
{
    const char *op = "batchnorm input grad";
    int rc = check_bn(op, n, c, hw, err);
    if (!rc)
        rc = check_eps(op, eps, err);
    if (!rc && !(inv_count >= 0.0f && inv_count <= 1.0f))
        rc = stk_fail(err, STK_EINVAL,
                      "%s: inv_count %g (1/count, or 0, in [0, 1], expected)",
                      op, (double)inv_count);
    if (!rc)
        rc = CHECK_PTRS(op, "dy x mean var gamma sums dx", dy, x, mean, var,
                        gamma, sums, dx);
    if (!rc && relu)
        rc = CHECK_PTRS(op, "beta", beta);
    return rc ? rc
              : be->ops->bn_input_grad(be, dy, x, n, c, hw, mean, var, eps,
                                       gamma, beta, relu, sums, inv_count, dx,
                                       err);
}

int stk_bn_running(stk_backend *be, float *run_mean, float *run_var,
                   const float *mean, const float *var, int c, float momentum,
                   float unbias, stk_err *err)
{
    const char *op = "batchnorm running stats";
    if (c < 1)
        return stk_fail(err, STK_EINVAL, "%s: %d channels (>= 1 expected)", op,
                        c);
    if (!(momentum >= 0.0f && momentum <= 1.0f))
        return stk_fail(err, STK_EINVAL, "%s: momentum %g is not in [0, 1]",
                        op, (double)momentum);
    if (!(unbias >= 1.0f) || isinf(unbias))
        return stk_fail(err, STK_EINVAL,
                        "%s: unbias %g (count/(count - 1) >= 1 of a batch of "
                        "2 or more values per channel expected)",
                        op, (double)unbias);
    int rc = CHECK_PTRS(op, "run_mean run_var mean var", run_mean, run_var,
                        mean, var);
    return rc ? rc
              : be->ops->bn_running(be, run_mean, run_var, mean, var, c,
                                    momentum, unbias, err);
}

int stk_dropout(stk_backend *be, float *x, size_t n, size_t first,
                size_t group, float p, stk_philox_key key, uint64_t stream,
                stk_err *err)
{
    if (!(p >= 0.0f && p < 1.0f) || group < 1)
        return stk_fail(err, STK_EINVAL,
                        "dropout: p must be in [0, 1), not %g", (double)p);
    if (first % group)
        return stk_fail(err, STK_EINVAL,
                        "dropout: element %zu does not start a group of %zu",
                        first, group);
    if (p == 0.0f || n == 0)
        return 0;
    return be->ops->dropout(be, x, n, first, group, p, key, stream, err);
}

static int check_xent(int n, int c, float smoothing, stk_err *err)
{
    if (n < 1 || c < 1)
        return stk_fail(err, STK_EINVAL, "cross-entropy: %d rows of %d", n, c);
    if (!(smoothing >= 0.0f && smoothing <= 1.0f))
        return stk_fail(err, STK_EINVAL,
                        "cross-entropy: label smoothing %g is not in [0, 1]",
                        (double)smoothing);
    return 0;
}

int stk_xent(stk_backend *be, const float *logits, const int32_t *labels,
             int n, int c, float smoothing, float *loss, float *dlogits,
             stk_err *err)
{
    int rc = check_xent(n, c, smoothing, err);
    return rc ? rc
              : be->ops->xent(be, logits, labels, n, c, smoothing, loss,
                              dlogits, err);
}

int stk_xent_metrics(stk_backend *be, const float *logits,
                     const int32_t *labels, int n, int c, float smoothing,
                     float *dlogits, stk_metrics *m, stk_err *err)
{
    int rc = check_xent(n, c, smoothing, err);
    return rc ? rc
              : be->ops->xent_metrics(be, logits, labels, n, c, smoothing,
                                      dlogits, m, err);
}

int stk_count_hits(stk_backend *be, const float *logits, const int32_t *labels,
                   int n, int c, stk_metrics *m, stk_err *err)
{
    if (n < 1 || c < 1)
        return stk_fail(err, STK_EINVAL, "count_hits: %d rows of %d", n, c);
    return be->ops->count_hits(be, logits, labels, n, c, m, err);
}

int stk_metrics_step(stk_backend *be, stk_metrics *m, int n, uint64_t step,
                     uint64_t epoch, stk_err *err)
{
    if (n < 1)
        return stk_fail(err, STK_EINVAL, "metrics_step: a step of %d samples", n);
    return be->ops->metrics_step(be, m, n, step, epoch, err);
}

int stk_grad_norm(stk_backend *be, float *g, size_t n, float clip,
                  uint64_t step, uint64_t epoch, stk_metrics *m, stk_err *err)
{
    return be->ops->grad_norm(be, g, n, clip, step, epoch, m, err);
}

int stk_transform_batch(stk_backend *be, const uint8_t *x,
                        const uint64_t *sample_ids, int n,
                        const stk_transform *t, float *y, stk_err *err)
{
    if (t->c < 1 || t->c > 4 || t->pad < 0 || t->pad > t->h || t->pad > t->w)
        return stk_fail(err, STK_EINVAL,
                        "transform: %d channels, padding %d", t->c, t->pad);
    return be->ops->transform(be, x, sample_ids, n, t, y, err);
}

int stk_axpy(stk_backend *be, size_t n, float alpha, const float *x, float *y,
             stk_err *err)
{
    return be->ops->axpy(be, n, alpha, x, y, err);
}

int stk_scale(stk_backend *be, size_t n, float alpha, float *x, stk_err *err)
{
    return be->ops->scale(be, n, alpha, x, err);
}

int stk_sumsq(stk_backend *be, const float *x, size_t n, double *out,
              stk_err *err)
{
    return be->ops->sumsq(be, x, n, out, err);
}

int stk_sgd_step(stk_backend *be, float *w, const float *g, float *buf,
                 size_t n, const stk_sgd_cfg *cfg, stk_err *err)
{
    return be->ops->sgd(be, w, g, buf, n, cfg, err);
}

int stk_adamw_step(stk_backend *be, float *w, const float *g, float *m,
                   float *v, size_t n, const stk_adamw_cfg *cfg, stk_err *err)
{
    return be->ops->adamw(be, w, g, m, v, n, cfg, err);
}
