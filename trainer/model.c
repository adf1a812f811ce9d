/* model.c - models as graphs over the kernels API: shapes, parameters in
 * one flat buffer (batchnorm's running statistics in another), PyTorch's
 * initialisation, memory; the schedule is planned in model_plan.c, forward
 * (in list order) and backward (in reverse) run in model_run.c.
 *
 * A layer reads one or two earlier outputs (in[]; STK_INPUT is the model's
 * input). Create works out a schedule once: which layers run fused (a
 * conv with the max-pool after it, piece by piece; a batchnorm with its
 * ReLU in one pass), which run in place on their input's buffer, which
 * need backward at all, and which gradient buffer of a small pool holds
 * each output's gradient (assigned by liveness: from the backward of the
 * output's last reader to the backward of its producer). Gradients of an
 * output read by several layers (a residual fan-out) add up there. */
#include "model_impl.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *kind_name(stk_layer_kind k)
{
    static const char *const kinds[] = {
        "conv",   "pool",      "relu", "dropout", "dropout2d", "flatten",
        "linear", "batchnorm", "add",  "avgpool", "globalpool"};
    return kinds[k];
}

/* ---- shapes and parameters --------------------------------------------- */

static void add_param(stk_param *list, int *np, size_t *total,
                      const char *prefix, const char *suffix, int ndim,
                      const int *shape, int *index)
{
    stk_param *p = &list[*np];
    snprintf(p->name, sizeof p->name, "%s.%s", prefix, suffix);
    p->ndim = ndim;
    p->count = 1;
    for (int d = 0; d < ndim; d++)
        p->count *= (size_t)(p->shape[d] = shape[d]);
    p->offset = *total;
    *total += p->count;
    p->no_decay = false;
    *index = (*np)++;
}

/* Sizes a model may reach: a layer's output over a batch and a parameter
 * tensor are counted in int (the GEMMs' and shapes' type), and the model's
 * parameters, each with gradient and optimizer state, in at most 8 GiB per
 * buffer. Everything is computed in 64 bits and checked against these
 * before it is stored or allocated. */
#define MODEL_MAX_VALUES ((int64_t)INT32_MAX)

const char *model_label(const layer *l, int index, char *buf, size_t n)
{
    if (*l->s.name)
        snprintf(buf, n, "%s", l->s.name);
    else
        snprintf(buf, n, "layer %d (%s)", index + 1, kind_name(l->s.kind));
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
            model_label(l, index, name, sizeof name), (long long)oc,
            (long long)oh, (long long)ow, m->max_batch,
            (long long)MODEL_MAX_VALUES);
    l->oc = (int)oc;
    l->oh = (int)oh;
    l->ow = (int)ow;
    return 0;
}

/* Adds a layer's weight (dims given in 64 bits) and, unless bias=false,
 * its bias, once the weight and the model's total stay within
 * MODEL_MAX_VALUES. */
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
                            model_label(l, index, name, sizeof name),
                            (long long)MODEL_MAX_VALUES);
        count *= shape[d];
        dims[d] = (int)shape[d];
    }
    if ((int64_t)m->total + count + shape[0] > MODEL_MAX_VALUES)
        return stk_fail(err, STK_ERANGE,
                        "model: %s: brings the model past %lld parameters",
                        model_label(l, index, name, sizeof name),
                        (long long)MODEL_MAX_VALUES);
    add_param(m->p, &m->np, &m->total, l->s.name, "weight", ndim, dims,
              &l->pw);
    if (!l->s.no_bias) {
        add_param(m->p, &m->np, &m->total, l->s.name, "bias", 1, dims, &l->pb);
        m->p[l->pb].no_decay = true;
    }
    return 0;
}

/* A batchnorm over c channels: weight and bias [c] (no decay under
 * --no-decay-norm-bias), buffers running_mean and running_var [c], the
 * num_batches_tracked counter. */
