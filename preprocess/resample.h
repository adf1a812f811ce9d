/* resample.h - resize.c's PIL-exact resampling, shared by transform.c
 * (internal to the preprocess library). */
#ifndef STK_RESAMPLE_H
#define STK_RESAMPLE_H

#include "preprocess.h"

/* stk_xform_scratch's buffers */
enum {
    STK_SCRATCH_CX,   /* horizontal filter taps */
    STK_SCRATCH_CY,   /* vertical filter taps */
    STK_SCRATCH_MID,  /* the window transposed, the horizontal pass */
    STK_SCRATCH_CONV, /* a channel conversion's pixels */
    STK_SCRATCH_ACC,  /* a pass's sums of one output row */
    STK_SCRATCH_N
};

void *stk_scratch_get(stk_xform_scratch *s, int i, size_t bytes);

/* Converts the channels of v (1 or 3) to out_c into HWC out (v->w * v->h *
 * out_c bytes). */
void stk_convert(const stk_pixview *v, int out_c, uint8_t *out);

/* Resizes in (1 or 3 channels) to ow x oh with PIL's antialiased BILINEAR
 * and writes the window [left, left+cw) x [top, top+ch) as CHW to chw,
 * mirrored left-right when flip. The horizontal pass runs only over the
 * rows the vertical pass reads. */
int stk_resample(const stk_pixview *in, int ow, int oh, int left, int top,
                 int cw, int ch, bool flip, stk_xform_scratch *s,
                 uint8_t *chw);

#endif
