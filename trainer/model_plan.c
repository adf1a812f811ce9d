/* model_plan.c - the schedule of a built model, worked out once by
 * stk_model_create: which layers run fused (a conv with the max-pool after
 * it, piece by piece; a batchnorm with its ReLU in one pass; a batchnorm,
 * the add that reads it and the ReLU after that in one forward pass),
 * which write into their input's buffer, which need backward at all, and
 * which buffer of a small pool holds each output's gradient (by liveness:
 * from the backward of the output's last reader to the backward of its
 * producer).
 * docs/architecture.md, "A model is a graph". */
#include "model_impl.h"

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
 * in the same pass (and masks its backward where the ReLU passed, the
 * ReLU's output recomputed from the batchnorm's input). */
static void fuse_bn_relu(stk_model *m, int i)
{
    if (m->l[i].s.kind == STK_L_BATCHNORM && sole_next(m, i, i + 1) &&
        m->l[i + 1].s.kind == STK_L_RELU) {
        m->l[i].bn_relu = true;
        m->l[i + 1].fused = true;
    }
}

/* A batchnorm whose only reader is an add of it and another output, whose
 * only reader is a ReLU, writes the ReLU's output in one pass (a residual
 * block's tail): the batchnorm's and the add's outputs are never written,
 * nothing reads them. The ReLU's backward runs as before, from the output
 * written. */
static void fuse_bn_add_relu(stk_model *m, int i)
{
    layer *b = &m->l[i], *a = i + 1 < m->nl ? &m->l[i + 1] : NULL;
    if (b->s.kind != STK_L_BATCHNORM || b->bn_relu || b->readers != 1 || !a ||
        a->s.kind != STK_L_ADD || a->nin != 2 || a->in[0] == a->in[1] ||
        (a->in[0] != i && a->in[1] != i) || !sole_next(m, i + 1, i + 2) ||
        m->l[i + 2].s.kind != STK_L_RELU)
        return;
    b->bn_add = i + 1;
    a->fwd_fused = true;
    m->l[i + 2].fwd_fused = true;
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

void model_plan(stk_model *m)
{
    for (int i = 0; i < m->nl; i++) {
        fuse_pool(m, i);
        fuse_bn_relu(m, i);
        fuse_bn_add_relu(m, i);
    }
    for (int i = 0; i < m->nl; i++)
        choose_inplace(m, i);
    plan_backward(m);
}
