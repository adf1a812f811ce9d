/* test_hardening - what train and sweep refuse or survive from hostile
 * input, at the library level (tests/e2e/train_hostile.sh drives the
 * tools): model-file numbers range-checked and layer sizes bounded in 64
 * bits, non-finite tensors refused on load, an out-of-range label named by
 * split and key, an empty evaluation shard, seeds parsed strictly, and
 * Nesterov without momentum refused by the library. */
#include "unit.h"

#include "common/cli.h"
#include "loader/loader.h"
#include "store/store.h"
#include "trainer/checkpoint.h"
#include "trainer/trainer.h"

#include <math.h>

#define SB 16 /* 1x4x4 samples */

/* A database of n samples in split "train" of 10 classes, sample i with
 * label i % 10 except sample bad_key (UINT64_MAX: none), labelled bad. */
static const char *make_db(const char *name, uint64_t n, uint64_t bad_key,
                           int32_t bad)
{
    static char dir[1100];
    snprintf(dir, sizeof dir, "%s", scratch(name));
    rmdir(dir);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_create(dir, NULL, &s, &err), 0);
    static uint64_t lc[10];
    memset(lc, 0, sizeof lc);
    uint8_t rec[STK_RECORD_HEADER + SB], px[SB];
    for (uint64_t i = 0; i < n; i++) {
        memset(px, (int)i, sizeof px);
        int32_t label = i == bad_key ? bad : (int32_t)(i % 10);
        stk_record_encode(rec, label, px, SB);
        assert_int_equal(stk_store_append(s, "train", rec, sizeof rec, &err),
                         0);
        lc[i % 10]++;
    }
    char *classes[10] = {"0", "1", "2", "3", "4", "5", "6", "7", "8", "9"};
    stk_meta m = {.channels = 1,
                  .height = 4,
                  .width = 4,
                  .nclasses = 10,
                  .classes = classes,
                  .nsplits = 1,
                  .source_path = "x",
                  .source_format = "test",
                  .tool = "t",
                  .created = ""};
    snprintf(m.splits[0].name, 32, "train");
    m.splits[0].count = n;
    m.splits[0].label_counts = lc;
    assert_int_equal(stk_store_finish(s, &m, &err), 0);
    stk_store_close(s);
    return dir;
}

/* ---- model files ---------------------------------------------------------
 */

static void expect_parse_error(const char *text, const char *want)
{
    stk_model_spec spec;
    stk_err err = {0};
    assert_int_equal(stk_model_parse(text, "m.txt", &spec, &err), STK_EINVAL);
    if (!strstr(err.msg, want))
        fail_msg("'%s': got \"%s\", want \"%s\"", text, err.msg, want);
}

static void model_file_numbers_are_range_checked(void **state)
{
    (void)state;
    /* (int)strtol made this `linear 1` */
    expect_parse_error(
        "flatten\nlinear 4294967297\n",
        "m.txt:2: '4294967297' is out of range: linear features "
        "takes a whole number 1..1048576");
    expect_parse_error(
        "conv 8 3 pad=2147483647\n",
        "m.txt:1: 'pad=2147483647' is out of range: pad takes a "
        "whole number 0..1024");
    expect_parse_error("conv 8 3 stride=0\n",
                       "m.txt:1: 'stride=0' is out of range: "
                       "stride takes a whole number 1..1024");
    expect_parse_error("conv 8 -3\n",
                       "m.txt:1: '-3' is out of range: conv kernel "
                       "takes a whole number 1..1024");
    expect_parse_error("\n\nconv 99999999999999999999 3\n",
                       "m.txt:3: '99999999999999999999' is out of range: conv "
                       "channels takes a whole number 1..1048576");
    expect_parse_error("pool 0x10\n",
                       "m.txt:1: '0x10' is not a number: pool size "
                       "takes a whole number 1..1024");
    expect_parse_error("dropout nan\n",
                       "m.txt:1: 'nan' is out of range: dropout "
                       "probability takes a number in [0, 1)");
    expect_parse_error("dropout 0.5x\n", "m.txt:1: '0.5x' is not a number");
    expect_parse_error("conv 8\n", "m.txt:1: conv needs a channel count and a "
                                   "kernel size");
    stk_model_spec spec; /* the limits themselves are accepted */
    stk_err err = {0};
    assert_int_equal(stk_model_parse("conv 1048576 1024 stride=1024 pad=1024\n"
                                     "linear classes\n",
                                     "m.txt", &spec, &err),
                     0);
    assert_int_equal(spec.layers[0].out, 1048576);
    assert_int_equal(spec.layers[0].pad, 1024);
}

static void expect_model_error(const char *text, int c, int hw, int batch,
                               const char *want)
{
    stk_backend *be;
    stk_model_spec spec;
    stk_model *m = NULL;
    stk_err err = {0};
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err), 0);
    assert_int_equal(stk_model_parse(text, "m.txt", &spec, &err), 0);
    assert_int_equal(
        stk_model_create(be, &spec, c, hw, hw, 10, batch, 1, &m, &err),
        STK_ERANGE);
    assert_null(m);
    if (!strstr(err.msg, want))
        fail_msg("got \"%s\", want \"%s\"", err.msg, want);
    stk_backend_destroy(be);
}

