/* train.c - the training loop: loader -> device transform -> forward ->
 * cross-entropy -> backward -> optimizer step, evaluation every epoch,
 * metrics lines and checkpoints. */
#include "checkpoint.h"
#include "loader/loader.h"
#include "train_impl.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
}

/* ---- the learning rate ------------------------------------------------- */

float stk_train_lr(const stk_train_opts *o, uint64_t step, uint64_t total,
                   int epoch)
{
    if (o->warmup > 0 && step < (uint64_t)o->warmup)
        return o->lr * (float)(step + 1) / (float)o->warmup;
    switch (o->sched) {
    case STK_SCHED_STEP:
        return o->lr * powf(o->gamma, (float)(epoch / (o->step_size > 0 ? o->step_size : 1)));
    case STK_SCHED_COSINE: {
        double span = (double)total - o->warmup, t = (double)step - o->warmup;
        if (span <= 0)
            return o->lr;
        return (float)(o->lr * 0.5 * (1.0 + cos(M_PI * (t < span ? t : span) / span)));
    }
    default:
        return o->lr;
    }
}

/* ---- one step ---------------------------------------------------------- */

/* Moves a loader batch to the device (the CPU backend uses it in place)
 * and runs the input transform. */
static int stage_batch(run_state *r, const stk_batch *b, uint64_t epoch,
                       bool train, stk_err *err)
{
    stk_backend *be = r->be;
    const uint8_t *x = b->data;
    const uint64_t *ids = b->indices;
    const int32_t *labels = b->labels;
    int rc = 0;
    if (stk_backend_kind(be) != STK_DEV_CPU) {
        rc = stk_copy_to_dev(be, r->x_u8, b->data, (size_t)b->n * b->sample_bytes, err);
        if (!rc)
            rc = stk_copy_to_dev(be, r->ids, b->indices, (size_t)b->n * sizeof *ids, err);
        if (!rc)
            rc = stk_copy_to_dev(be, r->labels, b->labels, (size_t)b->n * sizeof *labels, err);
        x = r->x_u8;
        ids = r->ids;
        labels = r->labels;
    }
    r->dev_labels = labels;
    stk_transform t = r->transform;
    t.stream = epoch;
    if (!train)
        t.pad = t.flip = 0;
    return rc ? rc : stk_transform_batch(be, x, ids, b->n, &t, r->x_f, err);
}

/* Counts argmax hits of logits against the batch's labels. */
static int count_correct(run_state *r, const float *logits, const stk_batch *b,
                         int *correct, stk_err *err)
{
    size_t n = (size_t)b->n * r->classes;
    const float *z = logits;
    if (stk_backend_kind(r->be) != STK_DEV_CPU) {
        int rc = stk_copy_to_host(r->be, r->host_logits, logits, n * sizeof(float), err);
        if (!rc)
            rc = stk_sync(r->be, err);
        if (rc)
            return rc;
        z = r->host_logits;
    }
    *correct = 0;
    for (int i = 0; i < b->n; i++) {
        int best = 0;
        for (int c = 1; c < r->classes; c++)
            if (z[(size_t)i * r->classes + c] > z[(size_t)i * r->classes + best])
                best = c;
        *correct += best == b->labels[i];
    }
    return 0;
}

static int clip_grads(run_state *r, float *norm, stk_err *err)
{
    double ss;
    size_t n = stk_model_param_count(r->model);
    int rc = stk_sumsq(r->be, stk_model_grads(r->model), n, &ss, err);
    *norm = (float)sqrt(ss);
    if (!rc && r->o->clip > 0 && *norm > r->o->clip)
        rc = stk_scale(r->be, n, r->o->clip / (*norm + 1e-6f), stk_model_grads(r->model), err);
    return rc;
}

static int optimizer_step(run_state *r, float lr, stk_err *err)
{
    const stk_train_opts *o = r->o;
    size_t n = stk_model_param_count(r->model);
    float *w = stk_model_weights(r->model), *g = stk_model_grads(r->model);
    if (o->optim == STK_OPT_SGD) {
        stk_sgd_cfg c = {lr, o->momentum, o->weight_decay, o->nesterov, r->step == 0};
        return stk_sgd_step(r->be, w, g, r->state1, n, &c, err);
    }
    double t = (double)r->step + 1, b1 = 0.9, b2 = 0.999;
    stk_adamw_cfg c = {lr, (float)b1, (float)b2, 1e-8f, o->weight_decay,
                       (float)(1.0 - pow(b1, t)), (float)sqrt(1.0 - pow(b2, t)),
                       (float)(1.0 - b1), (float)(1.0 - b2)};
    return stk_adamw_step(r->be, w, g, r->state1, r->state2, n, &c, err);
}

