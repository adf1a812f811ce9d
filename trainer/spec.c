/* spec.c - model specifications: the text format of docs/models.md (one
 * layer per line, inputs by name) and the built-in networks, which are
 * texts in that format (the same as the files under models/). */
#include "trainer.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the text format ------------------------------------------------------
 */

static int parse_kind(const char *w, stk_layer_kind *k)
{
    static const struct {
        const char *word;
        stk_layer_kind kind;
    } words[] = {
        {"conv", STK_L_CONV},           {"pool", STK_L_POOL},
        {"maxpool", STK_L_POOL},        {"relu", STK_L_RELU},
        {"dropout", STK_L_DROPOUT},     {"dropout2d", STK_L_DROPOUT2D},
        {"flatten", STK_L_FLATTEN},     {"linear", STK_L_LINEAR},
        {"batchnorm", STK_L_BATCHNORM}, {"add", STK_L_ADD},
        {"avgpool", STK_L_AVGPOOL},     {"globalpool", STK_L_GLOBALPOOL}};
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

/* A layer as read, before the names it reads are resolved to indices. */
typedef struct raw_layer {
    int line;
    int nin; /* names read: 0 = the layer before */
    char in[2][STK_NAME_MAX];
    char seen[64]; /* the options given, " stride= pad=": each once */
} raw_layer;

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

/* A layer name: up to STK_NAME_MAX - 1 of letters, digits, '_', '.', '-'
 * (it becomes a parameter prefix, "layer1.0.conv1.weight"). */
static int check_name(const char *name, const char *what, char *why, size_t n)
{
    size_t len = strlen(name);
    bool ok = len > 0 && len < STK_NAME_MAX;
    for (size_t i = 0; ok && i < len; i++)
        ok = isalnum((unsigned char)name[i]) || strchr("_.-", name[i]);
    if (!ok)
        snprintf(why, n,
                 "'%.80s' is not a %s: it takes 1..%d letters, digits, '_', "
                 "'.' or '-'",
                 name, what, STK_NAME_MAX - 1);
    return ok ? 0 : -1;
}

/* "key=value" options: which layers each applies to. */
static bool option_applies(const stk_layer_spec *s, const char *tok)
{
    bool conv = s->kind == STK_L_CONV, lin = s->kind == STK_L_LINEAR;
    bool pools = s->kind == STK_L_POOL || s->kind == STK_L_AVGPOOL;
    if (!strncmp(tok, "stride=", 7))
        return conv || pools;
    if (!strncmp(tok, "pad=", 4))
        return conv;
    if (!strncmp(tok, "bias=", 5))
        return conv || lin;
    if (!strncmp(tok, "from=", 5))
        return s->kind != STK_L_ADD; /* an add names both of its inputs */
    return false;
}

static int parse_option(stk_layer_spec *s, raw_layer *r, const char *tok,
                        char *why, size_t n)
{
    const char *val = strchr(tok, '=') + 1;
    if (!option_applies(s, tok)) {
        snprintf(why, n, "'%s' does not apply to this layer", tok);
        return -1;
    }
    char key[16]; /* " stride=": option_applies knows it, so it is short */
    snprintf(key, sizeof key, " %.*s", (int)(val - tok), tok);
    if (strstr(r->seen, key)) {
        snprintf(why, n, "'%s': %s given twice", tok, key + 1);
        return -1;
    }
    strncat(r->seen, key, sizeof r->seen - strlen(r->seen) - 1);
    if (!strncmp(tok, "stride=", 7))
        return whole("stride", tok, val, 1, SPEC_MAX_KERNEL, &s->stride, why,
                     n);
    if (!strncmp(tok, "pad=", 4))
        return whole("pad", tok, val, 0, SPEC_MAX_PAD, &s->pad, why, n);
    if (!strncmp(tok, "from=", 5)) {
        if (check_name(val, "layer name", why, n))
            return -1;
        r->nin = 1;
        snprintf(r->in[0], sizeof r->in[0], "%s", val);
        return 0;
    }
    if (strcmp(val, "false") && strcmp(val, "true")) {
        snprintf(why, n, "'%s': bias takes true or false", tok);
        return -1;
    }
    s->no_bias = !strcmp(val, "false");
    return 0;
}

/* add NAME (the layer before + NAME) or add A B: the names it reads. */
static int parse_add_arg(raw_layer *r, const char *tok, int pos, char *why,
                         size_t n)
{
    if (pos > 1) {
        snprintf(why, n, "unexpected '%s': add reads one or two names", tok);
        return -1;
    }
    if (check_name(tok, "layer name", why, n))
        return -1;
    snprintf(r->in[pos], sizeof r->in[pos], "%s", tok);
    r->nin = pos + 1;
    return 0;
}

/* Reads "key=value" or a positional argument into the spec; on failure,
 * why says which field is wrong, what it allows and what it got. */
static int parse_arg(stk_layer_spec *s, raw_layer *r, const char *tok, int pos,
                     char *why, size_t n)
{
    bool conv = s->kind == STK_L_CONV;
    bool pool = s->kind == STK_L_POOL || s->kind == STK_L_AVGPOOL;
    if (strchr(tok, '='))
        return parse_option(s, r, tok, why, n);
    if (s->kind == STK_L_ADD)
        return parse_add_arg(r, tok, pos, why, n);
    if ((s->kind == STK_L_DROPOUT || s->kind == STK_L_DROPOUT2D) && pos == 0) {
        char *end;
        s->p = strtof(tok, &end);
        if (end != tok && !*end && s->p >= 0 && s->p < 1)
            return 0;
        snprintf(why, n,
                 "'%s' is %s: dropout probability takes a number in [0, 1)",
                 tok, end == tok || *end ? "not a number" : "out of range");
        return -1;
    }
    if (pool && pos == 0) { /* the stride is the size unless given after */
        int rc =
            whole("pool size", tok, tok, 1, SPEC_MAX_KERNEL, &s->k, why, n);
        s->stride = s->k;
        return rc;
    }
    if (s->kind == STK_L_LINEAR && pos == 0 && !strcmp(tok, "classes"))
        return (s->out = 0), 0;
    if (pos == 0 && (conv || s->kind == STK_L_LINEAR))
        return whole(conv ? "conv channels" : "linear features", tok, tok, 1,
                     SPEC_MAX_WIDTH, &s->out, why, n);
    if (pos == 1 && conv)
        return whole("conv kernel", tok, tok, 1, SPEC_MAX_KERNEL, &s->k, why,
                     n);
    snprintf(why, n, "unexpected '%s'", tok);
    return -1;
}

/* What a layer must have been given, once its line is read. */
static int check_layer(const stk_layer_spec *s, const raw_layer *r, char *why,
                       size_t n)
{
    const char *need = NULL;
    if (s->kind == STK_L_CONV && (s->out < 1 || s->k < 1))
        need = "conv needs a channel count and a kernel size (conv C K)";
    else if (s->kind == STK_L_POOL && s->k < 1)
        need = "pool needs a kernel size (pool K)";
    else if (s->kind == STK_L_AVGPOOL && s->k < 1)
        need = "avgpool needs a kernel size (avgpool K)";
    else if (s->kind == STK_L_ADD && r->nin < 1)
        need = "add needs the name of the output it adds (add NAME or add "
               "A B)";
    if (need)
        snprintf(why, n, "%s", need);
    return need ? -1 : 0;
}

static int parse_line(char *line, stk_layer_spec *s, raw_layer *r, char *why,
                      size_t n)
{
    char *save = NULL, *tok = strtok_r(line, " \t", &save);
    memset(s, 0, sizeof *s);
    s->stride = 1;
    snprintf(why, n, "cannot read this layer");
    size_t len = strlen(tok);
    if (tok[len - 1] == ':') { /* "conv1:" names the layer */
        tok[len - 1] = '\0';
        if (check_name(tok, "layer name", why, n))
            return -1;
        if (!strcmp(tok, "input")) {
            snprintf(why, n,
                     "'input' is the model's input, not a name for "
                     "a layer");
            return -1;
        }
        snprintf(s->name, sizeof s->name, "%s", tok);
        tok = strtok_r(NULL, " \t", &save);
        if (!tok)
            return -1;
    }
    if (parse_kind(tok, &s->kind)) {
        snprintf(why, n, "unknown layer '%s'", tok);
        return -1;
    }
    if (s->kind == STK_L_DROPOUT || s->kind == STK_L_DROPOUT2D)
        s->p = 0.5f;
    int pos = 0;
    while ((tok = strtok_r(NULL, " \t", &save)))
        if (parse_arg(s, r, tok, strchr(tok, '=') ? pos : pos++, why, n))
            return -1;
    return check_layer(s, r, why, n);
}

/* Index of the layer named `name` among layers [from, to), or -1. */
static int find_layer(const stk_model_spec *spec, int from, int to,
                      const char *name)
{
    for (int i = from; i < to; i++)
        if (!strcmp(spec->layers[i].name, name))
            return i;
    return -1;
}

/* Layer i's names to indices: "input" is STK_INPUT, others earlier
 * layers; why names what is wrong otherwise (a name defined later, or
 * nowhere). */
static int resolve_inputs(stk_model_spec *spec, const raw_layer *raw, int i,
                          char *why, size_t n)
{
    stk_layer_spec *s = &spec->layers[i];
    const raw_layer *r = &raw[i];
    s->nin = 0;
    if (s->kind == STK_L_ADD && r->nin == 1) { /* add NAME: the layer before */
        s->in[0] = i - 1; /* -1 for the first layer: STK_INPUT */
        s->nin = 1;
    }
    for (int k = 0; k < r->nin; k++) {
        const char *name = r->in[k];
        int j =
            !strcmp(name, "input") ? STK_INPUT : find_layer(spec, 0, i, name);
        if (j == -1 && strcmp(name, "input")) {
            int later = find_layer(spec, i, spec->n, name);
            if (later == i)
                snprintf(why, n,
                         "this layer reads '%s', itself: a layer reads "
                         "earlier layers only",
                         name);
            else if (later > i)
                snprintf(why, n,
                         "'%s' is defined later (line %d): a layer reads "
                         "earlier layers only",
                         name, raw[later].line);
            else
                snprintf(why, n, "no layer is named '%s'", name);
            return -1;
        }
        s->in[s->nin++] = j;
    }
    return 0;
}

/* Names to indices, and no two layers of one name. */
static int resolve(stk_model_spec *spec, const raw_layer *raw,
                   const char *file, stk_err *err)
{
    char why[200];
    for (int i = 0; i < spec->n; i++) {
        const char *name = spec->layers[i].name;
        int first = *name ? find_layer(spec, 0, i, name) : -1;
        if (first >= 0)
            return stk_fail(err, STK_EINVAL,
                            "%s:%d: a second layer named '%s' (the first is "
                            "on line %d)",
                            file, raw[i].line, name, raw[first].line);
        if (resolve_inputs(spec, raw, i, why, sizeof why))
            return stk_fail(err, STK_EINVAL, "%s:%d: %s", file, raw[i].line,
                            why);
    }
    return 0;
}

/* Cuts comments and blanks off a line; returns its start. */
static char *trim(char *line)
{
    char *hash = strchr(line, '#');
    if (hash)
        *hash = '\0';
    while (*line && isspace((unsigned char)*line))
        line++;
    size_t n = strlen(line);
    while (n && isspace((unsigned char)line[n - 1]))
        line[--n] = '\0';
    return line;
}

int stk_model_parse(const char *text, const char *file, stk_model_spec *out,
                    stk_err *err)
{
    memset(out, 0, sizeof *out);
    char *copy = strdup(text), *next = NULL;
    raw_layer *raw = calloc(STK_MAX_LAYERS, sizeof *raw);
    if (!copy || !raw) {
        free(copy);
        free(raw);
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", file);
    }
    int lineno = 0, rc = 0;
    char why[200];
    for (char *line = copy; line && !rc; line = next) {
        next = strchr(line, '\n');
        if (next)
            *next++ = '\0';
        lineno++;
        line = trim(line);
        if (!*line)
            continue;
        if (out->n == STK_MAX_LAYERS) { /* before raw[out->n] is touched */
            rc = stk_fail(err, STK_EINVAL, "%s:%d: more than %d layers", file,
                          lineno, STK_MAX_LAYERS);
            break;
        }
        raw_layer *r = &raw[out->n];
        r->line = lineno;
        if (parse_line(line, &out->layers[out->n++], r, why, sizeof why))
            rc = stk_fail(err, STK_EINVAL,
                          "%s:%d: %s (see docs/models.md for the format)",
                          file, lineno, why);
    }
    if (!rc && !out->n)
        rc = stk_fail(err, STK_EINVAL, "%s: no layers", file);
    if (!rc)
        rc = resolve(out, raw, file, err);
    free(copy);
    free(raw);
    return rc;
}

/* ---- built-ins
 * -------------------------------------------------------------- */

/* PyTorch's DDP tutorial network (models/cnn.model). */
static const char cnn_text[] = "conv1: conv 32 3\n"
                               "pool 2\n"
                               "relu\n"
                               "conv2: conv 64 3\n"
                               "dropout2d 0.5\n"
                               "pool 2\n"
                               "relu\n"
                               "flatten\n"
                               "fc1: linear 500\n"
                               "relu\n"
                               "dropout 0.5\n"
                               "fc2: linear classes\n";

/* 784-256-128-10 on Fashion-MNIST (models/mlp.model). */
static const char mlp_text[] = "flatten\n"
                               "fc1: linear 256\n"
                               "relu\n"
                               "fc2: linear 128\n"
                               "relu\n"
                               "fc3: linear classes\n";

/* Appends a printf'd line to the text being built (it is sized for the
 * largest built-in, which a test parses). */
typedef struct text_buf {
    char *p;
    size_t used, cap;
} text_buf;

static void put(text_buf *t, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void put(text_buf *t, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(t->p + t->used, t->cap - t->used, fmt, ap);
    va_end(ap);
    t->used += k > 0 ? (size_t)k : 0;
    t->used = t->used < t->cap ? t->used : t->cap - 1;
}

/* torchvision's BasicBlock "layerS.B", reading `in`, to `width` channels:
 * conv1 (3x3, stride) bn1 relu conv2 (3x3) bn2, plus the input or, when
 * the shape changes, its 1x1 projection downsample.0 (conv) and .1 (bn);
 * the block's output is its last ReLU, named "layerS.B". */
static void basic_block(text_buf *t, int stage, int block, const char *in,
                        int width, int stride, bool project)
{
    char b[32];
    snprintf(b, sizeof b, "layer%d.%d", stage, block);
    if (stride == 1)
        put(t, "%s.conv1: conv %d 3 pad=1 bias=false\n", b, width);
    else
        put(t, "%s.conv1: conv %d 3 stride=%d pad=1 bias=false\n", b, width,
            stride);
    put(t, "%s.bn1: batchnorm\nrelu\n", b);
    put(t, "%s.conv2: conv %d 3 pad=1 bias=false\n", b, width);
    put(t, "%s.bn2: batchnorm\n", b);
    if (project) {
        put(t, "%s.downsample.0: conv %d 1 stride=%d bias=false from=%s\n", b,
            width, stride, in);
        put(t, "%s.downsample.1: batchnorm\n", b);
        put(t, "add %s.bn2\n", b);
    } else {
        put(t, "add %s\n", in);
    }
    put(t, "%s: relu\n", b);
}

/* A CIFAR ResNet: a 3x3 stem (conv1, bn1, ReLU "stem") to widths[0]
 * channels, `stages` stages of `blocks` BasicBlocks (the first block of
 * every stage after the first halving the size with stride 2 and a
 * projection shortcut), global average pooling and fc to the classes. */
static void resnet_text(text_buf *t, const char *title, const int *widths,
                        int stages, int blocks)
{
    put(t, "# %s (docs/models.md)\n", title);
    put(t, "conv1: conv %d 3 pad=1 bias=false\nbn1: batchnorm\nstem: relu\n",
        widths[0]);
    char in[32] = "stem";
    for (int s = 1; s <= stages; s++)
        for (int b = 0; b < blocks; b++) {
            bool first = b == 0 && s > 1;
            basic_block(t, s, b, in, widths[s - 1], first ? 2 : 1, first);
            snprintf(in, sizeof in, "layer%d.%d", s, b);
        }
    put(t, "globalpool\nflatten\nfc: linear classes\n");
}

/* The text of built-in `name` into t (NULL: no such built-in). */
static const char *builtin_text(const char *name, text_buf *t)
{
    static const int r20[] = {16, 32, 64}, r18[] = {64, 128, 256, 512};
    if (!strcmp(name, "cnn"))
        return cnn_text;
    if (!strcmp(name, "mlp"))
        return mlp_text;
    if (!strcmp(name, "resnet20"))
        resnet_text(t, "resnet20: He et al.'s CIFAR ResNet-20", r20, 3, 3);
    else if (!strcmp(name, "resnet18"))
        resnet_text(t, "resnet18: ResNet-18, CIFAR variant", r18, 4, 2);
    else
        return NULL;
    return t->p;
}

int stk_model_builtin(const char *name, stk_model_spec *out, stk_err *err)
{
    char buf[8192];
    text_buf t = {buf, 0, sizeof buf};
    buf[0] = '\0';
    const char *text = builtin_text(name, &t);
    if (t.used + 1 >= t.cap) /* cannot happen: buf fits the largest */
        return stk_fail(err, STK_ERANGE, "%s: built-in text too long", name);
    if (!text) {
        memset(out, 0, sizeof *out);
        return stk_fail(err, STK_EINVAL,
                        "--model: expected cnn, mlp, resnet20, resnet18 or a "
                        "model file, got '%s'",
                        name);
    }
    return stk_model_parse(text, name, out, err);
}
