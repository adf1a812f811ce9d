/* meta.c - dataset metadata <-> JSON (the "dataset" key of the meta db). */
#include "store.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STK_FORMAT_NAME "stoke"
#define STK_FORMAT_VERSION 1    /* fixed-size raw records */
#define STK_FORMAT_VERSION_V2 2 /* variable-size or encoded records */

void stk_meta_free(stk_meta *m)
{
    if (!m)
        return;
    for (int i = 0; i < m->nclasses; i++)
        free(m->classes[i]);
    free(m->classes);
    for (int s = 0; s < m->nsplits; s++)
        free(m->splits[s].label_counts);
    free(m->source_path);
    free(m->source_format);
    free(m->tool);
    free(m->created);
    free(m->skipped_json);
    memset(m, 0, sizeof *m);
}

bool stk_meta_fixed(const stk_meta *m)
{
    return !m->variable && m->encoding == STK_ENC_RAW;
}

size_t stk_meta_header_bytes(const stk_meta *m)
{
    return stk_meta_fixed(m) ? STK_RECORD_HEADER : STK_RECORD_HEADER_V2;
}

uint32_t stk_meta_sample_bytes(const stk_meta *m)
{
    if (!stk_meta_fixed(m))
        return 0;
    uint64_t n = (uint64_t)m->channels * (uint64_t)m->height *
                 (uint64_t)m->width;
    return n <= STK_MAX_SAMPLE_BYTES ? (uint32_t)n : 0;
}

int stk_split_name_ok(const char *name, stk_err *err)
{
    size_t n = strlen(name);
    if (n == 0 || n >= STK_SPLIT_NAME_MAX)
        return stk_fail(err, STK_EINVAL,
                        "split name \"%s\" must be 1..%d bytes", name,
                        STK_SPLIT_NAME_MAX - 1);
    if (!strcmp(name, STK_META_DB) || !strcmp(name, STK_CHECKSUM_DB))
        return stk_fail(err, STK_EINVAL,
                        "split name \"%s\" is reserved (the database holds "
                        "a \"%s\" and a \"%s\" table)",
                        name, STK_META_DB, STK_CHECKSUM_DB);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)name[i] < 0x20 || name[i] == 0x7f)
            return stk_fail(err, STK_EINVAL,
                            "split name has a control character at byte %zu",
                            i);
    return 0;
}

void stk_channel_stats(uint64_t sum, uint64_t sumsq, double n, double *mean,
                       double *std)
{
    double m = n ? (double)sum / n : 0.0;
    double var = (n ? (double)sumsq / n : 0.0) - m * m;
    *mean = m / 255.0;
    *std = (var > 0 ? sqrt(var) : 0.0) / 255.0;
}

int stk_meta_split(const stk_meta *m, const char *name)
{
    for (int s = 0; s < m->nsplits; s++)
        if (!strcmp(m->splits[s].name, name))
            return s;
    return -1;
}

static cJSON *doubles(const double *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; i < n && a; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

static cJSON *split_json(const stk_meta *m, const stk_split_meta *sp)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "count", (double)sp->count);
    cJSON *lc = cJSON_AddArrayToObject(o, "label_counts");
    for (int c = 0; c < m->nclasses; c++)
        cJSON_AddItemToArray(
            lc, cJSON_CreateNumber(sp->label_counts ? (double)sp->label_counts[c]
                                                    : 0));
    cJSON_AddItemToObject(o, "mean", doubles(sp->mean, m->channels));
    cJSON_AddItemToObject(o, "std", doubles(sp->std, m->channels));
    cJSON_AddNumberToObject(o, "skipped", (double)sp->nskipped);
    return o;
}

/* prep --holdout's rule, written out so that anyone can recompute which
 * files went to "test" (docs/formats.md). */
