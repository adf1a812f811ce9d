/* ops_inline.h - element-wise and indexing bodies shared by the CPU loops
 * (cpu.c) and the CUDA grid-stride kernels (cuda_ops.cu), so the CPU tests
 * check the arithmetic the GPU runs. Each body computes one element from
 * its index; nothing here allocates or branches on the backend. */
#ifndef STK_OPS_INLINE_H
#define STK_OPS_INLINE_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define STK_HD __host__ __device__ __forceinline__
#else
#define STK_HD static inline
#endif

/* ---- Philox 4x32-10 (Salmon et al., SC'11), counter-based ---------------- */

typedef struct stk_philox_key {
    uint32_t k0, k1;
} stk_philox_key;

STK_HD void stk_philox_round(uint32_t c[4], uint32_t k0, uint32_t k1)
{
    uint64_t p0 = (uint64_t)0xD2511F53u * c[0];
    uint64_t p1 = (uint64_t)0xCD9E8D57u * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
}

/* Ten rounds on counter c with key k; c becomes the output. */
STK_HD void stk_philox4x32_10(uint32_t c[4], stk_philox_key k)
{
    uint32_t k0 = k.k0, k1 = k.k1;
    for (int r = 0; r < 10; r++) {
        if (r) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        stk_philox_round(c, k0, k1);
    }
}

/* Uniform float in [0, 1) from 24 random bits. */
STK_HD float stk_u01(uint32_t x) { return (float)(x >> 8) * (1.0f / 16777216.0f); }

/* The four random words of block `block` in stream `stream`. */
STK_HD void stk_philox_block(stk_philox_key k, uint64_t stream,
                             uint64_t block, uint32_t out[4])
{
    out[0] = (uint32_t)block;
    out[1] = (uint32_t)(block >> 32);
    out[2] = (uint32_t)stream;
    out[3] = (uint32_t)(stream >> 32);
    stk_philox4x32_10(out, k);
}

/* Uniform number i of a stream: block i / 4, lane i % 4. */
STK_HD float stk_philox_uniform(stk_philox_key k, uint64_t stream,
                                uint64_t i)
{
    uint32_t c[4];
    stk_philox_block(k, stream, i >> 2, c);
    return stk_u01(c[i & 3]);
}

/* ---- element-wise ------------------------------------------------------ */

STK_HD float stk_relu1(float x) { return x > 0.0f ? x : 0.0f; }

/* ReLU backward from the output: the gradient passes where y > 0. */
STK_HD float stk_relu_grad1(float y, float dy) { return y > 0.0f ? dy : 0.0f; }

/* Dropout of element i: kept with probability 1 - p and scaled by
 * 1 / (1 - p). group > 1 drops whole groups (dropout2d: a group is one
 * channel of one sample, H*W elements). Forward and backward both call
 * this, so no mask is stored. */
STK_HD float stk_dropout_kept_scale(float p) { return 1.0f / (1.0f - p); }

/* scale is stk_dropout_kept_scale(p), which a loop computes once. */
STK_HD float stk_dropout_keep(float u, float p, float scale)
{
    return u >= p ? scale : 0.0f;
}

STK_HD float stk_dropout_scale1(stk_philox_key k, uint64_t stream, size_t i,
                                size_t group, float p)
{
    return stk_dropout_keep(stk_philox_uniform(k, stream, (uint64_t)(i / group)),
                            p, stk_dropout_kept_scale(p));
}

/* ---- im2col / col2im (NCHW batches) -------------------------------------- */

typedef struct stk_conv_shape {
    int c, h, w;      /* input channels and size */
    int kh, kw, sh, sw, ph, pw;
    int oh, ow;       /* output size */
} stk_conv_shape;

/* Element j of the columns of n samples: col[c*kh*kw, n*oh*ow], column
 * (sample * oh*ow + output pixel), so one GEMM convolves the batch. The
 * input pixel it reads, or 0 in the padding. */
/* The value at (sample, c, ky, kx, oy, ox) of the columns. */
STK_HD float stk_im2col_at(const float *x, const stk_conv_shape *s,
                           size_t sample, int c, int ky, int kx, int oy, int ox)
{
    int y = oy * s->sh - s->ph + ky, xx = ox * s->sw - s->pw + kx;
    if (y < 0 || y >= s->h || xx < 0 || xx >= s->w)
        return 0.0f;
    return x[((sample * s->c + c) * s->h + y) * s->w + xx];
}

STK_HD float stk_im2col1(const float *x, const stk_conv_shape *s, int n,
                         size_t j)
{
    size_t hw = (size_t)s->oh * s->ow, cols = hw * (size_t)n;
    size_t row = j / cols, col = j % cols;
    size_t sample = col / hw, p = col % hw;
    int kx = (int)(row % s->kw), ky = (int)(row / s->kw % s->kh);
    int c = (int)(row / ((size_t)s->kw * s->kh));
    return stk_im2col_at(x, s, sample, c, ky, kx, (int)(p / s->ow),
                         (int)(p % s->ow));
}

/* Input gradient at element i (sample, c, y, x) of n samples: the sum of
 * the column entries that read it (a gather, so no atomics are needed),
 * added in (ky, kx) order starting from 0, which is also the order of the
 * CPU's row-by-row scatter: the two give the same floats. */
