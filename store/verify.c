/* verify.c - stk_store_verify: every record read and checked against the
 * metadata and the checksums, so damage is found by a command (dbinfo
 * --verify, the end of prep) and not by a crash or a wrong label in the
 * middle of training. The structural check of the file (check.c) has
 * already passed when a store is open. */
#include "store_impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void problem(stk_verify_report *rep, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

static void problem(stk_verify_report *rep, const char *fmt, ...)
{
    if (rep->problems < STK_VERIFY_KEPT) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(rep->first[rep->problems], sizeof rep->first[0], fmt, ap);
        va_end(ap);
    }
    rep->problems++;
}

/* What one split's records add up to. */
typedef struct tally {
    uint64_t *labels;                    /* per class */
    uint64_t sums[2 * STK_MAX_CHANNELS]; /* per channel: sum, sum of squares */
    uint64_t pixels;                     /* per channel */
} tally;

/* The split's checksum list, or NULL (reported) when it is missing or does
 * not have one entry per record. */
static uint8_t *checksum_list(stk_store *s, const stk_split_meta *sp,
                              stk_verify_report *rep, int *rc, stk_err *err)
{
    uint8_t *list;
    size_t len;
    *rc = stk_store_get_copy(s, STK_CHECKSUM_DB, sp->name, &list, &len, err);
    if (*rc == STK_ENOENT) {
        *rc = 0;
        if (sp->count)
            problem(rep, "split \"%s\": its checksum list is missing",
                    sp->name);
        return NULL;
    }
    if (!*rc && len != sp->count * 4) {
        problem(rep,
                "split \"%s\": its checksum list holds %zu bytes, %llu "
                "records need %llu",
                sp->name, len, (unsigned long long)sp->count,
                (unsigned long long)sp->count * 4);
        free(list);
        return NULL;
    }
    return list;
}

static void add_pixels(tally *t, const stk_record *r, int channels)
{
    size_t plane = (size_t)r->height * (size_t)r->width;
    t->pixels += plane;
    for (int c = 0; c < channels; c++) {
        const uint8_t *p = r->data + (size_t)c * plane;
        uint64_t sum = 0, sq = 0;
        for (size_t j = 0; j < plane; j++) {
            sum += p[j];
            sq += (uint64_t)p[j] * p[j];
        }
        t->sums[2 * c] += sum;
        t->sums[2 * c + 1] += sq;
    }
}

/* One record: size (through the view), label, checksum. */
static void check_record(const stk_view *v, const stk_meta *m,
                         const stk_split_meta *sp, uint64_t i,
                         const uint8_t *crcs, tally *t, stk_verify_report *rep)
{
    stk_record r;
    stk_err e;
    rep->records++;
    if (stk_view_get(v, i, &r, &e)) {
        problem(rep, "%s", e.msg);
        return;
    }
    unsigned long long key = (unsigned long long)i;
    if (crcs) {
        uint32_t want = stk_get_le32(crcs + 4 * i);
        size_t hb = stk_meta_header_bytes(m);
        uint32_t have = stk_crc32(r.data - hb, hb + (size_t)r.nbytes);
        if (have != want)
            problem(rep,
                    "split \"%s\": key %llu: the record's crc32 is "
                    "%08x, its checksum list says %08x (changed after prep "
                    "wrote it)",
                    sp->name, key, have, want);
    }
    if (r.label < 0 || r.label >= m->nclasses) {
        problem(rep,
                "split \"%s\": key %llu: label %d is outside the %d "
                "classes (0..%d)",
                sp->name, key, r.label, m->nclasses, m->nclasses - 1);
        return;
    }
    t->labels[r.label]++;
    if (m->encoding == STK_ENC_RAW) /* JPEG: decoding is prep's business */
        add_pixels(t, &r, m->channels);
}

/* The significant digits, 6 at least, at which a and b print apart: two
 * numbers that differ beyond the tolerance must not read the same. */
static int digits_apart(double a, double b)
{
    for (int p = 6; p < 17 && a != b; p++) {
        char x[32], y[32];
        snprintf(x, sizeof x, "%.*g", p, a);
        snprintf(y, sizeof y, "%.*g", p, b);
        if (strcmp(x, y))
            return p;
    }
    return a == b ? 6 : 17; /* 17 digits tell any two doubles apart */
}

/* The split's label counts, mean and std against its metadata (the mean
 * and std computed as prep computes them, from integer sums). */
