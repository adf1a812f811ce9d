/* train_impl.h - private to the trainer: the state of one training run,
 * shared by the loop (train.c) and checkpoints (ckpt.c). */
#ifndef STK_TRAIN_IMPL_H
#define STK_TRAIN_IMPL_H

#include "loader/loader.h"
#include "store/store.h"
#include "trainer.h"

#include <stdio.h>

/* ---- uploads (upload.c) ----------------------------------------------------- */

typedef void (*batch_release_fn)(void *ctx, stk_batch *b);

typedef struct upload_buf {
    uint8_t *x;          /* the device copy of a batch */
    uint64_t *ids;
    int32_t *labels;
    stk_event *copied;   /* copy stream: after the batch's copies */
    stk_event *consumed; /* compute stream: after its last reader */
    bool read;           /* consumed was recorded */
} upload_buf;

/* Batch k copies into buf[k % 2] while batch k - 1 computes; the last batch
 * put stays held until its copy is seen complete. */
typedef struct uploader {
    stk_backend *be;
    upload_buf buf[2]; /* none on the CPU: batches are used in place */
    int next;
    stk_batch held;
    upload_buf *held_buf;
    batch_release_fn release;
    void *ctx;
    bool holding;
} uploader;

/* Device buffers for batches of up to `batch` samples of sample_bytes. */
int uploader_init(uploader *u, stk_backend *be, size_t batch,
                  size_t sample_bytes, stk_err *err);
void uploader_free(uploader *u);
/* Gives back any batch held, queues b's upload and makes the compute
 * stream wait for it; *dev is b with device pointers (b itself on the
 * CPU). b is held: release(ctx, b) gives it back in a later settle. */
int uploader_put(uploader *u, const stk_batch *b, batch_release_fn release,
                 void *ctx, stk_batch *dev, stk_err *err);
/* The compute stream has queued every read of the last batch put: its
 * buffer may take another batch once they are done. */
int uploader_used(uploader *u, stk_err *err);
/* Gives the held batch back once its copy is complete (the host waits for
 * the copy, which was queued a step ago, never for compute). */
int uploader_settle(uploader *u, stk_err *err);

/* The loaders' pinned blocks, allocated once per run and freed at its end. */
enum { PINNED_RING_MAX = 2 * STK_LOADER_MAX_WORKERS + 8 };
typedef struct pinned_block {
    void *p;
    size_t bytes;
    bool used;
} pinned_block;
typedef struct pinned_ring {
    stk_backend *be;
    pinned_block block[PINNED_RING_MAX];
    int n;
} pinned_ring;

/* The allocator for stk_loader_opts.host: blocks a closed loader freed go
 * to the next loader. */
stk_host_alloc pinned_ring_host(pinned_ring *pr, stk_backend *be);
void pinned_ring_free(pinned_ring *pr);

typedef struct run_state {
    const stk_train_opts *o;
    stk_backend *be;
    stk_store *store;
    stk_model_spec spec;
    stk_model *model;
    int classes;
    stk_philox_key key;
    stk_transform transform;
    int in_c, in_h, in_w;    /* the images the model sees */
    stk_augment augment;     /* --augment, AUTO resolved */
    stk_loader_xform train_xf, test_xf; /* the loaders' transforms */
    const char *eval_split;  /* "test", or "val" (ImageNet's layout) */
    stk_host_alloc host;     /* the loader's ring comes from the backend */
    pinned_ring ring;        /* the loaders' slots, pinned once */
    uploader up;             /* batches to the device */
    const int32_t *dev_labels;
    float *x_f;              /* the transformed batch */
    stk_metrics *mdev;       /* the steps' metrics, summed on the device */
    stk_metrics *mhost;      /* pinned: where they are read into */
    stk_event *mread;        /* the read's copy */
    float *state1, *state2;  /* momentum, or AdamW's m and v */
    uint64_t step, total_steps, eval_seen, start_batch;
    uint64_t pos_epoch, pos_batch; /* loader position after the last step */
    int epoch;
    float lr;
    double train_loss, train_acc, best_acc;
    FILE *metrics;
    int lock_fd; /* rank 0: the flock on RUN_DIR/.lock, or -1 */
    bool resumed_here; /* rank 0 resumed a checkpoint of RUN_DIR: its
                          metrics.jsonl is this run's to append to */
    int tty;
    /* data parallelism (group.c) */
    stk_rank_info rank;
    stk_store_server *srv;   /* SLURM rank 0 serves the store itself */
    stk_kv *kv;
    stk_comm *comm;
    stk_ddp *ddp;
    int ddp_rc;              /* the first error of a grads-ready call */
    int agree_steps;         /* the ranks read their metrics and agree on
                                stopping every this many steps */
    float *sync_dev;         /* device scratch for the small reductions */
    uint64_t shard;          /* training samples per rank per epoch */
    uint64_t batches;        /* and batches */
    int saved_world;         /* world size of the resumed checkpoint */
    /* rank 0: the steps each finished epoch took (o->epochs entries; known
     * unless resumed from a checkpoint that did not record them), and the
     * step at which the current epoch began; state.json keeps them so
     * that a resume can check its step against them */
    uint64_t *epoch_steps, epoch_first_step;
    bool epoch_steps_known;
    bool stopped;            /* the ranks agreed to stop (a signal) */
} run_state;

