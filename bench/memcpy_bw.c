/* memcpy_bw.c - this machine's copy bandwidth, the yardstick for the
 * loader's bytes/s (bench/loader_bench.sh).
 *
 *   cc -O2 -o memcpy_bw bench/memcpy_bw.c -lpthread
 *   memcpy_bw [--mib 256] [--reps 7] [--chunk 3072] [--threads 1]
 *
 * Prints one JSON object with three measurements, each the best of --reps
 * runs, in GB/s (1e9 bytes copied per second, bytes counted once, not
 * read + write):
 *   memcpy_gbs   one memcpy of a --mib MiB buffer into another (both larger
 *                than the caches, both touched first)
 *   gather_gbs   what a loader does: --chunk-byte pieces taken from random
 *                positions (a random permutation of chunk-sized slots) of a
 *                --mib MiB buffer, copied one after another into a batch
 *                buffer of 256 chunks that is reused (it stays in cache,
 *                like a ring slot); every chunk of the big buffer is copied
 *                once per run
 *   gather_par_gbs  the same gather run by --threads threads at once, each
 *                over its own buffer, aggregate GB/s (0 with --threads 1);
 *                shows whether this machine's CPUs scale on copies
 * Single-threaded figures use the calling thread only. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BATCH 256

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *big_alloc(size_t n)
{
    void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!p) {
        fprintf(stderr, "memcpy_bw: cannot allocate %zu bytes\n", n);
        exit(1);
    }
    memset(p, 1, n); /* fault every page in before timing */
    return p;
}

/* A compiler barrier so that copies into the reused batch buffer are not
 * optimised away. */
static void clobber(void *p) { __asm__ volatile("" : : "g"(p) : "memory"); }

typedef struct gather {
    uint8_t *src, *dst;
    uint32_t *order;
    size_t nchunks, chunk;
    int reps;
    double best; /* seconds for one pass */
} gather;

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void gather_init(gather *g, size_t bytes, size_t chunk, int reps,
                        uint64_t seed)
{
    g->chunk = chunk;
    g->nchunks = bytes / chunk;
    g->reps = reps;
    g->src = big_alloc(g->nchunks * chunk);
    g->dst = big_alloc(BATCH * chunk);
    g->order = malloc(g->nchunks * sizeof *g->order);
    if (!g->order)
        exit(1);
    for (size_t i = 0; i < g->nchunks; i++)
        g->order[i] = (uint32_t)i;
    for (size_t i = g->nchunks - 1; i > 0; i--) { /* Fisher-Yates */
        size_t j = splitmix(&seed) % (i + 1);
        uint32_t t = g->order[i];
        g->order[i] = g->order[j];
        g->order[j] = t;
    }
}

static void *gather_run(void *arg)
{
    gather *g = arg;
    g->best = 1e30;
    for (int r = 0; r < g->reps; r++) {
        double t0 = now();
        for (size_t i = 0; i < g->nchunks; i++) {
            memcpy(g->dst + (i % BATCH) * g->chunk,
                   g->src + (size_t)g->order[i] * g->chunk, g->chunk);
            if (i % BATCH == BATCH - 1)
                clobber(g->dst);
        }
        clobber(g->dst);
        double dt = now() - t0;
        if (dt < g->best)
            g->best = dt;
    }
    return NULL;
}

static void gather_free(gather *g)
{
    free(g->src);
    free(g->dst);
    free(g->order);
}

int main(int argc, char **argv)
{
    size_t mib = 256, chunk = 3072;
    int reps = 7, threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "usage: memcpy_bw [--mib N] [--reps N] [--chunk BYTES] [--threads N]\n");
            return 2;
        }
        if (!strcmp(a, "--mib"))
            mib = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--reps"))
            reps = atoi(v);
        else if (!strcmp(a, "--chunk"))
            chunk = strtoull(v, NULL, 10);
        else if (!strcmp(a, "--threads"))
            threads = atoi(v);
        else {
            fprintf(stderr, "memcpy_bw: unknown option %s\n", a);
            return 2;
        }
        i++;
    }
    if (!mib || !chunk || reps < 1 || threads < 1 || threads > 64) {
        fprintf(stderr, "memcpy_bw: bad arguments\n");
        return 2;
    }
    size_t bytes = mib << 20;

    /* 1. one big memcpy */
    uint8_t *src = big_alloc(bytes), *dst = big_alloc(bytes);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        memcpy(dst, src, bytes);
        clobber(dst);
        double dt = now() - t0;
        if (dt < best)
            best = dt;
    }
    free(src);
    free(dst);
    double memcpy_gbs = bytes / best / 1e9;

    /* 2. gathered chunks, one thread */
    gather g;
    gather_init(&g, bytes, chunk, reps, 42);
    gather_run(&g);
    double gather_gbs = g.nchunks * chunk / g.best / 1e9;
    gather_free(&g);

    /* 3. the same gather in several threads at once */
    double par_gbs = 0;
    if (threads > 1) {
        gather gs[64];
        pthread_t th[64];
        for (int t = 0; t < threads; t++)
            gather_init(&gs[t], bytes / threads, chunk, reps, 43 + t);
        for (int t = 0; t < threads; t++)
            pthread_create(&th[t], NULL, gather_run, &gs[t]);
        double slowest = 0;
        size_t total = 0;
        for (int t = 0; t < threads; t++) {
            pthread_join(th[t], NULL);
            slowest = gs[t].best > slowest ? gs[t].best : slowest;
            total += gs[t].nchunks * chunk;
            gather_free(&gs[t]);
        }
        par_gbs = total / slowest / 1e9;
    }
    printf("{\"mib\": %zu, \"reps\": %d, \"chunk\": %zu, \"threads\": %d, "
           "\"memcpy_gbs\": %.3f, \"gather_gbs\": %.3f, "
           "\"gather_par_gbs\": %.3f}\n",
           mib, reps, chunk, threads, memcpy_gbs, gather_gbs, par_gbs);
    return 0;
}
