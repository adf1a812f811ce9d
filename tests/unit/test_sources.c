/* test_sources - each raw-format reader loads exactly the bytes and labels
 * of synthetic files written here; bad files give errors naming them. */
#include "unit.h"

#include "preprocess/preprocess.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <zlib.h>

static void put_be32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

static void write_file(const char *dir, const char *name, const void *data,
                       size_t len, int gz)
{
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (gz) {
        gzFile f = gzopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(gzwrite(f, data, (unsigned)len), (int)len);
        gzclose(f);
    } else {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        assert_int_equal(fwrite(data, 1, len, f), len);
        fclose(f);
    }
}

/* IDX images n x rows x cols with pixel (i, p) = i*3 + p, labels i % 7. */
static void write_idx(const char *dir, const char *prefix, uint32_t n,
                      uint32_t labels_n, int gz, uint32_t magic)
{
    const uint32_t rows = 3, cols = 4;
    size_t len = 16 + (size_t)n * rows * cols;
    uint8_t *im = malloc(len), *lb = malloc(8 + labels_n);
    put_be32(im, magic);
    put_be32(im + 4, n);
    put_be32(im + 8, rows);
    put_be32(im + 12, cols);
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t p = 0; p < rows * cols; p++)
            im[16 + i * rows * cols + p] = (uint8_t)(i * 3 + p);
    put_be32(lb, 0x801);
    put_be32(lb + 4, labels_n);
    for (uint32_t i = 0; i < labels_n; i++)
        lb[8 + i] = (uint8_t)(i % 7);
    char name[128];
    snprintf(name, sizeof name, "%s-images-idx3-ubyte%s", prefix,
             gz ? ".gz" : "");
    write_file(dir, name, im, len, gz);
    snprintf(name, sizeof name, "%s-labels-idx1-ubyte%s", prefix,
             gz ? ".gz" : "");
    write_file(dir, name, lb, 8 + labels_n, gz);
    free(im);
    free(lb);
}

static void check_idx(const char *dir)
{
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(dir, NULL, &s, &err), 0);
    assert_string_equal(stk_source_format_name(s), "idx");
    assert_int_equal(stk_source_nsplits(s), 2);
    assert_string_equal(stk_source_split_name(s, 1), "test");
    assert_int_equal(stk_source_split_count(s, 0), 20);
    assert_int_equal(stk_source_split_count(s, 1), 9);
    assert_int_equal(stk_source_nclasses(s), 7);
    int c, h, w;
    stk_source_shape(s, &c, &h, &w);
    assert_int_equal(c * 100 + h * 10 + w, 134);
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < stk_source_split_count(s, k); i++) {
            uint8_t px[12];
            int32_t label;
            assert_int_equal(stk_source_load(s, NULL, k, i, &label, px, &err),
                             0);
            assert_int_equal(label, (int32_t)(i % 7));
            for (int p = 0; p < 12; p++)
                assert_int_equal(px[p], (uint8_t)(i * 3 + p));
        }
    stk_source_close(s);
}

static void idx_raw_and_gzip(void **state)
{
    (void)state;
    const char *raw = scratch("idx_raw");
    write_idx(raw, "train", 20, 20, 0, 0x803);
    write_idx(raw, "t10k", 9, 9, 0, 0x803);
    check_idx(raw);
    const char *gz = scratch("idx_gz");
    write_idx(gz, "train", 20, 20, 1, 0x803);
    write_idx(gz, "t10k", 9, 9, 1, 0x803);
    check_idx(gz);
}

static void expect_open_error(const char *dir, const char *needle)
{
    stk_source *s;
    stk_err err = {0};
    assert_int_not_equal(stk_source_open(dir, NULL, &s, &err), 0);
    assert_null(s);
    if (!strstr(err.msg, needle))
        fail_msg("error \"%s\" lacks \"%s\"", err.msg, needle);
}

static void idx_errors_name_the_file(void **state)
{
    (void)state;
    const char *d = scratch("idx_magic");
    write_idx(d, "train", 4, 4, 0, 0x802);
    expect_open_error(d, "train-images-idx3-ubyte: bad IDX magic 0x00000802");
    d = scratch("idx_count");
    write_idx(d, "train", 4, 3, 0, 0x803);
    expect_open_error(d, "holds 4 images but");
    d = scratch("idx_nolabels");
    write_idx(d, "train", 4, 4, 1, 0x803);
    char p[1200];
    snprintf(p, sizeof p, "%s/train-labels-idx1-ubyte.gz", d);
    remove(p);
    expect_open_error(d, "no train-labels-idx1-ubyte");
}

