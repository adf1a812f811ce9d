/* idx.c - MNIST-style IDX files (gzip or raw): train-images-idx3-ubyte,
 * train-labels-idx1-ubyte, t10k-... -> splits "train" and "test". */
#include "source_impl.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct idx_split {
    uint8_t *images, *labels; /* whole decompressed files */
    size_t nimages;
} idx_split;

typedef struct idx_data {
    idx_split split[2];
} idx_data;

static const char *const prefixes[2] = {"train", "t10k"};
static const char *const split_names[2] = {"train", "test"};
static const char *const fashion_classes[10] = {
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal",      "Shirt",   "Sneaker",  "Bag",   "Ankle boot"};

/* Finds prefix-kind[-.]idxN-ubyte[.gz] in dir; returns 0 and the path. */
static int find_file(const char *dir, const char *prefix, const char *kind,
                     int ndim, char *path, size_t n)
{
    static const char *const fmts[] = {"%s/%s-%s-idx%d-ubyte",
                                       "%s/%s-%s.idx%d-ubyte",
                                       "%s/%s-%s-idx%d-ubyte.gz",
                                       "%s/%s-%s.idx%d-ubyte.gz"};
    for (size_t f = 0; f < sizeof fmts / sizeof *fmts; f++) {
        snprintf(path, n, fmts[f], dir, prefix, kind, ndim);
        if (access(path, F_OK) == 0)
            return 0;
    }
    return STK_ENOENT;
}

/* Any of the four IDX files makes dir an IDX dataset, so that one missing
 * file is reported as missing rather than as "no class folders". */
int stk_idx_probe(const char *dir)
{
    char p[4096];
    for (int k = 0; k < 2; k++)
        if (find_file(dir, prefixes[k], "images", 3, p, sizeof p) == 0 ||
            find_file(dir, prefixes[k], "labels", 1, p, sizeof p) == 0)
            return 1;
    return 0;
}

static uint32_t be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 |
           p[3];
}

/* Checks an IDX header (magic and dimensions) and returns the number of
 * data bytes it promises in *expect. */
static int check_header(const char *path, const uint8_t *head, size_t got,
                        int ndim, uint32_t *dims, uint64_t *expect,
                        stk_err *err)
{
    size_t header = 4 + 4 * (size_t)ndim;
    uint32_t want = 0x0800u | (uint32_t)ndim;
    if (got < 4 || be32(head) != want)
        return stk_fail(err, STK_EFORMAT,
                        "%s: bad IDX magic 0x%08x, expected 0x%08x (unsigned "
                        "bytes, %d dimension%s)",
                        path, got < 4 ? 0 : be32(head), want, ndim,
                        ndim > 1 ? "s" : "");
    if (got < header)
        return stk_fail(err, STK_EFORMAT,
                        "%s: truncated IDX header (%zu of %zu bytes)", path,
                        got, header);
    for (int d = 0; d < ndim; d++)
        dims[d] = be32(head + 4 + 4 * d);
    if (ndim == 3 &&
        (dims[1] == 0 || dims[2] == 0 || dims[1] > 4096 || dims[2] > 4096))
        return stk_fail(err, STK_EFORMAT,
                        "%s: bad image size %ux%u (expected 1..4096 a side)",
                        path, dims[1], dims[2]);
    /* at most 2^32 * 4096 * 4096 = 2^56: no overflow in 64 bits */
    *expect = dims[0];
    for (int d = 1; d < ndim; d++)
        *expect *= dims[d];
    return 0;
}

/* Reads exactly the expect data bytes that follow the header, then one
 * more to find out whether the file goes on. The buffer grows with what
 * was actually read, never past what the header promises, so neither a
 * lying header nor a gzip bomb costs more memory than the data it holds. */
