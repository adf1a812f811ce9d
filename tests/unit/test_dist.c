/* test_dist - the rendezvous store (set, get that waits, add, barrier,
 * timeouts, a taken port), the shared-memory collectives between forked
 * rank processes (all-reduce bitwise equal to the rank-order sum on every
 * rank, average, broadcast, a peer that dies, a resident buffer summed in
 * place), the DDP bucket plan, and
 * the CPU ranks' binding to disjoint CPUs. */
#include "unit.h"

#include "dist/dist.h"
#include "tests/fork_ranks.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>

static stk_store_server *serve(int *port)
{
    stk_store_server *s;
    stk_err err;
    assert_int_equal(stk_store_server_start("127.0.0.1", 0, port, &s, &err), 0);
    assert_true(*port > 0);
    return s;
}

static stk_kv *client(int port)
{
    stk_kv *kv;
    stk_err err;
    assert_int_equal(stk_kv_connect("127.0.0.1", port, 2000, &kv, &err), 0);
    return kv;
}

typedef struct getter {
    int port;
    char got[64];
    int rc;
} getter;

static void *get_later(void *arg)
{
    getter *g = arg;
    stk_kv *kv = client(g->port);
    void *v;
    size_t n;
    stk_err err;
    g->rc = stk_kv_get(kv, "late", 5000, &v, &n, &err);
    if (!g->rc) {
        snprintf(g->got, sizeof g->got, "%.*s", (int)n, (char *)v);
        free(v);
    }
    stk_kv_close(kv);
    return NULL;
}

static void store_set_get_add(void **state)
{
    (void)state;
    int port;
    stk_store_server *s = serve(&port);
    stk_kv *kv = client(port);
    stk_err err;
    void *v;
    size_t n;
    /* a GET parked before its key exists is answered by the SET */
    getter g = {port, "", -1};
    pthread_t t;
    pthread_create(&t, NULL, get_later, &g);
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
    assert_int_equal(stk_kv_set(kv, "late", "value", 5, &err), 0);
    pthread_join(t, NULL);
    assert_int_equal(g.rc, 0);
    assert_string_equal(g.got, "value");
    /* binary values round trip; a SET replaces */
    uint8_t blob[300];
    for (int i = 0; i < 300; i++)
        blob[i] = (uint8_t)(i * 7);
    assert_int_equal(stk_kv_set(kv, "blob", blob, sizeof blob, &err), 0);
    assert_int_equal(stk_kv_get(kv, "blob", 1000, &v, &n, &err), 0);
    assert_int_equal(n, sizeof blob);
    assert_memory_equal(v, blob, sizeof blob);
    free(v);
    int64_t after;
    assert_int_equal(stk_kv_add(kv, "count", 5, &after, &err), 0);
    assert_int_equal(after, 5);
    assert_int_equal(stk_kv_add(kv, "count", -2, &after, &err), 0);
    assert_int_equal(after, 3);
    /* ADD on a value that is not a counter is refused */
    assert_int_equal(stk_kv_add(kv, "blob", 1, &after, &err), STK_EINVAL);
    stk_kv_close(kv);
    stk_store_server_stop(s);
}

static void store_timeouts_and_taken_port(void **state)
{
    (void)state;
    int port;
    stk_store_server *s = serve(&port);
    stk_kv *kv = client(port);
    stk_err err;
    void *v;
    size_t n;
    double t0 = stk_now();
    assert_int_equal(stk_kv_get(kv, "never", 300, &v, &n, &err), STK_ETIMEDOUT);
    assert_true(stk_now() - t0 < 2.0);
    assert_non_null(strstr(err.msg, "'never'"));
    stk_kv_close(kv);
    /* a barrier that only one of two ranks reaches */
    kv = client(port);
    assert_int_equal(stk_kv_barrier(kv, "lonely", 2, 300, &err), STK_ETIMEDOUT);
    assert_non_null(strstr(err.msg, "1 of 2 ranks"));
    stk_kv_close(kv);
    /* the same port again */
    stk_store_server *again;
    int bound;
    assert_int_equal(stk_store_server_start("127.0.0.1", port, &bound, &again, &err),
                     STK_EEXIST);
    assert_non_null(strstr(err.msg, "already in use"));
    stk_store_server_stop(s);
    /* nothing listens any more */
    t0 = stk_now();
    assert_int_equal(stk_kv_connect("127.0.0.1", port, 300, &kv, &err), STK_ETIMEDOUT);
    assert_non_null(strstr(err.msg, "cannot reach the rendezvous store"));
}

/* ---- collectives between forked ranks ---------------------------------- */

enum { N = 2500001 }; /* spans several 4 MiB chunks, and an odd tail */

static float value(int rank, size_t i)
{
    return sinf((float)i * 0.001f + (float)rank) * (float)(rank + 1) + 1e-3f * (float)(i % 97);
}

