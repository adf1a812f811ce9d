/* ckpt.c - checkpoints of a run: RUN_DIR/checkpoints/step-NNNNNNNN/ holds
 * model.safetensors (PyTorch's state_dict(): parameters, batchnorm's
 * running statistics and num_batches_tracked), optim.safetensors
 * (parameters only: momentum buffers, or AdamW's exp_avg and exp_avg_sq,
 * named after torch.optim's state) and state.json (epoch, step, loader
 * position, seed, best accuracy, configuration). A checkpoint
 * appears complete or not at all: it is written to a hidden directory,
 * synced and renamed. */
#include "checkpoint.h"
#include "train_impl.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The most tensors in one file: a batchnorm layer has five (weight, bias,
 * running_mean, running_var, num_batches_tracked); an optimizer file two
 * per parameter (AdamW's exp_avg and exp_avg_sq). */
#define MAX_TENSORS (5 * STK_MAX_LAYERS)

_Static_assert(sizeof((stk_param *)0)->name + sizeof ".momentum_buffer" <=
                   STK_TENSOR_NAME_MAX,
               "a parameter's name with an optimizer suffix fits a tensor name");

/* Views of the model's (host copy of its) parameters, with a suffix. */
static int tensors(run_state *r, float *host, const char *suffix,
                   stk_tensor *t)
{
    int n = stk_model_nparams(r->model);
    for (int i = 0; i < n; i++) {
        const stk_param *p = stk_model_param(r->model, i);
        t[i] = (stk_tensor){.dtype = STK_DT_F32, .ndim = p->ndim,
                            .count = p->count, .data = host + p->offset};
        snprintf(t[i].name, sizeof t[i].name, "%s%s", p->name, suffix);
        memcpy(t[i].shape, p->shape, sizeof p->shape);
    }
    return n;
}

static int dev_to_host(run_state *r, const float *dev, float *host, stk_err *err)
{
    size_t bytes = stk_model_param_count(r->model) * sizeof(float);
    int rc = stk_copy_to_host(r->be, host, dev, bytes, err);
    return rc ? rc : stk_sync(r->be, err);
}

/* Writes one or two parameter-shaped device buffers (dev2 may be NULL) as
 * the tensors NAME+suffix (and NAME+suffix2) of one file: the optimizer's
 * state, which batchnorm's buffers never have. */
static int save_params(run_state *r, const float *dev, const char *suffix,
                       const float *dev2, const char *suffix2,
                       const char *path, stk_err *err)
{
    size_t np = stk_model_param_count(r->model);
    float *host = malloc(np * (dev2 ? 2 : 1) * sizeof *host);
    stk_tensor *t = malloc(2 * (size_t)stk_model_nparams(r->model) * sizeof *t);
    int rc = host && t ? dev_to_host(r, dev, host, err)
                       : stk_fail(err, STK_ENOMEM, "checkpoint: out of memory");
    int n = rc ? 0 : tensors(r, host, suffix, t);
    if (!rc && dev2) {
        rc = dev_to_host(r, dev2, host + np, err);
        n += tensors(r, host + np, suffix2, t + n);
    }
    if (!rc)
        rc = stk_safetensors_write(path, t, n,
                                   "{\"format\":\"pt\",\"producer\":\"stoke\"}",
                                   err);
    free(t);
    free(host);
    return rc;
}

/* ---- the model's state: parameters, buffers, counters ---------------------- */

/* model.safetensors in host memory, as PyTorch's state_dict() of the
 * equivalent module holds it: the parameters (t[0, np)), batchnorm's
 * running_mean and running_var (F32, t[np, np + nb)) and its
 * num_batches_tracked (I64 scalars, t[np + nb, n)). */
typedef struct model_state {
    float *params, *buffers;
    int64_t *counters;
    stk_tensor *t;
    int np, nb, nc, n;
} model_state;

static void state_free(model_state *s)
{
    free(s->params);
    free(s->buffers);
    free(s->counters);
    free(s->t);
}

/* Allocates s and points its tensors at it. */
static int state_views(run_state *r, model_state *s, stk_err *err)
{
    stk_model *m = r->model;
    *s = (model_state){.nb = stk_model_nbuffers(m), .nc = stk_model_ncounters(m)};
    s->params = malloc(stk_model_param_count(m) * sizeof(float));
    s->buffers = malloc((stk_model_buffer_count(m) + 1) * sizeof(float));
    s->counters = calloc((size_t)s->nc + 1, sizeof(int64_t));
    s->t = malloc(((size_t)stk_model_nparams(m) + (size_t)(s->nb + s->nc)) *
                  sizeof *s->t);
    if (!s->params || !s->buffers || !s->counters || !s->t) {
        state_free(s);
        return stk_fail(err, STK_ENOMEM, "checkpoint: out of memory");
    }
    s->np = tensors(r, s->params, "", s->t);
    stk_tensor *t = s->t + s->np;
    for (int i = 0; i < s->nb; i++) {
        const stk_param *p = stk_model_buffer(m, i);
        t[i] = (stk_tensor){.dtype = STK_DT_F32, .ndim = p->ndim,
                            .count = p->count, .data = s->buffers + p->offset};
        snprintf(t[i].name, sizeof t[i].name, "%s", p->name);
        memcpy(t[i].shape, p->shape, sizeof p->shape);
    }
    t += s->nb;
    for (int i = 0; i < s->nc; i++) {
        t[i] = (stk_tensor){.dtype = STK_DT_I64, .ndim = 0, .count = 1,
                            .data = &s->counters[i]};
        snprintf(t[i].name, sizeof t[i].name, "%s", stk_model_counter_name(m, i));
    }
    s->n = s->np + s->nb + s->nc;
    return 0;
}

/* The model's state into s (host). */
static int state_from_model(run_state *r, model_state *s, stk_err *err)
{
    stk_model *m = r->model;
    size_t nbuf = stk_model_buffer_count(m);
    int rc = stk_copy_to_host(r->be, s->params, stk_model_weights(m),
                              stk_model_param_count(m) * sizeof(float), err);
    if (!rc && nbuf)
        rc = stk_copy_to_host(r->be, s->buffers, stk_model_buffers(m),
                              nbuf * sizeof(float), err);
    for (int i = 0; i < s->nc; i++)
        s->counters[i] = *stk_model_counter(m, i);
    return rc ? rc : stk_sync(r->be, err);
}

/* Writes the model's parameters, buffers and counters to path. */
static int save_model(run_state *r, const char *path, stk_err *err)
{
    model_state s;
    int rc = state_views(r, &s, err);
    if (rc)
        return rc;
    rc = state_from_model(r, &s, err);
    if (!rc)
        rc = stk_safetensors_write(path, s.t, s.n,
                                   "{\"format\":\"pt\",\"producer\":\"stoke\"}",
                                   err);
    state_free(&s);
    return rc;
}

/* Writes a small text file atomically: PATH.tmp (created anew, so that
 * nothing planted under that name, a FIFO say, is opened), fsync, rename. */
static int write_small(const char *path, const char *text, stk_err *err)
{
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    unlink(tmp);
    int fd =
        open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    size_t len = strlen(text);
    bool ok =
        fd >= 0 && write(fd, text, len) == (ssize_t)len && fsync(fd) == 0;
    int e = errno;
    if (fd >= 0 && close(fd) != 0 && ok)
        ok = false, e = errno;
    if (ok && rename(tmp, path) != 0)
        ok = false, e = errno;
    if (ok)
        return 0;
    unlink(tmp);
    return stk_fail(err, stk_from_errno(e), "%s: cannot write: %s", path,
                    strerror(e));
}

/* state.json's numbers are JSON numbers, read as doubles, exact to 2^53:
 * every count in it stays far below (a step is taken, not counted: 2^53
 * steps are centuries; a position is below STK_MAX_RECORDS, an epoch within
 * --epochs, a world within 2^20). The seed is any 64-bit number, so it is
 * written as a string of its decimal digits. */
static int write_state(run_state *r, const char *path, stk_err *err)
{
    const stk_train_opts *o = r->o;
    char seed[24];
    snprintf(seed, sizeof seed, "%llu", (unsigned long long)o->seed);
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "epoch", (double)r->pos_epoch);
    cJSON_AddNumberToObject(s, "step", (double)r->step);
    cJSON *pos = cJSON_AddObjectToObject(s, "loader");
    cJSON_AddNumberToObject(pos, "epoch", (double)r->pos_epoch);
    cJSON_AddNumberToObject(pos, "batch", (double)r->pos_batch);
    cJSON_AddNumberToObject(pos, "world", (double)r->rank.world);
    cJSON_AddStringToObject(s, "seed", seed);
    cJSON_AddNumberToObject(s, "best_acc", r->best_acc);
    cJSON_AddStringToObject(s, "optim", stk_optim_names[o->optim]);
    cJSON_AddStringToObject(s, "model", o->model);
    cJSON_AddNumberToObject(s, "batch", o->batch);
    cJSON_AddNumberToObject(s, "lr", o->lr);
    cJSON_AddNumberToObject(s, "epochs", o->epochs);
    cJSON_AddNumberToObject(s, "accum", o->accum);
    char config[GROUP_CONFIG_MAX];
    group_config_text(r, config, sizeof config);
    cJSON_AddStringToObject(s, "config", config);
    if (r->epoch_steps_known) {
        cJSON *es = cJSON_AddArrayToObject(s, "epoch_steps");
        for (uint64_t e = 0; e < r->pos_epoch; e++)
            cJSON_AddItemToArray(
                es, cJSON_CreateNumber((double)r->epoch_steps[e]));
    }
    char *text = cJSON_Print(s);
    cJSON_Delete(s);
    int rc = text ? write_small(path, text, err)
                  : stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    free(text);
    return rc;
}

