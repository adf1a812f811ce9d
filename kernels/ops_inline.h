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

/* The four uniforms of block `block` in stream `stream` (a 64-bit counter
 * each), so element i draws from block i / 4, lane i % 4. */
STK_HD float stk_philox_uniform(stk_philox_key k, uint64_t stream,
                                uint64_t i)
{
    uint64_t block = i >> 2;
    uint32_t c[4] = {(uint32_t)block, (uint32_t)(block >> 32),
                     (uint32_t)stream, (uint32_t)(stream >> 32)};
    stk_philox4x32_10(c, k);
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
STK_HD float stk_dropout_scale1(stk_philox_key k, uint64_t stream, size_t i,
                                size_t group, float p)
{
    float u = stk_philox_uniform(k, stream, (uint64_t)(i / group));
    return u >= p ? 1.0f / (1.0f - p) : 0.0f;
}

/* ---- im2col / col2im (NCHW, one sample) ---------------------------------- */

typedef struct stk_conv_shape {
    int c, h, w;      /* input channels and size */
    int kh, kw, sh, sw, ph, pw;
    int oh, ow;       /* output size */
} stk_conv_shape;

/* Element j of col (rows c*kh*kw, columns oh*ow): the input pixel it
 * reads, or 0 in the padding. */
STK_HD float stk_im2col1(const float *x, const stk_conv_shape *s, size_t j)
{
    size_t cols = (size_t)s->oh * s->ow;
    size_t row = j / cols, col = j % cols;
    int kx = (int)(row % s->kw), ky = (int)(row / s->kw % s->kh);
    int c = (int)(row / ((size_t)s->kw * s->kh));
    int oy = (int)(col / s->ow), ox = (int)(col % s->ow);
    int y = oy * s->sh - s->ph + ky, xx = ox * s->sw - s->pw + kx;
    if (y < 0 || y >= s->h || xx < 0 || xx >= s->w)
        return 0.0f;
    return x[((size_t)c * s->h + y) * s->w + xx];
}

/* Input gradient at pixel i (c, y, x) of one sample: the sum of the col
 * entries that read it (a gather, so no atomics are needed). */
STK_HD float stk_col2im1(const float *col, const stk_conv_shape *s, size_t i)
{
    int xx = (int)(i % s->w), y = (int)(i / s->w % s->h);
    int c = (int)(i / ((size_t)s->w * s->h));
    size_t cols = (size_t)s->oh * s->ow;
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
            sum += col[row * cols + (size_t)oy * s->ow + ox];
        }
    }
    return sum;
}

/* ---- max-pool ------------------------------------------------------------ */

/* Output element j (n*c plane, oy, ox) of a k x k, stride st max-pool over
 * h x w planes: the maximum and, in *arg, its index within the input. */
STK_HD float stk_maxpool1(const float *x, int h, int w, int k, int st, int oh,
                          int ow, size_t j, int32_t *arg)
{
    int ox = (int)(j % ow), oy = (int)(j / ow % oh);
    size_t plane = j / ((size_t)ow * oh);
    const float *p = x + plane * (size_t)h * w;
    float best = -INFINITY;
    int32_t at = -1;
    for (int dy = 0; dy < k; dy++)
        for (int dx = 0; dx < k; dx++) {
            int y = oy * st + dy, xx = ox * st + dx;
            if (y < h && xx < w) {
                float v = p[y * w + xx];
                if (v > best || at < 0 || v != v) { /* NaN propagates */
                    best = v;
                    at = y * w + xx;
                }
            }
        }
    *arg = at;
    return best;
}

/* ---- softmax cross-entropy ------------------------------------------------ */

/* Row r of logits [n, c]: its loss (logsumexp - logit[label]) and, when
 * dlogits is not NULL, the gradient of the mean loss: (softmax - onehot)/n. */
STK_HD float stk_xent_row(const float *logits, const int32_t *labels, int n,
                          int c, int r, float *dlogits)
{
    const float *z = logits + (size_t)r * c;
    float m = z[0];
    for (int j = 1; j < c; j++)
        m = z[j] > m ? z[j] : m;
    float s = 0.0f;
    for (int j = 0; j < c; j++)
        s += expf(z[j] - m);
    float lse = m + logf(s);
    if (dlogits)
        for (int j = 0; j < c; j++)
            dlogits[(size_t)r * c + j] =
                (expf(z[j] - lse) - (j == labels[r] ? 1.0f : 0.0f)) / (float)n;
    return lse - z[labels[r]];
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

/* Output element j of sample n (c, y, x): uint8 -> float, normalised, read
 * through the sample's random crop offset and flip. sample_id keys the
 * draws, so a sample's augmentation does not depend on the batch it is in. */
STK_HD float stk_transform1(const uint8_t *x, const stk_transform *t,
                            uint64_t sample_id, size_t j)
{
    size_t plane = (size_t)t->h * t->w;
    int xx = (int)(j % t->w), y = (int)(j / t->w % t->h);
    int c = (int)(j / plane % t->c);
    size_t n = j / (plane * t->c);
    int dy = 0, dx = 0, mirror = 0;
    if (t->pad || t->flip) {
        uint32_t ctr[4] = {(uint32_t)sample_id, (uint32_t)(sample_id >> 32),
                           (uint32_t)t->stream, (uint32_t)(t->stream >> 32)};
        stk_philox4x32_10(ctr, t->key);
        if (t->pad) {
            dy = (int)(ctr[0] % (uint32_t)(2 * t->pad + 1)) - t->pad;
            dx = (int)(ctr[1] % (uint32_t)(2 * t->pad + 1)) - t->pad;
        }
        mirror = t->flip && (ctr[2] & 1);
    }
    int sx = (mirror ? t->w - 1 - xx : xx) + dx, sy = y + dy;
    float v = 0.0f; /* crop outside the image reads the zero padding */
    if (sx >= 0 && sx < t->w && sy >= 0 && sy < t->h)
        v = (float)x[n * plane * t->c + (size_t)c * plane + (size_t)sy * t->w +
                     sx];
    return (v / 255.0f - t->mean[c]) * t->inv_std[c];
}

/* ---- optimizers (PyTorch's update rules, one parameter element) --------- */

typedef struct stk_sgd_cfg {
    float lr, momentum, weight_decay;
    int nesterov;
    int first;               /* first step: the buffer starts as the grad */
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
} stk_adamw_cfg;

STK_HD void stk_adamw1(float *w, const float *g, float *m, float *v, size_t i,
                       const stk_adamw_cfg *c)
{
    w[i] *= 1.0f - c->lr * c->weight_decay;
    m[i] = c->beta1 * m[i] + (1.0f - c->beta1) * g[i];
    v[i] = c->beta2 * v[i] + (1.0f - c->beta2) * g[i] * g[i];
    float denom = sqrtf(v[i]) / c->sqrt_bias2 + c->eps;
    w[i] -= (c->lr / c->bias1) * m[i] / denom;
}

#endif
