/* test_store - record codec, keys, metadata JSON, and the LMDB store:
 * bytes read back equal bytes written, the map grows, unfinished databases
 * vanish, readers name split and key in errors. */
#include "unit.h"

#include "store/store.h"

#include <cjson/cJSON.h>
#include <lmdb.h>
#include <math.h>
#include <sys/stat.h>
#include <unistd.h>

static void codec_round_trip(void **state)
{
    (void)state;
    uint8_t px[300], buf[STK_RECORD_HEADER + 300];
    for (int i = 0; i < 300; i++)
        px[i] = (uint8_t)(i * 7);
    stk_record_encode(buf, -5, px, 300);
    assert_int_equal(buf[0], 0xfb); /* -5 little-endian */
    assert_int_equal(buf[3], 0xff);
    assert_int_equal(buf[4], 300 & 0xff);
    assert_int_equal(buf[5], 300 >> 8);
    stk_record r;
    assert_int_equal(stk_record_decode(buf, sizeof buf, 300, &r), 0);
    assert_int_equal(r.label, -5);
    assert_int_equal(r.nbytes, 300);
    assert_memory_equal(r.data, px, 300);
    /* wrong expected size, short value, header/length disagreement */
    assert_int_equal(stk_record_decode(buf, sizeof buf, 299, &r), STK_EFORMAT);
    assert_int_equal(stk_record_decode(buf, 7, 300, &r), STK_EFORMAT);
    assert_int_equal(stk_record_decode(buf, sizeof buf - 1, 300, &r),
                     STK_EFORMAT);
}

static void keys_sort_in_index_order(void **state)
{
    (void)state;
    uint64_t vals[] = {0, 1, 255, 256, 65535, 1u << 31, UINT64_MAX - 1};
    uint8_t prev[8], cur[8];
    for (size_t i = 0; i < sizeof vals / sizeof *vals; i++) {
        stk_key_encode(cur, vals[i]);
        assert_true(stk_key_decode(cur) == vals[i]);
        if (i)
            assert_true(memcmp(prev, cur, 8) < 0);
        memcpy(prev, cur, 8);
    }
    stk_key_encode(cur, 0x0102030405060708ull);
    assert_int_equal(cur[0], 1);
    assert_int_equal(cur[7], 8);
}

static stk_meta sample_meta(uint64_t train, uint64_t test)
{
    static char *classes[] = {"cat", "dog", "emu"};
    static uint64_t lc_train[3], lc_test[3];
    stk_meta m = {0};
    m.channels = 3;
    m.height = 4;
    m.width = 5;
    m.nclasses = 3;
    m.classes = classes;
    m.nsplits = 2;
    snprintf(m.splits[0].name, 32, "train");
    snprintf(m.splits[1].name, 32, "test");
    m.splits[0].count = train;
    m.splits[1].count = test;
    for (int c = 0; c < 3; c++) {
        lc_train[c] = train / 3 + (c < (int)(train % 3));
        lc_test[c] = test / 3 + (c < (int)(test % 3));
        m.splits[0].mean[c] = 0.1 * (c + 1);
        m.splits[0].std[c] = 0.2 + c * 0.01;
    }
    m.splits[0].label_counts = lc_train;
    m.splits[1].label_counts = lc_test;
    m.source_path = "/raw";
    m.source_format = "folder";
    m.tool = "test";
    m.created = "2026-01-01T00:00:00Z";
    return m;
}

static void meta_json_round_trip(void **state)
{
    (void)state;
    stk_meta m = sample_meta(10, 4);
    m.complete = true;
    char *json = stk_meta_to_json(&m);
    assert_non_null(json);
    stk_meta back;
    stk_err err = {0};
    assert_int_equal(stk_meta_from_json(json, strlen(json), &back, &err), 0);
    assert_int_equal(back.channels, 3);
    assert_int_equal(back.height, 4);
    assert_int_equal(back.width, 5);
    assert_int_equal(back.nclasses, 3);
    assert_string_equal(back.classes[2], "emu");
    assert_int_equal(back.nsplits, 2);
    assert_string_equal(back.splits[1].name, "test");
    assert_int_equal(back.splits[0].count, 10);
    assert_int_equal(back.splits[0].label_counts[0], 4);
    /* cJSON keeps 15 significant digits */
    assert_true(fabs(back.splits[0].mean[2] - 0.1 * 3) < 1e-12);
    assert_true(back.complete);
    assert_string_equal(back.source_format, "folder");
    stk_meta_free(&back);
    /* a missing field is named */
    char *cut = strstr(json, "\"split_order\"");
    assert_non_null(cut);
    memcpy(cut, "\"split_xrder\"", 13);
    assert_int_equal(stk_meta_from_json(json, strlen(json), &back, &err),
                     STK_EFORMAT);
    assert_non_null(strstr(err.msg, "split_order"));
    free(json);
    assert_int_equal(stk_meta_from_json("{", 1, &back, &err), STK_EFORMAT);
}

/* Writes n records of varied sizes per split; payload i of split k is a
 * pattern of (k, i). */
static void fill(uint8_t *px, int k, uint64_t i, size_t n)
{
    for (size_t j = 0; j < n; j++)
        px[j] = (uint8_t)(k * 31 + i * 7 + j * 13 + (i >> 8));
}

