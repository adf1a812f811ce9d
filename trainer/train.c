/* train.c - the training loop: loader -> device transform -> forward ->
 * cross-entropy -> backward -> optimizer step, evaluation every epoch,
 * metrics lines and checkpoints. */
#include "checkpoint.h"
#include "loader/loader.h"
#include "train_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

void stk_train_defaults(stk_train_opts *o)
{
    memset(o, 0, sizeof *o);
    o->device = STK_DEV_CPU;
    o->model = "cnn";
    o->epochs = 10;
    o->batch = 64;
    o->workers = 2;
    o->optim = STK_OPT_ADAMW; /* 91.75% on Fashion-MNIST's cnn in 10 epochs */
    o->lr = -1;               /* per optimizer: see stk_train_resolve */
    o->weight_decay = -1;
    o->momentum = 0.9f;
    o->sched = STK_SCHED_COSINE;
    o->warmup = 100;
    o->step_size = 3;
    o->gamma = 0.1f;
    o->dropout = true;
    o->seed = 1;
    o->out = "runs/train";
    o->log_every = 50;
    o->keep = 3;
    o->accum = 1;
    o->bucket_mb = 25;   /* PyTorch DDP's bucket_cap_mb */
    o->timeout_s = 300;
}

/* ---- the learning rate ------------------------------------------------- */

/* PyTorch's _LRScheduler anneal: from a to b as pct goes 0 -> 1 along
 * half a cosine. */
static double cos_anneal(double a, double b, double pct)
{
    return b + (a - b) / 2.0 * (cos(M_PI * pct) + 1.0);
}

/* OneCycleLR(max_lr=lr, total_steps=total) with its defaults (pct_start
 * 0.3, anneal_strategy "cos", div_factor 25, final_div_factor 1e4,
 * three_phase False): up from lr / 25 to lr until step 0.3 * total - 1,
 * then down to lr / 25 / 1e4 at step total - 1, with the same phase
 * arithmetic as its get_lr. */
static double onecycle_lr(double lr, uint64_t step, uint64_t total)
{
    double initial = lr / 25.0, min = initial / 1e4, s = (double)step;
    double up = 0.3 * (double)total - 1.0, end = (double)total - 1.0;
    if (s <= up && up > 0)
        return cos_anneal(initial, lr, s / up);
    /* a run of 3 steps or less has up < 0: OneCycleLR then starts its
     * second phase at that negative step, so its step 0 is already below
     * max_lr (0.994 lr of 3 steps) */
    double pct = end > up ? (s - up) / (end - up) : 1.0;
    return cos_anneal(lr, min, pct < 1.0 ? pct : 1.0);
}

const char *const stk_optim_names[2] = {"sgd", "adamw"};
const char *const stk_sched_names[5] = {"constant", "step", "cosine", "linear",
                                        "onecycle"};
const char *const stk_conv_names[2] = {"auto", "im2col"};

float stk_train_lr(const stk_train_opts *o, uint64_t step, uint64_t total,
                   int epoch)
{
    if (o->sched == STK_SCHED_ONECYCLE) /* its first phase is its warm-up */
        return (float)onecycle_lr(o->lr, step, total);
    if (o->warmup > 0 && step < (uint64_t)o->warmup)
        return o->lr * (float)(step + 1) / (float)o->warmup;
    /* cosine and linear decay over the steps after the warm-up */
    double span = (double)total - o->warmup, t = (double)step - o->warmup;
    double done = span > 0 ? (t < span ? t : span) / span : 0.0;
    switch (o->sched) {
    case STK_SCHED_STEP:
        return o->lr * powf(o->gamma, (float)(epoch / (o->step_size > 0 ? o->step_size : 1)));
    case STK_SCHED_COSINE:
        return (float)(o->lr * 0.5 * (1.0 + cos(M_PI * done)));
    case STK_SCHED_LINEAR:
        return (float)(o->lr * (1.0 - done));
    default:
        return o->lr;
    }
}

/* ---- one step ---------------------------------------------------------- */

static void loader_release(void *l, stk_batch *b) { stk_loader_release(l, b); }

/* Uploads a batch of loader l (the CPU backend uses it in place) and runs
 * the input transform. The batch goes back to l in a later settle. */
static int stage_batch(run_state *r, stk_loader *l, const stk_batch *b,
                       uint64_t epoch, bool train, stk_err *err)
{
    stk_batch d;
    int rc = uploader_put(&r->up, b, loader_release, l, &d, err);
    if (rc)
        return rc;
    r->dev_labels = d.labels;
    stk_transform t = r->transform;
    t.stream = epoch;
    if (!train)
        t.pad = t.flip = 0;
    return stk_transform_batch(r->be, d.data, d.indices, b->n, &t, r->x_f, err);
}

/* Gives back the batch still held before its loader closes; the first
 * error wins. */
static int settle(run_state *r, int rc, stk_err *err)
{
    stk_err later = {0, {0}};
    int s = uploader_settle(&r->up, rc < 0 ? &later : err);
    return rc < 0 ? rc : s ? s : rc;
}

/* The device's metrics since the last read, zeroed there: the one wait of
 * a logging window (pinned memory and an event; nothing on the CPU). A
 * non-finite step or a label out of range recorded there is the run's
 * error, naming its step; the device refused its update and every one
 * after it (stk_update_refused), so the parameters are the last good
 * step's. */
static int read_metrics(run_state *r, stk_metrics *m, stk_err *err)
{
    stk_backend *be = r->be;
    int rc = stk_copy_to_host(be, r->mhost, r->mdev, sizeof *m, err);
    if (!rc)
        rc = stk_event_record(be, r->mread, STK_STREAM_COMPUTE, err);
    if (!rc)
        rc = stk_event_wait(be, r->mread, err);
    if (!rc)
        rc = stk_memzero(be, r->mdev, sizeof *m, err);
    if (rc)
        return rc;
    *m = *r->mhost;
    if (m->bad_row > 0)
        return stk_fail(err, STK_ERANGE, "cross-entropy: label %d of row %d is not in 0..%d",
                        (int)m->bad_label, (int)m->bad_row - 1, r->classes - 1);
    if (m->bad_step > 0)
        return stk_fail(err, STK_ERANGE,
                        "%s is %s at step %llu (epoch %llu); stopped, the last good "
                        "checkpoint is kept (lower --lr or set --clip)",
                        m->bad_kind == 1 ? "loss" : "gradient norm",
                        m->bad_nan ? "NaN" : "infinite", (unsigned long long)m->bad_step,
                        (unsigned long long)m->bad_epoch);
    return 0;
}

/* The update of floats [off, off + n) of the flat buffers, with weight
 * decay wd. */
