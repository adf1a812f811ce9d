/* curves.c - RUN_DIR/curves.svg: a run's loss, accuracy and learning rate
 * against epochs, drawn from RUN_DIR/metrics.jsonl, so that a resumed run
 * draws its whole history. The SVG is self-contained (no scripts, no
 * fonts but the viewer's sans-serif) and rewritten whole each time: a
 * temporary file renamed over the old one, never half written. */
#include "train_impl.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { TRAIN_LOSS, TEST_LOSS, TRAIN_ACC, TEST_ACC, NSERIES };
/* an epoch line's number beyond train's --epochs range is no real epoch;
 * the lr panel draws at most MAX_LR_POINTS points */
enum { MAX_EPOCHS = 100000, MAX_LR_POINTS = 1000 };

static const char *const series_key[NSERIES] = {"train_loss", "test_loss",
                                                "train_acc", "test_acc"};

/* One epoch, from its last epoch line (a line written again after a
 * resume replaces the earlier one). NAN: missing or not finite. */
typedef struct epoch_row {
    bool seen;
    double v[NSERIES];
    double end_step; /* steps done when the epoch ended */
} epoch_row;

/* A learning rate, from a step line or an epoch line. */
typedef struct lr_point {
    double step, lr;
    size_t line; /* later lines win at the same step */
} lr_point;

typedef struct history {
    epoch_row *ep;
    int nep, cap;
    lr_point *lr;
    size_t nlr, caplr;
} history;

/* A finite number field of o, or NAN. */
static double num(const cJSON *o, const char *key)
{
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) && isfinite(v->valuedouble) ? v->valuedouble
                                                         : NAN;
}

static int add_lr(history *h, double step, double lr, size_t line)
{
    if (isnan(step) || isnan(lr) || step < 0)
        return 0; /* a line without them draws nothing */
    if (h->nlr == h->caplr) {
        size_t cap = h->caplr ? 2 * h->caplr : 256;
        lr_point *p = realloc(h->lr, cap * sizeof *p);
        if (!p)
            return STK_ENOMEM;
        h->lr = p;
        h->caplr = cap;
    }
    h->lr[h->nlr++] = (lr_point){step, lr, line};
    return 0;
}

static int add_epoch(history *h, const cJSON *o, size_t line)
{
    double e = num(o, "epoch");
    if (!(e >= 1 && e <= MAX_EPOCHS && e == floor(e)))
        return 0;
    int k = (int)e;
    if (k > h->cap) {
        int cap = h->cap ? h->cap : 64;
        while (cap < k)
            cap *= 2;
        epoch_row *p = realloc(h->ep, (size_t)cap * sizeof *p);
        if (!p)
            return STK_ENOMEM;
        memset(p + h->cap, 0, (size_t)(cap - h->cap) * sizeof *p);
        h->ep = p;
        h->cap = cap;
    }
    epoch_row *row = &h->ep[k - 1];
    row->seen = true;
    for (int s = 0; s < NSERIES; s++)
        row->v[s] = num(o, series_key[s]);
    row->end_step = num(o, "step");
    if (k > h->nep)
        h->nep = k;
    return add_lr(h, row->end_step, num(o, "lr"), line);
}

/* One line of metrics.jsonl; a line that is not what train writes is
 * skipped (a torn last line, an edit by hand). */
static int add_line(history *h, const char *text, size_t line)
{
    cJSON *o = cJSON_Parse(text);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(o, "type");
    int rc = 0;
    if (cJSON_IsString(type) && !strcmp(type->valuestring, "epoch"))
        rc = add_epoch(h, o, line);
    else if (cJSON_IsString(type) && !strcmp(type->valuestring, "step"))
        rc = add_lr(h, num(o, "step"), num(o, "lr"), line);
    cJSON_Delete(o);
    return rc;
}

static int read_history(const char *path, history *h, stk_err *err)
{
    FILE *f = stk_fopen_regular(path, err);
    if (!f)
        return err->code ? err->code : STK_EIO;
    char *buf = NULL;
    size_t cap = 0, line = 0;
    int rc = 0;
    while (!rc && getline(&buf, &cap, f) >= 0)
        rc = add_line(h, buf, line++);
    if (!rc && ferror(f))
        rc = stk_fail(err, STK_EIO, "%s: %s", path, strerror(errno));
    else if (rc)
        rc = stk_fail(err, rc, "%s: out of memory", path);
    free(buf);
    fclose(f);
    return rc;
}

