/* source_impl.h - private: what every raw-format reader provides. */
#ifndef STK_SOURCE_IMPL_H
#define STK_SOURCE_IMPL_H

#include "preprocess.h"

#define SRC_MAX_SPLITS 8

typedef struct source_ops {
    /* Loads sample i of split into an image (borrowed or owned, see
     * owned) and its label. */
    int (*load)(const stk_source *s, stk_decoder *d, int split, uint64_t i,
                int32_t *label, stk_image *im, int *owned, stk_err *err);
    void (*free)(stk_source *s);
    /* The file sample i of split comes from; NULL: the source's dir. Every
     * load error of that sample starts with it and ": ". */
    const char *(*file)(const stk_source *s, int split, uint64_t i);
    /* The label of sample i of split without loading it; NULL: not known
     * before the sample is read (IDX, CIFAR). */
    int32_t (*label)(const stk_source *s, int split, uint64_t i);
} source_ops;

struct stk_source {
    const source_ops *ops;
    const char *format;       /* "idx", "cifar", "folder" */
    char *dir;
    int out_c, size;          /* requested output (size 0 = native) */
    double holdout;           /* stk_source_opts' */
    uint64_t holdout_seed;
    int short_side, max_side; /* aspect-keeping sizing; max_side 0: none */
    bool upscale;
    int native_w, native_h;   /* 0 when samples differ (folders) */
    int nclasses;
    char **classes;
    int nsplits;
    char split_name[SRC_MAX_SPLITS][32];
    uint64_t split_count[SRC_MAX_SPLITS];
    char notice[512];         /* "" or what the reader passed over and a
                                 user would miss (files it does not read,
                                 classes without an image) */
    void *impl;
};

/* Format readers: fill s (dir, out_c, size set by the caller). */
int stk_idx_open(stk_source *s, stk_err *err);
int stk_cifar_open(stk_source *s, stk_err *err);
int stk_folder_open(stk_source *s, stk_err *err);

/* Probes used by automatic format detection. */
int stk_idx_probe(const char *dir);
int stk_cifar_probe(const char *dir);

/* Adds a class name (copied); returns 0 or STK_ENOMEM. */
int stk_source_add_class(stk_source *s, const char *name);

#endif
