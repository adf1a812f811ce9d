/* loader.c - worker threads filling a ring of batch buffers in sampler
 * order.
 *
 * Batches are numbered by a sequence s = 0, 1, 2, ... from the start
 * position; batch s lives in ring slot s % K. A worker claims the next
 * sequence number when its slot is free and copies the batch's indices from
 * the epoch's shard; the batch is cut into one part per worker (fewer for
 * small batches of copied samples), which the workers take in (batch,
 * part) order and fill outside the lock, so all of them work on the
 * oldest batch first (the first batch comes W times sooner than if one
 * worker filled it). The consumer takes sequence numbers
 * in order and hands slots back with release. So the output order is fixed
 * whatever the scheduling, and memory is K buffers. */
#include "loader.h"

#include "kernels/ops_inline.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { SLOT_FREE, SLOT_FILLING, SLOT_READY, SLOT_HELD };

static uint64_t tag(uint64_t seq, int state)
{
    return seq << 2 | (uint64_t)state;
}

typedef struct slot {
    /* The batch's sequence number and the slot's state in one word
     * (tag()), so that a release compares both at once: a stale copy of an
     * older batch in the same buffer must not free a newer one. Moved
     * under mu, except that the consumer takes a ready batch and gives a
     * held one back without it (take_ready, stk_loader_release): a
     * worker's READY store publishes the batch (n, rc, the bytes), a
     * release's FREE store the consumer's last reads of it. */
    _Atomic uint64_t tag;
    int n;
    int parts, parts_left; /* parts handed out in turn; not yet filled */
    uint8_t *data;
    int32_t *labels;
    uint64_t *indices;
    int rc, rc_part; /* the error of the lowest failed part */
    stk_err err;
} slot;

static int slot_state(const slot *sl) { return (int)(sl->tag & 3); }
static uint64_t slot_seq(const slot *sl) { return sl->tag >> 2; }
static void set_state(slot *sl, int state)
{
    sl->tag = tag(slot_seq(sl), state);
}

/* A fetched sample: its pixels, or a JPEG record (jpeg non-NULL, v.w x
 * v.h its size from the record's header) that the transform decodes,
 * at a reduced DCT scale where the crop allows. Valid until the next get
 * on the same context. */
typedef struct sample {
    stk_pixview v;
    const uint8_t *jpeg;
    size_t len;
} sample;

/* Where samples come from: a database split or a raw source. */
typedef struct fetch_ops {
    int (*open)(stk_loader *l, void **ctx, stk_err *err);
    int (*get)(stk_loader *l, void *ctx, uint64_t index, sample *out,
               int32_t *label, stk_err *err);
    /* starts loading a record's first `bytes`; may be NULL */
    void (*prefetch)(void *ctx, uint64_t index, size_t bytes);
    void (*close)(void *ctx);
} fetch_ops;

/* A shard cached for one epoch; refs counts workers copying from it. */
typedef struct shard {
    uint64_t epoch;
    uint64_t *idx;
    int refs;
    struct shard *next;
} shard;

/* What a worker (or the caller, with no workers) fills batches with:
 * allocated once, reused for every sample. */
typedef struct wstate {
    void *ctx;               /* the fetcher's */
    stk_xform_scratch xs;    /* the transform's buffers */
    uint8_t *tmp;            /* aug_pad/aug_flip's copy (sample_bytes) */
    stk_decoder *dec;        /* JPEG records' decoder, made on first use */
    stk_image im;            /* its last image */
} wstate;

typedef struct worker {
    stk_loader *l;
    int id;
    pthread_t thread;
    wstate st;
} worker;

struct stk_loader {
    stk_loader_opts o;
    const fetch_ops *ops;
    stk_store *store;
    stk_view *view;
    const stk_source *src;
    int src_split;
    char split[STK_SPLIT_NAME_MAX];
    stk_sampler sampler;
    uint64_t shard_len, nbatches, first_abs; /* absolute = epoch*nb + batch */
    size_t sample_bytes; /* of an output sample */
    int c, h, w; /* the output sample's shape (augmentation) */
    int in_c, in_h, in_w; /* a record's, or the source's fitted sample's
                             (h, w 0: records of their own sizes) */
    bool jpeg;            /* records hold JPEG files */
    bool stream; /* opts.stream_stores, where nothing rewrites the copies */
    int nclasses; /* database labels are 0..nclasses-1 */

    pthread_mutex_t mu;
    pthread_cond_t ready, work; /* a batch is ready; a slot freed or a
                                   batch's parts to take */
    slot *slots;
    int nslots;
    int wake_at; /* see freed */
    int sleeping; /* workers waiting on `work` (mu) */
    bool spinning; /* an idle worker spins (see stir; mu) */
    double spin_s; /* opts.spin_us; 0: idle workers only sleep */
    size_t at_labels, at_indices, block; /* a slot's block: samples, labels,
                                            indices, 64-byte aligned */
    shard *shards;
    uint64_t claim_seq;
    uint64_t ahead; /* epochs below this have their shard made or under way */
    /* The consumer's; atomic for stk_loader_position and stats_get, which
     * may read them from another thread while next takes batches without
     * mu. */
    _Atomic uint64_t take_seq, batches, samples;
    _Atomic double t_first;
    slot *open;    /* the batch whose parts are being handed out */
    int open_next; /* its next part */
    atomic_bool stop; /* read by workers mid-batch, without mu */
    bool ended, started; /* ended: the consumer's */
    bool joined; /* stk_loader_stop: the workers are gone */
    atomic_int failed; /* written under mu; next reads it without */
    stk_err fail_err;
    worker *workers;
    int nworkers;
    wstate inline_st;   /* workers == 0: the caller's */

    double t_open, wait;
    double busy[STK_LOADER_MAX_WORKERS];

    /* What a release touches, on a line of its own (mu's is the workers'):
     *
     * freed: slots freed since the idle workers were last woken, less
     * those claimed since; wake_at of them (half the ring) wake them. A
     * worker idles only when the ring is full, so waking one per release
     * made every batch a futex call while half the ring still waited.
     *
     * stir: bumped by every release, a detach, a wake-up and every batch
     * whose parts are shared. One idle worker (spinning) watches it for up
     * to spin_s before it sleeps, and takes a freed slot with no one
     * woken: a wake-up costs the waker a futex call and the woken core's
     * interrupt (bench/wake_cost.c: 5.6 us for one, 24-26 for eight on 2
     * vCPUs), which at 100 KB batches was a third of the uploading
     * thread's time (docs/benchmarks.md).
     *
     * wakes: the wake-ups the consumer paid for (the lock and a
     * broadcast), in releases and in waits (stk_loader_stats).
     *
     * Last, so that the struct's alignment pads the line's end. */
    _Alignas(64) atomic_int freed;
    atomic_uint stir;
    _Atomic uint64_t wakes;
};

/* ---- fetchers ---------------------------------------------------------- */

/* Database samples come through one shared view (a snapshot with every
 * record's address), so a worker needs no state of its own and a batch's
 * records can be prefetched before they are copied. */
static int store_open(stk_loader *l, void **ctx, stk_err *err)
{
    (void)err;
    *ctx = l->view;
    return 0;
}

