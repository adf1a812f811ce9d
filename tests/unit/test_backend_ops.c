/* test_backend_ops - every op on the CUDA backend against the CPU backend
 * (the reference), on the same inputs. Exits 77 (skipped) where there is no
 * GPU or no CUDA build, saying why (STK_GPU_TESTS_ON_CPU=1 runs it with a
 * second CPU backend in the GPU's place, to check the tests' CPU side on a
 * machine without one). Element-wise ops must agree exactly
 * (the same shared bodies, no FMA contraction); GEMM and reductions within
 * a normalised error. */
#include "unit_gpu.h"

#include "kernels/kernels.h"

#include <math.h>

static stk_backend *cpu, *gpu;

static float *dev_copy(const void *host, size_t bytes)
{
    stk_err err;
    void *d = stk_dev_alloc(gpu, bytes, &err);
    assert_non_null(d);
    assert_int_equal(stk_copy_to_dev(gpu, d, host, bytes, &err), 0);
    return d;
}

static void *host_copy(const void *dev, size_t bytes)
{
    stk_err err;
    void *h = malloc(bytes);
    assert_int_equal(stk_copy_to_host(gpu, h, dev, bytes, &err), 0);
    assert_int_equal(stk_sync(gpu, &err), 0);
    return h;
}

static void fill(float *x, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++)
        x[i] = 2.0f * stk_philox_uniform((stk_philox_key){seed, 7}, 0, i) - 1.0f;
}

/* max |a-b| / max(1, max |b|) */
static double nerr(const float *a, const float *b, size_t n)
{
    double worst = 0, scale = 1;
    for (size_t i = 0; i < n; i++) {
        scale = fabs(b[i]) > scale ? fabs(b[i]) : scale;
        double d = fabs((double)a[i] - b[i]);
        if (d != d)
            return INFINITY;
        worst = d > worst ? d : worst;
    }
    return worst / scale;
}

static void gemm_agrees(void **state)
{
    (void)state;
    int m = 33, n = 70, k = 45;
    float *a = malloc(sizeof(float) * m * k), *b = malloc(sizeof(float) * k * n),
          *c = malloc(sizeof(float) * m * n);
    fill(a, (size_t)m * k, 1);
    fill(b, (size_t)k * n, 2);
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            fill(c, (size_t)m * n, 3);
            float *da = dev_copy(a, sizeof(float) * m * k),
                  *db = dev_copy(b, sizeof(float) * k * n),
                  *dc = dev_copy(c, sizeof(float) * m * n);
            stk_err err;
            int lda = ta ? m : k, ldb = tb ? k : n;
            assert_int_equal(stk_gemm(cpu, ta, tb, m, n, k, 0.7f, a, lda, b, ldb,
                                      0.3f, c, n, &err), 0);
            assert_int_equal(stk_gemm(gpu, ta, tb, m, n, k, 0.7f, da, lda, db, ldb,
                                      0.3f, dc, n, &err), 0);
            float *got = host_copy(dc, sizeof(float) * m * n);
            assert_true(nerr(got, c, (size_t)m * n) < 1e-5);
            free(got);
            stk_dev_free(gpu, da), stk_dev_free(gpu, db), stk_dev_free(gpu, dc);
        }
    free(a), free(b), free(c);
}

static void elementwise_ops_agree_exactly(void **state)
{
    (void)state;
    enum { N = 4 * 6 * 7 * 9 };
    float x[N], y[N], dy[N], dx[N];
    fill(x, N, 4);
    fill(dy, N, 5);
    stk_err err;
    float *dxs = dev_copy(x, sizeof x), *dys = dev_copy(dy, sizeof dy);
    float *dyo = dev_copy(x, sizeof x), *ddx = dev_copy(x, sizeof x);
    /* relu forward and backward */
    assert_int_equal(stk_relu_fwd(cpu, x, y, N, &err), 0);
    assert_int_equal(stk_relu_fwd(gpu, dxs, dyo, N, &err), 0);
    float *got = host_copy(dyo, sizeof y);
    assert_memory_equal(got, y, sizeof y);
    free(got);
    assert_int_equal(stk_relu_bwd(cpu, y, dy, dx, N, &err), 0);
    assert_int_equal(stk_relu_bwd(gpu, dyo, dys, ddx, N, &err), 0);
    got = host_copy(ddx, sizeof dx);
    assert_memory_equal(got, dx, sizeof dx);
    free(got);
    /* dropout and dropout2d */
    for (size_t group = 1; group <= 63; group += 62) {
        memcpy(y, x, sizeof x);
        assert_int_equal(stk_copy_to_dev(gpu, dyo, x, sizeof x, &err), 0);
        assert_int_equal(stk_dropout(cpu, y, N, 0, group, 0.4f, (stk_philox_key){3, 4}, 11, &err), 0);
        assert_int_equal(stk_dropout(gpu, dyo, N, 0, group, 0.4f, (stk_philox_key){3, 4}, 11, &err), 0);
        got = host_copy(dyo, sizeof y);
        assert_memory_equal(got, y, sizeof y);
        free(got);
    }
    /* bias add and bias grad: rows 4, cols 6, inner 63 */
    float b[6], db[6] = {0}, gdb[6];
    fill(b, 6, 6);
    float *dbias = dev_copy(b, sizeof b), *ddb = dev_copy(db, sizeof db);
    memcpy(y, x, sizeof x);
    assert_int_equal(stk_copy_to_dev(gpu, dyo, x, sizeof x, &err), 0);
    assert_int_equal(stk_bias_add(cpu, y, b, 4, 6, 63, &err), 0);
    assert_int_equal(stk_bias_add(gpu, dyo, dbias, 4, 6, 63, &err), 0);
    got = host_copy(dyo, sizeof y);
    assert_memory_equal(got, y, sizeof y);
    free(got);
    assert_int_equal(stk_bias_grad(cpu, dy, db, 4, 6, 63, &err), 0);
    assert_int_equal(stk_bias_grad(gpu, dys, ddb, 4, 6, 63, &err), 0);
    float *g6 = host_copy(ddb, sizeof gdb);
    assert_true(nerr(g6, db, 6) < 1e-6);
    free(g6);
    stk_dev_free(gpu, dxs), stk_dev_free(gpu, dys), stk_dev_free(gpu, dyo);
    stk_dev_free(gpu, ddx), stk_dev_free(gpu, dbias), stk_dev_free(gpu, ddb);
}

