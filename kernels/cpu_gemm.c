/* cpu_gemm.c - small GEMMs on AVX2 + FMA (or AVX-512), for the CPU backend's
 * convolutions: the Winograd point GEMMs (16-64 channels by a few hundred
 * to a few thousand tiles) and the im2col GEMMs of the strided and 1x1
 * convolutions. OpenBLAS packs both operands, zeroes C in a separate pass
 * and pays its call overhead on each of them; here nothing is packed:
 *
 * - op(B) = B (NN, TN): C is computed in tiles of MR rows by NR columns,
 *   each row of the tile one broadcast of A's element times NR contiguous
 *   floats of B's row, over all of K (the K x NR panel of B stays in L1
 *   across the rows of C).
 * - NT over a K of at most ROW_K_MAX: B^T's K x NR panels copied, then the
 *   row tiles as for NN.
 * - NT over a longer K: each element of C is a dot product of a row of A
 *   and a row of B, both contiguous; MR x DR of them at once, in 8 lanes
 *   each, the lanes added at the end in a fixed order.
 *
 * Where the CPU has AVX-512F both paths run in 16-lane vectors (the row
 * tiles 16 lanes of columns, the dot tiles two columns' 8 lanes to a
 * vector), computing every element of C with the same operations as in
 * 8 lanes: the same floats on either kind of CPU.
 *
 * Beta is applied in the tile's stores. Each element of C is summed by one
 * tile in one order, whatever part of C a call covers, so the results do
 * not depend on how the caller splits C among threads. Explicit FMA: GEMM
 * results are not bit-specified against OpenBLAS or cuBLAS. */
#include "cpu_gemm.h"

#include "backend_impl.h" /* stk_addr_at */

#include <stddef.h>
#include <stdint.h>

/* K on the row path at most (stk_small_gemm_wins): its panel copies */
enum { ROW_K_MAX = 256 };

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#define AVX512_INLINE                                                          \
    static inline __attribute__((always_inline, target("avx512f,avx2,fma")))

enum {
    MR = 4,  /* rows of a tile */
    NR = 24, /* columns of an NN/TN tile: 3 vectors */
    DR = 3,  /* columns of an NT tile (rows of B) */
    MR16 = 8,  /* rows of an AVX-512 row or NT tile */
    DR16 = 6,  /* columns of an AVX-512 NT tile: 3 vectors of 2 x 8 */
    NR16 = 48, /* its columns: 3 vectors of 16 */
    NR_MAX = NR16
};

/* The address x floats on from p, for a prefetch: past the last column
 * block it is past B's end (no harm to a prefetch), hence stk_addr_at. */
static inline const char *ahead(const float *p, int x)
{
    return (const char *)stk_addr_at(p, x);
}

/* loadu(lanes_src + 8 - r): the first r lanes set, for r in [0, 8] */
static const int32_t lanes_src[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                      0,  0,  0,  0,  0,  0,  0,  0};

AVX2_INLINE __m256i first_lanes(int r)
{
    r = r < 0 ? 0 : r > 8 ? 8 : r;
    return _mm256_loadu_si256((const __m256i *)(lanes_src + 8 - r));
}

/* alpha acc + beta C (C not read when beta is 0) into C's 8 floats at c,
 * only the lanes of `mask` when masked. */
AVX2_INLINE void store8(float *c, __m256 acc, float alpha, float beta,
                        bool masked, __m256i mask)
{
    __m256 o = _mm256_mul_ps(_mm256_set1_ps(alpha), acc);
    if (beta != 0.0f) {
        __m256 old = masked ? _mm256_maskload_ps(c, mask) : _mm256_loadu_ps(c);
        o = _mm256_add_ps(o, _mm256_mul_ps(_mm256_set1_ps(beta), old));
    }
    if (masked)
        _mm256_maskstore_ps(c, mask, o);
    else
        _mm256_storeu_ps(c, o);
}

/* One tile of C (NN, TN): rows [0, rows) x columns [0, cols) at c, with
 * nv = ceil(cols / 8) vectors (a constant at each call); A's element
 * (r, p) at a[r * rs + p * ps]. Rows past `rows` repeat the last row
 * (computed, not stored); edge: cols < 8 nv, the last vector masked. */
