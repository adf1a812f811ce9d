/* model_run.c - forward (in list order) and backward (in reverse) of a
 * planned model (model_plan.c): convolutions (model_conv.c), batchnorm on
 * batch or running statistics, gradients handed to each input's buffer as
 * the plan says, fan-out gradients added. */
#include "model_impl.h"

#include <stdio.h>
#include <string.h>

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

/* Where layer j's forward writes: its own buffer, or its input's when it
 * runs in place, worked out here for a layer whose forward an earlier one
 * runs (layer_forward sets an in-place y only on the layer's own turn). */
static float *out_buffer(stk_model *m, int j)
{
    const layer *l = &m->l[j];
    if (l->inplace < 0)
        return l->y;
    int p = l->in[l->inplace];
    return p != STK_INPUT && m->l[p].fwd_fused
               ? out_buffer(m, p)
               : (float *)input_of(m, l, l->inplace);
}

/* Batch statistics in training (refusing one value per channel over the
 * group, as PyTorch's BatchNorm and SyncBatchNorm), the running ones
 * otherwise; the ReLU after it in the same
 * pass when fused. */
static int bn_forward(stk_model *m, int i, const float *x, int n, bool train,
                      stk_err *err)
{
    layer *l = &m->l[i];
    int c = l->c, hw = l->h * l->w;
    const float *mean = m->bufs + m->bp[2 * l->bn].offset, *var = mean + c;
    char name[STK_NAME_MAX + 32];
    if (train && (int64_t)m->world * n * hw == 1)
        return stk_fail(
            err, STK_EINVAL,
            "model: %s: a batchnorm in training over a %dx%dx%dx%d "
            "input sees one value per channel; use batches of at "
            "least 2",
            model_label(l, i, name, sizeof name), n, l->c, l->h, l->w);
    if (train) {
        int rc = bn_batch_stats(m, l, x, n, err);
        if (rc)
            return rc;
        mean = l->stat;
        var = l->stat + c;
    }
    if (l->bn_add) { /* the add's other input, into the ReLU's output */
        const layer *a = &m->l[l->bn_add];
        return stk_bn_apply_add(m->be, x, input_of(m, a, a->in[0] == i),
                                out_buffer(m, l->bn_add + 1), n, c, hw, mean,
                                var, BN_EPS, param(m, l->pw), param(m, l->pb),
                                true, err);
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
               : model_dropout(m->be, m, i, l->y, 0, n, key, stream, err);
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
        return model_conv_forward(m, i, x, n, train, key, stream, err);
    case STK_L_POOL: /* fused: the conv before it ran it, piece by piece */
        return l->fused ? 0 : model_maxpool(m->be, l, x, 0, n, err);
    case STK_L_RELU: /* fused, fwd_fused: the batchnorm before it ran it */
        return l->fused || l->fwd_fused
                   ? 0
                   : stk_relu_fwd(m->be, x, l->y, total, err);
    case STK_L_FLATTEN:
        return 0;
    case STK_L_DROPOUT:
    case STK_L_DROPOUT2D:
        return dropout_forward(m, i, x, n, train, key, stream, err);
    case STK_L_LINEAR:
        return linear_forward(m, l, x, n, err);
    case STK_L_BATCHNORM:
        return bn_forward(m, i, x, n, train, err);
    case STK_L_ADD: /* fwd_fused: the batchnorm before it ran it */
        return l->fwd_fused
                   ? 0
                   : stk_add(m->be, x, input_of(m, l, 1), l->y, total, err);
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

/* The layer's gradients are final: tells the backward's listener, whose
 * thread reads them next (and the sanitizers, which may not have seen the
 * kernels write them). */
static void report(stk_model *m, const layer *l)
{
    int p[2] = {l->pw, l->pb};
    bool host = stk_backend_kind(m->be) == STK_DEV_CPU; /* not a device's */
    for (int i = 0; m->ready && i < 2; i++)
        if (p[i] >= 0) {
            if (host)
                stk_san_wrote(grad_of(m, p[i]), m->p[p[i]].count * sizeof(float));
            m->ready(p[i], m->ready_arg);
        }
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
    const float *gamma = param(m, l->pw), *beta = param(m, l->pb);
    float *sums = l->stat + 2 * c;
    if (!m->train) {
        mean = m->bufs + m->bp[2 * l->bn].offset;
        var = mean + c;
    }
    int rc = stk_bn_grad_sums(m->be, dy, x, n, c, hw, mean, var, BN_EPS, gamma,
                              beta, l->bn_relu, sums, err);
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
              : stk_bn_input_grad(m->be, dy, x, n, c, hw, mean, var, BN_EPS,
                                  gamma, beta, l->bn_relu, sums, inv, dy, err);
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
    case STK_L_CONV: {
        int rc = model_conv_backward(m, i, x, dy, dx, n, key, stream, err);
        if (!rc)
            report(m, l); /* dW is final after dx */
        return rc;
    }
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
                   ? model_dropout(m->be, m, i, dy, 0, n, key, stream, err)
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