static void conv_helpers_agree_exactly(void **state)
{
    (void)state;
    stk_conv_shape s = {3, 9, 8, 3, 3, 2, 1, 1, 1, 5, 8};
    int n = 4;
    size_t nx = (size_t)n * 3 * 9 * 8, ncol = (size_t)27 * n * 40;
    float *x = malloc(nx * 4), *col = malloc(ncol * 4), *dx = malloc(nx * 4);
    fill(x, nx, 8);
    stk_err err;
    float *dx_dev = dev_copy(x, nx * 4), *dcol = dev_copy(col, ncol * 4);
    assert_int_equal(stk_im2col(cpu, x, &s, n, col, &err), 0);
    assert_int_equal(stk_im2col(gpu, dx_dev, &s, n, dcol, &err), 0);
    float *got = host_copy(dcol, ncol * 4);
    assert_memory_equal(got, col, ncol * 4);
    free(got);
    assert_int_equal(stk_col2im(cpu, col, &s, n, dx, &err), 0);
    assert_int_equal(stk_col2im(gpu, dcol, &s, n, dx_dev, &err), 0);
    got = host_copy(dx_dev, nx * 4);
    assert_memory_equal(got, dx, nx * 4);
    free(got);
    /* swap01 and max-pool */
    float *sw = malloc(nx * 4), *dsw = dev_copy(x, nx * 4), *dsrc = dev_copy(x, nx * 4);
    assert_int_equal(stk_swap01(cpu, x, sw, 4, 3, 72, &err), 0);
    assert_int_equal(stk_swap01(gpu, dsrc, dsw, 4, 3, 72, &err), 0);
    got = host_copy(dsw, nx * 4);
    assert_memory_equal(got, sw, nx * 4);
    free(got);
    int32_t arg[12 * 4 * 4], *darg = (int32_t *)dev_copy(arg, sizeof arg);
    float py[12 * 4 * 4], *dpy = dev_copy(py, sizeof py);
    assert_int_equal(stk_maxpool_fwd(cpu, x, 12, 9, 8, 2, 2, py, arg, &err), 0);
    assert_int_equal(stk_maxpool_fwd(gpu, dsrc, 12, 9, 8, 2, 2, dpy, darg, &err), 0);
    got = host_copy(dpy, sizeof py);
    assert_memory_equal(got, py, sizeof py);
    free(got);
    assert_int_equal(stk_maxpool_bwd(cpu, py, arg, 12, 9, 8, 2, 2, dx, &err), 0);
    assert_int_equal(stk_maxpool_bwd(gpu, dpy, darg, 12, 9, 8, 2, 2, dx_dev, &err), 0);
    got = host_copy(dx_dev, nx * 4);
    assert_memory_equal(got, dx, nx * 4);
    free(got);
    /* overlapping windows (3x3, stride 1): the gather and the scatter agree */
    int32_t arg3[12 * 7 * 6], *darg3 = (int32_t *)dev_copy(arg3, sizeof arg3);
    float py3[12 * 7 * 6], *dpy3 = dev_copy(py3, sizeof py3);
    assert_int_equal(stk_maxpool_fwd(cpu, x, 12, 9, 8, 3, 1, py3, arg3, &err), 0);
    assert_int_equal(stk_maxpool_fwd(gpu, dsrc, 12, 9, 8, 3, 1, dpy3, darg3, &err), 0);
    assert_int_equal(stk_maxpool_bwd(cpu, py3, arg3, 12, 9, 8, 3, 1, dx, &err), 0);
    assert_int_equal(stk_maxpool_bwd(gpu, dpy3, darg3, 12, 9, 8, 3, 1, dx_dev, &err), 0);
    got = host_copy(dx_dev, nx * 4);
    assert_memory_equal(got, dx, nx * 4);
    free(got);
    stk_dev_free(gpu, darg3), stk_dev_free(gpu, dpy3);
    stk_dev_free(gpu, dx_dev), stk_dev_free(gpu, dcol), stk_dev_free(gpu, dsw);
    stk_dev_free(gpu, dsrc), stk_dev_free(gpu, darg), stk_dev_free(gpu, dpy);
    free(x), free(col), free(dx), free(sw);
}

/* One Winograd transform on both backends: cpu_out and the GPU's from the
 * same input must be the same bytes (the shared bodies, no FMA). */
typedef int (*wino_op)(stk_backend *be, const float *in, float *out,
                       const void *ctx, stk_err *err);

static void wino_agrees(wino_op op, const void *ctx, const float *in,
                        size_t nin, size_t nout, const char *what)
{
    stk_err err;
    float *out = calloc(nout, 4), *din = dev_copy(in, nin * 4),
          *dout = dev_copy(out, nout * 4), *in1 = malloc(nin * 4);
    memcpy(in1, in, nin * 4); /* the input gradient writes into its input */
    assert_int_equal(op(cpu, in1, out, ctx, &err), 0);
    assert_int_equal(op(gpu, din, dout, ctx, &err), 0);
    float *got = host_copy(dout, nout * 4);
    if (memcmp(got, out, nout * 4))
        fail_msg("winograd %s: the GPU's floats differ from the CPU's", what);
    free(got), free(out), free(in1);
    stk_dev_free(gpu, din), stk_dev_free(gpu, dout);
}

typedef struct wino_ctx {
    stk_conv_shape s;
    int n, cout;
    const float *bias; /* device or host, per backend: see wino_output */
    const float *dbias;
} wino_ctx;

static int w_filter(stk_backend *be, const float *in, float *out,
                    const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_filter(be, in, c->cout, c->s.c, out, err);
}

static int w_filter_grad(stk_backend *be, const float *in, float *out,
                         const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_filter_grad(be, in, c->cout, c->s.c, out, err);
}

static int w_input(stk_backend *be, const float *in, float *out,
                   const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_input(be, in, &c->s, c->n, out, err);
}

static int w_input_grad(stk_backend *be, const float *in, float *out,
                        const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_input_grad(be, (float *)in, &c->s, c->n, out, err);
}

static int w_output(stk_backend *be, const float *in, float *out,
                    const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_output(be, in, be == cpu ? c->bias : c->dbias, &c->s,
                           c->cout, c->n, out, err);
}

static int w_output_grad(stk_backend *be, const float *in, float *out,
                         const void *ctx, stk_err *err)
{
    const wino_ctx *c = ctx;
    return stk_wino_output_grad(be, in, &c->s, c->cout, c->n, out, err);
}

/* 16 row-major GEMMs C_p = alpha op(A_p) op(B_p) + beta C_p (A, B, C all
 * read from `in`, C_p packed m x n in a stride sc) on both backends,
 * within float rounding. */
