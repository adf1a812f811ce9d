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

static int is_image(const char *name)
{
    const char *dot = strrchr(name, '.');
    return dot && (!strcasecmp(dot, ".png") || !strcasecmp(dot, ".jpg") ||
                   !strcasecmp(dot, ".jpeg"));
}

/* Whether entry de of directory path is a directory (following symbolic
 * links, as torchvision does). d_type saves a stat per entry on the file
 * systems that fill it in. */
static int entry_is_dir(const char *path, const struct dirent *de)
{
    if (de->d_type != DT_UNKNOWN && de->d_type != DT_LNK)
        return de->d_type == DT_DIR;
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Lists the entries of dir (no hidden ones): folders into dirs (names),
 * files with an image extension into files (full paths); either may be
 * NULL. Such a file that is not a regular file (a FIFO named x.png, a
 * device, a dangling link) is listed too: loading it fails with the reason
 * and the name ("x.png: not a regular file (a FIFO)"), and --skip-bad
 * records it; nothing is ever opened here, so nothing can block.
 * *others counts the entries that are neither (may be NULL). */
static int list_dir(const char *dir, strvec *dirs, strvec *files,
                    size_t *others, stk_err *err)
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
        if (entry_is_dir(full, de)) {
            rc = dirs ? push(dirs, strdup(de->d_name)) : 0;
            free(full);
        } else if (files && is_image(de->d_name)) {
            rc = push(files, full);
        } else {
            free(full);
            if (others)
                ++*others;
        }
        errno = 0;
    }
    if (!rc && errno)
        rc = stk_fail(err, STK_EIO, "%s: cannot read directory: %s", dir,
                      strerror(errno));
    else if (rc == STK_ENOMEM)
        rc = stk_fail(err, rc, "%s: out of memory", dir);
    closedir(d);
    if (dirs && dirs->n > 1)
        qsort(dirs->v, dirs->n, sizeof *dirs->v, cmp_str);
    return rc;
}

/* The directories being walked, innermost first: a symbolic link back to
 * one of them would make the walk endless. */
typedef struct walk_frame {
    dev_t dev;
    ino_t ino;
    const char *path;
    const struct walk_frame *up;
} walk_frame;

