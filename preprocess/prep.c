/* prep.c - the worker pool and the ordered writer.
 *
 * Samples are cut into chunks of consecutive indices. Worker threads claim
 * chunks in sequence order and decode them into a ring of chunk slots; the
 * caller's thread is the writer: it waits for chunk 0, 1, 2... in order and
 * appends their records, so the database is the same whatever the number of
 * workers. A worker may run at most nslots chunks ahead of the writer, which
 * bounds memory. Statistics are integer sums, so they too are independent of
 * scheduling. */
#include "preprocess.h"
#include "store/store.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#define CHUNK 64

enum { SLOT_FREE, SLOT_BUSY, SLOT_DONE };

typedef struct chunk {
    int state;
    uint64_t seq;
    int split;
    uint64_t first;
    int n;
    uint8_t *recs;         /* n encoded records, record j at off[j] */
    size_t cap;            /* bytes allocated at recs */
    size_t off[CHUNK + 1]; /* a skipped record is 0 bytes long */
    uint8_t *ok;          /* 1 = loaded, 0 = skipped (skip_bad) */
    const char **file;    /* file of each skipped sample (the source's) */
    char **why;           /* and the reason it was skipped */
    uint64_t *sums;       /* 2 * channels: sum and sum of squares */
    uint64_t pixels;      /* per channel, over the loaded records */
    int rc;               /* fatal error at sample n_ok (no skip_bad) */
    stk_err err;
} chunk;

typedef struct pool {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    chunk *slots;
    int nslots;
    uint64_t next_claim, next_write, nchunks;
    uint64_t split_first_chunk[9]; /* chunk seq where each split starts */
    bool stop, mu_ready;
    const stk_source *src;
    const stk_prep_opts *opts;
    size_t header; /* record header bytes */
    int channels;
    int encoding, quality;
} pool;

/* What each worker thread owns. */
typedef struct worker {
    stk_decoder *dec;
    stk_encoder *enc; /* JPEG databases only */
    uint8_t *px;      /* the sample's CHW pixels */
    size_t px_cap;
} worker;

/* ---- workers ----------------------------------------------------------- */

static void chunk_plan(const pool *p, uint64_t seq, chunk *c)
{
    int k = 0;
    while (seq >= p->split_first_chunk[k + 1])
        k++;
    uint64_t local = seq - p->split_first_chunk[k];
    uint64_t count = stk_source_split_count(p->src, k);
    c->seq = seq;
    c->split = k;
    c->first = local * CHUNK;
    c->n = (int)(count - c->first < CHUNK ? count - c->first : CHUNK);
}

static void add_sums(uint64_t *sums, const uint8_t *px, int channels,
                     size_t plane)
{
    for (int ch = 0; ch < channels; ch++) {
        uint64_t s = 0, q = 0;
        for (size_t i = 0; i < plane; i++) {
            uint32_t v = px[ch * plane + i];
            s += v;
            q += v * v;
        }
        sums[2 * ch] += s;
        sums[2 * ch + 1] += q;
    }
}

/* Room for need more bytes at the end of the chunk's records. */
static int chunk_reserve(chunk *c, size_t used, size_t need)
{
    if (used + need <= c->cap)
        return 0;
    size_t cap = 2 * c->cap > used + need ? 2 * c->cap : used + need;
    uint8_t *r = realloc(c->recs, cap);
    if (!r)
        return STK_ENOMEM;
    c->recs = r;
    c->cap = cap;
    return 0;
}

/* Appends the record of the sample in wk->px (h x w) at c->off[j]; a JPEG
 * one is decoded back into wk->px. */
static int put_record(const pool *p, worker *wk, chunk *c, int j,
                      int32_t label, int h, int w, const char *file,
                      stk_err *err)
{
    const uint8_t *payload = wk->px;
    size_t n = (size_t)p->channels * h * w;
    stk_err je;
    int rc = 0;
    if (p->encoding == STK_ENC_JPEG &&
        (rc = stk_jpeg_encode(wk->enc, wk->px, p->channels, h, w, p->quality,
                              &payload, &n, &je)))
        return stk_fail(err, rc, "%s: %s", file, je.msg);
    if (chunk_reserve(c, c->off[j], p->header + n))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", file);
    uint8_t *dst = c->recs + c->off[j];
    if (p->header == STK_RECORD_HEADER)
        stk_record_put_header(dst, label, (uint32_t)n);
    else
        stk_record_put_header_v2(dst, label, (uint32_t)n, (uint32_t)h,
                                 (uint32_t)w);
    memcpy(dst + p->header, payload, n);
    c->off[j + 1] = c->off[j] + p->header + n;
    if (p->encoding != STK_ENC_JPEG)
        return 0;
    /* the statistics are of the pixels a reader decodes: decode it back */
    stk_meta m = {.channels = p->channels, .encoding = STK_ENC_JPEG};
    stk_record r = {label, (uint32_t)n, h, w, dst + p->header};
    if ((rc = stk_record_pixels(wk->dec, &m, &r, wk->px, &je)))
        return stk_fail(err, rc, "%s: %s", file, je.msg);
    return 0;
}

