/* test_safetensors.c - the safetensors reader and writer beyond F32
 * parameters: batchnorm's num_batches_tracked is an I64 0-dim tensor in
 * PyTorch's state dict (shape [], 8 bytes), and a tensor whose dtype or
 * shape is not the model's is refused by name. */
#include "unit.h"

#include "trainer/checkpoint.h"

#include <sys/stat.h>

/* The header of a safetensors file, as text (malloc'd). */
static char *header_of(const char *path)
{
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    uint8_t len[8];
    assert_int_equal(fread(len, 1, 8, f), 8);
    uint64_t n = 0;
    for (int b = 0; b < 8; b++)
        n |= (uint64_t)len[b] << (8 * b);
    char *h = calloc(n + 1, 1);
    assert_non_null(h);
    assert_int_equal(fread(h, 1, n, f), n);
    fclose(f);
    return h;
}

static const char *file_in(const char *dir, const char *name)
{
    static char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    return path;
}

/* A bn's state as PyTorch saves it: two F32 vectors and an I64 scalar,
 * read back bit for bit; the header says I64 and shape [] (8 bytes). */
static void i64_scalar_round_trips(void **state)
{
    (void)state;
    const char *path = file_in(scratch("i64"), "bn.safetensors");
    float mean[3] = {0.5f, -1.25f, 3e-8f}, var[3] = {1, 2.5f, 7};
    int64_t count = 1234567890123LL;
    stk_tensor t[3] = {
        {.name = "bn1.running_mean", .ndim = 1, .shape = {3}, .count = 3, .data = mean},
        {.name = "bn1.running_var", .ndim = 1, .shape = {3}, .count = 3, .data = var},
        {.name = "bn1.num_batches_tracked", .dtype = STK_DT_I64, .ndim = 0,
         .count = 1, .data = &count}};
    stk_err err = {0};
    assert_int_equal(stk_safetensors_write(path, t, 3, NULL, &err), 0);
    char *h = header_of(path);
    const char *want = "\"bn1.num_batches_tracked\":{\"dtype\":\"I64\",\"shape\":[],"
                       "\"data_offsets\":[24,32]}";
    if (!strstr(h, want))
        fail_msg("header %s lacks %s", h, want);
    free(h);
    float mean2[3] = {0}, var2[3] = {0};
    int64_t count2 = 0;
    t[0].data = mean2;
    t[1].data = var2;
    t[2].data = &count2;
    assert_int_equal(stk_safetensors_read(path, t, 3, NULL, &err), 0);
    assert_memory_equal(mean2, mean, sizeof mean);
    assert_memory_equal(var2, var, sizeof var);
    assert_true(count2 == count);
}

/* Reads path's only tensor as `want` and expects an error naming it. */
static void refused_as(const char *path, stk_tensor want, const char *msg)
{
    float buf[8] = {0};
    want.data = buf;
    stk_err err = {0};
    assert_int_equal(stk_safetensors_read(path, &want, 1, NULL, &err), STK_EFORMAT);
    char full[1400];
    snprintf(full, sizeof full, "%s: %s", path, msg);
    if (!strstr(err.msg, full))
        fail_msg("got \"%s\", want \"%s\"", err.msg, full);
}

/* A counter where the model wants a float (and the other way round), or a
 * scalar where it wants a vector of one: refused with the tensor's name,
 * what the model needs and what the file holds. */
static void wrong_dtype_or_shape_is_named(void **state)
{
    (void)state;
    const char *dir = scratch("kinds");
    char scalar[1200], vec[1200];
    snprintf(scalar, sizeof scalar, "%s", file_in(dir, "scalar.safetensors"));
    snprintf(vec, sizeof vec, "%s", file_in(dir, "vec.safetensors"));
    int64_t count = 5;
    float one = 1;
    stk_err err = {0};
    stk_tensor t = {.name = "bn1.num_batches_tracked", .dtype = STK_DT_I64,
                    .ndim = 0, .count = 1, .data = &count};
    assert_int_equal(stk_safetensors_write(scalar, &t, 1, NULL, &err), 0);
    stk_tensor v = {.name = "bn1.num_batches_tracked", .ndim = 1,
                    .shape = {1}, .count = 1, .data = &one};
    assert_int_equal(stk_safetensors_write(vec, &v, 1, NULL, &err), 0);

    stk_tensor as_f32 = {.name = "bn1.num_batches_tracked", .ndim = 0, .count = 1};
    refused_as(scalar, as_f32, "\"bn1.num_batches_tracked\" is I64, the model needs F32");
    stk_tensor as_vec = {.name = "bn1.num_batches_tracked", .dtype = STK_DT_I64,
                         .ndim = 1, .shape = {1}, .count = 1};
    refused_as(scalar, as_vec,
               "\"bn1.num_batches_tracked\" has shape [], the model needs [1]");
    stk_tensor as_i64 = {.name = "bn1.num_batches_tracked", .dtype = STK_DT_I64,
                         .ndim = 0, .count = 1};
    refused_as(vec, as_i64, "\"bn1.num_batches_tracked\" is F32, the model needs I64");
    stk_tensor as_scalar = {.name = "bn1.num_batches_tracked", .ndim = 0, .count = 1};
    refused_as(vec, as_scalar,
               "\"bn1.num_batches_tracked\" has shape [1], the model needs []");
}