static void write_cifar(const char *dir, const char *name, int label_bytes,
                        int n, int first)
{
    size_t rec = (size_t)label_bytes + 3072;
    uint8_t *buf = malloc(rec * n);
    for (int i = 0; i < n; i++) {
        uint8_t *r = buf + rec * i;
        r[0] = (uint8_t)((first + i) % 5);          /* coarse or only */
        r[label_bytes - 1] = (uint8_t)((first + i) % 10);
        for (int p = 0; p < 3072; p++)
            r[label_bytes + p] = (uint8_t)(p * 5 + first + i);
    }
    write_file(dir, name, buf, rec * n, 0);
    free(buf);
}

/* CIFAR-10's five train batches, of 2 + 2 + 1 + 2 + 2 records numbered on
 * from 0 across them: 9 records. */
static void write_cifar10_train(const char *dir)
{
    static const int n[5] = {2, 2, 1, 2, 2};
    for (int b = 0, first = 0; b < 5; first += n[b++]) {
        char name[32];
        snprintf(name, sizeof name, "data_batch_%d.bin", b + 1);
        write_cifar(dir, name, 1, n[b], first);
    }
}

static void check_cifar(const char *dir, uint64_t ntrain, const char *cls0)
{
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(dir, NULL, &s, &err), 0);
    assert_string_equal(stk_source_format_name(s), "cifar");
    assert_int_equal(stk_source_split_count(s, 0), ntrain);
    assert_int_equal(stk_source_split_count(s, 1), 3);
    assert_string_equal(stk_source_class_name(s, 0), cls0);
    uint8_t px[3072];
    for (int k = 0; k < 2; k++)
        for (uint64_t i = 0; i < stk_source_split_count(s, k); i++) {
            int first = k ? 1000 : 0;
            int32_t label;
            assert_int_equal(stk_source_load(s, NULL, k, i, &label, px, &err),
                             0);
            assert_int_equal(label, (int)((first + i) % 10));
            for (int p = 0; p < 3072; p++)
                assert_int_equal(px[p], (uint8_t)(p * 5 + first + i));
        }
    stk_source_close(s);
}

static void cifar10_and_100(void **state)
{
    (void)state;
    const char *d = scratch("cifar10");
    write_cifar10_train(d);
    write_cifar(d, "test_batch.bin", 1, 3, 1000);
    const char *names = "airplane\nautomobile\nbird\ncat\ndeer\ndog\nfrog\n"
                        "horse\nship\ntruck\n\n";
    write_file(d, "batches.meta.txt", names, strlen(names), 0);
    check_cifar(d, 9, "airplane");
    d = scratch("cifar100");
    write_cifar(d, "train.bin", 2, 6, 0);
    write_cifar(d, "test.bin", 2, 3, 1000);
    check_cifar(d, 6, "0");
}

/* Every train batch is required: one missing (from a download or a copy) is
 * named, not a smaller train split; so is a missing CIFAR-100 train.bin. */
static void cifar_missing_batch(void **state)
{
    (void)state;
    const char *d = scratch("cifar10_gap");
    write_cifar10_train(d);
    write_cifar(d, "test_batch.bin", 1, 3, 1000);
    char p[1200];
    snprintf(p, sizeof p, "%s/data_batch_3.bin", d);
    assert_int_equal(remove(p), 0);
    expect_open_error(d, "cifar10_gap/data_batch_3.bin: missing (CIFAR-10 has "
                         "data_batch_1.bin .. data_batch_5.bin)");
    snprintf(p, sizeof p, "%s/data_batch_5.bin", d);
    assert_int_equal(remove(p), 0);
    expect_open_error(d, "cifar10_gap/data_batch_3.bin: missing");
    d = scratch("cifar10_test_only");
    write_cifar(d, "test_batch.bin", 1, 3, 1000);
    expect_open_error(d, "cifar10_test_only/data_batch_1.bin: missing");
    d = scratch("cifar100_test_only");
    write_cifar(d, "test.bin", 2, 3, 1000);
    stk_source_opts o = {.format = STK_SRC_CIFAR};
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, &o, &s, &err), STK_ENOENT);
    assert_null(s);
    assert_non_null(strstr(err.msg, "cifar100_test_only/train.bin: missing "
                                    "(CIFAR-100 has train.bin and "
                                    "test.bin)"));
}

