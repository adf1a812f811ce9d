/* shm.c - collectives between the CPU ranks of one machine through a
 * shared-memory segment.
 *
 * All-reduce, per chunk: every rank copies its part into its own slot, a
 * barrier, each rank sums one slice of the chunk over the slots in rank
 * order into the result area, a barrier, every rank copies the result out.
 * So each element is added by one rank in one order and all ranks get the
 * same bits. Chunks alternate between two sets of slots, which makes a
 * third barrier unnecessary: a set is written again only after every rank
 * has passed a barrier that follows its last read of it.
 *
 * The barrier is a generation counter in the segment; waiters spin briefly,
 * then sleep on it with futex. While waiting they check, every few
 * milliseconds, the abort flag, the timeout and whether every peer process
 * is still alive, so a rank that dies ends the others' waits with an error
 * naming it instead of a hang. */
#include "comm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

enum {
    SEGMENT_BYTES = 32 << 20, /* the slots' share of /dev/shm (64 MiB in Docker) */
    CHUNK_MIN = 1 << 18,      /* floats per slot, 1 to 4 MiB: small worlds */
    CHUNK_MAX = 1 << 20,      /* reduce a 25 MB bucket in 6 rounds, not 24 */
    HEADER_BYTES = 4096,
    SPIN_ROUNDS = 20000,
    CHECK_MS = 20 /* how often a waiter looks at its peers */
};

typedef struct shm_header {
    _Atomic uint32_t arrived;
    _Atomic uint32_t gen; /* the futex word */
    _Atomic uint32_t abort;
    _Atomic int32_t failed_rank; /* who was found dead, -1 */
    int32_t world;
    int32_t pid[STK_MAX_RANKS];
} shm_header;

struct shm_comm {
    shm_header *h;
    float *base; /* 2 sets of (world slots + 1 result), chunk floats each */
    size_t chunk;
    size_t bytes;
    int rank, world, timeout_ms;
    unsigned parity;
    char name[128]; /* rank 0: the segment's name until it is unlinked */
};

static float *slot(shm_comm *s, unsigned set, int r)
{
    return s->base + ((size_t)set * (s->world + 1) + (size_t)r) * s->chunk;
}

static float *result(shm_comm *s, unsigned set) { return slot(s, set, s->world); }

static long futex(_Atomic uint32_t *addr, int op, uint32_t val,
                  const struct timespec *ts)
{
    return syscall(SYS_futex, (uint32_t *)addr, op, val, ts, NULL, 0);
}

/* Whether process pid still runs: it exists and is not a zombie (one that
 * exited but whose parent has not collected it yet). */
static bool alive(int32_t pid)
{
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return false;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return true; /* no /proc: trust kill */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *end = strrchr(buf, ')'); /* "pid (comm) S ..." */
    return !(end && end[1] == ' ' && (end[2] == 'Z' || end[2] == 'X'));
}

/* 0 while every peer runs; else the error, after raising the abort flag
 * so that the other waiters stop too. */
static int check_peers(shm_comm *s, double started, stk_err *err)
{
    shm_header *h = s->h;
    for (int r = 0; r < s->world; r++)
        if (r != s->rank && !alive(h->pid[r])) {
            int32_t none = -1;
            atomic_compare_exchange_strong(&h->failed_rank, &none, r);
            atomic_store(&h->abort, 1);
            futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
        }
    if (atomic_load(&h->abort)) {
        int f = atomic_load(&h->failed_rank);
        if (f >= 0)
            return stk_fail(err, STK_EPEER,
                            "rank %d (pid %d) exited during a collective; rank %d "
                            "stops too",
                            f, h->pid[f], s->rank);
        return stk_fail(err, STK_EPEER,
                        "another rank failed during a collective; rank %d stops "
                        "too",
                        s->rank);
    }
    if (stk_now() - started > s->timeout_ms / 1000.0)
        return stk_fail(err, STK_ETIMEDOUT,
                        "rank %d waited %.0f s in a collective for its peers; "
                        "giving up (a rank is stuck, or --timeout is too short)",
                        s->rank, s->timeout_ms / 1000.0);
    return 0;
}