static void gemm_batch_agrees(bool ta, bool tb, int m, int n, int k,
                              const float *in, size_t sa, const float *b_in,
                              size_t sb, float beta, size_t sc)
{
    stk_err err;
    size_t na = STK_WINO_P * sa, nb = STK_WINO_P * sb, nc = STK_WINO_P * sc;
    float *c = malloc(nc * 4), *da = dev_copy(in, na * 4), *db = dev_copy(b_in, nb * 4);
    memcpy(c, in, nc * 4);
    float *dc = dev_copy(c, nc * 4);
    int lda = ta ? m : k, ldb = tb ? k : n;
    assert_int_equal(stk_gemm_batched(cpu, ta, tb, m, n, k, 1, in, lda, sa, b_in, ldb,
                                      sb, beta, c, n, sc, STK_WINO_P, &err), 0);
    assert_int_equal(stk_gemm_batched(gpu, ta, tb, m, n, k, 1, da, lda, sa, db, ldb,
                                      sb, beta, dc, n, sc, STK_WINO_P, &err), 0);
    float *got = host_copy(dc, nc * 4);
    for (int p = 0; p < STK_WINO_P; p++)
        assert_true(nerr(got + p * sc, c + p * sc, (size_t)m * n) < 1e-5);
    free(got), free(c);
    stk_dev_free(gpu, da), stk_dev_free(gpu, db), stk_dev_free(gpu, dc);
}

/* im2col's batched GEMMs: the weights shared (stride 0) and each
 * sample's output a column block of one C (forward: W [co, K] x the
 * sample's columns; backward dx: W^T x the sample's dy, into dcol). */
static void im2col_batches_agree(void **state)
{
    (void)state;
    enum { CO = 6, K = 12, HW = 50, N = 3 };
    float w[CO * K], col[K * N * HW], y[N * CO * HW], dcol[K * N * HW];
    fill(w, CO * K, 31);
    fill(col, K * N * HW, 32);
    fill(y, N * CO * HW, 33);
    fill(dcol, K * N * HW, 34);
    float *dw = dev_copy(w, sizeof w), *dcolumns = dev_copy(col, sizeof col);
    float *dy = dev_copy(y, sizeof y), *ddcol = dev_copy(dcol, sizeof dcol);
    stk_err err;
    assert_int_equal(stk_gemm_batched(cpu, false, false, CO, HW, K, 1, w, K, 0, col,
                                      N * HW, HW, 0, y, HW, CO * HW, N, &err), 0);
    assert_int_equal(stk_gemm_batched(gpu, false, false, CO, HW, K, 1, dw, K, 0,
                                      dcolumns, N * HW, HW, 0, dy, HW, CO * HW, N,
                                      &err), 0);
    float *got = host_copy(dy, sizeof y);
    assert_true(nerr(got, y, N * CO * HW) < 1e-5);
    free(got);
    /* dx's columns from y as dy */
    assert_int_equal(stk_gemm_batched(cpu, true, false, K, HW, CO, 1, w, K, 0, y, HW,
                                      CO * HW, 0, dcol, N * HW, HW, N, &err), 0);
    assert_int_equal(stk_gemm_batched(gpu, true, false, K, HW, CO, 1, dw, K, 0, dy,
                                      HW, CO * HW, 0, ddcol, N * HW, HW, N, &err), 0);
    got = host_copy(ddcol, sizeof dcol);
    assert_true(nerr(got, dcol, K * N * HW) < 1e-5);
    free(got);
    stk_dev_free(gpu, dw), stk_dev_free(gpu, dcolumns), stk_dev_free(gpu, dy);
    stk_dev_free(gpu, ddcol);
}

/* Every Winograd transform, with padding and tiles running past the image;
 * and the batched GEMM within rounding of the CPU's. */
static void winograd_agrees(void **state)
{
    (void)state;
    float bias[6];
    fill(bias, 6, 21);
    wino_ctx c = {{5, 9, 11, 3, 3, 1, 1, 1, 2, 9, 13}, 3, 6, bias, NULL};
    float *dbias = dev_copy(bias, sizeof bias);
    c.dbias = dbias;
    int th, tw, nt = stk_wino_tiles(&c.s, &th, &tw) * c.n;
    size_t su = stk_wino_stride((size_t)c.cout * c.s.c);
    size_t sv = stk_wino_stride((size_t)c.s.c * nt);
    size_t sm = stk_wino_stride((size_t)c.cout * nt);
    size_t nx = (size_t)c.n * c.s.c * c.s.h * c.s.w;
    size_t ny = (size_t)c.n * c.cout * c.s.oh * c.s.ow, nw = (size_t)c.cout * c.s.c * 9;
    size_t big = STK_WINO_P * (sm > sv ? sm : sv) + nx + ny + nw;
    float *in = malloc(big * 4);
    fill(in, big, 22);
    wino_agrees(w_filter, &c, in, nw, STK_WINO_P * su, "filter");
    wino_agrees(w_filter_grad, &c, in, STK_WINO_P * su, nw, "filter_grad");
    wino_agrees(w_input, &c, in, nx, STK_WINO_P * sv, "input");
    wino_agrees(w_input_grad, &c, in, STK_WINO_P * sv, nx, "input_grad");
    wino_agrees(w_output, &c, in, STK_WINO_P * sm, ny, "output");
    wino_ctx nb = c; /* a convolution without bias (before a batchnorm) */
    nb.bias = nb.dbias = NULL;
    wino_agrees(w_output, &nb, in, STK_WINO_P * sm, ny, "output, no bias");
    wino_agrees(w_output_grad, &c, in, ny, STK_WINO_P * sm, "output_grad");
    /* the 16 GEMMs of the three passes: M_p = U_p V_p, dU_p += dM_p V_p^T,
     * dV_p = U_p^T dM_p */
    gemm_batch_agrees(false, false, c.cout, nt, c.s.c, in, su, in, sv, 0.0f, sm);
    gemm_batch_agrees(false, true, c.cout, c.s.c, nt, in, sm, in, sv, 1.0f, su);
    gemm_batch_agrees(true, false, c.s.c, nt, c.cout, in, su, in, sm, 0.0f, sv);
    free(in);
    stk_dev_free(gpu, dbias);
}

