/* loader.h - batches from a stoke database (or, for comparison, straight
 * from a raw image folder) through N worker threads into a ring of pinned
 * host buffers, in sampler order, so the accelerator never waits on the CPU.
 *
 *   stk_loader_open(store, &opts, &l)      threads start prefetching
 *   while ((rc = stk_loader_next(l, &b)) == 1) { use b; stk_loader_release(l, &b); }
 *   rc == 0: the epoch ended; the next call starts the next epoch
 *   stk_loader_close(l)                     any time, even mid-epoch
 *
 * Order: batch k of epoch e holds the samples the sampler assigns to this
 * rank, which depend only on (seed, epoch, rank, world, dataset size); the
 * bytes are the same for any number of workers or prefetch depth. */
#ifndef STK_LOADER_H
#define STK_LOADER_H

#include "common/common.h"
#include "preprocess/preprocess.h"
#include "store/store.h"

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define STK_LOADER_MAX_WORKERS 64

/* ---- sampler (torch.utils.data.DistributedSampler semantics) ----------- */

typedef struct stk_sampler {
    uint64_t n;           /* dataset size */
    uint64_t seed;
    int rank, world;
    bool shuffle;
    bool drop_last;       /* trim to equal shards instead of padding */
    bool uneven;          /* no padding, no trimming: shards differ by <= 1
                             (evaluation: every sample exactly once); with
                             fewer samples than ranks, some shards are empty */
} stk_sampler;

/* Samples in this rank's shard per epoch. */
uint64_t stk_sampler_len(const stk_sampler *s);

/* Writes this rank's shard for epoch (stk_sampler_len entries) to out.
 * Shuffled order: Fisher-Yates driven by SplitMix64 keyed by (seed, epoch)
 * (docs/loader.md); padding repeats the permutation from its start. */
int stk_sampler_shard(const stk_sampler *s, uint64_t epoch, uint64_t *out);

/* ---- the loader -------------------------------------------------------- */

/* The augmentation's Philox key for a seed: train's (its dropout key,
 * {seed, seed >> 32 ^ 0x5bd1e995}) with train's augmentation change, so
 * the loader draws the crops and flips `train --augment --seed S` does. */
void stk_loader_aug_key(uint64_t seed, uint32_t key[2]);

/* What the workers make of each sample, torchvision's transforms on the
 * uint8 pixels (preprocess/transform.c); a batch is then C x size x size
 * whatever the stored or decoded image's size. */
typedef enum stk_xform_kind {
    STK_XFORM_NONE = 0, /* the sample as stored (aug_pad, aug_flip apply) */
    STK_XFORM_RRC,      /* RandomResizedCrop(size, scale, ratio) [+ flip] */
    STK_XFORM_CENTRE    /* Resize(resize) + CenterCrop(size) (evaluation) */
} stk_xform_kind;

typedef struct stk_loader_xform {
    stk_xform_kind kind;
    int size;           /* output side, >= 1 */
    double scale[2];    /* RRC: area fraction; {0, 0} = {0.08, 1} */
    double ratio[2];    /* RRC: aspect ratio; {0, 0} = {3/4, 4/3} */
    bool flip;          /* RRC: and a random horizontal flip (p = 1/2) */
    int resize;         /* CENTRE: shorter side; 0 = size / 0.875 */
} stk_loader_xform;

/* Images of one size from a database, as train, sweep and the Python
 * Loader size them: side crop_size, else the stored side, or on an
 * aspect-keeping database (prep --short-side S) 0.875 S (S = 256 gives
 * 224). Fills *centre with the evaluation's Resize(side / ratio) +
 * CenterCrop(side), ratio crop_ratio, else 0.875 on an aspect-keeping
 * database and side / stored side on a fixed one (as stored when side is
 * the stored side). Returns 0, or STK_EINVAL naming db when there is no
 * side to derive (prep --max-side alone, no crop_size). */
int stk_loader_crop_plan(const stk_meta *m, int crop_size, double crop_ratio,
                         const char *db, stk_loader_xform *centre,
                         stk_err *err);

/* The draws of sample index in epoch for STK_XFORM_RRC: the uniforms
 * stk_rrc_box consumes and the flip, from Philox keyed by the seed
 * (docs/loader.md says which counters give which). */
void stk_loader_rrc_draw(uint64_t seed, uint64_t epoch, uint64_t index,
                         double u[STK_RRC_UNIFORMS], bool *flip);

/* Host memory for the batch ring: page-locked on CUDA (cudaHostAlloc),
 * aligned memory on CPU. NULL functions mean aligned_alloc / free. */
typedef struct stk_host_alloc {
    void *(*alloc)(size_t bytes, void *ctx);
    void (*free)(void *p, void *ctx);
    void *ctx;
} stk_host_alloc;

