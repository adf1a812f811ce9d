/* group.c - the trainer's side of data parallelism: joining the group,
 * starting every rank from rank 0's weights and position, the gradient
 * buckets, and the small per-step reductions that keep the ranks' loops in
 * step (the loss, the stop decision, per-rank timings). A world of one
 * takes the same paths, where every collective is the identity. */
#include "train_impl.h"

#include <stdlib.h>
#include <string.h>

/* floats in one host reduction: log_step's three per listed rank */
enum { SYNC_MAX = 3 * GROUP_LISTED_RANKS + 8 };

/* The store belongs to this run: under SLURM, rank 0 names the job step
 * and the others check it, so that a rank whose rank 0 could not take the
 * port never joins another job's store. */
static int same_run(run_state *r, int timeout, stk_err *err)
{
    const stk_rank_info *ri = &r->rank;
    if (!ri->run_id[0])
        return 0;
    if (ri->rank == 0)
        return stk_kv_set(r->kv, "train/run", ri->run_id, strlen(ri->run_id), err);
    void *v;
    size_t n;
    int rc = stk_kv_get(r->kv, "train/run", timeout, &v, &n, err);
    if (rc)
        return rc;
    if (n != strlen(ri->run_id) || memcmp(v, ri->run_id, n) != 0)
        rc = stk_fail(err, STK_EINVAL,
                      "the store at %s:%d belongs to %.*s, not to this rank's %s "
                      "(two runs on one port: set MASTER_PORT)",
                      ri->master_addr, ri->master_port, (int)(n < 64 ? n : 64),
                      (char *)v, ri->run_id);
    free(v);
    return rc;
}

int group_open(run_state *r, stk_err *err)
{
    const stk_rank_info *ri = &r->rank;
    int rc = 0;
    int timeout = r->o->timeout_s * 1000;
    if (ri->world > 1) {
        if (ri->host_store) {
            int bound;
            rc = stk_store_server_start("0.0.0.0", ri->master_port, &bound,
                                        &r->srv, err);
        }
        if (!rc)
            rc = stk_kv_connect(ri->master_addr, ri->master_port, timeout,
                                &r->kv, err);
        if (!rc)
            rc = same_run(r, timeout, err);
        if (!rc)
            rc = stk_kv_barrier(r->kv, "train/joined", ri->world, timeout, err);
    }
    if (!rc)
        rc = stk_comm_create(r->be, ri, r->kv, timeout, &r->comm, err);
    if (!rc && !(r->sync_dev = stk_dev_alloc(r->be, SYNC_MAX * sizeof(float), err)))
        rc = STK_ENOMEM;
    return rc;
}

void group_close(run_state *r)
{
    stk_ddp_destroy(r->ddp);
    r->ddp = NULL;
    if (r->sync_dev)
        stk_dev_free(r->be, r->sync_dev);
    r->sync_dev = NULL;
    stk_comm_destroy(r->comm);
    r->comm = NULL;
    stk_kv_close(r->kv);
    r->kv = NULL;
    stk_store_server_stop(r->srv);
    r->srv = NULL;
}

/* Sums v[0, n) (host floats) over the ranks, in place. */
int group_sum(run_state *r, float *v, int n, stk_err *err)
{
    if (r->rank.world == 1)
        return 0;
    if (n > SYNC_MAX)
        return stk_fail(err, STK_EINVAL, "group: %d values to reduce, at most %d",
                        n, SYNC_MAX);
    size_t bytes = (size_t)n * sizeof *v;
    int rc = stk_copy_to_dev(r->be, r->sync_dev, v, bytes, err);
    if (!rc)
        rc = stk_comm_allreduce(r->comm, r->sync_dev, (size_t)n, STK_SUM, err);
    if (!rc)
        rc = stk_copy_to_host(r->be, v, r->sync_dev, bytes, err);
    return rc ? rc : stk_sync(r->be, err);
}

int group_agree(run_state *r, int rc, stk_err *err)
{
    if (r->rank.world == 1)
        return rc;
    /* how many ranks failed, and whether rank 0 is one of them */
    float v[2] = {rc ? 1.0f : 0.0f, rc && r->rank.rank == 0 ? 1.0f : 0.0f};
    stk_err mine;
    int sum = group_sum(r, v, 2, rc ? &mine : err);
    if (rc || sum)
        return rc ? rc : sum;
    if (v[1] > 0)
        return stk_fail(err, STK_EPEER,
                        "rank 0 could not start (its message says why)");
    if (v[0] > 0)
        return stk_fail(err, STK_EPEER,
                        "%.0f other rank(s) could not start (their "
                        "messages say why)",
                        v[0]);
    return 0;
}