/* A record of the database as a sample: CHW pixels of its own size
 * (fixed or variable), or its JPEG bytes. */
static void record_sample(const stk_loader *l, const stk_record *r,
                          sample *out)
{
    out->jpeg = l->jpeg ? r->data : NULL;
    out->len = r->nbytes;
    out->v = stk_pixview_chw(r->data, l->in_c, r->height, r->width);
}

static int store_get(stk_loader *l, void *ctx, uint64_t index, sample *out,
                     int32_t *label, stk_err *err)
{
    stk_record r;
    int rc = stk_view_get(ctx, index, &r, err);
    if (rc)
        return rc;
    /* a label beyond the classes is named here, where its key is known,
     * not later as a row of some batch */
    if (r.label < 0 || r.label >= l->nclasses)
        return stk_fail(err, STK_EFORMAT,
                        "split \"%s\": key %llu: label %d is not one of the "
                        "database's %d classes (0..%d)",
                        l->split, (unsigned long long)index, (int)r.label,
                        l->nclasses, l->nclasses - 1);
    record_sample(l, &r, out);
    *label = r.label;
    return 0;
}

static void store_prefetch(void *ctx, uint64_t index, size_t bytes)
{
    stk_view_prefetch(ctx, index, bytes);
}

static void store_close(void *ctx) { (void)ctx; }

static const fetch_ops store_ops = {store_open, store_get, store_prefetch,
                                    store_close};

/* A raw worker's decoder and its last sample: prep's fitted image, or with
 * a transform the decoded original. */
typedef struct raw_ctx {
    stk_decoder *d;
    uint8_t *fitted;     /* the source's shape */
    stk_image im;
    bool owned;
} raw_ctx;

static void raw_close(void *ctx)
{
    raw_ctx *r = ctx;
    stk_decoder_destroy(r->d);
    free(r->fitted);
    if (r->owned)
        stk_image_free(&r->im);
    free(r);
}

static int raw_open(stk_loader *l, void **ctx, stk_err *err)
{
    raw_ctx *r = calloc(1, sizeof *r);
    if (r && !l->o.xform.kind)
        r->fitted = malloc((size_t)l->in_c * l->in_h * l->in_w);
    if (!r || (!l->o.xform.kind && !r->fitted)) {
        free(r);
        return stk_fail(err, STK_ENOMEM, "out of memory");
    }
    int rc = stk_decoder_create(&r->d, err);
    if (rc)
        raw_close(r);
    else
        *ctx = r;
    return rc;
}

static int raw_get(stk_loader *l, void *ctx, uint64_t index, sample *out,
                   int32_t *label, stk_err *err)
{
    raw_ctx *r = ctx;
    stk_pixview *v = &out->v;
    out->jpeg = NULL;
    if (!l->o.xform.kind) {
        *v = stk_pixview_chw(r->fitted, l->in_c, l->in_h, l->in_w);
        return stk_source_load(l->src, r->d, l->src_split, index, label,
                               r->fitted, err);
    }
    if (r->owned)
        stk_image_free(&r->im);
    int rc = stk_source_load_image(l->src, r->d, l->src_split, index, label,
                                   &r->im, &r->owned, err);
    if (!rc)
        *v = stk_pixview_hwc(r->im.px, r->im.w, r->im.h, r->im.c);
    return rc;
}

static const fetch_ops raw_ops = {raw_open, raw_get, NULL, raw_close};

/* ---- shards ------------------------------------------------------------ */

/* Returns the shard of epoch with a reference taken (mu held). */
/* A shard's memory for this loader's shard length; NULL when out of it. */
static shard *shard_new(const stk_loader *l)
{
    shard *s = calloc(1, sizeof *s);
    if (s && !(s->idx = malloc((l->shard_len ? l->shard_len : 1) *
                               sizeof(uint64_t)))) {
        free(s);
        s = NULL;
    }
    return s;
}

static shard *shard_get(stk_loader *l, uint64_t epoch, int *rc)
{
    shard **pp = &l->shards, *unused = NULL;
    for (shard *s = l->shards; s; s = s->next) {
        if (s->epoch == epoch) {
            s->refs++;
            return s;
        }
        if (!s->refs && s->epoch < epoch)
            unused = s;
    }
    shard *s = unused;
    if (!s) {
        if (!(s = shard_new(l))) {
            *rc = STK_ENOMEM;
            return NULL;
        }
        s->next = *pp;
        *pp = s;
    }
    s->epoch = epoch;
    s->refs = 1;
    *rc = stk_sampler_shard(&l->sampler, epoch, s->idx);
    if (*rc) {
        s->refs = 0;
        s->epoch = UINT64_MAX;
        return NULL;
    }
    return s;
}

/* Makes epoch's shard ahead of its first claim, outside mu (a worker
 * calls it for the next epoch when it claims the current epoch's first
 * batch): made in claim, a 60000-sample shuffle held the lock 0.2 ms
 * once an epoch, every other worker waiting. Reuses an unreferenced shard
 * older than the epoch before; failures are left to shard_get. */
static void shard_ahead(stk_loader *l, uint64_t epoch)
{
    pthread_mutex_lock(&l->mu);
    shard *s = NULL;
    for (shard **pp = &l->shards; *pp; pp = &(*pp)->next)
        if (!(*pp)->refs && (*pp)->epoch + 1 < epoch) {
            s = *pp;
            *pp = s->next; /* out of the list while it is written */
            break;
        }
    pthread_mutex_unlock(&l->mu);
    if (!s)
        s = shard_new(l);
    bool ok = s && !stk_sampler_shard(&l->sampler, epoch, s->idx);
    pthread_mutex_lock(&l->mu);
    if (ok) {
        s->epoch = epoch;
        s->refs = 0;
        s->next = l->shards;
        l->shards = s;
        s = NULL;
    }
    pthread_mutex_unlock(&l->mu);
    if (s)
        free(s->idx);
    free(s);
}

/* ---- filling ----------------------------------------------------------- */

static void seq_pos(const stk_loader *l, uint64_t seq, uint64_t *epoch,
                    uint64_t *batch)
{
    uint64_t abs = l->first_abs + seq;
    *epoch = abs / l->nbatches;
    *batch = abs % l->nbatches;
}

/* seq_pos's inverse: the sequence number of a batch handed out. */
static uint64_t batch_seq(const stk_loader *l, const stk_batch *b)
{
    return b->epoch * l->nbatches + b->index - l->first_abs;
}

/* How many parts a batch of n samples is cut into: one per worker, but
 * where samples are only copied, no part under PART_MIN_BYTES: a handoff
 * costs a lock round and a wake-up. On 16 cores (an H100's host), with
 * uploads, 12 or 16 workers delivered 100 KB batches at 2.3-3.9 GB/s cut
 * in 3 parts against 4.7-7.2 GB/s uncut (docs/benchmarks.md). Decoded
 * or resampled samples (JPEG records, a raw source, a crop or resize
 * transform) cost far more than a handoff: one each is fine. */
enum { PART_MIN_BYTES = 256 << 10 };
static int batch_parts(const stk_loader *l, int n)
{
    int parts = n < l->o.workers ? n : l->o.workers;
    if (l->jpeg || l->src || l->o.xform.kind)
        return parts;
    size_t fit = (size_t)n * l->sample_bytes / PART_MIN_BYTES;
    return fit < 1 ? 1 : fit < (size_t)parts ? (int)fit : parts;
}

