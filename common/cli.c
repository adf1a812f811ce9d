/* cli.c - checked flag values for the tools' mains. */
#include "cli.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int bad(const char *tool, const char *flag, const char *want,
               const char *got)
{
    fprintf(stderr, "%s: %s: expected %s, got '%s'\n", tool, flag, want, got);
    return -1;
}

int stk_cli_int(const char *tool, const char *flag, const char *s, long lo,
                long hi, int *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        char want[64];
        snprintf(want, sizeof want, "a whole number %ld..%ld", lo, hi);
        return bad(tool, flag, want, s);
    }
    *out = (int)v;
    return 0;
}

int stk_cli_u64(const char *tool, const char *flag, const char *s,
                uint64_t *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v =
        isdigit((unsigned char)*s) ? strtoull(s, &end, 10) : 0;
    if (!end || errno || *end)
        return bad(tool, flag, "a whole number 0..18446744073709551615", s);
    *out = (uint64_t)v;
    return 0;
}

int stk_cli_float(const char *tool, const char *flag, const char *s,
                  double lo, double hi, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi)) {
        char want[64];
        snprintf(want, sizeof want, "a number in [%g, %g]", lo, hi);
        return bad(tool, flag, want, s);
    }
    *out = (float)v;
    return 0;
}

int stk_cli_choice(const char *tool, const char *flag, const char *s,
                   const char *const *names, int n, int *out)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(s, names[i]))
            return (*out = i), 0;
    char want[256] = "";
    for (int i = 0; i < n; i++) {
        size_t u = strlen(want);
        snprintf(want + u, sizeof want - u, "%s%s",
                 i ? (i == n - 1 ? " or " : ", ") : "", names[i]);
    }
    return bad(tool, flag, want, s);
}

int stk_cli_bytes(const char *tool, const char *flag, const char *s,
                  size_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end), mul = 1;
    switch (*end) {
    case 'K': case 'k': mul = 1024.0; end++; break;
    case 'M': case 'm': mul = 1048576.0; end++; break;
    case 'G': case 'g': mul = 1073741824.0; end++; break;
    case 'T': case 't': mul = 1099511627776.0; end++; break;
    }
    if (errno || end == s || *end || v <= 0 || v * mul > 1e15)
        return bad(tool, flag, "a size in bytes like 64M or 2G", s);
    *out = (size_t)(v * mul);
    return 0;
}

int stk_cli_int_list(const char *tool, const char *flag, const char *s,
                     long lo, long hi, int *out, int max, int *n)
{
    char want[96];
    *n = 0;
    for (const char *p = s;; p++) {
        size_t len = strcspn(p, ",");
        if (!len) { /* ",1", "1,,2", "1," or "" */
            snprintf(want, sizeof want,
                     "whole numbers %ld..%ld separated by single commas, "
                     "such as 0,1,2,4",
                     lo, hi);
            return bad(tool, flag, want, s);
        }
        if (*n == max) {
            snprintf(want, sizeof want, "at most %d numbers", max);
            return bad(tool, flag, want, s);
        }
        char *item = strndup(p, len);
        if (!item)
            return bad(tool, flag, "a shorter list (out of memory)", s);
        int rc = stk_cli_int(tool, flag, item, lo, hi, &out[*n]);
        free(item);
        if (rc)
            return rc;
        ++*n;
        p += len;
        if (!*p)
            return 0;
    }
}