static void fill_chunk(pool *p, worker *wk, chunk *c)
{
    memset(c->sums, 0, 2 * STK_MAX_CHANNELS * sizeof *c->sums);
    c->pixels = 0;
    c->rc = 0;
    c->off[0] = 0;
    for (int j = 0; j < c->n; j++) {
        int32_t label = 0;
        int h = 0, w = 0;
        stk_err e = {0};
        uint64_t i = c->first + (uint64_t)j;
        const char *file = stk_source_sample_file(p->src, c->split, i);
        int rc = stk_source_load_any(p->src, wk->dec, c->split, i, &label,
                                     &wk->px, &wk->px_cap, &h, &w, &e);
        if (!rc)
            rc = put_record(p, wk, c, j, label, h, w, file, &e);
        c->ok[j] = rc == 0;
        free(c->why[j]);
        c->why[j] = NULL;
        if (!rc) { /* statistics of the stored (decoded) pixels */
            add_sums(c->sums, wk->px, p->channels, (size_t)h * w);
            c->pixels += (uint64_t)h * w;
        } else if (p->opts->skip_bad && rc != STK_ENOMEM) {
            /* the file and the reason apart, for the metadata's list */
            c->off[j + 1] = c->off[j];
            c->file[j] = file;
            c->why[j] =
                strdup(stk_source_error_reason(p->src, c->split, i, e.msg));
        } else {
            c->rc = rc;
            c->err = e;
            if (rc != STK_ENOMEM)
                stk_fail(&c->err, rc, "%s (--skip-bad skips bad samples)",
                         e.msg);
            c->n = j; /* records before the failure are still written */
            return;
        }
    }
}

static int worker_init(const pool *p, worker *wk, stk_err *err)
{
    int rc = stk_decoder_create(&wk->dec, err);
    if (!rc && p->encoding == STK_ENC_JPEG)
        rc = stk_encoder_create(&wk->enc, err);
    return rc;
}

static void *worker_main(void *arg)
{
    pool *p = arg;
    worker wk = {0};
    stk_err e;
    int drc = worker_init(p, &wk, &e);
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        if (p->next_claim < p->nchunks &&
            p->next_claim < p->next_write + (uint64_t)p->nslots) {
            uint64_t seq = p->next_claim++;
            chunk *c = &p->slots[seq % (uint64_t)p->nslots];
            c->state = SLOT_BUSY;
            pthread_mutex_unlock(&p->mu);
            chunk_plan(p, seq, c);
            if (drc) {
                c->rc = drc;
                c->err = e;
                c->n = 0;
            } else {
                fill_chunk(p, &wk, c);
            }
            pthread_mutex_lock(&p->mu);
            c->state = SLOT_DONE;
            pthread_cond_broadcast(&p->done);
        } else {
            pthread_cond_wait(&p->work, &p->mu);
        }
    }
    pthread_mutex_unlock(&p->mu);
    stk_decoder_destroy(wk.dec);
    stk_encoder_destroy(wk.enc);
    free(wk.px);
    return NULL;
}

/* ---- the run ----------------------------------------------------------- */

typedef struct split_stats {
    uint64_t *labels;
    uint64_t sums[2 * STK_MAX_CHANNELS];
    uint64_t pixels; /* per channel */
    uint64_t written, skipped;
} split_stats;

typedef struct run {
    pool p;
    pthread_t *threads;
    int nthreads;
    stk_store *store;
    split_stats stats[8];
    cJSON *skipped;   /* split -> [{file, error}] */
    uint64_t done, total;
    uint64_t bytes; /* record bytes written */
    double t0;
} run;

/* rec: the bytes of a record when they are known in advance, else a
 * first guess; chunks grow as they need. */
