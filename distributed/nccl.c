/* nccl.c - collectives between GPU ranks with NCCL.
 *
 * Rank 0 makes the unique id and passes it through the rendezvous store;
 * every rank has already selected its device (the backend did, before any
 * other CUDA call). The communicator is non-blocking: no NCCL call waits
 * inside NCCL for a peer, so every wait here is a poll of
 * ncclCommGetAsyncError (and of the stream) bounded by the timeout and the
 * abort flag; a peer that dies or a network error ends the job instead of
 * hanging it. On error the communicator is aborted; a clean end finalizes
 * it (flushing the last operations) before destroying it.
 *
 * Each operation runs on the communicator's own stream behind an event on
 * the backend's stream: recorded now, or, for a DDP bucket, when backward
 * made it ready (nccl_mark), so that its reduction overlaps the rest of
 * backward on the GPU. One thread at a time may use a communicator (the
 * DDP thread during backward, the trainer's thread otherwise). Every CUDA
 * and NCCL status on the working path is checked; teardown ignores
 * them. */
#include "comm_impl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { MARKS = 128 }; /* DDP buckets that can be marked */

struct nccl_comm {
    ncclComm_t comm;
    cudaStream_t compute; /* the backend's */
    cudaStream_t stream;  /* the communicator's */
    cudaEvent_t queued;   /* compute work before an operation */
    cudaEvent_t marks[MARKS]; /* compute work before bucket k; created lazily */
    float *one;           /* a device float for the barrier */
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

static int deadline_passed(nccl_comm *n, double start, const char *what,
                           stk_err *err)
{
    if (atomic_load(&n->abort_requested)) {
        abort_comm(n);
        return stk_fail(err, STK_EPEER, "nccl: rank %d left the group after an error",
                        n->rank);
    }
    if (stk_now() - start > n->timeout_ms / 1000.0) {
        abort_comm(n);
        return stk_fail(err, STK_ETIMEDOUT,
                        "nccl: rank %d waited %.0f s for %s; a peer is stuck or gone "
                        "(communicator aborted)",
                        n->rank, n->timeout_ms / 1000.0, what);
    }
    return 0;
}

/* Polls until the communicator's state is ncclSuccess (a non-blocking call
 * such as init, finalize or queueing a collective is complete) or, with
 * on_stream, until its stream is done; NCCL's asynchronous error is read
 * between polls, under the timeout and the abort flag. */
static int await(nccl_comm *n, bool on_stream, const char *what, stk_err *err)
{
    double start = stk_now();
    struct timespec pause = {0, 50 * 1000}; /* 50 us */
    for (;;) {
        if (on_stream) {
            cudaError_t q = cudaStreamQuery(n->stream);
            if (q == cudaSuccess)
                return 0;
            if (q != cudaErrorNotReady) {
                int rc = cuda_ok(q, what, err);
                abort_comm(n);
                return rc;
            }
        }
        ncclResult_t state = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &state);
        if (r != ncclSuccess || (state != ncclSuccess && state != ncclInProgress)) {
            int rc = nccl_ok(n, r != ncclSuccess ? r : state, what, err);
            abort_comm(n);
            return rc;
        }
        if (!on_stream && state == ncclSuccess)
            return 0;
        int rc = deadline_passed(n, start, what, err);
        if (rc)
            return rc;
        nanosleep(&pause, NULL);
    }
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
    return rc;
}

