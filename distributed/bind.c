/* bind.c - CPU ranks of one machine on disjoint CPUs.
 *
 * Left to the scheduler, a rank's loader and communication threads land on
 * a peer's core now and then; that peer loses the time, and since the
 * ranks meet at every step, all of them wait for it. Bound, each rank's
 * helpers take time from its own compute threads, the same on every rank.
 * CPUs are handed out in topology order (package, core), so that a rank's
 * group keeps hyper-threads of one core together and stays on one socket
 * where it can. */
#include "distributed.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct cpu_key {
    int package, core, cpu;
} cpu_key;

/* /sys/devices/system/cpu/cpuN/topology/NAME, or fallback. */
static int topology(int cpu, const char *name, int fallback)
{
    char path[96];
    snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/%s", cpu,
             name);
    FILE *f = fopen(path, "r");
    int v;
    if (!f)
        return fallback;
    if (fscanf(f, "%d", &v) != 1)
        v = fallback;
    fclose(f);
    return v;
}

static int by_topology(const void *a, const void *b)
{
    const cpu_key *x = a, *y = b;
    if (x->package != y->package)
        return x->package < y->package ? -1 : 1;
    if (x->core != y->core)
        return x->core < y->core ? -1 : 1;
    return (x->cpu > y->cpu) - (x->cpu < y->cpu);
}

int stk_rank_bind_cpus(const stk_rank_info *ri, int threads, stk_err *err)
{
    cpu_set_t usable, mine;
    if (ri->local_world < 2 || sched_getaffinity(0, sizeof usable, &usable) != 0)
        return 0;
    /* an equal share each, not just `threads` CPUs: the loader's workers
     * use the rest of it */
    int group = CPU_COUNT(&usable) / ri->local_world;
    if (group < 1 || group < threads)
        return 0;
    cpu_key *keys = malloc((size_t)CPU_COUNT(&usable) * sizeof *keys);
    if (!keys)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    int n = 0;
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++)
        if (CPU_ISSET(cpu, &usable))
            keys[n++] = (cpu_key){topology(cpu, "physical_package_id", 0),
                                  topology(cpu, "core_id", cpu), cpu};
    qsort(keys, (size_t)n, sizeof *keys, by_topology);
    CPU_ZERO(&mine);
    for (int k = ri->local_rank * group; k < (ri->local_rank + 1) * group; k++)
        CPU_SET(keys[k].cpu, &mine);
    free(keys);
    if (sched_setaffinity(0, sizeof mine, &mine) != 0)
        return stk_fail(err, STK_EIO, "rank %d: cannot bind to its CPUs: %s",
                        ri->rank, strerror(errno));
    return 1;
}
