/* sweep - time the loader for several worker counts and pick the knee. A
 * thin main over the loader: for each count, run whole epochs (optionally
 * with a simulated training step per batch) and report samples/s, MB/s, time
 * to first batch and data stall, as a table, JSON and an SVG chart. */
#include "common/cli.h"
#include "loader/loader.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_COUNTS 32

typedef struct config {
    const char *db, *split, *raw, *json, *plot;
    int counts[MAX_COUNTS], ncounts;
    int batch, epochs, prefetch;
    double consume_ms;
    uint64_t seed;
    const char *augment; /* "none", "crop" (train --augment's) or "rrc";
                            NULL: rrc on aspect-keeping databases, else none */
    int crop_size;       /* rrc and --eval output side; 0 = crop_side's */
    bool eval;           /* Resize(size / 0.875) + CenterCrop(size) */
} config;

typedef struct result {
    const char *source; /* "lmdb" or "raw" */
    int workers;
    stk_loader_stats st;
} result;

static const char usage[] =
    "usage: sweep --db DB_DIR [--split train] [--workers 0,1,2,4,8]\n"
    "             [--batch 256] [--epochs 1] [--prefetch K] [--consume-ms X]\n"
    "             [--raw RAW_DIR] [--seed S] [--json OUT.json] [--plot OUT.svg]\n"
    "             [--augment none|crop|rrc | --eval] [--crop-size N]\n"
    "Times the loader for each worker count. --consume-ms simulates a training\n"
    "step of X ms per batch; --raw also times decoding RAW_DIR's image files\n"
    "on every epoch (what an ImageFolder does), side by side. --augment: the\n"
    "workers' transform (crop: train --augment's padded crop + flip; rrc:\n"
    "RandomResizedCrop(N) + flip); --eval: train's test transform, Resize +\n"
    "CenterCrop(N) (docs/cli.md, train --crop-ratio);\n"
    "N = --crop-size, default the stored side (0.875 of the shorter side on\n"
    "aspect-keeping databases, as train).\n";

static int parse_counts(const char *s, config *c)
{
    return stk_cli_int_list("sweep", "--workers", s, 0, STK_LOADER_MAX_WORKERS,
                            c->counts, MAX_COUNTS, &c->ncounts);
}