static int add_batchnorm(stk_model *m, layer *l, int index, int64_t c,
                         stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    if ((int64_t)m->total + 2 * c > MODEL_MAX_VALUES)
        return stk_fail(err, STK_ERANGE,
                        "model: %s: brings the model past %lld parameters",
                        model_label(l, index, name, sizeof name),
                        (long long)MODEL_MAX_VALUES);
    int dims[1] = {(int)c}, b;
    add_param(m->p, &m->np, &m->total, l->s.name, "weight", 1, dims, &l->pw);
    add_param(m->p, &m->np, &m->total, l->s.name, "bias", 1, dims, &l->pb);
    m->p[l->pw].no_decay = m->p[l->pb].no_decay = true;
    l->bn = m->nb++;
    add_param(m->bp, &m->nbuf, &m->btotal, l->s.name, "running_mean", 1, dims,
              &b);
    add_param(m->bp, &m->nbuf, &m->btotal, l->s.name, "running_var", 1, dims,
              &b);
    snprintf(m->counter_name[l->bn], sizeof m->counter_name[l->bn],
             "%s.num_batches_tracked", l->s.name);
    return 0;
}

/* Automatic names: the n-th unnamed conv is convN, linear fcN, batchnorm
 * bnN (counting every layer of the kind, named or not). */
typedef struct auto_names {
    int conv, fc, bn;
} auto_names;

static void auto_name(layer *l, const char *prefix, int *count)
{
    ++*count;
    if (!*l->s.name)
        snprintf(l->s.name, sizeof l->s.name, "%s%d", prefix, *count);
}

static int shape_conv(stk_model *m, layer *l, int index, stk_err *err)
{
    stk_layer_spec *s = &l->s;
    int64_t h = l->h, w = l->w, k = s->k, stride = s->stride, pad = s->pad;
    if (h + 2 * pad < k || w + 2 * pad < k)
        return stk_fail(err, STK_EINVAL,
                        "model: %s: a %dx%d kernel does not fit its "
                        "%dx%dx%d input",
                        s->name, s->k, s->k, l->c, l->h, l->w);
    int rc = set_output(m, l, index, s->out, (h + 2 * pad - k) / stride + 1,
                        (w + 2 * pad - k) / stride + 1, err);
    if (!rc)
        rc = add_weights(m, l, index, 4, (int64_t[]){s->out, l->c, k, k}, err);
    if (rc)
        return rc;
    l->cs = (stk_conv_shape){l->c,      l->h,   l->w,   s->k,  s->k, s->stride,
                             s->stride, s->pad, s->pad, l->oh, l->ow};
    l->wino = m->conv != STK_CONV_IM2COL && stk_wino_fits(&l->cs, l->oc);
    return 0;
}

/* A k x k window of stride st over the input: max-pool or avgpool. */
static int shape_pool(stk_model *m, layer *l, int index, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    int64_t k = l->s.k, st = l->s.stride;
    if (l->h < k || l->w < k)
        return stk_fail(err, STK_EINVAL,
                        "model: %s: a %dx%d window does not fit its %dx%dx%d "
                        "input",
                        model_label(l, index, name, sizeof name), l->s.k,
                        l->s.k, l->c, l->h, l->w);
    return set_output(m, l, index, l->c, (l->h - k) / st + 1,
                      (l->w - k) / st + 1, err);
}

/* The shape of layer p's output (STK_INPUT: the model's input). */
static void output_shape(const stk_model *m, int p, int *c, int *h, int *w)
{
    *c = p == STK_INPUT ? m->ic : m->l[p].oc;
    *h = p == STK_INPUT ? m->ih : m->l[p].oh;
    *w = p == STK_INPUT ? m->iw : m->l[p].ow;
}

static const char *input_label(const stk_model *m, int p, char *buf, size_t n)
{
    if (p == STK_INPUT)
        return snprintf(buf, n, "input"), buf;
    return model_label(&m->l[p], p, buf, n);
}