static int by_step_then_line(const void *a, const void *b)
{
    const lr_point *p = a, *q = b;
    if (p->step != q->step)
        return p->step < q->step ? -1 : 1;
    return p->line < q->line ? -1 : p->line > q->line;
}

/* Sorts the rates by step, keeping the last line's at each step. */
static void sort_lr(history *h)
{
    if (h->nlr > 1)
        qsort(h->lr, h->nlr, sizeof *h->lr, by_step_then_line);
    size_t n = 0;
    for (size_t i = 0; i < h->nlr; i++) {
        if (n && h->lr[n - 1].step == h->lr[i].step)
            n--;
        h->lr[n++] = h->lr[i];
    }
    h->nlr = n;
}

/* A walk through the epochs along rates sorted by step. */
typedef struct epoch_walk {
    int e, prev;     /* the epoch looked at, the last one passed */
    double prev_end; /* where the last one passed ended */
} epoch_walk;

/* Where step s (at or after the steps asked before) lies in epochs:
 * within the first epoch that ended at or after it, by its share of that
 * epoch's steps; -1 past the last epoch drawn (an epoch not finished). */
static double step_x(const history *h, epoch_walk *w, double s)
{
    for (; w->e <= h->nep; w->e++) {
        const epoch_row *r = &h->ep[w->e - 1];
        if (!r->seen || isnan(r->end_step) || r->end_step <= w->prev_end)
            continue; /* not logged, or out of order: no landmark */
        if (s <= r->end_step)
            return w->prev + (double)(w->e - w->prev) * (s - w->prev_end) /
                                 (r->end_step - w->prev_end);
        w->prev_end = r->end_step;
        w->prev = w->e;
    }
    return -1;
}

/* ---- drawing ------------------------------------------------------------ */

enum { WIDTH = 960, HEIGHT = 320, PANEL_W = 320 };
/* the plot area within a panel */
enum { PAD_L = 62, PAD_R = 14, PAD_T = 40, PAD_B = 48 };

typedef struct axis {
    double lo, hi, step;
} axis;

/* Widens [lo, hi] to whole ticks of a 1, 2 or 5 step, about five. */
static axis fit_axis(double lo, double hi)
{
    if (!isfinite(hi - lo)) { /* values near DBL_MAX: a span that fits */
        lo = fmax(lo, -1e307);
        hi = fmin(hi, 1e307);
    }
    if (!(hi > lo)) {
        double pad = fabs(lo) > 0 ? fabs(lo) * 0.5 : 1.0;
        lo -= lo > 0 && lo - pad < 0 ? lo : pad; /* stay at or above 0 */
        hi += pad;
    }
    double raw = (hi - lo) / 5, mag = pow(10, floor(log10(raw))),
           f = raw / mag;
    double step = (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
    return (axis){floor(lo / step + 1e-9) * step,
                  ceil(hi / step - 1e-9) * step, step};
}

/* A panel: the frame of the plot area and its place on the page. */
typedef struct panel {
    double x0, y0, w, h; /* the plot area */
    axis x, y;
} panel;

static double px(const panel *p, double x)
{
    return p->x0 + p->w * (x - p->x.lo) / (p->x.hi - p->x.lo);
}

static double py(const panel *p, double y)
{
    return p->y0 + p->h - p->h * (y - p->y.lo) / (p->y.hi - p->y.lo);
}

/* A tick's label: as few digits as the step needs. */
static void tick_label(char *buf, size_t n, double v, double step)
{
    if (fabs(v) < step * 1e-6)
        v = 0;
    snprintf(buf, n, "%.4g", v);
}

static void draw_frame(FILE *f, const panel *p, const char *title,
                       const char *ylabel)
{
    fprintf(f,
            "<g class=\"panel\">\n<text x=\"%.1f\" y=\"%.1f\" "
            "class=\"title\">%s</text>\n",
            p->x0, p->y0 - 22, title);
    fprintf(f,
            "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" "
            "class=\"frame\"/>\n",
            p->x0, p->y0, p->w, p->h);
    char lab[32];
    for (int i = 0; i <= 1000; i++) { /* y ticks and grid */
        double v = p->y.lo + i * p->y.step;
        if (v > p->y.hi + p->y.step * 1e-6)
            break;
        double y = py(p, v);
        tick_label(lab, sizeof lab, v, p->y.step);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                "class=\"grid\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" class=\"ytick\">%s</text>\n",
                p->x0, y, p->x0 + p->w, y, p->x0 - 5, y + 4, lab);
    }
    for (int i = 0; i <= 1000; i++) { /* x ticks */
        double v = p->x.lo + i * p->x.step;
        if (v > p->x.hi + p->x.step * 1e-6)
            break;
        double x = px(p, v);
        tick_label(lab, sizeof lab, v, p->x.step);
        fprintf(f,
                "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                "class=\"tick\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" class=\"xtick\">%s</text>\n",
                x, p->y0 + p->h, x, p->y0 + p->h + 5, x, p->y0 + p->h + 18,
                lab);
    }
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" class=\"xlabel\">epoch</text>\n",
            p->x0 + p->w / 2, p->y0 + p->h + 36);
    double ly = p->y0 + p->h / 2, lx = p->x0 - 48;
    fprintf(f,
            "<text x=\"%.1f\" y=\"%.1f\" class=\"ylabel\" "
            "transform=\"rotate(-90 %.1f %.1f)\">%s</text>\n",
            lx, ly, lx, ly, ylabel);
}