STK_HD float stk_col2im1(const float *col, const stk_conv_shape *s, int n,
                         size_t i)
{
    int xx = (int)(i % s->w), y = (int)(i / s->w % s->h);
    int c = (int)(i / ((size_t)s->w * s->h) % s->c);
    size_t sample = i / ((size_t)s->w * s->h * s->c);
    size_t hw = (size_t)s->oh * s->ow, cols = hw * (size_t)n;
    float sum = 0.0f;
    for (int ky = 0; ky < s->kh; ky++) {
        int ty = y + s->ph - ky;
        if (ty < 0 || ty % s->sh)
            continue;
        int oy = ty / s->sh;
        if (oy >= s->oh)
            continue;
        for (int kx = 0; kx < s->kw; kx++) {
            int tx = xx + s->pw - kx;
            if (tx < 0 || tx % s->sw)
                continue;
            int ox = tx / s->sw;
            if (ox >= s->ow)
                continue;
            size_t row = ((size_t)c * s->kh + ky) * s->kw + kx;
            sum += col[row * cols + sample * hw + (size_t)oy * s->ow + ox];
        }
    }
    return sum;
}

/* Element j of dst[b, a, inner] = src[a, b, inner]: swaps the two outer
 * axes (NCHW <-> CNHW around the batched convolution GEMM). */
STK_HD float stk_swap01_1(const float *src, size_t a, size_t b, size_t inner,
                          size_t j)
{
    size_t in = j % inner, ai = j / inner % a, bi = j / (inner * a);
    return src[(ai * b + bi) * inner + in];
}

/* ---- Winograd F(2x2, 3x3) ------------------------------------------------- */

/* A 3x3 convolution of stride 1 in tiles of 2x2 outputs (Lavin and Gray,
 * "Fast Algorithms for Convolutional Neural Networks", 2016): each 4x4
 * input tile d and 3x3 filter g are transformed (V = B^T d B, U = G g G^T),
 * multiplied point by point, summed over input channels (16 GEMMs, one per
 * point), and transformed back (Y = A^T M A): 4 multiplies per output and
 * channel pair instead of 9. The backward passes are the exact adjoints of
 * these maps (dM = A dY A^T, dd = B dV B^T, dg = G^T dU G), so the
 * gradients are those of the function forward computes. Every coefficient
 * is 0, +-1 or +-1/2, so in float the outputs carry about the rounding
 * error of a direct sum (1.9e-7 against 2.1e-7 relative on the cnn's
 * second layer). F(4x4, 3x3) would need 4x fewer multiplies but carries
 * 10x the error, enough to take AdamW off PyTorch's track within 30 steps
 * (docs/architecture.md, "Convolutions"). */
enum {
    STK_WINO_M = 2,  /* outputs per tile side */
    STK_WINO_A = 4,  /* input tile side, the transforms' size */
    STK_WINO_P = 16  /* points per tile: GEMMs per convolution */
};

/* The six 1-D maps: B^T (4 -> 4) and its adjoint B, G (3 -> 4) and G^T,
 * A^T (4 -> 2) and A. */
typedef enum stk_wino_map {
    STK_WINO_BT, STK_WINO_B, STK_WINO_G, STK_WINO_GT, STK_WINO_AT, STK_WINO_A1
} stk_wino_map;

/* The maps' expressions: y0..y3 (as many as the map has outputs) from
 * a..d (as many as it reads), for float and, in the CPU's AVX-512
 * transforms (cpu.c), for 16-float vectors alike: one definition of the
 * arithmetic for every backend. */
#define STK_WINO_MAP(map, a, b, c, d, y0, y1, y2, y3)                          \
    do {                                                                       \
        switch (map) {                                                         \
        case STK_WINO_BT:                                                      \
            y0 = (a) - (c), y1 = (b) + (c), y2 = (c) - (b), y3 = (b) - (d);    \
            break;                                                             \
        case STK_WINO_B:                                                       \
            y0 = (a), y1 = ((b) - (c)) + (d), y2 = ((b) + (c)) - (a);          \
            y3 = -(d);                                                         \
            break;                                                             \
        case STK_WINO_G:                                                       \
            y0 = (a), y1 = ((a) + (b) + (c)) * 0.5f;                           \
            y2 = ((a) - (b) + (c)) * 0.5f, y3 = (c);                           \
            break;                                                             \
        case STK_WINO_GT:                                                      \
            y0 = (a) + ((b) + (c)) * 0.5f, y1 = ((b) - (c)) * 0.5f;            \
            y2 = ((b) + (c)) * 0.5f + (d);                                     \
            break;                                                             \
        case STK_WINO_AT:                                                      \
            y0 = (a) + (b) + (c), y1 = ((b) - (c)) - (d);                      \
            break;                                                             \
        case STK_WINO_A1:                                                      \
            y0 = (a), y1 = (a) + (b), y2 = (a) - (b), y3 = -(b);               \
            break;                                                             \
        }                                                                      \
    } while (0)

/* Inputs a map reads (A 2, G 3, the others 4) and outputs it writes (A^T
 * 2, G^T 3, the others 4). */
STK_HD int stk_wino_ins(stk_wino_map map)
{
    return map == STK_WINO_A1 ? 2 : map == STK_WINO_G ? 3 : 4;
}

STK_HD int stk_wino_outs(stk_wino_map map)
{
    return map == STK_WINO_AT ? 2 : map == STK_WINO_GT ? 3 : 4;
}

