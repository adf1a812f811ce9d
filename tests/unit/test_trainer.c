/* test_trainer - model specs (built-ins and the text format), shapes and
 * PyTorch parameter names, clear errors for models that do not fit, the
 * whole model's backward against finite differences, and every training
 * option (schedules, warm-up, clipping, SGD with momentum, Nesterov and
 * weight decay, AdamW, resume) through stk_train_run against a reference
 * written here. */
#include "unit.h"

#include "store/store.h"
#include "trainer/checkpoint.h"
#include "trainer/model_impl.h"
#include "trainer/train_impl.h"
#include "trainer/trainer.h"

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
    assert_int_equal(stk_xent(be, logits, y, n, 4, 0.0f, &loss, NULL, &err), 0);
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
    assert_int_equal(stk_xent(be, logits, y, N, 4, 0.0f, &loss, stk_model_dlogits(m), &err), 0);
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
    assert_int_equal(stk_xent(b, logits, y, n, sh.classes, 0.0f, &loss,
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

/* ---- graphs: residual models, batchnorm, pools ----------------------------
 */

/* A file of the source tree (models/...), read whole; the tree is found
 * from this file's path, as the build passes it. */
static char *source_file(const char *rel)
{
    char path[2048];
    const char *me = __FILE__, *cut = strstr(me, "tests/unit/test_trainer.c");
    snprintf(path, sizeof path, "%.*s%s", cut ? (int)(cut - me) : 0, me, rel);
    FILE *f = fopen(path, "rb");
    if (!f)
        fail_msg("cannot open %s", path);
    char *text = calloc(1, 1 << 16);
    size_t n = fread(text, 1, (1 << 16) - 1, f);
    fclose(f);
    assert_true(n > 0 && n < (1 << 16) - 1);
    return text;
}

/* stk_model_parse's error for text, which must contain `want`. */
static void expect_parse_error(const char *text, const char *want)
{
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse(text, "g.model", &spec, &err),
                     STK_EINVAL);
    if (!strstr(err.msg, want))
        fail_msg("error \"%s\" does not say \"%s\"", err.msg, want);
}

/* stk_model_create's error for text on c x hw x hw inputs, 4 classes. */
static void expect_create_error(const char *text, int c, int hw, int max_batch,
                                const char *want)
{
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_parse(text, "g.model", &spec, &err), 0);
    assert_int_equal(
        stk_model_create(be, &spec, c, hw, hw, 4, max_batch, 1, &m, &err),
        STK_EINVAL);
    assert_null(m);
    if (!strstr(err.msg, want))
        fail_msg("error \"%s\" does not say \"%s\"", err.msg, want);
}

/* Inputs by name, with one clear line for each way a graph can be wrong. */
static void graph_format_and_errors(void **state)
{
    (void)state;
    stk_model_spec spec;
    stk_err err;
    const char *text = "a: conv 4 3 pad=1 bias=false\n"
                       "bn: batchnorm\n"
                       "r: relu\n"
                       "b: conv 4 1 from=a\n"
                       "s: add r\n"    /* the layer before + r */
                       "add s input\n" /* two names */
                       "avgpool 2 stride=1\n"
                       "globalpool\n"
                       "flatten\n"
                       "linear classes bias=false\n";
    assert_int_equal(stk_model_parse(text, "g.model", &spec, &err), 0);
    assert_int_equal(spec.n, 10);
    assert_true(spec.layers[0].no_bias && !spec.layers[3].no_bias);
    assert_true(spec.layers[9].no_bias);
    assert_int_equal(spec.layers[2].nin, 0); /* reads the layer before */
    assert_int_equal(spec.layers[3].nin, 1);
    assert_int_equal(spec.layers[3].in[0], 0);
    assert_int_equal(spec.layers[4].nin, 2);
    assert_int_equal(spec.layers[4].in[0], 3);
    assert_int_equal(spec.layers[4].in[1], 2);
    assert_int_equal(spec.layers[5].in[0], 4);
    assert_int_equal(spec.layers[5].in[1], STK_INPUT);
    assert_int_equal(spec.layers[6].k, 2);
    assert_int_equal(spec.layers[6].stride, 1);
    stk_model *m;
    assert_int_equal(stk_model_create(be, &spec, 4, 6, 6, 4, 2, 1, &m, &err),
                     0);
    /* a.weight, bn.weight, bn.bias, b.weight, b.bias, fc1.weight */
    assert_int_equal(stk_model_nparams(m), 6);
    expect_param(m, 0, "a.weight", 4, 4, 4, 3, 3);
    expect_param(m, 1, "bn.weight", 1, 4, 0, 0, 0);
    expect_param(m, 4, "b.bias", 1, 4, 0, 0, 0);
    expect_param(m, 5, "fc1.weight", 2, 4, 4, 0, 0);
    assert_true(
        stk_model_param(m, 4)->no_decay && stk_model_param(m, 1)->no_decay &&
        stk_model_param(m, 2)->no_decay && !stk_model_param(m, 0)->no_decay);
    assert_int_equal(stk_model_nbuffers(m), 2);
    assert_string_equal(stk_model_buffer(m, 1)->name, "bn.running_var");
    assert_int_equal(stk_model_ncounters(m), 1);
    assert_string_equal(stk_model_counter_name(m, 0),
                        "bn.num_batches_tracked");
    stk_model_destroy(m);

    expect_parse_error("relu\nadd x\n", "g.model:2: no layer is named 'x'");
    expect_parse_error("conv 2 1 from=later\nlater: relu\n",
                       "g.model:1: 'later' is defined later (line 2)");
    expect_parse_error("x: relu\nadd x y\n\ny: relu\n",
                       "g.model:2: 'y' is defined later (line 4)");
    expect_parse_error("me: conv 2 1 from=me\n",
                       "g.model:1: this layer reads 'me'");
    expect_parse_error(
        "a: relu\n# twice\na: flatten\n",
        "g.model:3: a second layer named 'a' (the first is on line 1)");
    expect_parse_error("add\n", "g.model:1: add needs the name");
    expect_parse_error("relu\nadd a b c\n", "g.model:2: unexpected 'c'");
    expect_parse_error("input: relu\n", "'input' is the model's input");
    expect_parse_error("conv 2 3 bias=no\n",
                       "g.model:1: 'bias=no': bias takes true or false");
    expect_parse_error("relu bias=false\n", "'bias=false' does not apply");
    expect_parse_error("relu\nadd input from=input\n",
                       "'from=input' does not apply");
    expect_parse_error("avgpool\n", "avgpool needs a kernel size");
    expect_parse_error("globalpool 2\n", "unexpected '2'");
    expect_parse_error("a/b: relu\n", "'a/b' is not a layer name");
    expect_parse_error("a: relu\nb: relu from=a from=input\n",
                       "g.model:2: 'from=input': from= given twice");
    expect_parse_error("conv 4 3 pad=1 pad=0\n", "'pad=0': pad= given twice");
    /* one layer past the limit: refused at its line, nothing written past
     * the parser's per-layer table (ASan checks) */
    char *many = malloc(5 * (STK_MAX_LAYERS + 1) + 1);
    assert_non_null(many);
    for (int i = 0; i <= STK_MAX_LAYERS; i++)
        memcpy(many + 5 * i, "relu\n", 5);
    many[5 * (STK_MAX_LAYERS + 1)] = '\0';
    expect_parse_error(many, "g.model:257: more than 256 layers");
    free(many);

    expect_create_error("conv 4 3\nadd input\nflatten\nlinear classes\n", 2, 6,
                        2,
                        "layer 2 (add): adds 4x4x4 (conv1) and 2x6x6 (input): "
                        "the shapes differ");
    expect_create_error("s: conv 4 3 stride=2\nr: conv 4 3 from=input\nadd s\n"
                        "flatten\nlinear classes\n",
                        4, 9, 2, "adds 4x7x7 (r) and 4x4x4 (s)");
    expect_create_error(
        "flatten\nlinear 8\nmid: batchnorm\nlinear classes\n", 1, 4, 1,
        "mid: a batchnorm over 8x1x1 inputs in batches of at most 1 "
        "sees one value per channel in training");
    expect_create_error(
        "a: conv 2 1\nb: conv 2 1 from=input\nflatten\nlinear classes\n", 2, 3,
        2, "a: no layer reads its output");
}

/* Training on one sample of 1x1 planes: PyTorch's "Expected more than 1
 * value per channel when training"; evaluation is fine. */
