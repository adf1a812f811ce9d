/* cpu.c - the CPU backend: OpenBLAS SGEMM and C loops over the shared
 * element-wise bodies of ops_inline.h. This is the reference the CUDA
 * backend is tested against. */
#include "backend_impl.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

static void cpu_destroy(stk_backend *be) { (void)be; }

static void *cpu_alloc(stk_backend *be, size_t bytes, stk_err *err)
{
    (void)be;
    void *p = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (!p)
        stk_fail(err, STK_ENOMEM, "cpu: cannot allocate %zu bytes", bytes);
    return p;
}

static void cpu_free(stk_backend *be, void *p)
{
    (void)be;
    free(p);
}

static void *cpu_host_alloc(stk_backend *be, size_t bytes)
{
    return cpu_alloc(be, bytes, NULL);
}

static int cpu_copy(stk_backend *be, void *dst, const void *src, size_t n,
                    int to_dev, stk_err *err)
{
    (void)be;
    (void)to_dev;
    (void)err;
    if (n)
        memmove(dst, src, n);
    return 0;
}

static int cpu_memzero(stk_backend *be, void *p, size_t n, stk_err *err)
{
    (void)be;
    (void)err;
    memset(p, 0, n);
    return 0;
}

static int cpu_sync(stk_backend *be, stk_err *err)
{
    (void)be;
    (void)err;
    return 0;
}

static int cpu_gemm(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                    float alpha, const float *a, int lda, const float *b,
                    int ldb, float beta, float *c, int ldc, stk_err *err)
{
    (void)be;
    (void)err;
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans,
                tb ? CblasTrans : CblasNoTrans, m, n, k, alpha, a, lda, b, ldb,
                beta, c, ldc);
    return 0;
}

static int cpu_relu_fwd(stk_backend *be, const float *x, float *y, size_t n,
                        stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        y[i] = stk_relu1(x[i]);
    return 0;
}

static int cpu_relu_bwd(stk_backend *be, const float *y, const float *dy,
                        float *dx, size_t n, stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        dx[i] = stk_relu_grad1(y[i], dy[i]);
    return 0;
}

static int cpu_bias_add(stk_backend *be, float *y, const float *b, int rows,
                        int cols, int inner, stk_err *err)
{
    (void)be;
    (void)err;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            float *p = y + ((size_t)r * cols + c) * inner;
            for (int i = 0; i < inner; i++)
                p[i] += b[c];
        }
    return 0;
}

static int cpu_bias_grad(stk_backend *be, const float *dy, float *db, int rows,
                         int cols, int inner, stk_err *err)
{
    (void)be;
    (void)err;
    for (int c = 0; c < cols; c++) {
        double s = 0.0;
        for (int r = 0; r < rows; r++) {
            const float *p = dy + ((size_t)r * cols + c) * inner;
            for (int i = 0; i < inner; i++)
                s += p[i];
        }
        db[c] += (float)s;
    }
    return 0;
}

/* Loops in column order with the shared body of each element; no index
 * divisions per element. */
static int cpu_im2col(stk_backend *be, const float *x, const stk_conv_shape *s,
                      int n, float *col, stk_err *err)
{
    (void)be;
    (void)err;
    for (int c = 0; c < s->c; c++)
        for (int ky = 0; ky < s->kh; ky++)
            for (int kx = 0; kx < s->kw; kx++)
                for (int smp = 0; smp < n; smp++)
                    for (int oy = 0; oy < s->oh; oy++)
                        for (int ox = 0; ox < s->ow; ox++)
                            *col++ = stk_im2col_at(x, s, (size_t)smp, c, ky, kx,
                                                   oy, ox);
    return 0;
}

/* The transpose of im2col as a scatter, row by row: each pixel receives
 * its terms in the same (ky, kx) order as stk_col2im1's gather. */
static int cpu_col2im(stk_backend *be, const float *col,
                      const stk_conv_shape *s, int n, float *dx, stk_err *err)
{
    (void)be;
    (void)err;
    memset(dx, 0, (size_t)n * s->c * s->h * s->w * sizeof *dx);
    for (int c = 0; c < s->c; c++)
        for (int ky = 0; ky < s->kh; ky++)
            for (int kx = 0; kx < s->kw; kx++)
                for (int smp = 0; smp < n; smp++) {
                    float *img = dx + ((size_t)smp * s->c + c) * s->h * s->w;
                    for (int oy = 0; oy < s->oh; oy++) {
                        int y = oy * s->sh - s->ph + ky;
                        for (int ox = 0; ox < s->ow; ox++, col++) {
                            int xx = ox * s->sw - s->pw + kx;
                            if (y >= 0 && y < s->h && xx >= 0 && xx < s->w)
                                img[y * s->w + xx] += *col;
                        }
                    }
                }
    return 0;
}

static int cpu_swap01(stk_backend *be, const float *src, float *dst, size_t a,
                      size_t b, size_t inner, stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t bi = 0; bi < b; bi++)
        for (size_t ai = 0; ai < a; ai++)
            memcpy(dst + (bi * a + ai) * inner, src + (ai * b + bi) * inner,
                   inner * sizeof *dst);
    return 0;
}

