/* model.c - sequential models over the kernels API: shapes, parameters in
 * one flat buffer, PyTorch's initialisation, forward and backward. */
#include "trainer.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct layer {
    stk_layer_spec s;
    int c, h, w;        /* input shape */
    int oc, oh, ow;     /* output shape */
    int pw, pb;         /* indices of weight and bias params, -1 if none */
    float *y;           /* output, max_batch * oc*oh*ow (aliases x for
                           flatten and dropout, which work in place) */
    int32_t *arg;       /* max-pool winners */
    float *col;         /* conv: the columns (Winograd: V) of one piece */
    int piece;          /* conv: samples per piece (stk_conv_chunk) */
    stk_conv_shape cs;
    bool wino;          /* conv: Winograd F(2x2, 3x3) */
    bool col_kept;      /* conv: col holds the whole batch's, from forward */
    float *u, *du;      /* Winograd: transformed filters and their gradient */
    int pool_at, drop_at; /* conv: the max-pool after it (and a dropout
                           layer between them), run piece by piece with
                           it, so that its output stays in cache; 0: none */
    bool fused;         /* pool, dropout: run by the conv before them */
} layer;

struct stk_model {
    stk_backend *be;
    int nl, np, classes, max_batch;
    stk_conv_algo conv;
    layer l[STK_MAX_LAYERS];
    stk_param p[2 * STK_MAX_LAYERS];
    size_t total;
    float *w, *g;
    bool own_g;             /* g is ours to free (not stk_model_use_grads') */
    float *tmp;             /* conv outputs/gradients in [C, N, HW] order */
    float *dcol;            /* conv column gradients (Winograd: M and dM) */
    float *grad[3];         /* backward ping-pong, max activation size, and
                               a conv's output gradient from its pool */
    float *dlogits;
    const float *x;         /* the last forward input */
    int n;                  /* and its batch size */
    bool train;             /* and whether dropout was applied */
    stk_grads_ready_fn ready; /* during backward: who hears of final grads */
    void *ready_arg;
};

static size_t out_size(const layer *l) { return (size_t)l->oc * l->oh * l->ow; }
static size_t in_size(const layer *l) { return (size_t)l->c * l->h * l->w; }

/* ---- shapes and parameters ------------------------------------------------ */

static void add_param(stk_model *m, layer *l, const char *suffix, int ndim,
                      const int *shape, int *index)
{
    stk_param *p = &m->p[m->np];
    snprintf(p->name, sizeof p->name, "%s.%s", l->s.name, suffix);
    p->ndim = ndim;
    p->count = 1;
    for (int d = 0; d < ndim; d++)
        p->count *= (size_t)(p->shape[d] = shape[d]);
    p->offset = m->total;
    m->total += p->count;
    *index = m->np++;
}

/* Sizes a model may reach: a layer's output over a batch and a parameter
 * tensor are counted in int (the GEMMs' and shapes' type), and the model's
 * parameters, each with gradient and optimizer state, in at most 8 GiB per
 * buffer. Everything is computed in 64 bits and checked against these
 * before it is stored or allocated. */
#define MODEL_MAX_VALUES ((int64_t)INT32_MAX)

/* A layer's name for messages: its parameter prefix, or its kind and place. */
static const char *layer_label(const layer *l, int index, char *buf, size_t n)
{
    static const char *const kinds[] = {
        "conv", "pool", "relu", "dropout", "dropout2d", "flatten", "linear"};
    if (*l->s.name)
        snprintf(buf, n, "%s", l->s.name);
    else
        snprintf(buf, n, "layer %d (%s)", index + 1, kinds[l->s.kind]);
    return buf;
}

/* Stores an output shape computed in 64 bits, once it is known to fit:
 * per sample and over a batch of max_batch, at most MODEL_MAX_VALUES. */
static int set_output(stk_model *m, layer *l, int index, int64_t oc,
                      int64_t oh, int64_t ow, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    /* each factor first, so that their product cannot wrap */
    bool fits = oc >= 1 && oh >= 1 && ow >= 1 && oh <= MODEL_MAX_VALUES &&
                ow <= MODEL_MAX_VALUES && oc <= MODEL_MAX_VALUES / oh / ow &&
                oc * oh * ow <= MODEL_MAX_VALUES / m->max_batch;
    if (!fits)
        return stk_fail(
            err, STK_ERANGE,
            "model: %s: its %lldx%lldx%lld output over a batch of %d is "
            "more than %lld values",
            layer_label(l, index, name, sizeof name), (long long)oc,
            (long long)oh, (long long)ow, m->max_batch,
            (long long)MODEL_MAX_VALUES);
    l->oc = (int)oc;
    l->oh = (int)oh;
    l->ow = (int)ow;
    return 0;
}

