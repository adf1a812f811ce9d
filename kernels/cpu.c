/* cpu.c - the CPU backend: OpenBLAS SGEMM and C loops over the shared
 * element-wise bodies of ops_inline.h. This is the reference the CUDA
 * backend is tested against.
 *
 * Every op runs on the backend's thread pool (pool.c). OpenBLAS itself is
 * kept to one thread: its idle workers spin on the cores the pool needs,
 * and much of a step is not GEMM. A GEMM is cut instead into panels of
 * fixed width along the longer side of C (and a small C's K into chunks).
 * Every loop splits work whose results do not depend on the split
 * (panels, elements, planes, channels, fixed-size chunks), so results are
 * the same for any thread count. */
#include "backend_impl.h"
#include "cpu_gemm.h"

#include <cblas.h>
#include <stdlib.h>
#include <string.h>

/* OpenBLAS's own thread count control (not part of CBLAS proper). */
void openblas_set_num_threads(int n);

enum {
    GRAIN = 1 << 14,      /* elements per thread at least, simple loops */
    GEMM_PANELS = 4,      /* a GEMM in about this many OpenBLAS calls, */
    GEMM_PANEL_MIN = 64,  /* each this wide at least (rows or columns) */
    GEMM_PANEL_MAX = 256, /* and at most */
    GEMM_SMALL_C = 4096,  /* a C this small (elements) ... */
    GEMM_K_CHUNK = 1024,  /* ... is summed over K in chunks this long */
    SUMSQ_CHUNK = 1 << 15, /* fixed chunks: the sum's order ignores threads */
    BIAS_LANES = 16        /* partial sums per channel in bias_grad */
};

/* The loops of each op's part function twice, for AVX2 (8 floats a
 * vector) and for baseline x86-64 (SSE2, 4), the copy chosen once at load
 * time (an ifunc). AVX2 without FMA, and no contraction anyway: the same
 * operations in the same order, so the same bits as the baseline copy and
 * as CUDA. flatten inlines the helpers into each copy, which compiles them
 * for its target too. */
#if defined(__SANITIZE_THREAD__)
#define STK_NO_CLONES /* GCC's TSan: the ifunc resolvers run before its runtime */
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STK_NO_CLONES /* and clang's */
#endif
#endif
#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute) &&  \
    !defined(STK_NO_CLONES)
#if __has_attribute(target_clones) && __has_attribute(flatten)
#define CPU_HOT __attribute__((target_clones("avx2", "default"), flatten))
#define CPU_HOT3                                                               \
    __attribute__((target_clones("avx512f", "avx2", "default"), flatten))
#endif
#endif
#ifndef CPU_HOT
#define CPU_HOT
#define CPU_HOT3
#endif

/* Hand-vectorised AVX-512 copies of the Winograd transforms, chosen at run
 * time where the CPU has AVX-512F: each computes the same expressions
 * (STK_WINO_MAP) in the same order as the portable loops, 16 tiles to a
 * vector, so the same bits. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define CPU_AVX512 1
#define AVX512 __attribute__((target("avx512f")))
#define AVX512_INLINE                                                          \
    static inline __attribute__((always_inline, target("avx512f")))
static bool cpu_avx512(void) { return __builtin_cpu_supports("avx512f"); }
#else
static bool cpu_avx512(void) { return false; }
#endif

/* The CPU backend's state: its thread pool, and whether its GEMMs and
 * Winograd transforms take the 16-lane paths (the CPU has AVX-512F and
 * STK_CPU_NO_AVX512 was not set when the backend was made: the tests run
 * both paths on one machine). */
typedef struct cpu_state {
    stk_pool *pool;
    bool wide;
    double *bn_part; /* batchnorm sums' chunks (bn_chunks), bn_len */
    size_t bn_len;
    /* stk_cpu_ranges: a view per thread (no pool of its own: its ops run
     * on the thread calling them), each range's return code and error */
    struct cpu_views *views;
} cpu_state;

typedef struct cpu_views {
    int n;
    stk_backend *be;
    cpu_state *st;
    int *rc;
    stk_err *err;
} cpu_views;

static stk_pool *pool(stk_backend *be)
{
    return ((cpu_state *)be->impl)->pool;
}
static bool wide(const stk_backend *be)
{
    return ((const cpu_state *)be->impl)->wide;
}

int stk_cpu_threads(const stk_backend *be)
{
    return stk_pool_threads(((const cpu_state *)be->impl)->pool);
}

static void views_free(cpu_views *v)
{
    for (int r = 0; v && v->st && r < v->n; r++)
        free(v->st[r].bn_part);
    if (v) {
        free(v->be);
        free(v->st);
        free(v->rc);
        free(v->err);
    }
    free(v);
}

static void cpu_destroy(stk_backend *be)
{
    cpu_state *st = be->impl;
    if (st) {
        stk_pool_destroy(st->pool);
        views_free(st->views);
        free(st->bn_part);
    }
    free(st);
    be->impl = NULL;
}

/* One view of be per thread: the same ops and vector width, no pool. */
static cpu_views *views_make(const stk_backend *be, int n)
{
    cpu_views *v = calloc(1, sizeof *v);
    if (!v || !(v->be = calloc((size_t)n, sizeof *v->be)) ||
        !(v->st = calloc((size_t)n, sizeof *v->st)) ||
        !(v->rc = calloc((size_t)n, sizeof *v->rc)) ||
        !(v->err = calloc((size_t)n, sizeof *v->err))) {
        views_free(v);
        return NULL;
    }
    v->n = n;
    for (int r = 0; r < n; r++) {
        v->st[r].wide = wide(be);
        v->be[r] = *be;
        v->be[r].impl = &v->st[r];
    }
    return v;
}

typedef struct ranges_job {
    stk_range_fn fn;
    void *arg;
    cpu_views *v;
} ranges_job;

static void ranges_part(void *p, size_t b, size_t e)
{
    const ranges_job *j = p;
    for (size_t r = b; r < e; r++)
        j->v->rc[r] = j->fn(j->arg, (int)r, &j->v->be[r], &j->v->err[r]);
}

int stk_cpu_ranges(stk_backend *be, int n, stk_range_fn fn, void *arg,
                   stk_err *err)
{
    cpu_state *st = be->impl; /* views: one per thread, made with it */
    ranges_job j = {fn, arg, st->views};
    stk_pool_for(st->pool, (size_t)n, 1, ranges_part, &j);
    for (int r = 0; r < n; r++)
        if (j.v->rc[r]) {
            *err = j.v->err[r];
            return j.v->rc[r];
        }
    return 0;
}

int stk_cpu_backend_init(stk_backend *be, int threads, stk_err *err)
{
    be->ops = &stk_cpu_ops;
    openblas_set_num_threads(1);
    cpu_state *st = calloc(1, sizeof *st);
    if (!st)
        return stk_fail(err, STK_ENOMEM, "cpu: cannot allocate the backend");
    st->wide = cpu_avx512() && !getenv("STK_CPU_NO_AVX512");
    st->pool = stk_pool_create(threads > 0 ? threads : stk_usable_cpus(), err);
    if (!st->pool) {
        free(st);
        return STK_ENOMEM;
    }
    be->impl = st;
    int n = stk_pool_threads(st->pool);
    if (n > 1 && !(st->views = views_make(be, n))) {
        cpu_destroy(be);
        return stk_fail(err, STK_ENOMEM, "cpu: cannot allocate the backend");
    }
    return 0;
}

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

typedef struct bytes_job {
    char *dst;
    const char *src; /* NULL: zero dst */
} bytes_job;

static void bytes_part(void *v, size_t b, size_t e)
{
    const bytes_job *j = v;
    if (j->src)
        memcpy(j->dst + b, j->src + b, e - b);
    else
        memset(j->dst + b, 0, e - b);
}

/* Large copies (a batch, the gradients) take all threads; overlapping
 * ones, which the API allows, stay a single memmove. */
static int cpu_copy(stk_backend *be, void *dst, const void *src, size_t n,
                    int to_dev, stk_err *err)
{
    (void)to_dev;
    (void)err;
    const char *d = dst, *s = src;
    if (d + n <= s || s + n <= d) {
        bytes_job j = {dst, src};
        stk_pool_for(pool(be), n, GRAIN * sizeof(float), bytes_part, &j);
    } else if (n) {
        memmove(dst, src, n);
    }
    return 0;
}

static int cpu_memzero(stk_backend *be, void *p, size_t n, stk_err *err)
{
    (void)err;
    bytes_job j = {p, NULL};
    stk_pool_for(pool(be), n, GRAIN * sizeof(float), bytes_part, &j);
    return 0;
}

static int cpu_sync(stk_backend *be, stk_err *err)
{
    (void)be;
    (void)err;
    return 0;
}

/* ---- events: every op is done when it returns ------------------------------ */

/* An event has nothing to mark on the CPU; the handle only has to be a
 * distinct pointer its owner can free. */
static int cpu_event_create(stk_backend *be, stk_event **out, stk_err *err)
{
    (void)be;
    *out = malloc(1);
    return *out ? 0 : stk_fail(err, STK_ENOMEM, "cpu: out of memory for an event");
}

static void cpu_event_destroy(stk_backend *be, stk_event *ev)
{
    (void)be;
    free(ev);
}

static int cpu_event_record(stk_backend *be, stk_event *ev, stk_stream_id s,
                            stk_err *err)
{
    (void)be, (void)ev, (void)s, (void)err;
    return 0;
}

static int cpu_stream_wait(stk_backend *be, stk_stream_id s, stk_event *ev,
                           stk_err *err)
{
    (void)be, (void)ev, (void)s, (void)err;
    return 0;
}

static int cpu_event_query(stk_backend *be, stk_event *ev, bool *done,
                           stk_err *err)
{
    (void)be, (void)ev, (void)err;
    *done = true;
    return 0;
}

static int cpu_event_wait(stk_backend *be, stk_event *ev, stk_err *err)
{
    (void)be, (void)ev, (void)err;
    return 0;
}

static int cpu_upload(stk_backend *be, void *dst, const void *src, size_t n,
                      stk_err *err)
{
    return cpu_copy(be, dst, src, n, 1, err);
}

/* ---- GEMM ------------------------------------------------------------------ */

typedef struct gemm_job {
    bool ta, tb, split_n, whole, small; /* small: stk_small_gemm's shape */
    int lanes;                          /* its vector width (cpu_state) */
    int m, n, k, lda, ldb, ldc, panel;
    float alpha, beta;
    const float *a, *b;
    float *c;
} gemm_job;

/* Columns (split_n) or rows [from, to) of C. */
static void gemm_panel(const gemm_job *g, int from, int to)
{
    const float *a = g->a, *b = g->b;
    float *c = g->c;
    int m = g->m, n = g->n;
    if (g->split_n) {
        b += g->tb ? (size_t)from * g->ldb : (size_t)from;
        c += from;
        n = to - from;
    } else {
        a += g->ta ? (size_t)from : (size_t)from * g->lda;
        c += (size_t)from * g->ldc;
        m = to - from;
    }
    if (g->small) {
        stk_small_gemm_at(g->lanes, g->ta, g->tb, m, n, g->k, g->alpha, a,
                          g->lda, b, g->ldb, g->beta, c, g->ldc);
        return;
    }
    /* A small C over a long K (a convolution's weight gradient on large
     * images: K runs over a sample's output pixels) goes down OpenBLAS's
     * packing path: 32 x 9 x 6084 took 2.7x as long as in chunks of K on
     * its direct path (AVX-512 kernels). The chunks depend on the shape
     * alone, like the panels. */
    int kc = (size_t)m * n <= GEMM_SMALL_C ? GEMM_K_CHUNK : g->k;
    float beta = g->beta;
    int k0 = 0;
    do { /* once at least: with K = 0, C = beta C */
        int k = g->k - k0 < kc ? g->k - k0 : kc;
        cblas_sgemm(CblasRowMajor, g->ta ? CblasTrans : CblasNoTrans,
                    g->tb ? CblasTrans : CblasNoTrans, m, n, k, g->alpha,
                    a + (g->ta ? (size_t)k0 * g->lda : (size_t)k0), g->lda,
                    b + (g->tb ? (size_t)k0 : (size_t)k0 * g->ldb), g->ldb,
                    beta, c, g->ldc);
        k0 += k;
        beta = 1.0f;
    } while (k0 < g->k);
}

/* Panel p of g (all of C when g is whole), one OpenBLAS call (or its
 * chunks of K): OpenBLAS's rounding depends on the shape of the call, so
 * the panels depend on the shape alone, never on the thread count. */
static void gemm_panel_at(const gemm_job *g, size_t p)
{
    int len = g->split_n ? g->n : g->m;
    if (g->whole) {
        gemm_panel(g, 0, len);
        return;
    }
    int from = (int)p * g->panel;
    gemm_panel(g, from, len - from < g->panel ? len : from + g->panel);
}

static void gemm_part(void *v, size_t lo, size_t hi)
{
    for (size_t p = lo; p < hi; p++)
        gemm_panel_at(v, p);
}

/* The job of one GEMM and its number of panels: about GEMM_PANELS along
 * the longer side of C, a multiple of 16 wide (48 on the small-GEMM path:
 * whole tiles of its 24 columns); whole under about a megaflop, where a
 * split costs more than it saves. */
static gemm_job gemm_plan(stk_backend *be, bool ta, bool tb, int m, int n,
                          int k, float alpha, const float *a, int lda,
                          const float *b, int ldb, float beta, float *c,
                          int ldc, size_t *panels)
{
    gemm_job g = {.ta = ta, .tb = tb, .split_n = n >= m,
                  .whole = 2.0 * m * n * k < 1e6,
                  .small = stk_small_gemm_wins(ta, tb, m, n, k),
                  .lanes = wide(be) ? 16 : 8,
                  .m = m, .n = n, .k = k, .lda = lda, .ldb = ldb, .ldc = ldc,
                  .alpha = alpha, .beta = beta, .a = a, .b = b, .c = c};
    int len = g.split_n ? n : m, unit = g.small ? 48 : 16;
    int want = (len + GEMM_PANELS - 1) / GEMM_PANELS;
    want = want < GEMM_PANEL_MIN   ? GEMM_PANEL_MIN
           : want > GEMM_PANEL_MAX ? GEMM_PANEL_MAX
                                   : want;
    g.panel = (want + unit - 1) / unit * unit;
    *panels = g.whole ? 1 : (size_t)(len + g.panel - 1) / (size_t)g.panel;
    return g;
}

static int cpu_gemm(stk_backend *be, bool ta, bool tb, int m, int n, int k,
                    float alpha, const float *a, int lda, const float *b,
                    int ldb, float beta, float *c, int ldc, stk_err *err)
{
    (void)err;
    size_t panels;
    gemm_job g = gemm_plan(be, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta,
                           c, ldc, &panels);
    stk_pool_for(pool(be), panels, 1, gemm_part, &g);
    return 0;
}

typedef struct batch_job {
    gemm_job g;
    size_t sa, sb, sc, panels;
} batch_job;

/* Tasks [lo, hi) of the batch: GEMM t / panels, its panel t % panels. */
static void batch_part(void *v, size_t lo, size_t hi)
{
    const batch_job *j = v;
    for (size_t t = lo; t < hi; t++) {
        size_t i = t / j->panels;
        gemm_job g = j->g;
        g.a += i * j->sa;
        g.b += i * j->sb;
        g.c += i * j->sc;
        gemm_panel_at(&g, t % j->panels);
    }
}

