/* image.c - PNG (libspng) and JPEG (TurboJPEG) decoding to 8-bit gray or
 * RGB, colour conversions that match PIL, and PNG writing. */
#include "preprocess.h"

#include <spng.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

struct stk_decoder {
    tjhandle tj;
};

int stk_decoder_create(stk_decoder **out, stk_err *err)
{
    *out = NULL;
    stk_decoder *d = calloc(1, sizeof *d);
    if (!d)
        return stk_fail(err, STK_ENOMEM, "decoder: out of memory");
    d->tj = tjInitDecompress();
    if (!d->tj) {
        free(d);
        return stk_fail(err, STK_ENOMEM, "decoder: TurboJPEG: %s",
                        tjGetErrorStr2(NULL));
    }
    *out = d;
    return 0;
}

void stk_decoder_destroy(stk_decoder *d)
{
    if (!d)
        return;
    tjDestroy(d->tj);
    free(d);
}

void stk_image_free(stk_image *im)
{
    if (im) {
        free(im->px);
        im->px = NULL;
    }
}

/* Images above this many pixels are refused, as PIL refuses twice its
 * MAX_IMAGE_PIXELS: a few KB of PNG or JPEG must not claim gigabytes. */
#define MAX_PIXELS 178956970ull

static int why(char *buf, size_t n, const char *fmt, const char *detail)
{
    snprintf(buf, n, fmt, detail);
    return STK_EFORMAT;
}

/* ---- PNG --------------------------------------------------------------- */

static int decode_png(const uint8_t *data, size_t len, stk_image *out,
                      char *wbuf, size_t wlen)
{
    spng_ctx *ctx = spng_ctx_new(0);
    if (!ctx)
        return STK_ENOMEM;
    struct spng_ihdr ihdr;
    size_t need = 0;
    /* libspng's limits are unlimited by default; its guide for untrusted
     * files asks for image and chunk limits. */
    int rc = spng_set_png_buffer(ctx, data, len);
    if (!rc)
        rc = spng_set_image_limits(ctx, 65535, 65535);
    if (!rc)
        rc = spng_set_chunk_limits(ctx, 16u << 20, 64u << 20);
    if (!rc)
        rc = spng_get_ihdr(ctx, &ihdr);
    if (!rc && (uint64_t)ihdr.width * ihdr.height > MAX_PIXELS) {
        spng_ctx_free(ctx);
        return why(wbuf, wlen, "bad PNG: %s", "more pixels than allowed");
    }
    int gray = !rc && (ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE ||
                       ihdr.color_type == SPNG_COLOR_TYPE_GRAYSCALE_ALPHA);
    /* Gray decodes as RGB8 too (libspng's G8 covers <= 8-bit gray only);
     * the luma of equal R, G, B is that value exactly. */
    if (!rc)
        rc = spng_decoded_image_size(ctx, SPNG_FMT_RGB8, &need);
    uint8_t *rgb = rc ? NULL : malloc(need);
    if (!rc && !rgb)
        rc = SPNG_EMEM;
    if (!rc)
        rc = spng_decode_image(ctx, rgb, need, SPNG_FMT_RGB8, 0);
    spng_ctx_free(ctx);
    if (rc) { /* SPNG_EMEM is also how a chunk over the limits shows */
        free(rgb);
        return why(wbuf, wlen, "bad PNG: %s", spng_strerror(rc));
    }
    out->w = (int)ihdr.width;
    out->h = (int)ihdr.height;
    out->c = 3;
    out->px = rgb;
    if (gray) { /* keep one channel */
        size_t n = (size_t)out->w * out->h;
        for (size_t i = 0; i < n; i++)
            rgb[i] = rgb[3 * i];
        out->c = 1;
    }
    return 0;
}

/* ---- JPEG -------------------------------------------------------------- */

/* PIL's CMYK -> RGB for Adobe-inverted CMYK JPEGs ("CMYK;I"):
 * c = 255 - stored, out = (255 - k) - c * (255 - k) / 255, rounded as PIL's
 * MULDIV255. */
