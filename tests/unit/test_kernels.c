/* test_kernels - the CPU backend (the reference every backend is compared
 * with): Philox known answers, GEMM against a double loop, and every op's
 * backward against finite differences of a double-precision reference
 * forward. */
#include "unit.h"

#include "kernels/cpu_gemm.h"
#include "kernels/kernels.h"

#include <math.h>
#include <stdatomic.h>

static stk_backend *be;

static int setup(void **state)
{
    (void)state;
    stk_err err;
    return stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err);
}

static int teardown(void **state)
{
    (void)state;
    stk_backend_destroy(be);
    return 0;
}

static double frand(uint64_t *s) /* deterministic, in [-1, 1) */
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*s >> 11) / (double)(1ull << 52) - 1.0;
}

static void fill(float *x, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++)
        x[i] = (float)frand(&seed);
}

/* n floats from fill(seed), malloc'd */
static float *filled(size_t n, uint64_t seed)
{
    float *x = malloc(n * sizeof *x);
    assert_non_null(x);
    fill(x, n, seed);
    return x;
}

/* |a - b| <= tol * max(1, |b|) for every element, else a failure naming i */
static void near(const float *a, const double *b, size_t n, double tol,
                 const char *what)
{
    for (size_t i = 0; i < n; i++) {
        double scale = fabs(b[i]) > 1.0 ? fabs(b[i]) : 1.0;
        if (!(fabs(a[i] - b[i]) <= tol * scale))
            fail_msg("%s[%zu]: %.7g, expected %.7g", what, i, a[i], b[i]);
    }
}

static void philox_known_answers(void **state)
{
    (void)state;
    /* Random123's kat_vectors for philox4x32 10 */
    struct {
        uint32_t ctr[4], key[2], out[4];
    } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
         {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int t = 0; t < 3; t++) {
        uint32_t c[4];
        memcpy(c, kat[t].ctr, sizeof c);
        stk_philox4x32_10(c, (stk_philox_key){kat[t].key[0], kat[t].key[1]});
        assert_memory_equal(c, kat[t].out, sizeof c);
    }
}

/* C = 1.5 op(A) op(B) - 0.5 C against a double reference, every
 * transpose, padded leading dimensions. */
static void gemm_check(int m, int n, int k)
{
    int pad = 3;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            int lda = (ta ? m : k) + pad, ldb = (tb ? k : n) + pad,
                ldc = n + pad;
            size_t na = (size_t)(k + pad) * (m + pad),
                   nb = (size_t)(k + pad) * (n + pad), nc = (size_t)m * ldc;
            float *a = malloc(na * 4), *b = malloc(nb * 4), *c = malloc(nc * 4);
            double *want = malloc(nc * sizeof *want);
            assert_true(a && b && c && want);
            fill(a, na, 1 + ta);
            fill(b, nb, 3 + tb);
            fill(c, nc, 5);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double s = 0;
                    for (int p = 0; p < k; p++)
                        s += (double)(ta ? a[p * lda + i] : a[i * lda + p]) *
                             (tb ? b[j * ldb + p] : b[p * ldb + j]);
                    want[i * ldc + j] = 1.5 * s - 0.5 * c[i * ldc + j];
                }
            stk_err err;
            assert_int_equal(stk_gemm(be, ta, tb, m, n, k, 1.5f, a, lda, b,
                                      ldb, -0.5f, c, ldc, &err),
                             0);
            for (int i = 0; i < m; i++)
                near(c + i * ldc, want + i * ldc, (size_t)n,
                     k > 9 ? 1e-4 : 1e-5, "gemm");
            free(a), free(b), free(c), free(want);
        }
}

/* K = 2500 crosses the CPU's chunks of K for small outputs (cpu.c), and
 * 200 x 20 x 2500 also cuts C into row panels, each chunked. */
static void gemm_all_transposes(void **state)
{
    (void)state;
    gemm_check(7, 5, 9);
    gemm_check(7, 5, 2500);
    gemm_check(200, 20, 2500);
    stk_err err;
    float x[4];
    assert_int_equal(stk_gemm(be, false, false, 2, 2, 2, 1, x, 1, x, 2, 0, x,
                              2, &err),
                     STK_EINVAL);
}

/* ---- the small-GEMM path (cpu_gemm.c) ----------------------------------- */

typedef struct small_case {
    bool ta, tb;
    int m, n, k, lda, ldb, ldc;
    float alpha, beta;
} small_case;

/* alpha op(A) op(B) + beta C0 in double (C0 unused when beta is 0) */
static double *small_want(const small_case *t, const float *a, const float *b,
                          const float *c0)
{
    double *want = malloc((size_t)t->m * t->ldc * sizeof *want);
    assert_non_null(want);
    for (int i = 0; i < t->m; i++)
        for (int j = 0; j < t->n; j++) {
            double s = 0;
            for (int p = 0; p < t->k; p++)
                s += (double)(t->ta ? a[p * t->lda + i] : a[i * t->lda + p]) *
                     (t->tb ? b[j * t->ldb + p] : b[p * t->ldb + j]);
            want[i * t->ldc + j] =
                t->alpha * s +
                (t->beta != 0.0f ? t->beta * c0[i * t->ldc + j] : 0.0);
        }
    return want;
}

/* One case straight through stk_small_gemm_at in `lanes`: C prefilled
 * with NaN when beta is 0 (C must not be read), columns past n (the
 * padding) untouched. Returns C. */
static float *small_case_at(const small_case *t, int lanes, const float *a,
                            const float *b, const float *c0,
                            const double *want)
{
    size_t nc = (size_t)t->m * t->ldc;
    float *c = malloc(nc * 4);
    assert_non_null(c);
    for (size_t i = 0; i < nc; i++)
        c[i] = t->beta != 0.0f || (int)(i % t->ldc) >= t->n ? c0[i] : NAN;
    stk_small_gemm_at(lanes, t->ta, t->tb, t->m, t->n, t->k, t->alpha, a,
                      t->lda, b, t->ldb, t->beta, c, t->ldc);
    for (int i = 0; i < t->m; i++) {
        near(c + (size_t)i * t->ldc, want + (size_t)i * t->ldc, (size_t)t->n,
             t->k > 9 ? 1e-4 : 1e-5, "small gemm");
        for (int j = t->n; j < t->ldc; j++)
            assert_memory_equal(&c[i * t->ldc + j], &c0[i * t->ldc + j], 4);
    }
    return c;
}

/* The case in 8 lanes and, on a CPU with AVX-512F, in 16: both near the
 * double reference, and the same bytes. */
static void small_case_check(const small_case *t)
{
    size_t na = (size_t)(t->ta ? t->k : t->m) * t->lda,
           nb = (size_t)(t->tb ? t->n : t->k) * t->ldb,
           nc = (size_t)t->m * t->ldc;
    float *a = filled(na, 71 + t->k), *b = filled(nb, 72 + t->n),
          *c0 = filled(nc, 73);
    double *want = small_want(t, a, b, c0);
    float *c8 = small_case_at(t, 8, a, b, c0, want);
    if (stk_small_gemm_lanes() == 16) {
        float *c16 = small_case_at(t, 16, a, b, c0, want);
        if (memcmp(c8, c16, nc * 4) != 0)
            fail_msg("small gemm %c%c %dx%dx%d: 16 lanes differ from 8",
                     t->ta ? 'T' : 'N', t->tb ? 'T' : 'N', t->m, t->n, t->k);
        free(c16);
    }
    free(a), free(b), free(c0), free(c8), free(want);
}

/* Ragged edges of the row tiles (4 x 24 in 8 lanes, 8 x 48 in 16) and
 * of the dot tiles (NT over K > 256: 4 x 3 and 8 x 6) and of K's
 * vectors, every transpose the path serves, beta 0 and 1, alpha 1.5,
 * padded leading dimensions. */
static void small_gemm_matches_double(void **state)
{
    (void)state;
    if (!stk_small_gemm_available())
        skip(); /* no AVX2 + FMA: OpenBLAS serves every GEMM */
    static const int ms[] = {1, 5, 18}, ns[] = {1, 7, 33, 1000},
                     ks[] = {1, 3, 16, 64, 200, 301};
    for (int tr = 0; tr < 3; tr++)
        for (int im = 0; im < 3; im++)
            for (int in = 0; in < 4; in++)
                for (int ik = 0; ik < 6; ik++)
                    for (int beta = 0; beta < 2; beta++) {
                        small_case t = {tr == 1, tr == 2, ms[im], ns[in],
                                        ks[ik], 0, 0, 0, 1.5f, (float)beta};
                        t.lda = (t.ta ? t.m : t.k) + 3;
                        t.ldb = (t.tb ? t.k : t.n) + 5;
                        t.ldc = t.n + 2;
                        small_case_check(&t);
                        /* B's rows 256 bytes apart: the row path copies
                         * its panels (K > 8, more than a tile of rows) */
                        t.ldb = ((t.tb ? t.k : t.n) + 63) / 64 * 64;
                        small_case_check(&t);
                    }
}

/* Through the backend, shapes it hands to the small path (the Winograd
 * point GEMMs as a batch of 16, an im2col-like single GEMM cut into
 * panels, a dot-product GEMM): the double reference, and the same bytes
 * on 1, 2 and 3 threads. */
static void small_gemm_same_on_1_2_3_threads(void **state)
{
    (void)state;
    static const small_case cases[] = {
        {false, false, 32, 1003, 32, 32, 1003, 1003, 1.0f, 0.0f},
        {false, true, 16, 16, 997, 997, 997, 16, 1.0f, 1.0f},
        {true, false, 16, 1003, 16, 16, 1003, 1003, 1.0f, 0.0f},
        {false, false, 32, 999, 144, 147, 1001, 1000, 0.5f, 1.0f},
        {false, true, 32, 16, 999, 1001, 1002, 19, 1.5f, 1.0f},
    };
    for (size_t ci = 0; ci < sizeof cases / sizeof *cases; ci++) {
        const small_case *t = &cases[ci];
        int count = ci < 3 ? 16 : 1;
        size_t sa = (size_t)(t->ta ? t->k : t->m) * t->lda,
               sb = (size_t)(t->tb ? t->n : t->k) * t->ldb,
               sc = (size_t)t->m * t->ldc;
        float *a = malloc(sa * count * 4), *b = malloc(sb * count * 4),
              *c0 = malloc(sc * count * 4), *c[3];
        assert_true(a && b && c0);
        fill(a, sa * count, 81);
        fill(b, sb * count, 82);
        fill(c0, sc * count, 83);
        for (int th = 0; th < 3; th++) {
            stk_backend *bk;
            stk_err err;
            assert_int_equal(
                stk_backend_create(STK_DEV_CPU, 0, th + 1, &bk, &err), 0);
            c[th] = malloc(sc * count * 4);
            assert_non_null(c[th]);
            memcpy(c[th], c0, sc * count * 4);
            assert_int_equal(stk_gemm_batched(bk, t->ta, t->tb, t->m, t->n,
                                              t->k, t->alpha, a, t->lda, sa,
                                              b, t->ldb, sb, t->beta, c[th],
                                              t->ldc, sc, count, &err),
                             0);
            stk_backend_destroy(bk);
        }
        for (int i = 0; i < count; i++) {
            double *want = small_want(t, a + i * sa, b + i * sb, c0 + i * sc);
            for (int r = 0; r < t->m; r++)
                near(c[0] + i * sc + (size_t)r * t->ldc,
                     want + (size_t)r * t->ldc, (size_t)t->n, 1e-4,
                     "gemm batch");
            free(want);
        }
        for (int th = 1; th < 3; th++)
            assert_memory_equal(c[th], c[0], sc * count * 4);
        free(a), free(b), free(c0), free(c[0]), free(c[1]), free(c[2]);
    }
}

/* ---- finite differences ----------------------------------------------- */

/* Numerical gradient of a double function of x (n entries) at x. */
typedef double (*scalar_fn)(const double *x, void *ctx);

static void numgrad(scalar_fn f, double *x, size_t n, void *ctx, double *g)
{
    for (size_t i = 0; i < n; i++) {
        double keep = x[i], h = 1e-6 * (fabs(keep) > 1 ? fabs(keep) : 1);
        x[i] = keep + h;
        double up = f(x, ctx);
        x[i] = keep - h;
        double down = f(x, ctx);
        x[i] = keep;
        g[i] = (up - down) / (2 * h);
    }
}

static void to_double(const float *a, double *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        b[i] = a[i];
}

/* ReLU: L = sum g * relu(x) */
typedef struct { const float *g; size_t n; } relu_ctx;
static double relu_loss(const double *x, void *ctx)
{
    relu_ctx *c = ctx;
    double s = 0;
    for (size_t i = 0; i < c->n; i++)
        s += c->g[i] * (x[i] > 0 ? x[i] : 0);
    return s;
}

/* stk_backend_ranges: each range once, on a view of one thread whose ops
 * work on the backend's memory; the lowest failing range's error. */