/* A batch of GEMM_PANELS GEMMs or more gives the threads enough tasks with
 * one OpenBLAS call per GEMM; a smaller batch (im2col's few samples of a
 * piece) cuts each GEMM into panels like a single one. */
static int cpu_gemm_batched(stk_backend *be, bool ta, bool tb, int m, int n,
                            int k, float alpha, const float *a, int lda,
                            size_t sa, const float *b, int ldb, size_t sb,
                            float beta, float *c, int ldc, size_t sc,
                            int count, stk_err *err)
{
    (void)err;
    size_t panels;
    gemm_job g = gemm_plan(be, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta,
                           c, ldc, &panels);
    if (count >= GEMM_PANELS) {
        g.whole = true;
        panels = 1;
    }
    batch_job j = {g, sa, sb, sc, panels};
    stk_pool_for(pool(be), (size_t)count * panels, 1, batch_part, &j);
    return 0;
}

/* ---- element-wise ------------------------------------------------------------ */

typedef struct ew_job {
    const float *x, *y;
    float *out;
    float alpha;
} ew_job;

CPU_HOT static void relu_fwd_part(void *v, size_t b, size_t e)
{
    const ew_job *j = v;
    for (size_t i = b; i < e; i++)
        j->out[i] = stk_relu1(j->x[i]);
}

static int cpu_relu_fwd(stk_backend *be, const float *x, float *y, size_t n,
                        stk_err *err)
{
    (void)err;
    ew_job j = {.x = x, .out = y};
    stk_pool_for(pool(be), n, GRAIN, relu_fwd_part, &j);
    return 0;
}

CPU_HOT3 static void relu_bwd_part(void *v, size_t b, size_t e)
{
    const ew_job *j = v;
    for (size_t i = b; i < e; i++)
        j->out[i] = stk_relu_grad1(j->y[i], j->x[i]);
}

static int cpu_relu_bwd(stk_backend *be, const float *y, const float *dy,
                        float *dx, size_t n, stk_err *err)
{
    (void)err;
    ew_job j = {.x = dy, .y = y, .out = dx};
    stk_pool_for(pool(be), n, GRAIN, relu_bwd_part, &j);
    return 0;
}

CPU_HOT static void axpy_part(void *v, size_t b, size_t e)
{
    const ew_job *j = v;
    for (size_t i = b; i < e; i++)
        j->out[i] += j->alpha * j->x[i];
}

static int cpu_axpy(stk_backend *be, size_t n, float alpha, const float *x,
                    float *y, stk_err *err)
{
    (void)err;
    ew_job j = {.x = x, .out = y, .alpha = alpha};
    stk_pool_for(pool(be), n, GRAIN, axpy_part, &j);
    return 0;
}

CPU_HOT static void scale_part(void *v, size_t b, size_t e)
{
    const ew_job *j = v;
    for (size_t i = b; i < e; i++)
        j->out[i] *= j->alpha;
}

static int cpu_scale(stk_backend *be, size_t n, float alpha, float *x,
                     stk_err *err)
{
    (void)err;
    ew_job j = {.out = x, .alpha = alpha};
    stk_pool_for(pool(be), n, GRAIN, scale_part, &j);
    return 0;
}

/* ---- bias ------------------------------------------------------------------------ */

typedef struct bias_job {
    const float *src; /* dy (grad) or b (add) */
    float *dst;       /* db (grad) or y (add) */
    int rows, cols, inner;
} bias_job;

/* (row, channel) planes [b, e) of y [rows, cols, inner]; with inner 1
 * (a linear layer) rows [b, e), added along the row. */
CPU_HOT static void bias_add_part(void *v, size_t b, size_t e)
{
    const bias_job *j = v;
    if (j->inner == 1) {
        for (size_t r = b; r < e; r++) {
            float *p = j->dst + r * (size_t)j->cols;
            for (int c = 0; c < j->cols; c++)
                p[c] += j->src[c];
        }
        return;
    }
    for (size_t rc = b; rc < e; rc++) {
        float *p = j->dst + rc * (size_t)j->inner, bias = j->src[rc % j->cols];
        for (int i = 0; i < j->inner; i++)
            p[i] += bias;
    }
}

static int cpu_bias_add(stk_backend *be, float *y, const float *b, int rows,
                        int cols, int inner, stk_err *err)
{
    (void)err;
    if (rows <= 0 || cols <= 0 || inner <= 0)
        return 0; /* nothing to add (as on CUDA) */
    bias_job j = {b, y, rows, cols, inner};
    size_t units = (size_t)rows * (inner == 1 ? 1 : (size_t)cols);
    size_t per = inner == 1 ? (size_t)cols : (size_t)inner;
    stk_pool_for(pool(be), units, (GRAIN + per - 1) / per, bias_add_part, &j);
    return 0;
}

/* Channels [b, e): each summed in double by one thread, rows in order and
 * within a row in 16 lanes (independent chains, which the compiler
 * vectorises; four were bound by the adds' latency), so the sum
 * does not depend on the split. With inner 1 (a linear layer) the rows
 * are walked outside, so that the reads run along memory; each channel
 * still adds its rows in order. */
CPU_HOT static void bias_grad_part(void *v, size_t b, size_t e)
{
    const bias_job *j = v;
    if (j->inner == 1) {
        double acc[256];
        for (size_t c0 = b; c0 < e; c0 += 256) {
            size_t nc = e - c0 < 256 ? e - c0 : 256;
            memset(acc, 0, sizeof acc);
            for (int r = 0; r < j->rows; r++) {
                const float *p = j->src + (size_t)r * j->cols + c0;
                for (size_t c = 0; c < nc; c++)
                    acc[c] += p[c];
            }
            for (size_t c = 0; c < nc; c++)
                j->dst[c0 + c] += (float)acc[c];
        }
        return;
    }
    for (size_t c = b; c < e; c++) {
        double lane[BIAS_LANES] = {0.0};
        for (int r = 0; r < j->rows; r++) {
            const float *p = j->src + ((size_t)r * j->cols + c) * j->inner;
            int i = 0;
            for (; i + BIAS_LANES <= j->inner; i += BIAS_LANES)
                for (int l = 0; l < BIAS_LANES; l++)
                    lane[l] += p[i + l];
            for (; i < j->inner; i++)
                lane[i % BIAS_LANES] += p[i];
        }
        for (int w = BIAS_LANES / 2; w > 0; w /= 2) /* a fixed tree */
            for (int l = 0; l < w; l++)
                lane[l] += lane[l + w];
        j->dst[c] += (float)lane[0];
    }
}

static int cpu_bias_grad(stk_backend *be, const float *dy, float *db, int rows,
                         int cols, int inner, stk_err *err)
{
    (void)err;
    if (rows <= 0 || cols <= 0 || inner <= 0)
        return 0; /* an empty sum adds nothing (as on CUDA) */
    bias_job j = {dy, db, rows, cols, inner};
    size_t per = (size_t)rows * inner;
    stk_pool_for(pool(be), (size_t)cols, (GRAIN + per - 1) / per,
                 bias_grad_part, &j);
    return 0;
}

/* ---- im2col / col2im --------------------------------------------------------------- */

/* The outputs o in [*lo, *hi) of a row of `out` whose input o*st - pad + k
 * falls inside [0, len); the rest read the zero padding. */
static void inside(int out, int len, int st, int pad, int k, int *lo, int *hi)
{
    int first = pad - k; /* o*st >= first */
    *lo = first <= 0 ? 0 : (first + st - 1) / st;
    int last = len - 1 + pad - k; /* o*st <= last */
    *hi = last < 0 ? 0 : last / st + 1;
    if (*hi > out)
        *hi = out;
    if (*lo > *hi)
        *lo = *hi;
}

typedef struct conv_job {
    const float *src;
    float *dst;
    const stk_conv_shape *s;
    int n;
} conv_job;

/* One row of the columns (channel c, tap ky, kx) for all n samples: the
 * values stk_im2col_at defines, with the bounds worked out per row. */
/* n floats, for the short rows of im2col (11 or 26 in the cnn): 8 at a
 * time, the last 8 overlapping the ones before, instead of a call to
 * memcpy or a scalar tail per row. */
static inline void copy_short(float *dst, const float *src, int n)
{
    if (n < 8) {
        for (int i = 0; i < n; i++)
            dst[i] = src[i];
        return;
    }
    int i = 0;
    for (; i + 8 <= n; i += 8)
        memcpy(dst + i, src + i, 8 * sizeof *dst);
    if (i < n)
        memcpy(dst + n - 8, src + n - 8, 8 * sizeof *dst);
}

static void im2col_row(const conv_job *j, int c, int ky, int kx, float *col)
{
    const stk_conv_shape *s = j->s;
    int lo, hi;
    inside(s->ow, s->w, s->sw, s->pw, kx, &lo, &hi);
    for (int smp = 0; smp < j->n; smp++) {
        const float *plane = j->src + ((size_t)smp * s->c + c) * s->h * s->w;
        for (int oy = 0; oy < s->oh; oy++, col += s->ow) {
            int y = oy * s->sh - s->ph + ky;
            if (y < 0 || y >= s->h) {
                memset(col, 0, (size_t)s->ow * sizeof *col);
                continue;
            }
            const float *in = plane + (size_t)y * s->w - s->pw + kx;
            for (int ox = 0; ox < lo; ox++)
                col[ox] = 0.0f;
            if (s->sw == 1)
                copy_short(col + lo, in + lo, hi - lo);
            else if (s->sw == 2) /* a constant stride vectorises */
                for (int ox = lo; ox < hi; ox++)
                    col[ox] = in[2 * ox];
            else
                for (int ox = lo; ox < hi; ox++)
                    col[ox] = in[ox * s->sw];
            for (int ox = hi; ox < s->ow; ox++)
                col[ox] = 0.0f;
        }
    }
}

CPU_HOT3 static void im2col_part(void *v, size_t b, size_t e)
{
    const conv_job *j = v;
    const stk_conv_shape *s = j->s;
    size_t per_row = (size_t)j->n * s->oh * s->ow;
    for (size_t r = b; r < e; r++)
        im2col_row(j, (int)(r / ((size_t)s->kh * s->kw)),
                   (int)(r / s->kw % s->kh), (int)(r % s->kw),
                   j->dst + r * per_row);
}

#ifdef CPU_AVX512 /* below, with the other 16-lane code */
static bool s2k3_fits(const stk_conv_shape *s);
static void im2col_s2k3_part(void *v, size_t b, size_t e);
static void col2im_s2k3_part(void *v, size_t b, size_t e);
#endif

static int cpu_im2col(stk_backend *be, const float *x, const stk_conv_shape *s,
                      int n, float *col, stk_err *err)
{
    (void)err;
    conv_job j = {x, col, s, n};
#ifdef CPU_AVX512
    if (wide(be) && s2k3_fits(s)) {
        stk_pool_for(pool(be), (size_t)s->c, 1, im2col_s2k3_part, &j);
        return 0;
    }
#endif
    stk_pool_for(pool(be), (size_t)s->c * s->kh * s->kw, 1, im2col_part, &j);
    return 0;
}

/* Channels [b, e) of dx: the transpose of im2col as a scatter, row by row,
 * so each pixel receives its terms in the same (ky, kx) order as
 * stk_col2im1's gather and the two give the same floats. */
CPU_HOT3 static void col2im_part(void *v, size_t b, size_t e)
{
    const conv_job *j = v;
    const stk_conv_shape *s = j->s;
    size_t plane = (size_t)s->h * s->w, hw = (size_t)s->oh * s->ow;
    for (size_t c = b; c < e; c++) {
        for (int smp = 0; smp < j->n; smp++)
            memset(j->dst + ((size_t)smp * s->c + c) * plane, 0,
                   plane * sizeof(float));
        for (int ky = 0; ky < s->kh; ky++)
            for (int kx = 0; kx < s->kw; kx++) {
                int lo, hi;
                inside(s->ow, s->w, s->sw, s->pw, kx, &lo, &hi);
                const float *col =
                    j->src + ((c * s->kh + ky) * s->kw + kx) * hw * j->n;
                for (int smp = 0; smp < j->n; smp++) {
                    float *img = j->dst + ((size_t)smp * s->c + c) * plane;
                    for (int oy = 0; oy < s->oh; oy++, col += s->ow) {
                        int y = oy * s->sh - s->ph + ky;
                        if (y < 0 || y >= s->h)
                            continue;
                        float *out = img + (size_t)y * s->w - s->pw + kx;
                        if (s->sw == 2) /* as in im2col_row */
                            for (int ox = lo; ox < hi; ox++)
                                out[2 * ox] += col[ox];
                        else
                            for (int ox = lo; ox < hi; ox++)
                                out[ox * s->sw] += col[ox];
                    }
                }
            }
    }
}

static int cpu_col2im(stk_backend *be, const float *col,
                      const stk_conv_shape *s, int n, float *dx, stk_err *err)
{
    (void)err;
    conv_job j = {col, dx, s, n};
#ifdef CPU_AVX512
    if (wide(be) && s2k3_fits(s)) {
        stk_pool_for(pool(be), (size_t)s->c, 1, col2im_s2k3_part, &j);
        return 0;
    }
#endif
    stk_pool_for(pool(be), (size_t)s->c, 1, col2im_part, &j);
    return 0;
}

typedef struct swap_job {
    const float *src;
    float *dst;
    size_t a, b, inner;
} swap_job;

CPU_HOT static void swap01_part(void *v, size_t lo, size_t hi)
{
    const swap_job *j = v;
    for (size_t bi = lo; bi < hi; bi++)
        for (size_t ai = 0; ai < j->a; ai++)
            memcpy(j->dst + (bi * j->a + ai) * j->inner,
                   j->src + (ai * j->b + bi) * j->inner,
                   j->inner * sizeof(float));
}

static int cpu_swap01(stk_backend *be, const float *src, float *dst, size_t a,
                      size_t b, size_t inner, stk_err *err)
{
    (void)err;
    swap_job j = {src, dst, a, b, inner};
    size_t per = a * inner > 0 ? a * inner : 1;
    stk_pool_for(pool(be), b, (GRAIN + per - 1) / per, swap01_part, &j);
    return 0;
}

/* ---- Winograd F(2x2, 3x3) ------------------------------------------------ */

typedef struct wino_job {
    const float *src, *bias;
    float *dst;
    const stk_conv_shape *s; /* NULL for the filter transforms */
    int n, ch, tiles;        /* samples (filters: their input channels);
                                channels of the transformed side */
    bool wide;               /* the 16-lane transforms (cpu_state) */
} wino_job;

enum { LANES = STK_WINO_LANES };

/* Lanes in block b of n filters: LANES but for the last block. The full
 * blocks call the bodies with the constant LANES, which vectorises. */
static int lanes_in(size_t b, size_t n)
{
    return n - b * LANES < LANES ? (int)(n - b * LANES) : LANES;
}

/* Blocks [b, e) of the cout * c filters. */
CPU_HOT static void wino_filter_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
    size_t nf = (size_t)j->ch * j->n, us = stk_wino_stride(nf);
    for (size_t k = b; k < e; k++) {
        const float *w = j->src + k * LANES * 9;
        float *u = j->dst + k * LANES;
        if (lanes_in(k, nf) == LANES)
            stk_wino_filter_n(w, LANES, u, us);
        else
            stk_wino_filter_n(w, lanes_in(k, nf), u, us);
    }
}

CPU_HOT static void wino_filter_grad_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
    size_t nf = (size_t)j->ch * j->n, us = stk_wino_stride(nf);
    for (size_t k = b; k < e; k++) {
        const float *du = j->src + k * LANES;
        float *dw = j->dst + k * LANES * 9;
        if (lanes_in(k, nf) == LANES)
            stk_wino_filter_grad_n(du, us, LANES, dw);
        else
            stk_wino_filter_grad_n(du, us, lanes_in(k, nf), dw);
    }
}