static void holdout_json(cJSON *o, const stk_meta *m)
{
    cJSON *h = cJSON_AddObjectToObject(o, "holdout");
    cJSON_AddNumberToObject(h, "fraction", m->holdout);
    cJSON_AddNumberToObject(h, "seed", (double)m->holdout_seed);
    cJSON_AddStringToObject(h, "from", "train");
    cJSON_AddStringToObject(h, "to", "test");
    cJSON_AddStringToObject(h, "rule",
                            "per class, the floor(fraction * n + 0.5) files "
                            "(1..n-1 for n >= 2) of lowest splitmix64("
                            "fnv1a64(path relative to source.path) ^ seed)");
}

char *stk_meta_to_json(const stk_meta *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    cJSON_AddStringToObject(o, "format", STK_FORMAT_NAME);
    bool v1 = stk_meta_fixed(m);
    cJSON_AddNumberToObject(o, "format_version",
                            v1 ? STK_FORMAT_VERSION : STK_FORMAT_VERSION_V2);
    cJSON *rec = cJSON_AddObjectToObject(o, "record");
    cJSON_AddNumberToObject(rec, "header_bytes",
                            (double)stk_meta_header_bytes(m));
    cJSON_AddStringToObject(rec, "label", "int32 little-endian at offset 0");
    cJSON_AddStringToObject(rec, "nbytes", "uint32 little-endian at offset 4");
    if (!v1) {
        cJSON_AddStringToObject(rec, "height",
                                "uint32 little-endian at offset 8");
        cJSON_AddStringToObject(rec, "width",
                                "uint32 little-endian at offset 12");
    }
    cJSON_AddStringToObject(rec, "dtype", "uint8");
    cJSON_AddStringToObject(rec, "layout", "CHW");
    cJSON *shape = cJSON_AddArrayToObject(rec, "shape");
    cJSON_AddItemToArray(shape, cJSON_CreateNumber(m->channels));
    for (int i = 0; i < 2; i++) /* null: each record has its own */
        cJSON_AddItemToArray(
            shape, m->variable ? cJSON_CreateNull()
                               : cJSON_CreateNumber(i ? m->width : m->height));
    if (!v1) {
        cJSON_AddStringToObject(rec, "encoding",
                                m->encoding == STK_ENC_JPEG ? "jpeg" : "raw");
        cJSON_AddBoolToObject(rec, "variable", m->variable);
        if (m->encoding == STK_ENC_JPEG)
            cJSON_AddNumberToObject(rec, "quality", m->quality);
        if (m->variable) {
            cJSON_AddNumberToObject(rec, "short_side", m->short_side);
            cJSON_AddNumberToObject(rec, "max_side", m->max_side);
        }
    }
    cJSON_AddStringToObject(o, "key", "uint64 big-endian sample index");
    cJSON *cl = cJSON_AddArrayToObject(o, "classes");
    for (int c = 0; c < m->nclasses; c++)
        cJSON_AddItemToArray(cl, cJSON_CreateString(m->classes[c]));
    cJSON *splits = cJSON_AddObjectToObject(o, "splits");
    cJSON *order = cJSON_AddArrayToObject(o, "split_order");
    for (int s = 0; s < m->nsplits; s++) {
        cJSON_AddItemToObject(splits, m->splits[s].name,
                              split_json(m, &m->splits[s]));
        cJSON_AddItemToArray(order, cJSON_CreateString(m->splits[s].name));
    }
    cJSON *src = cJSON_AddObjectToObject(o, "source");
    cJSON_AddStringToObject(src, "path", m->source_path ? m->source_path : "");
    cJSON_AddStringToObject(src, "format",
                            m->source_format ? m->source_format : "");
    char *raw = m->skipped_json ? stk_json_unescape_bytes(
                                      m->skipped_json, strlen(m->skipped_json))
                                : NULL;
    cJSON *sk = raw ? cJSON_Parse(raw) : NULL;
    free(raw);
    cJSON_AddItemToObject(o, "skipped_files", sk ? sk : cJSON_CreateObject());
    if (m->holdout > 0)
        holdout_json(o, m);
    cJSON_AddStringToObject(o, "tool", m->tool ? m->tool : "");
    cJSON_AddStringToObject(o, "created", m->created ? m->created : "");
    if (m->checksums)
        cJSON_AddStringToObject(o, "checksums", "crc32");
    cJSON_AddBoolToObject(o, "complete", m->complete);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    /* names are bytes; the file is UTF-8 (text.c) */
    char *utf8 = text ? stk_json_escape_bytes(text) : NULL;
    free(text);
    return utf8;
}

