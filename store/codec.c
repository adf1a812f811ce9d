/* codec.c - the record value and key encodings (docs/formats.md). */
#include "store.h"

#include <stdio.h>
#include <string.h>
#include <zlib.h>

void stk_put_le32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

uint32_t stk_get_le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
           (uint32_t)p[3] << 24;
}

void stk_record_put_header(uint8_t *dst, int32_t label, uint32_t nbytes)
{
    stk_put_le32(dst, (uint32_t)label);
    stk_put_le32(dst + 4, nbytes);
}

void stk_record_encode(uint8_t *dst, int32_t label, const uint8_t *pixels,
                       uint32_t nbytes)
{
    stk_record_put_header(dst, label, nbytes);
    if (nbytes)
        memcpy(dst + STK_RECORD_HEADER, pixels, nbytes);
}

int stk_record_decode(const void *src, size_t len, uint32_t expect,
                      stk_record *out)
{
    const uint8_t *p = src;
    if (len < STK_RECORD_HEADER)
        return STK_EFORMAT;
    uint32_t n = stk_get_le32(p + 4);
    if (n != expect || len != STK_RECORD_HEADER + (size_t)n)
        return STK_EFORMAT;
    out->label = (int32_t)stk_get_le32(p);
    out->nbytes = n;
    out->height = out->width = 0; /* the caller knows the shape */
    out->data = p + STK_RECORD_HEADER;
    return 0;
}

void stk_record_put_header_v2(uint8_t *dst, int32_t label, uint32_t nbytes,
                              uint32_t height, uint32_t width)
{
    stk_record_put_header(dst, label, nbytes);
    stk_put_le32(dst + 8, height);
    stk_put_le32(dst + 12, width);
}

/* Format 1: the payload is C*H*W pixels of the meta's shape. */
static int parse_v1(const uint8_t *p, size_t len, const stk_meta *m,
                    stk_record *out, char *why, size_t n)
{
    uint32_t expect = stk_meta_sample_bytes(m);
    if (!stk_record_decode(p, len, expect, out)) {
        out->height = m->height;
        out->width = m->width;
        return 0;
    }
    if (len < STK_RECORD_HEADER)
        snprintf(why, n,
                 "record is %zu bytes, shorter than its %d-byte "
                 "header",
                 len, STK_RECORD_HEADER);
    else if (stk_get_le32(p + 4) != expect)
        snprintf(why, n,
                 "the record's size field says %u pixel bytes, the "
                 "metadata's shape needs %u",
                 stk_get_le32(p + 4), expect);
    else
        snprintf(why, n,
                 "record is %zu bytes, its size field and the shape "
                 "need %llu (%d-byte header + %u pixels)",
                 len, (unsigned long long)STK_RECORD_HEADER + expect,
                 STK_RECORD_HEADER, expect);
    return STK_EFORMAT;
}

/* Format 2: the header's H and W within the limits (the meta's shape when
 * fixed, 1..max_side when variable), the length exactly header + nbytes,
 * and nbytes == C*H*W for raw pixels. */
static int parse_v2(const uint8_t *p, size_t len, const stk_meta *m,
                    stk_record *out, char *why, size_t n)
{
    if (len < STK_RECORD_HEADER_V2) {
        snprintf(why, n,
                 "record is %zu bytes, shorter than its %d-byte "
                 "header",
                 len, STK_RECORD_HEADER_V2);
        return STK_EFORMAT;
    }
    uint32_t nb = stk_get_le32(p + 4), h = stk_get_le32(p + 8),
             w = stk_get_le32(p + 12);
    uint32_t maxs = (uint32_t)(m->variable ? m->max_side : 0);
    if (m->variable ? (h < 1 || w < 1 || h > maxs || w > maxs)
                    : (h != (uint32_t)m->height || w != (uint32_t)m->width)) {
        if (m->variable)
            snprintf(why, n,
                     "the record's size is %ux%u (HxW), outside "
                     "1..%u (the metadata's max_side)",
                     h, w, maxs);
        else
            snprintf(why, n,
                     "the record's size is %ux%u (HxW), the "
                     "metadata's shape says %dx%d",
                     h, w, m->height, m->width);
        return STK_EFORMAT;
    }
    uint64_t raw = (uint64_t)m->channels * h * w;
    if (m->encoding == STK_ENC_RAW && nb != raw) {
        snprintf(why, n,
                 "the record's size field says %u pixel bytes, "
                 "%d x %u x %u raw pixels need %llu",
                 nb, m->channels, h, w, (unsigned long long)raw);
        return STK_EFORMAT;
    }
    if (nb == 0 || len != STK_RECORD_HEADER_V2 + (size_t)nb) {
        snprintf(why, n, "record is %zu bytes, its header says %d + %u", len,
                 STK_RECORD_HEADER_V2, nb);
        return STK_EFORMAT;
    }
    out->label = (int32_t)stk_get_le32(p);
    out->nbytes = nb;
    out->height = (int)h;
    out->width = (int)w;
    out->data = p + STK_RECORD_HEADER_V2;
    return 0;
}

int stk_record_parse(const void *src, size_t len, const stk_meta *m,
                     stk_record *out, char *why, size_t n)
{
    return stk_meta_fixed(m) ? parse_v1(src, len, m, out, why, n)
                             : parse_v2(src, len, m, out, why, n);
}

void stk_key_encode(uint8_t key[8], uint64_t i)
{
    for (int b = 7; b >= 0; b--) {
        key[b] = (uint8_t)i;
        i >>= 8;
    }
}

uint64_t stk_key_decode(const uint8_t key[8])
{
    uint64_t v = 0;
    for (int b = 0; b < 8; b++)
        v = v << 8 | key[b];
    return v;
}

uint32_t stk_crc32(const void *data, size_t len)
{
    uLong crc = crc32(0L, Z_NULL, 0);
    const Bytef *p = data;
    while (len) { /* zlib takes uInt lengths */
        uInt n = len > (1u << 30) ? 1u << 30 : (uInt)len;
        crc = crc32(crc, p, n);
        p += n;
        len -= n;
    }
    return (uint32_t)crc;
}
