/* nccl.c - collectives between GPU ranks with NCCL.
 *
 * Rank 0 makes the unique id and passes it through the rendezvous store;
 * every rank has already selected its device (the backend did, before any
 * other CUDA call). The communicator is non-blocking: no NCCL call waits
 * inside NCCL for a peer, so every wait here is a poll of
 * ncclCommGetAsyncError (and of the stream or an event) bounded by the
 * timeout and the abort flag, which also looks, every 20 ms, at the peers'
 * processes on this machine (their pids travel through the store): a peer
 * that dies ends the wait naming it, one that is stopped (SIGSTOP) is
 * named when the wait times out, and a network error ends the job instead
 * of hanging it. Every failure, synchronous or not, aborts the
 * communicator (ncclCommAbort), so that the peers fail fast too; a clean
 * end finalizes it (flushing the last operations) before destroying it.
 *
 * Each operation runs on the communicator's own high-priority stream
 * behind an event on the backend's stream: recorded now, or, for a DDP
 * bucket, when backward made it ready (nccl_mark), so that its reduction
 * overlaps the rest of backward on the GPU. DDP queues a bucket without
 * waiting for it (nccl_queue_allreduce, an event recorded behind it) and
 * waits for the events in its finish (nccl_wait). One thread at a time
 * may use a communicator (the DDP thread during backward, the trainer's
 * thread otherwise). Every CUDA and NCCL status on the working path is
 * checked; teardown ignores them. */
#include "comm_impl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum {
    MARKS = 128,  /* DDP buckets that can be marked */
    CHECK_MS = 20 /* how often a waiter looks at its peers' processes */
};

struct nccl_comm {
    ncclComm_t comm;
    cudaStream_t compute; /* the backend's */
    cudaStream_t stream;  /* the communicator's */
    cudaEvent_t queued;   /* compute work before an operation */
    cudaEvent_t marks[MARKS]; /* compute work before bucket k; created lazily */
    cudaEvent_t done[MARKS];  /* bucket k's all-reduce; created lazily */
    float *one;           /* a device float for the barrier */
    peer_id *peer;        /* per rank: its process where it shares this machine */
    int rank, world, device, timeout_ms;
    bool broken; /* aborted: every later call fails at once */
    atomic_bool abort_requested; /* by nccl_abort, from any thread */
};