static int update_range(run_state *r, float lr, float wd, size_t off, size_t n,
                        stk_err *err)
{
    const stk_train_opts *o = r->o;
    float *w = stk_model_weights(r->model) + off, *g = stk_model_grads(r->model) + off;
    if (o->optim == STK_OPT_SGD) {
        stk_sgd_cfg c = {lr, o->momentum, wd, o->nesterov, r->step == 0, r->mdev};
        return stk_sgd_step(r->be, w, g, r->state1 + off, n, &c, err);
    }
    double t = (double)r->step + 1, b1 = 0.9, b2 = 0.999;
    stk_adamw_cfg c = {lr, (float)b1, (float)b2, 1e-8f, wd,
                       (float)(1.0 - pow(b1, t)), (float)sqrt(1.0 - pow(b2, t)),
                       (float)(1.0 - b1), (float)(1.0 - b2), r->mdev};
    return stk_adamw_step(r->be, w, g, r->state1 + off, r->state2 + off, n, &c, err);
}

/* One optimizer step. Under --no-decay-norm-bias the parameters fall in
 * maximal runs of one kind (decayed, or a bias or batchnorm weight with
 * no decay), each updated by one call: the same floats as PyTorch's two
 * param groups, which update every element alike but for its decay. */
static int optimizer_step(run_state *r, float lr, stk_err *err)
{
    const stk_model *m = r->model;
    float wd = r->o->weight_decay;
    if (!r->o->no_decay_norm_bias)
        return update_range(r, lr, wd, 0, stk_model_param_count(m), err);
    int np = stk_model_nparams(m), rc = 0;
    for (int i = 0; i < np && !rc;) {
        const stk_param *first = stk_model_param(m, i), *last = first;
        while (++i < np && stk_model_param(m, i)->no_decay == first->no_decay)
            last = stk_model_param(m, i);
        rc = update_range(r, lr, first->no_decay ? 0.0f : wd, first->offset,
                          last->offset + last->count - first->offset, err);
    }
    return rc;
}

/* One micro-batch of a step: forward, loss and backward into the
 * gradients, scaled by b->n / group_n so that a step's gradient is the
 * mean over all group_n samples of its micro-batches. The last one hands
 * the gradients to DDP as backward finishes them. The model runs in
 * training mode (batchnorm on batch statistics) even under --no-dropout,
 * which load_spec made p = 0 (the identity). */
static int micro_step(run_state *r, stk_loader *l, const stk_batch *b, int micro,
                      bool last, int group_n, stk_err *err)
{
    const float *logits;
    stk_philox_key key = r->key;
    float *dl = stk_model_dlogits(r->model);
    int rc = stage_batch(r, l, b, b->epoch, true, err);
    if (!rc)
        rc = stk_model_forward(r->model, r->x_f, b->n, true, key, r->step, &logits, err);
    if (!rc)
        rc = stk_xent_metrics(r->be, logits, r->dev_labels, b->n, r->classes,
                              r->o->label_smoothing, dl, r->mdev, err);
    if (!rc)
        rc = stk_count_hits(r->be, logits, r->dev_labels, b->n, r->classes, r->mdev, err);
    if (!rc) /* the labels' last reader */
        rc = uploader_used(&r->up, err);
    if (!rc && group_n != b->n)
        rc = stk_scale(r->be, (size_t)b->n * r->classes, (float)b->n / (float)group_n,
                       dl, err);
    r->ddp_rc = 0;
    bool share = last && r->rank.world > 1;
    if (!rc)
        rc = stk_model_backward(r->model, dl, b->n, key, r->step, micro > 0,
                                share ? group_grads_ready : NULL, r, err);
    return rc ? rc : r->ddp_rc;
}

typedef struct step_out {
    bool read;       /* the metrics below were read (else all 0) */
    double loss_sum; /* the steps read: each one's mean loss times its n */
    uint64_t hits, n;
    bool stop;       /* some rank was asked to stop */
    double waited, busy; /* DDP: waited after backward, reductions took */
} step_out;

/* A data-parallel read: the sums since the last read (loss, hits,
 * samples) and the stop decision over the ranks, the same on every rank,
 * so all stop at the same step. `mine` is this rank's failed read (a
 * non-finite step, a label out of range): it still joins the sum, so that
 * the others end at the same read naming it as a peer's. */
static int group_read(run_state *r, int mine, const stk_metrics *m, step_out *out,
                      stk_err *err)
{
    float v[4] = {out->stop ? 1.0f : 0.0f, (float)m->loss, (float)m->hits, (float)m->n};
    int failed = 0, rc = group_sum_failed(r, mine, v, 4, &failed, err);
    if (rc)
        return rc;
    if (failed > 0)
        return stk_fail(err, STK_EPEER,
                        "%d other rank(s) could not read their metrics by step %llu "
                        "(a non-finite loss or gradient norm, a label out of range or "
                        "a device error: their messages say which); the last good "
                        "checkpoint is kept",
                        failed, (unsigned long long)r->step + 1);
    out->stop = v[0] > 0;
    out->loss_sum = v[1];
    out->hits = (uint64_t)v[2];
    out->n = (uint64_t)v[3];
    if (!isfinite(v[1])) /* finite steps whose float sum overflowed */
        return stk_fail(err, STK_ERANGE,
                        "loss sum is not finite by step %llu; stopped, the last good "
                        "checkpoint is kept (lower --lr or set --clip)",
                        (unsigned long long)r->step + 1);
    return 0;
}

/* Under data parallelism on a device where reading the metrics waits, the
 * ranks read (and agree whether to stop) every AGREE_STEPS steps and at
 * every logged step; on the CPU every step, where reading costs nothing.
 * STK_AGREE_STEPS sets another cadence (the CPU tests run the GPUs'). */
enum { AGREE_STEPS = 16 };

static int agree_steps(const stk_backend *be)
{
    /* every rank must read the same value (the reads are collectives):
     * the launcher passes its environment to all of them */
    const char *e = getenv("STK_AGREE_STEPS");
    if (e && atoi(e) > 0)
        return atoi(e);
    return stk_backend_kind(be) == STK_DEV_CPU ? 1 : AGREE_STEPS;
}

/* Ends a step of n samples: the averaged gradients, the step's metrics
 * closed and the gradient norm checked (and clipped) on the device, the
 * update. The metrics come to the host only when `read` (a step line, the
 * epoch's end, a stop), on the CPU (no wait there) and under data
 * parallelism every AGREE_STEPS steps (all ranks read at the same steps:
 * the read is a collective); a non-finite loss or gradient norm is found
 * then and names its step. */