/* An add's two inputs must have one shape. */
static int shape_add(stk_model *m, layer *l, int index, stk_err *err)
{
    int bc, bh, bw;
    output_shape(m, l->in[1], &bc, &bh, &bw);
    char name[STK_NAME_MAX + 32], an[STK_NAME_MAX + 32], bn[STK_NAME_MAX + 32];
    if (bc != l->c || bh != l->h || bw != l->w)
        return stk_fail(err, STK_EINVAL,
                        "model: %s: adds %dx%dx%d (%s) and %dx%dx%d (%s): "
                        "the shapes differ",
                        model_label(l, index, name, sizeof name), l->c, l->h,
                        l->w, input_label(m, l->in[0], an, sizeof an), bc, bh,
                        bw, input_label(m, l->in[1], bn, sizeof bn));
    return set_output(m, l, index, l->c, l->h, l->w, err);
}

/* Batchnorm in training needs more than one value per channel (PyTorch
 * refuses one too): with 1x1 planes, more than one sample. */
static int shape_batchnorm(stk_model *m, layer *l, int index, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    if ((int64_t)l->h * l->w == 1 && m->max_batch == 1)
        return stk_fail(err, STK_EINVAL,
                        "model: %s: a batchnorm over %dx1x1 inputs in "
                        "batches of at most 1 sees one value per channel in "
                        "training; use batches of at least 2",
                        model_label(l, index, name, sizeof name), l->c);
    int rc = set_output(m, l, index, l->c, l->h, l->w, err);
    return rc ? rc : add_batchnorm(m, l, index, l->c, err);
}

static int shape_layer(stk_model *m, layer *l, int index, auto_names *an,
                       stk_err *err)
{
    stk_layer_spec *s = &l->s;
    int64_t c = l->c, h = l->h, w = l->w;
    l->pw = l->pb = l->bn = -1;
    switch (s->kind) {
    case STK_L_CONV:
        auto_name(l, "conv", &an->conv);
        return shape_conv(m, l, index, err);
    case STK_L_POOL:
    case STK_L_AVGPOOL:
        return shape_pool(m, l, index, err);
    case STK_L_GLOBALPOOL:
        return set_output(m, l, index, c, 1, 1, err);
    case STK_L_FLATTEN:
        return set_output(m, l, index, c * h * w, 1, 1, err);
    case STK_L_LINEAR: {
        auto_name(l, "fc", &an->fc);
        int64_t out = s->out ? s->out : m->classes;
        int rc = set_output(m, l, index, out, 1, 1, err);
        return rc ? rc
                  : add_weights(m, l, index, 2, (int64_t[]){out, c * h * w},
                                err);
    }
    case STK_L_BATCHNORM:
        auto_name(l, "bn", &an->bn);
        return shape_batchnorm(m, l, index, err);
    case STK_L_ADD:
        return shape_add(m, l, index, err);
    case STK_L_RELU:
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
        return set_output(m, l, index, c, h, w, err);
    }
    return STK_EINVAL;
}

/* The spec's inputs as indices (a spec built in code may name any layer
 * index: it must be an earlier one), and the input shape from in[0]. */
static int wire_layer(stk_model *m, int i, stk_err *err)
{
    layer *l = &m->l[i];
    const stk_layer_spec *s = &l->s;
    char name[STK_NAME_MAX + 32];
    l->nin = s->nin ? s->nin : 1;
    l->in[0] = s->nin ? s->in[0] : i - 1; /* i - 1 = STK_INPUT for layer 0 */
    l->in[1] = s->nin > 1 ? s->in[1] : STK_INPUT;
    if (s->kind == STK_L_ADD && l->nin != 2)
        return stk_fail(err, STK_EINVAL, "model: %s: an add reads two inputs",
                        model_label(l, i, name, sizeof name));
    for (int k = 0; k < l->nin; k++)
        if (s->nin < 0 || s->nin > 2 || l->in[k] < STK_INPUT || l->in[k] >= i)
            return stk_fail(err, STK_EINVAL,
                            "model: %s: reads layer %d, not an earlier one",
                            model_label(l, i, name, sizeof name),
                            l->in[k] + 1);
    for (int k = 0; k < l->nin; k++)
        if (l->in[k] != STK_INPUT)
            m->l[l->in[k]].readers++;
    output_shape(m, l->in[0], &l->c, &l->h, &l->w);
    return 0;
}

