/* codec.c - the record value and key encodings (docs/formats.md). */
#include "store.h"

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
    out->data = p + STK_RECORD_HEADER;
    return 0;
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
