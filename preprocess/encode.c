/* encode.c - JPEG records: compressing them in prep (TurboJPEG, one
 * compressor per worker thread) and turning any record back into pixels. */
#include "preprocess.h"
#include "store/store.h"

#include <stdlib.h>
#include <string.h>
#include <turbojpeg.h>

struct stk_encoder {
    tjhandle tj;
    uint8_t *hwc; /* the interleaved copy TurboJPEG reads */
    size_t hwc_cap;
    unsigned char *out; /* tjBufSize() bytes: compression never grows it */
    unsigned long out_cap;
};

int stk_encoder_create(stk_encoder **out, stk_err *err)
{
    *out = NULL;
    stk_encoder *e = calloc(1, sizeof *e);
    if (!e)
        return stk_fail(err, STK_ENOMEM, "encoder: out of memory");
    if (!(e->tj = tjInitCompress())) {
        free(e);
        return stk_fail(err, STK_ENOMEM, "encoder: TurboJPEG: %s",
                        tjGetErrorStr2(NULL));
    }
    *out = e;
    return 0;
}

void stk_encoder_destroy(stk_encoder *e)
{
    if (!e)
        return;
    tjDestroy(e->tj);
    tjFree(e->out);
    free(e->hwc);
    free(e);
}

/* Room for an h x w image: the HWC copy and the worst-case output. */
static int encoder_reserve(stk_encoder *e, int c, int h, int w, int samp)
{
    size_t n = (size_t)c * h * w;
    unsigned long need = tjBufSize(w, h, samp);
    if (need == (unsigned long)-1)
        return STK_EINVAL;
    if (n > e->hwc_cap) {
        uint8_t *p = realloc(e->hwc, n);
        if (!p)
            return STK_ENOMEM;
        e->hwc = p;
        e->hwc_cap = n;
    }
    if (need > e->out_cap) {
        tjFree(e->out);
        e->out_cap = 0;
        if (!(e->out = tjAlloc((int)need)))
            return STK_ENOMEM;
        e->out_cap = need;
    }
    return 0;
}

int stk_jpeg_encode(stk_encoder *e, const uint8_t *chw, int c, int h, int w,
                    int quality, const uint8_t **jpeg, size_t *len,
                    stk_err *err)
{
    int samp = c == 1 ? TJSAMP_GRAY : TJSAMP_420;
    int rc = encoder_reserve(e, c, h, w, samp);
    if (rc)
        return stk_fail(err, rc, "JPEG encoder: no room for a %dx%d image", w,
                        h);
    size_t plane = (size_t)h * w;
    for (size_t i = 0; i < plane; i++) /* CHW -> HWC */
        for (int k = 0; k < c; k++)
            e->hwc[i * c + k] = chw[k * plane + i];
    unsigned long size = e->out_cap;
    if (tjCompress2(e->tj, e->hwc, w, 0, h, c == 1 ? TJPF_GRAY : TJPF_RGB,
                    &e->out, &size, samp, quality, TJFLAG_NOREALLOC))
        return stk_fail(err, STK_EFORMAT, "JPEG encoder: %s",
                        tjGetErrorStr2(e->tj));
    *jpeg = e->out;
    *len = size;
    return 0;
}

int stk_record_pixels(stk_decoder *d, const stk_meta *m, const stk_record *rec,
                      uint8_t *chw, stk_err *err)
{
    size_t plane = (size_t)rec->height * rec->width;
    if (m->encoding == STK_ENC_RAW) {
        memcpy(chw, rec->data, plane * m->channels);
        return 0;
    }
    stk_image im = {0};
    char why[256];
    int rc = stk_image_decode(d, rec->data, rec->nbytes, &im, why, sizeof why);
    if (rc == STK_ENOMEM)
        return stk_fail(err, rc, "JPEG record: out of memory");
    if (rc)
        return stk_fail(err, rc, "JPEG record: %s", why);
    if (im.w != rec->width || im.h != rec->height || im.c != m->channels)
        rc = stk_fail(err, STK_EFORMAT,
                      "JPEG record: the image is %dx%d with %d channel(s), "
                      "its header says %dx%d with %d",
                      im.w, im.h, im.c, rec->width, rec->height, m->channels);
    for (size_t i = 0; !rc && i < plane; i++) /* HWC -> CHW */
        for (int k = 0; k < im.c; k++)
            chw[k * plane + i] = im.px[i * im.c + k];
    stk_image_free(&im);
    return rc;
}
