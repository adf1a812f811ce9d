/* group.c - the trainer's side of data parallelism: joining the group,
 * starting every rank from rank 0's weights and position, the gradient
 * buckets, and the small per-step reductions that keep the ranks' loops in
 * step (the loss, the stop decision, per-rank timings). A world of one
 * takes the same paths, where every collective is the identity. */
#include "train_impl.h"

#include <stdio.h>
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

void group_abort(run_state *r)
{
    stk_comm_abort(r->comm); /* NULL: a world of one, or not joined yet */
}

void group_close(run_state *r)
{
    stk_ddp_destroy(r->ddp);
    r->ddp = NULL;
    /* the communicator first: an aborted one is torn down (ncclCommAbort)
     * here, and a cudaFree before it would wait for the whole device, an
     * all-reduce a gone peer never matches included */
    stk_comm_destroy(r->comm);
    r->comm = NULL;
    if (r->sync_dev)
        stk_dev_free(r->be, r->sync_dev);
    r->sync_dev = NULL;
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

int group_sum_failed(run_state *r, int mine, float *v, int n, int *failed,
                     stk_err *err)
{
    float all[SYNC_MAX];
    if (n + 1 > SYNC_MAX)
        return stk_fail(err, STK_EINVAL, "group: %d values to reduce, at most %d",
                        n + 1, SYNC_MAX);
    memcpy(all, v, (size_t)n * sizeof *v);
    all[n] = mine ? 1.0f : 0.0f;
    stk_err ignored; /* a rank that failed keeps its own error */
    int rc = group_sum(r, all, n + 1, mine ? &ignored : err);
    if (mine || rc)
        return mine ? mine : rc;
    memcpy(v, all, (size_t)n * sizeof *v);
    *failed = (int)all[n];
    return 0;
}

int group_agree(run_state *r, int rc, stk_err *err)
{
    /* whether rank 0 is one of the ranks that failed */
    float v[1] = {rc && r->rank.rank == 0 ? 1.0f : 0.0f};
    int failed = 0;
    if ((rc = group_sum_failed(r, rc, v, 1, &failed, err)))
        return rc;
    if (v[0] > 0)
        return stk_fail(err, STK_EPEER,
                        "rank 0 could not start (its message says why)");
    if (failed > 0)
        return stk_fail(err, STK_EPEER,
                        "%d other rank(s) could not start (their "
                        "messages say why)",
                        failed);
    return 0;
}

/* The model's parameters: their count and an FNV-1a hash of each one's
 * name and size, so that two models of one count but another layout
 * differ too. */
static void model_layout(const stk_model *m, char *s, size_t n)
{
    uint64_t h = 1469598103934665603u;
    for (int i = 0; i < stk_model_nparams(m); i++) {
        const stk_param *p = stk_model_param(m, i);
        char one[STK_NAME_MAX + 64];
        int len = snprintf(one, sizeof one, "%s:%zu;", p->name, p->count);
        for (int k = 0; k < len && k < (int)sizeof one; k++)
            h = (h ^ (uint8_t)one[k]) * 1099511628211u;
    }
    snprintf(s, n, "%zu parameters in %d tensors (layout %016llx)",
             stk_model_param_count(m), stk_model_nparams(m),
             (unsigned long long)h);
}

/* v in the fewest digits that read back as the same value (a float's as
 * that float: --lr 0.07, not 0.0700000003), so a message shows the
 * number as it was typed. */
static const char *short_num(char *buf, size_t n, double v, bool single)
{
    for (int digits = 6; digits < 17; digits++) {
        snprintf(buf, n, "%.*g", digits, v);
        double back = strtod(buf, NULL);
        if (single ? (float)back == (float)v : back == v)
            return buf;
    }
    snprintf(buf, n, "%.17g", v);
    return buf;
}

/* The transforms as they run, not as the flags spell them (the defaults
 * resolved: --crop-size 28 on 28x28 records is the records as stored). */
static void transforms_text(const run_state *r, char *s, size_t n)
{
    const stk_meta *m = stk_store_meta(r->store);
    const stk_loader_xform *t = &r->test_xf, *a = &r->train_xf;
    int u = t->kind != STK_XFORM_CENTRE ||
                    (!m->variable && m->height == m->width &&
                     t->size == m->height && t->resize == t->size)
                ? snprintf(s, n, "as stored")
                : snprintf(s, n, "Resize(%d)+CenterCrop(%d)", t->resize,
                           t->size);
    if (a->kind != STK_XFORM_RRC || u < 0 || (size_t)u >= n)
        return;
    char lo[32], hi[32]; /* {0, 0}: torchvision's (0.08, 1) */
    bool dflt = !(a->scale[1] > 0);
    snprintf(s + u, n - (size_t)u, "\n--rrc-scale=%s,%s",
             short_num(lo, sizeof lo, dflt ? 0.08 : a->scale[0], false),
             short_num(hi, sizeof hi, dflt ? 1 : a->scale[1], false));
}

void group_config_text(const run_state *r, char *s, size_t n)
{
    static const char *const augs[] = {"auto", "none", "crop", "rrc"};
    const stk_train_opts *o = r->o;
    char model[160], xf[96], f[7][32];
    model_layout(r->model, model, sizeof model);
    transforms_text(r, xf, sizeof xf);
    const float floats[] = {o->lr, o->momentum, o->weight_decay, o->clip,
                            o->label_smoothing, o->gamma, o->bucket_mb};
    for (int i = 0; i < 7; i++)
        short_num(f[i], sizeof f[i], floats[i], true);
    snprintf(s, n,
             "model=%s\ndevice=%s\ndatabase=%dx%dx%d, %d classes, %llu train "
             "samples a rank\n--batch=%d\n--epochs=%d\n--accum=%d\n"
             "--max-steps=%d\n--seed=%llu\n--optim=%s\n--lr=%s\n"
             "--momentum=%s\n--nesterov=%d\n--weight-decay=%s\n"
             "--no-decay-norm-bias=%d\n--clip=%s\n--label-smoothing=%s\n"
             "--schedule=%s\n--warmup=%d\n--step-size=%d\n--gamma=%s\n"
             "--augment=%s\nevaluation=%s\n--no-dropout=%d\n--conv=%s\n"
             "--sync-bn=%d\n--bucket-mb=%s\n--evaluate=%d\n",
             model, o->device == STK_DEV_CUDA ? "cuda" : "cpu", r->in_c,
             r->in_h, r->in_w,
             stk_store_meta(r->store)->nclasses, (unsigned long long)r->shard,
             o->batch, o->epochs, o->accum, o->max_steps,
             (unsigned long long)o->seed, stk_optim_names[o->optim], f[0],
             f[1], o->nesterov, f[2], o->no_decay_norm_bias, f[3], f[4],
             stk_sched_names[o->sched], o->warmup, o->step_size, f[5],
             augs[r->augment], xf, !o->dropout, stk_conv_names[o->conv],
             o->sync_bn, f[6], o->evaluate);
}

/* The first item of mine that theirs does not hold alike, as an error. */
static int config_differs(const run_state *r, const char *mine,
                          const char *theirs, stk_err *err)
{
    for (;;) {
        size_t a = strcspn(mine, "\n"), b = strcspn(theirs, "\n");
        if (!mine[a] || !theirs[b]) /* both end alike: equal throughout */
            return 0;
        if (a != b || memcmp(mine, theirs, a)) {
            size_t eq = strcspn(mine, "=");
            return stk_fail(err, STK_EINVAL,
                            "rank %d's %.*s is %.*s, rank 0's %.*s: the "
                            "ranks of one run need the same flags, model "
                            "and database (nodes started by hand?)",
                            r->rank.rank, (int)eq, mine, (int)(a - eq - 1),
                            mine + eq + 1,
                            (int)(b - strcspn(theirs, "=") - 1),
                            theirs + strcspn(theirs, "=") + 1);
        }
        mine += a + 1;
        theirs += b + 1;
    }
}

/* Rank 0's configuration against this rank's (0 when they agree). */
static int compare_config(run_state *r, const char *mine, stk_err *err)
{
    void *v = NULL;
    size_t n = 0;
    int rc = stk_kv_get(r->kv, "train/config", r->o->timeout_s * 1000, &v, &n,
                        err);
    if (!rc && (!n || ((char *)v)[n - 1]))
        rc = stk_fail(err, STK_EFORMAT,
                      "rank 0's configuration in the store is not text");
    if (!rc)
        rc = config_differs(r, mine, v, err);
    free(v);
    return rc;
}

int group_check_config(run_state *r, stk_err *err)
{
    if (r->rank.world == 1)
        return 0;
    char mine[GROUP_CONFIG_MAX];
    group_config_text(r, mine, sizeof mine);
    int rc = r->rank.rank == 0
                 ? stk_kv_set(r->kv, "train/config", mine, strlen(mine) + 1, err)
                 : compare_config(r, mine, err);
    /* a rank that differs leaves its message where every rank reads it
     * once they have agreed that one failed: a launcher may stop that
     * rank before its own line is out */
    stk_err ignored;
    if (rc)
        stk_kv_set(r->kv, "train/config-differs", err->msg,
                   strlen(err->msg) + 1, &ignored);
    float none[1] = {0};
    int failed = 0;
    if ((rc = group_sum_failed(r, rc, none, 1, &failed, err)) || !failed)
        return rc;
    void *why = NULL;
    size_t n = 0;
    if (stk_kv_get(r->kv, "train/config-differs", 1000, &why, &n, &ignored) ||
        !n || ((char *)why)[n - 1])
        rc = stk_fail(err, STK_EPEER, "%d other rank(s) could not start (their "
                      "messages say why)", failed);
    else
        rc = stk_fail(err, STK_EINVAL, "%s", (char *)why);
    free(why);
    return rc;
}

/* Where rank 0 starts (fresh or resumed), for every rank. */
typedef struct start_pos {
    uint64_t step, start_batch;
    int32_t epoch, pad;
    double best_acc;
} start_pos;

/* Rank 0's counters (host int64) to every rank, through device memory. */
static int share_counters(run_state *r, stk_err *err)
{
    int nc = stk_model_ncounters(r->model);
    size_t bytes = (size_t)nc * sizeof(int64_t);
    int64_t *host = malloc(bytes);
    void *dev = host ? stk_dev_alloc(r->be, bytes, err) : NULL;
    int rc = host && dev ? 0 : stk_fail(err, STK_ENOMEM, "out of memory");
    for (int i = 0; !rc && i < nc; i++)
        host[i] = *stk_model_counter(r->model, i);
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, host, bytes, err);
    if (!rc)
        rc = stk_comm_broadcast(r->comm, dev, bytes, 0, err);
    if (!rc)
        rc = stk_copy_to_host(r->be, host, dev, bytes, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    for (int i = 0; !rc && i < nc; i++)
        *stk_model_counter(r->model, i) = host[i];
    if (dev)
        stk_dev_free(r->be, dev);
    free(host);
    return rc;
}

/* Each rank's running statistics follow its own batches (as each PyTorch
 * DDP rank's do between the broadcasts); rank 0's are the model's. */
int group_share_buffers(run_state *r, stk_err *err)
{
    if (r->rank.world == 1)
        return 0;
    size_t bytes = stk_model_buffer_count(r->model) * sizeof(float);
    int rc = bytes ? stk_comm_broadcast(r->comm, stk_model_buffers(r->model),
                                        bytes, 0, err)
                   : 0;
    return rc || !stk_model_ncounters(r->model) ? rc : share_counters(r, err);
}

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
    if (!rc)
        rc = group_share_buffers(r, err);
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

/* stk_allreduce_fn for SyncBatchNorm. Backward calls it while DDP's
 * thread may be reducing a bucket, and the group runs one collective at a
 * time: the buckets ready so far are reduced first. Buckets become ready
 * in the same order on every rank, so every rank issues the same
 * collectives in the same order. */
static int sync_bn_sum(void *arg, float *buf, int n, stk_err *err)
{
    run_state *r = arg;
    int rc = r->ddp ? stk_ddp_drain(r->ddp, err) : 0;
    return rc ? rc : stk_comm_allreduce(r->comm, buf, (size_t)n, STK_SUM, err);
}

/* --sync-bn: batchnorm's statistics over the whole group (a world of one
 * has nothing to sum). A model without batchnorm trains as it would
 * without the flag, as PyTorch's convert_sync_batchnorm leaves it. */
static void sync_bn(run_state *r)
{
    if (!r->o->sync_bn)
        return;
    if (r->rank.world == 1) {
        if (!r->o->quiet)
            fprintf(stderr, "train: --sync-bn: one rank, whose batch is the "
                            "whole batch: nothing to synchronise\n");
        return;
    }
    if (stk_model_ncounters(r->model) == 0) {
        if (r->rank.rank == 0 && !r->o->quiet)
            fprintf(stderr, "train: --sync-bn: the model has no batchnorm "
                            "layer, nothing to synchronise\n");
        return;
    }
    stk_model_sync_bn(r->model, sync_bn_sum, r, r->rank.world);
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
    if (!rc)
        sync_bn(r);
    return rc;
}

void group_grads_ready(int param, void *arg)
{
    run_state *r = arg;
    stk_err e;
    if (!r->ddp_rc)
        r->ddp_rc = stk_ddp_ready(r->ddp, param, &e);
}

/* Elements of mine[0, n) (host, `size` bytes each) whose bits differ
 * from rank 0's: added to *count. */
static int count_differing(run_state *r, const void *mine, size_t n,
                           size_t size, float *count, stk_err *err)
{
    size_t bytes = n * size;
    if (!bytes)
        return 0;
    uint8_t *theirs = malloc(bytes);
    void *dev = theirs ? stk_dev_alloc(r->be, bytes, err) : NULL;
    int rc = theirs && dev ? 0 : stk_fail(err, STK_ENOMEM, "out of memory");
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, mine, bytes, err);
    if (!rc)
        rc = stk_comm_broadcast(r->comm, dev, bytes, 0, err);
    if (!rc)
        rc = stk_copy_to_host(r->be, theirs, dev, bytes, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    for (size_t i = 0; !rc && i < n; i++)
        *count += memcmp((const uint8_t *)mine + i * size, theirs + i * size,
                         size) != 0;
    if (dev)
        stk_dev_free(r->be, dev);
    free(theirs);
    return rc;
}

/* A device array of n floats, compared as count_differing does. */
static int count_differing_dev(run_state *r, const float *dev, size_t n,
                               float *count, stk_err *err)
{
    float *mine = malloc(n * sizeof *mine + 1);
    int rc = mine ? stk_copy_to_host(r->be, mine, dev, n * sizeof *mine, err)
                  : stk_fail(err, STK_ENOMEM, "out of memory");
    if (!rc)
        rc = stk_sync(r->be, err);
    if (!rc)
        rc = count_differing(r, mine, n, sizeof *mine, count, err);
    free(mine);
    return rc;
}

/* After an epoch: every rank compares its weights, batchnorm's running
 * statistics and num_batches_tracked with rank 0's, bit for bit, and
 * *differ counts the values that differ on any rank (0 is what DDP
 * promises, and what group_share_buffers made of the buffers). */
int group_compare_weights(run_state *r, uint64_t *differ, stk_err *err)
{
    *differ = 0;
    if (r->rank.world == 1)
        return 0;
    stk_model *m = r->model;
    float count = 0;
    int rc = count_differing_dev(r, stk_model_weights(m),
                                 stk_model_param_count(m), &count, err);
    if (!rc && stk_model_buffer_count(m))
        rc = count_differing_dev(r, stk_model_buffers(m),
                                 stk_model_buffer_count(m), &count, err);
    int nc = stk_model_ncounters(m);
    int64_t *counters = malloc(((size_t)nc + 1) * sizeof *counters);
    if (!rc && !counters)
        rc = stk_fail(err, STK_ENOMEM, "out of memory");
    for (int i = 0; !rc && i < nc; i++)
        counters[i] = *stk_model_counter(m, i);
    if (!rc)
        rc = count_differing(r, counters, (size_t)nc, sizeof *counters, &count,
                             err);
    free(counters);
    if (!rc)
        rc = group_sum(r, &count, 1, err);
    *differ = (uint64_t)count;
    return rc;
}