static int parse_args(int argc, char **argv, config *c)
{
    static const struct option longs[] = {
        {"db", required_argument, 0, 'd'},
        {"split", required_argument, 0, 's'},
        {"workers", required_argument, 0, 'w'},
        {"batch", required_argument, 0, 'b'},
        {"epochs", required_argument, 0, 'e'},
        {"prefetch", required_argument, 0, 'p'},
        {"consume-ms", required_argument, 0, 'c'},
        {"raw", required_argument, 0, 'r'},
        {"seed", required_argument, 0, 'S'},
        {"json", required_argument, 0, 'j'},
        {"plot", required_argument, 0, 'P'},
        {"augment", required_argument, 0, 'a'},
        {"crop-size", required_argument, 0, 'C'},
        {"eval", no_argument, 0, 'E'},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int ch, rc = 0;
    float consume;
    opterr = 0;
    while (!rc && (ch = getopt_long(argc, argv, ":h", longs, NULL)) != -1) {
        switch (ch) {
        case 'd': c->db = optarg; break;
        case 's': c->split = optarg; break;
        case 'w': rc = parse_counts(optarg, c); break;
        case 'b': rc = stk_cli_int("sweep", "--batch", optarg, 1, 1 << 20, &c->batch); break;
        case 'e': rc = stk_cli_int("sweep", "--epochs", optarg, 1, 1000, &c->epochs); break;
        case 'p': rc = stk_cli_int("sweep", "--prefetch", optarg, 1, 1024, &c->prefetch); break;
        case 'c': rc = stk_cli_float("sweep", "--consume-ms", optarg, 0, 1e5, &consume); c->consume_ms = consume; break;
        case 'r': c->raw = optarg; break;
        case 'S': rc = stk_cli_u64("sweep", "--seed", optarg, &c->seed); break;
        case 'j': c->json = optarg; break;
        case 'P': c->plot = optarg; break;
        case 'a': c->augment = optarg; break;
        case 'C': rc = stk_cli_int("sweep", "--crop-size", optarg, 1, 16384, &c->crop_size); break;
        case 'E': c->eval = true; break;
        case 'h': fputs(usage, stdout); exit(0);
        case ':':
            fprintf(stderr, "sweep: %s needs a value\n", argv[optind - 1]);
            return -1;
        default:
            fprintf(stderr, "sweep: unknown option '%s' (see sweep --help)\n",
                    argv[optind - 1]);
            return -1;
        }
    }
    if (!rc && c->augment && strcmp(c->augment, "none") &&
        strcmp(c->augment, "crop") && strcmp(c->augment, "rrc")) {
        fprintf(stderr, "sweep: --augment: expected none, crop or rrc, got "
                        "'%s'\n", c->augment);
        return -1;
    }
    if (!rc && c->eval && c->augment && strcmp(c->augment, "none")) {
        fprintf(stderr, "sweep: --eval and --augment %s exclude each other\n",
                c->augment);
        return -1;
    }
    if (!rc && (optind != argc || !c->db)) {
        fprintf(stderr, "sweep: --db DB_DIR is required and takes no other "
                        "arguments (see sweep --help)\n");
        return -1;
    }
    return rc;
}

static void consume(double ms)
{
    if (ms <= 0)
        return;
    struct timespec ts = {(time_t)(ms / 1000),
                          (long)((ms - 1000 * (time_t)(ms / 1000)) * 1e6)};
    while (nanosleep(&ts, &ts) && errno == EINTR)
        ;
}

/* Runs the configured epochs through one loader. */
static int time_loader(stk_loader *l, const config *c, stk_loader_stats *st,
                       stk_err *err)
{
    stk_batch b;
    for (int e = 0; e < c->epochs; e++) {
        int rc;
        while ((rc = stk_loader_next(l, &b, err)) == 1) {
            consume(c->consume_ms);
            stk_loader_release(l, &b);
        }
        if (rc < 0)
            return rc;
    }
    stk_loader_stats_get(l, st);
    return 0;
}

/* The centre crop the flags and the database ask for (its size is every
 * transform's), as train chooses it. */
static int crop_plan(const config *c, const stk_meta *m,
                     stk_loader_xform *centre, stk_err *err)
{
    return stk_loader_crop_plan(m, c->crop_size, 0, c->db, centre, err);
}

/* The loader options of one run: the flags' transform on a database of
 * height h. */
static stk_loader_opts run_opts(const config *c, const stk_meta *m,
                                int workers)
{
    stk_loader_opts o = {.split = c->split, .batch_size = c->batch,
                         .workers = workers, .prefetch = c->prefetch,
                         .shuffle = true, .seed = c->seed};
    stk_loader_xform centre = {0};
    crop_plan(c, m, &centre, NULL); /* checked once in main */
    int h = m->height, size = centre.size;
    if (!strcmp(c->augment, "rrc")) {
        o.xform = (stk_loader_xform){.kind = STK_XFORM_RRC, .size = size,
                                     .flip = true};
    } else if (c->eval || m->variable) {
        /* records of many sizes: train's loader crops them to one for
         * none and crop alike (crop's padded crop is train's own step) */
        o.xform = centre;
    } else if (!strcmp(c->augment, "crop")) { /* train --augment's */
        o.aug_pad = h / 8;
        o.aug_flip = true;
    }
    return o;
}

static int run_one(stk_store *store, const stk_source *src, int src_split,
                   const config *c, result *r, stk_err *err)
{
    stk_loader_opts o = run_opts(c, stk_store_meta(store), r->workers);
    stk_loader *l;
    int rc = src ? stk_loader_open_raw(src, src_split, &o, &l, err)
                 : stk_loader_open(store, &o, &l, err);
    if (rc)
        return rc;
    rc = time_loader(l, c, &r->st, err);
    stk_loader_close(l);
    return rc;
}

static void print_row(const result *r)
{
    double busy = 0;
    int n = r->workers ? r->workers : 1;
    for (int i = 0; i < n; i++)
        busy += r->st.busy[i];
    printf("%-6s %7d %11.0f %9.1f %11.2f %8.1f %9.0f%%\n", r->source,
           r->workers, r->st.samples_per_s, r->st.bytes_per_s / 1e6,
           r->st.first_batch * 1e3, 100 * r->st.stall,
           r->st.elapsed > 0 ? 100 * busy / n / r->st.elapsed : 0);
    fflush(stdout);
}

/* The fewest workers within 5% of the best LMDB throughput. */
static int recommend(const result *rs, int n)
{
    double best = 0;
    for (int i = 0; i < n; i++)
        if (!strcmp(rs[i].source, "lmdb") && rs[i].st.samples_per_s > best)
            best = rs[i].st.samples_per_s;
    int pick = -1;
    for (int i = 0; i < n; i++)
        if (!strcmp(rs[i].source, "lmdb") &&
            rs[i].st.samples_per_s >= 0.95 * best &&
            (pick < 0 || rs[i].workers < rs[pick].workers))
            pick = i;
    return pick;
}

static int write_json(const config *c, const stk_meta *m, const result *rs,
                      int n, int pick, stk_err *err)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "db", c->db);
    cJSON_AddStringToObject(o, "split", c->split);
    cJSON_AddNumberToObject(o, "batch", c->batch);
    cJSON_AddNumberToObject(o, "epochs", c->epochs);
    cJSON_AddNumberToObject(o, "consume_ms", c->consume_ms);
    int shape[3] = {m->channels, m->height, m->width};
    cJSON_AddItemToObject(o, "shape", cJSON_CreateIntArray(shape, 3));
    /* what the workers made of the records, and its size */
    stk_loader_xform centre = {0};
    crop_plan(c, m, &centre, NULL);
    stk_loader_opts lo = run_opts(c, m, 1);
    bool sized = lo.xform.kind != STK_XFORM_NONE;
    int out[3] = {m->channels, sized ? centre.size : m->height,
                  sized ? centre.size : m->width};
    cJSON_AddStringToObject(o, "transform", c->eval ? "eval" : c->augment);
    cJSON_AddItemToObject(o, "sample_shape", cJSON_CreateIntArray(out, 3));
    cJSON *arr = cJSON_AddArrayToObject(o, "results");
    for (int i = 0; i < n; i++) {
        cJSON *r = cJSON_CreateObject();
        cJSON_AddStringToObject(r, "source", rs[i].source);
        cJSON_AddNumberToObject(r, "workers", rs[i].workers);
        cJSON_AddNumberToObject(r, "samples_per_s", rs[i].st.samples_per_s);
        cJSON_AddNumberToObject(r, "bytes_per_s", rs[i].st.bytes_per_s);
        cJSON_AddNumberToObject(r, "first_batch_s", rs[i].st.first_batch);
        cJSON_AddNumberToObject(r, "stall", rs[i].st.stall);
        cJSON_AddNumberToObject(r, "elapsed_s", rs[i].st.elapsed);
        cJSON_AddNumberToObject(r, "samples", (double)rs[i].st.samples);
        cJSON *busy = cJSON_AddArrayToObject(r, "busy_s");
        for (int w = 0; w < (rs[i].workers ? rs[i].workers : 1); w++)
            cJSON_AddItemToArray(busy, cJSON_CreateNumber(rs[i].st.busy[w]));
        cJSON_AddItemToArray(arr, r);
    }
    cJSON_AddNumberToObject(o, "recommended_workers",
                            pick >= 0 ? rs[pick].workers : -1);
    char *text = cJSON_Print(o);
    cJSON_Delete(o);
    if (!text)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", c->json);
    FILE *f = stk_fopen_output(c->json, err); /* a FIFO is refused */
    if (!f) {
        free(text);
        return err->code;
    }
    int ok = fputs(text, f) >= 0;
    ok = fclose(f) == 0 && ok;
    int e = errno;
    free(text);
    return ok ? 0 : stk_fail(err, STK_EIO, "%s: cannot write: %s", c->json,
                             strerror(e));
}