AVX2_INLINE void row_tile(int k, const float *a, size_t rs, size_t ps,
                          const float *b, int ldb, float *c, int ldc, int rows,
                          int cols, float alpha, float beta, int nv, bool edge)
{
    const float *ar[MR];
    for (int r = 0; r < MR; r++)
        ar[r] = a + (size_t)(r < rows ? r : rows - 1) * rs;
    __m256i mask = first_lanes(cols - 8 * (nv - 1));
    __m256 acc[MR][3];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm256_setzero_ps();
    for (int p = 0; p < k; p++) {
        const float *bp = b + (size_t)p * ldb;
        /* the next column block's row p, 4 points 8 apart: every line of
         * its 24 floats (K short strided runs escape the prefetchers) */
#pragma GCC unroll 4
        for (int x = 0; x < 32; x += 8)
            _mm_prefetch(ahead(bp, NR + (x < 24 ? x : 23)), _MM_HINT_T0);
        __m256 bv[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++)
            bv[v] = edge && v == nv - 1 ? _mm256_maskload_ps(bp + 8 * v, mask)
                                        : _mm256_loadu_ps(bp + 8 * v);
        size_t off = (size_t)p * ps;
#pragma GCC unroll 4
        for (int r = 0; r < MR; r++) {
            __m256 x = _mm256_broadcast_ss(ar[r] + off);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm256_fmadd_ps(x, bv[v], acc[r][v]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
        if (r < rows)
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++)
                store8(c + (size_t)r * ldc + 8 * v, acc[r][v], alpha, beta,
                       edge && v == nv - 1, mask);
}

/* One tile of C at c (rows < MR of A from a, columns < nr from b): an
 * ISA's row_tile for the tile's vector count. */
typedef void (*tile_fn)(int k, const float *a, size_t rs, size_t ps,
                        const float *b, int ldb, float *c, int ldc, int rows,
                        int cols, float alpha, float beta);

AVX2 static void tile_avx2(int k, const float *a, size_t rs, size_t ps,
                           const float *b, int ldb, float *c, int ldc,
                           int rows, int cols, float alpha, float beta)
{
    int nv = (cols + 7) / 8;
    if (nv == 3 && cols % 8 == 0)
        row_tile(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 3,
                 false);
    else if (nv == 3)
        row_tile(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 3,
                 true);
    else if (nv == 2)
        row_tile(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 2,
                 true);
    else
        row_tile(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 1,
                 true);
}

/* The same tile on AVX-512: MR16 rows by up to 3 vectors of 16 columns,
 * the last masked to `cols`. Each element of C is the same FMA chain over
 * K as in row_tile, so both ISAs give the same floats. */
AVX512_INLINE void row_tile16(int k, const float *a, size_t rs, size_t ps,
                              const float *b, int ldb, float *c, int ldc,
                              int rows, int cols, float alpha, float beta,
                              int nv)
{
    const float *ar[MR16];
    for (int r = 0; r < MR16; r++)
        ar[r] = a + (size_t)(r < rows ? r : rows - 1) * rs;
    __mmask16 last = (__mmask16)((1u << (cols - 16 * (nv - 1))) - 1u);
    __m512 acc[MR16][3];
#pragma GCC unroll 8
    for (int r = 0; r < MR16; r++)
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++)
            acc[r][v] = _mm512_setzero_ps();
    for (int p = 0; p < k; p++) {
        const float *bp = b + (size_t)p * ldb;
        /* the next column block's row p (see row_tile) */
#pragma GCC unroll 4
        for (int x = 0; x < 64; x += 16)
            _mm_prefetch(ahead(bp, NR16 + (x < 48 ? x : 47)), _MM_HINT_T0);
        __m512 bv[3];
#pragma GCC unroll 3
        for (int v = 0; v < nv; v++)
            bv[v] = v == nv - 1 ? _mm512_maskz_loadu_ps(last, bp + 16 * v)
                                : _mm512_loadu_ps(bp + 16 * v);
        size_t off = (size_t)p * ps;
#pragma GCC unroll 8
        for (int r = 0; r < MR16; r++) {
            __m512 x = _mm512_set1_ps(ar[r][off]);
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++)
                acc[r][v] = _mm512_fmadd_ps(x, bv[v], acc[r][v]);
        }
    }
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
#pragma GCC unroll 8
    for (int r = 0; r < MR16; r++)
        if (r < rows)
#pragma GCC unroll 3
            for (int v = 0; v < nv; v++) {
                __mmask16 mk = v == nv - 1 ? last : (__mmask16)0xffff;
                float *cv = c + (size_t)r * ldc + 16 * v;
                __m512 o = _mm512_mul_ps(va, acc[r][v]);
                if (beta != 0.0f) /* C not read when beta is 0 */
                    o = _mm512_add_ps(
                        o, _mm512_mul_ps(vb, _mm512_maskz_loadu_ps(mk, cv)));
                _mm512_mask_storeu_ps(cv, mk, o);
            }
}