static int wino_filters(stk_backend *be, const float *src, int cout, int c,
                        float *dst, stk_pool_fn part)
{
    wino_job j = {.src = src, .dst = dst, .n = c, .ch = cout};
    size_t nf = (size_t)cout * c;
    stk_pool_for(pool(be), (nf + LANES - 1) / LANES, 16, part, &j);
    return 0;
}

static int cpu_wino_filter(stk_backend *be, const float *w, int cout, int c,
                           float *u, stk_err *err)
{
    (void)err;
    return wino_filters(be, w, cout, c, u, wino_filter_part);
}

static int cpu_wino_filter_grad(stk_backend *be, const float *du, int cout,
                                int c, float *dw, stk_err *err)
{
    (void)err;
    return wino_filters(be, du, cout, c, dw, wino_filter_grad_part);
}

/* The job over the n * ch planes of an image and their tile columns. */
static wino_job wino_columns(stk_backend *be, const float *src,
                             const float *bias, float *dst,
                             const stk_conv_shape *s, int n, int ch)
{
    int th, tw;
    return (wino_job){src, bias, dst, s, n, ch, stk_wino_tiles(s, &th, &tw),
                      wide(be)};
}

/* The CPU's transforms of images (input, output gradient) work a row of
 * up to ROW_TILES tiles at a time: the first (column) pass of the 2-D map
 * runs along whole image rows, which vectorises, then the second pass runs
 * per tile. The expressions are those of stk_wino_input1 and
 * stk_wino_output_grad1 (the same floats as CUDA). */
enum { ROW_TILES = 16, ROW_W = ROW_TILES * STK_WINO_M + STK_WINO_A - STK_WINO_M };

/* The rows above and below an image, as the first pass reads them. */
static const float zero_row[ROW_W];

/* The first pass of a row of tiles: t[k * ROW_W + x] = map (k) of the
 * `in` image values below (y0, x0 + x), 0 outside the image. Rows inside
 * the image are read in place (a copy would be read back through
 * mismatched store-to-load forwarding), rows outside from zero_row, so
 * the padded rows of tiles vectorise as the others; a zero column is the
 * map of zeros, the value the padded tile has there. */
static void wino_first_pass(const float *plane, int h, int w, int y0, int x0,
                            int width, stk_wino_map map, int in, float *t)
{
    float zero[STK_WINO_A] = {0.0f}, z[STK_WINO_A];
    stk_wino_1d(map, zero, 1, z, 1);
    int lo = x0 < 0 ? -x0 : 0, hi = w - x0 < width ? w - x0 : width;
    hi = hi < lo ? lo : hi;
    const float *row[STK_WINO_A]; /* row k from column x0 + lo */
    for (int k = 0; k < in; k++)
        row[k] = y0 + k >= 0 && y0 + k < h
                     ? plane + (size_t)(y0 + k) * w + x0 + lo
                     : zero_row;
    for (int x = lo; x < hi; x++) {
        float v[STK_WINO_A] = {0.0f};
        for (int k = 0; k < in; k++)
            v[k] = row[k][x - lo];
        stk_wino_1d(map, v, 1, t + x, ROW_W);
    }
    for (int k = 0; k < STK_WINO_A; k++) {
        for (int x = 0; x < lo; x++)
            t[k * ROW_W + x] = z[k];
        for (int x = hi; x < width; x++)
            t[k * ROW_W + x] = z[k];
    }
}

/* Tiles (ty, tx0 .. tx0 + nt - 1) of one plane: point p of tile tx0 + t
 * into col[p * cs + t], from `in` rows of the image starting at row y0,
 * column x0, through the 1-D map (in -> STK_WINO_A) on both axes. */
static void wino_row_of_tiles(const float *plane, int h, int w, int y0,
                              int x0, int nt, stk_wino_map map, int in,
                              float *col, size_t cs)
{
    float t[STK_WINO_A * ROW_W];
    wino_first_pass(plane, h, w, y0, x0, (nt - 1) * STK_WINO_M + in, map, in,
                    t);
    for (int k = 0; k < STK_WINO_A; k++) /* along the tiles: vectorises */
        for (int tt = 0; tt < nt; tt++)
            stk_wino_1d(map, t + k * ROW_W + tt * STK_WINO_M, 1,
                        col + k * STK_WINO_A * cs + tt, cs);
}

/* A narrow plane's rows of tiles packed into 16 lanes: `rows` rows of tw
 * tiles side by side (lane r * tw + t), so that a 7 x 7 plane's 16 tiles
 * fill one vector instead of 4 of 16 lanes in each of four, and a 14 x 14
 * plane's rows go two to a vector. A tile's inputs are gathered from its
 * pixel rows by permutes: idx[j] picks column x0 + M t + j of tile t.
 * - Rows of pixels one to a vector from column x0: rows r and r ^ 1 are
 *   a permute's two sources (idx (r & 1) * 16 + M t + j), rows 2 and 3
 *   (the lanes `upper`) a second permute's.
 * - `pairs`, planes of w <= 7 pixels across and 3 or 4 rows of tiles: a
 *   vector holds the rows of tile rows r and r + 1 (columns 0 .. w - 1,
 *   then w .. 2w - 1, lane 15 zero), so one permute of two gathers all
 *   four rows; a column outside the plane reads lane 15. */
typedef struct pack16 {
    int rows, tw;
    bool pairs;
    int32_t idx[STK_WINO_A][16];
    uint16_t upper;
    /* The other way, tiles to pixels (output, input gradient): a vector
     * of row r's pixels from its first tile's column 0 takes column e of
     * tile t at lane M t + e from point column e's vector, lane r tw + t:
     * cols[r] = (lane & 1) * 16 + r tw + lane / 2 over two sources. */
    int32_t cols[4][16];
} pack16;

/* Lane l's source in pk's layout for input column j of its tile. */
static int32_t pack16_source(const pack16 *pk, int l, int j, int w, int x0)
{
    int r = l / pk->tw, x = STK_WINO_M * (l % pk->tw) + j;
    if (r >= pk->rows)
        return 0;
    if (!pk->pairs)
        return (r & 1) * 16 + x;
    x += x0;
    return x < 0 || x >= w ? 15 : (r >> 1) * 16 + (r & 1) * w + x;
}

/* Whether planes of w pixels and tw tiles across, their rows of tiles
 * reading `in` columns from column x0 on, pack (every column a row reads
 * in one vector of 16), and how. */
static bool pack16_plan(int w, int tw, int x0, int in, pack16 *pk)
{
    if ((tw - 1) * STK_WINO_M + in > 16)
        return false;
    pk->tw = tw;
    pk->rows = 16 / tw < 4 ? 16 / tw : 4;
    pk->pairs = pk->rows > 2 && 2 * w < 16;
    pk->upper = 0;
    for (int l = 0; l < 16; l++) {
        for (int j = 0; j < STK_WINO_A; j++)
            pk->idx[j][l] = pack16_source(pk, l, j, w, x0);
        if (l / tw >= 2)
            pk->upper |= (uint16_t)(1u << l);
        for (int r = 0; r < 4; r++)
            pk->cols[r][l] = (l & 1) * 16 + r * tw + l / 2;
    }
    return true;
}

#ifdef CPU_AVX512
/* Lanes m of the 16 floats from column x of a row, the rest 0. Column x
 * may be left of the row (x < 0: those lanes are masked off, never read),
 * hence stk_addr_at. (Expand loads and compress stores, which would need
 * no such address, made the transforms 20-60% slower.) */
AVX512_INLINE __m512 load_at(const float *row, int x, __mmask16 m)
{
    return _mm512_maskz_loadu_ps(m, (const void *)stk_addr_at(row, x));
}

/* Lanes m of v into the row from column x (as load_at). */
AVX512_INLINE void store_at(float *row, int x, __mmask16 m, __m512 v)
{
    _mm512_mask_storeu_ps((void *)stk_addr_at(row, x), m, v);
}

/* Lanes [lo, hi) of 16 (clamped to 0..16) as a mask. */
AVX512_INLINE __mmask16 lanes16(int lo, int hi)
{
    lo = lo < 0 ? 0 : lo > 16 ? 16 : lo;
    hi = hi < lo ? lo : hi > 16 ? 16 : hi;
    return (__mmask16)(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

/* The lanes of a store of a plane's row at pixel `at` of the plane's
 * `size`: past the row's end up to the plane's. The pixels past a row are
 * the next rows', which are stored after it and overwrite them: a masked
 * store that leaves the rest of its line to the next one is slow on Zen 5
 * (the 7 x 7 output transform took twice as long). */
AVX512_INLINE __mmask16 to_plane_end(size_t at, size_t size)
{
    return lanes16(0, size - at < 16 ? (int)(size - at) : 16);
}

/* The lanes m of the 16 floats from element `at` of base, the rest 0.
 * Where all 16 lie in the array (`whole`), a plain load and the mask
 * applied in a register: masked loads of cold data stall on Zen 5 (70% of
 * the stride-2 im2col's time, when GCC had made one of a plain load and
 * its mask, hence the empty asm between them). */
AVX512_INLINE __m512 load_kept(const float *base, ptrdiff_t at, bool whole,
                               __mmask16 m)
{
    if (!whole)
        return _mm512_maskz_loadu_ps(m, (const void *)stk_addr_at(base, at));
    __m512 v = _mm512_loadu_ps(base + at);
    __asm__("" : "+v"(v));
    return _mm512_maskz_mov_ps(m, v);
}

/* 16 floats of row r of an h x w plane from column x, 0 outside it. */
AVX512_INLINE __m512 row16(const float *plane, int h, int w, int r, int x)
{
    __mmask16 m = lanes16(-x, w - x);
    if (r < 0 || r >= h || !m)
        return _mm512_setzero_ps();
    /* (load_kept here made the 28x28 input transform 1.5x slower) */
    return load_at(plane + (size_t)r * w, x, m);
}

/* Even and odd elements of the 32 floats lo, hi. */
AVX512_INLINE __m512 evens(__m512 lo, __m512 hi)
{
    const __m512i e = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12,
                                       10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_ps(lo, e, hi);
}

AVX512_INLINE __m512 odds(__m512 lo, __m512 hi)
{
    const __m512i o = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13,
                                       11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_ps(lo, o, hi);
}

/* Elements 2 .. 17 of the 32 floats lo, hi. */
AVX512_INLINE __m512 from2(__m512 lo, __m512 hi)
{
    return _mm512_castsi512_ps(
        _mm512_alignr_epi32(_mm512_castps_si512(hi), _mm512_castps_si512(lo), 2));
}

/* Elements 14 .. 29 of the 32 floats lo, hi: hi moved two lanes right,
 * lo's last two in front. */
AVX512_INLINE __m512 from14(__m512 lo, __m512 hi)
{
    return _mm512_castsi512_ps(_mm512_alignr_epi32(
        _mm512_castps_si512(hi), _mm512_castps_si512(lo), 14));
}

/* The 16 points of nt <= 16 tiles side by side: p[q] = src[q * stride +
 * tile], 0 past nt. */
AVX512_INLINE void points16(const float *src, size_t stride, int nt,
                            __m512 p[STK_WINO_P])
{
    __mmask16 m = lanes16(0, nt);
    for (int q = 0; q < STK_WINO_P; q++)
        p[q] = _mm512_maskz_loadu_ps(m, src + (size_t)q * stride);
}

/* out = P in P^T on 16 tiles, as stk_wino_2d: in (i x i) as p[r * i + c],
 * out (o x o) as out[r * o + c], the columns first, then the rows. */
AVX512_INLINE void map2d16(stk_wino_map map, const __m512 *in, __m512 *out)
{
    int i = stk_wino_ins(map), o = stk_wino_outs(map);
    __m512 z = _mm512_setzero_ps(), t[STK_WINO_P];
    for (int c = 0; c < i; c++) {
        __m512 y[STK_WINO_A] = {z, z, z, z};
        STK_WINO_MAP(map, in[c], in[i + c], i > 2 ? in[2 * i + c] : z,
                     i > 3 ? in[3 * i + c] : z, y[0], y[1], y[2], y[3]);
        for (int r = 0; r < o; r++)
            t[r * i + c] = y[r];
    }
    for (int r = 0; r < o; r++) {
        __m512 y[STK_WINO_A] = {z, z, z, z};
        STK_WINO_MAP(map, t[r * i], t[r * i + 1], i > 2 ? t[r * i + 2] : z,
                     i > 3 ? t[r * i + 3] : z, y[0], y[1], y[2], y[3]);
        for (int c = 0; c < o; c++)
            out[r * o + c] = y[c];
    }
}

/* x[0..31] = a[0], b[0], a[1], b[1], ...: two tiles' columns side by side
 * as the 32 pixels they cover, in two vectors. */
AVX512_INLINE void interleave(__m512 a, __m512 b, __m512 x[2])
{
    const __m512i lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18,
                                        2, 17, 1, 16, 0),
                  hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11,
                                        26, 10, 25, 9, 24, 8);
    x[0] = _mm512_permutex2var_ps(a, lo, b);
    x[1] = _mm512_permutex2var_ps(a, hi, b);
}

/* A row of tiles is one vector: its tiles' mask, 1u << nt, and the three
 * column vectors read below need nt <= 16. */
_Static_assert(ROW_TILES <= 16, "a row of tiles fits 16 lanes");

/* wino_row_of_tiles in 16 lanes (nt <= 16 tiles of a map with 4 outputs):
 * the first pass on three vectors of columns, 0 where wino_first_pass
 * reads 0, then the second with the tiles' columns 2t .. 2t + 3 taken
 * out of it in vectors. */
AVX512_INLINE void wino_row_of_tiles16(const float *plane, int h, int w,
                                       int y0, int x0, int nt,
                                       stk_wino_map map, int in, float *col,
                                       size_t cs)
{
    __m512 t[STK_WINO_A][3], z = _mm512_setzero_ps();
    int width = (nt - 1) * STK_WINO_M + in;
    for (int v = 0; v < 3; v++) {
        if (16 * v >= width) { /* columns no tile of the row reads */
            for (int k = 0; k < STK_WINO_A; k++)
                t[k][v] = z;
            continue;
        }
        __m512 x[STK_WINO_A] = {z, z, z, z};
        for (int k = 0; k < in; k++)
            x[k] = row16(plane, h, w, y0 + k, x0 + 16 * v);
        STK_WINO_MAP(map, x[0], x[1], x[2], x[3], t[0][v], t[1][v], t[2][v],
                     t[3][v]);
    }
    __mmask16 out = lanes16(0, nt);
    for (int k = 0; k < STK_WINO_A; k++) {
        __m512 s0 = from2(t[k][0], t[k][1]), s1 = from2(t[k][1], t[k][2]);
        __m512 a = evens(t[k][0], t[k][1]), b = odds(t[k][0], t[k][1]),
               c = evens(s0, s1), d = odds(s0, s1), y[STK_WINO_A] = {z, z, z, z};
        STK_WINO_MAP(map, a, b, c, d, y[0], y[1], y[2], y[3]);
        for (int i = 0; i < STK_WINO_A; i++)
            _mm512_mask_storeu_ps(col + (size_t)(k * STK_WINO_A + i) * cs, out,
                                  y[i]);
    }
}

/* Pixel rows y and y + M of a plane w <= 7 wide side by side, 0 outside
 * it and in lanes 2w .. 15 (pack16's pairs). */
