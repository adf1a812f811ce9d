/* cifar.c - CIFAR-10 (data_batch_N.bin, test_batch.bin: 1 label byte +
 * 3072 CHW pixels) and CIFAR-100 (train.bin, test.bin: coarse and fine label
 * bytes + 3072 pixels; the fine label is used) binary batches. */
#include "source_impl.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SIDE 32
#define PIXELS (3 * SIDE * SIDE)
#define TRAIN_BATCHES 5 /* CIFAR-10's data_batch_1.bin .. data_batch_5.bin */

typedef struct cifar_file {
    uint8_t *data;
    uint64_t first, count; /* sample range within the split */
} cifar_file;

typedef struct cifar_data {
    int label_bytes;       /* 1 (CIFAR-10) or 2 (CIFAR-100) */
    int nfiles[2];
    cifar_file file[2][TRAIN_BATCHES];
} cifar_data;

static int exists(const char *dir, const char *name)
{
    char p[4096];
    return !stk_path_join(p, sizeof p, dir, name) && access(p, F_OK) == 0;
}

int stk_cifar_probe(const char *dir)
{
    return exists(dir, "data_batch_1.bin") || exists(dir, "test_batch.bin") ||
           (exists(dir, "train.bin") && exists(dir, "test.bin")) ||
           exists(dir, "cifar-10-batches-bin") ||
           exists(dir, "cifar-100-binary");
}

/* Moves dir into the extracted archive's folder when given its parent. */
static void descend(stk_source *s)
{
    static const char *const subs[] = {"cifar-10-batches-bin",
                                       "cifar-100-binary"};
    for (int i = 0; i < 2; i++)
        if (!exists(s->dir, "test_batch.bin") && !exists(s->dir, "test.bin") &&
            exists(s->dir, subs[i])) {
            char *p;
            if (asprintf(&p, "%s/%s", s->dir, subs[i]) >= 0) {
                free(s->dir);
                s->dir = p;
            }
        }
}

/* Reads the batch file name into split k; a missing one is an error that
 * names it and says which files the dataset has (why). */
static int add_file(stk_source *s, cifar_data *x, int k, const char *name,
                    const char *why, stk_err *err)
{
    char path[4096];
    if (stk_path_join(path, sizeof path, s->dir, name))
        return stk_fail(err, STK_ERANGE, "%s: path too long", s->dir);
    if (access(path, F_OK) != 0 && errno == ENOENT)
        return stk_fail(err, STK_ENOENT, "%s: missing (%s)", path, why);
    uint8_t *data;
    size_t len;
    int rc = stk_read_file(path, &data, &len, err);
    if (rc)
        return rc;
    size_t rec = (size_t)x->label_bytes + PIXELS;
    if (len == 0 || len % rec) {
        free(data);
        return stk_fail(err, STK_EFORMAT,
                        "%s: %zu bytes is not a whole number of %zu-byte "
                        "CIFAR records (truncated?)",
                        path, len, rec);
    }
    cifar_file *f = &x->file[k][x->nfiles[k]++];
    f->data = data;
    f->first = s->split_count[s->nsplits];
    f->count = len / rec;
    s->split_count[s->nsplits] += f->count;
    return 0;
}

/* The train split is required whole: every one of its batch files, so that
 * a file missing from a download or a copy is an error, not a smaller
 * split. The test split is optional. */
static int open_files(stk_source *s, cifar_data *x, stk_err *err)
{
    const char *has =
        x->label_bytes == 2
            ? "CIFAR-100 has train.bin and test.bin"
            : "CIFAR-10 has data_batch_1.bin .. data_batch_5.bin";
    int rc = 0;
    snprintf(s->split_name[0], 32, "train");
    if (x->label_bytes == 2) {
        rc = add_file(s, x, 0, "train.bin", has, err);
    } else {
        for (int b = 1; !rc && b <= TRAIN_BATCHES; b++) {
            char name[64];
            snprintf(name, sizeof name, "data_batch_%d.bin", b);
            rc = add_file(s, x, 0, name, has, err);
        }
    }
    if (rc)
        return rc;
    s->nsplits++;
    const char *test = x->label_bytes == 2 ? "test.bin" : "test_batch.bin";
    if (exists(s->dir, test)) {
        snprintf(s->split_name[s->nsplits], 32, "test");
        rc = add_file(s, x, 1, test, has, err);
        s->nsplits++;
    }
    return rc;
}

