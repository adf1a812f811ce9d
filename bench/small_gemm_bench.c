/* small_gemm_bench - the small-GEMM path (kernels/cpu_gemm.c) against
 * OpenBLAS, one thread, on resnet20's convolution shapes on 28x28 inputs:
 * each shape as a batch of `count` GEMMs on distinct operands (16 for a
 * Winograd layer's point GEMMs, a piece's samples for im2col), checked
 * against a double-precision reference first, then timed interleaved:
 * OpenBLAS, the 8-lane (AVX2) path and, on a CPU with AVX-512F, the
 * 16-lane one (0 where there is none).
 * With an argument (cold), 8 MiB are written between batches. Prints ns
 * per batch of each and OpenBLAS's time over the path stk_small_gemm takes. */
#include "kernels/cpu_gemm.h"

#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

void openblas_set_num_threads(int n);

typedef struct shape {
    const char *what;
    bool ta, tb;
    int m, n, k, count;
    float beta;
} shape;

static const shape shapes[] = {
    {"wino fwd stem", 0, 0, 16, 980, 1, 16, 0},
    {"wino fwd 16", 0, 0, 16, 980, 16, 16, 0},
    {"wino fwd 32", 0, 0, 32, 490, 32, 16, 0},
    {"wino fwd 64", 0, 0, 64, 256, 64, 16, 0},
    {"wino fwd 64 nt 250", 0, 0, 64, 250, 64, 16, 0},
    {"wino fwd 64 nt 272", 0, 0, 64, 272, 64, 16, 0},
    {"wino dU 64 nt 250", 0, 1, 64, 64, 250, 16, 1},
    {"wino dU 64 nt 272", 0, 1, 64, 64, 272, 16, 1},
    {"wino dU stem", 0, 1, 16, 1, 980, 16, 1},
    {"wino dU 16", 0, 1, 16, 16, 980, 16, 1},
    {"wino dU 32", 0, 1, 32, 32, 490, 16, 1},
    {"wino dU 64", 0, 1, 64, 64, 256, 16, 1},
    {"wino dV 16", 1, 0, 16, 980, 16, 16, 0},
    {"wino dV 32", 1, 0, 32, 490, 32, 16, 0},
    {"wino dV 64", 1, 0, 64, 256, 64, 16, 0},
    {"im2col fwd 3x3/2 32", 0, 0, 32, 196, 144, 10, 0},
    {"im2col fwd 3x3/2 64", 0, 0, 64, 49, 288, 16, 0},
    {"im2col fwd 1x1/2 32", 0, 0, 32, 196, 16, 10, 0},
    {"im2col fwd 1x1/2 64", 0, 0, 64, 49, 32, 16, 0},
    {"im2col dcol 3x3/2 32", 1, 0, 144, 196, 32, 10, 0},
    {"im2col dcol 3x3/2 64", 1, 0, 288, 49, 64, 16, 0},
    {"im2col dcol 1x1/2 32", 1, 0, 16, 196, 32, 10, 0},
    {"im2col dcol 1x1/2 64", 1, 0, 32, 49, 64, 16, 0},
    {"im2col dW 3x3/2 32", 0, 1, 32, 144, 196, 1, 1},
    {"im2col dW 3x3/2 64", 0, 1, 64, 288, 49, 1, 1},
    {"im2col dW 1x1/2 32", 0, 1, 32, 16, 196, 1, 1},
    {"im2col dW 1x1/2 64", 0, 1, 64, 32, 49, 1, 1},
    /* resnet18's (CIFAR stem) strided weight gradients on 28x28 inputs:
     * larger C on the NT row path */
    {"r18 fwd 3x3/2 128", 0, 0, 128, 196, 576, 10, 0},
    {"r18 fwd 3x3/2 256", 0, 0, 256, 49, 1152, 16, 0},
    {"r18 dW 1x1/2 128", 0, 1, 128, 64, 196, 1, 1},
    {"r18 dW 3x3/2 128", 0, 1, 128, 576, 196, 1, 1},
    {"r18 dW 3x3/2 256", 0, 1, 256, 1152, 49, 1, 1},
    {"fc fwd", 0, 1, 128, 10, 64, 1, 0},
    {"fc dW", 1, 0, 10, 64, 128, 1, 1},
    {"fc dx", 0, 0, 128, 64, 10, 1, 0},
};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); /* not the time descheduled */
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* which: 0 OpenBLAS, else stk_small_gemm in `which` lanes (8 or 16) */
static void run(const shape *s, int which, const float *a, const float *b,
                float *c)
{
    int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n, ldc = s->n;
    size_t sa = (size_t)s->m * s->k, sb = (size_t)s->k * s->n,
           sc = (size_t)s->m * s->n;
    for (int i = 0; i < s->count; i++) {
        if (which)
            stk_small_gemm_at(which, s->ta, s->tb, s->m, s->n, s->k, 1.0f,
                              a + i * sa, lda, b + i * sb, ldb, s->beta,
                              c + i * sc, ldc);
        else
            cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans,
                        s->tb ? CblasTrans : CblasNoTrans, s->m, s->n, s->k,
                        1.0f, a + i * sa, lda, b + i * sb, ldb, s->beta,
                        c + i * sc, ldc);
    }
}