/* ---- parsing ----------------------------------------------------------- */

static int want(const cJSON *item, int (*is)(const cJSON *), const char *name,
                stk_err *err)
{
    if (!item || !is(item))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: field \"%s\" is missing or has the wrong "
                        "type",
                        name);
    return 0;
}

static int is_str(const cJSON *x) { return cJSON_IsString(x); }
static int is_arr(const cJSON *x) { return cJSON_IsArray(x); }
static int is_obj(const cJSON *x) { return cJSON_IsObject(x); }
static int is_bool(const cJSON *x) { return cJSON_IsBool(x); }

/* A whole number 0..max from field name; a double that is negative,
 * fractional, not finite or too large is refused before any conversion
 * (casting it would be undefined and wraps to nonsense like 2^64 - 5). */
static int get_count(const cJSON *v, uint64_t max, const char *name,
                     uint64_t *out, stk_err *err)
{
    if (!cJSON_IsNumber(v))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: field \"%s\" is missing or not a number",
                        name);
    double d = v->valuedouble;
    if (!(d >= 0 && d <= (double)max) || d != floor(d))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"%s\" is %.17g, expected a whole number "
                        "0..%llu",
                        name, d, (unsigned long long)max);
    *out = (uint64_t)d;
    return 0;
}

static char *dup_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return strdup(cJSON_IsString(v) ? v->valuestring : "");
}

/* n numbers in lo..hi. */
static int read_vec(const cJSON *a, double *out, int n, double lo, double hi,
                    const char *what, stk_err *err)
{
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != n)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"%s\" must be an array of %d numbers",
                        what, n);
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetArrayItem(a, i);
        if (!cJSON_IsNumber(v) || !(v->valuedouble >= lo) ||
            !(v->valuedouble <= hi))
            return stk_fail(err, STK_EFORMAT,
                            "metadata: \"%s\"[%d] is not a number in "
                            "%g..%g",
                            what, i, lo, hi);
        out[i] = v->valuedouble;
    }
    return 0;
}

/* label_counts: nclasses whole numbers that sum to count. */
static int parse_label_counts(const cJSON *lc, const stk_meta *m,
                              stk_split_meta *sp, stk_err *err)
{
    char field[96];
    snprintf(field, sizeof field, "splits.%s.label_counts", sp->name);
    if (!cJSON_IsArray(lc) || cJSON_GetArraySize(lc) != m->nclasses)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: %s must have %d entries (one per class)",
                        field, m->nclasses);
    sp->label_counts = calloc((size_t)m->nclasses + 1, sizeof(uint64_t));
    if (!sp->label_counts)
        return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    uint64_t sum = 0;
    const cJSON *v;
    int c = 0, rc;
    cJSON_ArrayForEach(v, lc)
    {
        if ((rc = get_count(v, sp->count, field, &sp->label_counts[c], err)))
            return rc;
        sum += sp->label_counts[c++]; /* each <= count < 2^30: no wrap */
    }
    if (sum != sp->count)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: %s sum to %llu but splits.%s.count is "
                        "%llu",
                        field, (unsigned long long)sum, sp->name,
                        (unsigned long long)sp->count);
    return 0;
}