/* Adds a layer's weight (dims given in 64 bits) and bias once the weight
 * and the model's total stay within MODEL_MAX_VALUES. */
static int add_weights(stk_model *m, layer *l, int index, int ndim,
                       const int64_t *shape, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    int64_t count = 1;
    int dims[4];
    for (int d = 0; d < ndim; d++) {
        if (count > MODEL_MAX_VALUES / shape[d])
            return stk_fail(err, STK_ERANGE,
                            "model: %s: its weight has more than %lld values",
                            layer_label(l, index, name, sizeof name),
                            (long long)MODEL_MAX_VALUES);
        count *= shape[d];
        dims[d] = (int)shape[d];
    }
    if ((int64_t)m->total + count + shape[0] > MODEL_MAX_VALUES)
        return stk_fail(err, STK_ERANGE,
                        "model: %s: brings the model past %lld parameters",
                        layer_label(l, index, name, sizeof name),
                        (long long)MODEL_MAX_VALUES);
    add_param(m, l, "weight", ndim, dims, &l->pw);
    add_param(m, l, "bias", 1, dims, &l->pb);
    return 0;
}

static int shape_layer(stk_model *m, layer *l, int index, int *auto_conv,
                       int *auto_fc, stk_err *err)
{
    stk_layer_spec *s = &l->s;
    int64_t c = l->c, h = l->h, w = l->w, k = s->k, stride = s->stride,
            pad = s->pad;
    l->pw = l->pb = -1;
    switch (s->kind) {
    case STK_L_CONV: {
        ++*auto_conv; /* the n-th conv is convN unless named otherwise */
        if (!*s->name)
            snprintf(s->name, sizeof s->name, "conv%d", *auto_conv);
        if (h + 2 * pad < k || w + 2 * pad < k)
            return stk_fail(err, STK_EINVAL,
                            "model: %s: a %dx%d kernel does not fit its "
                            "%dx%dx%d input",
                            s->name, s->k, s->k, l->c, l->h, l->w);
        int rc =
            set_output(m, l, index, s->out, (h + 2 * pad - k) / stride + 1,
                       (w + 2 * pad - k) / stride + 1, err);
        if (!rc)
            rc =
                add_weights(m, l, index, 4, (int64_t[]){s->out, c, k, k}, err);
        if (rc)
            return rc;
        l->cs = (stk_conv_shape){l->c, l->h, l->w, s->k, s->k, s->stride,
                                 s->stride, s->pad, s->pad, l->oh, l->ow};
        l->wino = m->conv != STK_CONV_IM2COL && stk_wino_fits(&l->cs, l->oc);
        return 0;
    }
    case STK_L_POOL:
        if (h < k || w < k)
            return stk_fail(err, STK_EINVAL,
                            "model: a %dx%d max-pool does not fit its %dx%dx%d "
                            "input",
                            s->k, s->k, l->c, l->h, l->w);
        return set_output(m, l, index, c, (h - k) / stride + 1,
                          (w - k) / stride + 1, err);
    case STK_L_FLATTEN:
        return set_output(m, l, index, c * h * w, 1, 1, err);
    case STK_L_LINEAR: {
        ++*auto_fc;
        if (!*s->name)
            snprintf(s->name, sizeof s->name, "fc%d", *auto_fc);
        int64_t out = s->out ? s->out : m->classes;
        int rc = set_output(m, l, index, out, 1, 1, err);
        return rc ? rc
                  : add_weights(m, l, index, 2, (int64_t[]){out, c * h * w},
                                err);
    }
    default:
        return set_output(m, l, index, c, h, w, err);
    }
}

/* kaiming_uniform_(a=sqrt(5)) and PyTorch's bias rule both give
 * U(-1/sqrt(fan_in), 1/sqrt(fan_in)); drawn from Philox(seed). */
static int init_params(stk_model *m, uint64_t seed, stk_err *err)
{
    float *host = malloc(m->total * sizeof *host);
    if (!host)
        return stk_fail(err, STK_ENOMEM, "model: out of memory");
    stk_philox_key key = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int l = 0; l < m->nl; l++) {
        const layer *ly = &m->l[l];
        if (ly->pw < 0)
            continue;
        const stk_param *w = &m->p[ly->pw];
        size_t fan_in = w->count / (size_t)w->shape[0];
        float bound = 1.0f / sqrtf((float)fan_in);
        for (int k = 0; k < 2; k++) {
            const stk_param *p = &m->p[k ? ly->pb : ly->pw];
            for (size_t i = 0; i < p->count; i++)
                host[p->offset + i] =
                    (2.0f * stk_philox_uniform(key, 1000 + (uint64_t)(k ? ly->pb : ly->pw), i) - 1.0f) *
                    bound;
        }
    }
    int rc = stk_copy_to_dev(m->be, m->w, host, m->total * sizeof *host, err);
    if (!rc)
        rc = stk_sync(m->be, err);
    free(host);
    return rc;
}