static int max_label(const cifar_data *x)
{
    int top = 0;
    size_t rec = (size_t)x->label_bytes + PIXELS;
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < x->nfiles[k]; f++)
            for (uint64_t i = 0; i < x->file[k][f].count; i++) {
                int l = x->file[k][f].data[i * rec + x->label_bytes - 1];
                top = l > top ? l : top;
            }
    return top;
}

#define MAX_NAME 255 /* bytes of a class name */

/* Reads the class names file (one a line, blank lines skipped) when there
 * is one; a label is one byte, so at most 256 names. */
static int read_names(stk_source *s, const char *path, stk_err *err)
{
    stk_err e = {0};
    FILE *f = stk_fopen_regular(path, &e);
    if (!f) /* no names file: numbers; anything else is reported */
        return e.code == STK_ENOENT ? 0 : stk_fail(err, e.code, "%s", e.msg);
    char line[MAX_NAME + 2];
    int rc = 0, n = 0;
    while (!rc && fgets(line, sizeof line, f)) {
        n++;
        size_t len = strcspn(line, "\r\n");
        line[len] = '\0';
        if (len > MAX_NAME)
            rc = stk_fail(err, STK_EFORMAT,
                          "%s: line %d is longer than %d bytes", path, n,
                          MAX_NAME);
        else if (!len)
            continue;
        else if (s->nclasses == 256)
            rc = stk_fail(err, STK_EFORMAT,
                          "%s: more than 256 class names (a label is one "
                          "byte)",
                          path);
        else if (stk_source_add_class(s, line))
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    }
    if (!rc && ferror(f))
        rc = stk_fail(err, STK_EIO, "%s: read failed", path);
    fclose(f);
    return rc;
}

/* Class names from batches.meta.txt / fine_label_names.txt, else numbers. */
static int add_classes(stk_source *s, const cifar_data *x, stk_err *err)
{
    int top = max_label(x);
    char path[4096];
    if (stk_path_join(path, sizeof path, s->dir,
                      x->label_bytes == 2 ? "fine_label_names.txt"
                                          : "batches.meta.txt"))
        return stk_fail(err, STK_ERANGE, "%s: path too long", s->dir);
    int rc = read_names(s, path, err);
    if (rc)
        return rc;
    if (s->nclasses && s->nclasses <= top)
        return stk_fail(err, STK_EFORMAT,
                        "%s names %d classes but a record has label %d", path,
                        s->nclasses, top);
    for (int c = s->nclasses; c <= top; c++) {
        char num[12];
        snprintf(num, sizeof num, "%d", c);
        if (stk_source_add_class(s, num))
            return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    }
    return 0;
}

static int cifar_load(const stk_source *s, stk_decoder *d, int split,
                      uint64_t i, int32_t *label, stk_image *im, int *owned,
                      stk_err *err)
{
    (void)d;
    const cifar_data *x = s->impl;
    int k = strcmp(s->split_name[split], "train") ? 1 : 0;
    const cifar_file *f = x->file[k];
    while (i >= f->first + f->count)
        f++;
    const uint8_t *rec =
        f->data + (i - f->first) * ((size_t)x->label_bytes + PIXELS);
    *label = rec[x->label_bytes - 1];
    const uint8_t *chw = rec + x->label_bytes;
    if (!(im->px = malloc(PIXELS)))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    for (int p = 0; p < SIDE * SIDE; p++)
        for (int c = 0; c < 3; c++)
            im->px[3 * p + c] = chw[c * SIDE * SIDE + p];
    im->w = im->h = SIDE;
    im->c = 3;
    *owned = 1;
    return 0;
}

static void cifar_free(stk_source *s)
{
    cifar_data *x = s->impl;
    if (!x)
        return;
    for (int k = 0; k < 2; k++)
        for (int f = 0; f < x->nfiles[k]; f++)
            free(x->file[k][f].data);
    free(x);
}

static const source_ops cifar_ops = {cifar_load, cifar_free, NULL, NULL};

int stk_cifar_open(stk_source *s, stk_err *err)
{
    s->ops = &cifar_ops;
    s->format = "cifar";
    cifar_data *x = calloc(1, sizeof *x);
    if (!(s->impl = x))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    descend(s);
    x->label_bytes = exists(s->dir, "train.bin") || exists(s->dir, "test.bin")
                         ? 2
                         : 1;
    s->native_w = s->native_h = SIDE;
    if (!s->out_c)
        s->out_c = 3;
    int rc = open_files(s, x, err);
    return rc ? rc : add_classes(s, x, err);
}