static int pool_init(run *r, size_t rec, stk_err *err)
{
    pool *p = &r->p;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->mu_ready = true;
    p->nslots = 4 * r->nthreads + 4;
    p->slots = calloc((size_t)p->nslots, sizeof *p->slots);
    r->threads = calloc((size_t)r->nthreads, sizeof *r->threads);
    int want = r->nthreads;
    r->nthreads = 0; /* none started yet */
    if (!p->slots || !r->threads)
        return stk_fail(err, STK_ENOMEM, "out of memory for %d workers", want);
    for (int i = 0; i < p->nslots; i++) {
        chunk *c = &p->slots[i];
        c->cap = rec * CHUNK; /* exact for fixed raw records */
        c->recs = malloc(c->cap);
        c->ok = malloc(CHUNK);
        c->file = calloc(CHUNK, sizeof *c->file);
        c->why = calloc(CHUNK, sizeof *c->why);
        c->sums = calloc(2 * STK_MAX_CHANNELS, sizeof *c->sums);
        if (!c->recs || !c->ok || !c->file || !c->why || !c->sums)
            return stk_fail(err, STK_ENOMEM,
                            "out of memory for %d chunks of %d %zu-byte "
                            "records (fewer --workers need fewer)",
                            p->nslots, CHUNK, rec);
    }
    int ns = stk_source_nsplits(p->src);
    for (int k = 0; k < ns; k++) {
        uint64_t n = stk_source_split_count(p->src, k);
        p->split_first_chunk[k + 1] =
            p->split_first_chunk[k] + (n + CHUNK - 1) / CHUNK;
    }
    for (int k = ns + 1; k < 9; k++)
        p->split_first_chunk[k] = UINT64_MAX;
    p->nchunks = p->split_first_chunk[ns];
    for (; r->nthreads < want; r->nthreads++) {
        int e = stk_thread_start(&r->threads[r->nthreads], worker_main, p,
                                 "stk-prep", r->nthreads);
        if (e)
            return stk_fail(err, STK_ENOMEM,
                            "cannot start worker thread %d of %d: %s",
                            r->nthreads + 1, want, strerror(e));
    }
    return 0;
}

static void pool_stop(run *r)
{
    pool *p = &r->p;
    if (!p->mu_ready)
        return;
    p->mu_ready = false;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < r->nthreads; i++)
        pthread_join(r->threads[i], NULL);
    for (int i = 0; p->slots && i < p->nslots; i++) {
        chunk *c = &p->slots[i];
        for (int j = 0; c->why && j < CHUNK; j++)
            free(c->why[j]);
        free(c->recs);
        free(c->ok);
        free(c->file);
        free(c->why);
        free(c->sums);
    }
    free(p->slots);
    free(r->threads);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
}

static bool canceled(const stk_prep_opts *o)
{
    return o->cancel && *o->cancel;
}

