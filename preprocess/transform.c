/* transform.c - torchvision's image transforms on 8-bit pixel views:
 * RandomResizedCrop's box and resampling, Resize + CenterCrop. Pure: the
 * caller draws the uniforms (the loader from Philox), so the same draws
 * give the same pixels anywhere. */
#include "resample.h"

#include <math.h>
#include <string.h>

stk_pixview stk_pixview_hwc(const uint8_t *px, int w, int h, int c)
{
    return (stk_pixview){.px = px, .w = w, .h = h, .c = c, .xs = c,
                         .ys = (ptrdiff_t)w * c, .cs = 1};
}

stk_pixview stk_pixview_chw(const uint8_t *px, int c, int h, int w)
{
    return (stk_pixview){.px = px, .w = w, .h = h, .c = c, .xs = 1,
                         .ys = w, .cs = (ptrdiff_t)w * h};
}

int stk_rrc_box(int h, int w, const double scale[2], const double ratio[2],
                const double *u, stk_box *b)
{
    double area = (double)h * w;
    /* torch.log(torch.tensor(ratio)) is float32 */
    double lr0 = logf((float)ratio[0]), lr1 = logf((float)ratio[1]);
    int n = 0;
    for (int attempt = 0; attempt < 10; attempt++) {
        double target = area * (scale[0] + u[n++] * (scale[1] - scale[0]));
        double aspect = exp(lr0 + u[n++] * (lr1 - lr0));
        /* Python's round(): halves to even, as nearbyint by default */
        int cw = (int)nearbyint(sqrt(target * aspect));
        int ch = (int)nearbyint(sqrt(target / aspect));
        if (cw > 0 && cw <= w && ch > 0 && ch <= h) {
            int top = (int)floor(u[n++] * (h - ch + 1));
            int left = (int)floor(u[n++] * (w - cw + 1));
            *b = (stk_box){.top = top < h - ch ? top : h - ch,
                           .left = left < w - cw ? left : w - cw,
                           .h = ch, .w = cw};
            return n;
        }
    }
    double in_ratio = (double)w / h, lo = fmin(ratio[0], ratio[1]),
           hi = fmax(ratio[0], ratio[1]);
    int cw = w, ch = h;
    if (in_ratio < lo)
        ch = (int)nearbyint(cw / lo);
    else if (in_ratio > hi)
        cw = (int)nearbyint(ch * hi);
    *b = (stk_box){.top = (h - ch) / 2, .left = (w - cw) / 2, .h = ch,
                   .w = cw};
    return n;
}

/* v in out_c channels: v itself, or its conversion in scratch. */
static int as_channels(const stk_pixview *v, int out_c, stk_xform_scratch *s,
                       stk_pixview *out)
{
    *out = *v;
    if (v->c == out_c)
        return 0;
    uint8_t *px = stk_scratch_get(s, STK_SCRATCH_CONV,
                                  (size_t)v->w * v->h * out_c);
    if (!px)
        return STK_ENOMEM;
    stk_convert(v, out_c, px);
    *out = stk_pixview_hwc(px, v->w, v->h, out_c);
    return 0;
}

/* Resamples v to ow x oh, keeps the cw x ch window at (left, top) and
 * writes it CHW, mirrored when flip. */
static int window_chw(const stk_pixview *v, int ow, int oh, int left,
                      int top, int cw, int ch, bool flip, int out_c,
                      stk_xform_scratch *s, uint8_t *chw)
{
    stk_pixview in;
    int rc = as_channels(v, out_c, s, &in);
    return rc ? rc
              : stk_resample(&in, ow, oh, left, top, cw, ch, flip, s, chw);
}

int stk_resized_crop(const stk_pixview *v, stk_box b, int size, bool flip,
                     int out_c, stk_xform_scratch *s, uint8_t *chw)
{
    stk_pixview sub = *v; /* PIL's crop: a view, nothing copied */
    sub.px += b.top * v->ys + b.left * v->xs;
    sub.w = b.w;
    sub.h = b.h;
    return window_chw(&sub, size, size, 0, 0, size, size, flip, out_c, s,
                      chw);
}

/* Python's round() of d/2 for d >= 0: halves go to the even neighbour. */
static int half_even(int d)
{
    int h = d / 2;
    return (d % 2 && h % 2) ? h + 1 : h;
}

int stk_centre_crop(const stk_pixview *v, int resize, int size, int out_c,
                    stk_xform_scratch *s, uint8_t *chw)
{
    int w = v->w, h = v->h, ow = w, oh = h;
    if (resize > 0) { /* shorter side to resize, longer scaled, truncated */
        if (w <= h) {
            ow = resize;
            oh = (int)((int64_t)resize * h / w);
        } else {
            oh = resize;
            ow = (int)((int64_t)resize * w / h);
        }
    }
    int cw = size > 0 ? size : ow, ch = size > 0 ? size : oh;
    return window_chw(v, ow, oh, half_even(ow - cw), half_even(oh - ch), cw,
                      ch, false, out_c, s, chw);
}

int stk_image_fit(const stk_image *src, int out_c, int size, uint8_t *chw)
{
    stk_pixview v = stk_pixview_hwc(src->px, src->w, src->h, src->c);
    stk_xform_scratch s = {0};
    int rc = stk_centre_crop(&v, size, size, out_c, &s, chw);
    stk_xform_scratch_free(&s);
    return rc;
}

int stk_image_resize(const stk_image *src, int out_c, int ow, int oh,
                     uint8_t *chw)
{
    stk_pixview v = stk_pixview_hwc(src->px, src->w, src->h, src->c);
    stk_xform_scratch s = {0};
    int rc = window_chw(&v, ow, oh, 0, 0, ow, oh, false, out_c, &s, chw);
    stk_xform_scratch_free(&s);
    return rc;
}