typedef struct ranges_probe {
    atomic_int calls[4];
    int threads[4];
    float *data;
    int fail_from;
} ranges_probe;

static int probe_range(void *arg, int r, stk_backend *view, stk_err *err)
{
    ranges_probe *p = arg;
    atomic_fetch_add(&p->calls[r], 1);
    p->threads[r] = stk_backend_threads(view);
    int rc = stk_scale(view, 1000, (float)(r + 2), p->data + 1000 * r, err);
    if (!rc && r >= p->fail_from)
        rc = stk_fail(err, STK_EINVAL, "range %d failed", r);
    return rc;
}

static void ranges_run_each_once_on_one_thread(void **state)
{
    (void)state;
    for (int t = 1; t <= 3; t++) {
        stk_backend *bt;
        stk_err err;
        assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, t, &bt, &err), 0);
        ranges_probe p = {.fail_from = 4};
        p.data = stk_dev_alloc(bt, 4000 * sizeof(float), &err);
        for (int i = 0; i < 4000; i++)
            p.data[i] = 1.0f;
        assert_int_equal(stk_backend_ranges(bt, t, probe_range, &p, &err), 0);
        for (int r = 0; r < t; r++) {
            assert_int_equal(atomic_load(&p.calls[r]), 1);
            /* a view runs on its caller's thread; one range: be itself */
            assert_int_equal(p.threads[r], 1);
            for (int i = 0; i < 1000; i++)
                assert_true(p.data[1000 * r + i] == (float)(r + 2));
        }
        assert_int_equal(atomic_load(&p.calls[t]), 0);
        p.fail_from = 1;
        int rc = stk_backend_ranges(bt, t, probe_range, &p, &err);
        assert_int_equal(rc, t > 1 ? STK_EINVAL : 0);
        if (t > 1)
            assert_string_equal(err.msg, "range 1 failed");
        stk_dev_free(bt, p.data);
        stk_backend_destroy(bt);
    }
}

static void relu_backward_matches_fd(void **state)
{
    (void)state;
    enum { N = 64 };
    float x[N], y[N], g[N], dx[N];
    double xd[N], num[N];
    fill(x, N, 11);
    fill(g, N, 12);
    for (int i = 0; i < N; i++) /* keep away from the kink */
        if (fabsf(x[i]) < 1e-3f)
            x[i] = 0.5f;
    stk_err err;
    assert_int_equal(stk_relu_fwd(be, x, y, N, &err), 0);
    assert_int_equal(stk_relu_bwd(be, y, g, dx, N, &err), 0);
    to_double(x, xd, N);
    relu_ctx c = {g, N};
    numgrad(relu_loss, xd, N, &c, num);
    near(dx, num, N, 1e-6, "relu dx");
}

/* Linear y = x W^T + b through gemm + bias: L = sum g * y */
typedef struct { int n, in, out; const float *g; double *w, *b, *x; int wrt; } lin_ctx;
static double lin_loss(const double *v, void *ctx)
{
    lin_ctx *c = ctx;
    const double *x = c->wrt == 0 ? v : c->x, *w = c->wrt == 1 ? v : c->w,
                 *b = c->wrt == 2 ? v : c->b;
    double s = 0;
    for (int r = 0; r < c->n; r++)
        for (int o = 0; o < c->out; o++) {
            double y = b[o];
            for (int i = 0; i < c->in; i++)
                y += x[r * c->in + i] * w[o * c->in + i];
            s += c->g[r * c->out + o] * y;
        }
    return s;
}

static void linear_backward_matches_fd(void **state)
{
    (void)state;
    enum { B = 3, IN = 6, OUT = 4 };
    float x[B * IN], w[OUT * IN], b[OUT], g[B * OUT];
    fill(x, B * IN, 21);
    fill(w, OUT * IN, 22);
    fill(b, OUT, 23);
    fill(g, B * OUT, 24);
    float dx[B * IN], dw[OUT * IN] = {0}, db[OUT] = {0};
    stk_err err;
    /* dx = g W; dW = g^T x; db = column sums of g */
    assert_int_equal(stk_gemm(be, false, false, B, IN, OUT, 1, g, OUT, w, IN,
                              0, dx, IN, &err), 0);
    assert_int_equal(stk_gemm(be, true, false, OUT, IN, B, 1, g, OUT, x, IN,
                              1, dw, IN, &err), 0);
    assert_int_equal(stk_bias_grad(be, g, db, B, OUT, 1, &err), 0);
    double xd[B * IN], wd[OUT * IN], bd[OUT], num[OUT * IN];
    to_double(x, xd, B * IN);
    to_double(w, wd, OUT * IN);
    to_double(b, bd, OUT);
    lin_ctx c = {B, IN, OUT, g, wd, bd, xd, 0};
    numgrad(lin_loss, xd, B * IN, &c, num);
    near(dx, num, B * IN, 1e-5, "linear dx");
    c.wrt = 1;
    numgrad(lin_loss, wd, OUT * IN, &c, num);
    near(dw, num, OUT * IN, 1e-5, "linear dW");
    c.wrt = 2;
    numgrad(lin_loss, bd, OUT, &c, num);
    near(db, num, OUT, 1e-5, "linear db");
}

/* Conv2d of one sample via im2col + GEMM + bias; backward via GEMMs and
 * col2im; against a direct double convolution. */
typedef struct { stk_conv_shape s; int cout; const float *g; double *x, *w, *b; int wrt; } conv_ctx;
static double conv_loss(const double *v, void *ctx)
{
    conv_ctx *c = ctx;
    const stk_conv_shape *s = &c->s;
    const double *x = c->wrt == 0 ? v : c->x, *w = c->wrt == 1 ? v : c->w,
                 *b = c->wrt == 2 ? v : c->b;
    double L = 0;
    for (int o = 0; o < c->cout; o++)
        for (int oy = 0; oy < s->oh; oy++)
            for (int ox = 0; ox < s->ow; ox++) {
                double y = b[o];
                for (int ci = 0; ci < s->c; ci++)
                    for (int ky = 0; ky < s->kh; ky++)
                        for (int kx = 0; kx < s->kw; kx++) {
                            int iy = oy * s->sh - s->ph + ky,
                                ix = ox * s->sw - s->pw + kx;
                            if (iy < 0 || iy >= s->h || ix < 0 || ix >= s->w)
                                continue;
                            y += x[(ci * s->h + iy) * s->w + ix] *
                                 w[((o * s->c + ci) * s->kh + ky) * s->kw + kx];
                        }
                L += c->g[(o * s->oh + oy) * s->ow + ox] * y;
            }
    return L;
}

/* The forward value L = sum g * y and the backward's dx and dW of one
 * sample's convolution (weights w, bias b) against the direct double
 * convolution and its central differences. */
static void conv_matches_reference(const stk_conv_shape *s, int cout,
                                   const float *x, const float *w,
                                   const float *b, const float *g,
                                   const float *y, const float *dx,
                                   const float *dw, const char *what)
{
    size_t nx = (size_t)s->c * s->h * s->w, nw = (size_t)cout * s->c * s->kh * s->kw;
    double *xd = malloc(nx * 8), *wd = malloc(nw * 8), bd[16],
           *num = malloc((nw + nx) * 8);
    to_double(x, xd, nx);
    to_double(w, wd, nw);
    to_double(b, bd, (size_t)cout);
    conv_ctx c = {*s, cout, g, xd, wd, bd, 0};
    double L = 0;
    for (int i = 0; i < cout * s->oh * s->ow; i++)
        L += (double)g[i] * y[i];
    assert_true(fabs(L - conv_loss(xd, &c)) < 1e-4);
    char name[64];
    numgrad(conv_loss, xd, nx, &c, num);
    snprintf(name, sizeof name, "%s dx", what);
    near(dx, num, nx, 1e-5, name);
    c.wrt = 1;
    numgrad(conv_loss, wd, nw, &c, num);
    snprintf(name, sizeof name, "%s dW", what);
    near(dw, num, nw, 1e-5, name);
    free(xd), free(wd), free(num);
}

static void conv_backward_matches_fd(void **state)
{
    (void)state;
    stk_conv_shape shapes[] = {
        {2, 7, 6, 3, 3, 1, 1, 0, 0, 5, 4},  /* valid, the cnn's case */
        {3, 6, 7, 3, 2, 2, 1, 1, 1, 3, 8},  /* stride 2x1, padding */
    };
    for (int t = 0; t < 2; t++) {
        stk_conv_shape s = shapes[t];
        int cout = 4, K = s.c * s.kh * s.kw, HW = s.oh * s.ow;
        size_t nx = (size_t)s.c * s.h * s.w;
        float *x = malloc(nx * 4), *w = malloc((size_t)cout * K * 4),
              b[4], *g = malloc((size_t)cout * HW * 4),
              *col = malloc((size_t)K * HW * 4),
              *dcol = malloc((size_t)K * HW * 4), *dx = malloc(nx * 4),
              *dw = calloc((size_t)cout * K, 4), db[4] = {0},
              *y = malloc((size_t)cout * HW * 4);
        fill(x, nx, 31 + t);
        fill(w, (size_t)cout * K, 32);
        fill(b, 4, 33);
        fill(g, (size_t)cout * HW, 34);
        stk_err err;
        /* forward, to check it too */
        assert_int_equal(stk_im2col(be, x, &s, 1, col, &err), 0);
        assert_int_equal(stk_gemm(be, false, false, cout, HW, K, 1, w, K, col,
                                  HW, 0, y, HW, &err), 0);
        assert_int_equal(stk_bias_add(be, y, b, 1, cout, HW, &err), 0);
        /* backward */
        assert_int_equal(stk_gemm(be, false, true, cout, K, HW, 1, g, HW, col,
                                  HW, 1, dw, K, &err), 0);
        assert_int_equal(stk_bias_grad(be, g, db, 1, cout, HW, &err), 0);
        assert_int_equal(stk_gemm(be, true, false, K, HW, cout, 1, w, K, g, HW,
                                  0, dcol, HW, &err), 0);
        assert_int_equal(stk_col2im(be, dcol, &s, 1, dx, &err), 0);
        conv_matches_reference(&s, cout, x, w, b, g, y, dx, dw, "conv");
        double *xd = malloc(nx * 8), *wd = malloc((size_t)cout * K * 8),
               bd[4], *num = malloc(((size_t)cout * K + nx) * 8);
        to_double(x, xd, nx);
        to_double(w, wd, (size_t)cout * K);
        to_double(b, bd, 4);
        conv_ctx c = {s, cout, g, xd, wd, bd, 2};
        numgrad(conv_loss, bd, 4, &c, num);
        near(db, num, 4, 1e-5, "conv db");
        free(x), free(w), free(g), free(col), free(dcol), free(dx), free(dw);
        free(y), free(xd), free(wd), free(num);
    }
}

/* Point stride of a Winograd array of rows x cols per point. */
static size_t wino_ps(int rows, int cols)
{
    return stk_wino_stride((size_t)rows * cols);
}

/* The same convolution through Winograd F(2x2, 3x3): forward from the
 * transforms and 16 batched GEMMs, backward through the adjoints, against
 * the direct double convolution and its finite differences. */