/* Whether name in the checkpoints directory d is a checkpoint: a real
 * directory named step-N (lstat: a FIFO or a symbolic link by that name is
 * neither read by --resume auto nor emptied by pruning). */
static bool is_step_dir(DIR *d, const char *name)
{
    struct stat st;
    return !strncmp(name, "step-", 5) &&
           fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
           S_ISDIR(st.st_mode);
}

/* Removes step directories beyond the newest `keep`, sparing the best. */
static void prune(const char *dir, int keep, const char *best,
                  const char *just_written)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    char *names[4096];
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 4096)
        if (is_step_dir(d, de->d_name)) /* never through a link or FIFO */
            names[n++] = strdup(de->d_name);
    closedir(d);
    for (int i = 0; i < n; i++) /* names sort by step: zero-padded */
        for (int j = i + 1; j < n; j++)
            if (strcmp(names[i], names[j]) > 0) {
                char *t = names[i];
                names[i] = names[j];
                names[j] = t;
            }
    for (int i = 0; i < n; i++) {
        if (i < n - keep && strcmp(names[i], best) &&
            strcmp(names[i], just_written)) {
            char p[4096 + 300];
            snprintf(p, sizeof p, "%s/%s", dir, names[i]);
            stk_remove_flat_dir(p, NULL);
        }
        free(names[i]);
    }
}

