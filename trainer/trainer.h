/* trainer.h - models, optimizers, schedules, the training loop,
 * evaluation, metrics and checkpoints.
 *
 * A model is a graph of layers (conv, pool, avgpool, globalpool, relu,
 * dropout, dropout2d, flatten, linear, batchnorm, add), listed so that
 * every layer reads earlier ones only (by default the one before it).
 * Parameters live in one contiguous buffer, in layer order, with the
 * gradients in a second buffer of the same layout: backward runs the
 * layers in reverse order, so the distributed trainer all-reduces that
 * buffer in buckets from its end (last layers first) while backward runs.
 * Batchnorm's running statistics are buffers of their own (never touched
 * by the optimizer or DDP's reduction). Names follow the equivalent PyTorch
 * module ("conv1.weight", "layer1.0.bn1.running_mean") so checkpoints load
 * into it. */
#ifndef STK_TRAINER_H
#define STK_TRAINER_H

#include "common/common.h"
#include "distributed/distributed.h"
#include "kernels/kernels.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STK_MAX_LAYERS 256
#define STK_NAME_MAX 64

/* ---- models ---------------------------------------------------------------- */

typedef enum stk_layer_kind {
    STK_L_CONV, STK_L_POOL, STK_L_RELU, STK_L_DROPOUT, STK_L_DROPOUT2D,
    STK_L_FLATTEN, STK_L_LINEAR,
    STK_L_BATCHNORM,  /* 2-d over N, H, W per channel; 1-d after linear */
    STK_L_ADD,        /* the sum of two earlier outputs of one shape */
    STK_L_AVGPOOL,    /* k x k average pool, stride k unless given */
    STK_L_GLOBALPOOL  /* average over each channel's whole plane */
} stk_layer_kind;

/* The model's input, as a layer index in stk_layer_spec.in. */
#define STK_INPUT (-1)

/* A layer as specified, before shapes are known. A zeroed spec with a kind
 * is a layer reading the one before it. */
typedef struct stk_layer_spec {
    stk_layer_kind kind;
    char name[STK_NAME_MAX]; /* parameter prefix and the name other layers
                                read it by; "" = automatic */
    int out;                 /* conv: channels; linear: features (0 = classes) */
    int k, stride, pad;      /* conv, pool, avgpool */
    float p;                 /* dropout */
    bool no_bias;            /* conv, linear: bias=false */
    int nin;                 /* 0: reads the layer before; else in[0..nin) */
    int in[2];               /* earlier layer indices, or STK_INPUT */
} stk_layer_spec;

/* How 3x3 convolutions of stride 1 (and at least 8 channels in and out)
 * are computed: Winograd F(2x2, 3x3), the default, or im2col + GEMM like
 * every other convolution (docs/architecture.md, "Convolutions"). */
typedef enum stk_conv_algo { STK_CONV_AUTO = 0, STK_CONV_IM2COL } stk_conv_algo;

typedef struct stk_model_spec {
    int n;
    stk_layer_spec layers[STK_MAX_LAYERS];
    stk_conv_algo conv;
} stk_model_spec;

/* Built-ins: "cnn" (the PyTorch DDP tutorial network), "mlp"
 * (784-256-128-10, adapted to the input and class count), "resnet20" (He
 * et al.'s CIFAR ResNet) and "resnet18" (its CIFAR variant, torchvision's
 * parameter names); docs/models.md. */
int stk_model_builtin(const char *name, stk_model_spec *out, stk_err *err);

/* Parses the text format of docs/models.md (one layer per line; inputs by
 * name, resolved to indices in stk_layer_spec.in). A malformed line, a
 * name read before it is defined (or never), two layers of one name: an
 * error naming FILE:LINE. The built-ins are such texts (models/). */
int stk_model_parse(const char *text, const char *file, stk_model_spec *out,
                    stk_err *err);

/* One parameter tensor: a view into the model's parameter buffer (or, for
 * a buffer such as running_mean, into the model's buffer of buffers). */
typedef struct stk_param {
    char name[STK_NAME_MAX + 32]; /* layer name + ".weight" */
    int ndim, shape[4];
    size_t offset, count; /* in floats, within the flat buffers */
    bool no_decay;        /* a bias or a batchnorm weight: weight decay
                             skips it under --no-decay-norm-bias */
} stk_param;

typedef struct stk_model stk_model;

/* Builds spec for inputs of shape c x h x w and nclasses outputs on the
 * backend, for batches of up to max_batch samples, initialised as PyTorch
 * does (kaiming_uniform_(a=sqrt(5)) weights, U(+-1/sqrt(fan_in)) biases)
 * from seed; batchnorm weight 1, bias 0, running mean 0, variance 1. A
 * spec that does not fit the shape (a kernel larger than its input, an
 * add of two shapes, a batchnorm that can only see one value per channel
 * in training: 1x1 planes and max_batch 1), reads a later layer, or has
 * an output no layer reads (but the last) is an error naming the layer
 * and the shapes. */