/* y (stride ys) = map applied to x (stride xs). */
STK_HD void stk_wino_1d(stk_wino_map map, const float *x, size_t xs, float *y,
                        size_t ys)
{
    int ins = stk_wino_ins(map), outs = stk_wino_outs(map);
    float a = x[0], b = x[xs], c = ins > 2 ? x[2 * xs] : 0.0f,
          d = ins > 3 ? x[3 * xs] : 0.0f, y0 = 0.0f, y1 = 0.0f, y2 = 0.0f,
          y3 = 0.0f;
    STK_WINO_MAP(map, a, b, c, d, y0, y1, y2, y3);
    y[0] = y0;
    y[ys] = y1;
    if (outs > 2)
        y[2 * ys] = y2;
    if (outs > 3)
        y[3 * ys] = y3;
}

/* Tiles per body call: the CPU transforms 8 tiles side by side, which its
 * compiler turns into vector instructions; a CUDA thread takes one. */
#ifdef __CUDACC__
#define STK_WINO_LANES 1
#else
#define STK_WINO_LANES 8
#endif

/* out = P in P^T on `lanes` tiles at once, for the map P of size o x i:
 * element (r, c) of tile l at in[(r * i + c) * is + l] and at
 * out[(r * o + c) * os + l]. The columns first, then the rows, through
 * t (o * i * lanes floats); out may be in. Every tile gets the same
 * operations in the same order, so no lane count or layout changes a
 * result. */
STK_HD void stk_wino_2d(stk_wino_map map, int i, int o, const float *in,
                        size_t is, float *t, float *out, size_t os, int lanes)
{
    size_t ti = (size_t)i * lanes;
    for (int c = 0; c < i; c++)
        for (int l = 0; l < lanes; l++)
            stk_wino_1d(map, in + c * is + l, i * is, t + c * lanes + l, ti);
    for (int r = 0; r < o; r++)
        for (int l = 0; l < lanes; l++)
            stk_wino_1d(map, t + r * ti + l, lanes, out + r * o * os + l, os);
}

/* Floats from one point's matrix to the next in U, V and M (layouts
 * [points, rows, cols]): rows * cols rounded up to whole 64-byte lines,
 * plus a line when the lines are a multiple of 16. Points a multiple of
 * 4 KiB apart would share their L1 sets: a transform writing 16 points
 * of a tile would evict its own lines (a 12-way cache). */
STK_HD size_t stk_wino_stride(size_t elems)
{
    size_t lines = (elems + 15) / 16;
    return (lines + (lines % 16 == 0 ? 1 : 0)) * 16;
}

/* Tiles per sample: rows *th, columns *tw of 2x2 outputs. */
STK_HD int stk_wino_tiles(const stk_conv_shape *s, int *th, int *tw)
{
    *th = (s->oh + STK_WINO_M - 1) / STK_WINO_M;
    *tw = (s->ow + STK_WINO_M - 1) / STK_WINO_M;
    return *th * *tw;
}

/* Where column j (sample * tiles + tile) of a transformed array sits: its
 * sample, and the top-left output pixel (oy, ox) of its tile. */
typedef struct stk_wino_at {
    size_t sample;
    int oy, ox;
} stk_wino_at;

STK_HD stk_wino_at stk_wino_column(size_t j, int tiles, int tw)
{
    int t = (int)(j % (size_t)tiles);
    stk_wino_at a = {j / (size_t)tiles, t / tw * STK_WINO_M,
                     t % tw * STK_WINO_M};
    return a;
}

/* Filters f0 .. f0 + lanes - 1 of [cout * c] (9 floats each, at w):
 * u[p * us + l] = (G g G^T)[p] of filter f0 + l. */
STK_HD void stk_wino_filter_n(const float *w, int lanes, float *u, size_t us)
{
    float d[9 * STK_WINO_LANES], t[3 * STK_WINO_A * STK_WINO_LANES];
    for (int k = 0; k < 9; k++)
        for (int l = 0; l < lanes; l++)
            d[k * lanes + l] = w[l * 9 + k];
    stk_wino_2d(STK_WINO_G, 3, STK_WINO_A, d, lanes, t, u, us, lanes);
}

/* The adjoint: dw[l * 9 + k] += (G^T dU G)[k] of filter f0 + l, its
 * points at du[p * us + l]. */
STK_HD void stk_wino_filter_grad_n(const float *du, size_t us, int lanes,
                                   float *dw)
{
    float t[3 * STK_WINO_A * STK_WINO_LANES], o[9 * STK_WINO_LANES];
    stk_wino_2d(STK_WINO_GT, STK_WINO_A, 3, du, us, t, o, lanes, lanes);
    for (int k = 0; k < 9; k++)
        for (int l = 0; l < lanes; l++)
            dw[l * 9 + k] += o[k * lanes + l];
}

/* Column j (sample * tiles + tile) of channel ci: v[p * vs] = (B^T d B)[p]
 * for the 4x4 input tile of x [n, s->c, h, w] that column stands for,
 * read as 0 outside the image (the padding). The CPU computes the same
 * expressions a row of tiles at a time (cpu.c, wino_row_of_tiles). */
