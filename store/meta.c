/* meta.c - dataset metadata <-> JSON (the "dataset" key of the meta db). */
#include "store.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define STK_FORMAT_NAME "stoke"
#define STK_FORMAT_VERSION 1

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

uint32_t stk_meta_sample_bytes(const stk_meta *m)
{
    return (uint32_t)m->channels * (uint32_t)m->height * (uint32_t)m->width;
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

char *stk_meta_to_json(const stk_meta *m)
{
    cJSON *o = cJSON_CreateObject();
    if (!o)
        return NULL;
    cJSON_AddStringToObject(o, "format", STK_FORMAT_NAME);
    cJSON_AddNumberToObject(o, "format_version", STK_FORMAT_VERSION);
    cJSON *rec = cJSON_AddObjectToObject(o, "record");
    cJSON_AddNumberToObject(rec, "header_bytes", STK_RECORD_HEADER);
    cJSON_AddStringToObject(rec, "label", "int32 little-endian at offset 0");
    cJSON_AddStringToObject(rec, "nbytes", "uint32 little-endian at offset 4");
    cJSON_AddStringToObject(rec, "dtype", "uint8");
    cJSON_AddStringToObject(rec, "layout", "CHW");
    int shape[3] = {m->channels, m->height, m->width};
    cJSON_AddItemToObject(rec, "shape", cJSON_CreateIntArray(shape, 3));
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
    cJSON *sk = m->skipped_json ? cJSON_Parse(m->skipped_json) : NULL;
    cJSON_AddItemToObject(o, "skipped_files", sk ? sk : cJSON_CreateObject());
    cJSON_AddStringToObject(o, "tool", m->tool ? m->tool : "");
    cJSON_AddStringToObject(o, "created", m->created ? m->created : "");
    cJSON_AddBoolToObject(o, "complete", m->complete);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    return text;
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

static int is_num(const cJSON *x) { return cJSON_IsNumber(x); }
static int is_str(const cJSON *x) { return cJSON_IsString(x); }
static int is_arr(const cJSON *x) { return cJSON_IsArray(x); }
static int is_obj(const cJSON *x) { return cJSON_IsObject(x); }
static int is_bool(const cJSON *x) { return cJSON_IsBool(x); }

static char *dup_str(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return strdup(cJSON_IsString(v) ? v->valuestring : "");
}

static int read_vec(const cJSON *a, double *out, int n, const char *what,
                    stk_err *err)
{
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != n)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"%s\" must be an array of %d numbers",
                        what, n);
    for (int i = 0; i < n; i++) {
        const cJSON *v = cJSON_GetArrayItem(a, i);
        if (!cJSON_IsNumber(v))
            return stk_fail(err, STK_EFORMAT,
                            "metadata: \"%s\"[%d] is not a number", what, i);
        out[i] = v->valuedouble;
    }
    return 0;
}

static int parse_split(const cJSON *o, const char *name, stk_meta *m,
                       stk_split_meta *sp, stk_err *err)
{
    int rc;
    snprintf(sp->name, sizeof sp->name, "%s", name);
    const cJSON *count = cJSON_GetObjectItemCaseSensitive(o, "count");
    if ((rc = want(count, is_num, "splits.count", err)))
        return rc;
    sp->count = (uint64_t)count->valuedouble;
    const cJSON *lc = cJSON_GetObjectItemCaseSensitive(o, "label_counts");
    if (!cJSON_IsArray(lc) || cJSON_GetArraySize(lc) != m->nclasses)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: splits.%s.label_counts must have %d "
                        "entries",
                        name, m->nclasses);
    sp->label_counts = calloc((size_t)m->nclasses + 1, sizeof(uint64_t));
    if (!sp->label_counts)
        return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    for (int c = 0; c < m->nclasses; c++)
        sp->label_counts[c] =
            (uint64_t)cJSON_GetArrayItem(lc, c)->valuedouble;
    if ((rc = read_vec(cJSON_GetObjectItemCaseSensitive(o, "mean"), sp->mean,
                       m->channels, "mean", err)) ||
        (rc = read_vec(cJSON_GetObjectItemCaseSensitive(o, "std"), sp->std,
                       m->channels, "std", err)))
        return rc;
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(o, "skipped");
    sp->nskipped = cJSON_IsNumber(sk) ? (uint64_t)sk->valuedouble : 0;
    return 0;
}

