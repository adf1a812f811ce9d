/* test_image - PNG/JPEG decoding, PNG writing, channel conversion and the
 * resize/crop geometry and arithmetic (hand-computed PIL values). */
#include "unit.h"

#include "preprocess/preprocess.h"

#include <turbojpeg.h>

static stk_decoder *dec;

static int setup(void **state)
{
    (void)state;
    stk_err err;
    return stk_decoder_create(&dec, &err);
}

static int teardown(void **state)
{
    (void)state;
    stk_decoder_destroy(dec);
    return 0;
}

static uint8_t *slurp(const char *path, size_t *len)
{
    uint8_t *d;
    stk_err err;
    assert_int_equal(stk_read_file(path, &d, len, &err), 0);
    return d;
}

static void png_round_trip(void **state)
{
    (void)state;
    for (int c = 1; c <= 3; c += 2) {
        int w = 13, h = 7;
        uint8_t px[13 * 7 * 3];
        for (int i = 0; i < w * h * c; i++)
            px[i] = (uint8_t)(i * 37 + c);
        char path[1100];
        snprintf(path, sizeof path, "%s/rt%d.png", scratch("png"), c);
        stk_err err;
        assert_int_equal(stk_png_write(path, px, w, h, c, &err), 0);
        size_t len;
        uint8_t *data = slurp(path, &len);
        stk_image im;
        char why[128];
        assert_int_equal(stk_image_decode(dec, data, len, &im, why, sizeof why),
                         0);
        assert_int_equal(im.w, w);
        assert_int_equal(im.h, h);
        assert_int_equal(im.c, c);
        assert_memory_equal(im.px, px, (size_t)w * h * c);
        stk_image_free(&im);
        /* truncated: an error that says PNG, no crash */
        assert_int_equal(
            stk_image_decode(dec, data, len / 2, &im, why, sizeof why),
            STK_EFORMAT);
        assert_non_null(strstr(why, "bad PNG"));
        free(data);
    }
}

static void jpeg_decode(void **state)
{
    (void)state;
    int w = 32, h = 24;
    uint8_t rgb[32 * 24 * 3];
    for (int y = 0; y < h; y++) /* smooth, so JPEG is near lossless */
        for (int x = 0; x < w; x++)
            for (int k = 0; k < 3; k++)
                rgb[(y * w + x) * 3 + k] = (uint8_t)(40 + 4 * x + 3 * y + 20 * k);
    tjhandle tj = tjInitCompress();
    unsigned char *jpg = NULL;
    unsigned long len = 0;
    assert_int_equal(tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &jpg, &len,
                                 TJSAMP_444, 100, 0),
                     0);
    stk_image im;
    char why[128];
    assert_int_equal(stk_image_decode(dec, jpg, len, &im, why, sizeof why), 0);
    assert_int_equal(im.c, 3);
    assert_int_equal(im.w, w);
    int worst = 0;
    for (int i = 0; i < w * h * 3; i++) {
        int d = abs(im.px[i] - rgb[i]);
        worst = d > worst ? d : worst;
    }
    assert_true(worst <= 3);
    /* junk before the EOI marker is a libjpeg warning, not a broken image:
     * accepted (as PIL does), same pixels */
    unsigned char *junk = malloc(len + 3);
    memcpy(junk, jpg, len - 2);
    memcpy(junk + len - 2, "\x01\x02\x03\xff\xd9", 5);
    stk_image im2;
    assert_int_equal(stk_image_decode(dec, junk, len + 3, &im2, why, sizeof why),
                     0);
    assert_memory_equal(im2.px, im.px, (size_t)w * h * 3);
    stk_image_free(&im2);
    free(junk);
    stk_image_free(&im);
    /* gray JPEG stays one channel */
    tjFree(jpg);
    jpg = NULL;
    assert_int_equal(tjCompress2(tj, rgb, w * 3, 0, h / 3, TJPF_GRAY, &jpg,
                                 &len, TJSAMP_GRAY, 95, 0),
                     0);
    assert_int_equal(stk_image_decode(dec, jpg, len, &im, why, sizeof why), 0);
    assert_int_equal(im.c, 1);
    stk_image_free(&im);
    /* truncated JPEG fails, as PIL refuses it */
    assert_int_equal(stk_image_decode(dec, jpg, len - 40, &im, why, sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "bad JPEG"));
    tjFree(jpg);
    tjDestroy(tj);
}