/* An optional tensor that the file lacks leaves its data alone and says
 * so; a required one is refused by name; the prefix "module." is taken
 * for both. */
static void optional_tensors_may_be_missing(void **state)
{
    (void)state;
    const char *path = file_in(scratch("optional"), "w.safetensors");
    float w[2] = {1, 2};
    stk_tensor t = {.name = "module.fc.weight", .ndim = 1, .shape = {2}, .count = 2,
                    .data = w};
    stk_err err = {0};
    assert_int_equal(stk_safetensors_write(path, &t, 1, NULL, &err), 0);
    float back[2] = {0}, keep[2] = {7, 8};
    int64_t n = 42;
    stk_tensor r[3] = {
        {.name = "fc.weight", .ndim = 1, .shape = {2}, .count = 2, .data = back},
        {.name = "bn.running_mean", .ndim = 1, .shape = {2}, .count = 2,
         .data = keep, .optional = true, .found = true},
        {.name = "bn.num_batches_tracked", .dtype = STK_DT_I64, .count = 1,
         .data = &n, .optional = true, .found = true}};
    assert_int_equal(stk_safetensors_read(path, r, 3, NULL, &err), 0);
    assert_true(r[0].found && !r[1].found && !r[2].found);
    assert_memory_equal(back, w, sizeof w);
    assert_true(keep[0] == 7 && keep[1] == 8 && n == 42);
    r[1].optional = false;
    assert_int_equal(stk_safetensors_read(path, r, 3, NULL, &err), STK_EFORMAT);
    assert_non_null(strstr(err.msg, "no tensor \"bn.running_mean\""));
}

/* The longest name a model can give a parameter, with the longest
 * optimizer suffix, is written and read back whole. */
static void longest_names_fit(void **state)
{
    (void)state;
    const char *path = file_in(scratch("names"), "long.safetensors");
    stk_param p;
    char name[STK_TENSOR_NAME_MAX];
    memset(p.name, 'a', sizeof p.name - 1);
    p.name[sizeof p.name - 1] = '\0';
    int len = snprintf(name, sizeof name, "%s.momentum_buffer", p.name);
    assert_true(len > 0 && (size_t)len < sizeof name);
    float x = 3;
    stk_tensor t = {.ndim = 1, .shape = {1}, .count = 1, .data = &x};
    memcpy(t.name, name, sizeof name);
    stk_err err = {0};
    assert_int_equal(stk_safetensors_write(path, &t, 1, NULL, &err), 0);
    char *h = header_of(path);
    assert_non_null(strstr(h, name));
    free(h);
    float y = 0;
    t.data = &y;
    assert_int_equal(stk_safetensors_read(path, &t, 1, NULL, &err), 0);
    assert_true(y == 3);
}

/* Writes a file of one tensor "t" of dtype dt and shape [n], its data the
 * given bytes (a header of the length given, whatever the text). */
static void write_raw(const char *path, const char *dt, int n,
                      const void *data, size_t bytes)
{
    char h[200];
    int hl = snprintf(h, sizeof h,
                      "{\"t\":{\"dtype\":\"%s\",\"shape\":[%d],"
                      "\"data_offsets\":[0,%zu]}}",
                      dt, n, bytes);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t len[8] = {0};
    for (int b = 0; b < 8; b++)
        len[b] = (uint8_t)((uint64_t)hl >> (8 * b));
    fwrite(len, 1, 8, f);
    fwrite(h, 1, (size_t)hl, f);
    fwrite(data, 1, bytes, f);
    fclose(f);
}

/* Half, bfloat16 and double weights are cast to float, an int32 counter
 * to int64, as load_state_dict's copy casts them (values exact in each). */