static void png_at(const char *root, const char *rel, uint8_t value)
{
    char path[1200], cmd[1300];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    snprintf(cmd, sizeof cmd, "mkdir -p \"$(dirname '%s')\"", path);
    assert_int_equal(system(cmd), 0);
    uint8_t px[4 * 4 * 3];
    memset(px, value, sizeof px);
    stk_err err;
    assert_int_equal(stk_png_write(path, px, 4, 4, 3, &err), 0);
}

static void folder_order_and_labels(void **state)
{
    (void)state;
    const char *d = scratch("folder");
    png_at(d, "b/x.png", 50);
    png_at(d, "a/2.png", 20);
    png_at(d, "a/1.PNG", 10);
    png_at(d, "a/sub/0.png", 30);
    png_at(d, "a/.hidden.png", 99);
    write_file(d, "a/readme.txt", "x", 1, 0);
    stk_source_opts o = {.size = 4};
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, &o, &s, &err), 0);
    assert_string_equal(stk_source_format_name(s), "folder");
    assert_int_equal(stk_source_nsplits(s), 1);
    assert_string_equal(stk_source_split_name(s, 0), "train");
    assert_int_equal(stk_source_nclasses(s), 2);
    assert_int_equal(stk_source_split_count(s, 0), 4);
    /* sorted paths: a/1.PNG, a/2.png, a/sub/0.png, b/x.png */
    uint8_t want[] = {10, 20, 30, 50};
    int32_t labels[] = {0, 0, 0, 1};
    for (int i = 0; i < 4; i++) {
        uint8_t px[48];
        int32_t label;
        stk_decoder *dec;
        assert_int_equal(stk_decoder_create(&dec, &err), 0);
        assert_int_equal(stk_source_load(s, dec, 0, (uint64_t)i, &label, px,
                                         &err),
                         0);
        stk_decoder_destroy(dec);
        assert_int_equal(label, labels[i]);
        assert_int_equal(px[0], want[i]);
        assert_int_equal(px[47], want[i]);
    }
    stk_source_close(s);
}

static void folder_split_layout(void **state)
{
    (void)state;
    const char *d = scratch("splits");
    png_at(d, "train/cat/1.png", 1);
    png_at(d, "train/dog/1.png", 2);
    png_at(d, "test/dog/1.png", 3);
    png_at(d, "test/emu/1.png", 4);
    png_at(d, "zeta/cat/1.png", 5);
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, NULL, &s, &err), 0);
    assert_int_equal(stk_source_nsplits(s), 3);
    assert_string_equal(stk_source_split_name(s, 0), "train");
    assert_string_equal(stk_source_split_name(s, 1), "test");
    assert_string_equal(stk_source_split_name(s, 2), "zeta");
    assert_int_equal(stk_source_nclasses(s), 3); /* cat, dog, emu */
    assert_string_equal(stk_source_class_name(s, 2), "emu");
    int c, h, w;
    stk_source_shape(s, &c, &h, &w);
    assert_int_equal(c, 3);
    assert_int_equal(h, 64); /* default folder size */
    uint8_t *px = malloc(3 * 64 * 64);
    int32_t label;
    stk_decoder *dec;
    assert_int_equal(stk_decoder_create(&dec, &err), 0);
    assert_int_equal(stk_source_load(s, dec, 1, 1, &label, px, &err), 0);
    assert_int_equal(label, 2);
    assert_int_equal(px[0], 4);
    stk_decoder_destroy(dec);
    free(px);
    stk_source_close(s);
}

/* ---- hostile input ------------------------------------------------------ */

/* A case that opens a FIFO fails in 300 s instead of hanging the suite if
 * opening ever blocks again (generous: the sanitizers on a loaded machine
 * are slow, and only a hang takes that long). */
static void fail_instead_of_hanging(void) { alarm(300); }

static long max_rss_kib(void)
{
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return ru.ru_maxrss;
}

/* gzip members of zeros appended to path: mib MiB more once inflated. */
static void append_zero_members(const char *path, int mib)
{
    static uint8_t zeros[1 << 20];
    uLongf n = compressBound(sizeof zeros) + 32;
    uint8_t *member = malloc(n);
    z_stream zs = {0};
    assert_int_equal(deflateInit2(&zs, 9, Z_DEFLATED, 15 + 16, 9,
                                  Z_DEFAULT_STRATEGY),
                     Z_OK);
    zs.next_in = zeros;
    zs.avail_in = sizeof zeros;
    zs.next_out = member;
    zs.avail_out = (uInt)n;
    assert_int_equal(deflate(&zs, Z_FINISH), Z_STREAM_END);
    size_t len = n - zs.avail_out;
    deflateEnd(&zs);
    FILE *f = fopen(path, "ab");
    assert_non_null(f);
    for (int i = 0; i < mib; i++)
        assert_int_equal(fwrite(member, 1, len, f), len);
    fclose(f);
    free(member);
}

