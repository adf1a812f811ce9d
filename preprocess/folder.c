/* folder.c - image folders, as torchvision's ImageFolder reads them:
 *   RAW/<split>/<class>/... images (png, jpg, jpeg) when RAW/train holds folders
 *   RAW/<class>/... images                     otherwise (one split, "train",
 *                                              or "train" and "test" with
 *                                              --holdout)
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
    const char *not_regular; /* "a FIFO", ...: what the walk found instead */
} item;

typedef struct itemvec {
    item *v;
    size_t n, cap;
} itemvec;

typedef struct folder_data {
    item *items[SRC_MAX_SPLITS];
} folder_data;

/* Files a listing passed over (neither a folder nor an image by its
 * extension), and the first of them. */
typedef struct passed_over {
    size_t n;
    char first[200];
} passed_over;

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

static int push_item(itemvec *iv, char *path, const char *not_regular)
{
    if (!path)
        return STK_ENOMEM;
    if (iv->n == iv->cap) {
        size_t cap = iv->cap ? iv->cap * 2 : 64;
        item *v = realloc(iv->v, cap * sizeof *v);
        if (!v) {
            free(path);
            return STK_ENOMEM;
        }
        iv->v = v;
        iv->cap = cap;
    }
    iv->v[iv->n++] = (item){path, -1, not_regular};
    return 0;
}

static void itemvec_free(itemvec *iv)
{
    for (size_t i = 0; i < iv->n; i++)
        free(iv->v[i].path);
    free(iv->v);
    memset(iv, 0, sizeof *iv);
}