static void other_dtypes_are_cast(void **state)
{
    (void)state;
    const char *dir = scratch("casts");
    char path[1200];
    snprintf(path, sizeof path, "%s", file_in(dir, "x.safetensors"));
    const float want[4] = {1.5f, -2.0f, 0.0f, 65504.0f};
    const uint16_t f16[4] = {0x3e00, 0xc000, 0x0000, 0x7bff};
    const uint16_t bf16[4] = {0x3fc0, 0xc000, 0x0000, 0x477f};
    const double f64[4] = {1.5, -2.0, 0.0, 65504.0};
    const void *data[3] = {f16, bf16, f64};
    const char *names[3] = {"F16", "BF16", "F64"};
    const size_t bytes[3] = {sizeof f16, sizeof bf16, sizeof f64};
    stk_err err = {0};
    for (int k = 0; k < 3; k++) {
        write_raw(path, names[k], 4, data[k], bytes[k]);
        float got[4] = {9, 9, 9, 9};
        stk_tensor t = {.name = "t", .ndim = 1, .shape = {4}, .count = 4,
                        .data = got};
        assert_int_equal(stk_safetensors_read(path, &t, 1, NULL, &err), 0);
        float w[4];
        memcpy(w, want, sizeof w);
        if (k == 1)
            w[3] = 65280.0f; /* 0x477f: bfloat16's nearest */
        assert_memory_equal(got, w, sizeof w);
    }
    /* F16's infinity and a double beyond float's range: refused, the
     * latter by its value */
    const uint16_t inf16[4] = {0x3c00, 0x7c00, 0, 0};
    write_raw(path, "F16", 4, inf16, sizeof inf16);
    float got4[4];
    stk_tensor t4 = {.name = "t", .ndim = 1, .shape = {4}, .count = 4,
                     .data = got4};
    assert_int_equal(stk_safetensors_read(path, &t4, 1, NULL, &err), STK_ERANGE);
    assert_non_null(strstr(err.msg, "\"t\" holds an infinity at element 1"));
    const double big[4] = {1, 2, 1e300, 4};
    write_raw(path, "F64", 4, big, sizeof big);
    assert_int_equal(stk_safetensors_read(path, &t4, 1, NULL, &err), STK_ERANGE);
    assert_non_null(strstr(err.msg, "\"t\" holds 1e+300 at element 2, beyond a float's range"));
    const int32_t i32[2] = {7, -3};
    write_raw(path, "I32", 2, i32, sizeof i32);
    int64_t got[2] = {0, 0};
    stk_tensor c = {.name = "t", .dtype = STK_DT_I64, .ndim = 1, .shape = {2},
                    .count = 2, .data = got};
    assert_int_equal(stk_safetensors_read(path, &c, 1, NULL, &err), 0);
    assert_true(got[0] == 7 && got[1] == -3);
}

/* What was given instead of safetensors is said: an empty file, torch.save's
 * zip and pickle, a file cut in its header or in its data. */
static void not_safetensors_says_what(void **state)
{
    (void)state;
    const char *dir = scratch("notst");
    char path[1200];
    snprintf(path, sizeof path, "%s", file_in(dir, "x"));
    const char *heads[4] = {"", "PK\x03\x04rest-of-a-zip", "\x80\x02}q\x00.",
                            "\xff\x00\x00\x00\x00\x00\x00\x00{\"t\":"};
    const size_t lens[4] = {0, 17, 6, 13};
    const char *why[4] = {"an empty file", "a zip archive, as torch.save writes",
                          "a pickle (torch.save's legacy format)",
                          "cut short: its header alone"};
    stk_tensor t = {.name = "t", .ndim = 1, .shape = {4}, .count = 4};
    for (int k = 0; k < 4; k++) {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        fwrite(heads[k], 1, lens[k], f);
        fclose(f);
        refused_as(path, t, why[k]);
    }
    /* a header that is JSON but not an object of tensors, or holds none */
    const char *hdrs[3] = {"[1]", "{}", "{\"__metadata__\":{}}"};
    const char *hwhy[3] = {"not a safetensors file (its header is JSON but not an object of tensors)",
                           "no tensor \"t\" (the file holds no tensor)",
                           "no tensor \"t\" (the file holds no tensor)"};
    for (int k = 0; k < 3; k++) {
        FILE *f = fopen(path, "wb");
        assert_non_null(f);
        uint8_t hl[8] = {(uint8_t)strlen(hdrs[k])};
        fwrite(hl, 1, 8, f);
        fwrite(hdrs[k], 1, strlen(hdrs[k]), f);
        fclose(f);
        refused_as(path, t, hwhy[k]);
    }
    /* a file whose header length ends in byte 0x80 (128), cut: not a
     * pickle */
    char h128[129];
    memset(h128, ' ', 128);
    h128[128] = '\0';
    const char *head = "{\"t\":{\"dtype\":\"F32\",\"shape\":[4],"
                       "\"data_offsets\":[0,16]}}";
    memcpy(h128, head, strlen(head));
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    uint8_t hl[8] = {0x80};
    fwrite(hl, 1, 8, f);
    fwrite(h128, 1, 52, f);
    fclose(f);
    refused_as(path, t, "cut short: its header alone");
    const float four[4] = {1, 2, 3, 4}; /* then its data cut to 2 floats */
    write_raw(path, "F32", 4, four, sizeof four);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(truncate(path, st.st_size - 8), 0);
    refused_as(path, t, "\"t\" lies past the file's end (8 bytes of data): "
                        "the file is cut short");
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(other_dtypes_are_cast),
    cmocka_unit_test(not_safetensors_says_what),
    cmocka_unit_test(i64_scalar_round_trips),
    cmocka_unit_test(wrong_dtype_or_shape_is_named),
    cmocka_unit_test(optional_tensors_may_be_missing),
    cmocka_unit_test(longest_names_fit),
};

UNIT_MAIN(tests)