static int finish_step(run_state *r, int n, uint64_t epoch, bool read,
                       step_out *out, stk_err *err)
{
    stk_backend *be = r->be;
    size_t np = stk_model_param_count(r->model);
    *out = (step_out){.stop = r->o->stop && *r->o->stop};
    int rc = stk_ddp_finish(r->ddp, &out->waited, &out->busy, err);
    if (!rc && r->ddp && stk_backend_kind(be) == STK_DEV_CPU)
        /* the sums DDP's thread wrote back, which the CPU's kernels (unseen
         * by TSan) clip and apply next: from here on, this thread's */
        stk_san_wrote(stk_model_grads(r->model), np * sizeof(float));
    if (!rc)
        rc = stk_metrics_step(be, r->mdev, n, r->step, epoch, err);
    if (!rc)
        rc = stk_grad_norm(be, stk_model_grads(r->model), np, r->o->clip, r->step,
                           epoch, r->mdev, err);
    if (!rc) {
        r->lr = stk_train_lr(r->o, r->step, r->total_steps, (int)epoch);
        rc = optimizer_step(r, r->lr, err);
    }
    bool world = r->rank.world > 1, cpu = stk_backend_kind(be) == STK_DEV_CPU;
    /* a rank's own stop request reads at once only when alone */
    out->read = read || (world ? (r->step + 1) % (uint64_t)r->agree_steps == 0
                               : cpu || out->stop);
    if (!out->read)
        out->stop = false; /* a data-parallel stop waits for the next read */
    if (rc || !out->read)
        return rc;
    stk_metrics m = {0}; /* a failed read leaves it unset */
    rc = read_metrics(r, &m, err);
    if (world)
        return group_read(r, rc, &m, out, err);
    if (!rc) {
        out->loss_sum = m.loss;
        out->hits = (uint64_t)m.hits;
        out->n = (uint64_t)m.n;
    }
    return rc;
}

/* ---- evaluation ---------------------------------------------------------- */

/* What the training and the test loaders share: split, batch and
 * transform are each one's. Where batches go to a GPU, an idle worker
 * spins for the slots uploads free (the loader's default) and records are
 * written with streaming stores (the copy engine read lines still dirty in
 * the workers' caches at 11 GB/s, 14-15 once streamed in an experiment
 * build: docs/loader.md); on the CPU the step's own threads want every
 * core, a release per step is cheap to wake on, and the step reads the
 * batch from the cache. */
static stk_loader_opts loader_opts(const run_state *r, const char *split,
                                   stk_loader_xform xf)
{
    bool gpu = r->o->device == STK_DEV_CUDA;
    return (stk_loader_opts){.split = split, .batch_size = r->o->batch,
                             .workers = r->o->workers, .host = r->host,
                             .rank = r->rank.rank, .world = r->rank.world,
                             .xform = xf, .spin_us = gpu ? 0 : -1,
                             .stream_stores = gpu};
}

/* The test split in eval mode (batchnorm on running statistics, no
 * dropout). The test loss is the training criterion's, label smoothing
 * included, as PyTorch users compute it with the same CrossEntropyLoss. */
static int evaluate(run_state *r, double *loss, double *acc, stk_err *err)
{
    stk_loader_opts lo = loader_opts(r, r->eval_split, r->test_xf);
    lo.uneven = true;
    stk_loader *l;
    int rc = stk_loader_open(r->store, &lo, &l, err);
    if (rc)
        return rc;
    stk_batch b;
    uint64_t seen = 0;
    while (!rc && !(rc = uploader_settle(&r->up, err)) &&
           (rc = stk_loader_next(l, &b, err)) == 1) {
        const float *logits;
        rc = stage_batch(r, l, &b, 0, false, err);
        if (!rc)
            rc = stk_model_forward(r->model, r->x_f, b.n, false, r->key, 0, &logits, err);
        if (!rc)
            rc = stk_xent_metrics(r->be, logits, r->dev_labels, b.n, r->classes,
                                  r->o->label_smoothing, NULL, r->mdev, err);
        if (!rc)
            rc = stk_count_hits(r->be, logits, r->dev_labels, b.n, r->classes, r->mdev,
                                err);
        if (!rc)
            rc = uploader_used(&r->up, err);
        seen += (uint64_t)b.n;
    }
    rc = settle(r, rc, err);
    stk_loader_close(l);
    stk_metrics m = {0}; /* the sums of the open step: one read for the split */
    if (rc >= 0)
        rc = read_metrics(r, &m, err);
    /* each rank read its own shard exactly once: the sums are the split's;
     * a rank that failed joins the sum too, so that the others end here
     * naming it instead of waiting for it until --timeout */
    float v[3] = {(float)m.step_loss, (float)m.step_hits, (float)seen};
    int failed = 0;
    if ((rc = group_sum_failed(r, rc < 0 ? rc : 0, v, 3, &failed, err)))
        return rc;
    if (failed > 0)
        return stk_fail(err, STK_EPEER, "%d other rank(s) failed in evaluation (their "
                        "messages say why)", failed);
    double sum = v[0];
    uint64_t hits = (uint64_t)v[1];
    seen = (uint64_t)v[2];
    r->eval_seen = seen;
    *loss = seen ? sum / seen : 0;
    *acc = seen ? (double)hits / seen : 0;
    return 0;
}

/* ---- metrics ---------------------------------------------------------------- */