static int cmp_item(const void *a, const void *b)
{
    return strcmp(((const item *)a)->path, ((const item *)b)->path);
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

/* What entry de (at path) is, following symbolic links as torchvision
 * does: a directory (*is_dir), a regular file, or something else, named in
 * *other as stk_open_regular names it. d_type saves a stat per entry where
 * the file system fills it in; nothing is opened, so nothing can block or
 * wake a device. A dangling link counts as a file: loading it says why. */
static void classify(const char *path, const struct dirent *de, int *is_dir,
                     const char **other)
{
    *is_dir = 0;
    *other = NULL;
    mode_t m = de->d_type == DT_DIR    ? S_IFDIR
               : de->d_type == DT_REG  ? S_IFREG
               : de->d_type == DT_FIFO ? S_IFIFO
               : de->d_type == DT_SOCK ? S_IFSOCK
               : de->d_type == DT_CHR  ? S_IFCHR
               : de->d_type == DT_BLK  ? S_IFBLK
                                       : 0; /* DT_LNK, DT_UNKNOWN */
    struct stat st;
    if (!m)
        m = stat(path, &st) == 0 ? st.st_mode & S_IFMT : S_IFREG;
    *is_dir = S_ISDIR(m);
    if (!S_ISDIR(m) && !S_ISREG(m))
        *other = S_ISFIFO(m)   ? "a FIFO"
                 : S_ISSOCK(m) ? "a socket"
                 : S_ISCHR(m)  ? "a character device"
                 : S_ISBLK(m)  ? "a block device"
                               : "not a file";
}

/* Lists the entries of dir (no hidden ones): folders into dirs (names),
 * files with an image extension into files (full paths); either may be
 * NULL. Such an entry that is not a regular file (a FIFO named x.png, a
 * device) is listed too, with what it is: loading it fails naming it
 * ("x.png: not a regular file (a FIFO)") without opening it, and
 * --skip-bad records it. *others counts the entries that are neither (may
 * be NULL). */
static int list_dir(const char *dir, strvec *dirs, itemvec *files,
                    passed_over *others, stk_err *err)
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
        int is_dir;
        const char *other;
        classify(full, de, &is_dir, &other);
        if (is_dir) {
            rc = dirs ? push(dirs, strdup(de->d_name)) : 0;
            free(full);
        } else if (files && is_image(de->d_name)) {
            rc = push_item(files, full, other);
        } else {
            if (others && !others->n++)
                stk_snprintf_text(others->first, sizeof others->first,
                                  "%s", full);
            free(full);
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

/* Collects every image below dir, recursively; counts the other files. */
static int walk(const char *dir, const walk_frame *up, itemvec *files,
                passed_over *others, stk_err *err)
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
    int rc = list_dir(dir, &sub, files, others, err);
    for (size_t i = 0; !rc && i < sub.n; i++) {
        char *p;
        if (asprintf(&p, "%s/%s", dir, sub.v[i]) < 0)
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
        else {
            rc = walk(p, &here, files, others, err);
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

/* Lists split folder root/<class>/... into the split's items: each class's
 * images sorted by path, the classes in name order. */
static int index_split(stk_source *s, folder_data *x, int k, const char *root,
                       passed_over *others, stk_err *err)
{
    strvec classes = {0};
    itemvec all = {0};
    int rc = list_dir(root, &classes, NULL, NULL, err);
    for (size_t c = 0; !rc && c < classes.n; c++) {
        char *cdir;
        if (asprintf(&cdir, "%s/%s", root, classes.v[c]) < 0) {
            rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", root);
            break;
        }
        size_t first = all.n;
        rc = walk(cdir, NULL, &all, others, err);
        free(cdir);
        if (all.n - first > 1) /* an empty class folder has nothing to sort */
            qsort(all.v + first, all.n - first, sizeof *all.v, cmp_item);
        int32_t label = class_index(s, classes.v[c]);
        for (size_t i = first; i < all.n; i++)
            all.v[i].label = label;
    }
    strvec_free(&classes);
    if (!rc && !all.n)
        rc = stk_fail(err, STK_ENOENT,
                      "%s: no .png/.jpg/.jpeg files in class folders", root);
    if (rc) {
        itemvec_free(&all);
        return rc;
    }
    x->items[k] = all.v; /* the source owns them now */
    s->split_count[k] = all.n;
    return 0;
}

typedef struct ranked {
    uint64_t rank;
    const char *rel; /* path relative to RAW_DIR */
    size_t i;        /* index into the train split's items */
} ranked;

static int cmp_ranked(const void *a, const void *b)
{
    const ranked *x = a, *y = b;
    if (x->rank != y->rank)
        return x->rank < y->rank ? -1 : 1;
    return strcmp(x->rel, y->rel); /* equal ranks: still one order */
}

/* Moves each class's share of the "train" items (stk_holdout_rank's lowest)
 * into a new "test" split; both keep path order. */
static int hold_out(stk_source *s, folder_data *x, stk_err *err)
{
    uint64_t n = s->split_count[0];
    item *all = x->items[0];
    ranked *r = malloc(n * sizeof *r);
    unsigned char *to_test = calloc(n, 1);
    item *test = malloc(n * sizeof *test);
    if (!r || !to_test || !test) {
        free(r);
        free(to_test);
        free(test);
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    }
    size_t root = strlen(s->dir) + 1; /* items are DIR "/" RELPATH */
    for (size_t i = 0; i < n; i++)
        r[i] = (ranked){stk_holdout_rank(all[i].path + root, s->holdout_seed),
                        all[i].path + root, i};
    for (size_t a = 0, b; a < n; a = b) { /* a class's items are adjacent */
        for (b = a + 1; b < n && all[b].label == all[a].label; b++)
            ;
        qsort(r + a, b - a, sizeof *r, cmp_ranked);
        uint64_t k = stk_holdout_count(b - a, s->holdout);
        for (size_t j = a; j < a + k; j++)
            to_test[r[j].i] = 1;
    }
    size_t ntrain = 0, ntest = 0;
    for (size_t i = 0; i < n; i++)
        if (to_test[i])
            test[ntest++] = all[i];
        else
            all[ntrain++] = all[i];
    free(r);
    free(to_test);
    if (!ntest) {
        free(test);
        return stk_fail(err, STK_EINVAL,
                        "%s: --holdout %g holds out no file: every class "
                        "folder has a single image",
                        s->dir, s->holdout);
    }
    x->items[1] = test;
    s->split_count[0] = ntrain;
    s->split_count[1] = ntest;
    snprintf(s->split_name[s->nsplits++], sizeof s->split_name[0], "test");
    return 0;
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
    itemvec files = {0};
    passed_over others = {0};
    if (list_dir(dir, NULL, &files, &others, NULL) == 0)
        snprintf(buf, n,
                 files.n || others.n ? "; it holds %zu image file(s) and %zu "
                                       "other file(s) but no folder"
                                     : "; it is empty",
                 files.n, others.n);
    else
        buf[0] = '\0';
    itemvec_free(&files);
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
    if (it->not_regular) /* as stk_read_file would say, without opening it */
        return stk_fail(err, STK_EFORMAT, "%s: not a regular file (%s)",
                        it->path, it->not_regular);
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

static int32_t folder_label(const stk_source *s, int split, uint64_t i)
{
    const folder_data *x = s->impl;
    return x->items[split][i].label;
}

static const source_ops folder_ops = {folder_load, folder_free, folder_file,
                                      folder_label};

uint64_t stk_source_drop_files(stk_source *s, int split,
                               const char *const *rel, size_t n)
{
    if (s->ops != &folder_ops || split < 0 || split >= s->nsplits)
        return 0;
    folder_data *x = s->impl;
    size_t dir = strlen(s->dir) + 1; /* items are DIR/REL */
    uint64_t kept = 0, count = s->split_count[split];
    for (uint64_t i = 0; i < count; i++) {
        item *it = &x->items[split][i];
        const char *r = it->path + dir;
        if (bsearch(&r, rel, n, sizeof *rel, cmp_str))
            free(it->path);
        else
            x->items[split][kept++] = *it;
    }
    s->split_count[split] = kept;
    return count - kept;
}

/* What a user would miss, in s->notice: files the folders hold that prep
 * does not read (torchvision's ImageFolder also reads .bmp, .webp, .tif,
 * ...), and classes with no image in train (ImageFolder refuses a class
 * folder without a file; here the class keeps its index). */
static void note_passed_over(stk_source *s, const folder_data *x,
                             const passed_over *others)
{
    if (others->n)
        stk_snprintf_text(s->notice, sizeof s->notice,
                          "%zu file(s) that are not .png, .jpg or .jpeg were "
                          "passed over (the first: %s)",
                          others->n, others->first);
    unsigned char *empty = malloc((size_t)s->nclasses + 1);
    if (!empty)
        return; /* the notice is a help, not a need */
    memset(empty, 1, (size_t)s->nclasses + 1);
    for (uint64_t i = 0; i < s->split_count[0]; i++)
        if (x->items[0][i].label >= 0)
            empty[x->items[0][i].label] = 0;
    stk_source_name_classes(s, empty, "with no image in train (kept, with "
                            "their indices)", s->notice, sizeof s->notice);
    free(empty);
}

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
    if (!rc && layout_split && s->holdout)
        rc = stk_fail(err, STK_EINVAL,
                      "%s: holds split folders (%s/train/<class>/...): they "
                      "are the splits, so --holdout does not apply (drop "
                      "it, or put the class folders directly in %s)",
                      s->dir, s->dir, s->dir);
    if (!rc)
        rc = collect_classes(s, layout_split, err);
    passed_over others = {0};
    for (int k = 0; !rc && k < s->nsplits; k++) {
        char *root = split_root(s, layout_split, k);
        rc = root ? index_split(s, s->impl, k, root, &others, err)
                  : stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
        free(root);
    }
    if (!rc)
        note_passed_over(s, s->impl, &others);
    if (!rc && s->holdout)
        rc = hold_out(s, s->impl, err);
    return rc;
}
