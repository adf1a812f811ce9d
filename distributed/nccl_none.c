/* nccl_none.c - the NCCL entry points of a build without CUDA. */
#include "comm_impl.h"

int nccl_create(stk_backend *be, int rank, int world, stk_kv *kv,
                int timeout_ms, nccl_comm **out, stk_err *err)
{
    (void)be;
    (void)rank;
    (void)world;
    (void)kv;
    (void)timeout_ms;
    *out = NULL;
    return stk_fail(err, STK_EUNSUPPORTED,
                    "this stoke was built without CUDA, so without NCCL");
}

void nccl_destroy(nccl_comm *n) { (void)n; }
void nccl_abort(nccl_comm *n) { (void)n; }

int nccl_allreduce(nccl_comm *n, float *buf, size_t count, stk_reduce op,
                   stk_err *err)
{
    (void)n;
    (void)buf;
    (void)count;
    (void)op;
    return stk_fail(err, STK_EUNSUPPORTED, "built without NCCL");
}

int nccl_broadcast(nccl_comm *n, void *buf, size_t bytes, int root,
                   stk_err *err)
{
    (void)n;
    (void)buf;
    (void)bytes;
    (void)root;
    return stk_fail(err, STK_EUNSUPPORTED, "built without NCCL");
}

int nccl_barrier(nccl_comm *n, stk_err *err)
{
    (void)n;
    return stk_fail(err, STK_EUNSUPPORTED, "built without NCCL");
}

int nccl_mark(nccl_comm *n, int slot, stk_err *err)
{
    (void)n;
    (void)slot;
    return stk_fail(err, STK_EUNSUPPORTED, "built without NCCL");
}

int nccl_queue_allreduce(nccl_comm *n, int slot, float *buf, size_t count,
                         stk_reduce op, stk_err *err)
{
    (void)slot;
    return nccl_allreduce(n, buf, count, op, err);
}

int nccl_wait(nccl_comm *n, int slot, stk_err *err)
{
    (void)n;
    (void)slot;
    return stk_fail(err, STK_EUNSUPPORTED, "built without NCCL");
}