static int read_body(stk_zfile *f, const char *path, size_t header,
                     uint64_t expect, uint8_t **out, stk_err *err)
{
    if (expect > SIZE_MAX - header - 1)
        return stk_fail(err, STK_ERANGE,
                        "%s: header promises %llu data bytes, more than this "
                        "machine can address",
                        path, (unsigned long long)expect);
    size_t total = header + (size_t)expect, cap = 0, have = header, got = 0;
    uint8_t *buf = NULL;
    int rc = 0;
    while (!rc && have < total) {
        size_t next = cap ? cap * 2 : (size_t)16 << 20;
        next = next > total ? total : next;
        uint8_t *b = realloc(buf, next);
        if (!b) {
            rc = stk_fail(err, STK_ENOMEM,
                          "%s: cannot allocate %zu bytes for the %llu data "
                          "bytes the header promises",
                          path, next, (unsigned long long)expect);
            break;
        }
        buf = b;
        cap = next;
        rc = stk_zfile_read(f, buf + have, cap - have, &got, err);
        have += got;
        if (!rc && have < cap)
            break; /* the data ended early */
    }
    uint8_t extra;
    if (!rc && have == total)
        rc = stk_zfile_read(f, &extra, 1, &got, err);
    if (!rc && have < total)
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: header promises %llu data bytes but the file "
                      "holds %zu (truncated)",
                      path, (unsigned long long)expect, have - header);
    else if (!rc && got)
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: header promises %llu data bytes but the %s holds "
                      "more (trailing data; reading stopped at %llu bytes)",
                      path, (unsigned long long)expect,
                      stk_zfile_is_gzip(f) ? "gzip data" : "file",
                      (unsigned long long)expect + 1);
    if (rc) {
        free(buf);
        return rc;
    }
    if (!buf && !(buf = malloc(header))) /* no data at all: 0 images */
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    *out = buf;
    return 0;
}

/* Reads an IDX file (gzip or not): the header first, then exactly the data
 * it promises. dims gets the ndim sizes; *out the header and the data. */
static int read_idx(const char *path, int ndim, uint32_t *dims, uint8_t **out,
                    stk_err *err)
{
    stk_zfile *f;
    int rc = stk_zfile_open(path, &f, err);
    if (rc)
        return rc;
    uint8_t head[16];
    size_t header = 4 + 4 * (size_t)ndim, got = 0;
    uint64_t expect = 0;
    rc = stk_zfile_read(f, head, header, &got, err);
    if (!rc)
        rc = check_header(path, head, got, ndim, dims, &expect, err);
    /* a plain file's size is known: a wrong one fails before any reading */
    uint64_t disk = stk_zfile_disk_size(f);
    if (!rc && !stk_zfile_is_gzip(f) && disk - header != expect)
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: header promises %llu data bytes but the file "
                      "holds %llu (%s)",
                      path, (unsigned long long)expect,
                      (unsigned long long)(disk - header),
                      disk - header < expect ? "truncated" : "trailing data");
    if (!rc)
        rc = read_body(f, path, header, expect, out, err);
    if (!rc)
        memcpy(*out, head, header);
    stk_zfile_close(f);
    return rc;
}