/* A convolution's piece of the batch and its scratch: columns (and their
 * gradient, of the size *dcol grows to) or, for Winograd, V and M, and
 * the transformed filters. */
static int conv_buffers(stk_model *m, layer *l, size_t *dcol, stk_err *err)
{
    stk_backend *be = m->be;
    size_t per, dper; /* floats per sample: col (V), dcol (M) */
    if (l->wino) {
        int th, tw, tiles = stk_wino_tiles(&l->cs, &th, &tw);
        per = (size_t)STK_WINO_P * l->c * tiles;
        dper = (size_t)STK_WINO_P * l->oc * tiles;
    } else {
        per = dper = (size_t)l->cs.c * l->cs.kh * l->cs.kw * l->oh * l->ow;
    }
    /* a piece's hot scratch: its columns and output; Winograd's M, the
     * larger of V and M, which are not both worked on at once */
    size_t both = l->wino ? dper : per + out_size(l);
    l->piece = stk_conv_chunk(be, both * sizeof(float), m->max_batch);
    size_t c = per * (size_t)l->piece, d = dper * (size_t)l->piece, u = 0;
    if (l->wino) { /* with the points' padding (stk_wino_stride) */
        c = STK_WINO_P * stk_wino_stride(c / STK_WINO_P);
        d = STK_WINO_P * stk_wino_stride(d / STK_WINO_P);
        u = STK_WINO_P * stk_wino_stride((size_t)l->oc * l->c);
    }
    *dcol = d > *dcol ? d : *dcol;
    if (!(l->col = stk_dev_alloc(be, c * sizeof(float), err)))
        return STK_ENOMEM;
    if (l->wino && (!(l->u = stk_dev_alloc(be, u * sizeof(float), err)) ||
                    !(l->du = stk_dev_alloc(be, u * sizeof(float), err))))
        return STK_ENOMEM;
    return 0;
}

/* Device buffers: parameters, gradients, activations, scratch. */
static int alloc_buffers(stk_model *m, stk_err *err)
{
    stk_backend *be = m->be;
    size_t act = 0, col = 1, B = (size_t)m->max_batch;
    m->w = stk_dev_alloc(be, m->total * sizeof(float), err);
    m->g = m->w ? stk_dev_alloc(be, m->total * sizeof(float), err) : NULL;
    if (!m->g)
        return STK_ENOMEM;
    m->own_g = true;
    for (int i = 0; i < m->nl; i++) {
        layer *l = &m->l[i];
        act = out_size(l) > act ? out_size(l) : act;
        act = in_size(l) > act ? in_size(l) : act;
        if (l->s.kind == STK_L_FLATTEN || l->s.kind == STK_L_DROPOUT ||
            l->s.kind == STK_L_DROPOUT2D)
            continue; /* in place: y is set at forward time */
        if (!(l->y = stk_dev_alloc(be, out_size(l) * B * sizeof(float), err)))
            return STK_ENOMEM;
        if (l->s.kind == STK_L_POOL &&
            !(l->arg = stk_dev_alloc(be, out_size(l) * B * sizeof(int32_t), err)))
            return STK_ENOMEM;
        if (l->s.kind == STK_L_CONV && conv_buffers(m, l, &col, err))
            return STK_ENOMEM;
    }
    act *= B;
    m->tmp = stk_dev_alloc(be, act * sizeof(float), err);
    m->dcol = m->tmp ? stk_dev_alloc(be, col * sizeof(float), err) : NULL;
    m->grad[0] = m->dcol ? stk_dev_alloc(be, act * sizeof(float), err) : NULL;
    m->grad[1] = m->grad[0] ? stk_dev_alloc(be, act * sizeof(float), err) : NULL;
    m->grad[2] = m->grad[1] ? stk_dev_alloc(be, act * sizeof(float), err) : NULL;
    m->dlogits = m->grad[2] ? stk_dev_alloc(be, B * m->classes * sizeof(float), err)
                            : NULL;
    return m->dlogits ? 0 : STK_ENOMEM;
}

static bool is_dropout(const layer *l)
{
    return l->s.kind == STK_L_DROPOUT || l->s.kind == STK_L_DROPOUT2D;
}

/* A conv followed by a max-pool, with or without a dropout layer between
 * them, runs them piece by piece (conv_forward, conv_backward). */