AVX512 static void tile_avx512(int k, const float *a, size_t rs, size_t ps,
                               const float *b, int ldb, float *c, int ldc,
                               int rows, int cols, float alpha, float beta)
{
    int nv = (cols + 15) / 16;
    if (nv == 3)
        row_tile16(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 3);
    else if (nv == 2)
        row_tile16(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 2);
    else
        row_tile16(k, a, rs, ps, b, ldb, c, ldc, rows, cols, alpha, beta, 1);
}

/* The 8 x 8 block of B at b (rows of ldb floats) transposed into buf (rows
 * of nr floats): unpacks, then shuffles, then 128-bit lane swaps. */
AVX2_INLINE void transpose8(const float *b, size_t ldb, float *buf, int nr)
{
    __m256 r[8], t[8], u[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm256_loadu_ps(b + i * ldb);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(buf + i * nr,
                         _mm256_permute2f128_ps(u[i], u[i + 4], 0x20));
        _mm256_storeu_ps(buf + (i + 4) * nr,
                         _mm256_permute2f128_ps(u[i], u[i + 4], 0x31));
    }
}

/* B^T's K x cols panel (B's rows are its columns) into buf, 8 x 8 blocks
 * transposed in registers (an element at a time this took a third of the
 * time of the row tiles that use the panel); the same floats. */
AVX2 static void copy_panel_t(const float *b, int ldb, int k, int cols,
                              int nr, float *buf)
{
    int x8 = cols / 8 * 8, p8 = k / 8 * 8;
    for (int x = 0; x < x8; x += 8)
        for (int p = 0; p < p8; p += 8)
            transpose8(b + (size_t)x * ldb + p, (size_t)ldb, buf + p * nr + x,
                       nr);
    for (int x = 0; x < cols; x++) /* the edges */
        for (int p = x < x8 ? p8 : 0; p < k; p++)
            buf[p * nr + x] = b[(size_t)x * ldb + p];
}

/* op(B)'s K x nr panel from column j into buf (rows of nr floats): B's
 * rows, or with tb its columns (B^T's rows). */
static void copy_panel(const float *b, int ldb, bool tb, int k, int cols,
                       int nr, float *buf)
{
    if (tb) {
        copy_panel_t(b, ldb, k, cols, nr, buf);
        return;
    }
    for (int p = 0; p < k; p++)
        for (int x = 0; x < cols; x++)
            buf[p * nr + x] = b[(size_t)p * ldb + x];
}

/* C = alpha op(A) op(B) + beta C in tiles of mr x nr: columns of nr
 * outermost, so that op(B)'s K x nr panel is reused by every row tile. A
 * row stride of B that is a multiple of 256 bytes (nt = 256 tiles,
 * layer3's pieces) puts the panel's rows in a few of L1's sets, which
 * evict each other: then the panel is copied (K x nr floats, used by m /
 * mr row tiles); B^T's panel (tb, K <= ROW_K_MAX) is always copied. */
static void gemm_rows_in(tile_fn tile, int mr, int nr, bool ta, bool tb,
                         int m, int n, int k, float alpha, const float *a,
                         int lda, const float *b, int ldb, float beta,
                         float *c, int ldc)
{
    size_t rs = ta ? 1 : (size_t)lda, ps = ta ? (size_t)lda : 1;
    bool copy = tb || (k > 8 && k <= ROW_K_MAX && ldb % 64 == 0 && m > mr);
    _Alignas(64) float buf[ROW_K_MAX * NR_MAX];
    for (int j = 0; j < n; j += nr) {
        int cols = n - j < nr ? n - j : nr;
        const float *bj = tb ? b + (size_t)j * ldb : b + j;
        int ldbj = ldb;
        if (copy) {
            copy_panel(bj, ldb, tb, k, cols, nr, buf);
            bj = buf;
            ldbj = nr;
        }
        for (int i = 0; i < m; i += mr)
            tile(k, a + (size_t)i * rs, rs, ps, bj, ldbj, c + (size_t)i * ldc + j,
                 ldc, m - i < mr ? m - i : mr, cols, alpha, beta);
    }
}