static void batchnorm_refuses_one_value_per_channel(void **state)
{
    (void)state;
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(
        stk_model_parse("flatten\nlinear 5\nbn: batchnorm\nlinear classes\n",
                        "t", &spec, &err),
        0);
    assert_int_equal(stk_model_create(be, &spec, 1, 3, 3, 4, 4, 1, &m, &err),
                     0);
    float x[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    const float *logits;
    assert_int_equal(stk_model_forward(m, x, 1, true, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     STK_EINVAL);
    assert_non_null(strstr(err.msg,
                           "bn: a batchnorm in training over a 1x5x1x1 "
                           "input sees one value per channel"));
    assert_int_equal(stk_model_forward(m, x, 1, false, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    stk_model_destroy(m);
    /* 2-d: one sample of 2x2 planes is four values per channel */
    assert_int_equal(stk_model_parse("batchnorm\nflatten\nlinear classes\n",
                                     "t", &spec, &err),
                     0);
    assert_int_equal(stk_model_create(be, &spec, 1, 2, 2, 4, 1, 1, &m, &err),
                     0);
    assert_int_equal(stk_model_forward(m, x, 1, true, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    stk_model_destroy(m);
}

/* The parameter names and count of a built-in on c x hw x hw inputs. */
static size_t builtin_params(const char *name, int c, int hw, int classes,
                             char names[][STK_NAME_MAX + 32], int *np)
{
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_builtin(name, &spec, &err), 0);
    assert_int_equal(
        stk_model_create(be, &spec, c, hw, hw, classes, 2, 1, &m, &err), 0);
    *np = stk_model_nparams(m);
    for (int i = 0; i < *np; i++)
        snprintf(names[i], sizeof names[i], "%s", stk_model_param(m, i)->name);
    size_t total = stk_model_param_count(m);
    stk_model_destroy(m);
    return total;
}

/* models/NAME.model is the built-in NAME, field for field; the built-ins
 * keep their parameter names and counts. */
static void model_files_are_the_builtins(void **state)
{
    (void)state;
    static const char *const names[] = {"cnn", "mlp", "resnet20", "resnet18"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        stk_model_spec *file = malloc(sizeof *file),
                       *builtin = malloc(sizeof *builtin);
        char rel[64];
        stk_err err;
        snprintf(rel, sizeof rel, "models/%s.model", names[i]);
        char *text = source_file(rel);
        assert_int_equal(stk_model_parse(text, rel, file, &err), 0);
        assert_int_equal(stk_model_builtin(names[i], builtin, &err), 0);
        if (memcmp(file, builtin, sizeof *file))
            fail_msg("%s differs from the built-in %s", rel, names[i]);
        free(text);
        free(file);
        free(builtin);
    }
    static char got[2 * STK_MAX_LAYERS][STK_NAME_MAX + 32];
    int np;
    assert_int_equal(builtin_params("mlp", 1, 28, 10, got, &np),
                     784 * 256 + 256 + 256 * 128 + 128 + 1290);
    assert_int_equal(np, 6);
    assert_string_equal(got[5], "fc3.bias");
    assert_int_equal(builtin_params("cnn", 1, 28, 10, got, &np), CNN_PARAMS);
    assert_int_equal(np, 8);
    assert_string_equal(got[3], "conv2.bias");
    /* resnet20 with option B shortcuts: 16/32/64 channels; Fashion-MNIST
     * sizes work (28 -> 14 -> 7) */
    size_t r20 =
        16 * 1 * 9 + 32 + /* stem */
        6 * (16 * 16 * 9 + 32) + (32 * 16 * 9 + 64 + 32 * 32 * 9 + 64) +
        4 * (32 * 32 * 9 + 64) + (32 * 16 + 64) + /* downsample of layer2 */
        (64 * 32 * 9 + 128 + 64 * 64 * 9 + 128) + 4 * (64 * 64 * 9 + 128) +
        (64 * 32 + 128) + 64 * 10 + 10;
    assert_int_equal(builtin_params("resnet20", 1, 28, 10, got, &np), r20);
    assert_string_equal(got[0], "conv1.weight");
    assert_string_equal(got[3], "layer1.0.conv1.weight");
    assert_string_equal(got[np - 1], "fc.bias");
}

/* torchvision's resnet18 state dict (CIFAR stem: conv1 3x3 on 3 channels,
 * no max-pool), written out by PyTorch: parameters (P), running
 * statistics (B) and num_batches_tracked (C), in order. */
static const struct {
    const char *name;
    char kind;
    int ndim, shape[4];
} resnet18_state[] = {
    {"conv1.weight", 'P', 4, {64, 3, 3, 3}},
    {"bn1.weight", 'P', 1, {64, 0, 0, 0}},
    {"bn1.bias", 'P', 1, {64, 0, 0, 0}},
    {"bn1.running_mean", 'B', 1, {64, 0, 0, 0}},
    {"bn1.running_var", 'B', 1, {64, 0, 0, 0}},
    {"bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer1.0.conv1.weight", 'P', 4, {64, 64, 3, 3}},
    {"layer1.0.bn1.weight", 'P', 1, {64, 0, 0, 0}},
    {"layer1.0.bn1.bias", 'P', 1, {64, 0, 0, 0}},
    {"layer1.0.bn1.running_mean", 'B', 1, {64, 0, 0, 0}},
    {"layer1.0.bn1.running_var", 'B', 1, {64, 0, 0, 0}},
    {"layer1.0.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer1.0.conv2.weight", 'P', 4, {64, 64, 3, 3}},
    {"layer1.0.bn2.weight", 'P', 1, {64, 0, 0, 0}},
    {"layer1.0.bn2.bias", 'P', 1, {64, 0, 0, 0}},
    {"layer1.0.bn2.running_mean", 'B', 1, {64, 0, 0, 0}},
    {"layer1.0.bn2.running_var", 'B', 1, {64, 0, 0, 0}},
    {"layer1.0.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer1.1.conv1.weight", 'P', 4, {64, 64, 3, 3}},
    {"layer1.1.bn1.weight", 'P', 1, {64, 0, 0, 0}},
    {"layer1.1.bn1.bias", 'P', 1, {64, 0, 0, 0}},
    {"layer1.1.bn1.running_mean", 'B', 1, {64, 0, 0, 0}},
    {"layer1.1.bn1.running_var", 'B', 1, {64, 0, 0, 0}},
    {"layer1.1.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer1.1.conv2.weight", 'P', 4, {64, 64, 3, 3}},
    {"layer1.1.bn2.weight", 'P', 1, {64, 0, 0, 0}},
    {"layer1.1.bn2.bias", 'P', 1, {64, 0, 0, 0}},
    {"layer1.1.bn2.running_mean", 'B', 1, {64, 0, 0, 0}},
    {"layer1.1.bn2.running_var", 'B', 1, {64, 0, 0, 0}},
    {"layer1.1.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer2.0.conv1.weight", 'P', 4, {128, 64, 3, 3}},
    {"layer2.0.bn1.weight", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.bn1.bias", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.bn1.running_mean", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.bn1.running_var", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer2.0.conv2.weight", 'P', 4, {128, 128, 3, 3}},
    {"layer2.0.bn2.weight", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.bn2.bias", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.bn2.running_mean", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.bn2.running_var", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer2.0.downsample.0.weight", 'P', 4, {128, 64, 1, 1}},
    {"layer2.0.downsample.1.weight", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.downsample.1.bias", 'P', 1, {128, 0, 0, 0}},
    {"layer2.0.downsample.1.running_mean", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.downsample.1.running_var", 'B', 1, {128, 0, 0, 0}},
    {"layer2.0.downsample.1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer2.1.conv1.weight", 'P', 4, {128, 128, 3, 3}},
    {"layer2.1.bn1.weight", 'P', 1, {128, 0, 0, 0}},
    {"layer2.1.bn1.bias", 'P', 1, {128, 0, 0, 0}},
    {"layer2.1.bn1.running_mean", 'B', 1, {128, 0, 0, 0}},
    {"layer2.1.bn1.running_var", 'B', 1, {128, 0, 0, 0}},
    {"layer2.1.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer2.1.conv2.weight", 'P', 4, {128, 128, 3, 3}},
    {"layer2.1.bn2.weight", 'P', 1, {128, 0, 0, 0}},
    {"layer2.1.bn2.bias", 'P', 1, {128, 0, 0, 0}},
    {"layer2.1.bn2.running_mean", 'B', 1, {128, 0, 0, 0}},
    {"layer2.1.bn2.running_var", 'B', 1, {128, 0, 0, 0}},
    {"layer2.1.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer3.0.conv1.weight", 'P', 4, {256, 128, 3, 3}},
    {"layer3.0.bn1.weight", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.bn1.bias", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.bn1.running_mean", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.bn1.running_var", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer3.0.conv2.weight", 'P', 4, {256, 256, 3, 3}},
    {"layer3.0.bn2.weight", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.bn2.bias", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.bn2.running_mean", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.bn2.running_var", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer3.0.downsample.0.weight", 'P', 4, {256, 128, 1, 1}},
    {"layer3.0.downsample.1.weight", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.downsample.1.bias", 'P', 1, {256, 0, 0, 0}},
    {"layer3.0.downsample.1.running_mean", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.downsample.1.running_var", 'B', 1, {256, 0, 0, 0}},
    {"layer3.0.downsample.1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer3.1.conv1.weight", 'P', 4, {256, 256, 3, 3}},
    {"layer3.1.bn1.weight", 'P', 1, {256, 0, 0, 0}},
    {"layer3.1.bn1.bias", 'P', 1, {256, 0, 0, 0}},
    {"layer3.1.bn1.running_mean", 'B', 1, {256, 0, 0, 0}},
    {"layer3.1.bn1.running_var", 'B', 1, {256, 0, 0, 0}},
    {"layer3.1.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer3.1.conv2.weight", 'P', 4, {256, 256, 3, 3}},
    {"layer3.1.bn2.weight", 'P', 1, {256, 0, 0, 0}},
    {"layer3.1.bn2.bias", 'P', 1, {256, 0, 0, 0}},
    {"layer3.1.bn2.running_mean", 'B', 1, {256, 0, 0, 0}},
    {"layer3.1.bn2.running_var", 'B', 1, {256, 0, 0, 0}},
    {"layer3.1.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer4.0.conv1.weight", 'P', 4, {512, 256, 3, 3}},
    {"layer4.0.bn1.weight", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.bn1.bias", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.bn1.running_mean", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.bn1.running_var", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer4.0.conv2.weight", 'P', 4, {512, 512, 3, 3}},
    {"layer4.0.bn2.weight", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.bn2.bias", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.bn2.running_mean", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.bn2.running_var", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer4.0.downsample.0.weight", 'P', 4, {512, 256, 1, 1}},
    {"layer4.0.downsample.1.weight", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.downsample.1.bias", 'P', 1, {512, 0, 0, 0}},
    {"layer4.0.downsample.1.running_mean", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.downsample.1.running_var", 'B', 1, {512, 0, 0, 0}},
    {"layer4.0.downsample.1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer4.1.conv1.weight", 'P', 4, {512, 512, 3, 3}},
    {"layer4.1.bn1.weight", 'P', 1, {512, 0, 0, 0}},
    {"layer4.1.bn1.bias", 'P', 1, {512, 0, 0, 0}},
    {"layer4.1.bn1.running_mean", 'B', 1, {512, 0, 0, 0}},
    {"layer4.1.bn1.running_var", 'B', 1, {512, 0, 0, 0}},
    {"layer4.1.bn1.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"layer4.1.conv2.weight", 'P', 4, {512, 512, 3, 3}},
    {"layer4.1.bn2.weight", 'P', 1, {512, 0, 0, 0}},
    {"layer4.1.bn2.bias", 'P', 1, {512, 0, 0, 0}},
    {"layer4.1.bn2.running_mean", 'B', 1, {512, 0, 0, 0}},
    {"layer4.1.bn2.running_var", 'B', 1, {512, 0, 0, 0}},
    {"layer4.1.bn2.num_batches_tracked", 'C', 0, {0, 0, 0, 0}},
    {"fc.weight", 'P', 2, {10, 512, 0, 0}},
    {"fc.bias", 'P', 1, {10, 0, 0, 0}},
};

static void resnet18_has_torchvision_names(void **state)
{
    (void)state;
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_builtin("resnet18", &spec, &err), 0);
    assert_int_equal(
        stk_model_create(be, &spec, 3, 32, 32, 10, 2, 1, &m, &err), 0);
    int ip = 0, ib = 0, ic = 0;
    for (size_t i = 0; i < sizeof resnet18_state / sizeof *resnet18_state;
         i++) {
        const char *want = resnet18_state[i].name;
        const stk_param *p = NULL;
        if (resnet18_state[i].kind == 'C') {
            assert_true(ic < stk_model_ncounters(m));
            assert_string_equal(stk_model_counter_name(m, ic++), want);
            continue;
        }
        if (resnet18_state[i].kind == 'P') {
            assert_true(ip < stk_model_nparams(m));
            p = stk_model_param(m, ip++);
        } else {
            assert_true(ib < stk_model_nbuffers(m));
            p = stk_model_buffer(m, ib++);
        }
        assert_string_equal(p->name, want);
        assert_int_equal(p->ndim, resnet18_state[i].ndim);
        for (int d = 0; d < p->ndim; d++)
            assert_int_equal(p->shape[d], resnet18_state[i].shape[d]);
    }
    assert_int_equal(ip, stk_model_nparams(m));
    assert_int_equal(ib, stk_model_nbuffers(m));
    assert_int_equal(ic, stk_model_ncounters(m));
    assert_int_equal(stk_model_param_count(m), 11173962); /* PyTorch's count */
    /* new statistics: running_mean 0, running_var 1; bn weight 1, bias 0 */
    const float *b = stk_model_buffers(m), *w = stk_model_weights(m);
    const stk_param *rv = stk_model_buffer(m, 1), *bw = stk_model_param(m, 1),
                    *bb = stk_model_param(m, 2);
    assert_true(b[0] == 0.0f && b[rv->offset] == 1.0f &&
                b[rv->offset + 63] == 1.0f);
    assert_true(w[bw->offset] == 1.0f && w[bb->offset + 5] == 0.0f);
    assert_int_equal(*stk_model_counter(m, 0), 0);
    stk_model_destroy(m);
}

/* Cross-entropy of logits [n, classes] in double, and its gradient. */
static double xent_double(const float *logits, const int32_t *y, int n,
                          int classes, float *dlogits)
{
    double loss = 0;
    for (int i = 0; i < n; i++) {
        const float *z = logits + i * classes;
        double mx = z[0], sum = 0;
        for (int j = 1; j < classes; j++)
            mx = z[j] > mx ? z[j] : mx;
        for (int j = 0; j < classes; j++)
            sum += exp(z[j] - mx);
        loss += (log(sum) + mx - z[y[i]]) / n;
        for (int j = 0; dlogits && j < classes; j++)
            dlogits[i * classes + j] =
                (float)((exp(z[j] - mx) / sum - (j == y[i])) / n);
    }
    return loss;
}

/* The training-mode loss of m on a fixed batch. */
static double train_loss(stk_model *m, const float *x, const int32_t *y, int n,
                         int classes)
{
    const float *logits;
    stk_err err;
    assert_int_equal(stk_model_forward(m, x, n, true, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    return xent_double(logits, y, n, classes, NULL);
}

/* The whole backward of a residual model in training mode (batchnorm's
 * gradient through the batch statistics, 2-d and 1-d; a projection
 * shortcut of stride 2 beside a strided 3x3 conv; a fan-out whose
 * gradients add up; a Winograd conv; average and global pools; layers
 * without bias) against central differences of the loss, computed in
 * double from the float logits, on every parameter. */
static void residual_backward_matches_fd(void **state)
{
    (void)state;
    const char *text = "c1: conv 8 3 pad=1 bias=false\n"
                       "b1: batchnorm\n"
                       "r1: relu\n"
                       "c2: conv 8 3 stride=2 pad=1 bias=false\n"
                       "b2: batchnorm\n"
                       "relu\n"
                       "c3: conv 8 3 pad=1 bias=false\n" /* Winograd */
                       "b3: batchnorm\n"
                       "d0: conv 8 1 stride=2 bias=false from=r1\n"
                       "d1: batchnorm\n"
                       "add b3\n"
                       "r2: relu\n"
                       "pooled: avgpool 2 stride=1\n"
                       "add pooled pooled\n" /* one output read twice */
                       "globalpool\n"
                       "flatten\n"
                       "fc1: linear 6\n"
                       "bn1d: batchnorm\n"
                       "relu\n"
                       "fc2: linear classes\n";
    enum { N = 4, C = 3, H = 8, K = 4 };
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_parse(text, "t", &spec, &err), 0);
    assert_int_equal(stk_model_create(be, &spec, C, H, H, K, N, 3, &m, &err),
                     0);
    float x[N * C * H * H], dl[N * K];
    int32_t y[N] = {1, 3, 0, 2};
    for (int i = 0; i < N * C * H * H; i++)
        x[i] = sinf((float)i * 0.37f) + 0.2f * cosf((float)i * 1.3f);
    const float *logits;
    assert_int_equal(stk_model_forward(m, x, N, true, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    xent_double(logits, y, N, K, dl);
    assert_int_equal(stk_model_backward(m, dl, N, (stk_philox_key){0, 0}, 0,
                                        false, NULL, NULL, &err),
                     0);
    size_t np = stk_model_param_count(m);
    float *g = malloc(np * sizeof *g), *w = stk_model_weights(m);
    memcpy(g, stk_model_grads(m), np * sizeof *g);
    /* the loss at w[i] + k h, k = -2..2; the four slopes between them
     * agree where the loss is smooth, and differ where a ReLU switches
     * (every unit after a batchnorm lies near 0 with some probability):
     * such a point is a kink, and only smooth points are compared */
    int bad = 0, kinks = 0;
    for (size_t i = 0; i < np; i++) {
        float keep = w[i],
              h = 1e-3f * (fabsf(keep) > 0.5f ? fabsf(keep) : 0.5f);
        double at[5], slope[4], lo = 1e30, hi = -1e30;
        for (int k = 0; k < 5; k++) {
            w[i] = keep + (float)(k - 2) * h;
            at[k] = train_loss(m, x, y, N, K);
        }
        w[i] = keep;
        for (int k = 0; k < 4; k++) {
            slope[k] = (at[k + 1] - at[k]) / h;
            lo = slope[k] < lo ? slope[k] : lo;
            hi = slope[k] > hi ? slope[k] : hi;
        }
        double num = (at[3] - at[1]) / (2 * h);
        double scale = fabs(num) > 1e-2 ? fabs(num) : 1e-2;
        if (hi - lo > 0.02 * scale + 1e-3) { /* float noise: about 3e-4 */
            kinks++;
        } else if (fabs(num - g[i]) > 0.02 * scale + 5e-4) {
            print_message("param %zu: backward %.6g, differences %.6g\n", i,
                          g[i], num);
            bad++;
        }
    }
    if (bad || kinks > (int)np / 4)
        fail_msg(
            "%d of %zu parameter gradients disagree with finite differences "
            "at smooth points (%d kinks)",
            bad, np, kinks);
    free(g);
    stk_model_destroy(m);
}

/* One training step of the model in `text` (forward in training mode,
 * backward of the double cross-entropy) on b: logits and gradients; the
 * parameter count. */
/* graph_step on a model made for batches of up to max_batch, its
 * convolutions' range 0 taking at most front_max pieces (0: no limit). */
static size_t graph_step_at(stk_backend *b, const char *text, int c, int hw,
                            int n, int max_batch, int front_max,
                            float *logits_out, float *grads_out,
                            float *buffers_out)
{
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_parse(text, "t", &spec, &err), 0);
    assert_int_equal(
        stk_model_create(b, &spec, c, hw, hw, 5, max_batch, 11, &m, &err), 0);
    m->front_max = front_max;
    float *x = malloc((size_t)n * c * hw * hw * sizeof *x), dl[64 * 5];
    int32_t y[64];
    for (int i = 0; i < n * c * hw * hw; i++)
        x[i] = sinf((float)i * 0.29f) + 0.5f * cosf((float)i * 0.071f);
    for (int i = 0; i < n; i++)
        y[i] = (i * 3) % 5;
    const float *logits;
    assert_int_equal(stk_model_forward(m, x, n, true, (stk_philox_key){3, 4},
                                       2, &logits, &err),
                     0);
    memcpy(logits_out, logits, (size_t)n * 5 * sizeof(float));
    xent_double(logits, y, n, 5, dl);
    assert_int_equal(stk_model_backward(m, dl, n, (stk_philox_key){3, 4}, 2,
                                        false, NULL, NULL, &err),
                     0);
    size_t np = stk_model_param_count(m);
    memcpy(grads_out, stk_model_grads(m), np * sizeof(float));
    if (buffers_out)
        memcpy(buffers_out, stk_model_buffers(m),
               stk_model_buffer_count(m) * sizeof(float));
    free(x);
    stk_model_destroy(m);
    return np;
}

static size_t graph_step(stk_backend *b, const char *text, int c, int hw,
                         int n, float *logits_out, float *grads_out,
                         float *buffers_out)
{
    return graph_step_at(b, text, c, hw, n, n, 0, logits_out, grads_out,
                         buffers_out);
}

/* An output read by two layers gets the sum of their gradients: with the
 * add, h + h = 2h feeds fc2, which is fc2 with doubled weights on h (the
 * doubling is exact in float): every gradient below fc2 is the same to
 * the bit, and fc2's weight gradient is twice the plain one. */
static void fan_out_gradients_add_up(void **state)
{
    (void)state;
    enum { N = 6, PX = 2 * 5 * 5 };
    stk_model_spec sa, sb;
    stk_err err;
    stk_model *a, *b;
    const char *fanned = "c: conv 3 3 pad=1\nfc1: linear 7\nh: relu\nadd h "
                         "h\nfc2: linear classes\n";
    const char *plain =
        "c: conv 3 3 pad=1\nfc1: linear 7\nh: relu\nfc2: linear classes\n";
    assert_int_equal(stk_model_parse(fanned, "a", &sa, &err), 0);
    assert_int_equal(stk_model_parse(plain, "b", &sb, &err), 0);
    assert_int_equal(stk_model_create(be, &sa, 2, 5, 5, 5, N, 1, &a, &err), 0);
    assert_int_equal(stk_model_create(be, &sb, 2, 5, 5, 5, N, 1, &b, &err), 0);
    size_t np = stk_model_param_count(a);
    assert_int_equal(np, stk_model_param_count(b));
    const stk_param *w2 = stk_model_param(b, 4);
    assert_string_equal(w2->name, "fc2.weight");
    for (size_t i = 0; i < w2->count; i++)
        stk_model_weights(b)[w2->offset + i] *= 2;
    float x[N * PX], la[N * 5], lb[N * 5], dl[N * 5];
    int32_t y[N] = {0, 1, 2, 3, 4, 0};
    for (int i = 0; i < N * PX; i++)
        x[i] = cosf((float)i * 0.53f);
    stk_model *ms[2] = {a, b};
    float *ls[2] = {la, lb};
    for (int k = 0; k < 2; k++) {
        const float *logits;
        assert_int_equal(stk_model_forward(ms[k], x, N, true,
                                           (stk_philox_key){0, 0}, 0, &logits,
                                           &err),
                         0);
        memcpy(ls[k], logits, sizeof la);
        xent_double(logits, y, N, 5, dl);
        assert_int_equal(stk_model_backward(ms[k], dl, N,
                                            (stk_philox_key){0, 0}, 0, false,
                                            NULL, NULL, &err),
                         0);
    }
    assert_memory_equal(la, lb, sizeof la);
    const float *ga = stk_model_grads(a), *gb = stk_model_grads(b);
    assert_memory_equal(ga, gb, w2->offset * sizeof(float)); /* c, fc1 */
    for (size_t i = 0; i < w2->count; i++)
        assert_true(ga[w2->offset + i] == 2 * gb[w2->offset + i]);
    bool nonzero = false;
    for (size_t i = 0; i < w2->offset; i++)
        nonzero |= ga[i] != 0;
    assert_true(nonzero);
    stk_model_destroy(a);
    stk_model_destroy(b);
}

/* Training forward: the running statistics move by PyTorch's rule
 * (momentum 0.1, unbiased variance) and num_batches_tracked counts;
 * evaluation normalises with the running statistics: logits equal the
 * formula, computed here in double. */
static void batchnorm_eval_uses_running_stats(void **state)
{
    (void)state;
    enum { N = 5, C = 3, HW = 4, K = 5 };
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(
        stk_model_parse("bn: batchnorm\nflatten\nfc: linear classes\n", "t",
                        &spec, &err),
        0);
    assert_int_equal(stk_model_create(be, &spec, C, 2, 2, K, N, 7, &m, &err),
                     0);
    float x[N * C * HW];
    for (int i = 0; i < N * C * HW; i++)
        x[i] = 2.0f * sinf((float)i * 0.7f) + (float)(i % 3);
    float *w = stk_model_weights(m), *run = stk_model_buffers(m);
    const float *logits;
    for (int step = 0; step < 2; step++)
        assert_int_equal(stk_model_forward(m, x, N, true,
                                           (stk_philox_key){0, 0}, 0, &logits,
                                           &err),
                         0);
    assert_int_equal(*stk_model_counter(m, 0), 2);
    for (int c = 0; c < C; c++) {
        double s = 0, ss = 0, cnt = N * HW;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++)
                s += x[(n * C + c) * HW + i];
        double mean = s / cnt;
        for (int n = 0; n < N; n++)
            for (int i = 0; i < HW; i++)
                ss += pow(x[(n * C + c) * HW + i] - mean, 2);
        double var = ss / (cnt - 1), rm = 0, rv = 1;
        for (int step = 0; step < 2; step++) {
            rm = 0.9 * rm + 0.1 * mean;
            rv = 0.9 * rv + 0.1 * var;
        }
        assert_float_equal(run[c], rm, 1e-5 * (1 + fabs(rm)));
        assert_float_equal(run[C + c], rv, 1e-5 * (1 + fabs(rv)));
    }
    /* gamma and beta of our choosing; evaluation */
    const stk_param *gw = stk_model_param(m, 0), *gb = stk_model_param(m, 1),
                    *fw = stk_model_param(m, 2), *fb = stk_model_param(m, 3);
    for (int c = 0; c < C; c++) {
        w[gw->offset + c] = 0.5f + (float)c;
        w[gb->offset + c] = 0.25f * (float)c - 0.3f;
    }
    assert_int_equal(stk_model_forward(m, x, N, false, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    assert_int_equal(*stk_model_counter(m, 0), 2); /* eval does not count */
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++) {
            double z = w[fb->offset + k];
            for (int c = 0; c < C; c++)
                for (int i = 0; i < HW; i++) {
                    double v = (x[(n * C + c) * HW + i] - run[c]) /
                                   sqrt((double)run[C + c] + 1e-5) *
                                   w[gw->offset + c] +
                               w[gb->offset + c];
                    z += v * w[fw->offset + k * C * HW + c * HW + i];
                }
            assert_float_equal(logits[n * K + k], z, 1e-5 * (1 + fabs(z)));
        }
    stk_model_destroy(m);
}

/* A small residual network with batchnorm (2-d fused with its ReLU, 1-d,
 * a projection shortcut, average and global pools) gives the same bytes
 * on 1, 2 and 3 threads: logits, gradients, running statistics. */
static const char graph_net[] =
    "conv1: conv 16 3 pad=1 bias=false\n"
    "bn1: batchnorm\n"
    "stem: relu\n"
    "b.conv1: conv 16 3 pad=1 bias=false\n"
    "b.bn1: batchnorm\n"
    "relu\n"
    "b.conv2: conv 16 3 pad=1 bias=false\n"
    "b.bn2: batchnorm\n"
    "add stem\n"
    "b: relu\n"
    "c.conv1: conv 32 3 stride=2 pad=1 bias=false\n"
    "c.bn1: batchnorm\n"
    "relu\n"
    "c.conv2: conv 32 3 pad=1 bias=false\n"
    "c.bn2: batchnorm\n"
    "c.down: conv 32 1 stride=2 bias=false from=b\n"
    "c.dbn: batchnorm\n"
    "add c.bn2\n"
    "relu\n"
    "avgpool 2\n"
    "globalpool\n"
    "flatten\n"
    "fc1: linear 24\n"
    "bn: batchnorm\n"
    "relu\n"
    "fc2: linear classes\n";

static void graph_results_do_not_depend_on_threads(void **state)
{
    (void)state;
    enum { N = 12, C = 3, HW = 20, MAXP = 40000 };
    static float l[3][N * 5], g[3][MAXP], b[3][512];
    size_t np = 0;
    for (int t = 0; t < 3; t++) {
        stk_backend *bt;
        stk_err err;
        assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, t + 1, &bt, &err),
                         0);
        np = graph_step(bt, graph_net, C, HW, N, l[t], g[t], b[t]);
        stk_backend_destroy(bt);
        assert_true(np <= MAXP);
    }
    for (int t = 1; t < 3; t++) {
        assert_memory_equal(l[0], l[t], sizeof l[0]);
        assert_memory_equal(g[0], g[t], np * sizeof(float));
        assert_memory_equal(b[0], b[t], sizeof b[0]);
    }
}

/* On several threads a convolution runs its pieces in ranges, one per
 * thread, the weight gradient's units of the later ranges stashed and
 * added in order (model_conv.c): the same bytes as one thread. ranges_net
 * on 48x48 inputs and graph_net on 24x24 split every convolution into 2
 * to 40 pieces at 40 samples: Winograd with and without a bias, im2col
 * strided and 1x1 with and without one, a max-pool and a dropout run
 * piece by piece. Range 0 taking as many pieces as it can, or one only
 * (so that the others surely stash theirs); a batch of 40, and of 27 on a
 * model made for 40 (a short last piece). */
static const char ranges_net[] =
    "conv1: conv 16 3 pad=1\n"
    "dropout2d 0.25\n"
    "pool 2\n"
    "relu\n"
    "conv2: conv 16 3 pad=1\n"
    "bn1: batchnorm\n"
    "relu\n"
    "conv3: conv 24 3 stride=2 pad=1\n"
    "relu\n"
    "conv4: conv 24 1 bias=false\n"
    "globalpool\n"
    "flatten\n"
    "fc: linear classes\n";

static void conv_ranges_match_one_thread(void **state)
{
    (void)state;
    enum { N = 40, MAXP = 40000 };
    static float l[2][N * 5], g[2][MAXP], b[2][512];
    const char *nets[] = {ranges_net, graph_net};
    const int hws[] = {48, 24};
    for (int k = 0; k < 2; k++)
        for (int n = N; n >= 27; n -= 13) {
            size_t np = graph_step_at(be, nets[k], 3, hws[k], n, N, 0, l[0],
                                      g[0], b[0]);
            assert_true(np <= MAXP);
            for (int t = 2; t <= 4; t++)
                for (int most = 0; most <= 1; most++) {
                    stk_backend *bt;
                    stk_err err;
                    assert_int_equal(
                        stk_backend_create(STK_DEV_CPU, 0, t, &bt, &err), 0);
                    graph_step_at(bt, nets[k], 3, hws[k], n, N, most, l[1],
                                  g[1], b[1]);
                    stk_backend_destroy(bt);
                    assert_memory_equal(l[0], l[1], (size_t)n * 5 * 4);
                    assert_memory_equal(g[0], g[1], np * sizeof(float));
                    assert_memory_equal(b[0], b[1], sizeof b[0]);
                }
        }
}

/* The ranges' claims on a convolution's pieces, in every order of turns
 * (a bit per turn: range 0 or another range), range 0 with and without a
 * limit of one piece: each piece once, range 0's pieces a prefix taken in
 * order (piece 0 always its own, even when the other ranges come first),
 * the others' from the back down to it. */
static void conv_claims_split_the_pieces(void **state)
{
    (void)state;
    for (int pieces = 1; pieces <= 9; pieces++)
        for (unsigned turns = 0; turns < 1u << 13; turns++) {
            /* the 13th bit: range 0 limited to one piece */
            int most = turns >> 12 ? 1 : pieces;
            _Atomic uint64_t claims;
            atomic_init(&claims, 0);
            int seen[9] = {0}, front = 0, back = pieces, got = 0;
            for (int t = 0; t < 36; t++) { /* 12 set turns, 24 alternate */
                int r = t < 12 ? (int)(turns >> t & 1) * (1 + t % 3) : t % 2;
                int k = model_conv_claim(&claims, pieces, most, r);
                if (k < 0)
                    continue;
                assert_true(k < pieces && !seen[k]++);
                got++;
                if (r == 0)
                    assert_int_equal(k, front++);
                else
                    assert_int_equal(k, --back);
            }
            assert_int_equal(got, pieces); /* both sides ran out */
            assert_true(seen[0] && front >= 1 && front == back);
            assert_true(front <= most);
            for (int r = 0; r < 3; r++)
                assert_int_equal(model_conv_claim(&claims, pieces, most, r),
                                 -1);
        }
}

/* A batchnorm fused with its ReLU computes what the two layers compute
 * apart (a dropout of p 0 between them, the identity, keeps them apart):
 * the same logits, gradients and running statistics, to the bit. */
static void bn_relu_fusion_matches_unfused(void **state)
{
    (void)state;
    enum { N = 12, C = 3, HW = 20, MAXP = 40000 };
    static float l[2][N * 5], g[2][MAXP], b[2][512];
    char *apart = malloc(2 * sizeof graph_net);
    /* every "batchnorm\nrelu" of graph_net gets a dropout between */
    const char *from = graph_net;
    char *to = apart;
    for (const char *at; (at = strstr(from, "batchnorm\n"));) {
        size_t len = (size_t)(at - from) + strlen("batchnorm\n");
        memcpy(to, from, len);
        to += len;
        from += len;
        if (!strncmp(from, "relu", 4) || !strncmp(from, "stem: relu", 10) ||
            !strncmp(from, "b: relu", 7))
            to += sprintf(to, "dropout 0\n");
    }
    strcpy(to, from);
    size_t n1 = graph_step(be, graph_net, C, HW, N, l[0], g[0], b[0]);
    size_t n2 = graph_step(be, apart, C, HW, N, l[1], g[1], b[1]);
    free(apart);
    assert_int_equal(n1, n2);
    assert_memory_equal(l[0], l[1], sizeof l[0]);
    assert_memory_equal(g[0], g[1], n1 * sizeof(float));
    assert_memory_equal(b[0], b[1], sizeof b[0]);
}

/* A residual block's tail, a batchnorm, the add that reads it and the
 * ReLU after that, run forward in one pass, computes what the three
 * compute apart (a dropout of p 0 between the add and the ReLU keeps them
 * apart): the same logits, gradients and running statistics, to the bit;
 * also where the add names the batchnorm second ("add c.bn2 c.dbn"). */
static void bn_add_relu_fusion_matches_unfused(void **state)
{
    (void)state;
    enum { N = 12, C = 3, HW = 20, MAXP = 40000 };
    static float l[2][N * 5], g[2][MAXP], b[2][512];
    char *net = malloc(2 * sizeof graph_net), *apart = malloc(2 * sizeof graph_net);
    assert_non_null(net);
    assert_non_null(apart);
    for (int second = 0; second < 2; second++) {
        strcpy(net, graph_net);
        if (second) { /* the same graph, the add's inputs named the other way */
            char *at = strstr(net, "add c.bn2\n");
            assert_non_null(at);
            memmove(at + strlen("add c.bn2 c.dbn\n"), at + strlen("add c.bn2\n"),
                    strlen(at + strlen("add c.bn2\n")) + 1);
            memcpy(at, "add c.bn2 c.dbn\n", strlen("add c.bn2 c.dbn\n"));
        }
        /* every "add ...\n" before a ReLU gets a dropout after it */
        const char *from = net;
        char *to = apart;
        for (const char *at; (at = strstr(from, "add "));) {
            size_t len = (size_t)(strchr(at, '\n') + 1 - from);
            memcpy(to, from, len);
            to += len;
            from += len;
            if (!strncmp(from, "relu", 4) || !strncmp(from, "b: relu", 7))
                to += sprintf(to, "dropout 0\n");
        }
        strcpy(to, from);
        assert_true(strcmp(net, apart) != 0);
        size_t n1 = graph_step(be, net, C, HW, N, l[0], g[0], b[0]);
        size_t n2 = graph_step(be, apart, C, HW, N, l[1], g[1], b[1]);
        assert_int_equal(n1, n2);
        assert_memory_equal(l[0], l[1], sizeof l[0]);
        assert_memory_equal(g[0], g[1], n1 * sizeof(float));
        assert_memory_equal(b[0], b[1], sizeof b[0]);
    }
    free(net), free(apart);
}

/* Backward reports every parameter once, layer by layer from the last
 * (DDP reduces the buckets at the end of the buffer while backward runs
 * on). */
typedef struct ready_log {
    int order[2 * STK_MAX_LAYERS], n;
} ready_log;

static void log_ready(int param, void *arg)
{
    ready_log *r = arg;
    r->order[r->n++] = param;
}

static void backward_reports_last_layers_first(void **state)
{
    (void)state;
    stk_model_spec spec;
    stk_err err;
    stk_model *m;
    assert_int_equal(stk_model_builtin("resnet20", &spec, &err), 0);
    assert_int_equal(stk_model_create(be, &spec, 1, 8, 8, 10, 2, 1, &m, &err),
                     0);
    float x[2 * 64];
    for (int i = 0; i < 2 * 64; i++)
        x[i] = sinf((float)i);
    const float *logits;
    int32_t y[2] = {3, 8};
    float dl[2 * 10];
    assert_int_equal(stk_model_forward(m, x, 2, true, (stk_philox_key){0, 0},
                                       0, &logits, &err),
                     0);
    xent_double(logits, y, 2, 10, dl);
    ready_log r = {.n = 0};
    assert_int_equal(stk_model_backward(m, dl, 2, (stk_philox_key){0, 0}, 0,
                                        false, log_ready, &r, &err),
                     0);
    int np = stk_model_nparams(m);
    assert_int_equal(r.n, np);
    bool seen[2 * STK_MAX_LAYERS] = {false};
    for (int i = 0; i < np; i++) {
        assert_false(seen[r.order[i]]);
        seen[r.order[i]] = true;
        /* a later-reported parameter lies lower in the buffer, unless it
         * is the bias of the same layer as the weight before it */
        if (i) {
            const stk_param *a = stk_model_param(m, r.order[i - 1]),
                            *b = stk_model_param(m, r.order[i]);
            size_t prefix = strlen(a->name) - strlen("weight");
            bool same_layer = !strncmp(a->name, b->name, prefix) &&
                              strlen(b->name) == prefix + strlen("bias");
            assert_true(b->offset < a->offset || same_layer);
        }
    }
    stk_model_destroy(m);
}

/* ---- the learning rate, step by step ----------------------------------- */

/* stk_train_lr against values worked out by hand: warm-up ramps
 * lr * (step + 1) / warmup over the first `warmup` steps of every schedule;
 * step multiplies by gamma every step_size epochs; cosine goes from lr at
 * the end of warm-up to 0 at `total` steps (and stays there). */
static void lr_schedules_step_by_step(void **state)
{
    (void)state;
    stk_train_opts o;
    stk_train_defaults(&o);
    struct { stk_sched sched; int warmup, step_size; float gamma;
             uint64_t step, total; int epoch; double want; } cases[] = {
        /* constant with 4 warm-up steps: 1/4, 2/4, 3/4, then lr */
        {STK_SCHED_CONSTANT, 4, 3, 0.1f, 0, 100, 0, 0.025},
        {STK_SCHED_CONSTANT, 4, 3, 0.1f, 1, 100, 0, 0.05},
        {STK_SCHED_CONSTANT, 4, 3, 0.1f, 2, 100, 0, 0.075},
        {STK_SCHED_CONSTANT, 4, 3, 0.1f, 3, 100, 0, 0.1},
        {STK_SCHED_CONSTANT, 4, 3, 0.1f, 4, 100, 0, 0.1},
        {STK_SCHED_CONSTANT, 0, 3, 0.1f, 0, 100, 0, 0.1},
        /* step: x0.1 every 3 epochs */
        {STK_SCHED_STEP, 0, 3, 0.1f, 0, 100, 0, 0.1},
        {STK_SCHED_STEP, 0, 3, 0.1f, 40, 100, 2, 0.1},
        {STK_SCHED_STEP, 0, 3, 0.1f, 41, 100, 3, 0.01},
        {STK_SCHED_STEP, 0, 3, 0.1f, 50, 100, 5, 0.01},
        {STK_SCHED_STEP, 0, 3, 0.1f, 60, 100, 6, 0.001},
        {STK_SCHED_STEP, 0, 1, 0.5f, 60, 100, 3, 0.0125},
        /* warm-up comes first, whatever the epoch */
        {STK_SCHED_STEP, 2, 1, 0.5f, 0, 100, 3, 0.05},
        {STK_SCHED_STEP, 2, 1, 0.5f, 2, 100, 3, 0.0125},
        /* cosine over 10 steps, 2 of warm-up: the cosine spans 8 */
        {STK_SCHED_COSINE, 2, 3, 0.1f, 0, 10, 0, 0.05},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 1, 10, 0, 0.1},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 2, 10, 0, 0.1},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 4, 10, 0, 0.1 * 0.5 * (1 + 0.70710678118654752)},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 6, 10, 0, 0.05},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 9, 10, 0, 0.1 * 0.5 * (1 - 0.92387953251128674)},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 10, 10, 0, 0.0},
        {STK_SCHED_COSINE, 2, 3, 0.1f, 12, 10, 0, 0.0},
        {STK_SCHED_COSINE, 0, 3, 0.1f, 5, 10, 0, 0.05},
        /* onecycle on runs of 1 to 4 steps: PyTorch 1.13's OneCycleLR
         * (max_lr 1.0, printed to 6 digits, times 0.1) */
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 0, 1, 0, 4e-07},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 0, 2, 0, 0.0811746},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 0, 3, 0, 0.0994415},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 1, 3, 0, 0.0462637},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 2, 3, 0, 4e-07},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 0, 4, 0, 0.004},
        {STK_SCHED_ONECYCLE, 0, 3, 0.1f, 2, 4, 0, 0.0283061},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        o.lr = 0.1f;
        o.sched = cases[i].sched;
        o.warmup = cases[i].warmup;
        o.step_size = cases[i].step_size;
        o.gamma = cases[i].gamma;
        double got = stk_train_lr(&o, cases[i].step, cases[i].total, cases[i].epoch);
        if (fabs(got - cases[i].want) > 2e-6 * cases[i].want + 1e-9)
            fail_msg("case %zu (schedule %d, warm-up %d, step %llu, epoch %d): lr %.9g, "
                     "expected %.9g", i, (int)cases[i].sched, cases[i].warmup,
                     (unsigned long long)cases[i].step, cases[i].epoch, got,
                     cases[i].want);
    }
}