/* Collects every image below dir, recursively. */
static int walk(const char *dir, const walk_frame *up, strvec *files,
                stk_err *err)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return stk_fail(err, stk_from_errno(errno),
                        "%s: cannot read directory: %s", dir, strerror(errno));
    for (const walk_frame *f = up; f; f = f->up)
        if (f->dev == st.st_dev && f->ino == st.st_ino)
            return stk_fail(err, STK_EFORMAT,
                            "%s: a link back to %s (a directory loop)", dir,
                            f->path);
    walk_frame here = {st.st_dev, st.st_ino, dir, up};
    strvec sub = {0};
    int rc = list_dir(dir, &sub, files, NULL, err);
    for (size_t i = 0; !rc && i < sub.n; i++) {
        char *p;
        if (asprintf(&p, "%s/%s", dir, sub.v[i]) < 0)
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
        else {
            rc = walk(p, &here, files, err);
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
    int rc = list_dir(root, &classes, NULL, NULL, err);
    size_t cap = 0, n = 0;
    for (size_t c = 0; !rc && c < classes.n; c++) {
        char *cdir;
        if (asprintf(&cdir, "%s/%s", root, classes.v[c]) < 0) {
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", root);
            break;
        }
        files.n = 0;
        rc = walk(cdir, NULL, &files, err);
        free(cdir);
        if (files.n > 1) /* an empty class folder has no array to sort */
            qsort(files.v, files.n, sizeof *files.v, cmp_str);
        if (!rc && n + files.n > cap) {
            cap = (n + files.n) * 2;
            item *it = realloc(x->items[k], cap * sizeof *it);
            if (!it)
                rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", root);
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

/* The folder that holds split k's class folders (malloc'd). */
static char *split_root(const stk_source *s, int layout_split, int k)
{
    char *p;
    if (!layout_split)
        return strdup(s->dir);
    return asprintf(&p, "%s/%s", s->dir, s->split_name[k]) < 0 ? NULL : p;
}

/* Splits: "train" first, then the other folders in name order. */
static int find_splits(stk_source *s, strvec *top, int *layout_split,
                       stk_err *err)
{
    *layout_split = 0;
    for (size_t i = 0; i < top->n; i++)
        if (!strcmp(top->v[i], "train")) {
            strvec inner = {0};
            char *p;
            if (asprintf(&p, "%s/train", s->dir) < 0)
                return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
            if (list_dir(p, &inner, NULL, NULL, NULL) == 0 && inner.n)
                *layout_split = 1;
            strvec_free(&inner);
            free(p);
        }
    snprintf(s->split_name[s->nsplits++], 32, "train");
    for (size_t i = 0; *layout_split && i < top->n; i++) {
        if (!strcmp(top->v[i], "train"))
            continue;
        if (strlen(top->v[i]) >= sizeof s->split_name[0])
            return stk_fail(err, STK_EINVAL,
                            "%s/%s: a split folder's name must be under %zu "
                            "bytes",
                            s->dir, top->v[i], sizeof s->split_name[0]);
        if (s->nsplits == SRC_MAX_SPLITS)
            return stk_fail(err, STK_EINVAL,
                            "%s: more than %d split folders (RAW/train holds "
                            "folders, so every folder of RAW is a split)",
                            s->dir, SRC_MAX_SPLITS);
        snprintf(s->split_name[s->nsplits++], 32, "%s", top->v[i]);
    }
    return 0;
}

/* For "no class folders": what dir holds instead. */
static void describe(const char *dir, char *buf, size_t n)
{
    strvec files = {0};
    size_t others = 0;
    if (list_dir(dir, NULL, &files, &others, NULL) == 0)
        snprintf(buf, n,
                 files.n || others ? "; it holds %zu image file(s) and %zu "
                                     "other file(s) but no folder"
                                   : "; it is empty",
                 files.n, others);
    else
        buf[0] = '\0';
    strvec_free(&files);
}

/* Union of class folder names over the splits, sorted by bytes (Python's
 * order for UTF-8 names; any other bytes are kept as they are). */
static int collect_classes(stk_source *s, int layout_split, stk_err *err)
{
    strvec all = {0};
    int rc = 0;
    for (int k = 0; !rc && k < s->nsplits; k++) {
        char *root = split_root(s, layout_split, k);
        rc = root ? list_dir(root, &all, NULL, NULL, err)
                  : stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
        free(root);
    }
    if (!rc && all.n > 1)
        qsort(all.v, all.n, sizeof *all.v, cmp_str);
    for (size_t i = 0; !rc && i < all.n; i++)
        if (i == 0 || strcmp(all.v[i], all.v[i - 1]))
            if (stk_source_add_class(s, all.v[i]))
                rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    strvec_free(&all);
    if (!rc && !s->nclasses) {
        char what[128];
        describe(s->dir, what, sizeof what);
        rc = stk_fail(err, STK_ENOENT,
                      "%s: no class folders (expected RAW/<class>/*.png or "
                      "RAW/<split>/<class>/*.jpg%s)",
                      s->dir, what);
    }
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

static const char *folder_file(const stk_source *s, int split, uint64_t i)
{
    const folder_data *x = s->impl;
    return x->items[split][i].path;
}

static const source_ops folder_ops = {folder_load, folder_free, folder_file};

int stk_folder_open(stk_source *s, stk_err *err)
{
    s->ops = &folder_ops;
    s->format = "folder";
    if (!(s->impl = calloc(1, sizeof(folder_data))))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    if (!s->out_c)
        s->out_c = 3;
    if (!s->size)
        s->size = DEFAULT_SIZE;
    strvec top = {0};
    int layout_split = 0;
    int rc = list_dir(s->dir, &top, NULL, NULL, err);
    if (!rc)
        rc = find_splits(s, &top, &layout_split, err);
    strvec_free(&top);
    if (!rc)
        rc = collect_classes(s, layout_split, err);
    for (int k = 0; !rc && k < s->nsplits; k++) {
        char *root = split_root(s, layout_split, k);
        rc = root ? index_split(s, s->impl, k, root, err)
                  : stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
        free(root);
    }
    return rc;
}
