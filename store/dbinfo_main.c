/* dbinfo - what is in a stoke database: metadata, counts per split, label
 * histogram, mean/std, skipped files; --grid writes a contact sheet. */
#include "preprocess/preprocess.h"
#include "store/store.h"

#include <cjson/cJSON.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#define GRID 8
#define GAP 2

static const char usage[] =
    "usage: dbinfo DB_DIR [--split NAME] [--grid OUT.png] [--verify]\n"
    "Print what a stoke database holds; --grid writes a PNG contact sheet of\n"
    "the first 64 samples of a split (default: the first split); --verify\n"
    "reads every record of every split and checks it against the metadata\n"
    "and checksums (exit 1 when anything is wrong).\n";

/* Prints a name from the database for a terminal: valid UTF-8 as is,
 * control characters (C0, DEL, C1), bytes that are not UTF-8 and the
 * backslash as \xHH escapes, so a file name cannot move the cursor or
 * change colours. */
static void put_name(const char *s)
{
    size_t cap = 4 * strlen(s) + 1;
    char *clean = malloc(cap);
    fputs(clean ? stk_text_printable(clean, cap, s) : "?", stdout);
    free(clean);
}

static void print_header(const char *dir, const stk_meta *m)
{
    char path[4096];
    struct stat st;
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    double mib = stat(path, &st) == 0 ? st.st_size / 1048576.0 : 0;
    printf("database  %s (%s, %.1f MiB)\n", dir,
           m->complete ? "complete" : "INCOMPLETE", mib);
    printf("source    ");
    put_name(m->source_path);
    printf(" (");
    put_name(m->source_format);
    printf(")\ncreated   ");
    put_name(m->created);
    printf(" by ");
    put_name(m->tool);
    printf("\n");
    if (stk_meta_fixed(m))
        printf("record    %d-byte header + uint8 %dx%dx%d (CHW) = %u bytes\n",
               STK_RECORD_HEADER, m->channels, m->height, m->width,
               STK_RECORD_HEADER + stk_meta_sample_bytes(m));
    else if (!m->variable)
        printf("record    %d-byte header + %dx%dx%d as JPEG (quality %d)\n",
               STK_RECORD_HEADER_V2, m->channels, m->height, m->width,
               m->quality);
    else
        printf("record    %d-byte header + %d channel(s), variable size "
               "(short side %d, max side %d), %s",
               STK_RECORD_HEADER_V2, m->channels, m->short_side, m->max_side,
               m->encoding == STK_ENC_JPEG ? "JPEG" : "raw CHW");
    if (m->variable && m->encoding == STK_ENC_JPEG)
        printf(" (quality %d)\n", m->quality);
    else if (m->variable)
        printf("\n");
    if (m->holdout > 0)
        printf("holdout   %g of each class moved from \"train\" to \"test\" "
               "(prep --holdout %g --holdout-seed %llu)\n",
               m->holdout, m->holdout, (unsigned long long)m->holdout_seed);
    printf("classes   %d:", m->nclasses);
    for (int c = 0; c < m->nclasses; c++) {
        printf("%s ", c ? "," : "");
        put_name(m->classes[c]);
    }
    printf("\n");
}

/* Sizes of a format 2 split's records, read from their headers: min/max H
 * and W and the bytes of an average record (one page read per record). */
static void print_sizes(stk_store *s, const stk_split_meta *sp)
{
    stk_view *v;
    stk_err e;
    if (stk_view_open(s, sp->name, &v, &e)) {
        printf("\n  sizes: %s", e.msg);
        return;
    }
    int hmin = STK_MAX_SIDE, hmax = 0, wmin = STK_MAX_SIDE, wmax = 0;
    uint64_t bytes = 0, n = stk_view_count(v);
    for (uint64_t i = 0; i < n; i++) {
        stk_record r;
        if (stk_view_get(v, i, &r, &e)) {
            printf("\n  sizes: %s", e.msg);
            break;
        }
        hmin = r.height < hmin ? r.height : hmin;
        hmax = r.height > hmax ? r.height : hmax;
        wmin = r.width < wmin ? r.width : wmin;
        wmax = r.width > wmax ? r.width : wmax;
        bytes += STK_RECORD_HEADER_V2 + (uint64_t)r.nbytes;
    }
    if (n)
        printf("\n  height %d..%d   width %d..%d   %.0f bytes/record", hmin,
               hmax, wmin, wmax, (double)bytes / (double)n);
    stk_view_close(v);
}

