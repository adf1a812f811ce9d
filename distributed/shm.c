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
 * A resident buffer (DDP's gradients) lives in a second segment, one part
 * per rank at the same offsets. Reducing a range of it needs no copies: a
 * barrier, each rank sums its slice of the range over the parts and writes
 * the result into every part, a barrier.
 *
 * The barrier is a generation counter in the segment; waiters spin briefly,
 * then sleep on it with futex. While waiting they check, every few
 * milliseconds, the abort flag, the timeout and whether every peer process
 * is still alive, so a rank that dies ends the others' waits with an error
 * naming it instead of a hang. Each rank notes the generation it arrived
 * at, so that a wait that times out names the rank that never came (one
 * stopped with SIGSTOP, or stuck elsewhere); that rank, and every other,
 * then finds the abort flag raised. */
#include "comm_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <limits.h>
#include <stdbool.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

enum {
    SEGMENT_BYTES = 32 << 20, /* the slots' share of /dev/shm (64 MiB in Docker) */
    CHUNK_MIN = 1 << 18,      /* floats per slot, 1 to 4 MiB: small worlds */
    CHUNK_MAX = 1 << 20,      /* reduce a 25 MB bucket in 6 rounds, not 24 */
    HEADER_BYTES = 4096,
    SUM_BLOCK = 2048, /* floats summed at a time: they stay in L1 */
    SPIN_ROUNDS = 20000,
    CHECK_MS = 20 /* how often a waiter looks at its peers */
};

typedef struct shm_header {
    _Atomic uint32_t arrived;
    _Atomic uint32_t gen; /* the futex word */
    _Atomic uint32_t abort;
    _Atomic int32_t failure; /* rank << 1 | 1 if it missed a barrier, 0
                                if it died; -1: none so far */
    int32_t world;
    peer_id peer[STK_MAX_RANKS];
    _Atomic uint32_t at[STK_MAX_RANKS]; /* the generation each rank last
                                           arrived at, plus one */
} shm_header;

struct shm_comm {
    shm_header *h;
    float *base; /* 2 sets of (world slots + 1 result), chunk floats each */
    size_t chunk;
    size_t bytes;
    int rank, world, timeout_ms;
    unsigned parity;
    float *res;        /* the resident segment: world parts, stride apart */
    size_t res_n, res_stride, res_bytes;
    unsigned res_calls; /* names each call's keys in the store */
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

/* Records rank r as the one that failed (the first finding wins) and
 * raises the abort flag, so that the other waiters stop too. */
static void blame(shm_header *h, int r, bool stuck)
{
    int32_t none = -1;
    atomic_compare_exchange_strong(&h->failure, &none, r << 1 | stuck);
    atomic_store(&h->abort, 1);
    futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
}

/* The first rank that has not arrived at the barrier of generation g. */
static int missing_rank(shm_comm *s, uint32_t g)
{
    for (int r = 0; r < s->world; r++)
        if (r != s->rank && atomic_load(&s->h->at[r]) != g + 1)
            return r;
    return -1;
}

/* 0 while every peer runs and the wait for the barrier of generation g
 * is within the timeout; else the error, naming the rank that died or
 * did not arrive, after raising the abort flag. */
static int check_peers(shm_comm *s, double started, uint32_t g, stk_err *err)
{
    shm_header *h = s->h;
    for (int r = 0; r < s->world; r++)
        if (r != s->rank && peer_state_of(h->peer[r]) == PEER_GONE)
            blame(h, r, false);
    int late = -1;
    if (!atomic_load(&h->abort) && stk_now() - started > s->timeout_ms / 1000.0) {
        if ((late = missing_rank(s, g)) < 0)
            return stk_fail(err, STK_ETIMEDOUT,
                            "rank %d waited %.0f s in a collective for its peers; "
                            "giving up (--timeout is too short?)",
                            s->rank, s->timeout_ms / 1000.0);
        blame(h, late, true);
    }
    if (!atomic_load(&h->abort))
        return 0;
    int32_t failure = atomic_load(&h->failure);
    int f = failure >> 1;
    if (failure < 0)
        return stk_fail(err, STK_EPEER,
                        "another rank failed during a collective; rank %d stops "
                        "too",
                        s->rank);
    if (!(failure & 1))
        return stk_fail(err, STK_EPEER,
                        "rank %d (pid %d) exited during a collective; rank %d "
                        "stops too",
                        f, (int)h->peer[f].pid, s->rank);
    if (f == s->rank) /* resumed after the others gave up on it */
        return stk_fail(err, STK_EPEER,
                        "rank %d did not reach a collective within %.0f s "
                        "(--timeout; stopped or stuck?) and the others stopped",
                        f, s->timeout_ms / 1000.0);
    bool stopped = peer_state_of(h->peer[f]) == PEER_STOPPED;
    return stk_fail(err, f == late ? STK_ETIMEDOUT : STK_EPEER,
                    "rank %d (pid %d%s) did not reach a collective within %.0f s "
                    "(--timeout); rank %d stops too",
                    f, (int)h->peer[f].pid, stopped ? ", stopped" : "",
                    s->timeout_ms / 1000.0, s->rank);
}

/* A barrier that the group was aborted around fails: a rank resumed
 * after the others gave up on it must not count their stale arrivals.
 * But one that every rank passed (the generation moved on) before a rank
 * aborted for its own error, blaming none, stands: that rank gave its
 * values (an evaluation's failure flag among them) and its peers read
 * them; their next collective fails. */
static int passed(shm_comm *s, uint32_t g, stk_err *err)
{
    shm_header *h = s->h;
    if (!atomic_load(&h->abort))
        return 0;
    if (atomic_load(&h->gen) != g && atomic_load(&h->failure) < 0)
        return 0;
    return check_peers(s, stk_now(), g, err);
}

static int barrier(shm_comm *s, stk_err *err)
{
    shm_header *h = s->h;
    uint32_t g = atomic_load(&h->gen);
    if (atomic_load(&h->abort))
        return passed(s, g, err);
    atomic_store(&h->at[s->rank], g + 1);
    if (atomic_fetch_add(&h->arrived, 1) + 1 == (uint32_t)s->world) {
        atomic_store(&h->arrived, 0);
        atomic_fetch_add(&h->gen, 1);
        futex(&h->gen, FUTEX_WAKE, INT_MAX, NULL);
        return passed(s, g, err);
    }
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load_explicit(&h->gen, memory_order_acquire) != g)
            return passed(s, g, err);
        stk_cpu_relax();
    }
    double started = stk_now();
    struct timespec ts = {0, CHECK_MS * 1000000L};
    while (atomic_load(&h->gen) == g) {
        int rc = check_peers(s, started, g, err);
        if (rc)
            return rc;
        futex(&h->gen, FUTEX_WAIT, g, &ts);
    }
    return passed(s, g, err);
}

