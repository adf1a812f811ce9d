/* resize.c - channel conversion and antialiased bilinear resampling of a
 * window of a resized pixel view (stk_resample, for transform.c).
 *
 * The arithmetic follows PIL's BILINEAR resampling (triangle filter widened
 * by the downscale factor, 22-bit fixed-point weights, horizontal pass
 * rounded to 8 bits, then vertical pass) and torchvision's Resize(S) +
 * CenterCrop(S) geometry, so a database agrees with what a PyTorch
 * ImageFolder pipeline would have produced. Only the cropped window is
 * computed. */
#include "resample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define PRECISION_BITS 22

/* Filter taps of one output position: weights for in[first..first+n). */
typedef struct taps {
    int first, n;
    int32_t *w;
} taps;

typedef struct coeffs {
    int ksize;
    taps *t;     /* one per cropped output position */
} coeffs;

_Static_assert(STK_SCRATCH_N ==
                   sizeof((stk_xform_scratch *)0)->buf / sizeof(void *),
               "stk_xform_scratch holds one buffer per STK_SCRATCH_ slot");

/* Scratch buffer i holding at least bytes; NULL when out of memory. */
void *stk_scratch_get(stk_xform_scratch *s, int i, size_t bytes)
{
    if (s->cap[i] < bytes) {
        void *p = realloc(s->buf[i], bytes);
        if (!p)
            return NULL;
        s->buf[i] = p;
        s->cap[i] = bytes;
    }
    return s->buf[i];
}

void stk_xform_scratch_free(stk_xform_scratch *s)
{
    for (int i = 0; i < STK_SCRATCH_N; i++) {
        free(s->buf[i]);
        s->buf[i] = NULL;
        s->cap[i] = 0;
    }
}