/* A few KB of gzip that inflate to 256 MiB behind a header promising 20
 * images of 3x4: refused after reading what the header promises plus one
 * byte, without the memory to hold the rest. */
static void idx_gzip_bomb_costs_no_memory(void **state)
{
    (void)state;
    const char *d = scratch("idx_bomb");
    write_idx(d, "train", 20, 20, 1, 0x803);
    char p[1200];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", d);
    append_zero_members(p, 256);
    long before = max_rss_kib();
    expect_open_error(d, "train-images-idx3-ubyte.gz: header promises 240 "
                         "data bytes but the gzip data holds more (trailing "
                         "data; reading stopped at 241 bytes)");
    long grown = max_rss_kib() - before;
    if (grown > 32 * 1024)
        fail_msg("the peak resident size grew by %ld KiB", grown);
}

/* train-images-idx3-ubyte.gz in dir: a gzip member with a header promising
 * n images of side x side, then mib members of 1 MiB of zeros each; and n
 * labels 0 beside it. */
static void write_zero_idx(const char *dir, uint32_t n, uint32_t side, int mib)
{
    uint8_t head[16], *lb = calloc(1, 8 + (size_t)n);
    assert_non_null(lb);
    put_be32(head, 0x803);
    put_be32(head + 4, n);
    put_be32(head + 8, side);
    put_be32(head + 12, side);
    write_file(dir, "train-images-idx3-ubyte.gz", head, sizeof head, 1);
    char p[1200];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", dir);
    append_zero_members(p, mib);
    put_be32(lb, 0x801);
    put_be32(lb + 4, n);
    write_file(dir, "train-labels-idx1-ubyte.gz", lb, 8 + (size_t)n, 1);
    free(lb);
}

/* A header promising 100 MiB over gzip that holds a MiB more, or a MiB
 * less: the content is counted before memory is allocated for it, so the
 * lie costs nothing (it once cost what the header promised). Over exactly
 * 100 MiB the same file loads. */
static void idx_gzip_lying_header_costs_no_memory(void **state)
{
    (void)state;
    const char *d = scratch("idx_lie_more");
    write_zero_idx(d, 100, 1024, 101);
    long before = max_rss_kib();
    expect_open_error(d, "train-images-idx3-ubyte.gz: header promises "
                         "104857600 data bytes but the gzip data holds more "
                         "(trailing data; reading stopped at 104857601 "
                         "bytes)");
    d = scratch("idx_lie_less");
    write_zero_idx(d, 100, 1024, 99);
    expect_open_error(d, "train-images-idx3-ubyte.gz: header promises "
                         "104857600 data bytes but the file holds 103809024 "
                         "(truncated)");
    long grown = max_rss_kib() - before;
    if (grown > 32 * 1024)
        fail_msg("the peak resident size grew by %ld KiB", grown);
    d = scratch("idx_big_zeros");
    write_zero_idx(d, 100, 1024, 100);
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, NULL, &s, &err), 0);
    assert_int_equal(stk_source_split_count(s, 0), 100);
    uint8_t *px = malloc(1 << 20), zero[1024] = {0};
    int32_t label = -1;
    assert_int_equal(stk_source_load(s, NULL, 0, 99, &label, px, &err), 0);
    assert_int_equal(label, 0);
    for (int r = 0; r < 1024; r++)
        assert_memory_equal(px + r * 1024, zero, sizeof zero);
    free(px);
    stk_source_close(s);
}

/* An images file in dir that holds only head (the labels beside it are
 * never reached: the images are read first). */
static void write_header_only(const char *dir, const char *name,
                              const uint8_t *head, int gz)
{
    write_file(dir, name, head, 16, gz);
    write_file(dir, "train-labels-idx1-ubyte", head, 8, 0);
}

/* An IDX header's limits hold before anything is allocated: at most
 * 2^30-1 records, at most 4 GiB of data bytes (plain or gzip), and for
 * gzip at most 1032 times the file's size. */
