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
#define STK_MAX_CHANNELS_FIT 3

/* Filter taps of one output position: weights for in[first..first+n). */
typedef struct taps {
    int first, n;
    int32_t *w;
} taps;

typedef struct coeffs {
    int ksize;
    taps *t;     /* one per cropped output position */
} coeffs;

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

/* Filter taps applied along a line whose samples are stride bytes apart,
 * for 1 or 3 channels cs bytes apart. Weights are >= 0 and sum to 1 << 22, so
 * 255 * (1 << 22) plus the rounding half fits an int32, as in PIL. */
#define HALF (1 << (PRECISION_BITS - 1))

static inline void tap1(const uint8_t *p, ptrdiff_t stride, const taps *t,
                        uint8_t *out)
{
    int32_t a = HALF;
    p += t->first * stride;
    for (int x = 0; x < t->n; x++, p += stride)
        a += p[0] * t->w[x];
    out[0] = clip8(a);
}

static inline void tap3(const uint8_t *p, ptrdiff_t stride, ptrdiff_t cs,
                        const taps *t, uint8_t *out)
{
    int32_t a = HALF, b = HALF, c = HALF;
    p += t->first * stride;
    for (int x = 0; x < t->n; x++, p += stride) {
        int32_t w = t->w[x];
        a += p[0] * w;
        b += p[cs] * w;
        c += p[2 * cs] * w;
    }
    out[0] = clip8(a);
    out[1] = clip8(b);
    out[2] = clip8(c);
}

/* One output line: n outputs (HWC), output i from taps t[i] (or one tap set
 * for all outputs when t is NULL, with in advancing by step per output). */
static void tap_line(const uint8_t *in, ptrdiff_t stride, ptrdiff_t cs,
                     ptrdiff_t step, int c, const taps *t, const taps *one,
                     int n, uint8_t *out)
{
    for (int i = 0; i < n; i++, out += c, in += step) {
        const taps *ti = one ? one : &t[i];
        if (c == 3)
            tap3(in, stride, cs, ti, out);
        else
            tap1(in, stride, ti, out);
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

int stk_resample(const stk_pixview *in, int ow, int oh, int left, int top,
                 int cw, int ch, stk_xform_scratch *s, uint8_t *out)
{
    int w = in->w, h = in->h, c = in->c;
    coeffs cx = {0}, cy = {0};
    uint8_t *mid = stk_scratch_get(s, STK_SCRATCH_MID, (size_t)h * cw * c);
    int rc = mid ? 0 : STK_ENOMEM;
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
    size_t row = (size_t)cw * c;
    for (int y = y0; y < y1; y++) {
        const uint8_t *src = in->px + y * in->ys;
        uint8_t *dst = mid + (size_t)y * row;
        if (ow != w)
            tap_line(src, in->xs, in->cs, 0, c, cx.t, NULL, cw, dst);
        else /* a copy through the view's strides */
            for (int x = 0; x < cw; x++)
                for (int k = 0; k < c; k++)
                    dst[x * c + k] = src[(left + x) * in->xs + k * in->cs];
    }
    for (int y = 0; y < ch; y++) {
        uint8_t *dst = out + (size_t)y * row;
        if (oh == h)
            memcpy(dst, mid + (size_t)(top + y) * row, row);
        else
            tap_line(mid, (ptrdiff_t)row, 1, c, c, NULL, &cy.t[y], cw, dst);
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