static void winograd_matches_fd(void **state)
{
    (void)state;
    stk_conv_shape shapes[] = {
        {3, 7, 9, 3, 3, 1, 1, 0, 0, 5, 7}, /* odd sizes: tiles run past */
        {2, 6, 5, 3, 3, 1, 1, 1, 1, 6, 5}, /* padding on every side */
    };
    for (int t = 0; t < 2; t++) {
        stk_conv_shape s = shapes[t];
        int cout = 4, th, tw, T = stk_wino_tiles(&s, &th, &tw), HW = s.oh * s.ow;
        size_t nx = (size_t)s.c * s.h * s.w, nw = (size_t)cout * s.c * 9;
        size_t su = wino_ps(cout, s.c), sv = wino_ps(s.c, T), sm = wino_ps(cout, T);
        float *x = malloc(nx * 4), *w = malloc(nw * 4), b[4], db[4] = {0},
              *g = malloc((size_t)cout * HW * 4), *y = malloc((size_t)cout * HW * 4),
              *u = malloc(STK_WINO_P * su * 4), *du = malloc(STK_WINO_P * su * 4),
              *v = malloc(STK_WINO_P * sv * 4), *m = malloc(STK_WINO_P * sm * 4),
              *dx = malloc(nx * 4), *dw = calloc(nw, 4);
        fill(x, nx, 41 + t);
        fill(w, nw, 42);
        fill(b, 4, 43);
        fill(g, (size_t)cout * HW, 44);
        stk_err err;
        assert_int_equal(stk_wino_filter(be, w, cout, s.c, u, &err), 0);
        assert_int_equal(stk_wino_input(be, x, &s, 1, v, &err), 0);
        assert_int_equal(stk_gemm_batched(be, false, false, cout, T, s.c, 1, u, s.c, su,
                                          v, T, sv, 0, m, T, sm, STK_WINO_P, &err), 0);
        assert_int_equal(stk_wino_output(be, m, b, &s, cout, 1, y, &err), 0);
        /* backward: dM from g; dU = dM V^T; dV = U^T dM; dx and dW */
        assert_int_equal(stk_wino_output_grad(be, g, &s, cout, 1, m, &err), 0);
        assert_int_equal(stk_gemm_batched(be, false, true, cout, s.c, T, 1, m, T, sm,
                                          v, T, sv, 0, du, s.c, su, STK_WINO_P, &err), 0);
        assert_int_equal(stk_gemm_batched(be, true, false, s.c, T, cout, 1, u, s.c, su,
                                          m, T, sm, 0, v, T, sv, STK_WINO_P, &err), 0);
        assert_int_equal(stk_wino_input_grad(be, v, &s, 1, dx, &err), 0);
        assert_int_equal(stk_wino_filter_grad(be, du, cout, s.c, dw, &err), 0);
        assert_int_equal(stk_bias_grad(be, g, db, 1, cout, HW, &err), 0);
        conv_matches_reference(&s, cout, x, w, b, g, y, dx, dw, "winograd");
        double *xd = malloc(nx * 8), *wd = malloc(nw * 8), bd[4];
        to_double(x, xd, nx);
        to_double(w, wd, nw);
        to_double(b, bd, 4);
        conv_ctx c = {s, cout, g, xd, wd, bd, 0};
        /* every output against the direct double convolution */
        for (int i = 0; i < cout * HW; i++) {
            memset(g, 0, (size_t)cout * HW * 4);
            g[i] = 1;
            c.wrt = 0;
            double want = conv_loss(xd, &c);
            if (!(fabs(y[i] - want) <= 1e-5 * (fabs(want) > 1 ? fabs(want) : 1)))
                fail_msg("winograd y[%d]: %.7g, expected %.7g", i, y[i], want);
        }
        free(x), free(w), free(g), free(y), free(u), free(du), free(v), free(m);
        free(dx), free(dw), free(xd), free(wd);
    }
}

/* The CPU transforms images a row of tiles at a time and scatters the
 * input gradient; CUDA runs the per-tile bodies and gathers. Both must give
 * the same floats: the bodies are run here on the CPU, tile by tile. */
static void winograd_rows_equal_bodies_on(stk_backend *bk, stk_conv_shape s)
{
    enum { N = 3, COUT = 5 };
    int th, tw, T = stk_wino_tiles(&s, &th, &tw), nt = N * T;
    size_t nx = (size_t)N * s.c * s.h * s.w, ny = (size_t)N * COUT * s.oh * s.ow;
    size_t sv = wino_ps(s.c, nt), sm = wino_ps(COUT, nt);
    float *x = malloc(nx * 4), *dy = malloc(ny * 4), b[COUT];
    float *v = calloc(STK_WINO_P * sv, 4), *v1 = calloc(STK_WINO_P * sv, 4);
    float *m = calloc(STK_WINO_P * sm, 4), *m1 = calloc(STK_WINO_P * sm, 4);
    float *y = malloc(ny * 4), *y1 = malloc(ny * 4);
    float *dx = malloc(nx * 4), *dx1 = malloc(nx * 4);
    fill(x, nx, 51);
    fill(dy, ny, 52);
    fill(b, COUT, 53);
    stk_err err;
    assert_int_equal(stk_wino_input(bk, x, &s, N, v, &err), 0);
    for (int ci = 0; ci < s.c; ci++)
        for (int j = 0; j < nt; j++)
            stk_wino_input1(x, &s, ci, (size_t)j, v1 + (size_t)ci * nt + j, sv);
    assert_memory_equal(v, v1, STK_WINO_P * sv * 4);
    assert_int_equal(stk_wino_output_grad(bk, dy, &s, COUT, N, m, &err), 0);
    for (int co = 0; co < COUT; co++)
        for (int j = 0; j < nt; j++)
            stk_wino_output_grad1(dy, &s, co, COUT, (size_t)j,
                                  m1 + (size_t)co * nt + j, sm);
    assert_memory_equal(m, m1, STK_WINO_P * sm * 4);
    fill(y, ny, 56); /* every pixel written */
    assert_int_equal(stk_wino_output(bk, m, b, &s, COUT, N, y, &err), 0);
    for (int co = 0; co < COUT; co++)
        for (int j = 0; j < nt; j++)
            stk_wino_output1(m + (size_t)co * nt + j, sm, b[co], &s, co, COUT,
                             (size_t)j, y1);
    assert_memory_equal(y, y1, ny * 4);
    /* no bias (a convolution before a batchnorm): the outputs plus 0 */
    assert_int_equal(stk_wino_output(bk, m, NULL, &s, COUT, N, y, &err), 0);
    for (int co = 0; co < COUT; co++)
        for (int j = 0; j < nt; j++)
            stk_wino_output1(m + (size_t)co * nt + j, sm, 0.0f, &s, co, COUT,
                             (size_t)j, y1);
    assert_memory_equal(y, y1, ny * 4);
    /* the input gradient from v as dV: CPU scatter against body + gather */
    memcpy(v1, v, STK_WINO_P * sv * 4);
    fill(dx, nx, 54); /* every pixel must be written, none only added to */
    assert_int_equal(stk_wino_input_grad(bk, v, &s, N, dx, &err), 0);
    for (int ci = 0; ci < s.c; ci++)
        for (int j = 0; j < nt; j++)
            stk_wino_input_grad_n(v1 + (size_t)ci * nt + j, sv, 1);
    for (size_t i = 0; i < nx; i++) {
        size_t q = i / ((size_t)s.h * s.w), px = i % ((size_t)s.h * s.w);
        dx1[i] = stk_wino_gather1(v1 + q % s.c * nt + q / s.c * T, sv, &s,
                                  (int)(px / s.w), (int)(px % s.w));
    }
    assert_memory_equal(dx, dx1, nx * 4);
    free(x), free(dy), free(v), free(v1), free(m), free(m1), free(y), free(y1);
    free(dx), free(dx1);
}

/* On the backend as made here (its 16-lane transforms where the CPU has
 * AVX-512F) and on one made with STK_CPU_NO_AVX512 (the portable loops),
 * whatever the CPU. */
static void winograd_rows_equal_per_tile_bodies(void **state)
{
    (void)state;
    stk_backend *narrow;
    stk_err err;
    setenv("STK_CPU_NO_AVX512", "1", 1);
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 1, &narrow, &err), 0);
    unsetenv("STK_CPU_NO_AVX512");
    for (int pass = 0; pass < 2; pass++) {
        stk_backend *bk = pass ? narrow : be;
        /* 7 x 5 tiles; 10 x 11 tiles, more than the CPU's 64 per transform
         * call, so a call ends inside a row of tiles */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){4, 13, 11, 3, 3, 1, 1, 1, 0, 13, 9});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 20, 22, 3, 3, 1, 1, 1, 1, 20, 22});
        /* 3 x 131 tiles: calls that start and end inside a row; an odd
         * width and a cut last tile with pw = 2 */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){1, 5, 259, 3, 3, 1, 1, 1, 2, 5, 261});
        /* ph = 2, pw = 0: rows of tiles above the image */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 9, 12, 3, 3, 1, 1, 2, 0, 11, 10});
        /* resnet20's planes: 14 x 14 tiles of 28 x 28, 4 x 4 of 7 x 7 (the
         * AVX-512 transforms' rows of 16 lanes, part used) */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){3, 28, 28, 3, 3, 1, 1, 1, 1, 28, 28});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){5, 7, 7, 3, 3, 1, 1, 1, 1, 7, 7});
        /* narrow planes, their rows of tiles packed into 16 lanes (pack16):
         * two rows of 7 tiles, the last alone (14 x 14); three rows, a
         * permute per pair of rows (10 x 10); four rows (8 x 8); rows of
         * pixels two to a vector (6 x 6, and 5 x 5 with pw = 2, where
         * columns left of the image are read); a 3 x 5 plane */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 14, 14, 3, 3, 1, 1, 1, 1, 14, 14});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){3, 10, 10, 3, 3, 1, 1, 1, 1, 10, 10});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 8, 8, 3, 3, 1, 1, 1, 1, 8, 8});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 6, 6, 3, 3, 1, 1, 1, 1, 6, 6});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 5, 5, 3, 3, 1, 1, 2, 2, 7, 7});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){1, 3, 5, 3, 3, 1, 1, 1, 1, 3, 5});
        /* 8, 6, 2 and 1 tiles across (output transforms packed at 8, an
         * odd width's last pixel in lane 15); four rows a vector with a
         * part group (14 x 8) and pairs over several groups (14 x 6); no
         * padding; a padding of 7 left of a one-pixel-wide image */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 16, 16, 3, 3, 1, 1, 1, 1, 16, 16});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 15, 15, 3, 3, 1, 1, 1, 1, 15, 15});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 12, 12, 3, 3, 1, 1, 1, 1, 12, 12});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 4, 3, 3, 3, 1, 1, 1, 1, 4, 3});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 2, 2, 3, 3, 1, 1, 1, 1, 2, 2});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 1, 1, 3, 3, 1, 1, 1, 1, 1, 1});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 14, 8, 3, 3, 1, 1, 1, 1, 14, 8});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 14, 6, 3, 3, 1, 1, 1, 1, 14, 6});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 9, 9, 3, 3, 1, 1, 0, 0, 7, 7});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 7, 7, 3, 3, 1, 1, 0, 0, 5, 5});
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){2, 3, 1, 3, 3, 1, 1, 1, 7, 3, 13});
        /* 300 tiles across: wider than the 16-lane input gradient's rows */
        winograd_rows_equal_bodies_on(bk, (stk_conv_shape){1, 3, 600, 3, 3, 1, 1, 1, 1, 3, 600});
    }
    stk_backend_destroy(narrow);
}

/* A batch of GEMMs equals the GEMMs one by one (within float rounding: the
 * single GEMM is cut into panels), and a shape that cannot work is
 * refused. */
static void gemm_batched_equals_one_by_one(void **state)
{
    (void)state;
    enum { M = 37, N = 70, K = 19, COUNT = 5 };
    size_t sa = M * K + 3, sb = K * N + 5, sc = M * N + 7;
    float *a = malloc(COUNT * sa * 4), *b = malloc(COUNT * sb * 4),
          *c = malloc(COUNT * sc * 4), *c1 = malloc(COUNT * sc * 4);
    fill(a, COUNT * sa, 61);
    fill(b, COUNT * sb, 62);
    fill(c, COUNT * sc, 63);
    memcpy(c1, c, COUNT * sc * 4);
    stk_err err;
    assert_int_equal(stk_gemm_batched(be, true, false, M, N, K, 0.5f, a, M, sa, b, N,
                                      sb, 1.0f, c, N, sc, COUNT, &err), 0);
    for (int i = 0; i < COUNT; i++)
        assert_int_equal(stk_gemm(be, true, false, M, N, K, 0.5f, a + i * sa, M,
                                  b + i * sb, N, 1.0f, c1 + i * sc, N, &err), 0);
    for (size_t i = 0; i < COUNT * sc; i++)
        assert_float_equal(c[i], c1[i], 1e-5);
    assert_int_equal(stk_gemm_batched(be, false, false, M, N, K, 1, a, K - 1, sa,
                                      b, N, sb, 0, c, N, sc, COUNT, &err),
                     STK_EINVAL);
    assert_int_equal(stk_gemm_batched(be, false, false, M, N, K, 1, a, K, sa, b, N,
                                      sb, 0, c, N, sc, -1, &err),
                     STK_EINVAL);
    /* C matrices that overlap would be written by two threads at once */
    assert_int_equal(stk_gemm_batched(be, false, false, M, N, K, 1, a, K, sa, b, N,
                                      sb, 0, c, N, (size_t)M * N - 1, COUNT, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "overlap"));
    /* side by side in the rows of one C (im2col's per-sample blocks), A
     * shared (stride 0): each block equals its own GEMM; one column less
     * of room and the blocks overlap */
    int ldc = COUNT * N;
    float *w = calloc((size_t)M * ldc, 4), *w1 = calloc((size_t)M * ldc, 4);
    assert_int_equal(stk_gemm_batched(be, false, false, M, N, K, 1, a, K, 0, b, N,
                                      sb, 0, w, ldc, N, COUNT, &err), 0);
    for (int i = 0; i < COUNT; i++)
        assert_int_equal(stk_gemm(be, false, false, M, N, K, 1, a, K, b + i * sb,
                                  N, 0, w1 + i * N, ldc, &err), 0);
    assert_memory_equal(w, w1, (size_t)M * ldc * 4);
    assert_int_equal(stk_gemm_batched(be, false, false, M, N, K, 1, a, K, 0, b, N,
                                      sb, 0, w, ldc - 1, N, COUNT, &err),
                     STK_EINVAL);
    free(a), free(b), free(c), free(c1), free(w), free(w1);
    /* a batch of 2 GEMMs of 1.5 megaflops each is cut into panels like a
     * single GEMM: the same floats as stk_gemm's */
    enum { M2 = 64, N2 = 300, K2 = 40 };
    float *a2 = malloc(2 * M2 * K2 * 4), *b2 = malloc(2 * K2 * N2 * 4),
          *c2 = malloc(2 * M2 * N2 * 4), *d2 = malloc(2 * M2 * N2 * 4);
    fill(a2, 2 * M2 * K2, 64);
    fill(b2, 2 * K2 * N2, 65);
    assert_int_equal(stk_gemm_batched(be, false, false, M2, N2, K2, 1, a2, K2,
                                      M2 * K2, b2, N2, K2 * N2, 0, c2, N2,
                                      M2 * N2, 2, &err), 0);
    for (int i = 0; i < 2; i++)
        assert_int_equal(stk_gemm(be, false, false, M2, N2, K2, 1, a2 + i * M2 * K2,
                                  K2, b2 + i * K2 * N2, N2, 0, d2 + i * M2 * N2, N2,
                                  &err), 0);
    assert_memory_equal(c2, d2, 2 * M2 * N2 * 4);
    free(a2), free(b2), free(c2), free(d2);
}