static void metric_line(run_state *r, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void metric_line(run_state *r, const char *fmt, ...)
{
    if (!r->metrics)
        return;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(r->metrics, fmt, ap);
    va_end(ap);
    fputc('\n', r->metrics);
    fflush(r->metrics);
}

static void progress(run_state *r, const stk_loader_stats *st, double loss,
                     double acc, bool final_line)
{
    if (r->o->quiet)
        return;
    double rate = st->elapsed > 0 ? st->samples / st->elapsed : 0;
    uint64_t left = r->total_steps > r->step ? r->total_steps - r->step : 0;
    double eta = rate > 0 ? (double)left * r->o->batch / rate : 0;
    /* the epoch's last line holds the epoch's means, the others the
     * window's since the line before: named, so no jump misleads */
    fprintf(stderr, "%sepoch %d/%d step %llu  %sloss %.4f  acc %.2f%%  %.0f samples/s  stall %.1f%%  ETA %.0fs%s",
            r->tty ? "\r" : "", r->epoch + 1, r->o->epochs,
            (unsigned long long)r->step, final_line ? "epoch's " : "", loss,
            100 * acc, rate,
            100 * st->stall, eta, r->tty && !final_line ? "\033[K" : "\n");
}

/* ---- the epoch loop ----------------------------------------------------------- */

/* Samples in this rank's batches [from, to) of an epoch: every rank's
 * shard is padded to the same size (as DistributedSampler does), so all
 * ranks agree. */
static int samples_in(const run_state *r, uint64_t from, uint64_t to)
{
    uint64_t b = (uint64_t)r->o->batch, end = to * b < r->shard ? to * b : r->shard;
    return (int)(end - from * b);
}

/* The metrics window between log lines. */
typedef struct window {
    double loss, t0, waited, busy;
    uint64_t n, hits, steps;
} window;

/* One step line: the window's loss and accuracy over all ranks, every
 * rank's samples/s, stall and step time, and how much of the gradient
 * reduction backward hid. */
static int log_step(run_state *r, stk_loader *l, window *w, stk_err *err)
{
    int world = r->rank.world, me = r->rank.rank;
    stk_loader_stats st;
    stk_loader_stats_get(l, &st);
    float v[3 * GROUP_LISTED_RANKS] = {0};
    if (world > GROUP_LISTED_RANKS)
        world = 0; /* too many ranks to list: the totals only */
    if (world) {
        v[3 * me] = (float)st.samples_per_s;
        v[3 * me + 1] = (float)st.stall;
        v[3 * me + 2] = (float)(1000 * (stk_now() - w->t0) / (double)w->steps);
    }
    int rc = group_sum(r, v, 3 * world, err);
    if (rc)
        return rc;
    char per[GROUP_LISTED_RANKS * 40] = "";
    double rate = 0;
    size_t used = 0;
    for (int k = 0; k < world && used < sizeof per; k++) {
        rate += v[3 * k];
        used += (size_t)snprintf(per + used, sizeof per - used, "%s[%.1f,%.4f,%.2f]",
                                 k ? "," : "", v[3 * k], v[3 * k + 1], v[3 * k + 2]);
    }
    double hidden = w->busy > 0 ? 1.0 - w->waited / w->busy : 1.0;
    metric_line(r, "{\"type\":\"step\",\"step\":%llu,\"epoch\":%d,\"loss\":%.6f,"
                "\"acc\":%.6f,\"lr\":%.6g,\"samples_per_s\":%.1f,\"stall\":%.4f,"
                "\"world\":%d,\"ranks\":[%s],\"comm_s\":%.4f,\"comm_wait_s\":%.4f,"
                "\"comm_hidden\":%.4f}",
                (unsigned long long)r->step, r->epoch + 1, w->loss / (double)w->n,
                (double)w->hits / (double)w->n, r->lr, world > 1 ? rate : st.samples_per_s,
                st.stall, r->rank.world, per, w->busy, w->waited,
                hidden < 0 ? 0.0 : hidden);
    progress(r, &st, w->loss / (double)w->n, (double)w->hits / (double)w->n, false);
    *w = (window){.t0 = stk_now()};
    return 0;
}

static int train_batches(run_state *r, stk_loader *l, stk_err *err)
{
    stk_batch b;
    int rc;
    int accum = r->o->accum;
    double loss_sum = 0;
    uint64_t seen = 0, hits = 0;
    int step_n = 0;
    window w = {.t0 = stk_now()};
    while (!(rc = uploader_settle(&r->up, err)) &&
           (rc = stk_loader_next(l, &b, err)) == 1) {
        int micro = (int)(b.index % (uint64_t)accum);
        uint64_t first = b.index - (uint64_t)micro;
        uint64_t end = first + (uint64_t)accum < r->batches ? first + (uint64_t)accum
                                                            : r->batches;
        bool last = b.index + 1 >= end;
        uint64_t epoch = b.epoch;
        rc = micro_step(r, l, &b, micro, last, samples_in(r, first, end), err);
        step_n += b.n;
        if (rc)
            return rc;
        if (!last)
            continue;
        /* the metrics come to the host for a step line, at the epoch's end
         * and at the last step */
        uint64_t max = (uint64_t)r->o->max_steps;
        bool read = (r->step + 1) % (uint64_t)r->o->log_every == 0 ||
                    end >= r->batches || (max && r->step + 1 >= max);
        step_out so;
        rc = finish_step(r, step_n, epoch, read, &so, err);
        if (rc)
            return rc;
        step_n = 0;
        r->step++;
        stk_loader_pos pos = stk_loader_position(l);
        r->pos_epoch = pos.epoch;
        r->pos_batch = pos.batch;
        loss_sum += so.loss_sum;
        seen += so.n;
        hits += so.hits;
        w.loss += so.loss_sum;
        w.n += so.n;
        w.hits += so.hits;
        w.steps++;
        w.waited += so.waited;
        w.busy += so.busy;
        if (r->step % (uint64_t)r->o->log_every == 0 && (rc = log_step(r, l, &w, err)))
            return rc;
        if (so.stop || (r->o->max_steps && r->step >= (uint64_t)r->o->max_steps)) {
            r->stopped = so.stop;
            break;
        }
    }
    if (rc < 0)
        return rc;
    r->train_loss = seen ? loss_sum / seen : 0;
    r->train_acc = seen ? (double)hits / seen : 0;
    return 0;
}

/* An epoch's batches; the last one held goes back before l closes. */
static int train_epoch(run_state *r, stk_loader *l, stk_err *err)
{
    return settle(r, train_batches(r, l, err), err);
}

/* Rank 0, which writes metrics.jsonl, redraws RUN_DIR/curves.svg from it. */
/* Rank 0 redraws RUN_DIR/curves.svg after the epoch's checkpoint. A
 * picture that cannot be drawn (a full disk, a directory in its place) is
 * a warning: it must not stop the training it shows. */
static void draw_curves(run_state *r)
{
    char metrics[4200], svg[4200];
    stk_err e = {0};
    if (!r->metrics)
        return;
    if (stk_path_join(metrics, sizeof metrics, r->o->out, "metrics.jsonl") ||
        stk_path_join(svg, sizeof svg, r->o->out, "curves.svg"))
        stk_fail(&e, STK_ERANGE, "--out %s: path too long", r->o->out);
    else
        stk_curves_write(metrics, svg, &e);
    if (*e.msg) /* also under --quiet: it is no progress line */
        fprintf(stderr, "train: warning: curves.svg not drawn: %s\n", e.msg);
}

/* Rank 0 alone writes checkpoints, with its running statistics. */
static int save(run_state *r, bool is_best, stk_err *err)
{
    int rc = group_share_buffers(r, err);
    return rc || r->rank.rank != 0 ? rc : stk_checkpoint_save(r, is_best, err);
}

/* Whether some rank was asked to stop (Ctrl-C, SIGTERM) during the
 * epoch's evaluation and checkpoint: the run then ends there, before the
 * next epoch's first step and a second checkpoint. The ranks agree. */
static int stop_asked(run_state *r, bool *stop, stk_err *err)
{
    float v = r->o->stop && *r->o->stop ? 1.0f : 0.0f;
    int rc = group_sum(r, &v, 1, err);
    *stop = !rc && v > 0;
    return rc;
}

static int run_epochs(run_state *r, stk_train_result *res, stk_err *err)
{
    int rc = 0;
    /* a resume at or past --max-steps (the total, as when it stopped)
     * trains nothing: a step would pass the limit and its checkpoint push
     * an older one out of --keep */
    res->at_max_steps = r->o->max_steps && r->epoch < r->o->epochs &&
                        r->step >= (uint64_t)r->o->max_steps;
    for (; r->epoch < r->o->epochs && !rc && !res->at_max_steps; r->epoch++) {
        stk_loader_opts lo = loader_opts(r, "train", r->train_xf);
        lo.shuffle = true;
        lo.seed = r->o->seed;
        lo.start_epoch = (uint64_t)r->epoch;
        lo.start_batch = r->start_batch;
        stk_loader *l;
        if ((rc = stk_loader_open(r->store, &lo, &l, err)))
            break;
        r->pos_epoch = (uint64_t)r->epoch; /* where a stop before any step is */
        r->pos_batch = r->start_batch;
        double t0 = stk_now();
        rc = train_epoch(r, l, err);
        stk_loader_stats st;
        stk_loader_stats_get(l, &st);
        stk_loader_close(l);
        r->start_batch = 0;
        /* the ranks' common decision, never one rank's own flag */
        bool stopped = r->stopped ||
                       (r->o->max_steps && r->step >= (uint64_t)r->o->max_steps);
        if (rc)
            break;
        if (stopped && r->pos_epoch == (uint64_t)r->epoch) {
            /* mid-epoch: keep the work, with the loader's position */
            rc = save(r, false, err);
            res->stopped = true;
            break;
        }
        double tl = 0, ta = 0;
        if ((rc = group_share_buffers(r, err)) || /* rank 0's statistics */
            (rc = evaluate(r, &tl, &ta, err)))
            break;
        if (!isfinite(tl)) {
            rc = stk_fail(err, STK_ERANGE,
                          "test loss is not finite after epoch %d; stopped, the last "
                          "good checkpoint is kept",
                          r->epoch + 1);
            break;
        }
        uint64_t differ;
        if ((rc = group_compare_weights(r, &differ, err)))
            break;
        progress(r, &st, r->train_loss, r->train_acc, true);
        metric_line(r, "{\"type\":\"epoch\",\"epoch\":%d,\"step\":%llu,\"train_loss\":%.6f,"
                    "\"train_acc\":%.6f,\"test_loss\":%.6f,\"test_acc\":%.6f,"
                    "\"test_samples\":%llu,\"lr\":%.6g,\"samples_per_s\":%.1f,\"stall\":%.4f,"
                    "\"seconds\":%.2f,\"world\":%d,\"params_differing_across_ranks\":%llu}",
                    r->epoch + 1, (unsigned long long)r->step, r->train_loss,
                    r->train_acc, tl, ta, (unsigned long long)r->eval_seen, r->lr,
                    st.samples_per_s * r->rank.world, st.stall, stk_now() - t0,
                    r->rank.world, (unsigned long long)differ);
        if (differ)
            rc = stk_fail(err, STK_EPEER,
                          "after epoch %d, %llu parameters differ between the ranks; "
                          "stopped (the ranks' gradients are no longer reduced alike)",
                          r->epoch + 1, (unsigned long long)differ);
        if (rc)
            break;
        if (!r->o->quiet)
            fprintf(stderr, "epoch %d: train loss %.4f acc %.2f%%, test loss %.4f acc %.2f%% (%llu samples)\n",
                    r->epoch + 1, r->train_loss, 100 * r->train_acc, tl, 100 * ta,
                    (unsigned long long)r->eval_seen);
        res->test_acc = ta;
        res->test_loss = tl;
        res->train_loss = r->train_loss;
        res->epochs_done = r->epoch + 1;
        if (ta > r->best_acc)
            r->best_acc = ta;
        r->epoch_steps[r->epoch] = r->step - r->epoch_first_step;
        r->epoch_first_step = r->step;
        rc = save(r, ta >= r->best_acc, err);
        if (!rc)
            draw_curves(r);
        if (!rc && !stopped && r->epoch + 1 < r->o->epochs)
            rc = stop_asked(r, &stopped, err);
        if (!rc && stopped) { /* at an epoch boundary: evaluated and saved */
            res->stopped = true;
            r->epoch++;
            break;
        }
    }
    res->steps = r->step;
    res->best_acc = r->best_acc;
    return rc;
}

/* ---- setting up -------------------------------------------------------------- */

/* Whether --model names a built-in rather than a file. */
static bool is_builtin(const char *name)
{
    static const char *const names[] = {"cnn", "mlp", "resnet20", "resnet18"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strcmp(name, names[i]))
            return true;
    return false;
}

static int read_spec(const char *m, stk_model_spec *spec, stk_err *err)
{
    if (is_builtin(m))
        return stk_model_builtin(m, spec, err);
    uint8_t *text;
    size_t len;
    int rc = stk_read_file(m, &text, &len, err); /* names the file */
    if (rc)
        return rc;
    char *s = malloc(len + 1);
    if (!s) {
        free(text);
        return stk_fail(err, STK_ENOMEM, "out of memory");
    }
    memcpy(s, text, len);
    s[len] = '\0';
    rc = stk_model_parse(s, m, spec, err);
    free(s);
    free(text);
    return rc;
}

/* The model's spec with the run's choices: the convolution algorithm and,
 * under --no-dropout, every dropout's p at 0 (stk_dropout's identity), so
 * that the model still trains in training mode (batchnorm). */
static int load_spec(run_state *r, stk_err *err)
{
    int rc = read_spec(r->o->model, &r->spec, err);
    r->spec.conv = r->o->conv;
    for (int i = 0; i < r->spec.n && !r->o->dropout; i++)
        if (r->spec.layers[i].kind == STK_L_DROPOUT ||
            r->spec.layers[i].kind == STK_L_DROPOUT2D)
            r->spec.layers[i].p = 0.0f;
    return rc;
}

/* The images the model sees and the loaders' transforms that make them:
 * the records as stored, or (--augment rrc, --crop-size, --crop-ratio, or
 * an aspect-keeping database) crop x crop images: the test split through
 * torchvision's Resize(crop / ratio) + CenterCrop(crop), the train split
 * through RandomResizedCrop + flip (rrc) or the same centre crop. */
static int input_shape(run_state *r, const stk_meta *m, stk_err *err)
{
    const stk_train_opts *o = r->o;
    r->augment = o->augment != STK_AUG_AUTO ? o->augment
                 : m->variable              ? STK_AUG_RRC
                                            : STK_AUG_NONE;
    if (o->rrc_scale[1] > 0 && r->augment != STK_AUG_RRC) /* the default */
        return stk_fail(err, STK_EINVAL,
                        "--rrc-scale applies to --augment rrc "
                        "(RandomResizedCrop); %s holds records of one size, "
                        "which train as stored by default: add --augment rrc",
                        o->db);
    r->in_c = m->channels;
    r->in_h = m->height;
    r->in_w = m->width;
    if (!m->variable && r->augment != STK_AUG_RRC && !o->crop_size &&
        !(o->crop_ratio > 0))
        return 0; /* as stored (JPEG records decoded by the loader) */
    int rc = stk_loader_crop_plan(m, o->crop_size, o->crop_ratio, o->db,
                                  &r->test_xf, err);
    if (rc)
        return rc;
    int crop = r->test_xf.size;
    r->train_xf = r->test_xf;
    if (r->augment == STK_AUG_RRC)
        r->train_xf = (stk_loader_xform){
            .kind = STK_XFORM_RRC, .size = crop, .flip = true,
            .scale = {o->rrc_scale[0], o->rrc_scale[1]}};
    r->in_h = r->in_w = crop;
    return 0;
}

static int setup_data(run_state *r, stk_err *err)
{
    const stk_train_opts *o = r->o;
    int rc = stk_store_open(o->db, 0, &r->store, err);
    if (rc)
        return rc;
    const stk_meta *m = stk_store_meta(r->store);
    /* evaluation on "test", or ImageNet's "val" where there is no test */
    int tr = stk_meta_split(m, "train"), te = stk_meta_split(m, "test");
    r->eval_split = "test";
    if (te < 0 && (te = stk_meta_split(m, "val")) >= 0)
        r->eval_split = "val";
    if (tr >= 0 && te < 0 && !strcmp(m->source_format, "folder"))
        return stk_fail(err, STK_EINVAL,
                        "%s: has no \"test\" split to evaluate on; hold part of "
                        "each class out with `prep --holdout 0.1 --force %s %s` (or give "
                        "the photos RAW/train/<class> and RAW/test/<class> folders)",
                        o->db, m->source_path, o->db);
    if (tr < 0 || te < 0)
        return stk_fail(err, STK_EINVAL,
                        "%s: needs splits \"train\" and \"test\" (or \"val\") "
                        "(has %d split%s)",
                        o->db, m->nsplits, m->nsplits == 1 ? "" : "s");
    if ((rc = input_shape(r, m, err)))
        return rc;
    r->classes = m->nclasses;
    /* augmentation draws from its own key, so its words never coincide
     * with dropout's (which uses r->key with step-based streams) */
    stk_philox_key aug = {r->key.k0 ^ 0x243f6a88u, r->key.k1 ^ 0x85a308d3u};
    bool crop = r->augment == STK_AUG_CROP;
    stk_transform t = {r->in_c, r->in_h, r->in_w, {0}, {0},
                       crop ? r->in_h / 8 : 0, crop, aug, 0};
    for (int c = 0; c < m->channels; c++) {
        t.mean[c] = (float)m->splits[tr].mean[c];
        t.inv_std[c] = 1.0f / (float)(m->splits[tr].std[c] > 0 ? m->splits[tr].std[c] : 1);
    }
    r->transform = t;
    /* per rank: the shard (padded as DistributedSampler pads), its batches,
     * and the optimizer steps they make */
    uint64_t world = (uint64_t)r->rank.world, b = (uint64_t)o->batch;
    r->shard = (m->splits[tr].count + world - 1) / world;
    r->batches = (r->shard + b - 1) / b;
    uint64_t per = (r->batches + (uint64_t)o->accum - 1) / (uint64_t)o->accum;
    r->total_steps = per * (uint64_t)o->epochs;
    return 0;
}

static int setup_buffers(run_state *r, stk_err *err)
{
    stk_backend *be = r->be;
    r->agree_steps = agree_steps(be);
    size_t n = (size_t)r->o->batch, sb = (size_t)r->in_c * r->in_h * r->in_w;
    size_t np = stk_model_param_count(r->model);
    r->x_f = stk_dev_alloc(be, n * sb * sizeof(float), err);
    r->mdev = stk_dev_alloc(be, sizeof *r->mdev, err);
    r->mhost = stk_pinned_alloc(be, sizeof *r->mhost);
    r->state1 = stk_dev_alloc(be, np * sizeof(float), err);
    r->state2 = r->o->optim == STK_OPT_ADAMW ? stk_dev_alloc(be, np * sizeof(float), err)
                                             : NULL;
    int rc = uploader_init(&r->up, be, n, sb, err);
    if (!rc)
        rc = stk_event_create(be, &r->mread, err);
    if (rc)
        return rc;
    if (!r->x_f || !r->mdev || !r->mhost || !r->state1 ||
        (r->o->optim == STK_OPT_ADAMW && !r->state2))
        return stk_fail(err, STK_ENOMEM, "out of memory for a batch of %zu", n);
    rc = stk_memzero(be, r->mdev, sizeof *r->mdev, err);
    if (!rc)
        rc = stk_memzero(be, r->state1, np * sizeof(float), err);
    if (!rc && r->state2)
        rc = stk_memzero(be, r->state2, np * sizeof(float), err);
    return rc;
}

/* mkdir -p */
static int make_dirs(const char *dir, stk_err *err)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", dir);
    for (char *c = p + 1; *c; c++)
        if (*c == '/') {
            *c = '\0';
            if (mkdir(p, 0775) != 0 && errno != EEXIST)
                return stk_fail(err, stk_from_errno(errno), "--out %s: %s: %s", dir,
                                p, strerror(errno));
            *c = '/';
        }
    if (mkdir(p, 0775) != 0 && errno != EEXIST)
        return stk_fail(err, stk_from_errno(errno), "--out %s: %s", dir, strerror(errno));
    return 0;
}

