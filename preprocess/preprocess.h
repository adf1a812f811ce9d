/* preprocess.h - raw datasets in, stoke databases out.
 *
 * Three layers, each usable alone:
 *   images   decode PNG/JPEG to 8-bit pixels, convert channels, resize the
 *            shorter side and centre-crop, encode PNG (for dbinfo --grid);
 *   sources  a raw dataset (IDX, CIFAR binary, image folder) seen as named
 *            splits of samples that any thread can load by index;
 *   prep     a pool of worker threads that load samples in parallel and one
 *            ordered writer that appends them to a new database. */
#ifndef STK_PREPROCESS_H
#define STK_PREPROCESS_H

#include "common/common.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- images ------------------------------------------------------------ */

/* 8-bit pixels, interleaved HWC, c = 1 (gray) or 3 (RGB). */
typedef struct stk_image {
    int w, h, c;
    uint8_t *px; /* owned unless borrowed by the caller */
} stk_image;

/* Per-thread decoder state (a TurboJPEG handle); not thread-safe. */
typedef struct stk_decoder stk_decoder;
int stk_decoder_create(stk_decoder **out, stk_err *err);
void stk_decoder_destroy(stk_decoder *d); /* NULL is a no-op */

/* Decodes a PNG (any colour type and depth; alpha dropped, 16 bit reduced to
 * 8) or a JPEG (baseline, progressive, gray, CMYK) held in memory. Gray
 * sources give c = 1, all others c = 3. On failure why holds the reason
 * (without the file name, which the caller knows). out->px is malloc'd. */
int stk_image_decode(stk_decoder *d, const uint8_t *data, size_t len,
                     stk_image *out, char *why, size_t why_len);

void stk_image_free(stk_image *im);

/* Writes src as out_c channels (1: ITU-R 601 luma, as PIL's "L"; 3: gray
 * replicated), with the shorter side resized to size (antialiased bilinear,
 * as PIL's BILINEAR) and centre-cropped to size x size (torchvision's
 * Resize + CenterCrop), into chw (out_c * size * size bytes, CHW order).
 * size 0 keeps the source size. Returns 0 or STK_ENOMEM. */
int stk_image_fit(const stk_image *src, int out_c, int size, uint8_t *chw);

/* ---- transforms (transform.c): pure, the caller draws the randomness -- */

/* Read-only 8-bit pixels: channel k of pixel (y, x) at
 * px[y * ys + x * xs + k * cs], so CHW records and HWC images alike. */
typedef struct stk_pixview {
    const uint8_t *px;
    int w, h, c;
    ptrdiff_t xs, ys, cs;
} stk_pixview;

stk_pixview stk_pixview_hwc(const uint8_t *px, int w, int h, int c);
stk_pixview stk_pixview_chw(const uint8_t *px, int c, int h, int w);

typedef struct stk_box {
    int top, left, h, w;
} stk_box;

/* Uniforms stk_rrc_box may consume: 10 attempts of 2, then 2 offsets. */
#define STK_RRC_UNIFORMS 22

/* The box of torchvision 0.14's RandomResizedCrop.get_params for an h x w
 * image, given the uniforms in [0, 1) its draws consume in order (area,
 * log aspect ratio per attempt, then top and left: uniform_(a, b) =
 * a + u * (b - a), randint(0, n) = floor(u * n)); after 10 failed attempts
 * its centre-crop fallback. In double. Returns the uniforms used. */
int stk_rrc_box(int h, int w, const double scale[2], const double ratio[2],
                const double *u, stk_box *box);

/* Buffers a transform reuses between calls (one per thread); zero it to
 * start, free with stk_xform_scratch_free. */
typedef struct stk_xform_scratch {
    void *buf[5];
    size_t cap[5];
} stk_xform_scratch;
void stk_xform_scratch_free(stk_xform_scratch *s);

/* PIL's img.crop(box).resize((size, size), BILINEAR) of v, mirrored
 * left-right when flip, as out_c x size x size CHW (out_c from v->c as
 * stk_image_fit converts). Returns 0 or STK_ENOMEM. */