static void fuse_pool(stk_model *m, int i)
{
    int j = i + 1, d = 0;
    if (m->l[i].s.kind != STK_L_CONV)
        return;
    if (j < m->nl && is_dropout(&m->l[j]))
        d = j++;
    if (j >= m->nl || m->l[j].s.kind != STK_L_POOL)
        return;
    m->l[i].pool_at = j;
    m->l[i].drop_at = d;
    m->l[j].fused = true;
    if (d)
        m->l[d].fused = true;
}

int stk_model_create(stk_backend *be, const stk_model_spec *spec, int c,
                     int h, int w, int nclasses, int max_batch, uint64_t seed,
                     stk_model **out, stk_err *err)
{
    *out = NULL;
    if (spec->n < 1 || max_batch < 1 || nclasses < 1)
        return stk_fail(err, STK_EINVAL, "model: empty model or batch");
    if (c < 1 || h < 1 || w < 1 || (int64_t)c * h > MODEL_MAX_VALUES ||
        (int64_t)c * h * w > MODEL_MAX_VALUES / max_batch)
        return stk_fail(
            err, STK_ERANGE,
            "model: a %dx%dx%d input over a batch of %d is more than "
            "%lld values",
            c, h, w, max_batch, (long long)MODEL_MAX_VALUES);
    stk_model *m = calloc(1, sizeof *m);
    if (!m)
        return stk_fail(err, STK_ENOMEM, "model: out of memory");
    m->be = be;
    m->nl = spec->n;
    m->conv = spec->conv;
    m->classes = nclasses;
    m->max_batch = max_batch;
    int rc = 0, auto_conv = 0, auto_fc = 0;
    for (int i = 0; i < m->nl && !rc; i++) {
        layer *l = &m->l[i];
        l->s = spec->layers[i];
        l->c = i ? m->l[i - 1].oc : c;
        l->h = i ? m->l[i - 1].oh : h;
        l->w = i ? m->l[i - 1].ow : w;
        rc = shape_layer(m, l, i, &auto_conv, &auto_fc, err);
    }
    for (int i = 0; i < m->nl; i++)
        fuse_pool(m, i);
    for (int i = 0; !rc && i < m->np; i++)
        for (int j = 0; j < i; j++)
            if (!strcmp(m->p[i].name, m->p[j].name)) {
                rc = stk_fail(err, STK_EINVAL,
                              "model: two layers are named \"%.*s\"; give them "
                              "different names",
                              (int)(strrchr(m->p[i].name, '.') - m->p[i].name),
                              m->p[i].name);
                break;
            }
    for (int i = 0; !rc && i < m->nl; i++) { /* im2col's GEMM sizes are int */
        const layer *l = &m->l[i];
        char name[STK_NAME_MAX + 32];
        if (l->s.kind == STK_L_CONV &&
            (int64_t)l->cs.c * l->cs.kh * l->cs.kw >
                MODEL_MAX_VALUES / ((int64_t)l->oh * l->ow * max_batch))
            rc = stk_fail(
                err, STK_ERANGE,
                "model: %s: its im2col columns over a batch of %d are more "
                "than %lld values",
                layer_label(l, i, name, sizeof name), max_batch,
                (long long)MODEL_MAX_VALUES);
    }
    const layer *last = &m->l[m->nl - 1];
    if (!rc && out_size(last) != (size_t)nclasses)
        rc = stk_fail(err, STK_EINVAL,
                      "model: ends with %zu outputs (%dx%dx%d) but the data "
                      "has %d classes",
                      out_size(last), last->oc, last->oh, last->ow, nclasses);
    if (!rc && !m->total)
        rc = stk_fail(err, STK_EINVAL, "model: has no parameters");
    if (!rc)
        rc = alloc_buffers(m, err);
    if (!rc)
        rc = init_params(m, seed, err);
    if (rc) {
        stk_model_destroy(m);
        return rc;
    }
    *out = m;
    return 0;
}

void stk_model_destroy(stk_model *m)
{
    if (!m)
        return;
    for (int i = 0; i < m->nl; i++) {
        if (m->l[i].s.kind != STK_L_FLATTEN && m->l[i].s.kind != STK_L_DROPOUT &&
            m->l[i].s.kind != STK_L_DROPOUT2D)
            stk_dev_free(m->be, m->l[i].y);
        stk_dev_free(m->be, m->l[i].arg);
        stk_dev_free(m->be, m->l[i].col);
        stk_dev_free(m->be, m->l[i].u);
        stk_dev_free(m->be, m->l[i].du);
    }
    stk_dev_free(m->be, m->w);
    if (m->own_g)
        stk_dev_free(m->be, m->g);
    stk_dev_free(m->be, m->tmp);
    stk_dev_free(m->be, m->dcol);
    stk_dev_free(m->be, m->grad[0]);
    stk_dev_free(m->be, m->grad[1]);
    stk_dev_free(m->be, m->grad[2]);
    stk_dev_free(m->be, m->dlogits);
    free(m);
}