/* A fresh run must not mix its checkpoints and metrics with an earlier
 * run's: RUN_DIR with checkpoints needs --resume. */
static int check_fresh(const char *ckdir, const char *out, stk_err *err)
{
    DIR *d = opendir(ckdir);
    struct dirent *de;
    int used = 0;
    while (d && (de = readdir(d)))
        used |= !strncmp(de->d_name, "step-", 5);
    if (d)
        closedir(d);
    return used ? stk_fail(err, STK_EEXIST,
                           "--out %s holds the checkpoints of an earlier run; continue it "
                           "with --resume auto, or choose another --out",
                           out)
                : 0;
}

/* One run at a time in RUN_DIR: an exclusive flock on RUN_DIR/.lock, held
 * for the life of the run (the kernel drops it when the process ends, even
 * by kill -9, so a crash never blocks the next run). The holder writes its
 * pid there, for the message of a run it turns away. */
static int lock_run_dir(run_state *r, const char *dir, stk_err *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = stk_open_output(path, O_RDWR | O_CREAT, err);
    if (fd < 0)
        return fd;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char pid[24] = "";
        ssize_t n = pread(fd, pid, sizeof pid - 1, 0);
        close(fd);
        pid[n > 0 ? n : 0] = '\0';
        pid[strspn(pid, "0123456789")] = '\0';
        if (e != EWOULDBLOCK)
            return stk_fail(err, stk_from_errno(e), "%s: cannot lock: %s",
                            path, strerror(e));
        return stk_fail(
            err, STK_EEXIST,
            "--out %s is in use by another train (pid %s); two runs never "
            "share a RUN_DIR: wait for it to end or choose another --out",
            dir, *pid ? pid : "unknown");
    }
    char line[32];
    int len = snprintf(line, sizeof line, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, line, (size_t)len, 0) != len) {
        int e = errno;
        close(fd);
        return stk_fail(err, stk_from_errno(e), "%s: %s", path, strerror(e));
    }
    r->lock_fd = fd;
    return 0;
}

