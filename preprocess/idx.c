/* idx.c - MNIST-style IDX files (gzip or raw): train-images-idx3-ubyte,
 * train-labels-idx1-ubyte, t10k-... -> splits "train" and "test". */
#include "source_impl.h"

#include "store/store.h"

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

/* What an IDX header may promise, checked before anything is allocated
 * (docs/formats.md). The largest real IDX sets (EMNIST, QMNIST) hold under
 * 1 GB, so 4 GiB of data bytes leaves room for any real one while a lying
 * header cannot ask for more; a count must also fit a split's records. */
#define IDX_MAX_DATA ((uint64_t)4 << 30)
/* deflate's densest code is a 258-byte match in about 2 bits, so no gzip
 * file inflates to more than 1032 times its own size: a header promising
 * more than that of a gzip file is a lie, refused before inflating. */
#define DEFLATE_MAX_RATIO 1032
/* see read_idx */
#define IDX_COUNT_FIRST ((uint64_t)64 << 20)

/* Checks an IDX header (magic, dimensions and the limits above) and
 * returns the number of data bytes it promises in *expect. */
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
    if (dims[0] > STK_MAX_RECORDS)
        return stk_fail(err, STK_ERANGE,
                        "%s: header promises %u %s, more than the %llu "
                        "records a split can hold",
                        path, dims[0], ndim == 3 ? "images" : "labels",
                        (unsigned long long)STK_MAX_RECORDS);
    /* at most 2^30 * 4096 * 4096 = 2^54: no overflow in 64 bits */
    *expect = dims[0];
    for (int d = 1; d < ndim; d++)
        *expect *= dims[d];
    if (*expect > IDX_MAX_DATA)
        return stk_fail(err, STK_ERANGE,
                        "%s: header promises %llu data bytes, over the limit "
                        "of %llu (4 GiB) for an IDX file",
                        path, (unsigned long long)*expect,
                        (unsigned long long)IDX_MAX_DATA);
    return 0;
}

/* The header's promise against what the file can hold: a plain file's
 * size is known, and a gzip file inflates to at most DEFLATE_MAX_RATIO
 * times its size. Both are checked before any data is read. */
static int check_size(stk_zfile *f, const char *path, size_t header,
                      uint64_t expect, stk_err *err)
{
    uint64_t disk = stk_zfile_disk_size(f);
    if (stk_zfile_is_gzip(f)) {
        if (disk > (header + expect) / DEFLATE_MAX_RATIO)
            return 0;
        return stk_fail(
            err, STK_EFORMAT,
            "%s: header promises %llu data bytes but %llu bytes "
            "of gzip inflate to at most %llu (deflate's limit "
            "is %d:1)",
            path, (unsigned long long)expect, (unsigned long long)disk,
            (unsigned long long)(disk * DEFLATE_MAX_RATIO), DEFLATE_MAX_RATIO);
    }
    if (disk - header == expect)
        return 0;
    return stk_fail(err, STK_EFORMAT,
                    "%s: header promises %llu data bytes but the file holds "
                    "%llu (%s)",
                    path, (unsigned long long)expect,
                    (unsigned long long)(disk - header),
                    disk - header < expect ? "truncated" : "trailing data");
}

/* Reads exactly the n data bytes that follow the header (into buf, or
 * counted and dropped when buf is NULL), then one more to find out whether
 * the file goes on; fails naming both sizes when the content is not n. */
static int read_exactly(stk_zfile *f, const char *path, uint8_t *buf,
                        uint64_t n, stk_err *err)
{
    enum { CHUNK = 64 * 1024 };
    uint8_t *scratch = buf ? NULL : malloc(CHUNK), byte;
    if (!buf && !scratch)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    uint64_t have = 0;
    size_t got = 0, want = 0;
    int rc = 0;
    while (!rc && have < n && got == want) { /* got < want: content ended */
        want = n - have < CHUNK ? (size_t)(n - have) : CHUNK;
        rc = stk_zfile_read(f, buf ? buf + have : scratch, want, &got, err);
        have += got;
    }
    free(scratch);
    got = 0;
    if (!rc && have == n)
        rc = stk_zfile_read(f, &byte, 1, &got, err);
    if (!rc && have < n)
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: header promises %llu data bytes but the file "
                      "holds %llu (truncated)",
                      path, (unsigned long long)n, (unsigned long long)have);
    else if (!rc && got)
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: header promises %llu data bytes but the %s holds "
                      "more (trailing data; reading stopped at %llu bytes)",
                      path, (unsigned long long)n,
                      stk_zfile_is_gzip(f) ? "gzip data" : "file",
                      (unsigned long long)n + 1);
    return rc;
}