/* the first GEMM of the batch against a double loop (beta 0), in `lanes` */
static int check(const shape *s, int lanes, const float *a, const float *b,
                 float *c)
{
    shape one = *s;
    one.count = 1;
    one.beta = 0;
    run(&one, lanes, a, b, c);
    int lda = s->ta ? s->m : s->k, ldb = s->tb ? s->k : s->n;
    for (int i = 0; i < s->m; i++)
        for (int j = 0; j < s->n; j++) {
            double r = 0;
            for (int p = 0; p < s->k; p++)
                r += (double)(s->ta ? a[p * lda + i] : a[i * lda + p]) *
                     (s->tb ? b[j * ldb + p] : b[p * ldb + j]);
            if (fabs(c[i * s->n + j] - r) > 1e-4 * (1 + fabs(r))) {
                fprintf(stderr, "%s: C[%d][%d] = %g, expected %g\n", s->what,
                        i, j, c[i * s->n + j], r);
                return 1;
            }
        }
    return 0;
}

enum { FLUSH = 1 << 21 }; /* 8 MiB */

int main(int argc, char **argv)
{
    (void)argv;
    bool cold = argc > 1; /* any argument: the caches flushed before each batch */
    float *flush = calloc(FLUSH, 4);
    openblas_set_num_threads(1);
    if (!stk_small_gemm_wins(false, false, 16, 16, 16))
        printf("(this CPU lacks AVX2+FMA: the small path is off)\n");
    int wide = stk_small_gemm_lanes(); /* 16 with AVX-512F */
    printf("%-22s %4s %4s %4s %5s %10s %10s %10s %7s %s\n", "shape", "m", "n",
           "k", "count", "blas ns", "8 lanes", "16 lanes", "blas/sm", "wins");
    for (size_t t = 0; t < sizeof shapes / sizeof *shapes; t++) {
        const shape *s = &shapes[t];
        size_t sa = (size_t)s->m * s->k * s->count,
               sb = (size_t)s->k * s->n * s->count,
               sc = (size_t)s->m * s->n * s->count;
        float *a = malloc(sa * 4), *b = malloc(sb * 4), *c = malloc(sc * 4);
        for (size_t i = 0; i < sa; i++)
            a[i] = (float)rand() / RAND_MAX - 0.5f;
        for (size_t i = 0; i < sb; i++)
            b[i] = (float)rand() / RAND_MAX - 0.5f;
        for (size_t i = 0; i < sc; i++)
            c[i] = 0;
        if (check(s, 8, a, b, c) || (wide == 16 && check(s, 16, a, b, c)))
            return 1;
        int which[3] = {0, 8, wide};
        double best[3] = {1e9, 1e9, 1e9};
        int reps = cold ? 1
                        : (int)(2e8 / (2.0 * s->m * s->n * s->k * s->count)) + 1;
        for (int round = 0; round < (cold ? 40 : 10); round++)
            for (int w = 0; w < (wide == 16 ? 3 : 2); w++) {
                if (cold) /* the operands out of L1/L2, as after a transform */
                    for (size_t i = 0; i < FLUSH; i++)
                        flush[i] += 1.0f;
                double t0 = now();
                for (int r = 0; r < reps; r++)
                    run(s, which[w], a, b, c);
                double dt = (now() - t0) / reps;
                best[w] = dt < best[w] ? dt : best[w];
            }
        double small = wide == 16 ? best[2] : best[1];
        printf("%-22s %4d %4d %4d %5d %10.0f %10.0f %10.0f %7.2f %s\n",
               s->what, s->m, s->n, s->k, s->count, best[0] * 1e9,
               best[1] * 1e9, wide == 16 ? best[2] * 1e9 : 0.0, best[0] / small,
               stk_small_gemm_wins(s->ta, s->tb, s->m, s->n, s->k) ? "small"
                                                                   : "blas");
        free(a);
        free(b);
        free(c);
    }
    return 0;
}
