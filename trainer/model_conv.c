/* model_conv.c - a convolution's forward and backward, piece by piece
 * (pieces of the batch whose scratch stays in cache), with the dropout
 * and max-pool fused after it.
 *
 * On a CPU of several threads the pieces run in ranges, a thread's share
 * of the batch each (stk_backend_ranges), so that a piece's transforms,
 * GEMMs and outputs stay in one core's cache; cutting every op across the
 * threads instead moves about half of each op's data between cores. The
 * floats do not change: forward has nothing to sum across pieces, and the
 * weight gradient's sum over the batch (Winograd: dU piece by piece;
 * im2col: dW sample by sample) stays in the order of one thread. Range 0
 * takes pieces from the front and adds their units (pieces or samples) to
 * the gradient as they come; the later ranges take pieces from the back
 * and stash their units, added in order once the ranges meet, which
 * equals adding them as they come where the GEMM adds its product with
 * one rounding (stk_gemm_adds_once). */
#include "model_impl.h"

#include <stdatomic.h>

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

int model_dropout(stk_backend *be, const stk_model *m, int d, float *x, int s0,
                  int cn, stk_philox_key key, uint64_t stream, stk_err *err)
{
    const layer *l = &m->l[d];
    size_t per = out_size(l);
    size_t group = l->s.kind == STK_L_DROPOUT2D ? (size_t)l->h * l->w : 1;
    return stk_dropout(be, x + per * s0, per * cn, per * s0, group, l->s.p,
                       key, layer_stream(stream, d), err);
}

int model_maxpool(stk_backend *be, const layer *p, const float *x, int s0,
                  int cn, stk_err *err)
{
    size_t in = in_size(p) * s0, out = out_size(p) * s0;
    return stk_maxpool_fwd(be, x + in, cn * p->c, p->h, p->w, p->s.k,
                           p->s.stride, p->y + out, p->arg + out, err);
}

/* ---- pieces, ranges and the stash ---------------------------------------- */

static int pieces(const layer *l, int n)
{
    return (n + l->piece - 1) / l->piece;
}

static int im2col_k(const layer *l)
{
    return l->cs.c * l->cs.kh * l->cs.kw;
}

/* The weight gradient's units: Winograd's dU of each piece (STK_WINO_P
 * points of `len` floats, `stride` apart), im2col's dW of each sample. */
typedef struct units {
    int count, points;
    size_t len, stride;
} units;

static units units_of(const layer *l, int n)
{
    if (l->wino) {
        size_t len = (size_t)l->oc * l->c;
        return (units){pieces(l, n), STK_WINO_P, len, stk_wino_stride(len)};
    }
    size_t len = (size_t)l->oc * im2col_k(l);
    return (units){n, 1, len, len};
}

size_t model_conv_stash(const layer *l, int n)
{
    units u = units_of(l, n);
    return (size_t)u.count * u.points * u.stride;
}

/* Whether every unit's GEMM adds its product with one rounding. */
static bool sum_cuts(stk_model *m, const layer *l, int n)
{
    if (!l->wino)
        return stk_gemm_adds_once(m->be, false, true, l->oc, im2col_k(l),
                                  l->oh * l->ow);
    int th, tw, t = stk_wino_tiles(&l->cs, &th, &tw);
    int last = n - (pieces(l, n) - 1) * l->piece;
    return stk_gemm_adds_once(m->be, false, true, l->oc, l->c, l->piece * t) &&
           stk_gemm_adds_once(m->be, false, true, l->oc, l->c, last * t);
}

/* The ranges a convolution of n samples runs in: the model's, at most
 * one per piece, where there are two pieces at least and, backward, the
 * weight gradient's sum can be cut (same floats) with a stash large
 * enough; else one, each op cut across the threads. */
static int conv_ranges(stk_model *m, const layer *l, int n, bool backward)
{
    int r = m->ranges < pieces(l, n) ? m->ranges : pieces(l, n);
    if (r < 2)
        return 1;
    if (backward &&
        (!sum_cuts(m, l, n) || model_conv_stash(l, n) > m->stash_floats))
        return 1;
    return r;
}

