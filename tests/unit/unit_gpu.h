/* unit_gpu.h - the main of the test files that run every case on the CPU
 * backend and on the GPU (the file's `cpu` and `gpu`): exits 77 (skipped)
 * with the reason where there is no GPU or no CUDA build, 1 where CUDA is
 * there but does not work. STK_GPU_TESTS_ON_CPU=1 puts a second CPU backend
 * (2 threads) in the GPU's place, to run the tests' CPU side on a machine
 * without one. */
#ifndef STK_UNIT_GPU_H
#define STK_UNIT_GPU_H

#include "unit.h"

#include "kernels/kernels.h"

#include <stdbool.h>

/* Opens *cpu (cpu_threads, 0 = one per CPU) and *gpu; 0, 77 or 1. */
static inline int unit_gpu_open(int cpu_threads, stk_backend **cpu,
                                stk_backend **gpu)
{
    stk_err err = {0};
    bool on_cpu = getenv("STK_GPU_TESTS_ON_CPU") != NULL;
    int n = 0, rc = on_cpu ? 0 : stk_cuda_device_count(&n, &err);
    if (rc == STK_ENODEV) {
        printf("SKIP: %s\n", err.msg);
        return 77;
    }
    if (rc || stk_backend_create(STK_DEV_CPU, 0, cpu_threads, cpu, &err) ||
        stk_backend_create(on_cpu ? STK_DEV_CPU : STK_DEV_CUDA, 0,
                           on_cpu ? 2 : 0, gpu, &err)) {
        printf("FAIL: %s\n", err.msg);
        return 1;
    }
    return 0;
}

#define UNIT_GPU_MAIN(tests, cpu_threads)                                      \
    int main(int argc, char **argv)                                            \
    {                                                                          \
        int rc = unit_gpu_open(cpu_threads, &cpu, &gpu);                       \
        if (!rc && argc > 1 &&                                                 \
            !unit_filter_matches(tests, sizeof tests / sizeof *tests,          \
                                 argv[1]))                                     \
            rc = 1;                                                            \
        else if (!rc && argc > 1)                                              \
            cmocka_set_test_filter(argv[1]);                                   \
        if (!rc)                                                               \
            rc = cmocka_run_group_tests(tests, NULL, NULL);                    \
        stk_backend_destroy(gpu);                                              \
        stk_backend_destroy(cpu);                                              \
        return rc;                                                             \
    }

#endif