STK_HD void stk_wino_input1(const float *x, const stk_conv_shape *s, int ci,
                            size_t j, float *v, size_t vs)
{
    float d[STK_WINO_P], t[STK_WINO_P];
    int th, tw, tiles = stk_wino_tiles(s, &th, &tw);
    stk_wino_at a = stk_wino_column(j, tiles, tw);
    const float *plane = x + (a.sample * s->c + ci) * s->h * s->w;
    for (int r = 0; r < STK_WINO_A; r++)
        for (int c = 0; c < STK_WINO_A; c++) {
            int y = a.oy - s->ph + r, xx = a.ox - s->pw + c;
            d[r * STK_WINO_A + c] = y >= 0 && y < s->h && xx >= 0 && xx < s->w
                                        ? plane[y * s->w + xx]
                                        : 0.0f;
        }
    stk_wino_2d(STK_WINO_BT, STK_WINO_A, STK_WINO_A, d, 1, t, v, vs, 1);
}

/* In place, `lanes` columns: dv[p * vs + l] becomes the tile's input
 * gradient (B dV B^T)[p], the pixel at row p / 4, column p % 4 of the
 * tile (before the padding is cut off). */
STK_HD void stk_wino_input_grad_n(float *dv, size_t vs, int lanes)
{
    float t[STK_WINO_P * STK_WINO_LANES];
    stk_wino_2d(STK_WINO_B, STK_WINO_A, STK_WINO_A, dv, vs, t, dv, vs, lanes);
}

/* Input gradient at pixel (y, x) of one plane: the sum of the tile
 * gradients (stk_wino_input_grad_n, left in dd[p * ds + tile]) that cover
 * it, tiles in row-major order from 0, which is also the order of the
 * CPU's tile-by-tile scatter: the two give the same floats. */
STK_HD float stk_wino_gather1(const float *dd, size_t ds,
                              const stk_conv_shape *s, int y, int x)
{
    int th, tw;
    stk_wino_tiles(s, &th, &tw);
    int ry = y + s->ph, rx = x + s->pw; /* in tile coordinates */
    /* the tiles t with t * M <= r < t * M + A: ascending, as the scatter */
    int ty0 = ry >= STK_WINO_A ? (ry - STK_WINO_A) / STK_WINO_M + 1 : 0;
    int tx0 = rx >= STK_WINO_A ? (rx - STK_WINO_A) / STK_WINO_M + 1 : 0;
    int ty1 = ry / STK_WINO_M < th - 1 ? ry / STK_WINO_M : th - 1;
    int tx1 = rx / STK_WINO_M < tw - 1 ? rx / STK_WINO_M : tw - 1;
    float sum = 0.0f;
    for (int ty = ty0; ty <= ty1; ty++)
        for (int tx = tx0; tx <= tx1; tx++) {
            int r = ry - ty * STK_WINO_M, c = rx - tx * STK_WINO_M;
            sum += dd[(size_t)(r * STK_WINO_A + c) * ds + ty * tw + tx];
        }
    return sum;
}

/* One output value: point q of a tile's A^T M A plus the bias (the
 * macro for the CPU's vectors too). */
#define STK_WINO_OUT(v, bias) ((v) + (bias))
STK_HD float stk_wino_out1(float v, float bias)
{
    return STK_WINO_OUT(v, bias);
}

/* Column j of output channel co: the tile's outputs (A^T M A) + bias from
 * m[p * ms], into y [n, cout, oh, ow] where they fall inside the image. */
STK_HD void stk_wino_output1(const float *m, size_t ms, float bias,
                             const stk_conv_shape *s, int co, int cout,
                             size_t j, float *y)
{
    float t[STK_WINO_P], o[STK_WINO_M * STK_WINO_M];
    int th, tw, tiles = stk_wino_tiles(s, &th, &tw);
    stk_wino_at a = stk_wino_column(j, tiles, tw);
    float *plane = y + (a.sample * cout + co) * s->oh * s->ow;
    stk_wino_2d(STK_WINO_AT, STK_WINO_A, STK_WINO_M, m, ms, t, o, 1, 1);
    for (int r = 0; r < STK_WINO_M && a.oy + r < s->oh; r++)
        for (int c = 0; c < STK_WINO_M && a.ox + c < s->ow; c++)
            plane[(a.oy + r) * s->ow + a.ox + c] =
                stk_wino_out1(o[r * STK_WINO_M + c], bias);
}

/* The adjoint: dm[p * ms] = (A dY A^T)[p] for the output-gradient tile of
 * column j in dy [n, cout, oh, ow] (0 where it runs past the image). The
 * CPU computes the same expressions a row of tiles at a time. */
STK_HD void stk_wino_output_grad1(const float *dy, const stk_conv_shape *s,
                                  int co, int cout, size_t j, float *dm,
                                  size_t ms)
{
    float d[STK_WINO_M * STK_WINO_M], t[STK_WINO_P];
    int th, tw, tiles = stk_wino_tiles(s, &th, &tw);
    stk_wino_at a = stk_wino_column(j, tiles, tw);
    const float *plane = dy + (a.sample * cout + co) * s->oh * s->ow;
    for (int r = 0; r < STK_WINO_M; r++)
        for (int c = 0; c < STK_WINO_M; c++)
            d[r * STK_WINO_M + c] = a.oy + r < s->oh && a.ox + c < s->ow
                                        ? plane[(a.oy + r) * s->ow + a.ox + c]
                                        : 0.0f;
    stk_wino_2d(STK_WINO_A1, STK_WINO_M, STK_WINO_A, d, 1, t, dm, ms, 1);
}

/* ---- max-pool ------------------------------------------------------------ */