static int barrier(shm_comm *s, stk_err *err)
{
    shm_header *h = s->h;
    uint32_t g = atomic_load(&h->gen);
    if (atomic_fetch_add(&h->arrived, 1) + 1 == (uint32_t)s->world) {
        atomic_store(&h->arrived, 0);
        atomic_fetch_add(&h->gen, 1);
        futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
        return 0;
    }
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g)
            return 0;
        cpu_relax();
    }
    double started = stk_now();
    struct timespec ts = {0, CHECK_MS * 1000000L};
    while (atomic_load(&h->gen) == g) {
        int rc = check_peers(s, started, err);
        if (rc)
            return rc;
        futex(&h->gen, FUTEX_WAIT, g, &ts);
    }
    return 0;
}

int shm_barrier(shm_comm *s, stk_err *err) { return barrier(s, err); }

/* Sums slice [b, e) of the chunk over the slots, in rank order. */
static void reduce_slice(shm_comm *s, unsigned set, size_t b, size_t e,
                         float scale)
{
    float *out = result(s, set);
    const float *first = slot(s, set, 0);
    for (size_t i = b; i < e; i++)
        out[i] = first[i];
    for (int r = 1; r < s->world; r++) {
        const float *in = slot(s, set, r);
        for (size_t i = b; i < e; i++)
            out[i] += in[i];
    }
    if (scale != 1.0f)
        for (size_t i = b; i < e; i++)
            out[i] *= scale;
}

int shm_allreduce(shm_comm *s, float *buf, size_t n, stk_reduce op,
                  stk_err *err)
{
    float scale = op == STK_AVG ? 1.0f / (float)s->world : 1.0f;
    for (size_t off = 0; off < n; off += s->chunk) {
        size_t len = n - off < s->chunk ? n - off : s->chunk;
        unsigned set = s->parity++ & 1;
        memcpy(slot(s, set, s->rank), buf + off, len * sizeof(float));
        int rc = barrier(s, err);
        if (rc)
            return rc;
        reduce_slice(s, set, len * (size_t)s->rank / (size_t)s->world,
                     len * (size_t)(s->rank + 1) / (size_t)s->world, scale);
        if ((rc = barrier(s, err)))
            return rc;
        memcpy(buf + off, result(s, set), len * sizeof(float));
    }
    return 0;
}

int shm_broadcast(shm_comm *s, void *buf, size_t bytes, int root,
                  stk_err *err)
{
    const size_t chunk = s->chunk * sizeof(float);
    for (size_t off = 0; off < bytes; off += chunk) {
        size_t len = bytes - off < chunk ? bytes - off : chunk;
        unsigned set = s->parity++ & 1;
        if (s->rank == root)
            memcpy(result(s, set), (char *)buf + off, len);
        int rc = barrier(s, err);
        if (rc)
            return rc;
        if (s->rank != root)
            memcpy((char *)buf + off, result(s, set), len);
    }
    /* the last set is rewritten two operations later, after a barrier that
     * every reader passes only once done */
    return 0;
}

/* This machine: its host name and boot id, so that ranks on different
 * machines (or containers without a shared /dev/shm) are told apart. */
static void machine_id(char *out, size_t n)
{
    char host[256] = "", boot[64] = "";
    gethostname(host, sizeof host - 1);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f))
            boot[0] = '\0';
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    snprintf(out, n, "%s %s", host, boot);
}

static int same_machine(stk_kv *kv, int rank, int timeout_ms, stk_err *err)
{
    char mine[400];
    machine_id(mine, sizeof mine);
    if (rank == 0)
        return stk_kv_set(kv, "shm/machine", mine, strlen(mine), err);
    void *v;
    size_t n;
    int rc = stk_kv_get(kv, "shm/machine", timeout_ms, &v, &n, err);
    if (rc)
        return rc;
    if (strcmp(v, mine) != 0)
        rc = stk_fail(err, STK_EUNSUPPORTED,
                      "the cpu backend's collectives use shared memory, so all "
                      "ranks must run on one machine: rank 0 is on '%s', rank %d "
                      "on '%s' (use --device cuda with NCCL across machines)",
                      (char *)v, rank, mine);
    free(v);
    return rc;
}