static int open_split(stk_source *s, idx_data *x, int k, stk_err *err)
{
    char ipath[4096], lpath[4096];
    int no_images =
        find_file(s->dir, prefixes[k], "images", 3, ipath, sizeof ipath);
    int no_labels =
        find_file(s->dir, prefixes[k], "labels", 1, lpath, sizeof lpath);
    if (no_images && no_labels && k == 1)
        return 1; /* a missing test split is fine */
    if (no_images && no_labels) {
        char t[4096];
        int test = !find_file(s->dir, "t10k", "images", 3, t, sizeof t) ||
                   !find_file(s->dir, "t10k", "labels", 1, t, sizeof t);
        return stk_fail(err, STK_ENOENT,
                        "%s: no train-images-idx3-ubyte[.gz] and no "
                        "train-labels-idx1-ubyte[.gz] (the train split is "
                        "required%s)",
                        s->dir, test ? "; found only t10k-* files" : "");
    }
    if (no_images)
        return stk_fail(err, STK_ENOENT,
                        "%s: found %s but no %s-images-idx3-ubyte[.gz]",
                        s->dir, lpath, prefixes[k]);
    if (no_labels)
        return stk_fail(err, STK_ENOENT,
                        "%s: found %s but no %s-labels-idx1-ubyte[.gz]",
                        s->dir, ipath, prefixes[k]);
    idx_split *sp = &x->split[k];
    uint32_t idims[3], ldims[1];
    int rc = read_idx(ipath, 3, idims, &sp->images, err);
    if (!rc)
        rc = read_idx(lpath, 1, ldims, &sp->labels, err);
    if (rc)
        return rc;
    if (idims[0] != ldims[0])
        return stk_fail(err, STK_EFORMAT,
                        "%s holds %u images but %s holds %u labels", ipath,
                        idims[0], lpath, ldims[0]);
    if (s->native_w && (s->native_w != (int)idims[2] ||
                        s->native_h != (int)idims[1]))
        return stk_fail(err, STK_EFORMAT,
                        "%s: images are %ux%u but the train split's are "
                        "%dx%d",
                        ipath, idims[2], idims[1], s->native_w, s->native_h);
    s->native_h = (int)idims[1];
    s->native_w = (int)idims[2];
    sp->nimages = idims[0];
    snprintf(s->split_name[s->nsplits], 32, "%s", split_names[k]);
    s->split_count[s->nsplits++] = idims[0];
    return 0;
}

static int add_classes(stk_source *s, idx_data *x)
{
    int top = 0;
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < x->split[k].nimages; i++)
            if (x->split[k].labels[8 + i] > top)
                top = x->split[k].labels[8 + i];
    char lower[4096];
    size_t n = strlen(s->dir);
    for (size_t i = 0; i <= n && i < sizeof lower; i++)
        lower[i] = (char)tolower((unsigned char)s->dir[i]);
    lower[sizeof lower - 1] = '\0';
    int fashion = top == 9 && strstr(lower, "fashion");
    for (int c = 0; c <= top; c++) {
        char num[12];
        snprintf(num, sizeof num, "%d", c);
        if (stk_source_add_class(s, fashion ? fashion_classes[c] : num))
            return STK_ENOMEM;
    }
    return 0;
}

static int idx_load(const stk_source *s, stk_decoder *d, int split,
                    uint64_t i, int32_t *label, stk_image *im, int *owned,
                    stk_err *err)
{
    (void)d;
    (void)err;
    const idx_data *x = s->impl;
    /* splits were added in order, skipping a missing test split */
    const idx_split *sp = &x->split[strcmp(s->split_name[split], "train") ? 1
                                                                          : 0];
    size_t plane = (size_t)s->native_w * s->native_h;
    *label = sp->labels[8 + i];
    im->w = s->native_w;
    im->h = s->native_h;
    im->c = 1;
    im->px = sp->images + 16 + i * plane;
    *owned = 0;
    return 0;
}

static void idx_free(stk_source *s)
{
    idx_data *x = s->impl;
    if (!x)
        return;
    for (int k = 0; k < 2; k++) {
        free(x->split[k].images);
        free(x->split[k].labels);
    }
    free(x);
}

static const source_ops idx_ops = {idx_load, idx_free, NULL};

int stk_idx_open(stk_source *s, stk_err *err)
{
    s->ops = &idx_ops;
    s->format = "idx";
    if (!(s->impl = calloc(1, sizeof(idx_data))))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    if (!s->out_c)
        s->out_c = 1;
    for (int k = 0; k < 2; k++) {
        int rc = open_split(s, s->impl, k, err);
        if (rc < 0)
            return rc;
    }
    if (add_classes(s, s->impl))
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->dir);
    return 0;
}
