/* model.c - models as graphs over the kernels API: shapes, parameters in
 * one flat buffer (batchnorm's running statistics in another), PyTorch's
 * initialisation, forward in list order and backward in reverse.
 *
 * A layer reads one or two earlier outputs (in[]; STK_INPUT is the model's
 * input). Create works out a schedule once: which layers run fused (a
 * conv with the max-pool after it, piece by piece; a batchnorm with its
 * ReLU in one pass), which run in place on their input's buffer, which
 * need backward at all, and which gradient buffer of a small pool holds
 * each output's gradient (assigned by liveness: from the backward of the
 * output's last reader to the backward of its producer). Gradients of an
 * output read by several layers (a residual fan-out) add up there. */
#include "trainer.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* PyTorch's BatchNorm2d/1d defaults. */
#define BN_EPS 1e-5f
#define BN_MOMENTUM 0.1f

/* How backward hands a layer's input gradient to the layer that produced
 * the input: none needed; the layer computed it in place in its own
 * output gradient's buffer, which becomes the input's (donate); written
 * into the input's fresh buffer; or added to what a later reader of the
 * same output already put there (accumulate). */
typedef enum grad_mode { G_NONE, G_DONATE, G_WRITE, G_ACCUM } grad_mode;

typedef struct layer {
    stk_layer_spec s;
    int nin, in[2]; /* inputs: earlier layers or STK_INPUT */
    int readers;    /* layers that read its output */
    int c, h, w;    /* input shape (of in[0]) */
    int oc, oh, ow; /* output shape */
    int pw, pb;     /* indices of weight and bias params, -1 if none */
    float *y;       /* output, max_batch * oc*oh*ow; an input's own
                       buffer when the layer runs in place */
    int inplace;    /* the input slot whose buffer y is; -1: its own */
    int32_t *arg;   /* max-pool winners */
    float *col;     /* conv: the columns (Winograd: V) of one piece */
    int piece;      /* conv: samples per piece (stk_conv_chunk) */
    stk_conv_shape cs;
    bool wino;     /* conv: Winograd F(2x2, 3x3) */
    bool col_kept; /* conv: col holds the whole batch's, from forward */
    float *u, *du; /* Winograd: transformed filters and their gradient */
    int pool_at, drop_at; /* conv: the max-pool after it (and a dropout
                           layer between them), run piece by piece with
                           it, so that its output stays in cache; 0: none */
    bool fused;           /* pool, dropout: run by the conv before them;
                             relu: by the batchnorm before it */
    bool bn_relu;         /* batchnorm: applies the ReLU after it too */
    int bn;               /* batchnorm: its number (buffers 2bn, 2bn+1) */
    float *stat;          /* batchnorm: mean [c], var [c] of the last
                             training forward, backward's sums [2c] */
    bool back;            /* backward runs it (it has parameters, or an
                             input that leads to some) */
    int gy;               /* gradient buffer of its output; -1: none */
    grad_mode gmode[2];   /* and how each input's gradient is handed on */
    int gtmp;             /* scratch buffer for an accumulated input
                             gradient; -1: none */
} layer;

struct stk_model {
    stk_backend *be;
    int nl, np, classes, max_batch;
    int ic, ih, iw; /* input shape */
    stk_conv_algo conv;
    layer l[STK_MAX_LAYERS];
    stk_param p[2 * STK_MAX_LAYERS];
    size_t total;
    float *w, *g;
    bool own_g; /* g is ours to free (not stk_model_use_grads') */
    /* batchnorm: running_mean and running_var of each, counters */
    int nb, nbuf;
    stk_param bp[2 * STK_MAX_LAYERS];
    size_t btotal;
    float *bufs, *stats;
    int64_t counter[STK_MAX_LAYERS];
    char counter_name[STK_MAX_LAYERS][STK_NAME_MAX + 32];
    stk_allreduce_fn sync_fn; /* SyncBatchNorm (NULL: per rank) */
    void *sync_arg;
    int world;
    float *tmp;  /* conv outputs/gradients in [C, N, HW] order */
    float *dcol; /* conv column gradients (Winograd: M and dM) */
    int ngrad;   /* gradient buffers (max activation size) */
    float *grad[2 * STK_MAX_LAYERS];
    float *pool_dy; /* a pooled conv's output gradient */
    float *dlogits;
    const float *x;           /* the last forward input */
    int n;                    /* and its batch size */
    bool train;               /* and whether it was in training mode */
    stk_grads_ready_fn ready; /* during backward: who hears of final grads */
    void *ready_arg;
};