typedef struct conv_job {
    stk_model *m;
    layer *l;
    const float *x, *dy;  /* dy: the conv's own output gradient */
    const float *pool_dy; /* a pooled conv: the pool's */
    float *dx;
    int n, ranges;
    bool train;
    stk_philox_key key;
    uint64_t stream;
    /* pieces claimed: from the front (low half), from the back (high) */
    _Atomic uint64_t claims;
} conv_job;

int model_conv_claim(_Atomic uint64_t *claims, int pieces, int front_max,
                     int r)
{
    uint64_t w = atomic_load_explicit(claims, memory_order_relaxed);
    for (;;) {
        int front = (int)(uint32_t)w, back = (int)(w >> 32);
        int next = r == 0 ? front : pieces - 1 - back;
        if (next < front || next > pieces - 1 - back ||
            (r == 0 && next >= front_max) || (r > 0 && next == 0))
            return -1;
        uint64_t to = r == 0 ? w + 1 : w + (UINT64_C(1) << 32);
        if (atomic_compare_exchange_weak_explicit(
                claims, &w, to, memory_order_relaxed, memory_order_relaxed))
            return next;
    }
}

static int claim(conv_job *j, int r)
{
    int p = pieces(j->l, j->n), most = j->m->front_max;
    return model_conv_claim(&j->claims, p, most > 0 && most < p ? most : p, r);
}

/* The pieces range 0 took: the units from there on were stashed. */
static int front_of(conv_job *j)
{
    return (int)(uint32_t)atomic_load(&j->claims);
}

/* Range r's tools: its backend, scratch and stash. */
typedef struct conv_range {
    stk_backend *be;   /* the model's, or range r's view */
    float *col, *dcol; /* im2col's columns and their gradient; V and M */
    float *stash;      /* NULL: units added to the gradient */
    bool bias;         /* the pieces add the bias gradient (one range) */
} conv_range;

static conv_range range_of(const conv_job *j, int r, stk_backend *view)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    float *own = m->scratch + (size_t)r * m->scratch_stride;
    return (conv_range){.be = view,
                        .col = l->col ? l->col : own,
                        .dcol = own + m->scratch_col,
                        .stash = r > 0 ? m->stash : NULL,
                        .bias = j->ranges == 1 && l->pb >= 0};
}

/* The samples of the piece from sample s0: a piece's, or the rest. */
static int piece_len(const conv_job *j, int s0)
{
    return j->n - s0 < j->l->piece ? j->n - s0 : j->l->piece;
}

/* Where unit k of the weight gradient is stashed. */
static float *stash_unit(float *stash, const units *u, int k)
{
    return stash + (size_t)k * u->points * u->stride;
}

/* ---- forward ------------------------------------------------------------- */

/* Winograd, one piece: V from the input, M_p = U_p V_p (U transformed
 * before the first piece), outputs (with the bias, if any) from M. */
static int wino_forward_piece(const conv_job *j, const conv_range *c, int s0,
                              int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), ch = l->c,
                oc = l->oc;
    int rc =
        stk_wino_input(c->be, j->x + s0 * in_size(l), &l->cs, cn, c->col, err);
    if (!rc)
        rc = stk_gemm_batched(c->be, false, false, oc, nt, ch, 1.0f, l->u, ch,
                              stk_wino_stride((size_t)oc * ch), c->col, nt,
                              stk_wino_stride((size_t)ch * nt), 0.0f, c->dcol,
                              nt, stk_wino_stride((size_t)oc * nt), STK_WINO_P,
                              err);
    return rc ? rc
              : stk_wino_output(c->be, c->dcol, param(m, l->pb), &l->cs, oc,
                                cn, l->y + s0 * out_size(l), err);
}

/* im2col, one piece: columns [K, n*HW]; W [cout, K] times each sample's
 * [K, HW] block is that sample's [cout, HW] output, in place in NCHW (no
 * swap), plus the bias (if any) while the piece is in cache (a pass over the
 * whole output afterwards would read it back from memory). */
