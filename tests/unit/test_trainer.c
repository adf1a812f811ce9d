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
    assert_non_null(strstr(err.msg, "bad.txt:2: 'eight' is not a number"));
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

/* Backward of the model in `text` on inputs N x C x 8 x 8 against central
 * differences of its loss, on every 7th parameter. */
static void model_backward_matches_fd(const char *text, int C)
{
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse(text, "t", &spec, &err), 0);
    stk_model *m;
    enum { N = 3, H = 8, W = 8 };
    assert_int_equal(stk_model_create(be, &spec, C, H, W, 4, N, 9, &m, &err), 0);
    float *x = malloc((size_t)N * C * H * W * sizeof *x);
    for (int i = 0; i < N * C * H * W; i++)
        x[i] = sinf((float)i * 0.37f);
    int32_t y[N] = {1, 3, 0};
    const float *logits;
    float loss;
    assert_int_equal(stk_model_forward(m, x, N, true, (stk_philox_key){0, 0}, 0,
                                       &logits, &err), 0);
    assert_int_equal(stk_xent(be, logits, y, N, 4, &loss, stk_model_dlogits(m), &err), 0);
    assert_int_equal(stk_model_backward(m, stk_model_dlogits(m), N,
                                        (stk_philox_key){0, 0}, 0, false, NULL, NULL,
                                        &err), 0);
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
    free(x);
    stk_model_destroy(m);
}

static void whole_model_backward_matches_fd(void **state)
{
    (void)state;
    model_backward_matches_fd("conv 3 3 pad=1\npool 2\nrelu\nconv 4 2 stride=2\n"
                              "relu\nflatten\nlinear 6\nrelu\nlinear classes\n",
                              2);
}

/* The same with a Winograd convolution (3x3, stride 1, 8 channels in and
 * out) between im2col ones, padded and not. */
static void winograd_model_backward_matches_fd(void **state)
{
    (void)state;
    model_backward_matches_fd("conv 8 3 pad=1\nrelu\nconv 8 3\nrelu\n"
                              "conv 8 3 pad=1\npool 2\nrelu\nflatten\n"
                              "linear classes\n",
                              2);
}

enum { CNN_N = 16, CNN_PX = 28 * 28, CNN_PARAMS = 824326 };

/* A step of a model built from spec for inputs c x hw x hw and `classes`
 * outputs: forward (train: dropout on, keyed {7, 9}, stream 3) and
 * backward on n samples; the logits and the gradients it leaves, and the
 * parameter count. */
typedef struct step_shape {
    int c, hw, classes, max_batch;
} step_shape;

static size_t model_step(stk_backend *b, const stk_model_spec *spec,
                         step_shape sh, int n, const float *x,
                         const int32_t *y, bool train, float *logits_out,
                         float *grads_out)
{
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_create(b, spec, sh.c, sh.hw, sh.hw, sh.classes,
                                      sh.max_batch, 5, &m, &err), 0);
    const float *logits;
    float loss;
    stk_philox_key key = {7, 9};
    assert_int_equal(stk_model_forward(m, x, n, train, key, 3, &logits, &err), 0);
    memcpy(logits_out, logits, (size_t)n * sh.classes * sizeof(float));
    assert_int_equal(stk_xent(b, logits, y, n, sh.classes, &loss,
                              stk_model_dlogits(m), &err), 0);
    assert_int_equal(stk_model_backward(m, stk_model_dlogits(m), n, key, 3, false,
                                        NULL, NULL, &err), 0);
    size_t np = stk_model_param_count(m);
    memcpy(grads_out, stk_model_grads(m), np * sizeof(float));
    stk_model_destroy(m);
    return np;
}

/* One step of the cnn on a batch of up to 16 Fashion-MNIST-sized inputs. */
static void cnn_step_conv(stk_backend *b, stk_conv_algo conv, int n,
                          const float *x, const int32_t *y, bool train,
                          float *logits_out, float *grads_out)
{
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_builtin("cnn", &spec, &err), 0);
    spec.conv = conv;
    assert_int_equal(model_step(b, &spec, (step_shape){1, 28, 10, 16}, n, x, y,
                                train, logits_out, grads_out),
                     CNN_PARAMS);
}

static void cnn_step(stk_backend *b, int n, const float *x, const int32_t *y,
                     bool train, float *logits_out, float *grads_out)
{
    cnn_step_conv(b, STK_CONV_AUTO, n, x, y, train, logits_out, grads_out);
}

static void cnn_batch(float *x, int32_t *y)
{
    for (int i = 0; i < CNN_N * CNN_PX; i++)
        x[i] = sinf((float)i * 0.011f) + 0.3f * cosf((float)i * 0.17f);
    for (int i = 0; i < CNN_N; i++)
        y[i] = (i * 7) % 10;
}

/* The CPU backend splits every loop and GEMM over its threads; none of the
 * splits may change a bit of the result. */
static void cnn_results_do_not_depend_on_threads(void **state)
{
    (void)state;
    static float x[CNN_N * CNN_PX], l1[CNN_N * 10], l3[CNN_N * 10];
    static float g1[CNN_PARAMS], g3[CNN_PARAMS];
    int32_t y[CNN_N];
    cnn_batch(x, y);
    stk_backend *three;
    stk_err err;
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 3, &three, &err), 0);
    cnn_step(be, CNN_N, x, y, true, l1, g1);
    cnn_step(three, CNN_N, x, y, true, l3, g3);
    stk_backend_destroy(three);
    assert_memory_equal(l1, l3, sizeof l1);
    assert_memory_equal(g1, g3, sizeof g1);
}

