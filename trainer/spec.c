/* spec.c - model specifications: the built-in networks and the text format
 * for custom sequential models (docs/models.md). */
#include "trainer.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static stk_layer_spec L(stk_layer_kind kind, const char *name, int out, int k,
                        float p)
{
    stk_layer_spec s = {kind, "", out, k, 1, 0, p, false, 0, {0, 0}};
    snprintf(s.name, sizeof s.name, "%s", name);
    if (kind == STK_L_POOL)
        s.stride = k;
    return s;
}

int stk_model_builtin(const char *name, stk_model_spec *out, stk_err *err)
{
    memset(out, 0, sizeof *out);
    stk_layer_spec *l = out->layers;
    if (!strcmp(name, "cnn")) { /* PyTorch's DDP tutorial network */
        l[0] = L(STK_L_CONV, "conv1", 32, 3, 0);
        l[1] = L(STK_L_POOL, "", 0, 2, 0);
        l[2] = L(STK_L_RELU, "", 0, 0, 0);
        l[3] = L(STK_L_CONV, "conv2", 64, 3, 0);
        l[4] = L(STK_L_DROPOUT2D, "", 0, 0, 0.5f);
        l[5] = L(STK_L_POOL, "", 0, 2, 0);
        l[6] = L(STK_L_RELU, "", 0, 0, 0);
        l[7] = L(STK_L_FLATTEN, "", 0, 0, 0);
        l[8] = L(STK_L_LINEAR, "fc1", 500, 0, 0);
        l[9] = L(STK_L_RELU, "", 0, 0, 0);
        l[10] = L(STK_L_DROPOUT, "", 0, 0, 0.5f);
        l[11] = L(STK_L_LINEAR, "fc2", 0, 0, 0);
        out->n = 12;
    } else if (!strcmp(name, "mlp")) {
        l[0] = L(STK_L_FLATTEN, "", 0, 0, 0);
        l[1] = L(STK_L_LINEAR, "fc1", 256, 0, 0);
        l[2] = L(STK_L_RELU, "", 0, 0, 0);
        l[3] = L(STK_L_LINEAR, "fc2", 128, 0, 0);
        l[4] = L(STK_L_RELU, "", 0, 0, 0);
        l[5] = L(STK_L_LINEAR, "fc3", 0, 0, 0);
        out->n = 6;
    } else {
        return stk_fail(err, STK_EINVAL,
                        "--model: expected cnn, mlp or a model file, got "
                        "'%s'",
                        name);
    }
    return 0;
}

/* ---- the text format ------------------------------------------------------ */

static int parse_kind(const char *w, stk_layer_kind *k)
{
    static const struct {
        const char *word;
        stk_layer_kind kind;
    } words[] = {{"conv", STK_L_CONV},       {"pool", STK_L_POOL},
                 {"maxpool", STK_L_POOL},    {"relu", STK_L_RELU},
                 {"dropout", STK_L_DROPOUT}, {"dropout2d", STK_L_DROPOUT2D},
                 {"flatten", STK_L_FLATTEN}, {"linear", STK_L_LINEAR}};
    for (size_t i = 0; i < sizeof words / sizeof *words; i++)
        if (!strcmp(w, words[i].word)) {
            *k = words[i].kind;
            return 0;
        }
    return -1;
}

/* What a model file may ask for (docs/models.md): every number is checked
 * against these before it sizes anything, so that no value wraps an int. */
enum {
    SPEC_MAX_WIDTH = 1 << 20, /* conv channels, linear features */
    SPEC_MAX_KERNEL = 1024,   /* conv and pool kernel sizes, strides */
    SPEC_MAX_PAD = 1024,
};

/* A whole number lo..hi for a layer's field; why says what is wrong with
 * the token, which field it is for and what that field takes. */
static int whole(const char *field, const char *tok, const char *val, long lo,
                 long hi, int *out, char *why, size_t n)
{
    char *end;
    errno = 0;
    long v = strtol(val, &end, 10);
    if (end == val || *end || errno || v < lo || v > hi) {
        snprintf(why, n, "'%s' is %s: %s takes a whole number %ld..%ld", tok,
                 end == val || *end ? "not a number" : "out of range", field,
                 lo, hi);
        return -1;
    }
    *out = (int)v;
    return 0;
}

/* Reads "key=value" or a positional integer/float into the spec; on
 * failure, why says which field is wrong, what it allows and what it got. */