/* The step directory RUN_DIR/checkpoints/BEST names ("" when there is no
 * BEST yet); anything there but a regular file is an error. */
static int read_best(const char *run, char *name, size_t n, stk_err *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/checkpoints/BEST", run);
    *name = '\0';
    stk_err e = {0};
    FILE *f = stk_fopen_regular(path, &e);
    if (!f) {
        if (e.code == STK_ENOENT)
            return 0;
        if (err)
            *err = e;
        return e.code;
    }
    if (fgets(name, (int)n, f))
        name[strcspn(name, "\n")] = '\0';
    fclose(f);
    return 0;
}

int stk_checkpoint_save(run_state *r, bool is_best, stk_err *err)
{
    char dir[4096], tmp[4096], path[4200], name[32];
    snprintf(name, sizeof name, "step-%08llu", (unsigned long long)r->step);
    snprintf(dir, sizeof dir, "%s/checkpoints/%s", r->o->out, name);
    snprintf(tmp, sizeof tmp, "%s/checkpoints/.%s.tmp", r->o->out, name);
    stk_remove_flat_dir(tmp, NULL);
    if (mkdir(tmp, 0775) != 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", tmp, strerror(errno));
    bool sgd = r->o->optim == STK_OPT_SGD;
    snprintf(path, sizeof path, "%s/model.safetensors", tmp);
    int rc = save_model(r, path, err);
    snprintf(path, sizeof path, "%s/optim.safetensors", tmp);
    if (!rc)
        rc = save_params(r, r->state1, sgd ? ".momentum_buffer" : ".exp_avg",
                         sgd ? NULL : r->state2, ".exp_avg_sq", path, err);
    snprintf(path, sizeof path, "%s/state.json", tmp);
    if (!rc)
        rc = write_state(r, path, err);
    if (!rc)
        rc = stk_fsync_dir(tmp, err);
    if (!rc) {
        stk_remove_flat_dir(dir, NULL); /* a rerun of the same step */
        if (rename(tmp, dir) != 0)
            rc = stk_fail(err, stk_from_errno(errno), "%s: %s", dir, strerror(errno));
    }
    snprintf(path, sizeof path, "%s/checkpoints", r->o->out);
    if (!rc)
        rc = stk_fsync_dir(path, err);
    if (!rc && is_best) {
        char best[4200], line[64];
        snprintf(best, sizeof best, "%s/best.safetensors", r->o->out);
        rc = save_model(r, best, err);
        snprintf(best, sizeof best, "%s/checkpoints/BEST", r->o->out);
        snprintf(line, sizeof line, "%s\n", name);
        if (!rc)
            rc = write_small(best, line, err);
    }
    if (rc) {
        stk_remove_flat_dir(tmp, NULL);
        return rc;
    }
    char best_name[64];
    if ((rc = read_best(r->o->out, best_name, sizeof best_name, err)))
        return rc; /* prune nothing while the best is unknown */
    snprintf(path, sizeof path, "%s/checkpoints", r->o->out);
    prune(path, r->o->keep > 0 ? r->o->keep : 1, best_name, name);
    return 0;
}

int stk_checkpoint_check_dir(run_state *r, stk_err *err)
{
    char best_name[64];
    return read_best(r->o->out, best_name, sizeof best_name, err);
}

/* ---- loading -------------------------------------------------------------- */

static int load_params(run_state *r, float *dev, const char *path,
                       const char *suffix, stk_err *err)
{
    size_t n = stk_model_param_count(r->model);
    float *host = malloc(n * sizeof *host);
    stk_tensor *t = malloc((size_t)stk_model_nparams(r->model) * sizeof *t);
    int rc = host && t ? 0
                       : stk_fail(err, STK_ENOMEM,
                                  "%s: out of memory for %zu floats", path, n);
    int nt = rc ? 0 : tensors(r, host, suffix, t);
    if (!rc)
        rc = stk_safetensors_read(path, t, nt, NULL, err);
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, host, n * sizeof *host, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    free(t);
    free(host);
    return rc;
}

/* Which of batchnorm's tensors path must hold. A checkpoint (strict) holds
 * them all, as it is written. An --init-from file holds the running
 * statistics of every batchnorm layer or of none (weights saved without
 * buffers: the statistics start at 0 and 1, as in a new model, which a
 * line says), never some of them (another model); num_batches_tracked
 * that it lacks is 0, as PyTorch loads a state dict from before the
 * counter existed. A negative count or variance is refused (either would
 * make every later evaluation meaningless without an error). */
static int check_bn_state(run_state *r, const char *path, const model_state *s,
                          bool strict, bool *with_buffers, stk_err *err)
{
    const stk_tensor *buf = s->t + s->np, *cnt = buf + s->nb;
    int found = 0;
    for (int i = 0; i < s->nb; i++)
        found += buf[i].found;
    *with_buffers = found > 0;
    for (int i = 0; i < s->nb; i++)
        if (!buf[i].found && (strict || found))
            return stk_fail(err, STK_EFORMAT,
                            "%s: no tensor \"%s\" (the file holds %d of the "
                            "model's %d batchnorm running statistics)",
                            path, buf[i].name, found, s->nb);
    for (int i = 0; i < s->nb; i++) {
        size_t len = strlen(buf[i].name), k = strlen(".running_var");
        bool var = len > k && !strcmp(buf[i].name + len - k, ".running_var");
        const float *v = buf[i].data; /* running statistics are F32 */
        for (size_t j = 0; var && buf[i].found && j < buf[i].count; j++)
            if (v[j] < 0)
                return stk_fail(err, STK_EFORMAT,
                                "%s: \"%s\" element %zu is %g, a variance "
                                "(>= 0)",
                                path, buf[i].name, j, (double)v[j]);
    }
    for (int i = 0; i < s->nc; i++) {
        if (!cnt[i].found && strict)
            return stk_fail(err, STK_EFORMAT, "%s: no tensor \"%s\"", path,
                            cnt[i].name);
        if (s->counters[i] < 0)
            return stk_fail(err, STK_EFORMAT,
                            "%s: \"%s\" is %lld, a count of batches (>= 0)",
                            path, cnt[i].name, (long long)s->counters[i]);
    }
    if (s->nb && !found && !r->o->quiet)
        fprintf(stderr,
                "train: %s holds no batchnorm running statistics: they start "
                "at 0 and 1, as in a new model\n",
                path);
    return 0;
}

/* Loads a model.safetensors (a checkpoint's: strict) or an --init-from
 * file into the model: parameters, buffers and counters. */
static int load_model(run_state *r, const char *path, bool strict, stk_err *err)
{
    model_state s;
    int rc = state_views(r, &s, err);
    if (rc)
        return rc;
    for (int i = s.np; i < s.n; i++)
        s.t[i].optional = true; /* check_bn_state says which must be there */
    rc = stk_safetensors_read_all(path, s.t, s.n, err);
    bool with_buffers = false;
    if (!rc)
        rc = check_bn_state(r, path, &s, strict, &with_buffers, err);
    stk_model *m = r->model;
    if (!rc)
        rc = stk_copy_to_dev(r->be, stk_model_weights(m), s.params,
                             stk_model_param_count(m) * sizeof(float), err);
    if (!rc && with_buffers)
        rc = stk_copy_to_dev(r->be, stk_model_buffers(m), s.buffers,
                             stk_model_buffer_count(m) * sizeof(float), err);
    for (int i = 0; !rc && i < s.nc; i++)
        *stk_model_counter(m, i) = s.counters[i]; /* 0 where not found */
    if (!rc)
        rc = stk_sync(r->be, err);
    state_free(&s);
    return rc;
}

int stk_checkpoint_load_weights(run_state *r, const char *path, stk_err *err)
{
    struct stat st;
    char file[4300];
    snprintf(file, sizeof file, "%s/model.safetensors", path);
    if (stat(path, &st) == 0 && S_ISDIR(st.st_mode))
        return stk_fail(err, STK_EINVAL,
                        "--init-from %s: a directory; %s", path,
                        access(file, F_OK) == 0
                            ? "a checkpoint's weights are its model.safetensors "
                              "(--resume continues it whole)"
                            : "expected a safetensors file of weights");
    int rc = load_model(r, path, false, err);
    if (rc && err) { /* which flag named the file */
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err->msg);
        stk_fail(err, rc, "--init-from: %s", msg);
    }
    return rc;
}