/* The four sums of a0..a3's lanes, each in one fixed order. */
AVX2_INLINE __m128 sum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* acc[r][j] += A's row r times B's row j, 8 lanes from p (masked: the
 * lanes of mask, the rest 0). */
AVX2_INLINE void dot_step(const float *const *ar, const float *const *bc,
                          int p, bool masked, __m256i mask,
                          __m256 acc[MR][DR])
{
    __m256 bv[DR];
#pragma GCC unroll 3
    for (int j = 0; j < DR; j++)
        bv[j] = masked ? _mm256_maskload_ps(bc[j] + p, mask)
                       : _mm256_loadu_ps(bc[j] + p);
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++) {
        __m256 x = masked ? _mm256_maskload_ps(ar[r] + p, mask)
                          : _mm256_loadu_ps(ar[r] + p);
#pragma GCC unroll 3
        for (int j = 0; j < DR; j++)
            acc[r][j] = _mm256_fmadd_ps(x, bv[j], acc[r][j]);
    }
}

/* Column j of an NT tile from its rows' 8-lane sums acc0..acc3: C[r][j]
 * = alpha * (the lanes' sum, sum4's order) (+ beta C[r][j]), r < rows. */
AVX2_INLINE void dot_store(__m256 acc0, __m256 acc1, __m256 acc2,
                           __m256 acc3, float *c, int ldc, int rows,
                           float alpha, float beta)
{
    float s[4];
    _mm_storeu_ps(s, sum4(acc0, acc1, acc2, acc3));
    for (int r = 0; r < rows; r++) {
        float *cr = c + (size_t)r * ldc, o = alpha * s[r];
        *cr = beta != 0.0f ? o + beta * *cr : o;
    }
}

/* One NT tile: C[r][j] = dot(A's row r, B's row j) for r < rows, j < cols;
 * rows and columns past them repeat the last (computed, not stored); K's
 * last partial vector masked. */
AVX2 static void dot_tile(int k, const float *a, int lda, const float *b,
                          int ldb, float *c, int ldc, int rows, int cols,
                          float alpha, float beta)
{
    const float *ar[MR], *bc[DR];
    for (int r = 0; r < MR; r++)
        ar[r] = a + (size_t)(r < rows ? r : rows - 1) * lda;
    for (int j = 0; j < DR; j++)
        bc[j] = b + (size_t)(j < cols ? j : cols - 1) * ldb;
    __m256 acc[MR][DR];
#pragma GCC unroll 4
    for (int r = 0; r < MR; r++)
#pragma GCC unroll 3
        for (int j = 0; j < DR; j++)
            acc[r][j] = _mm256_setzero_ps();
    int p = 0;
    for (; p + 8 <= k; p += 8)
        dot_step(ar, bc, p, false, first_lanes(8), acc);
    if (p < k)
        dot_step(ar, bc, p, true, first_lanes(k - p), acc);
    for (int j = 0; j < cols; j++)
        dot_store(acc[0][j], acc[1][j], acc[2][j], acc[3][j], c + j, ldc,
                  rows, alpha, beta);
}

/* 8 floats at lo and 8 at hi in one 16-lane vector (masked: the lanes
 * of mask, the rest 0). */
AVX512_INLINE __m512 pair8(const float *lo, const float *hi, bool masked,
                           __m256i mask)
{
    __m256 l = masked ? _mm256_maskload_ps(lo, mask) : _mm256_loadu_ps(lo);
    __m256 h = masked ? _mm256_maskload_ps(hi, mask) : _mm256_loadu_ps(hi);
    return _mm512_castpd_ps(_mm512_insertf64x4(
        _mm512_castpd256_pd512(_mm256_castps_pd(l)), _mm256_castps_pd(h), 1));
}

/* dot_step on AVX-512: acc[r][q] holds the 8-lane sums of columns 2q
 * (low half) and 2q + 1 (high half), each lane the same FMA chain as in
 * 8 lanes. */