/* A run that continues no checkpoint of RUN_DIR starts metrics.jsonl
 * afresh: lines already there are an earlier run's that left no
 * checkpoint (killed before its first), kept as metrics.jsonl.N, the first
 * N free, so two runs never mix their lines and none is lost. */
static int set_metrics_aside(run_state *r, const char *path, stk_err *err)
{
    struct stat st;
    if (r->resumed_here || lstat(path, &st) != 0 ||
        !S_ISREG(st.st_mode) || st.st_size == 0)
        return 0; /* anything but a regular file: stk_open_output says */
    char aside[4300]; /* path is at most 4200 */
    for (int n = 1; n < 1000; n++) {
        snprintf(aside, sizeof aside, "%s.%d", path, n);
        if (lstat(aside, &st) == 0 || errno != ENOENT)
            continue;
        if (rename(path, aside) != 0)
            break;
        fprintf(stderr, "train: %s held the lines of an earlier run that left "
                        "no checkpoint; they are in %s\n", path, aside);
        return 0;
    }
    return stk_fail(err, stk_from_errno(errno),
                    "%s holds an earlier run's lines and cannot be set aside "
                    "(%s): move it away", path, strerror(errno));
}

static int open_run_dir(run_state *r, stk_err *err)
{
    char path[4096];
    const char *dir = r->o->out;
    int rc = make_dirs(dir, err);
    if (!rc)
        rc = lock_run_dir(r, dir, err); /* before anything in it is read */
    if (rc)
        return rc;
    snprintf(path, sizeof path, "%s/checkpoints", dir);
    if (mkdir(path, 0775) != 0 && errno != EEXIST)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
    if (!r->o->resume && (rc = check_fresh(path, dir, err)))
        return rc;
    return stk_checkpoint_check_dir(r, err);
}