static void xent_transform_and_optimizers_agree(void **state)
{
    (void)state;
    enum { N = 37, C = 10 };
    float z[N * C], dz[N * C], loss, gloss;
    int32_t labels[N];
    fill(z, N * C, 9);
    for (int i = 0; i < N; i++)
        labels[i] = (i * 7) % C;
    stk_err err;
    float *dzs = dev_copy(z, sizeof z), *ddz = dev_copy(z, sizeof z);
    int32_t *dl = (int32_t *)dev_copy(labels, sizeof labels);
    assert_int_equal(stk_xent(cpu, z, labels, N, C, 0.0f, &loss, dz, &err), 0);
    assert_int_equal(stk_xent(gpu, dzs, dl, N, C, 0.0f, &gloss, ddz, &err), 0);
    assert_true(fabs(gloss - loss) <= 1e-6 * fabs(loss));
    float *got = host_copy(ddz, sizeof dz);
    assert_true(nerr(got, dz, N * C) < 1e-6); /* expf/logf may differ by ulps */
    free(got);
    /* the input transform, with crop and flip */
    enum { S = 9, CH = 3, H = 10, W = 12 };
    uint8_t img[S * CH * H * W];
    uint64_t ids[S];
    for (int i = 0; i < (int)sizeof img; i++)
        img[i] = (uint8_t)(i * 31);
    for (int i = 0; i < S; i++)
        ids[i] = 77 + (uint64_t)i * 13;
    stk_transform t = {CH, H, W, {0.2f, 0.4f, 0.6f}, {3.0f, 2.0f, 1.0f}, 2, 1, {5, 6}, 4};
    float out[S * CH * H * W];
    uint8_t *dimg = (uint8_t *)dev_copy(img, sizeof img);
    uint64_t *dids = (uint64_t *)dev_copy(ids, sizeof ids);
    float *dout = dev_copy(out, sizeof out);
    assert_int_equal(stk_transform_batch(cpu, img, ids, S, &t, out, &err), 0);
    assert_int_equal(stk_transform_batch(gpu, dimg, dids, S, &t, dout, &err), 0);
    got = host_copy(dout, sizeof out);
    assert_memory_equal(got, out, sizeof out);
    free(got);
    /* SGD (nesterov, weight decay) and AdamW: same floats */
    float w[100], g[100], buf[100] = {0}, m[100] = {0}, v[100] = {0};
    fill(w, 100, 10);
    fill(g, 100, 11);
    float *dw = dev_copy(w, sizeof w), *dg = dev_copy(g, sizeof g),
          *dbuf = dev_copy(buf, sizeof buf), *dm = dev_copy(m, sizeof m),
          *dv = dev_copy(v, sizeof v);
    stk_sgd_cfg sc = {0.1f, 0.9f, 0.01f, 1, 1, NULL};
    stk_adamw_cfg ac = {0.01f, 0.9f, 0.999f, 1e-8f, 0.1f, 0.1f, sqrtf(0.001f),
                        (float)(1 - 0.9), (float)(1 - 0.999), NULL};
    assert_int_equal(stk_sgd_step(cpu, w, g, buf, 100, &sc, &err), 0);
    assert_int_equal(stk_sgd_step(gpu, dw, dg, dbuf, 100, &sc, &err), 0);
    assert_int_equal(stk_adamw_step(cpu, w, g, m, v, 100, &ac, &err), 0);
    assert_int_equal(stk_adamw_step(gpu, dw, dg, dm, dv, 100, &ac, &err), 0);
    got = host_copy(dw, sizeof w);
    assert_true(nerr(got, w, 100) < 1e-6); /* sqrtf and division may round differently */
    /* a device guard holding a non-finite step: both updates refused there */
    stk_metrics bad = {.bad_step = 3};
    stk_metrics *dbad = (stk_metrics *)dev_copy(&bad, sizeof bad);
    sc.guard = ac.guard = dbad;
    assert_int_equal(stk_sgd_step(gpu, dw, dg, dbuf, 100, &sc, &err), 0);
    assert_int_equal(stk_adamw_step(gpu, dw, dg, dm, dv, 100, &ac, &err), 0);
    float *kept = host_copy(dw, sizeof w);
    assert_memory_equal(kept, got, sizeof w);
    free(kept);
    stk_dev_free(gpu, dbad);
    free(got);
    double ss, gss;
    assert_int_equal(stk_sumsq(cpu, w, 100, &ss, &err), 0);
    assert_int_equal(stk_sumsq(gpu, dw, 100, &gss, &err), 0);
    assert_true(fabs(ss - gss) <= 1e-6 * ss);
    stk_dev_free(gpu, dzs), stk_dev_free(gpu, ddz), stk_dev_free(gpu, dl);
    stk_dev_free(gpu, dimg), stk_dev_free(gpu, dids), stk_dev_free(gpu, dout);
    stk_dev_free(gpu, dw), stk_dev_free(gpu, dg), stk_dev_free(gpu, dbuf);
    stk_dev_free(gpu, dm), stk_dev_free(gpu, dv);
}

/* The average pools, the residual add and the device copy: the same bytes
 * on both backends (shared bodies; the backward pass a gather on both). */
static void pools_add_and_copy_agree_exactly(void **state)
{
    (void)state;
    enum { P = 6, H = 9, W = 8, N = P * H * W };
    static const int cfg[][4] = {{3, 3, 2, 2}, {2, 3, 1, 2}, {H, W, 1, 1}};
    float x[N], g[N], y[N], dx[N];
    fill(x, N, 31);
    fill(g, N, 32);
    stk_err err;
    float *dxs = dev_copy(x, sizeof x), *dg = dev_copy(g, sizeof g);
    float *dy = dev_copy(x, sizeof x), *ddx = dev_copy(x, sizeof x);
    for (int t = 0; t < 3; t++) {
        const int *q = cfg[t];
        int out = P * ((H - q[0]) / q[2] + 1) * ((W - q[1]) / q[3] + 1);
        assert_int_equal(
            stk_avgpool_fwd(cpu, x, P, H, W, q[0], q[1], q[2], q[3], y, &err),
            0);
        assert_int_equal(stk_avgpool_fwd(gpu, dxs, P, H, W, q[0], q[1], q[2],
                                         q[3], dy, &err),
                         0);
        float *got = host_copy(dy, out * 4);
        assert_memory_equal(got, y, out * 4);
        free(got);
        assert_int_equal(
            stk_avgpool_bwd(cpu, g, P, H, W, q[0], q[1], q[2], q[3], dx, &err),
            0);
        assert_int_equal(stk_avgpool_bwd(gpu, dg, P, H, W, q[0], q[1], q[2],
                                         q[3], ddx, &err),
                         0);
        got = host_copy(ddx, sizeof dx);
        assert_memory_equal(got, dx, sizeof dx);
        free(got);
    }
    assert_int_equal(stk_add(cpu, x, g, y, N, &err), 0);
    assert_int_equal(stk_add(gpu, dxs, dg, dy, N, &err), 0);
    float *got = host_copy(dy, sizeof y);
    assert_memory_equal(got, y, sizeof y);
    free(got);
    assert_int_equal(stk_copy_dev(gpu, ddx, dg, N, &err), 0);
    got = host_copy(ddx, sizeof g);
    assert_memory_equal(got, g, sizeof g);
    free(got);
    stk_dev_free(gpu, dxs), stk_dev_free(gpu, dg), stk_dev_free(gpu, dy);
    stk_dev_free(gpu, ddx);
}

