/* test_backend_async - the copy stream and events (stk_upload,
 * stk_event_*, stk_stream_wait) on each backend: cpu_* cases run here,
 * cuda_* cases on a GPU (a cuda_* case exits 77 where there is none). The
 * same bodies run on both: bytes uploaded on the copy stream reach a
 * compute op queued behind the copy's event, and an upload queued behind a
 * compute event lands after that compute. */
#include "unit.h"

#include "kernels/kernels.h"

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
    assert_int_equal(stk_event_record(be, computed, STK_STREAM_COMPUTE, &err), 0);
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

static const struct CMUnitTest tests[] = {
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
    if (argc > 1 && !unit_filter_matches(tests, sizeof tests / sizeof *tests, argv[1]))
        rc = 1;
    else if (argc > 1)
        cmocka_set_test_filter(argv[1]);
    if (!rc)
        rc = cmocka_run_group_tests(tests, NULL, NULL);
    stk_backend_destroy(gpu);
    stk_backend_destroy(cpu);
    return rc;
}