static void store_bytes_round_trip_with_map_growth(void **state)
{
    (void)state;
    const char *dir = scratch("growth");
    rmdir(dir); /* the store creates it */
    stk_store_opts o = {.map_size = 64 << 10, .txn_bytes = 256 << 10};
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, &o, &s, &err), 0);
    size_t n = 3 * 4 * 5;
    uint8_t rec[STK_RECORD_HEADER + 60], px[60];
    uint64_t counts[2] = {5000, 333};
    const char *names[2] = {"train", "test"};
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < counts[k]; i++) {
            fill(px, k, i, n);
            stk_record_encode(rec, (int32_t)(i % 3), px, (uint32_t)n);
            assert_int_equal(
                stk_store_append(s, names[k], rec, sizeof rec, &err), 0);
        }
    assert_int_equal(stk_store_count(s, "train"), 5000);
    assert_true(stk_store_map_size(s) > (64u << 10)); /* it grew */
    /* going back to a finished split is refused */
    assert_int_equal(stk_store_append(s, "train", rec, sizeof rec, &err),
                     STK_EINVAL);
    stk_meta m = sample_meta(5000, 333);
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);

    assert_int_equal(stk_store_open(dir, 8, &s, &err), 0);
    const stk_meta *got = stk_store_meta(s);
    assert_true(got->complete);
    assert_int_equal(got->splits[0].count, 5000);
    for (int k = 0; k < 2; k++) {
        stk_reader *r;
        assert_int_equal(stk_reader_open(s, names[k], &r, &err), 0);
        for (uint64_t i = 0; i < counts[k]; i++) {
            stk_record rr;
            assert_int_equal(stk_reader_get(r, i, &rr, &err), 0);
            fill(px, k, i, n);
            assert_int_equal(rr.label, (int32_t)(i % 3));
            assert_memory_equal(rr.data, px, n);
            if (i % 1000 == 999)
                stk_reader_release(r); /* renew path */
        }
        stk_record rr;
        assert_int_equal(stk_reader_get(r, counts[k], &rr, &err), STK_ERANGE);
        assert_non_null(strstr(err.msg, names[k]));
        stk_reader_close(r);
    }
    stk_reader *r;
    assert_int_equal(stk_reader_open(s, "val", &r, &err), STK_ENOENT);
    assert_null(r);
    /* a view addresses the same records by index */
    stk_view *v;
    assert_int_equal(stk_view_open(s, "train", &v, &err), 0);
    assert_int_equal(stk_view_count(v), 5000);
    for (uint64_t i = 0; i < 5000; i += 7) {
        stk_record rr;
        stk_view_prefetch(v, i, i % 2 ? 128 : SIZE_MAX); /* clamped to the record */
        assert_int_equal(stk_view_get(v, i, &rr, &err), 0);
        fill(px, 0, i, n);
        assert_int_equal(rr.label, (int32_t)(i % 3));
        assert_memory_equal(rr.data, px, n);
    }
    stk_record rr;
    assert_int_equal(stk_view_get(v, 5000, &rr, &err), STK_ERANGE);
    stk_view_prefetch(v, 5000, 64); /* out of range: ignored */
    stk_view_close(v);
    assert_int_equal(stk_view_open(s, "val", &v, &err), STK_ENOENT);
    assert_null(v);
    stk_store_close(s);
}

static void unfinished_store_leaves_nothing(void **state)
{
    (void)state;
    const char *dir = scratch("unfinished");
    rmdir(dir);
    char partial[1100];
    snprintf(partial, sizeof partial, "%.*s/.unfinished.partial",
             (int)(strrchr(dir, '/') - dir), dir);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    struct stat st;
    assert_int_equal(stat(partial, &st), 0); /* work happens beside it */
    assert_int_not_equal(stat(dir, &st), 0);
    uint8_t rec[STK_RECORD_HEADER + 60] = {0};
    rec[4] = 60;
    assert_int_equal(stk_store_append(s, "train", rec, sizeof rec, &err), 0);
    /* a second writer is refused while the first holds the lock */
    stk_store *other;
    assert_int_equal(stk_store_create(dir, NULL, &other, &err), STK_EEXIST);
    assert_non_null(strstr(err.msg, "another prep"));
    assert_null(other);
    stk_store_close(s);
    assert_int_not_equal(stat(partial, &st), 0);
    assert_int_not_equal(stat(dir, &st), 0);
}

static void counts_must_match_metadata(void **state)
{
    (void)state;
    const char *dir = scratch("mismatch");
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    uint8_t rec[STK_RECORD_HEADER + 60] = {0};
    rec[4] = 60;
    assert_int_equal(stk_store_append(s, "train", rec, sizeof rec, &err), 0);
    stk_meta m = sample_meta(2, 0);
    assert_int_equal(stk_store_finish(s, &m, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "train"));
    stk_store_close(s);
    assert_int_equal(stk_store_open(dir, 0, &s, &err), STK_ENOENT);
}

/* A record of the wrong size is reported with its split and key. */
static void corrupt_record_names_key(void **state)
{
    (void)state;
    const char *dir = scratch("corrupt");
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    uint8_t rec[STK_RECORD_HEADER + 60] = {0};
    rec[4] = 60;
    for (int i = 0; i < 3; i++)
        assert_int_equal(
            stk_store_append(s, "train", rec, i == 1 ? 50 : sizeof rec, &err),
            0);
    stk_meta m = sample_meta(3, 0);
    m.nsplits = 1;
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    stk_reader *r;
    stk_record rr;
    assert_int_equal(stk_reader_open(s, "train", &r, &err), 0);
    assert_int_equal(stk_reader_get(r, 0, &rr, &err), 0);
    assert_int_equal(stk_reader_get(r, 1, &rr, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "split \"train\": key 1"));
    assert_non_null(strstr(err.msg, "50 bytes"));
    stk_reader_close(r);
    stk_store_close(s);
}

/* A database without the completion marker is refused by readers. */
static void incomplete_database_refused(void **state)
{
    (void)state;
    const char *dir = scratch("incomplete");
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    mdb_env_set_maxdbs(env, 4);
    assert_int_equal(mdb_env_open(env, dir, 0, 0664), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "meta", MDB_CREATE, &dbi), 0);
    stk_meta m = sample_meta(0, 0);
    m.complete = false;
    char *json = stk_meta_to_json(&m);
    MDB_val k = {7, "dataset"}, v = {strlen(json), json};
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
    free(json);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_open(dir, 0, &s, &err), STK_EINCOMPLETE);
    assert_non_null(strstr(err.msg, "incomplete"));
    assert_int_equal(stk_store_open_any(dir, &s, &err), 0);
    assert_false(stk_store_meta(s)->complete);
    stk_store_close(s);
    /* and prep would not replace it silently */
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), STK_EEXIST);
    assert_non_null(strstr(err.msg, "--force"));
}

/* ---- damaged files ----------------------------------------------------- */

