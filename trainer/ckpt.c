/* ckpt.c - checkpoints of a run: RUN_DIR/checkpoints/step-NNNNNNNN/ holds
 * model.safetensors (PyTorch names), optim.safetensors (momentum buffers,
 * or AdamW's exp_avg and exp_avg_sq, named after torch.optim's state) and
 * state.json (epoch,
 * step, loader position, seed, best accuracy, configuration). A checkpoint
 * appears complete or not at all: it is written to a hidden directory,
 * synced and renamed. */
#include "checkpoint.h"
#include "train_impl.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define MAX_TENSORS (2 * STK_MAX_LAYERS)

/* Views of the model's (host copy of its) parameters, with a suffix. */
static int tensors(run_state *r, float *host, const char *suffix,
                   stk_tensor *t)
{
    int n = stk_model_nparams(r->model);
    for (int i = 0; i < n; i++) {
        const stk_param *p = stk_model_param(r->model, i);
        snprintf(t[i].name, sizeof t[i].name, "%s%s", p->name, suffix);
        t[i].ndim = p->ndim;
        memcpy(t[i].shape, p->shape, sizeof p->shape);
        t[i].count = p->count;
        t[i].data = host + p->offset;
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
 * the tensors NAME+suffix (and NAME+suffix2) of one file. */
static int save_params(run_state *r, const float *dev, const char *suffix,
                       const float *dev2, const char *suffix2,
                       const char *path, stk_err *err)
{
    size_t np = stk_model_param_count(r->model);
    float *host = malloc(np * (dev2 ? 2 : 1) * sizeof *host);
    stk_tensor t[2 * MAX_TENSORS];
    if (!host)
        return stk_fail(err, STK_ENOMEM, "checkpoint: out of memory");
    int rc = dev_to_host(r, dev, host, err);
    int n = tensors(r, host, suffix, t);
    if (!rc && dev2) {
        rc = dev_to_host(r, dev2, host + np, err);
        n += tensors(r, host + np, suffix2, t + n);
    }
    if (!rc)
        rc = stk_safetensors_write(path, t, n,
                                   "{\"format\":\"pt\",\"producer\":\"stoke\"}",
                                   err);
    free(host);
    return rc;
}

static int write_state(run_state *r, const char *path, stk_err *err)
{
    const stk_train_opts *o = r->o;
    cJSON *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(s, "epoch", (double)r->pos_epoch);
    cJSON_AddNumberToObject(s, "step", (double)r->step);
    cJSON *pos = cJSON_AddObjectToObject(s, "loader");
    cJSON_AddNumberToObject(pos, "epoch", (double)r->pos_epoch);
    cJSON_AddNumberToObject(pos, "batch", (double)r->pos_batch);
    cJSON_AddNumberToObject(pos, "world", (double)r->rank.world);
    cJSON_AddNumberToObject(s, "seed", (double)o->seed);
    cJSON_AddNumberToObject(s, "best_acc", r->best_acc);
    cJSON_AddStringToObject(s, "optim", o->optim == STK_OPT_SGD ? "sgd" : "adamw");
    cJSON_AddStringToObject(s, "model", o->model);
    cJSON_AddNumberToObject(s, "batch", o->batch);
    cJSON_AddNumberToObject(s, "lr", o->lr);
    cJSON_AddNumberToObject(s, "epochs", o->epochs);
    char *text = cJSON_Print(s);
    cJSON_Delete(s);
    FILE *f = fopen(path, "w");
    int ok = f && text && fputs(text, f) >= 0 && fflush(f) == 0 &&
             fsync(fileno(f)) == 0;
    if (f && fclose(f) != 0)
        ok = 0;
    free(text);
    return ok ? 0 : stk_fail(err, STK_EIO, "%s: cannot write: %s", path, strerror(errno));
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
        if (!strncmp(de->d_name, "step-", 5))
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
    int rc = save_params(r, stk_model_weights(r->model), "", NULL, NULL, path, err);
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
        char best[4200];
        snprintf(best, sizeof best, "%s/best.safetensors", r->o->out);
        rc = save_params(r, stk_model_weights(r->model), "", NULL, NULL, best, err);
        char tmpb[4300];
        snprintf(best, sizeof best, "%s/checkpoints/BEST", r->o->out);
        snprintf(tmpb, sizeof tmpb, "%s.tmp", best);
        FILE *f = rc ? NULL : fopen(tmpb, "w");
        if (!rc && (!f || fprintf(f, "%s\n", name) < 0 || fflush(f) ||
                    fsync(fileno(f)) || fclose(f) || (f = NULL, rename(tmpb, best))))
            rc = stk_fail(err, STK_EIO, "%s: cannot write: %s", best, strerror(errno));
        if (f)
            fclose(f);
    }
    if (rc) {
        stk_remove_flat_dir(tmp, NULL);
        return rc;
    }
    char best_name[64] = "";
    snprintf(path, sizeof path, "%s/checkpoints/BEST", r->o->out);
    FILE *f = fopen(path, "r");
    if (f && fgets(best_name, sizeof best_name, f))
        best_name[strcspn(best_name, "\n")] = '\0';
    if (f)
        fclose(f);
    snprintf(path, sizeof path, "%s/checkpoints", r->o->out);
    prune(path, r->o->keep > 0 ? r->o->keep : 1, best_name, name);
    return 0;
}

/* ---- loading -------------------------------------------------------------- */

static int load_params(run_state *r, float *dev, const char *path,
                       const char *suffix, stk_err *err)
{
    size_t n = stk_model_param_count(r->model);
    float *host = malloc(n * sizeof *host);
    if (!host)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    stk_tensor t[MAX_TENSORS];
    int nt = tensors(r, host, suffix, t);
    int rc = stk_safetensors_read(path, t, nt, NULL, err);
    if (!rc)
        rc = stk_copy_to_dev(r->be, dev, host, n * sizeof *host, err);
    if (!rc)
        rc = stk_sync(r->be, err);
    free(host);
    return rc;
}

int stk_checkpoint_load_weights(run_state *r, const char *path, stk_err *err)
{
    return load_params(r, stk_model_weights(r->model), path, "", err);
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
        if (!strncmp(de->d_name, "step-", 5) && strcmp(de->d_name, best) > 0)
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
static uint64_t resume_batch(run_state *r, uint64_t batch, const cJSON *world)
{
    uint64_t was = cJSON_IsNumber(world) && world->valuedouble >= 1
                       ? (uint64_t)world->valuedouble
                       : 1;
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

static int read_state(run_state *r, const char *dir, stk_err *err)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/state.json", dir);
    uint8_t *text;
    size_t len;
    int rc = stk_read_file(path, &text, &len, err);
    if (rc)
        return rc;
    cJSON *s = cJSON_ParseWithLength((const char *)text, len);
    free(text);
    const cJSON *ep = cJSON_GetObjectItemCaseSensitive(s, "epoch");
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(s, "step");
    const cJSON *opt = cJSON_GetObjectItemCaseSensitive(s, "optim");
    const cJSON *pos = cJSON_GetObjectItemCaseSensitive(s, "loader");
    const cJSON *pb = cJSON_GetObjectItemCaseSensitive(pos, "batch");
    const char *want = r->o->optim == STK_OPT_SGD ? "sgd" : "adamw";
    if (!cJSON_IsNumber(ep) || !cJSON_IsNumber(st) || !cJSON_IsString(opt) ||
        !cJSON_IsNumber(pb))
        rc = stk_fail(err, STK_EFORMAT, "%s: missing epoch, step, optim or loader", path);
    else if (strcmp(opt->valuestring, want))
        rc = stk_fail(err, STK_EINVAL, "%s: written with --optim %s, this run uses %s",
                      path, opt->valuestring, want);
    const cJSON *pe = cJSON_GetObjectItemCaseSensitive(pos, "epoch");
    if (!rc && (!cJSON_IsNumber(pe) || pe->valuedouble < 0 || st->valuedouble < 0 ||
                pb->valuedouble < 0))
        rc = stk_fail(err, STK_EFORMAT, "%s: negative or missing loader position", path);
    if (!rc) {
        r->epoch = pe->valueint;
        r->step = (uint64_t)st->valuedouble;
        r->start_batch = resume_batch(r, (uint64_t)pb->valuedouble,
                                      cJSON_GetObjectItemCaseSensitive(pos, "world"));
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(s, "best_acc");
        r->best_acc = cJSON_IsNumber(b) ? b->valuedouble : 0;
    }
    cJSON_Delete(s);
    return rc;
}

int stk_checkpoint_resume(run_state *r, const char *which, stk_err *err)
{
    char dir[4200], path[4300];
    if (!strcmp(which, "auto")) {
        newest(r->o->out, dir, sizeof dir);
        if (!*dir)
            return 0; /* nothing to resume: a fresh run */
    } else {
        snprintf(dir, sizeof dir, "%s", which);
    }
    bool sgd = r->o->optim == STK_OPT_SGD;
    int rc = read_state(r, dir, err);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    if (!rc)
        rc = load_params(r, stk_model_weights(r->model), path, "", err);
    snprintf(path, sizeof path, "%s/optim.safetensors", dir);
    if (!rc)
        rc = load_params(r, r->state1, path, sgd ? ".momentum_buffer" : ".exp_avg", err);
    if (!rc && !sgd)
        rc = load_params(r, r->state2, path, ".exp_avg_sq", err);
    if (!rc && !r->o->quiet)
        fprintf(stderr, "train: resumed from %s (epoch %d, step %llu)\n", dir,
                r->epoch + 1, (unsigned long long)r->step);
    return rc;
}
