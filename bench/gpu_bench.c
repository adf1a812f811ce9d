/* gpu_bench.c - the GPU yardsticks of scripts/gpu_check.sh: the loader's
 * host-to-device rate against pinned copies of the same batches, and the
 * cuBLAS SGEMM peak beside which training's FLOP/s is read.
 *
 *   gpu_bench --db DB [--batch 128] [--workers 1,2,4,8] [--epochs 2]
 *             [--gpu 0] [--gemm 8192] [--inflight 2] [--prefetch 0]
 *             [--spin US] [--stores stream|plain]
 *             [--device cuda | --device cpu [--link G]]
 *
 * Every upload runs as the trainer's do (trainer/upload.c): on the copy
 * stream, two in flight (--inflight K: K, for the baseline too), a buffer
 * reused once its event completed; --prefetch P: the loader's ring (0: its
 * default); --spin US: the loader's spin_us (0: its default, -1: none);
 * --stores: how the workers write records into the ring, `stream`
 * (stream_stores, non-temporal stores: the trainer's on a GPU, and the
 * default with --device cuda) or `plain` (the default with --device cpu);
 * --device cpu: the same loop on the CPU backend, where an upload is a
 * memcpy (a stand-in for the uploading thread's costs on machines without
 * a GPU), and --link G makes each last as long as a copy at G GB/s (a
 * GPU's link) by spinning after it; --gemm 0: no SGEMM. Prints one JSON
 * line (GB/s are 1e9 bytes per second, bytes counted once):
 *   copy_gbs       one batch's bytes copied again and again from one
 *                  pinned buffer: the cudaMemcpyAsync peak for batches of
 *                  this size, the ceiling for uploading them
 *   copy_ring_gbs  the same copies from `ring` pinned buffers in turn (the
 *                  best count's ring): the same bytes as the loader's ring
 *                  to read, past the host's caches for large batches
 *   copy_big_gbs   the same as copy_gbs with 64 MiB copies: the link's
 *                  peak
 *   loader         {workers: GB/s} for each --workers count: the stoke
 *                  loader over DB's train split into its pinned ring,
 *                  every batch uploaded from its slot, the slot handed
 *                  back once its copy is done
 *   workers, loader_gbs, loader_share   the best count, its GB/s and
 *                  loader_gbs / copy_gbs (issue 15's target: >= 0.8)
 *   consumer       {workers: [next, stall, release, settle, issue, busy,
 *                  wakes]}:
 *                  the shares of the uploading thread's time spent in
 *                  stk_loader_next (stall: of that, waiting for a batch
 *                  to be filled, the loader's own count), in
 *                  stk_loader_release, waiting for a buffer's earlier
 *                  copy, and queueing the copy and its event; and the
 *                  workers' mean share of time spent filling batches;
 *                  wakes: the times per batch the uploading thread woke
 *                  idle workers (a futex call each)
 *   stores         "stream" or "plain": --stores
 *   sgemm_tflops   the best of 5 N x N x N stk_gemm calls on the GPU
 *                  (cuBLAS, its default math: no TF32), 2 N^3 flops each */
#include "common/cli.h"
#include "kernels/kernels.h"
#include "loader/loader.h"
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { MAX_COUNTS = 16, MAX_INFLIGHT = 8, MAX_RING = 1024, JSON_CAP = 1024 };

typedef struct opts {
    const char *db;
    stk_device_kind device;
    int batch, epochs, gpu, gemm_n, inflight, prefetch, spin;
    double link_gbs; /* --device cpu: the emulated link's rate */
    int stores; /* --stores: 1 stream, 0 plain, -1 the device's default */
    int workers[MAX_COUNTS], nworkers;
} opts;

/* "1,2,4": distinct worker counts of 0..STK_LOADER_MAX_WORKERS; -1 when
 * not (printed). */
static int parse_workers(const char *v, opts *o)
{
    if (stk_cli_int_list("gpu_bench", "--workers", v, 0,
                         STK_LOADER_MAX_WORKERS, o->workers, MAX_COUNTS,
                         &o->nworkers))
        return -1;
    for (int j = 1; j < o->nworkers; j++)
        for (int i = 0; i < j; i++)
            if (o->workers[i] == o->workers[j]) {
                fprintf(stderr, "gpu_bench: --workers: expected distinct "
                                "counts, got '%s'\n", v);
                return -1;
            }
    return 0;
}