static uint8_t muldiv255(int a, int b)
{
    int t = a * b + 128;
    return (uint8_t)(((t >> 8) + t) >> 8);
}

static void cmyk_to_rgb(const uint8_t *cmyk, uint8_t *rgb, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int nk = cmyk[4 * i + 3]; /* stored inverted: 255 - k */
        for (int ch = 0; ch < 3; ch++) {
            int c = 255 - cmyk[4 * i + ch];
            rgb[3 * i + ch] = (uint8_t)(nk - muldiv255(c, nk));
        }
    }
}

/* Decodes a JPEG scaled by sf in the DCT (TurboJPEG's scaling factors;
 * {1, 1}: full size). */
static int decode_jpeg(stk_decoder *d, const uint8_t *data, size_t len,
                       tjscalingfactor sf, stk_image *out, char *wbuf,
                       size_t wlen)
{
    /* TurboJPEG 2.1 returns success without setting these for a stream that
     * ends before the frame header (tables only). */
    int w = 0, h = 0, subsamp = 0, cs = 0;
    if (len > 0x7fffffffUL ||
        tjDecompressHeader3(d->tj, data, (unsigned long)len, &w, &h, &subsamp,
                            &cs) != 0)
        return why(wbuf, wlen, "bad JPEG: %s", tjGetErrorStr2(d->tj));
    if (w <= 0 || h <= 0)
        return why(wbuf, wlen, "bad JPEG: %s",
                   "no frame header (truncated or tables only)");
    if ((uint64_t)w * h > MAX_PIXELS)
        return why(wbuf, wlen, "bad JPEG: %s", "more pixels than allowed");
    w = TJSCALED(w, sf);
    h = TJSCALED(h, sf);
    int cmyk = cs == TJCS_CMYK || cs == TJCS_YCCK;
    int pf = cs == TJCS_GRAY ? TJPF_GRAY : cmyk ? TJPF_CMYK : TJPF_RGB;
    int c = tjPixelSize[pf];
    uint8_t *px = malloc((size_t)w * h * c);
    if (!px)
        return STK_ENOMEM;
    /* TurboJPEG returns -1 on warnings too. A truncated stream is refused
     * (as PIL refuses it); other warnings, such as extraneous bytes before
     * a marker, leave a complete image that PIL loads, and so do we.
     * TJFLAG_LIMITSCANS stops progressive-scan bombs. */
    if (tjDecompress2(d->tj, data, (unsigned long)len, px, w, 0, h, pf,
                      TJFLAG_LIMITSCANS) != 0 &&
        (tjGetErrorCode(d->tj) != TJERR_WARNING ||
         strstr(tjGetErrorStr2(d->tj), "Premature end"))) {
        free(px);
        return why(wbuf, wlen, "bad JPEG: %s", tjGetErrorStr2(d->tj));
    }
    if (cmyk) {
        uint8_t *rgb = malloc((size_t)w * h * 3);
        if (!rgb) {
            free(px);
            return STK_ENOMEM;
        }
        cmyk_to_rgb(px, rgb, (size_t)w * h);
        free(px);
        px = rgb;
        c = 3;
    }
    out->w = w;
    out->h = h;
    out->c = c;
    out->px = px;
    return 0;
}

int stk_image_decode(stk_decoder *d, const uint8_t *data, size_t len,
                     stk_image *out, char *wbuf, size_t wlen)
{
    memset(out, 0, sizeof *out);
    static const uint8_t png_magic[8] = {0x89, 'P', 'N', 'G', '\r', '\n',
                                         0x1a, '\n'};
    if (len >= 8 && !memcmp(data, png_magic, 8))
        return decode_png(data, len, out, wbuf, wlen);
    if (len >= 3 && data[0] == 0xff && data[1] == 0xd8 && data[2] == 0xff)
        return decode_jpeg(d, data, len, (tjscalingfactor){1, 1}, out, wbuf,
                           wlen);
    return why(wbuf, wlen, "%s",
               len ? "not a PNG or JPEG file (bad magic bytes)"
                   : "an empty file (0 bytes), not a PNG or JPEG");
}

