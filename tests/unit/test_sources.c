/* test_sources - each raw-format reader loads exactly the bytes and labels
 * of synthetic files written here; bad files give errors naming them. */
#include "unit.h"

#include "preprocess/preprocess.h"

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
    write_cifar(d, "data_batch_1.bin", 1, 4, 0);
    write_cifar(d, "data_batch_2.bin", 1, 5, 4);
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

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(idx_raw_and_gzip),
    cmocka_unit_test(idx_errors_name_the_file),
    cmocka_unit_test(cifar10_and_100),
    cmocka_unit_test(folder_order_and_labels),
    cmocka_unit_test(folder_split_layout),
};
UNIT_MAIN(tests)