/* The mean and std of split k's n records of 3 planes (fill()), as prep
 * computes them: from integer sums. */
static void pixel_stats(stk_split_meta *sp, int k, uint64_t n, size_t plane)
{
    uint8_t *px = malloc(3 * plane);
    uint64_t sum[3] = {0}, sq[3] = {0};
    for (uint64_t i = 0; i < n; i++) {
        fill(px, k, i, 3 * plane);
        for (size_t j = 0; j < 3 * plane; j++) {
            sum[j / plane] += px[j];
            sq[j / plane] += (uint64_t)px[j] * px[j];
        }
    }
    for (int c = 0; c < 3; c++) {
        double cnt = (double)n * (double)plane;
        double mean = sum[c] / cnt, var = sq[c] / cnt - mean * mean;
        sp->mean[c] = mean / 255.0;
        sp->std[c] = (var > 0 ? sqrt(var) : 0.0) / 255.0;
    }
    free(px);
}

/* Builds dir with splits "train" (ntrain records) and "test" (20) of shape
 * 3 x h x 5; pixels from fill(), label i % 3; the metadata's train mean of
 * channel 0 off by skew (0: as computed). */
static void build_db_skewed(const char *dir, int h, uint64_t ntrain,
                            double skew)
{
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    size_t n = (size_t)3 * h * 5;
    uint8_t *rec = malloc(STK_RECORD_HEADER + n), *px = malloc(n);
    uint64_t counts[2] = {ntrain, 20};
    const char *names[2] = {"train", "test"};
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < counts[k]; i++) {
            fill(px, k, i, n);
            stk_record_encode(rec, (int32_t)(i % 3), px, (uint32_t)n);
            assert_int_equal(stk_store_append(s, names[k], rec,
                                              STK_RECORD_HEADER + n, &err),
                             0);
        }
    stk_meta m = sample_meta(ntrain, 20);
    m.height = h;
    for (int k = 0; k < 2; k++)
        pixel_stats(&m.splits[k], k, counts[k], (size_t)h * 5);
    m.splits[0].mean[0] += skew;
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);
    free(rec);
    free(px);
}

static void build_db(const char *dir, int h, uint64_t ntrain)
{
    build_db_skewed(dir, h, ntrain, 0);
}

static uint8_t *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *d = malloc(*len);
    assert_int_equal(fread(d, 1, *len, f), *len);
    fclose(f);
    return d;
}

static void write_all(const char *path, const uint8_t *d, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(d, 1, len, f), len);
    fclose(f);
}

/* Opens dir, verifies it, and reads every record of every split through a
 * view and a reader: with a damaged file, each step either fails with a
 * message or works, and none may crash; when all of it works, every record
 * must be the one written (the damage was in bytes nobody reads). Returns
 * 0 when all of it worked. */
static int read_everything(const char *dir)
{
    stk_store *s;
    stk_err err = {0};
    stk_verify_report rep;
    int rc = stk_store_open(dir, 0, &s, &err);
    if (rc) {
        assert_true(rc < 0 && err.msg[0]);
        return rc;
    }
    if ((rc = stk_store_verify(s, &rep, &err))) {
        assert_true(rc < 0 && err.msg[0]);
        stk_store_close(s);
        return rc;
    }
    const stk_meta *m = stk_store_meta(s);
    uint8_t px[3 * 200 * 5];
    for (int k = 0; !rc && k < m->nsplits; k++) {
        stk_view *v;
        stk_reader *r;
        if ((rc = stk_view_open(s, m->splits[k].name, &v, &err)))
            break;
        rc = stk_reader_open(s, m->splits[k].name, &r, &err);
        int kk = !strcmp(m->splits[k].name, "test");
        for (uint64_t i = 0; !rc && i < stk_view_count(v); i++) {
            stk_record a, b;
            if (!(rc = stk_view_get(v, i, &a, &err)) &&
                !(rc = stk_reader_get(r, i, &b, &err))) {
                fill(px, kk, i, a.nbytes);
                assert_int_equal(a.label, (int32_t)(i % 3));
                assert_memory_equal(a.data, px, a.nbytes);
                assert_memory_equal(b.data, px, b.nbytes);
            }
        }
        stk_reader_close(r);
        stk_view_close(v);
    }
    stk_store_close(s);
    return rc;
}

/* Changes bytes where liblmdb 0.9 trusts the file (page headers, node
 * offsets, node headers, meta pages) and anywhere at random, one change at a
 * time, in a database of small inline records and one of large (overflow)
 * records: opening, verifying and reading must fail cleanly or work, never
 * crash, and what works must read the records written. */