static size_t out_size(const layer *l)
{
    return (size_t)l->oc * l->oh * l->ow;
}
static size_t in_size(const layer *l)
{
    return (size_t)l->c * l->h * l->w;
}

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

/* A layer's name for messages: its parameter prefix, or its kind and place. */
static const char *layer_label(const layer *l, int index, char *buf, size_t n)
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
            layer_label(l, index, name, sizeof name), (long long)oc,
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
                        layer_label(l, index, name, sizeof name),
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
                        layer_label(l, index, name, sizeof name), l->s.k,
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
    return layer_label(&m->l[p], p, buf, n);
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
                        layer_label(l, index, name, sizeof name), l->c, l->h,
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
                        layer_label(l, index, name, sizeof name), l->c);
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
                        layer_label(l, i, name, sizeof name));
    for (int k = 0; k < l->nin; k++)
        if (s->nin < 0 || s->nin > 2 || l->in[k] < STK_INPUT || l->in[k] >= i)
            return stk_fail(err, STK_EINVAL,
                            "model: %s: reads layer %d, not an earlier one",
                            layer_label(l, i, name, sizeof name),
                            l->in[k] + 1);
    for (int k = 0; k < l->nin; k++)
        if (l->in[k] != STK_INPUT)
            m->l[l->in[k]].readers++;
    output_shape(m, l->in[0], &l->c, &l->h, &l->w);
    return 0;
}

/* ---- the schedule ------------------------------------------------------- */

static bool is_dropout(const layer *l)
{
    return l->s.kind == STK_L_DROPOUT || l->s.kind == STK_L_DROPOUT2D;
}

/* Whether layer j reads the layer before it, and is its only reader. */
static bool sole_next(const stk_model *m, int i, int j)
{
    return j == i + 1 && j < m->nl && m->l[j].nin == 1 && m->l[j].in[0] == i &&
           m->l[i].readers == 1;
}

/* A conv followed by a max-pool, with or without a dropout layer between
 * them (each the only reader of the one before), runs them piece by
 * piece (conv_forward, conv_backward). */
static void fuse_pool(stk_model *m, int i)
{
    int j = i + 1, d = 0;
    if (m->l[i].s.kind != STK_L_CONV)
        return;
    if (sole_next(m, i, j) && is_dropout(&m->l[j]))
        d = j++;
    if (!sole_next(m, j - 1, j) || m->l[j].s.kind != STK_L_POOL)
        return;
    m->l[i].pool_at = j;
    m->l[i].drop_at = d;
    m->l[j].fused = true;
    if (d)
        m->l[d].fused = true;
}

/* A batchnorm whose only reader is a ReLU right after it applies the ReLU
 * in the same pass (and masks its backward with the ReLU's output). */
static void fuse_bn_relu(stk_model *m, int i)
{
    if (m->l[i].s.kind == STK_L_BATCHNORM && sole_next(m, i, i + 1) &&
        m->l[i + 1].s.kind == STK_L_RELU) {
        m->l[i].bn_relu = true;
        m->l[i + 1].fused = true;
    }
}

/* Whether layer p's output buffer may be overwritten by its reader: it is
 * not the model's input and every layer up the chain of in-place layers
 * that share the buffer has that one reader. */
static bool sole_owner(const stk_model *m, int p)
{
    while (p != STK_INPUT) {
        const layer *l = &m->l[p];
        if (l->readers != 1)
            return false;
        if (l->inplace < 0)
            return true;
        p = l->in[l->inplace];
    }
    return false;
}

/* Whether a ReLU up the chain of layers sharing p's buffer keeps its
 * output there for its backward's mask. A ReLU or dropout on top keeps
 * the mask's meaning (zero where the gradient is zero anyway); an add
 * would not. */
static bool holds_mask(const stk_model *m, int p)
{
    while (p != STK_INPUT) {
        const layer *l = &m->l[p];
        if (l->s.kind == STK_L_RELU)
            return true;
        if (l->inplace < 0)
            return false;
        p = l->in[l->inplace];
    }
    return false;
}