static void idx_header_limits(void **state)
{
    (void)state;
    uint8_t head[16];
    put_be32(head, 0x803);
    put_be32(head + 4, 1280); /* 1280 x 2048 x 2048: 5 GiB */
    put_be32(head + 8, 2048);
    put_be32(head + 12, 2048);
    const char *d = scratch("idx_cap_plain");
    write_header_only(d, "train-images-idx3-ubyte", head, 0);
    expect_open_error(d, "train-images-idx3-ubyte: header promises "
                         "5368709120 data bytes, over the limit of "
                         "4294967296 (4 GiB) for an IDX file");
    d = scratch("idx_cap_gzip");
    write_header_only(d, "train-images-idx3-ubyte.gz", head, 1);
    expect_open_error(d, "train-images-idx3-ubyte.gz: header promises "
                         "5368709120 data bytes, over the limit of "
                         "4294967296 (4 GiB) for an IDX file");
    put_be32(head + 4, 1024); /* exactly 4 GiB: within the limit */
    d = scratch("idx_cap_exact");
    write_header_only(d, "train-images-idx3-ubyte", head, 0);
    expect_open_error(d, "train-images-idx3-ubyte: header promises "
                         "4294967296 data bytes but the file holds 0 "
                         "(truncated)");
    put_be32(head + 4, 1u << 30); /* 2^30 images of 1x1 */
    put_be32(head + 8, 1);
    put_be32(head + 12, 1);
    d = scratch("idx_records");
    write_header_only(d, "train-images-idx3-ubyte", head, 0);
    expect_open_error(d, "train-images-idx3-ubyte: header promises "
                         "1073741824 images, more than the 1073741823 "
                         "records a split can hold");
    put_be32(head + 4, 64); /* 64 MiB from a few bytes of gzip */
    put_be32(head + 8, 1024);
    put_be32(head + 12, 1024);
    d = scratch("idx_ratio");
    write_header_only(d, "train-images-idx3-ubyte.gz", head, 1);
    char p[1200], want[400];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", d);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    snprintf(want, sizeof want,
             "train-images-idx3-ubyte.gz: header promises 67108864 data "
             "bytes but %lld bytes of gzip inflate to at most %lld "
             "(deflate's limit is 1032:1)",
             (long long)st.st_size, (long long)st.st_size * 1032);
    expect_open_error(d, want);
}

/* A plain IDX file's size is compared with its header before it is read. */
static void idx_sizes_named(void **state)
{
    (void)state;
    const char *d = scratch("idx_short");
    write_idx(d, "train", 20, 20, 0, 0x803);
    char p[1200];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte", d);
    assert_int_equal(truncate(p, 16 + 100), 0);
    expect_open_error(d, "train-images-idx3-ubyte: header promises 240 data "
                         "bytes but the file holds 100 (truncated)");
    write_idx(d, "train", 20, 20, 0, 0x803);
    assert_int_equal(truncate(p, 16 + 241), 0);
    expect_open_error(d, "train-images-idx3-ubyte: header promises 240 data "
                         "bytes but the file holds 241 (trailing data)");
    d = scratch("idx_gzshort");
    write_idx(d, "train", 20, 20, 1, 0x803);
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte.gz", d);
    uint8_t all[16 + 240] = {0};
    put_be32(all, 0x803);
    put_be32(all + 4, 21); /* one image more than the data holds */
    put_be32(all + 8, 3);
    put_be32(all + 12, 4);
    write_file(d, "train-images-idx3-ubyte.gz", all, sizeof all, 1);
    expect_open_error(d, "header promises 252 data bytes but the file holds "
                         "240 (truncated)");
}

/* Only t10k-* files: said so, not "no class folders". */
static void idx_test_split_only(void **state)
{
    (void)state;
    const char *d = scratch("idx_t10k");
    write_idx(d, "t10k", 9, 9, 1, 0x803);
    expect_open_error(d, "no train-images-idx3-ubyte[.gz] and no "
                         "train-labels-idx1-ubyte[.gz] (the train split is "
                         "required; found only t10k-* files)");
    d = scratch("idx_labels_only");
    write_idx(d, "train", 4, 4, 0, 0x803);
    char p[1200];
    snprintf(p, sizeof p, "%s/train-images-idx3-ubyte", d);
    remove(p);
    expect_open_error(d, "train-labels-idx1-ubyte but no "
                         "train-images-idx3-ubyte[.gz]");
}

/* stk_zfile reads plain and gzip files in pieces of any size, several gzip
 * members as one, and names damaged gzip data. */