static int parse_split(const cJSON *o, const char *name, stk_meta *m,
                       stk_split_meta *sp, stk_err *err)
{
    int rc;
    char field[96];
    snprintf(sp->name, sizeof sp->name, "%s", name);
    snprintf(field, sizeof field, "splits.%s.count", name);
    if ((rc = get_count(cJSON_GetObjectItemCaseSensitive(o, "count"),
                        STK_MAX_RECORDS, field, &sp->count, err)) ||
        (rc = parse_label_counts(
             cJSON_GetObjectItemCaseSensitive(o, "label_counts"), m, sp, err)))
        return rc;
    snprintf(field, sizeof field, "splits.%s.mean", name);
    if ((rc = read_vec(cJSON_GetObjectItemCaseSensitive(o, "mean"), sp->mean,
                       m->channels, 0, 1, field, err)))
        return rc;
    snprintf(field, sizeof field, "splits.%s.std", name);
    if ((rc = read_vec(cJSON_GetObjectItemCaseSensitive(o, "std"), sp->std,
                       m->channels, 0, 1, field, err)))
        return rc;
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(o, "skipped");
    snprintf(field, sizeof field, "splits.%s.skipped", name);
    sp->nskipped = 0;
    return sk ? get_count(sk, (uint64_t)1 << 53, field, &sp->nskipped, err)
              : 0;
}

/* Format 2's record fields: encoding, variable, quality (jpeg only),
 * short_side and max_side (variable only). */
static int parse_record_v2(const cJSON *rec, stk_meta *m, stk_err *err)
{
    const cJSON *enc = cJSON_GetObjectItemCaseSensitive(rec, "encoding");
    const cJSON *var = cJSON_GetObjectItemCaseSensitive(rec, "variable");
    int rc;
    if ((rc = want(enc, is_str, "record.encoding", err)) ||
        (rc = want(var, is_bool, "record.variable", err)))
        return rc;
    if (strcmp(enc->valuestring, "raw") && strcmp(enc->valuestring, "jpeg"))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.encoding is \"%s\", expected "
                        "\"raw\" or \"jpeg\"",
                        enc->valuestring);
    m->encoding =
        strcmp(enc->valuestring, "jpeg") ? STK_ENC_RAW : STK_ENC_JPEG;
    m->variable = cJSON_IsTrue(var);
    if (stk_meta_fixed(m))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: format_version 2 with fixed-size raw "
                        "records (those are format_version 1)");
    uint64_t v = 0;
    if (m->encoding == STK_ENC_JPEG) {
        if ((rc = get_count(cJSON_GetObjectItemCaseSensitive(rec, "quality"),
                            100, "record.quality", &v, err)))
            return rc;
        if (v == 0)
            return stk_fail(err, STK_EFORMAT,
                            "metadata: record.quality is 0, expected 1..100");
        m->quality = (int)v;
    }
    if (!m->variable)
        return 0;
    if ((rc = get_count(cJSON_GetObjectItemCaseSensitive(rec, "max_side"),
                        STK_MAX_SIDE, "record.max_side", &v, err)))
        return rc;
    if (v == 0)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.max_side is 0, expected "
                        "1..%d",
                        STK_MAX_SIDE);
    m->max_side = (int)v;
    if ((rc = get_count(cJSON_GetObjectItemCaseSensitive(rec, "short_side"),
                        (uint64_t)m->max_side, "record.short_side", &v, err)))
        return rc;
    m->short_side = (int)v;
    return 0;
}

/* record.shape: C 1..STK_MAX_CHANNELS, H and W 1..STK_MAX_SIDE (null for
 * variable records), and C*H*W at most STK_MAX_SAMPLE_BYTES, checked
 * before any int holds them. */