/* The resident buffer: a sub-range summed in place leaves the rest alone,
 * both give the rank-order sum's bits; a buffer /dev/shm cannot hold is
 * none, on every rank, and no error. */
static int resident_checks(stk_comm *c, stk_kv *kv, int rank, int world,
                           const float *want)
{
    stk_err err;
    float *x, *none;
    struct statvfs v;
    size_t huge = statvfs("/dev/shm", &v) ? 0 : (size_t)v.f_bavail * v.f_frsize / 4;
    if (stk_comm_resident(c, kv, huge, &none, &err) || none) {
        fprintf(stderr, "rank %d: a resident buffer larger than /dev/shm\n", rank);
        return 20;
    }
    if (stk_comm_resident(c, kv, N, &x, &err) || !x) {
        fprintf(stderr, "rank %d: no resident buffer: %s\n", rank, err.msg);
        return 21;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    enum { HEAD = 1000 };
    if (stk_comm_allreduce(c, x + HEAD, N - HEAD, STK_SUM, &err))
        return 22;
    for (size_t i = 0; i < N; i++)
        if (memcmp(&x[i], i < HEAD ? &(float){value(rank, i)} : &want[i], sizeof *x)) {
            fprintf(stderr, "rank %d: resident sum differs at %zu\n", rank, i);
            return 23;
        }
    if (stk_comm_allreduce(c, x, HEAD, STK_AVG, &err))
        return 24;
    for (size_t i = 0; i < HEAD; i++)
        if (x[i] != want[i] * (1.0f / (float)world))
            return 25;
    return 0;
}

/* One rank: joins, all-reduces, checks against the rank-order sum. */
static int rank_main(int rank, int world, int port, int die_rank)
{
    stk_err err;
    stk_backend *be;
    stk_kv *kv;
    stk_comm *c;
    stk_rank_info ri = {.rank = rank, .world = world, .local_rank = rank,
                        .local_world = world};
    if (stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err) ||
        stk_kv_connect("127.0.0.1", port, 5000, &kv, &err) ||
        stk_comm_create(be, &ri, kv, 5000, &c, &err)) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 10;
    }
    if (rank == die_rank)
        _exit(3); /* a rank that dies before the collective */
    float *x = malloc(N * sizeof *x), *want = malloc(N * sizeof *want);
    for (size_t i = 0; i < N; i++) {
        x[i] = value(rank, i);
        want[i] = value(0, i);
        for (int r = 1; r < world; r++)
            want[i] += value(r, i);
    }
    double t0 = stk_now();
    int rc = stk_comm_allreduce(c, x, N, STK_SUM, &err);
    if (die_rank >= 0) { /* the survivors: an error naming the dead rank */
        char expect[32];
        snprintf(expect, sizeof expect, "rank %d", die_rank);
        bool named = rc == STK_EPEER && strstr(err.msg, expect);
        if (!named)
            fprintf(stderr, "rank %d: rc %d: %s\n", rank, rc, err.msg);
        rc = named && stk_now() - t0 < 5 ? 0 : 11;
        free(x);
        free(want);
        stk_comm_destroy(c);
        stk_kv_close(kv);
        stk_backend_destroy(be);
        return rc;
    }
    if (rc || memcmp(x, want, N * sizeof *x)) {
        fprintf(stderr, "rank %d: all-reduce sum differs (%s)\n", rank, rc ? err.msg : "");
        return 12;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    rc = stk_comm_allreduce(c, x, N, STK_AVG, &err);
    for (size_t i = 0; !rc && i < N; i++)
        if (x[i] != want[i] * (1.0f / (float)world))
            rc = 13;
    if (rc) {
        fprintf(stderr, "rank %d: average differs\n", rank);
        return 13;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    if (stk_comm_broadcast(c, x, N * sizeof *x, world - 1, &err) ||
        stk_comm_barrier(c, &err))
        return 14;
    for (size_t i = 0; i < N; i++)
        if (x[i] != value(world - 1, i))
            return 15;
    if ((rc = resident_checks(c, kv, rank, world, want)))
        return rc;
    free(x);
    free(want);
    stk_comm_destroy(c);
    stk_kv_close(kv);
    stk_backend_destroy(be);
    return 0;
}

static int rank_entry(int rank, int world, int port, void *die_rank)
{
    return rank_main(rank, world, port, *(int *)die_rank);
}

/* Runs `world` ranks; returns how many exited other than expected. */
static int run_ranks(int world, int die_rank)
{
    int st[8];
    assert_int_equal(stk_fork_ranks(world, rank_entry, &die_rank, st), 0);
    int bad = 0;
    for (int r = 0; r < world; r++) {
        int want = r == die_rank ? 3 : 0;
        if (!WIFEXITED(st[r]) || WEXITSTATUS(st[r]) != want) {
            print_message("rank %d: status %d\n", r,
                          WIFEXITED(st[r]) ? WEXITSTATUS(st[r]) : -1);
            bad++;
        }
    }
    return bad;
}

static void shm_collectives_two_ranks(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(2, -1), 0);
}

