/* ddp.c - DDP's gradient buckets: all-reduced by a communication thread
 * while backward computes the earlier layers.
 *
 * Parameters lie in one flat buffer in layer order and backward produces
 * them last first, so buckets are contiguous ranges taken from the end:
 * bucket 0 holds the last layers and is ready first. The thread reduces
 * buckets strictly in index order, the same on every rank, which is what
 * keeps the ranks' collectives matched. On shared memory it reduces each
 * one in turn; on NCCL it only queues them, every ready bucket as soon as
 * it is ready, and the finish waits for each bucket's event. */
#include "comm_impl.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct bucket {
    size_t off, n;    /* range of the gradient buffer */
    int nparams;
    int pending;      /* parameters not yet final this step */
    bool ready;
} bucket;

struct stk_ddp {
    stk_comm *c;
    float *g;
    bucket *b;
    int nb;
    int *param_bucket;
    int nparams;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int next;     /* the bucket the thread reduces next */
    bool busy;    /* a reduction is running */
    bool stop;
    int rc;       /* the thread's first error */
    stk_err err;
    double busy_s; /* seconds spent reducing this step */
    double first_queued; /* NCCL: when this step's first bucket was queued */
};

static void *comm_main(void *arg)
{
    stk_ddp *d = arg;
    pthread_mutex_lock(&d->mu);
    for (;;) {
        while (!d->stop && !(d->next < d->nb && d->b[d->next].ready && !d->rc))
            pthread_cond_wait(&d->cv, &d->mu);
        if (d->stop)
            break;
        bucket *b = &d->b[d->next];
        d->busy = true;
        pthread_mutex_unlock(&d->mu);
        stk_err e;
        double t0 = stk_now();
        int rc = comm_queue_allreduce(d->c, d->next, d->g + b->off, b->n, STK_AVG, &e);
        double spent = stk_now() - t0;
        pthread_mutex_lock(&d->mu);
        d->busy = false;
        d->busy_s += spent;
        if (d->next == 0)
            d->first_queued = t0;
        if (rc) {
            d->rc = rc;
            d->err = e;
        }
        d->next++;
        pthread_cond_broadcast(&d->cv);
    }
    pthread_mutex_unlock(&d->mu);
    return NULL;
}

/* Groups the parameters from the last one back: a bucket closes once it
 * holds at least its cap (the first one first_bytes), as PyTorch's do. */
static int plan(stk_ddp *d, const size_t *offsets, size_t n,
                size_t bucket_bytes, size_t first_bytes)
{
    d->b = calloc((size_t)d->nparams, sizeof *d->b);
    d->param_bucket = calloc((size_t)d->nparams, sizeof *d->param_bucket);
    if (!d->b || !d->param_bucket)
        return STK_ENOMEM;
    size_t end = n, cap = first_bytes;
    bucket *cur = NULL;
    for (int p = d->nparams - 1; p >= 0; p--) {
        if (!cur)
            cur = &d->b[d->nb++];
        cur->off = offsets[p];
        cur->n += end - offsets[p];
        end = offsets[p];
        cur->nparams++;
        d->param_bucket[p] = (int)(cur - d->b);
        if (cur->n * sizeof(float) >= cap) {
            cur = NULL;
            cap = bucket_bytes;
        }
    }
    for (int i = 0; i < d->nb; i++)
        d->b[i].pending = d->b[i].nparams;
    return 0;
}

