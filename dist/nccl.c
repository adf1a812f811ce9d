/* nccl.c - collectives between GPU ranks with NCCL.
 *
 * Rank 0 makes the unique id and passes it through the rendezvous store;
 * every rank has already selected its device (the backend did, before any
 * other CUDA call). Each operation is queued on the communicator's own
 * stream behind an event recorded on the backend's stream, so it sees all
 * compute work queued so far, and then waited for by polling: between
 * polls NCCL's asynchronous error is read, so a peer that dies or a
 * network error ends the wait (the communicator is aborted, never
 * destroyed, since destroying it would wait for the dead peer). Every
 * CUDA and NCCL status is checked. */
#include "comm_impl.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct nccl_comm {
    ncclComm_t comm;
    cudaStream_t compute; /* the backend's */
    cudaStream_t stream;  /* the communicator's */
    cudaEvent_t queued;   /* compute work before an operation */
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
    if (r == ncclSuccess || r == ncclInProgress)
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

/* Waits for the communicator's stream, reading NCCL's asynchronous error
 * between polls. */
static int wait_done(nccl_comm *n, const char *what, stk_err *err)
{
    double start = stk_now();
    struct timespec pause = {0, 50 * 1000}; /* 50 us */
    for (;;) {
        cudaError_t q = cudaStreamQuery(n->stream);
        if (q == cudaSuccess)
            return 0;
        if (q != cudaErrorNotReady) {
            int rc = cuda_ok(q, what, err);
            abort_comm(n);
            return rc;
        }
        ncclResult_t async = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &async);
        if (r != ncclSuccess || async != ncclSuccess) {
            int rc = nccl_ok(n, r != ncclSuccess ? r : async, what, err);
            abort_comm(n);
            return rc;
        }
        if (atomic_load(&n->abort_requested)) {
            abort_comm(n);
            return stk_fail(err, STK_EPEER,
                            "nccl: rank %d left the group after an error", n->rank);
        }
        if (stk_now() - start > n->timeout_ms / 1000.0) {
            abort_comm(n);
            return stk_fail(err, STK_ETIMEDOUT,
                            "nccl: rank %d waited %.0f s for %s; a peer is "
                            "stuck or gone (communicator aborted)",
                            n->rank, n->timeout_ms / 1000.0, what);
        }
        nanosleep(&pause, NULL);
    }
}

/* The communicator's stream waits for the compute work queued so far. */
static int follow_compute(nccl_comm *n, stk_err *err)
{
    if (n->broken)
        return stk_fail(err, STK_EPEER,
                        "nccl: the communicator was aborted after an earlier "
                        "error");
    int rc = cuda_ok(cudaSetDevice(n->device), "cudaSetDevice", err);
    if (!rc)
        rc = cuda_ok(cudaEventRecord(n->queued, n->compute), "cudaEventRecord", err);
    if (!rc)
        rc = cuda_ok(cudaStreamWaitEvent(n->stream, n->queued, 0),
                     "cudaStreamWaitEvent", err);
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
    if (!rc)
        rc = nccl_ok(n, ncclCommInitRank(&n->comm, n->world, id, n->rank),
                     "ncclCommInitRank", err);
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

/* Another thread may be polling in wait_done: it performs the abort. */
void nccl_abort(nccl_comm *n) { atomic_store(&n->abort_requested, true); }

void nccl_destroy(nccl_comm *n)
{
    if (!n)
        return;
    abort_comm(n); /* never blocks on a peer that may be gone */
    if (n->one)
        cudaFree(n->one);
    if (n->queued)
        cudaEventDestroy(n->queued);
    if (n->stream)
        cudaStreamDestroy(n->stream);
    free(n);
}

int nccl_allreduce(nccl_comm *n, float *buf, size_t count, stk_reduce op,
                   stk_err *err)
{
    int rc = follow_compute(n, err);
    if (!rc)
        rc = nccl_ok(n, ncclAllReduce(buf, buf, count, ncclFloat,
                                      op == STK_AVG ? ncclAvg : ncclSum, n->comm,
                                      n->stream),
                     "ncclAllReduce", err);
    return rc ? rc : wait_done(n, "an all-reduce", err);
}

int nccl_broadcast(nccl_comm *n, void *buf, size_t bytes, int root,
                   stk_err *err)
{
    int rc = follow_compute(n, err);
    if (!rc)
        rc = nccl_ok(n, ncclBroadcast(buf, buf, bytes, ncclChar, root, n->comm,
                                      n->stream),
                     "ncclBroadcast", err);
    return rc ? rc : wait_done(n, "a broadcast", err);
}

int nccl_barrier(nccl_comm *n, stk_err *err)
{
    return nccl_allreduce(n, n->one, 1, STK_SUM, err);
}