/* One batchnorm training step on both backends. The sums are reductions
 * in another order (within 1e-6, and the GPU's repeat exactly); the
 * element-wise passes, given the CPU's statistics, the same bytes. */
static void bn_agrees(int n, int c, int hw, bool relu)
{
    size_t total = (size_t)n * c * hw, bytes = total * 4, cb = (size_t)c * 4;
    float *x = malloc(bytes), *g = malloc(bytes), *y = malloc(bytes),
          *dx = malloc(bytes), *p = malloc(2 * cb), *mean = malloc(cb),
          *var = malloc(cb), *sums = malloc(2 * cb), *rm = malloc(2 * cb);
    fill(x, total, 41);
    fill(g, total, 42);
    fill(p, 2 * (size_t)c, 43);
    fill(rm, 2 * (size_t)c, 44);
    for (int i = 0; i < c; i++)
        rm[c + i] += 2.0f; /* running variances */
    stk_err err;
    double inv = 1.0 / ((double)n * hw);
    float *dx_ = dev_copy(x, bytes), *dg = dev_copy(g, bytes),
          *dp = dev_copy(p, 2 * cb), *dy = dev_copy(x, bytes),
          *ddx = dev_copy(x, bytes), *dst = dev_copy(p, 2 * cb),
          *dsums = dev_copy(p, 2 * cb), *drm = dev_copy(rm, 2 * cb);
    /* statistics */
    assert_int_equal(stk_bn_sums(cpu, x, n, c, hw, NULL, inv, mean, &err), 0);
    assert_int_equal(stk_bn_sums(cpu, x, n, c, hw, mean, inv, var, &err), 0);
    assert_int_equal(stk_bn_sums(gpu, dx_, n, c, hw, NULL, inv, dst, &err), 0);
    float *got = host_copy(dst, cb), *again;
    assert_true(nerr(got, mean, c) < 1e-6);
    assert_int_equal(stk_bn_sums(gpu, dx_, n, c, hw, NULL, inv, dst, &err), 0);
    again = host_copy(dst, cb);
    assert_memory_equal(again, got, cb);
    free(got), free(again);
    assert_int_equal(stk_copy_to_dev(gpu, dst, mean, cb, &err), 0);
    assert_int_equal(stk_bn_sums(gpu, dx_, n, c, hw, dst, inv, dst + c, &err),
                     0);
    got = host_copy(dst + c, cb);
    assert_true(nerr(got, var, c) < 1e-6);
    free(got);
    /* the normalisation from the CPU's statistics */
    assert_int_equal(stk_copy_to_dev(gpu, dst + c, var, cb, &err), 0);
    assert_int_equal(stk_bn_apply(cpu, x, y, n, c, hw, mean, var, 1e-5f, p,
                                  p + c, relu, &err),
                     0);
    assert_int_equal(stk_bn_apply(gpu, dx_, dy, n, c, hw, dst, dst + c, 1e-5f,
                                  dp, dp + c, relu, &err),
                     0);
    got = host_copy(dy, bytes);
    assert_memory_equal(got, y, bytes);
    free(got);
    /* with a residual (g as it), the residual block's tail, into buffers
     * of its own (y and dy stay the plain forward's, read below) */
    float *yr = malloc(bytes), *dyr = dev_copy(x, bytes);
    assert_int_equal(stk_bn_apply_add(cpu, x, g, yr, n, c, hw, mean, var,
                                      1e-5f, p, p + c, relu, &err),
                     0);
    assert_int_equal(stk_bn_apply_add(gpu, dx_, dg, dyr, n, c, hw, dst,
                                      dst + c, 1e-5f, dp, dp + c, relu, &err),
                     0);
    got = host_copy(dyr, bytes);
    assert_memory_equal(got, yr, bytes);
    free(got), free(yr);
    stk_dev_free(gpu, dyr);
    /* backward (the fused ReLU's mask recomputed from x) */
    assert_int_equal(stk_bn_grad_sums(cpu, g, x, n, c, hw, mean, var, 1e-5f, p,
                                      p + c, relu, sums, &err),
                     0);
    assert_int_equal(stk_bn_grad_sums(gpu, dg, dx_, n, c, hw, dst, dst + c,
                                      1e-5f, dp, dp + c, relu, dsums, &err),
                     0);
    got = host_copy(dsums, 2 * cb);
    assert_true(nerr(got, sums, c) < 1e-5);
    assert_true(nerr(got + c, sums + c, c) < 1e-5);
    free(got);
    assert_int_equal(stk_copy_to_dev(gpu, dsums, sums, 2 * cb, &err), 0);
    assert_int_equal(stk_bn_input_grad(cpu, g, x, n, c, hw, mean, var, 1e-5f, p,
                                       p + c, relu, sums, (float)inv, dx, &err),
                     0);
    assert_int_equal(stk_bn_input_grad(gpu, dg, dx_, n, c, hw, dst, dst + c,
                                       1e-5f, dp, dp + c, relu, dsums,
                                       (float)inv, ddx, &err),
                     0);
    got = host_copy(ddx, bytes);
    assert_memory_equal(got, dx, bytes);
    free(got);
    if (relu) { /* the recomputed mask is the GPU forward's: dy's own, read */
        float *dm = dev_copy(g, bytes), *ds = dev_copy(p, 2 * cb),
              *ds2 = dev_copy(p, 2 * cb), *dd = dev_copy(x, bytes);
        assert_int_equal(stk_relu_bwd(gpu, dy, dg, dm, total, &err), 0);
        assert_int_equal(stk_bn_grad_sums(gpu, dg, dx_, n, c, hw, dst, dst + c,
                                          1e-5f, dp, dp + c, true, ds, &err),
                         0);
        assert_int_equal(stk_bn_grad_sums(gpu, dm, dx_, n, c, hw, dst, dst + c,
                                          1e-5f, NULL, NULL, false, ds2, &err),
                         0);
        float *s1 = host_copy(ds, 2 * cb), *s2 = host_copy(ds2, 2 * cb);
        assert_memory_equal(s1, s2, 2 * cb);
        assert_int_equal(stk_bn_input_grad(gpu, dm, dx_, n, c, hw, dst,
                                           dst + c, 1e-5f, dp, NULL, false,
                                           dsums, (float)inv, dd, &err),
                         0);
        got = host_copy(dd, bytes);
        assert_memory_equal(got, dx, bytes);
        free(got), free(s1), free(s2);
        stk_dev_free(gpu, dm), stk_dev_free(gpu, ds), stk_dev_free(gpu, ds2);
        stk_dev_free(gpu, dd);
    }
    /* running statistics */
    assert_int_equal(
        stk_bn_running(cpu, rm, rm + c, mean, var, c, 0.1f, 1.25f, &err), 0);
    assert_int_equal(
        stk_bn_running(gpu, drm, drm + c, dst, dst + c, c, 0.1f, 1.25f, &err),
        0);
    got = host_copy(drm, 2 * cb);
    assert_memory_equal(got, rm, 2 * cb);
    free(got);
    free(x), free(g), free(y), free(dx), free(p), free(mean), free(var);
    free(sums), free(rm);
    stk_dev_free(gpu, dx_), stk_dev_free(gpu, dg), stk_dev_free(gpu, dp);
    stk_dev_free(gpu, dy), stk_dev_free(gpu, ddx), stk_dev_free(gpu, dst);
    stk_dev_free(gpu, dsums), stk_dev_free(gpu, drm);
}

