/* test_trainer - model specs (built-ins and the text format), shapes and
 * PyTorch parameter names, clear errors for models that do not fit, and
 * the whole model's backward against finite differences. */
#include "unit.h"

#include "trainer/trainer.h"

#include <math.h>

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

static void expect_param(const stk_model *m, int i, const char *name, int ndim,
                         int d0, int d1, int d2, int d3)
{
    const stk_param *p = stk_model_param(m, i);
    assert_string_equal(p->name, name);
    assert_int_equal(p->ndim, ndim);
    int want[4] = {d0, d1, d2, d3};
    for (int d = 0; d < ndim; d++)
        assert_int_equal(p->shape[d], want[d]);
}

static void cnn_has_pytorch_names_and_shapes(void **state)
{
    (void)state;
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_builtin("cnn", &spec, &err), 0);
    stk_model *m;
    assert_int_equal(stk_model_create(be, &spec, 1, 28, 28, 10, 4, 1, &m, &err), 0);
    assert_int_equal(stk_model_nparams(m), 8);
    expect_param(m, 0, "conv1.weight", 4, 32, 1, 3, 3);
    expect_param(m, 1, "conv1.bias", 1, 32, 0, 0, 0);
    expect_param(m, 2, "conv2.weight", 4, 64, 32, 3, 3);
    expect_param(m, 4, "fc1.weight", 2, 500, 1600, 0, 0);
    expect_param(m, 6, "fc2.weight", 2, 10, 500, 0, 0);
    expect_param(m, 7, "fc2.bias", 1, 10, 0, 0, 0);
    assert_int_equal(stk_model_param_count(m),
                     32 * 9 + 32 + 64 * 32 * 9 + 64 + 500 * 1600 + 500 + 5000 + 10);
    /* initialisation: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), both signs used */
    const float *w = stk_model_weights(m);
    const stk_param *fc1 = stk_model_param(m, 4);
    float bound = 1.0f / sqrtf(1600.0f), lo = 1, hi = -1;
    for (size_t i = 0; i < fc1->count; i++) {
        float v = w[fc1->offset + i];
        assert_true(fabsf(v) <= bound);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    assert_true(lo < -0.9f * bound && hi > 0.9f * bound);
    stk_model_destroy(m);
    /* mlp adapts to the input and classes */
    assert_int_equal(stk_model_builtin("mlp", &spec, &err), 0);
    assert_int_equal(stk_model_create(be, &spec, 3, 32, 32, 100, 4, 1, &m, &err), 0);
    expect_param(m, 0, "fc1.weight", 2, 256, 3072, 0, 0);
    expect_param(m, 4, "fc3.weight", 2, 100, 128, 0, 0);
    stk_model_destroy(m);
    assert_int_equal(stk_model_builtin("resnet", &spec, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "--model"));
}

static void text_format_and_errors(void **state)
{
    (void)state;
    const char *text = "# a small net\n"
                       "\n"
                       "conv 8 3 pad=1   # keeps 12x12\n"
                       "relu\n"
                       "pool 2\n"
                       "dropout2d 0.25\n"
                       "flatten\n"
                       "head: linear classes\n";
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse(text, "net.txt", &spec, &err), 0);
    assert_int_equal(spec.n, 6);
    assert_int_equal(spec.layers[0].pad, 1);
    assert_true(fabsf(spec.layers[3].p - 0.25f) < 1e-6f);
    stk_model *m;
    assert_int_equal(stk_model_create(be, &spec, 1, 12, 12, 5, 2, 3, &m, &err), 0);
    expect_param(m, 0, "conv1.weight", 4, 8, 1, 3, 3);
    expect_param(m, 2, "head.weight", 2, 5, 8 * 6 * 6, 0, 0);
    stk_model_destroy(m);
    /* errors name the file and line, or the layer and shapes */
    assert_int_equal(stk_model_parse("relu\nconv eight 3\n", "bad.txt", &spec, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "bad.txt:2"));
    assert_int_equal(stk_model_parse("conv 4 9\nflatten\nlinear classes\n", "big.txt",
                                     &spec, &err), 0);
    assert_int_equal(stk_model_create(be, &spec, 1, 5, 5, 3, 2, 1, &m, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "conv1: a 9x9 kernel does not fit its 1x5x5 input"));
    assert_int_equal(stk_model_parse("flatten\nlinear 7\n", "out.txt", &spec, &err), 0);
    assert_int_equal(stk_model_create(be, &spec, 1, 4, 4, 10, 2, 1, &m, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg, "ends with 7 outputs"));
}