/* Rank 0 creates the segment and publishes its name; the rest open it. */
static int open_segment(shm_comm *s, stk_kv *kv, int timeout_ms, int *fd,
                        stk_err *err)
{
    char name[128];
    if (s->rank == 0) {
        snprintf(name, sizeof name, "/stoke-%d-%llx", (int)getpid(),
                 (unsigned long long)(stk_now() * 1e6));
        *fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (*fd < 0)
            return stk_fail(err, STK_EIO, "shared memory %s: %s", name,
                            strerror(errno));
        snprintf(s->name, sizeof s->name, "%s", name); /* shm_destroy unlinks */
        int e;
        while ((e = posix_fallocate(*fd, 0, (off_t)s->bytes)) == EINTR)
            ; /* a Ctrl-C during startup */
        if (e) {
            close(*fd);
            return stk_fail(err, e == ENOSPC ? STK_ENOSPACE : STK_EIO,
                            "shared memory: cannot reserve %zu MiB in /dev/shm "
                            "for the collectives: %s",
                            s->bytes >> 20, strerror(e));
        }
        return stk_kv_set(kv, "shm/name", name, strlen(name), err);
    }
    void *v;
    size_t n;
    int rc = stk_kv_get(kv, "shm/name", timeout_ms, &v, &n, err);
    if (rc)
        return rc;
    snprintf(name, sizeof name, "%s", (char *)v);
    free(v);
    *fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600);
    return *fd < 0 ? stk_fail(err, STK_EIO, "shared memory %s: %s", name,
                              strerror(errno))
                   : 0;
}

int shm_create(int rank, int world, stk_kv *kv, int timeout_ms,
               shm_comm **out, stk_err *err)
{
    *out = NULL;
    if (world > STK_MAX_RANKS)
        return stk_fail(err, STK_EUNSUPPORTED,
                        "shared-memory collectives: at most %d ranks, not %d",
                        STK_MAX_RANKS, world);
    shm_comm *s = calloc(1, sizeof *s);
    if (!s)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    s->rank = rank;
    s->world = world;
    s->timeout_ms = timeout_ms;
    /* fewer, larger rounds: each has two barriers, where a rank whose peer
     * is not running yet sleeps and is woken (2-3% of the cnn's step on 2
     * cores, docs/benchmarks.md); every rank derives the same size */
    size_t chunk = SEGMENT_BYTES / (2 * (size_t)(world + 1) * sizeof(float));
    chunk = chunk > CHUNK_MAX ? CHUNK_MAX : chunk < CHUNK_MIN ? CHUNK_MIN : chunk;
    s->chunk = chunk & ~(size_t)1023; /* whole pages */
    s->bytes = HEADER_BYTES + 2 * (size_t)(world + 1) * s->chunk * sizeof(float);
    int fd = -1;
    int rc = same_machine(kv, rank, timeout_ms, err);
    if (!rc)
        rc = open_segment(s, kv, timeout_ms, &fd, err);
    if (!rc) {
        void *p = mmap(NULL, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        close(fd);
        if (p == MAP_FAILED)
            rc = stk_fail(err, STK_EIO, "shared memory: mmap: %s", strerror(errno));
        else
            s->h = p;
    }
    if (!rc) {
        s->base = (float *)((char *)s->h + HEADER_BYTES);
        s->h->pid[rank] = (int32_t)getpid();
        if (rank == 0)
            atomic_store(&s->h->failed_rank, -1);
        rc = stk_kv_barrier(kv, "shm/mapped", world, timeout_ms, err);
    }
    if (!rc && rank == 0) { /* everyone has it mapped: the name can go */
        shm_unlink(s->name);
        s->name[0] = '\0';
    }
    if (rc) {
        shm_destroy(s);
        return rc;
    }
    *out = s;
    return 0;
}

void shm_abort(shm_comm *s)
{
    if (!s || !s->h)
        return;
    atomic_store(&s->h->abort, 1);
    futex(&s->h->gen, FUTEX_WAKE, INT_MAX, NULL);
}

void shm_destroy(shm_comm *s)
{
    if (!s)
        return;
    if (s->name[0]) /* rank 0 failed before the others mapped it */
        shm_unlink(s->name);
    if (s->h)
        munmap(s->h, s->bytes);
    free(s);
}
