/* comm_impl.h - private to distributed/: the collective backends behind stk_comm
 * (shared memory in shm.c, NCCL in nccl.c). */
#ifndef STK_COMM_IMPL_H
#define STK_COMM_IMPL_H

#include "distributed.h"

enum { STK_MAX_RANKS = 64 }; /* shared-memory ranks on one machine */

/* A peer process on this machine (peers.c). */
typedef enum peer_state { PEER_RUNNING, PEER_GONE, PEER_STOPPED } peer_state;
/* A process, told apart from a later one that reuses its pid by its start
 * time (clock ticks after boot, /proc/PID/stat field 22; 0 = unknown). */
typedef struct peer_id {
    int32_t pid;
    uint64_t start;
} peer_id;
peer_id peer_self(void);
/* A pid of 0 or less is unknown and counts as running; a process whose
 * start time is not p.start has exited and its pid went to another. */
peer_state peer_state_of(peer_id p);
/* This machine: its host name, boot id and pid namespace, so that ranks
 * on different machines, or in containers that do not share /dev/shm or
 * see each other's processes, are told apart. */
void machine_id(char *out, size_t n);

typedef struct shm_comm shm_comm;

int shm_create(int rank, int world, stk_kv *kv, int timeout_ms,
               shm_comm **out, stk_err *err);
void shm_destroy(shm_comm *s);
void shm_abort(shm_comm *s); /* wakes every waiter with an error */
int shm_allreduce(shm_comm *s, float *buf, size_t n, stk_reduce op,
                  stk_err *err);
int shm_broadcast(shm_comm *s, void *buf, size_t bytes, int root,
                  stk_err *err);
int shm_barrier(shm_comm *s, stk_err *err);
/* stk_comm_resident on shared memory. */
int shm_resident(shm_comm *s, stk_kv *kv, size_t n, float **out, stk_err *err);

typedef struct nccl_comm nccl_comm;

/* NCCL on be's device; STK_EUNSUPPORTED in a build without CUDA. Each
 * operation runs on the communicator's own stream after the work queued
 * so far on the backend's stream; the blocking ones return once it is
 * complete, polling NCCL's asynchronous errors and the peers meanwhile (a
 * dead peer ends the wait: the communicator is aborted, as on every
 * error). Callable from a thread other than the one queueing compute work
 * (DDP's communication thread). */
int nccl_create(stk_backend *be, int rank, int world, stk_kv *kv,
                int timeout_ms, nccl_comm **out, stk_err *err);
void nccl_destroy(nccl_comm *n); /* aborts the communicator */
void nccl_abort(nccl_comm *n);
int nccl_allreduce(nccl_comm *n, float *buf, size_t count, stk_reduce op,
                   stk_err *err);
int nccl_broadcast(nccl_comm *n, void *buf, size_t bytes, int root,
                   stk_err *err);
int nccl_barrier(nccl_comm *n, stk_err *err); /* a one-float all-reduce */
/* Records mark `slot` behind the compute work queued so far (the thread
 * queueing compute work calls it), and an all-reduce queued behind that
 * mark only, without waiting for it: a DDP bucket reduced while later
 * backward kernels run; nccl_wait waits for it. */
int nccl_mark(nccl_comm *n, int slot, stk_err *err);
int nccl_queue_allreduce(nccl_comm *n, int slot, float *buf, size_t count,
                         stk_reduce op, stk_err *err);
int nccl_wait(nccl_comm *n, int slot, stk_err *err);

/* DDP's use of a group (comm.c): mark bucket `slot` ready where it was
 * computed, queue its reduction behind that mark, and wait for it. On
 * shared memory the compute is already done, the mark is nothing, the
 * reduction is done once queued and the wait is nothing; comm_queued
 * says whether reductions outlive their queueing (NCCL). */
int comm_mark(stk_comm *c, int slot, stk_err *err);
int comm_queue_allreduce(stk_comm *c, int slot, float *buf, size_t n,
                         stk_reduce op, stk_err *err);
int comm_wait(stk_comm *c, int slot, stk_err *err);
bool comm_queued(const stk_comm *c);

struct stk_comm {
    stk_backend *be;
    int rank, world;
    shm_comm *shm;
    nccl_comm *nccl;
};

#endif