/* ---- training options through stk_train_run, against a reference --------
 *
 * A database of 24 training and 6 test samples of 1x4x4 pixels in 3
 * classes, a linear model (16 -> 3) and batches of 8: 3 steps an epoch. The
 * reference below recomputes each step in double from the documented rules
 * (PyTorch's SGD and AdamW, the schedules, clipping by the global L2 norm)
 * starting from the model's initial weights; the trainer must end within
 * float rounding of it. */

enum { TR_N = 24, TE_N = 6, T_PX = 16, T_CLS = 3, T_BATCH = 8,
       T_STEPS = TR_N / T_BATCH, T_W = T_CLS * T_PX, T_P = T_W + T_CLS };
#define T_MEAN 0.5
#define T_STD 0.25

static uint8_t t_pixel(uint64_t i, int j)
{
    return (uint8_t)((i * 37 + (uint64_t)j * 11 + (i * (uint64_t)j) % 7) * 13 % 256);
}

static int32_t t_label(uint64_t i) { return (int32_t)((i * 5 + 1) % T_CLS); }

/* A test's scratch directory: the database, the model file and the run. */
typedef struct tiny {
    char dir[1024], db[1100], model[1100], out[1100];
} tiny;

/* Writes the database (train: samples 0..23, test: 24..29) and the model
 * file into t's paths. */