int stk_model_nparams(const stk_model *m) { return m->np; }
const stk_param *stk_model_param(const stk_model *m, int i) { return &m->p[i]; }
size_t stk_model_param_count(const stk_model *m) { return m->total; }
float *stk_model_weights(stk_model *m) { return m->w; }
float *stk_model_grads(stk_model *m) { return m->g; }

int stk_model_use_grads(stk_model *m, float *g, stk_err *err)
{
    int rc = stk_memzero(m->be, g, m->total * sizeof(float), err);
    if (rc)
        return rc;
    if (m->own_g)
        stk_dev_free(m->be, m->g);
    m->g = g;
    m->own_g = false;
    return 0;
}
float *stk_model_dlogits(stk_model *m) { return m->dlogits; }

void stk_model_describe(const stk_model *m, char *buf, size_t n)
{
    static const char *const kinds[] = {"conv", "pool", "relu", "dropout",
                                        "dropout2d", "flatten", "linear"};
    size_t used = (size_t)snprintf(buf, n, "%dx%dx%d", m->l[0].c, m->l[0].h,
                                   m->l[0].w);
    for (int i = 0; i < m->nl && used < n; i++) {
        const layer *l = &m->l[i];
        used += (size_t)snprintf(buf + used, n - used, " -> %s%s%s %dx%dx%d",
                                 kinds[l->s.kind], *l->s.name ? ":" : "",
                                 l->s.name, l->oc, l->oh, l->ow);
    }
    if (used < n)
        snprintf(buf + used, n - used, " (%zu parameters)", m->total);
}

/* ---- forward ------------------------------------------------------------------ */

static uint64_t layer_stream(uint64_t stream, int layer)
{
    return stream * STK_MAX_LAYERS + (uint64_t)layer;
}

/* Winograd, one piece: V from the input, M_p = U_p V_p (U transformed
 * before the first piece), outputs with the bias from M. */
static int wino_forward_piece(stk_model *m, layer *l, const float *x, int s0,
                              int cn, stk_err *err)
{
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), c = l->c, oc = l->oc;
    int rc = stk_wino_input(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, false, oc, nt, c, 1.0f, l->u, c,
                              stk_wino_stride((size_t)oc * c), l->col, nt,
                              stk_wino_stride((size_t)c * nt), 0.0f, m->dcol,
                              nt, stk_wino_stride((size_t)oc * nt), STK_WINO_P,
                              err);
    return rc ? rc
              : stk_wino_output(m->be, m->dcol, m->w + m->p[l->pb].offset,
                                &l->cs, oc, cn, l->y + s0 * out_size(l), err);
}

/* im2col, one piece: columns [K, n*HW]; W [cout, K] times each sample's
 * [K, HW] block is that sample's [cout, HW] output, in place in NCHW (no
 * swap), plus the bias while the piece is in cache (a pass over the whole
 * output afterwards would read it back from memory). */
static int im2col_forward_piece(stk_model *m, layer *l, const float *x, int s0,
                                int cn, stk_err *err)
{
    int K = l->cs.c * l->cs.kh * l->cs.kw, hw = l->oh * l->ow;
    float *y = l->y + s0 * out_size(l);
    int rc = stk_im2col(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, false, l->oc, hw, K, 1.0f,
                              m->w + m->p[l->pw].offset, K, 0, l->col,
                              cn * hw, (size_t)hw, 0.0f, y, hw,
                              out_size(l), cn, err);
    return rc ? rc
              : stk_bias_add(m->be, y, m->w + m->p[l->pb].offset, cn, l->oc,
                             hw, err);
}

/* A max-pool on samples [s0, s0 + cn) of its input. */
static int pool_forward_piece(stk_model *m, layer *p, const float *x, int s0,
                              int cn, stk_err *err)
{
    size_t in = in_size(p) * s0, out = out_size(p) * s0;
    return stk_maxpool_fwd(m->be, x + in, cn * p->c, p->h, p->w, p->s.k,
                           p->s.stride, p->y + out, p->arg + out, err);
}

/* Dropout layer d on samples [s0, s0 + cn) of its tensor x (in place;
 * the same call is its backward pass). */
static int dropout_piece(stk_model *m, int d, float *x, int s0, int cn,
                         stk_philox_key key, uint64_t stream, stk_err *err)
{
    const layer *l = &m->l[d];
    size_t per = out_size(l);
    size_t group = l->s.kind == STK_L_DROPOUT2D ? (size_t)l->h * l->w : 1;
    return stk_dropout(m->be, x + per * s0, per * cn, per * s0, group, l->s.p,
                       key, layer_stream(stream, d), err);
}