int stk_resized_crop(const stk_pixview *v, stk_box box, int size, bool flip,
                     int out_c, stk_xform_scratch *s, uint8_t *chw);

/* torchvision's Resize(resize) + CenterCrop(size) (resize >= size; 0 keeps
 * the source size) as out_c x size x size CHW, only the window computed;
 * size 0 keeps the whole resized image. Returns 0 or STK_ENOMEM. */
int stk_centre_crop(const stk_pixview *v, int resize, int size, int out_c,
                    stk_xform_scratch *s, uint8_t *chw);

/* A JPEG's full size from its header: 1, or 0 (w = h = 0) when data is
 * not a readable JPEG. */
int stk_image_jpeg_size(stk_decoder *d, const uint8_t *data, size_t len,
                        int *w, int *h);

/* stk_image_decode for a crop of box (full-size pixels) to size x size:
 * where size is at most half the box's sides, a JPEG decodes at
 * TurboJPEG's smallest DCT scaling factor of at most 1/2 whose scaled box
 * still has size pixels on each side, and box becomes its cover in the
 * decoded image (start floored, end ceiled). At 1/2, 1/4 and 1/8 the pixels are PIL's
 * Image.draft's (the same libjpeg-turbo scaled IDCT). PNGs decode whole,
 * box unchanged. */
int stk_image_decode_box(stk_decoder *d, const uint8_t *data, size_t len,
                         int size, stk_box *box, stk_image *out, char *why,
                         size_t why_len);
/* The size an image of w x h is stored at by prep --short-side/--max-side,
 * computed as torchvision's Resize(short_side, max_size=max_side): the
 * shorter side to short_side (0: unchanged), the longer one scaled and
 * truncated; when that exceeds max_side (0: no cap) the longer side becomes
 * max_side and the shorter int(max_side * short / long). A result that is
 * not smaller than the image keeps the image's size unless upscale. */
void stk_image_keep_aspect(int w, int h, int short_side, int max_side,
                           bool upscale, int *ow, int *oh);

/* Writes src as out_c channels resized to ow x oh (antialiased bilinear,
 * as stk_image_fit, no crop) into chw (out_c * ow * oh bytes, CHW). */
int stk_image_resize(const stk_image *src, int out_c, int ow, int oh,
                     uint8_t *chw);

/* Per-thread JPEG compressor (a TurboJPEG handle); not thread-safe. */
typedef struct stk_encoder stk_encoder;
int stk_encoder_create(stk_encoder **out, stk_err *err);
void stk_encoder_destroy(stk_encoder *e); /* NULL is a no-op */

/* Compresses c x h x w CHW pixels (c = 1: gray, 3: RGB with 4:2:0 chroma
 * subsampling) as a baseline JPEG of quality 1..100. *jpeg points into
 * the encoder and stays valid until its next call. */
int stk_jpeg_encode(stk_encoder *e, const uint8_t *chw, int c, int h, int w,
                    int quality, const uint8_t **jpeg, size_t *len,
                    stk_err *err);

struct stk_meta;
struct stk_record;

/* Writes the pixels of a record of the database m as C x H x W CHW bytes
 * (rec->height x rec->width) to chw: a copy of a raw record, a decoded
 * JPEG one (which must have the header's size and the meta's channels). */
int stk_record_pixels(stk_decoder *d, const struct stk_meta *m,
                      const struct stk_record *rec, uint8_t *chw,
                      stk_err *err);

/* Writes an 8-bit gray or RGB image (HWC) as a PNG file. */
int stk_png_write(const char *path, const uint8_t *px, int w, int h, int c,
                  stk_err *err);

/* ---- sources ----------------------------------------------------------- */

typedef enum stk_src_format {
    STK_SRC_AUTO = 0,
    STK_SRC_IDX,
    STK_SRC_CIFAR,
    STK_SRC_FOLDER
} stk_src_format;