/* ---- data parallelism (group.c) ------------------------------------------ */

/* Ranks whose own figures a step line lists (beyond: the totals only). */
enum { GROUP_LISTED_RANKS = 64 };

/* Joins the group of r->rank (a world of one needs nothing). */
int group_open(run_state *r, stk_err *err);
/* On an error exit, before group_close: the peers' pending and future
 * waits fail at once ("another rank failed", NCCL's abort) instead of
 * waiting out --timeout for this rank. */
void group_abort(run_state *r);
void group_close(run_state *r);
/* Every rank's run against rank 0's, before the first collective that
 * depends on it: the model's parameters (the collectives' lengths), the
 * training flags and the database's shape. A rank that differs fails
 * naming the first field (nodes started by hand with other flags), and
 * the others with it (group_agree). */
int group_check_config(run_state *r, stk_err *err);
/* What the ranks of one run must share, as "field=value" items each ended
 * by '\n': the model, the device kind (not its number: each rank has its
 * own GPU), the data's shape and the flags that decide the data order,
 * the arithmetic and the number of steps. A checkpoint's state.json keeps
 * it too, so that a resume can name what it changes. */
enum { GROUP_CONFIG_MAX = 1400 };
void group_config_text(const run_state *r, char *s, size_t n);
/* Rank 0's weights, buffers, optimizer state and position to every rank. */
int group_share_start(run_state *r, stk_err *err);
/* Rank 0's batchnorm buffers and counters to every rank (DDP's
 * broadcast_buffers): before every evaluation and checkpoint, so that
 * every rank evaluates and saves rank 0's running statistics. */
int group_share_buffers(run_state *r, stk_err *err);
/* The gradient buckets over the model's gradients, and, under --sync-bn,
 * batchnorm's statistics summed over the group. */
int group_ddp(run_state *r, stk_err *err);
/* stk_grads_ready_fn for backward: hands the parameter to DDP. */
void group_grads_ready(int param, void *arg);
/* Values of the weights, buffers and counters whose bits differ from rank
 * 0's on some rank (0 expected: buffers after group_share_buffers). */
int group_compare_weights(run_state *r, uint64_t *differ, stk_err *err);
/* Sums n host floats over the ranks, in place. */
int group_sum(run_state *r, float *v, int n, stk_err *err);
/* group_sum of v[0, n) beside this rank's failure (mine, its error
 * already in err): a rank that failed still joins the sum, so that every
 * rank learns of it at the same point (no one waits out --timeout for it).
 * Returns mine or the sum's error; else 0, v summed and *failed the count
 * of ranks that failed (their values in v are to be ignored then). */
int group_sum_failed(run_state *r, int mine, float *v, int n, int *failed,
                     stk_err *err);
/* Every rank passes its setup's rc: each returns its own error, or an
 * error naming the ranks that failed when it did not, so that no rank
 * waits out --timeout for one that has already given up. */
int group_agree(run_state *r, int rc, stk_err *err);

float stk_train_lr(const stk_train_opts *o, uint64_t step, uint64_t total,
                   int epoch);

/* Draws RUN_DIR/curves.svg (svg_path) from the epoch and step lines of
 * RUN_DIR/metrics.jsonl (metrics_path; lines that do not parse are
 * skipped, and a later line for the same epoch or step replaces an earlier
 * one): loss and accuracy, train and test, and the learning rate against
 * epochs. Written to svg_path.tmp and renamed over svg_path. */
int stk_curves_write(const char *metrics_path, const char *svg_path,
                     stk_err *err);

/* Writes RUN_DIR/checkpoints/step-N (weights, optimizer, state.json with
 * the loader position r->pos_epoch, r->pos_batch) atomically, keeps the
 * last o->keep and the best, and updates RUN_DIR/best.safetensors when
 * is_best. */
int stk_checkpoint_save(run_state *r, bool is_best, stk_err *err);

/* Restores weights, optimizer state and position from a checkpoint
 * directory ("auto": the newest in RUN_DIR/checkpoints); sets
 * r->resumed_here when that directory lies in RUN_DIR/checkpoints. */
int stk_checkpoint_resume(run_state *r, const char *which, stk_err *err);

/* Checks what RUN_DIR/checkpoints holds besides step directories (BEST)
 * is what a run wrote there: a regular file. */
int stk_checkpoint_check_dir(run_state *r, stk_err *err);

/* Loads weights, and batchnorm's buffers and counters where the file has
 * them (--init-from; ckpt.c says what a file without them does). */
int stk_checkpoint_load_weights(run_state *r, const char *path, stk_err *err);

#endif