typedef struct stk_loader_opts {
    const char *split;    /* default "train" */
    int batch_size;       /* >= 1 */
    int workers;          /* 0 = load in the caller's thread */
    int prefetch;         /* batches in flight (ring size); 0 =
                             max(4, 2*workers) */
    bool shuffle;
    uint64_t seed;
    bool drop_last;       /* sampler trims and the last short batch is dropped */
    bool uneven;          /* see stk_sampler; an empty shard is no error:
                             each stk_loader_next returns 0 (an epoch ended) */
    int rank, world;      /* world 0 means 1 */
    int aug_pad;          /* augmentation in the workers (train
                             --augment's, on uint8): a random crop with this
                             much zero padding; 0: none */
    bool aug_flip;        /* and a random horizontal flip; both drawn by
                             stk_transform_draw keyed by the seed
                             (stk_loader_aug_key), stream the epoch, counter
                             the sample's index */
    stk_loader_xform xform; /* not with aug_pad or aug_flip */
    int spin_us;          /* how long the one idle worker that watches
                             for freed slots spins before it sleeps, so
                             that releases need not wake it (docs/loader.md);
                             0 = 50 where workers + 1 <= usable CPUs, else
                             none; < 0: idle workers only sleep */
    bool stream_stores;   /* copy records into the ring with
                             stk_copy_stream (non-temporal stores, the
                             lines go to memory, not the worker's cache),
                             a fence before each part of a batch is
                             published: for batches a GPU's copy engine
                             uploads, which read freshly written lines
                             slowly while they were dirty in a CPU's cache
                             (docs/loader.md). Off by default. Only records
                             copied as they are stream: samples that a
                             transform (xform, JPEG decoding) or the
                             augmentation (aug_pad, aug_flip) writes are
                             written as before. */
    uint64_t start_epoch; /* resume position (see stk_loader_position) */
    uint64_t start_batch;
    stk_host_alloc host;
} stk_loader_opts;

typedef struct stk_batch {
    uint64_t epoch, index;  /* which batch this is */
    int n;                  /* samples in it (<= batch_size) */
    size_t sample_bytes;    /* C*H*W (H = W = xform.size with a transform) */
    uint8_t *data;          /* n samples, CHW uint8 each, contiguous; lives
                               in a ring buffer until released */
    int32_t *labels;        /* n */
    uint64_t *indices;      /* n dataset indices */
    int slot;               /* internal */
} stk_batch;

typedef struct stk_loader_pos {
    uint64_t epoch, batch;  /* the next batch stk_loader_next returns */
} stk_loader_pos;

typedef struct stk_loader_stats {
    uint64_t batches, samples, bytes;  /* delivered to the consumer */
    double elapsed;           /* seconds since open */
    double first_batch;       /* seconds from open to the first batch */
    double wait;              /* seconds the consumer spent blocked in next */
    uint64_t wakes;           /* times the consumer (its releases, its
                                 waits) took the lock to wake idle
                                 workers */
    double samples_per_s, bytes_per_s, stall; /* stall = wait / elapsed */
    int workers;
    double busy[STK_LOADER_MAX_WORKERS]; /* seconds each worker filled */
} stk_loader_stats;

typedef struct stk_loader stk_loader;

/* Opens a loader over a split of a complete database (the store must
 * outlive the loader) and starts its workers. */
int stk_loader_open(stk_store *store, const stk_loader_opts *opts,
                    stk_loader **out, stk_err *err);

/* The same machinery over a raw dataset, decoding every sample on every
 * epoch (what a PyTorch ImageFolder does); for `sweep --raw`. split indexes
 * the source's splits. The source must outlive the loader. */
int stk_loader_open_raw(const stk_source *src, int split,
                        const stk_loader_opts *opts, stk_loader **out,
                        stk_err *err);

/* Next batch in order: returns 1 and fills b, 0 at the end of an epoch (the
 * following call starts the next one), or a negative code with err naming
 * the split and key of the sample that failed. One thread at a time calls
 * next (and next_for): a ready batch is taken without the loader's lock. */
int stk_loader_next(stk_loader *l, stk_batch *b, stk_err *err);

/* stk_loader_next waiting at most `seconds` (> 0) for the workers:
 * STK_ETIMEDOUT (err untouched, nothing taken, the loader as it was) when
 * the batch is not ready by then. For callers that must look up between
 * waits (an interpreter checking for Ctrl-C). */
int stk_loader_next_for(stk_loader *l, stk_batch *b, double seconds,
                        stk_err *err);

/* The ring's buffers: batch k of the loader's life (counting from open,
 * over epochs) lives in buffer k % stk_loader_slots until released; a
 * batch still held when the ring comes round to its buffer stops
 * stk_loader_next with an error. */
int stk_loader_slots(const stk_loader *l);

/* Gives a batch's buffer back to the ring and clears b->data. Thread-safe
 * against stk_loader_next. A batch that is not held (released already,
 * through a copy of b, or detached) is left alone: its buffer may be
 * being refilled. */
void stk_loader_release(stk_loader *l, stk_batch *b);

/* Hands a held batch's buffer to the caller for good, and gives its ring
 * slot a fresh one (from opts.host), so that the ring goes on while the
 * caller keeps the batch as long as it likes: for a consumer that cannot
 * say when it is done with a batch (an interpreter's views of it). The
 * batch's pointers stay valid until stk_loader_free_detached, which must
 * come before stk_loader_close; do not release it. STK_ENOMEM leaves the
 * batch held as it was. */
int stk_loader_detach(stk_loader *l, stk_batch *b, stk_err *err);
void stk_loader_free_detached(const stk_loader *l, stk_batch *b);

/* Batches per epoch for this rank. */
uint64_t stk_loader_batches(const stk_loader *l);

/* Where the loader stands: reopening with start_epoch/start_batch set to
 * this continues with exactly the batches an uninterrupted run would get. */
stk_loader_pos stk_loader_position(const stk_loader *l);

void stk_loader_stats_get(const stk_loader *l, stk_loader_stats *out);

/* Stops the workers (mid-epoch is fine: each leaves its batch after the
 * sample it copies) and keeps the ring: batches taken stay valid and may still be
 * released, stk_loader_next refuses (one waiting in another thread
 * returns). For a holder of batches that must outlive the threads (a
 * Python view). Idempotent, not concurrently with itself; NULL is a
 * no-op. */
void stk_loader_stop(stk_loader *l);

/* Stops the workers (mid-epoch is fine) and frees everything. NULL is a
 * no-op. Batches not released become invalid. */
void stk_loader_close(stk_loader *l);

#ifdef __cplusplus
}
#endif

#endif
