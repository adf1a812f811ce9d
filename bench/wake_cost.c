/* wake_cost.c - what waking sleeping threads costs the thread that wakes
 * them: the loader's consumer did this every half ring (loader/loader.c,
 * docs/loader.md "Idle workers").
 *
 *   cc -O2 -o wake_cost bench/wake_cost.c -lpthread
 *   wake_cost [--sleepers 1,2,8] [--reps 2000]
 *
 * For each count N, N threads sleep on a condition variable; the caller
 * waits until all of them sleep (and 50 us more, so that their cores go
 * idle), then times lock + pthread_cond_broadcast + unlock. Prints one
 * JSON object: {"N": mean microseconds, ...}, and "clock_us", the mean
 * cost of the clock_gettime pair around it. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { MAX_SLEEPERS = 64 };

typedef struct room {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int gen; /* bumped by each wake-up; -1: leave */
    atomic_int asleep;
} room;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void *sleeper(void *arg)
{
    room *r = arg;
    pthread_mutex_lock(&r->mu);
    for (int seen = r->gen; seen >= 0; seen = r->gen) {
        r->asleep++;
        while (r->gen == seen)
            pthread_cond_wait(&r->cv, &r->mu);
        r->asleep--;
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void wake(room *r, int gen)
{
    pthread_mutex_lock(&r->mu);
    r->gen = gen;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* Mean seconds of one broadcast to n sleeping threads. */
static double broadcast_cost(int n, int reps)
{
    room r = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0};
    pthread_t t[MAX_SLEEPERS];
    for (int i = 0; i < n; i++)
        pthread_create(&t[i], NULL, sleeper, &r);
    double sum = 0;
    for (int k = 1; k <= reps; k++) {
        while (r.asleep < n)
            usleep(10);
        usleep(50);
        double t0 = now();
        wake(&r, k);
        sum += now() - t0;
    }
    while (r.asleep < n)
        usleep(10);
    wake(&r, -1);
    for (int i = 0; i < n; i++)
        pthread_join(t[i], NULL);
    return sum / reps;
}

/* "1,2,8": counts 1..MAX_SLEEPERS, no empty item; returns how many or -1. */
static int parse_counts(const char *s, int *out)
{
    int k = 0;
    for (const char *p = s;; p++) {
        char *end;
        long n = strtol(p, &end, 10);
        if (end == p || n < 1 || n > MAX_SLEEPERS || k == MAX_SLEEPERS ||
            (*end && *end != ','))
            return -1;
        out[k++] = (int)n;
        if (!*end)
            return k;
        p = end;
    }
}

int main(int argc, char **argv)
{
    const char *counts = "1,2,8", *reps_s = "2000";
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--sleepers"))
            counts = argv[i + 1];
        else if (!strcmp(argv[i], "--reps"))
            reps_s = argv[i + 1];
        else
            argc = 0; /* an unknown flag: the usage below */
    }
    char *end;
    long reps = strtol(reps_s, &end, 10);
    int n[MAX_SLEEPERS], k = parse_counts(counts, n);
    if (reps < 1 || reps > 1000000000 || *end || argc % 2 == 0 || k < 0) {
        fprintf(stderr, "usage: wake_cost [--sleepers 1,2,8] [--reps N]: "
                        "counts 1..%d, no empty item\n", MAX_SLEEPERS);
        return 2;
    }
    double clock_s = 0;
    for (int i = 0; i < 1000; i++) {
        double t0 = now();
        clock_s += (now() - t0) / 1000;
    }
    printf("{");
    for (int i = 0; i < k; i++)
        printf("\"%d\": %.2f, ", n[i], broadcast_cost(n[i], (int)reps) * 1e6);
    printf("\"clock_us\": %.3f}\n", clock_s * 1e6);
    return 0;
}
