/* gpu_bench.c - the GPU yardsticks of scripts/gpu_check.sh: the loader's
 * host-to-device rate against a plain pinned copy of the same batches, and
 * the cuBLAS SGEMM peak beside which training's FLOP/s is read.
 *
 *   gpu_bench --db DB [--batch 128] [--workers 4] [--epochs 2] [--gpu 0]
 *             [--gemm 8192]
 *
 * Prints one JSON line (GB/s are 1e9 bytes per second, bytes counted once):
 *   copy_gbs       stk_copy_to_dev of one batch's bytes from a pinned buffer,
 *                  repeated (cudaMemcpyAsync + the wait the trainer pays):
 *                  the ceiling for uploading batches of this size
 *   copy_big_gbs   the same with 64 MiB copies: the link's peak
 *   loader_gbs     the stoke loader over DB's train split into its pinned
 *                  ring, every batch uploaded from its slot before the slot
 *                  goes back: what the training loop can be fed at
 *   loader_share   loader_gbs / copy_gbs (issue 15's target: >= 0.8)
 *   sgemm_tflops   the best of 5 N x N x N stk_gemm calls on the GPU
 *                  (cuBLAS, its default math: no TF32), 2 N^3 flops each */
#include "kernels/kernels.h"
#include "loader/loader.h"
#include "store/store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct opts {
    const char *db;
    int batch, workers, epochs, gpu, gemm_n;
} opts;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int die(const char *what, const stk_err *err)
{
    fprintf(stderr, "gpu_bench: %s: %s\n", what, err->msg);
    return 1;
}

static int parse(int argc, char **argv, opts *o)
{
    *o = (opts){NULL, 128, 4, 2, 0, 8192};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int *num = !strcmp(a, "--batch")     ? &o->batch
                   : !strcmp(a, "--workers") ? &o->workers
                   : !strcmp(a, "--epochs")  ? &o->epochs
                   : !strcmp(a, "--gpu")     ? &o->gpu
                   : !strcmp(a, "--gemm")    ? &o->gemm_n
                                             : NULL;
        if (!v || (!num && strcmp(a, "--db"))) {
            fprintf(stderr, "gpu_bench: unknown or incomplete option '%s' "
                            "(expected --db DB, --batch, --workers, --epochs, "
                            "--gpu, --gemm N)\n", a);
            return 2;
        }
        if (num)
            *num = atoi(v);
        else
            o->db = v;
        i++;
    }
    if (!o->db || o->batch < 1 || o->epochs < 1 || o->gemm_n < 1) {
        fprintf(stderr, "gpu_bench: needs --db DB and positive sizes\n");
        return 2;
    }
    return 0;
}

/* GB/s of `reps` uploads of `bytes` from pinned memory. */
static int copy_rate(stk_backend *be, size_t bytes, int reps, double *gbs,
                     stk_err *err)
{
    void *host = stk_pinned_alloc(be, bytes);
    void *dev = stk_dev_alloc(be, bytes, err);
    int rc = host && dev ? 0 : STK_ENOMEM;
    if (!host)
        stk_fail(err, STK_ENOMEM, "pinned buffer of %zu bytes", bytes);
    if (!rc) {
        memset(host, 1, bytes);
        rc = stk_copy_to_dev(be, dev, host, bytes, err); /* warm-up */
    }
    double t0 = now();
    for (int i = 0; i < reps && !rc; i++)
        rc = stk_copy_to_dev(be, dev, host, bytes, err);
    if (!rc)
        rc = stk_sync(be, err);
    *gbs = (double)bytes * reps / (now() - t0) / 1e9;
    stk_dev_free(be, dev);
    stk_pinned_free(be, host);
    return rc;
}

static void *pin(size_t n, void *ctx) { return stk_pinned_alloc(ctx, n); }
static void unpin(void *p, void *ctx) { stk_pinned_free(ctx, p); }

/* The loader into its pinned ring, each batch uploaded from its slot. */
static int loader_rate(stk_backend *be, const opts *o, size_t *batch_bytes,
                       double *gbs, stk_err *err)
{
    stk_store *st = NULL;
    stk_loader *l = NULL;
    int rc = stk_store_open(o->db, 0, &st, err);
    stk_loader_opts lo = {.split = "train", .batch_size = o->batch,
                          .workers = o->workers, .shuffle = true, .seed = 1,
                          .host = {pin, unpin, be}};
    if (!rc)
        rc = stk_loader_open(st, &lo, &l, err);
    const stk_meta *meta = st ? stk_store_meta(st) : NULL;
    size_t per = meta ? (size_t)meta->channels * meta->height * meta->width : 0;
    *batch_bytes = per * (size_t)o->batch;
    void *dev = rc ? NULL : stk_dev_alloc(be, *batch_bytes, err);
    if (!rc && !dev)
        rc = STK_ENOMEM;
    size_t bytes = 0;
    double t0 = now();
    for (int e = 0; e < o->epochs && !rc; e++) {
        stk_batch b;
        while (!rc && (rc = stk_loader_next(l, &b, err)) == 1) {
            size_t n = (size_t)b.n * b.sample_bytes;
            rc = stk_copy_to_dev(be, dev, b.data, n, err);
            stk_loader_release(l, &b);
            bytes += n;
        }
        rc = rc < 0 ? rc : 0; /* 0: the epoch ended */
    }
    if (!rc)
        rc = stk_sync(be, err);
    *gbs = (double)bytes / (now() - t0) / 1e9;
    stk_dev_free(be, dev);
    stk_loader_close(l);
    stk_store_close(st);
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
        double t0 = now();
        rc = stk_gemm(be, false, false, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n,
                      err);
        if (!rc)
            rc = stk_sync(be, err);
        if (i > 0 && now() - t0 < best)
            best = now() - t0;
    }
    *tflops = 2.0 * n * (double)n * n / best / 1e12;
    stk_dev_free(be, c);
    stk_dev_free(be, b);
    stk_dev_free(be, a);
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
    if (stk_backend_create(STK_DEV_CUDA, o.gpu, 1, &be, &err))
        return err.code == STK_ENODEV ? (printf("SKIP: %s\n", err.msg), 77)
                                      : die("cuda", &err);
    size_t batch_bytes = 0;
    double loader = 0, copy = 0, big = 0, tflops = 0;
    if (loader_rate(be, &o, &batch_bytes, &loader, &err))
        rc = die(o.db, &err);
    else if (copy_rate(be, batch_bytes, 2000, &copy, &err) ||
             copy_rate(be, (size_t)64 << 20, 20, &big, &err))
        rc = die("pinned copy", &err);
    else if (gemm_peak(be, o.gemm_n, &tflops, &err))
        rc = die("sgemm", &err);
    if (!rc)
        printf("{\"device\": \"%s\", \"batch_bytes\": %zu, \"workers\": %d, "
               "\"copy_gbs\": %.3f, \"copy_big_gbs\": %.3f, "
               "\"loader_gbs\": %.3f, \"loader_share\": %.3f, "
               "\"sgemm_n\": %d, \"sgemm_tflops\": %.2f}\n",
               stk_backend_name(be), batch_bytes, o.workers, copy, big, loader,
               loader / copy, o.gemm_n, tflops);
    stk_backend_destroy(be);
    return rc;
}