/* An SVG line chart of samples/s against workers, one line per source. */
static int write_svg(const config *c, const result *rs, int n, stk_err *err)
{
    const int W = 640, H = 400, L = 80, R = 20, T = 40, B = 50;
    double ymax = 1;
    int xmax = 1;
    for (int i = 0; i < n; i++) {
        ymax = rs[i].st.samples_per_s > ymax ? rs[i].st.samples_per_s : ymax;
        xmax = rs[i].workers > xmax ? rs[i].workers : xmax;
    }
    ymax *= 1.1;
    FILE *f = stk_fopen_output(c->plot, err); /* a FIFO is refused */
    if (!f)
        return err->code;
    fprintf(f, "<svg xmlns='http://www.w3.org/2000/svg' width='%d' height='%d' "
               "font-family='sans-serif' font-size='12'>\n"
               "<rect width='100%%' height='100%%' fill='white'/>\n"
               "<text x='%d' y='24' font-size='15'>stoke loader: samples/s "
               "against workers (batch %d, %s)</text>\n",
            W, H, L, c->batch, c->split);
    fprintf(f, "<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='black'/>\n"
               "<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='black'/>\n",
            L, H - B, W - R, H - B, L, T, L, H - B);
    for (int t = 0; t <= 4; t++) {
        double v = ymax * t / 4;
        int y = H - B - (int)((H - T - B) * t / 4.0);
        fprintf(f, "<text x='%d' y='%d' text-anchor='end'>%.0f</text>\n"
                   "<line x1='%d' y1='%d' x2='%d' y2='%d' stroke='#ddd'/>\n",
                L - 6, y + 4, v, L, y, W - R, y);
    }
    for (int x = 0; x <= xmax; x++)
        fprintf(f, "<text x='%d' y='%d' text-anchor='middle'>%d</text>\n",
                L + (W - L - R) * x / xmax, H - B + 18, x);
    fprintf(f, "<text x='%d' y='%d' text-anchor='middle'>workers</text>\n",
            (L + W - R) / 2, H - 12);
    const char *sources[2] = {"lmdb", "raw"}, *colors[2] = {"#1f6fb4", "#d0602a"};
    for (int s = 0; s < 2; s++) {
        fprintf(f, "<polyline fill='none' stroke='%s' stroke-width='2' points='",
                colors[s]);
        int any = 0;
        for (int i = 0; i < n; i++)
            if (!strcmp(rs[i].source, sources[s])) {
                any = 1;
                fprintf(f, "%d,%d ", L + (W - L - R) * rs[i].workers / xmax,
                        H - B - (int)((H - T - B) * rs[i].st.samples_per_s / ymax));
            }
        fprintf(f, "'/>\n");
        if (any)
            fprintf(f, "<text x='%d' y='%d' fill='%s'>%s</text>\n", W - R - 60,
                    T + 16 + 16 * s, colors[s],
                    s ? "raw files (decode each epoch)" : "stoke LMDB");
    }
    fprintf(f, "</svg>\n");
    int failed = ferror(f); /* a write that failed before the last flush */
    if (fclose(f) || failed)
        return stk_fail(err, STK_EIO, "%s: write failed", c->plot);
    return 0;
}

