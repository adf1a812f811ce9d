/* checkpoint.h - private to the trainer: safetensors files. */
#ifndef STK_CHECKPOINT_H
#define STK_CHECKPOINT_H

#include "trainer.h"

#define STK_TENSOR_NAME_MAX 96

/* A named float32 tensor in host memory. */
typedef struct stk_tensor {
    char name[STK_TENSOR_NAME_MAX];
    int ndim, shape[4];
    size_t count;
    float *data;
} stk_tensor;

/* Writes tensors (in order) with optional string metadata (a JSON object of
 * strings) atomically: PATH.tmp, fsync, rename. */
int stk_safetensors_write(const char *path, const stk_tensor *t, int n,
                          const char *meta_json, stk_err *err);

/* Fills each tensor's data by name (accepting a "module." prefix); the
 * shape must match. *meta_json (may be NULL) gets the metadata, malloc'd. */
int stk_safetensors_read(const char *path, stk_tensor *t, int n,
                         char **meta_json, stk_err *err);

#endif