AVX512_INLINE void dot_step16(const float *const *ar, const float *const *bc,
                              int p, bool masked, __m256i mask,
                              __m512 acc[MR16][DR16 / 2])
{
    __m512 bv[DR16 / 2];
#pragma GCC unroll 3
    for (int q = 0; q < DR16 / 2; q++)
        bv[q] = pair8(bc[2 * q] + p, bc[2 * q + 1] + p, masked, mask);
#pragma GCC unroll 8
    for (int r = 0; r < MR16; r++) {
        __m256 h = masked ? _mm256_maskload_ps(ar[r] + p, mask)
                          : _mm256_loadu_ps(ar[r] + p);
        __m512 x = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(h)));
#pragma GCC unroll 3
        for (int q = 0; q < DR16 / 2; q++)
            acc[r][q] = _mm512_fmadd_ps(x, bv[q], acc[r][q]);
    }
}

/* dot_tile on AVX-512, MR16 x DR16: two columns to a vector, the same
 * floats as dot_tile. 8 rows, not 4: each of B's loads then feeds twice
 * the FMAs, and a tile's rows of A and B come from L2 (1.2x on resnet20's
 * weight gradients). */
AVX512 static void dot_tile16(int k, const float *a, int lda, const float *b,
                              int ldb, float *c, int ldc, int rows, int cols,
                              float alpha, float beta)
{
    const float *ar[MR16], *bc[DR16];
    for (int r = 0; r < MR16; r++)
        ar[r] = a + (size_t)(r < rows ? r : rows - 1) * lda;
    for (int j = 0; j < DR16; j++)
        bc[j] = b + (size_t)(j < cols ? j : cols - 1) * ldb;
    __m512 acc[MR16][DR16 / 2];
#pragma GCC unroll 8
    for (int r = 0; r < MR16; r++)
#pragma GCC unroll 3
        for (int q = 0; q < DR16 / 2; q++)
            acc[r][q] = _mm512_setzero_ps();
    int p = 0;
    for (; p + 8 <= k; p += 8)
        dot_step16(ar, bc, p, false, first_lanes(8), acc);
    if (p < k)
        dot_step16(ar, bc, p, true, first_lanes(k - p), acc);
    for (int r0 = 0; r0 < rows; r0 += MR) /* dot_store's 4 rows at a time */
        for (int j = 0; j < cols; j++) {
            __m256 h[MR];
            for (int r = 0; r < MR; r++) {
                __m512d v = _mm512_castps_pd(acc[r0 + r][j / 2]);
                h[r] = _mm256_castpd_ps(j % 2 ? _mm512_extractf64x4_pd(v, 1)
                                              : _mm512_castpd512_pd256(v));
            }
            dot_store(h[0], h[1], h[2], h[3], c + (size_t)r0 * ldc + j, ldc,
                      rows - r0 < MR ? rows - r0 : MR, alpha, beta);
        }
}

/* An ISA's NT tile (dot_tile, dot_tile16). */
typedef void (*dot_fn)(int k, const float *a, int lda, const float *b,
                       int ldb, float *c, int ldc, int rows, int cols,
                       float alpha, float beta);

/* C = alpha A B^T + beta C in tiles of MR x dr: A's MR rows stay in cache
 * while B's rows go by. */
static void gemm_dots(int lanes, int m, int n, int k, float alpha,
                      const float *a, int lda, const float *b, int ldb,
                      float beta, float *c, int ldc)
{
    dot_fn tile = lanes == 16 ? dot_tile16 : dot_tile;
    int dr = lanes == 16 ? DR16 : DR, mr = lanes == 16 ? MR16 : MR;
    for (int i = 0; i < m; i += mr) {
        int rows = m - i < mr ? m - i : mr;
        for (int j = 0; j < n; j += dr)
            tile(k, a + (size_t)i * lda, lda, b + (size_t)j * ldb, ldb,
                 c + (size_t)i * ldc + j, ldc, rows, n - j < dr ? n - j : dr,
                 alpha, beta);
    }
}

/* (libgcc's constructor has filled in what __builtin_cpu_supports reads:
 * no state of our own to race on) */