static int parse_arg(stk_layer_spec *s, const char *tok, int pos, char *why,
                     size_t n)
{
    const char *eq = strchr(tok, '=');
    const char *val = eq ? eq + 1 : tok;
    bool conv = s->kind == STK_L_CONV, pool = s->kind == STK_L_POOL;
    const char *kind = conv ? "conv" : pool ? "pool" : "linear";
    char field[32];
    if (eq && !(!strncmp(tok, "stride=", 7) && (conv || pool)) &&
        !(!strncmp(tok, "pad=", 4) && conv)) {
        snprintf(why, n, "'%s' does not apply to this layer", tok);
        return -1;
    }
    if (!strncmp(tok, "stride=", 7))
        return whole("stride", tok, val, 1, SPEC_MAX_KERNEL, &s->stride, why,
                     n);
    if (!strncmp(tok, "pad=", 4))
        return whole("pad", tok, val, 0, SPEC_MAX_PAD, &s->pad, why, n);
    if ((s->kind == STK_L_DROPOUT || s->kind == STK_L_DROPOUT2D) && pos == 0) {
        char *end;
        s->p = strtof(val, &end);
        if (end != val && !*end && s->p >= 0 && s->p < 1)
            return 0;
        snprintf(why, n,
                 "'%s' is %s: dropout probability takes a number in [0, 1)",
                 tok, end == val || *end ? "not a number" : "out of range");
        return -1;
    }
    if (pool && pos == 0) {
        int rc =
            whole("pool size", tok, val, 1, SPEC_MAX_KERNEL, &s->k, why, n);
        s->stride = s->k;
        return rc;
    }
    if (s->kind == STK_L_LINEAR && pos == 0 && !strcmp(val, "classes"))
        return (s->out = 0), 0;
    snprintf(field, sizeof field, "%s %s", kind,
             conv ? "channels" : "features");
    if (pos == 0 && (conv || s->kind == STK_L_LINEAR))
        return whole(field, tok, val, 1, SPEC_MAX_WIDTH, &s->out, why, n);
    if (pos == 1 && conv)
        return whole("conv kernel", tok, val, 1, SPEC_MAX_KERNEL, &s->k, why,
                     n);
    snprintf(why, n, "unexpected '%s'", tok);
    return -1;
}

static int parse_line(char *line, stk_layer_spec *s, char *why, size_t n)
{
    char *save = NULL, *tok = strtok_r(line, " \t", &save);
    memset(s, 0, sizeof *s);
    s->stride = 1;
    snprintf(why, n, "cannot read this layer");
    size_t len = strlen(tok);
    if (tok[len - 1] == ':') { /* "conv1:" names the layer */
        tok[len - 1] = '\0';
        snprintf(s->name, sizeof s->name, "%s", tok);
        tok = strtok_r(NULL, " \t", &save);
        if (!tok)
            return -1;
    }
    if (parse_kind(tok, &s->kind)) {
        snprintf(why, n, "unknown layer '%s'", tok);
        return -1;
    }
    s->p = 0.5f;
    int pos = 0;
    while ((tok = strtok_r(NULL, " \t", &save)))
        if (parse_arg(s, tok, pos++, why, n))
            return -1;
    if (s->kind == STK_L_CONV && (s->out < 1 || s->k < 1)) {
        snprintf(why, n,
                 "conv needs a channel count and a kernel size (conv C K)");
        return -1;
    }
    if (s->kind == STK_L_POOL && s->k < 1) {
        snprintf(why, n, "pool needs a kernel size (pool K)");
        return -1;
    }
    return 0;
}

int stk_model_parse(const char *text, const char *file, stk_model_spec *out,
                    stk_err *err)
{
    memset(out, 0, sizeof *out);
    char *copy = strdup(text), *next = NULL;
    int lineno = 0, rc = 0;
    char why[160];
    for (char *line = copy; line && !rc; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        lineno++;
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        while (*line && isspace((unsigned char)*line))
            line++;
        size_t n = strlen(line);
        while (n && isspace((unsigned char)line[n - 1]))
            line[--n] = '\0';
        if (!*line)
            continue;
        if (out->n == STK_MAX_LAYERS)
            rc = stk_fail(err, STK_EINVAL, "%s: more than %d layers", file,
                          STK_MAX_LAYERS);
        else if (parse_line(line, &out->layers[out->n++], why, sizeof why))
            rc = stk_fail(err, STK_EINVAL, "%s:%d: %s (see docs/models.md for the format)",
                          file, lineno, why);
    }
    free(copy);
    if (!rc && !out->n)
        rc = stk_fail(err, STK_EINVAL, "%s: no layers", file);
    return rc;
}
