/* text.c - file and class names in the UTF-8 metadata.
 *
 * Names come from the file system, where they are bytes: a class folder or
 * a skipped file may be called b"caf\xe9" (Latin-1), which is not UTF-8.
 * The metadata is UTF-8 JSON, so each byte that is not part of a valid
 * UTF-8 sequence is written as the JSON escape \udcXX: PEP 383's
 * "surrogateescape", exactly what Python's json.dumps(os.fsdecode(name))
 * writes for it. Python gets the bytes back with os.fsencode(json.loads(..))
 * and stoke with stk_json_unescape_bytes before cJSON (which refuses lone
 * surrogates) parses the text. */
#include "store.h"

#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t stk_utf8_len(const char *s, size_t n)
{
    const unsigned char *p = (const unsigned char *)s;
    if (n == 0)
        return 0;
    if (p[0] < 0x80)
        return 1;
    /* the lead byte gives the length and the range of the second byte
     * (no overlong forms, no surrogates, nothing above U+10FFFF) */
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf;
    if (p[0] >= 0xc2 && p[0] <= 0xdf)
        len = 2;
    else if (p[0] >= 0xe0 && p[0] <= 0xef) {
        len = 3;
        lo = p[0] == 0xe0 ? 0xa0 : 0x80;
        hi = p[0] == 0xed ? 0x9f : 0xbf;
    } else if (p[0] >= 0xf0 && p[0] <= 0xf4) {
        len = 4;
        lo = p[0] == 0xf0 ? 0x90 : 0x80;
        hi = p[0] == 0xf4 ? 0x8f : 0xbf;
    } else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return len;
}

char *stk_text_printable(char *out, size_t cap, const char *s)
{
    size_t n = strlen(s), w = 0;
    for (size_t i = 0, k; i < n; i += k) {
        unsigned char b = (unsigned char)s[i];
        k = stk_utf8_len(s + i, n - i);
        bool c1 = k == 2 && b == 0xc2 && (unsigned char)s[i + 1] < 0xa0;
        bool plain = b >= 0x80 || (b >= 0x20 && b != 0x7f && b != '\\');
        if (k && !c1 && plain) {
            if (w + k >= cap)
                break;
            memcpy(out + w, s + i, k);
            w += k;
            continue;
        }
        k = k ? k : 1;
        if (w + 4 * k >= cap)
            break;
        for (size_t j = 0; j < k; j++, w += 4)
            snprintf(out + w, 5, "\\x%02x", (unsigned char)s[i + j]);
    }
    if (cap)
        out[w < cap ? w : cap - 1] = '\0';
    return out;
}

char *stk_json_escape_bytes(const char *text)
{
    size_t n = strlen(text), bad = 0;
    for (size_t i = 0, k; i < n; i += k ? k : 1)
        bad += (k = stk_utf8_len(text + i, n - i)) == 0;
    char *out = malloc(n + 5 * bad + 1), *o = out;
    if (!out)
        return NULL;
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0, k; i < n; i += k ? k : 1) {
        k = stk_utf8_len(text + i, n - i);
        if (k) {
            memcpy(o, text + i, k);
            o += k;
            continue;
        }
        unsigned char b = (unsigned char)text[i];
        memcpy(o, "\\udc", 4);
        o[4] = hex[b >> 4];
        o[5] = hex[b & 15];
        o += 6;
    }
    *o = '\0';
    return out;
}

/* The value of the 4 hex digits at p, or -1. */
static long hex4(const char *p)
{
    long v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

char *stk_json_unescape_bytes(const char *json, size_t len)
{
    char *out = malloc(len + 1), *o = out;
    if (!out)
        return NULL;
    bool after_high = false; /* the last thing copied was \ud800..\udbff */
    for (size_t i = 0; i < len;) {
        if (json[i] != '\\' || i + 1 >= len) {
            *o++ = json[i++];
            after_high = false;
            continue;
        }
        long u = json[i + 1] == 'u' && i + 6 <= len ? hex4(json + i + 2) : -1;
        if (u >= 0xdc80 && u <= 0xdcff && !after_high) {
            *o++ = (char)(u - 0xdc00); /* an escaped byte */
            i += 6;
            continue;
        }
        size_t k = u >= 0 ? 6 : 2; /* any other escape, copied whole */
        memcpy(o, json + i, k);
        o += k;
        i += k;
        after_high = u >= 0xd800 && u <= 0xdbff;
    }
    *o = '\0';
    return out;
}