bool stk_small_gemm_available(void)
{
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

int stk_small_gemm_lanes(void)
{
    return __builtin_cpu_supports("avx512f") ? 16 : 8;
}

static void gemm_rows(int lanes, bool ta, bool tb, int m, int n, int k,
                      float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc)
{
    if (lanes == 16)
        gemm_rows_in(tile_avx512, MR16, NR16, ta, tb, m, n, k, alpha, a, lda,
                     b, ldb, beta, c, ldc);
    else
        gemm_rows_in(tile_avx2, MR, NR, ta, tb, m, n, k, alpha, a, lda, b,
                     ldb, beta, c, ldc);
}

#else /* no x86-64: OpenBLAS serves every GEMM */

bool stk_small_gemm_available(void) { return false; }
int stk_small_gemm_lanes(void) { return 8; }
static void gemm_rows(int lanes, bool ta, bool tb, int m, int n, int k,
                      float alpha, const float *a, int lda, const float *b,
                      int ldb, float beta, float *c, int ldc)
{
    (void)lanes, (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha;
    (void)a, (void)lda, (void)b, (void)ldb, (void)beta, (void)c, (void)ldc;
}
static void gemm_dots(int lanes, int m, int n, int k, float alpha,
                      const float *a, int lda, const float *b, int ldb,
                      float beta, float *c, int ldc)
{
    gemm_rows(lanes, false, true, m, n, k, alpha, a, lda, b, ldb, beta, c,
              ldc);
}

#endif

/* From bench/small_gemm_bench on resnet20's shapes (Zen 3, one thread):
 * OpenBLAS wins from about 64 x 64 dot products of K ~ 256, on dot
 * products shorter than about 128 (the lanes' sums at the end of a tile
 * cost as much as the tile) and over a K of 288 on the row path, where
 * both run near the core's peak; the K and A bounds keep a row tile's
 * operands in L1/L2 and a dot tile's rows in L2 (nothing here blocks for
 * cache). The choice depends on the shape alone, not on the vector
 * width, so that CPUs with and without AVX-512 compute the same floats.
 * In 16 lanes (Zen 5, whose OpenBLAS 0.3.21 runs its Haswell kernels) the
 * row path is 1.5-2.2x OpenBLAS, also at K = 288, and the dot products
 * 1.2-1.5x up to C of 64 x 72, but those keep OpenBLAS as in 8 lanes.
 * NT products over K <= ROW_K_MAX on the row path with B^T's panels
 * copied: in 16 lanes 1.3-1.6x OpenBLAS (64 x 64 x 256, Winograd's dU of
 * resnet20's last stage, 7% of a step on OpenBLAS), in 8 lanes 0.92-0.97x
 * on Zen 5, up to C of 4096 elements at first; since B^T's panels are
 * transposed in registers (8 x 8 blocks), 1.08-1.14x in 8 lanes and
 * 1.8-2x in 16 on the strided convolutions' weight gradients too (C of
 * 32 x 144 to 256 x 1152, K 49-196), hence a C of up to 512 Ki elements.
 * (NN over K > 256 stays on OpenBLAS: 1.7x in 16 lanes but 0.82-0.94x in
 * 8, K 288-1152.) (A linear layer's forward, batch x
 * 64 over K = 1568, routed to the dot tiles took tests/e2e/sync_bn.py's
 * 1 x 128 and 2 x 64 runs apart: a chaotic 9e-5 in the loss at step 20,
 * against 6e-7 with OpenBLAS, the results themselves as exact.) */
bool stk_small_gemm_wins(bool ta, bool tb, int m, int n, int k)
{
    if (!stk_small_gemm_available() || (ta && tb) || m < 1 || n < 1)
        return false;
    if (tb && k <= ROW_K_MAX) /* B^T's panels on the row path */
        return (size_t)m * n <= 512 * 1024;
    if (tb) /* dot products: C small, K long */
        return (size_t)m * n <= 2048 && k >= 128 && k <= 4096;
    return k <= ROW_K_MAX && (size_t)m * k <= 64 * 1024;
}

void stk_small_gemm_at(int lanes, bool ta, bool tb, int m, int n, int k,
                       float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc)
{
    lanes = lanes == 16 && stk_small_gemm_lanes() == 16 ? 16 : 8;
    if (tb && k > ROW_K_MAX) /* too long to copy B^T's panels */
        gemm_dots(lanes, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else
        gemm_rows(lanes, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c,
                  ldc);
}

void stk_small_gemm(bool ta, bool tb, int m, int n, int k, float alpha,
                    const float *a, int lda, const float *b, int ldb,
                    float beta, float *c, int ldc)
{
    stk_small_gemm_at(stk_small_gemm_lanes(), ta, tb, m, n, k, alpha, a, lda,
                      b, ldb, beta, c, ldc);
}
