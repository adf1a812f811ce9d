/* test_backend_async - the copy stream and events (stk_upload,
 * stk_event_*, stk_stream_wait) and the training metrics kept on the device
 * (stk_xent_metrics, stk_count_hits, stk_metrics_step, stk_grad_norm) on
 * each backend: cpu_* cases run here,
 * cuda_* cases on a GPU (a cuda_* case exits 77 where there is none). The
 * same bodies run on both: bytes uploaded on the copy stream reach a
 * compute op queued behind the copy's event, and an upload queued behind a
 * compute event lands after that compute. */
#include "unit.h"

#include "kernels/kernels.h"

#include <math.h>

static stk_backend *cpu, *gpu;

static stk_event *event(stk_backend *be)
{
    stk_err err;
    stk_event *ev = NULL;
    assert_int_equal(stk_event_create(be, &ev, &err), 0);
    assert_non_null(ev);
    return ev;
}

static float *download(stk_backend *be, const float *d, size_t n)
{
    stk_err err;
    float *h = malloc(n * sizeof *h);
    assert_int_equal(stk_copy_to_host(be, h, d, n * sizeof *h, &err), 0);
    assert_int_equal(stk_sync(be, &err), 0);
    return h;
}

/* Over 2^20 floats (many blocks and copy pieces): uploaded from pinned
 * memory, compute waits on the copy's event and doubles them. */
static void upload_reaches_compute(stk_backend *be)
{
    size_t n = (1u << 20) + 5;
    stk_err err;
    float *p = stk_pinned_alloc(be, n * sizeof *p);
    float *d = stk_dev_alloc(be, n * sizeof *d, &err);
    assert_non_null(p);
    assert_non_null(d);
    for (size_t i = 0; i < n; i++)
        p[i] = (float)(i % 1000) - 300.0f;
    stk_event *copied = event(be);
    bool done = false;
    assert_int_equal(stk_event_query(be, copied, &done, &err), 0);
    assert_true(done); /* never recorded: complete */
    assert_int_equal(stk_upload(be, d, p, n * sizeof *p, &err), 0);
    assert_int_equal(stk_event_record(be, copied, STK_STREAM_COPY, &err), 0);
    assert_int_equal(stk_stream_wait(be, STK_STREAM_COMPUTE, copied, &err), 0);
    assert_int_equal(stk_scale(be, n, 2.0f, d, &err), 0);
    assert_int_equal(stk_event_wait(be, copied, &err), 0);
    assert_int_equal(stk_event_query(be, copied, &done, &err), 0);
    assert_true(done);
    float *back = download(be, d, n);
    for (size_t i = 0; i < n; i++)
        if (back[i] != 2.0f * p[i])
            fail_msg("element %zu: %g, not %g", i, back[i], 2.0 * p[i]);
    free(back);
    stk_event_destroy(be, copied);
    stk_dev_free(be, d);
    stk_pinned_free(be, p);
}

/* Compute rewrites d (2^22 floats, 40 passes, then its head tripled: long
 * enough that a copy not waiting would land before the end); the copy
 * stream waits for it, then uploads new bytes over d's head: that must hold
 * the upload, not three times it. */
static void upload_waits_for_compute(stk_backend *be)
{
    size_t n = 1u << 22, k = 4096;
    stk_err err;
    float *p = stk_pinned_alloc(be, k * sizeof *p);
    float *d = stk_dev_alloc(be, n * sizeof *d, &err);
    assert_non_null(p);
    assert_non_null(d);
    for (size_t i = 0; i < k; i++)
        p[i] = (float)i + 0.5f;
    assert_int_equal(stk_memzero(be, d, n * sizeof *d, &err), 0);
    for (int i = 0; i < 40; i++)
        assert_int_equal(stk_axpy(be, n, 1.0f, d, d, &err), 0);
    assert_int_equal(stk_scale(be, k, 3.0f, d, &err), 0);
    stk_event *computed = event(be), *copied = event(be);
    assert_int_equal(stk_event_record(be, computed, STK_STREAM_COMPUTE, &err),
                     0);
    assert_int_equal(stk_stream_wait(be, STK_STREAM_COPY, computed, &err), 0);
    assert_int_equal(stk_upload(be, d, p, k * sizeof *p, &err), 0);
    assert_int_equal(stk_event_record(be, copied, STK_STREAM_COPY, &err), 0);
    assert_int_equal(stk_stream_wait(be, STK_STREAM_COMPUTE, copied, &err), 0);
    float *back = download(be, d, k);
    assert_memory_equal(back, p, k * sizeof *p);
    free(back);
    stk_event_destroy(be, computed);
    stk_event_destroy(be, copied);
    stk_dev_free(be, d);
    stk_pinned_free(be, p);
}