/* Every output but the last is read by some layer (an unread one is most
 * likely a mistake in the file). */
static int check_readers(const stk_model *m, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    for (int i = 0; i < m->nl - 1; i++)
        if (!m->l[i].readers)
            return stk_fail(err, STK_EINVAL,
                            "model: %s: no layer reads its output (the last "
                            "layer's output is the model's)",
                            model_label(&m->l[i], i, name, sizeof name));
    return 0;
}

/* ---- initialisation and memory ------------------------------------------ */

/* kaiming_uniform_(a=sqrt(5)) and PyTorch's bias rule both give
 * U(-1/sqrt(fan_in), 1/sqrt(fan_in)); drawn from Philox(seed) keyed by
 * the parameter's number. Batchnorm: weight 1, bias 0. */
static void init_layer(const stk_model *m, const layer *l, stk_philox_key key,
                       float *host)
{
    const stk_param *w = &m->p[l->pw];
    size_t fan_in = w->count / (size_t)w->shape[0];
    float bound = 1.0f / sqrtf((float)fan_in);
    for (int k = 0; k < 2; k++) {
        int pi = k ? l->pb : l->pw;
        if (pi < 0)
            continue;
        const stk_param *p = &m->p[pi];
        for (size_t i = 0; i < p->count; i++)
            host[p->offset + i] =
                l->s.kind == STK_L_BATCHNORM
                    ? (float)!k
                    : (2.0f * stk_philox_uniform(key, 1000 + (uint64_t)pi, i) -
                       1.0f) *
                          bound;
    }
}

/* Parameters as above; running means 0 and variances 1. */
static int init_params(stk_model *m, uint64_t seed, stk_err *err)
{
    size_t n = m->total > m->btotal ? m->total : m->btotal;
    float *host = malloc(n * sizeof *host);
    if (!host)
        return stk_fail(err, STK_ENOMEM, "model: out of memory");
    stk_philox_key key = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (int l = 0; l < m->nl; l++)
        if (m->l[l].pw >= 0)
            init_layer(m, &m->l[l], key, host);
    int rc = stk_copy_to_dev(m->be, m->w, host, m->total * sizeof *host, err);
    if (!rc)
        rc = stk_sync(m->be, err);
    for (int b = 0; b < m->nbuf; b++)
        for (size_t i = 0; i < m->bp[b].count; i++)
            host[m->bp[b].offset + i] = (float)(b & 1);
    if (!rc && m->btotal)
        rc = stk_copy_to_dev(m->be, m->bufs, host, m->btotal * sizeof *host,
                             err);
    if (!rc)
        rc = stk_sync(m->be, err);
    free(host);
    return rc;
}
/* A convolution's piece of the batch and its scratch: columns (and their
 * gradient, of the sizes *col and *dcol grow to, in the model's scratch)
 * or, for Winograd, V and M, and the transformed filters. A layer whose
 * batch is always one piece (CUDA's) keeps its own columns, which
 * backward reads again. */
static int conv_buffers(stk_model *m, layer *l, size_t *col, size_t *dcol,
                        stk_err *err)
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
    if (l->piece < m->max_batch)
        *col = c > *col ? c : *col;
    else if (!(l->col = stk_dev_alloc(be, c * sizeof(float), err)))
        return STK_ENOMEM;
    if (l->wino && (!(l->u = stk_dev_alloc(be, u * sizeof(float), err)) ||
                    !(l->du = stk_dev_alloc(be, u * sizeof(float), err))))
        return STK_ENOMEM;
    return 0;
}

/* The stash of a convolution's weight gradient cut in ranges (model_conv.c)
 * at most: a batch's per-sample products for resnet20's strided
 * convolutions are 9.4 MiB; a layer that needs more runs each op across
 * the threads instead. */