/* RUN_DIR/metrics.jsonl, once the run knows what it continues and has
 * passed every check: a refused run changes nothing there. */
static int open_metrics(run_state *r, stk_err *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/metrics.jsonl", r->o->out);
    int rc = set_metrics_aside(r, path, err);
    if (rc)
        return rc;
    int fd = stk_open_output(path, O_WRONLY | O_APPEND | O_CREAT, err);
    if (fd < 0)
        return fd;
    if (!(r->metrics = fdopen(fd, "a"))) {
        close(fd);
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
    }
    return 0;
}

/* An epoch's last batch of one sample would fail in a batchnorm over 1x1
 * planes after the epoch's work (the model's own check sees only
 * --batch): refused before the first step, naming the remainder. */
static int check_last_batch(const run_state *r, stk_err *err)
{
    uint64_t b = (uint64_t)r->o->batch, last = r->shard % b,
             accum = (uint64_t)r->o->accum;
    /* a run that --max-steps ends before the epoch's last batch never
     * meets it (a short smoke test) */
    uint64_t left = (r->batches + accum - 1) / accum - r->start_batch / accum;
    if (r->o->max_steps && r->step + left > (uint64_t)r->o->max_steps)
        return 0;
    char name[STK_NAME_MAX + 32];
    const char *bn = last == 1 ? stk_model_single_value_bn(r->model, 1, name,
                                                          sizeof name)
                               : NULL;
    if (!bn)
        return 0;
    return stk_fail(err, STK_EINVAL,
                    "model: %s: a batchnorm over 1x1 inputs sees one value "
                    "per channel in the epoch's last batch, of 1 sample "
                    "(%llu train samples a rank = %llu x --batch %llu + 1); "
                    "choose a --batch that leaves another remainder",
                    bn, (unsigned long long)r->shard,
                    (unsigned long long)(r->shard / b), (unsigned long long)b);
}

/* A warm-up that takes the whole schedule leaves no decay, and the rate
 * may never reach --lr: said (the default 100 steps outlast a small
 * dataset's run). */
static void note_warmup(const run_state *r)
{
    const stk_train_opts *o = r->o;
    if (o->sched == STK_SCHED_ONECYCLE || o->warmup <= 0 ||
        (uint64_t)o->warmup < r->total_steps)
        return;
    fprintf(stderr, "train: note: --warmup %d takes the run's whole %llu "
                    "steps: the rate rises to %g (--lr %g) and never "
                    "decays; give a shorter --warmup\n",
            o->warmup, (unsigned long long)r->total_steps,
            (double)o->lr * (double)r->total_steps / o->warmup, (double)o->lr);
}