static void damaged_file_never_crashes(void **state)
{
    (void)state;
    const int heights[2] = {4, 200}; /* 60-byte and 3000-byte records */
    unsigned seed = 12345;
    int refused = 0, trials = 0;
    for (int d = 0; d < 2; d++) {
        const char *dir = scratch(d ? "fuzz_big" : "fuzz_small");
        build_db(dir, heights[d], d ? 400 : 2000);
        char path[1100];
        snprintf(path, sizeof path, "%s/data.mdb", dir);
        size_t len;
        uint8_t *orig = read_all(path, &len), *buf = malloc(len);
        size_t ps = 4096, npages = len / ps;
        for (size_t pg = 0; pg < npages; pg++) {
            /* the header, the first node offsets, the first node, and
             * when that node's value is on overflow pages, their number */
            const uint8_t *p = orig + pg * ps;
            uint16_t first = 0, pflags = 0, nflags = 0, ksize = 0;
            memcpy(&first, p + 16, 2);
            memcpy(&pflags, p + 10, 2);
            size_t spots[48];
            int ns = 0;
            for (int b = 0; b < 24; b++)
                spots[ns++] = b;
            for (size_t b = 0; b < 12 && first >= 16 && first + b < ps; b++)
                spots[ns++] = first + b;
            if (first >= 16 && first + 8u <= ps) {
                memcpy(&nflags, p + first + 4, 2);
                memcpy(&ksize, p + first + 6, 2);
            }
            bool big =
                (pflags & 0x02) && (nflags & 0x01); /* P_LEAF, F_BIGDATA */
            for (size_t b = 0; big && b < 8 && first + 8u + ksize + b < ps;
                 b++)
                spots[ns++] = first + 8u + ksize + b;
            if (pg < 2) /* meta pages: every field */
                for (int b = 24; b < 16 + 136 && ns < 48; b += 4)
                    spots[ns++] = b;
            /* meta pages: every spot; others: 4 spots drawn */
            for (int j = 0; j < (pg < 2 ? ns : 4); j++) {
                size_t at = spots[pg < 2 ? j : (int)(rand_r(&seed) % ns)];
                const uint8_t vals[4] = {0x00, 0xff, p[at] ^ 0x01,
                                         p[at] ^ 0x80};
                memcpy(buf, orig, len);
                buf[pg * ps + at] = vals[rand_r(&seed) % 4];
                write_all(path, buf, len);
                refused += read_everything(dir) != 0;
                trials++;
            }
        }
        for (int t = 0; t < 300; t++) { /* anywhere, 1 to 4 bytes */
            memcpy(buf, orig, len);
            int nb = 1 + (int)(rand_r(&seed) % 4);
            for (int b = 0; b < nb; b++)
                buf[rand_r(&seed) % len] = (uint8_t)rand_r(&seed);
            write_all(path, buf, len);
            refused += read_everything(dir) != 0;
            trials++;
        }
        /* cut short anywhere */
        for (size_t cut = 0; cut < len; cut += len / 37 + 1) {
            write_all(path, orig, cut);
            assert_int_not_equal(read_everything(dir), 0);
            trials++, refused++;
        }
        write_all(path, orig, len);
        assert_int_equal(read_everything(dir), 0);
        free(orig);
        free(buf);
    }
    print_message("%d damaged files, %d refused, none crashed\n", trials,
                  refused);
    assert_true(refused > trials / 10);
}

/* A file cut short is named with its size and the size LMDB's meta page
 * needs; a page header changed is named with database and page. */
static void damage_is_named(void **state)
{
    (void)state;
    const char *dir = scratch("named");
    build_db(dir, 4, 2000);
    char path[1100];
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    size_t len;
    uint8_t *orig = read_all(path, &len);
    write_all(path, orig, len / 2);
    stk_store *s;
    stk_err err = {0};
    char want[1300];
    assert_int_equal(stk_store_open(dir, 0, &s, &err), STK_EFORMAT);
    snprintf(want, sizeof want, "%s: data.mdb is truncated (%zu of %zu bytes)",
             dir, len / 2, len);
    assert_string_equal(err.msg, want);
    /* every leaf page of the train split: its type byte zeroed */
    int hits = 0;
    for (size_t pg = 2; pg < len / 4096; pg++) {
        uint8_t *p = orig + pg * 4096;
        if (p[10] != 0x02 || p[12] <= 26) /* a leaf of records, not names */
            continue;
        p[10] = 0;
        write_all(path, orig, len);
        p[10] = 0x02;
        assert_int_equal(stk_store_open(dir, 0, &s, &err), STK_EFORMAT);
        snprintf(want, sizeof want, "%s: data.mdb is damaged (database \"",
                 dir);
        assert_non_null(strstr(err.msg, want));
        assert_non_null(strstr(err.msg, "page flags 0x0 where a leaf page "
                                        "is due"));
        hits++;
    }
    assert_true(hits > 10);
    free(orig);
}

/* ---- metadata bounds and names ----------------------------------------- */

/* Parses edited metadata JSON (root, deleted here) as a reader would. */
static int parse_back(cJSON *root, stk_err *err)
{
    char *json = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    stk_meta back;
    int rc = stk_meta_from_json(json, strlen(json), &back, err);
    free(json);
    if (!rc)
        stk_meta_free(&back);
    return rc;
}

/* The sample metadata's JSON with one field replaced: path is "record",
 * "shape", 1 style (object keys, then an array index as a number). */
static int parse_with(const char *key1, const char *key2, int index,
                      const char *value, stk_err *err)
{
    stk_meta m = sample_meta(10, 4);
    m.complete = true;
    char *json = stk_meta_to_json(&m);
    cJSON *root = cJSON_Parse(json);
    free(json);
    cJSON *parent = cJSON_GetObjectItemCaseSensitive(root, key1);
    if (key2)
        parent = cJSON_GetObjectItemCaseSensitive(parent, key2);
    assert_non_null(parent);
    cJSON *v = cJSON_Parse(value);
    assert_non_null(v);
    if (index >= 0)
        cJSON_ReplaceItemInArray(parent, index, v);
    else
        cJSON_ReplaceItemInObjectCaseSensitive(
            cJSON_GetObjectItemCaseSensitive(root, key1), key2, v);
    return parse_back(root, err);
}

static void refused_naming(int rc, const stk_err *err, const char *field,
                           const char *why)
{
    if (rc != STK_EFORMAT || !strstr(err->msg, field) ||
        !strstr(err->msg, why))
        fail_msg("expected a refusal naming %s (%s), got %d: %s", field, why,
                 rc, err->msg);
}

/* Shapes and counts out of range are refused, naming the field, before
 * they size anything (C*H*W once wrapped in 32 bits, a count of -5 printed
 * as 18446744073709551611). */
