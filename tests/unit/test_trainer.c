/* test_trainer - model specs (built-ins and the text format), shapes and
 * PyTorch parameter names, clear errors for models that do not fit, the
 * whole model's backward against finite differences, and every training
 * option (schedules, warm-up, clipping, SGD with momentum, Nesterov and
 * weight decay, AdamW, resume) through stk_train_run against a reference
 * written here. */
#include "unit.h"

#include "store/store.h"
#include "trainer/checkpoint.h"
#include "trainer/train_impl.h"
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
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        o.lr = 0.1f;
        o.sched = cases[i].sched;
        o.warmup = cases[i].warmup;
        o.step_size = cases[i].step_size;
        o.gamma = cases[i].gamma;
        double got = stk_train_lr(&o, cases[i].step, cases[i].total, cases[i].epoch);
        if (fabs(got - cases[i].want) > 1e-6 * cases[i].want + 1e-9)
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
    cmocka_unit_test(lr_schedules_step_by_step),
    cmocka_unit_test(sgd_momentum_decay_warmup_match_reference),
    cmocka_unit_test(sgd_nesterov_step_schedule_match_reference),
    cmocka_unit_test(adamw_cosine_warmup_match_reference),
    cmocka_unit_test(clip_scales_to_the_norm_only_above_it),
    cmocka_unit_test(resume_sgd_equals_uninterrupted),
    cmocka_unit_test(resume_adamw_equals_uninterrupted),
};

UNIT_MAIN_WITH(tests, setup, teardown)
