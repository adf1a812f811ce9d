/* allreduce_bench.c - one shared-memory all-reduce, timed alone: a
 * private buffer (copied through the segment's slots) against the
 * resident buffer (summed where it lies), as DDP reduces its gradients.
 *
 *   build/bin/allreduce_bench [--world W] [--floats N] [--reps R]
 *
 * Serves a store, forks W ranks (default 2), each on the CPU backend with
 * its gradients in a private buffer and then in the resident one; each
 * does R (default 300) averaging all-reduces of N floats (default 824326,
 * the cnn's parameters) after 20 untimed ones. Rank 0 prints one JSON
 * line: the median and best milliseconds per all-reduce for each. */
#include "distributed/distributed.h"
#include "tests/fork_ranks.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

enum { WARMUP = 20 };

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Median and best of R timed all-reduces of buf, in ms. */
static int time_allreduce(stk_comm *c, float *buf, size_t n, int reps,
                          double *med, double *best, stk_err *err)
{
    double *t = malloc((size_t)reps * sizeof *t);
    if (!t)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    int rc = 0;
    for (int i = 0; !rc && i < WARMUP + reps; i++) {
        double t0 = stk_now();
        rc = stk_comm_allreduce(c, buf, n, STK_AVG, err);
        if (i >= WARMUP)
            t[i - WARMUP] = (stk_now() - t0) * 1e3;
    }
    if (!rc) {
        qsort(t, (size_t)reps, sizeof *t, cmp);
        *med = t[reps / 2];
        *best = t[0];
    }
    free(t);
    return rc;
}

static int rank_main(int rank, int world, int port, size_t n, int reps)
{
    stk_err err;
    stk_backend *be = NULL;
    stk_kv *kv = NULL;
    stk_comm *c = NULL;
    stk_rank_info ri = {.rank = rank, .world = world, .local_rank = rank,
                        .local_world = world};
    float *priv = calloc(n, sizeof *priv), *res = NULL;
    double pm = 0, pb = 0, rm = 0, rb = 0;
    int rc = priv ? 0 : stk_fail(&err, STK_ENOMEM, "out of memory");
    if (!rc)
        rc = stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err);
    if (!rc)
        rc = stk_kv_connect("127.0.0.1", port, 10000, &kv, &err);
    if (!rc)
        rc = stk_comm_create(be, &ri, kv, 10000, &c, &err);
    if (!rc)
        rc = time_allreduce(c, priv, n, reps, &pm, &pb, &err);
    if (!rc)
        rc = stk_comm_resident(c, kv, n, &res, &err);
    if (!rc && !res)
        rc = stk_fail(&err, STK_ENOSPACE, "/dev/shm has no room for %d x %zu floats",
                      world, n);
    if (!rc)
        rc = time_allreduce(c, res, n, reps, &rm, &rb, &err);
    if (rc)
        fprintf(stderr, "allreduce_bench: rank %d: %s\n", rank, err.msg);
    else if (rank == 0)
        printf("{\"world\": %d, \"floats\": %zu, \"reps\": %d, "
               "\"copied_ms\": %.4f, \"copied_best_ms\": %.4f, "
               "\"resident_ms\": %.4f, \"resident_best_ms\": %.4f}\n",
               world, n, reps, pm, pb, rm, rb);
    fflush(stdout); /* the rank leaves with _exit */
    stk_comm_destroy(c);
    stk_kv_close(kv);
    if (be)
        stk_backend_destroy(be);
    free(priv);
    return rc ? 1 : 0;
}

typedef struct bench_args {
    size_t n;
    int reps;
} bench_args;

static int rank_entry(int rank, int world, int port, void *arg)
{
    const bench_args *a = arg;
    return rank_main(rank, world, port, a->n, a->reps);
}

int main(int argc, char **argv)
{
    int world = 2, reps = 300;
    size_t n = 824326;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--world"))
            world = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--floats"))
            n = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else {
            fprintf(stderr, "allreduce_bench: unknown flag %s (want --world, "
                            "--floats, --reps)\n", argv[i]);
            return 2;
        }
    }
    if (world < 2 || world > 64 || reps < 1 || n == 0) {
        fprintf(stderr, "allreduce_bench: want --world 2..64, --reps >= 1, "
                        "--floats >= 1\n");
        return 2;
    }
    bench_args args = {n, reps};
    int *st = calloc((size_t)world, sizeof *st);
    int bad = !st || stk_fork_ranks(world, rank_entry, &args, st);
    for (int r = 0; !bad && r < world; r++)
        bad = !WIFEXITED(st[r]) || WEXITSTATUS(st[r]) != 0;
    free(st);
    return bad;
}