enum { STASH_MAX_FLOATS = 4 << 20 };

/* The convolutions' scratch, col and dcol floats (the largest piece's)
 * for each range, and the stash. */
static int scratch_buffers(stk_model *m, size_t col, size_t dcol,
                           stk_err *err)
{
    stk_backend *be = m->be;
    m->ranges = stk_backend_kind(be) == STK_DEV_CPU ? stk_backend_threads(be)
                                                    : 1;
    m->scratch_col = (col + 15) / 16 * 16; /* whole cache lines */
    m->scratch_stride = m->scratch_col + (dcol + 15) / 16 * 16;
    for (int i = 0; i < m->nl && m->ranges > 1; i++) {
        const layer *l = &m->l[i]; /* a layer of one piece never stashes */
        size_t need = l->s.kind == STK_L_CONV && l->piece < m->max_batch
                          ? model_conv_stash(l, m->max_batch)
                          : 0;
        if (need <= STASH_MAX_FLOATS && need > m->stash_floats)
            m->stash_floats = need;
    }
    size_t scratch = (size_t)m->ranges * m->scratch_stride;
    if (!(m->scratch = stk_dev_alloc(be, scratch * sizeof(float), err)))
        return STK_ENOMEM;
    if (m->stash_floats &&
        !(m->stash = stk_dev_alloc(be, m->stash_floats * sizeof(float), err)))
        return STK_ENOMEM;
    return 0;
}

/* Device buffers: parameters, gradients, batchnorm's buffers and
 * statistics, activations, scratch, the gradient pool. */
static int alloc_buffers(stk_model *m, stk_err *err)
{
    stk_backend *be = m->be;
    size_t act = 0, col = 1, dcol = 1, B = (size_t)m->max_batch, stats = 0;
    bool pooled = false;
    m->w = stk_dev_alloc(be, m->total * sizeof(float), err);
    m->g = m->w ? stk_dev_alloc(be, m->total * sizeof(float), err) : NULL;
    /* at least one float: a copy of none still gets a valid pointer */
    m->bufs =
        m->g ? stk_dev_alloc(be, (m->btotal + 1) * sizeof(float), err) : NULL;
    if (!m->bufs)
        return STK_ENOMEM;
    m->own_g = true;
    for (int i = 0; i < m->nl; i++) {
        layer *l = &m->l[i];
        act = out_size(l) > act ? out_size(l) : act;
        act = in_size(l) > act ? in_size(l) : act;
        stats += l->s.kind == STK_L_BATCHNORM ? 4 * (size_t)l->c : 0;
        pooled |= l->pool_at > 0;
        if (l->inplace >= 0)
            continue; /* y is its input's, set at forward time */
        if (!(l->y = stk_dev_alloc(be, out_size(l) * B * sizeof(float), err)))
            return STK_ENOMEM;
        if (l->s.kind == STK_L_POOL &&
            !(l->arg =
                  stk_dev_alloc(be, out_size(l) * B * sizeof(int32_t), err)))
            return STK_ENOMEM;
        if (l->s.kind == STK_L_CONV && conv_buffers(m, l, &col, &dcol, err))
            return STK_ENOMEM;
    }
    if (scratch_buffers(m, col, dcol, err))
        return STK_ENOMEM;
    if (stats && !(m->stats = stk_dev_alloc(be, stats * sizeof(float), err)))
        return STK_ENOMEM;
    for (int i = 0, at = 0; i < m->nl; i++)
        if (m->l[i].s.kind == STK_L_BATCHNORM) {
            m->l[i].stat = m->stats + at;
            at += 4 * m->l[i].c;
        }
    act *= B;
    if (!(m->tmp = stk_dev_alloc(be, act * sizeof(float), err)) ||
        (pooled &&
         !(m->pool_dy = stk_dev_alloc(be, act * sizeof(float), err))))
        return STK_ENOMEM;
    for (int b = 0; b < m->ngrad; b++)
        if (!(m->grad[b] = stk_dev_alloc(be, act * sizeof(float), err)))
            return STK_ENOMEM;
    m->dlogits = stk_dev_alloc(be, B * m->classes * sizeof(float), err);
    return m->dlogits ? 0 : STK_ENOMEM;
}