AVX512_INLINE __m512 pair16(const float *plane, int h, int w, int y)
{
    __m512 v = _mm512_setzero_ps();
    if (y >= 0 && y < h)
        v = _mm512_maskz_loadu_ps(lanes16(0, w), plane + (size_t)y * w);
    y += STK_WINO_M;
    if (y >= 0 && y < h)
        v = _mm512_mask_loadu_ps(v, lanes16(w, 2 * w),
                                 (const void *)stk_addr_at(plane, y * w - w));
    return v;
}

/* Rows ty .. ty + rows - 1 of a narrow plane's tiles through the map, as
 * wino_row_of_tiles16, packed as pk says: the pixel rows they read (up to
 * (4 - 1) * M + 4 = 10) loaded once (in pairs, the rows both pairs read
 * twice), each tile's `in` x `in` inputs
 * gathered from them by permutes, the 2-D map on 16 tiles at once, and a
 * store per point. The gathered inputs go through map2d16's expressions
 * in its order, the same floats as the rows of tiles. */
AVX512_INLINE void rows_packed16(const float *plane, int h, int w, int y0,
                                 int x0, int rows, const pack16 *pk,
                                 bool pairs, stk_wino_map map, int in,
                                 float *col, size_t cs)
{
    __m512 z = _mm512_setzero_ps(), px[(4 - 1) * STK_WINO_M + STK_WINO_A];
    __m512 p[STK_WINO_P], o[STK_WINO_P];
    int lines = (rows - 1) * STK_WINO_M + in;
    for (int k = 0; k < (4 - 1) * STK_WINO_M + STK_WINO_A; k++)
        px[k] = k < lines && !pairs ? row16(plane, h, w, y0 + k, x0) : z;
    for (int i = 0; pairs && i < in; i++) {
        __m512 lo = pair16(plane, h, w, y0 + i),
               hi = pair16(plane, h, w, y0 + 2 * STK_WINO_M + i);
        for (int j = 0; j < in; j++)
            p[i * in + j] = _mm512_permutex2var_ps(
                lo, _mm512_loadu_si512(pk->idx[j]), hi);
    }
    for (int i = 0; !pairs && i < in; i++) {
        const __m512 *s = px + i; /* row r's pixels at s[M r] */
        for (int j = 0; j < in; j++) {
            __m512i idx = _mm512_loadu_si512(pk->idx[j]);
            __m512 lo = _mm512_permutex2var_ps(
                s[0], idx, rows > 1 ? s[STK_WINO_M] : z);
            if (rows > 2) {
                __m512 hi = _mm512_permutex2var_ps(
                    s[2 * STK_WINO_M], idx,
                    rows > 3 ? s[3 * STK_WINO_M] : z);
                lo = _mm512_mask_blend_ps(pk->upper, lo, hi);
            }
            p[i * in + j] = lo;
        }
    }
    map2d16(map, p, o);
    __mmask16 out = lanes16(0, rows * pk->tw);
    for (int q = 0; q < STK_WINO_P; q++)
        _mm512_mask_storeu_ps(col + (size_t)q * cs, out, o[q]);
}

/* rows_packed16 on a constant layout. */
AVX512_INLINE void wino_rows_packed16(const float *plane, int h, int w,
                                      int y0, int x0, int rows,
                                      const pack16 *pk, stk_wino_map map,
                                      int in, float *col, size_t cs)
{
    if (pk->pairs)
        rows_packed16(plane, h, w, y0, x0, rows, pk, true, map, in, col, cs);
    else
        rows_packed16(plane, h, w, y0, x0, rows, pk, false, map, in, col, cs);
}

/* Strided 3x3 convolutions (stride 2, padding 1: resnet's downsampling)
 * on planes of up to 32 columns, in 16 lanes, a channel's planes at a
 * time: im2col loads each input row once (a vector or two) and takes the
 * three taps' columns out of it (the even and odd columns, and the odd
 * ones a lane right), col2im builds each input row's gradient in
 * registers from the columns that read it, in stk_col2im1's (ky, kx)
 * order (an absent term adds +0, which leaves a sum as it is), and stores
 * it once. Row stores run past the row (to_plane_end's reason) up to the
 * end of the column row or plane. The rows of tens of columns the
 * per-element loops took were mostly loop overhead. */
static bool s2k3_fits(const stk_conv_shape *s)
{
    return s->kh == 3 && s->kw == 3 && s->sh == 2 && s->sw == 2 &&
           s->ph == 1 && s->pw == 1 && s->w <= 32 && s->ow <= 16;
}

/* 16 floats of src from element at, lanes `in` kept, the rest 0 (as
 * load_kept), the array ending at element `end`. */
AVX512_INLINE __m512 run16(const float *src, size_t at, size_t end,
                           __mmask16 in)
{
    return load_kept(src, (ptrdiff_t)at, at + 16 <= end, in);
}

AVX512 static void im2col_s2k3_part(void *v, size_t b, size_t e)
{
    const conv_job *j = v;
    const stk_conv_shape *s = j->s;
    size_t hw = (size_t)s->oh * s->ow, per_row = hw * j->n,
           end = (size_t)j->n * s->c * s->h * s->w;
    __m512 z = _mm512_setzero_ps();
    __mmask16 in0 = lanes16(0, s->w), in1 = lanes16(0, s->w - 16);
    for (size_t c = b; c < e; c++)
        for (int smp = 0; smp < j->n; smp++) {
            size_t plane = ((size_t)smp * s->c + c) * s->h * s->w;
            for (int oy = 0; oy < s->oh; oy++) {
                size_t at = (size_t)smp * hw + (size_t)oy * s->ow;
                __mmask16 m = to_plane_end(at, per_row);
                for (int ky = 0; ky < 3; ky++) {
                    int y = 2 * oy - 1 + ky;
                    __m512 lo = z, hi = z;
                    if (y >= 0 && y < s->h) {
                        size_t r = plane + (size_t)y * s->w;
                        lo = run16(j->src, r, end, in0);
                        if (s->w > 16)
                            hi = run16(j->src, r + 16, end, in1);
                    }
                    __m512 ev = evens(lo, hi), od = odds(lo, hi);
                    __m512 od1 = _mm512_castsi512_ps(_mm512_alignr_epi32(
                        _mm512_castps_si512(od), _mm512_castps_si512(z), 15));
                    float *out = j->dst + ((c * 3 + ky) * 3) * per_row + at;
                    _mm512_mask_storeu_ps(out, m, od1); /* column 2 ox - 1 */
                    _mm512_mask_storeu_ps(out + per_row, m, ev);
                    _mm512_mask_storeu_ps(out + 2 * per_row, m, od);
                }
            }
        }
}

/* Lane l of half h of an input row (column 16 h + l) from tap kx reads
 * output column ox = (16 h + l + 1 - kx) / 2 where that is whole and in
 * [0, ow): idx and the mask of such lanes. */
typedef struct s2k3_taps {
    __mmask16 in[2][3];
    int32_t idx[2][3][16];
} s2k3_taps;

static void s2k3_taps_plan(int ow, s2k3_taps *t)
{
    for (int h = 0; h < 2; h++)
        for (int kx = 0; kx < 3; kx++) {
            t->in[h][kx] = 0;
            for (int l = 0; l < 16; l++) {
                int d = 16 * h + l + 1 - kx;
                bool ok = d >= 0 && d % 2 == 0 && d / 2 < ow;
                t->idx[h][kx][l] = ok ? d / 2 : 0;
                if (ok)
                    t->in[h][kx] |= (__mmask16)(1u << l);
            }
        }
}

AVX512 static void col2im_s2k3_part(void *v, size_t b, size_t e)
{
    const conv_job *j = v;
    const stk_conv_shape *s = j->s;
    size_t hw = (size_t)s->oh * s->ow, per_row = hw * j->n,
           end = (size_t)s->c * 9 * per_row, size = (size_t)s->h * s->w;
    int halves = s->w > 16 ? 2 : 1;
    s2k3_taps t;
    s2k3_taps_plan(s->ow, &t);
    __mmask16 cols = lanes16(0, s->ow);
    for (size_t c = b; c < e; c++)
        for (int smp = 0; smp < j->n; smp++) {
            float *plane = j->dst + ((size_t)smp * s->c + c) * size;
            for (int y = 0; y < s->h; y++) {
                __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
                for (int ky = 0; ky < 3; ky++) {
                    int d = y + 1 - ky;
                    if (d < 0 || d % 2 || d / 2 >= s->oh)
                        continue;
                    size_t at = (c * 9 + (size_t)ky * 3) * per_row +
                                (size_t)smp * hw + (size_t)(d / 2) * s->ow;
                    for (int kx = 0; kx < 3; kx++) {
                        __m512 cv = run16(j->src, at + kx * per_row, end, cols);
                        for (int h = 0; h < halves; h++)
                            acc[h] = acc[h] + _mm512_maskz_permutexvar_ps(
                                                  t.in[h][kx],
                                                  _mm512_loadu_si512(t.idx[h][kx]),
                                                  cv);
                    }
                }
                for (int h = 0; h < halves; h++) {
                    size_t px = (size_t)y * s->w + 16 * h;
                    _mm512_mask_storeu_ps(plane + px, to_plane_end(px, size),
                                          acc[h]);
                }
            }
        }
}
#endif

/* One row of tiles of one map, each map's row functions specialised on
 * it (the 16-lane ones where the CPU has AVX-512F). */
typedef void (*tile_row_fn)(const float *plane, int h, int w, int y0, int x0,
                            int nt, float *col, size_t cs);

/* Packed rows of tiles of one map (wino_rows_packed16). */
typedef void (*tile_rows_fn)(const float *plane, int h, int w, int y0, int x0,
                             int rows, const pack16 *pk, float *col,
                             size_t cs);

static void rows_input(const float *plane, int h, int w, int y0, int x0,
                       int nt, float *col, size_t cs)
{
    wino_row_of_tiles(plane, h, w, y0, x0, nt, STK_WINO_BT, STK_WINO_A, col,
                      cs);
}

static void rows_output_grad(const float *plane, int h, int w, int y0,
                             int x0, int nt, float *col, size_t cs)
{
    wino_row_of_tiles(plane, h, w, y0, x0, nt, STK_WINO_A1, STK_WINO_M, col,
                      cs);
}

#ifdef CPU_AVX512
AVX512 static void rows16_input(const float *plane, int h, int w, int y0,
                                int x0, int nt, float *col, size_t cs)
{
    wino_row_of_tiles16(plane, h, w, y0, x0, nt, STK_WINO_BT, STK_WINO_A, col,
                        cs);
}

AVX512 static void rows16_output_grad(const float *plane, int h, int w,
                                      int y0, int x0, int nt, float *col,
                                      size_t cs)
{
    wino_row_of_tiles16(plane, h, w, y0, x0, nt, STK_WINO_A1, STK_WINO_M, col,
                        cs);
}

AVX512 static void packed16_input(const float *plane, int h, int w, int y0,
                                  int x0, int rows, const pack16 *pk,
                                  float *col, size_t cs)
{
    wino_rows_packed16(plane, h, w, y0, x0, rows, pk, STK_WINO_BT, STK_WINO_A,
                       col, cs);
}

AVX512 static void packed16_output_grad(const float *plane, int h, int w,
                                        int y0, int x0, int rows,
                                        const pack16 *pk, float *col,
                                        size_t cs)
{
    wino_rows_packed16(plane, h, w, y0, x0, rows, pk, STK_WINO_A1, STK_WINO_M,
                       col, cs);
}

#else /* no AVX-512 copies: the portable ones stand in */
#define rows16_input rows_input
#define rows16_output_grad rows_output_grad
#define packed16_input NULL
#define packed16_output_grad NULL
#endif

/* An image transform's ways through a row of tiles: the portable one,
 * the 16-lane one, and the 16-lane one for narrow planes' packed rows
 * (NULL: none), the map reading `in` pixels per tile side. */
typedef struct image_rows {
    tile_row_fn narrow, wide16;
    tile_rows_fn packed16;
    int in;
} image_rows;

/* Planes [b, e) of an image [n, ch, h, w] (plane sample * ch + channel)
 * into the columns of a [points, ch, n * tiles] array. */
static void wino_image_part(const wino_job *j, size_t b, size_t e,
                            const image_rows *how, int h, int w, int pad_y,
                            int pad_x)
{
    int th, tw;
    stk_wino_tiles(j->s, &th, &tw);
    tile_row_fn row = j->wide ? how->wide16 : how->narrow;
    pack16 pk;
    bool packed = j->wide && how->packed16 &&
                  pack16_plan(w, tw, -pad_x, how->in, &pk);
    size_t nt = (size_t)j->n * j->tiles, vs = stk_wino_stride(j->ch * nt);
    for (size_t q = b; q < e; q++) {
        const float *plane = j->src + q * h * w;
        float *out = j->dst + q % j->ch * nt + q / j->ch * j->tiles;
        /* the plane after next, asked for ahead: a small plane is read
         * four rows at a time, a pattern the hardware prefetcher picks up
         * late (1.3% faster cnn steps at 1 thread, measured in pairs) */
        if (q + 2 < e)
            for (size_t o = 0; o < (size_t)h * w; o += 16)
                __builtin_prefetch(plane + 2 * (size_t)h * w + o);
        for (int ty = 0; packed && ty < th; ty += pk.rows)
            how->packed16(plane, h, w, ty * STK_WINO_M - pad_y, -pad_x,
                          th - ty < pk.rows ? th - ty : pk.rows, &pk,
                          out + ty * tw, vs);
        for (int ty = 0; !packed && ty < th; ty++)
            for (int tx0 = 0; tx0 < tw; tx0 += ROW_TILES) {
                int cnt = tw - tx0 < ROW_TILES ? tw - tx0 : ROW_TILES;
                row(plane, h, w, ty * STK_WINO_M - pad_y,
                    tx0 * STK_WINO_M - pad_x, cnt, out + ty * tw + tx0, vs);
            }
    }
}

/* Not CPU_HOT, nor wino_output_grad_part: their rows of 4 to 16 tiles are
 * short for 8 lanes, and the AVX2 copy ran 22% more instructions than the
 * baseline one on resnet20's shapes (callgrind). */
static void wino_input_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
    const stk_conv_shape *s = j->s;
    static const image_rows how = {rows_input, rows16_input, packed16_input,
                                   STK_WINO_A};
    wino_image_part(j, b, e, &how, s->h, s->w, s->ph, s->pw);
}

/* Runs part over the n * ch planes of j. */
static int wino_planes(stk_backend *be, const wino_job *j, stk_pool_fn part)
{
    size_t per = (size_t)j->tiles * STK_WINO_P;
    stk_pool_for(pool(be), (size_t)j->n * j->ch, (GRAIN + per - 1) / per,
                 part, (void *)j);
    return 0;
}

static int cpu_wino_input(stk_backend *be, const float *x,
                          const stk_conv_shape *s, int n, float *v,
                          stk_err *err)
{
    (void)err;
    wino_job j = wino_columns(be, x, NULL, v, s, n, s->c);
    return wino_planes(be, &j, wino_input_part);
}

/* Tiles per stk_wino_2d call in the CPU's per-plane transforms. */
enum { LANES_MAX = 64 };

/* Tiles [tx0, tx1) of a plane's row ty of tiles, their pixel gradients at
 * o[(r * A + c) * lanes + tile - tx0], added into the plane row by row. A
 * pixel at tile column 2k + e (e = 0, 1) takes tile k - 1's column e + 2,
 * then tile k's column e: with the rows of tiles in order, every pixel
 * adds its tiles in stk_wino_gather1's order. */