static void garbage_is_named(void **state)
{
    (void)state;
    uint8_t junk[64] = "GIF89a";
    stk_image im;
    char why[128];
    assert_int_equal(stk_image_decode(dec, junk, sizeof junk, &im, why,
                                      sizeof why),
                     STK_EFORMAT);
    assert_non_null(strstr(why, "not a PNG or JPEG"));
    assert_int_equal(stk_image_decode(dec, junk, 0, &im, why, sizeof why),
                     STK_EFORMAT);
    assert_string_equal(why, "an empty file (0 bytes), not a PNG or JPEG");
}

static void fit_native_is_a_transpose(void **state)
{
    (void)state;
    uint8_t hwc[2 * 3 * 3], chw[2 * 3 * 3];
    for (int i = 0; i < 18; i++)
        hwc[i] = (uint8_t)i;
    stk_image im = {3, 2, 3, hwc};
    assert_int_equal(stk_image_fit(&im, 3, 0, chw), 0);
    for (int k = 0; k < 3; k++)
        for (int p = 0; p < 6; p++)
            assert_int_equal(chw[k * 6 + p], hwc[p * 3 + k]);
}

static void fit_constant_stays_constant(void **state)
{
    (void)state;
    int sizes[][2] = {{64, 64}, {50, 37}, {7, 300}, {300, 7}, {5, 5}};
    uint8_t out[3 * 40 * 40];
    for (size_t t = 0; t < sizeof sizes / sizeof *sizes; t++) {
        int w = sizes[t][0], h = sizes[t][1];
        uint8_t *px = malloc((size_t)w * h * 3);
        memset(px, 173, (size_t)w * h * 3);
        stk_image im = {w, h, 3, px};
        for (int s = 1; s <= 40; s += 13) {
            assert_int_equal(stk_image_fit(&im, 3, s, out), 0);
            for (int i = 0; i < 3 * s * s; i++)
                assert_int_equal(out[i], 173);
        }
        free(px);
    }
}

static void fit_crop_geometry(void **state)
{
    (void)state;
    /* 11x6 gray, size 6: no resize, centre crop starts at round(5/2) = 2
     * (Python rounds halves to even) */
    uint8_t px[11 * 6], out[36];
    for (int i = 0; i < 66; i++)
        px[i] = (uint8_t)i;
    stk_image im = {11, 6, 1, px};
    assert_int_equal(stk_image_fit(&im, 1, 6, out), 0);
    for (int y = 0; y < 6; y++)
        for (int x = 0; x < 6; x++)
            assert_int_equal(out[y * 6 + x], px[y * 11 + x + 2]);
    /* 9x6: round(3/2) = 2 */
    stk_image im9 = {9, 6, 1, px};
    assert_int_equal(stk_image_fit(&im9, 1, 6, out), 0);
    assert_int_equal(out[0], px[2]);
    /* 6x11 tall: crop rows from round(5/2) = 2 */
    stk_image tall = {6, 11, 1, px};
    assert_int_equal(stk_image_fit(&tall, 1, 6, out), 0);
    assert_int_equal(out[0], px[2 * 6]);
}

static void fit_downscale_matches_pil(void **state)
{
    (void)state;
    /* rows [0 70 140 210], 4x4 -> 2x2. PIL bilinear at scale 2: taps 3/7,
     * 3/7, 1/7 -> 50 and 160 (hand-computed, and what PIL prints). */
    uint8_t px[16], out[4];
    for (int i = 0; i < 16; i++)
        px[i] = (uint8_t)(70 * (i % 4));
    stk_image im = {4, 4, 1, px};
    assert_int_equal(stk_image_fit(&im, 1, 2, out), 0);
    assert_int_equal(out[0], 50);
    assert_int_equal(out[1], 160);
    assert_int_equal(out[2], 50);
    assert_int_equal(out[3], 160);
}