/* Waits for chunk seq; returns it, or NULL when canceled. */
static chunk *wait_chunk(run *r, uint64_t seq)
{
    pool *p = &r->p;
    chunk *c = &p->slots[seq % (uint64_t)p->nslots];
    pthread_mutex_lock(&p->mu);
    while (!(c->state == SLOT_DONE && c->seq == seq)) {
        if (canceled(p->opts)) {
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000 * 1000;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&p->done, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
    return c;
}

static void release_chunk(run *r, chunk *c)
{
    pthread_mutex_lock(&r->p.mu);
    c->state = SLOT_FREE;
    r->p.next_write++;
    pthread_cond_broadcast(&r->p.work);
    pthread_mutex_unlock(&r->p.mu);
}

/* Adds {file, error} to the split's list of skipped files. */
static int note_skipped(run *r, const char *split, const char *file,
                        const char *why, stk_err *err)
{
    cJSON *list = cJSON_GetObjectItemCaseSensitive(r->skipped, split);
    if (!list)
        list = cJSON_AddArrayToObject(r->skipped, split);
    cJSON *o = cJSON_CreateObject();
    if (!list || !o || !why || !cJSON_AddStringToObject(o, "file", file) ||
        !cJSON_AddStringToObject(o, "error", why)) {
        cJSON_Delete(o);
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", file);
    }
    cJSON_AddItemToArray(list, o);
    return 0;
}

static int write_chunk(run *r, chunk *c, stk_err *err)
{
    const pool *p = &r->p;
    const char *split = stk_source_split_name(p->src, c->split);
    split_stats *st = &r->stats[c->split];
    for (int j = 0; j < c->n; j++) {
        int rc;
        if (!c->ok[j]) {
            st->skipped++;
            if ((rc = note_skipped(r, split, c->file[j], c->why[j], err)))
                return rc;
            continue;
        }
        const uint8_t *v = c->recs + c->off[j];
        size_t len = c->off[j + 1] - c->off[j];
        rc = stk_store_append(r->store, split, v, len, err);
        if (rc)
            return rc;
        r->bytes += len;
        st->labels[(uint32_t)v[0] | (uint32_t)v[1] << 8 |
                   (uint32_t)v[2] << 16 | (uint32_t)v[3] << 24]++;
        st->written++;
    }
    for (int k = 0; k < 2 * p->channels; k++)
        st->sums[k] += c->sums[k];
    st->pixels += c->pixels;
    r->done += (uint64_t)c->n;
    if (c->rc) {
        *err = c->err;
        return c->rc;
    }
    return 0;
}

static void report(run *r, const char *split)
{
    const stk_prep_opts *o = r->p.opts;
    if (!o->progress)
        return;
    uint64_t skipped = 0;
    for (int k = 0; k < 8; k++)
        skipped += r->stats[k].skipped;
    stk_prep_progress pr = {split, r->done, r->total, skipped,
                            stk_now() - r->t0};
    o->progress(&pr, o->progress_arg);
}

static int write_all(run *r, stk_err *err)
{
    for (uint64_t seq = 0; seq < r->p.nchunks; seq++) {
        chunk *c = canceled(r->p.opts) ? NULL : wait_chunk(r, seq);
        if (!c)
            return stk_fail(err, STK_ECANCELED, "interrupted");
        int rc = write_chunk(r, c, err);
        const char *split = stk_source_split_name(r->p.src, c->split);
        release_chunk(r, c);
        if (rc)
            return rc;
        report(r, split);
    }
    return 0;
}

/* ---- metadata ---------------------------------------------------------- */

static int build_meta(run *r, const char *raw_dir, stk_meta *m,
                      stk_err *err)
{
    const stk_source *src = r->p.src;
    memset(m, 0, sizeof *m);
    stk_source_shape(src, &m->channels, &m->height, &m->width);
    m->variable = stk_source_variable(src, &m->short_side, &m->max_side);
    m->encoding = r->p.encoding;
    m->quality = r->p.encoding == STK_ENC_JPEG ? r->p.quality : 0;
    m->nclasses = stk_source_nclasses(src);
    m->classes = calloc((size_t)m->nclasses + 1, sizeof(char *));
    m->nsplits = stk_source_nsplits(src);
    if (!m->classes)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", raw_dir);
    for (int c = 0; c < m->nclasses; c++)
        if (!(m->classes[c] = strdup(stk_source_class_name(src, c))))
            return stk_fail(err, STK_ENOMEM, "%s: out of memory", raw_dir);
    for (int k = 0; k < m->nsplits; k++) {
        stk_split_meta *sp = &m->splits[k];
        split_stats *st = &r->stats[k];
        snprintf(sp->name, sizeof sp->name, "%s",
                 stk_source_split_name(src, k));
        sp->count = st->written;
        sp->nskipped = st->skipped;
        sp->label_counts = st->labels; /* borrowed; see release_meta */
        for (int ch = 0; ch < m->channels; ch++) {
            stk_channel_stats(st->sums[2 * ch], st->sums[2 * ch + 1],
                              (double)st->pixels, &sp->mean[ch], &sp->std[ch]);
        }
    }
    m->holdout = r->p.opts->source.holdout;
    m->holdout_seed = r->p.opts->source.holdout_seed;
    m->source_path = realpath(raw_dir, NULL);
    if (!m->source_path)
        m->source_path = strdup(raw_dir);
    m->source_format = strdup(stk_source_format_name(src));
    m->tool = strdup("stoke prep " STK_VERSION);
    m->created = strdup(r->p.opts->created ? r->p.opts->created : "");
    m->skipped_json = cJSON_PrintUnformatted(r->skipped);
    if (!m->source_path || !m->source_format || !m->tool || !m->created ||
        !m->skipped_json)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", raw_dir);
    return 0;
}

static void release_meta(stk_meta *m)
{
    for (int k = 0; k < m->nsplits; k++)
        m->splits[k].label_counts = NULL; /* owned by the run */
    stk_meta_free(m);
}

/* LMDB map estimate: records above ~2 KB take whole overflow pages. */
static size_t map_estimate(uint64_t samples, size_t rec)
{
    double per = rec + 24 > 2000 ? (double)((rec + 16 + 4095) / 4096 * 4096)
                                 : (double)(rec + 26) * 1.5;
    return (size_t)(per * (double)samples * 1.25) + ((size_t)16 << 20);
}

/* Payload bytes of a typical record: exact for fixed raw ones; variable
 * ones at 4:3 (the short side, or the max side as the long one); JPEG
 * about a sixth of the pixels. */
static size_t record_guess(int c, int h, int w, int short_side, int max_side,
                           int encoding)
{
    double px = h            ? (double)h * w
                : short_side ? (double)short_side * short_side * 4 / 3
                             : (double)max_side * max_side * 3 / 4;
    return (size_t)(c * px / (encoding == STK_ENC_JPEG ? 6 : 1));
}

/* The classes of a --holdout run that held out some of their files (a
 * class of one file stays in train by design) and that --skip-bad left
 * with no record in one split, as a warning line. */
static void holdout_warning(const run *r, stk_prep_summary *s)
{
    const stk_source *src = r->p.src;
    if (!r->p.opts->source.holdout || stk_source_nsplits(src) != 2 ||
        !(r->stats[0].skipped + r->stats[1].skipped))
        return;
    int nc = stk_source_nclasses(src);
    unsigned char *in = calloc(2 * (size_t)nc + 1, 1); /* files: split, class */
    if (!in)
        return; /* a warning is a help, not a need */
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < stk_source_split_count(src, k); i++) {
            int32_t c = stk_source_label(src, k, i);
            if (c >= 0 && c < nc)
                in[k * nc + c] = 1;
        }
    for (int c = 0; c < nc; c++) /* emptied: the first nc, in place */
        in[c] = in[c] && in[nc + c] &&
                (!r->stats[0].labels[c] || !r->stats[1].labels[c]);
    stk_source_name_classes(src, in, "with no record in one split: "
                            "their files there were skipped (--skip-bad) "
                            "after --holdout divided them; mend or remove the "
                            "bad files, or try another --holdout-seed",
                            s->warning, sizeof s->warning);
    free(in);
}

static void fill_summary(const run *r, stk_prep_summary *s)
{
    if (!s)
        return;
    memset(s, 0, sizeof *s);
    const stk_source *src = r->p.src;
    s->nsplits = stk_source_nsplits(src);
    for (int k = 0; k < s->nsplits; k++) {
        snprintf(s->split[k], sizeof s->split[k], "%s",
                 stk_source_split_name(src, k));
        s->count[k] = r->stats[k].written;
        s->skipped[k] = r->stats[k].skipped;
        s->samples += r->stats[k].written;
    }
    stk_source_shape(src, &s->channels, &s->height, &s->width);
    s->encoding = r->p.encoding;
    s->bytes = r->bytes;
    s->seconds = stk_now() - r->t0;
    snprintf(s->warning, sizeof s->warning, "%s", stk_source_notice(src));
    holdout_warning(r, s);
}

static int run_all(run *r, const char *raw_dir, const char *db_dir,
                   stk_err *err)
{
    const stk_prep_opts *o = r->p.opts;
    int c, h, w, ss, ms, rc;
    stk_source_shape(r->p.src, &c, &h, &w);
    bool variable = stk_source_variable(r->p.src, &ss, &ms);
    r->p.channels = c;
    r->p.encoding = o->encoding;
    r->p.quality = o->quality ? o->quality : 90;
    bool fixed = !variable && o->encoding == STK_ENC_RAW;
    r->p.header = fixed ? STK_RECORD_HEADER : STK_RECORD_HEADER_V2;
    size_t rec = record_guess(c, h, w, ss, ms, o->encoding) + r->p.header;
    for (int k = 0; k < stk_source_nsplits(r->p.src); k++) {
        r->total += stk_source_split_count(r->p.src, k);
        r->stats[k].labels = calloc(
            (size_t)stk_source_nclasses(r->p.src) + 1, sizeof(uint64_t));
        if (!r->stats[k].labels)
            return stk_fail(err, STK_ENOMEM, "%s: out of memory", db_dir);
    }
    stk_store_opts so = {
        .map_size = o->map_size ? o->map_size : map_estimate(r->total, rec),
        .map_size_max = o->map_size_max,
        .force = o->force,
        .force_hint = o->force_hint,
        .verify = true, /* read it all back before publishing */
        .cancel = o->cancel,
    };
    if (!(r->skipped = cJSON_CreateObject()))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", db_dir);
    if ((rc = stk_store_create(db_dir, &so, &r->store, err)) ||
        (rc = pool_init(r, rec, err)) || (rc = write_all(r, err)))
        return rc;
    pool_stop(r);
    /* stop requests are honoured up to here and during the read-back
     * verify in stk_store_finish; after that, DB_DIR appears complete and
     * the run has succeeded */
    if (canceled(o))
        return stk_fail(err, STK_ECANCELED, "interrupted");
    stk_meta m;
    rc = build_meta(r, raw_dir, &m, err);
    if (!rc)
        rc = stk_store_finish(r->store, &m, err);
    release_meta(&m);
    return rc;
}

/* Checks DB_DIR before any work, so that a name that can never be moved
 * into place fails at once instead of after the whole conversion: it must
 * not be empty, must be a directory if it exists, and its parent must be
 * one. Whether it holds a database is the store's business. */
static int check_db_dir(const char *db, stk_err *err)
{
    if (!*db)
        return stk_fail(err, STK_EINVAL, "DB_DIR is empty");
    struct stat st;
    if (stat(db, &st) == 0)
        return S_ISDIR(st.st_mode)
                   ? 0
                   : stk_fail(err, STK_EEXIST,
                              "%s: exists and is not a directory", db);
    if (errno != ENOENT && errno != ENOTDIR)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", db,
                        strerror(errno));
    /* every leading component, shortest first, names the first bad one */
    char *p = strdup(db);
    if (!p)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", db);
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') /* "db/" is db */
        p[--n] = '\0';
    int rc = 0;
    for (size_t i = 1; !rc && i < n; i++) {
        if (p[i] != '/' || p[i - 1] == '/')
            continue;
        p[i] = '\0';
        if (stat(p, &st) != 0)
            rc = stk_fail(err, stk_from_errno(errno), "%s: %s", p,
                          strerror(errno));
        else if (!S_ISDIR(st.st_mode))
            rc = stk_fail(err, STK_ENOENT, "%s: not a directory", p);
        p[i] = '/';
    }
    free(p);
    return rc;
}

