/* source.c - opening a raw dataset: format detection, shared accessors and
 * the per-sample load path (decode -> channels -> resize/crop -> CHW). */
#include "source_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int detect(const char *dir, stk_src_format *f, stk_err *err)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", dir,
                        strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return stk_fail(err, STK_EINVAL, "%s: not a directory", dir);
    *f = stk_idx_probe(dir)     ? STK_SRC_IDX
         : stk_cifar_probe(dir) ? STK_SRC_CIFAR
                                : STK_SRC_FOLDER;
    return 0;
}

int stk_source_add_class(stk_source *s, const char *name)
{
    char **c = realloc(s->classes, (size_t)(s->nclasses + 1) * sizeof *c);
    if (!c)
        return STK_ENOMEM;
    s->classes = c;
    if (!(c[s->nclasses] = strdup(name)))
        return STK_ENOMEM;
    s->nclasses++;
    return 0;
}

/* The flags that only a folder of class folders takes, against the
 * format (what names the dataset: its directory or --format). */
static int fits_format(const char *what, const stk_source_opts *o,
                       stk_err *err)
{
    if (o->format == STK_SRC_FOLDER || o->format == STK_SRC_AUTO)
        return 0;
    const char *name = o->format == STK_SRC_IDX ? "IDX" : "CIFAR";
    if (o->holdout)
        return stk_fail(err, STK_EINVAL,
                        "%s: --holdout needs a folder of class folders; an "
                        "%s dataset comes with its own train and test "
                        "splits",
                        what, name);
    if (o->short_side || o->max_side) /* one size already */
        return stk_fail(err, STK_EINVAL,
                        "%s: --short-side/--max-side apply to image folders; "
                        "%s images all have one size already",
                        what, name);
    return 0;
}

int stk_source_opts_check(const stk_source_opts *opts, stk_err *err)
{
    stk_source_opts o = opts ? *opts : (stk_source_opts){0};
    if (o.channels != 0 && o.channels != 1 && o.channels != 3)
        return stk_fail(err, STK_EINVAL, "channels must be 1 or 3, not %d",
                        o.channels);
    if (o.size < 0 || o.size > 4096)
        return stk_fail(err, STK_EINVAL, "--size must be 1..4096, not %d",
                        o.size);
    if (o.holdout != 0 && !(o.holdout > 0 && o.holdout < 1))
        return stk_fail(err, STK_EINVAL,
                        "--holdout must be a fraction between 0 and 1 "
                        "(exclusive), not %g",
                        o.holdout);
    if (o.short_side < 0 || o.short_side > 4096 || o.max_side < 0 ||
        o.max_side > 8192)
        return stk_fail(err, STK_EINVAL,
                        "--short-side must be 1..4096 and --max-side "
                        "1..8192");
    if ((o.short_side || o.max_side) && o.size)
        return stk_fail(err, STK_EINVAL,
                        "--size crops to a square, --short-side/--max-side "
                        "keep the aspect ratio: give one or the other");
    if (o.short_side && o.max_side && o.max_side < o.short_side)
        return stk_fail(err, STK_EINVAL,
                        "--max-side %d is below --short-side %d", o.max_side,
                        o.short_side);
    if (o.upscale && !o.short_side)
        return stk_fail(err, STK_EINVAL, "--upscale needs --short-side");
    if (o.holdout_seed && !o.holdout)
        return stk_fail(err, STK_EINVAL, "--holdout-seed needs --holdout");
    return fits_format(o.format == STK_SRC_IDX ? "--format idx" : "--format cifar",
                       &o, err);
}