/* Which input buffer (if any) layer i writes its output into: flatten
 * always (it changes no value), a ReLU or dropout over an input only it
 * reads, an add over such an input that keeps no ReLU mask. Backward
 * needs no layer's overwritten value: a layer that reads its input in
 * backward (conv, linear, batchnorm) never shares it. */
static void choose_inplace(stk_model *m, int i)
{
    layer *l = &m->l[i];
    l->inplace = -1;
    switch (l->s.kind) {
    case STK_L_FLATTEN:
        l->inplace = 0;
        break;
    case STK_L_RELU:
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
        if (l->fused || sole_owner(m, l->in[0]))
            l->inplace = 0;
        break;
    case STK_L_ADD:
        for (int k = 1; k >= 0; k--)
            if (sole_owner(m, l->in[k]) && !holds_mask(m, l->in[k]))
                l->inplace = k;
        break;
    default:
        break;
    }
}

/* Layers whose backward works in place on their output gradient (a ReLU's
 * mask, a dropout's, batchnorm's, or nothing at all), so that the buffer
 * can become the input's gradient. */
static bool back_in_place(const layer *l)
{
    switch (l->s.kind) {
    case STK_L_RELU:
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
    case STK_L_FLATTEN:
    case STK_L_BATCHNORM:
    case STK_L_ADD:
        return true;
    case STK_L_POOL:
        return l->fused; /* its conv runs it */
    default:
        return false;
    }
}

/* The gradient pool: a stack of free buffer numbers. */
typedef struct grad_pool {
    int free[2 * STK_MAX_LAYERS], nfree, n;
} grad_pool;

static int take(grad_pool *g)
{
    return g->nfree ? g->free[--g->nfree] : g->n++;
}

static void give(grad_pool *g, int b)
{
    g->free[g->nfree++] = b;
}

/* Backward as it will run, assigning gradient buffers: the output's
 * buffer from its last reader's backward (in list order) to its own. */
static void plan_backward(stk_model *m)
{
    grad_pool pool = {.nfree = 0, .n = 0};
    for (int i = 0; i < m->nl; i++) {
        layer *l = &m->l[i];
        l->back = l->pw >= 0;
        for (int k = 0; k < l->nin; k++)
            l->back |= l->in[k] != STK_INPUT && m->l[l->in[k]].back;
        l->gy = l->gtmp = -1;
    }
    m->l[m->nl - 1].gy = take(&pool);
    for (int i = m->nl - 1; i >= 0; i--) {
        layer *l = &m->l[i];
        if (!l->back)
            continue;
        bool donated = false;
        for (int k = 0; k < l->nin; k++) {
            layer *p = l->in[k] == STK_INPUT ? NULL : &m->l[l->in[k]];
            if (!p || !p->back) {
                l->gmode[k] = G_NONE;
            } else if (p->gy >= 0) {
                l->gmode[k] = G_ACCUM;
                if (!back_in_place(l) && l->gtmp < 0)
                    l->gtmp = take(&pool);
            } else if (back_in_place(l) && !donated) {
                l->gmode[k] = G_DONATE;
                p->gy = l->gy;
                donated = true;
            } else {
                l->gmode[k] = G_WRITE;
                p->gy = take(&pool);
            }
        }
        if (!donated)
            give(&pool, l->gy);
        if (l->gtmp >= 0)
            give(&pool, l->gtmp);
    }
    m->ngrad = pool.n;
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
                            layer_label(&m->l[i], i, name, sizeof name));
    return 0;
}