static int cpu_maxpool_fwd(stk_backend *be, const float *x, int planes, int h,
                           int w, int k, int st, float *y, int32_t *arg,
                           stk_err *err)
{
    (void)be;
    (void)err;
    int oh = (h - k) / st + 1, ow = (w - k) / st + 1;
    for (int p = 0; p < planes; p++, x += (size_t)h * w)
        for (int oy = 0; oy < oh; oy++)
            for (int ox = 0; ox < ow; ox++)
                *y++ = stk_maxpool_at(x, h, w, k, st, oy, ox, arg++);
    return 0;
}

static int cpu_maxpool_bwd(stk_backend *be, const float *dy,
                           const int32_t *arg, int planes, int h, int w,
                           int oh, int ow, float *dx, stk_err *err)
{
    (void)be;
    (void)err;
    memset(dx, 0, (size_t)planes * h * w * sizeof *dx);
    for (int p = 0; p < planes; p++)
        for (int j = 0; j < oh * ow; j++) {
            size_t o = (size_t)p * oh * ow + j;
            dx[(size_t)p * h * w + arg[o]] += dy[o];
        }
    return 0;
}

/* One draw per group (dropout2d) or per element, four elements per Philox
 * block, the same numbers stk_dropout_scale1 draws. */
static int cpu_dropout(stk_backend *be, float *x, size_t n, size_t group,
                       float p, stk_philox_key key, uint64_t stream,
                       stk_err *err)
{
    (void)be;
    (void)err;
    uint32_t r[4];
    size_t groups = (n + group - 1) / group;
    for (size_t g = 0; g < groups; g++) {
        if (g % 4 == 0)
            stk_philox_block(key, stream, g / 4, r);
        float scale = stk_dropout_keep(stk_u01(r[g % 4]), p);
        size_t end = (g + 1) * group < n ? (g + 1) * group : n;
        for (size_t i = g * group; i < end; i++)
            x[i] *= scale;
    }
    return 0;
}

static int cpu_xent(stk_backend *be, const float *logits,
                    const int32_t *labels, int n, int c, float *loss,
                    float *dlogits, stk_err *err)
{
    (void)be;
    for (int r = 0; r < n; r++)
        if (labels[r] < 0 || labels[r] >= c)
            return stk_fail(err, STK_ERANGE,
                            "cross-entropy: label %d of row %d is not in "
                            "0..%d",
                            labels[r], r, c - 1);
    double sum = 0.0;
    for (int r = 0; r < n; r++)
        sum += stk_xent_row(logits, labels, n, c, r, dlogits);
    *loss = (float)(sum / n);
    return 0;
}

/* One draw per sample, then its pixels in order: the same floats as
 * stk_transform1 per element (the CUDA kernel), without per-pixel index
 * arithmetic or Philox calls. */
static int cpu_transform(stk_backend *be, const uint8_t *x,
                         const uint64_t *ids, int n, const stk_transform *t,
                         float *y, stk_err *err)
{
    (void)be;
    (void)err;
    size_t per = (size_t)t->c * t->h * t->w;
    for (int s = 0; s < n; s++) {
        int dy, dx, mirror;
        stk_transform_draw(t, ids[s], &dy, &dx, &mirror);
        const uint8_t *img = x + (size_t)s * per;
        for (int c = 0; c < t->c; c++)
            for (int r = 0; r < t->h; r++)
                for (int q = 0; q < t->w; q++)
                    *y++ = stk_transform_px(img, t, c, r, q, dy, dx, mirror);
    }
    return 0;
}

static int cpu_axpy(stk_backend *be, size_t n, float alpha, const float *x,
                    float *y, stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        y[i] += alpha * x[i];
    return 0;
}

static int cpu_scale(stk_backend *be, size_t n, float alpha, float *x,
                     stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        x[i] *= alpha;
    return 0;
}

static int cpu_sumsq(stk_backend *be, const float *x, size_t n, double *out,
                     stk_err *err)
{
    (void)be;
    (void)err;
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        s += (double)x[i] * x[i];
    *out = s;
    return 0;
}

static int cpu_sgd(stk_backend *be, float *w, const float *g, float *buf,
                   size_t n, const stk_sgd_cfg *cfg, stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        stk_sgd1(w, g, buf, i, cfg);
    return 0;
}

static int cpu_adamw(stk_backend *be, float *w, const float *g, float *m,
                     float *v, size_t n, const stk_adamw_cfg *cfg,
                     stk_err *err)
{
    (void)be;
    (void)err;
    for (size_t i = 0; i < n; i++)
        stk_adamw1(w, g, m, v, i, cfg);
    return 0;
}

const backend_ops stk_cpu_ops = {
    cpu_destroy,  cpu_alloc,       cpu_free,        cpu_host_alloc,
    cpu_free,     cpu_copy,        cpu_memzero,     cpu_sync,
    cpu_gemm,     cpu_relu_fwd,    cpu_relu_bwd,    cpu_bias_add,
    cpu_bias_grad, cpu_im2col,     cpu_col2im,      cpu_swap01,
    cpu_maxpool_fwd,
    cpu_maxpool_bwd, cpu_dropout,  cpu_xent,        cpu_transform,
    cpu_axpy,     cpu_scale,       cpu_sumsq,       cpu_sgd,
    cpu_adamw,
};