static void batchnorm_agrees(void **state)
{
    (void)state;
    bn_agrees(3, 5, 7 * 9, false);
    bn_agrees(3, 5, 7 * 9, true);
    bn_agrees(37, 300, 1, true);     /* BatchNorm1d */
    bn_agrees(3, 4100, 1, false);    /* more channels than blocks */
    bn_agrees(24, 3, 33 * 31, true); /* two ranges of samples a channel */
    bn_agrees(50000, 3, 1, false);   /* six */
}

/* ---- sizes past one grid, gemm edge cases, bias_grad ------------------- */

/* Over 2^20 elements (MAX_BLOCKS x THREADS): every thread loops. */
enum { BIG = 3 * (1 << 20) + 77 };

/* relu, add and dropout (exact) and sumsq (a two-pass reduction of
 * MAX_BLOCKS blocks, within double rounding, the same double twice). */
static void grid_stride_loops_cover_large_sizes(void **state)
{
    (void)state;
    size_t bytes = (size_t)BIG * 4;
    float *x = malloc(bytes), *g = malloc(bytes), *y = malloc(bytes);
    fill(x, BIG, 51);
    fill(g, BIG, 52);
    stk_err err;
    float *dx = dev_copy(x, bytes), *dg = dev_copy(g, bytes),
          *dy = dev_copy(x, bytes);
    assert_int_equal(stk_relu_fwd(cpu, x, y, BIG, &err), 0);
    assert_int_equal(stk_relu_fwd(gpu, dx, dy, BIG, &err), 0);
    float *got = host_copy(dy, bytes);
    assert_memory_equal(got, y, bytes);
    free(got);
    assert_int_equal(stk_add(cpu, x, g, y, BIG, &err), 0);
    assert_int_equal(stk_add(gpu, dx, dg, dy, BIG, &err), 0);
    got = host_copy(dy, bytes);
    assert_memory_equal(got, y, bytes);
    free(got);
    assert_int_equal(stk_dropout(cpu, y, BIG, 6, 3, 0.3f, (stk_philox_key){8, 9}, 2, &err), 0);
    assert_int_equal(stk_dropout(gpu, dy, BIG, 6, 3, 0.3f, (stk_philox_key){8, 9}, 2, &err), 0);
    got = host_copy(dy, bytes);
    assert_memory_equal(got, y, bytes);
    free(got);
    double ss, gss, again;
    assert_int_equal(stk_sumsq(cpu, x, BIG, &ss, &err), 0);
    assert_int_equal(stk_sumsq(gpu, dx, BIG, &gss, &err), 0);
    assert_int_equal(stk_sumsq(gpu, dx, BIG, &again, &err), 0);
    print_message("sumsq of %d: cpu %.17g gpu %.17g\n", BIG, ss, gss);
    assert_true(ss > 0 && fabs(ss - gss) <= 1e-12 * ss);
    assert_memory_equal(&again, &gss, sizeof gss);
    free(x), free(g), free(y);
    stk_dev_free(gpu, dx), stk_dev_free(gpu, dg), stk_dev_free(gpu, dy);
}

/* Row-major C = 0.7 op(A) op(B) + 0.3 C with every leading dimension
 * above its minimum: the result within rounding, and the padding of C
 * (columns n..ldc) the same bytes as before. */
static void gemm_padded(bool ta, bool tb, int m, int n, int k)
{
    int lda = (ta ? m : k) + 3, ldb = (tb ? k : n) + 5, ldc = n + 7;
    size_t na = (size_t)(ta ? k : m) * lda, nb = (size_t)(tb ? n : k) * ldb,
           nc = (size_t)m * ldc;
    float *a = malloc(na * 4), *b = malloc(nb * 4), *c = malloc(nc * 4),
          *c0 = malloc(nc * 4);
    fill(a, na, 61);
    fill(b, nb, 62);
    fill(c0, nc, 63);
    memcpy(c, c0, nc * 4);
    float *da = dev_copy(a, na * 4), *db = dev_copy(b, nb * 4),
          *dc = dev_copy(c, nc * 4);
    stk_err err;
    assert_int_equal(stk_gemm(cpu, ta, tb, m, n, k, 0.7f, a, lda, b, ldb, 0.3f,
                              c, ldc, &err), 0);
    assert_int_equal(stk_gemm(gpu, ta, tb, m, n, k, 0.7f, da, lda, db, ldb,
                              0.3f, dc, ldc, &err), 0);
    float *got = host_copy(dc, nc * 4);
    for (int i = 0; i < m; i++) {
        const float *g = got + (size_t)i * ldc, *want = c + (size_t)i * ldc,
                    *before = c0 + (size_t)i * ldc;
        if (nerr(g, want, n) >= 1e-5)
            fail_msg("gemm ta=%d tb=%d: row %d differs", ta, tb, i);
        assert_memory_equal(want + n, before + n, (size_t)(ldc - n) * 4);
        assert_memory_equal(g + n, before + n, (size_t)(ldc - n) * 4);
    }
    free(got), free(a), free(b), free(c), free(c0);
    stk_dev_free(gpu, da), stk_dev_free(gpu, db), stk_dev_free(gpu, dc);
}

/* k = 0: C = beta C exactly (BLAS: nothing of A or B is read), for beta
 * 0.5 and 0, every transpose, at the smallest leading dimensions the API
 * takes (a row stride of 0 for an empty row). */