static void *to_dev(stk_backend *be, const void *h, size_t bytes)
{
    stk_err err;
    void *d = stk_dev_alloc(be, bytes, &err);
    assert_non_null(d);
    assert_int_equal(stk_copy_to_dev(be, d, h, bytes, &err), 0);
    return d;
}

static stk_metrics read_metrics(stk_backend *be, const stk_metrics *d)
{
    stk_err err;
    stk_metrics m;
    assert_int_equal(stk_copy_to_host(be, &m, d, sizeof m, &err), 0);
    assert_int_equal(stk_sync(be, &err), 0);
    return m;
}

/* The device metrics against the ops that return host values, on the same
 * backend (the same sums in the same order: equal to the bit): 70001 rows
 * (many blocks), two micro-batches and a step closed, then a gradient of
 * 2^20 + 3 floats clipped. */
static void metrics_match_host_ops(stk_backend *be)
{
    enum { C = 10 };
    int n = 70001;
    size_t np = (1u << 20) + 3;
    stk_err err;
    float *z = malloc(sizeof(float) * n * C), *g = malloc(sizeof(float) * np);
    int32_t *y = malloc(sizeof(int32_t) * n);
    for (size_t i = 0; i < (size_t)n * C; i++)
        z[i] = 4.0f * stk_philox_uniform((stk_philox_key){5, 6}, 0, i) - 2.0f;
    for (int i = 0; i < n; i++)
        y[i] = (int32_t)(stk_philox_uniform((stk_philox_key){5, 7}, 0,
                                            (uint64_t)i) *
                         C) %
               C;
    for (size_t i = 0; i < np; i++)
        g[i] = stk_philox_uniform((stk_philox_key){5, 8}, 0, i) - 0.5f;
    float *dz = to_dev(be, z, sizeof(float) * n * C),
          *dg = to_dev(be, g, sizeof(float) * np);
    int32_t *dy = to_dev(be, y, sizeof(int32_t) * n);
    stk_metrics *dm = stk_dev_alloc(be, sizeof *dm, &err);
    assert_int_equal(stk_memzero(be, dm, sizeof *dm, &err), 0);
    float loss;
    assert_int_equal(stk_xent(be, dz, dy, n, C, 0.1f, &loss, NULL, &err), 0);
    for (int micro = 0; micro < 2; micro++) {
        assert_int_equal(
            stk_xent_metrics(be, dz, dy, n, C, 0.1f, NULL, dm, &err), 0);
        assert_int_equal(stk_count_hits(be, dz, dy, n, C, dm, &err), 0);
    }
    int hits = 0;
    for (int r = 0; r < n; r++)
        hits += stk_argmax_row(z, C, r) == y[r];
    stk_metrics m = read_metrics(be, dm);
    assert_true(m.step_loss == 2 * ((double)loss * n));
    assert_true(m.step_hits == 2.0 * hits);
    assert_int_equal(stk_metrics_step(be, dm, 2 * n, 6, 1, &err), 0);
    m = read_metrics(be, dm);
    float l = (float)(2 * ((double)loss * n)) / (float)(2 * n);
    assert_true(m.loss == (double)l * (2 * n) && m.n == 2.0 * n &&
                m.hits == 2.0 * hits);
    assert_true(m.step_loss == 0 && m.step_hits == 0 && m.bad_step == 0);
    /* clipped to half its norm: the same floats as stk_sumsq and stk_scale */
    double ss;
    assert_int_equal(stk_sumsq(be, dg, np, &ss, &err), 0);
    float norm = (float)sqrt(ss), clip = norm / 2;
    float *want = to_dev(be, g, sizeof(float) * np);
    assert_int_equal(stk_scale(be, np, clip / (norm + 1e-6f), want, &err), 0);
    assert_int_equal(stk_grad_norm(be, dg, np, clip, 6, 1, dm, &err), 0);
    float *a = malloc(sizeof(float) * np), *b = malloc(sizeof(float) * np);
    assert_int_equal(stk_copy_to_host(be, a, dg, sizeof(float) * np, &err), 0);
    assert_int_equal(stk_copy_to_host(be, b, want, sizeof(float) * np, &err),
                     0);
    assert_int_equal(stk_sync(be, &err), 0);
    assert_memory_equal(a, b, sizeof(float) * np);
    assert_true(read_metrics(be, dm).scale == (double)(clip / (norm + 1e-6f)));
    /* a norm under the clip leaves g alone */
    assert_int_equal(stk_grad_norm(be, dg, np, 1e9f, 6, 1, dm, &err), 0);
    assert_int_equal(stk_copy_to_host(be, b, dg, sizeof(float) * np, &err), 0);
    assert_int_equal(stk_sync(be, &err), 0);
    assert_memory_equal(a, b, sizeof(float) * np);
    free(a), free(b), free(z), free(g), free(y);
    stk_dev_free(be, dz), stk_dev_free(be, dg), stk_dev_free(be, dy);
    stk_dev_free(be, dm), stk_dev_free(be, want);
}