int shm_barrier(shm_comm *s, stk_err *err) { return barrier(s, err); }

/* out[0][b, e) = the sum of in[0..world)[b, e) in rank order, times
 * scale, copied to out[1..nout) too. out[0] may be in[0]. Both paths sum
 * here, so every element gets the same arithmetic. */
static void sum_slice(float *const *in, int world, float *const *out,
                      int nout, size_t b, size_t e, float scale)
{
    float *o = out[0];
    for (size_t lo = b; lo < e; lo += SUM_BLOCK) {
        size_t hi = e - lo < SUM_BLOCK ? e : lo + SUM_BLOCK;
        if (o != in[0])
            memcpy(o + lo, in[0] + lo, (hi - lo) * sizeof *o);
        for (int r = 1; r < world; r++) {
            const float *x = in[r];
            for (size_t i = lo; i < hi; i++)
                o[i] += x[i];
        }
        if (scale != 1.0f)
            for (size_t i = lo; i < hi; i++)
                o[i] *= scale;
        for (int k = 1; k < nout; k++)
            memcpy(out[k] + lo, o + lo, (hi - lo) * sizeof *o);
    }
}

/* [off, off + n) of the resident buffer, summed in place in every part. */
static int resident_allreduce(shm_comm *s, size_t off, size_t n, float scale,
                              stk_err *err)
{
    float *part[STK_MAX_RANKS];
    for (int r = 0; r < s->world; r++)
        part[r] = s->res + (size_t)r * s->res_stride;
    int rc = barrier(s, err); /* every part's range is final */
    if (rc)
        return rc;
    size_t b = off + n * (size_t)s->rank / (size_t)s->world;
    size_t e = off + n * (size_t)(s->rank + 1) / (size_t)s->world;
    sum_slice(part, s->world, part, s->world, b, e, scale);
    return barrier(s, err); /* every slice is everywhere */
}