static void gemm_k0(bool ta, bool tb, int m, int n)
{
    int lda = ta ? m : 0, ldb = tb ? 0 : n, ldc = n;
    size_t nc = (size_t)m * n;
    float one = 1.0f, *c = malloc(nc * 4), *want = malloc(nc * 4);
    float *da = dev_copy(&one, 4), *db = dev_copy(&one, 4);
    for (int z = 0; z < 2; z++) {
        float beta = z ? 0.0f : 0.5f;
        fill(c, nc, 64);
        for (size_t i = 0; i < nc; i++)
            want[i] = beta ? c[i] * beta : 0.0f; /* +0, as BLAS */
        float *dc = dev_copy(c, nc * 4);
        stk_err err;
        assert_int_equal(stk_gemm(cpu, ta, tb, m, n, 0, 0.7f, &one, lda, &one,
                                  ldb, beta, c, ldc, &err), 0);
        assert_int_equal(stk_gemm(gpu, ta, tb, m, n, 0, 0.7f, da, lda, db, ldb,
                                  beta, dc, ldc, &err), 0);
        float *got = host_copy(dc, nc * 4);
        if (memcmp(c, want, nc * 4) || memcmp(got, want, nc * 4))
            fail_msg("gemm k=0 ta=%d tb=%d beta=%g: C is not beta C (cpu %s, "
                     "gpu %s)", ta, tb, beta,
                     memcmp(c, want, nc * 4) ? "wrong" : "right",
                     memcmp(got, want, nc * 4) ? "wrong" : "right");
        free(got);
        stk_dev_free(gpu, dc);
    }
    free(c), free(want);
    stk_dev_free(gpu, da), stk_dev_free(gpu, db);
}

/* The batched GEMM with k = 0: 3 matrices C_p = 0.5 C_p, a padded row
 * stride and a gap between them left as they were. */
static void gemm_batched_k0(bool ta, bool tb, int m, int n)
{
    int ldc = n + 2;
    size_t sc = (size_t)m * ldc + 1, nc = 3 * sc;
    float one = 1.0f, *c = malloc(nc * 4), *want = malloc(nc * 4);
    fill(c, nc, 65);
    memcpy(want, c, nc * 4);
    for (int p = 0; p < 3; p++)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++)
                want[p * sc + (size_t)i * ldc + j] *= 0.5f;
    float *da = dev_copy(&one, 4), *db = dev_copy(&one, 4),
          *dc = dev_copy(c, nc * 4);
    stk_err err;
    assert_int_equal(stk_gemm_batched(cpu, ta, tb, m, n, 0, 1, &one,
                                      ta ? m : 0, 0, &one, tb ? 0 : n, 0,
                                      0.5f, c, ldc, sc, 3, &err), 0);
    assert_int_equal(stk_gemm_batched(gpu, ta, tb, m, n, 0, 1, da,
                                      ta ? m : 0, 0, db, tb ? 0 : n, 0,
                                      0.5f, dc, ldc, sc, 3, &err), 0);
    float *got = host_copy(dc, nc * 4);
    assert_memory_equal(c, want, nc * 4);
    assert_memory_equal(got, want, nc * 4);
    free(got), free(c), free(want);
    stk_dev_free(gpu, da), stk_dev_free(gpu, db), stk_dev_free(gpu, dc);
}

static void gemm_k0_and_padded_leading_dims(void **state)
{
    (void)state;
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            gemm_padded(ta, tb, 33, 70, 45);
            gemm_padded(ta, tb, 1, 129, 300);
            gemm_k0(ta, tb, 9, 13);
            gemm_batched_k0(ta, tb, 4, 5);
        }
}

/* One cross-entropy over rows rows of 10 classes on both backends. */
static void xent_rows_agree(int rows, const int32_t *labels, const float *z)
{
    size_t nz = (size_t)rows * 10;
    float *dz = malloc(nz * 4), loss, gloss, again;
    float *dlog = dev_copy(z, nz * 4), *ddz = dev_copy(z, nz * 4);
    int32_t *dl = (int32_t *)dev_copy(labels, (size_t)rows * 4);
    stk_err err;
    assert_int_equal(stk_xent(cpu, z, labels, rows, 10, 0.1f, &loss, dz, &err), 0);
    assert_int_equal(stk_xent(gpu, dlog, dl, rows, 10, 0.1f, &gloss, ddz, &err), 0);
    assert_int_equal(stk_xent(gpu, dlog, dl, rows, 10, 0.1f, &again, ddz, &err), 0);
    print_message("xent of %d rows: cpu %.9g gpu %.9g\n", rows, loss, gloss);
    assert_true(fabs(gloss - loss) <= 1e-6 * fabs(loss));
    assert_memory_equal(&again, &gloss, sizeof gloss);
    float *got = host_copy(ddz, nz * 4);
    assert_true(nerr(got, dz, nz) < 1e-6);
    free(got), free(dz);
    stk_dev_free(gpu, dlog), stk_dev_free(gpu, ddz), stk_dev_free(gpu, dl);
}

/* Both backends refuse with STK_ERANGE naming the first bad row and its
 * label. */
static void xent_refuses(int rows, const int32_t *labels, const float *z,
                         const char *want)
{
    size_t nz = (size_t)rows * 10;
    float loss, *dz = malloc(nz * 4);
    float *dlog = dev_copy(z, nz * 4), *ddz = dev_copy(z, nz * 4);
    int32_t *dl = (int32_t *)dev_copy(labels, (size_t)rows * 4);
    stk_err err = {0};
    assert_int_equal(stk_xent(cpu, z, labels, rows, 10, 0.0f, &loss, dz, &err),
                     STK_ERANGE);
    if (!strstr(err.msg, want))
        fail_msg("cpu: '%s' does not say '%s'", err.msg, want);
    memset(&err, 0, sizeof err);
    assert_int_equal(stk_xent(gpu, dlog, dl, rows, 10, 0.0f, &loss, ddz, &err),
                     STK_ERANGE);
    if (!strstr(err.msg, want))
        fail_msg("gpu: '%s' does not say '%s'", err.msg, want);
    /* the backend still works after the refusal */
    assert_int_equal(stk_sync(gpu, &err), 0);
    free(dz);
    stk_dev_free(gpu, dlog), stk_dev_free(gpu, ddz), stk_dev_free(gpu, dl);
}

/* Many rows (the row kernel strides, the sum is one block's) and labels
 * out of range on both sides of 0..9. */
static void xent_many_rows_and_bad_labels(void **state)
{
    (void)state;
    enum { ROWS = 200003 };
    float *z = malloc((size_t)ROWS * 10 * 4);
    int32_t *labels = malloc(ROWS * 4);
    fill(z, (size_t)ROWS * 10, 71);
    for (int i = 0; i < ROWS; i++)
        labels[i] = (i * 7 + i / 3) % 10;
    xent_rows_agree(ROWS, labels, z);
    labels[150000] = -1;
    xent_refuses(ROWS, labels, z, "label -1 of row 150000 is not in 0..9");
    labels[70001] = 10; /* the first bad row is the one named */
    xent_refuses(ROWS, labels, z, "label 10 of row 70001 is not in 0..9");
    free(z), free(labels);
}

/* bias_grad (db += dy summed over rows and inner) at one shape: within
 * float rounding of the CPU, the GPU's floats the same twice. */