static void shm_collectives_three_ranks(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(3, -1), 0);
}

static void shm_dead_peer_ends_the_wait(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(3, 1), 0);
}

/* ---- the bucket plan ------------------------------------------------------ */

static void ddp_buckets_last_layers_first(void **state)
{
    (void)state;
    /* the cnn's parameters: conv1 w/b, conv2 w/b, fc1 w/b, fc2 w/b */
    size_t sizes[8] = {288, 32, 18432, 64, 800000, 500, 5000, 10}, off[8], n = 0;
    for (int i = 0; i < 8; i++) {
        off[i] = n;
        n += sizes[i];
    }
    stk_err err;
    stk_backend *be;
    stk_comm *c;
    stk_rank_info one = {.world = 1, .local_world = 1};
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err), 0);
    assert_int_equal(stk_comm_create(be, &one, NULL, 1000, &c, &err), 0);
    float *g = calloc(n, sizeof *g);
    stk_ddp *d;
    /* 1 MB first bucket, then 25 MB: fc2+fc1, then the convolutions */
    assert_int_equal(stk_ddp_create(c, g, off, 8, n, 25u << 20, 1u << 20, &d, &err), 0);
    assert_int_equal(stk_ddp_buckets(d), 2);
    stk_ddp_destroy(d);
    /* 64 KB buckets: fc2 (20 KB) needs fc1 too, fc1 alone is over, then
     * conv2 closes one, and conv1 the last */
    assert_int_equal(stk_ddp_create(c, g, off, 8, n, 64u << 10, 64u << 10, &d, &err), 0);
    assert_int_equal(stk_ddp_buckets(d), 3);
    stk_ddp_destroy(d);
    size_t bad[2] = {0, 0};
    assert_int_equal(stk_ddp_create(c, g, bad, 2, n, 1, 1, &d, &err), STK_EINVAL);
    free(g);
    stk_comm_destroy(c);
    stk_backend_destroy(be);
}

/* The CPU this thread is bound to after binding local rank `rank` of two
 * within `cpus` (-2: more than one); the thread's affinity is restored. */
static int bound_cpu(const cpu_set_t *cpus, int rank, int threads, int *bound)
{
    stk_rank_info ri = {.rank = rank, .world = 2, .local_rank = rank,
                        .local_world = 2};
    stk_err err;
    cpu_set_t orig, got;
    assert_int_equal(sched_getaffinity(0, sizeof orig, &orig), 0);
    assert_int_equal(sched_setaffinity(0, sizeof *cpus, cpus), 0);
    *bound = stk_rank_bind_cpus(&ri, threads, &err);
    assert_int_equal(sched_getaffinity(0, sizeof got, &got), 0);
    assert_int_equal(sched_setaffinity(0, sizeof orig, &orig), 0);
    int cpu = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &got))
            cpu = CPU_COUNT(&got) == 1 ? c : -2;
    return cpu;
}

static void cpu_ranks_bound_to_disjoint_cpus(void **state)
{
    (void)state;
    cpu_set_t all, two;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    CPU_ZERO(&two); /* the first two CPUs this process may use */
    for (int c = 0, n = 0; c < CPU_SETSIZE && n < 2; c++)
        if (CPU_ISSET(c, &all)) {
            CPU_SET(c, &two);
            n++;
        }
    int b0, b1, b2;
    int c0 = bound_cpu(&two, 0, 1, &b0), c1 = bound_cpu(&two, 1, 1, &b1);
    int c2 = bound_cpu(&two, 1, 2, &b2); /* 2 ranks x 2 threads */
    if (CPU_COUNT(&two) < 2) { /* one CPU: two ranks never fit */
        assert_true(b0 == 0 && b1 == 0 && c0 == c1);
        return;
    }
    assert_true(b0 == 1 && b1 == 1);
    assert_true(c0 >= 0 && c1 >= 0 && c0 != c1);
    assert_true(CPU_ISSET(c0, &two) && CPU_ISSET(c1, &two));
    assert_int_equal(b2, 0); /* left alone: both CPUs still allowed */
    assert_int_equal(c2, -2);
    stk_rank_info one = {.world = 1, .local_world = 1};
    stk_err err;
    assert_int_equal(stk_rank_bind_cpus(&one, 1, &err), 0);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(store_set_get_add),
    cmocka_unit_test(store_timeouts_and_taken_port),
    cmocka_unit_test(shm_collectives_two_ranks),
    cmocka_unit_test(shm_collectives_three_ranks),
    cmocka_unit_test(shm_dead_peer_ends_the_wait),
    cmocka_unit_test(ddp_buckets_last_layers_first),
    cmocka_unit_test(cpu_ranks_bound_to_disjoint_cpus),
};

UNIT_MAIN(tests)