int stk_ddp_create(stk_comm *c, float *grads, const size_t *param_offsets,
                   int nparams, size_t n, size_t bucket_bytes,
                   size_t first_bytes, stk_ddp **out, stk_err *err)
{
    *out = NULL;
    for (int p = 0; p < nparams; p++)
        if (param_offsets[p] >= n || (p && param_offsets[p] <= param_offsets[p - 1]))
            return stk_fail(err, STK_EINVAL,
                            "ddp: parameter offsets must ascend within the %zu "
                            "gradients",
                            n);
    stk_ddp *d = calloc(1, sizeof *d);
    if (!d)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    d->c = c;
    d->g = grads;
    d->nparams = nparams;
    if (pthread_mutex_init(&d->mu, NULL) || pthread_cond_init(&d->cv, NULL)) {
        free(d);
        return stk_fail(err, STK_ENOMEM, "ddp: cannot create a mutex");
    }
    int rc = nparams > 0 && param_offsets[0] != 0
                 ? stk_fail(err, STK_EINVAL, "ddp: the first parameter must start "
                                             "the gradient buffer")
                 : plan(d, param_offsets, n, bucket_bytes ? bucket_bytes : 1,
                        first_bytes ? first_bytes : 1);
    if (rc == STK_ENOMEM)
        stk_fail(err, rc, "out of memory");
    if (!rc && stk_comm_world(c) > 1) {
        if (stk_thread_start(&d->thread, comm_main, d, "stk-ddp", -1))
            rc = stk_fail(err, STK_ENOMEM, "ddp: cannot start the communication "
                                           "thread");
        else
            d->started = true;
    }
    if (rc) {
        stk_ddp_destroy(d);
        return rc;
    }
    *out = d;
    return 0;
}

void stk_ddp_destroy(stk_ddp *d)
{
    if (!d)
        return;
    pthread_mutex_lock(&d->mu);
    d->stop = true;
    bool mid_step = d->busy || d->next > 0;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    if (mid_step) /* leaving mid-step: the peers must not wait for this rank */
        stk_comm_abort(d->c);
    if (d->started)
        pthread_join(d->thread, NULL);
    pthread_cond_destroy(&d->cv);
    pthread_mutex_destroy(&d->mu);
    free(d->b);
    free(d->param_bucket);
    free(d);
}

int stk_ddp_buckets(const stk_ddp *d) { return d->nb; }

int stk_ddp_ready(stk_ddp *d, int param, stk_err *err)
{
    if (param < 0 || param >= d->nparams)
        return stk_fail(err, STK_EINVAL, "ddp: no parameter %d", param);
    bucket *b = &d->b[d->param_bucket[param]];
    if (--b->pending > 0 || !d->started)
        return 0;
    /* on a GPU: the point in the compute stream the reduction waits for */
    int rc = comm_mark(d->c, (int)(b - d->b), err);
    if (rc)
        return rc;
    pthread_mutex_lock(&d->mu);
    b->ready = true;
    pthread_cond_broadcast(&d->cv);
    pthread_mutex_unlock(&d->mu);
    return 0;
}

int stk_ddp_drain(stk_ddp *d, stk_err *err)
{
    if (!d->started)
        return 0;
    pthread_mutex_lock(&d->mu);
    while (!d->rc && (d->busy || (d->next < d->nb && d->b[d->next].ready)))
        pthread_cond_wait(&d->cv, &d->mu);
    int rc = d->rc;
    if (rc && err)
        *err = d->err;
    pthread_mutex_unlock(&d->mu);
    return rc;
}

int stk_ddp_finish(stk_ddp *d, double *waited, double *busy, stk_err *err)
{
    *waited = *busy = 0;
    if (!d->started)
        return 0; /* a world of one: the gradients are the average */
    double t0 = stk_now();
    pthread_mutex_lock(&d->mu);
    for (int i = 0; i < d->nb; i++)
        if (!d->b[i].ready) {
            while (d->busy) /* the group is used by one thread at a time */
                pthread_cond_wait(&d->cv, &d->mu);
            pthread_mutex_unlock(&d->mu);
            return stk_fail(err, STK_EINVAL,
                            "ddp: bucket %d was never ready (a parameter got no "
                            "gradient this step)",
                            i);
        }
    while (d->next < d->nb && !d->rc)
        pthread_cond_wait(&d->cv, &d->mu);
    int rc = d->rc;
    if (rc && err)
        *err = d->err;
    /* NCCL: every bucket is queued and the thread idle; their events */
    for (int i = 0; !rc && comm_queued(d->c) && i < d->nb; i++)
        rc = comm_wait(d->c, i, err);
    *waited = stk_now() - t0;
    *busy = comm_queued(d->c) && d->nb ? stk_now() - d->first_queued : d->busy_s;
    for (int i = 0; i < d->nb; i++) {
        d->b[i].ready = false;
        d->b[i].pending = d->b[i].nparams;
    }
    d->next = 0;
    d->busy_s = 0;
    pthread_mutex_unlock(&d->mu);
    return rc;
}