static void plan(stk_model *m)
{
    for (int i = 0; i < m->nl; i++) {
        fuse_pool(m, i);
        fuse_bn_relu(m, i);
    }
    for (int i = 0; i < m->nl; i++)
        choose_inplace(m, i);
    plan_backward(m);
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

/* Device buffers: parameters, gradients, batchnorm's buffers and
 * statistics, activations, scratch, the gradient pool. */
static int alloc_buffers(stk_model *m, stk_err *err)
{
    stk_backend *be = m->be;
    size_t act = 0, col = 1, B = (size_t)m->max_batch, stats = 0;
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
        if (l->s.kind == STK_L_CONV && conv_buffers(m, l, &col, err))
            return STK_ENOMEM;
    }
    if (stats && !(m->stats = stk_dev_alloc(be, stats * sizeof(float), err)))
        return STK_ENOMEM;
    for (int i = 0, at = 0; i < m->nl; i++)
        if (m->l[i].s.kind == STK_L_BATCHNORM) {
            m->l[i].stat = m->stats + at;
            at += 4 * m->l[i].c;
        }
    act *= B;
    if (!(m->tmp = stk_dev_alloc(be, act * sizeof(float), err)) ||
        !(m->dcol = stk_dev_alloc(be, col * sizeof(float), err)) ||
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
                layer_label(l, i, name, sizeof name), m->max_batch,
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
        plan(m);
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
    stk_dev_free(m->be, m->dcol);
    stk_dev_free(m->be, m->pool_dy);
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

/* ---- forward ---------------------------------------------------------- */

/* Dropout's Philox stream for layer `layer` at training step `stream`.
 * Layers 0..63 keep the keys of when a model had at most 64 layers
 * (stream * 64 + layer), so that the existing models draw the same masks;
 * layers 64..255 take keys with the top bit set, which no lower layer's
 * key has and which do not repeat, for any stream below 2^55. */
static uint64_t layer_stream(uint64_t stream, int layer)
{
    if (layer < 64)
        return stream * 64 + (uint64_t)layer;
    return UINT64_C(1) << 63 | (stream * STK_MAX_LAYERS + (uint64_t)layer);
}

static const float *param(const stk_model *m, int i)
{
    return i < 0 ? NULL : m->w + m->p[i].offset;
}

/* Input k of layer l as the last forward left it. */
static const float *input_of(const stk_model *m, const layer *l, int k)
{
    return l->in[k] == STK_INPUT ? m->x : m->l[l->in[k]].y;
}

/* Winograd, one piece: V from the input, M_p = U_p V_p (U transformed
 * before the first piece), outputs (with the bias, if any) from M. */
static int wino_forward_piece(stk_model *m, layer *l, const float *x, int s0,
                              int cn, stk_err *err)
{
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), c = l->c,
                oc = l->oc;
    int rc =
        stk_wino_input(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, false, oc, nt, c, 1.0f, l->u, c,
                              stk_wino_stride((size_t)oc * c), l->col, nt,
                              stk_wino_stride((size_t)c * nt), 0.0f, m->dcol,
                              nt, stk_wino_stride((size_t)oc * nt), STK_WINO_P,
                              err);
    return rc ? rc
              : stk_wino_output(m->be, m->dcol, param(m, l->pb), &l->cs, oc,
                                cn, l->y + s0 * out_size(l), err);
}

/* im2col, one piece: columns [K, n*HW]; W [cout, K] times each sample's
 * [K, HW] block is that sample's [cout, HW] output, in place in NCHW (no
 * swap), plus the bias (if any) while the piece is in cache (a pass over the
 * whole output afterwards would read it back from memory). */
static int im2col_forward_piece(stk_model *m, layer *l, const float *x, int s0,
                                int cn, stk_err *err)
{
    int K = l->cs.c * l->cs.kh * l->cs.kw, hw = l->oh * l->ow;
    float *y = l->y + s0 * out_size(l);
    int rc = stk_im2col(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, false, l->oc, hw, K, 1.0f,
                              m->w + m->p[l->pw].offset, K, 0, l->col, cn * hw,
                              (size_t)hw, 0.0f, y, hw, out_size(l), cn, err);
    if (!rc && l->pb >= 0)
        rc = stk_bias_add(m->be, y, param(m, l->pb), cn, l->oc, hw, err);
    return rc;
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
    int rc = l->wino ? stk_wino_filter(m->be, param(m, l->pw), l->oc, l->c,
                                       l->u, err)
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

/* Training: the batch's mean and (biased) variance per channel, over all
 * ranks under SyncBatchNorm, then the running statistics' update with
 * the unbiased variance, as PyTorch. */
static int bn_batch_stats(stk_model *m, layer *l, const float *x, int n,
                          stk_err *err)
{
    int c = l->c, hw = l->h * l->w;
    float *mean = l->stat, *var = l->stat + c;
    double count = (double)m->world * n * hw;
    int rc = stk_bn_sums(m->be, x, n, c, hw, NULL, 1.0 / count, mean, err);
    if (!rc && m->sync_fn)
        rc = m->sync_fn(m->sync_arg, mean, c, err);
    if (!rc)
        rc = stk_bn_sums(m->be, x, n, c, hw, mean, 1.0 / count, var, err);
    if (!rc && m->sync_fn)
        rc = m->sync_fn(m->sync_arg, var, c, err);
    float *run = m->bufs + m->bp[2 * l->bn].offset;
    if (!rc)
        rc = stk_bn_running(m->be, run, run + c, mean, var, c, BN_MOMENTUM,
                            (float)(count / (count - 1)), err);
    if (!rc)
        m->counter[l->bn]++;
    return rc;
}

/* Batch statistics in training (refusing one value per channel, as
 * PyTorch), the running ones otherwise; the ReLU after it in the same
 * pass when fused. */
static int bn_forward(stk_model *m, int i, const float *x, int n, bool train,
                      stk_err *err)
{
    layer *l = &m->l[i];
    int c = l->c, hw = l->h * l->w;
    const float *mean = m->bufs + m->bp[2 * l->bn].offset, *var = mean + c;
    char name[STK_NAME_MAX + 32];
    if (train && (int64_t)n * hw == 1)
        return stk_fail(
            err, STK_EINVAL,
            "model: %s: a batchnorm in training over a %dx%dx%dx%d "
            "input sees one value per channel; use batches of at "
            "least 2",
            layer_label(l, i, name, sizeof name), n, l->c, l->h, l->w);
    if (train) {
        int rc = bn_batch_stats(m, l, x, n, err);
        if (rc)
            return rc;
        mean = l->stat;
        var = l->stat + c;
    }
    return stk_bn_apply(m->be, x, l->y, n, c, hw, mean, var, BN_EPS,
                        param(m, l->pw), param(m, l->pb), l->bn_relu, err);
}

/* Dropout in place, or on a copy where the input is read elsewhere. */
static int dropout_forward(stk_model *m, int i, const float *x, int n,
                           bool train, stk_philox_key key, uint64_t stream,
                           stk_err *err)
{
    layer *l = &m->l[i];
    int rc = l->inplace < 0
                 ? stk_copy_dev(m->be, l->y, x, out_size(l) * (size_t)n, err)
                 : 0;
    return rc || !train || l->fused
               ? rc
               : dropout_piece(m, i, l->y, 0, n, key, stream, err);
}

static int linear_forward(stk_model *m, layer *l, const float *x, int n,
                          stk_err *err)
{
    int in = (int)in_size(l);
    int rc = stk_gemm(m->be, false, true, n, l->oc, in, 1.0f, x, in,
                      param(m, l->pw), in, 0.0f, l->y, l->oc, err);
    if (!rc && l->pb >= 0)
        rc = stk_bias_add(m->be, l->y, param(m, l->pb), n, l->oc, 1, err);
    return rc;
}

static int layer_forward(stk_model *m, int i, int n, bool train,
                         stk_philox_key key, uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i];
    const float *x = input_of(m, l, 0);
    size_t total = out_size(l) * (size_t)n;
    int planes = n * l->c;
    if (l->inplace >= 0)
        l->y = (float *)input_of(m, l, l->inplace);
    switch (l->s.kind) {
    case STK_L_CONV:
        return conv_forward(m, i, x, n, train, key, stream, err);
    case STK_L_POOL: /* fused: the conv before it ran it, piece by piece */
        return l->fused ? 0 : pool_forward_piece(m, l, x, 0, n, err);
    case STK_L_RELU: /* fused: the batchnorm before it ran it */
        return l->fused ? 0 : stk_relu_fwd(m->be, x, l->y, total, err);
    case STK_L_FLATTEN:
        return 0;
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
        return dropout_forward(m, i, x, n, train, key, stream, err);
    case STK_L_LINEAR:
        return linear_forward(m, l, x, n, err);
    case STK_L_BATCHNORM:
        return bn_forward(m, i, x, n, train, err);
    case STK_L_ADD:
        return stk_add(m->be, x, input_of(m, l, 1), l->y, total, err);
    case STK_L_AVGPOOL:
        return stk_avgpool_fwd(m->be, x, planes, l->h, l->w, l->s.k, l->s.k,
                               l->s.stride, l->s.stride, l->y, err);
    case STK_L_GLOBALPOOL:
        return stk_avgpool_fwd(m->be, x, planes, l->h, l->w, l->h, l->w, 1, 1,
                               l->y, err);
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
    for (int i = 0; i < m->nl; i++) {
        int rc = layer_forward(m, i, n, train, key, stream, err);
        if (rc)
            return rc;
    }
    *logits = m->l[m->nl - 1].y;
    return 0;
}

/* ---- backward ---------------------------------------------------------- */

/* The layer's gradients are final: tells the backward's listener. */
static void report(stk_model *m, const layer *l)
{
    if (m->ready && l->pw >= 0)
        m->ready(l->pw, m->ready_arg);
    if (m->ready && l->pb >= 0)
        m->ready(l->pb, m->ready_arg);
}

static float *grad_of(const stk_model *m, int p)
{
    return m->g + m->p[p].offset;
}

/* Winograd, one piece: dM from dy; dU_p (+)= dM_p V_p^T (V rebuilt unless
 * forward left the whole batch's); dV_p = U_p^T dM_p into V's place, then
 * back to pixels; db += the piece's sums (if it has a bias). */
static int wino_backward_piece(stk_model *m, layer *l, const float *x,
                               const float *dy, float *dx, int s0, int cn,
                               stk_err *err)
{
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), c = l->c,
                oc = l->oc;
    size_t su = stk_wino_stride((size_t)oc * c),
           sv = stk_wino_stride((size_t)c * nt);
    size_t sm = stk_wino_stride((size_t)oc * nt);
    int rc = stk_wino_output_grad(m->be, dy + s0 * out_size(l), &l->cs, oc, cn,
                                  m->dcol, err);
    if (!rc && !l->col_kept)
        rc = stk_wino_input(m->be, x + s0 * in_size(l), &l->cs, cn, l->col,
                            err);
    if (!rc)
        rc = stk_gemm_batched(m->be, false, true, oc, c, nt, 1.0f, m->dcol, nt,
                              sm, l->col, nt, sv, s0 ? 1.0f : 0.0f, l->du, c,
                              su, STK_WINO_P, err);
    if (!rc && dx) {
        l->col_kept = false; /* V's place now holds dV */
        rc = stk_gemm_batched(m->be, true, false, c, nt, oc, 1.0f, l->u, c, su,
                              m->dcol, nt, sm, 0.0f, l->col, nt, sv,
                              STK_WINO_P, err);
        if (!rc)
            rc = stk_wino_input_grad(m->be, l->col, &l->cs, cn,
                                     dx + s0 * in_size(l), err);
    }
    if (!rc && l->pb >= 0)
        rc = stk_bias_grad(m->be, dy + s0 * out_size(l), grad_of(m, l->pb), cn,
                           oc, l->oh * l->ow, err);
    return rc;
}

/* dW += dy cols^T for one im2col piece, dy [n, cout, HW]. The CPU sums
 * sample by sample (each a [cout, HW] block against its [K, HW] columns);
 * CUDA, with the whole batch as one piece, swaps dy to [cout, n*HW] for
 * one GEMM instead of n small ones. */
static int im2col_weight_grad(stk_model *m, layer *l, const float *dy, int cn,
                              stk_err *err)
{
    int K = l->cs.c * l->cs.kh * l->cs.kw, hw = l->oh * l->ow, nhw = cn * hw;
    float *dw = grad_of(m, l->pw);
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
    int rc = l->pb >= 0 ? stk_bias_grad(m->be, dy, grad_of(m, l->pb), cn,
                                        l->oc, hw, err)
                        : 0;
    if (!rc && l->piece < n)
        rc = stk_im2col(m->be, x + s0 * in_size(l), &l->cs, cn, l->col, err);
    if (!rc)
        rc = im2col_weight_grad(m, l, dy, cn, err);
    if (!rc && dx)
        rc = stk_gemm_batched(m->be, true, false, K, hw, l->oc, 1.0f,
                              param(m, l->pw), K, 0, dy, hw, out_size(l), 0.0f,
                              m->dcol, cn * hw, (size_t)hw, cn, err);
    if (!rc && dx)
        rc = stk_col2im(m->be, m->dcol, &l->cs, cn, dx + s0 * in_size(l), err);
    return rc;
}

/* Piece by piece; a pooled conv gets its pool's output gradient as dy and
 * runs the pool's backward (and its dropout's) on each piece first, into
 * pool_dy. dW is final only after the last piece (Winograd: once dU's
 * adjoint transform is added), so the layer reports its gradients after
 * its input gradient. */
static int conv_backward(stk_model *m, int i, const float *x, const float *dy,
                         float *dx, int n, stk_philox_key key, uint64_t stream,
                         stk_err *err)
{
    layer *l = &m->l[i], *pool = l->pool_at ? &m->l[l->pool_at] : NULL;
    const float *dyc = pool ? m->pool_dy : dy; /* the conv's output gradient */
    int rc = 0;
    for (int s0 = 0; s0 < n && !rc; s0 += l->piece) {
        int cn = n - s0 < l->piece ? n - s0 : l->piece;
        if (pool) {
            size_t at = out_size(pool) * s0;
            rc = stk_maxpool_bwd(m->be, dy + at, pool->arg + at, cn * pool->c,
                                 pool->h, pool->w, pool->s.k, pool->s.stride,
                                 m->pool_dy + out_size(l) * s0, err);
        }
        if (!rc && l->drop_at && m->train)
            rc = dropout_piece(m, l->drop_at, m->pool_dy, s0, cn, key, stream,
                               err);
        if (!rc)
            rc = l->wino
                     ? wino_backward_piece(m, l, x, dyc, dx, s0, cn, err)
                     : im2col_backward_piece(m, l, x, dyc, dx, n, s0, cn, err);
    }
    if (!rc && l->wino)
        rc = stk_wino_filter_grad(m->be, l->du, l->oc, l->c, grad_of(m, l->pw),
                                  err);
    if (!rc)
        report(m, l);
    return rc;
}

static int linear_backward(stk_model *m, layer *l, const float *x,
                           const float *dy, float *dx, int n, stk_err *err)
{
    int in = (int)in_size(l);
    int rc = stk_gemm(m->be, true, false, l->oc, in, n, 1.0f, dy, l->oc, x, in,
                      1.0f, grad_of(m, l->pw), in, err);
    if (!rc && l->pb >= 0)
        rc = stk_bias_grad(m->be, dy, grad_of(m, l->pb), n, l->oc, 1, err);
    if (!rc)
        report(m, l); /* before dx: the reduction overlaps it */
    if (!rc && dx)
        rc = stk_gemm(m->be, false, false, n, in, l->oc, 1.0f, dy, l->oc,
                      param(m, l->pw), in, 0.0f, dx, in, err);
    return rc;
}

/* Batchnorm, in place on dy: the sums of g and g * xhat per channel (g
 * masked by the fused ReLU's output) are beta's and gamma's gradients;
 * the input gradient takes the batch statistics' part from the same sums
 * (all ranks' under SyncBatchNorm). In evaluation mode the statistics
 * are constants: inv_count 0 leaves gamma / sqrt(var + eps) * g. */
static int bn_backward(stk_model *m, layer *l, const float *x, float *dy,
                       bool need_dx, stk_err *err)
{
    int c = l->c, hw = l->h * l->w, n = m->n;
    const float *mean = l->stat, *var = l->stat + c;
    const float *relu_y = l->bn_relu ? l->y : NULL;
    float *sums = l->stat + 2 * c;
    if (!m->train) {
        mean = m->bufs + m->bp[2 * l->bn].offset;
        var = mean + c;
    }
    int rc = stk_bn_grad_sums(m->be, dy, relu_y, x, n, c, hw, mean, var,
                              BN_EPS, sums, err);
    if (!rc)
        rc =
            stk_axpy(m->be, (size_t)c, 1.0f, sums + c, grad_of(m, l->pw), err);
    if (!rc)
        rc = stk_axpy(m->be, (size_t)c, 1.0f, sums, grad_of(m, l->pb), err);
    if (!rc)
        report(m, l);
    if (rc || !need_dx)
        return rc;
    if (m->train && m->sync_fn)
        rc = m->sync_fn(m->sync_arg, sums, 2 * c, err);
    float inv = m->train ? (float)(1.0 / ((double)m->world * n * hw)) : 0.0f;
    return rc ? rc
              : stk_bn_input_grad(m->be, dy, relu_y, x, n, c, hw, mean, var,
                                  BN_EPS, param(m, l->pw), sums, inv, dy, err);
}

/* Where layer l's backward writes input k's gradient: layers that work in
 * place write into dy (and hand_on moves it on); the others into the
 * input's buffer, or into scratch when it is to be added there. */
static float *dx_target(const stk_model *m, const layer *l, int k)
{
    switch (l->gmode[k]) {
    case G_NONE:
        return NULL;
    case G_WRITE:
        return back_in_place(l) ? m->grad[l->gy] : m->grad[m->l[l->in[k]].gy];
    case G_ACCUM:
        return back_in_place(l) ? m->grad[l->gy] : m->grad[l->gtmp];
    case G_DONATE:
        return m->grad[l->gy];
    }
    return NULL;
}

/* Layer i's backward from its output gradient dy, its input gradient (if
 * any is needed) where dx_target says. */
static int layer_backward(stk_model *m, int i, float *dy, stk_philox_key key,
                          uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i];
    int n = m->n, planes = n * l->c;
    size_t total = out_size(l) * (size_t)n;
    const float *x = input_of(m, l, 0);
    float *dx = dx_target(m, l, 0);
    switch (l->s.kind) {
    case STK_L_CONV:
        return conv_backward(m, i, x, dy, dx, n, key, stream, err);
    case STK_L_LINEAR:
        return linear_backward(m, l, x, dy, dx, n, err);
    case STK_L_BATCHNORM:
        return bn_backward(m, l, x, dy, dx != NULL, err);
    case STK_L_POOL: /* fused: the conv before it runs it, piece by piece */
        return l->fused || !dx
                   ? 0
                   : stk_maxpool_bwd(m->be, dy, l->arg, planes, l->h, l->w,
                                     l->s.k, l->s.stride, dx, err);
    case STK_L_AVGPOOL:
        return dx ? stk_avgpool_bwd(m->be, dy, planes, l->h, l->w, l->s.k,
                                    l->s.k, l->s.stride, l->s.stride, dx, err)
                  : 0;
    case STK_L_GLOBALPOOL:
        return dx ? stk_avgpool_bwd(m->be, dy, planes, l->h, l->w, l->h, l->w,
                                    1, 1, dx, err)
                  : 0;
    case STK_L_RELU: /* fused: the batchnorm before it masks */
        return l->fused ? 0 : stk_relu_bwd(m->be, l->y, dy, dy, total, err);
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D: /* identity in eval; fused: the conv runs it */
        return m->train && !l->fused
                   ? dropout_piece(m, i, dy, 0, n, key, stream, err)
                   : 0;
    case STK_L_FLATTEN:
    case STK_L_ADD: /* both inputs' gradients are dy */
        return 0;
    }
    return STK_EINVAL;
}