static int cuda_ok(cudaError_t e, const char *call, stk_err *err)
{
    if (e == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    return stk_fail(err, STK_EIO, "nccl: %s: %s", call, cudaGetErrorString(e));
}

static int nccl_ok(nccl_comm *n, ncclResult_t r, const char *call,
                   stk_err *err)
{
    if (r == ncclSuccess || r == ncclInProgress) /* in progress: see await */
        return 0;
    const char *detail = n && n->comm ? ncclGetLastError(n->comm) : "";
    return stk_fail(err, r == ncclRemoteError ? STK_EPEER : STK_EIO,
                    "nccl: %s: %s%s%s", call, ncclGetErrorString(r),
                    detail && *detail ? ": " : "", detail ? detail : "");
}

static void abort_comm(nccl_comm *n)
{
    if (n->comm && !n->broken)
        ncclCommAbort(n->comm);
    n->broken = true;
}

/* A peer on this machine that exited ends the wait at once. */
static int check_peers(nccl_comm *n, stk_err *err)
{
    for (int r = 0; r < n->world; r++)
        if (n->peer[r].pid && peer_state_of(n->peer[r]) == PEER_GONE)
            return stk_fail(err, STK_EPEER,
                            "nccl: rank %d (pid %d) exited; rank %d stops too "
                            "(communicator aborted)",
                            r, (int)n->peer[r].pid, n->rank);
    return 0;
}

/* The first peer on this machine that is stopped (SIGSTOP, a debugger),
 * or -1: the one a timed-out wait names. */
static int stopped_peer(nccl_comm *n)
{
    for (int r = 0; r < n->world; r++)
        if (n->peer[r].pid && peer_state_of(n->peer[r]) == PEER_STOPPED)
            return r;
    return -1;
}

static int deadline_passed(nccl_comm *n, double start, const char *what,
                           stk_err *err)
{
    if (atomic_load(&n->abort_requested))
        return stk_fail(err, STK_EPEER, "nccl: rank %d left the group after an error",
                        n->rank);
    if (stk_now() - start <= n->timeout_ms / 1000.0)
        return 0;
    int s = stopped_peer(n);
    if (s >= 0)
        return stk_fail(err, STK_ETIMEDOUT,
                        "nccl: rank %d waited %.0f s for %s: rank %d (pid %d, "
                        "stopped) does not answer (communicator aborted)",
                        n->rank, n->timeout_ms / 1000.0, what, s, (int)n->peer[s].pid);
    return stk_fail(err, STK_ETIMEDOUT,
                    "nccl: rank %d waited %.0f s for %s; a peer is stuck or gone "
                    "(communicator aborted)",
                    n->rank, n->timeout_ms / 1000.0, what);
}

/* *done: the device work is complete (ev, or with ev NULL the stream). */
static int device_done(nccl_comm *n, cudaEvent_t ev, bool *done,
                       const char *what, stk_err *err)
{
    cudaError_t q = ev ? cudaEventQuery(ev) : cudaStreamQuery(n->stream);
    *done = q == cudaSuccess;
    if (q == cudaErrorNotReady) /* "not yet" also sets this thread's last */
        (void)cudaGetLastError(); /* error, which the next launch check reads */
    return q == cudaSuccess || q == cudaErrorNotReady ? 0 : cuda_ok(q, what, err);
}

/* NCCL's state: ncclSuccess or ncclInProgress, else the error. */
static int async_state(nccl_comm *n, ncclResult_t *state, const char *what,
                       stk_err *err)
{
    ncclResult_t r = ncclCommGetAsyncError(n->comm, state);
    if (r != ncclSuccess)
        return nccl_ok(n, r, "ncclCommGetAsyncError", err);
    if (*state != ncclSuccess && *state != ncclInProgress)
        return nccl_ok(n, *state, what, err);
    return 0;
}

enum { SPIN_POLLS = 256 }; /* polls before the first sleep: about 0.5 ms */

/* Polls until the communicator's state is ncclSuccess (a non-blocking call
 * such as init, finalize or queueing a collective is complete) or, with
 * on_device, until the device work is done (event ev, or the stream where
 * ev is NULL). NCCL's asynchronous error is read at every poll, after the
 * device query, so an error that came with the completion is seen too;
 * the peers, the timeout and the abort flag are checked between polls.
 * Any failure aborts the communicator. */
static int await(nccl_comm *n, bool on_device, cudaEvent_t ev, bool patient,
                 const char *what, stk_err *err)
{
    double start = stk_now(), checked = start;
    /* the first polls only yield: an all-reduce about to finish is seen
     * within microseconds (a sleep, however short, lasts the timer slack,
     * 50 us or more); then a sleep between polls, 50 us where a step
     * waits, 1 ms where the wait is long anyway (a rendezvous, a
     * finalize) */
    struct timespec pause = {0, patient ? 1000000 : 50000};
    for (unsigned polls = 0;; polls++) {
        bool done = false;
        ncclResult_t state = ncclSuccess;
        int rc = on_device ? device_done(n, ev, &done, what, err) : 0;
        if (!rc)
            rc = async_state(n, &state, what, err);
        if (!rc && (on_device ? done : state == ncclSuccess))
            return 0;
        if (!rc && stk_now() - checked > CHECK_MS / 1000.0) {
            checked = stk_now();
            rc = check_peers(n, err);
        }
        if (!rc)
            rc = deadline_passed(n, start, what, err);
        if (rc) {
            abort_comm(n);
            return rc;
        }
        if (polls < SPIN_POLLS)
            sched_yield();
        else
            nanosleep(&pause, NULL);
    }
}

/* rc, after aborting the communicator where it is an error. */
static int aborted_on(nccl_comm *n, int rc)
{
    if (rc)
        abort_comm(n);
    return rc;
}

/* The communicator's stream waits for the compute work queued before
 * mark `slot` (< 0: queued so far). */
static int follow_compute(nccl_comm *n, int slot, stk_err *err)
{
    if (n->broken || atomic_load(&n->abort_requested)) {
        abort_comm(n);
        return stk_fail(err, STK_EPEER,
                        "nccl: the communicator was aborted after an earlier error");
    }
    int rc = cuda_ok(cudaSetDevice(n->device), "cudaSetDevice", err);
    cudaEvent_t ev = slot >= 0 ? n->marks[slot] : n->queued;
    if (!rc && slot < 0)
        rc = cuda_ok(cudaEventRecord(ev, n->compute), "cudaEventRecord", err);
    if (!rc && !ev)
        rc = stk_fail(err, STK_EINVAL, "nccl: bucket %d was never marked", slot);
    if (!rc)
        rc = cuda_ok(cudaStreamWaitEvent(n->stream, ev, 0), "cudaStreamWaitEvent", err);
    return aborted_on(n, rc);
}

/* Another thread may be polling in await: it performs the abort. */
void nccl_abort(nccl_comm *n) { atomic_store(&n->abort_requested, true); }

int nccl_mark(nccl_comm *n, int slot, stk_err *err)
{
    if (slot < 0 || slot >= MARKS)
        return stk_fail(err, STK_EUNSUPPORTED, "nccl: at most %d DDP buckets", MARKS);
    int rc = 0;
    if (!n->marks[slot])
        rc = cuda_ok(cudaEventCreateWithFlags(&n->marks[slot], cudaEventDisableTiming),
                     "cudaEventCreateWithFlags", err);
    if (!rc)
        rc = cuda_ok(cudaEventRecord(n->marks[slot], n->compute), "cudaEventRecord",
                     err);
    if (rc) /* the DDP thread may be using the communicator: it aborts it */
        nccl_abort(n);
    return rc;
}

static int share_id(nccl_comm *n, stk_kv *kv, ncclUniqueId *id, stk_err *err)
{
    if (n->rank == 0) {
        int rc = nccl_ok(n, ncclGetUniqueId(id), "ncclGetUniqueId", err);
        return rc ? rc : stk_kv_set(kv, "nccl/id", id, sizeof *id, err);
    }
    void *v;
    size_t len;
    int rc = stk_kv_get(kv, "nccl/id", n->timeout_ms, &v, &len, err);
    if (rc)
        return rc;
    if (len != sizeof *id)
        rc = stk_fail(err, STK_EFORMAT,
                      "nccl: the unique id in the store has %zu bytes, not %zu "
                      "(ranks built against different NCCL versions?)",
                      len, sizeof *id);
    else
        memcpy(id, v, sizeof *id);
    free(v);
    return rc;
}

/* Every rank's process (pid and start time) and machine through the
 * store: n->peer holds the peers on this machine, whose processes the
 * waits watch. */
static int share_pids(nccl_comm *n, stk_kv *kv, stk_err *err)
{
    char mine[400], entry[480], key[48];
    machine_id(mine, sizeof mine);
    peer_id me = peer_self();
    snprintf(entry, sizeof entry, "%d %llu %s", (int)me.pid,
             (unsigned long long)me.start, mine);
    snprintf(key, sizeof key, "nccl/peer/%d", n->rank);
    int rc = stk_kv_set(kv, key, entry, strlen(entry) + 1, err);
    for (int r = 0; !rc && r < n->world; r++) {
        if (r == n->rank)
            continue;
        void *v;
        size_t len;
        snprintf(key, sizeof key, "nccl/peer/%d", r);
        if ((rc = stk_kv_get(kv, key, n->timeout_ms, &v, &len, err)))
            break;
        const char *theirs = v;
        int pid, used = 0;
        unsigned long long start;
        if (len && theirs[len - 1] == '\0' &&
            sscanf(theirs, "%d %llu %n", &pid, &start, &used) == 2 && used &&
            strcmp(theirs + used, mine) == 0)
            n->peer[r] = (peer_id){pid, start};
        free(v);
    }
    return rc;
}

static int setup(nccl_comm *n, stk_backend *be, stk_kv *kv, stk_err *err)
{
    n->compute = (cudaStream_t)stk_backend_stream(be);
    int least = 0, greatest = 0;
    int rc = cuda_ok(cudaGetDevice(&n->device), "cudaGetDevice", err);
    /* the reductions go first where they compete with backward's kernels */
    if (!rc)
        rc = cuda_ok(cudaDeviceGetStreamPriorityRange(&least, &greatest),
                     "cudaDeviceGetStreamPriorityRange", err);
    if (!rc)
        rc = cuda_ok(cudaStreamCreateWithPriority(&n->stream, cudaStreamNonBlocking,
                                                  greatest),
                     "cudaStreamCreateWithPriority", err);
    if (!rc)
        rc = cuda_ok(cudaEventCreateWithFlags(&n->queued, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags", err);
    if (!rc)
        rc = cuda_ok(cudaMalloc((void **)&n->one, sizeof(float)), "cudaMalloc", err);
    if (!rc)
        rc = cuda_ok(cudaMemsetAsync(n->one, 0, sizeof(float), n->stream),
                     "cudaMemsetAsync", err);
    if (!rc)
        rc = cuda_ok(cudaStreamSynchronize(n->stream), "cudaStreamSynchronize", err);
    if (!rc)
        rc = share_pids(n, kv, err);
    ncclUniqueId id;
    if (!rc)
        rc = share_id(n, kv, &id, err);
    /* non-blocking: init returns at once, and is waited for by polling */
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (!rc)
        rc = aborted_on(n, nccl_ok(n, ncclCommInitRankConfig(&n->comm, n->world, id,
                                                             n->rank, &config),
                                   "ncclCommInitRankConfig", err));
    if (!rc)
        rc = await(n, false, NULL, true, "the other ranks to create the communicator", err);
    return rc;
}

int nccl_create(stk_backend *be, int rank, int world, stk_kv *kv,
                int timeout_ms, nccl_comm **out, stk_err *err)
{
    *out = NULL;
    nccl_comm *n = calloc(1, sizeof *n);
    peer_id *pids = calloc((size_t)world, sizeof *pids);
    if (!n || !pids) {
        free(n);
        free(pids);
        return stk_fail(err, STK_ENOMEM, "out of memory");
    }
    n->peer = pids;
    n->rank = rank;
    n->world = world;
    n->timeout_ms = timeout_ms;
    int rc = setup(n, be, kv, err);
    if (rc) {
        nccl_destroy(n);
        return rc;
    }
    *out = n;
    return 0;
}

void nccl_destroy(nccl_comm *n)
{
    if (!n)
        return;
    stk_err e;
    if (n->comm && !n->broken && !atomic_load(&n->abort_requested) &&
        cudaSetDevice(n->device) == cudaSuccess &&
        nccl_ok(n, ncclCommFinalize(n->comm), "ncclCommFinalize", &e) == 0 &&
        await(n, false, NULL, true, "the communicator to finish", &e) == 0)
        ncclCommDestroy(n->comm); /* flushed and quiescent */
    else
        abort_comm(n); /* never blocks on a peer that may be gone */
    for (int i = 0; i < MARKS; i++) {
        if (n->marks[i])
            cudaEventDestroy(n->marks[i]);
        if (n->done[i])
            cudaEventDestroy(n->done[i]);
    }
    if (n->one)
        cudaFree(n->one);
    if (n->queued)
        cudaEventDestroy(n->queued);
    if (n->stream)
        cudaStreamDestroy(n->stream);
    free(n->peer);
    free(n);
}

/* Hands a collective to NCCL and waits until it is queued on the stream
 * (not done); a synchronous failure aborts the communicator. */
static int enqueue(nccl_comm *n, ncclResult_t queued, const char *call,
                   const char *what, stk_err *err)
{
    int rc = aborted_on(n, nccl_ok(n, queued, call, err));
    return rc ? rc : await(n, false, NULL, false, what, err);
}

int nccl_queue_allreduce(nccl_comm *n, int slot, float *buf, size_t count,
                         stk_reduce op, stk_err *err)
{
    if (slot < 0 || slot >= MARKS)
        return aborted_on(n, stk_fail(err, STK_EINVAL, "nccl: no bucket %d", slot));
    int rc = follow_compute(n, slot, err);
    if (!rc)
        rc = enqueue(n,
                     ncclAllReduce(buf, buf, count, ncclFloat,
                                   op == STK_AVG ? ncclAvg : ncclSum, n->comm, n->stream),
                     "ncclAllReduce", "a bucket's all-reduce to be queued", err);
    if (!rc && !n->done[slot])
        rc = cuda_ok(cudaEventCreateWithFlags(&n->done[slot], cudaEventDisableTiming),
                     "cudaEventCreateWithFlags", err);
    if (!rc)
        rc = cuda_ok(cudaEventRecord(n->done[slot], n->stream), "cudaEventRecord", err);
    return aborted_on(n, rc);
}

int nccl_wait(nccl_comm *n, int slot, stk_err *err)
{
    if (n->broken || atomic_load(&n->abort_requested)) { /* comm may be freed */
        abort_comm(n);
        return stk_fail(err, STK_EPEER,
                        "nccl: the communicator was aborted after an earlier error");
    }
    if (slot < 0 || slot >= MARKS || !n->done[slot])
        return aborted_on(n, stk_fail(err, STK_EINVAL,
                                      "nccl: bucket %d was never queued", slot));
    return await(n, true, n->done[slot], false, "a bucket's all-reduce", err);
}

/* Queues a collective behind the compute work so far and waits for it. */
static int run(nccl_comm *n, ncclResult_t queued, const char *call,
               const char *what, stk_err *err)
{
    int rc = enqueue(n, queued, call, what, err);
    return rc ? rc : await(n, true, NULL, false, what, err);
}

int nccl_allreduce(nccl_comm *n, float *buf, size_t count, stk_reduce op,
                   stk_err *err)
{
    int rc = follow_compute(n, -1, err);
    return rc ? rc
              : run(n,
                    ncclAllReduce(buf, buf, count, ncclFloat,
                                  op == STK_AVG ? ncclAvg : ncclSum, n->comm, n->stream),
                    "ncclAllReduce", "an all-reduce", err);
}

int nccl_broadcast(nccl_comm *n, void *buf, size_t bytes, int root,
                   stk_err *err)
{
    int rc = follow_compute(n, -1, err);
    return rc ? rc
              : run(n, ncclBroadcast(buf, buf, bytes, ncclChar, root, n->comm, n->stream),
                    "ncclBroadcast", "a broadcast", err);
}

int nccl_barrier(nccl_comm *n, stk_err *err)
{
    return nccl_allreduce(n, n->one, 1, STK_SUM, err);
}
