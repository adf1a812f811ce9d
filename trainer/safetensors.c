/* safetensors.c - reading and writing the safetensors format (an 8-byte
 * little-endian header length, a JSON header naming each tensor's dtype,
 * shape and byte range, then the data), so PyTorch loads stoke's weights
 * with safetensors.torch.load_file and load_state_dict. Writes are atomic:
 * a temporary file, fsync, rename. */
#include "checkpoint.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int write_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n) {
        ssize_t w = write(fd, b, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

static const char *dtype_name(stk_dtype d) { return d == STK_DT_I64 ? "I64" : "F32"; }

static size_t elem_size(stk_dtype d)
{
    return d == STK_DT_I64 ? sizeof(int64_t) : sizeof(float);
}

static char *header_json(const stk_tensor *t, int n, const char *meta_json)
{
    cJSON *o = cJSON_CreateObject();
    cJSON *meta = meta_json ? cJSON_Parse(meta_json) : NULL;
    cJSON_AddItemToObject(o, "__metadata__", meta ? meta : cJSON_CreateObject());
    size_t off = 0;
    for (int i = 0; i < n; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "dtype", dtype_name(t[i].dtype));
        /* a 0-dim tensor's shape is [] (cJSON makes no array of 0 items
         * from an array) */
        cJSON_AddItemToObject(e, "shape",
                              t[i].ndim ? cJSON_CreateIntArray(t[i].shape, t[i].ndim)
                                        : cJSON_CreateArray());
        size_t bytes = t[i].count * elem_size(t[i].dtype);
        double range[2] = {(double)off, (double)(off + bytes)};
        cJSON_AddItemToObject(e, "data_offsets", cJSON_CreateDoubleArray(range, 2));
        cJSON_AddItemToObject(o, t[i].name, e);
        off += bytes;
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

int stk_safetensors_write(const char *path, const stk_tensor *t, int n,
                          const char *meta_json, stk_err *err)
{
    char *json = header_json(t, n, meta_json);
    if (!json)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    size_t hl = strlen(json), padded = (hl + 7) / 8 * 8;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    /* created anew: whatever was left under that name (a FIFO would
     * block the open) is never written through */
    unlink(tmp);
    int fd =
        open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0644);
    int rc = fd < 0 ? -1 : 0;
    uint8_t len[8];
    for (int b = 0; b < 8; b++)
        len[b] = (uint8_t)((uint64_t)padded >> (8 * b));
    if (!rc)
        rc = write_all(fd, len, 8) || write_all(fd, json, hl) ||
             write_all(fd, "        ", padded - hl);
    for (int i = 0; !rc && i < n; i++)
        rc = write_all(fd, t[i].data, t[i].count * elem_size(t[i].dtype));
    int e = errno;
    if (!rc && fsync(fd) != 0)
        rc = -1, e = errno;
    if (fd >= 0 && close(fd) != 0 && !rc)
        rc = -1, e = errno;
    free(json);
    if (!rc && rename(tmp, path) != 0)
        rc = -1, e = errno;
    if (rc) {
        unlink(tmp);
        return stk_fail(err, stk_from_errno(e), "%s: cannot write: %s", path,
                        strerror(e));
    }
    return 0;
}

/* Finds name, or "module." + name (as DDP saves), in the header. */
static const cJSON *find(const cJSON *hdr, const char *name)
{
    const cJSON *e = cJSON_GetObjectItemCaseSensitive(hdr, name);
    if (!e) {
        char alt[STK_TENSOR_NAME_MAX + 8];
        snprintf(alt, sizeof alt, "module.%s", name);
        e = cJSON_GetObjectItemCaseSensitive(hdr, alt);
    }
    return e;
}

/* "[2,3]" for a shape (at most 4 dims). */
static void shape_text(const int *shape, int ndim, char *out, size_t n)
{
    size_t u = (size_t)snprintf(out, n, "[");
    for (int d = 0; d < ndim && u < n; d++)
        u += (size_t)snprintf(out + u, n - u, "%s%d", d ? "," : "", shape[d]);
    if (u < n)
        snprintf(out + u, n - u, "]");
}

/* The dtypes a file may hold for a tensor of the model's: PyTorch's
 * load_state_dict copies with a cast, so a half, bfloat16 or double state
 * dict loads into float weights, an int32 counter into an int64 one. */
typedef struct file_dtype {
    const char *name;
    size_t size;
    stk_dtype to;
} file_dtype;
static const file_dtype file_dtypes[] = {
    {"F32", 4, STK_DT_F32}, {"F16", 2, STK_DT_F32}, {"BF16", 2, STK_DT_F32},
    {"F64", 8, STK_DT_F32}, {"I64", 8, STK_DT_I64}, {"I32", 4, STK_DT_I64}};

static float half_to_float(uint16_t h)
{
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v = e == 0    ? ldexpf((float)m, -24) /* subnormal */
              : e == 31 ? (m ? NAN : INFINITY)
                        : ldexpf((float)(m | 0x400), e - 25);
    return h & 0x8000 ? -v : v;
}

/* t->count elements of kind k (F16, BF16, F64 or I32) at src into
 * t->data, cast to t's dtype. */
static void cast_into(const file_dtype *k, const uint8_t *src, stk_tensor *t)
{
    float *f = t->data;
    int64_t *q = t->data;
    bool half = !strcmp(k->name, "F16"), bf16 = !strcmp(k->name, "BF16");
    for (size_t i = 0; i < t->count; i++) {
        const uint8_t *p = src + i * k->size;
        uint16_t h = (uint16_t)(p[0] | p[1] << 8);
        uint32_t bits = (uint32_t)h << 16; /* BF16: a float's upper half */
        double d;
        int32_t n;
        if (half)
            f[i] = half_to_float(h);
        else if (bf16)
            memcpy(&f[i], &bits, sizeof bits);
        else if (k->to == STK_DT_F32) /* F64 */
            memcpy(&d, p, sizeof d), f[i] = (float)d;
        else /* I32 */
            memcpy(&n, p, sizeof n), q[i] = n;
    }
}

/* Whether the header's dtype (one that casts to t's: *kind) and shape are
 * t's; if not, an error that names the tensor, what the model needs and
 * what the file holds. */
static int check_kind(const char *path, const cJSON *e, const stk_tensor *t,
                      const file_dtype **kind, stk_err *err)
{
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const char *want_dt = dtype_name(t->dtype);
    *kind = NULL;
    for (size_t i = 0; i < sizeof file_dtypes / sizeof *file_dtypes; i++)
        if (cJSON_IsString(dt) && file_dtypes[i].to == t->dtype &&
            !strcmp(dt->valuestring, file_dtypes[i].name))
            *kind = &file_dtypes[i];
    if (!*kind)
        return stk_fail(err, STK_EFORMAT,
                        "%s: \"%s\" is %.16s, the model needs %s (%s cast "
                        "to it, as load_state_dict does)",
                        path, t->name,
                        cJSON_IsString(dt) ? dt->valuestring : "no dtype",
                        want_dt,
                        t->dtype == STK_DT_F32 ? "F16, BF16 and F64 are"
                                               : "I32 is");
    int same = cJSON_IsArray(sh) && cJSON_GetArraySize(sh) == t->ndim;
    for (int d = 0; same && d < t->ndim; d++) {
        const cJSON *v = cJSON_GetArrayItem(sh, d);
        same = cJSON_IsNumber(v) && v->valuedouble == t->shape[d];
    }
    if (same)
        return 0;
    char want[64];
    shape_text(t->shape, t->ndim, want, sizeof want);
    char *got = cJSON_PrintUnformatted(sh);
    int rc = stk_fail(err, STK_EFORMAT, "%s: \"%s\" has shape %.60s, the model needs %s",
                      path, t->name, got ? got : "?", want);
    free(got);
    return rc;
}

static int load_one(const char *path, const cJSON *hdr, const uint8_t *data,
                    size_t dlen, stk_tensor *t, stk_err *err)
{
    const cJSON *e = find(hdr, t->name);
    t->found = e != NULL;
    if (!e && !t->optional) { /* the file's own first name shows its kind */
        const cJSON *f = hdr->child;
        if (f && !strcmp(f->string, "__metadata__"))
            f = f->next;
        if (!f)
            return stk_fail(err, STK_EFORMAT,
                            "%s: no tensor \"%s\" (the file holds no tensor)",
                            path, t->name);
        return stk_fail(err, STK_EFORMAT,
                        "%s: no tensor \"%s\" (the file's first is "
                        "\"%.*s\"; of name prefixes only DDP's \"module.\" is "
                        "taken off)",
                        path, t->name,
                        (int)stk_utf8_fit(f->string, strnlen(f->string, 200)),
                        f->string);
    }
    if (!e)
        return 0;
    const file_dtype *kind;
    int rc = check_kind(path, e, t, &kind, err);
    if (rc)
        return rc;
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    size_t bytes = t->count * kind->size;
    double b = cJSON_GetArrayItem(off, 0) ? cJSON_GetArrayItem(off, 0)->valuedouble : -1;
    double en = cJSON_GetArrayItem(off, 1) ? cJSON_GetArrayItem(off, 1)->valuedouble : -1;
    if (b < 0 || b != floor(b) || en - b != (double)bytes)
        return stk_fail(err, STK_EFORMAT, "%s: \"%s\" has a bad byte range",
                        path, t->name);
    if (en > (double)dlen)
        return stk_fail(err, STK_EFORMAT,
                        "%s: \"%s\" lies past the file's end (%zu bytes of "
                        "data): the file is cut short",
                        path, t->name, dlen);
    if (kind->size == elem_size(t->dtype))
        memcpy(t->data, data + (size_t)b, bytes);
    else
        cast_into(kind, data + (size_t)b, t);
    if (t->dtype != STK_DT_F32)
        return 0;
    /* a NaN or infinity would spread through every later step and into
     * every checkpoint written after it */
    const float *f = t->data;
    for (size_t i = 0; i < t->count; i++) {
        double d = 0;
        if (!isfinite(f[i]) && !strcmp(kind->name, "F64"))
            memcpy(&d, data + (size_t)b + i * 8, sizeof d);
        if (isfinite(d) && d != 0) /* a finite double beyond float's range */
            return stk_fail(err, STK_ERANGE,
                            "%s: \"%s\" holds %g at element %zu, beyond a "
                            "float's range", path, t->name, d, i);
        if (!isfinite(f[i]))
            return stk_fail(err, STK_ERANGE,
                            "%s: \"%s\" holds %s at element %zu (weights, "
                            "buffers and optimizer state must be finite)",
                            path, t->name, isnan(f[i]) ? "NaN" : "an infinity", i);
    }
    return 0;
}

/* Refuses the header's tensors that are none of t[0, n): what PyTorch's
 * load_state_dict (strict, its default) calls unexpected keys. Each
 * tensor found took one entry (find), so there are some exactly when the
 * header holds more; the first is looked for only then. */
static int check_unexpected(const char *path, const cJSON *hdr,
                            const stk_tensor *t, int n, stk_err *err)
{
    int entries = cJSON_GetArraySize(hdr), found = 0;
    for (int i = 0; i < n; i++)
        found += t[i].found;
    int extra = entries - found -
                (cJSON_GetObjectItemCaseSensitive(hdr, "__metadata__") != NULL);
    if (extra <= 0)
        return 0;
    const char *first = NULL;
    for (const cJSON *e = hdr->child; e && !first; e = e->next) {
        int i = 0;
        while (i < n && find(hdr, t[i].name) != e)
            i++;
        if (i == n && strcmp(e->string, "__metadata__"))
            first = e->string;
    }
    return stk_fail(err, STK_EINVAL,
                    "%s: holds \"%.200s\"%s, which the model has no tensor "
                    "for: a state dict of another model? (read strictly, as "
                    "PyTorch's load_state_dict)",
                    path, first ? first : "?", extra > 1 ? " and others" : "");
}

/* Why a file is not safetensors, from its first bytes: what a user is
 * likely to have given instead, or a file cut short. */
static int not_safetensors(const char *path, const uint8_t *file, size_t len,
                           uint64_t hl, stk_err *err)
{
    bool header_cut = len > 8 && hl > len - 8 && hl < ((uint64_t)1 << 32) &&
                      file[8] == '{';
    const char *why =
        len == 0 ? "an empty file"
        : len >= 4 && !memcmp(file, "PK\x03\x04", 4)
            ? "a zip archive, as torch.save writes (.pt, .pth): save the "
              "state dict with safetensors.torch.save_file"
        : header_cut ? "cut short: its header alone would take more than "
                       "the file"
        /* pickle's PROTO opcode and a protocol of 2..5 */
        : len >= 2 && file[0] == 0x80 && file[1] >= 2 && file[1] <= 5
            ? "a pickle (torch.save's legacy format): save the state dict "
              "with safetensors.torch.save_file"
        : len <= 8 ? "cut short: not even its 8-byte header length and a "
                     "header"
                   : "not a safetensors file (an 8-byte header length, then "
                     "a JSON header)";
    return stk_fail(err, STK_EFORMAT, "%s: %s", path, why);
}

static int read_tensors(const char *path, stk_tensor *t, int n, bool strict,
                        char **meta_json, stk_err *err)
{
    uint8_t *file;
    size_t len;
    int rc = stk_read_file(path, &file, &len, err);
    if (rc)
        return rc;
    uint64_t hl = 0;
    for (int b = 0; len >= 8 && b < 8; b++)
        hl |= (uint64_t)file[b] << (8 * b);
    cJSON *hdr = len >= 8 && hl <= len - 8
                     ? cJSON_ParseWithLength((const char *)file + 8, (size_t)hl)
                     : NULL;
    if (!hdr)
        rc = not_safetensors(path, file, len, hl, err);
    else if (!cJSON_IsObject(hdr))
        rc = stk_fail(err, STK_EFORMAT,
                      "%s: not a safetensors file (its header is JSON but "
                      "not an object of tensors)",
                      path);
    for (int i = 0; !rc && i < n; i++)
        rc = load_one(path, hdr, file + 8 + hl, len - 8 - hl, &t[i], err);
    if (!rc && strict)
        rc = check_unexpected(path, hdr, t, n, err);
    if (!rc && meta_json) {
        const cJSON *m = cJSON_GetObjectItemCaseSensitive(hdr, "__metadata__");
        *meta_json = m ? cJSON_PrintUnformatted(m) : NULL;
    }
    cJSON_Delete(hdr);
    free(file);
    return rc;
}

int stk_safetensors_read(const char *path, stk_tensor *t, int n,
                         char **meta_json, stk_err *err)
{
    return read_tensors(path, t, n, false, meta_json, err);
}

int stk_safetensors_read_all(const char *path, stk_tensor *t, int n,
                             stk_err *err)
{
    return read_tensors(path, t, n, true, NULL, err);
}
