/* folder.c - image folders, as torchvision's ImageFolder reads them:
 *   RAW/<split>/<class>/... images (png, jpg, jpeg) when RAW/train holds folders
 *   RAW/<class>/... images                     otherwise (one split, "train")
 * Classes are the sorted union of class folder names over all splits; files
 * are sorted by path. Each sample is read and decoded by a worker. */
#include "source_impl.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#define DEFAULT_SIZE 64

typedef struct strvec {
    char **v;
    size_t n, cap;
} strvec;

typedef struct item {
    char *path;
    int32_t label;
} item;

typedef struct folder_data {
    item *items[SRC_MAX_SPLITS];
} folder_data;

static int push(strvec *sv, char *s)
{
    if (!s)
        return STK_ENOMEM;
    if (sv->n == sv->cap) {
        size_t cap = sv->cap ? sv->cap * 2 : 64;
        char **v = realloc(sv->v, cap * sizeof *v);
        if (!v) {
            free(s);
            return STK_ENOMEM;
        }
        sv->v = v;
        sv->cap = cap;
    }
    sv->v[sv->n++] = s;
    return 0;
}

static void strvec_free(strvec *sv)
{
    for (size_t i = 0; i < sv->n; i++)
        free(sv->v[i]);
    free(sv->v);
    memset(sv, 0, sizeof *sv);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static int is_dir(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static int is_image(const char *name)
{
    const char *dot = strrchr(name, '.');
    return dot && (!strcasecmp(dot, ".png") || !strcasecmp(dot, ".jpg") ||
                   !strcasecmp(dot, ".jpeg"));
}

/* Lists the entries of dir (no hidden ones): folders into dirs (names),
 * images into files (full paths); either may be NULL. */
static int list_dir(const char *dir, strvec *dirs, strvec *files,
                    stk_err *err)
{
    DIR *d = opendir(dir);
    if (!d)
        return stk_fail(err, stk_from_errno(errno),
                        "%s: cannot read directory: %s", dir, strerror(errno));
    struct dirent *de;
    int rc = 0;
    errno = 0;
    while (!rc && (de = readdir(d))) {
        if (de->d_name[0] == '.')
            continue;
        char *full;
        if (asprintf(&full, "%s/%s", dir, de->d_name) < 0) {
            rc = STK_ENOMEM;
            break;
        }
        if (is_dir(full)) {
            rc = dirs ? push(dirs, strdup(de->d_name)) : 0;
            free(full);
        } else if (files && is_image(de->d_name)) {
            rc = push(files, full);
        } else {
            free(full);
        }
    }
    if (!rc && errno)
        rc = stk_fail(err, STK_EIO, "%s: cannot read directory: %s", dir,
                      strerror(errno));
    else if (rc == STK_ENOMEM)
        rc = stk_fail(err, rc, "%s: out of memory", dir);
    closedir(d);
    if (dirs && dirs->n)
        qsort(dirs->v, dirs->n, sizeof *dirs->v, cmp_str);
    return rc;
}

/* Collects every image below dir, recursively. */
static int walk(const char *dir, strvec *files, stk_err *err)
{
    strvec sub = {0};
    int rc = list_dir(dir, &sub, files, err);
    for (size_t i = 0; !rc && i < sub.n; i++) {
        char *p;
        if (asprintf(&p, "%s/%s", dir, sub.v[i]) < 0)
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
        else {
            rc = walk(p, files, err);
            free(p);
        }
    }
    strvec_free(&sub);
    return rc;
}

static int class_index(const stk_source *s, const char *name)
{
    for (int c = 0; c < s->nclasses; c++)
        if (!strcmp(s->classes[c], name))
            return c;
    return -1;
}

/* Lists split folder root/<class>/... into the split's items. */
static int index_split(stk_source *s, folder_data *x, int k, const char *root,
                       stk_err *err)
{
    strvec classes = {0}, files = {0};
    int rc = list_dir(root, &classes, NULL, err);
    size_t cap = 0, n = 0;
    for (size_t c = 0; !rc && c < classes.n; c++) {
        char *cdir;
        if (asprintf(&cdir, "%s/%s", root, classes.v[c]) < 0) {
            rc = stk_fail(err, STK_ENOMEM, "out of memory");
            break;
        }
        files.n = 0;
        rc = walk(cdir, &files, err);
        free(cdir);
        qsort(files.v, files.n, sizeof *files.v, cmp_str);
        if (!rc && n + files.n > cap) {
            cap = (n + files.n) * 2;
            item *it = realloc(x->items[k], cap * sizeof *it);
            if (!it)
                rc = stk_fail(err, STK_ENOMEM, "out of memory");
            else
                x->items[k] = it;
        }
        for (size_t f = 0; !rc && f < files.n; f++) {
            x->items[k][n].path = files.v[f];
            x->items[k][n++].label = class_index(s, classes.v[c]);
            files.v[f] = NULL;
        }
        for (size_t f = 0; f < files.n; f++)
            free(files.v[f]);
    }
    free(files.v);
    strvec_free(&classes);
    s->split_count[k] = n;
    if (!rc && !n)
        rc = stk_fail(err, STK_ENOENT,
                      "%s: no .png/.jpg/.jpeg files in class folders", root);
    return rc;
}

/* Splits: "train" first, then the other folders in name order. */
static int find_splits(stk_source *s, strvec *top, int *layout_split)
{
    char p[4096];
    *layout_split = 0;
    for (size_t i = 0; i < top->n; i++)
        if (!strcmp(top->v[i], "train")) {
            strvec inner = {0};
            snprintf(p, sizeof p, "%s/train", s->dir);
            if (list_dir(p, &inner, NULL, NULL) == 0 && inner.n)
                *layout_split = 1;
            strvec_free(&inner);
        }
    if (!*layout_split) {
        snprintf(s->split_name[0], 32, "train");
        s->nsplits = 1;
        return 0;
    }
    snprintf(s->split_name[s->nsplits++], 32, "train");
    for (size_t i = 0; i < top->n; i++) {
        if (!strcmp(top->v[i], "train"))
            continue;
        if (s->nsplits == SRC_MAX_SPLITS || strlen(top->v[i]) >= 32)
            return STK_EINVAL;
        snprintf(s->split_name[s->nsplits++], 32, "%s", top->v[i]);
    }
    return 0;
}

/* Union of class folder names over the splits, sorted. */
static int collect_classes(stk_source *s, int layout_split, stk_err *err)
{
    strvec all = {0};
    int rc = 0;
    for (int k = 0; !rc && k < s->nsplits; k++) {
        char root[4096];
        snprintf(root, sizeof root, "%s%s%s", s->dir, layout_split ? "/" : "",
                 layout_split ? s->split_name[k] : "");
        rc = list_dir(root, &all, NULL, err);
    }
    if (!rc && all.n)
        qsort(all.v, all.n, sizeof *all.v, cmp_str);
    for (size_t i = 0; !rc && i < all.n; i++)
        if (i == 0 || strcmp(all.v[i], all.v[i - 1]))
            if (stk_source_add_class(s, all.v[i]))
                rc = stk_fail(err, STK_ENOMEM, "out of memory");
    strvec_free(&all);
    if (!rc && !s->nclasses)
        rc = stk_fail(err, STK_ENOENT,
                      "%s: no class folders (expected RAW/<class>/*.png or "
                      "RAW/<split>/<class>/*.jpg)",
                      s->dir);
    return rc;
}

static int folder_load(const stk_source *s, stk_decoder *d, int split,
                       uint64_t i, int32_t *label, stk_image *im, int *owned,
                       stk_err *err)
{
    const folder_data *x = s->impl;
    const item *it = &x->items[split][i];
    uint8_t *data;
    size_t len;
    int rc = stk_read_file(it->path, &data, &len, err);
    if (rc)
        return rc;
    char why[256];
    rc = stk_image_decode(d, data, len, im, why, sizeof why);
    free(data);
    if (rc == STK_ENOMEM)
        return stk_fail(err, rc, "%s: out of memory", it->path);
    if (rc)
        return stk_fail(err, rc, "%s: %s", it->path, why);
    *label = it->label;
    *owned = 1;
    return 0;
}

static void folder_free(stk_source *s)
{
    folder_data *x = s->impl;
    if (!x)
        return;
    for (int k = 0; k < SRC_MAX_SPLITS; k++) {
        for (uint64_t i = 0; x->items[k] && i < s->split_count[k]; i++)
            free(x->items[k][i].path);
        free(x->items[k]);
    }
    free(x);
}

static const source_ops folder_ops = {folder_load, folder_free};

int stk_folder_open(stk_source *s, stk_err *err)
{
    s->ops = &folder_ops;
    s->format = "folder";
    if (!(s->impl = calloc(1, sizeof(folder_data))))
        return stk_fail(err, STK_ENOMEM, "out of memory");
    if (!s->out_c)
        s->out_c = 3;
    if (!s->size)
        s->size = DEFAULT_SIZE;
    strvec top = {0};
    int layout_split = 0;
    int rc = list_dir(s->dir, &top, NULL, err);
    if (!rc && find_splits(s, &top, &layout_split))
        rc = stk_fail(err, STK_EINVAL, "%s: too many split folders", s->dir);
    strvec_free(&top);
    if (!rc)
        rc = collect_classes(s, layout_split, err);
    for (int k = 0; !rc && k < s->nsplits; k++) {
        char root[4096];
        snprintf(root, sizeof root, "%s%s%s", s->dir, layout_split ? "/" : "",
                 layout_split ? s->split_name[k] : "");
        rc = index_split(s, s->impl, k, root, err);
    }
    return rc;
}