/* The newest complete checkpoint directory, or "" when there is none. */
static void newest(const char *run, char *out, size_t n)
{
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/checkpoints", run);
    DIR *d = opendir(dir);
    char best[300] = "";
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strcmp(de->d_name, best) > 0 && is_step_dir(d, de->d_name))
            snprintf(best, sizeof best, "%s", de->d_name);
    if (d)
        closedir(d);
    if (*best)
        snprintf(out, n, "%s/%s", dir, best);
    else
        *out = '\0';
}

/* The batch to resume at: the saved one, or, when the checkpoint was
 * written by another number of ranks, the batch where this world has
 * trained the same number of samples of the epoch (rounded down to a whole
 * step). */
static uint64_t resume_batch(run_state *r, uint64_t batch, uint64_t was)
{
    uint64_t now = (uint64_t)r->rank.world, accum = (uint64_t)r->o->accum;
    if (was == now) /* a step starts at a multiple of --accum, whatever the
                       checkpoint's run used */
        return batch / accum * accum;
    uint64_t at = batch * was / now / accum * accum;
    if (!r->o->quiet)
        fprintf(stderr,
                "train: the checkpoint was written by %llu rank(s), this run has "
                "%llu: resuming the epoch at batch %llu of each rank (sample %llu "
                "of the epoch instead of %llu)\n",
                (unsigned long long)was, (unsigned long long)now,
                (unsigned long long)at,
                (unsigned long long)(at * now * (uint64_t)r->o->batch),
                (unsigned long long)(batch * was * (uint64_t)r->o->batch));
    return at;
}