static void check_totals(const stk_meta *m, const stk_split_meta *sp,
                         const tally *t, stk_verify_report *rep)
{
    char name[96]; /* a class name from the file system, made printable */
    for (int c = 0; c < m->nclasses; c++)
        if (t->labels[c] != sp->label_counts[c])
            problem(rep,
                    "split \"%s\": %llu records have label %d (%s), the "
                    "metadata's label_counts say %llu",
                    sp->name, (unsigned long long)t->labels[c], c,
                    stk_text_printable(name, sizeof name, m->classes[c]),
                    (unsigned long long)sp->label_counts[c]);
    double n = (double)t->pixels;
    for (int c = 0; c < m->channels && n > 0 && m->encoding == STK_ENC_RAW;
         c++) {
        double mean, std;
        stk_channel_stats(t->sums[2 * c], t->sums[2 * c + 1], n, &mean, &std);
        if (fabs(mean - sp->mean[c]) > 1e-9 || fabs(std - sp->std[c]) > 1e-9) {
            int pm = digits_apart(mean, sp->mean[c]);
            int ps = digits_apart(std, sp->std[c]);
            problem(rep,
                    "split \"%s\": channel %d has mean %.*g and std "
                    "%.*g, the metadata says %.*g and %.*g",
                    sp->name, c, pm, mean, ps, std, pm, sp->mean[c], ps,
                    sp->std[c]);
        }
    }
}

static int verify_split(stk_store *s, const stk_split_meta *sp,
                        const atomic_int *cancel,
                        stk_verify_report *rep, stk_err *err)
{
    const stk_meta *m = stk_store_meta(s);
    stk_view *v;
    stk_err e;
    int rc = stk_view_open(s, sp->name, &v, &e);
    if (rc == STK_EFORMAT) { /* a missing or misplaced key */
        problem(rep, "%s", e.msg);
        return 0;
    }
    if (rc)
        return stk_fail(err, rc, "%s", e.msg);
    uint8_t *crcs = m->checksums ? checksum_list(s, sp, rep, &rc, err) : NULL;
    tally t = {.labels = calloc((size_t)m->nclasses + 1, sizeof(uint64_t))};
    if (!rc && !t.labels)
        rc = stk_fail(err, STK_ENOMEM, "out of memory");
    for (uint64_t i = 0; !rc && i < stk_view_count(v); i++) {
        if (cancel && *cancel && i % 1024 == 0)
            rc = stk_fail(err, STK_ECANCELED, "interrupted");
        else
            check_record(v, m, sp, i, crcs, &t, rep);
    }
    if (!rc)
        check_totals(m, sp, &t, rep);
    free(t.labels);
    free(crcs);
    stk_view_close(v);
    return rc;
}

/* The metadata's bytes against their checksum. */
static int verify_meta(stk_store *s, stk_verify_report *rep, stk_err *err)
{
    uint8_t *json = NULL, *crc = NULL;
    size_t jlen, clen;
    int rc = stk_store_get_copy(s, STK_META_DB, "dataset", &json, &jlen, err);
    if (!rc)
        rc = stk_store_get_copy(s, STK_META_DB, STK_META_CRC_KEY, &crc, &clen,
                                err);
    if (rc == STK_ENOENT) {
        rc = 0;
        problem(rep, "metadata: its checksum (\"%s\") is missing",
                STK_META_CRC_KEY);
    } else if (!rc &&
               (clen != 4 || stk_get_le32(crc) != stk_crc32(json, jlen))) {
        problem(rep, "metadata: the \"dataset\" value does not match its "
                     "checksum (changed after prep wrote it)");
    }
    free(json);
    free(crc);
    return rc;
}

int stk_store_verify(stk_store *s, stk_verify_report *rep, stk_err *err)
{
    return stk_store_verify_until(s, NULL, rep, err);
}

int stk_store_verify_until(stk_store *s, const atomic_int *cancel,
                           stk_verify_report *rep, stk_err *err)
{
    memset(rep, 0, sizeof *rep);
    const stk_meta *m = stk_store_meta(s);
    rep->checksums = m->checksums;
    int rc = m->checksums ? verify_meta(s, rep, err) : 0;
    for (int k = 0; !rc && k < m->nsplits; k++)
        rc = verify_split(s, &m->splits[k], cancel, rep, err);
    if (rc)
        return rc;
    if (rep->problems)
        return stk_fail(err, STK_EFORMAT, "%s%s", rep->first[0],
                        rep->problems > 1 ? " (and more)" : "");
    return 0;
}
