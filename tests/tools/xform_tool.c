/* xform_tool - the C transforms (preprocess/transform.c) for the Python
 * tests that hold them against torchvision and PIL (tests/e2e/xform.py).
 *
 *   xform_tool box < lines "H W S0 S1 R0 R1 U1..U22"   prints "N TOP LEFT H W"
 *   xform_tool crop FILE hwc|chw TOP LEFT H W SIZE FLIP OUT_C   CHW bytes
 *   xform_tool centre FILE hwc|chw RESIZE SIZE OUT_C             CHW bytes
 *   xform_tool decode FILE                      "W H C\n" then HWC bytes
 *   xform_tool decodebox FILE SIZE TOP LEFT H W
 *       "W H C TOP LEFT H W\n" (the decoded size, the mapped box), HWC */
#include "preprocess/preprocess.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int die(const char *msg, const char *what)
{
    fprintf(stderr, "xform_tool: %s: %s\n", what, msg);
    return 1;
}

static int boxes(void)
{
    int h, w;
    double sc[2], ra[2], u[STK_RRC_UNIFORMS];
    while (scanf("%d %d %lf %lf %lf %lf", &h, &w, &sc[0], &sc[1], &ra[0],
                 &ra[1]) == 6) {
        for (int i = 0; i < STK_RRC_UNIFORMS; i++)
            if (scanf("%lf", &u[i]) != 1)
                return die("expected 22 uniforms", "stdin");
        stk_box b;
        int n = stk_rrc_box(h, w, sc, ra, u, &b);
        printf("%d %d %d %d %d\n", n, b.top, b.left, b.h, b.w);
    }
    return 0;
}

/* Decodes path into im (through stk_image_decode_box when box). */
static int load(const char *path, int size, stk_box *box, stk_image *im)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return die("cannot open", path);
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc((size_t)len);
    size_t got = data ? fread(data, 1, (size_t)len, f) : 0;
    fclose(f);
    stk_decoder *d = NULL;
    stk_err err = {0};
    char why[256] = "";
    int rc = got != (size_t)len || stk_decoder_create(&d, &err) ||
             (box ? stk_image_decode_box(d, data, (size_t)len, size, box, im,
                                         why, sizeof why)
                  : stk_image_decode(d, data, (size_t)len, im, why,
                                     sizeof why));
    stk_decoder_destroy(d);
    free(data);
    return rc ? die(why[0] ? why : "cannot read", path) : 0;
}

/* im's pixels as a view: HWC as decoded, or copied to CHW (in *chw). */
static stk_pixview view(const stk_image *im, const char *layout,
                        uint8_t **chw)
{
    *chw = NULL;
    if (strcmp(layout, "chw"))
        return stk_pixview_hwc(im->px, im->w, im->h, im->c);
    size_t plane = (size_t)im->w * im->h;
    *chw = malloc(plane * im->c);
    for (size_t i = 0; i < plane; i++)
        for (int k = 0; k < im->c; k++)
            (*chw)[k * plane + i] = im->px[i * im->c + k];
    return stk_pixview_chw(*chw, im->c, im->h, im->w);
}

int main(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "box"))
        return boxes();
    if (argc < 3)
        return die("usage: box | crop | centre | decode ...", "arguments");
    stk_image im = {0};
    if (!strcmp(argv[1], "decodebox")) {
        if (argc != 8)
            return die("wrong number of arguments", argv[1]);
        stk_box b = {atoi(argv[4]), atoi(argv[5]), atoi(argv[6]),
                     atoi(argv[7])};
        if (load(argv[2], atoi(argv[3]), &b, &im))
            return 1;
        printf("%d %d %d %d %d %d %d\n", im.w, im.h, im.c, b.top, b.left, b.h,
               b.w);
        fwrite(im.px, 1, (size_t)im.w * im.h * im.c, stdout);
        stk_image_free(&im);
        return 0;
    }
    if (load(argv[2], 0, NULL, &im))
        return 1;
    if (!strcmp(argv[1], "decode")) {
        printf("%d %d %d\n", im.w, im.h, im.c);
        fwrite(im.px, 1, (size_t)im.w * im.h * im.c, stdout);
        stk_image_free(&im);
        return 0;
    }
    int crop = !strcmp(argv[1], "crop");
    if (argc != (crop ? 11 : 7))
        return die("wrong number of arguments", argv[1]);
    int a[7];
    for (int i = 4; i < argc; i++)
        a[i - 4] = atoi(argv[i]);
    uint8_t *chw_in, *out;
    stk_pixview v = view(&im, argv[3], &chw_in);
    int size = crop ? a[4] : a[1], out_c = crop ? a[6] : a[2];
    stk_xform_scratch s = {0};
    out = malloc((size_t)size * size * out_c);
    int rc = crop ? stk_resized_crop(&v, (stk_box){a[0], a[1], a[2], a[3]},
                                     size, a[5] != 0, out_c, &s, out)
                  : stk_centre_crop(&v, a[0], size, out_c, &s, out);
    if (!rc)
        fwrite(out, 1, (size_t)size * size * out_c, stdout);
    stk_xform_scratch_free(&s);
    free(out);
    free(chw_in);
    stk_image_free(&im);
    return rc ? die("transform failed", argv[1]) : 0;
}