/* A legend entry, right-aligned in the title row: slot 0 is rightmost. */
static void draw_legend(FILE *f, const panel *p, int slot, const char *color,
                        const char *name)
{
    double x = p->x0 + p->w - 62 * (slot + 1), y = p->y0 - 26;
    fprintf(
        f,
        "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" "
        "stroke-width=\"2\"/><text x=\"%.1f\" y=\"%.1f\" "
        "class=\"legend\">%s</text>\n",
        x, y, x + 16, y, color, x + 20, y + 4, name);
}

/* One series: a polyline of its points (x, y pairs), with markers where
 * they are few enough to tell apart. */
static void draw_series(FILE *f, const panel *p, const char *id,
                        const char *color, const double *xy, size_t n)
{
    fprintf(
        f,
        "<polyline id=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.6\" "
        "points=\"",
        id, color);
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%s%.2f,%.2f", i ? " " : "", px(p, xy[2 * i]),
                py(p, xy[2 * i + 1]));
    fputs("\"/>\n", f);
    for (size_t i = 0; n <= 60 && i < n; i++)
        fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.2\" fill=\"%s\"/>\n",
                px(p, xy[2 * i]), py(p, xy[2 * i + 1]), color);
}

static const char *const color_train = "#1f77b4",
                         *const color_test = "#d62728",
                         *const color_lr = "#2ca02c";

/* Collects series s of the epochs into xy (x = the epoch; accuracy in
 * percent), widening [*lo, *hi]. */
static size_t epoch_points(const history *h, int s, double *xy, double *lo,
                           double *hi)
{
    size_t n = 0;
    double scale = s == TRAIN_ACC || s == TEST_ACC ? 100 : 1;
    for (int e = 1; e <= h->nep; e++) {
        double v = h->ep[e - 1].v[s] * scale;
        if (!h->ep[e - 1].seen || isnan(v))
            continue;
        xy[2 * n] = e;
        xy[2 * n + 1] = v;
        *lo = fmin(*lo, v);
        *hi = fmax(*hi, v);
        n++;
    }
    return n;
}

/* The loss or accuracy panel: train and test series of the epochs. */
static void draw_pair(FILE *f, const history *h, panel *p, int train, int test,
                      const char *title, const char *ylabel, double *xy)
{
    double lo = INFINITY, hi = -INFINITY;
    size_t n1 = epoch_points(h, train, xy, &lo, &hi);
    size_t n2 = epoch_points(h, test, xy + 2 * n1, &lo, &hi);
    bool acc = train == TRAIN_ACC;
    if (!(lo <= hi))
        lo = 0, hi = acc ? 100 : 1;
    if (!acc)
        lo = fmin(lo, 0); /* a loss reads best from 0 */
    p->y = fit_axis(lo, hi);
    if (acc && p->y.hi > 100)
        p->y.hi = 100;
    draw_frame(f, p, title, ylabel);
    draw_legend(f, p, 0, color_test, "test");
    draw_legend(f, p, 1, color_train, "train");
    draw_series(f, p, series_key[train], color_train, xy, n1);
    draw_series(f, p, series_key[test], color_test, xy + 2 * n1, n2);
    fputs("</g>\n", f);
}

/* The learning-rate panel: every rate logged, placed in epochs; of more
 * than MAX_LR_POINTS (more than the panel has pixels), every k-th and the
 * last. */