/* Claims seq into its slot and copies its indices (mu held): its parts
 * (batch_parts), or one part when that fails (the error is the batch's). */
static int claim(stk_loader *l, uint64_t seq, slot *sl)
{
    uint64_t epoch, batch;
    seq_pos(l, seq, &epoch, &batch);
    sl->tag = tag(seq, SLOT_FILLING);
    sl->rc = 0;
    sl->parts = sl->parts_left = 1;
    uint64_t first = batch * (uint64_t)l->o.batch_size;
    uint64_t left = l->shard_len - first;
    sl->n = (int)(left < (uint64_t)l->o.batch_size ? left
                                                   : (uint64_t)l->o.batch_size);
    int rc;
    shard *s = shard_get(l, epoch, &rc);
    if (!s)
        return rc;
    memcpy(sl->indices, s->idx + first, (size_t)sl->n * sizeof(uint64_t));
    s->refs--;
    if (l->o.workers > 1)
        sl->parts = sl->parts_left = batch_parts(l, sl->n);
    return 0;
}

/* Part p's samples of sl: [*from, *to), balanced, never empty. */
static void part_range(const slot *sl, int p, int *from, int *to)
{
    *from = (int)((int64_t)sl->n * p / sl->parts);
    *to = (int)((int64_t)sl->n * (p + 1) / sl->parts);
}

/* A part filled (mu held): its error kept if it is the lowest part's, so
 * the batch reports the same error whichever worker finished first. */
static void part_done(stk_loader *l, slot *sl, int p, int rc,
                      const stk_err *e)
{
    if (rc && (!sl->rc || p < sl->rc_part)) {
        sl->rc = rc;
        sl->rc_part = p;
        sl->err = *e;
    }
    if (--sl->parts_left == 0) {
        set_state(sl, SLOT_READY);
        pthread_cond_broadcast(&l->ready);
    }
}

void stk_loader_aug_key(uint64_t seed, uint32_t key[2])
{
    key[0] = (uint32_t)seed ^ 0x243f6a88u;
    key[1] = ((uint32_t)(seed >> 32) ^ 0x5bd1e995u) ^ 0x85a308d3u;
}

/* Sample index's crop and flip (stk_transform_draw, as the trainer's
 * device transform draws them) applied to its uint8 CHW image in place,
 * through tmp (sample_bytes). */
static void augment(const stk_loader *l, uint64_t epoch, uint64_t index,
                    uint8_t *img, uint8_t *tmp)
{
    uint32_t k[2];
    stk_loader_aug_key(l->o.seed, k);
    stk_transform t = {.c = l->c, .h = l->h, .w = l->w, .pad = l->o.aug_pad,
                       .flip = l->o.aug_flip, .key = {k[0], k[1]},
                       .stream = epoch};
    int dy, dx, mirror;
    stk_transform_draw(&t, index, &dy, &dx, &mirror);
    if (!dy && !dx && !mirror)
        return;
    memcpy(tmp, img, l->sample_bytes);
    for (int c = 0; c < t.c; c++)
        for (int y = 0; y < t.h; y++)
            for (int x = 0; x < t.w; x++)
                *img++ = stk_transform_src(tmp, &t, c, y, x, dy, dx, mirror);
}

/* A stopping loader's workers leave the batch they fill (nobody will take
 * it): stk_loader_stop waits for one sample, not a whole batch. */
static bool stopping(stk_loader *l)
{
    return atomic_load_explicit(&l->stop, memory_order_relaxed);
}

void stk_loader_rrc_draw(uint64_t seed, uint64_t epoch, uint64_t index,
                         double u[STK_RRC_UNIFORMS], bool *flip)
{
    uint32_t k[2];
    stk_loader_aug_key(seed, k);
    /* a key of its own: no block repeats the pad-crop's draws */
    stk_philox_key key = {k[0] ^ 0x52524331u, k[1]};
    for (uint32_t block = 0; block < 6; block++) {
        uint32_t ctr[4] = {(uint32_t)index, (uint32_t)(index >> 32),
                           (uint32_t)epoch, block};
        stk_philox4x32_10(ctr, key);
        for (int j = 0; j < 4; j++) {
            int n = (int)block * 4 + j;
            if (n < STK_RRC_UNIFORMS)
                u[n] = ctr[j] * 0x1p-32;
            else if (n == STK_RRC_UNIFORMS)
                *flip = ctr[j] & 1;
        }
    }
}

int stk_loader_crop_plan(const stk_meta *m, int crop_size, double crop_ratio,
                         const char *db, stk_loader_xform *centre,
                         stk_err *err)
{
    if (!(crop_ratio >= 0 && crop_ratio <= 1) || crop_size < 0 ||
        crop_size > 16384)
        return stk_fail(err, STK_EINVAL,
                        "crop ratio %g must be in (0, 1] and crop size %d in "
                        "1..16384",
                        crop_ratio, crop_size);
    int stored = m->variable ? m->short_side
                             : (m->height < m->width ? m->height : m->width);
    if (!stored && !crop_size)
        return stk_fail(err, STK_EINVAL,
                        "%s: its records keep their aspect ratio with only "
                        "the longer side capped (prep --max-side), so there "
                        "is no shorter side to size the crops from: give a "
                        "crop size (train --crop-size, stoke.Loader's "
                        "crop_size)",
                        db);
    int side = crop_size ? crop_size
               : m->variable ? (int)lround(0.875 * stored)
                             : stored;
    double ratio = crop_ratio > 0 ? crop_ratio
                   : m->variable || !stored ? 0.875
                                            : (double)side / stored;
    /* floor, as timm's crop_pct and check_xform's default: 224 -> 256 */
    double resize = floor(side / ratio + 1e-9);
    if (resize > 65535)
        return stk_fail(err, STK_EINVAL,
                        "crop ratio %g resizes the shorter side to %.0f, over "
                        "65535",
                        ratio, resize);
    *centre = (stk_loader_xform){.kind = STK_XFORM_CENTRE, .size = side,
                                 .resize = resize < side ? side : (int)resize};
    return 0;
}

/* A JPEG record decoded, whole (box NULL) or for a crop of *box to the
 * output size: at a reduced DCT scale where that allows, box then mapped
 * into the decoded image (stk_image_decode_box). The pixels live in
 * st->im. The JPEG must have its record header's size, which the box was
 * drawn on. */
