/* model_run.c - forward (in list order) and backward (in reverse) of a
 * planned model (model_plan.c): convolutions piece by piece with their
 * max-pool, batchnorm on batch or running statistics, gradients handed
 * to each input's buffer as the plan says, fan-out gradients added. */
#include "model_impl.h"

#include <stdio.h>
#include <string.h>

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

/* The layer's gradients are final: tells the backward's listener. */
static void report(stk_model *m, const layer *l)
{
    if (m->ready && l->pw >= 0)
        m->ready(l->pw, m->ready_arg);
    if (m->ready && l->pb >= 0)
        m->ready(l->pb, m->ready_arg);
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