static void meta_bounds_refused(void **state)
{
    (void)state;
    stk_err err = {0};
    refused_naming(parse_with("record", "shape", 1, "70000", &err), &err,
                   "record.shape[1] (height)", "0..65536");
    refused_naming(parse_with("record", "shape", 2, "1e20", &err), &err,
                   "record.shape[2] (width)", "is 1e+20");
    refused_naming(parse_with("record", "shape", 0, "2.5", &err), &err,
                   "record.shape[0] (channels)", "whole number");
    refused_naming(parse_with("record", "shape", 0, "0", &err), &err,
                   "record.shape[0] (channels)", "is 0");
    refused_naming(parse_with("record", "shape", -1, "[4,65536,65536]", &err),
                   &err, "record.shape [4,65536,65536]",
                   "17179869184-byte records, over the limit of 1073741824");
    refused_naming(parse_with("record", "header_bytes", -1, "8.5", &err), &err,
                   "record.header_bytes", "whole number");
    refused_naming(parse_with("splits", "train", -1,
                              "{\"count\": -5, \"label_counts\": [0,0,0], "
                              "\"mean\": [0,0,0], \"std\": [0,0,0]}",
                              &err),
                   &err, "splits.train.count", "is -5");
    refused_naming(parse_with("splits", "train", -1,
                              "{\"count\": 1e300, \"label_counts\": [0,0,0], "
                              "\"mean\": [0,0,0], \"std\": [0,0,0]}",
                              &err),
                   &err, "splits.train.count", "0..1073741823");
    refused_naming(parse_with("splits", "train", -1,
                              "{\"count\": 10, \"label_counts\": [3,3,3], "
                              "\"mean\": [0,0,0], \"std\": [0,0,0]}",
                              &err),
                   &err, "splits.train.label_counts", "sum to 9 but");
    refused_naming(parse_with("splits", "train", -1,
                              "{\"count\": 10, \"label_counts\": [11,-1,0], "
                              "\"mean\": [0,0,0], \"std\": [0,0,0]}",
                              &err),
                   &err, "splits.train.label_counts", "is 11");
    refused_naming(parse_with("splits", "train", -1,
                              "{\"count\": 10, \"label_counts\": [4,3,3], "
                              "\"mean\": [0,7,0], \"std\": [0,0,0]}",
                              &err),
                   &err, "splits.train.mean", "[1] is not a number in 0..1");
    refused_naming(parse_with("split_order", NULL, 1, "\"train\"", &err), &err,
                   "split_order", "names \"train\" twice");
    refused_naming(parse_with("split_order", NULL, 1, "\"meta\"", &err), &err,
                   "split_order", "\"meta\" is reserved");
    /* and the untouched metadata parses */
    assert_int_equal(parse_with("record", "shape", 1, "4", &err), 0);
}

/* Every byte that is not part of valid UTF-8 becomes \udcXX and comes back;
 * valid UTF-8, surrogate pairs and escaped backslashes are left alone. */
static void utf8_escape_round_trip(void **state)
{
    (void)state;
    char *e = stk_json_escape_bytes("\"caf\xe9 \xc3\xa9 \xed\xa0\x80 \xff\"");
    assert_string_equal(
        e, "\"caf\\udce9 \xc3\xa9 \\udced\\udca0\\udc80 \\udcff\"");
    free(e);
    const char *keep = "\"\\ud83d\\udc80 \\\\udc80 \\u00e9\"";
    char *u = stk_json_unescape_bytes(keep, strlen(keep));
    assert_string_equal(u, keep);
    free(u);
    unsigned seed = 7;
    for (int t = 0; t < 20000; t++) {
        char s[16];
        int n = 1 + t % 14;
        for (int i = 0; i < n; i++) { /* no quote, backslash or NUL */
            s[i] = (char)(t < 255 && i == 0 ? t + 1 : rand_r(&seed));
            while (!s[i] || s[i] == '"' || s[i] == '\\')
                s[i] = (char)rand_r(&seed);
        }
        s[n] = '\0';
        e = stk_json_escape_bytes(s);
        for (size_t i = 0, k, len = strlen(e); i < len; i += k)
            assert_int_not_equal(k = stk_utf8_len(e + i, len - i), 0);
        u = stk_json_unescape_bytes(e, strlen(e));
        assert_string_equal(u, s);
        free(e);
        free(u);
    }
}

/* Class names and skipped files that are not UTF-8 survive the metadata's
 * round trip byte for byte, and the JSON written is valid UTF-8. */
static void meta_names_keep_their_bytes(void **state)
{
    (void)state;
    stk_meta m = sample_meta(10, 4);
    char *classes[] = {"caf\xe9", "\xe2\x82\xac uro", "\x1b[31mred"};
    m.classes = classes;
    m.skipped_json = "{\"train\":[{\"file\":\"raw/caf\xe9/bad\xfe.png\","
                     "\"error\":\"bad PNG\"}]}";
    m.complete = true;
    char *json = stk_meta_to_json(&m);
    for (size_t i = 0, k, n = strlen(json); i < n; i += k)
        assert_int_not_equal(k = stk_utf8_len(json + i, n - i), 0);
    assert_non_null(strstr(json, "\"caf\\udce9\""));
    assert_non_null(strstr(json, "bad\\udcfe.png"));
    stk_meta back;
    stk_err err = {0};
    assert_int_equal(stk_meta_from_json(json, strlen(json), &back, &err), 0);
    for (int c = 0; c < 3; c++)
        assert_string_equal(back.classes[c], classes[c]);
    assert_non_null(strstr(back.skipped_json, "raw/caf\xe9/bad\xfe.png"));
    stk_meta_free(&back);
    free(json);
}

/* Rewrites record key of split "train" through LMDB after byte at is set
 * to val (a tampered record that LMDB itself finds nothing wrong with). */
static void tamper(const char *dir, uint64_t key, size_t at, uint8_t val)
{
    MDB_env *env;
    MDB_txn *txn;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    mdb_env_set_maxdbs(env, 12);
    assert_int_equal(mdb_env_open(env, dir, 0, 0664), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "train", 0, &dbi), 0);
    uint8_t kb[8], rec[STK_RECORD_HEADER + 60];
    stk_key_encode(kb, key);
    MDB_val k = {8, kb}, v;
    assert_int_equal(mdb_get(txn, dbi, &k, &v), 0);
    assert_int_equal(v.mv_size, sizeof rec);
    memcpy(rec, v.mv_data, sizeof rec);
    rec[at] = val;
    v = (MDB_val){sizeof rec, rec};
    assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);
}

/* dbinfo --verify's checks: a changed pixel (checksum), a label out of
 * range, a size field that disagrees with the shape, each named with split
 * and key; counts and mean that no longer agree with the metadata. */