/* stk_resized_crop reads a planar (CHW) view through other loops than an
 * interleaved (HWC) one: the same pixels give the same bytes, and a flip
 * gives the mirror, for odd sizes, edge boxes, reductions and enlargements. */
static void resized_crop_views_and_mirror_agree(void **state)
{
    (void)state;
    enum { H = 37, W = 53, C = 3, MAX = 40 };
    static uint8_t hwc[H * W * C], chw[C * H * W];
    uint32_t r = 12345;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++)
            for (int k = 0; k < C; k++) {
                r = r * 1664525u + 1013904223u;
                uint8_t v = (uint8_t)(x * 4 + y * 3 + (r >> 28) * 9 + k);
                hwc[(y * W + x) * C + k] = chw[(k * H + y) * W + x] = v;
            }
    stk_pixview vh = stk_pixview_hwc(hwc, W, H, C);
    stk_pixview vc = stk_pixview_chw(chw, C, H, W);
    stk_box boxes[] = {{0, 0, H, W},
                       {3, 50, 30, 3},
                       {20, 1, 17, 40},
                       {0, 17, 1, 36},
                       {36, 52, 1, 1}};
    int sizes[] = {5, 17, 40};
    stk_xform_scratch s = {0};
    static uint8_t a[C * MAX * MAX], b[C * MAX * MAX], m[C * MAX * MAX];
    for (int i = 0; i < 5; i++)
        for (int j = 0; j < 3; j++)
            for (int c = 1; c <= C; c += 2) {
                int n = sizes[j], plane = n * n;
                assert_int_equal(
                    stk_resized_crop(&vh, boxes[i], n, false, c, &s, a), 0);
                assert_int_equal(
                    stk_resized_crop(&vc, boxes[i], n, false, c, &s, b), 0);
                assert_memory_equal(a, b, (size_t)c * plane);
                assert_int_equal(
                    stk_resized_crop(&vc, boxes[i], n, true, c, &s, m), 0);
                for (int p = 0; p < c * plane; p++)
                    assert_int_equal(m[p], a[p - p % n + n - 1 - p % n]);
            }
    stk_xform_scratch_free(&s);
}

static void channel_conversions(void **state)
{
    (void)state;
    uint8_t rgb[] = {255, 0, 0, 0, 255, 0, 0, 0, 255, 10, 20, 30};
    uint8_t gray[4];
    stk_image im = {4, 1, 3, rgb};
    assert_int_equal(stk_image_fit(&im, 1, 0, gray), 0);
    /* PIL "L": (R*19595 + G*38470 + B*7471 + 0x8000) >> 16 */
    assert_int_equal(gray[0], 76);
    assert_int_equal(gray[1], 150);
    assert_int_equal(gray[2], 29);
    assert_int_equal(gray[3], 18);
    uint8_t g[] = {9, 200}, out[6];
    stk_image gi = {2, 1, 1, g};
    assert_int_equal(stk_image_fit(&gi, 3, 0, out), 0);
    uint8_t want[] = {9, 200, 9, 200, 9, 200};
    assert_memory_equal(out, want, 6);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(png_round_trip),
    cmocka_unit_test(jpeg_decode),
    cmocka_unit_test(garbage_is_named),
    cmocka_unit_test(fit_native_is_a_transpose),
    cmocka_unit_test(fit_constant_stays_constant),
    cmocka_unit_test(fit_crop_geometry),
    cmocka_unit_test(fit_downscale_matches_pil),
    cmocka_unit_test(resized_crop_views_and_mirror_agree),
    cmocka_unit_test(channel_conversions),
};

UNIT_MAIN_WITH(tests, setup, teardown)