/* The whole number obj[key] of state.json, in lo..hi; a message names the
 * file, the field and (why) what bounds it. */
static int state_num(const char *path, const cJSON *obj, const char *key,
                     const char *field, double lo, double hi, const char *why,
                     uint64_t *out, stk_err *err)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v))
        return stk_fail(err, STK_EFORMAT, "%s: %s is missing or not a number",
                        path, field);
    double d = v->valuedouble;
    if (!(d >= lo && d <= hi) || d != floor(d))
        return stk_fail(
            err, STK_EFORMAT,
            "%s: %s is %.17g, expected a whole number %.0f..%.0f%s", path,
            field, d, lo, hi, why);
    *out = (uint64_t)d;
    return 0;
}

/* Whether state.json's seed is this run's: the decimal string written
 * now, or the number older checkpoints hold where it is exact (to 2^53:
 * a number above cannot tell neighbouring seeds apart). `found` says what
 * the file holds, for the message. */
static bool same_seed(const cJSON *v, uint64_t want, char *found, size_t size)
{
    char digits[24];
    snprintf(digits, sizeof digits, "%llu", (unsigned long long)want);
    if (cJSON_IsString(v)) {
        snprintf(found, size, "'%.40s'", v->valuestring);
        return !strcmp(v->valuestring, digits);
    }
    if (!cJSON_IsNumber(v)) {
        snprintf(found, size, "no seed");
        return false;
    }
    bool exact = v->valuedouble >= 0 && v->valuedouble <= 0x1p53;
    snprintf(found, size, "%.17g%s", v->valuedouble,
             exact ? "" : ", a number exact only to 2^53");
    return exact && v->valuedouble == (double)want;
}

/* What state.json says about the run so far, each field checked against
 * this run (its --batch, --seed, --optim, --epochs and the train split). */
typedef struct saved_state {
    uint64_t epoch, loader_epoch, batch, world, step, accum, size;
    double best_acc;
} saved_state;

/* A resume may change --lr and --accum (a rate for the rest of the run, a
 * batch split otherwise), but then it no longer ends as the uninterrupted
 * run would: a line says so, also under --quiet. */
static void note_changes(const run_state *r, const char *path, const cJSON *s,
                         const saved_state *v)
{
    const cJSON *lr = cJSON_GetObjectItemCaseSensitive(s, "lr");
    if (cJSON_IsNumber(lr) && (float)lr->valuedouble != r->o->lr)
        fprintf(stderr, "train: note: %s was written with --lr %g, this run "
                        "uses %g: it will not end as the uninterrupted run\n",
                path, lr->valuedouble, (double)r->o->lr);
    if (v->accum != (uint64_t)r->o->accum)
        fprintf(stderr, "train: note: %s was written with --accum %llu, this "
                        "run uses %d: it will not end as the uninterrupted "
                        "run\n",
                path, (unsigned long long)v->accum, r->o->accum);
}