static int die(const char *what, const stk_err *err)
{
    fprintf(stderr, "gpu_bench: %s: %s\n", what, err->msg);
    return 1;
}

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){NULL, STK_DEV_CUDA, 128, 2, 0, 8192, 2, 0, 0, 0, -1,
                {1, 2, 4, 8}, 4};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *num = !strcmp(a, "--batch")    ? &o->batch
                   : !strcmp(a, "--epochs") ? &o->epochs
                   : !strcmp(a, "--gpu")    ? &o->gpu
                   : !strcmp(a, "--gemm")   ? &o->gemm_n
                   : !strcmp(a, "--inflight") ? &o->inflight
                   : !strcmp(a, "--prefetch") ? &o->prefetch
                   : !strcmp(a, "--spin")   ? &o->spin
                                            : NULL;
        bool known = num || !strcmp(a, "--db") || !strcmp(a, "--workers") ||
                     !strcmp(a, "--device") || !strcmp(a, "--link") ||
                     !strcmp(a, "--stores");
        if (!v || !known) {
            fprintf(stderr, "gpu_bench: unknown or incomplete option '%s' "
                            "(expected --db DB, --batch, --workers N,N,..., "
                            "--epochs, --gpu, --gemm N, --inflight K, "
                            "--prefetch P, --spin US, --stores "
                            "stream|plain, --device cuda|cpu, --link "
                            "GB/s)\n", a);
            return 2;
        }
        if (num)
            *num = atoi(v);
        else if (!strcmp(a, "--db"))
            o->db = v;
        else if (!strcmp(a, "--link")) {
            char *end;
            o->link_gbs = strtod(v, &end);
            if (end == v || *end || !(o->link_gbs > 0)) {
                fprintf(stderr, "gpu_bench: --link '%s': expected GB/s > "
                                "0\n", v);
                return 2;
            }
        }
        else if (!strcmp(a, "--stores")) {
            if (strcmp(v, "stream") && strcmp(v, "plain")) {
                fprintf(stderr, "gpu_bench: --stores '%s': expected stream "
                                "or plain\n", v);
                return 2;
            }
            o->stores = !strcmp(v, "stream");
        }
        else if (!strcmp(a, "--device")) {
            if (strcmp(v, "cuda") && strcmp(v, "cpu")) {
                fprintf(stderr, "gpu_bench: --device '%s': expected cuda or "
                                "cpu\n", v);
                return 2;
            }
            o->device = strcmp(v, "cpu") ? STK_DEV_CUDA : STK_DEV_CPU;
        }
        else if (parse_workers(v, o))
            return 2;
        i++;
    }
    if (!o->db || o->batch < 1 || o->epochs < 1 || o->gemm_n < 0 ||
        o->inflight < 1 || o->inflight > MAX_INFLIGHT || o->prefetch < 0 ||
        o->prefetch > MAX_RING ||
        o->link_gbs < 0 || (o->link_gbs && o->device != STK_DEV_CPU)) {
        fprintf(stderr, "gpu_bench: needs --db DB, positive sizes, "
                        "--inflight 1..%d and --link only with --device "
                        "cpu\n", MAX_INFLIGHT);
        return 2;
    }
    if (o->stores < 0) /* as the trainer: streamed for the copy engine */
        o->stores = o->device == STK_DEV_CUDA;
    return 0;
}

/* k uploads in flight (the trainer keeps two, trainer/upload.c): each on
 * the copy stream, an event behind it; a buffer is reused (and its batch's
 * slot handed back) once its event completed. The seconds spent waiting
 * for buffers and queueing copies are summed for the report. */
typedef struct flight {
    void *dev[MAX_INFLIGHT];
    stk_event *ev[MAX_INFLIGHT];
    stk_batch held[MAX_INFLIGHT];
    bool busy[MAX_INFLIGHT];
    int next, k;
    double link_gbs; /* > 0: each copy lasts as long as on such a link */
    double settle_s, issue_s, release_s;
} flight;