/* Loss of the model on a fixed batch, for finite differences. */
static double batch_loss(stk_model *m, const float *x, const int32_t *y, int n)
{
    const float *logits;
    stk_err err;
    float loss;
    assert_int_equal(stk_model_forward(m, x, n, false, (stk_philox_key){0, 0}, 0,
                                       &logits, &err), 0);
    assert_int_equal(stk_xent(be, logits, y, n, 4, &loss, NULL, &err), 0);
    return loss;
}

static void whole_model_backward_matches_fd(void **state)
{
    (void)state;
    const char *text = "conv 3 3 pad=1\npool 2\nrelu\nconv 4 2 stride=2\nrelu\n"
                       "flatten\nlinear 6\nrelu\nlinear classes\n";
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse(text, "t", &spec, &err), 0);
    stk_model *m;
    enum { N = 3, C = 2, H = 8, W = 8 };
    assert_int_equal(stk_model_create(be, &spec, C, H, W, 4, N, 9, &m, &err), 0);
    float x[N * C * H * W];
    for (int i = 0; i < N * C * H * W; i++)
        x[i] = sinf((float)i * 0.37f);
    int32_t y[N] = {1, 3, 0};
    const float *logits;
    float loss;
    assert_int_equal(stk_model_forward(m, x, N, true, (stk_philox_key){0, 0}, 0,
                                       &logits, &err), 0);
    assert_int_equal(stk_xent(be, logits, y, N, 4, &loss, stk_model_dlogits(m), &err), 0);
    assert_int_equal(stk_model_backward(m, stk_model_dlogits(m), N,
                                        (stk_philox_key){0, 0}, 0, NULL, NULL, &err), 0);
    size_t np = stk_model_param_count(m);
    float *g = malloc(np * sizeof *g), *w = stk_model_weights(m);
    memcpy(g, stk_model_grads(m), np * sizeof *g);
    /* central differences on every 7th parameter, in float with h = 2e-3
     * (the loss is smooth away from ReLU kinks at this scale) */
    int checked = 0, bad = 0, kinks = 0;
    for (size_t i = 0; i < np; i += 7) {
        float keep = w[i], h = 2e-3f;
        w[i] = keep + h;
        double up = batch_loss(m, x, y, N);
        w[i] = keep - h;
        double down = batch_loss(m, x, y, N);
        w[i] = keep;
        double num = (up - down) / (2 * h);
        double scale = fabs(num) > 1e-2 ? fabs(num) : 1e-2;
        if (fabs(num - g[i]) > 0.05 * scale + 2e-4) { /* float noise */
            double mid = batch_loss(m, x, y, N);
            print_message("param %zu: backward %.6g, differences %.6g "
                          "(one-sided %.6g / %.6g)\n",
                          i, g[i], num, (up - mid) / h, (mid - down) / h);
            /* a kink (ReLU or max-pool switch) inside [-h, h] shows as
             * one-sided slopes that disagree; only count smooth points */
            if (fabs((up - mid) / h - (mid - down) / h) < 0.1 * scale)
                bad++;
            else
                kinks++;
        }
        checked++;
    }
    if (bad || kinks > checked / 5)
        fail_msg("%d of %d parameter gradients disagree with finite differences "
                 "at smooth points (%d kinks)",
                 bad, checked, kinks);
    free(g);
    stk_model_destroy(m);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(cnn_has_pytorch_names_and_shapes),
    cmocka_unit_test(text_format_and_errors),
    cmocka_unit_test(whole_model_backward_matches_fd),
};

UNIT_MAIN_WITH(tests, setup, teardown)