/* One candidate v at index i against the window's best so far: a larger
 * value or a NaN wins, so the first maximum is kept and NaN propagates (as
 * in PyTorch). Selects rather than branches: on real activations the
 * comparison is a coin toss that a branch predictor loses. */
STK_HD void stk_maxpool_take(float *best, int32_t *at, float v, int32_t i)
{
    int take = (v > *best) | (v != v);
    *best = take ? v : *best;
    *at = take ? i : *at;
}

/* The k x k window at (oy, ox) of plane p (h x w), stride st: its maximum
 * and, in *arg, the winner's index within the plane. Windows lie inside
 * the plane (no padding, floor mode), which stk_maxpool_fwd checks. */
STK_HD float stk_maxpool_at(const float *p, int h, int w, int k, int st,
                            int oy, int ox, int32_t *arg)
{
    (void)h;
    int32_t at = oy * st * w + ox * st;
    float best = p[at];
    for (int dy = 0; dy < k; dy++)
        for (int dx = 0; dx < k; dx++) {
            int32_t i = (oy * st + dy) * w + ox * st + dx;
            stk_maxpool_take(&best, &at, p[i], i);
        }
    *arg = at;
    return best;
}

/* Pools without padding: the outputs o in [*lo, *hi] of one axis (out of them)
 * whose window [o * st, o * st + k) holds coordinate y. */
STK_HD void stk_pool_span(int y, int k, int st, int out, int *lo, int *hi)
{
    *lo = y - k + 1 > 0 ? (y - k + 1 + st - 1) / st : 0;
    *hi = y / st < out - 1 ? y / st : out - 1;
}

/* Input gradient at element i (plane, y, x) of a max-pool's input: the sum
 * of dy over the windows that contain (y, x) and chose it, taken in
 * ascending output order, which is the order of the CPU's scatter (one add
 * per output, outputs in order): the two give the same floats, also where
 * windows overlap, with no atomics. */
STK_HD float stk_maxpool_grad1(const float *dy, const int32_t *arg, int h,
                               int w, int k, int st, size_t i)
{
    int oh = (h - k) / st + 1, ow = (w - k) / st + 1;
    size_t plane = i / ((size_t)h * w);
    int32_t q = (int32_t)(i % ((size_t)h * w));
    int y = q / w, x = q % w;
    int oy0, oy1, ox0, ox1;
    stk_pool_span(y, k, st, oh, &oy0, &oy1);
    stk_pool_span(x, k, st, ow, &ox0, &ox1);
    const float *g = dy + plane * (size_t)oh * ow;
    const int32_t *a = arg + plane * (size_t)oh * ow;
    float sum = 0.0f;
    for (int oy = oy0; oy <= oy1; oy++)
        for (int ox = ox0; ox <= ox1; ox++)
            if (a[oy * ow + ox] == q)
                sum += g[oy * ow + ox];
    return sum;
}

/* Output element j (plane, oy, ox) of a max-pool over h x w planes. */
STK_HD float stk_maxpool1(const float *x, int h, int w, int k, int st, int oh,
                          int ow, size_t j, int32_t *arg)
{
    int ox = (int)(j % ow), oy = (int)(j / ow % oh);
    size_t plane = j / ((size_t)ow * oh);
    return stk_maxpool_at(x + plane * (size_t)h * w, h, w, k, st, oy, ox, arg);
}

/* ---- average pool --------------------------------------------------------
 */

/* The divisor of a kh x kw window, as PyTorch's (sum / (kh * kw)). */
STK_HD float stk_avgpool_div(int kh, int kw)
{
    return (float)((int64_t)kh * kw);
}

/* The kh x kw window at (oy, ox) of plane p (row length w), strides sh,
 * sw: its sum in row-major order, divided by the window's size. Windows
 * lie inside the plane (no padding, floor mode): stk_avgpool_fwd checks. */
STK_HD float stk_avgpool_at(const float *p, int w, int kh, int kw, int sh,
                            int sw, int oy, int ox)
{
    const float *r = p + (size_t)oy * sh * w + (size_t)ox * sw;
    float sum = 0.0f;
    for (int dy = 0; dy < kh; dy++, r += w)
        for (int dx = 0; dx < kw; dx++)
            sum += r[dx];
    return sum / stk_avgpool_div(kh, kw);
}

/* Output element j (plane, oy, ox) of an average pool over h x w planes. */
STK_HD float stk_avgpool1(const float *x, int h, int w, int kh, int kw, int sh,
                          int sw, int oh, int ow, size_t j)
{
    int ox = (int)(j % ow), oy = (int)(j / ow % oh);
    size_t plane = j / ((size_t)ow * oh);
    return stk_avgpool_at(x + plane * (size_t)h * w, w, kh, kw, sh, sw, oy,
                          ox);
}

/* Input gradient at pixel (y, x) of one plane, g being the plane's output
 * gradient (oh x ow): the sum of g / (kh * kw) over the windows that hold
 * the pixel, in ascending output order. That is the order of PyTorch's
 * scatter (one add per output, outputs in order), and a gather needs no
 * atomics, so every backend and thread count gives the same floats. */
STK_HD float stk_avgpool_grad_at(const float *g, int oh, int ow, int kh,
                                 int kw, int sh, int sw, int y, int x)
{
    int oy0, oy1, ox0, ox1;
    stk_pool_span(y, kh, sh, oh, &oy0, &oy1);
    stk_pool_span(x, kw, sw, ow, &ox0, &ox1);
    float div = stk_avgpool_div(kh, kw), sum = 0.0f;
    for (int oy = oy0; oy <= oy1; oy++)
        for (int ox = ox0; ox <= ox1; ox++)
            sum += g[(size_t)oy * ow + ox] / div;
    return sum;
}