int stk_prep_opts_check(const stk_prep_opts *opts, stk_err *err)
{
    if (opts->workers < 1 || opts->workers > 256)
        return stk_fail(err, STK_EINVAL, "--workers must be 1..256, not %d",
                        opts->workers);
    if (opts->encoding != STK_ENC_RAW && opts->encoding != STK_ENC_JPEG)
        return stk_fail(err, STK_EINVAL, "encoding must be raw or jpeg");
    if (opts->quality < 0 || opts->quality > 100)
        return stk_fail(err, STK_EINVAL, "--quality must be 1..100, not %d",
                        opts->quality);
    if (opts->quality && opts->encoding != STK_ENC_JPEG)
        return stk_fail(err, STK_EINVAL, "--quality needs --encode jpeg");
    return stk_source_opts_check(&opts->source, err);
}

int stk_prep_run(const char *raw_dir, const char *db_dir,
                 const stk_prep_opts *opts, stk_prep_summary *summary,
                 stk_err *err)
{
    int rc = stk_prep_opts_check(opts, err);
    if (rc)
        return rc;
    run r;
    memset(&r, 0, sizeof r);
    r.p.opts = opts;
    r.nthreads = opts->workers;
    r.t0 = stk_now();
    stk_source *src = NULL;
    rc = check_db_dir(db_dir, err);
    if (!rc)
        rc = stk_source_open(raw_dir, &opts->source, &src, err);
    if (!rc && canceled(opts)) /* listing a large tree takes a while */
        rc = stk_fail(err, STK_ECANCELED, "interrupted");
    if (!rc) {
        r.p.src = src;
        rc = run_all(&r, raw_dir, db_dir, err);
        fill_summary(&r, summary);
    }
    /* After a stop request, whatever failed (a read cut short by the
     * signal, say, where a handler runs: Python's) is the interruption:
     * the caller exits 130. */
    if (rc && rc != STK_ECANCELED && canceled(opts))
        rc = stk_fail(err, STK_ECANCELED, "interrupted");
    pool_stop(&r);
    stk_store_close(r.store); /* removes the partial database on failure */
    for (int k = 0; k < 8; k++)
        free(r.stats[k].labels);
    cJSON_Delete(r.skipped);
    stk_source_close(src);
    return rc;
}