static int im2col_forward_piece(const conv_job *j, const conv_range *c, int s0,
                                int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int K = im2col_k(l), hw = l->oh * l->ow;
    float *y = l->y + s0 * out_size(l);
    int rc =
        stk_im2col(c->be, j->x + s0 * in_size(l), &l->cs, cn, c->col, err);
    if (!rc)
        rc = stk_gemm_batched(c->be, false, false, l->oc, hw, K, 1.0f,
                              param(m, l->pw), K, 0, c->col, cn * hw,
                              (size_t)hw, 0.0f, y, hw, out_size(l), cn, err);
    if (!rc && l->pb >= 0)
        rc = stk_bias_add(c->be, y, param(m, l->pb), cn, l->oc, hw, err);
    return rc;
}

/* One piece forward, with the dropout and the max-pool that follow a
 * pooled convolution on each piece as it comes. */
static int forward_piece(const conv_job *j, const conv_range *c, int s0,
                         int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int rc = l->wino ? wino_forward_piece(j, c, s0, cn, err)
                     : im2col_forward_piece(j, c, s0, cn, err);
    if (!rc && l->drop_at && j->train)
        rc = model_dropout(c->be, m, l->drop_at, l->y, s0, cn, j->key,
                           j->stream, err);
    if (!rc && l->pool_at)
        rc = model_maxpool(c->be, &m->l[l->pool_at], l->y, s0, cn, err);
    return rc;
}

typedef int (*piece_fn)(const conv_job *j, const conv_range *c, int s0, int cn,
                        stk_err *err);

/* Range r's pieces, each through `step`, as the range claims them. */
static int run_range(conv_job *j, int r, stk_backend *view, piece_fn step,
                     stk_err *err)
{
    conv_range c = range_of(j, r, view);
    int rc = 0;
    for (int k; !rc && (k = claim(j, r)) >= 0;) {
        int s0 = k * j->l->piece;
        rc = step(j, &c, s0, piece_len(j, s0), err);
    }
    return rc;
}

static int forward_range(void *arg, int r, stk_backend *view, stk_err *err)
{
    return run_range(arg, r, view, forward_piece, err);
}

int model_conv_forward(stk_model *m, int i, const float *x, int n, bool train,
                       stk_philox_key key, uint64_t stream, stk_err *err)
{
    layer *l = &m->l[i];
    conv_job j = {.m = m,
                  .l = l,
                  .x = x,
                  .n = n,
                  .train = train,
                  .key = key,
                  .stream = stream,
                  .ranges = conv_ranges(m, l, n, false)};
    atomic_init(&j.claims, 0);
    int rc = l->wino ? stk_wino_filter(m->be, param(m, l->pw), l->oc, l->c,
                                       l->u, err)
                     : 0;
    if (!rc)
        rc = stk_backend_ranges(m->be, j.ranges, forward_range, &j, err);
    l->col_kept = l->col && l->piece >= n;
    return rc;
}

/* ---- backward ------------------------------------------------------------ */

/* Winograd, one piece: dM from dy; dU_p (+)= dM_p V_p^T (V rebuilt unless
 * forward left the whole batch's); dV_p = U_p^T dM_p into V's place, then
 * back to pixels; db += the piece's sums (if it has a bias). */