static void zfile_reads_and_refuses(void **state)
{
    (void)state;
    const char *d = scratch("zfile");
    uint8_t data[70000];
    for (size_t i = 0; i < sizeof data; i++)
        data[i] = (uint8_t)(i * 7 + i / 300);
    write_file(d, "plain", data, sizeof data, 0);
    write_file(d, "one.gz", data, sizeof data, 1);
    char p[1200], q[4000];
    snprintf(p, sizeof p, "%s/one.gz", d);
    snprintf(q, sizeof q, "cat '%s' '%s' > '%s/two.gz'", p, p, d);
    assert_int_equal(system(q), 0);
    const char *names[] = {"plain", "one.gz", "two.gz"};
    for (int k = 0; k < 3; k++) {
        snprintf(p, sizeof p, "%s/%s", d, names[k]);
        stk_zfile *f;
        stk_err err = {0};
        assert_int_equal(stk_zfile_open(p, &f, &err), 0);
        assert_int_equal(stk_zfile_is_gzip(f), k > 0);
        uint8_t *out = malloc(2 * sizeof data + 65536);
        size_t have = 0, got, piece = 1;
        for (;;) { /* pieces of 1, 2, 4, ... 64 Ki bytes */
            assert_int_equal(stk_zfile_read(f, out + have, piece, &got, &err),
                             0);
            have += got;
            if (got < piece)
                break;
            piece = piece < 65536 ? piece * 2 : piece;
        }
        assert_int_equal(have, (k == 2 ? 2 : 1) * sizeof data);
        assert_memory_equal(out, data, sizeof data);
        if (k == 2)
            assert_memory_equal(out + sizeof data, data, sizeof data);
        free(out);
        stk_zfile_close(f);
    }
    /* truncated and corrupt gzip data */
    snprintf(p, sizeof p, "%s/one.gz", d);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    snprintf(q, sizeof q, "head -c %lld '%s' > '%s/cut.gz'",
             (long long)st.st_size / 2, p, d);
    assert_int_equal(system(q), 0);
    snprintf(q, sizeof q,
             "{ head -c 20 '%s'; head -c 2000 /dev/zero | tr '\\0' '\\377'; } "
             "> '%s/bad.gz'", p, d);
    assert_int_equal(system(q), 0);
    const char *bad[] = {"cut.gz", "bad.gz"};
    const char *why[] = {"cut.gz: gzip data is truncated",
                         "bad.gz: gzip data is corrupt ("};
    for (int k = 0; k < 2; k++) {
        snprintf(p, sizeof p, "%s/%s", d, bad[k]);
        stk_zfile *f;
        stk_err err = {0};
        assert_int_equal(stk_zfile_open(p, &f, &err), 0);
        uint8_t *out = malloc(sizeof data);
        size_t got;
        assert_int_equal(stk_zfile_read(f, out, sizeof data, &got, &err),
                         STK_EFORMAT);
        if (!strstr(err.msg, why[k]))
            fail_msg("error \"%s\" lacks \"%s\"", err.msg, why[k]);
        free(out);
        stk_zfile_close(f);
    }
}

/* A FIFO named like an image is listed (so --skip-bad can record it) and
 * refused by name when loaded, without waiting for a writer; so is a
 * dangling link (it once failed the listing: "cannot read directory"); a
 * name holding ": " keeps its file and reason apart. */
static void folder_fifo_and_odd_names(void **state)
{
    (void)state;
    fail_instead_of_hanging();
    const char *d = scratch("folder_fifo");
    png_at(d, "a/1.png", 10);
    png_at(d, "a/x: y.png", 20);
    char p[1200];
    snprintf(p, sizeof p, "%s/a/2.png", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    snprintf(p, sizeof p, "%s/a/3.png", d);
    assert_int_equal(symlink("/nonexistent/3.png", p), 0);
    write_file(d, "a/x: y.png", "garbage", 7, 0);
    stk_source_opts o = {.size = 4};
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, &o, &s, &err), 0);
    assert_int_equal(stk_source_split_count(s, 0), 4);
    stk_decoder *dec;
    assert_int_equal(stk_decoder_create(&dec, &err), 0);
    uint8_t px[48];
    int32_t label;
    assert_int_equal(stk_source_load(s, dec, 0, 0, &label, px, &err), 0);
    /* a/2.png, the FIFO */
    assert_int_equal(stk_source_load(s, dec, 0, 1, &label, px, &err),
                     STK_EFORMAT);
    snprintf(p, sizeof p, "%s/a/2.png: not a regular file (a FIFO)", d);
    assert_string_equal(err.msg, p);
    snprintf(p, sizeof p, "%s/a/2.png", d);
    assert_string_equal(stk_source_sample_file(s, 0, 1), p);
    assert_string_equal(stk_source_error_reason(s, 0, 1, err.msg),
                        "not a regular file (a FIFO)");
    /* a/3.png, the dangling link */
    assert_int_equal(stk_source_load(s, dec, 0, 2, &label, px, &err),
                     STK_ENOENT);
    assert_string_equal(stk_source_error_reason(s, 0, 2, err.msg),
                        "No such file or directory");
    /* a/x: y.png, garbage */
    assert_int_equal(stk_source_load(s, dec, 0, 3, &label, px, &err),
                     STK_EFORMAT);
    snprintf(p, sizeof p, "%s/a/x: y.png", d);
    assert_string_equal(stk_source_sample_file(s, 0, 3), p);
    assert_string_equal(stk_source_error_reason(s, 0, 3, err.msg),
                        "not a PNG or JPEG file (bad magic bytes)");
    stk_decoder_destroy(dec);
    stk_source_close(s);
    alarm(0);
}