/* Max-pool 2x2 stride 2 over 2 planes of 5x6 (odd edge dropped). */
typedef struct { int planes, h, w; const float *g; } pool_ctx;
static double pool_loss(const double *x, void *ctx)
{
    pool_ctx *c = ctx;
    int oh = c->h / 2, ow = c->w / 2;
    double L = 0;
    for (int p = 0; p < c->planes; p++)
        for (int oy = 0; oy < oh; oy++)
            for (int ox = 0; ox < ow; ox++) {
                double m = -INFINITY;
                for (int d = 0; d < 4; d++) {
                    double v = x[(p * c->h + oy * 2 + d / 2) * c->w + ox * 2 +
                                 d % 2];
                    m = v > m ? v : m;
                }
                L += c->g[(p * oh + oy) * ow + ox] * m;
            }
    return L;
}

/* Batched columns equal per-sample columns side by side; swap01 swaps. */
static void batched_im2col_and_swap(void **state)
{
    (void)state;
    stk_conv_shape s = {2, 5, 4, 3, 2, 1, 2, 1, 0, 5, 2};
    int n = 3, K = 2 * 3 * 2, hw = 5 * 2;
    float x[3 * 2 * 5 * 4], one[12 * 10], all[12 * 30], back[3 * 40], b1[40];
    fill(x, sizeof x / 4, 61);
    stk_err err;
    assert_int_equal(stk_im2col(be, x, &s, n, all, &err), 0);
    for (int smp = 0; smp < n; smp++) {
        assert_int_equal(stk_im2col(be, x + smp * 40, &s, 1, one, &err), 0);
        for (int r = 0; r < K; r++)
            assert_memory_equal(all + r * n * hw + smp * hw, one + r * hw,
                                hw * sizeof(float));
    }
    assert_int_equal(stk_col2im(be, all, &s, n, back, &err), 0);
    for (int smp = 0; smp < n; smp++) {
        assert_int_equal(stk_im2col(be, x + smp * 40, &s, 1, one, &err), 0);
        assert_int_equal(stk_col2im(be, one, &s, 1, b1, &err), 0);
        assert_memory_equal(back + smp * 40, b1, sizeof b1);
    }
    float src[2 * 3 * 4], dst[2 * 3 * 4];
    for (int i = 0; i < 24; i++)
        src[i] = (float)i;
    assert_int_equal(stk_swap01(be, src, dst, 2, 3, 4, &err), 0);
    for (int a = 0; a < 2; a++)
        for (int b = 0; b < 3; b++)
            for (int i = 0; i < 4; i++)
                assert_true(dst[(b * 2 + a) * 4 + i] == src[(a * 3 + b) * 4 + i]);
    assert_int_equal(stk_swap01(be, src, src, 2, 3, 4, &err), STK_EINVAL);
    /* the CPU loops give exactly what the per-element bodies (the CUDA
     * kernels' arithmetic) give */
    for (size_t j = 0; j < (size_t)K * n * hw; j++)
        assert_true(all[j] == stk_im2col1(x, &s, n, j));
    for (size_t i = 0; i < (size_t)n * 40; i++)
        assert_true(back[i] == stk_col2im1(all, &s, n, i));
    for (size_t j = 0; j < 24; j++)
        assert_true(dst[j] == stk_swap01_1(src, 2, 3, 4, j));
}

/* Stride-2 columns (im2col_row's loop with the constant stride, the
 * 16-lane 3x3 path) and their col2im equal the per-element bodies. */
static void im2col_stride2_matches_bodies(void **state)
{
    (void)state;
    /* resnet20's strided 3x3 and 1x1 shapes, odd sizes, long rows,
     * padding 2 and a stride of 1 down; the 16-lane stride-2 3x3 path's
     * planes (up to 32 columns) of even and odd widths, one vector or two,
     * at 16, 31, 32 and past it (33: the loops), 2 wide, 1 high */
    static const stk_conv_shape shapes[] = {
        {3, 28, 28, 3, 3, 2, 2, 1, 1, 14, 14},
        {4, 14, 14, 1, 1, 2, 2, 0, 0, 7, 7},
        {2, 9, 75, 3, 3, 1, 2, 2, 2, 11, 39},
        {1, 5, 7, 3, 3, 2, 2, 1, 1, 3, 4},
        {3, 14, 14, 3, 3, 2, 2, 1, 1, 7, 7},
        {2, 13, 17, 3, 3, 2, 2, 1, 1, 7, 9},
        {2, 32, 32, 3, 3, 2, 2, 1, 1, 16, 16},
        {1, 2, 1, 3, 3, 2, 2, 1, 1, 1, 1},
        {2, 9, 33, 3, 3, 2, 2, 1, 1, 5, 17},
        {1, 16, 16, 3, 3, 2, 2, 1, 1, 8, 8},
        {2, 3, 2, 3, 3, 2, 2, 1, 1, 2, 1},
        {1, 5, 31, 3, 3, 2, 2, 1, 1, 3, 16},
        {2, 1, 9, 3, 3, 2, 2, 1, 1, 1, 5}};
    stk_err err;
    for (size_t t = 0; t < sizeof shapes / sizeof *shapes; t++) {
        const stk_conv_shape *s = &shapes[t];
        int n = 3;
        size_t nx = (size_t)n * s->c * s->h * s->w,
               ncol = (size_t)s->c * s->kh * s->kw * n * s->oh * s->ow;
        float *x = filled(nx, 91 + t), *col = malloc(ncol * 4),
              *dcol = filled(ncol, 93 + t), *dx = malloc(nx * 4);
        assert_non_null(col);
        assert_non_null(dx);
        fill(col, ncol, 92); /* every element written */
        assert_int_equal(stk_im2col(be, x, s, n, col, &err), 0);
        for (size_t j = 0; j < ncol; j++)
            if (col[j] != stk_im2col1(x, s, n, j))
                fail_msg("im2col shape %zu: element %zu", t, j);
        fill(dx, nx, 94);
        assert_int_equal(stk_col2im(be, dcol, s, n, dx, &err), 0);
        for (size_t i = 0; i < nx; i++)
            if (dx[i] != stk_col2im1(dcol, s, n, i))
                fail_msg("col2im shape %zu: element %zu", t, i);
        free(x), free(col), free(dcol), free(dx);
    }
}

static void maxpool_backward_matches_fd(void **state)
{
    (void)state;
    enum { P = 2, H = 5, W = 6, OH = 2, OW = 3 };
    float x[P * H * W], y[P * OH * OW], g[P * OH * OW], dx[P * H * W];
    int32_t arg[P * OH * OW];
    fill(x, P * H * W, 41); /* distinct values: no ties at the max */
    fill(g, P * OH * OW, 42);
    stk_err err;
    assert_int_equal(stk_maxpool_fwd(be, x, P, H, W, 2, 2, y, arg, &err), 0);
    assert_int_equal(stk_maxpool_bwd(be, g, arg, P, H, W, 2, 2, dx, &err), 0);
    double xd[P * H * W], num[P * H * W];
    to_double(x, xd, P * H * W);
    pool_ctx c = {P, H, W, g};
    numgrad(pool_loss, xd, P * H * W, &c, num);
    near(dx, num, P * H * W, 1e-6, "maxpool dx");
    assert_int_equal(stk_maxpool_fwd(be, x, P, H, W, 7, 1, y, arg, &err),
                     STK_EINVAL);
}

/* Overlapping windows: the CPU's scatter and the gather body the CUDA
 * kernel runs give the same floats; ties (repeated values), -0 gradients
 * and an odd last row or column (in no 2x2 window) included. */
static void maxpool_gather_equals_scatter(void **state)
{
    (void)state;
    enum { P = 3, N = P * 9 * 9 };
    static const int ks[][2] = {{3, 1}, {3, 2}, {2, 1}, {2, 2}, {4, 3}};
    static const int hw[][2] = {{9, 8}, {8, 9}};
    float x[N], y[N], g[N], dx[N];
    int32_t arg[N];
    for (int i = 0; i < N; i++)
        x[i] = (float)((i * 37) % 11); /* many ties */
    fill(g, N, 43);
    for (int i = 0; i < N; i += 5)
        g[i] = -0.0f;
    stk_err err;
    for (size_t s = 0; s < sizeof hw / sizeof *hw; s++)
        for (size_t t = 0; t < sizeof ks / sizeof *ks; t++) {
            int H = hw[s][0], W = hw[s][1], k = ks[t][0], st = ks[t][1];
            memset(dx, 0x7f, sizeof dx); /* every element must be written */
            assert_int_equal(stk_maxpool_fwd(be, x, P, H, W, k, st, y, arg, &err), 0);
            assert_int_equal(stk_maxpool_bwd(be, g, arg, P, H, W, k, st, dx, &err), 0);
            for (size_t i = 0; i < (size_t)P * H * W; i++) {
                float want = stk_maxpool_grad1(g, arg, H, W, k, st, i);
                if (memcmp(&want, &dx[i], sizeof want))
                    fail_msg("%dx%d, k %d stride %d element %zu: scatter %g, gather %g",
                             H, W, k, st, i, (double)dx[i], (double)want);
            }
        }
}

/* Mean softmax cross-entropy */
typedef struct { int n, c; const int32_t *labels; } xent_ctx;
static double xent_loss(const double *z, void *ctx)
{
    xent_ctx *c = ctx;
    double L = 0;
    for (int r = 0; r < c->n; r++) {
        double m = -INFINITY, s = 0;
        for (int j = 0; j < c->c; j++)
            m = z[r * c->c + j] > m ? z[r * c->c + j] : m;
        for (int j = 0; j < c->c; j++)
            s += exp(z[r * c->c + j] - m);
        L += m + log(s) - z[r * c->c + c->labels[r]];
    }
    return L / c->n;
}

static void xent_matches_reference_and_fd(void **state)
{
    (void)state;
    enum { N = 5, C = 7 };
    float z[N * C], dz[N * C], loss;
    int32_t labels[N] = {0, 6, 3, 3, 1};
    fill(z, N * C, 51);
    for (int i = 0; i < N * C; i++)
        z[i] *= 4; /* a spread that makes the softmax non-trivial */
    stk_err err;
    assert_int_equal(stk_xent(be, z, labels, N, C, 0.0f, &loss, dz, &err), 0);
    double zd[N * C], num[N * C];
    to_double(z, zd, N * C);
    xent_ctx c = {N, C, labels};
    assert_true(fabs(loss - xent_loss(zd, &c)) < 1e-5);
    numgrad(xent_loss, zd, N * C, &c, num);
    near(dz, num, N * C, 1e-5, "xent dlogits");
    labels[2] = 7;
    assert_int_equal(stk_xent(be, z, labels, N, C, 0.0f, &loss, dz, &err),
                     STK_ERANGE);
    assert_non_null(strstr(err.msg, "label 7 of row 2"));
}

/* ---- average pool, add, copy ---------------------------------------------
 */

/* L = sum g * avgpool(x), windows kh x kw of stride sh x sw. */
typedef struct {
    int planes, h, w, kh, kw, sh, sw;
    const float *g;
} avg_ctx;

static int avg_out(int len, int k, int st)
{
    return (len - k) / st + 1;
}