/* Input gradient element i (plane, y, x) of an average pool. */
STK_HD float stk_avgpool_grad1(const float *dy, int h, int w, int kh, int kw,
                               int sh, int sw, size_t i)
{
    int oh = (h - kh) / sh + 1, ow = (w - kw) / sw + 1;
    size_t plane = i / ((size_t)h * w);
    int x = (int)(i % w), y = (int)(i / w % h);
    return stk_avgpool_grad_at(dy + plane * (size_t)oh * ow, oh, ow, kh, kw,
                               sh, sw, y, x);
}

/* The residual add. */
STK_HD float stk_add1(float a, float b)
{
    return a + b;
}

/* ---- batch normalisation -------------------------------------------------
 */

/* Per-channel values are computed in double from the float statistics and
 * rounded once, so that both backends get the same floats (double
 * arithmetic is correctly rounded on both, and no FMA contraction is
 * allowed); the per-element work is then a few float operations. */

/* 1 / sqrt(var + eps). */
STK_HD double stk_bn_invstd(float var, float eps)
{
    return 1.0 / sqrt((double)var + (double)eps);
}

/* One channel of the forward pass: y = (x - mean) * k + beta. */
typedef struct stk_bn_fwd_coef {
    float mean, k, beta;
} stk_bn_fwd_coef;

STK_HD stk_bn_fwd_coef stk_bn_fwd_coef_of(float mean, float var, float eps,
                                          float gamma, float beta)
{
    stk_bn_fwd_coef c = {mean, (float)(stk_bn_invstd(var, eps) * gamma), beta};
    return c;
}

/* The normalisation before the ReLU, c a stk_bn_fwd_coef (the macro for
 * the CPU's vectors too: the backward's recomputed mask is this). */
#define STK_BN_LINEAR(x, c) (((x) - (c).mean) * (c).k + (c).beta)
STK_HD float stk_bn_apply1(float x, stk_bn_fwd_coef c, int relu)
{
    float y = STK_BN_LINEAR(x, c);
    return relu ? stk_relu1(y) : y;
}

/* stk_bn_apply1 with a residual s added before the ReLU (a batchnorm, the
 * add after it and a ReLU after that in one pass): the floats of
 * stk_bn_apply1, stk_add1 and stk_relu1 run in turn. */
STK_HD float stk_bn_add1(float x, float s, stk_bn_fwd_coef c, int relu)
{
    float y = stk_add1(STK_BN_LINEAR(x, c), s);
    return relu ? stk_relu1(y) : y;
}

/* The gradient reaching the batchnorm's output: dy, or with a fused ReLU
 * (f its forward coefficients, not NULL), dy where the ReLU passed it. The
 * ReLU's output is recomputed from x (the same float stk_bn_apply wrote,
 * so the same mask), not read back: a stream fewer through memory in both
 * backward passes. */
STK_HD float stk_bn_g1(float dy, float x, const stk_bn_fwd_coef *f)
{
    return f ? stk_relu_grad1(stk_bn_apply1(x, *f, 1), dy) : dy;
}

/* The terms of the backward sums: g, and g * (x - mean) (times invstd once
 * per channel, at the end, as PyTorch's dotp). */
STK_HD double stk_bn_gx1(float g, float x, float mean)
{
    return (double)g * ((double)x - (double)mean);
}

/* The term of the variance's sum. */
STK_HD double stk_bn_sq1(float x, float shift)
{
    double d = (double)x - (double)shift;
    return d * d;
}

/* One channel of the input gradient:
 * dx = (g - gm - (x - mean) * proj) * k with k = gamma * invstd,
 * gm = inv_count * sum g, proj = inv_count * invstd * sum g xhat: the
 * formula of stk_bn_input_grad with xhat's invstd folded into proj. */
typedef struct stk_bn_bwd_coef {
    float mean, k, gm, proj;
} stk_bn_bwd_coef;

STK_HD stk_bn_bwd_coef stk_bn_bwd_coef_of(float mean, float var, float eps,
                                          float gamma, float sum_g,
                                          float sum_gxhat, float inv_count)
{
    double is = stk_bn_invstd(var, eps);
    stk_bn_bwd_coef c = {mean, (float)(is * gamma),
                         (float)((double)inv_count * sum_g),
                         (float)((double)inv_count * sum_gxhat * is)};
    return c;
}

STK_HD float stk_bn_dx1(float g, float x, stk_bn_bwd_coef c)
{
    return (g - c.gm - (x - c.mean) * c.proj) * c.k;
}

/* CUDA's per-channel sums run in two passes: each channel's samples split
 * into `parts` ranges, one block per (channel, range), then the ranges'
 * sums added in order. The split depends on the shape alone (so do the
 * floats): about 8192 elements a range, at most n ranges (of whole
 * samples) and 256 (more only where a range would reach 2^31 elements:
 * a block walks its range with 32-bit divisions). */
enum { STK_BN_PART_ELEMS = 8192, STK_BN_MAX_PARTS = 256 };