static void draw_lr(FILE *f, const history *h, panel *p, double *xy)
{
    size_t n = 0;
    double hi = 0;
    epoch_walk w = {1, 0, 0};
    for (size_t i = 0; i < h->nlr; i++) {
        double x = step_x(h, &w, h->lr[i].step);
        if (x < 0)
            break; /* the rest are later still */
        xy[2 * n] = x;
        xy[2 * n + 1] = h->lr[i].lr;
        hi = fmax(hi, h->lr[i].lr);
        n++;
    }
    size_t k = (n + MAX_LR_POINTS - 1) / MAX_LR_POINTS, kept = 0;
    for (size_t i = 0; k > 1 && i < n; i++)
        if (i % k == 0 || i == n - 1) {
            xy[2 * kept] = xy[2 * i];
            xy[2 * kept + 1] = xy[2 * i + 1];
            kept++;
        }
    if (k > 1)
        n = kept;
    p->y = fit_axis(0, hi > 0 ? hi : 1);
    draw_frame(f, p, "learning rate", "lr");
    draw_legend(f, p, 0, color_lr, "lr");
    draw_series(f, p, "lr", color_lr, xy, n);
    fputs("</g>\n", f);
}

static void draw(FILE *f, const history *h, double *xy)
{
    fprintf(
        f,
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
        "viewBox=\"0 0 %d %d\" font-family=\"sans-serif\" font-size=\"11\">\n"
        "<style>.frame{fill:none;stroke:#444}.grid{stroke:#e4e4e4}"
        ".tick{stroke:#444}.ytick{text-anchor:end}.xtick,.xlabel,.ylabel"
        "{text-anchor:middle}.title{font-size:13px;font-weight:bold}</style>\n"
        "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
        WIDTH, HEIGHT, WIDTH, HEIGHT);
    panel p[3];
    for (int k = 0; k < 3; k++)
        p[k] = (panel){k * PANEL_W + PAD_L,
                       PAD_T,
                       PANEL_W - PAD_L - PAD_R,
                       HEIGHT - PAD_T - PAD_B,
                       fit_axis(0, h->nep > 1 ? h->nep : 1),
                       {0, 1, 1}};
    draw_pair(f, h, &p[0], TRAIN_LOSS, TEST_LOSS, "loss", "loss", xy);
    draw_pair(f, h, &p[1], TRAIN_ACC, TEST_ACC, "accuracy", "accuracy (%)",
              xy);
    draw_lr(f, h, &p[2], xy);
    fputs("</svg>\n", f);
}

/* Writes the drawing to svg_path's temporary file, then renames it. */
static int write_svg(const history *h, const char *svg_path, stk_err *err)
{
    size_t most = 2 * (size_t)h->nep > h->nlr ? 2 * (size_t)h->nep : h->nlr;
    double *xy = malloc((most + 1) * 2 * sizeof *xy);
    char tmp[4200];
    if (!xy)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", svg_path);
    if (snprintf(tmp, sizeof tmp, "%s.tmp", svg_path) >= (int)sizeof tmp) {
        free(xy);
        return stk_fail(err, STK_ERANGE, "%s: path too long", svg_path);
    }
    /* the temporary name is ours: whatever is there (a FIFO even) goes,
     * and the file is created anew, never opened */
    unlink(tmp);
    int fd = stk_open_output(tmp, O_WRONLY | O_CREAT | O_EXCL, err);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "w");
    if (!f) {
        int rc = fd < 0 ? fd
                        : stk_fail(err, stk_from_errno(errno), "%s: %s", tmp,
                                   strerror(errno));
        if (fd >= 0)
            close(fd);
        free(xy);
        return rc;
    }
    draw(f, h, xy);
    free(xy);
    const char *bad = ferror(f) ? tmp : NULL; /* where it failed */
    int e = errno;
    if (fclose(f) != 0 && !bad) {
        bad = tmp;
        e = errno;
    }
    if (!bad && rename(tmp, svg_path) != 0) {
        bad = svg_path;
        e = errno;
    }
    if (!bad)
        return 0;
    unlink(tmp);
    return stk_fail(err, stk_from_errno(e), "%s: %s", bad, strerror(e));
}

int stk_curves_write(const char *metrics_path, const char *svg_path,
                     stk_err *err)
{
    history h = {0};
    int rc = read_history(metrics_path, &h, err);
    if (!rc) {
        sort_lr(&h);
        rc = write_svg(&h, svg_path, err);
    }
    free(h.ep);
    free(h.lr);
    return rc;
}
