/* loader_cold.c - stoke's time to first batch in a fresh process, the way a
 * training script meets it (bench/loader_bench.sh, part D). `sweep` reads
 * the split once before it times anything, so its first batch finds the
 * database's pages already mapped; here nothing is read before the clock
 * starts (the page cache is warm, the process's page tables are not).
 *
 *   cc -O2 -I. bench/loader_cold.c build/loader/libstk_loader.a \
 *      build/preprocess/libstk_preprocess.a build/store/libstk_store.a \
 *      build/common/libstk_common.a -lcjson -llmdb -lturbojpeg -lspng -lz -lm \
 *      -lpthread
 *   loader_cold DB_DIR WORKERS [BATCH]
 *
 * Prints one JSON object: store_open_ms (stk_store_open), first_batch_ms
 * (stk_loader_open to the first batch in hand, what sweep calls first batch
 * plus the open), epoch_ms and samples_per_s for the rest of that first
 * epoch. */
#include "loader/loader.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: loader_cold DB_DIR WORKERS [BATCH]\n");
        return 2;
    }
    int workers = atoi(argv[2]), batch = argc > 3 ? atoi(argv[3]) : 256;
    stk_err err = {0};
    stk_store *store;
    double t0 = now();
    if (stk_store_open(argv[1], 0, &store, &err)) {
        fprintf(stderr, "loader_cold: %s\n", err.msg);
        return 1;
    }
    double t1 = now();
    stk_loader_opts o = {.split = "train", .batch_size = batch,
                         .workers = workers, .shuffle = true};
    stk_loader *l;
    if (stk_loader_open(store, &o, &l, &err)) {
        fprintf(stderr, "loader_cold: %s\n", err.msg);
        return 1;
    }
    stk_batch b;
    int rc;
    long n = 0;
    double first = 0;
    while ((rc = stk_loader_next(l, &b, &err)) == 1) {
        if (!n)
            first = now() - t1;
        n += b.n;
        stk_loader_release(l, &b);
    }
    double t2 = now();
    if (rc < 0) {
        fprintf(stderr, "loader_cold: %s\n", err.msg);
        return 1;
    }
    stk_loader_close(l);
    stk_store_close(store);
    printf("{\"workers\": %d, \"batch\": %d, \"samples\": %ld, \"store_open_ms\": %.3f, "
           "\"first_batch_ms\": %.3f, \"epoch_ms\": %.3f, \"samples_per_s\": %.0f}\n",
           workers, batch, n, (t1 - t0) * 1e3, first * 1e3, (t2 - t1) * 1e3,
           n / (t2 - t1));
    return 0;
}