STK_HD int stk_bn_parts(int n, int hw)
{
    size_t count = (size_t)n * hw, parts = count / STK_BN_PART_ELEMS;
    parts = parts < 1 ? 1 : parts;
    parts =
        parts > (size_t)STK_BN_MAX_PARTS ? (size_t)STK_BN_MAX_PARTS : parts;
    parts = parts > (size_t)n ? (size_t)n : parts;
    while (parts < (size_t)n &&
           ((size_t)n + parts - 1) / parts * hw >= ((size_t)1 << 31))
        parts++;
    return (int)parts;
}

/* Range p of `parts` over n samples: samples [*r0, *r1). */
STK_HD void stk_bn_part(int n, int parts, int p, int *r0, int *r1)
{
    *r0 = (int)((int64_t)n * p / parts);
    *r1 = (int)((int64_t)n * (p + 1) / parts);
}

/* PyTorch's running statistic update, in double as its CPU kernel:
 * momentum * stat + (1 - momentum) * run. */
STK_HD float stk_bn_running1(float run, double stat, float momentum)
{
    double m = momentum;
    return (float)(m * stat + (1.0 - m) * (double)run);
}

/* ---- softmax cross-entropy ------------------------------------------------ */

/* Row r of logits [n, c]: its loss with label smoothing e (PyTorch's
 * definition: the target is (1 - e) onehot + e/c, so the loss is
 * logsumexp - (1 - e) logit[label] - e mean(logit)) and, when dlogits is
 * not NULL, the gradient of the mean loss: (softmax - target)/n. e = 0 is
 * plain cross-entropy, to the bit. */
STK_HD float stk_xent_row(const float *logits, const int32_t *labels, int n,
                          int c, float e, int r, float *dlogits)
{
    const float *z = logits + (size_t)r * c;
    float m = z[0], zsum = 0.0f;
    for (int j = 1; j < c; j++)
        m = z[j] > m ? z[j] : m;
    float s = 0.0f;
    for (int j = 0; j < c; j++) {
        s += expf(z[j] - m);
        zsum += z[j];
    }
    float lse = m + logf(s), off = e / (float)c;
    if (dlogits)
        for (int j = 0; j < c; j++)
            dlogits[(size_t)r * c + j] =
                (expf(z[j] - lse) - (j == labels[r] ? 1.0f - e : 0.0f) - off) /
                (float)n;
    if (e == 0.0f)
        return lse - z[labels[r]];
    return lse - (1.0f - e) * z[labels[r]] - off * zsum;
}

/* ---- training metrics kept on the device ----------------------------------- */

/* What training sums on the device between the host's reads (once per
 * logging window), so that a step never waits for the GPU. Doubles: their
 * counts stay exact. All zero (stk_memzero) is the empty state; *_step,
 * *_epoch and bad_row are 1-based, 0 meaning none. */
typedef struct stk_metrics {
    double step_loss, step_hits; /* the open step: mean loss x n per
                                    micro-batch, argmax hits */
    double last_loss, last_hits; /* the last closed step's */
    double loss, hits, n;        /* closed steps: each step's mean loss as
                                    a float, times its n */
    double bad_step, bad_epoch;  /* the first non-finite step */
    double bad_kind;             /* 1: its loss, 2: its gradient norm */
    double bad_nan;              /* 1: NaN, 0: infinite */
    double bad_row, bad_label;   /* the first label out of range */
    double scale;                /* the gradient clip factor last applied */
} stk_metrics;

/* A micro-batch's mean loss as stk_xent returns it (a float), times n. */
STK_HD void stk_metrics_add_loss(stk_metrics *m, double row_sum, int n)
{
    m->step_loss += (double)(float)(row_sum / n) * n;
}

STK_HD void stk_metrics_check(stk_metrics *m, int kind, float v, uint64_t step,
                              uint64_t epoch)
{
    if (m->bad_step == 0 && !isfinite(v)) {
        m->bad_step = (double)(step + 1);
        m->bad_epoch = (double)(epoch + 1);
        m->bad_kind = kind;
        m->bad_nan = isnan(v) ? 1 : 0;
    }
}

/* Closes a step of n samples: its loss is (float)sum / n in float (what a
 * float all-reduce of the sums gives), checked, and added times n. */
STK_HD void stk_metrics_close(stk_metrics *m, int n, uint64_t step,
                              uint64_t epoch)
{
    float l = (float)m->step_loss / (float)n;
    stk_metrics_check(m, 1, l, step, epoch);
    m->last_loss = m->step_loss;
    m->last_hits = m->step_hits;
    m->loss += (double)l * n;
    m->hits += m->step_hits;
    m->n += n;
    m->step_loss = m->step_hits = 0.0;
}

/* The gradient norm from its sum of squares, checked; the factor that
 * clips it to clip (clip > 0), else 1, kept in m->scale. */
STK_HD float stk_metrics_norm(stk_metrics *m, double sumsq, float clip,
                              uint64_t step, uint64_t epoch)
{
    float norm = (float)sqrt(sumsq);
    stk_metrics_check(m, 2, norm, step, epoch);
    float f = clip > 0 && norm > clip ? clip / (norm + 1e-6f) : 1.0f;
    m->scale = f;
    return f;
}

/* The first largest logit of row r of [n, c]. */
STK_HD int stk_argmax_row(const float *logits, int c, int r)
{
    const float *z = logits + (size_t)r * c;
    int best = 0;
    for (int j = 1; j < c; j++)
        if (z[j] > z[best])
            best = j;
    return best;
}

/* ---- the device-side input transform ------------------------------------- */