/* An empty first class folder is a class with no samples (it once passed
 * NULL to qsort: UBSan). */
static void folder_empty_first_class(void **state)
{
    (void)state;
    const char *d = scratch("folder_empty_first");
    png_at(d, "b/1.png", 10);
    char p[1200];
    snprintf(p, sizeof p, "%s/a", d);
    assert_int_equal(mkdir(p, 0755), 0);
    stk_source_opts o = {.size = 4};
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, &o, &s, &err), 0);
    assert_int_equal(stk_source_nclasses(s), 2);
    assert_string_equal(stk_source_class_name(s, 0), "a");
    assert_int_equal(stk_source_split_count(s, 0), 1);
    stk_source_close(s);
}

/* A symbolic link back to a folder being walked is refused by name instead
 * of walking until the path is too long. */
static void folder_link_loop(void **state)
{
    (void)state;
    const char *d = scratch("folder_loop");
    png_at(d, "a/1.png", 10);
    char p[1200], want[2400];
    snprintf(p, sizeof p, "%s/a/sub", d);
    assert_int_equal(symlink("..", p), 0);
    snprintf(want, sizeof want, "%s/a/sub/a: a link back to %s/a (a directory "
             "loop)", d, d);
    expect_open_error(d, want);
}

/* Names that are not UTF-8 are kept byte for byte and sorted by bytes. */
static void folder_non_utf8_names(void **state)
{
    (void)state;
    const char *d = scratch("folder_bytes");
    png_at(d, "caf\xc3\xa9/\xff.png", 30); /* UTF-8 "café" */
    png_at(d, "caf\xe9/b.png", 20);        /* Latin-1 "café" */
    png_at(d, "caf\xe9/\x80.png", 21);
    png_at(d, "cafe/a.png", 10);
    stk_source_opts o = {.size = 4};
    stk_source *s;
    stk_err err = {0};
    assert_int_equal(stk_source_open(d, &o, &s, &err), 0);
    assert_int_equal(stk_source_nclasses(s), 3);
    assert_string_equal(stk_source_class_name(s, 0), "cafe");
    assert_string_equal(stk_source_class_name(s, 1), "caf\xc3\xa9");
    assert_string_equal(stk_source_class_name(s, 2), "caf\xe9");
    char p[1200];
    snprintf(p, sizeof p, "%s/caf\xe9/\x80.png", d);
    assert_string_equal(stk_source_sample_file(s, 0, 3), p);
    uint8_t want[] = {10, 30, 20, 21}; /* b.png before \x80.png */
    int32_t labels[] = {0, 1, 2, 2};
    stk_decoder *dec;
    assert_int_equal(stk_decoder_create(&dec, &err), 0);
    for (int i = 0; i < 4; i++) {
        uint8_t px[48];
        int32_t label;
        assert_int_equal(stk_source_load(s, dec, 0, (uint64_t)i, &label, px,
                                         &err),
                         0);
        assert_int_equal(label, labels[i]);
        assert_int_equal(px[0], want[i]);
    }
    stk_decoder_destroy(dec);
    stk_source_close(s);
}

/* Names shortened for a message are cut between UTF-8 characters (of 2,
 * 3 and 4 bytes), never through one; bytes that are not UTF-8 are cut
 * where asked. */
static void utf8_cuts_between_characters(void **state)
{
    (void)state;
    const char *s = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80z"; /* a é € 😀 z */
    size_t want[] = {0, 1, 1, 3, 3, 3, 6, 6, 6, 6, 10, 11};
    for (size_t n = 0; n < sizeof want / sizeof *want; n++)
        assert_int_equal(stk_utf8_fit(s, n), want[n]);
    assert_int_equal(stk_utf8_fit("\xe9\xe9\xe9", 2), 2); /* Latin-1 */
    assert_int_equal(stk_utf8_fit("\x80\x80\x80\x80", 4), 4);
    assert_int_equal(stk_utf8_fit("\x80\x80\x80\x80\x80", 4), 4); /* no lead */
    assert_int_equal(stk_utf8_fit("\xc3\xa9\xa9", 2), 2); /* é, then a stray byte */
    char buf[6];
    assert_int_equal(stk_snprintf_text(buf, sizeof buf, "ab%s", "\xe2\x82\xac!"), 6);
    assert_string_equal(buf, "ab\xe2\x82\xac"); /* fits whole */
    assert_int_equal(stk_snprintf_text(buf, sizeof buf, "abc%s", "\xe2\x82\xac"), 6);
    assert_string_equal(buf, "abc"); /* the euro sign would be cut */
}