static double triangle(double x)
{
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

static int32_t fixed(double v)
{
    return (int32_t)(v < 0 ? v * (1 << PRECISION_BITS) - 0.5
                           : v * (1 << PRECISION_BITS) + 0.5);
}

/* Weights for output positions first..first+count-1 of a resize from in_size
 * to out_size samples, in scratch buffer slot. */
static int coeffs_make(coeffs *c, int in_size, int out_size, int first,
                       int count, stk_xform_scratch *s, int slot)
{
    double scale = (double)in_size / out_size;
    double fscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * fscale;
    c->ksize = (int)ceil(support) * 2 + 1;
    size_t nt = (size_t)count * sizeof *c->t, nk = c->ksize * sizeof(double);
    uint8_t *mem = stk_scratch_get(
        s, slot, nt + nk + (size_t)count * c->ksize * sizeof(int32_t));
    if (!mem)
        return STK_ENOMEM;
    c->t = (taps *)mem;
    double *k = (double *)(mem + nt);
    int32_t *w = (int32_t *)(mem + nt + nk);
    for (int o = 0; o < count; o++) {
        double center = (first + o + 0.5) * scale, sum = 0.0;
        int lo = (int)(center - support + 0.5);
        int hi = (int)(center + support + 0.5);
        lo = lo < 0 ? 0 : lo;
        hi = hi > in_size ? in_size : hi;
        taps *t = &c->t[o];
        t->first = lo;
        t->n = hi - lo;
        t->w = w + (size_t)o * c->ksize;
        for (int x = 0; x < t->n; x++) {
            k[x] = triangle((x + lo - center + 0.5) / fscale);
            sum += k[x];
        }
        for (int x = 0; x < t->n; x++)
            t->w[x] = fixed(sum != 0.0 ? k[x] / sum : k[x]);
    }
    return 0;
}

/* A sum's 8-bit sample, as a max and a min that vectorise. */
static inline uint8_t clip8(int32_t acc)
{
    int32_t v = acc >> PRECISION_BITS;
    v = v < 0 ? 0 : v;
    return (uint8_t)(v > 255 ? 255 : v);
}

/* Weights are >= 0 and sum to 1 << 22, so 255 * (1 << 22) plus the
 * rounding half fits an int32, as in PIL. */
#define HALF (1 << (PRECISION_BITS - 1))

/* Taps t applied down the columns of rows (the first tap's row, rows len
 * bytes apart) into len outputs: sums of whole rows into acc, contiguous
 * loops that the compiler vectorises. x86-64's baseline SSE2 lacks 32-bit
 * multiplies, so an AVX2 clone too (picked at load time by the CPU; integer
 * arithmetic, the same bytes). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(__SANITIZE_THREAD__) /* its resolver runs before TSan's start */
__attribute__((target_clones("avx2", "default")))
#endif
static void
taps_down(const uint8_t *rows, int len, const taps *t, int32_t *acc,
          uint8_t *out)
{
    for (int x = 0; x < len; x++)
        acc[x] = HALF;
    for (int k = 0; k < t->n; k++, rows += len) {
        int32_t w = t->w[k];
        for (int x = 0; x < len; x++)
            acc[x] += rows[x] * w;
    }
    for (int x = 0; x < len; x++)
        out[x] = clip8(acc[x]);
}

/* dst[x * ny + y] = src[y * ys + x * xs] for x < bx, y < by: one tile of
 * a transpose, unrolled where inlined with constant sizes. */
static inline void tile(const uint8_t *src, ptrdiff_t xs, ptrdiff_t ys, int bx,
                        int by, int ny, uint8_t *dst)
{
    for (int x = 0; x < bx; x++)
        for (int y = 0; y < by; y++)
            dst[(size_t)x * ny + y] = src[y * ys + x * xs];
}

/* dst[x * ny + y] = src[y * ys + x * xs] for x < nx, y < ny, in tiles that
 * keep both sides in cache; whole tiles of a contiguous src (xs 1) get
 * unrolled copies. */
static void transpose(const uint8_t *src, ptrdiff_t xs, ptrdiff_t ys, int nx,
                      int ny, uint8_t *dst)
{
    enum { TILE = 16 };
    for (int y0 = 0; y0 < ny; y0 += TILE)
        for (int x0 = 0; x0 < nx; x0 += TILE) {
            const uint8_t *s = src + y0 * ys + x0 * xs;
            uint8_t *d = dst + (size_t)x0 * ny + y0;
            int bx = nx - x0 < TILE ? nx - x0 : TILE;
            int by = ny - y0 < TILE ? ny - y0 : TILE;
            if (bx < TILE || by < TILE)
                tile(s, xs, ys, bx, by, ny, d);
            else if (xs == 1)
                tile(s, 1, ys, TILE, TILE, ny, d);
            else
                tile(s, xs, ys, TILE, TILE, ny, d);
        }
}

/* Converts channels of v into HWC out: 3 -> 1 with PIL's "L" luma, 1 -> 3
 * by replication, or a copy. */
void stk_convert(const stk_pixview *v, int out_c, uint8_t *out)
{
    for (int y = 0; y < v->h; y++)
        for (int x = 0; x < v->w; x++, out += out_c) {
            const uint8_t *p = v->px + y * v->ys + x * v->xs;
            if (v->c == 3 && out_c == 1)
                out[0] = (uint8_t)((p[0] * 19595 + p[v->cs] * 38470 +
                                    p[2 * v->cs] * 7471 + 0x8000) >> 16);
            else
                for (int k = 0; k < out_c; k++)
                    out[k] = p[v->c == 1 ? 0 : k * v->cs];
        }
}

/* The range [*lo, *hi) of input samples that outputs first..first+n of c
 * read (those outputs themselves without a resize). */
static void span(const coeffs *c, int first, int n, int *lo, int *hi)
{
    *lo = c->t ? c->t[0].first : first;
    *hi = c->t ? c->t[n - 1].first + c->t[n - 1].n : first + n;
}

/* One pass of c down the columns of src (rows len bytes apart, row 0 input
 * sample lo): output row i of n (in reverse order when mirror) from taps
 * c->t[i], or input sample first + i when c does not resize. */
static void pass(const uint8_t *src, int len, int lo, const coeffs *c,
                 int first, int n, bool mirror, int32_t *acc, uint8_t *dst)
{
    for (int i = 0; i < n; i++) {
        const taps *t = c->t ? &c->t[i] : NULL;
        int row = (t ? t->first : first + i) - lo;
        const uint8_t *r = src + (size_t)row * len;
        uint8_t *o = dst + (size_t)(mirror ? n - 1 - i : i) * len;
        if (t)
            taps_down(r, len, t, acc, o);
        else
            memcpy(o, r, len);
    }
}

int stk_resample(const stk_pixview *in, int ow, int oh, int left, int top,
                 int cw, int ch, bool flip, stk_xform_scratch *s, uint8_t *chw)
{
    coeffs cx = {0}, cy = {0};
    int rc = 0;
    if (ow != in->w)
        rc = coeffs_make(&cx, in->w, ow, left, cw, s, STK_SCRATCH_CX);
    if (!rc && oh != in->h)
        rc = coeffs_make(&cy, in->h, oh, top, ch, s, STK_SCRATCH_CY);
    if (rc)
        return rc;
    int x0, x1, y0, y1; /* the input window that the output reads */
    span(&cx, left, cw, &x0, &x1);
    span(&cy, top, ch, &y0, &y1);
    int nx = x1 - x0, ny = y1 - y0, wide = nx > cw ? nx : cw;
    /* the window transposed (then the vertical pass's input), and the
     * horizontal pass's columns */
    uint8_t *win =
        stk_scratch_get(s, STK_SCRATCH_MID, (size_t)(wide + cw) * ny);
    int32_t *acc = stk_scratch_get(s, STK_SCRATCH_ACC,
                                   (size_t)(ny > cw ? ny : cw) * sizeof *acc);
    if (!win || !acc)
        return STK_ENOMEM;
    uint8_t *cols = win + (size_t)wide * ny;
    /* A plane at a time, both passes down contiguous rows (vectorised):
     * the horizontal one on the transposed window, mirrored there when
     * flip, the vertical one on its result transposed back, into CHW. */
    for (int k = 0; k < in->c; k++) {
        transpose(in->px + k * in->cs + y0 * in->ys + x0 * in->xs, in->xs,
                  in->ys, nx, ny, win);
        pass(win, ny, x0, &cx, left, cw, flip, acc, cols);
        transpose(cols, 1, ny, ny, cw, win);
        pass(win, cw, y0, &cy, top, ch, false, acc, chw + (size_t)k * cw * ch);
    }
    return 0;
}

void stk_image_keep_aspect(int w, int h, int short_side, int max_side,
                           bool upscale, int *ow, int *oh)
{
    int64_t s = w <= h ? w : h, l = w <= h ? h : w;
    int64_t ns = s, nl = l;
    if (short_side > 0) { /* torchvision's Resize(short_side) */
        ns = short_side;
        nl = (int64_t)short_side * l / s;
    }
    if (max_side > 0 && nl > max_side) { /* and its max_size */
        ns = (int64_t)max_side * ns / nl;
        nl = max_side;
    }
    if (ns < 1)
        ns = 1;
    if (!upscale && nl >= l) /* not a reduction: kept as it is */
        ns = s, nl = l;
    *ow = (int)(w <= h ? ns : nl);
    *oh = (int)(w <= h ? nl : ns);
}