static int parse_shape(const cJSON *root, stk_meta *m, stk_err *err)
{
    const cJSON *rec = cJSON_GetObjectItemCaseSensitive(root, "record");
    int rc = want(rec, is_obj, "record", err);
    if (rc)
        return rc;
    const cJSON *hb = cJSON_GetObjectItemCaseSensitive(rec, "header_bytes");
    if (!cJSON_IsNumber(hb) || hb->valueint != STK_RECORD_HEADER)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.header_bytes must be %d",
                        STK_RECORD_HEADER);
    double shape[3];
    if ((rc = read_vec(cJSON_GetObjectItemCaseSensitive(rec, "shape"), shape,
                       3, "record.shape", err)))
        return rc;
    m->channels = (int)shape[0];
    m->height = (int)shape[1];
    m->width = (int)shape[2];
    if (m->channels < 1 || m->channels > STK_MAX_CHANNELS || m->height < 1 ||
        m->width < 1)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: record.shape [%d,%d,%d] is not a valid "
                        "CHW shape",
                        m->channels, m->height, m->width);
    return 0;
}

static int parse_classes(const cJSON *root, stk_meta *m, stk_err *err)
{
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(root, "classes");
    int rc = want(cl, is_arr, "classes", err);
    if (rc)
        return rc;
    m->nclasses = 0;
    m->classes = calloc((size_t)cJSON_GetArraySize(cl) + 1, sizeof(char *));
    if (!m->classes)
        return stk_fail(err, STK_ENOMEM, "metadata: out of memory");
    const cJSON *c;
    cJSON_ArrayForEach(c, cl)
    {
        if ((rc = want(c, is_str, "classes[]", err)))
            return rc;
        m->classes[m->nclasses++] = strdup(c->valuestring);
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
        if (!cJSON_IsString(name) || m->nsplits == STK_MAX_SPLITS ||
            strlen(name->valuestring) >= STK_SPLIT_NAME_MAX)
            return stk_fail(err, STK_EFORMAT,
                            "metadata: split_order holds a bad or extra "
                            "name");
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

static int parse_root(const cJSON *root, stk_meta *m, stk_err *err)
{
    int rc;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(root, "format_version");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, STK_FORMAT_NAME))
        return stk_fail(err, STK_EFORMAT,
                        "metadata: \"format\" is not \"%s\"", STK_FORMAT_NAME);
    if (!cJSON_IsNumber(ver) || ver->valueint != STK_FORMAT_VERSION)
        return stk_fail(err, STK_EFORMAT,
                        "metadata: format_version is not %d (written by a "
                        "different stoke?)",
                        STK_FORMAT_VERSION);
    if ((rc = parse_shape(root, m, err)) || (rc = parse_classes(root, m, err)) ||
        (rc = parse_splits(root, m, err)))
        return rc;
    const cJSON *src = cJSON_GetObjectItemCaseSensitive(root, "source");
    m->source_path = dup_str(src, "path");
    m->source_format = dup_str(src, "format");
    m->tool = dup_str(root, "tool");
    m->created = dup_str(root, "created");
    const cJSON *sk = cJSON_GetObjectItemCaseSensitive(root, "skipped_files");
    m->skipped_json = sk ? cJSON_PrintUnformatted(sk) : NULL;
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
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root)
        return stk_fail(err, STK_EFORMAT, "metadata: not valid JSON");
    int rc = parse_root(root, m, err);
    cJSON_Delete(root);
    if (rc)
        stk_meta_free(m);
    return rc;
}