static int wino_backward_piece(const conv_job *j, const conv_range *c, int s0,
                               int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int th, tw, nt = cn * stk_wino_tiles(&l->cs, &th, &tw), ch = l->c,
                oc = l->oc;
    units u = units_of(l, j->n);
    size_t sv = stk_wino_stride((size_t)ch * nt),
           sm = stk_wino_stride((size_t)oc * nt);
    float *du = c->stash ? stash_unit(c->stash, &u, s0 / l->piece) : l->du;
    float beta = c->stash || s0 == 0 ? 0.0f : 1.0f; /* the first, or apart */
    int rc = stk_wino_output_grad(c->be, j->dy + s0 * out_size(l), &l->cs, oc,
                                  cn, c->dcol, err);
    if (!rc && !l->col_kept)
        rc = stk_wino_input(c->be, j->x + s0 * in_size(l), &l->cs, cn, c->col,
                            err);
    if (!rc)
        rc = stk_gemm_batched(c->be, false, true, oc, ch, nt, 1.0f, c->dcol,
                              nt, sm, c->col, nt, sv, beta, du, ch, u.stride,
                              STK_WINO_P, err);
    if (!rc && j->dx) {
        rc = stk_gemm_batched(c->be, true, false, ch, nt, oc, 1.0f, l->u, ch,
                              u.stride, c->dcol, nt, sm, 0.0f, c->col, nt, sv,
                              STK_WINO_P, err);
        if (!rc)
            rc = stk_wino_input_grad(c->be, c->col, &l->cs, cn,
                                     j->dx + s0 * in_size(l), err);
    }
    if (!rc && c->bias)
        rc = stk_bias_grad(c->be, j->dy + s0 * out_size(l), grad_of(m, l->pb),
                           cn, oc, l->oh * l->ow, err);
    return rc;
}

/* dW += dy cols^T for one im2col piece, dy [n, cout, HW]. The CPU sums
 * sample by sample (each a [cout, HW] block against its [K, HW] columns);
 * CUDA, with the whole batch as one piece, swaps dy to [cout, n*HW] for
 * one GEMM instead of n small ones. */
static int im2col_weight_grad(const conv_job *j, const conv_range *c, int s0,
                              int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int K = im2col_k(l), hw = l->oh * l->ow, nhw = cn * hw;
    const float *dy = j->dy + s0 * out_size(l);
    float *dw = grad_of(m, l->pw);
    if (stk_backend_kind(m->be) == STK_DEV_CPU) {
        units u = units_of(l, j->n);
        int rc = 0;
        for (int s = 0; s < cn && !rc; s++) {
            float *to = c->stash ? stash_unit(c->stash, &u, s0 + s) : dw;
            rc = stk_gemm(c->be, false, true, l->oc, K, hw, 1.0f,
                          dy + s * out_size(l), hw, c->col + (size_t)s * hw,
                          nhw, c->stash ? 0.0f : 1.0f, to, K, err);
        }
        return rc;
    }
    int rc = stk_swap01(c->be, dy, m->tmp, (size_t)cn, (size_t)l->oc,
                        (size_t)hw, err);
    return rc ? rc
              : stk_gemm(c->be, false, true, l->oc, K, nhw, 1.0f, m->tmp, nhw,
                         c->col, nhw, 1.0f, dw, K, err);
}

/* im2col, one piece: db += dy's sums per channel, dW += dy cols^T, and
 * each sample's dcols = W^T dy, then back to pixels. The columns are
 * rebuilt from x unless the batch was one piece, whose columns forward
 * left in place. */
static int im2col_backward_piece(const conv_job *j, const conv_range *c,
                                 int s0, int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int K = im2col_k(l), hw = l->oh * l->ow;
    const float *dy = j->dy + s0 * out_size(l);
    int rc = c->bias ? stk_bias_grad(c->be, dy, grad_of(m, l->pb), cn, l->oc,
                                     hw, err)
                     : 0;
    if (!rc && !l->col_kept)
        rc =
            stk_im2col(c->be, j->x + s0 * in_size(l), &l->cs, cn, c->col, err);
    if (!rc)
        rc = im2col_weight_grad(j, c, s0, cn, err);
    if (!rc && j->dx)
        rc = stk_gemm_batched(c->be, true, false, K, hw, l->oc, 1.0f,
                              param(m, l->pw), K, 0, dy, hw, out_size(l), 0.0f,
                              c->dcol, cn * hw, (size_t)hw, cn, err);
    if (!rc && j->dx)
        rc = stk_col2im(c->be, c->dcol, &l->cs, cn, j->dx + s0 * in_size(l),
                        err);
    return rc;
}