/* The pool in double into y (planes * oh * ow), a naive loop. */
static void avg_ref(const avg_ctx *c, const double *x, double *y)
{
    int oh = avg_out(c->h, c->kh, c->sh), ow = avg_out(c->w, c->kw, c->sw);
    for (int p = 0; p < c->planes; p++)
        for (int oy = 0; oy < oh; oy++)
            for (int ox = 0; ox < ow; ox++) {
                double s = 0;
                for (int dy = 0; dy < c->kh; dy++)
                    for (int dx = 0; dx < c->kw; dx++)
                        s += x[(p * c->h + oy * c->sh + dy) * c->w +
                               ox * c->sw + dx];
                y[(p * oh + oy) * ow + ox] = s / (c->kh * c->kw);
            }
}

static double avg_loss(const double *x, void *ctx)
{
    const avg_ctx *c = ctx;
    int n =
        c->planes * avg_out(c->h, c->kh, c->sh) * avg_out(c->w, c->kw, c->sw);
    double y[512], L = 0;
    avg_ref(c, x, y);
    for (int i = 0; i < n; i++)
        L += c->g[i] * y[i];
    return L;
}

/* Overlapping, non-square, strided and global windows, odd edges left
 * out: the forward against a naive double loop, the backward against
 * finite differences, every input gradient written. */
static void avgpool_matches_naive_and_fd(void **state)
{
    (void)state;
    enum { P = 3, N = P * 7 * 8 };
    static const int cfg[][6] = {/* h w kh kw sh sw */
                                 {7, 8, 3, 3, 2, 2}, {7, 8, 2, 3, 1, 2},
                                 {7, 8, 3, 2, 2, 1}, {6, 8, 2, 2, 2, 2},
                                 {7, 8, 7, 8, 1, 1}, {5, 3, 5, 3, 2, 3},
                                 {7, 8, 1, 1, 3, 2}};
    float x[N], y[N], g[N], dx[N];
    double xd[N], yd[N], num[N];
    fill(x, N, 71);
    fill(g, N, 72);
    for (int i = 0; i < N; i += 7)
        g[i] = -0.0f; /* a sum from +0 turns these into +0 */
    stk_err err;
    for (size_t t = 0; t < sizeof cfg / sizeof *cfg; t++) {
        const int *q = cfg[t];
        avg_ctx c = {P, q[0], q[1], q[2], q[3], q[4], q[5], g};
        int in = P * q[0] * q[1];
        int out = P * avg_out(q[0], q[2], q[4]) * avg_out(q[1], q[3], q[5]);
        assert_int_equal(stk_avgpool_fwd(be, x, P, q[0], q[1], q[2], q[3],
                                         q[4], q[5], y, &err),
                         0);
        to_double(x, xd, in);
        avg_ref(&c, xd, yd);
        near(y, yd, out, 1e-6, "avgpool y");
        memset(dx, 0x7f, sizeof dx);
        assert_int_equal(stk_avgpool_bwd(be, g, P, q[0], q[1], q[2], q[3],
                                         q[4], q[5], dx, &err),
                         0);
        numgrad(avg_loss, xd, in, &c, num);
        near(dx, num, in, 1e-6, "avgpool dx");
        /* the CPU's scatter gives the floats of the gather CUDA runs */
        for (int i = 0; i < in; i++) {
            float want = stk_avgpool_grad1(g, q[0], q[1], q[2], q[3], q[4],
                                           q[5], (size_t)i);
            if (memcmp(&want, &dx[i], sizeof want))
                fail_msg("avgpool %dx%d, %dx%d stride %dx%d, element %d: "
                         "scatter %g, gather %g",
                         q[0], q[1], q[2], q[3], q[4], q[5], i, (double)dx[i],
                         (double)want);
        }
    }
    assert_int_equal(stk_avgpool_fwd(be, x, P, 4, 4, 5, 2, 1, 1, y, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "avg-pool"));
    assert_int_equal(stk_avgpool_bwd(be, g, P, 4, 4, 2, 2, 0, 1, dx, &err),
                     STK_EINVAL);
}

static void add_and_device_copy(void **state)
{
    (void)state;
    enum { N = 1000 };
    float a[N], b[N], y[N];
    fill(a, N, 73);
    fill(b, N, 74);
    stk_err err;
    assert_int_equal(stk_add(be, a, b, y, N, &err), 0);
    for (int i = 0; i < N; i++)
        assert_true(y[i] == a[i] + b[i]);
    assert_int_equal(stk_add(be, y, b, y, N, &err), 0); /* y aliases a */
    for (int i = 0; i < N; i++)
        assert_true(y[i] == (a[i] + b[i]) + b[i]);
    assert_int_equal(stk_copy_dev(be, y, a, N, &err), 0);
    assert_memory_equal(y, a, sizeof a);
    assert_int_equal(stk_copy_dev(be, a + 1, a, 10, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "overlap"));
    assert_int_equal(stk_add(be, a, NULL, y, N, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "add: b is NULL"));
}

/* ---- batch normalisation -------------------------------------------------
 */

/* Training-mode batchnorm in double: v = x [n, c, hw], then gamma [c],
 * beta [c]; L = sum g * y (y after the ReLU when relu). */
typedef struct {
    int n, c, hw, relu;
    double eps;
    const float *g;
} bn_ctx;

static double bn_loss(const double *v, void *ctx)
{
    const bn_ctx *b = ctx;
    size_t total = (size_t)b->n * b->c * b->hw;
    const double *gamma = v + total, *beta = gamma + b->c;
    double L = 0, cnt = (double)b->n * b->hw;
    for (int ch = 0; ch < b->c; ch++) {
        double m = 0, var = 0;
        for (int r = 0; r < b->n; r++)
            for (int i = 0; i < b->hw; i++)
                m += v[((size_t)r * b->c + ch) * b->hw + i];
        m /= cnt;
        for (int r = 0; r < b->n; r++)
            for (int i = 0; i < b->hw; i++) {
                double d = v[((size_t)r * b->c + ch) * b->hw + i] - m;
                var += d * d;
            }
        var /= cnt;
        for (int r = 0; r < b->n; r++)
            for (int i = 0; i < b->hw; i++) {
                size_t at = ((size_t)r * b->c + ch) * b->hw + i;
                double y =
                    (v[at] - m) / sqrt(var + b->eps) * gamma[ch] + beta[ch];
                L += b->g[at] * (b->relu && y < 0 ? 0 : y);
            }
    }
    return L;
}

/* stk_bn_apply_add (a residual block's tail in one pass) gives the floats
 * of the batchnorm, the add and the ReLU run in turn, also with y over
 * the residual; a missing residual is refused. */
static void bn_add_check(const float *x, const float *res, int n, int c,
                         int hw, const float *mean, const float *var,
                         float eps, const float *gamma, const float *beta,
                         int relu)
{
    size_t total = (size_t)n * c * hw;
    float *want = malloc(total * 4), *got = malloc(total * 4);
    stk_err err;
    assert_non_null(want);
    assert_non_null(got);
    assert_int_equal(stk_bn_apply(be, x, want, n, c, hw, mean, var, eps,
                                  gamma, beta, false, &err),
                     0);
    assert_int_equal(stk_add(be, want, res, want, total, &err), 0);
    if (relu)
        assert_int_equal(stk_relu_fwd(be, want, want, total, &err), 0);
    assert_int_equal(stk_bn_apply_add(be, x, res, got, n, c, hw, mean, var,
                                      eps, gamma, beta, relu, &err),
                     0);
    assert_memory_equal(got, want, total * 4);
    memcpy(got, res, total * 4); /* y over the residual */
    assert_int_equal(stk_bn_apply_add(be, x, got, got, n, c, hw, mean, var,
                                      eps, gamma, beta, relu, &err),
                     0);
    assert_memory_equal(got, want, total * 4);
    assert_int_equal(stk_bn_apply_add(be, x, NULL, got, n, c, hw, mean, var,
                                      eps, gamma, beta, relu, &err),
                     STK_EINVAL);
    free(want), free(got);
}

/* The whole training step through the ops: statistics, the normalisation
 * (y against a naive double computation from the same float statistics),
 * then the backward sums and input gradient against central differences of
 * the loss through the batch statistics (x, gamma and beta). In place
 * (y over x, dx over dy) gives the same floats. */
static void bn_training_check(int n, int c, int hw, int relu)
{
    size_t total = (size_t)n * c * hw, nv = total + 2 * (size_t)c;
    float *x = malloc(total * 4), *y = malloc(total * 4),
          *g = malloc(total * 4), *dx = malloc(total * 4),
          *t = malloc(total * 4), *p = malloc(2 * c * 4);
    double *v = malloc(nv * sizeof *v), *num = malloc(nv * sizeof *num),
           *want = malloc(total * sizeof *want);
    float mean[8], var[8], sums[16], eps = 1e-5f;
    fill(x, total, 81 + hw);
    for (size_t i = 0; i < total; i++)
        x[i] = x[i] * 2 + 0.5f; /* a mean off 0 */
    fill(g, total, 82);
    fill(p, 2 * (size_t)c, 83);
    for (int ch = 0; ch < c; ch++)
        p[ch] += 1.5f; /* gamma away from 0 */
    const float *gamma = p, *beta = p + c;
    stk_err err;
    double inv = 1.0 / ((double)n * hw);
    assert_int_equal(stk_bn_sums(be, x, n, c, hw, NULL, inv, mean, &err), 0);
    assert_int_equal(stk_bn_sums(be, x, n, c, hw, mean, inv, var, &err), 0);
    assert_int_equal(stk_bn_apply(be, x, y, n, c, hw, mean, var, eps, gamma,
                                  beta, relu, &err),
                     0);
    for (size_t i = 0; i < total; i++) {
        int ch = (int)(i / hw % c);
        double z = (x[i] - (double)mean[ch]) / sqrt((double)var[ch] + eps) *
                       gamma[ch] +
                   beta[ch];
        want[i] = relu && z < 0 ? 0 : z;
    }
    near(y, want, total, 2e-6, "batchnorm y");
    memcpy(t, x, total * 4); /* in place */
    assert_int_equal(stk_bn_apply(be, t, t, n, c, hw, mean, var, eps, gamma,
                                  beta, relu, &err),
                     0);
    assert_memory_equal(t, y, total * 4);
    bn_add_check(x, g, n, c, hw, mean, var, eps, gamma, beta, relu);

    assert_int_equal(stk_bn_grad_sums(be, g, x, n, c, hw, mean, var, eps, gamma,
                                      beta, relu, sums, &err),
                     0);
    assert_int_equal(stk_bn_input_grad(be, g, x, n, c, hw, mean, var, eps,
                                       gamma, beta, relu, sums, (float)inv, dx,
                                       &err),
                     0);
    memcpy(t, g, total * 4); /* dx over dy */
    assert_int_equal(stk_bn_input_grad(be, t, x, n, c, hw, mean, var, eps,
                                       gamma, beta, relu, sums, (float)inv, t,
                                       &err),
                     0);
    assert_memory_equal(t, dx, total * 4);
    if (relu) { /* the recomputed mask is the forward's: y's own, read */
        float *masked = malloc(total * 4), s2[16];
        assert_int_equal(stk_relu_bwd(be, y, g, masked, total, &err), 0);
        assert_int_equal(stk_bn_grad_sums(be, masked, x, n, c, hw, mean, var,
                                          eps, NULL, NULL, false, s2, &err),
                         0);
        assert_memory_equal(s2, sums, 2 * (size_t)c * 4);
        assert_int_equal(stk_bn_input_grad(be, masked, x, n, c, hw, mean, var,
                                           eps, gamma, NULL, false, sums,
                                           (float)inv, t, &err),
                         0);
        assert_memory_equal(t, dx, total * 4);
        free(masked);
    }

    to_double(x, v, total);
    to_double(p, v + total, 2 * (size_t)c);
    bn_ctx b = {n, c, hw, relu, eps, g};
    numgrad(bn_loss, v, nv, &b, num);
    near(dx, num, total, 2e-5, "batchnorm dx");
    near(sums + c, num + total, c, 2e-5, "batchnorm dgamma");
    near(sums, num + total + c, c, 2e-5, "batchnorm dbeta");
    free(x), free(y), free(g), free(dx), free(t), free(p);
    free(v), free(num), free(want);
}

static void batchnorm_training_matches_fd(void **state)
{
    (void)state;
    for (int relu = 0; relu < 2; relu++) {
        bn_training_check(3, 4, 5, relu);  /* BatchNorm2d, planes of 5 */
        bn_training_check(2, 3, 37, relu); /* lanes and a tail */
        bn_training_check(7, 5, 1, relu);  /* BatchNorm1d */
    }
}

/* A channel's sum as the CPU forms it: the batch in 8 chunks (chunk k
 * the samples [n k / 8, n (k + 1) / 8)), each chunk's in 16 double lanes
 * (element i of a plane in lane i % 16, the planes in sample order) added
 * by the halving tree (kernels/cpu.c, lanes_total), the chunks' added in
 * order. term(src, i, at) is element i's term, `at` the shift or mean it
 * uses. */
typedef double (*bn_term)(const float *const *src, size_t i, float at);