static int setup(run_state *r, stk_err *err)
{
    const stk_train_opts *o = r->o;
    r->key = (stk_philox_key){(uint32_t)o->seed, (uint32_t)(o->seed >> 32) ^ 0x5bd1e995u};
    /* the backend first: on a GPU it selects the rank's device before any
     * other CUDA call */
    r->epoch_steps = calloc((size_t)o->epochs, sizeof *r->epoch_steps);
    r->epoch_steps_known = true;
    if (!r->epoch_steps)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    int rc = stk_backend_create(o->device, o->device_id, o->threads, &r->be, err);
    if (!rc)
        rc = group_open(r, err);
    if (rc)
        return rc;
    rc = load_spec(r, err);
    if (!rc)
        rc = setup_data(r, err);
    if (!rc) {
        const stk_meta *m = stk_store_meta(r->store);
        r->host = pinned_ring_host(&r->ring, r->be);
        rc =
            stk_model_create(r->be, &r->spec, r->in_c, r->in_h, r->in_w,
                             m->nclasses, o->batch, o->seed, &r->model, err);
    }
    if (!rc)
        rc = setup_buffers(r, err);
    bool lead = r->rank.rank == 0; /* rank 0 owns RUN_DIR; the rest follow it */
    bool writes = !o->evaluate;   /* --evaluate leaves RUN_DIR alone */
    if (!rc && lead && writes)
        rc = open_run_dir(r, err);
    if (!rc && lead && o->resume)
        rc = stk_checkpoint_resume(r, o->resume, err);
    /* --resume auto with --init-from: the weights to start from when there
     * is no checkpoint yet (a job that restarts itself) */
    if (!rc && lead && o->init_from && r->resumed_here)
        fprintf(stderr, "train: note: --init-from %s is not read: the run "
                        "continues its checkpoint\n", o->init_from);
    else if (!rc && lead && o->init_from)
        rc = stk_checkpoint_load_weights(r, o->init_from, err);
    rc = group_agree(r, rc, err); /* a rank that failed ends them all now */
    if (!rc)
        rc = group_check_config(r, err);
    if (!rc)
        rc = group_share_start(r, err);
    if (!rc && writes) { /* metrics.jsonl: for a run that passed every check */
        rc = check_last_batch(r, err);
        if (!rc && lead)
            rc = open_metrics(r, err);
        rc = group_agree(r, rc, err);
    }
    if (!rc && lead && writes)
        note_warmup(r);
    return rc ? rc : group_ddp(r, err);
}

static void teardown(run_state *r)
{
    group_close(r);
    if (r->metrics)
        fclose(r->metrics);
    if (r->lock_fd >= 0)
        close(r->lock_fd); /* the last: RUN_DIR is free once all is written */
    if (r->be) {
        stk_dev_free(r->be, r->x_f);
        uploader_free(&r->up);
        stk_dev_free(r->be, r->mdev);
        stk_pinned_free(r->be, r->mhost);
        stk_event_destroy(r->be, r->mread);
        pinned_ring_free(&r->ring); /* every loader is closed */
        stk_dev_free(r->be, r->state1);
        stk_dev_free(r->be, r->state2);
    }
    free(r->epoch_steps);
    stk_model_destroy(r->model);
    stk_store_close(r->store);
    stk_backend_destroy(r->be);
}

/* The learning rate and weight decay left unset (negative) take the
 * chosen optimizer's defaults: AdamW 0.002 and 0.01, SGD 0.02 and 0. */
static stk_train_opts resolve(const stk_train_opts *in)
{
    stk_train_opts o = *in;
    bool adamw = o.optim == STK_OPT_ADAMW;
    if (o.lr < 0)
        o.lr = adamw ? 0.002f : 0.02f;
    if (o.weight_decay < 0)
        o.weight_decay = adamw ? 0.01f : 0.0f;
    return o;
}

int stk_train_check_opts(const stk_train_opts *o, stk_err *err)
{
    if (o->epochs < 1 || o->batch < 1 || o->log_every < 1 || o->accum < 1)
        return stk_fail(err, STK_EINVAL,
                        "epochs, batch, accum and log interval must be >= 1");
    /* as PyTorch's SGD: Nesterov's look-ahead is along the momentum */
    if (o->nesterov && o->optim == STK_OPT_SGD && !(o->momentum > 0))
        return stk_fail(err, STK_EINVAL,
                        "--nesterov needs --momentum above 0 (Nesterov momentum "
                        "requires a momentum and zero dampening)");
    if (!(o->label_smoothing >= 0 && o->label_smoothing < 1))
        return stk_fail(err, STK_EINVAL,
                        "--label-smoothing must be in [0, 1), not %g",
                        (double)o->label_smoothing);
    if (o->evaluate && (!o->init_from || o->resume))
        return stk_fail(err, STK_EINVAL,
                        "--evaluate evaluates the weights of --init-from FILE "
                        "(a checkpoint's are its model.safetensors), %s",
                        o->resume ? "not --resume" : "which is missing");
    if (o->init_from && o->resume && strcmp(o->resume, "auto"))
        return stk_fail(err, STK_EINVAL,
                        "--init-from and --resume PATH exclude each other: a "
                        "resumed run takes its weights from the checkpoint "
                        "(with --resume auto, --init-from is read when there "
                        "is none yet)");
    if (o->rrc_scale[1] > 0 && o->augment != STK_AUG_RRC &&
        o->augment != STK_AUG_AUTO)
        return stk_fail(err, STK_EINVAL,
                        "--rrc-scale applies to --augment rrc (RandomResizedCrop)");
    return 0;
}

int stk_train_run(const stk_train_opts *in, stk_train_result *res,
                  stk_err *err)
{
    int rc = stk_train_check_opts(in, err);
    if (rc)
        return rc;
    stk_train_opts o_resolved = resolve(in);
    const stk_train_opts *o = &o_resolved;
    run_state r;
    memset(&r, 0, sizeof r);
    memset(res, 0, sizeof *res);
    r.o = o;
    r.lock_fd = -1;
    if (in->rank) {
        r.rank = *in->rank;
    } else {
        r.rank.world = r.rank.local_world = 1;
        r.rank.source = "single process";
    }
    bool speak = !o_resolved.quiet;
    if (r.rank.rank != 0)
        o_resolved.quiet = true; /* rank 0 alone prints */
    r.tty = isatty(2);
    rc = setup(&r, err);
    if (!rc && speak && r.rank.world > 1) /* which device each rank took */
        fprintf(stderr, "train: rank %d of %d on %s, %d thread(s) (%s)\n", r.rank.rank,
                r.rank.world, stk_backend_name(r.be), stk_backend_threads(r.be),
                r.rank.source);
    if (!rc && !o->quiet) {
        char desc[480]; /* a sequential model whole; a ResNet's first
                           layers, " ..." and its parameter count */
        stk_model_describe(r.model, desc, sizeof desc);
        fprintf(stderr, "train: %s on %s, %s\n", o->model, stk_backend_name(r.be), desc);
    }
    if (!rc && o->evaluate) {
        res->evaluated = true;
        res->eval_split = r.eval_split;
        rc = evaluate(&r, &res->test_loss, &res->test_acc, err);
    } else if (!rc) {
        rc = run_epochs(&r, res, err);
    }
    if (rc)
        group_abort(&r); /* the peers stop now, not after --timeout */
    teardown(&r);
    return rc;
}