static void tiny_write(const tiny *t)
{
    FILE *f = fopen(t->model, "w");
    assert_non_null(f);
    fputs("flatten\nhead: linear classes\n", f);
    fclose(f);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(t->db, NULL, &s, &err), 0);
    static uint64_t counts[2][T_CLS];
    memset(counts, 0, sizeof counts);
    uint8_t rec[STK_RECORD_HEADER + T_PX], px[T_PX];
    for (uint64_t i = 0; i < TR_N + TE_N; i++) {
        for (int j = 0; j < T_PX; j++)
            px[j] = t_pixel(i, j);
        stk_record_encode(rec, t_label(i), px, T_PX);
        assert_int_equal(stk_store_append(s, i < TR_N ? "train" : "test", rec,
                                          sizeof rec, &err), 0);
        counts[i >= TR_N][t_label(i)]++;
    }
    char *classes[T_CLS] = {"a", "b", "c"};
    stk_meta m = {.channels = 1, .height = 4, .width = 4, .nclasses = T_CLS,
                  .classes = classes, .nsplits = 2, .source_path = "x",
                  .source_format = "test", .tool = "t", .created = ""};
    for (int k = 0; k < 2; k++) {
        snprintf(m.splits[k].name, 32, "%s", k ? "test" : "train");
        m.splits[k].count = k ? TE_N : TR_N;
        m.splits[k].label_counts = counts[k];
        m.splits[k].mean[0] = T_MEAN;
        m.splits[k].std[0] = T_STD;
    }
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);
}