static int parse_shape(const cJSON *root, int version, stk_meta *m,
                       stk_err *err)
{
    const cJSON *rec = cJSON_GetObjectItemCaseSensitive(root, "record");
    int rc = want(rec, is_obj, "record", err);
    if (rc)
        return rc;
    if (version == STK_FORMAT_VERSION_V2 &&
        (rc = parse_record_v2(rec, m, err)))
        return rc;
    uint64_t hb = 0, want_hb = stk_meta_header_bytes(m);
    if ((rc = get_count(cJSON_GetObjectItemCaseSensitive(rec, "header_bytes"),
                        UINT32_MAX, "record.header_bytes", &hb, err)))
        return rc;
    if (hb != want_hb)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.header_bytes is %llu, expected %llu",
                        (unsigned long long)hb, (unsigned long long)want_hb);
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(rec, "shape");
    if (!cJSON_IsArray(shape) || cJSON_GetArraySize(shape) != 3)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"record.shape\" must be an array of 3 "
                        "numbers (C, H, W)");
    static const char *const names[3] = {"record.shape[0] (channels)",
                                         "record.shape[1] (height)",
                                         "record.shape[2] (width)"};
    const uint64_t max[3] = {STK_MAX_CHANNELS, STK_MAX_SIDE, STK_MAX_SIDE};
    uint64_t dim[3] = {0, 1, 1};
    for (int i = 0; i < 3; i++) {
        const cJSON *d = cJSON_GetArrayItem(shape, i);
        if (i && m->variable) {
            if (!cJSON_IsNull(d))
                return stk_fail(err, STK_EFORMAT,
                                "metadata: %s must be null for variable-size "
                                "records",
                                names[i]);
            continue;
        }
        if ((rc = get_count(d, max[i], names[i], &dim[i], err)))
            return rc;
        if (dim[i] == 0)
            return stk_fail(err, STK_EFORMAT, "metadata: %s is 0", names[i]);
    }
    if (m->encoding == STK_ENC_JPEG && dim[0] != 1 && dim[0] != 3)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: %s is %llu, but JPEG records hold 1 (gray) "
                        "or 3 (RGB) channels",
                        names[0], (unsigned long long)dim[0]);
    if (m->variable) { /* the largest record bounds C*H*W */
        dim[1] = dim[2] = (uint64_t)m->max_side;
    }
    uint64_t bytes = dim[0] * dim[1] * dim[2]; /* <= 4 * 2^32: no wrap */
    if (bytes > STK_MAX_SAMPLE_BYTES)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.shape [%llu,%llu,%llu] makes "
                        "%llu-byte records, over the limit of %llu",
                        (unsigned long long)dim[0], (unsigned long long)dim[1],
                        (unsigned long long)dim[2], (unsigned long long)bytes,
                        (unsigned long long)STK_MAX_SAMPLE_BYTES);
    m->channels = (int)dim[0];
    m->height = m->variable ? 0 : (int)dim[1];
    m->width = m->variable ? 0 : (int)dim[2];
    return 0;
}

static int parse_classes(const cJSON *root, stk_meta *m, stk_err *err)
{
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(root, "classes");
    int rc = want(cl, is_arr, "classes", err);
    if (rc)
        return rc;
    if (cJSON_GetArraySize(cl) > STK_MAX_CLASSES)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"classes\" holds %d names, over the "
                        "limit of %d",
                        cJSON_GetArraySize(cl), STK_MAX_CLASSES);
    m->nclasses = 0;
    m->classes = calloc((size_t)cJSON_GetArraySize(cl) + 1, sizeof(char *));
    if (!m->classes)
        return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    const cJSON *c;
    cJSON_ArrayForEach(c, cl)
    {
        if ((rc = want(c, is_str, "classes[]", err)))
            return rc;
        if (!(m->classes[m->nclasses++] = strdup(c->valuestring)))
            return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    }
    return 0;
}