static void print_split(stk_store *s, const stk_meta *m,
                        const stk_split_meta *sp)
{
    printf("\nsplit %s: %llu records", sp->name,
           (unsigned long long)sp->count);
    if (sp->nskipped)
        printf(", %llu skipped", (unsigned long long)sp->nskipped);
    if (!stk_meta_fixed(m))
        print_sizes(s, sp);
    printf("\n  mean");
    for (int c = 0; c < m->channels; c++)
        printf(" %.4f", sp->mean[c]);
    printf("   std");
    for (int c = 0; c < m->channels; c++)
        printf(" %.4f", sp->std[c]);
    printf("\n  labels\n");
    uint64_t top = 1;
    for (int c = 0; c < m->nclasses; c++)
        top = sp->label_counts[c] > top ? sp->label_counts[c] : top;
    for (int c = 0; c < m->nclasses; c++) {
        int bar = (int)(30 * sp->label_counts[c] / top);
        printf("    %3d ", c);
        put_name(m->classes[c]);
        printf("  %llu %.*s\n", (unsigned long long)sp->label_counts[c], bar,
               "##############################");
    }
}

/* The files prep --skip-bad left out, of one split or (NULL) of all. */
static void print_skipped(const stk_meta *m, const char *only)
{
    cJSON *sk = m->skipped_json ? cJSON_Parse(m->skipped_json) : NULL;
    const cJSON *split;
    cJSON_ArrayForEach(split, sk)
    {
        const cJSON *f;
        if (only && (!split->string || strcmp(only, split->string)))
            continue;
        printf("\nskipped in ");
        put_name(split->string ? split->string : "?");
        printf(":\n");
        cJSON_ArrayForEach(f, split)
        {
            const char *file =
                cJSON_GetStringValue(cJSON_GetObjectItem(f, "file"));
            const char *why =
                cJSON_GetStringValue(cJSON_GetObjectItem(f, "error"));
            printf("  ");
            put_name(file ? file : "?");
            printf(": ");
            put_name(why ? why : "?");
            printf("\n");
        }
    }
    cJSON_Delete(sk);
}

/* Tile side of a sheet of a format 2 database: records are decoded and
 * fitted (shorter side resized, centre crop) to it. */
#define TILE_MAX 128

/* The pixels of a record of a format 2 database as a tile x tile CHW
 * square in out (channels c). */
static int fit_tile(stk_decoder *d, const stk_meta *m, const stk_record *rec,
                    int tile, uint8_t *out, stk_err *err)
{
    size_t plane = (size_t)rec->height * rec->width;
    uint8_t *chw = malloc(plane * m->channels);
    stk_image im = {rec->width, rec->height, m->channels,
                    malloc(plane * m->channels)};
    int rc = chw && im.px ? stk_record_pixels(d, m, rec, chw, err)
                          : stk_fail(err, STK_ENOMEM, "out of memory");
    for (size_t i = 0; !rc && i < plane; i++) /* CHW -> HWC */
        for (int k = 0; k < m->channels; k++)
            im.px[i * m->channels + k] = chw[k * plane + i];
    if (!rc && stk_image_fit(&im, m->channels, tile, out))
        rc = stk_fail(err, STK_ENOMEM, "out of memory");
    free(chw);
    stk_image_free(&im);
    return rc;
}

/* Writes up to 64 samples of split as an 8x8 sheet with gaps. */
static int write_grid(stk_store *s, const char *split, const char *out,
                      stk_err *err)
{
    const stk_meta *m = stk_store_meta(s);
    int c = m->channels == 1 ? 1 : 3, h = m->height, w = m->width;
    bool fit = !stk_meta_fixed(m); /* decode, fit to a square tile */
    if (fit) { /* square tiles, whatever the records' shape */
        int side = m->variable ? (m->short_side ? m->short_side : m->max_side)
                               : (h < w ? h : w);
        h = w = side < TILE_MAX ? side : TILE_MAX;
    }
    if (fit && m->channels != c)
        return stk_fail(err, STK_EINVAL,
                        "--grid: %d-channel records cannot be shown",
                        m->channels);
    uint8_t *tile = fit ? malloc((size_t)c * h * w) : NULL;
    stk_decoder *dec = NULL;
    if (fit && (!tile || stk_decoder_create(&dec, err))) {
        free(tile);
        return tile ? STK_ENOMEM : stk_fail(err, STK_ENOMEM, "out of memory");
    }
    int W = GRID * w + (GRID + 1) * GAP, H = GRID * h + (GRID + 1) * GAP;
    uint8_t *sheet = calloc((size_t)W * H * c, 1);
    stk_reader *r = NULL;
    int rc = sheet ? stk_reader_open(s, split, &r, err)
                   : stk_fail(err, STK_ENOMEM, "out of memory");
    const stk_split_meta *sp =
        &m->splits[stk_meta_split(m, split) < 0 ? 0
                                                : stk_meta_split(m, split)];
    uint64_t n = sp->count < GRID * GRID ? sp->count : GRID * GRID;
    size_t plane = (size_t)h * w;
    for (uint64_t i = 0; !rc && i < n; i++) {
        stk_record rec;
        if ((rc = stk_reader_get(r, i, &rec, err)) ||
            (fit && (rc = fit_tile(dec, m, &rec, h, tile, err))))
            break;
        const uint8_t *px = fit ? tile : rec.data;
        int x0 = GAP + (int)(i % GRID) * (w + GAP);
        int y0 = GAP + (int)(i / GRID) * (h + GAP);
        for (int y = 0; y < h; y++)
            for (int x = 0; x < w; x++)
                for (int k = 0; k < c; k++)
                    sheet[(((size_t)(y0 + y) * W) + x0 + x) * c + k] =
                        px[(size_t)k * plane + (size_t)y * w + x];
    }
    stk_reader_close(r);
    stk_decoder_destroy(dec);
    free(tile);
    if (!rc)
        rc = stk_png_write(out, sheet, W, H, c, err);
    free(sheet);
    return rc;
}

