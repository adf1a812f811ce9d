/* pool.c - the CPU backend's threads: one parallel loop at a time, the
 * caller running the first part itself.
 *
 * A training step is a chain of short ops (tens of microseconds each), so
 * waking threads through a condition variable per op would cost as much as
 * the work. Workers spin on a generation counter for a while after each job
 * and only then sleep; the caller spins on a pending count, which the
 * balanced parts keep short. */
#include "backend_impl.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* About 50-100 microseconds of pause instructions: longer than the gap
 * between two ops of a step, shorter than anything a user would notice as
 * a busy core. */
enum { SPIN_ROUNDS = 20000 };

struct stk_pool {
    int threads; /* including the caller */
    pthread_t *tid;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    atomic_uint gen;    /* bumped once per job */
    atomic_int pending; /* workers that have not finished the job */
    atomic_int sleepers;
    atomic_bool stop;
    /* the job; written by the caller before gen is bumped */
    stk_pool_fn fn;
    void *arg;
    size_t n;
    int parts;
};

typedef struct worker_arg {
    stk_pool *pool;
    int index;
} worker_arg;

/* Part i of [0, n) in `parts` nearly equal contiguous ranges. */
static void part_range(size_t n, int parts, int i, size_t *b, size_t *e)
{
    *b = n * (size_t)i / (size_t)parts;
    *e = n * (size_t)(i + 1) / (size_t)parts;
}

static unsigned wait_job(stk_pool *p, unsigned seen)
{
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        unsigned g = atomic_load_explicit(&p->gen, memory_order_acquire);
        if (g != seen || atomic_load(&p->stop))
            return g;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add(&p->sleepers, 1);
    unsigned g;
    while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop))
        pthread_cond_wait(&p->cv, &p->mu);
    atomic_fetch_sub(&p->sleepers, 1);
    pthread_mutex_unlock(&p->mu);
    return g;
}

static void *worker_main(void *v)
{
    worker_arg *wa = v;
    stk_pool *p = wa->pool;
    int index = wa->index;
    free(wa);
    unsigned seen = 0;
    for (;;) {
        seen = wait_job(p, seen);
        if (atomic_load(&p->stop))
            return NULL;
        if (index < p->parts) {
            size_t b, e;
            part_range(p->n, p->parts, index, &b, &e);
            p->fn(p->arg, b, e);
        }
        atomic_fetch_sub_explicit(&p->pending, 1, memory_order_release);
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
        worker_arg *wa = malloc(sizeof *wa);
        if (wa)
            *wa = (worker_arg){p, i};
        if (!wa || pthread_create(&p->tid[i], NULL, worker_main, wa)) {
            free(wa);
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
    int parts = p && p->threads > 1 ? p->threads : 1;
    if ((size_t)parts > want)
        parts = (int)want;
    if (parts == 1) {
        fn(arg, 0, n);
        return;
    }
    p->fn = fn;
    p->arg = arg;
    p->n = n;
    p->parts = parts;
    atomic_store_explicit(&p->pending, p->threads - 1, memory_order_relaxed);
    atomic_fetch_add(&p->gen, 1); /* publishes the job (seq_cst) */
    wake_all(p);
    size_t b, e;
    part_range(n, parts, 0, &b, &e);
    fn(arg, b, e);
    for (unsigned spins = 0;
         atomic_load_explicit(&p->pending, memory_order_acquire) > 0; spins++) {
        if (spins < SPIN_ROUNDS)
            cpu_relax();
        else
            sched_yield(); /* a worker was preempted: let it run */
    }
}
