/* resize.c - channel conversion, antialiased bilinear resize of the shorter
 * side and centre crop, HWC -> CHW.
 *
 * The arithmetic follows PIL's BILINEAR resampling (triangle filter widened
 * by the downscale factor, 22-bit fixed-point weights, horizontal pass
 * rounded to 8 bits, then vertical pass) and torchvision's Resize(S) +
 * CenterCrop(S) geometry, so a database agrees with what a PyTorch
 * ImageFolder pipeline would have produced. Only the cropped window is
 * computed. */
#include "preprocess.h"

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
    int32_t *w;  /* ksize weights per position */
} coeffs;

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
 * to out_size samples. */
static int coeffs_make(coeffs *c, int in_size, int out_size, int first,
                       int count)
{
    double scale = (double)in_size / out_size;
    double fscale = scale < 1.0 ? 1.0 : scale;
    double support = 1.0 * fscale;
    c->ksize = (int)ceil(support) * 2 + 1;
    c->t = calloc((size_t)count, sizeof *c->t);
    c->w = calloc((size_t)count * c->ksize, sizeof *c->w);
    double *k = malloc((size_t)c->ksize * sizeof *k);
    if (!c->t || !c->w || !k) {
        free(k);
        return STK_ENOMEM;
    }
    for (int o = 0; o < count; o++) {
        double center = (first + o + 0.5) * scale, sum = 0.0;
        int lo = (int)(center - support + 0.5);
        int hi = (int)(center + support + 0.5);
        lo = lo < 0 ? 0 : lo;
        hi = hi > in_size ? in_size : hi;
        taps *t = &c->t[o];
        t->first = lo;
        t->n = hi - lo;
        t->w = c->w + (size_t)o * c->ksize;
        for (int x = 0; x < t->n; x++) {
            k[x] = triangle((x + lo - center + 0.5) / fscale);
            sum += k[x];
        }
        for (int x = 0; x < t->n; x++)
            t->w[x] = fixed(sum != 0.0 ? k[x] / sum : k[x]);
    }
    free(k);
    return 0;
}

static void coeffs_free(coeffs *c)
{
    free(c->t);
    free(c->w);
}

static uint8_t clip8(int32_t acc)
{
    acc >>= PRECISION_BITS;
    return (uint8_t)(acc < 0 ? 0 : acc > 255 ? 255 : acc);
}

/* Filter taps applied along a line whose samples are stride bytes apart,
 * for 1 or 3 interleaved channels. Weights are >= 0 and sum to 1 << 22, so
 * 255 * (1 << 22) plus the rounding half fits an int32, as in PIL. */
#define HALF (1 << (PRECISION_BITS - 1))

static inline void tap1(const uint8_t *p, size_t stride, const taps *t,
                        uint8_t *out)
{
    int32_t a = HALF;
    p += (size_t)t->first * stride;
    for (int x = 0; x < t->n; x++, p += stride)
        a += p[0] * t->w[x];
    out[0] = clip8(a);
}

static inline void tap3(const uint8_t *p, size_t stride, const taps *t,
                        uint8_t *out)
{
    int32_t a = HALF, b = HALF, c = HALF;
    p += (size_t)t->first * stride;
    for (int x = 0; x < t->n; x++, p += stride) {
        int32_t w = t->w[x];
        a += p[0] * w;
        b += p[1] * w;
        c += p[2] * w;
    }
    out[0] = clip8(a);
    out[1] = clip8(b);
    out[2] = clip8(c);
}

/* One output line: n outputs, output i from taps t[i] (or one tap set for
 * all outputs when ts is NULL, with in advancing by step per output). */
static void tap_line(const uint8_t *in, size_t stride, size_t step, int c,
                     const taps *t, const taps *one, int n, uint8_t *out)
{
    for (int i = 0; i < n; i++, out += c, in += step) {
        const taps *ti = one ? one : &t[i];
        if (c == 3)
            tap3(in, stride, ti, out);
        else
            tap1(in, stride, ti, out);
    }
}

/* Python's round() of d/2 for d >= 0: halves go to the even neighbour. */
static int half_even(int d)
{
    int h = d / 2;
    return (d % 2 && h % 2) ? h + 1 : h;
}