/* Pixels x, x + 1 of a row from tile k (tx0 <= k <= tx1) and its left
 * neighbour, as wino_scatter_row, where either may be outside the image. */
static inline void wino_scatter_edge(float *row, int w, int x, int k, int tx0,
                                     int tx1, const float *const c[4], int i)
{
    if (x >= 0 && x < w)
        row[x] = k == tx0   ? row[x] + c[0][i]
                 : k == tx1 ? row[x] + c[2][i - 1]
                            : (row[x] + c[2][i - 1]) + c[0][i];
    if (x + 1 >= 0 && x + 1 < w)
        row[x + 1] = k == tx0   ? row[x + 1] + c[1][i]
                     : k == tx1 ? row[x + 1] + c[3][i - 1]
                                : (row[x + 1] + c[3][i - 1]) + c[1][i];
}

static void wino_scatter_row(float *plane, const stk_conv_shape *s, int ty,
                             int tx0, int tx1, const float *o, int lanes)
{
    /* tiles [in0, in1]: both columns inside the image, both neighbours
     * added; the loop over them has no test and vectorises */
    int in0 = (s->pw + 1) / 2, in1 = (s->w + s->pw - 2) / 2;
    in0 = in0 > tx0 + 1 ? in0 : tx0 + 1;
    in1 = in1 < tx1 - 1 ? in1 : tx1 - 1;
    for (int r = 0; r < STK_WINO_A; r++) {
        int y = ty * STK_WINO_M - s->ph + r;
        if (y < 0 || y >= s->h)
            continue;
        float *row = plane + (size_t)y * s->w;
        /* point (r, c) of tile k at c[c][k - tx0] */
        const float *c[4];
        for (int cc = 0; cc < STK_WINO_A; cc++)
            c[cc] = o + (size_t)(r * STK_WINO_A + cc) * lanes;
        /* tile columns 2k + e, k = tx0 .. tx1 (the last only from tile
         * tx1 - 1) */
        int k = tx0;
        for (; k <= tx1 && k < in0; k++)
            wino_scatter_edge(row, s->w, k * STK_WINO_M - s->pw, k, tx0, tx1,
                              c, k - tx0);
        for (; k <= in1; k++) {
            int x = k * STK_WINO_M - s->pw, i = k - tx0;
            row[x] = (row[x] + c[2][i - 1]) + c[0][i];
            row[x + 1] = (row[x + 1] + c[3][i - 1]) + c[1][i];
        }
        for (; k <= tx1; k++)
            wino_scatter_edge(row, s->w, k * STK_WINO_M - s->pw, k, tx0, tx1,
                              c, k - tx0);
    }
}

#ifdef CPU_AVX512
/* wino_output16 on a narrow plane's packed rows of tiles (pack16): each
 * output pixel row, up to 16 pixels, a permute of its tile row's two
 * point columns. */
AVX512_INLINE void output_packed16(const wino_job *j, const pack16 *pk,
                                   const float *m, size_t ms, __m512 bias,
                                   float *plane)
{
    const stk_conv_shape *s = j->s;
    for (int ty = 0; ty * pk->tw < j->tiles; ty += pk->rows) {
        int rows = j->tiles / pk->tw - ty < pk->rows ? j->tiles / pk->tw - ty
                                                     : pk->rows;
        __m512 p[STK_WINO_P], o[STK_WINO_M * STK_WINO_M];
        points16(m + ty * pk->tw, ms, rows * pk->tw, p);
        map2d16(STK_WINO_AT, p, o);
        for (int r = 0; r < rows; r++) {
            __m512i idx = _mm512_loadu_si512(pk->cols[r]);
            for (int a = 0; a < STK_WINO_M; a++) {
                int y = (ty + r) * STK_WINO_M + a;
                if (y >= s->oh)
                    break;
                __m512 px = _mm512_permutex2var_ps(o[a * STK_WINO_M], idx,
                                                   o[a * STK_WINO_M + 1]);
                size_t at = (size_t)y * s->ow;
                _mm512_mask_storeu_ps(
                    plane + at, to_plane_end(at, (size_t)s->oh * s->ow),
                    STK_WINO_OUT(px, bias));
            }
        }
    }
}

/* wino_output_part in 16 lanes: a row of up to 16 tiles' outputs A^T M A
 * (+ bias, stk_wino_out1), the tiles' columns interleaved into pixels;
 * narrow planes on packed rows. */
AVX512 static void wino_output16(const wino_job *j, size_t b, size_t e)
{
    const stk_conv_shape *s = j->s;
    int th, tw;
    stk_wino_tiles(s, &th, &tw);
    size_t nt = (size_t)j->n * j->tiles, ms = stk_wino_stride(j->ch * nt);
    pack16 pk;
    bool packed = pack16_plan(s->ow, tw, 0, STK_WINO_M, &pk);
    for (size_t q = b; q < e; q++) {
        float *plane = j->dst + q * s->oh * s->ow;
        __m512 bias = _mm512_set1_ps(j->bias ? j->bias[q % j->ch] : 0.0f);
        const float *m = j->src + q % j->ch * nt + q / j->ch * j->tiles;
        if (packed)
            output_packed16(j, &pk, m, ms, bias, plane);
        for (int ty = 0; !packed && ty < th; ty++)
            for (int tx0 = 0; tx0 < tw; tx0 += 16) {
                int cnt = tw - tx0 < 16 ? tw - tx0 : 16;
                __m512 p[STK_WINO_P], o[STK_WINO_M * STK_WINO_M], px[2];
                points16(m + ty * tw + tx0, ms, cnt, p);
                map2d16(STK_WINO_AT, p, o);
                for (int r = 0; r < STK_WINO_M; r++) {
                    int y = ty * STK_WINO_M + r, x0 = tx0 * STK_WINO_M;
                    if (y >= s->oh)
                        break;
                    interleave(o[r * STK_WINO_M], o[r * STK_WINO_M + 1], px);
                    /* past the row only where one strip is the row:
                     * with more, the next row has its first strip */
                    size_t at = (size_t)y * s->ow + x0,
                           end = tw <= 16 ? (size_t)s->oh * s->ow
                                          : (size_t)(y + 1) * s->ow;
                    for (int v = 0; v < 2 && x0 + 16 * v < s->ow; v++)
                        _mm512_mask_storeu_ps(
                            plane + at + 16 * v,
                            to_plane_end(at + 16 * v, end),
                            STK_WINO_OUT(px[v], bias));
                }
            }
    }
}

/* The 16-lane input gradient's pixel rows, in vectors from pixel -pw:
 * up to GRAD_STRIPS strips of 16 tiles (wider planes take the portable
 * path, the same floats). */
enum { GRAD_STRIPS = 16, GRAD_VECS = 2 * GRAD_STRIPS + 1 };

/* Tile row ty's strip of up to 16 tiles from tile tx0, B dV B^T, added
 * into the four pixel rows it covers, rows[r][2 * strip ..], as
 * wino_scatter_row does: pixel column 2k + e takes tile k - 1's column
 * e + 2, then tile k's column e (a tile that is not there adds +0, which
 * leaves the sum, never -0, as it is). */
AVX512_INLINE void grad_strip16(const float *dv, size_t vs, int cnt,
                                __m512 rows[][GRAD_VECS], int strip)
{
    __m512 z = _mm512_setzero_ps(), p[STK_WINO_P], o[STK_WINO_P];
    points16(dv, vs, cnt, p);
    map2d16(STK_WINO_B, p, o);
    for (int r = 0; r < STK_WINO_A; r++) {
        __m512 right[3], left[2], l[3];
        interleave(o[r * STK_WINO_A], o[r * STK_WINO_A + 1], right);
        right[2] = z;
        interleave(o[r * STK_WINO_A + 2], o[r * STK_WINO_A + 3], left);
        l[0] = from14(z, left[0]);
        l[1] = from14(left[0], left[1]);
        l[2] = from14(left[1], z);
        __m512 *row = rows[r] + 2 * strip;
        for (int v = 0; v < 3; v++)
            row[v] = (row[v] + l[v]) + right[v];
    }
}

/* Pixel row y of the plane from its vectors (pixel -pw on), if y is in:
 * vector v's lanes in[v] (the image's columns). (Storing past the row, as
 * the output transform does, made these stores no faster.) */
AVX512_INLINE void grad_row_out16(float *plane, const stk_conv_shape *s, int y,
                                  const __m512 *row, const __mmask16 *in,
                                  int vecs)
{
    if (y < 0 || y >= s->h)
        return;
    for (int v = 0; v < vecs; v++)
        if (in[v])
            store_at(plane + (size_t)y * s->w, 16 * v - s->pw, in[v], row[v]);
}

/* After a row of tiles (pixel rows y .. y + 3 in rows[0 .. 3]): rows 0
 * and 1 are whole and go out as pixel rows y and y + 1; 2 and 3, the next
 * row of tiles' 0 and 1, move up, and 2 and 3 start again from 0. */
AVX512_INLINE void grad_rows_down(float *plane, const stk_conv_shape *s,
                                  int y, __m512 rows[][GRAD_VECS],
                                  const __mmask16 *in, int vecs)
{
    __m512 z = _mm512_setzero_ps();
    for (int r = 0; r < STK_WINO_M; r++) {
        grad_row_out16(plane, s, y + r, rows[r], in, vecs);
        for (int v = 0; v < vecs; v++) {
            rows[r][v] = rows[r + STK_WINO_M][v];
            rows[r + STK_WINO_M][v] = z;
        }
    }
}

/* wino_input_grad_part in 16 lanes, on planes of `strips` strips of 16
 * tiles. The pixel rows two rows of tiles share stay in registers between
 * them, not stored and loaded back: masked stores do not forward to
 * loads, and the loads waited for them (2.5x the input transform's time
 * per tile). Rows move down by copies, which a constant `strips` lets the
 * compiler keep in registers. Every pixel row is written once, when its
 * last row of tiles is in; the tiles cover every pixel of a 3x3
 * convolution's input. */
AVX512_INLINE void grad_planes16(const wino_job *j, size_t b, size_t e,
                                 int strips)
{
    const stk_conv_shape *s = j->s;
    int th, tw, vecs = 2 * strips + 1;
    stk_wino_tiles(s, &th, &tw);
    size_t nt = (size_t)j->n * j->tiles, vs = stk_wino_stride(s->c * nt);
    __m512 rows[STK_WINO_A][GRAD_VECS], z = _mm512_setzero_ps();
    __mmask16 in[GRAD_VECS];
    for (int v = 0; v < vecs; v++)
        in[v] = lanes16(s->pw - 16 * v, s->w + s->pw - 16 * v);
    for (size_t q = b; q < e; q++) {
        float *plane = j->dst + q * s->h * s->w;
        const float *dv = j->src + q % s->c * nt + q / s->c * j->tiles;
        for (int r = 0; r < STK_WINO_A; r++)
            for (int v = 0; v < vecs; v++)
                rows[r][v] = z;
        for (int ty = 0; ty < th; ty++) {
            for (int k = 0; k < strips; k++)
                grad_strip16(dv + ty * tw + 16 * k, vs,
                             tw - 16 * k < 16 ? tw - 16 * k : 16, rows, k);
            grad_rows_down(plane, s, ty * STK_WINO_M - s->ph, rows, in,
                           vecs);
        }
        grad_rows_down(plane, s, th * STK_WINO_M - s->ph, rows, in, vecs);
    }
}

/* grad_planes16 on a narrow plane's packed rows of tiles (pack16): B dV
 * B^T on up to 16 tiles at once, then each row of tiles in turn added
 * into its four pixel rows (one vector each) as grad_strip16 adds it, its
 * tiles' columns taken out by permutes (0 where grad_strip16 has no
 * tile). */
AVX512_INLINE void grad_packed16(const wino_job *j, const pack16 *pk,
                                 size_t b, size_t e)
{
    const stk_conv_shape *s = j->s;
    int th = j->tiles / pk->tw, tw = pk->tw;
    size_t nt = (size_t)j->n * j->tiles, vs = stk_wino_stride(s->c * nt);
    __m512 z = _mm512_setzero_ps(), rows[STK_WINO_A][GRAD_VECS];
    __mmask16 in = lanes16(s->pw, s->w + s->pw), right = lanes16(0, STK_WINO_M * tw),
              left = lanes16(STK_WINO_M, STK_WINO_M * tw + STK_WINO_M);
    for (size_t q = b; q < e; q++) {
        float *plane = j->dst + q * s->h * s->w;
        const float *dv = j->src + q % s->c * nt + q / s->c * j->tiles;
        for (int r = 0; r < STK_WINO_A; r++)
            rows[r][0] = z;
        for (int ty = 0; ty < th; ty += pk->rows) {
            int nr = th - ty < pk->rows ? th - ty : pk->rows;
            __m512 p[STK_WINO_P], o[STK_WINO_P];
            points16(dv + ty * tw, vs, nr * tw, p);
            map2d16(STK_WINO_B, p, o);
            for (int t = 0; t < nr; t++) {
                __m512i idx = _mm512_loadu_si512(pk->cols[t]),
                        idx1 = _mm512_sub_epi32(idx, _mm512_set1_epi32(1));
                for (int r = 0; r < STK_WINO_A; r++) {
                    const __m512 *c = o + r * STK_WINO_A;
                    __m512 rt = _mm512_maskz_permutex2var_ps(right, c[0], idx,
                                                             c[1]),
                           lt = _mm512_maskz_permutex2var_ps(left, c[2], idx1,
                                                             c[3]);
                    rows[r][0] = (rows[r][0] + lt) + rt;
                }
                grad_rows_down(plane, s, (ty + t) * STK_WINO_M - s->ph, rows,
                               &in, 1);
            }
        }
        grad_rows_down(plane, s, th * STK_WINO_M - s->ph, rows, &in, 1);
    }
}

/* Narrow planes on packed rows, planes of up to 16 tiles across on the
 * constant 1 strip, wider ones on their strip count. */
AVX512 static void wino_input_grad16(const wino_job *j, size_t b, size_t e)
{
    int th, tw;
    stk_wino_tiles(j->s, &th, &tw);
    pack16 pk;
    if (pack16_plan(j->s->w, tw, -j->s->pw, STK_WINO_A, &pk))
        grad_packed16(j, &pk, b, e);
    else if (tw <= 16)
        grad_planes16(j, b, e, 1);
    else
        grad_planes16(j, b, e, (tw + 15) / 16);
}
#endif

/* Planes [b, e) of dx (sample * c + ci): the plane's tiles' pixel
 * gradients (B dV B^T, up to LANES_MAX tiles side by side), added into the
 * plane a row of tiles at a time in stk_wino_gather1's order (the same
 * floats as CUDA's transform in place and gather). dV is read once, not
 * rewritten. */
CPU_HOT static void wino_input_grad_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
    const stk_conv_shape *s = j->s;
    int th, tw;
    stk_wino_tiles(s, &th, &tw);
#ifdef CPU_AVX512
    if (j->wide && tw <= 16 * GRAD_STRIPS) {
        wino_input_grad16(j, b, e);
        return;
    }