/* --verify: every record against the metadata and checksums; the first
 * problems on stderr, exit 1 when there are any. */
static int run_verify(stk_store *s, const char *dir)
{
    stk_verify_report rep;
    stk_err err = {0};
    int rc = stk_store_verify(s, &rep, &err);
    if (rc && rc != STK_EFORMAT) {
        fprintf(stderr, "dbinfo: error: %s: %s\n", dir, err.msg);
        return rc;
    }
    for (uint64_t i = 0; i < rep.problems && i < STK_VERIFY_KEPT; i++)
        fprintf(stderr, "dbinfo: error: %s: %s\n", dir, rep.first[i]);
    if (rep.problems > STK_VERIFY_KEPT)
        fprintf(stderr, "dbinfo: error: %s: ... %llu problems in all\n", dir,
                (unsigned long long)rep.problems);
    printf("\nverify    %llu records: %s%s\n", (unsigned long long)rep.records,
           rep.problems ? "DAMAGED" : "ok",
           rep.checksums ? "" : " (no checksums: written by an older prep)");
    return rc;
}

int main(int argc, char **argv)
{
    static const struct option longs[] = {{"split", required_argument, 0, 's'},
                                          {"grid", required_argument, 0, 'g'},
                                          {"verify", no_argument, 0, 'v'},
                                          {"help", no_argument, 0, 'h'},
                                          {0, 0, 0, 0}};
    const char *split = NULL, *grid = NULL;
    bool verify = false;
    int ch;
    opterr = 0;
    while ((ch = getopt_long(argc, argv, ":h", longs, NULL)) != -1) {
        if (ch == 's')
            split = optarg;
        else if (ch == 'g')
            grid = optarg;
        else if (ch == 'v')
            verify = true;
        else if (ch == 'h') {
            fputs(usage, stdout);
            return 0;
        } else {
            fprintf(stderr, "dbinfo: %s '%s' (see dbinfo --help)\n",
                    ch == ':' ? "missing value for" : "unknown option",
                    argv[optind - 1]);
            return 2;
        }
    }
    if (argc - optind != 1) {
        fprintf(stderr, "dbinfo: expected one DB_DIR (see dbinfo --help)\n");
        return 2;
    }
    const char *dir = argv[optind];
    stk_store *s;
    stk_err err = {0};
    if (stk_store_open(dir, 0, &s, &err)) {
        fprintf(stderr, "dbinfo: error: %s\n", err.msg);
        return 1;
    }
    const stk_meta *m = stk_store_meta(s);
    if (split && stk_meta_split(m, split) < 0) {
        fprintf(stderr, "dbinfo: --split: no split \"%s\" in %s\n", split,
                dir);
        stk_store_close(s);
        return 2;
    }
    /* --grid is written after the report: a path there that is not a
     * regular file is refused before it (opened without truncating) */
    if (grid && access(grid, F_OK) == 0) {
        int fd = stk_open_output(grid, O_WRONLY, &err);
        if (fd < 0) {
            fprintf(stderr, "dbinfo: error: %s\n", err.msg);
            stk_store_close(s);
            return 1;
        }
        close(fd);
    }
    print_header(dir, m);
    for (int k = 0; k < m->nsplits; k++)
        if (!split || !strcmp(split, m->splits[k].name))
            print_split(s, m, &m->splits[k]);
    print_skipped(m, split);
    int rc = 0;
    if (grid && m->nsplits) {
        const char *gs = split ? split : m->splits[0].name;
        if ((rc = write_grid(s, gs, grid, &err)))
            fprintf(stderr, "dbinfo: error: %s\n", err.msg);
        else
            printf("\nwrote %s: first samples of split %s\n", grid, gs);
    }
    if (!rc && verify)
        rc = run_verify(s, dir);
    stk_store_close(s);
    return rc ? 1 : 0;
}