/* One training step on batch b; *loss and *correct for the metrics. */
static int train_step(run_state *r, const stk_batch *b, float *loss,
                      int *correct, stk_err *err)
{
    const float *logits;
    stk_philox_key key = r->key;
    int rc = stage_batch(r, b, b->epoch, true, err);
    if (!rc)
        rc = stk_model_forward(r->model, r->x_f, b->n, r->o->dropout, key, r->step, &logits, err);
    if (!rc)
        rc = stk_xent(r->be, logits, r->dev_labels, b->n, r->classes, loss,
                      stk_model_dlogits(r->model), err);
    if (!rc && !isfinite(*loss))
        return stk_fail(err, STK_ERANGE,
                        "loss is %s at step %llu (epoch %llu); stopped, the last good "
                        "checkpoint is kept (lower --lr or set --clip)",
                        isnan(*loss) ? "NaN" : "infinite",
                        (unsigned long long)r->step + 1,
                        (unsigned long long)b->epoch + 1);
    if (!rc)
        rc = count_correct(r, logits, b, correct, err);
    if (!rc)
        rc = stk_model_backward(r->model, stk_model_dlogits(r->model), b->n, key,
                                r->step, false, NULL, NULL, err);
    float norm;
    if (!rc)
        rc = clip_grads(r, &norm, err);
    if (!rc && !isfinite(norm)) /* never let a non-finite step into the weights */
        return stk_fail(err, STK_ERANGE,
                        "gradient norm is %s at step %llu (epoch %llu); stopped, the "
                        "last good checkpoint is kept (lower --lr or set --clip)",
                        isnan(norm) ? "NaN" : "infinite",
                        (unsigned long long)r->step + 1,
                        (unsigned long long)b->epoch + 1);
    if (!rc) {
        r->lr = stk_train_lr(r->o, r->step, r->total_steps, (int)b->epoch);
        rc = optimizer_step(r, r->lr, err);
    }
    return rc;
}

/* ---- evaluation ---------------------------------------------------------- */

static int evaluate(run_state *r, double *loss, double *acc, stk_err *err)
{
    stk_loader_opts lo = {.split = "test", .batch_size = r->o->batch,
                          .workers = r->o->workers, .uneven = true,
                          .host = r->host};
    stk_loader *l;
    int rc = stk_loader_open(r->store, &lo, &l, err);
    if (rc)
        return rc;
    stk_batch b;
    double sum = 0;
    uint64_t seen = 0, hits = 0;
    while (!rc && (rc = stk_loader_next(l, &b, err)) == 1) {
        const float *logits;
        float bl = 0;
        int correct = 0;
        rc = stage_batch(r, &b, 0, false, err);
        if (!rc)
            rc = stk_model_forward(r->model, r->x_f, b.n, false, r->key, 0, &logits, err);
        if (!rc)
            rc = stk_xent(r->be, logits, r->dev_labels, b.n, r->classes, &bl, NULL, err);
        if (!rc)
            rc = count_correct(r, logits, &b, &correct, err);
        sum += (double)bl * b.n;
        seen += (uint64_t)b.n;
        hits += (uint64_t)correct;
        stk_loader_release(l, &b);
    }
    stk_loader_close(l);
    if (rc < 0)
        return rc;
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
    fprintf(stderr, "%sepoch %d/%d step %llu  loss %.4f  acc %.2f%%  %.0f samples/s  stall %.1f%%  ETA %.0fs%s",
            r->tty ? "\r" : "", r->epoch + 1, r->o->epochs,
            (unsigned long long)r->step, loss, 100 * acc, rate,
            100 * st->stall, eta, r->tty && !final_line ? "\033[K" : "\n");
}

/* ---- the epoch loop ----------------------------------------------------------- */

static int train_epoch(run_state *r, stk_loader *l, stk_err *err)
{
    stk_batch b;
    int rc;
    double loss_sum = 0, win_loss = 0;
    uint64_t seen = 0, hits = 0, win_n = 0, win_hits = 0;
    while ((rc = stk_loader_next(l, &b, err)) == 1) {
        float loss;
        int correct;
        rc = train_step(r, &b, &loss, &correct, err);
        stk_loader_release(l, &b);
        if (rc)
            return rc;
        r->step++;
        stk_loader_pos pos = stk_loader_position(l);
        r->pos_epoch = pos.epoch;
        r->pos_batch = pos.batch;
        loss_sum += (double)loss * b.n;
        seen += (uint64_t)b.n;
        hits += (uint64_t)correct;
        win_loss += (double)loss * b.n;
        win_n += (uint64_t)b.n;
        win_hits += (uint64_t)correct;
        if (r->step % (uint64_t)r->o->log_every == 0) {
            stk_loader_stats st;
            stk_loader_stats_get(l, &st);
            metric_line(r, "{\"type\":\"step\",\"step\":%llu,\"epoch\":%d,\"loss\":%.6f,"
                        "\"acc\":%.6f,\"lr\":%.6g,\"samples_per_s\":%.1f,\"stall\":%.4f}",
                        (unsigned long long)r->step, r->epoch + 1, win_loss / win_n,
                        (double)win_hits / win_n, r->lr, st.samples_per_s, st.stall);
            progress(r, &st, win_loss / win_n, (double)win_hits / win_n, false);
            win_loss = 0;
            win_n = win_hits = 0;
        }
        if ((r->o->stop && *r->o->stop) ||
            (r->o->max_steps && r->step >= (uint64_t)r->o->max_steps))
            break;
    }
    if (rc < 0)
        return rc;
    r->train_loss = seen ? loss_sum / seen : 0;
    r->train_acc = seen ? (double)hits / seen : 0;
    return 0;
}