/* Names, shapes and sizes that only the whole model can check. */
static int check_model(const stk_model *m, stk_err *err)
{
    char name[STK_NAME_MAX + 32];
    for (int i = 0; i < m->nl; i++)
        for (int j = 0; *m->l[i].s.name && j < i; j++)
            if (!strcmp(m->l[i].s.name, m->l[j].s.name))
                return stk_fail(err, STK_EINVAL,
                                "model: two layers are named \"%s\"; give "
                                "them different names",
                                m->l[i].s.name);
    for (int i = 0; i < m->nl; i++) { /* im2col's GEMM sizes are int */
        const layer *l = &m->l[i];
        if (l->s.kind == STK_L_CONV &&
            (int64_t)l->cs.c * l->cs.kh * l->cs.kw >
                MODEL_MAX_VALUES / ((int64_t)l->oh * l->ow * m->max_batch))
            return stk_fail(
                err, STK_ERANGE,
                "model: %s: its im2col columns over a batch of %d are more "
                "than %lld values",
                model_label(l, i, name, sizeof name), m->max_batch,
                (long long)MODEL_MAX_VALUES);
    }
    const layer *last = &m->l[m->nl - 1];
    if (out_size(last) != (size_t)m->classes)
        return stk_fail(err, STK_EINVAL,
                        "model: ends with %zu outputs (%dx%dx%d) but the "
                        "data has %d classes",
                        out_size(last), last->oc, last->oh, last->ow,
                        m->classes);
    if (!m->total)
        return stk_fail(err, STK_EINVAL, "model: has no parameters");
    return check_readers(m, err);
}

/* Layers wired to their inputs and shaped, in list order. */
static int build_layers(stk_model *m, const stk_model_spec *spec, stk_err *err)
{
    auto_names an = {0, 0, 0};
    int rc = 0;
    for (int i = 0; i < m->nl && !rc; i++) {
        m->l[i].s = spec->layers[i];
        rc = wire_layer(m, i, err);
        if (!rc)
            rc = shape_layer(m, &m->l[i], i, &an, err);
    }
    return rc;
}

int stk_model_create(stk_backend *be, const stk_model_spec *spec, int c, int h,
                     int w, int nclasses, int max_batch, uint64_t seed,
                     stk_model **out, stk_err *err)
{
    *out = NULL;
    if (spec->n < 1 || spec->n > STK_MAX_LAYERS || max_batch < 1 ||
        nclasses < 1)
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
    *m = (stk_model){.be = be,
                     .nl = spec->n,
                     .conv = spec->conv,
                     .classes = nclasses,
                     .max_batch = max_batch,
                     .ic = c,
                     .ih = h,
                     .iw = w,
                     .world = 1};
    int rc = build_layers(m, spec, err);
    if (!rc)
        rc = check_model(m, err);
    if (!rc) {
        model_plan(m);
        rc = alloc_buffers(m, err);
    }
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
        if (m->l[i].inplace < 0)
            stk_dev_free(m->be, m->l[i].y);
        stk_dev_free(m->be, m->l[i].arg);
        stk_dev_free(m->be, m->l[i].col);
        stk_dev_free(m->be, m->l[i].u);
        stk_dev_free(m->be, m->l[i].du);
    }
    stk_dev_free(m->be, m->w);
    if (m->own_g)
        stk_dev_free(m->be, m->g);
    stk_dev_free(m->be, m->bufs);
    stk_dev_free(m->be, m->stats);
    stk_dev_free(m->be, m->tmp);
    stk_dev_free(m->be, m->pool_dy);
    stk_dev_free(m->be, m->scratch);
    stk_dev_free(m->be, m->stash);
    for (int b = 0; b < m->ngrad; b++)
        stk_dev_free(m->be, m->grad[b]);
    stk_dev_free(m->be, m->dlogits);
    free(m);
}