static void verify_names_each_problem(void **state)
{
    (void)state;
    const char *dir = scratch("verify");
    build_db(dir, 4, 200);
    stk_store *s;
    stk_err err = {0};
    stk_verify_report rep;
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    assert_int_equal(stk_store_verify(s, &rep, &err), 0);
    assert_int_equal(rep.records, 220);
    assert_true(rep.checksums);
    stk_store_close(s);
    tamper(dir, 7, STK_RECORD_HEADER + 10, 0xee); /* a pixel */
    tamper(dir, 9, 0, 5);                         /* label 5 of 3 classes */
    tamper(dir, 11, 4, 61);                       /* size field 61, not 60 */
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    assert_int_equal(stk_store_verify(s, &rep, &err), STK_EFORMAT);
    stk_store_close(s);
    const char *want[] = {
        "split \"train\": key 7: the record's crc32 is",
        "split \"train\": key 9: the record's crc32 is",
        "split \"train\": key 9: label 5 is outside the 3 classes (0..2)",
        "split \"train\": key 11: the record's size field says 61 pixel "
        "bytes, the metadata's shape needs 60",
        "split \"train\": 66 records have label 0 (cat), the metadata's "
        "label_counts say 67",
        "split \"train\": 65 records have label 2 (emu), the metadata's "
        "label_counts say 66",
        "split \"train\": channel 0 has mean"};
    assert_true(rep.problems >= 7);
    for (int i = 0; i < 7; i++)
        if (!strstr(rep.first[i], want[i]))
            fail_msg("problem %d is \"%s\", expected \"%s...\"", i,
                     rep.first[i], want[i]);
    assert_non_null(strstr(err.msg, want[0]));
}

/* Names made printable for a terminal: UTF-8 kept, control characters, C1
 * codes, stray bytes and the backslash as \xHH; cut short only at a whole
 * character or escape. */
static void names_made_printable(void **state)
{
    (void)state;
    char b[64];
    assert_string_equal(stk_text_printable(b, sizeof b, "ok \xc3\xa9"),
                        "ok \xc3\xa9");
    assert_string_equal(stk_text_printable(b, sizeof b, "a\x1b[31m"),
                        "a\\x1b[31m");
    assert_string_equal(stk_text_printable(b, sizeof b, "\xff\\\x7f"),
                        "\\xff\\x5c\\x7f");
    assert_string_equal(stk_text_printable(b, sizeof b, "\xc2\x85"),
                        "\\xc2\\x85");
    assert_string_equal(stk_text_printable(b, 6, "abc\x1b"), "abc");
    assert_string_equal(stk_text_printable(b, 3, "a\xc3\xa9"), "a");
    assert_string_equal(stk_text_printable(b, 1, "abc"), "");
}

/* A mean off by a little more than verify's tolerance (1e-9) is shown with
 * the digits that tell the two apart (%.6f printed the same number twice);
 * the std, which agrees, with 6. */
static void verify_shows_the_difference(void **state)
{
    (void)state;
    const char *dir = scratch("verify_digits");
    build_db_skewed(dir, 4, 200, 3e-9);
    stk_store *s;
    stk_err err = {0};
    stk_verify_report rep;
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    assert_int_equal(stk_store_verify(s, &rep, &err), STK_EFORMAT);
    stk_store_close(s);
    assert_int_equal(rep.problems, 1);
    char mean[40], std[40], mmean[40], mstd[40];
    assert_int_equal(sscanf(rep.first[0],
                            "split \"train\": channel 0 has mean %39s and "
                            "std %39[^,], the metadata says %39s and %39s",
                            mean, std, mmean, mstd),
                     4);
    print_message("%s\n", rep.first[0]);
    if (!strcmp(mean, mmean))
        fail_msg("the means print alike: \"%s\"", rep.first[0]);
    assert_string_equal(std, mstd);
    assert_true(strlen(std) <= 8); /* 0.dddddd: 6 digits where they agree */
    assert_true(strtod(mmean, NULL) > strtod(mean, NULL));
}

/* A stop request ends a verify (prep's Ctrl-C during its end-of-run read
 * back), and only a set one does. */
static void verify_stops_when_asked(void **state)
{
    (void)state;
    const char *dir = scratch("verify_stop");
    build_db(dir, 4, 200);
    stk_store *s;
    stk_err err = {0};
    stk_verify_report rep;
    atomic_int stop = 0;
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    assert_int_equal(stk_store_verify_until(s, &stop, &rep, &err), 0);
    assert_int_equal(rep.records, 220);
    stop = 1;
    assert_int_equal(stk_store_verify_until(s, &stop, &rep, &err),
                     STK_ECANCELED);
    assert_int_equal(rep.records, 0);
    stk_store_close(s);
}

/* prep's end: with opts.verify a database whose records disagree with the
 * metadata is not published. */
static void finish_verifies_before_publishing(void **state)
{
    (void)state;
    const char *dir = scratch("unverified");
    rmdir(dir);
    stk_store_opts o = {.verify = true};
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, &o, &s, &err), 0);
    uint8_t rec[STK_RECORD_HEADER + 60] = {0};
    for (int i = 0; i < 3; i++) {
        stk_record_encode(rec, i == 2 ? 7 : i, rec + STK_RECORD_HEADER, 60);
        assert_int_equal(stk_store_append(s, "train", rec, sizeof rec, &err),
                         0);
    }
    stk_meta m = sample_meta(3, 0);
    m.nsplits = 1;
    memset(m.splits[0].mean, 0, sizeof m.splits[0].mean);
    memset(m.splits[0].std, 0, sizeof m.splits[0].std);
    assert_int_equal(stk_store_finish(s, &m, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "the database written does not verify: "
                                    "split \"train\": key 2: label 7 is "
                                    "outside the 3 classes"));
    stk_store_close(s);
    struct stat st;
    assert_int_not_equal(stat(dir, &st), 0);
}

/* A variable-size raw meta (format 2) of sample_meta's splits. */
static stk_meta variable_meta(uint64_t train, int encoding)
{
    stk_meta m = sample_meta(train, 0);
    m.nsplits = 1;
    m.height = m.width = 0;
    m.variable = true;
    m.encoding = encoding;
    m.quality = encoding == STK_ENC_JPEG ? 85 : 0;
    m.short_side = 4;
    m.max_side = 8;
    return m;
}