/* Hands each input gradient of layer l to its producer's buffer: a
 * donated buffer is already there; a written one is there unless the
 * layer worked in place (then copied); an accumulated one is added. */
static int hand_on(stk_model *m, const layer *l, stk_err *err)
{
    int rc = 0;
    for (int k = 0; k < l->nin && !rc; k++) {
        if (l->gmode[k] == G_NONE || l->gmode[k] == G_DONATE)
            continue;
        const layer *p = &m->l[l->in[k]];
        float *to = m->grad[p->gy], *from = dx_target(m, l, k);
        size_t count = out_size(p) * (size_t)m->n;
        if (l->gmode[k] == G_ACCUM)
            rc = stk_add(m->be, to, from, to, count, err);
        else if (from != to)
            rc = stk_copy_dev(m->be, to, from, count, err);
    }
    return rc;
}

int stk_model_backward(stk_model *m, const float *dlogits, int n,
                       stk_philox_key key, uint64_t stream, bool accumulate,
                       stk_grads_ready_fn ready, void *arg, stk_err *err)
{
    if (n != m->n)
        return stk_fail(err, STK_EINVAL,
                        "model: backward of %d samples after a forward of %d",
                        n, m->n);
    int rc = accumulate
                 ? 0
                 : stk_memzero(m->be, m->g, m->total * sizeof(float), err);
    if (rc)
        return rc;
    m->ready = ready;
    m->ready_arg = arg;
    /* the last layer's gradient buffer starts as a copy of dlogits, so
     * that in-place layers never write into the caller's buffer */
    float *dy = m->grad[m->l[m->nl - 1].gy];
    if (dlogits != dy)
        rc = stk_copy_dev(m->be, dy, dlogits, (size_t)n * m->classes, err);
    for (int i = m->nl - 1; i >= 0 && !rc; i--) {
        layer *l = &m->l[i];
        if (!l->back)
            continue; /* neither parameters nor any below it */
        rc = layer_backward(m, i, m->grad[l->gy], key, stream, err);
        if (!rc)
            rc = hand_on(m, l, err);
    }
    m->ready = NULL;
    return rc;
}