/* Fills t for the test `name`, writes its data, and returns the options
 * of a run into t->out: SGD without momentum at a constant 0.1, no
 * warm-up; tests set what they check. */
static stk_train_opts tiny_open(const char *name, tiny *t)
{
    snprintf(t->dir, sizeof t->dir, "%s", scratch(name));
    snprintf(t->db, sizeof t->db, "%s/db", t->dir);
    snprintf(t->model, sizeof t->model, "%s/linear.txt", t->dir);
    snprintf(t->out, sizeof t->out, "%s/run", t->dir);
    tiny_write(t);
    stk_train_opts o;
    stk_train_defaults(&o);
    o.db = t->db;
    o.model = t->model;
    o.out = t->out;
    o.threads = 1;
    o.workers = 1;
    o.batch = T_BATCH;
    o.epochs = 4;
    o.optim = STK_OPT_SGD;
    o.lr = 0.1f;
    o.momentum = 0;
    o.weight_decay = 0;
    o.sched = STK_SCHED_CONSTANT;
    o.warmup = 0;
    o.dropout = false;
    o.seed = 3;
    o.quiet = true;
    o.log_every = 1000;
    o.keep = 100;
    return o;
}

/* What the reference keeps: weights, the optimizer's state (momentum, or
 * AdamW's exp_avg and exp_avg_sq), the largest and smallest gradient norm
 * seen before clipping. */