typedef struct stk_transform {
    int c, h, w;            /* stored sample shape (uint8 CHW) */
    float mean[4], inv_std[4];
    int pad;                /* random crop: pad by this much, crop back */
    int flip;               /* random horizontal flip */
    stk_philox_key key;
    uint64_t stream;        /* e.g. the epoch; samples draw by their index */
} stk_transform;

/* The random crop offset and flip of one sample, keyed by its id. */
STK_HD void stk_transform_draw(const stk_transform *t, uint64_t sample_id,
                               int *dy, int *dx, int *mirror)
{
    *dy = *dx = *mirror = 0;
    if (!t->pad && !t->flip)
        return;
    uint32_t ctr[4] = {(uint32_t)sample_id, (uint32_t)(sample_id >> 32),
                       (uint32_t)t->stream, (uint32_t)(t->stream >> 32)};
    stk_philox4x32_10(ctr, t->key);
    if (t->pad) {
        *dy = (int)(ctr[0] % (uint32_t)(2 * t->pad + 1)) - t->pad;
        *dx = (int)(ctr[1] % (uint32_t)(2 * t->pad + 1)) - t->pad;
    }
    *mirror = t->flip && (ctr[2] & 1);
}

/* A pixel value v (0..255) of channel c, normalised. */
STK_HD float stk_normalize1(float v, const stk_transform *t, int c)
{
    return (v / 255.0f - t->mean[c]) * t->inv_std[c];
}

/* Pixel (c, y, x) of one sample img (uint8 CHW) after its draw: read
 * through the crop offset and flip, 0 outside the image (the padding).
 * The loader's uint8 augmentation and the device transform share it. */
STK_HD uint8_t stk_transform_src(const uint8_t *img, const stk_transform *t,
                                 int c, int y, int x, int dy, int dx,
                                 int mirror)
{
    int sx = (mirror ? t->w - 1 - x : x) + dx, sy = y + dy;
    if (sx < 0 || sx >= t->w || sy < 0 || sy >= t->h)
        return 0;
    return img[((size_t)c * t->h + sy) * t->w + sx];
}

/* Output pixel (c, y, x) of one sample img given its draw, normalised. */
STK_HD float stk_transform_px(const uint8_t *img, const stk_transform *t,
                              int c, int y, int x, int dy, int dx, int mirror)
{
    return stk_normalize1(
        (float)stk_transform_src(img, t, c, y, x, dy, dx, mirror), t, c);
}

/* Output element j of the batch (n, c, y, x). sample_id keys the draws, so
 * a sample's augmentation does not depend on the batch it is in. */
STK_HD float stk_transform1(const uint8_t *x, const stk_transform *t,
                            uint64_t sample_id, size_t j)
{
    size_t plane = (size_t)t->h * t->w;
    int xx = (int)(j % t->w), y = (int)(j / t->w % t->h);
    int c = (int)(j / plane % t->c);
    size_t n = j / (plane * t->c);
    int dy, dx, mirror;
    stk_transform_draw(t, sample_id, &dy, &dx, &mirror);
    return stk_transform_px(x + n * plane * t->c, t, c, y, xx, dy, dx, mirror);
}

/* ---- optimizers (PyTorch's update rules, one parameter element) --------- */

/* An update's guard: the run's metrics on the update's device (NULL: none).
 * A step whose loss or gradient norm was non-finite, or whose labels were
 * out of range, is not applied (checked on the device, so the host need
 * not wait for the check); the run names that step at its next read. */
STK_HD int stk_update_refused(const stk_metrics *guard)
{
    return guard && (guard->bad_step != 0 || guard->bad_row != 0);
}

typedef struct stk_sgd_cfg {
    float lr, momentum, weight_decay;
    int nesterov;
    int first;               /* first step: the buffer starts as the grad */
    const stk_metrics *guard; /* stk_update_refused */
} stk_sgd_cfg;

STK_HD void stk_sgd1(float *w, const float *g, float *buf, size_t i,
                     const stk_sgd_cfg *c)
{
    float d = g[i] + c->weight_decay * w[i];
    if (c->momentum != 0.0f) {
        float b = c->first ? d : c->momentum * buf[i] + d;
        buf[i] = b;
        d = c->nesterov ? d + c->momentum * b : b;
    }
    w[i] -= c->lr * d;
}

typedef struct stk_adamw_cfg {
    float lr, beta1, beta2, eps, weight_decay;
    float bias1, sqrt_bias2; /* 1 - beta1^t and sqrt(1 - beta2^t) */
    /* 1 - beta1 and 1 - beta2 computed in double, as PyTorch does: in float
     * 1 - 0.999f is 0.0009999871, which no longer cancels against the
     * double bias correction (steps 6.7e-6 too large) */
    float one_minus_beta1, one_minus_beta2;
    const stk_metrics *guard; /* stk_update_refused */
} stk_adamw_cfg;

STK_HD void stk_adamw1(float *w, const float *g, float *m, float *v, size_t i,
                       const stk_adamw_cfg *c)
{
    w[i] *= 1.0f - c->lr * c->weight_decay;
    m[i] = c->beta1 * m[i] + c->one_minus_beta1 * g[i];
    v[i] = c->beta2 * v[i] + c->one_minus_beta2 * g[i] * g[i];
    float denom = sqrtf(v[i]) / c->sqrt_bias2 + c->eps;
    w[i] -= (c->lr / c->bias1) * m[i] / denom;
}

#endif