#endif
    size_t nt = (size_t)j->n * j->tiles, vs = stk_wino_stride(s->c * nt);
    float t[STK_WINO_P * LANES_MAX], o[STK_WINO_P * LANES_MAX];
    for (size_t q = b; q < e; q++) {
        float *plane = j->dst + q * s->h * s->w;
        const float *dv = j->src + q % s->c * nt + q / s->c * j->tiles;
        memset(plane, 0, (size_t)s->h * s->w * sizeof *plane);
        for (int t0 = 0; t0 < j->tiles; t0 += LANES_MAX) {
            int lanes = j->tiles - t0 < LANES_MAX ? j->tiles - t0 : LANES_MAX;
            stk_wino_2d(STK_WINO_B, STK_WINO_A, STK_WINO_A, dv + t0, vs, t, o,
                        (size_t)lanes, lanes);
            for (int ty = t0 / tw; ty * tw < t0 + lanes; ty++) {
                int a = ty * tw < t0 ? t0 - ty * tw : 0;
                int z = (ty + 1) * tw > t0 + lanes ? t0 + lanes - ty * tw : tw;
                wino_scatter_row(plane, s, ty, a, z, o + (ty * tw + a - t0),
                                 lanes);
            }
        }
    }
}

static int cpu_wino_input_grad(stk_backend *be, float *dv,
                               const stk_conv_shape *s, int n, float *dx,
                               stk_err *err)
{
    (void)err;
    wino_job j = wino_columns(be, dv, NULL, dx, s, n, s->c);
    return wino_planes(be, &j, wino_input_grad_part);
}

/* Outputs of tiles [tx0, tx1) of row ty of a plane's tiles, their point
 * (r, c) at o[(r * M + c) * lanes + tile - tx0], plus the bias, row by
 * row. */
static void wino_output_row(float *plane, const stk_conv_shape *s, int ty,
                            int tx0, int tx1, const float *o, int lanes,
                            float bias)
{
    for (int r = 0; r < STK_WINO_M && ty * STK_WINO_M + r < s->oh; r++) {
        float *row = plane + (size_t)(ty * STK_WINO_M + r) * s->ow;
        const float *c0 = o + (size_t)r * STK_WINO_M * lanes, *c1 = c0 + lanes;
        int whole = (s->ow / STK_WINO_M < tx1 ? s->ow / STK_WINO_M : tx1);
        for (int k = tx0; k < whole; k++) {
            row[k * STK_WINO_M] = stk_wino_out1(c0[k - tx0], bias);
            row[k * STK_WINO_M + 1] = stk_wino_out1(c1[k - tx0], bias);
        }
        for (int k = whole > tx0 ? whole : tx0; k < tx1; k++) /* cut tile */
            row[k * STK_WINO_M] = stk_wino_out1(c0[k - tx0], bias);
    }
}

/* Planes [b, e) of y (sample * cout + co): the plane's tiles, up to
 * LANES_MAX side by side through stk_wino_2d, plus the bias, a row of
 * tiles at a time. */
CPU_HOT static void wino_output_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
#ifdef CPU_AVX512
    if (j->wide) {
        wino_output16(j, b, e);
        return;
    }
#endif
    const stk_conv_shape *s = j->s;
    int th, tw;
    stk_wino_tiles(s, &th, &tw);
    size_t nt = (size_t)j->n * j->tiles, ms = stk_wino_stride(j->ch * nt);
    float t[STK_WINO_P * LANES_MAX], o[STK_WINO_M * STK_WINO_M * LANES_MAX];
    for (size_t q = b; q < e; q++) {
        float *plane = j->dst + q * s->oh * s->ow,
              bias = j->bias ? j->bias[q % j->ch] : 0.0f; /* NULL: none */
        const float *m = j->src + q % j->ch * nt + q / j->ch * j->tiles;
        for (int t0 = 0; t0 < j->tiles; t0 += LANES_MAX) {
            int lanes = j->tiles - t0 < LANES_MAX ? j->tiles - t0 : LANES_MAX;
            stk_wino_2d(STK_WINO_AT, STK_WINO_A, STK_WINO_M, m + t0, ms, t, o,
                        (size_t)lanes, lanes);
            for (int ty = t0 / tw; ty * tw < t0 + lanes; ty++) {
                int a = ty * tw < t0 ? t0 - ty * tw : 0;
                int z = (ty + 1) * tw > t0 + lanes ? t0 + lanes - ty * tw : tw;
                wino_output_row(plane, s, ty, a, z, o + (ty * tw + a - t0),
                                lanes, bias);
            }
        }
    }
}

static int cpu_wino_output(stk_backend *be, const float *m, const float *bias,
                           const stk_conv_shape *s, int cout, int n, float *y,
                           stk_err *err)
{
    (void)err;
    wino_job j = wino_columns(be, m, bias, y, s, n, cout);
    return wino_planes(be, &j, wino_output_part);
}

static void wino_output_grad_part(void *v, size_t b, size_t e)
{
    const wino_job *j = v;
    const stk_conv_shape *s = j->s;
    static const image_rows how = {rows_output_grad, rows16_output_grad,
                                   packed16_output_grad, STK_WINO_M};
    wino_image_part(j, b, e, &how, s->oh, s->ow, 0, 0);
}

static int cpu_wino_output_grad(stk_backend *be, const float *dy,
                                const stk_conv_shape *s, int cout, int n,
                                float *dm, stk_err *err)
{
    (void)err;
    wino_job j = wino_columns(be, dy, NULL, dm, s, n, cout);
    return wino_planes(be, &j, wino_output_grad_part);
}

/* ---- max-pool ------------------------------------------------------------------- */

typedef struct pool_job {
    const float *x;
    float *y;
    int32_t *arg;
    const int32_t *carg;
    int h, w, k, st, oh, ow;
} pool_job;

/* Output row oy of a 2x2, stride-2 pool of plane x: the windows of
 * stk_maxpool_at in the same order, written so that the compiler can
 * vectorise across the row. */
static void maxpool2_row(const float *x, int w, int oy, int ow, float *y,
                         int32_t *arg)
{
    const float *r0 = x + (size_t)2 * oy * w, *r1 = r0 + w;
    for (int ox = 0; ox < ow; ox++) {
        int32_t i = 2 * oy * w + 2 * ox;
        float best = r0[2 * ox];
        int32_t at = i;
        stk_maxpool_take(&best, &at, r0[2 * ox + 1], i + 1);
        stk_maxpool_take(&best, &at, r1[2 * ox], i + w);
        stk_maxpool_take(&best, &at, r1[2 * ox + 1], i + w + 1);
        y[ox] = best;
        arg[ox] = at;
    }
}

/* Planes [b, e). */
CPU_HOT static void maxpool_fwd_part(void *v, size_t b, size_t e)
{
    const pool_job *j = v;
    size_t in = (size_t)j->h * j->w, out = (size_t)j->oh * j->ow;
    for (size_t p = b; p < e; p++) {
        const float *x = j->x + p * in;
        float *y = j->y + p * out;
        int32_t *arg = j->arg + p * out;
        for (int oy = 0; oy < j->oh; oy++, y += j->ow, arg += j->ow) {
            if (j->k == 2 && j->st == 2) {
                maxpool2_row(x, j->w, oy, j->ow, y, arg);
                continue;
            }
            for (int ox = 0; ox < j->ow; ox++)
                y[ox] = stk_maxpool_at(x, j->h, j->w, j->k, j->st, oy, ox,
                                       &arg[ox]);
        }
    }
}

static int cpu_maxpool_fwd(stk_backend *be, const float *x, int planes, int h,
                           int w, int k, int st, float *y, int32_t *arg,
                           stk_err *err)
{
    (void)err;
    pool_job j = {.x = x, .y = y, .arg = arg, .h = h, .w = w, .k = k,
                  .st = st, .oh = (h - k) / st + 1, .ow = (w - k) / st + 1};
    size_t per = (size_t)h * w;
    stk_pool_for(pool(be), (size_t)planes, (GRAIN + per - 1) / per,
                 maxpool_fwd_part, &j);
    return 0;
}

CPU_HOT static void maxpool_bwd_part(void *v, size_t b, size_t e)
{
    const pool_job *j = v;
    size_t in = (size_t)j->h * j->w, out = (size_t)j->oh * j->ow;
    for (size_t p = b; p < e; p++) {
        float *dx = j->y + p * in;
        memset(dx, 0, in * sizeof *dx);
        for (size_t o = p * out; o < (p + 1) * out; o++)
            dx[j->carg[o]] += j->x[o];
    }
}

/* A scatter in output order; stk_maxpool_grad1 is the same sum as a gather
 * (what the CUDA kernel runs), and a test checks they agree. */
static int cpu_maxpool_bwd(stk_backend *be, const float *dy,
                           const int32_t *arg, int planes, int h, int w,
                           int k, int st, float *dx, stk_err *err)
{
    (void)err;
    pool_job j = {.x = dy, .y = dx, .carg = arg, .h = h, .w = w,
                  .oh = (h - k) / st + 1, .ow = (w - k) / st + 1};
    size_t per = (size_t)h * w;
    stk_pool_for(pool(be), (size_t)planes, (GRAIN + per - 1) / per,
                 maxpool_bwd_part, &j);
    return 0;
}

/* ---- average pool --------------------------------------------------------
 */

typedef struct avgpool_job {
    const float *x; /* x (forward) or dy (backward) */
    float *y;       /* y (forward) or dx (backward) */
    int h, w, kh, kw, sh, sw, oh, ow;
} avgpool_job;

static avgpool_job avgpool_plan(const float *x, float *y, int h, int w, int kh,
                                int kw, int sh, int sw)
{
    avgpool_job j = {
        x, y, h, w, kh, kw, sh, sw, (h - kh) / sh + 1, (w - kw) / sw + 1};
    return j;
}

/* Planes [b, e). */
CPU_HOT static void avgpool_fwd_part(void *v, size_t b, size_t e)
{
    const avgpool_job *j = v;
    size_t in = (size_t)j->h * j->w, out = (size_t)j->oh * j->ow;
    for (size_t p = b; p < e; p++) {
        const float *x = j->x + p * in;
        float *y = j->y + p * out;
        for (int oy = 0; oy < j->oh; oy++, y += j->ow)
            for (int ox = 0; ox < j->ow; ox++)
                y[ox] = stk_avgpool_at(x, j->w, j->kh, j->kw, j->sh, j->sw, oy,
                                       ox);
    }
}

/* Runs part over the planes, from src into dst (forward: x into y;
 * backward: dy into dx), in pieces of about GRAIN input pixels. */
static int avgpool_run(stk_backend *be, stk_pool_fn part, const float *src,
                       float *dst, int planes, int h, int w, int kh, int kw,
                       int sh, int sw)
{
    avgpool_job j = avgpool_plan(src, dst, h, w, kh, kw, sh, sw);
    size_t per = (size_t)h * w;
    stk_pool_for(pool(be), (size_t)planes, (GRAIN + per - 1) / per, part, &j);
    return 0;
}

static int cpu_avgpool_fwd(stk_backend *be, const float *x, int planes, int h,
                           int w, int kh, int kw, int sh, int sw, float *y,
                           stk_err *err)
{
    (void)err;
    return avgpool_run(be, avgpool_fwd_part, x, y, planes, h, w, kh, kw, sh,
                       sw);
}

/* Planes [b, e): a scatter in output order, each output's dy / (kh * kw)
 * added to its window. Every pixel so adds its windows' shares in
 * ascending output order starting from 0, the sum stk_avgpool_grad1
 * gathers (what the CUDA kernel runs): the same floats, also where windows
 * overlap, and a tenth of the gather's work. */
CPU_HOT static void avgpool_bwd_part(void *v, size_t b, size_t e)
{
    const avgpool_job *j = v;
    size_t in = (size_t)j->h * j->w, out = (size_t)j->oh * j->ow;
    float div = stk_avgpool_div(j->kh, j->kw);
    for (size_t p = b; p < e; p++) {
        const float *g = j->x + p * out;
        float *dx = j->y + p * in;
        memset(dx, 0, in * sizeof *dx);
        for (int oy = 0; oy < j->oh; oy++)
            for (int ox = 0; ox < j->ow; ox++) {
                float share = g[(size_t)oy * j->ow + ox] / div;
                float *r = dx + (size_t)oy * j->sh * j->w + (size_t)ox * j->sw;
                for (int dy = 0; dy < j->kh; dy++, r += j->w)
                    for (int dx1 = 0; dx1 < j->kw; dx1++)
                        r[dx1] += share;
            }
    }
}

static int cpu_avgpool_bwd(stk_backend *be, const float *dy, int planes, int h,
                           int w, int kh, int kw, int sh, int sw, float *dx,
                           stk_err *err)
{
    (void)err;
    return avgpool_run(be, avgpool_bwd_part, dy, dx, planes, h, w, kh, kw, sh,
                       sw);
}

/* ---- residual add and device copies --------------------------------------
 */

CPU_HOT3 static void add_part(void *v, size_t b, size_t e)
{
    const ew_job *j = v;
    const float *x = j->x, *y = j->y;
    float *out = j->out;
    for (size_t i = b; i < e; i++)
        out[i] = stk_add1(x[i], y[i]);
}

static int cpu_add(stk_backend *be, const float *a, const float *b, float *y,
                   size_t n, stk_err *err)
{
    (void)err;
    ew_job j = {.x = a, .y = b, .out = y};
    stk_pool_for(pool(be), n, GRAIN, add_part, &j);
    return 0;
}

static int cpu_copy_dev(stk_backend *be, float *dst, const float *src,
                        size_t n, stk_err *err)
{
    return cpu_copy(be, dst, src, n * sizeof *dst, 1, err);
}

/* ---- batch normalisation -------------------------------------------------
 */

/* x [n, c, hw] channel by channel. Each channel's sums are taken in an
 * order fixed by the shape alone, so they do not depend on the thread
 * count: with hw > 1 in BN_CHUNKS chunks of the batch (bn_chunks), each
 * chunk's planes in sample order in BN_LANES double lanes (independent
 * chains the compiler vectorises, as in bias_grad) added up by a fixed
 * tree, the chunks' totals added in order; with hw = 1 (BatchNorm1d) by
 * one thread a channel, the rows in order, BN_BLOCK channels side by side
 * along memory. The element-wise passes (apply, input gradient) split
 * planes, or rows when hw = 1. */
enum { BN_LANES = 16, BN_BLOCK = 256 };

typedef struct bn_job {
    const float *x, *dy, *shift, *mean, *var, *gamma, *beta, *sums;
    const float *res; /* bn_apply's residual (stk_bn_add1), or NULL */
    float *out;
    double *part; /* the sums' chunks: [BN_CHUNKS][2][c] (hw > 1) */
    int n, c, hw, relu;
    float eps, inv_count;
    double scale;
} bn_job;