int stk_model_create(stk_backend *be, const stk_model_spec *spec, int c,
                     int h, int w, int nclasses, int max_batch, uint64_t seed,
                     stk_model **out, stk_err *err);
void stk_model_destroy(stk_model *m); /* NULL is a no-op */

int stk_model_nparams(const stk_model *m);
const stk_param *stk_model_param(const stk_model *m, int i);
size_t stk_model_param_count(const stk_model *m); /* floats */
float *stk_model_weights(stk_model *m);   /* device memory, flat */
float *stk_model_grads(stk_model *m);     /* device memory, flat */
/* Buffers: batchnorm's running_mean and running_var ([C] each, in layer
 * order, one flat device array of stk_model_buffer_count floats; a new
 * model's are 0 and 1), never optimized or all-reduced. */
int stk_model_nbuffers(const stk_model *m);
const stk_param *stk_model_buffer(const stk_model *m, int i);
size_t stk_model_buffer_count(const stk_model *m); /* floats */
float *stk_model_buffers(stk_model *m);              /* device memory, flat */

/* Batchnorm's num_batches_tracked, one host counter per batchnorm layer
 * (int64 0-dim tensors in PyTorch's state dict), counted by forward in
 * training. */
int stk_model_ncounters(const stk_model *m);
const char *stk_model_counter_name(const stk_model *m, int i);
int64_t *stk_model_counter(stk_model *m, int i);

/* Sums n floats of device memory over the data-parallel group, in place
 * (the same call on every rank, in the same order). */
typedef int (*stk_allreduce_fn)(void *arg, float *buf, int n, stk_err *err);
/* SyncBatchNorm: batchnorm layers in training take their statistics (and
 * their backward's sums) over all `world` ranks through fn, every rank's
 * batch being of the same size. fn NULL: each rank's own batch. */
void stk_model_sync_bn(stk_model *m, stk_allreduce_fn fn, void *arg,
                       int world);

/* Makes g the gradient buffer, zeroed: backend memory for
 * stk_model_param_count floats that the caller owns and keeps until the
 * model is destroyed (DDP's buffer that the all-reduce sums in place). */
int stk_model_use_grads(stk_model *m, float *g, stk_err *err);

/* The first batchnorm (its label written to buf) that would see one value
 * per channel in a training batch of n samples (1x1 planes, one sample,
 * its statistics not summed over ranks); NULL where none would: such a
 * batch fails in forward, as PyTorch's does. */
const char *stk_model_single_value_bn(const stk_model *m, int n, char *buf,
                                      size_t size);

/* A one-line description: layers with output shapes and parameter count. */
void stk_model_describe(const stk_model *m, char *buf, size_t n);

/* Forward pass of n samples x (device, float NCHW) to logits (returned,
 * device memory owned by the model, n x classes). train is training mode:
 * dropout (masks keyed by (key, stream)) and batchnorm on batch
 * statistics, updating the running ones; otherwise evaluation mode. A
 * batchnorm in training that would see one value per channel is an error
 * naming the layer and the shape (PyTorch refuses it too). */
int stk_model_forward(stk_model *m, const float *x, int n, bool train,
                      stk_philox_key key, uint64_t stream,
                      const float **logits, stk_err *err);

/* Called by backward once parameter `param`'s gradient is final (both of a
 * layer's, before the layer's input gradient is computed), last layer
 * first: DDP starts reducing a bucket when all of its parameters are. */
typedef void (*stk_grads_ready_fn)(int param, void *arg);

/* Backward from dlogits (device, n x classes) into the gradient buffer:
 * zeroed first, or added to when accumulate (gradient accumulation), in
 * the mode of the last forward (after an evaluation forward, batchnorm's
 * statistics are constants). key and stream must be the forward's. */
int stk_model_backward(stk_model *m, const float *dlogits, int n,
                       stk_philox_key key, uint64_t stream, bool accumulate,
                       stk_grads_ready_fn ready, void *arg, stk_err *err);

/* Scratch of n floats owned by the model (device), for dlogits. */
float *stk_model_dlogits(stk_model *m);

/* ---- training ---------------------------------------------------------- */

typedef enum stk_optim { STK_OPT_SGD, STK_OPT_ADAMW } stk_optim;
/* Learning-rate schedules (docs/cli.md): constant; step (x gamma every
 * step_size epochs); cosine and linear (decay to 0 over the steps after
 * the warm-up); onecycle (PyTorch's OneCycleLR with its defaults, max_lr
 * = lr: its own warm-up over the first 30% of the steps, so warmup is not
 * used; momentum is not cycled, as cycle_momentum=False). */
typedef enum stk_sched {
    STK_SCHED_CONSTANT, STK_SCHED_STEP, STK_SCHED_COSINE, STK_SCHED_LINEAR,
    STK_SCHED_ONECYCLE
} stk_sched;