/* The configuration's items that a resume may change without a refusal
 * or a note of their own, but that then make it end otherwise than the
 * uninterrupted run: not the model (its tensors are checked), the device,
 * the database's shape (a rank's share follows the rank count), --batch,
 * --seed and --optim (refused), --lr and --accum (noted above),
 * --max-steps, --bucket-mb, nor --epochs where the schedule does not
 * span the run. */
static bool changes_result(const char *item, size_t len,
                           const stk_train_opts *o)
{
    static const char *const same[] = {
        "model", "device", "database", "--batch", "--seed", "--optim",
        "--lr", "--accum", "--max-steps", "--bucket-mb"};
    for (size_t i = 0; i < sizeof same / sizeof *same; i++)
        if (strlen(same[i]) == len && !memcmp(item, same[i], len))
            return false;
    bool spans = o->sched != STK_SCHED_CONSTANT && o->sched != STK_SCHED_STEP;
    return spans || len != 8 || memcmp(item, "--epochs", 8);
}

/* The line of configuration text after the one at t. */
static const char *next_item(const char *t)
{
    size_t n = strcspn(t, "\n");
    return t + n + (t[n] != 0);
}

/* The value of field name[0, len) in configuration text, and its length. */
static const char *config_value(const char *text, const char *name,
                                size_t len, size_t *vlen)
{
    for (const char *t = text; *t; t = next_item(t))
        if (!strncmp(t, name, len) && t[len] == '=') {
            *vlen = strcspn(t + len + 1, "\n");
            return t + len + 1;
        }
    return NULL;
}

/* Another --model than the checkpoint's, whose layout differs from the
 * one state.json's configuration records (older checkpoints lack it),
 * refused naming both before any tensor. The same --model with another
 * layout (another crop or database) is left to the tensors' shapes,
 * which name the first that differs. */
static int check_model(const run_state *r, const char *path, const cJSON *s,
                       stk_err *err)
{
    const cJSON *config = cJSON_GetObjectItemCaseSensitive(s, "config");
    const cJSON *name = cJSON_GetObjectItemCaseSensitive(s, "model");
    size_t was_len, now_len;
    const char *was = cJSON_IsString(config)
                          ? config_value(config->valuestring, "model", 5,
                                         &was_len)
                          : NULL;
    char now[GROUP_CONFIG_MAX];
    group_config_text(r, now, sizeof now);
    const char *mine = config_value(now, "model", 5, &now_len);
    if (!was || !mine || !cJSON_IsString(name) ||
        !strcmp(name->valuestring, r->o->model) ||
        (was_len == now_len && !memcmp(was, mine, now_len)))
        return 0;
    return stk_fail(err, STK_EINVAL,
                    "%s: written with --model %s (%.*s), this run's --model "
                    "%s has %.*s: resume with the checkpoint's model",
                    path, name->valuestring, (int)was_len, was, r->o->model,
                    (int)now_len, mine);
}

/* A line for each item of state.json's configuration (older checkpoints
 * lack it) that this run changes and that changes the run's end. */
static void note_config(const run_state *r, const char *path, const char *was)
{
    char now[GROUP_CONFIG_MAX];
    group_config_text(r, now, sizeof now);
    for (const char *a = was; *a; a = next_item(a)) {
        size_t line = strcspn(a, "\n"), eq = strcspn(a, "="), vlen;
        if (eq >= line || !changes_result(a, eq, r->o))
            continue;
        const char *v = config_value(now, a, eq, &vlen);
        if (v && (vlen != line - eq - 1 || memcmp(v, a + eq + 1, vlen)))
            fprintf(stderr, "train: note: %s was written with %.*s %.*s, this "
                            "run uses %.*s: it will not end as the "
                            "uninterrupted run\n",
                    path, (int)eq, a, (int)(line - eq - 1), a + eq + 1,
                    (int)vlen, v);
    }
}

/* state.json's epoch_steps (older checkpoints lack it): one entry per
 * finished epoch, each 1..most, adding up with the steps of the current
 * epoch to step. Copied to r->epoch_steps for the checkpoints to come. */