typedef struct ref_run {
    double w[T_P], s1[T_P], s2[T_P];
    double max_norm, min_norm;
} ref_run;

/* The learning rate of step `step` (of `total`) in epoch `epoch`, from
 * docs/cli.md: warm-up ramps linearly over the first steps, then the
 * schedule. */
static double ref_lr(const stk_train_opts *o, uint64_t step, uint64_t total, int epoch)
{
    if (step < (uint64_t)o->warmup)
        return o->lr * (double)(step + 1) / o->warmup;
    if (o->sched == STK_SCHED_STEP)
        return o->lr * pow(o->gamma, epoch / o->step_size);
    if (o->sched == STK_SCHED_COSINE) {
        double span = (double)(total - (uint64_t)o->warmup);
        double t = fmin((double)(step - (uint64_t)o->warmup), span);
        return o->lr * 0.5 * (1 + cos(M_PI * t / span));
    }
    return o->lr;
}

/* The mean cross-entropy gradient of the linear model over batch idx. */
static void ref_grad(const double *w, const uint64_t *idx, int n, double *g)
{
    memset(g, 0, T_P * sizeof *g);
    for (int s = 0; s < n; s++) {
        double x[T_PX], z[T_CLS], zmax = -1e300, sum = 0;
        for (int j = 0; j < T_PX; j++)
            x[j] = (t_pixel(idx[s], j) / 255.0 - T_MEAN) / T_STD;
        for (int c = 0; c < T_CLS; c++) {
            z[c] = w[T_W + c];
            for (int j = 0; j < T_PX; j++)
                z[c] += w[c * T_PX + j] * x[j];
            zmax = fmax(zmax, z[c]);
        }
        for (int c = 0; c < T_CLS; c++)
            sum += exp(z[c] - zmax);
        for (int c = 0; c < T_CLS; c++) {
            double d = (exp(z[c] - zmax) / sum - (c == t_label(idx[s]))) / n;
            for (int j = 0; j < T_PX; j++)
                g[c * T_PX + j] += d * x[j];
            g[T_W + c] += d;
        }
    }
}