static int parse_splits(const cJSON *root, stk_meta *m, stk_err *err)
{
    const cJSON *splits = cJSON_GetObjectItemCaseSensitive(root, "splits");
    const cJSON *order = cJSON_GetObjectItemCaseSensitive(root, "split_order");
    int rc;
    if ((rc = want(splits, is_obj, "splits", err)) ||
        (rc = want(order, is_arr, "split_order", err)))
        return rc;
    const cJSON *name;
    cJSON_ArrayForEach(name, order)
    {
        if (!cJSON_IsString(name) || m->nsplits == STK_MAX_SPLITS)
            return stk_fail(err, STK_EFORMAT,
                            "metadata: split_order holds more than %d names "
                            "or one that is not a string",
                            STK_MAX_SPLITS);
        stk_err why;
        if ((rc = stk_split_name_ok(name->valuestring, &why)))
            return stk_fail(err, STK_EFORMAT, "metadata: split_order: %s",
                            why.msg);
        if (stk_meta_split(m, name->valuestring) >= 0)
            return stk_fail(err, STK_EFORMAT,
                            "metadata: split_order names \"%s\" twice",
                            name->valuestring);
        const cJSON *o =
            cJSON_GetObjectItemCaseSensitive(splits, name->valuestring);
        if (!cJSON_IsObject(o))
            return stk_fail(err, STK_EFORMAT,
                            "metadata: split \"%s\" is listed but not "
                            "described",
                            name->valuestring);
        if ((rc = parse_split(o, name->valuestring, m,
                              &m->splits[m->nsplits++], err)))
            return rc;
    }
    return 0;
}

/* "holdout" is optional (databases without one, or written before it). */
static int parse_holdout(const cJSON *root, stk_meta *m, stk_err *err)
{
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(root, "holdout");
    if (!h)
        return 0;
    int rc;
    if ((rc = want(h, is_obj, "holdout", err)))
        return rc;
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(h, "fraction");
    if (!cJSON_IsNumber(f) || !(f->valuedouble > 0 && f->valuedouble < 1))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"holdout.fraction\" is not a number "
                        "between 0 and 1");
    m->holdout = f->valuedouble;
    return get_count(cJSON_GetObjectItemCaseSensitive(h, "seed"),
                     ((uint64_t)1 << 53) - 1, "holdout.seed",
                     &m->holdout_seed, err);
}

static int parse_root(const cJSON *root, stk_meta *m, stk_err *err)
{
    int rc;
    if (!cJSON_IsObject(root))
        return stk_fail(err, STK_EFORMAT, "metadata: not a JSON object");
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(root, "format_version");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, STK_FORMAT_NAME))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"format\" is not \"%s\"", STK_FORMAT_NAME);
    if (!cJSON_IsNumber(ver) || (ver->valuedouble != STK_FORMAT_VERSION &&
                                 ver->valuedouble != STK_FORMAT_VERSION_V2))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: format_version is not %d or %d (written by "
                        "a different stoke?)",
                        STK_FORMAT_VERSION, STK_FORMAT_VERSION_V2);
    if ((rc = parse_shape(root, ver->valueint, m, err)) ||
        (rc = parse_classes(root, m, err)) ||
        (rc = parse_splits(root, m, err)))
        return rc;
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(root, "source");
    m->source_path = dup_str(src, "path");
    m->source_format = dup_str(src, "format");
    m->tool = dup_str(root, "tool");
    m->created = dup_str(root, "created");
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(root, "skipped_files");
    m->skipped_json = sk ? cJSON_PrintUnformatted(sk) : NULL;
    if ((rc = parse_holdout(root, m, err)))
        return rc;
    const cJSON *ck = cJSON_GetObjectItemCaseSensitive(root, "checksums");
    if (ck && (!cJSON_IsString(ck) || strcmp(ck->valuestring, "crc32")))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"checksums\" is not \"crc32\"");
    m->checksums = ck != NULL;
    const cJSON *done = cJSON_GetObjectItemCaseSensitive(root, "complete");
    if ((rc = want(done, is_bool, "complete", err)))
        return rc;
    m->complete = cJSON_IsTrue(done);
    return 0;
}

int stk_meta_from_json(const char *json, size_t len, stk_meta *m,
                       stk_err *err)
{
    memset(m, 0, sizeof *m);
    char *raw = stk_json_unescape_bytes(json, len); /* text.c */
    if (!raw)
        return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    cJSON *root = cJSON_Parse(raw);
    free(raw);
    if (!root)
        return stk_fail(err, STK_EFORMAT, "metadata: not valid JSON");
    int rc = parse_root(root, m, err);
    cJSON_Delete(root);
    if (rc)
        stk_meta_free(m);
    return rc;
}