/* The CPU computes a convolution in cache-sized pieces of the batch (7
 * samples for the cnn's second conv, 9 for its first) and rebuilds each
 * piece's columns (Winograd: V) in backward: a batch's gradient must be the
 * mean of its samples' own. */
static void pieces_add_up_to_the_batch(void **state)
{
    (void)state;
    static float x[CNN_N * CNN_PX], logits[CNN_N * 10], one[10];
    static float g[CNN_PARAMS], gi[CNN_PARAMS];
    static double mean[CNN_PARAMS];
    int32_t y[CNN_N];
    cnn_batch(x, y);
    cnn_step(be, CNN_N, x, y, false, logits, g);
    memset(mean, 0, sizeof mean);
    for (int i = 0; i < CNN_N; i++) {
        cnn_step(be, 1, x + i * CNN_PX, y + i, false, one, gi);
        for (int j = 0; j < 10; j++)
            assert_float_equal(one[j], logits[i * 10 + j], 1e-5);
        for (int j = 0; j < CNN_PARAMS; j++)
            mean[j] += gi[j] / CNN_N;
    }
    double worst = 0, scale = 0;
    for (int j = 0; j < CNN_PARAMS; j++) {
        double d = fabs(mean[j] - g[j]);
        worst = d > worst ? d : worst;
        scale = fabs(mean[j]) > scale ? fabs(mean[j]) : scale;
    }
    if (worst > 1e-5 * scale)
        fail_msg("batch gradient differs from the mean of the samples' by "
                 "%g (largest gradient %g)", worst, scale);
}

/* One train-mode step (dropout on) of the model in `text` on a fixed batch
 * of n x 8 x 48 x 48: logits and gradients. */
static void text_step(const char *text, int n, float *logits_out,
                      float *grads_out, size_t *np)
{
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse(text, "t", &spec, &err), 0);
    float *x = malloc((size_t)n * 8 * 48 * 48 * sizeof *x);
    int32_t y[64];
    for (int i = 0; i < n * 8 * 48 * 48; i++)
        x[i] = sinf((float)i * 0.23f);
    for (int i = 0; i < n; i++)
        y[i] = i % 4;
    *np = model_step(be, &spec, (step_shape){8, 48, 4, n}, n, x, y, true,
                     logits_out, grads_out);
    free(x);
}

/* A conv, dropout2d and max-pool run piece by piece together (fused) give
 * the same floats as the layers one after the other: here the relu
 * between dropout and pool keeps them apart, and relu commutes with both
 * the pool and dropout's non-negative scale. 12 samples: 12 pieces of the
 * first conv (im2col, 5x5), 2 of the second (Winograd). */
static void fused_pool_equals_layer_by_layer(void **state)
{
    (void)state;
    enum { N = 12, MAXP = 40000 };
    static float l1[N * 4], l2[N * 4], g1[MAXP], g2[MAXP];
    size_t n1, n2;
    const char *fused = "conv 8 5 pad=2\ndropout2d 0.5\npool 2\nrelu\n"
                        "conv 16 3 pad=1\ndropout2d 0.3\npool 2\nrelu\n"
                        "flatten\nlinear classes\n";
    const char *apart = "conv 8 5 pad=2\ndropout2d 0.5\nrelu\npool 2\n"
                        "conv 16 3 pad=1\ndropout2d 0.3\nrelu\npool 2\n"
                        "flatten\nlinear classes\n";
    text_step(fused, N, l1, g1, &n1);
    text_step(apart, N, l2, g2, &n2);
    assert_int_equal(n1, n2);
    assert_true(n1 <= MAXP);
    assert_memory_equal(l1, l2, sizeof l1);
    assert_memory_equal(g1, g2, n1 * sizeof(float));
}

/* --conv im2col and the default Winograd compute the same cnn: logits and
 * gradients within float rounding of each other. */
static void winograd_and_im2col_agree(void **state)
{
    (void)state;
    static float x[CNN_N * CNN_PX], l1[CNN_N * 10], l2[CNN_N * 10];
    static float g1[CNN_PARAMS], g2[CNN_PARAMS];
    int32_t y[CNN_N];
    cnn_batch(x, y);
    cnn_step_conv(be, STK_CONV_AUTO, CNN_N, x, y, true, l1, g1);
    cnn_step_conv(be, STK_CONV_IM2COL, CNN_N, x, y, true, l2, g2);
    for (int i = 0; i < CNN_N * 10; i++)
        assert_float_equal(l1[i], l2[i], 1e-5);
    double worst = 0, scale = 0, differ = 0;
    for (int j = 0; j < CNN_PARAMS; j++) {
        double d = fabs(g1[j] - g2[j]);
        worst = d > worst ? d : worst;
        scale = fabs(g2[j]) > scale ? fabs(g2[j]) : scale;
        differ += g1[j] != g2[j];
    }
    if (worst > 1e-5 * scale)
        fail_msg("Winograd and im2col gradients differ by %g (largest %g)",
                 worst, scale);
    assert_true(differ > 0); /* they are two computations, not one */
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(cnn_has_pytorch_names_and_shapes),
    cmocka_unit_test(text_format_and_errors),
    cmocka_unit_test(whole_model_backward_matches_fd),
    cmocka_unit_test(winograd_model_backward_matches_fd),
    cmocka_unit_test(winograd_and_im2col_agree),
    cmocka_unit_test(fused_pool_equals_layer_by_layer),
    cmocka_unit_test(cnn_results_do_not_depend_on_threads),
    cmocka_unit_test(pieces_add_up_to_the_batch),
};

UNIT_MAIN_WITH(tests, setup, teardown)
