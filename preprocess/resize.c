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

_Static_assert(STK_SCRATCH_N == sizeof ((stk_xform_scratch *)0)->buf /
                                    sizeof(void *),
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

static uint8_t clip8(int32_t acc)
{
    acc >>= PRECISION_BITS;
    return (uint8_t)(acc < 0 ? 0 : acc > 255 ? 255 : acc);
}

/* Weights are >= 0 and sum to 1 << 22, so 255 * (1 << 22) plus the
 * rounding half fits an int32, as in PIL. */
#define HALF (1 << (PRECISION_BITS - 1))

/* The horizontal pass of nr rows of a plane (samples xs apart, rows ys
 * apart) into cw outputs each (rows cw bytes apart), mirrored when flip: the
 * vertical pass then keeps the mirror. Rows share each output's taps, so
 * several at a time load the taps once; nr is a constant where inlined. */
enum { ROWS = 4 };

static inline void rows_h(const uint8_t *src, ptrdiff_t xs, ptrdiff_t ys,
                          int nr, const taps *t, int cw, bool flip,
                          uint8_t *out)
{
    for (int x = 0; x < cw; x++) {
        const uint8_t *p = src + t[x].first * xs;
        int32_t a[ROWS];
        for (int j = 0; j < nr; j++)
            a[j] = HALF;
        for (int k = 0; k < t[x].n; k++, p += xs)
            for (int j = 0; j < nr; j++)
                a[j] += p[j * ys] * t[x].w[k];
        uint8_t *o = out + (flip ? cw - 1 - x : x);
        for (int j = 0; j < nr; j++)
            o[(size_t)j * cw] = clip8(a[j]);
    }
}

/* The vertical pass of one output row: taps t down the columns of mid
 * (rows cw bytes apart), summed a whole row at a time into acc, loops over
 * contiguous rows that the compiler vectorises. x86-64's baseline SSE2
 * lacks 32-bit multiplies, so an AVX2 clone too (picked at load time by the
 * CPU; integer arithmetic, the same bytes). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
static void row_v(const uint8_t *mid, int cw, const taps *t, int32_t *acc,
                  uint8_t *out)
{
    for (int x = 0; x < cw; x++)
        acc[x] = HALF;
    const uint8_t *r = mid + (size_t)t->first * cw;
    for (int k = 0; k < t->n; k++, r += cw) {
        int32_t w = t->w[k];
        for (int x = 0; x < cw; x++)
            acc[x] += r[x] * w;
    }
    for (int x = 0; x < cw; x++) { /* clip8, as min and max */
        int32_t v = acc[x] >> PRECISION_BITS;
        v = v < 0 ? 0 : v;
        out[x] = (uint8_t)(v > 255 ? 255 : v);
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

/* Rows y0..y1 of plane px (samples xs apart, rows ys apart) through the
 * horizontal pass (or the window's columns copied when cx is NULL) into mid,
 * whose rows are cw bytes apart and indexed as the plane's. A planar view
 * (xs 1) gets its own inlined copy of the loops, with contiguous taps. */
static void pass_h(const uint8_t *px, ptrdiff_t xs, ptrdiff_t ys,
                   const coeffs *cx, int left, int cw, int y0, int y1,
                   bool flip, uint8_t *mid)
{
    int y = y0;
    for (; cx && y + ROWS <= y1; y += ROWS)
        if (xs == 1)
            rows_h(px + y * ys, 1, ys, ROWS, cx->t, cw, flip,
                   mid + (size_t)y * cw);
        else
            rows_h(px + y * ys, xs, ys, ROWS, cx->t, cw, flip,
                   mid + (size_t)y * cw);
    for (; y < y1; y++) {
        const uint8_t *src = px + y * ys;
        uint8_t *dst = mid + (size_t)y * cw;
        if (cx)
            rows_h(src, xs, ys, 1, cx->t, cw, flip, dst);
        else
            for (int x = 0; x < cw; x++)
                dst[flip ? cw - 1 - x : x] = src[(left + x) * xs];
    }
}

int stk_resample(const stk_pixview *in, int ow, int oh, int left, int top,
                 int cw, int ch, bool flip, stk_xform_scratch *s,
                 uint8_t *chw)
{
    int w = in->w, h = in->h;
    coeffs cx = {0}, cy = {0};
    uint8_t *mid = stk_scratch_get(s, STK_SCRATCH_MID, (size_t)h * cw);
    int32_t *acc = stk_scratch_get(s, STK_SCRATCH_ACC, cw * sizeof *acc);
    int rc = mid && acc ? 0 : STK_ENOMEM;
    if (!rc && ow != w)
        rc = coeffs_make(&cx, w, ow, left, cw, s, STK_SCRATCH_CX);
    if (!rc && oh != h)
        rc = coeffs_make(&cy, h, oh, top, ch, s, STK_SCRATCH_CY);
    if (rc)
        return rc;
    int y0 = top, y1 = top + ch; /* rows of in that the output needs */
    if (oh != h) {
        y0 = cy.t[0].first;
        y1 = cy.t[ch - 1].first + cy.t[ch - 1].n;
    }
    /* one plane at a time, each written straight to its CHW plane */
    for (int k = 0; k < in->c; k++) {
        uint8_t *dst = chw + (size_t)k * cw * ch;
        pass_h(in->px + k * in->cs, in->xs, in->ys, ow != w ? &cx : NULL,
               left, cw, y0, y1, flip, mid);
        for (int y = 0; y < ch; y++, dst += cw)
            if (oh == h)
                memcpy(dst, mid + (size_t)(top + y) * cw, cw);
            else
                row_v(mid, cw, &cy.t[y], acc, dst);
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