static int flight_open(stk_backend *be, flight *f, int k, double link_gbs,
                       size_t bytes, stk_err *err)
{
    memset(f, 0, sizeof *f);
    f->k = k;
    f->link_gbs = link_gbs;
    int rc = 0;
    for (int i = 0; i < k && !rc; i++) {
        f->dev[i] = stk_dev_alloc(be, bytes, err);
        rc = f->dev[i] ? stk_event_create(be, &f->ev[i], err) : STK_ENOMEM;
    }
    return rc;
}

static void flight_close(stk_backend *be, flight *f)
{
    for (int i = 0; i < f->k; i++) {
        stk_event_destroy(be, f->ev[i]);
        stk_dev_free(be, f->dev[i]);
    }
}

/* Waits for buffer i's upload; its batch (if any) goes back to l. */
static int flight_settle(stk_backend *be, flight *f, int i, stk_loader *l,
                         stk_err *err)
{
    if (!f->busy[i])
        return 0;
    double t0 = stk_now();
    int rc = stk_event_wait(be, f->ev[i], err);
    f->settle_s += stk_now() - t0;
    f->busy[i] = false;
    t0 = stk_now();
    if (!rc && l)
        stk_loader_release(l, &f->held[i]);
    f->release_s += stk_now() - t0;
    return rc;
}

/* Queues n bytes from src (pinned) into the next buffer; b, if any, is
 * held until the copy is done. */
static int flight_put(stk_backend *be, flight *f, const void *src, size_t n,
                      const stk_batch *b, stk_loader *l, stk_err *err)
{
    int i = f->next;
    f->next = (i + 1) % f->k;
    int rc = flight_settle(be, f, i, l, err);
    double t0 = stk_now();
    if (!rc)
        rc = stk_upload(be, f->dev[i], src, n, err);
    /* the CPU's copy is done when it returns; a GPU's queued copy keeps
     * its thread in the CUDA calls for about as long (at two in flight) */
    while (!rc && f->link_gbs && stk_now() - t0 < (double)n / f->link_gbs / 1e9)
        stk_cpu_relax();
    if (!rc)
        rc = stk_event_record(be, f->ev[i], STK_STREAM_COPY, err);
    f->issue_s += stk_now() - t0;
    if (!rc && b)
        f->held[i] = *b;
    f->busy[i] = !rc;
    return rc;
}

static int flight_drain(stk_backend *be, flight *f, stk_loader *l, stk_err *err)
{
    int rc = 0;
    for (int i = 0; i < f->k; i++) {
        int rci = flight_settle(be, f, i, l, err);
        rc = rc ? rc : rci;
    }
    return rc;
}

/* GB/s of `reps` uploads of `bytes` from nbuf pinned buffers in turn, k
 * in flight: from one, the cudaMemcpyAsync peak for copies of this size;
 * from as many as the loader's ring, the same reading memory as the
 * ring's footprint (past the caches where that is larger). */
static int copy_rate(stk_backend *be, const opts *o, size_t bytes, int nbuf,
                     int reps, double *gbs, stk_err *err)
{
    void *host[MAX_RING] = {0};
    flight f;
    int rc = flight_open(be, &f, o->inflight, o->link_gbs, bytes, err);
    for (int i = 0; i < nbuf && !rc; i++) {
        if (!(host[i] = stk_pinned_alloc(be, bytes)))
            rc = stk_fail(err, STK_ENOMEM, "%d pinned buffers of %zu bytes",
                          nbuf, bytes);
        else
            memset(host[i], 1, bytes);
    }
    if (!rc) /* a warm-up */
        rc = flight_put(be, &f, host[0], bytes, NULL, NULL, err);
    if (!rc)
        rc = flight_drain(be, &f, NULL, err);
    double t0 = stk_now();
    for (int i = 0; i < reps && !rc; i++)
        rc = flight_put(be, &f, host[i % nbuf], bytes, NULL, NULL, err);
    if (!rc)
        rc = flight_drain(be, &f, NULL, err);
    *gbs = (double)bytes * reps / (stk_now() - t0) / 1e9;
    flight_close(be, &f);
    for (int i = 0; i < nbuf; i++)
        stk_pinned_free(be, host[i]);
    return rc;
}