int nccl_mark(nccl_comm *n, int slot, stk_err *err)
{
    if (slot < 0 || slot >= MARKS)
        return stk_fail(err, STK_EUNSUPPORTED, "nccl: at most %d DDP buckets", MARKS);
    int rc = 0;
    if (!n->marks[slot])
        rc = cuda_ok(cudaEventCreateWithFlags(&n->marks[slot], cudaEventDisableTiming),
                     "cudaEventCreateWithFlags", err);
    return rc ? rc : cuda_ok(cudaEventRecord(n->marks[slot], n->compute),
                             "cudaEventRecord", err);
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

static int setup(nccl_comm *n, stk_backend *be, stk_kv *kv, stk_err *err)
{
    n->compute = (cudaStream_t)stk_backend_stream(be);
    int rc = cuda_ok(cudaGetDevice(&n->device), "cudaGetDevice", err);
    if (!rc)
        rc = cuda_ok(cudaStreamCreateWithFlags(&n->stream, cudaStreamNonBlocking),
                     "cudaStreamCreateWithFlags", err);
    if (!rc)
        rc = cuda_ok(cudaEventCreateWithFlags(&n->queued, cudaEventDisableTiming),
                     "cudaEventCreateWithFlags", err);
    if (!rc)
        rc = cuda_ok(cudaMalloc((void **)&n->one, sizeof(float)), "cudaMalloc", err);
    if (!rc)
        rc = cuda_ok(cudaMemset(n->one, 0, sizeof(float)), "cudaMemset", err);
    ncclUniqueId id;
    if (!rc)
        rc = share_id(n, kv, &id, err);
    /* non-blocking: init returns at once, and is waited for by polling */
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    if (!rc)
        rc = nccl_ok(n, ncclCommInitRankConfig(&n->comm, n->world, id, n->rank, &config),
                     "ncclCommInitRankConfig", err);
    if (!rc)
        rc = await(n, false, "the other ranks to create the communicator", err);
    return rc;
}

int nccl_create(stk_backend *be, int rank, int world, stk_kv *kv,
                int timeout_ms, nccl_comm **out, stk_err *err)
{
    *out = NULL;
    nccl_comm *n = calloc(1, sizeof *n);
    if (!n)
        return stk_fail(err, STK_ENOMEM, "out of memory");
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

/* Another thread may be polling in await: it performs the abort. */
void nccl_abort(nccl_comm *n) { atomic_store(&n->abort_requested, true); }

void nccl_destroy(nccl_comm *n)
{
    if (!n)
        return;
    stk_err e;
    if (n->comm && !n->broken && !atomic_load(&n->abort_requested) &&
        cudaSetDevice(n->device) == cudaSuccess &&
        nccl_ok(n, ncclCommFinalize(n->comm), "ncclCommFinalize", &e) == 0 &&
        await(n, false, "the communicator to finish", &e) == 0)
        ncclCommDestroy(n->comm); /* flushed and quiescent */
    else
        abort_comm(n); /* never blocks on a peer that may be gone */
    for (int i = 0; i < MARKS; i++)
        if (n->marks[i])
            cudaEventDestroy(n->marks[i]);
    if (n->one)
        cudaFree(n->one);
    if (n->queued)
        cudaEventDestroy(n->queued);
    if (n->stream)
        cudaStreamDestroy(n->stream);
    free(n);
}

/* Waits for a queued collective: queueing done, then its stream. */
static int run(nccl_comm *n, ncclResult_t queued, const char *call,
               const char *what, stk_err *err)
{
    int rc = nccl_ok(n, queued, call, err);
    if (!rc)
        rc = await(n, false, what, err); /* queued */
    return rc ? rc : await(n, true, what, err); /* and done */
}

int nccl_allreduce_after(nccl_comm *n, int slot, float *buf, size_t count,
                         stk_reduce op, stk_err *err)
{
    int rc = follow_compute(n, slot, err);
    return rc ? rc
              : run(n,
                    ncclAllReduce(buf, buf, count, ncclFloat,
                                  op == STK_AVG ? ncclAvg : ncclSum, n->comm, n->stream),
                    "ncclAllReduce", "an all-reduce", err);
}

int nccl_allreduce(nccl_comm *n, float *buf, size_t count, stk_reduce op,
                   stk_err *err)
{
    return nccl_allreduce_after(n, -1, buf, count, op, err);
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