/* One piece backward; a pooled conv runs the pool's backward (and its
 * dropout's) on the piece first, into pool_dy. */
static int backward_piece(const conv_job *j, const conv_range *c, int s0,
                          int cn, stk_err *err)
{
    stk_model *m = j->m;
    const layer *l = j->l;
    int rc = 0;
    if (l->pool_at) {
        const layer *pool = &m->l[l->pool_at];
        size_t at = out_size(pool) * s0;
        rc = stk_maxpool_bwd(c->be, j->pool_dy + at, pool->arg + at,
                             cn * pool->c, pool->h, pool->w, pool->s.k,
                             pool->s.stride, m->pool_dy + out_size(l) * s0,
                             err);
    }
    if (!rc && l->drop_at && j->train)
        rc = model_dropout(c->be, m, l->drop_at, m->pool_dy, s0, cn, j->key,
                           j->stream, err);
    if (!rc)
        rc = l->wino ? wino_backward_piece(j, c, s0, cn, err)
                     : im2col_backward_piece(j, c, s0, cn, err);
    return rc;
}

static int backward_range(void *arg, int r, stk_backend *view, stk_err *err)
{
    return run_range(arg, r, view, backward_piece, err);
}

/* Range r's slice of each point: the stashed units added to the weight
 * gradient in order. */
static int add_stash_range(void *arg, int r, stk_backend *view, stk_err *err)
{
    conv_job *j = arg;
    const layer *l = j->l;
    units u = units_of(l, j->n);
    size_t lo = u.len * r / j->ranges, hi = u.len * (r + 1) / j->ranges;
    float *grad = l->wino ? l->du : grad_of(j->m, l->pw);
    int first = l->wino ? front_of(j) : front_of(j) * l->piece, rc = 0;
    for (int k = first; k < u.count && !rc; k++) {
        const float *from = stash_unit(j->m->stash, &u, k);
        for (int p = 0; p < u.points && !rc; p++) {
            size_t at = (size_t)p * u.stride + lo;
            rc = stk_axpy(view, hi - lo, 1.0f, from + at, grad + at, err);
        }
    }
    return rc;
}

/* The bias gradient piece by piece, in the order of one range. */
static int bias_grads(const conv_job *j, stk_err *err)
{
    const layer *l = j->l;
    int rc = 0;
    for (int s0 = 0; s0 < j->n && !rc && l->pb >= 0; s0 += l->piece)
        rc = stk_bias_grad(j->m->be, j->dy + s0 * out_size(l),
                           grad_of(j->m, l->pb), piece_len(j, s0), l->oc,
                           l->oh * l->ow, err);
    return rc;
}

/* dW is final only after the last piece (Winograd: once dU's adjoint
 * transform is added), so the caller reports the layer's gradients after
 * its input gradient. */
int model_conv_backward(stk_model *m, int i, const float *x, const float *dy,
                        float *dx, int n, stk_philox_key key, uint64_t stream,
                        stk_err *err)
{
    layer *l = &m->l[i];
    bool pooled = l->pool_at > 0;
    conv_job j = {.m = m,
                  .l = l,
                  .x = x,
                  .dy = pooled ? m->pool_dy : dy,
                  .pool_dy = dy,
                  .dx = dx,
                  .n = n,
                  .train = m->train,
                  .key = key,
                  .stream = stream,
                  .ranges = conv_ranges(m, l, n, true)};
    atomic_init(&j.claims, 0);
    int rc = stk_backend_ranges(m->be, j.ranges, backward_range, &j, err);
    if (dx)
        l->col_kept = false; /* V's place now holds dV */
    if (!rc && j.ranges > 1 && front_of(&j) < pieces(l, n))
        rc = stk_backend_ranges(m->be, j.ranges, add_stash_range, &j, err);
    if (!rc && j.ranges > 1)
        rc = bias_grads(&j, err);
    if (!rc && l->wino)
        rc = stk_wino_filter_grad(m->be, l->du, l->oc, l->c, grad_of(m, l->pw),
                                  err);
    return rc;
}
