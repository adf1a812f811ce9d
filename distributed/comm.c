/* comm.c - the collective interface: one group per process, shared memory
 * between CPU ranks and NCCL between GPUs. */
#include "comm_impl.h"

#include <stdlib.h>

int stk_comm_create(stk_backend *be, const stk_rank_info *info, stk_kv *kv,
                    int timeout_ms, stk_comm **out, stk_err *err)
{
    *out = NULL;
    stk_comm *c = calloc(1, sizeof *c);
    if (!c)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    c->be = be;
    c->rank = info->rank;
    c->world = info->world;
    int rc = 0;
    if (info->world > 1) {
        if (stk_backend_kind(be) == STK_DEV_CPU)
            rc = shm_create(c->rank, c->world, kv, timeout_ms, &c->shm, err);
        else
            rc = nccl_create(be, c->rank, c->world, kv, timeout_ms, &c->nccl, err);
    }
    if (rc) {
        free(c);
        return rc;
    }
    *out = c;
    return 0;
}

void stk_comm_destroy(stk_comm *c)
{
    if (!c)
        return;
    shm_destroy(c->shm);
    nccl_destroy(c->nccl);
    free(c);
}

void stk_comm_abort(stk_comm *c)
{
    if (c && c->shm)
        shm_abort(c->shm);
    if (c && c->nccl)
        nccl_abort(c->nccl);
}

int stk_comm_rank(const stk_comm *c) { return c->rank; }
int stk_comm_world(const stk_comm *c) { return c->world; }

int stk_comm_allreduce(stk_comm *c, float *buf, size_t n, stk_reduce op,
                       stk_err *err)
{
    if (c->shm)
        return shm_allreduce(c->shm, buf, n, op, err);
    if (c->nccl)
        return nccl_allreduce(c->nccl, buf, n, op, err);
    return 0; /* a world of one: the sum and the mean are the input */
}

int comm_mark(stk_comm *c, int slot, stk_err *err)
{
    return c->nccl ? nccl_mark(c->nccl, slot, err) : 0;
}

int comm_queue_allreduce(stk_comm *c, int slot, float *buf, size_t n,
                         stk_reduce op, stk_err *err)
{
    if (c->nccl)
        return nccl_queue_allreduce(c->nccl, slot, buf, n, op, err);
    return stk_comm_allreduce(c, buf, n, op, err);
}

int comm_wait(stk_comm *c, int slot, stk_err *err)
{
    return c->nccl ? nccl_wait(c->nccl, slot, err) : 0;
}

bool comm_queued(const stk_comm *c) { return c->nccl != NULL; }

int stk_comm_resident(stk_comm *c, stk_kv *kv, size_t n, float **out,
                      stk_err *err)
{
    *out = NULL;
    return c->shm ? shm_resident(c->shm, kv, n, out, err) : 0;
}

int stk_comm_broadcast(stk_comm *c, void *buf, size_t bytes, int root,
                       stk_err *err)
{
    if (root < 0 || root >= c->world)
        return stk_fail(err, STK_EINVAL, "broadcast: root %d is not a rank of %d",
                        root, c->world);
    if (c->shm)
        return shm_broadcast(c->shm, buf, bytes, root, err);
    if (c->nccl)
        return nccl_broadcast(c->nccl, buf, bytes, root, err);
    return 0;
}

int stk_comm_barrier(stk_comm *c, stk_err *err)
{
    if (c->shm)
        return shm_barrier(c->shm, err);
    if (c->nccl)
        return nccl_barrier(c->nccl, err);
    return 0;
}