/* Where rank 0 starts (fresh or resumed), for every rank. */
typedef struct start_pos {
    uint64_t step, start_batch;
    int32_t epoch, pad;
    double best_acc;
} start_pos;

int group_share_start(run_state *r, stk_err *err)
{
    if (r->rank.world == 1)
        return 0;
    size_t bytes = stk_model_param_count(r->model) * sizeof(float);
    int rc = stk_comm_broadcast(r->comm, stk_model_weights(r->model), bytes, 0, err);
    if (!rc)
        rc = stk_comm_broadcast(r->comm, r->state1, bytes, 0, err);
    if (!rc && r->state2)
        rc = stk_comm_broadcast(r->comm, r->state2, bytes, 0, err);
    start_pos p = {r->step, r->start_batch, r->epoch, 0, r->best_acc};
    float *dev = r->sync_dev;
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, &p, sizeof p, err);
    if (!rc)
        rc = stk_comm_broadcast(r->comm, dev, sizeof p, 0, err);
    if (!rc)
        rc = stk_copy_to_host(r->be, &p, dev, sizeof p, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    if (!rc) {
        r->step = p.step;
        r->start_batch = p.start_batch;
        r->epoch = p.epoch;
        r->best_acc = p.best_acc;
    }
    return rc;
}

int group_ddp(run_state *r, stk_err *err)
{
    /* gradients where the all-reduce sums them, if the group has a place */
    float *res;
    int rc = stk_comm_resident(r->comm, r->kv, stk_model_param_count(r->model),
                               &res, err);
    if (!rc && res)
        rc = stk_model_use_grads(r->model, res, err);
    if (rc)
        return rc;
    int np = stk_model_nparams(r->model);
    size_t *off = malloc((size_t)np * sizeof *off);
    if (!off)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    for (int i = 0; i < np; i++)
        off[i] = stk_model_param(r->model, i)->offset;
    size_t bucket = (size_t)(r->o->bucket_mb * 1024 * 1024);
    size_t first = bucket < (1u << 20) ? bucket : (1u << 20); /* PyTorch's 1 MB */
    rc = stk_ddp_create(r->comm, stk_model_grads(r->model), off, np,
                            stk_model_param_count(r->model), bucket, first,
                            &r->ddp, err);
    free(off);
    return rc;
}

void group_grads_ready(int param, void *arg)
{
    run_state *r = arg;
    stk_err e;
    if (!r->ddp_rc)
        r->ddp_rc = stk_ddp_ready(r->ddp, param, &e);
}

/* After an epoch: every rank compares its weights with rank 0's, bit for
 * bit, and *differ counts the parameters that differ on any rank (0 is
 * what DDP promises). */
int group_compare_weights(run_state *r, uint64_t *differ, stk_err *err)
{
    *differ = 0;
    if (r->rank.world == 1)
        return 0;
    size_t n = stk_model_param_count(r->model), bytes = n * sizeof(float);
    float *mine = malloc(bytes), *theirs = malloc(bytes);
    float *dev = stk_dev_alloc(r->be, bytes, err);
    int rc = mine && theirs && dev ? 0 : stk_fail(err, STK_ENOMEM, "out of memory");
    if (!rc)
        rc = stk_copy_to_host(r->be, mine, stk_model_weights(r->model), bytes, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, mine, bytes, err);
    if (!rc)
        rc = stk_comm_broadcast(r->comm, dev, bytes, 0, err);
    if (!rc)
        rc = stk_copy_to_host(r->be, theirs, dev, bytes, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    float count = 0;
    for (size_t i = 0; !rc && i < n; i++)
        count += memcmp(&mine[i], &theirs[i], sizeof(float)) != 0;
    if (!rc)
        rc = group_sum(r, &count, 1, err);
    *differ = (uint64_t)count;
    free(mine);
    free(theirs);
    if (dev)
        stk_dev_free(r->be, dev);
    return rc;
}
