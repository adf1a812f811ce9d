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

static uint8_t clip8(int64_t acc)
{
    acc >>= PRECISION_BITS;
    return (uint8_t)(acc < 0 ? 0 : acc > 255 ? 255 : acc);
}

/* Applies taps along a line of n samples spaced stride apart, per channel. */
static uint8_t tap(const uint8_t *in, size_t stride, const taps *t)
{
    int64_t acc = (int64_t)1 << (PRECISION_BITS - 1);
    for (int x = 0; x < t->n; x++)
        acc += (int64_t)in[(size_t)(t->first + x) * stride] * t->w[x];
    return clip8(acc);
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
 * [left, left+cw) x [top, top+ch) as HWC in out. */
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
    for (int y = 0; !rc && y < h; y++) /* horizontal pass, every row */
        for (int x = 0; x < cw; x++)
            for (int k = 0; k < c; k++)
                mid[((size_t)y * cw + x) * c + k] =
                    ow != w ? tap(in + (size_t)y * w * c + k, (size_t)c,
                                  &cx.t[x])
                            : in[((size_t)y * w + left + x) * c + k];
    for (int y = 0; !rc && y < ch; y++) /* vertical pass, cropped rows */
        for (int x = 0; x < cw; x++)
            for (int k = 0; k < c; k++)
                out[((size_t)y * cw + x) * c + k] =
                    oh != h ? tap(mid + (size_t)x * c + k, (size_t)cw * c,
                                  &cy.t[y])
                            : mid[((size_t)(top + y) * cw + x) * c + k];
    coeffs_free(&cx);
    coeffs_free(&cy);
    free(mid);
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
    uint8_t *conv = convert(src, out_c);
    uint8_t *hwc = malloc((size_t)cw * ch * out_c);
    int rc = conv && hwc ? resample(conv, w, h, out_c, ow, oh, left, top, cw,
                                    ch, hwc)
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