/* What a read must report: the first non-finite step (a NaN logit, then an
 * infinite gradient: the first stays), and the first label out of range
 * (its loss not added). */
static void metrics_flag_the_first_bad_step(stk_backend *be)
{
    enum { N = 300, C = 4 };
    stk_err err;
    float z[N * C], g[1000];
    int32_t y[N];
    for (int i = 0; i < N * C; i++)
        z[i] = (float)(i % 7) / 7.0f;
    for (int i = 0; i < N; i++)
        y[i] = i % C;
    for (int i = 0; i < 1000; i++)
        g[i] = 1.0f;
    float *dz = to_dev(be, z, sizeof z), *dg = to_dev(be, g, sizeof g);
    int32_t *dy = to_dev(be, y, sizeof y);
    stk_metrics *dm = stk_dev_alloc(be, sizeof *dm, &err);
    assert_int_equal(stk_memzero(be, dm, sizeof *dm, &err), 0);
    /* step 3 (0-based 2) finite, step 4 NaN */
    assert_int_equal(stk_xent_metrics(be, dz, dy, N, C, 0.0f, NULL, dm, &err),
                     0);
    assert_int_equal(stk_metrics_step(be, dm, N, 2, 0, &err), 0);
    assert_int_equal(stk_grad_norm(be, dg, 1000, 0.0f, 2, 0, dm, &err), 0);
    assert_true(read_metrics(be, dm).bad_step == 0);
    float nan = NAN, inf = INFINITY;
    assert_int_equal(
        stk_copy_to_dev(be, dz + 5 * C + 1, &nan, sizeof nan, &err), 0);
    assert_int_equal(stk_xent_metrics(be, dz, dy, N, C, 0.0f, NULL, dm, &err),
                     0);
    assert_int_equal(stk_metrics_step(be, dm, N, 3, 0, &err), 0);
    assert_int_equal(stk_copy_to_dev(be, dg + 999, &inf, sizeof inf, &err), 0);
    assert_int_equal(stk_grad_norm(be, dg, 1000, 0.0f, 3, 0, dm, &err), 0);
    assert_int_equal(stk_grad_norm(be, dg, 1000, 0.0f, 4, 1, dm, &err), 0);
    stk_metrics m = read_metrics(be, dm);
    assert_true(m.bad_step == 4 && m.bad_epoch == 1 && m.bad_kind == 1 &&
                m.bad_nan == 1);
    assert_true(m.bad_row == 0);
    /* an infinite gradient norm alone, on a fresh record */
    assert_int_equal(stk_memzero(be, dm, sizeof *dm, &err), 0);
    assert_int_equal(stk_grad_norm(be, dg, 1000, 1.0f, 9, 2, dm, &err), 0);
    m = read_metrics(be, dm);
    assert_true(m.bad_step == 10 && m.bad_epoch == 3 && m.bad_kind == 2 &&
                m.bad_nan == 0);
    /* labels out of range at rows 7 and 9: row 7 is named, nothing added */
    int32_t bad = C, worse = -1;
    assert_int_equal(stk_memzero(be, dm, sizeof *dm, &err), 0);
    assert_int_equal(stk_copy_to_dev(be, dy + 7, &bad, sizeof bad, &err), 0);
    assert_int_equal(stk_copy_to_dev(be, dy + 9, &worse, sizeof worse, &err),
                     0);
    assert_int_equal(stk_xent_metrics(be, dz, dy, N, C, 0.0f, NULL, dm, &err),
                     0);
    m = read_metrics(be, dm);
    assert_true(m.bad_row == 8 && m.bad_label == C && m.step_loss == 0);
    stk_dev_free(be, dz), stk_dev_free(be, dg), stk_dev_free(be, dy),
        stk_dev_free(be, dm);
}

