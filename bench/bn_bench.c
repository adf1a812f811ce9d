/* bn_bench - the CPU's batchnorm passes (kernels/cpu.c) on resnet20's
 * three activation shapes at batch 128, one thread: GB/s of each pass
 * (the bytes it must read and write once) and ns per element, best of
 * `rounds` (default 10). The passes' results are tested in
 * tests/unit/test_kernels.c; this only times them. */
#include "kernels/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef struct shape {
    const char *what;
    int c, hw;
} shape;

static const shape shapes[] = {
    {"16ch 28x28", 16, 784}, {"32ch 14x14", 32, 196}, {"64ch 7x7", 64, 49}};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); /* not the time descheduled */
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float *filled(size_t n, float lo)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; p && i < n; i++)
        p[i] = lo + (float)rand() / RAND_MAX;
    return p;
}

enum { MEAN, VAR, APPLY, GRAD_SUMS, INPUT_GRAD, KINDS };
static const char *const kind_name[KINDS] = {"mean", "var", "apply_relu",
                                             "grad_sums", "input_grad"};
/* floats each pass reads and writes per element (the backward passes
 * recompute the fused ReLU's output from x) */
static const int streams[KINDS] = {1, 1, 2, 2, 3};

typedef struct bufs {
    float *x, *y, *dy, *dx, *mean, *var, *gamma, *beta, *sums;
} bufs;

static int one(stk_backend *be, int kind, int n, int c, int hw, bufs *b,
               stk_err *err)
{
    double scale = 1.0 / ((double)n * hw);
    switch (kind) {
    case MEAN:
        return stk_bn_sums(be, b->x, n, c, hw, NULL, scale, b->mean, err);
    case VAR:
        return stk_bn_sums(be, b->x, n, c, hw, b->mean, scale, b->var, err);
    case APPLY:
        return stk_bn_apply(be, b->x, b->y, n, c, hw, b->mean, b->var, 1e-5f,
                            b->gamma, b->beta, true, err);
    case GRAD_SUMS:
        return stk_bn_grad_sums(be, b->dy, b->x, n, c, hw, b->mean, b->var,
                                1e-5f, b->gamma, b->beta, true, b->sums, err);
    default:
        return stk_bn_input_grad(be, b->dy, b->x, n, c, hw, b->mean, b->var,
                                 1e-5f, b->gamma, b->beta, true, b->sums,
                                 (float)scale, b->dx, err);
    }
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 10, n = 128;
    stk_err err = {0};
    stk_backend *be;
    if (stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err)) {
        fprintf(stderr, "bn_bench: %s\n", err.msg);
        return 1;
    }
    printf("%-12s", "shape");
    for (int k = 0; k < KINDS; k++)
        printf(" %16s", kind_name[k]);
    printf("   (GB/s, ns per element; best of %d)\n", rounds);
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        int c = shapes[i].c, hw = shapes[i].hw;
        size_t len = (size_t)n * c * hw;
        bufs b = {filled(len, -0.5f), filled(len, -0.5f), filled(len, -0.5f),
                  filled(len, -0.5f), filled(c, -0.5f), filled(c, 0.5f),
                  filled(c, 0.5f),   filled(c, -0.5f),  filled(2 * c, -0.5f)};
        if (!b.x || !b.y || !b.dy || !b.dx || !b.mean || !b.var || !b.gamma ||
            !b.beta || !b.sums)
            return 1;
        printf("%-12s", shapes[i].what);
        for (int k = 0; k < KINDS; k++) {
            double best = 1e9;
            for (int r = 0; r < rounds; r++) {
                double t0 = now();
                if (one(be, k, n, c, hw, &b, &err)) {
                    fprintf(stderr, "bn_bench: %s\n", err.msg);
                    return 1;
                }
                double dt = now() - t0;
                best = dt < best ? dt : best;
            }
            printf("   %6.1f %6.3f", streams[k] * 4.0 * len / best * 1e-9,
                   best * 1e9 / (double)len);
        }
        printf("\n");
        float **all = (float **)&b;
        for (size_t f = 0; f < sizeof b / sizeof b.x; f++)
            free(all[f]);
    }
    stk_backend_destroy(be);
    return 0;
}