static int decode_record(const stk_loader *l, wstate *st, uint64_t index,
                         const sample *in, stk_box *box, stk_pixview *v,
                         stk_err *err)
{
    int rc = st->dec ? 0 : stk_decoder_create(&st->dec, err);
    if (rc)
        return rc;
    stk_image_free(&st->im);
    char why[200] = "";
    int w = 0, h = 0;
    if (!stk_image_jpeg_size(st->dec, in->jpeg, in->len, &w, &h))
        snprintf(why, sizeof why, "not a readable JPEG"), rc = STK_EFORMAT;
    else if (w != in->v.w || h != in->v.h)
        snprintf(why, sizeof why, "the JPEG is %dx%d, its record header says "
                 "%dx%d", w, h, in->v.w, in->v.h), rc = STK_EFORMAT;
    else if (box)
        rc = stk_image_decode_box(st->dec, in->jpeg, in->len, l->w, box,
                                  &st->im, why, sizeof why);
    else
        rc = stk_image_decode(st->dec, in->jpeg, in->len, &st->im, why,
                              sizeof why);
    if (rc == STK_ENOMEM)
        return stk_fail(err, rc, "out of memory");
    if (!rc && st->im.c != l->in_c) /* prep encodes the database's channels */
        snprintf(why, sizeof why, "the JPEG has %d channel(s), the database "
                 "%d", st->im.c, l->in_c), rc = STK_EFORMAT;
    if (rc)
        return stk_fail(err, STK_EFORMAT, "split \"%s\": key %llu: %s",
                        l->split, (unsigned long long)index, why);
    *v = stk_pixview_hwc(st->im.px, st->im.w, st->im.h, st->im.c);
    return 0;
}

/* Sample index made into the output sample dst: copied, or through the
 * transform with its draws. */
static int shape(const stk_loader *l, wstate *st, uint64_t epoch,
                 uint64_t index, const sample *in, uint8_t *dst,
                 stk_err *err)
{
    const stk_loader_xform *x = &l->o.xform;
    stk_pixview v = in->v;
    int rc = 0;
    if (x->kind == STK_XFORM_RRC) {
        double u[STK_RRC_UNIFORMS];
        bool flip;
        stk_loader_rrc_draw(l->o.seed, epoch, index, u, &flip);
        stk_box box; /* drawn on the stored size, decoded or not */
        stk_rrc_box(v.h, v.w, x->scale, x->ratio, u, &box);
        if (in->jpeg)
            rc = decode_record(l, st, index, in, &box, &v, err);
        return rc ? rc
                  : stk_resized_crop(&v, box, x->size, flip && x->flip, l->c,
                                     &st->xs, dst);
    }
    if (in->jpeg && (rc = decode_record(l, st, index, in, NULL, &v, err)))
        return rc;
    if (x->kind == STK_XFORM_CENTRE) {
        int lo = v.w < v.h ? v.w : v.h, hi = v.w < v.h ? v.h : v.w;
        if ((int64_t)x->resize * hi / lo > STK_MAX_SIDE) /* a sliver */
            return stk_fail(err, STK_EFORMAT,
                            "split \"%s\": key %llu: a %dx%d image resized "
                            "to %d on its shorter side is over %d on its "
                            "longer one", l->split, (unsigned long long)index,
                            v.w, v.h, x->resize, STK_MAX_SIDE);
        return stk_centre_crop(&v, x->resize, x->size, l->c, &st->xs, dst);
    }
    if (!in->jpeg) { /* a CHW record or fitted sample, as it is */
        if (l->stream)
            stk_copy_stream(dst, v.px, l->sample_bytes);
        else
            memcpy(dst, v.px, l->sample_bytes);
        return 0;
    }
    return stk_centre_crop(&v, 0, 0, l->c, &st->xs, dst); /* HWC -> CHW */
}

/* How fill prefetches: every record's first lines at once (its header, so
 * the lookups' misses overlap), and the rest of the record AHEAD samples
 * before it is copied, up to WHOLE bytes (longer records stream, and the
 * CPU's own prefetcher follows them). Both stages doubled the loader's
 * rate on Fashion-MNIST's 784-byte records (docs/benchmarks.md), where
 * each copy had waited on a miss every few lines. */
enum { PREFETCH_HEAD = 128, PREFETCH_WHOLE = 2048, PREFETCH_AHEAD = 8 };

/* Fills samples [from, to) of sl's batch. */
static int fill_samples(stk_loader *l, wstate *st, slot *sl, int from,
                        int to, stk_err *err)
{
    uint64_t epoch, batch;
    seq_pos(l, slot_seq(sl), &epoch, &batch);
    void (*prefetch)(void *, uint64_t, size_t) = l->ops->prefetch;
    for (int i = from; prefetch && i < to; i++) /* the first AHEAD whole */
        prefetch(st->ctx, sl->indices[i],
                 i < from + PREFETCH_AHEAD ? PREFETCH_WHOLE : PREFETCH_HEAD);
    for (int i = from; i < to; i++) {
        if (stopping(l))
            return stk_fail(err, STK_ECANCELED, "the loader is stopped");
        if (prefetch && i + PREFETCH_AHEAD < to)
            prefetch(st->ctx, sl->indices[i + PREFETCH_AHEAD], PREFETCH_WHOLE);
        sample in;
        uint8_t *dst = sl->data + (size_t)i * l->sample_bytes;
        int rc = l->ops->get(l, st->ctx, sl->indices[i], &in, &sl->labels[i],
                             err);
        if (!rc && (rc = shape(l, st, epoch, sl->indices[i], &in, dst,
                               err)) == STK_ENOMEM)
            stk_fail(err, rc, "split \"%s\": key %llu: out of memory in "
                     "the transform", l->split,
                     (unsigned long long)sl->indices[i]);
        if (rc)
            return rc;
    }
    for (int i = from; (l->o.aug_pad || l->o.aug_flip) && i < to &&
                       !stopping(l); i++)
        augment(l, epoch, sl->indices[i],
                sl->data + (size_t)i * l->sample_bytes, st->tmp);
    return 0;
}

/* fill_samples, and where the samples were streamed (stream_stores) a
 * fence: the caller's part_done publishes the part next (under mu; READY
 * by the part's last worker), and non-temporal stores may pass it. Each
 * worker fences its own part: sfence orders only its own core's stores. */
static int fill(stk_loader *l, wstate *st, slot *sl, int from, int to,
                stk_err *err)
{
    int rc = fill_samples(l, st, sl, from, to, err);
    if (l->stream)
        stk_stream_fence();
    return rc;
}

/* Opens st's fetcher and buffers (once per worker). */
static int wstate_open(stk_loader *l, wstate *st, stk_err *err)
{
    if ((l->o.aug_pad || l->o.aug_flip) && !st->tmp) {
        st->tmp = malloc(l->sample_bytes);
        if (!st->tmp)
            return stk_fail(err, STK_ENOMEM, "out of memory");
    }
    return l->ops->open(l, &st->ctx, err);
}

static void wstate_close(stk_loader *l, wstate *st)
{
    if (st->ctx)
        l->ops->close(st->ctx);
    st->ctx = NULL;
    stk_xform_scratch_free(&st->xs);
    free(st->tmp);
    st->tmp = NULL;
    stk_decoder_destroy(st->dec);
    st->dec = NULL;
    stk_image_free(&st->im);
}

/* The next part to fill (mu held): of the batch being handed out, else
 * of the next batch when its slot is free; NULL when there is none. *rc
 * is claim's error (the whole batch is then that part). */