static void cpu_upload_reaches_compute(void **state)
{
    (void)state;
    upload_reaches_compute(cpu);
}

static void cpu_upload_waits_for_compute(void **state)
{
    (void)state;
    upload_waits_for_compute(cpu);
}

static void cuda_upload_reaches_compute(void **state)
{
    (void)state;
    if (!gpu)
        skip();
    upload_reaches_compute(gpu);
}

static void cuda_upload_waits_for_compute(void **state)
{
    (void)state;
    if (!gpu)
        skip();
    upload_waits_for_compute(gpu);
}

static void cpu_metrics_match_host_ops(void **state)
{
    (void)state;
    metrics_match_host_ops(cpu);
}

static void cpu_metrics_flag_the_first_bad_step(void **state)
{
    (void)state;
    metrics_flag_the_first_bad_step(cpu);
}

static void cuda_metrics_match_host_ops(void **state)
{
    (void)state;
    if (!gpu)
        skip();
    metrics_match_host_ops(gpu);
}

static void cuda_metrics_flag_the_first_bad_step(void **state)
{
    (void)state;
    if (!gpu)
        skip();
    metrics_flag_the_first_bad_step(gpu);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(cpu_metrics_match_host_ops),
    cmocka_unit_test(cpu_metrics_flag_the_first_bad_step),
    cmocka_unit_test(cuda_metrics_match_host_ops),
    cmocka_unit_test(cuda_metrics_flag_the_first_bad_step),
    cmocka_unit_test(cpu_upload_reaches_compute),
    cmocka_unit_test(cpu_upload_waits_for_compute),
    cmocka_unit_test(cuda_upload_reaches_compute),
    cmocka_unit_test(cuda_upload_waits_for_compute),
};

/* A cuda_* case asked for by name on a machine without a GPU exits 77;
 * run together, the cuda_* cases are skipped there. */
int main(int argc, char **argv)
{
    stk_err err = {0};
    int n = 0;
    bool want_gpu = argc < 2 || !strncmp(argv[1], "cuda_", 5);
    if (stk_backend_create(STK_DEV_CPU, 0, 2, &cpu, &err)) {
        printf("FAIL: %s\n", err.msg);
        return 1;
    }
    int rc = want_gpu ? stk_cuda_device_count(&n, &err) : 0;
    if (want_gpu && rc == STK_ENODEV && argc > 1) {
        printf("SKIP: %s\n", err.msg);
        stk_backend_destroy(cpu);
        return 77;
    }
    if (want_gpu && rc != STK_ENODEV &&
        (rc || stk_backend_create(STK_DEV_CUDA, 0, 0, &gpu, &err))) {
        printf("FAIL: %s\n", err.msg);
        return 1;
    }
    rc = 0;
    if (argc > 1 &&
        !unit_filter_matches(tests, sizeof tests / sizeof *tests, argv[1]))
        rc = 1;
    else if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    if (!rc)
        rc = cmocka_run_group_tests(tests, NULL, NULL);
    stk_backend_destroy(gpu);
    stk_backend_destroy(cpu);
    return rc;
}