/* Reads the split once so that every worker count meets the same (warm)
 * page cache, whatever order the counts run in: every record's bytes,
 * whatever their format (nothing decoded). */
static int warm_up(stk_store *store, const config *c, stk_err *err)
{
    stk_view *v;
    int rc = stk_view_open(store, c->split, &v, err);
    volatile uint8_t sink = 0;
    for (uint64_t i = 0; !rc && i < stk_view_count(v); i++) {
        stk_record r;
        if (!(rc = stk_view_get(v, i, &r, err)))
            for (uint32_t k = 0; k < r.nbytes; k += 4096)
                sink ^= r.data[k];
    }
    (void)sink;
    stk_view_close(v);
    return rc;
}

static int cmp_path(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The files of the split that prep --skip-bad left out of the database,
 * left out of the raw folder's split too, so both rows time the same
 * samples. The database lists them by the path prep was given; each is
 * offered as every tail of it (dog/bad.jpg of _data/photos/dog/bad.jpg),
 * and the folder drops a file whose path under RAW_DIR is one of them. */
static int drop_skipped(const config *c, const stk_meta *m, stk_source *src,
                        int split, stk_err *err)
{
    cJSON *sk = m->skipped_json ? cJSON_Parse(m->skipped_json) : NULL;
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(sk, c->split), *f;
    size_t n = 0, cap = 0;
    const char **tails = NULL;
    int rc = 0;
    cJSON_ArrayForEach(f, list)
    {
        const char *p = cJSON_GetStringValue(cJSON_GetObjectItem(f, "file"));
        for (; p && *p && !rc; p = strchr(p, '/') ? strchr(p, '/') + 1 : NULL) {
            if (n == cap) {
                const char **t = realloc(tails, (cap = cap ? 2 * cap : 64) *
                                                    sizeof *t);
                if (!t) {
                    rc = stk_fail(err, STK_ENOMEM, "out of memory");
                    break;
                }
                tails = t;
            }
            tails[n++] = p;
        }
    }
    if (!rc && n) {
        qsort(tails, n, sizeof *tails, cmp_path);
        uint64_t dropped = stk_source_drop_files(src, split, tails, n);
        if (dropped)
            fprintf(stderr, "sweep: --raw leaves out the %llu file(s) that "
                            "prep --skip-bad left out of %s's split %s\n",
                    (unsigned long long)dropped, c->db, c->split);
    }
    free(tails);
    cJSON_Delete(sk);
    return rc;
}

/* Opens the raw folder with the database's shape, and finds the split. */
static int open_raw(const config *c, const stk_meta *m, stk_source **src,
                    int *split, stk_err *err)
{
    /* the database's holdout, so that "test" holds the same files */
    stk_source_opts so = {.format = STK_SRC_FOLDER, .size = m->height,
                          .channels = m->channels, .holdout = m->holdout,
                          .holdout_seed = m->holdout_seed};
    int rc = stk_source_open(c->raw, &so, src, err);
    if (rc)
        return rc;
    for (int k = 0; k < stk_source_nsplits(*src); k++)
        if (!strcmp(stk_source_split_name(*src, k), c->split)) {
            *split = k;
            return drop_skipped(c, m, *src, k, err);
        }
    return stk_fail(err, STK_ENOENT, "%s: no split \"%s\"", c->raw, c->split);
}

int main(int argc, char **argv)
{
    config c = {.split = "train", .counts = {0, 1, 2, 4, 8}, .ncounts = 5,
                .batch = 256, .epochs = 1};
    if (parse_args(argc, argv, &c))
        return 2;
    stk_err err = {0};
    stk_store *store = NULL;
    stk_source *src = NULL;
    int src_split = 0, rc = stk_store_open(c.db, 0, &store, &err);
    const stk_meta *m = rc ? NULL : stk_store_meta(store);
    bool usage = false; /* a flag the database contradicts: exit 2 */
    if (!rc && stk_meta_split(m, c.split) < 0) {
        usage = true;
        rc = stk_fail(&err, STK_ENOENT, "--split: no split \"%s\" in %s",
                      c.split, c.db);
    }
    if (!rc && !c.augment) /* records of many sizes need a crop to one */
        c.augment = m->variable && !c.eval ? "rrc" : "none";
    stk_loader_xform centre = {0};
    if (!rc && (rc = crop_plan(&c, m, &centre, &err)))
        usage = true;
    if (!rc && c.raw)
        rc = open_raw(&c, m, &src, &src_split, &err);
    if (!rc)
        rc = warm_up(store, &c, &err);
    result rs[2 * MAX_COUNTS];
    int n = 0;
    if (!rc) {
        char shape[64];
        if (m->variable)
            snprintf(shape, sizeof shape, "%dx(own HxW)", m->channels);
        else
            snprintf(shape, sizeof shape, "%dx%dx%d", m->channels, m->height,
                     m->width);
        if (m->encoding == STK_ENC_JPEG)
            strcat(shape, " JPEG");
        printf("sweep: %s split %s, %llu samples of %s, batch %d, %d "
               "epoch(s), consume %.1f ms/batch, transform %s (to %d)\n",
               c.db, c.split,
               (unsigned long long)m->splits[stk_meta_split(m, c.split)].count,
               shape, c.batch, c.epochs, c.consume_ms,
               c.eval ? "eval" : c.augment, centre.size);
        printf("source workers   samples/s      MB/s  first(ms)  stall%%  "
               "busy/wkr\n");
    }
    for (int s = 0; !rc && s < (c.raw ? 2 : 1); s++)
        for (int i = 0; !rc && i < c.ncounts; i++) {
            result *r = &rs[n];
            r->source = s ? "raw" : "lmdb";
            r->workers = c.counts[i];
            rc = run_one(store, s ? src : NULL, src_split, &c, r, &err);
            if (!rc)
                print_row(&rs[n++]);
        }
    int pick = rc ? -1 : recommend(rs, n);
    if (pick >= 0)
        printf("recommendation: --workers %d (the fewest within 5%% of the "
               "best, %.0f samples/s)\n",
               rs[pick].workers, rs[pick].st.samples_per_s);
    if (!rc && c.json)
        rc = write_json(&c, m, rs, n, pick, &err);
    if (!rc && c.plot)
        rc = write_svg(&c, rs, n, &err);
    if (rc)
        fprintf(stderr, "sweep: error: %s\n", err.msg);
    stk_source_close(src);
    stk_store_close(store);
    return rc ? (usage ? 2 : 1) : 0;
}