/* The flags' spellings of stk_optim (--optim), stk_sched (--schedule) and
 * stk_conv_algo (--conv), in enum order: the one table that the parser,
 * state.json and the ranks' configuration check read. */
extern const char *const stk_optim_names[2];
extern const char *const stk_sched_names[5];
extern const char *const stk_conv_names[2];

/* The training transform (--augment). CROP is the CIFAR recipe's random
 * crop with h/8 zero padding and a horizontal flip, drawn on the device
 * (or the CPU backend) as the batch is normalised; RRC is ImageNet's
 * RandomResizedCrop and a flip, done by the loader's workers on uint8
 * records of any size. AUTO: RRC on an aspect-keeping database, else
 * NONE. */
typedef enum stk_augment {
    STK_AUG_AUTO, STK_AUG_NONE, STK_AUG_CROP, STK_AUG_RRC
} stk_augment;

typedef struct stk_train_opts {
    const char *db;           /* database directory (train and test splits) */
    stk_device_kind device;
    int device_id, threads;   /* threads: BLAS threads on the CPU, 0 = all */
    const char *model;        /* "cnn", "mlp" or a model file */
    int epochs, batch, workers;
    stk_optim optim;
    float lr, momentum, weight_decay, clip; /* clip: max grad norm, 0 = off;
                                 lr, weight_decay < 0: the optimizer's default */
    bool nesterov;
    bool no_decay_norm_bias;  /* weight decay on conv and linear weights
                                 only (stk_param.no_decay skipped) */
    float label_smoothing;    /* in [0, 1): PyTorch's CrossEntropyLoss
                                 label_smoothing, training and test loss */
    stk_sched sched;
    int warmup;               /* steps of linear warm-up (not onecycle) */
    int step_size;            /* step schedule: epochs per decay */
    float gamma;
    stk_augment augment;      /* the training transform */
    int crop_size;            /* side of the loader's output (rrc, and the
                                 evaluation's centre crop); 0: the stored
                                 side (fixed-size databases) or 0.875 of
                                 the shorter side (aspect-keeping ones) */
    float crop_ratio;         /* evaluation: resize the shorter side to
                                 crop_size / crop_ratio, centre crop; 0:
                                 0.875 (aspect-keeping) or crop / stored */
    double rrc_scale[2];      /* RandomResizedCrop's area fraction range;
                                 0,0: torchvision's (0.08, 1) */
    bool dropout;             /* false: every dropout layer's p is 0 (the
                                 identity; batchnorm still trains) */
    stk_conv_algo conv;       /* 3x3 convolutions: Winograd or im2col */
    uint64_t seed;
    const char *out;          /* RUN_DIR: metrics.jsonl, checkpoints/ */
    const char *resume;       /* NULL, "auto" or a checkpoint directory */
    const char *init_from;    /* safetensors weights to start from */
    int log_every;            /* steps between metric lines */
    int keep;                 /* checkpoints kept besides the best */
    int max_steps;            /* stop after this many steps (0 = all) */
    bool quiet;
    const atomic_int *stop; /* non-zero: stop at the next step boundary */
    int accum;                /* micro-batches per optimizer step (>= 1) */
    /* data parallelism: this process's rank (NULL: a world of one), the
     * DDP bucket size and the timeout of every wait on the other ranks */
    const stk_rank_info *rank;
    float bucket_mb;
    int timeout_s;
    bool sync_bn;             /* batchnorm's statistics over all ranks */
    bool evaluate;            /* the test split with init_from's weights,
                                 nothing trained nor written (PyTorch
                                 examples' --evaluate) */
} stk_train_opts;

/* Fills opts with the defaults that train Fashion-MNIST well. */
void stk_train_defaults(stk_train_opts *o);

typedef struct stk_train_result {
    bool evaluated;           /* o->evaluate: test_acc and test_loss alone */
    const char *eval_split;   /* "test", or "val" where there is no test */
    bool stopped;             /* by o->stop or max_steps; checkpoint written */
    bool at_max_steps;        /* resumed at or past max_steps: nothing ran */
    int epochs_done;
    uint64_t steps;
    double test_acc, test_loss, train_loss;
    double best_acc;
} stk_train_result;

/* Whether the options agree with themselves (--nesterov needs SGD's
 * momentum above 0, as in PyTorch; counts are >= 1; label smoothing in
 * [0, 1)), before anything is
 * opened: STK_EINVAL naming the flag. stk_train_run checks them first; a
 * CLI calls this too, to tell bad usage from a run that failed. */
int stk_train_check_opts(const stk_train_opts *o, stk_err *err);

/* Trains and evaluates every epoch; writes RUN_DIR/metrics.jsonl and
 * checkpoints. Errors (options as stk_train_check_opts, a model that does
 * not fit the data, a checkpoint that does not fit the model, a NaN loss)
 * name the cause. */
int stk_train_run(const stk_train_opts *o, stk_train_result *res,
                  stk_err *err);

#ifdef __cplusplus
}
#endif

#endif