static double bn_lane_sum(const float *const *src, int n, int c, int hw,
                          int ch, bn_term term, float at)
{
    double total = 0.0;
    for (int k = 0; k < 8; k++) {
        double lane[16] = {0.0};
        for (int r = n * k / 8; r < n * (k + 1) / 8; r++)
            for (int i = 0; i < hw; i++)
                lane[i % 16] += term(src, ((size_t)r * c + ch) * hw + i, at);
        for (int w = 8; w > 0; w /= 2)
            for (int l = 0; l < w; l++)
                lane[l] += lane[l + w];
        total += lane[0];
    }
    return total;
}

static double term_x(const float *const *src, size_t i, float at)
{
    (void)at;
    return src[0][i];
}

static double term_sq(const float *const *src, size_t i, float at)
{
    return stk_bn_sq1(src[0][i], at);
}

/* src: x, dy, relu_y (NULL: none) */
static double term_g(const float *const *src, size_t i, float at)
{
    (void)at;
    return src[2] ? stk_relu_grad1(src[2][i], src[1][i]) : src[1][i];
}

static double term_gx(const float *const *src, size_t i, float at)
{
    return stk_bn_gx1((float)term_g(src, i, at), src[0][i], at);
}

/* The sums exactly as that order gives them, planes with tails of 5, 1, 4,
 * 5 and 9 past the lanes, batches of fewer samples than chunks and of 2-5
 * samples a chunk, values off 0 (a lane past a plane's end that added
 * anything shows), with and without the ReLU's mask (the op recomputes the
 * ReLU's output from x, gamma and beta; here it is stk_bn_apply1's, the
 * body stk_bn_apply runs, and about half of it is 0); on a CPU with
 * AVX-512F the loops' AVX-512 clones. */
static void bn_sums_follow_the_lanes(void **state)
{
    (void)state;
    static const int shapes[][3] = {
        {3, 5, 37}, {2, 4, 49}, {2, 3, 196}, {19, 3, 21}, {40, 2, 9}};
    for (int t = 0; t < 5; t++) {
        int n = shapes[t][0], c = shapes[t][1], hw = shapes[t][2];
        size_t total = (size_t)n * c * hw;
        float *x = filled(total, 111), *g = filled(total, 112),
              *ry = malloc(total * 4), *p = filled(16, 113), mean[8], var[8],
              sums[16];
        const float *gamma = p, *beta = p + 8;
        for (size_t i = 0; i < total; i++)
            x[i] += 3.0f;
        double inv = 1.0 / ((double)n * hw);
        stk_err err;
        assert_int_equal(stk_bn_sums(be, x, n, c, hw, NULL, inv, mean, &err), 0);
        assert_int_equal(stk_bn_sums(be, x, n, c, hw, mean, inv, var, &err), 0);
        const float *src[3] = {x, g, NULL};
        size_t zeros = 0;
        for (size_t i = 0; i < total; i++) {
            int ch = (int)(i / hw % c);
            stk_bn_fwd_coef f = stk_bn_fwd_coef_of(mean[ch], var[ch], 1e-5f,
                                                   gamma[ch] + 1.0f, beta[ch]);
            ry[i] = stk_bn_apply1(x[i], f, 1);
            zeros += ry[i] == 0.0f;
        }
        assert_true(zeros > total / 4 && zeros < total * 3 / 4);
        for (int ch = 0; ch < c; ch++)
            p[ch] += 1.0f; /* gamma as above */
        for (int ch = 0; ch < c; ch++) {
            assert_true(mean[ch] ==
                        (float)(bn_lane_sum(src, n, c, hw, ch, term_x, 0) * inv));
            assert_true(var[ch] == (float)(bn_lane_sum(src, n, c, hw, ch,
                                                        term_sq, mean[ch]) *
                                            inv));
        }
        for (int relu = 0; relu < 2; relu++) {
            src[2] = relu ? ry : NULL;
            assert_int_equal(stk_bn_grad_sums(be, g, x, n, c, hw, mean, var,
                                              1e-5f, gamma, beta, relu, sums,
                                              &err),
                             0);
            for (int ch = 0; ch < c; ch++) {
                assert_true(sums[ch] ==
                            (float)bn_lane_sum(src, n, c, hw, ch, term_g, 0));
                assert_true(sums[c + ch] ==
                            (float)(bn_lane_sum(src, n, c, hw, ch, term_gx,
                                                mean[ch]) *
                                    stk_bn_invstd(var[ch], 1e-5f)));
            }
        }
        free(x), free(g), free(ry), free(p);
    }
}

/* PyTorch's update in double, rounded once: momentum * stat + (1 -
 * momentum) * running, the variance unbiased; momentum 0 and 1 exactly. */
static void bn_running_follows_pytorch(void **state)
{
    (void)state;
    enum { C = 6 };
    float rm[C], rv[C], m[C], v[C], rm0[C], rv0[C];
    fill(rm, C, 91);
    fill(rv, C, 92);
    fill(m, C, 93);
    fill(v, C, 94);
    for (int i = 0; i < C; i++)
        rv[i] += 1.5f, v[i] += 1.5f;
    memcpy(rm0, rm, sizeof rm);
    memcpy(rv0, rv, sizeof rv);
    stk_err err;
    float unbias = 8.0f / 7.0f;
    assert_int_equal(stk_bn_running(be, rm, rv, m, v, C, 0.1f, unbias, &err),
                     0);
    for (int i = 0; i < C; i++) {
        double mo = 0.1f;
        assert_true(rm[i] == (float)(mo * m[i] + (1 - mo) * rm0[i]));
        assert_true(rv[i] ==
                    (float)(mo * ((double)v[i] * unbias) + (1 - mo) * rv0[i]));
        /* and within float rounding of the exact 0.1 and 8/7 */
        assert_true(fabs(rm[i] - (0.1 * m[i] + 0.9 * rm0[i])) < 1e-7);
        assert_true(fabs(rv[i] - (0.1 * v[i] * 8 / 7 + 0.9 * rv0[i])) <
                    3e-7 * rv[i]);
    }
    memcpy(rm0, rm, sizeof rm);
    assert_int_equal(stk_bn_running(be, rm, rv, m, v, C, 0.0f, unbias, &err),
                     0);
    assert_memory_equal(rm, rm0, sizeof rm);
    assert_int_equal(stk_bn_running(be, rm, rv, m, v, C, 1.0f, 1.0f, &err), 0);
    assert_memory_equal(rm, m, sizeof rm);
    assert_memory_equal(rv, v, sizeof rv);
    assert_int_equal(stk_bn_running(be, rm, rv, m, v, C, 1.5f, unbias, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "momentum 1.5"));
    assert_int_equal(stk_bn_running(be, rm, rv, m, v, C, 0.1f, 0.5f, &err),
                     STK_EINVAL);
    assert_int_equal(
        stk_bn_apply(be, m, m, 1, C, 1, m, v, 0.0f, m, m, false, &err),
        STK_EINVAL);
    assert_non_null(strstr(err.msg, "eps"));
    assert_int_equal(stk_bn_sums(be, m, 1, 0, 1, NULL, 1.0, v, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "batchnorm sums"));
    assert_int_equal(stk_bn_input_grad(be, m, m, 1, C, 1, m, v, 1e-5f, NULL,
                                       NULL, false, m, 1.0f, v, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "gamma is NULL"));
    /* a fused ReLU's output is recomputed from gamma and beta */
    assert_int_equal(stk_bn_grad_sums(be, m, m, 1, C, 2, m, v, 1e-5f, m, NULL,
                                      true, v, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "beta is NULL"));
    assert_int_equal(stk_bn_input_grad(be, m, m, 1, C, 2, m, v, 1e-5f, m, NULL,
                                       true, m, 1.0f, v, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "beta is NULL"));
}

/* The ranges CUDA's batchnorm sums split a channel's samples into: whole
 * samples, covering the batch in order, none empty, each under 2^31
 * elements, at most 256 unless that bound forces more. */
static void bn_cuda_ranges_cover_the_batch(void **state)
{
    (void)state;
    static const int shapes[][2] = {{128, 1024},  {2, 50176},     {1, 1},
                                    {3000, 1},    {7, 37},        {1000000, 1},
                                    {4, 1 << 30}, {3000, 1 << 20}};
    for (size_t t = 0; t < sizeof shapes / sizeof *shapes; t++) {
        int n = shapes[t][0], hw = shapes[t][1];
        int parts = stk_bn_parts(n, hw), next = 0;
        assert_true(parts >= 1 && parts <= n);
        assert_true(parts <= STK_BN_MAX_PARTS ||
                    (size_t)n / STK_BN_MAX_PARTS * hw >= (size_t)1 << 31);
        for (int p = 0; p < parts; p++) {
            int r0, r1;
            stk_bn_part(n, parts, p, &r0, &r1);
            assert_int_equal(r0, next);
            assert_true(r1 > r0);
            assert_true((size_t)(r1 - r0) * hw < (size_t)1 << 31);
            next = r1;
        }
        assert_int_equal(next, n);
    }
    assert_int_equal(stk_bn_parts(128, 1024), 16); /* 8192 elements each */
}

/* Every new op on 1, 2 and 3 threads: the same bytes. The shapes split
 * channels, planes and rows across threads (BatchNorm1d's channel blocks
 * included). */
typedef struct {
    float *mean, *var, *y, *sums, *dx, *pool, *dpool;
} bn_outs;

static void bn_run_all(stk_backend *b, const float *x, const float *g,
                       const float *p, int n, int c, int hw, bn_outs *o)
{
    stk_err err;
    double inv = 1.0 / ((double)n * hw);
    const float *gamma = p, *beta = p + c;
    assert_int_equal(stk_bn_sums(b, x, n, c, hw, NULL, inv, o->mean, &err), 0);
    assert_int_equal(stk_bn_sums(b, x, n, c, hw, o->mean, inv, o->var, &err),
                     0);
    assert_int_equal(stk_bn_apply(b, x, o->y, n, c, hw, o->mean, o->var, 1e-5f,
                                  gamma, beta, true, &err),
                     0);
    assert_int_equal(stk_bn_grad_sums(b, g, x, n, c, hw, o->mean, o->var, 1e-5f,
                                      gamma, beta, true, o->sums, &err),
                     0);
    assert_int_equal(stk_bn_input_grad(b, g, x, n, c, hw, o->mean, o->var,
                                       1e-5f, gamma, beta, true, o->sums,
                                       (float)inv, o->dx, &err),
                     0);
    if (hw > 1) { /* planes of 50 x hw/50, a 3x3 stride 2 pool */
        int h = 50, w = hw / 50, oh = (h - 3) / 2 + 1, ow = (w - 3) / 2 + 1;
        assert_int_equal(
            stk_avgpool_fwd(b, x, n * c, h, w, 3, 3, 2, 2, o->pool, &err), 0);
        assert_int_equal(
            stk_avgpool_bwd(b, g, n * c, h, w, 3, 3, 2, 2, o->dpool, &err), 0);
        (void)oh, (void)ow;
    }
}

static void bn_outs_alloc(bn_outs *o, size_t total, int c)
{
    o->mean = malloc(c * 4), o->var = malloc(c * 4),
    o->sums = malloc(2 * c * 4);
    o->y = malloc(total * 4), o->dx = malloc(total * 4);
    o->pool = calloc(total, 4), o->dpool = calloc(total, 4);
}

static void bn_outs_free(bn_outs *o)
{
    free(o->mean), free(o->var), free(o->sums), free(o->y), free(o->dx);
    free(o->pool), free(o->dpool);
}

/* The chunks' order, with values whose sums cancel (from helper-39's
 * review): 16 samples of 3 planes of 4096 (enough for the chunks to be
 * split among the threads), zero but for element 0 of some planes.
 * Channel 0: 2^60 in chunk 0, then -2^60 and 1 in chunk 1: 0 chunk by
 * chunk (1 is lost beside -2^60 within chunk 1), 1 as one flat sum.
 * Channel 1: 2^60, -2^60, 1 in chunks 3, 4, 5: 1 in chunk order, 0 in
 * halves or in reverse. Channel 2: 0. The same at 1, 2 and 3 threads,
 * for the statistics' sum and the gradient's sum of g; and 5 samples (3
 * chunks empty) of ones summing to 5. */