int stk_model_nparams(const stk_model *m)
{
    return m->np;
}
const stk_param *stk_model_param(const stk_model *m, int i)
{
    return &m->p[i];
}
size_t stk_model_param_count(const stk_model *m)
{
    return m->total;
}
float *stk_model_weights(stk_model *m)
{
    return m->w;
}
float *stk_model_grads(stk_model *m)
{
    return m->g;
}

int stk_model_nbuffers(const stk_model *m)
{
    return m->nbuf;
}
const stk_param *stk_model_buffer(const stk_model *m, int i)
{
    return &m->bp[i];
}
size_t stk_model_buffer_count(const stk_model *m)
{
    return m->btotal;
}
float *stk_model_buffers(stk_model *m)
{
    return m->bufs;
}
int stk_model_ncounters(const stk_model *m)
{
    return m->nb;
}
const char *stk_model_counter_name(const stk_model *m, int i)
{
    return m->counter_name[i];
}
int64_t *stk_model_counter(stk_model *m, int i)
{
    return &m->counter[i];
}

const char *stk_model_single_value_bn(const stk_model *m, int n, char *buf,
                                      size_t size)
{
    for (int i = 0; i < m->nl; i++) {
        const layer *l = &m->l[i];
        if (l->s.kind == STK_L_BATCHNORM &&
            (int64_t)m->world * n * l->h * l->w == 1)
            return model_label(l, i, buf, size);
    }
    return NULL;
}

void stk_model_sync_bn(stk_model *m, stk_allreduce_fn fn, void *arg, int world)
{
    m->sync_fn = fn;
    m->sync_arg = arg;
    m->world = fn && world > 1 ? world : 1;
}

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
float *stk_model_dlogits(stk_model *m)
{
    return m->dlogits;
}

/* Layer i as "kind:name(<-inputs) CxHxW", inputs other than the layer
 * before named after "<-". */
static void describe_layer(const stk_model *m, int i, char *buf, size_t n)
{
    const layer *l = &m->l[i];
    char from[2 * (STK_NAME_MAX + 32) + 16] = "", a[STK_NAME_MAX + 32];
    for (int k = 0; k < l->nin; k++)
        if (l->in[k] != i - 1)
            snprintf(from + strlen(from), sizeof from - strlen(from), "%s%s",
                     *from ? "," : "(<-",
                     input_label(m, l->in[k], a, sizeof a));
    snprintf(buf, n, " -> %s%s%s%s%s %dx%dx%d", kind_name(l->s.kind),
             *l->s.name ? ":" : "", l->s.name, from, *from ? ")" : "", l->oc,
             l->oh, l->ow);
}

/* "1x28x28 -> conv:conv1 32x26x26 -> ... (824326 parameters)": the
 * layers as far as they fit in n, then " ...", and the count always. */
void stk_model_describe(const stk_model *m, char *buf, size_t n)
{
    char tail[64], one[3 * (STK_NAME_MAX + 32) + 64];
    size_t t =
        (size_t)snprintf(tail, sizeof tail, " (%zu parameters)", m->total);
    if (n <= t + 16) {
        snprintf(buf, n, "%s", tail + 1);
        return;
    }
    size_t room = n - t - 4; /* " ..." */
    size_t used = (size_t)snprintf(buf, room, "%dx%dx%d", m->ic, m->ih, m->iw);
    int i = 0;
    for (; i < m->nl; i++) {
        describe_layer(m, i, one, sizeof one);
        if (used + strlen(one) >= (i == m->nl - 1 ? room + 4 : room))
            break;
        used += (size_t)snprintf(buf + used, n - used, "%s", one);
    }
    snprintf(buf + used, n - used, "%s%s", i < m->nl ? " ..." : "", tail);
}