static void bias_grad_agrees(int rows, int cols, int inner)
{
    size_t n = (size_t)rows * cols * inner, cb = (size_t)cols * 4;
    float *dy = malloc(n ? n * 4 : 4), *db = malloc(cb), *db0 = malloc(cb);
    fill(dy, n, 81);
    fill(db0, cols, 82);
    memcpy(db, db0, cb);
    stk_err err;
    float *ddy = dev_copy(dy, n ? n * 4 : 4), *ddb = dev_copy(db0, cb);
    assert_int_equal(stk_bias_grad(cpu, dy, db, rows, cols, inner, &err), 0);
    assert_int_equal(stk_bias_grad(gpu, ddy, ddb, rows, cols, inner, &err), 0);
    float *got = host_copy(ddb, cb);
    double e = nerr(got, db, cols);
    if (e >= 1e-6)
        fail_msg("bias_grad rows %d cols %d inner %d: error %g", rows, cols,
                 inner, e);
    assert_int_equal(stk_copy_to_dev(gpu, ddb, db0, cb, &err), 0);
    assert_int_equal(stk_bias_grad(gpu, ddy, ddb, rows, cols, inner, &err), 0);
    float *again = host_copy(ddb, cb);
    if (memcmp(again, got, cb))
        fail_msg("bias_grad rows %d cols %d inner %d: not the same twice",
                 rows, cols, inner);
    if (n == 0) /* an empty sum adds nothing */
        assert_memory_equal(got, db0, cb);
    free(got), free(again), free(dy), free(db), free(db0);
    stk_dev_free(gpu, ddy), stk_dev_free(gpu, ddb);
}

/* Shapes around the walk's steps (inner below, at and above THREADS = 256,
 * inner 1 of a linear layer), one row, many rows (ranges of rows), and
 * over 2^20 elements. */
static void bias_grad_odd_and_large_shapes(void **state)
{
    (void)state;
    static const int shape[][3] = {
        {1, 1, 1},       {3, 7, 1},      {2, 5, 3},       {5, 3, 255},
        {3, 2, 256},     {4, 3, 257},    {9, 2, 1000},    {1, 4, 300001},
        {7, 3, 100003},  {1000, 5000, 1}, {128, 32, 1024}, {600, 6, 17},
        {0, 4, 5},       {4, 6, 63},
    };
    for (size_t i = 0; i < sizeof shape / sizeof *shape; i++)
        bias_grad_agrees(shape[i][0], shape[i][1], shape[i][2]);
}

/* The batchnorm's reductions and passes over 2^20 elements, by many
 * samples and by few large planes. */
static void batchnorm_large_sizes(void **state)
{
    (void)state;
    bn_agrees(64, 24, 32 * 32, true); /* 1.5M: 192 ranges a channel */
    bn_agrees(5, 2, 1 << 18, false);  /* ranges of one sample, 2^18 each */
    bn_agrees(40000, 33, 1, true);    /* BatchNorm1d, 1.3M */
}

/* The transform with one draw per sample: many samples (the grid strides
 * over blocks), odd planes, one channel and four, crop without flip and
 * flip without crop: the same floats as the CPU. */
static void transform_agrees(int n, int c, int h, int w, int pad, int flip)
{
    size_t per = (size_t)c * h * w, total = (size_t)n * per;
    uint8_t *img = malloc(total);
    uint64_t *ids = malloc((size_t)n * 8);
    float *out = malloc(total * 4);
    for (size_t i = 0; i < total; i++)
        img[i] = (uint8_t)(i * 131 + i / 7);
    for (int i = 0; i < n; i++)
        ids[i] = 1000003ull * (uint64_t)i + ((uint64_t)i << 33);
    stk_transform t = {c, h, w, {0.1f, 0.2f, 0.3f, 0.4f},
                       {2.0f, 3.0f, 4.0f, 5.0f}, pad, flip, {11, 12}, 5};
    uint8_t *dimg = (uint8_t *)dev_copy(img, total);
    uint64_t *dids = (uint64_t *)dev_copy(ids, (size_t)n * 8);
    float *dout = dev_copy(out, total * 4);
    stk_err err;
    assert_int_equal(stk_transform_batch(cpu, img, ids, n, &t, out, &err), 0);
    assert_int_equal(stk_transform_batch(gpu, dimg, dids, n, &t, dout, &err), 0);
    float *got = host_copy(dout, total * 4);
    if (memcmp(got, out, total * 4))
        fail_msg("transform n %d c %d %dx%d pad %d flip %d: the GPU differs",
                 n, c, h, w, pad, flip);
    free(got), free(img), free(ids), free(out);
    stk_dev_free(gpu, dimg), stk_dev_free(gpu, dids), stk_dev_free(gpu, dout);
}

static void transform_one_draw_per_sample(void **state)
{
    (void)state;
    transform_agrees(5000, 3, 32, 32, 4, 1); /* 15M: blocks stride */
    transform_agrees(7, 1, 28, 28, 3, 0);
    transform_agrees(9, 4, 17, 19, 0, 1);
    transform_agrees(3, 3, 5, 300, 2, 1); /* a plane wider than a block */
    transform_agrees(2, 2, 6, 6, 0, 0);   /* no augmentation */
}

static void pinned_memory_round_trip(void **state)
{
    (void)state;
    size_t n = 1 << 20;
    uint8_t *p = stk_pinned_alloc(gpu, n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 7);
    stk_err err;
    void *d = stk_dev_alloc(gpu, n, &err);
    assert_int_equal(stk_copy_to_dev(gpu, d, p, n, &err), 0);
    uint8_t *back = host_copy(d, n);
    assert_memory_equal(back, p, n);
    free(back);
    stk_dev_free(gpu, d);
    stk_pinned_free(gpu, p);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(gemm_agrees),
    cmocka_unit_test(elementwise_ops_agree_exactly),
    cmocka_unit_test(conv_helpers_agree_exactly),
    cmocka_unit_test(winograd_agrees),
    cmocka_unit_test(im2col_batches_agree),
    cmocka_unit_test(xent_transform_and_optimizers_agree),
    cmocka_unit_test(pools_add_and_copy_agree_exactly),
    cmocka_unit_test(batchnorm_agrees),
    cmocka_unit_test(pinned_memory_round_trip),
    cmocka_unit_test(grid_stride_loops_cover_large_sizes),
    cmocka_unit_test(gemm_k0_and_padded_leading_dims),
    cmocka_unit_test(xent_many_rows_and_bad_labels),
    cmocka_unit_test(bias_grad_odd_and_large_shapes),
    cmocka_unit_test(batchnorm_large_sizes),
    cmocka_unit_test(transform_one_draw_per_sample),
};

UNIT_GPU_MAIN(tests, 1)