static void bn_sums_keep_the_chunks_order(void **state)
{
    (void)state;
    enum { N = 16, C = 3, HW = 4096 };
    size_t total = (size_t)N * C * HW;
    float *x = calloc(total, 4), *ones = malloc(total * 4), zero[C] = {0},
          one[C] = {1, 1, 1}, mean[C], sums[2 * C];
    assert_non_null(x);
    assert_non_null(ones);
    const float big = 1152921504606846976.0f; /* 2^60 */
    x[(0 * C + 0) * HW] = big;                /* chunk 0 */
    x[(2 * C + 0) * HW] = -big;               /* chunk 1 */
    x[(3 * C + 0) * HW] = 1.0f;               /* chunk 1 */
    x[(6 * C + 1) * HW] = big;                /* chunk 3 */
    x[(8 * C + 1) * HW] = -big;               /* chunk 4 */
    x[(10 * C + 1) * HW] = 1.0f;              /* chunk 5 */
    for (size_t i = 0; i < total; i++)
        ones[i] = 1.0f;
    for (int t = 1; t <= 3; t++) {
        stk_backend *b;
        stk_err err;
        assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, t, &b, &err), 0);
        assert_int_equal(stk_bn_sums(b, x, N, C, HW, NULL, 1.0, mean, &err),
                         0);
        assert_true(mean[0] == 0.0f && mean[1] == 1.0f && mean[2] == 0.0f);
        /* g = x, no ReLU: the sums of g as above */
        assert_int_equal(stk_bn_grad_sums(b, x, ones, N, C, HW, zero, one,
                                          1e-5f, one, zero, false, sums, &err),
                         0);
        assert_true(sums[0] == 0.0f && sums[1] == 1.0f && sums[2] == 0.0f);
        assert_int_equal(stk_bn_sums(b, ones, 5, C, 1, NULL, 1.0, mean, &err),
                         0);
        assert_true(mean[0] == 5.0f && mean[2] == 5.0f);
        assert_int_equal(stk_bn_sums(b, ones, 5, C, 16, NULL, 1.0, mean, &err),
                         0);
        assert_true(mean[0] == 80.0f && mean[2] == 80.0f);
        stk_backend_destroy(b);
    }
    free(x), free(ones);
}

static void bn_same_on_1_2_3_threads(void **state)
{
    (void)state;
    /* 70 channels of 150: the sums' blocks of 32 channels, whole and
     * part; 19 samples: the sums' 8 chunks of 2 and 3 samples split among
     * the threads */
    static const int shapes[][3] = {
        {4, 7, 50 * 60}, {3000, 300, 1}, {3, 70, 50 * 3}, {19, 40, 50 * 4}};
    for (int s = 0; s < 4; s++) {
        int n = shapes[s][0], c = shapes[s][1], hw = shapes[s][2];
        size_t total = (size_t)n * c * hw;
        float *x = filled(total, 101), *g = filled(total, 102),
              *p = filled(2 * (size_t)c, 103);
        bn_outs o[3];
        for (int t = 0; t < 3; t++) {
            stk_backend *b;
            stk_err err;
            assert_int_equal(
                stk_backend_create(STK_DEV_CPU, 0, t + 1, &b, &err), 0);
            bn_outs_alloc(&o[t], total, c);
            bn_run_all(b, x, g, p, n, c, hw, &o[t]);
            stk_backend_destroy(b);
        }
        for (int t = 1; t < 3; t++) {
            assert_memory_equal(o[t].mean, o[0].mean, c * 4);
            assert_memory_equal(o[t].var, o[0].var, c * 4);
            assert_memory_equal(o[t].sums, o[0].sums, 2 * c * 4);
            assert_memory_equal(o[t].y, o[0].y, total * 4);
            assert_memory_equal(o[t].dx, o[0].dx, total * 4);
            assert_memory_equal(o[t].pool, o[0].pool, total * 4);
            assert_memory_equal(o[t].dpool, o[0].dpool, total * 4);
        }
        for (int t = 0; t < 3; t++)
            bn_outs_free(&o[t]);
        free(x), free(g), free(p);
    }
}

/* The pool's threads claim a job's ranges, whoever is free first: over
 * thousands of short jobs of changing lengths, on more threads than this
 * machine's cores (so workers are descheduled and wake inside later jobs),
 * y += 1 (axpy of ones) must run every index exactly once per job that
 * covers it. */
static void pool_runs_every_range_once(void **state)
{
    (void)state;
    enum { N = 200000, JOBS = 3000 };
    float *x = malloc(N * 4), *y = calloc(N, 4);
    int *covers = calloc(N + 1, sizeof *covers);
    for (size_t i = 0; i < N; i++)
        x[i] = 1.0f;
    for (int threads = 2; threads <= 5; threads += 3) {
        stk_backend *b;
        stk_err err;
        assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, threads, &b, &err),
                         0);
        memset(y, 0, N * 4);
        memset(covers, 0, (N + 1) * sizeof *covers);
        for (int j = 0; j < JOBS; j++) {
            size_t n = 1 + (size_t)j * 7919 % N;
            covers[n]++; /* indices below n */
            assert_int_equal(stk_axpy(b, n, 1.0f, x, y, &err), 0);
        }
        stk_backend_destroy(b);
        int expect = 0;
        for (size_t i = N; i-- > 0;) {
            expect += covers[i + 1];
            if (y[i] != (float)expect)
                fail_msg("%d threads: index %zu ran %g times, not %d", threads,
                         i, (double)y[i], expect);
        }
    }
    free(x), free(y), free(covers);
}

/* ---- label smoothing -----------------------------------------------------
 */

/* PyTorch's definition: the target q = (1 - e) onehot(label) + e / C, the
 * loss -sum q log softmax(z) per row, averaged over the rows. */
typedef struct {
    int n, c;
    const int32_t *labels;
    double e;
} smooth_ctx;
static double smooth_loss(const double *z, void *ctx)
{
    const smooth_ctx *s = ctx;
    double L = 0;
    for (int r = 0; r < s->n; r++) {
        const double *zr = z + r * s->c;
        double m = -INFINITY, sum = 0;
        for (int j = 0; j < s->c; j++)
            m = zr[j] > m ? zr[j] : m;
        for (int j = 0; j < s->c; j++)
            sum += exp(zr[j] - m);
        for (int j = 0; j < s->c; j++) {
            double q = (j == s->labels[r] ? 1 - s->e : 0) + s->e / s->c;
            L -= q * (zr[j] - m - log(sum));
        }
    }
    return L / s->n;
}

static void xent_label_smoothing_matches_pytorch_and_fd(void **state)
{
    (void)state;
    enum { N = 5, C = 7 };
    static const float es[] = {0.1f, 0.3f, 1.0f};
    float z[N * C], dz[N * C], loss;
    int32_t labels[N] = {0, 6, 3, 3, 1};
    fill(z, N * C, 111);
    for (int i = 0; i < N * C; i++)
        z[i] *= 4;
    double zd[N * C], num[N * C];
    stk_err err;
    for (int t = 0; t < 3; t++) {
        assert_int_equal(stk_xent(be, z, labels, N, C, es[t], &loss, dz, &err),
                         0);
        to_double(z, zd, N * C);
        smooth_ctx s = {N, C, labels, es[t]};
        double want = smooth_loss(zd, &s);
        if (!(fabs(loss - want) < 2e-6 * (1 + fabs(want))))
            fail_msg("smoothing %g: loss %.9g, expected %.9g", (double)es[t],
                     (double)loss, want);
        /* the gradient, directly: (softmax - q) / n */
        double direct[N * C];
        for (int r = 0; r < N; r++) {
            double m = -INFINITY, sum = 0;
            for (int j = 0; j < C; j++)
                m = zd[r * C + j] > m ? zd[r * C + j] : m;
            for (int j = 0; j < C; j++)
                sum += exp(zd[r * C + j] - m);
            for (int j = 0; j < C; j++)
                direct[r * C + j] =
                    (exp(zd[r * C + j] - m) / sum -
                     ((j == labels[r] ? 1 - s.e : 0) + s.e / C)) /
                    N;
        }
        near(dz, direct, N * C, 1e-6, "smoothed dlogits");
        numgrad(smooth_loss, zd, N * C, &s, num);
        near(dz, num, N * C, 1e-5, "smoothed dlogits (fd)");
    }
    assert_int_equal(stk_xent(be, z, labels, N, C, 1.5f, &loss, dz, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "label smoothing"));
}

static void dropout_rates_and_groups(void **state)
{
    (void)state;
    enum { N = 100000 };
    float *x = malloc(N * 4), *g = malloc(N * 4);
    for (int i = 0; i < N; i++)
        x[i] = g[i] = 1.0f;
    stk_philox_key k = {7, 9};
    stk_err err;
    assert_int_equal(stk_dropout(be, x, N, 0, 1, 0.3f, k, 5, &err), 0);
    int kept = 0;
    for (int i = 0; i < N; i++) {
        assert_true(x[i] == 0.0f || fabsf(x[i] - 1 / 0.7f) < 1e-6f);
        kept += x[i] != 0.0f;
    }
    assert_true(fabs(kept / (double)N - 0.7) < 0.01);
    /* backward: the same call on the gradient drops the same elements */
    assert_int_equal(stk_dropout(be, g, N, 0, 1, 0.3f, k, 5, &err), 0);
    assert_memory_equal(x, g, N * 4);
    /* another stream (step) draws another mask */
    for (int i = 0; i < N; i++)
        g[i] = 1.0f;
    assert_int_equal(stk_dropout(be, g, N, 0, 1, 0.3f, k, 6, &err), 0);
    assert_memory_not_equal(x, g, N * 4);
    /* dropout2d: whole groups of 25 */
    for (int i = 0; i < N; i++)
        x[i] = 1.0f;
    assert_int_equal(stk_dropout(be, x, N, 0, 25, 0.5f, k, 1, &err), 0);
    for (int i = 0; i < N; i += 25)
        for (int j = 1; j < 25; j++)
            assert_true(x[i + j] == x[i]);
    for (int i = 0; i < N; i++) /* the per-element body agrees */
        assert_true(x[i] == stk_dropout_scale1(k, 1, (size_t)i, 25, 0.5f));
    for (int i = 0; i < N; i++)
        g[i] = 1.0f;
    assert_int_equal(stk_dropout(be, g, N, 0, 1, 0.3f, k, 9, &err), 0);
    for (int i = 0; i < N; i++)
        assert_true(g[i] == stk_dropout_scale1(k, 9, (size_t)i, 1, 0.3f));
    assert_int_equal(stk_dropout(be, x, N, 0, 1, 1.0f, k, 1, &err), STK_EINVAL);
    /* in pieces (first > 0, groups of 25 and single elements, pieces that
     * start inside a Philox block of 4 groups): the same as in one call */
    size_t cuts[] = {0, 25 * 3, 25 * 401, 25 * 1000, N};
    for (size_t group = 1; group <= 25; group += 24) {
        for (int i = 0; i < N; i++)
            x[i] = g[i] = 1.0f + (float)(i % 7);
        assert_int_equal(stk_dropout(be, x, N, 0, group, 0.4f, k, 3, &err), 0);
        for (int c = 0; c < 4; c++)
            assert_int_equal(stk_dropout(be, g + cuts[c], cuts[c + 1] - cuts[c],
                                         cuts[c], group, 0.4f, k, 3, &err), 0);
        assert_memory_equal(x, g, N * 4);
    }
    assert_int_equal(stk_dropout(be, x, 10, 7, 25, 0.4f, k, 3, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "element 7 does not start a group of 25"));
    free(x);
    free(g);
}

static void transform_normalises_crops_and_flips(void **state)
{
    (void)state;
    enum { N = 64, C = 2, H = 4, W = 5 };
    uint8_t x[N * C * H * W];
    for (int i = 0; i < N * C * H * W; i++)
        x[i] = (uint8_t)(i * 7);
    uint64_t ids[N];
    for (int i = 0; i < N; i++)
        ids[i] = 1000 + i;
    stk_transform t = {C, H, W, {0.5f, 0.25f}, {2.0f, 4.0f}, 0, 0, {1, 2}, 3};
    float y[N * C * H * W];
    stk_err err;
    assert_int_equal(stk_transform_batch(be, x, ids, N, &t, y, &err), 0);
    for (int i = 0; i < N * C * H * W; i++) {
        int c = i / (H * W) % C;
        float want = (x[i] / 255.0f - t.mean[c]) * t.inv_std[c];
        assert_true(fabsf(y[i] - want) < 1e-6f);
    }
    /* flip only: each sample is itself or its mirror, both happen */
    t.flip = 1;
    assert_int_equal(stk_transform_batch(be, x, ids, N, &t, y, &err), 0);
    int flips = 0;
    for (int s = 0; s < N; s++) {
        int same = 1, mirror = 1;
        for (int c = 0; c < C; c++)
            for (int r = 0; r < H; r++)
                for (int q = 0; q < W; q++) {
                    size_t o = ((size_t)(s * C + c) * H + r) * W;
                    float v = y[o + q];
                    float a = (x[o + q] / 255.0f - t.mean[c]) * t.inv_std[c];
                    float b = (x[o + W - 1 - q] / 255.0f - t.mean[c]) *
                              t.inv_std[c];
                    same &= fabsf(v - a) < 1e-6f;
                    mirror &= fabsf(v - b) < 1e-6f;
                }
        assert_true(same || mirror);
        flips += !same;
    }
    assert_true(flips > 10 && flips < 54);
    /* crop with padding 1: every output is a shifted input or the padding */
    t.flip = 0;
    t.pad = 1;
    assert_int_equal(stk_transform_batch(be, x, ids, N, &t, y, &err), 0);
    float pad0 = (0 - t.mean[0]) * t.inv_std[0];
    int shifted = 0;
    for (int s = 0; s < N; s++) {
        int found = 0;
        for (int dy = -1; dy <= 1 && !found; dy++)
            for (int dx = -1; dx <= 1 && !found; dx++) {
                int ok = 1;
                for (int r = 0; r < H && ok; r++)
                    for (int q = 0; q < W && ok; q++) {
                        int sy = r + dy, sx = q + dx;
                        float v = y[((size_t)s * C * H + r) * W + q];
                        float want = sy < 0 || sy >= H || sx < 0 || sx >= W
                                         ? pad0
                                         : (x[((size_t)s * C * H + sy) * W + sx] /
                                                255.0f - t.mean[0]) *
                                               t.inv_std[0];
                        ok = fabsf(v - want) < 1e-6f;
                    }
                found = ok;
                shifted += ok && (dy || dx);
            }
        assert_true(found);
    }
    assert_true(shifted > 20);
    /* the CPU loop gives exactly the per-element body's floats (the CUDA
     * kernel's arithmetic), with crop and flip on */
    t.flip = 1;
    assert_int_equal(stk_transform_batch(be, x, ids, N, &t, y, &err), 0);
    for (int s = 0; s < N; s++)
        for (size_t j = 0; j < (size_t)C * H * W; j++)
            assert_true(y[(size_t)s * C * H * W + j] ==
                        stk_transform1(x, &t, ids[s], (size_t)s * C * H * W + j));
}