static int check_epoch_steps(run_state *r, const char *path, const cJSON *s,
                             const saved_state *v, uint64_t most,
                             uint64_t in_epoch, stk_err *err)
{
    const cJSON *es = cJSON_GetObjectItemCaseSensitive(s, "epoch_steps");
    r->epoch_steps_known = es != NULL;
    if (!es)
        return 0;
    if (!cJSON_IsArray(es) || (uint64_t)cJSON_GetArraySize(es) != v->epoch)
        return stk_fail(
            err, STK_EFORMAT,
            "%s: epoch_steps is not a list of %llu entries (one per "
            "finished epoch)",
            path, (unsigned long long)v->epoch);
    uint64_t sum = in_epoch;
    char field[48];
    for (uint64_t e = 0; e < v->epoch; e++) {
        snprintf(field, sizeof field, "epoch_steps[%llu]",
                 (unsigned long long)e);
        const cJSON *item = cJSON_GetArrayItem(es, (int)e);
        if (!cJSON_IsNumber(item) || item->valuedouble < 1 ||
            item->valuedouble > (double)most ||
            item->valuedouble != floor(item->valuedouble))
            return stk_fail(
                err, STK_EFORMAT,
                "%s: %s is not a whole number 1..%llu (the steps an epoch "
                "can take)",
                path, field, (unsigned long long)most);
        r->epoch_steps[e] = (uint64_t)item->valuedouble;
        sum += r->epoch_steps[e];
    }
    if (sum != v->step)
        return stk_fail(
            err, STK_EFORMAT,
            "%s: step is %llu, but epoch_steps and loader.batch add up to "
            "%llu",
            path, (unsigned long long)v->step, (unsigned long long)sum);
    return 0;
}

static int check_state(run_state *r, const char *path, const cJSON *s,
                       saved_state *v, stk_err *err)
{
    const stk_train_opts *o = r->o;
    const stk_meta *m = stk_store_meta(r->store);
    uint64_t n = m->splits[stk_meta_split(m, "train")].count,
             b = (uint64_t)o->batch;
    const cJSON *pos = cJSON_GetObjectItemCaseSensitive(s, "loader");
    const cJSON *opt = cJSON_GetObjectItemCaseSensitive(s, "optim");
    const cJSON *seed = cJSON_GetObjectItemCaseSensitive(s, "seed");
    const cJSON *best = cJSON_GetObjectItemCaseSensitive(s, "best_acc");
    const char *want = stk_optim_names[o->optim];
    char why[96], found[96];
    *v = (saved_state){.world = 1, .accum = 1};
    if (!cJSON_IsObject(s))
        return stk_fail(err, STK_EFORMAT, "%s: not a JSON object", path);
    if (!cJSON_IsString(opt) || strcmp(opt->valuestring, want))
        return stk_fail(
            err, STK_EINVAL, "%s: written with --optim %s, this run uses %s",
            path, cJSON_IsString(opt) ? opt->valuestring : "(none)", want);
    int rc = check_model(r, path, s, err);
    if (!rc)
        rc = state_num(path, s, "batch", "batch", (double)b, (double)b,
                       " (this run's --batch: the position counts its "
                       "batches)",
                       &v->size, err);
    if (!rc && !same_seed(seed, o->seed, found, sizeof found))
        rc = stk_fail(
            err, STK_EINVAL,
            "%s: seed is not this run's --seed %llu (it holds %s; the data "
            "order and dropout derive from it: resume with the same --seed)",
            path, (unsigned long long)o->seed, found);
    snprintf(why, sizeof why, " (this run's --epochs %d)", o->epochs);
    if (!rc)
        rc = state_num(path, s, "epoch", "epoch", 0, o->epochs, why, &v->epoch,
                       err);
    if (!rc)
        rc = state_num(path, pos, "epoch", "loader.epoch", (double)v->epoch,
                       (double)v->epoch, " (the same as epoch)",
                       &v->loader_epoch, err);
    if (!rc)
        rc = state_num(path, pos, "world", "loader.world", 1, 1 << 20, "",
                       &v->world, err);
    /* a position within the epoch, as that many ranks split it; a finished
     * run's is the start of the epoch after its last */
    uint64_t batches = rc ? 0 : ((n + v->world - 1) / v->world + b - 1) / b;
    bool done = v->epoch == (uint64_t)o->epochs;
    snprintf(why, sizeof why, " (%s)",
             done ? "all epochs are done"
                  : "the batches of an epoch for loader.world ranks");
    if (!rc)
        rc = state_num(path, pos, "batch", "loader.batch", 0,
                       done ? 0 : (double)batches - 1, why, &v->batch, err);
    v->accum = (uint64_t)o->accum; /* older checkpoints do not record it */
    if (!rc && cJSON_GetObjectItemCaseSensitive(s, "accum"))
        rc = state_num(path, s, "accum", "accum", 1, 1 << 16, "", &v->accum,
                       err);
    /* every finished epoch took at least one step and at most one per
     * batch of a single rank; this one as many as its position says */
    uint64_t in_epoch = (v->batch + v->accum - 1) / v->accum,
             most = (n + b - 1) / b;
    if (!rc)
        rc = state_num(path, s, "step", "step", (double)(v->epoch + in_epoch),
                       (double)v->epoch * (double)most + (double)in_epoch,
                       " (the steps that epoch and loader.batch allow)",
                       &v->step, err);
    if (!rc)
        rc = check_epoch_steps(r, path, s, v, most, in_epoch, err);
    const cJSON *config = cJSON_GetObjectItemCaseSensitive(s, "config");
    if (!rc)
        note_changes(r, path, s, v);
    if (!rc && cJSON_IsString(config))
        note_config(r, path, config->valuestring);
    v->best_acc = cJSON_IsNumber(best) ? best->valuedouble : 0;
    if (!rc && best &&
        !(cJSON_IsNumber(best) && v->best_acc >= 0 && v->best_acc <= 1))
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: best_acc is not an accuracy in [0, 1]", path);
    return rc;
}