int stk_image_jpeg_size(stk_decoder *d, const uint8_t *data, size_t len,
                        int *w, int *h)
{
    int subsamp, cs;
    *w = *h = 0;
    if (len < 3 || data[0] != 0xff || data[1] != 0xd8 || len > 0x7fffffffUL)
        return 0;
    if (tjDecompressHeader3(d->tj, data, (unsigned long)len, w, h, &subsamp,
                            &cs) != 0 || *w <= 0 || *h <= 0)
        *w = *h = 0;
    return *w > 0;
}

/* box of a w x h image in the image scaled by sf: start floored, end
 * ceiled, so the scaled box covers the original one. */
static stk_box scale_box(stk_box b, int w, int h, tjscalingfactor sf)
{
    int64_t sw = TJSCALED(w, sf), sh = TJSCALED(h, sf);
    int64_t x0 = b.left * sw / w, y0 = b.top * sh / h;
    int64_t x1 = ((int64_t)(b.left + b.w) * sw + w - 1) / w;
    int64_t y1 = ((int64_t)(b.top + b.h) * sh + h - 1) / h;
    x1 = x1 > sw ? sw : x1;
    y1 = y1 > sh ? sh : y1;
    return (stk_box){.top = (int)y0, .left = (int)x0, .h = (int)(y1 - y0),
                     .w = (int)(x1 - x0)};
}

int stk_image_decode_box(stk_decoder *d, const uint8_t *data, size_t len,
                         int size, stk_box *box, stk_image *out, char *wbuf,
                         size_t wlen)
{
    int w, h, n = 0;
    if (!stk_image_jpeg_size(d, data, len, &w, &h))
        return stk_image_decode(d, data, len, out, wbuf, wlen);
    memset(out, 0, sizeof *out);
    tjscalingfactor best = {1, 1}, *sf = tjGetScalingFactors(&n);
    if (2 * size > box->w || 2 * size > box->h)
        n = 0; /* output over half the box: decode full size */
    for (int i = 0; sf && i < n; i++) {
        stk_box s = scale_box(*box, w, h, sf[i]);
        /* at most half size, and the smallest that still covers the
         * output */
        if (2 * sf[i].num <= sf[i].denom && s.w >= size && s.h >= size &&
            sf[i].num * best.denom < best.num * sf[i].denom)
            best = sf[i];
    }
    int rc = decode_jpeg(d, data, len, best, out, wbuf, wlen);
    if (!rc)
        *box = scale_box(*box, w, h, best);
    return rc;
}

/* ---- PNG writing ------------------------------------------------------- */

int stk_png_write(const char *path, const uint8_t *px, int w, int h, int c,
                  stk_err *err)
{
    stk_err own = {0}; /* for the code when the caller passes no err */
    FILE *f = stk_fopen_output(path, err ? err : &own); /* FIFO refused */
    if (!f)
        return err ? err->code : own.code;
    spng_ctx *ctx = spng_ctx_new(SPNG_CTX_ENCODER);
    struct spng_ihdr ihdr = {
        .width = (uint32_t)w,
        .height = (uint32_t)h,
        .bit_depth = 8,
        .color_type = c == 1 ? SPNG_COLOR_TYPE_GRAYSCALE
                             : SPNG_COLOR_TYPE_TRUECOLOR,
    };
    int rc = ctx ? spng_set_png_file(ctx, f) : SPNG_EMEM;
    if (!rc)
        rc = spng_set_ihdr(ctx, &ihdr);
    if (!rc)
        rc = spng_encode_image(ctx, px, (size_t)w * h * c, SPNG_FMT_PNG,
                               SPNG_ENCODE_FINALIZE);
    spng_ctx_free(ctx);
    int closed = fclose(f);
    if (rc || closed)
        return stk_fail(err, STK_EIO, "%s: cannot write PNG: %s", path,
                        rc ? spng_strerror(rc) : "close failed");
    return 0;
}