static void optimizers_follow_pytorch_rules(void **state)
{
    (void)state;
    /* two steps by hand, PyTorch's formulas */
    float w[2] = {1.0f, -2.0f}, g[2] = {0.5f, 0.25f}, buf[2];
    stk_sgd_cfg s = {0.1f, 0.9f, 0.01f, 0, 1, NULL};
    stk_err err;
    assert_int_equal(stk_sgd_step(be, w, g, buf, 2, &s, &err), 0);
    double d0 = 0.5 + 0.01 * 1.0, w0 = 1.0 - 0.1 * d0;
    assert_true(fabs(w[0] - w0) < 1e-6);
    s.first = 0;
    assert_int_equal(stk_sgd_step(be, w, g, buf, 2, &s, &err), 0);
    double d1 = 0.5 + 0.01 * w0, b1 = 0.9 * d0 + d1;
    assert_true(fabs(w[0] - (w0 - 0.1 * b1)) < 1e-6);
    /* nesterov */
    float wn[1] = {1.0f}, bn[1];
    stk_sgd_cfg sn = {0.1f, 0.9f, 0.0f, 1, 1, NULL};
    assert_int_equal(stk_sgd_step(be, wn, g, bn, 1, &sn, &err), 0);
    assert_true(fabs(wn[0] - (1.0 - 0.1 * (0.5 + 0.9 * 0.5))) < 1e-6);
    /* AdamW, step 1 at lr 1 (so an error in the step shows at full size):
     * w = w(1 - lr wd) - lr * m1/(1-b1) / (sqrt(v1/(1-b2)) + eps) */
    float wa[1] = {1.0f}, m[1] = {0}, v[1] = {0};
    stk_adamw_cfg a = {1.0f, 0.9f, 0.999f, 1e-8f, 0.1f, (float)(1 - 0.9),
                       (float)sqrt(1 - 0.999), (float)(1 - 0.9), (float)(1 - 0.999), NULL};
    assert_int_equal(stk_adamw_step(be, wa, g, m, v, 1, &a, &err), 0);
    double mm = 0.1 * 0.5, vv = 0.001 * 0.25;
    double want = 1.0 * (1 - 1.0 * 0.1) - 1.0 / 0.1 * mm / (sqrt(vv) / sqrt(0.001) + 1e-8);
    assert_true(fabs(wa[0] - want) < 2e-7 * fabs(want) + 1e-7);
}

/* A guard that recorded a non-finite step or a label out of range refuses
 * the update: weights and optimizer state keep every bit; a clean guard
 * updates as without one. */
static void a_guard_refuses_a_bad_step(void **state)
{
    (void)state;
    stk_err err;
    const float w0[2] = {1.0f, -2.0f}, g[2] = {0.5f, 0.25f};
    stk_metrics bad[3] = {{.bad_step = 7}, {.bad_row = 3}, {.bad_step = 0}};
    for (int k = 0; k < 3; k++) {
        float w[2], buf[2] = {0.5f, 0.5f}, m[2] = {0.1f, 0.1f}, v[2] = {0.2f, 0.2f};
        float ws[2], bufs[2] = {0.5f, 0.5f};
        memcpy(w, w0, sizeof w);
        memcpy(ws, w0, sizeof ws);
        stk_sgd_cfg s = {0.1f, 0.9f, 0.01f, 0, 0, &bad[k]}, plain = s;
        plain.guard = NULL;
        assert_int_equal(stk_sgd_step(be, w, g, buf, 2, &s, &err), 0);
        assert_int_equal(stk_sgd_step(be, ws, g, bufs, 2, &plain, &err), 0);
        bool refused = k < 2;
        assert_true(refused ? !memcmp(w, w0, sizeof w) && buf[0] == 0.5f
                            : !memcmp(w, ws, sizeof w) && !memcmp(buf, bufs, sizeof buf));
        stk_adamw_cfg a = {0.1f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.5f, 0.5f, 0.1f, 0.001f,
                           &bad[k]};
        float wa[2];
        memcpy(wa, w0, sizeof wa);
        assert_int_equal(stk_adamw_step(be, wa, g, m, v, 2, &a, &err), 0);
        assert_true(refused == (!memcmp(wa, w0, sizeof wa) && m[0] == 0.1f && v[0] == 0.2f));
    }
}

/* Several steps from a non-zero state against the rules written in double:
 * SGD with momentum (plain and Nesterov: their terms only differ once the
 * buffer holds an earlier step) and weight decay, and AdamW at steps 5..8
 * from non-zero moments. */
static void optimizers_several_steps_from_a_state(void **state)
{
    (void)state;
    enum { P = 5, STEPS = 4 };
    stk_err err;
    for (int nesterov = 0; nesterov < 2; nesterov++) {
        float w[P], buf[P], g[P];
        double rw[P], rb[P];
        for (int i = 0; i < P; i++) {
            rw[i] = w[i] = 0.5f - 0.3f * (float)i;
            rb[i] = buf[i] = 0.2f * (float)(i % 3) - 0.15f;
        }
        for (int t = 0; t < STEPS; t++) {
            stk_sgd_cfg c = {0.05f * (float)(t + 1), 0.9f, 0.01f, nesterov, 0, NULL};
            for (int i = 0; i < P; i++)
                g[i] = sinf((float)(i + 3 * t));
            assert_int_equal(stk_sgd_step(be, w, g, buf, P, &c, &err), 0);
            for (int i = 0; i < P; i++) {
                double d = g[i] + (double)0.01f * rw[i];
                rb[i] = (double)0.9f * rb[i] + d;
                d = nesterov ? d + (double)0.9f * rb[i] : rb[i];
                rw[i] -= (double)c.lr * d;
            }
        }
        for (int i = 0; i < P; i++) {
            assert_true(fabs(w[i] - rw[i]) < 2e-6 * (fabs(rw[i]) + 1));
            assert_true(fabs(buf[i] - rb[i]) < 2e-6 * (fabs(rb[i]) + 1));
        }
    }
    float w[P], m[P], v[P], g[P];
    double rw[P], rm[P], rv[P];
    for (int i = 0; i < P; i++) {
        rw[i] = w[i] = 0.5f - 0.3f * (float)i;
        rm[i] = m[i] = 0.05f * (float)(i - 2);
        rv[i] = v[i] = 0.01f + 0.002f * (float)i;
    }
    for (int t = 5; t < 5 + STEPS; t++) {
        double b1 = 0.9, b2 = 0.999, lr = 0.01 * t, wd = 0.1;
        stk_adamw_cfg c = {(float)lr, (float)b1, (float)b2, 1e-8f, (float)wd,
                           (float)(1 - pow(b1, t)), (float)sqrt(1 - pow(b2, t)),
                           (float)(1 - b1), (float)(1 - b2), NULL};
        for (int i = 0; i < P; i++)
            g[i] = cosf((float)(2 * i + t));
        assert_int_equal(stk_adamw_step(be, w, g, m, v, P, &c, &err), 0);
        for (int i = 0; i < P; i++) {
            rw[i] *= 1 - (double)c.lr * (double)c.weight_decay;
            rm[i] = b1 * rm[i] + (1 - b1) * g[i];
            rv[i] = b2 * rv[i] + (1 - b2) * g[i] * g[i];
            double den = sqrt(rv[i] / (1 - pow(b2, t))) + 1e-8;
            rw[i] -= (double)c.lr * rm[i] / (1 - pow(b1, t)) / den;
        }
    }
    for (int i = 0; i < P; i++) {
        assert_true(fabs(w[i] - rw[i]) < 2e-6 * (fabs(rw[i]) + 1));
        assert_true(fabs(m[i] - rm[i]) < 2e-6 * (fabs(rm[i]) + 0.1));
        assert_true(fabs(v[i] - rv[i]) < 2e-6 * rv[i]);
    }
}

static void reductions(void **state)
{
    (void)state;
    float x[1000], y[1000];
    for (int i = 0; i < 1000; i++)
        x[i] = y[i] = (float)i / 100;
    double s;
    stk_err err;
    assert_int_equal(stk_sumsq(be, x, 1000, &s, &err), 0);
    double want = 0;
    for (int i = 0; i < 1000; i++)
        want += (double)x[i] * x[i];
    assert_true(fabs(s - want) < 1e-9 * want);
    assert_int_equal(stk_axpy(be, 1000, -2.0f, x, y, &err), 0);
    assert_int_equal(stk_scale(be, 1000, -1.0f, y, &err), 0);
    for (int i = 0; i < 1000; i++)
        assert_true(y[i] == x[i]);
}

static void cuda_without_gpu_fails_clearly(void **state)
{
    (void)state;
    stk_backend *cu;
    stk_err err = {0};
    int rc = stk_backend_create(STK_DEV_CUDA, 0, 0, &cu, &err);
    int n;
    stk_err e2;
    if (stk_cuda_device_count(&n, &e2) == 0) {
        assert_int_equal(rc, 0); /* a GPU is here: it must work */
        stk_backend_destroy(cu);
        return;
    }
    assert_int_not_equal(rc, 0);
    assert_null(cu);
    assert_non_null(strstr(err.msg, "--device cuda"));
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(philox_known_answers),
    cmocka_unit_test(gemm_all_transposes),
    cmocka_unit_test(small_gemm_matches_double),
    cmocka_unit_test(small_gemm_same_on_1_2_3_threads),
    cmocka_unit_test(ranges_run_each_once_on_one_thread),
    cmocka_unit_test(relu_backward_matches_fd),
    cmocka_unit_test(linear_backward_matches_fd),
    cmocka_unit_test(conv_backward_matches_fd),
    cmocka_unit_test(winograd_matches_fd),
    cmocka_unit_test(winograd_rows_equal_per_tile_bodies),
    cmocka_unit_test(gemm_batched_equals_one_by_one),
    cmocka_unit_test(batched_im2col_and_swap),
    cmocka_unit_test(im2col_stride2_matches_bodies),
    cmocka_unit_test(maxpool_backward_matches_fd),
    cmocka_unit_test(maxpool_gather_equals_scatter),
    cmocka_unit_test(xent_matches_reference_and_fd),
    cmocka_unit_test(xent_label_smoothing_matches_pytorch_and_fd),
    cmocka_unit_test(avgpool_matches_naive_and_fd),
    cmocka_unit_test(add_and_device_copy),
    cmocka_unit_test(batchnorm_training_matches_fd),
    cmocka_unit_test(bn_sums_follow_the_lanes),
    cmocka_unit_test(bn_running_follows_pytorch),
    cmocka_unit_test(bn_sums_keep_the_chunks_order),
    cmocka_unit_test(bn_same_on_1_2_3_threads),
    cmocka_unit_test(pool_runs_every_range_once),
    cmocka_unit_test(bn_cuda_ranges_cover_the_batch),
    cmocka_unit_test(dropout_rates_and_groups),
    cmocka_unit_test(transform_normalises_crops_and_flips),
    cmocka_unit_test(optimizers_follow_pytorch_rules),
    cmocka_unit_test(a_guard_refuses_a_bad_step),
    cmocka_unit_test(optimizers_several_steps_from_a_state),
    cmocka_unit_test(reductions),
    cmocka_unit_test(cuda_without_gpu_fails_clearly),
};

UNIT_MAIN_WITH(tests, setup, teardown)