/* Piece by piece (all of the batch at once on CUDA), with the dropout and
 * the max-pool that follow a pooled convolution on each piece as it
 * comes. */
static int conv_forward(stk_model *m, int i, const float *x, int n, bool train,
                        stk_philox_key key, uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i], *pool = l->pool_at ? &m->l[l->pool_at] : NULL;
    int rc = l->wino ? stk_wino_filter(m->be, m->w + m->p[l->pw].offset, l->oc,
                                       l->c, l->u, err)
                     : 0;
    for (int s0 = 0; s0 < n && !rc; s0 += l->piece) {
        int cn = n - s0 < l->piece ? n - s0 : l->piece;
        rc = l->wino ? wino_forward_piece(m, l, x, s0, cn, err)
                     : im2col_forward_piece(m, l, x, s0, cn, err);
        if (!rc && l->drop_at && train)
            rc = dropout_piece(m, l->drop_at, l->y, s0, cn, key, stream, err);
        if (!rc && pool)
            rc = pool_forward_piece(m, pool, l->y, s0, cn, err);
    }
    l->col_kept = l->piece >= n;
    return rc;
}

static int layer_forward(stk_model *m, int i, const float *x, int n,
                         bool train, stk_philox_key key, uint64_t stream,
                         stk_err *err)
{
    layer *l = &m->l[i];
    size_t total = out_size(l) * (size_t)n;
    switch (l->s.kind) {
    case STK_L_CONV:
        return conv_forward(m, i, x, n, train, key, stream, err);
    case STK_L_POOL: /* fused: the conv before it ran it, piece by piece */
        return l->fused ? 0 : pool_forward_piece(m, l, x, 0, n, err);
    case STK_L_RELU:
        return stk_relu_fwd(m->be, x, l->y, total, err);
    case STK_L_FLATTEN:
        l->y = (float *)x;
        return 0;
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
        l->y = (float *)x; /* in place (see docs/architecture.md) */
        return train && !l->fused
                   ? dropout_piece(m, i, l->y, 0, n, key, stream, err)
                   : 0;
    case STK_L_LINEAR: {
        int in = (int)in_size(l);
        int rc = stk_gemm(m->be, false, true, n, l->oc, in, 1.0f, x, in,
                          m->w + m->p[l->pw].offset, in, 0.0f, l->y, l->oc,
                          err);
        return rc ? rc : stk_bias_add(m->be, l->y, m->w + m->p[l->pb].offset,
                                      n, l->oc, 1, err);
    }
    case STK_L_BATCHNORM:
    case STK_L_ADD:
    case STK_L_AVGPOOL:
    case STK_L_GLOBALPOOL: /* not implemented yet (issue 14, in progress) */
        return stk_fail(err, STK_EINVAL, "model: layer kind not implemented yet");
    }
    return STK_EINVAL;
}

int stk_model_forward(stk_model *m, const float *x, int n, bool train,
                      stk_philox_key key, uint64_t stream,
                      const float **logits, stk_err *err)
{
    if (n < 1 || n > m->max_batch)
        return stk_fail(err, STK_EINVAL, "model: batch of %d, at most %d", n,
                        m->max_batch);
    m->x = x;
    m->n = n;
    m->train = train;
    const float *cur = x;
    for (int i = 0; i < m->nl; i++) {
        int rc = layer_forward(m, i, cur, n, train, key, stream, err);
        if (rc)
            return rc;
        cur = m->l[i].y;
    }
    *logits = cur;
    return 0;
}

/* ---- backward -------------------------------------------------------------- */

/* The layer's gradients are final: tells the backward's listener. */
static void report(stk_model *m, const layer *l)
{
    if (m->ready && l->pw >= 0) {
        m->ready(l->pw, m->ready_arg);
        m->ready(l->pb, m->ready_arg);
    }
}

/* Winograd, one piece: dM from dy; dU_p (+)= dM_p V_p^T (V rebuilt unless
 * forward left the whole batch's); dV_p = U_p^T dM_p into V's place, then
 * back to pixels; db += the piece's sums. */