static slot *take_part(stk_loader *l, int *p, int *rc)
{
    *rc = 0;
    if (l->open && l->open_next < l->open->parts) {
        *p = l->open_next++;
        return l->open;
    }
    slot *sl = &l->slots[l->claim_seq % (uint64_t)l->nslots];
    if (slot_state(sl) != SLOT_FREE)
        return NULL;
    /* one freed slot taken: no longer one to wake a worker for */
    int f = l->freed;
    while (f > 0 && !atomic_compare_exchange_weak(&l->freed, &f, f - 1))
        ;
    *rc = claim(l, l->claim_seq++, sl);
    l->open = sl;
    l->open_next = 1;
    *p = 0;
    /* one idle worker for each other part: waking them all made 16
     * workers queue on mu for every batch, the consumer among them (a
     * woken worker finding nothing goes back to sleep; one never woken is
     * busy and looks for work before it sleeps) */
    for (int k = 1; k < sl->parts; k++)
        pthread_cond_signal(&l->work);
    if (sl->parts > 1)
        l->stir++; /* and the spinner */
    return sl;
}

/* Spins until stir moves from s0 or the loader stops (true), or for
 * spin_s (false). */
static bool spin(stk_loader *l, unsigned s0)
{
    double end = stk_now() + l->spin_s;
    for (;;) {
        for (int i = 0; i < 64; i++) {
            if (atomic_load_explicit(&l->stir, memory_order_relaxed) != s0 ||
                l->stop)
                return true;
            stk_cpu_relax();
        }
        if (stk_now() > end)
            return false;
    }
}

/* An idle worker's wait (mu held): the first spins (when spin_s > 0 and
 * it did not just spin for nothing) until stir moves from s0, its value
 * before the worker looked at the ring; the others sleep until woken.
 * *spun: it spun and nothing came. */
