/* pool.c - the CPU backend's threads: one parallel loop at a time, its
 * ranges claimed by whichever thread is free first, the caller included.
 *
 * A training step is a chain of short ops (tens of microseconds each), so
 * waking threads through a condition variable per op would cost as much as
 * the work. Workers spin on the job word for a while after each job and
 * only then sleep. The caller runs ranges too and waits only for ranges a
 * worker has started: when a worker is descheduled (a core shared with
 * another process), the caller takes its range instead of waiting for the
 * scheduler to bring it back. */
#include "backend_impl.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>

/* About 50-100 microseconds of pause instructions: longer than the gap
 * between two ops of a step, shorter than anything a user would notice as
 * a busy core. */
enum { SPIN_ROUNDS = 20000 };

struct stk_pool {
    int threads; /* including the caller */
    pthread_t *tid;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* the job word: generation << 32 | ranges << 16 | next range to claim.
     * A claim is one fetch_add; its result says which job and range it
     * got, so a worker that wakes late claims in the current job or in
     * none, never in a finished one. */
    _Atomic uint64_t job;
    atomic_size_t done; /* ranges of the job finished */
    atomic_int sleepers;
    atomic_bool stop;
    uint32_t gen; /* the caller's count of jobs */
    /* the job; written by the caller before the job word is published,
     * read only by a thread holding one of its ranges */
    stk_pool_fn fn;
    void *arg;
    size_t n;
};

enum { RANGES_MAX = 0xffff };

static uint32_t job_gen(uint64_t w) { return (uint32_t)(w >> 32); }

/* Part i of [0, n) in `parts` nearly equal contiguous ranges. */
static void part_range(size_t n, size_t parts, size_t i, size_t *b, size_t *e)
{
    *b = n * i / parts;
    *e = n * (i + 1) / parts;
}

/* Claims and runs ranges of the current job until none is left. */
static void run_ranges(stk_pool *p)
{
    for (;;) {
        uint64_t w = atomic_fetch_add_explicit(&p->job, 1,
                                               memory_order_acq_rel);
        size_t i = w & 0xffff, parts = (w >> 16) & 0xffff;
        if (i >= parts)
            return;
        size_t b, e;
        part_range(p->n, parts, i, &b, &e);
        p->fn(p->arg, b, e);
        atomic_fetch_add_explicit(&p->done, 1, memory_order_release);
    }
}

/* Waits for a job of another generation than `seen`, or for stop. */
static uint32_t wait_job(stk_pool *p, uint32_t seen)
{
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        uint32_t g = job_gen(atomic_load_explicit(&p->job,
                                                  memory_order_relaxed));
        if (g != seen || atomic_load(&p->stop))
            return g;
        stk_cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    uint32_t g;
    while ((g = job_gen(atomic_load(&p->job))) == seen &&
           !atomic_load(&p->stop))
        pthread_cond_wait(&p->cv, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *v)
{
    stk_pool *p = v;
    uint32_t seen = 0;
    for (;;) {
        seen = wait_job(p, seen);
        if (atomic_load(&p->stop))
            return NULL;
        run_ranges(p);
    }
}

static void wake_all(stk_pool *p)
{
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
}

void stk_pool_destroy(stk_pool *p)
{
    if (!p)
        return;
    atomic_store(&p->stop, true);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 1; i < p->threads; i++)
        pthread_join(p->tid[i], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->tid);
    free(p);
}

stk_pool *stk_pool_create(int threads, stk_err *err)
{
    stk_pool *p = calloc(1, sizeof *p);
    if (!p || !(p->tid = calloc((size_t)threads, sizeof *p->tid))) {
        free(p);
        stk_fail(err, STK_ENOMEM, "cpu: out of memory for %d threads",
                 threads);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->threads = 1; /* grows as workers start, so destroy joins only those */
    for (int i = 1; i < threads; i++) {
        if (stk_thread_start(&p->tid[i], worker_main, p, "stk-pool", i)) {
            stk_pool_destroy(p);
            stk_fail(err, STK_ENOMEM, "cpu: cannot start compute thread %d "
                     "of %d", i + 1, threads);
            return NULL;
        }
        p->threads = i + 1;
    }
    return p;
}

int stk_pool_threads(const stk_pool *p) { return p ? p->threads : 1; }

void stk_pool_for(stk_pool *p, size_t n, size_t grain, stk_pool_fn fn,
                  void *arg)
{
    if (n == 0)
        return;
    size_t want = grain ? (n + grain - 1) / grain : n;
    size_t parts = p && p->threads > 1 ? (size_t)p->threads : 1;
    if (parts > want)
        parts = want;
    if (parts > RANGES_MAX)
        parts = RANGES_MAX;
    if (parts == 1) {
        fn(arg, 0, n);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    atomic_store_explicit(&p->done, 0, memory_order_relaxed);
    /* publishes the job (seq_cst: ordered before the sleepers check) */
    atomic_store(&p->job, (uint64_t)++p->gen << 32 | (uint64_t)parts << 16);
    wake_all(p);
    run_ranges(p);
    for (unsigned spins = 0;
         atomic_load_explicit(&p->done, memory_order_acquire) < parts;
         spins++) {
        if (spins < SPIN_ROUNDS)
            stk_cpu_relax();
        else
            sched_yield(); /* a worker was preempted: let it run */
    }
}