typedef struct stk_source_opts {
    stk_src_format format; /* AUTO: chosen from the directory's content */
    int size;              /* output side; 0 = native (IDX, CIFAR) or 64 */
    int channels;          /* 1, 3 or 0 = the source's own (folders: 3) */
    double holdout;        /* 0, or a fraction in (0, 1): an image folder
                              without split folders gets a "test" split
                              with that share of each class (see
                              stk_holdout_rank) */
    uint64_t holdout_seed;
    /* Aspect-keeping storage (folders only; excludes size): every image at
     * stk_image_keep_aspect's size, a variable-size database. */
    int short_side, max_side; /* 0 = unused; short_side alone caps the
                                 longer side at 2 * short_side */
    bool upscale;
} stk_source_opts;

typedef struct stk_source stk_source;

/* Checks the options alone, before any file is read: each value in its
 * range, and the flags that exclude or need each other (size with
 * short_side/max_side, max_side below short_side, upscale without
 * short_side). Returns 0 or STK_EINVAL, the message naming the prep flags.
 * stk_source_open checks the same; a tool calls this to tell bad usage
 * from a failed run. */
int stk_source_opts_check(const stk_source_opts *opts, stk_err *err);

/* Opens a raw dataset directory and indexes it (reads IDX/CIFAR files into
 * memory, lists image folders). Errors name the file and the problem. */
int stk_source_open(const char *raw_dir, const stk_source_opts *opts,
                    stk_source **out, stk_err *err);
void stk_source_close(stk_source *s); /* NULL is a no-op */

const char *stk_source_format_name(const stk_source *s);

/* The --holdout rule: a file's rank within its class, from the bytes of
 * its path relative to RAW_DIR and the seed (FNV-1a 64 of the path, xor
 * the seed, through SplitMix64's finaliser; docs/formats.md). Each class
 * holds out its floor(fraction * n + 0.5) files of lowest rank (at least
 * one and never all of a class of two or more), so the choice depends on
 * nothing but names and the seed: not on workers, machine or listing
 * order. */
uint64_t stk_holdout_rank(const char *relpath, uint64_t seed);

/* Files a class of n holds out at fraction f. */
uint64_t stk_holdout_count(uint64_t n, double f);
int stk_source_nsplits(const stk_source *s);
const char *stk_source_split_name(const stk_source *s, int split);
uint64_t stk_source_split_count(const stk_source *s, int split);
int stk_source_nclasses(const stk_source *s);
/* "" or lines on what the reader passed over that a user would miss
 * (folders: files it does not read, classes with no image in train). */
const char *stk_source_notice(const stk_source *s);
/* Appends to buf (as a line of its own after any text there) a warning
 * naming the classes c with which[c] set: up to three, quoted, " and
 * others" past them, then ": N class(es) " and what. Nothing when none is
 * set; the text is cut at cap. */
void stk_source_name_classes(const stk_source *s, const unsigned char *which,
                             const char *what, char *buf, size_t cap);
const char *stk_source_class_name(const stk_source *s, int cls);
/* Drops from a folder source's split the files whose paths relative to
 * its directory are in rel[0, n) (sorted by strcmp), as prep --skip-bad
 * left them out of a database; returns how many (0 for IDX and CIFAR). */
uint64_t stk_source_drop_files(stk_source *s, int split,
                               const char *const *rel, size_t n);

/* The label of sample i of split as the source lists it, before any file
 * is read (a folder's class); -1 where only reading tells (IDX, CIFAR). */
int32_t stk_source_label(const stk_source *s, int split, uint64_t i);
/* Output shape of every sample (CHW); h and w are 0 when variable. */
void stk_source_shape(const stk_source *s, int *c, int *h, int *w);

/* Aspect-keeping sizing: true, with the short and max side in effect,
 * when each sample has its own size. */
bool stk_source_variable(const stk_source *s, int *short_side, int *max_side);

/* Loads sample i of split at its output size, fixed or variable: label,
 * *h x *w and c*h*w CHW pixels in *px (malloc'd, grown as needed; *cap
 * its size). Errors as stk_source_load. */