/* CIFAR: a FIFO as a batch or as the class names file is refused by name;
 * so is a names file with an overlong line. */
static void cifar_fifo_and_names(void **state)
{
    (void)state;
    fail_instead_of_hanging();
    const char *d = scratch("cifar_fifo");
    char p[1200];
    snprintf(p, sizeof p, "%s/data_batch_1.bin", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    expect_open_error(d, "data_batch_1.bin: not a regular file (a FIFO)");
    d = scratch("cifar_meta_fifo");
    write_cifar10_train(d);
    snprintf(p, sizeof p, "%s/batches.meta.txt", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    expect_open_error(d, "batches.meta.txt: not a regular file (a FIFO)");
    d = scratch("cifar_meta_long");
    write_cifar10_train(d);
    char names[600];
    memset(names, 'x', sizeof names);
    memcpy(names, "cat\n", 4);
    write_file(d, "batches.meta.txt", names, sizeof names, 0);
    expect_open_error(d, "batches.meta.txt: line 2 is longer than 255 bytes");
    alarm(0);
}

/* The PNG writer (dbinfo --grid) writes only to a regular file: a FIFO is
 * refused by name, never waited on, whether or not a reader holds it open
 * (with one, a write-only open would succeed), nothing is written into it,
 * and an existing regular file is replaced. */
static void png_write_refuses_fifo(void **state)
{
    (void)state;
    fail_instead_of_hanging();
    const char *d = scratch("png_out");
    char p[1200];
    snprintf(p, sizeof p, "%s/sheet.png", d);
    assert_int_equal(mkfifo(p, 0600), 0);
    uint8_t px[4 * 4 * 3] = {0};
    stk_err err = {0};
    assert_int_equal(stk_png_write(p, px, 4, 4, 3, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "sheet.png: not a regular file (a FIFO)"));
    int rd = open(p, O_RDONLY | O_NONBLOCK);
    assert_true(rd >= 0);
    memset(&err, 0, sizeof err);
    assert_int_equal(stk_png_write(p, px, 4, 4, 3, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "sheet.png: not a regular file (a FIFO)"));
    uint8_t b;
    assert_int_equal(read(rd, &b, 1), 0); /* no writer ever: end of file */
    close(rd);
    assert_int_equal(stk_png_write(p, px, 4, 4, 3, NULL), STK_EFORMAT);
    assert_int_equal(unlink(p), 0);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    for (int i = 0; i < 100000; i++)
        fputc('x', f);
    fclose(f);
    assert_int_equal(stk_png_write(p, px, 4, 4, 3, &err), 0);
    struct stat st;
    assert_int_equal(stat(p, &st), 0);
    assert_true(S_ISREG(st.st_mode) && st.st_size > 8 && st.st_size < 1000);
    alarm(0);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(idx_raw_and_gzip),
    cmocka_unit_test(idx_errors_name_the_file),
    cmocka_unit_test(cifar10_and_100),
    cmocka_unit_test(cifar_missing_batch),
    cmocka_unit_test(folder_order_and_labels),
    cmocka_unit_test(folder_split_layout),
    cmocka_unit_test(idx_gzip_bomb_costs_no_memory),
    cmocka_unit_test(idx_sizes_named),
    cmocka_unit_test(idx_gzip_lying_header_costs_no_memory),
    cmocka_unit_test(idx_header_limits),
    cmocka_unit_test(idx_test_split_only),
    cmocka_unit_test(zfile_reads_and_refuses),
    cmocka_unit_test(folder_fifo_and_odd_names),
    cmocka_unit_test(folder_empty_first_class),
    cmocka_unit_test(folder_link_loop),
    cmocka_unit_test(folder_non_utf8_names),
    cmocka_unit_test(cifar_fifo_and_names),
    cmocka_unit_test(png_write_refuses_fifo),
    cmocka_unit_test(utf8_cuts_between_characters),
};
UNIT_MAIN(tests)