int stk_source_open(const char *raw_dir, const stk_source_opts *opts,
                    stk_source **out, stk_err *err)
{
    *out = NULL;
    stk_source_opts o = opts ? *opts : (stk_source_opts){0};
    int rc = stk_source_opts_check(&o, err);
    if (rc)
        return rc;
    if (o.format == STK_SRC_AUTO && ((rc = detect(raw_dir, &o.format, err)) ||
                                     (rc = fits_format(raw_dir, &o, err))))
        return rc;
    stk_source *s = calloc(1, sizeof *s);
    if (!s || !(s->dir = strdup(raw_dir))) {
        free(s);
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", raw_dir);
    }
    s->out_c = o.channels;
    s->size = o.size;
    s->holdout = o.holdout;
    s->holdout_seed = o.holdout_seed;
    s->short_side = o.short_side;
    s->max_side = o.max_side ? o.max_side : 2 * o.short_side;
    s->upscale = o.upscale;
    rc = o.format == STK_SRC_IDX     ? stk_idx_open(s, err)
         : o.format == STK_SRC_CIFAR ? stk_cifar_open(s, err)
                                     : stk_folder_open(s, err);
    if (rc) {
        stk_source_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

void stk_source_close(stk_source *s)
{
    if (!s)
        return;
    if (s->ops && s->ops->free)
        s->ops->free(s);
    for (int i = 0; i < s->nclasses; i++)
        free(s->classes[i]);
    free(s->classes);
    free(s->dir);
    free(s);
}

const char *stk_source_format_name(const stk_source *s) { return s->format; }

uint64_t stk_holdout_rank(const char *relpath, uint64_t seed)
{
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a 64 */
    for (const unsigned char *p = (const unsigned char *)relpath; *p; p++)
        h = (h ^ *p) * 0x100000001b3ull;
    h ^= seed; /* SplitMix64's finaliser spreads the seed over all bits */
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    return h ^ (h >> 31);
}

uint64_t stk_holdout_count(uint64_t n, double f)
{
    if (n < 2)
        return 0;
    uint64_t k = (uint64_t)(f * (double)n + 0.5);
    return k < 1 ? 1 : k > n - 1 ? n - 1 : k;
}
int stk_source_nsplits(const stk_source *s) { return s->nsplits; }
const char *stk_source_split_name(const stk_source *s, int i)
{
    return s->split_name[i];
}
uint64_t stk_source_split_count(const stk_source *s, int i)
{
    return s->split_count[i];
}
int stk_source_nclasses(const stk_source *s) { return s->nclasses; }
int32_t stk_source_label(const stk_source *s, int split, uint64_t i)
{
    return s->ops->label ? s->ops->label(s, split, i) : -1;
}
const char *stk_source_notice(const stk_source *s) { return s->notice; }

void stk_source_name_classes(const stk_source *s, const unsigned char *which,
                             const char *what, char *buf, size_t cap)
{
    size_t start = strlen(buf), u = start;
    int n = 0;
    for (int c = 0; c < s->nclasses && u < cap; c++) {
        if (!which[c] || n++ >= 3)
            continue;
        const char *name = s->classes[c];
        size_t len = strlen(name), keep = len > 40 ? stk_utf8_fit(name, 40) : len;
        int w = stk_snprintf_text(buf + u, cap - u, "%s\"%.*s%s\"",
                                  u > start ? ", " : start ? "\n" : "",
                                  (int)keep, name, keep < len ? "..." : "");
        u += w > 0 ? (size_t)w : 0;
    }
    if (n && u < cap)
        stk_snprintf_text(buf + u, cap - u, "%s: %d class(es) %s",
                          n > 3 ? " and others" : "", n, what);
}
const char *stk_source_class_name(const stk_source *s, int i)
{
    return s->classes[i];
}

bool stk_source_variable(const stk_source *s, int *short_side, int *max_side)
{
    *short_side = s->short_side;
    *max_side = s->max_side;
    return s->max_side > 0;
}

void stk_source_shape(const stk_source *s, int *c, int *h, int *w)
{
    *c = s->out_c;
    if (s->max_side) {
        *h = *w = 0;
        return;
    }
    *h = s->size ? s->size : s->native_h;
    *w = s->size ? s->size : s->native_w;
}

const char *stk_source_sample_file(const stk_source *s, int split, uint64_t i)
{
    return s->ops->file ? s->ops->file(s, split, i) : s->dir;
}

const char *stk_source_error_reason(const stk_source *s, int split, uint64_t i,
                                    const char *msg)
{
    const char *file = stk_source_sample_file(s, split, i);
    size_t n = strlen(file);
    return strncmp(msg, file, n) || strncmp(msg + n, ": ", 2) ? msg
                                                              : msg + n + 2;
}

int stk_source_load(const stk_source *s, stk_decoder *d, int split,
                    uint64_t i, int32_t *label, uint8_t *pixels, stk_err *err)
{
    stk_image im = {0};
    int owned = 0;
    int rc = s->ops->load(s, d, split, i, label, &im, &owned, err);
    if (rc)
        return rc;
    const char *file = stk_source_sample_file(s, split, i);
    if (!s->size && (im.w != s->native_w || im.h != s->native_h))
        rc = stk_fail(err, STK_EFORMAT, "%s: sample %llu is %dx%d, not %dx%d",
                      file, (unsigned long long)i, im.w, im.h, s->native_w,
                      s->native_h);
    else if (stk_image_fit(&im, s->out_c, s->size, pixels))
        rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", file);
    if (owned)
        stk_image_free(&im);
    return rc;
}

int stk_source_load_image(const stk_source *s, stk_decoder *d, int split,
                          uint64_t i, int32_t *label, stk_image *im,
                          bool *owned, stk_err *err)
{
    int own = 0;
    *im = (stk_image){0};
    int rc = s->ops->load(s, d, split, i, label, im, &own, err);
    *owned = !rc && own;
    return rc;
}

/* Grows *px to at least need bytes. */
static int reserve(uint8_t **px, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    uint8_t *p = realloc(*px, need);
    if (!p)
        return STK_ENOMEM;
    *px = p;
    *cap = need;
    return 0;
}

int stk_source_load_any(const stk_source *s, stk_decoder *d, int split,
                        uint64_t i, int32_t *label, uint8_t **px, size_t *cap,
                        int *h, int *w, stk_err *err)
{
    const char *file = stk_source_sample_file(s, split, i);
    int c;
    stk_source_shape(s, &c, h, w);
    if (!s->max_side) /* fixed size */
        return reserve(px, cap, (size_t)c * *h * *w)
                   ? stk_fail(err, STK_ENOMEM, "%s: out of memory", file)
                   : stk_source_load(s, d, split, i, label, *px, err);
    stk_image im = {0};
    int owned = 0;
    int rc = s->ops->load(s, d, split, i, label, &im, &owned, err);
    if (rc)
        return rc;
    stk_image_keep_aspect(im.w, im.h, s->short_side, s->max_side, s->upscale,
                          w, h);
    if (reserve(px, cap, (size_t)c * *h * *w) ||
        stk_image_resize(&im, c, *w, *h, *px))
        rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", file);
    if (owned)
        stk_image_free(&im);
    return rc;
}
