/* sgemm_peak.c - this machine's OpenBLAS single-precision GEMM peak, the
 * denominator of bench/train_bench.sh's "% of SGEMM peak".
 *
 *   cc -O2 -o sgemm_peak bench/sgemm_peak.c -lopenblas
 *   sgemm_peak [--n N] [--threads T] [--reps R]
 *
 * Times C = A * B for N x N row-major float matrices (cblas_sgemm, no
 * transposes, alpha 1, beta 0) with openblas_set_num_threads(T), one
 * untimed warm-up call then R timed calls, and prints one JSON line with
 * the best and the median GFLOP/s (2 N^3 flops per call). */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

void openblas_set_num_threads(int num_threads);
char *openblas_get_config(void);
char *openblas_get_corename(void);

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    int n = 2048, threads = 1, reps = 5;
    for (int i = 1; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "--n"))
            n = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--threads"))
            threads = atoi(argv[++i]);
        else if (i + 1 < argc && !strcmp(argv[i], "--reps"))
            reps = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: sgemm_peak [--n N] [--threads T] [--reps R]\n");
            return 2;
        }
    }
    if (n < 1 || threads < 1 || reps < 1 || reps > 1000) {
        fprintf(stderr, "sgemm_peak: bad arguments\n");
        return 2;
    }
    openblas_set_num_threads(threads);
    size_t count = (size_t)n * (size_t)n;
    float *a = malloc(count * sizeof *a), *b = malloc(count * sizeof *b),
          *c = malloc(count * sizeof *c);
    double *gf = malloc((size_t)reps * sizeof *gf);
    if (!a || !b || !c || !gf) {
        fprintf(stderr, "sgemm_peak: out of memory\n");
        return 1;
    }
    unsigned s = 12345;
    for (size_t i = 0; i < count; i++) {
        s = s * 1664525u + 1013904223u;
        a[i] = (float)(s >> 8) / 16777216.0f - 0.5f;
        s = s * 1664525u + 1013904223u;
        b[i] = (float)(s >> 8) / 16777216.0f - 0.5f;
        c[i] = 0.0f;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f, c, n);
    double flops = 2.0 * (double)n * (double)n * (double)n;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a, n, b, n, 0.0f,
                    c, n);
        gf[r] = flops / (now() - t0) / 1e9;
    }
    qsort(gf, (size_t)reps, sizeof *gf, cmp);
    /* c[0] printed so that the calls cannot be optimised away */
    printf("{\"n\": %d, \"threads\": %d, \"reps\": %d, \"best_gflops\": %.2f, "
           "\"median_gflops\": %.2f, \"core\": \"%s\", \"config\": \"%s\", \"check\": %.4g}\n",
           n, threads, reps, gf[reps - 1], gf[reps / 2], openblas_get_corename(),
           openblas_get_config(), (double)c[0]);
    free(a);
    free(b);
    free(c);
    free(gf);
    return 0;
}