static double lanes_total(double *lane)
{
    for (int w = BN_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    return lane[0];
}

/* Plane p (hw floats) into the lanes: its values, or (x - shift)^2. */
static void lanes_add(double *lane, const float *p, int hw, const float *shift,
                      float s)
{
    int i = 0;
    if (shift) {
        for (; i + BN_LANES <= hw; i += BN_LANES)
            for (int l = 0; l < BN_LANES; l++)
                lane[l] += stk_bn_sq1(p[i + l], s);
        for (; i < hw; i++)
            lane[i % BN_LANES] += stk_bn_sq1(p[i], s);
        return;
    }
    for (; i + BN_LANES <= hw; i += BN_LANES)
        for (int l = 0; l < BN_LANES; l++)
            lane[l] += p[i + l];
    for (; i < hw; i++)
        lane[i % BN_LANES] += p[i];
}

/* hw = 1: channels [b, e), rows in order. */
static void bn_sums_rows(const bn_job *j, size_t b, size_t e)
{
    double acc[BN_BLOCK];
    for (size_t c0 = b; c0 < e; c0 += BN_BLOCK) {
        size_t nc = e - c0 < BN_BLOCK ? e - c0 : BN_BLOCK;
        memset(acc, 0, sizeof acc);
        for (int r = 0; r < j->n; r++) {
            const float *p = j->x + (size_t)r * j->c + c0;
            if (j->shift)
                for (size_t c = 0; c < nc; c++)
                    acc[c] += stk_bn_sq1(p[c], j->shift[c0 + c]);
            else
                for (size_t c = 0; c < nc; c++)
                    acc[c] += p[c];
        }
        for (size_t c = 0; c < nc; c++)
            j->out[c0 + c] = (float)(acc[c] * j->scale);
    }
}

/* The sums over planes (hw > 1) go through memory in blocks of
 * BN_CH_BLOCK channels, a sample's planes of the block (one contiguous
 * run) after another, each channel's lanes adding its planes in sample
 * order (a channel at a time read short runs a sample apart, which the
 * hardware prefetcher picks up late, and the passes waited on memory).
 * The batch is cut into BN_CHUNKS fixed chunks of samples, whose lane
 * totals are added in chunk order: a thread takes whole chunks, the
 * samples its own convolution range wrote (model_conv.c), where a split
 * by channel had every thread read every sample (2 threads: 2x the
 * gradient sums' time on resnet20). The chunks follow the batch, not the
 * threads, so neither do the floats. */
enum { BN_CH_BLOCK = 32, BN_CHUNKS = 8 };

/* Samples [*r0, *r1) of chunk k. */
static void bn_chunk(const bn_job *j, size_t k, int *r0, int *r1)
{
    *r0 = (int)((size_t)j->n * k / BN_CHUNKS);
    *r1 = (int)((size_t)j->n * (k + 1) / BN_CHUNKS);
}

/* Chunks [b, e) of the sums (or of (x - shift)^2) into part[k][0][ch]. */
CPU_HOT3 static void bn_sums_part(void *v, size_t b, size_t e)
{
    const bn_job *j = v;
    double lane[BN_CH_BLOCK][BN_LANES];
    for (size_t q = b; q < e; q++) {
        int r0, r1;
        bn_chunk(j, q, &r0, &r1);
        for (int c0 = 0; c0 < j->c; c0 += BN_CH_BLOCK) {
            int nc = j->c - c0 < BN_CH_BLOCK ? j->c - c0 : BN_CH_BLOCK;
            memset(lane, 0, sizeof lane);
            for (int r = r0; r < r1; r++)
                for (int k = 0; k < nc; k++)
                    lanes_add(lane[k],
                              j->x + ((size_t)r * j->c + c0 + k) * j->hw,
                              j->hw, j->shift,
                              j->shift ? j->shift[c0 + k] : 0.0f);
            for (int k = 0; k < nc; k++)
                j->part[q * 2 * j->c + c0 + k] = lanes_total(lane[k]);
        }
    }
}

/* Channels in parallel, each at least about GRAIN elements (hw = 1). */
static void bn_channels(stk_backend *be, const bn_job *j, stk_pool_fn part)
{
    size_t per = (size_t)j->n * j->hw;
    stk_pool_for(pool(be), (size_t)j->c, (GRAIN + per - 1) / per, part,
                 (void *)j);
}

/* The BN_CHUNKS chunks in parallel (hw > 1), into the backend's scratch
 * of 2 * BN_CHUNKS * c doubles (grown as needed). */
static int bn_chunks(stk_backend *be, bn_job *j, stk_pool_fn part,
                     stk_err *err)
{
    cpu_state *st = be->impl;
    size_t need = (size_t)2 * BN_CHUNKS * j->c;
    if (need > st->bn_len) {
        double *p = realloc(st->bn_part, need * sizeof *p);
        if (!p)
            return stk_fail(err, STK_ENOMEM,
                            "cpu: cannot allocate a batchnorm's sums of %d "
                            "channels",
                            j->c);
        st->bn_part = p;
        st->bn_len = need;
    }
    j->part = st->bn_part;
    size_t per = ((size_t)j->n * j->c * j->hw + BN_CHUNKS - 1) / BN_CHUNKS;
    stk_pool_for(pool(be), BN_CHUNKS, (GRAIN + per - 1) / per, part, j);
    return 0;
}

/* Sum w of channel ch over the chunks, in chunk order. */
static double bn_chunks_total(const bn_job *j, int w, int ch)
{
    double t = 0.0;
    for (size_t q = 0; q < BN_CHUNKS; q++)
        t += j->part[(q * 2 + (size_t)w) * j->c + ch];
    return t;
}

static void bn_planes(stk_backend *be, const bn_job *j, stk_pool_fn part)
{
    size_t units = (size_t)j->n * (j->hw == 1 ? 1 : (size_t)j->c);
    size_t per = j->hw == 1 ? (size_t)j->c : (size_t)j->hw;
    stk_pool_for(pool(be), units, (GRAIN + per - 1) / per, part, (void *)j);
}

CPU_HOT3 static void bn_sums_rows_part(void *v, size_t b, size_t e)
{
    bn_sums_rows(v, b, e);
}

static int cpu_bn_sums(stk_backend *be, const float *x, int n, int c, int hw,
                       const float *shift, double scale, float *sums,
                       stk_err *err)
{
    bn_job j = {.x = x,
                .shift = shift,
                .out = sums,
                .n = n,
                .c = c,
                .hw = hw,
                .scale = scale};
    if (hw == 1) {
        bn_channels(be, &j, bn_sums_rows_part);
        return 0;
    }
    int rc = bn_chunks(be, &j, bn_sums_part, err);
    for (int ch = 0; ch < c && !rc; ch++)
        sums[ch] = (float)(bn_chunks_total(&j, 0, ch) * scale);
    return rc;
}

static stk_bn_fwd_coef bn_fwd_coef(const bn_job *j, size_t ch)
{
    return stk_bn_fwd_coef_of(j->mean[ch], j->var[ch], j->eps, j->gamma[ch],
                              j->beta[ch]);
}

/* Planes [b, e) (hw > 1), or rows [b, e) a block of channels at a time. */
CPU_HOT3 static void bn_apply_part(void *v, size_t b, size_t e)
{
    const bn_job *j = v;
    if (j->hw == 1) {
        stk_bn_fwd_coef k[BN_BLOCK];
        for (size_t c0 = 0; c0 < (size_t)j->c; c0 += BN_BLOCK) {
            size_t nc = j->c - c0 < BN_BLOCK ? j->c - c0 : BN_BLOCK;
            for (size_t c = 0; c < nc; c++)
                k[c] = bn_fwd_coef(j, c0 + c);
            for (size_t r = b; r < e; r++) {
                size_t at = r * j->c + c0;
                if (j->res)
                    for (size_t c = 0; c < nc; c++)
                        j->out[at + c] = stk_bn_add1(
                            j->x[at + c], j->res[at + c], k[c], j->relu);
                else
                    for (size_t c = 0; c < nc; c++)
                        j->out[at + c] =
                            stk_bn_apply1(j->x[at + c], k[c], j->relu);
            }
        }
        return;
    }
    for (size_t q = b; q < e; q++) { /* each case its own loop: vectorises */
        stk_bn_fwd_coef k = bn_fwd_coef(j, q % j->c);
        const float *x = j->x + q * j->hw, *s = j->res ? j->res + q * j->hw : 0;
        float *y = j->out + q * j->hw;
        if (s && j->relu)
            for (int i = 0; i < j->hw; i++)
                y[i] = stk_bn_add1(x[i], s[i], k, 1);
        else if (s)
            for (int i = 0; i < j->hw; i++)
                y[i] = stk_bn_add1(x[i], s[i], k, 0);
        else if (j->relu)
            for (int i = 0; i < j->hw; i++)
                y[i] = stk_bn_apply1(x[i], k, 1);
        else
            for (int i = 0; i < j->hw; i++)
                y[i] = stk_bn_apply1(x[i], k, 0);
    }
}

static int cpu_bn_apply(stk_backend *be, const float *x, const float *res,
                        float *y, int n, int c, int hw, const float *mean,
                        const float *var, float eps, const float *gamma,
                        const float *beta, bool relu, stk_err *err)
{
    (void)err;
    bn_job j = {.x = x,
                .res = res,
                .out = y,
                .n = n,
                .c = c,
                .hw = hw,
                .mean = mean,
                .var = var,
                .eps = eps,
                .gamma = gamma,
                .beta = beta,
                .relu = relu};
    bn_planes(be, &j, bn_apply_part);
    return 0;
}

/* hw = 1: channels [b, e), rows in order. */
static void bn_grad_sums_rows(const bn_job *j, size_t b, size_t e)
{
    double sg[BN_BLOCK], sgx[BN_BLOCK];
    stk_bn_fwd_coef f[BN_BLOCK];
    for (size_t c0 = b; c0 < e; c0 += BN_BLOCK) {
        size_t nc = e - c0 < BN_BLOCK ? e - c0 : BN_BLOCK;
        memset(sg, 0, sizeof sg);
        memset(sgx, 0, sizeof sgx);
        for (size_t c = 0; j->relu && c < nc; c++)
            f[c] = bn_fwd_coef(j, c0 + c);
        for (int r = 0; r < j->n; r++) {
            size_t at = (size_t)r * j->c + c0;
            for (size_t c = 0; c < nc; c++) {
                float g = stk_bn_g1(j->dy[at + c], j->x[at + c],
                                    j->relu ? &f[c] : NULL);
                sg[c] += g;
                sgx[c] += stk_bn_gx1(g, j->x[at + c], j->mean[c0 + c]);
            }
        }
        for (size_t c = 0; c < nc; c++) {
            j->out[c0 + c] = (float)sg[c];
            j->out[j->c + c0 + c] =
                (float)(sgx[c] * stk_bn_invstd(j->var[c0 + c], j->eps));
        }
    }
}

/* Eight of the BN_LANES double lanes, and eight floats, as vectors of the
 * compiler's (each clone makes them its widest registers; the lanes keep
 * their order, so every clone adds the same doubles in the same order). */
typedef double bn_d8 __attribute__((vector_size(64)));
typedef float bn_f8 __attribute__((vector_size(32)));
typedef int32_t bn_i8 __attribute__((vector_size(32)));

/* stk_bn_g1 on elements [0, 8) into *g: dy where the fused ReLU's output,
 * stk_bn_apply1 of x, is above 0, else +0 (the same bits as
 * stk_relu_grad1, NaN included). Vectors pass by pointer: a vector
 * argument's ABI would depend on the clone's target. */
static void g8_at(bn_f8 *g, const float *dy, const float *x,
                  const stk_bn_fwd_coef *f)
{
    memcpy(g, dy, sizeof *g);
    if (f) {
        bn_f8 y;
        memcpy(&y, x, sizeof y);
        y = STK_BN_LINEAR(y, *f); /* above 0 where its ReLU is */
        *g = (bn_f8)((y > 0.0f) & (bn_i8)*g);
    }
}

/* The plane at element `at` into the lanes of sum g and sum g (x - mean):
 * stk_bn_gx1 element-wise, element i into lane i % BN_LANES. */
static void grad_lanes_add(double *sg, double *sgx, const bn_job *j, size_t at,
                           float mean, const stk_bn_fwd_coef *f)
{
    _Static_assert(BN_LANES == 16, "two bn_d8 of lanes");
    const float *dy = j->dy + at, *x = j->x + at;
    bn_d8 a[2], b[2], m = (bn_d8){0} + (double)mean;
    memcpy(a, sg, sizeof a);
    memcpy(b, sgx, sizeof b);
    int i = 0;
    for (; i + BN_LANES <= j->hw; i += BN_LANES)
        for (int h = 0; h < 2; h++) {
            int k = i + 8 * h;
            bn_f8 gf, xf;
            g8_at(&gf, dy + k, x + k, f);
            memcpy(&xf, x + k, sizeof xf);
            bn_d8 g = __builtin_convertvector(gf, bn_d8);
            a[h] += g;
            b[h] += g * (__builtin_convertvector(xf, bn_d8) - m);
        }
    memcpy(sg, a, sizeof a);
    memcpy(sgx, b, sizeof b);
    for (; i < j->hw; i++) {
        float g = stk_bn_g1(dy[i], x[i], f);
        sg[i % BN_LANES] += g;
        sgx[i % BN_LANES] += stk_bn_gx1(g, x[i], mean);
    }
}

/* Chunks [b, e) of sum g and sum g (x - mean) in lanes, as bn_sums_part,
 * into part[k][0][ch] and part[k][1][ch]. */
CPU_HOT3 static void bn_grad_sums_part(void *v, size_t b, size_t e)
{
    const bn_job *j = v;
    double sg[BN_CH_BLOCK][BN_LANES], sgx[BN_CH_BLOCK][BN_LANES];
    stk_bn_fwd_coef f[BN_CH_BLOCK];
    for (size_t q = b; q < e; q++) {
        int r0, r1;
        bn_chunk(j, q, &r0, &r1);
        double *part = j->part + q * 2 * j->c;
        for (int c0 = 0; c0 < j->c; c0 += BN_CH_BLOCK) {
            int nc = j->c - c0 < BN_CH_BLOCK ? j->c - c0 : BN_CH_BLOCK;
            memset(sg, 0, sizeof sg);
            memset(sgx, 0, sizeof sgx);
            for (int k = 0; j->relu && k < nc; k++)
                f[k] = bn_fwd_coef(j, (size_t)(c0 + k));
            for (int r = r0; r < r1; r++)
                for (int k = 0; k < nc; k++)
                    grad_lanes_add(sg[k], sgx[k], j,
                                   ((size_t)r * j->c + c0 + k) * j->hw,
                                   j->mean[c0 + k], j->relu ? &f[k] : NULL);
            for (int k = 0; k < nc; k++) {
                part[c0 + k] = lanes_total(sg[k]);
                part[j->c + c0 + k] = lanes_total(sgx[k]);
            }
        }
    }
}

CPU_HOT3 static void bn_grad_sums_rows_part(void *v, size_t b, size_t e)
{
    bn_grad_sums_rows(v, b, e);
}

static int cpu_bn_grad_sums(stk_backend *be, const float *dy, const float *x,
                            int n, int c, int hw, const float *mean,
                            const float *var, float eps, const float *gamma,
                            const float *beta, bool relu, float *sums,
                            stk_err *err)
{
    bn_job j = {.dy = dy,
                .x = x,
                .n = n,
                .c = c,
                .hw = hw,
                .mean = mean,
                .var = var,
                .eps = eps,
                .gamma = gamma,
                .beta = beta,
                .relu = relu,
                .out = sums};
    if (hw == 1) {
        bn_channels(be, &j, bn_grad_sums_rows_part);
        return 0;
    }
    int rc = bn_chunks(be, &j, bn_grad_sums_part, err);
    for (int ch = 0; ch < c && !rc; ch++) {
        sums[ch] = (float)bn_chunks_total(&j, 0, ch);
        sums[c + ch] = (float)(bn_chunks_total(&j, 1, ch) *
                               stk_bn_invstd(var[ch], eps));
    }
    return rc;
}

static stk_bn_bwd_coef bn_bwd_coef(const bn_job *j, size_t ch)
{
    return stk_bn_bwd_coef_of(j->mean[ch], j->var[ch], j->eps, j->gamma[ch],
                              j->sums[ch], j->sums[j->c + ch], j->inv_count);
}

/* Planes [b, e) (hw > 1), or rows [b, e) a block of channels at a time. */
CPU_HOT3 static void bn_input_grad_part(void *v, size_t b, size_t e)
{
    const bn_job *j = v;
    if (j->hw == 1) {
        stk_bn_bwd_coef k[BN_BLOCK];
        stk_bn_fwd_coef f[BN_BLOCK];
        for (size_t c0 = 0; c0 < (size_t)j->c; c0 += BN_BLOCK) {
            size_t nc = j->c - c0 < BN_BLOCK ? j->c - c0 : BN_BLOCK;
            for (size_t c = 0; c < nc; c++) {
                k[c] = bn_bwd_coef(j, c0 + c);
                if (j->relu)
                    f[c] = bn_fwd_coef(j, c0 + c);
            }
            for (size_t r = b; r < e; r++) {
                size_t at = r * j->c + c0;
                for (size_t c = 0; c < nc; c++) {
                    float x = j->x[at + c];
                    j->out[at + c] = stk_bn_dx1(
                        stk_bn_g1(j->dy[at + c], x, j->relu ? &f[c] : NULL),
                        x, k[c]);
                }
            }
        }
        return;
    }
    for (size_t q = b; q < e; q++) {
        stk_bn_bwd_coef k = bn_bwd_coef(j, q % j->c);
        size_t at = q * j->hw;
        if (j->relu) { /* two loops without a test in them, which vectorise */
            stk_bn_fwd_coef f = bn_fwd_coef(j, q % j->c);
            for (int i = 0; i < j->hw; i++) {
                float x = j->x[at + i];
                j->out[at + i] =
                    stk_bn_dx1(stk_bn_g1(j->dy[at + i], x, &f), x, k);
            }
        } else {
            for (int i = 0; i < j->hw; i++)
                j->out[at + i] =
                    stk_bn_dx1(j->dy[at + i], j->x[at + i], k);
        }
    }
}

static int cpu_bn_input_grad(stk_backend *be, const float *dy, const float *x,
                             int n, int c, int hw, const float *mean,
                             const float *var, float eps, const float *gamma,
                             const float *beta, bool relu, const float *sums,
                             float inv_count, float *dx, stk_err *err)
{
    (void)err;
    bn_job j = {.dy = dy,
                .x = x,
                .n = n,
                .c = c,
                .hw = hw,
                .mean = mean,
                .var = var,
                .eps = eps,
                .gamma = gamma,
                .beta = beta,
                .relu = relu,
                .sums = sums,
                .inv_count = inv_count,
                .out = dx};
    bn_planes(be, &j, bn_input_grad_part);
    return 0;
}

/* A few hundred channels at most: not worth waking the pool. */
static int cpu_bn_running(stk_backend *be, float *run_mean, float *run_var,
                          const float *mean, const float *var, int c,
                          float momentum, float unbias, stk_err *err)
{
    (void)be;
    (void)err;
    for (int ch = 0; ch < c; ch++) {
        run_mean[ch] = stk_bn_running1(run_mean[ch], mean[ch], momentum);
        run_var[ch] =
            stk_bn_running1(run_var[ch], (double)var[ch] * unbias, momentum);
    }
    return 0;
}

/* ---- dropout ----------------------------------------------------------------------- */

typedef struct dropout_job {
    float *x;         /* element `first` of the tensor */
    size_t n, first, group;
    float p;
    stk_philox_key key;
    uint64_t stream;
} dropout_job;

/* Philox blocks [b, e) of those the elements [first, first + n) draw from
 * (block 0 here is the one holding element first's group): four groups
 * (dropout2d: a channel of a sample) or elements each, the same numbers
 * stk_dropout_scale1 draws. */
CPU_HOT static void dropout_part(void *v, size_t b, size_t e)
{
    const dropout_job *j = v;
    uint32_t r[4];
    float kept = stk_dropout_kept_scale(j->p);
    size_t g0 = j->first / j->group, g1 = (j->first + j->n - 1) / j->group + 1;
    size_t lo = (g0 / 4 + b) * 4, hi = (g0 / 4 + e) * 4;
    lo = lo > g0 ? lo : g0; /* the first block may start before g0 */
    for (size_t g = lo; g < hi && g < g1; g++) {
        if (g == lo || g % 4 == 0)
            stk_philox_block(j->key, j->stream, g / 4, r);
        float scale = stk_dropout_keep(stk_u01(r[g % 4]), j->p, kept);
        size_t from = g * j->group > j->first ? g * j->group - j->first : 0;
        size_t to = (g + 1) * j->group - j->first;
        for (size_t i = from; i < to && i < j->n; i++)
            j->x[i] *= scale;
    }
}

static int cpu_dropout(stk_backend *be, float *x, size_t n, size_t first,
                       size_t group, float p, stk_philox_key key,
                       uint64_t stream, stk_err *err)
{
    (void)err;
    dropout_job j = {x, n, first, group, p, key, stream};
    size_t g0 = first / group, g1 = (first + n - 1) / group + 1;
    size_t blocks = (g1 - 1) / 4 - g0 / 4 + 1, per = 4 * group;
    stk_pool_for(pool(be), blocks, (GRAIN + per - 1) / per, dropout_part, &j);
    return 0;
}

/* ---- loss and input ----------------------------------------------------------------- */

/* The first row whose label is not in 0..c-1, or -1. */
static int xent_bad_row(const int32_t *labels, int n, int c)
{
    for (int r = 0; r < n; r++)
        if (labels[r] < 0 || labels[r] >= c)
            return r;
    return -1;
}

/* The row losses' sum, in row order (and dlogits). */
static double xent_sum(const float *logits, const int32_t *labels, int n,
                       int c, float smoothing, float *dlogits)
{
    double sum = 0.0;
    for (int r = 0; r < n; r++)
        sum += stk_xent_row(logits, labels, n, c, smoothing, r, dlogits);
    return sum;
}

static int cpu_xent(stk_backend *be, const float *logits,
                    const int32_t *labels, int n, int c, float smoothing,
                    float *loss, float *dlogits, stk_err *err)
{
    (void)be;
    int r = xent_bad_row(labels, n, c);
    if (r >= 0)
        return stk_fail(err, STK_ERANGE,
                        "cross-entropy: label %d of row %d is not in "
                        "0..%d",
                        labels[r], r, c - 1);
    *loss = (float)(xent_sum(logits, labels, n, c, smoothing, dlogits) / n);
    return 0;
}

/* ---- training metrics (stk_metrics: ops_inline.h) ----------------------------- */

static int cpu_xent_metrics(stk_backend *be, const float *logits,
                            const int32_t *labels, int n, int c,
                            float smoothing, float *dlogits, stk_metrics *m,
                            stk_err *err)
{
    (void)be, (void)err;
    int r = xent_bad_row(labels, n, c);
    if (r >= 0 && m->bad_row == 0) {
        m->bad_row = r + 1;
        m->bad_label = labels[r];
    }
    if (r < 0)
        stk_metrics_add_loss(m, xent_sum(logits, labels, n, c, smoothing, dlogits), n);
    return 0;
}

static int cpu_count_hits(stk_backend *be, const float *logits,
                          const int32_t *labels, int n, int c, stk_metrics *m,
                          stk_err *err)
{
    (void)be, (void)err;
    int hits = 0;
    for (int r = 0; r < n; r++)
        hits += stk_argmax_row(logits, c, r) == labels[r];
    m->step_hits += hits;
    return 0;
}

static int cpu_metrics_step(stk_backend *be, stk_metrics *m, int n,
                            uint64_t step, uint64_t epoch, stk_err *err)
{
    (void)be, (void)err;
    stk_metrics_close(m, n, step, epoch);
    return 0;
}

static int cpu_sumsq(stk_backend *be, const float *x, size_t n, double *out,
                     stk_err *err);

static int cpu_grad_norm(stk_backend *be, float *g, size_t n, float clip,
                         uint64_t step, uint64_t epoch, stk_metrics *m,
                         stk_err *err)
{
    double ss;
    int rc = cpu_sumsq(be, g, n, &ss, err);
    float f = rc ? 1.0f : stk_metrics_norm(m, ss, clip, step, epoch);
    return rc || f == 1.0f ? rc : cpu_scale(be, n, f, g, err);
}

typedef struct transform_job {
    const uint8_t *x;
    const uint64_t *ids;
    const stk_transform *t;
    float *y;
} transform_job;

/* Samples [b, e): one draw per sample, then its pixels in order: the same
 * floats as stk_transform1 per element (a draw per pixel, the reference the
 * tests compare with; CUDA draws once per sample too), without per-pixel
 * index arithmetic or Philox calls. */
CPU_HOT static void transform_part(void *v, size_t b, size_t e)
{
    const transform_job *j = v;
    const stk_transform *t = j->t;
    size_t per = (size_t)t->c * t->h * t->w;
    float *y = j->y + b * per;
    for (size_t s = b; s < e; s++) {
        int dy, dx, mirror;
        stk_transform_draw(t, j->ids[s], &dy, &dx, &mirror);
        const uint8_t *img = j->x + s * per;
        if (!dy && !dx && !mirror) { /* no augmentation: a straight loop */
            size_t plane = (size_t)t->h * t->w;
            for (int c = 0; c < t->c; c++, img += plane)
                for (size_t i = 0; i < plane; i++)
                    *y++ = stk_normalize1((float)img[i], t, c);
            continue;
        }
        for (int c = 0; c < t->c; c++)
            for (int r = 0; r < t->h; r++)
                for (int q = 0; q < t->w; q++)
                    *y++ = stk_transform_px(img, t, c, r, q, dy, dx, mirror);
    }
}

static int cpu_transform(stk_backend *be, const uint8_t *x,
                         const uint64_t *ids, int n, const stk_transform *t,
                         float *y, stk_err *err)
{
    (void)err;
    transform_job j = {x, ids, t, y};
    size_t per = (size_t)t->c * t->h * t->w;
    if (n <= 0 || per == 0)
        return 0;
    stk_pool_for(pool(be), (size_t)n, (GRAIN + per - 1) / per, transform_part,
                 &j);
    return 0;
}

/* ---- reductions and optimizers ---------------------------------------------------- */

typedef struct sumsq_job {
    const float *x;
    size_t n, chunk;
    double *partial;
} sumsq_job;

/* Chunks [b, e), each in four vectorisable double lanes. */
CPU_HOT static void sumsq_part(void *v, size_t b, size_t e)
{
    const sumsq_job *j = v;
    for (size_t c = b; c < e; c++) {
        size_t from = c * j->chunk;
        size_t to = from + j->chunk < j->n ? from + j->chunk : j->n;
        double lane[4] = {0.0, 0.0, 0.0, 0.0};
        size_t i = from;
        for (; i + 4 <= to; i += 4)
            for (int l = 0; l < 4; l++)
                lane[l] += (double)j->x[i + l] * j->x[i + l];
        for (; i < to; i++)
            lane[0] += (double)j->x[i] * j->x[i];
        j->partial[c] = (lane[0] + lane[1]) + (lane[2] + lane[3]);
    }
}

/* The chunk size depends on n alone, and the chunks are added in order, so
 * the result is the same for any number of threads. */
static int cpu_sumsq(stk_backend *be, const float *x, size_t n, double *out,
                     stk_err *err)
{
    (void)err;
    enum { MAX_CHUNKS = 1024 };
    double partial[MAX_CHUNKS];
    size_t chunk = SUMSQ_CHUNK;
    if ((n + chunk - 1) / chunk > MAX_CHUNKS)
        chunk = (n + MAX_CHUNKS - 1) / MAX_CHUNKS;
    sumsq_job j = {x, n, chunk, partial};
    size_t chunks = (n + chunk - 1) / chunk;
    stk_pool_for(pool(be), chunks, 1, sumsq_part, &j);
    double s = 0.0;
    for (size_t c = 0; c < chunks; c++)
        s += partial[c];
    *out = s;
    return 0;
}

typedef struct optim_job {
    float *w, *m, *v;
    const float *g;
    const stk_sgd_cfg *sgd;
    const stk_adamw_cfg *adamw;
} optim_job;

/* The settings copied to a local: through the pointer the compiler must
 * assume every store to w may change them, and reloads and tests them per
 * element instead of vectorising. */
CPU_HOT static void sgd_part(void *v, size_t b, size_t e)
{
    const optim_job *j = v;
    const stk_sgd_cfg c = *j->sgd;
    float *w = j->w, *m = j->m;
    const float *g = j->g;
    for (size_t i = b; i < e; i++)
        stk_sgd1(w, g, m, i, &c);
}

static int cpu_sgd(stk_backend *be, float *w, const float *g, float *buf,
                   size_t n, const stk_sgd_cfg *cfg, stk_err *err)
{
    (void)err;
    if (stk_update_refused(cfg->guard))
        return 0;
    optim_job j = {.w = w, .m = buf, .g = g, .sgd = cfg};
    stk_pool_for(pool(be), n, GRAIN, sgd_part, &j);
    return 0;
}

CPU_HOT static void adamw_part(void *v, size_t b, size_t e)
{
    const optim_job *j = v;
    const stk_adamw_cfg c = *j->adamw; /* a local, as in sgd_part */
    float *w = j->w, *m = j->m, *vv = j->v;
    const float *g = j->g;
    for (size_t i = b; i < e; i++)
        stk_adamw1(w, g, m, vv, i, &c);
}

static int cpu_adamw(stk_backend *be, float *w, const float *g, float *m,
                     float *v, size_t n, const stk_adamw_cfg *cfg,
                     stk_err *err)
{
    (void)err;
    if (stk_update_refused(cfg->guard))
        return 0;
    optim_job j = {.w = w, .m = m, .v = v, .g = g, .adamw = cfg};
    stk_pool_for(pool(be), n, GRAIN, adamw_part, &j);
    return 0;
}

const backend_ops stk_cpu_ops = {
    .destroy = cpu_destroy,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_free,
    .copy = cpu_copy,
    .memzero = cpu_memzero,
    .sync = cpu_sync,
    .event_create = cpu_event_create,
    .event_destroy = cpu_event_destroy,
    .event_record = cpu_event_record,
    .stream_wait = cpu_stream_wait,
    .event_query = cpu_event_query,
    .event_wait = cpu_event_wait,
    .upload = cpu_upload,
    .gemm = cpu_gemm,
    .gemm_batched = cpu_gemm_batched,
    .relu_fwd = cpu_relu_fwd,
    .relu_bwd = cpu_relu_bwd,
    .bias_add = cpu_bias_add,
    .bias_grad = cpu_bias_grad,
    .im2col = cpu_im2col,
    .col2im = cpu_col2im,
    .swap01 = cpu_swap01,
    .wino_filter = cpu_wino_filter,
    .wino_filter_grad = cpu_wino_filter_grad,
    .wino_input = cpu_wino_input,
    .wino_input_grad = cpu_wino_input_grad,
    .wino_output = cpu_wino_output,
    .wino_output_grad = cpu_wino_output_grad,
    .maxpool_fwd = cpu_maxpool_fwd,
    .maxpool_bwd = cpu_maxpool_bwd,
    .avgpool_fwd = cpu_avgpool_fwd,
    .avgpool_bwd = cpu_avgpool_bwd,
    .add = cpu_add,
    .copy_dev = cpu_copy_dev,
    .bn_sums = cpu_bn_sums,
    .bn_apply = cpu_bn_apply,
    .bn_grad_sums = cpu_bn_grad_sums,
    .bn_input_grad = cpu_bn_input_grad,
    .bn_running = cpu_bn_running,
    .dropout = cpu_dropout,
    .xent = cpu_xent,
    .xent_metrics = cpu_xent_metrics,
    .count_hits = cpu_count_hits,
    .metrics_step = cpu_metrics_step,
    .grad_norm = cpu_grad_norm,
    .transform = cpu_transform,
    .axpy = cpu_axpy,
    .scale = cpu_scale,
    .sumsq = cpu_sumsq,
    .sgd = cpu_sgd,
    .adamw = cpu_adamw,
};