/* torch.nn.utils.clip_grad_norm_: scale by max / (norm + 1e-6) when the
 * global norm exceeds max. */
static void ref_clip(const stk_train_opts *o, double *g, ref_run *r)
{
    double ss = 0;
    for (int i = 0; i < T_P; i++)
        ss += g[i] * g[i];
    double norm = sqrt(ss);
    r->max_norm = fmax(r->max_norm, norm);
    r->min_norm = fmin(r->min_norm, norm);
    if (o->clip > 0 && norm > o->clip)
        for (int i = 0; i < T_P; i++)
            g[i] *= o->clip / (norm + 1e-6);
}

/* torch.optim.SGD (momentum, dampening 0, Nesterov, weight decay) and
 * torch.optim.AdamW (betas 0.9, 0.999, eps 1e-8), step t = step + 1. */
static void ref_update(const stk_train_opts *o, double lr, uint64_t step,
                       const double *g, ref_run *r)
{
    for (int i = 0; i < T_P; i++) {
        if (o->optim == STK_OPT_SGD) {
            double d = g[i] + o->weight_decay * r->w[i];
            if (o->momentum != 0) {
                r->s1[i] = step == 0 ? d : o->momentum * r->s1[i] + d;
                d = o->nesterov ? d + o->momentum * r->s1[i] : r->s1[i];
            }
            r->w[i] -= lr * d;
        } else {
            double t = (double)step + 1;
            r->w[i] *= 1 - lr * o->weight_decay;
            r->s1[i] = 0.9 * r->s1[i] + 0.1 * g[i];
            r->s2[i] = 0.999 * r->s2[i] + 0.001 * g[i] * g[i];
            double mhat = r->s1[i] / (1 - pow(0.9, t));
            double vhat = r->s2[i] / (1 - pow(0.999, t));
            r->w[i] -= lr * mhat / (sqrt(vhat) + 1e-8);
        }
    }
}

/* The whole run of o: the model's initial weights from its seed, then
 * every step of every epoch in the sampler's order. */
static void ref_train(const stk_train_opts *o, ref_run *r)
{
    memset(r, 0, sizeof *r);
    r->min_norm = INFINITY;
    stk_model_spec spec;
    stk_err err;
    assert_int_equal(stk_model_parse("flatten\nhead: linear classes\n", "t", &spec, &err), 0);
    stk_model *m;
    assert_int_equal(stk_model_create(be, &spec, 1, 4, 4, T_CLS, T_BATCH, o->seed, &m,
                                      &err), 0);
    assert_int_equal(stk_model_param_count(m), T_P);
    for (int i = 0; i < T_P; i++)
        r->w[i] = stk_model_weights(m)[i];
    stk_model_destroy(m);
    uint64_t total = (uint64_t)T_STEPS * o->epochs, step = 0;
    for (int e = 0; e < o->epochs; e++) {
        uint64_t order[TR_N];
        stk_sampler smp = {.n = TR_N, .seed = o->seed, .rank = 0, .world = 1,
                           .shuffle = true};
        assert_int_equal(stk_sampler_shard(&smp, (uint64_t)e, order), 0);
        for (int b = 0; b < T_STEPS; b++, step++) {
            double g[T_P];
            ref_grad(r->w, order + b * T_BATCH, T_BATCH, g);
            ref_clip(o, g, r);
            ref_update(o, ref_lr(o, step, total, e), step, g, r);
        }
    }
}

/* Reads RUN/checkpoints/step-N's weights and optimizer state. */
static void read_checkpoint(const stk_train_opts *o, uint64_t step, float *w,
                            float *s1, float *s2)
{
    char dir[1200], path[1300];
    snprintf(dir, sizeof dir, "%s/checkpoints/step-%08llu", o->out,
             (unsigned long long)step);
    bool sgd = o->optim == STK_OPT_SGD;
    const char *suffix[3] = {"", sgd ? ".momentum_buffer" : ".exp_avg", ".exp_avg_sq"};
    float *dst[3] = {w, s1, s2};
    for (int k = 0; k < (sgd ? 2 : 3); k++) {
        stk_tensor t[2] = {{.ndim = 2, .shape = {T_CLS, T_PX}, .count = T_W, .data = dst[k]},
                           {.ndim = 1, .shape = {T_CLS}, .count = T_CLS,
                            .data = dst[k] + T_W}};
        snprintf(t[0].name, sizeof t[0].name, "head.weight%s", suffix[k]);
        snprintf(t[1].name, sizeof t[1].name, "head.bias%s", suffix[k]);
        snprintf(path, sizeof path, "%s/%s.safetensors", dir, k ? "optim" : "model");
        stk_err err = {0};
        if (stk_safetensors_read(path, t, 2, NULL, &err))
            fail_msg("%s", err.msg);
    }
}