/* Format 2 records: header fields at their offsets, parsed against a
 * variable raw, a variable JPEG and a fixed JPEG meta; every disagreement
 * refused with the reason. */
static void codec_v2_round_trip(void **state)
{
    (void)state;
    uint8_t buf[STK_RECORD_HEADER_V2 + 3 * 5 * 7 + 1];
    stk_record_put_header_v2(buf, 2, 3 * 5 * 7, 5, 7);
    for (int i = 0; i < 3 * 5 * 7; i++)
        buf[STK_RECORD_HEADER_V2 + i] = (uint8_t)i;
    assert_int_equal(buf[4], 105);
    assert_int_equal(buf[8], 5);  /* height at 8 */
    assert_int_equal(buf[12], 7); /* width at 12 */
    size_t len = STK_RECORD_HEADER_V2 + 105;
    stk_meta m = variable_meta(1, STK_ENC_RAW);
    assert_false(stk_meta_fixed(&m));
    assert_int_equal(stk_meta_sample_bytes(&m), 0);
    assert_int_equal(stk_meta_header_bytes(&m), 16);
    stk_record r;
    char why[200];
    assert_int_equal(stk_record_parse(buf, len, &m, &r, why, sizeof why), 0);
    assert_int_equal(r.label, 2);
    assert_int_equal(r.height, 5);
    assert_int_equal(r.width, 7);
    assert_int_equal(r.nbytes, 105);
    assert_ptr_equal(r.data, buf + STK_RECORD_HEADER_V2);
    /* truncated, one byte too long, shorter than the header */
    assert_int_equal(stk_record_parse(buf, len - 1, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "its header says 16 + 105"));
    assert_int_equal(stk_record_parse(buf, len + 1, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_int_equal(stk_record_parse(buf, 15, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "16-byte header"));
    /* above the max side, zero, raw size disagreeing with C*H*W */
    stk_record_put_header_v2(buf, 2, 105, 9, 7);
    assert_int_equal(stk_record_parse(buf, len, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "9x7 (HxW), outside 1..8"));
    stk_record_put_header_v2(buf, 2, 105, 0, 7);
    assert_int_equal(stk_record_parse(buf, len, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    stk_record_put_header_v2(buf, 2, 105, 7, 5); /* 3*7*5 = 105 too: ok */
    assert_int_equal(stk_record_parse(buf, len, &m, &r, why, sizeof why), 0);
    stk_record_put_header_v2(buf, 2, 105, 5, 6);
    assert_int_equal(stk_record_parse(buf, len, &m, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "3 x 5 x 6 raw pixels need 90"));
    /* JPEG: any payload size, H and W within the max side */
    stk_meta j = variable_meta(1, STK_ENC_JPEG);
    assert_int_equal(stk_record_parse(buf, len, &j, &r, why, sizeof why), 0);
    assert_int_equal(r.width, 6);
    /* fixed JPEG (--size with --encode jpeg): H and W are the shape's */
    stk_meta f = sample_meta(1, 0); /* 3x4x5 */
    f.encoding = STK_ENC_JPEG;
    f.quality = 90;
    assert_int_equal(stk_meta_header_bytes(&f), 16);
    assert_int_equal(stk_record_parse(buf, len, &f, &r, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "shape says 4x5"));
    stk_record_put_header_v2(buf, 2, 105, 4, 5);
    assert_int_equal(stk_record_parse(buf, len, &f, &r, why, sizeof why), 0);
    /* a format 1 meta reads the old 8-byte header and fills H and W */
    stk_meta v1 = sample_meta(1, 0);
    uint8_t old[STK_RECORD_HEADER + 60] = {0};
    stk_record_put_header(old, 1, 60);
    assert_int_equal(
        stk_record_parse(old, sizeof old, &v1, &r, why, sizeof why), 0);
    assert_int_equal(r.height, 4);
    assert_int_equal(r.width, 5);
}

/* Format 2 metadata round-trips; a v1 reader's shape check sees null. */
static void meta_v2_round_trip(void **state)
{
    (void)state;
    for (int enc = STK_ENC_RAW; enc <= STK_ENC_JPEG; enc++) {
        stk_meta m = variable_meta(10, enc);
        m.complete = true;
        char *json = stk_meta_to_json(&m);
        assert_non_null(json);
        assert_non_null(strstr(json, "\"format_version\":\t2"));
        assert_non_null(strstr(json, "[3, null, null]"));
        stk_meta back;
        stk_err err = {0};
        assert_int_equal(stk_meta_from_json(json, strlen(json), &back, &err),
                         0);
        assert_true(back.variable);
        assert_int_equal(back.encoding, enc);
        assert_int_equal(back.quality, enc == STK_ENC_JPEG ? 85 : 0);
        assert_int_equal(back.short_side, 4);
        assert_int_equal(back.max_side, 8);
        assert_int_equal(back.channels, 3);
        assert_int_equal(back.height, 0);
        stk_meta_free(&back);
        free(json);
    }
    /* a fixed raw meta stays format 1 with its 8-byte header */
    stk_meta f = sample_meta(10, 4);
    char *json = stk_meta_to_json(&f);
    assert_non_null(strstr(json, "\"format_version\":\t1"));
    assert_non_null(strstr(json, "\"header_bytes\":\t8"));
    assert_null(strstr(json, "encoding"));
    free(json);
}

/* Edits one field of a variable JPEG meta's JSON record object and parses
 * it. value NULL removes the field. */
static int parse_v2_with(const char *field, const char *value, stk_err *err)
{
    stk_meta m = variable_meta(10, STK_ENC_JPEG);
    m.complete = true;
    char *json = stk_meta_to_json(&m);
    cJSON *root = cJSON_Parse(json);
    free(json);
    cJSON *rec = cJSON_GetObjectItemCaseSensitive(root, "record");
    if (value)
        cJSON_ReplaceItemInObjectCaseSensitive(rec, field, cJSON_Parse(value));
    else
        cJSON_DeleteItemFromObjectCaseSensitive(rec, field);
    return parse_back(root, err);
}

static void meta_v2_refused(void **state)
{
    (void)state;
    stk_err err = {0};
    assert_int_equal(parse_v2_with("quality", "85", &err), 0);
    refused_naming(parse_v2_with("encoding", "\"png\"", &err), &err,
                   "record.encoding", "\"raw\" or \"jpeg\"");
    refused_naming(parse_v2_with("encoding", NULL, &err), &err,
                   "record.encoding", "missing");
    refused_naming(parse_v2_with("variable", "1", &err), &err,
                   "record.variable", "wrong type");
    refused_naming(parse_v2_with("quality", "101", &err), &err,
                   "record.quality", "0..100");
    refused_naming(parse_v2_with("quality", "0", &err), &err, "record.quality",
                   "1..100");
    refused_naming(parse_v2_with("max_side", "70000", &err), &err,
                   "record.max_side", "0..65536");
    refused_naming(parse_v2_with("max_side", NULL, &err), &err,
                   "record.max_side", "missing");
    refused_naming(parse_v2_with("short_side", "9", &err), &err,
                   "record.short_side", "0..8");
    refused_naming(parse_v2_with("header_bytes", "8", &err), &err,
                   "record.header_bytes", "expected 16");
    refused_naming(parse_v2_with("shape", "[3, 4, null]", &err), &err,
                   "record.shape[1] (height)", "null for variable");
    refused_naming(parse_v2_with("max_side", "20000", &err), &err,
                   "record.shape", "over the limit");
    /* a JPEG decodes to gray or RGB: any other count would be misread */
    refused_naming(parse_v2_with("shape", "[4, null, null]", &err), &err,
                   "record.shape[0] (channels)", "1 (gray) or 3 (RGB)");
    refused_naming(parse_v2_with("shape", "[2, null, null]", &err), &err,
                   "record.shape[0] (channels)", "1 (gray) or 3 (RGB)");
    /* format 2 claiming fixed raw records: those are format 1 */
    refused_naming(parse_v2_with("variable", "false", &err), &err,
                   "record.shape[1] (height)", "");
    /* a format 1 meta with a null height (what a v1 reader would see) */
    refused_naming(parse_with("record", "shape", 1, "null", &err), &err,
                   "record.shape[1] (height)", "not a number");
}

/* A variable JPEG database: records of their own size come back through
 * readers and views, verify passes, and a truncated or oversized record is
 * refused naming the split and key. */
static void variable_store_round_trip(void **state)
{
    (void)state;
    const char *dir = scratch("variable");
    rmdir(dir);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    uint8_t rec[STK_RECORD_HEADER_V2 + 40];
    for (int i = 0; i < 4; i++) {
        uint32_t n = 10 + 10 * (uint32_t)i;
        stk_record_put_header_v2(rec, i % 3, n, 1 + (uint32_t)i,
                                 i == 3 ? 9 : 8 - (uint32_t)i);
        memset(rec + STK_RECORD_HEADER_V2, 'a' + i, n);
        size_t len = STK_RECORD_HEADER_V2 + n - (i == 2); /* 2: cut short */
        assert_int_equal(stk_store_append(s, "train", rec, len, &err), 0);
    }
    stk_meta m = variable_meta(4, STK_ENC_JPEG);
    static uint64_t lc[3] = {2, 1, 1};
    m.splits[0].label_counts = lc;
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    assert_true(stk_store_meta(s)->variable);
    stk_view *v;
    stk_record r;
    assert_int_equal(stk_view_open(s, "train", &v, &err), 0);
    assert_int_equal(stk_view_get(v, 1, &r, &err), 0);
    assert_int_equal(r.height, 2);
    assert_int_equal(r.width, 7);
    assert_int_equal(r.nbytes, 20);
    assert_int_equal(r.data[19], 'b');
    assert_int_equal(stk_view_get(v, 2, &r, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "split \"train\": key 2"));
    assert_non_null(strstr(err.msg, "its header says 16 + 30"));
    assert_int_equal(stk_view_get(v, 3, &r, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "split \"train\": key 3"));
    assert_non_null(strstr(err.msg, "4x9 (HxW), outside 1..8"));
    stk_view_close(v);
    stk_reader *rd;
    assert_int_equal(stk_reader_open(s, "train", &rd, &err), 0);
    assert_int_equal(stk_reader_get(rd, 0, &r, &err), 0);
    assert_int_equal(r.width, 8);
    assert_int_equal(stk_reader_get(rd, 3, &r, &err), STK_EFORMAT);
    stk_reader_close(rd);
    stk_verify_report rep;
    assert_int_equal(stk_store_verify(s, &rep, &err), STK_EFORMAT);
    assert_true(rep.problems >= 2); /* the two records, then the counts */
    assert_non_null(strstr(rep.first[0], "key 2"));
    assert_non_null(strstr(rep.first[1], "key 3"));
    stk_store_close(s);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(codec_round_trip),
    cmocka_unit_test(keys_sort_in_index_order),
    cmocka_unit_test(meta_json_round_trip),
    cmocka_unit_test(store_bytes_round_trip_with_map_growth),
    cmocka_unit_test(unfinished_store_leaves_nothing),
    cmocka_unit_test(counts_must_match_metadata),
    cmocka_unit_test(corrupt_record_names_key),
    cmocka_unit_test(incomplete_database_refused),
    cmocka_unit_test(damaged_file_never_crashes),
    cmocka_unit_test(damage_is_named),
    cmocka_unit_test(verify_names_each_problem),
    cmocka_unit_test(verify_shows_the_difference),
    cmocka_unit_test(verify_stops_when_asked),
    cmocka_unit_test(finish_verifies_before_publishing),
    cmocka_unit_test(meta_bounds_refused),
    cmocka_unit_test(utf8_escape_round_trip),
    cmocka_unit_test(names_made_printable),
    cmocka_unit_test(meta_names_keep_their_bytes),
    cmocka_unit_test(codec_v2_round_trip),
    cmocka_unit_test(meta_v2_round_trip),
    cmocka_unit_test(meta_v2_refused),
    cmocka_unit_test(variable_store_round_trip),
};
UNIT_MAIN(tests)