static int read_state(run_state *r, const char *dir, stk_err *err)
{
    char path[4300]; /* dir is at most 4200 */
    snprintf(path, sizeof path, "%s/state.json", dir);
    uint8_t *text;
    size_t len;
    int rc = stk_read_file(path, &text, &len, err);
    if (rc)
        return rc;
    cJSON *s = cJSON_ParseWithLength((const char *)text, len);
    free(text);
    saved_state v;
    rc = check_state(r, path, s, &v, err);
    if (!rc) {
        r->epoch = (int)v.epoch;
        r->step = v.step;
        r->epoch_first_step = v.step - (v.batch + v.accum - 1) / v.accum;
        r->start_batch = resume_batch(r, v.batch, v.world);
        r->best_acc = v.best_acc;
    }
    cJSON_Delete(s);
    return rc;
}

/* Whether checkpoint directory dir lies in ckdir, by device and inode
 * however either is spelt. */
static bool lies_in(const char *dir, const char *ckdir)
{
    char parent[4200];
    snprintf(parent, sizeof parent, "%s", dir);
    size_t n = strlen(parent);
    while (n > 1 && parent[n - 1] == '/')
        parent[--n] = '\0';
    char *slash = strrchr(parent, '/');
    if (!slash)
        snprintf(parent, sizeof parent, ".");
    else
        slash[slash == parent] = '\0'; /* "/step-1": the root */
    struct stat a, b;
    return stat(parent, &a) == 0 && stat(ckdir, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* --resume PATH continues PATH's run in --out, whose checkpoints must be
 * that run's up to PATH: a newer one there (the run rewound to PATH) or
 * any at all where PATH lies elsewhere (!here: another run) would be taken
 * by --resume auto, BEST and the pruning of --keep for this run's own. */
static int check_line(const run_state *r, const char *dir, bool here,
                      stk_err *err)
{
    char last[4300];
    newest(r->o->out, last, sizeof last);
    if (!*last)
        return 0;
    const char *name = strrchr(last, '/') + 1;
    if (!here)
        return stk_fail(err, STK_EEXIST,
                        "--resume %s: --out %s holds the checkpoints of "
                        "another run (the newest %s), which this one would "
                        "mix with its own: choose another --out",
                        dir, r->o->out, name);
    if (strtoull(name + 5, NULL, 10) > r->step)
        return stk_fail(err, STK_EEXIST,
                        "--resume %s rewinds to step %llu, and --out %s holds "
                        "the newer checkpoints of the run it leaves (up to "
                        "%s), which --resume auto and --keep would take for "
                        "this run's: choose another --out, or move them away",
                        dir, (unsigned long long)r->step, r->o->out, name);
    return 0;
}

int stk_checkpoint_resume(run_state *r, const char *which, stk_err *err)
{
    char dir[4200], path[4300];
    bool latest = !strcmp(which, "auto"), here = latest;
    if (latest) {
        newest(r->o->out, dir, sizeof dir);
        if (!*dir)
            return 0; /* nothing to resume: a fresh run */
    } else {
        snprintf(dir, sizeof dir, "%s", which);
        snprintf(path, sizeof path, "%s/checkpoints", r->o->out);
        here = lies_in(dir, path);
    }
    bool sgd = r->o->optim == STK_OPT_SGD;
    int rc = read_state(r, dir, err);
    if (!rc && !latest)
        rc = check_line(r, dir, here, err);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!rc)
        rc = load_model(r, path, true, err);
    snprintf(path, sizeof path, "%s/optim.safetensors", dir);
    if (!rc)
        rc = load_params(r, r->state1, path, sgd ? ".momentum_buffer" : ".exp_avg", err);
    if (!rc && !sgd)
        rc = load_params(r, r->state2, path, ".exp_avg_sq", err);
    if (!rc && !r->o->quiet)
        fprintf(stderr, "train: resumed from %s (epoch %d, step %llu)\n", dir,
                r->epoch + 1, (unsigned long long)r->step);
    r->resumed_here = !rc && here;
    return rc;
}