static int run_epochs(run_state *r, stk_train_result *res, stk_err *err)
{
    int rc = 0;
    for (; r->epoch < r->o->epochs && !rc; r->epoch++) {
        stk_loader_opts lo = {.split = "train", .batch_size = r->o->batch,
                              .workers = r->o->workers, .shuffle = true,
                              .seed = r->o->seed, .start_epoch = (uint64_t)r->epoch,
                              .start_batch = r->start_batch, .host = r->host};
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
        bool stopped = (r->o->stop && *r->o->stop) ||
                       (r->o->max_steps && r->step >= (uint64_t)r->o->max_steps);
        if (rc)
            break;
        if (stopped && r->pos_epoch == (uint64_t)r->epoch) {
            /* mid-epoch: keep the work, with the loader's position */
            rc = stk_checkpoint_save(r, false, err);
            res->stopped = true;
            break;
        }
        double tl, ta;
        if ((rc = evaluate(r, &tl, &ta, err)))
            break;
        if (!isfinite(tl)) {
            rc = stk_fail(err, STK_ERANGE,
                          "test loss is not finite after epoch %d; stopped, the last "
                          "good checkpoint is kept",
                          r->epoch + 1);
            break;
        }
        progress(r, &st, r->train_loss, r->train_acc, true);
        metric_line(r, "{\"type\":\"epoch\",\"epoch\":%d,\"step\":%llu,\"train_loss\":%.6f,"
                    "\"train_acc\":%.6f,\"test_loss\":%.6f,\"test_acc\":%.6f,"
                    "\"test_samples\":%llu,\"samples_per_s\":%.1f,\"stall\":%.4f,\"seconds\":%.2f}",
                    r->epoch + 1, (unsigned long long)r->step, r->train_loss,
                    r->train_acc, tl, ta, (unsigned long long)r->eval_seen,
                    st.samples_per_s, st.stall, stk_now() - t0);
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
        rc = stk_checkpoint_save(r, ta >= r->best_acc, err);
        if (stopped) { /* at an epoch boundary: evaluated and saved */
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

static void *pinned_alloc(size_t n, void *ctx) { return stk_pinned_alloc(ctx, n); }
static void pinned_free(void *p, void *ctx) { stk_pinned_free(ctx, p); }

static int load_spec(run_state *r, stk_err *err)
{
    const char *m = r->o->model;
    if (!strcmp(m, "cnn") || !strcmp(m, "mlp"))
        return stk_model_builtin(m, &r->spec, err);
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
    rc = stk_model_parse(s, m, &r->spec, err);
    free(s);
    free(text);
    return rc;
}

static int setup_data(run_state *r, stk_err *err)
{
    const stk_train_opts *o = r->o;
    int rc = stk_store_open(o->db, 0, &r->store, err);
    if (rc)
        return rc;
    const stk_meta *m = stk_store_meta(r->store);
    int tr = stk_meta_split(m, "train"), te = stk_meta_split(m, "test");
    if (tr < 0 || te < 0)
        return stk_fail(err, STK_EINVAL,
                        "%s: needs splits \"train\" and \"test\" (has %d split%s)",
                        o->db, m->nsplits, m->nsplits == 1 ? "" : "s");
    r->classes = m->nclasses;
    /* augmentation draws from its own key, so its words never coincide
     * with dropout's (which uses r->key with step-based streams) */
    stk_philox_key aug = {r->key.k0 ^ 0x243f6a88u, r->key.k1 ^ 0x85a308d3u};
    stk_transform t = {m->channels, m->height, m->width, {0}, {0},
                       o->augment ? m->height / 8 : 0, o->augment, aug, 0};
    for (int c = 0; c < m->channels; c++) {
        t.mean[c] = (float)m->splits[tr].mean[c];
        t.inv_std[c] = 1.0f / (float)(m->splits[tr].std[c] > 0 ? m->splits[tr].std[c] : 1);
    }
    r->transform = t;
    uint64_t per = (m->splits[tr].count + (uint64_t)o->batch - 1) / (uint64_t)o->batch;
    r->total_steps = per * (uint64_t)o->epochs;
    return 0;
}

static int setup_buffers(run_state *r, stk_err *err)
{
    const stk_meta *m = stk_store_meta(r->store);
    stk_backend *be = r->be;
    size_t n = (size_t)r->o->batch, sb = stk_meta_sample_bytes(m);
    size_t np = stk_model_param_count(r->model);
    r->x_f = stk_dev_alloc(be, n * sb * sizeof(float), err);
    r->host_logits = malloc(n * (size_t)r->classes * sizeof(float));
    r->state1 = stk_dev_alloc(be, np * sizeof(float), err);
    r->state2 = r->o->optim == STK_OPT_ADAMW ? stk_dev_alloc(be, np * sizeof(float), err)
                                             : NULL;
    if (stk_backend_kind(be) != STK_DEV_CPU) {
        r->x_u8 = stk_dev_alloc(be, n * sb, err);
        r->ids = stk_dev_alloc(be, n * sizeof(uint64_t), err);
        r->labels = stk_dev_alloc(be, n * sizeof(int32_t), err);
        if (!r->x_u8 || !r->ids || !r->labels)
            return STK_ENOMEM;
    }
    if (!r->x_f || !r->host_logits || !r->state1 ||
        (r->o->optim == STK_OPT_ADAMW && !r->state2))
        return stk_fail(err, STK_ENOMEM, "out of memory for a batch of %zu", n);
    int rc = stk_memzero(be, r->state1, np * sizeof(float), err);
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

static int open_run_dir(run_state *r, stk_err *err)
{
    char path[4096];
    const char *dir = r->o->out;
    int rc = make_dirs(dir, err);
    if (rc)
        return rc;
    snprintf(path, sizeof path, "%s/checkpoints", dir);
    if (mkdir(path, 0775) != 0 && errno != EEXIST)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
    if (!r->o->resume && (rc = check_fresh(path, dir, err)))
        return rc;
    snprintf(path, sizeof path, "%s/metrics.jsonl", dir);
    if (!(r->metrics = fopen(path, "a")))
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
    return 0;
}

static int setup(run_state *r, stk_err *err)
{
    const stk_train_opts *o = r->o;
    r->key = (stk_philox_key){(uint32_t)o->seed, (uint32_t)(o->seed >> 32) ^ 0x5bd1e995u};
    int rc = stk_backend_create(o->device, o->device_id, o->threads, &r->be, err);
    if (!rc)
        rc = load_spec(r, err);
    if (!rc)
        rc = setup_data(r, err);
    if (rc)
        return rc;
    const stk_meta *m = stk_store_meta(r->store);
    r->host = (stk_host_alloc){pinned_alloc, pinned_free, r->be};
    rc = stk_model_create(r->be, &r->spec, m->channels, m->height, m->width,
                          m->nclasses, o->batch, o->seed, &r->model, err);
    if (!rc)
        rc = setup_buffers(r, err);
    if (!rc)
        rc = open_run_dir(r, err);
    if (!rc && o->init_from)
        rc = stk_checkpoint_load_weights(r, o->init_from, err);
    if (!rc && o->resume)
        rc = stk_checkpoint_resume(r, o->resume, err);
    return rc;
}

static void teardown(run_state *r)
{
    if (r->metrics)
        fclose(r->metrics);
    if (r->be) {
        stk_dev_free(r->be, r->x_f);
        stk_dev_free(r->be, r->x_u8);
        stk_dev_free(r->be, r->ids);
        stk_dev_free(r->be, r->labels);
        stk_dev_free(r->be, r->state1);
        stk_dev_free(r->be, r->state2);
    }
    free(r->host_logits);
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

int stk_train_run(const stk_train_opts *in, stk_train_result *res,
                  stk_err *err)
{
    if (in->epochs < 1 || in->batch < 1 || in->log_every < 1)
        return stk_fail(err, STK_EINVAL, "epochs, batch and log interval must be >= 1");
    stk_train_opts o_resolved = resolve(in);
    const stk_train_opts *o = &o_resolved;
    run_state r;
    memset(&r, 0, sizeof r);
    memset(res, 0, sizeof *res);
    r.o = o;
    r.tty = isatty(2);
    int rc = setup(&r, err);
    if (!rc && !o->quiet) {
        char desc[2048];
        stk_model_describe(r.model, desc, sizeof desc);
        fprintf(stderr, "train: %s on %s, %s\n", o->model, stk_backend_name(r.be), desc);
    }
    if (!rc)
        rc = run_epochs(&r, res, err);
    teardown(&r);
    return rc;
}