/* One state vector against the reference: within float rounding (a few
 * 1e-6 of the element, or of the vector's largest element near zero). */
static void expect_close(const char *what, const float *got, const double *want)
{
    double scale = 0;
    for (int i = 0; i < T_P; i++)
        scale = fmax(scale, fabs(want[i]));
    for (int i = 0; i < T_P; i++)
        if (fabs(got[i] - want[i]) > 3e-5 * fabs(want[i]) + 3e-6 * scale)
            fail_msg("%s[%d] is %.9g, the reference %.9g", what, i, got[i], want[i]);
}

/* Trains o with stk_train_run and checks the last checkpoint's weights
 * and optimizer state against the reference; returns the reference. */
static ref_run train_and_compare(const stk_train_opts *o)
{
    stk_train_result res;
    stk_err err = {0};
    if (stk_train_run(o, &res, &err))
        fail_msg("train: %s", err.msg);
    uint64_t steps = (uint64_t)T_STEPS * o->epochs;
    assert_int_equal(res.steps, steps);
    static float w[T_P], s1[T_P], s2[T_P];
    read_checkpoint(o, steps, w, s1, s2);
    ref_run r;
    ref_train(o, &r);
    expect_close("weight", w, r.w);
    expect_close(o->optim == STK_OPT_SGD ? "momentum" : "exp_avg", s1, r.s1);
    if (o->optim == STK_OPT_ADAMW)
        expect_close("exp_avg_sq", s2, r.s2);
    return r;
}

/* SGD with momentum, weight decay and 4 warm-up steps (constant after). */
static void sgd_momentum_decay_warmup_match_reference(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("sgd", &t);
    o.momentum = 0.9f;
    o.weight_decay = 0.05f;
    o.warmup = 4;
    train_and_compare(&o);
}

/* Nesterov momentum over 15 steps (the order of its terms matters from
 * the second step on) under the step schedule: x0.5 every 2 epochs, after
 * 2 warm-up steps. */
static void sgd_nesterov_step_schedule_match_reference(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("nesterov", &t);
    o.momentum = 0.8f;
    o.nesterov = true;
    o.epochs = 5;
    o.sched = STK_SCHED_STEP;
    o.step_size = 2;
    o.gamma = 0.5f;
    o.warmup = 2;
    o.lr = 0.2f;
    train_and_compare(&o);
}

/* AdamW with weight decay over 12 steps of cosine decay after 3 warm-up
 * steps (its moments are non-zero from the second step on). */
static void adamw_cosine_warmup_match_reference(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("adamw", &t);
    o.optim = STK_OPT_ADAMW;
    o.lr = 0.05f;
    o.weight_decay = 0.1f;
    o.sched = STK_SCHED_COSINE;
    o.warmup = 3;
    train_and_compare(&o);
}

/* --clip below every step's gradient norm scales each step down to it;
 * above every norm it changes nothing (the reference without --clip). */
static void clip_scales_to_the_norm_only_above_it(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("clip", &t);
    o.momentum = 0.9f;
    o.clip = 0.05f;
    ref_run r = train_and_compare(&o);
    if (!(r.min_norm > 2 * o.clip))
        fail_msg("the test needs every step clipped: smallest norm %g", r.min_norm);
    stk_train_opts wide = o;
    wide.clip = 1000;
    char wide_out[1100];
    snprintf(wide_out, sizeof wide_out, "%s/wide", t.dir);
    wide.out = wide_out;
    ref_run rw = train_and_compare(&wide);
    if (!(rw.max_norm < wide.clip))
        fail_msg("the test needs no step clipped: largest norm %g", rw.max_norm);
    stk_train_opts none = wide;
    none.clip = 0;
    ref_run rn;
    ref_train(&none, &rn);
    assert_memory_equal(rn.w, rw.w, sizeof rn.w);
    double moved = 0;
    for (int i = 0; i < T_P; i++)
        moved = fmax(moved, fabs(r.w[i] - rn.w[i]));
    assert_true(moved > 1e-3); /* clipping made a difference */
}

/* Runs o stopping after each of the steps in stops (a checkpoint, as
 * Ctrl-C does), resuming from it each time, to the end. */
static void train_with_stops(stk_train_opts o, const int *stops, int n)
{
    stk_train_result res;
    stk_err err = {0};
    for (int k = 0; k <= n; k++) {
        o.resume = k ? "auto" : NULL;
        o.max_steps = k < n ? stops[k] : 0;
        if (stk_train_run(&o, &res, &err))
            fail_msg("train (part %d): %s", k + 1, err.msg);
        assert_int_equal(res.steps, k < n ? (uint64_t)stops[k] : (uint64_t)T_STEPS * o.epochs);
        assert_int_equal(res.stopped, k < n);
    }
}

static void expect_same_file(const char *a, const char *b)
{
    uint8_t *x, *y;
    size_t nx, ny;
    stk_err err;
    assert_int_equal(stk_read_file(a, &x, &nx, &err), 0);
    assert_int_equal(stk_read_file(b, &y, &ny, &err), 0);
    if (nx != ny || memcmp(x, y, nx))
        fail_msg("%s and %s differ", a, b);
    free(x);
    free(y);
}

/* A run stopped mid-epoch (step 4 of 12), then at an epoch boundary (step
 * 9), resumed each time in the same process, ends with the bits of an
 * uninterrupted run: weights and optimizer state (momentum, or both AdamW
 * moments), which the reference also checks. */
static void resume_equals_uninterrupted(stk_train_opts o)
{
    char whole[1200], parts[1200], a[1300], b[1300];
    snprintf(whole, sizeof whole, "%s-whole", o.out);
    snprintf(parts, sizeof parts, "%s-parts", o.out);
    stk_train_opts w = o;
    w.out = whole;
    train_and_compare(&w);
    o.out = parts;
    train_with_stops(o, (const int[]){4, 9}, 2);
    static float wt[T_P], s1[T_P], s2[T_P];
    read_checkpoint(&o, (uint64_t)T_STEPS * o.epochs, wt, s1, s2);
    ref_run r;
    ref_train(&o, &r);
    expect_close("resumed weight", wt, r.w);
    expect_close("resumed state", s1, r.s1);
    if (o.optim == STK_OPT_ADAMW)
        expect_close("resumed exp_avg_sq", s2, r.s2);
    for (int k = 0; k < 2; k++) {
        const char *f = k ? "optim.safetensors" : "model.safetensors";
        snprintf(a, sizeof a, "%s/checkpoints/step-%08d/%s", whole, T_STEPS * o.epochs, f);
        snprintf(b, sizeof b, "%s/checkpoints/step-%08d/%s", parts, T_STEPS * o.epochs, f);
        expect_same_file(a, b);
    }
}

static void resume_sgd_equals_uninterrupted(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("resume-sgd", &t);
    o.momentum = 0.9f;
    o.nesterov = true;
    o.weight_decay = 0.01f;
    o.sched = STK_SCHED_COSINE;
    o.warmup = 2;
    resume_equals_uninterrupted(o);
}

static void resume_adamw_equals_uninterrupted(void **state)
{
    (void)state;
    tiny t;
    stk_train_opts o = tiny_open("resume-adamw", &t);
    o.optim = STK_OPT_ADAMW;
    o.lr = 0.05f;
    o.weight_decay = 0.1f;
    o.sched = STK_SCHED_STEP;
    o.step_size = 1;
    o.gamma = 0.7f;
    o.warmup = 2;
    resume_equals_uninterrupted(o);
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
    cmocka_unit_test(graph_format_and_errors),
    cmocka_unit_test(batchnorm_refuses_one_value_per_channel),
    cmocka_unit_test(model_files_are_the_builtins),
    cmocka_unit_test(resnet18_has_torchvision_names),
    cmocka_unit_test(residual_backward_matches_fd),
    cmocka_unit_test(fan_out_gradients_add_up),
    cmocka_unit_test(batchnorm_eval_uses_running_stats),
    cmocka_unit_test(graph_results_do_not_depend_on_threads),
    cmocka_unit_test(conv_ranges_match_one_thread),
    cmocka_unit_test(conv_claims_split_the_pieces),
    cmocka_unit_test(bn_relu_fusion_matches_unfused),
    cmocka_unit_test(bn_add_relu_fusion_matches_unfused),
    cmocka_unit_test(backward_reports_last_layers_first),
    cmocka_unit_test(lr_schedules_step_by_step),
    cmocka_unit_test(sgd_momentum_decay_warmup_match_reference),
    cmocka_unit_test(sgd_nesterov_step_schedule_match_reference),
    cmocka_unit_test(adamw_cosine_warmup_match_reference),
    cmocka_unit_test(clip_scales_to_the_norm_only_above_it),
    cmocka_unit_test(resume_sgd_equals_uninterrupted),
    cmocka_unit_test(resume_adamw_equals_uninterrupted),
};

UNIT_MAIN_WITH(tests, setup, teardown)
