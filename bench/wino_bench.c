/* wino_bench - the CPU's Winograd transforms (kernels/cpu.c) on resnet20's
 * 3x3 convolutions of 28x28 inputs, one thread, each on one piece of the
 * batch as the trainer sizes it (a 1 MiB M, trainer/model.c): ns per tile
 * of the input, output, output-gradient and input-gradient transforms,
 * best of `rounds` (default 20). The transforms' results are tested in
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
    {"16ch 28x28", 16, 28}, {"32ch 14x14", 32, 14}, {"64ch 7x7", 64, 7}};

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); /* not the time descheduled */
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static float *filled(size_t n)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; p && i < n; i++)
        p[i] = (float)rand() / RAND_MAX - 0.5f;
    return p;
}

enum { INPUT, OUTPUT, OUTPUT_GRAD, INPUT_GRAD, KINDS };
static const char *const kind_name[KINDS] = {"input", "output", "output_grad",
                                             "input_grad"};

static int one(stk_backend *be, int kind, const stk_conv_shape *s, int n,
               float *x, float *v, float *m, float *b, stk_err *err)
{
    switch (kind) {
    case INPUT:
        return stk_wino_input(be, x, s, n, v, err);
    case OUTPUT:
        return stk_wino_output(be, m, b, s, s->c, n, x, err);
    case OUTPUT_GRAD:
        return stk_wino_output_grad(be, x, s, s->c, n, m, err);
    default:
        return stk_wino_input_grad(be, v, s, n, x, err);
    }
}

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 20;
    stk_err err = {0};
    stk_backend *be;
    if (stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err)) {
        fprintf(stderr, "wino_bench: %s\n", err.msg);
        return 1;
    }
    printf("%-12s %6s %6s", "shape", "piece", "tiles");
    for (int k = 0; k < KINDS; k++)
        printf(" %12s", kind_name[k]);
    printf("   (ns per tile, best of %d)\n", rounds);
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        int c = shapes[i].c, hw = shapes[i].hw, th, tw;
        stk_conv_shape s = {c, hw, hw, 3, 3, 1, 1, 1, 1, hw, hw};
        int tiles = stk_wino_tiles(&s, &th, &tw);
        /* the piece trainer/model.c sizes for M, of a batch of 128 */
        int n = stk_conv_chunk(be, (size_t)STK_WINO_P * c * tiles * sizeof(float),
                               128);
        size_t nt = (size_t)n * tiles,
               vs = STK_WINO_P * stk_wino_stride((size_t)c * nt);
        float *x = filled((size_t)n * c * hw * hw), *v = filled(vs),
              *m = filled(vs), *b = filled((size_t)c);
        if (!x || !v || !m || !b)
            return 1;
        printf("%-12s %6d %6zu", shapes[i].what, n, nt * c);
        for (int k = 0; k < KINDS; k++) {
            double best = 1e9;
            for (int r = 0; r < rounds; r++) {
                double t0 = now();
                for (int rep = 0; rep < 20; rep++)
                    if (one(be, k, &s, n, x, v, m, b, &err)) {
                        fprintf(stderr, "wino_bench: %s\n", err.msg);
                        return 1;
                    }
                double dt = (now() - t0) / 20;
                best = dt < best ? dt : best;
            }
            printf(" %12.2f", best * 1e9 / (double)(nt * c));
        }
        printf("\n");
        free(x);
        free(v);
        free(m);
        free(b);
    }
    stk_backend_destroy(be);
    return 0;
}
