/* model_impl.h - the model's insides, shared by model.c (shapes,
 * parameters, memory), model_plan.c (the schedule: fusions, in-place
 * layers, gradient buffers) and model_run.c (forward and backward). Not a
 * public header: stk_model is opaque outside trainer/model*.c. */
#ifndef STK_MODEL_IMPL_H
#define STK_MODEL_IMPL_H

#include "trainer.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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
    float *col;     /* conv: the columns (Winograd: V) of the batch, kept
                       for backward, where the batch is always one piece;
                       else NULL (the model's scratch) */
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
    int bn_add;           /* batchnorm: the add after it (and the ReLU
                             after that), run in its pass; 0: none */
    bool fwd_fused;       /* add, relu: forward run by the batchnorm
                             before them (the ReLU's backward runs) */
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
    int ngrad;   /* gradient buffers (max activation size) */
    float *grad[2 * STK_MAX_LAYERS];
    float *pool_dy; /* a pooled conv's output gradient */
    /* model_conv.c: a convolution's pieces in `ranges` ranges (the CPU's
     * threads; 1 on CUDA), each with scratch of its own, shared by the
     * layers (`scratch_stride` floats a range): a piece's columns
     * (Winograd: V), unless the layer keeps its own (col), then from
     * `scratch_col` on their gradient's (Winograd: M and dM); the weight
     * gradient's units that the ranges after the first stash */
    int ranges;
    float *scratch;
    size_t scratch_col, scratch_stride;
    float *stash;
    size_t stash_floats;
    int front_max; /* tests: range 0 takes at most this many pieces (0: no
                      limit), so that the other ranges surely stash */
    float *dlogits;
    const float *x;           /* the last forward input */
    int n;                    /* and its batch size */
    bool train;               /* and whether it was in training mode */
    stk_grads_ready_fn ready; /* during backward: who hears of final grads */
    void *ready_arg;
};

static inline size_t out_size(const layer *l)
{
    return (size_t)l->oc * l->oh * l->ow;
}

static inline size_t in_size(const layer *l)
{
    return (size_t)l->c * l->h * l->w;
}

static inline const float *param(const stk_model *m, int i)
{
    return i < 0 ? NULL : m->w + m->p[i].offset;
}

static inline float *grad_of(const stk_model *m, int p)
{
    return m->g + m->p[p].offset;
}

/* Input k of layer l as the last forward left it. */
static inline const float *input_of(const stk_model *m, const layer *l, int k)
{
    return l->in[k] == STK_INPUT ? m->x : m->l[l->in[k]].y;
}

/* Layers whose backward works in place on their output gradient (a ReLU's
 * mask, a dropout's, batchnorm's, or nothing at all), so that the buffer
 * can become the input's gradient. */
static inline bool back_in_place(const layer *l)
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

/* A layer's name for messages: its parameter prefix, or its kind and
 * place ("layer 9 (add)"). */
const char *model_label(const layer *l, int index, char *buf, size_t n);

/* model_conv.c: a convolution's forward and backward over n samples; the
 * dropout and max-pool run piece by piece with it (on be, samples
 * [s0, s0 + cn)) also alone; the stash that backward of n samples in
 * ranges needs (floats). */
int model_conv_forward(stk_model *m, int i, const float *x, int n,
                       bool train, stk_philox_key key, uint64_t stream,
                       stk_err *err);
int model_conv_backward(stk_model *m, int i, const float *x, const float *dy,
                        float *dx, int n, stk_philox_key key, uint64_t stream,
                        stk_err *err);
int model_dropout(stk_backend *be, const stk_model *m, int d, float *x,
                  int s0, int cn, stk_philox_key key, uint64_t stream,
                  stk_err *err);
int model_maxpool(stk_backend *be, const layer *p, const float *x, int s0,
                  int cn, stk_err *err);
size_t model_conv_stash(const layer *l, int n);
/* The next of `pieces` pieces for range r, or -1 when none is left, from
 * `claims` (0 at the start). Range 0 takes pieces from the front, in
 * order, at most front_max (1 to pieces) of them, and adds their units to
 * the gradient as they come; the other ranges take them from the back
 * (piece 0 left to range 0) and stash theirs. A range whose thread runs
 * late or slow (a vCPU shared with another process, a layer's stash
 * written to memory) takes fewer pieces, so the ranges finish within a
 * piece of each other. */
int model_conv_claim(_Atomic uint64_t *claims, int pieces, int front_max,
                     int r);

/* Plans the built model's schedule (model_plan.c). */
void model_plan(stk_model *m);

#endif