static void *pin(size_t n, void *ctx) { return stk_pinned_alloc(ctx, n); }
static void unpin(void *p, void *ctx) { stk_pinned_free(ctx, p); }

/* The uploading thread's time: waiting in stk_loader_next, for a buffer,
 * queueing copies (shares of the whole). */
typedef struct consumer_time {
    double next, stall, release, settle, issue, busy, wakes;
} consumer_time;

/* The loader with `workers` threads into its pinned ring, each batch (of
 * at most batch_bytes) uploaded from its slot, which goes back once the
 * copy is done. */
static int loader_rate(stk_backend *be, stk_store *st, const opts *o,
                       size_t batch_bytes, int workers, double *gbs,
                       consumer_time *ct, int *slots, stk_err *err)
{
    stk_loader *l = NULL;
    stk_loader_opts lo = {.split = "train", .batch_size = o->batch,
                          .workers = workers, .prefetch = o->prefetch,
                          .spin_us = o->spin, .stream_stores = o->stores,
                          .shuffle = true, .seed = 1,
                          .host = {pin, unpin, be}};
    flight f;
    int rc = flight_open(be, &f, o->inflight, o->link_gbs, batch_bytes, err);
    if (!rc)
        rc = stk_loader_open(st, &lo, &l, err);
    size_t bytes = 0;
    double t0 = stk_now(), next_s = 0, t1;
    for (int e = 0; e < o->epochs && !rc; e++) {
        stk_batch b;
        /* the buffer's last batch goes back before the next is asked for,
         * so that a ring of 2 (one worker) can make progress */
        while (!(rc = flight_settle(be, &f, f.next, l, err)) &&
               (t1 = stk_now(), rc = stk_loader_next(l, &b, err),
                next_s += stk_now() - t1, rc == 1)) {
            size_t n = (size_t)b.n * b.sample_bytes;
            rc = flight_put(be, &f, b.data, n, &b, l, err);
            if (rc) /* the copy may still read it: the close frees it */
                break;
            bytes += n;
        }
        rc = rc < 0 ? rc : 0; /* 0: the epoch ended */
    }
    if (!rc)
        rc = flight_drain(be, &f, l, err);
    double s = stk_now() - t0;
    *gbs = (double)bytes / s / 1e9;
    stk_loader_stats ls = {0};
    if (l) {
        stk_loader_stats_get(l, &ls);
        *slots = stk_loader_slots(l);
    }
    double busy = 0;
    for (int w = 0; w < ls.workers; w++)
        busy += ls.busy[w] / s / ls.workers;
    *ct = (consumer_time){next_s / s,      ls.wait / s,   f.release_s / s,
                          f.settle_s / s,  f.issue_s / s, busy,
                          ls.batches ? (double)ls.wakes / ls.batches : 0};
    stk_loader_close(l); /* after an error too: cudaFreeHost waits for the
                            copies still reading its blocks */
    flight_close(be, &f);
    return rc;
}

static int gemm_peak(stk_backend *be, int n, double *tflops, stk_err *err)
{
    size_t bytes = (size_t)n * n * sizeof(float);
    float *a = stk_dev_alloc(be, bytes, err), *b = NULL, *c = NULL;
    if (a)
        b = stk_dev_alloc(be, bytes, err);
    if (b)
        c = stk_dev_alloc(be, bytes, err);
    int rc = c ? 0 : STK_ENOMEM;
    if (!rc)
        rc = stk_memzero(be, a, bytes, err) || stk_memzero(be, b, bytes, err);
    double best = 1e30;
    for (int i = 0; i < 6 && !rc; i++) { /* the first is a warm-up */
        double t0 = stk_now();
        rc = stk_gemm(be, false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n,
                      err);
        if (!rc)
            rc = stk_sync(be, err);
        if (i > 0 && stk_now() - t0 < best)
            best = stk_now() - t0;
    }
    *tflops = 2.0 * n * (double)n * n / best / 1e12;
    stk_dev_free(be, c);
    stk_dev_free(be, b);
    stk_dev_free(be, a);
    return rc;
}