/* Opens path, reads its header into head and checks it (check_header,
 * check_size). On failure *f is NULL. */
static int open_idx(const char *path, int ndim, uint8_t *head, uint32_t *dims,
                    uint64_t *expect, stk_zfile **f, stk_err *err)
{
    size_t header = 4 + 4 * (size_t)ndim, got = 0;
    int rc = stk_zfile_open(path, f, err);
    if (!rc)
        rc = stk_zfile_read(*f, head, header, &got, err);
    if (!rc)
        rc = check_header(path, head, got, ndim, dims, expect, err);
    if (!rc)
        rc = check_size(*f, path, header, *expect, err);
    if (rc) {
        stk_zfile_close(*f);
        *f = NULL;
    }
    return rc;
}

/* Reads an IDX file (gzip or not): the header, checked against the limits,
 * then exactly the data it promises into a buffer of exactly that size. A
 * gzip file promising more than IDX_COUNT_FIRST is inflated twice: once to
 * count its content, dropped as it comes, then into the buffer, so that
 * memory is allocated only for data the file was seen to hold (a header
 * lying about a gzip bomb of 1 GiB once cost 1 GiB). Below that, a lie
 * costs at most that much, freed at once, which is cheaper than inflating
 * twice (a fifth of an MNIST prep). dims gets the ndim sizes; *out the
 * header and the data. */
static int read_idx(const char *path, int ndim, uint32_t *dims, uint8_t **out,
                    stk_err *err)
{
    uint8_t head[16], again[16];
    size_t header = 4 + 4 * (size_t)ndim;
    uint64_t expect = 0;
    stk_zfile *f;
    int rc = open_idx(path, ndim, head, dims, &expect, &f, err);
    if (!rc && stk_zfile_is_gzip(f) && expect > IDX_COUNT_FIRST) {
        rc = read_exactly(f, path, NULL, expect, err);
        stk_zfile_close(f);
        f = NULL;
        if (!rc)
            rc = open_idx(path, ndim, again, dims, &expect, &f, err);
        if (!rc && memcmp(head, again, header))
            rc = stk_fail(err, STK_EIO, "%s: changed while it was read", path);
    }
    uint8_t *buf = NULL;
    if (!rc && expect > SIZE_MAX - header)
        rc = stk_fail(err, STK_ERANGE,
                      "%s: header promises %llu data bytes, more than this "
                      "machine can address",
                      path, (unsigned long long)expect);
    if (!rc && !(buf = malloc(header + (size_t)expect)))
        rc = stk_fail(err, STK_ENOMEM,
                      "%s: cannot allocate %llu bytes for the data the "
                      "header promises",
                      path, (unsigned long long)expect);
    if (!rc)
        rc = read_exactly(f, path, buf + header, expect, err);
    stk_zfile_close(f);
    if (rc) {
        free(buf);
        return rc;
    }
    memcpy(buf, head, header);
    *out = buf;
    return 0;
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

/* Whether a folder's own name holds "fashion" (any case), or, for
 * torchvision's layout (ROOT/FashionMNIST/raw), its parent's: as typed,
 * and as resolved ("." or a link), never a folder further up. */
static bool named_fashion(const char *dir)
{
    char p[4096];
    snprintf(p, sizeof p, "%s", dir);
    for (int up = 0; up < 2; up++) {
        size_t n = strlen(p);
        while (n > 1 && p[n - 1] == '/')
            p[--n] = '\0';
        char *name = strrchr(p, '/');
        name = name ? name + 1 : p;
        for (char *c = name; *c; c++)
            *c = (char)tolower((unsigned char)*c);
        if (strstr(name, "fashion"))
            return true;
        if (strcmp(name, "raw") || name == p)
            return false;
        name[-1] = '\0'; /* ROOT/FashionMNIST/raw: the parent's name */
    }
    return false;
}

static int add_classes(stk_source *s, idx_data *x)
{
    int top = 0;
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < x->split[k].nimages; i++)
            if (x->split[k].labels[8 + i] > top)
                top = x->split[k].labels[8 + i];
    char *real = realpath(s->dir, NULL);
    int fashion = top == 9 && (named_fashion(s->dir) ||
                               (real && named_fashion(real)));
    free(real);
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

static const source_ops idx_ops = {idx_load, idx_free, NULL, NULL};

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