/* Sizes that wrapped 32 bits (or would need absurd memory) are refused
 * naming the layer, before anything is allocated. */
static void layer_sizes_are_bounded_in_64_bits(void **state)
{
    (void)state;
    expect_model_error(
        "conv 1048576 3\nflatten\nlinear classes\n", 1, 28, 64,
        "model: conv1: its 1048576x26x26 output over a batch of 64 "
        "is more than 2147483647 values");
    /* 2^20 x 2^20 weights: 2^40 values */
    expect_model_error(
        "flatten\nbig: linear 1048576\nlinear 1048576\nlinear classes\n", 1,
        28, 1, "model: fc2: its weight has more than 2147483647 values");
    /* an output of 3 * 2049 * 2049 per sample, times 1024 samples */
    expect_model_error(
        "conv 3 1 pad=1024\nflatten\nlinear classes\n", 1, 1, 1024,
        "model: conv1: its 3x2049x2049 output over a batch of 1024");
    /* flatten of 1024 x 1025 x 1025 in int wrapped; per sample it is fine */
    expect_model_error(
        "conv 1024 1 pad=512\nflatten\nlinear classes\n", 1, 1, 2,
        "model: conv1: its 1024x1025x1025 output over a batch of 2");
    expect_model_error("relu\n", 65536, 65536, 1,
                       "model: a 65536x65536x65536 input");
}

/* ---- checkpoints ---------------------------------------------------------
 */

static void non_finite_tensors_are_refused_on_load(void **state)
{
    (void)state;
    const char *dir = scratch("nan");
    char path[1200];
    snprintf(path, sizeof path, "%s/w.safetensors", dir);
    const float bad[2] = {NAN, INFINITY};
    for (int k = 0; k < 2; k++) {
        float data[4] = {1, 2, 3, 4}, back[4] = {0};
        data[2] = bad[k];
        stk_tensor t = {.name = "fc1.weight",
                        .ndim = 2,
                        .shape = {2, 2},
                        .count = 4,
                        .data = data};
        stk_err err = {0};
        assert_int_equal(stk_safetensors_write(path, &t, 1, NULL, &err), 0);
        t.data = back;
        assert_int_equal(stk_safetensors_read(path, &t, 1, NULL, &err),
                         STK_ERANGE);
        char want[1400];
        snprintf(want, sizeof want, "%s: \"fc1.weight\" holds %s at element 2",
                 path, k ? "an infinity" : "NaN");
        if (!strstr(err.msg, want))
            fail_msg("got \"%s\", want \"%s\"", err.msg, want);
    }
    float ok[4] = {1, -2, 3e38f, -0.0f}, back[4] = {0};
    stk_tensor t = {
        .name = "b", .ndim = 1, .shape = {4}, .count = 4, .data = ok};
    stk_err err = {0};
    assert_int_equal(stk_safetensors_write(path, &t, 1, NULL, &err), 0);
    t.data = back;
    assert_int_equal(stk_safetensors_read(path, &t, 1, NULL, &err), 0);
    assert_memory_equal(back, ok, sizeof ok);
}

/* ---- the loader ----------------------------------------------------------
 */

/* A label beyond the classes is named by split and key where the record
 * is read, for any worker count. */
static void out_of_range_label_names_split_and_key(void **state)
{
    (void)state;
    const char *dir = make_db("badlabel", 40, 27, 12);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    for (int w = 0; w <= 2; w += 2) {
        stk_loader_opts o = {.batch_size = 8, .workers = w};
        stk_loader *l;
        assert_int_equal(stk_loader_open(s, &o, &l, &err), 0);
        stk_batch b;
        int rc, good = 0;
        while ((rc = stk_loader_next(l, &b, &err)) == 1) {
            good++;
            stk_loader_release(l, &b);
        }
        assert_int_equal(good, 3); /* the batches before key 27 */
        assert_int_equal(rc, STK_EFORMAT);
        const char *want =
            "split \"train\": key 27: label 12 is not one of the "
            "database's 10 classes (0..9)";
        if (!strstr(err.msg, want))
            fail_msg("got \"%s\", want \"%s\"", err.msg, want);
        stk_loader_close(l);
    }
    stk_store_close(s);
}

/* Evaluation over more ranks than samples: the ranks without a sample
 * open an empty shard whose epochs end at once, and the shards together
 * hold every sample exactly once. */