static int wino_backward_piece(stk_model *m, layer *l, const float *x,
                               const float *dy, float *dx, int s0, int cn,
                               stk_err *err)
{
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), c = l->c, oc = l->oc;
    size_t su = stk_wino_stride((size_t)oc * c), sv = stk_wino_stride((size_t)c * nt);
    size_t sm = stk_wino_stride((size_t)oc * nt);
    int rc = stk_wino_output_grad(m->be, dy + s0 * out_size(l), &l->cs, oc, cn,
                                  m->dcol, err);
    if (!rc && !l->col_kept)
        rc = stk_wino_input(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, true, oc, c, nt, 1.0f, m->dcol, nt,
                              sm, l->col, nt, sv, s0 ? 1.0f : 0.0f, l->du, c,
                              su, STK_WINO_P, err);
    if (!rc && dx) {
        l->col_kept = false; /* V's place now holds dV */
        rc = stk_gemm_batched(m->be, true, false, c, nt, oc, 1.0f, l->u, c, su,
                              m->dcol, nt, sm, 0.0f, l->col, nt, sv, STK_WINO_P,
                              err);
        if (!rc)
            rc = stk_wino_input_grad(m->be, l->col, &l->cs, cn,
                                     dx + s0 * in_size(l), err);
    }
    return rc ? rc
              : stk_bias_grad(m->be, dy + s0 * out_size(l),
                              m->g + m->p[l->pb].offset, cn, oc,
                              l->oh * l->ow, err);
}

/* dW += dy cols^T for one im2col piece, dy [n, cout, HW]. The CPU sums
 * sample by sample (each a [cout, HW] block against its [K, HW] columns);
 * CUDA, with the whole batch as one piece, swaps dy to [cout, n*HW] for
 * one GEMM instead of n small ones. */
static int im2col_weight_grad(stk_model *m, layer *l, const float *dy, int cn,
                              stk_err *err)
{
    int K = l->cs.c * l->cs.kh * l->cs.kw, hw = l->oh * l->ow, nhw = cn * hw;
    float *dw = m->g + m->p[l->pw].offset;
    if (stk_backend_kind(m->be) == STK_DEV_CPU) {
        int rc = 0;
        for (int s = 0; s < cn && !rc; s++)
            rc = stk_gemm(m->be, false, true, l->oc, K, hw, 1.0f,
                          dy + s * out_size(l), hw, l->col + (size_t)s * hw,
                          nhw, 1.0f, dw, K, err);
        return rc;
    }
    int rc = stk_swap01(m->be, dy, m->tmp, (size_t)cn, (size_t)l->oc,
                        (size_t)hw, err);
    return rc ? rc
              : stk_gemm(m->be, false, true, l->oc, K, nhw, 1.0f, m->tmp, nhw,
                         l->col, nhw, 1.0f, dw, K, err);
}

/* im2col, one piece: db += dy's sums per channel, dW += dy cols^T, and
 * each sample's dcols = W^T dy, then back to pixels. The columns are
 * rebuilt from x unless the batch was one piece, whose columns forward
 * left in place. */
static int im2col_backward_piece(stk_model *m, layer *l, const float *x,
                                 const float *dy, float *dx, int n, int s0,
                                 int cn, stk_err *err)
{
    int K = l->cs.c * l->cs.kh * l->cs.kw, hw = l->oh * l->ow;
    dy += s0 * out_size(l);
    int rc = stk_bias_grad(m->be, dy, m->g + m->p[l->pb].offset, cn, l->oc,
                           hw, err);
    if (!rc && l->piece < n)
        rc = stk_im2col(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = im2col_weight_grad(m, l, dy, cn, err);
    if (!rc && dx)
        rc = stk_gemm_batched(m->be, true, false, K, hw, l->oc, 1.0f,
                              m->w + m->p[l->pw].offset, K, 0, dy, hw,
                              out_size(l), 0.0f, m->dcol, cn * hw, (size_t)hw,
                              cn, err);
    if (!rc && dx)
        rc = stk_col2im(m->be, m->dcol, &l->cs, cn, dx + s0 * in_size(l), err);
    return rc;
}

/* Piece by piece; a pooled conv gets its pool's output gradient as dy and
 * runs the pool's backward (and its dropout's) on each piece first, into
 * grad[2]. dW is final only after the last piece (Winograd: once dU's
 * adjoint transform is added), so the layer reports its gradients after
 * its input gradient. */
static int conv_backward(stk_model *m, int i, const float *x, const float *dy,
                         float *dx, int n, stk_philox_key key,
                         uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i], *pool = l->pool_at ? &m->l[l->pool_at] : NULL;
    const float *dyc = pool ? m->grad[2] : dy; /* the conv's output gradient */
    int rc = 0;
    for (int s0 = 0; s0 < n && !rc; s0 += l->piece) {
        int cn = n - s0 < l->piece ? n - s0 : l->piece;
        if (pool) {
            size_t at = out_size(pool) * s0;
            rc = stk_maxpool_bwd(m->be, dy + at, pool->arg + at, cn * pool->c,
                                 pool->h, pool->w, pool->s.k, pool->s.stride,
                                 m->grad[2] + out_size(l) * s0, err);
        }
        if (!rc && l->drop_at && m->train)
            rc = dropout_piece(m, l->drop_at, m->grad[2], s0, cn, key, stream,
                               err);
        if (!rc)
            rc = l->wino ? wino_backward_piece(m, l, x, dyc, dx, s0, cn, err)
                         : im2col_backward_piece(m, l, x, dyc, dx, n, s0, cn,
                                                 err);
    }
    if (!rc && l->wino)
        rc = stk_wino_filter_grad(m->be, l->du, l->oc, l->c,
                                  m->g + m->p[l->pw].offset, err);
    if (!rc)
        report(m, l);
    return rc;
}