int stk_source_load_any(const stk_source *s, stk_decoder *d, int split,
                        uint64_t i, int32_t *label, uint8_t **px, size_t *cap,
                        int *h, int *w, stk_err *err);

/* Loads sample i of split: label and c*h*w CHW pixels. Safe to call from
 * many threads at once, each with its own decoder. A bad sample returns
 * STK_EFORMAT (or STK_EIO) with the message "FILE: REASON", FILE being
 * stk_source_sample_file(s, split, i). */
int stk_source_load(const stk_source *s, stk_decoder *d, int split,
                    uint64_t i, int32_t *label, uint8_t *pixels,
                    stk_err *err);

/* Sample i of split as decoded, before stk_source_load's resize and
 * channel conversion (for transforms of the original image): HWC pixels
 * in im, owned (free with stk_image_free) when *owned, else borrowed from
 * s. Errors as stk_source_load's. */
int stk_source_load_image(const stk_source *s, stk_decoder *d, int split,
                          uint64_t i, int32_t *label, stk_image *im,
                          bool *owned, stk_err *err);

/* The file sample i of split is read from: the image of a folder source,
 * the dataset directory for IDX and CIFAR. Borrowed; lives as long as s. */
const char *stk_source_sample_file(const stk_source *s, int split,
                                   uint64_t i);

/* The REASON of a load error message "FILE: REASON" of sample i (found by
 * its known FILE, so a file name holding ": " is no trouble); the whole
 * message when it does not start with FILE. Points into msg. */
const char *stk_source_error_reason(const stk_source *s, int split,
                                    uint64_t i, const char *msg);

/* ---- prep -------------------------------------------------------------- */

typedef struct stk_prep_progress {
    const char *split;
    uint64_t done, total;         /* samples over all splits */
    uint64_t skipped;
    double seconds;               /* since the start */
} stk_prep_progress;

typedef struct stk_prep_opts {
    int workers;                  /* decoding threads, >= 1 */
    bool skip_bad;                /* record bad samples instead of failing */
    bool force;                   /* replace an existing complete database */
    const char *force_hint;       /* see stk_store_opts; NULL = "--force" */
    size_t map_size;              /* initial LMDB map; 0 = from the data */
    size_t map_size_max;          /* 0 = 1 TiB */
    int encoding;                 /* STK_ENC_RAW (0) or STK_ENC_JPEG */
    int quality;                  /* JPEG quality 1..100; 0 = 90 */
    stk_source_opts source;
    const char *created;          /* ISO 8601 creation time for the meta */
    const atomic_int *cancel;     /* non-zero asks the run to stop (atomic:
                                   * another thread sets it: prep's signal
                                   * watcher, Python's caller) */
    void (*progress)(const stk_prep_progress *p, void *arg);
    void *progress_arg;           /* called from the writer thread */
} stk_prep_opts;

typedef struct stk_prep_summary {
    int nsplits;
    char split[8][32];
    uint64_t count[8], skipped[8];
    uint64_t samples, bytes;      /* written */
    double seconds;
    int channels, height, width;  /* height, width 0: variable size */
    int encoding;
    /* "" or lines to show: what the source passed over (files it does not
     * read, empty classes: stk_source_notice), and --holdout's promise
     * (each class of two files or more in both splits) broken by
     * --skip-bad's skipped files, found only after the division */
    char warning[900];
} stk_prep_summary;

/* stk_source_opts_check for prep's options: also workers 1..256, the
 * encoding, quality 0..100 and quality only with STK_ENC_JPEG. Returns 0 or
 * STK_EINVAL; stk_prep_run checks the same before anything else. */
int stk_prep_opts_check(const stk_prep_opts *opts, stk_err *err);

/* Converts raw_dir into a complete database at db_dir, or leaves db_dir as
 * it was. Returns 0, STK_ECANCELED when *cancel became non-zero, or the
 * first error (a bad sample unless skip_bad, the disk, the map). */
int stk_prep_run(const char *raw_dir, const char *db_dir,
                 const stk_prep_opts *opts, stk_prep_summary *summary,
                 stk_err *err);

#ifdef __cplusplus
}
#endif

#endif