static void uneven_shards_may_be_empty(void **state)
{
    (void)state;
    const char *dir = make_db("two", 2, UINT64_MAX, 0);
    stk_store *s;
    stk_err err = {0};
    assert_int_equal(stk_store_open(dir, 0, &s, &err), 0);
    for (int w = 0; w <= 2; w += 2) {
        int seen[2] = {0, 0};
        for (int rank = 0; rank < 3; rank++) {
            stk_loader_opts o = {.batch_size = 64,
                                 .workers = w,
                                 .uneven = true,
                                 .rank = rank,
                                 .world = 3};
            stk_loader *l;
            assert_int_equal(stk_loader_open(s, &o, &l, &err), 0);
            assert_int_equal(stk_loader_batches(l), rank < 2 ? 1 : 0);
            for (int epoch = 0; epoch < 2; epoch++) {
                stk_batch b;
                int rc;
                while ((rc = stk_loader_next(l, &b, &err)) == 1) {
                    for (int i = 0; i < b.n; i++)
                        seen[b.indices[i]] += epoch == 0;
                    stk_loader_release(l, &b);
                }
                assert_int_equal(rc, 0);
            }
            stk_loader_stats st;
            stk_loader_stats_get(l, &st);
            assert_int_equal(st.samples, rank < 2 ? 2 : 0);
            stk_loader_close(l);
        }
        assert_int_equal(seen[0], 1);
        assert_int_equal(seen[1], 1);
    }
    /* an empty split is still an error, and so is a padded shard of none */
    stk_loader_opts o = {.batch_size = 64, .drop_last = true};
    stk_loader *l;
    assert_int_equal(stk_loader_open(s, &o, &l, &err), STK_EINVAL);
    assert_null(l);
    stk_store_close(s);
}

/* ---- flags ---------------------------------------------------------------
 */

static void seeds_are_whole_unsigned_64_bit_numbers(void **state)
{
    (void)state;
    uint64_t v = 7;
    const char *bad[] = {
        "abc", "-1", " 1", "+1", "1x", "", "18446744073709551616", "1e3"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        if (stk_cli_u64("test", "--seed", bad[i], &v) != -1)
            fail_msg("'%s' was accepted", bad[i]);
        assert_int_equal(v, 7);
    }
    assert_int_equal(stk_cli_u64("test", "--seed", "18446744073709551615", &v),
                     0);
    assert_true(v == UINT64_MAX);
    assert_int_equal(stk_cli_u64("test", "--seed", "0", &v), 0);
    assert_true(v == 0);
}

/* A list flag (sweep's and gpu_bench's --workers, train's --gpus): an
 * empty item is refused wherever it stands, as are a bad number and one
 * item too many. */
static void int_lists_have_no_empty_items(void **state)
{
    (void)state;
    int v[4], n = -1;
    assert_int_equal(stk_cli_int_list("test", "--w", "0,1,2,4", 0, 8, v, 4, &n),
                     0);
    assert_int_equal(n, 4);
    assert_int_equal(v[0] * 1000 + v[1] * 100 + v[2] * 10 + v[3], 124);
    assert_int_equal(stk_cli_int_list("test", "--w", "3", 0, 8, v, 4, &n), 0);
    assert_int_equal(n, 1);
    assert_int_equal(v[0], 3);
    const char *bad[] = {"0,,2", "1,", ",1", "", ",", "1,x", "9", "1,2,3,4,5",
                         "1;2"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        if (stk_cli_int_list("test", "--w", bad[i], 0, 8, v, 4, &n) != -1)
            fail_msg("'%s' was accepted (%d items)", bad[i], n);
}

/* Nesterov without momentum is refused by the library itself (not only by
 * train's flags), naming the flag, before anything is opened or created. */
static void nesterov_needs_momentum(void **state)
{
    (void)state;
    char db[1100], out[1100];
    const char *dir = scratch("nesterov"); /* empty */
    snprintf(db, sizeof db, "%s/no-db", dir);
    snprintf(out, sizeof out, "%s/run", dir);
    stk_train_opts o;
    stk_train_defaults(&o);
    o.db = db;
    o.out = out;
    o.quiet = true;
    o.optim = STK_OPT_SGD;
    o.nesterov = true;
    o.momentum = 0;
    stk_err err = {0};
    stk_train_result res;
    assert_int_equal(stk_train_run(&o, &res, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "--nesterov needs --momentum above 0"));
    assert_int_equal(access(out, F_OK), -1); /* no RUN_DIR made */
    assert_int_equal(stk_train_check_opts(&o, &err), STK_EINVAL);
    o.momentum = 0.5f; /* with momentum, or with AdamW, it is fine */
    assert_int_equal(stk_train_check_opts(&o, &err), 0);
    o.momentum = 0;
    o.optim = STK_OPT_ADAMW;
    assert_int_equal(stk_train_check_opts(&o, &err), 0);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(model_file_numbers_are_range_checked),
    cmocka_unit_test(layer_sizes_are_bounded_in_64_bits),
    cmocka_unit_test(non_finite_tensors_are_refused_on_load),
    cmocka_unit_test(out_of_range_label_names_split_and_key),
    cmocka_unit_test(uneven_shards_may_be_empty),
    cmocka_unit_test(seeds_are_whole_unsigned_64_bit_numbers),
    cmocka_unit_test(int_lists_have_no_empty_items),
    cmocka_unit_test(nesterov_needs_momentum),
};

UNIT_MAIN(tests)