/* The loader's rate at each worker count, as JSON pairs into json, and
 * the uploading thread's time into cjson (JSON_CAP bytes each); the best
 * count and rate. */
static int loader_rates(stk_backend *be, const opts *o, size_t *batch_bytes,
                        char *json, char *cjson, int *best_w, int *best_slots,
                        double *best, stk_err *err)
{
    stk_store *st = NULL;
    int rc = stk_store_open(o->db, 0, &st, err);
    if (rc)
        return rc;
    const stk_meta *meta = stk_store_meta(st);
    *batch_bytes = (size_t)meta->channels * meta->height * meta->width *
                   (size_t)o->batch;
    size_t at = 0, cat = 0, cap = JSON_CAP;
    *best = -1;
    for (int i = 0; i < o->nworkers && !rc; i++) {
        double gbs = 0;
        consumer_time ct = {0};
        int slots = 0;
        rc = loader_rate(be, st, o, *batch_bytes, o->workers[i], &gbs, &ct,
                         &slots, err);
        if (!rc && gbs > *best)
            *best = gbs, *best_w = o->workers[i], *best_slots = slots;
        if (!rc && at < cap)
            at += (size_t)snprintf(json + at, cap - at, "%s\"%d\": %.3f",
                                   i ? ", " : "", o->workers[i], gbs);
        if (!rc && cat < cap)
            cat += (size_t)snprintf(cjson + cat, cap - cat,
                                    "%s\"%d\": [%.3f, %.3f, %.3f, %.3f, "
                                    "%.3f, %.3f, %.3f]",
                                    i ? ", " : "", o->workers[i], ct.next,
                                    ct.stall, ct.release, ct.settle,
                                    ct.issue, ct.busy, ct.wakes);
    }
    stk_store_close(st);
    return rc;
}

int main(int argc, char **argv)
{
    opts o;
    int rc = parse(argc, argv, &o);
    if (rc)
        return rc;
    stk_err err = {0};
    stk_backend *be = NULL;
    if (stk_backend_create(o.device, o.gpu, 1, &be, &err))
        return err.code == STK_ENODEV ? (printf("SKIP: %s\n", err.msg), 77)
                                      : die("cuda", &err);
    size_t batch_bytes = 0;
    double loader = 0, copy = 0, ring = 0, big = 0, tflops = 0;
    int best_w = 0, slots = 0; /* the best count's ring */
    char rates[JSON_CAP] = "", times[JSON_CAP] = "";
    if (loader_rates(be, &o, &batch_bytes, rates, times, &best_w, &slots,
                     &loader, &err))
        rc = die(o.db, &err);
    if (!rc && (copy_rate(be, &o, batch_bytes, 1, 4000, &copy, &err) ||
                copy_rate(be, &o, batch_bytes, slots, 4000, &ring, &err) ||
                copy_rate(be, &o, (size_t)64 << 20, 1, 40, &big, &err)))
        rc = die("pinned copy", &err);
    else if (o.gemm_n && gemm_peak(be, o.gemm_n, &tflops, &err))
        rc = die("sgemm", &err);
    if (!rc)
        printf("{\"device\": \"%s\", \"batch_bytes\": %zu, "
               "\"inflight\": %d, \"loader\": {%s}, \"workers\": %d, "
               "\"copy_gbs\": %.3f, \"copy_ring_gbs\": %.3f, "
               "\"ring\": %d, \"copy_big_gbs\": %.3f, "
               "\"loader_gbs\": %.3f, \"loader_share\": %.3f, "
               "\"consumer\": {%s}, \"stores\": \"%s\", "
               "\"sgemm_n\": %d, \"sgemm_tflops\": %.2f}\n",
               stk_backend_name(be), batch_bytes, o.inflight, rates, best_w,
               copy, ring, slots, big, loader, loader / copy, times,
               o.stores ? "stream" : "plain", o.gemm_n, tflops);
    stk_backend_destroy(be);
    return rc;
}