int shm_allreduce(shm_comm *s, float *buf, size_t n, stk_reduce op,
                  stk_err *err)
{
    float scale = op == STK_AVG ? 1.0f / (float)s->world : 1.0f;
    float *mine = s->res ? s->res + (size_t)s->rank * s->res_stride : NULL;
    if (mine && buf >= mine && buf < mine + s->res_n) {
        if (n > s->res_n - (size_t)(buf - mine))
            return stk_fail(err, STK_EINVAL, "all-reduce: %zu floats run past "
                                             "the resident buffer", n);
        return resident_allreduce(s, (size_t)(buf - mine), n, scale, err);
    }
    for (size_t off = 0; off < n; off += s->chunk) {
        size_t len = n - off < s->chunk ? n - off : s->chunk;
        unsigned set = s->parity++ & 1;
        memcpy(slot(s, set, s->rank), buf + off, len * sizeof(float));
        int rc = barrier(s, err);
        if (rc)
            return rc;
        float *in[STK_MAX_RANKS], *out = result(s, set);
        for (int r = 0; r < s->world; r++)
            in[r] = slot(s, set, r);
        sum_slice(in, s->world, &out, 1, len * (size_t)s->rank / (size_t)s->world,
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

/* Whether an optional segment of `bytes` leaves /dev/shm at least half
 * free: other programs (PyTorch's loaders, say) live there too. */
static bool room_for(size_t bytes)
{
    struct statvfs v;
    if (statvfs("/dev/shm", &v) != 0)
        return false;
    return bytes <= (size_t)v.f_bavail * v.f_frsize / 2;
}

/* Rank 0 creates a segment of `bytes` and publishes its name under `key`;
 * every rank maps it at *map. An optional one that /dev/shm has no room
 * for is published as "" and *map is NULL on every rank. Rank 0's `name`
 * holds the segment's name, for unmapped() to unlink. */
static int map_segment(shm_comm *s, stk_kv *kv, const char *key, size_t bytes,
                       bool optional, void **map, char name[128], stk_err *err)
{
    *map = NULL;
    name[0] = '\0';
    int fd = -1, rc = 0;
    if (s->rank == 0 && !(optional && !room_for(bytes))) {
        snprintf(name, 128, "/stoke-%d-%llx", (int)getpid(),
                 (unsigned long long)(stk_now() * 1e6));
        fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd < 0)
            return stk_fail(err, STK_EIO, "shared memory %s: %s", name,
                            strerror(errno));
        int e;
        while ((e = posix_fallocate(fd, 0, (off_t)bytes)) == EINTR)
            ; /* a Ctrl-C during startup */
        if (e) {
            close(fd);
            shm_unlink(name);
            return stk_fail(err, e == ENOSPC ? STK_ENOSPACE : STK_EIO,
                            "shared memory: cannot reserve %zu MiB in /dev/shm "
                            "for the collectives: %s",
                            bytes >> 20, strerror(e));
        }
    }
    if (s->rank == 0)
        rc = stk_kv_set(kv, key, name, strlen(name), err);
    else {
        void *v;
        size_t n;
        if ((rc = stk_kv_get(kv, key, s->timeout_ms, &v, &n, err)))
            return rc;
        snprintf(name, 128, "%.*s", (int)n, (char *)v);
        free(v);
        if (name[0] && (fd = shm_open(name, O_RDWR | O_CLOEXEC, 0600)) < 0)
            return stk_fail(err, STK_EIO, "shared memory %s: %s", name,
                            strerror(errno));
        name[0] = '\0'; /* rank 0's to unlink */
    }
    if (!rc && fd >= 0) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
            rc = stk_fail(err, STK_EIO, "shared memory: mmap: %s", strerror(errno));
        else
            *map = p;
    }
    if (fd >= 0)
        close(fd);
    return rc;
}

/* Every rank has mapped the segment, or failed: rank 0 unlinks its name
 * either way, so that nothing is left in /dev/shm. */
static int all_mapped(shm_comm *s, stk_kv *kv, const char *barrier_name,
                      const char *name, int rc, stk_err *err)
{
    if (!rc)
        rc = stk_kv_barrier(kv, barrier_name, s->world, s->timeout_ms, err);
    if (name[0])
        shm_unlink(name);
    return rc;
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
    char name[128] = "";
    void *p = NULL;
    int rc = same_machine(kv, rank, timeout_ms, err);
    if (!rc)
        rc = map_segment(s, kv, "shm/name", s->bytes, false, &p, name, err);
    if (!rc) {
        s->h = p;
        s->base = (float *)((char *)s->h + HEADER_BYTES);
        s->h->peer[rank] = peer_self();
        if (rank == 0)
            atomic_store(&s->h->failure, -1);
    }
    rc = all_mapped(s, kv, "shm/mapped", name, rc, err);
    if (rc) {
        shm_destroy(s);
        return rc;
    }
    *out = s;
    return 0;
}

int shm_resident(shm_comm *s, stk_kv *kv, size_t n, float **out, stk_err *err)
{
    *out = NULL;
    if (s->res)
        return stk_fail(err, STK_EINVAL, "shared memory: one resident buffer "
                                         "per group");
    if (n == 0 || n > SIZE_MAX / sizeof(float) / (size_t)s->world - 1024)
        return 0; /* nothing to keep, or more than memory holds */
    size_t stride = (n + 1023) & ~(size_t)1023; /* parts start on pages */
    size_t bytes = (size_t)s->world * stride * sizeof(float);
    char name[128], key[64], mapped[64];
    snprintf(key, sizeof key, "shm/resident/%u", s->res_calls);
    snprintf(mapped, sizeof mapped, "shm/resident/%u/mapped", s->res_calls++);
    void *p = NULL;
    int rc = map_segment(s, kv, key, bytes, true, &p, name, err);
    rc = all_mapped(s, kv, mapped, name, rc, err);
    if (rc || !p) {
        if (p)
            munmap(p, bytes);
        return rc;
    }
    s->res = p;
    s->res_n = n;
    s->res_stride = stride;
    s->res_bytes = bytes;
    *out = s->res + (size_t)s->rank * stride;
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
    if (s->res)
        munmap(s->res, s->res_bytes);
    if (s->h)
        munmap(s->h, s->bytes);
    free(s);
}
