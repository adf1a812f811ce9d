/* cpu_gemm.h - private to the CPU backend: a small-GEMM path (cpu_gemm.c)
 * for the shapes of the Winograd point GEMMs and the im2col convolutions,
 * where OpenBLAS spends its time packing, zeroing C and being called. */
#ifndef STK_CPU_GEMM_H
#define STK_CPU_GEMM_H

#include <stdbool.h>

/* Whether this CPU has AVX2 and FMA, which stk_small_gemm needs. */
bool stk_small_gemm_available(void);

/* Whether stk_small_gemm serves this GEMM and beats OpenBLAS on it: false
 * on a CPU without AVX2 and FMA, for A and B both transposed, and for the
 * shapes where OpenBLAS wins. Depends on the shape alone. */
bool stk_small_gemm_wins(bool ta, bool tb, int m, int n, int k);

/* C = alpha op(A) op(B) + beta C, row-major, as cblas_sgemm (beta 0: C is
 * not read), A and B not both transposed, on a CPU where
 * stk_small_gemm_available (stk_small_gemm_wins says for which shapes it
 * is worth it). Every element of C is summed
 * over K in one fixed order, so a part of C computed alone (a panel of
 * rows or columns) has the same floats as within the whole. */
void stk_small_gemm(bool ta, bool tb, int m, int n, int k, float alpha,
                    const float *a, int lda, const float *b, int ldb,
                    float beta, float *c, int ldc);

/* The vector width stk_small_gemm works in: 16 floats where the CPU has
 * AVX-512F, else 8. */
int stk_small_gemm_lanes(void);

/* stk_small_gemm in `lanes`-wide vectors: 16 where stk_small_gemm_lanes
 * is 16, else 8 (the CPU backend without AVX-512 paths, the tests,
 * bench/small_gemm_bench). Both widths give the same floats: each element
 * of C the same FMAs in the same order, the dot products summed in 8
 * lanes at both. */
void stk_small_gemm_at(int lanes, bool ta, bool tb, int m, int n, int k,
                       float alpha, const float *a, int lda, const float *b,
                       int ldb, float beta, float *c, int ldc);

#endif
