/* checkpoint.h - private to the trainer: safetensors files. */
#ifndef STK_CHECKPOINT_H
#define STK_CHECKPOINT_H

#include "trainer.h"

/* A tensor name: a parameter's (STK_NAME_MAX + 32) with the longest
 * optimizer suffix (".momentum_buffer") never truncates; reading also
 * tries "module." + name. */
#define STK_TENSOR_NAME_MAX (STK_NAME_MAX + 64)

/* The element types stoke reads and writes: parameters, optimizer state
 * and batchnorm's running statistics are F32, num_batches_tracked I64 (a
 * 0-dim tensor, as PyTorch saves it). */
typedef enum stk_dtype { STK_DT_F32 = 0, STK_DT_I64 } stk_dtype;

/* A named tensor in host memory: count elements of dtype at data. ndim 0
 * is a scalar (shape [], count 1). */
typedef struct stk_tensor {
    char name[STK_TENSOR_NAME_MAX];
    stk_dtype dtype;
    int ndim, shape[4];
    size_t count;
    void *data;
    bool optional; /* reading: a tensor the file lacks is no error ... */
    bool found;    /* ... and this says whether it was there */
} stk_tensor;

/* Writes tensors (in order) with optional string metadata (a JSON object of
 * strings) atomically: PATH.tmp, fsync, rename. */
int stk_safetensors_write(const char *path, const stk_tensor *t, int n,
                          const char *meta_json, stk_err *err);

/* Fills each tensor's data by name (accepting a "module." prefix); the
 * dtype and shape must match (an error names the tensor, what the model
 * needs and what the file holds), and F32 values must be finite. A
 * missing tensor is an error unless it is optional. *meta_json (may be
 * NULL) gets the metadata, malloc'd. */
int stk_safetensors_read(const char *path, stk_tensor *t, int n,
                         char **meta_json, stk_err *err);

/* stk_safetensors_read, and every tensor of the file must be one of t
 * (STK_EINVAL naming the first that is not): a model's weights, read as
 * strictly as PyTorch's load_state_dict. */
int stk_safetensors_read_all(const char *path, stk_tensor *t, int n,
                             stk_err *err);

#endif