static int linear_backward(stk_model *m, layer *l, const float *x,
                           const float *dy, float *dx, int n, stk_err *err)
{
    int in = (int)in_size(l);
    int rc = stk_gemm(m->be, true, false, l->oc, in, n, 1.0f, dy, l->oc, x, in,
                      1.0f, m->g + m->p[l->pw].offset, in, err);
    if (!rc)
        rc = stk_bias_grad(m->be, dy, m->g + m->p[l->pb].offset, n, l->oc, 1,
                           err);
    if (!rc)
        report(m, l); /* before dx: the reduction overlaps it */
    if (!rc && dx)
        rc = stk_gemm(m->be, false, false, n, in, l->oc, 1.0f, dy, l->oc,
                      m->w + m->p[l->pw].offset, in, 0.0f, dx, in, err);
    return rc;
}

/* Writes dx (NULL for the first layer) from dy; may return dy itself for
 * in-place layers through *dx_out. */
static int layer_backward(stk_model *m, int i, const float *x, float *dy,
                          float *dx, float **dx_out, stk_philox_key key,
                          uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i];
    int n = m->n;
    size_t total = out_size(l) * (size_t)n;
    *dx_out = dx;
    switch (l->s.kind) {
    case STK_L_CONV:
        return conv_backward(m, i, x, dy, dx, n, key, stream, err);
    case STK_L_LINEAR:
        return linear_backward(m, l, x, dy, dx, n, err);
    case STK_L_POOL:
        if (l->fused) { /* the conv before it runs it, piece by piece */
            *dx_out = dy;
            return 0;
        }
        return dx ? stk_maxpool_bwd(m->be, dy, l->arg, n * l->c, l->h, l->w,
                                    l->s.k, l->s.stride, dx, err)
                  : 0;
    case STK_L_RELU:
        *dx_out = dy;
        return stk_relu_bwd(m->be, l->y, dy, dy, total, err);
    case STK_L_FLATTEN:
        *dx_out = dy;
        return 0;
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D: /* identity in eval; fused: the conv runs it */
        *dx_out = dy;
        return m->train && !l->fused
                   ? dropout_piece(m, i, dy, 0, n, key, stream, err)
                   : 0;
    case STK_L_BATCHNORM:
    case STK_L_ADD:
    case STK_L_AVGPOOL:
    case STK_L_GLOBALPOOL: /* not implemented yet (issue 14, in progress) */
        return stk_fail(err, STK_EINVAL, "model: layer kind not implemented yet");
    }
    return STK_EINVAL;
}

int stk_model_backward(stk_model *m, const float *dlogits, int n,
                       stk_philox_key key, uint64_t stream, bool accumulate,
                       stk_grads_ready_fn ready, void *arg, stk_err *err)
{
    if (n != m->n)
        return stk_fail(err, STK_EINVAL,
                        "model: backward of %d samples after a forward of %d",
                        n, m->n);
    int rc = accumulate ? 0 : stk_memzero(m->be, m->g, m->total * sizeof(float), err);
    if (rc)
        return rc;
    m->ready = ready;
    m->ready_arg = arg;
    /* the first gradient buffer starts as a copy of dlogits, so that
     * in-place layers never write into the caller's buffer */
    size_t nl = (size_t)n * m->classes;
    float *dy = m->grad[0];
    if (dlogits != dy) {
        if ((rc = stk_memzero(m->be, dy, nl * sizeof(float), err)) ||
            (rc = stk_axpy(m->be, nl, 1.0f, dlogits, dy, err)))
            return rc;
    }
    int first = 0; /* no input gradient is needed below the first parameters */
    while (first < m->nl - 1 && m->l[first].pw < 0)
        first++;
    for (int i = m->nl - 1; i >= first; i--) {
        const float *x = i ? m->l[i - 1].y : m->x;
        float *spare = dy == m->grad[0] ? m->grad[1] : m->grad[0];
        float *dx;
        rc = layer_backward(m, i, x, dy, i > first ? spare : NULL, &dx, key,
                            stream, err);
        if (rc)
            break;
        dy = dx;
    }
    m->ready = NULL;
    return rc;
}