/* Converts channels: 3 -> 1 with PIL's "L" luma, 1 -> 3 by replication. */
static uint8_t *convert(const stk_image *src, int out_c)
{
    size_t n = (size_t)src->w * src->h;
    uint8_t *px = malloc(n * out_c);
    if (!px)
        return NULL;
    const uint8_t *s = src->px;
    if (src->c == out_c)
        memcpy(px, s, n * out_c);
    else if (out_c == 1)
        for (size_t i = 0; i < n; i++)
            px[i] = (uint8_t)((s[3 * i] * 19595 + s[3 * i + 1] * 38470 +
                               s[3 * i + 2] * 7471 + 0x8000) >> 16);
    else
        for (size_t i = 0; i < n; i++)
            px[3 * i] = px[3 * i + 1] = px[3 * i + 2] = s[i];
    return px;
}

/* Resizes w x h (c channels) to ow x oh and keeps the window
 * [left, left+cw) x [top, top+ch) as HWC in out. The horizontal pass runs
 * only over the rows the vertical pass reads. */
static int resample(const uint8_t *in, int w, int h, int c, int ow, int oh,
                    int left, int top, int cw, int ch, uint8_t *out)
{
    coeffs cx = {0}, cy = {0};
    uint8_t *mid = malloc((size_t)h * cw * c);
    int rc = mid ? 0 : STK_ENOMEM;
    if (!rc && ow != w)
        rc = coeffs_make(&cx, w, ow, left, cw);
    if (!rc && oh != h)
        rc = coeffs_make(&cy, h, oh, top, ch);
    int y0 = top, y1 = top + ch; /* rows of in that the output needs */
    if (!rc && oh != h) {
        y0 = cy.t[0].first;
        y1 = cy.t[ch - 1].first + cy.t[ch - 1].n;
    }
    size_t row = (size_t)cw * c;
    for (int y = y0; !rc && y < y1; y++) {
        const uint8_t *src = in + (size_t)y * w * c;
        uint8_t *dst = mid + (size_t)y * row;
        if (ow == w)
            memcpy(dst, src + (size_t)left * c, row);
        else
            tap_line(src, (size_t)c, 0, c, cx.t, NULL, cw, dst);
    }
    for (int y = 0; !rc && y < ch; y++) {
        uint8_t *dst = out + (size_t)y * row;
        if (oh == h)
            memcpy(dst, mid + (size_t)(top + y) * row, row);
        else
            tap_line(mid, row, (size_t)c, c, NULL, &cy.t[y], cw, dst);
    }
    coeffs_free(&cx);
    coeffs_free(&cy);
    free(mid);
    return rc;
}

/* Resizes src (converted to out_c channels) to ow x oh and keeps the
 * window [left, left+cw) x [top, top+ch), written CHW to chw. */
static int fit_window(const stk_image *src, int out_c, int ow, int oh,
                      int left, int top, int cw, int ch, uint8_t *chw)
{
    uint8_t *conv = convert(src, out_c);
    uint8_t *hwc = malloc((size_t)cw * ch * out_c);
    int rc = conv && hwc ? resample(conv, src->w, src->h, out_c, ow, oh, left,
                                    top, cw, ch, hwc)
                         : STK_ENOMEM;
    if (!rc) { /* HWC -> CHW */
        size_t plane = (size_t)cw * ch;
        for (size_t i = 0; i < plane; i++)
            for (int k = 0; k < out_c; k++)
                chw[k * plane + i] = hwc[i * out_c + k];
    }
    free(conv);
    free(hwc);
    return rc;
}

int stk_image_fit(const stk_image *src, int out_c, int size, uint8_t *chw)
{
    int w = src->w, h = src->h;
    int ow = w, oh = h, cw = w, ch = h;
    if (size > 0) { /* shorter side to size, longer scaled and truncated */
        if (w <= h) {
            ow = size;
            oh = (int)((int64_t)size * h / w);
        } else {
            oh = size;
            ow = (int)((int64_t)size * w / h);
        }
        cw = ch = size;
    }
    int left = half_even(ow - cw), top = half_even(oh - ch);
    return fit_window(src, out_c, ow, oh, left, top, cw, ch, chw);
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

int stk_image_resize(const stk_image *src, int out_c, int ow, int oh,
                     uint8_t *chw)
{
    return fit_window(src, out_c, ow, oh, 0, 0, ow, oh, chw);
}