static void idle(stk_loader *l, unsigned s0, bool *spun)
{
    if (!*spun && l->spin_s > 0 && !l->spinning) {
        l->spinning = true;
        pthread_mutex_unlock(&l->mu);
        *spun = !spin(l, s0);
        pthread_mutex_lock(&l->mu);
        l->spinning = false;
        return;
    }
    l->sleeping++;
    pthread_cond_wait(&l->work, &l->mu);
    l->sleeping--;
    *spun = false;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    stk_loader *l = w->l;
    bool spun = false;
    pthread_mutex_lock(&l->mu);
    while (!l->stop) {
        int p, rc;
        /* before the look: a slot freed after it moves stir (read after
         * the look, a release in between was missed: the consumer, woken
         * by this worker's last batch, frees a slot just then) */
        unsigned s0 = l->stir;
        slot *sl = take_part(l, &p, &rc);
        if (!sl) {
            idle(l, s0, &spun);
            continue;
        }
        /* the watch goes on: a sleeper takes a freed slot or spins, so
         * that the next slot freed is taken as it comes, no one woken */
        bool pass = l->spin_s > 0 && l->sleeping && !l->spinning;
        spun = false;
        uint64_t epoch, batch;
        seq_pos(l, slot_seq(sl), &epoch, &batch);
        bool ahead = !rc && l->ahead <= epoch + 1;
        if (ahead)
            l->ahead = epoch + 2;
        pthread_mutex_unlock(&l->mu);
        if (pass)
            pthread_cond_signal(&l->work);
        if (ahead)
            shard_ahead(l, epoch + 1);
        double t0 = stk_now();
        stk_err e = {0};
        if (rc)
            rc = stk_fail(&e, rc, "split \"%s\": cannot build the epoch's "
                          "sample order", l->split);
        else if (!w->st.ctx)
            rc = wstate_open(l, &w->st, &e);
        if (!rc) {
            int from, to;
            part_range(sl, p, &from, &to);
            rc = fill(l, &w->st, sl, from, to, &e);
        }
        double dt = stk_now() - t0;
        pthread_mutex_lock(&l->mu);
        l->busy[w->id] += dt;
        part_done(l, sl, p, rc, &e);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

/* ---- opening ----------------------------------------------------------- */

static void *host_alloc(const stk_loader *l, size_t n)
{
    if (l->o.host.alloc)
        return l->o.host.alloc(n, l->o.host.ctx);
    return aligned_alloc(4096, (n + 4095) / 4096 * 4096);
}

/* Validates the transform and fills in its defaults. */
static int check_xform(stk_loader_opts *o, stk_err *err)
{
    stk_loader_xform *x = &o->xform;
    if (x->kind == STK_XFORM_NONE)
        return 0;
    if (x->kind != STK_XFORM_RRC && x->kind != STK_XFORM_CENTRE)
        return stk_fail(err, STK_EINVAL, "unknown transform %d", x->kind);
    if (o->aug_pad || o->aug_flip)
        return stk_fail(err, STK_EINVAL, "a transform (random resized or "
                        "centre crop) cannot be combined with the padded "
                        "crop or its flip");
    if (x->size < 1 || x->size > 16384)
        return stk_fail(err, STK_EINVAL, "crop size must be 1..16384, not %d",
                        x->size);
    if (x->kind == STK_XFORM_CENTRE) {
        if (!x->resize)
            x->resize = (int)(x->size / 0.875);
        if (x->resize < x->size || x->resize > 65535)
            return stk_fail(err, STK_EINVAL, "resize must be %d..65535 (at "
                            "least the crop size), not %d", x->size,
                            x->resize);
        return 0;
    }
    if (!x->scale[0] && !x->scale[1])
        x->scale[0] = 0.08, x->scale[1] = 1.0;
    if (!x->ratio[0] && !x->ratio[1])
        x->ratio[0] = 3.0 / 4.0, x->ratio[1] = 4.0 / 3.0;
    if (!(x->scale[0] > 0 && x->scale[0] <= x->scale[1] && x->scale[1] <= 1))
        return stk_fail(err, STK_EINVAL, "crop scale must be 0 < min <= max "
                        "<= 1, not (%g, %g)", x->scale[0], x->scale[1]);
    if (!(x->ratio[0] > 0 && x->ratio[0] <= x->ratio[1]))
        return stk_fail(err, STK_EINVAL, "crop ratio must be 0 < min <= max, "
                        "not (%g, %g)", x->ratio[0], x->ratio[1]);
    return 0;
}

static int check_opts(stk_loader_opts *o, stk_err *err)
{
    if (o->batch_size < 1)
        return stk_fail(err, STK_EINVAL, "batch size must be >= 1, not %d",
                        o->batch_size);
    if (o->workers < 0 || o->workers > STK_LOADER_MAX_WORKERS)
        return stk_fail(err, STK_EINVAL, "workers must be 0..%d, not %d",
                        STK_LOADER_MAX_WORKERS, o->workers);
    if (o->world == 0)
        o->world = 1;
    if (o->world < 0 || o->rank < 0 || o->rank >= o->world)
        return stk_fail(err, STK_EINVAL, "rank %d is not in a world of %d",
                        o->rank, o->world);
    if (o->prefetch == 0)
        o->prefetch = o->workers * 2 > 4 ? o->workers * 2 : 4;
    if (o->prefetch < 1 || o->prefetch > 1024)
        return stk_fail(err, STK_EINVAL, "prefetch must be 1..1024, not %d",
                        o->prefetch);
    if (o->aug_pad < 0 || o->aug_pad > 4096)
        return stk_fail(err, STK_EINVAL,
                        "augmentation padding must be 0..4096, not %d",
                        o->aug_pad);
    if (!o->split)
        o->split = "train";
    /* a spinner takes a core from no one where the workers and the
     * consumer have one each; beyond that it may hold up a worker that
     * fills (2 workers on 2 vCPUs: a gain with a slow consumer, no clear
     * difference with a fast one; docs/benchmarks.md) */
    if (o->spin_us == 0)
        o->spin_us = o->workers + 1 <= stk_usable_cpus() ? 50 : -1;
    if (o->spin_us > 1000000)
        return stk_fail(err, STK_EINVAL, "spin must be at most 1000000 "
                        "microseconds, not %d", o->spin_us);
    return check_xform(o, err);
}

/* Points slot s at block (samples, then labels and indices). */
static void set_block(const stk_loader *l, slot *s, uint8_t *block)
{
    s->data = block;
    s->labels = (int32_t *)(block + l->at_labels);
    s->indices = (uint64_t *)(block + l->at_indices);
}

static int alloc_ring(stk_loader *l, stk_err *err)
{
    l->nslots = l->o.prefetch;
    l->wake_at = l->nslots / 2 > 1 ? l->nslots / 2 : 1;
    l->spin_s = l->o.spin_us > 0 ? l->o.spin_us * 1e-6 : 0;
    l->slots = calloc((size_t)l->nslots, sizeof *l->slots);
    if (!l->slots)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    /* one (pinnable) block per slot: samples, then labels and indices, so
     * that all three copy to a GPU without a pageable staging step */
    size_t n = (size_t)l->o.batch_size;
    size_t bytes = (size_t)l->o.batch_size * l->sample_bytes;
    l->at_labels = (bytes + 63) / 64 * 64;
    l->at_indices = l->at_labels + (n * sizeof(int32_t) + 63) / 64 * 64;
    l->block = l->at_indices + n * sizeof(uint64_t);
    for (int i = 0; i < l->nslots; i++) {
        uint8_t *block = host_alloc(l, l->block);
        if (!block)
            return stk_fail(err, STK_ENOMEM,
                            "cannot allocate %d batch buffers of %zu bytes",
                            l->nslots, l->block);
        set_block(l, &l->slots[i], block);
    }
    return 0;
}

static int start_workers(stk_loader *l, stk_err *err)
{
    if (!l->o.workers)
        return wstate_open(l, &l->inline_st, err);
    l->workers = calloc((size_t)l->o.workers, sizeof *l->workers);
    if (!l->workers)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    for (; l->nworkers < l->o.workers; l->nworkers++) {
        worker *w = &l->workers[l->nworkers];
        w->l = l;
        w->id = l->nworkers;
        if (stk_thread_start(&w->thread, worker_main, w, "stk-load", w->id))
            return stk_fail(err, STK_ENOMEM, "cannot start loader thread %d",
                            l->nworkers);
    }
    return 0;
}

/* Shared tail of both opens: sampler, sizes, ring, threads. */
static int open_common(stk_loader *l, uint64_t n, stk_err *err)
{
    l->sampler = (stk_sampler){n, l->o.seed, l->o.rank, l->o.world,
                               l->o.shuffle, l->o.drop_last, l->o.uneven};
    l->shard_len = stk_sampler_len(&l->sampler);
    uint64_t b = (uint64_t)l->o.batch_size;
    l->nbatches = l->o.drop_last ? l->shard_len / b : (l->shard_len + b - 1) / b;
    /* an uneven shard may be empty where the split has fewer samples than
     * ranks: the others evaluate them all, and this rank's epochs end at
     * once; anywhere else a rank without a batch is an error */
    if (!l->nbatches && !(l->o.uneven && n > 0))
        return stk_fail(err, STK_EINVAL,
                        "split \"%s\": rank %d gets %llu of %llu samples, not "
                        "one batch of %d",
                        l->split, l->o.rank, (unsigned long long)l->shard_len,
                        (unsigned long long)n, l->o.batch_size);
    l->first_abs = l->o.start_epoch * l->nbatches + l->o.start_batch;
    /* mu is taken twice a batch by every worker and the consumer, for a
     * few instructions: adaptive, a waiter spins briefly before it sleeps */
    pthread_mutexattr_t adaptive;
    pthread_mutexattr_init(&adaptive);
    (void)pthread_mutexattr_settype(&adaptive, PTHREAD_MUTEX_ADAPTIVE_NP);
    /* (refused: a normal mutex, the same but for the spinning) */
    pthread_mutex_init(&l->mu, &adaptive);
    pthread_mutexattr_destroy(&adaptive);
    pthread_condattr_t monotonic; /* stk_loader_next_for's deadline */
    pthread_condattr_init(&monotonic);
    pthread_condattr_setclock(&monotonic, CLOCK_MONOTONIC);
    pthread_cond_init(&l->ready, &monotonic);
    pthread_condattr_destroy(&monotonic);
    pthread_cond_init(&l->work, NULL);
    l->started = true;
    if (!l->t_open)
        l->t_open = stk_now();
    if (!l->nbatches)
        return 0; /* nothing to load: no ring, no workers */
    int rc = alloc_ring(l, err);
    return rc ? rc : start_workers(l, err);
}

static int finish_open(stk_loader *l, uint64_t n, stk_loader **out,
                       stk_err *err)
{
    int rc = open_common(l, n, err);
    if (rc) {
        stk_loader_close(l);
        return rc;
    }
    *out = l;
    return 0;
}

/* The stored sample's shape and the output's. */
static void set_shape(stk_loader *l, int c, int h, int w)
{
    l->in_c = l->c = c;
    l->in_h = l->h = h;
    l->in_w = l->w = w;
    if (l->o.xform.kind)
        l->h = l->w = l->o.xform.size;
    l->sample_bytes = (size_t)l->c * l->h * l->w;
}

static stk_loader *new_loader(const stk_loader_opts *opts, stk_err *err,
                              int *rc)
{
    stk_loader *l = aligned_alloc(_Alignof(stk_loader), sizeof *l);
    if (l)
        memset(l, 0, sizeof *l);
    if (!l) {
        *rc = stk_fail(err, STK_ENOMEM, "out of memory");
        return NULL;
    }
    l->o = *opts;
    if ((*rc = check_opts(&l->o, err))) {
        free(l);
        return NULL;
    }
    snprintf(l->split, sizeof l->split, "%s", l->o.split);
    /* augment reads each copy back and rewrites it: streamed out of the
     * cache first, it would only be read back from memory (transforms and
     * JPEG records never take shape's copy) */
    l->stream = l->o.stream_stores && !l->o.aug_pad && !l->o.aug_flip;
    return l;
}

int stk_loader_open(stk_store *store, const stk_loader_opts *opts,
                    stk_loader **out, stk_err *err)
{
    *out = NULL;
    int rc;
    stk_loader *l = new_loader(opts, err, &rc);
    if (!l)
        return rc;
    const stk_meta *m = stk_store_meta(store);
    if (m->variable && !l->o.xform.kind) { /* no one size to copy */
        free(l);
        return stk_fail(err, STK_EINVAL,
                        "the records of this database differ in size "
                        "(prep --short-side/--max-side): the loader needs a "
                        "transform to one size (random resized or centre "
                        "crop)");
    }
    l->ops = &store_ops;
    l->store = store;
    l->jpeg = m->encoding == STK_ENC_JPEG;
    set_shape(l, m->channels, m->height, m->width);
    l->nclasses = stk_store_meta(store)->nclasses;
    l->t_open = stk_now(); /* indexing the split counts toward first batch */
    /* the view checks that the split exists and knows its size */
    if ((rc = stk_view_open(store, l->split, &l->view, err))) {
        free(l);
        return rc;
    }
    return finish_open(l, stk_view_count(l->view), out, err);
}

int stk_loader_open_raw(const stk_source *src, int split,
                        const stk_loader_opts *opts, stk_loader **out,
                        stk_err *err)
{
    *out = NULL;
    int rc;
    stk_loader_opts o = *opts;
    o.split = stk_source_split_name(src, split);
    stk_loader *l = new_loader(&o, err, &rc);
    if (!l)
        return rc;
    int c, h, w;
    stk_source_shape(src, &c, &h, &w);
    if (!h && !l->o.xform.kind) { /* aspect-keeping: no one size */
        free(l);
        return stk_fail(err, STK_EINVAL,
                        "the images of %s keep their own sizes: the loader "
                        "needs a transform to one size (random resized or "
                        "centre crop)",
                        o.split);
    }
    l->ops = &raw_ops;
    l->src = src;
    l->src_split = split;
    set_shape(l, c, h, w);
    return finish_open(l, stk_source_split_count(src, split), out, err);
}

/* ---- consuming --------------------------------------------------------- */

/* The slots are used in turn, so one batch held for nslots more batches
 * blocks the ring: the caller is told which. */
static int held_error(const stk_loader *l, stk_err *err)
{
    return stk_fail(err, STK_EINVAL,
                    "the next batch's buffer is still held by the batch "
                    "taken %d batches ago (the %d prefetch buffers are "
                    "reused in turn); release it before asking for the next",
                    l->nslots, l->nslots);
}

/* Wakes the sleeping workers and stirs the spinning one for the slots
 * freed since they were last woken (mu held; the consumer's, counted in
 * stats' wakes). */
static void wake_workers(stk_loader *l)
{
    l->freed = 0;
    l->stir++;
    l->wakes++;
    pthread_cond_broadcast(&l->work);
}

/* Waits (until `deadline` on stk_now's clock; 0: for ever) for slot sl
 * to hold batch seq, filling it here when there are no workers (mu held);
 * STK_ETIMEDOUT, with no message, when the deadline passed. */
static int await_slot(stk_loader *l, slot *sl, uint64_t seq, double deadline,
                      stk_err *err)
{
    if (l->stop) /* stk_loader_stop: nothing would fill it */
        return stk_fail(err, STK_ECANCELED, "the loader is stopped");
    int state = slot_state(sl);
    if (state == SLOT_HELD || (state != SLOT_FREE && slot_seq(sl) != seq &&
                               !l->o.workers))
        return held_error(l, err);
    if (!l->o.workers) {
        /* a claim that fails is the batch's error, as in a worker: the
         * loader then stays failed instead of going on with the next */
        stk_err e = {0};
        int rc = claim(l, l->claim_seq++, sl);
        if (rc) {
            part_done(l, sl, 0, stk_fail(&e, rc, "split \"%s\": cannot "
                                         "build the sample order", l->split),
                      &e);
            return 0;
        }
        double t0 = stk_now();
        part_done(l, sl, 0, fill(l, &l->inline_st, sl, 0, sl->n, &e), &e);
        double dt = stk_now() - t0;
        l->busy[0] += dt;
        l->wait += dt; /* the consumer waits for data while it loads it */
        return 0;
    }
    double t0 = stk_now();
    while (sl->tag != tag(seq, SLOT_READY)) {
        if (slot_state(sl) == SLOT_HELD)
            return held_error(l, err);
        /* the consumer waits: no freed slot may stay idle (a release may
         * have freed this one and not yet counted it) */
        if (l->freed || slot_state(sl) == SLOT_FREE)
            wake_workers(l);
        if (l->stop) /* stk_loader_stop: nothing would fill it */
            return stk_fail(err, STK_ECANCELED, "the loader is stopped");
        if (!deadline) {
            pthread_cond_wait(&l->ready, &l->mu);
            continue;
        }
        double left = deadline - stk_now();
        if (left <= 0) {
            l->wait += stk_now() - t0;
            return STK_ETIMEDOUT;
        }
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        double end = (double)ts.tv_nsec * 1e-9 + left;
        ts.tv_sec += (time_t)end;
        ts.tv_nsec = (long)((end - (double)(time_t)end) * 1e9);
        pthread_cond_timedwait(&l->ready, &l->mu, &ts);
    }
    l->wait += stk_now() - t0;
    return 0;
}

/* The consumer's next batch, seq, starts an epoch that has not yet been
 * reported ended (next returns 0 once between epochs). */
static bool epoch_end_due(const stk_loader *l, uint64_t seq)
{
    return (l->first_abs + seq) % l->nbatches == 0 && seq > 0 && !l->ended;
}

/* Takes the ready batch in sl (the consumer's next) into b, held. */
static void hand_out(stk_loader *l, slot *sl, stk_batch *b)
{
    uint64_t seq = slot_seq(sl);
    sl->tag = tag(seq, SLOT_HELD); /* no one else moves a READY slot */
    l->ended = false;
    l->take_seq = seq + 1; /* a store: only the consumer writes it */
    seq_pos(l, seq, &b->epoch, &b->index);
    b->n = sl->n;
    b->sample_bytes = l->sample_bytes;
    b->data = sl->data;
    b->labels = sl->labels;
    b->indices = sl->indices;
    b->slot = (int)(sl - l->slots);
    l->samples += (uint64_t)sl->n;
    if (l->batches == 0) /* before the count: stats_get may read both */
        l->t_first = stk_now() - l->t_open;
    l->batches++;
}

/* The next batch when it is ready and there is nothing else to say (no
 * error, no epoch end, not stopped), taken without mu: the consumer took
 * mu twice a batch, and on 16 cores its waits behind the workers were half
 * of an upload's time (docs/benchmarks.md). false: take the locked way. */
static bool take_ready(stk_loader *l, stk_batch *b)
{
    uint64_t seq = l->take_seq;
    if (l->failed || !l->nbatches || epoch_end_due(l, seq))
        return false;
    slot *sl = &l->slots[seq % (uint64_t)l->nslots];
    /* the tag (the acquire) before rc and n: a worker wrote them first */
    if (sl->tag != tag(seq, SLOT_READY) || sl->rc)
        return false;
    hand_out(l, sl, b);
    return true;
}

int stk_loader_next(stk_loader *l, stk_batch *b, stk_err *err)
{
    return stk_loader_next_for(l, b, 0, err);
}

int stk_loader_next_for(stk_loader *l, stk_batch *b, double seconds,
                        stk_err *err)
{
    if (take_ready(l, b))
        return 1;
    double deadline = seconds > 0 ? stk_now() + seconds : 0;
    pthread_mutex_lock(&l->mu);
    int rc = l->failed;
    if (rc) {
        if (err)
            *err = l->fail_err;
        pthread_mutex_unlock(&l->mu);
        return rc;
    }
    if (!l->nbatches) { /* an empty shard: every epoch ends at once */
        pthread_mutex_unlock(&l->mu);
        return 0;
    }
    if (epoch_end_due(l, l->take_seq)) {
        l->ended = true; /* report the epoch boundary once */
        pthread_mutex_unlock(&l->mu);
        return 0;
    }
    slot *sl = &l->slots[l->take_seq % (uint64_t)l->nslots];
    rc = await_slot(l, sl, l->take_seq, deadline, err);
    if (rc == STK_ETIMEDOUT) {
        pthread_mutex_unlock(&l->mu);
        return rc;
    }
    if (!rc && sl->rc) {
        rc = l->failed = sl->rc;
        l->fail_err = sl->err;
        if (err)
            *err = sl->err;
        set_state(sl, SLOT_FREE);
    }
    if (!rc)
        hand_out(l, sl, b);
    pthread_mutex_unlock(&l->mu);
    return rc ? rc : 1;
}

void stk_loader_release(stk_loader *l, stk_batch *b)
{
    if (!b->data || b->slot < 0 || b->slot >= l->nslots)
        return; /* none, or detached: not the ring's */
    slot *sl = &l->slots[b->slot];
    /* only b's batch, held: a stale copy of a batch released twice must
     * not free the slot that its buffer went on to (workers may be
     * filling it, the consumer may hold a newer batch in it); without mu,
     * as the consumer takes batches (take_ready) */
    uint64_t seq = batch_seq(l, b), held = tag(seq, SLOT_HELD);
    b->data = NULL;
    if (!atomic_compare_exchange_strong(&sl->tag, &held, tag(seq, SLOT_FREE)))
        return;
    /* a spinning worker takes the slot (and counts it taken) before half
     * the ring is free; the sleepers are woken only when it is, or when
     * the consumer must wait */
    l->stir++;
    if (atomic_fetch_add(&l->freed, 1) + 1 < l->wake_at)
        return;
    pthread_mutex_lock(&l->mu); /* a worker between its look at the ring
                                   and its wait hears this */
    wake_workers(l);
    pthread_mutex_unlock(&l->mu);
}

/* b's batch is in its slot, held (or, under mu, released meanwhile: the
 * slot is then free and no worker has claimed it yet). */
static bool holds(const stk_loader *l, const stk_batch *b, bool or_freed)
{
    if (!b->data || b->slot < 0 || b->slot >= l->nslots)
        return false;
    uint64_t t = l->slots[b->slot].tag, seq = batch_seq(l, b);
    return t == tag(seq, SLOT_HELD) || (or_freed && t == tag(seq, SLOT_FREE));
}

int stk_loader_detach(stk_loader *l, stk_batch *b, stk_err *err)
{
    bool held = holds(l, b, false);
    if (!held)
        return stk_fail(err, STK_EINVAL, "detach: not a batch the consumer "
                        "holds");
    uint8_t *fresh = host_alloc(l, l->block);
    if (!fresh)
        return stk_fail(err, STK_ENOMEM,
                        "cannot allocate a batch buffer of %zu bytes",
                        l->block);
    pthread_mutex_lock(&l->mu);
    slot *sl = &l->slots[b->slot];
    if (!holds(l, b, true)) { /* released and refilled meanwhile: misuse */
        pthread_mutex_unlock(&l->mu);
        stk_loader_free_detached(l, &(stk_batch){.data = fresh, .slot = -1});
        return stk_fail(err, STK_EINVAL, "detach: the batch was released "
                        "while it was being detached");
    }
    set_block(l, sl, fresh);
    set_state(sl, SLOT_FREE);
    l->stir++; /* a spinning worker takes it */
    pthread_cond_signal(&l->work);
    pthread_mutex_unlock(&l->mu);
    b->slot = -1;
    return 0;
}

void stk_loader_free_detached(const stk_loader *l, stk_batch *b)
{
    if (!b->data)
        return;
    if (l->o.host.free)
        l->o.host.free(b->data, l->o.host.ctx);
    else
        free(b->data);
    b->data = NULL;
}

uint64_t stk_loader_batches(const stk_loader *l) { return l->nbatches; }

int stk_loader_slots(const stk_loader *l) { return l->nslots; }

stk_loader_pos stk_loader_position(const stk_loader *l)
{
    if (!l->nbatches)
        return (stk_loader_pos){l->o.start_epoch, 0};
    pthread_mutex_lock((pthread_mutex_t *)&l->mu);
    uint64_t abs = l->first_abs + l->take_seq;
    pthread_mutex_unlock((pthread_mutex_t *)&l->mu);
    return (stk_loader_pos){abs / l->nbatches, abs % l->nbatches};
}

void stk_loader_stats_get(const stk_loader *l, stk_loader_stats *st)
{
    memset(st, 0, sizeof *st);
    pthread_mutex_lock((pthread_mutex_t *)&l->mu);
    st->batches = l->batches; /* each read once: next updates them */
    st->samples = l->samples;
    st->bytes = st->samples * l->sample_bytes;
    st->elapsed = stk_now() - l->t_open;
    st->first_batch = l->t_first;
    st->wait = l->wait;
    st->wakes = l->wakes;
    st->workers = l->o.workers;
    for (int i = 0; i < (l->o.workers ? l->o.workers : 1); i++)
        st->busy[i] = l->busy[i];
    pthread_mutex_unlock((pthread_mutex_t *)&l->mu);
    if (st->elapsed > 0) {
        st->samples_per_s = st->samples / st->elapsed;
        st->bytes_per_s = st->bytes / st->elapsed;
        st->stall = st->wait / st->elapsed;
    }
}

void stk_loader_stop(stk_loader *l)
{
    if (!l || l->joined)
        return;
    if (l->started) {
        pthread_mutex_lock(&l->mu);
        l->stop = true;
        if (!l->failed) {
            l->failed = STK_ECANCELED;
            stk_fail(&l->fail_err, STK_ECANCELED, "split \"%s\": the loader is "
                     "stopped", l->split);
        }
        pthread_cond_broadcast(&l->work);
        pthread_cond_broadcast(&l->ready); /* a waiting next returns */
        pthread_mutex_unlock(&l->mu);
    }
    for (int i = 0; i < l->nworkers; i++)
        pthread_join(l->workers[i].thread, NULL);
    for (int i = 0; l->workers && i < l->nworkers; i++)
        wstate_close(l, &l->workers[i].st);
    l->nworkers = 0;
    l->joined = true;
    wstate_close(l, &l->inline_st);
}

void stk_loader_close(stk_loader *l)
{
    if (!l)
        return;
    stk_loader_stop(l);
    for (int i = 0; l->slots && i < l->nslots; i++) {
        if (l->o.host.free)
            l->o.host.free(l->slots[i].data, l->o.host.ctx);
        else
            free(l->slots[i].data);
    }
    while (l->shards) {
        shard *s = l->shards;
        l->shards = s->next;
        free(s->idx);
        free(s);
    }
    if (l->started) {
        pthread_mutex_destroy(&l->mu);
        pthread_cond_destroy(&l->ready);
        pthread_cond_destroy(&l->work);
    }
    stk_view_close(l->view);
    free(l->workers);
    free(l->slots);
    free(l);
}
