/* distributed.h - multi-process data parallelism: who this process is (rank,
 * world), the rendezvous store the ranks meet through, collectives behind
 * one interface (shared memory between CPU ranks, NCCL between GPUs), the
 * gradient buckets of DDP, and the launcher that starts the ranks.
 *
 * Process model (docs/distributed.md): `train --nproc N` or `--gpus ...`
 * runs a launcher, which hosts the store (node 0) and spawns one trainer
 * process per rank with the torchrun variables set. A trainer process that
 * finds RANK/WORLD_SIZE (or SLURM's variables) in its environment is a
 * rank; without them it is a world of one. */
#ifndef STK_DISTRIBUTED_H
#define STK_DISTRIBUTED_H

#include "common/common.h"
#include "kernels/kernels.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- who am I ------------------------------------------------------------ */

typedef struct stk_rank_info {
    int rank, world;             /* global */
    int local_rank, local_world; /* on this node */
    char master_addr[256];
    int master_port;
    bool host_store; /* this process serves the store itself (SLURM rank 0) */
    const char *source; /* "torchrun variables", "stoke launcher" (which
                           sets them), "SLURM", "single process" */
    char run_id[64]; /* which run the ranks belong to ("SLURM job J step S"),
                        checked at the store; "" where nothing names it */
} stk_rank_info;

/* Reads RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
 * MASTER_PORT, or else, in a task srun started, SLURM_PROCID,
 * SLURM_STEP_NUM_TASKS, SLURM_LOCALID, SLURM_STEP_NUM_NODES,
 * SLURM_STEP_TASKS_PER_NODE, SLURM_JOB_ID and SLURM_STEP_ID (with
 * MASTER_ADDR, required over several nodes, and MASTER_PORT, by default
 * one derived from the job step), or else describes a single process.
 * Inconsistent values are an error naming the variable. */
int stk_rank_from_env(stk_rank_info *out, stk_err *err);

/* Binds the calling thread, and the threads it starts later, to this CPU
 * rank's share of the CPUs it may use: the local_rank-th of local_world
 * equal groups, in topology order. Returns 1 when bound, 0 when left
 * alone (one rank on the node, or a share would hold fewer CPUs than the
 * rank's compute threads). For ranks a launcher started: srun places the
 * ones it starts itself. */
int stk_rank_bind_cpus(const stk_rank_info *ri, int threads, stk_err *err);

/* ---- rendezvous store (TCP key-value, like torch's TCPStore) -------------- */

typedef struct stk_store_server stk_store_server;

/* What any one client can make the server hold (docs/distributed.md, "What
 * the store holds, at most"). A client that would go over one is
 * disconnected, with one log line naming it and the limit; the store and
 * its other clients go on. Bytes are counted with a fixed overhead for
 * every key, parked GET and reply, so that many tiny ones count too. */
typedef struct stk_store_limits {
    size_t key;      /* bytes in a key */
    size_t value;    /* bytes in a value */
    size_t keys;     /* keys in the store */
    size_t stored;   /* bytes of all keys and values */
    size_t pending;  /* held for one connection: the request still
                        arriving, replies it has not read, its parked GETs */
    size_t inflight; /* the same for all connections together */
} stk_store_limits;

/* 4 KiB a key, 8 MiB a value, 1 Mi keys, 256 MiB stored, 32 MiB a
 * connection, 512 MiB all connections. */
stk_store_limits stk_store_default_limits(void);

/* One line about a refused client, without its newline; called on the
 * server's thread. */
typedef void (*stk_store_log_fn)(void *arg, const char *line);

/* Serves the store on host:port from a thread of its own (libuv). port 0
 * picks a free port, *bound tells which. A port in use is an error that
 * names it and says what to do. limits NULL: the defaults; log NULL: no
 * log. */
int stk_store_server_open(const char *host, int port,
                          const stk_store_limits *limits, stk_store_log_fn log,
                          void *log_arg, int *bound, stk_store_server **out,
                          stk_err *err);
/* stk_store_server_open with the default limits, logging on stderr: the
 * launcher's and a SLURM rank 0's store, whose log is that process's. */
int stk_store_server_start(const char *host, int port, int *bound,
                           stk_store_server **out, stk_err *err);
void stk_store_server_stop(stk_store_server *s); /* NULL is a no-op */

/* What the server holds now, and the most it has held for its
 * connections; readable from any thread while it runs. */
typedef struct stk_store_usage {
    size_t keys, stored;   /* against limits.keys, limits.stored */
    size_t inflight, peak; /* against limits.inflight */
    size_t dropped;        /* clients disconnected over a limit */
} stk_store_usage;
void stk_store_server_usage(stk_store_server *s, stk_store_usage *out);

typedef struct stk_kv stk_kv;

/* Connects to the store, retrying refused connections until timeout_ms:
 * the server may start after its clients. SET and ADD wait at most
 * timeout_ms for their answer too. */
int stk_kv_connect(const char *host, int port, int timeout_ms, stk_kv **out,
                   stk_err *err);
void stk_kv_close(stk_kv *kv); /* NULL is a no-op */
/* From another thread: makes a call blocked on kv return with an error. */
void stk_kv_interrupt(stk_kv *kv);
int stk_kv_set(stk_kv *kv, const char *key, const void *val, size_t n,
               stk_err *err);
/* Waits up to timeout_ms for key to exist; *val is malloc'd (free it). */
int stk_kv_get(stk_kv *kv, const char *key, int timeout_ms, void **val,
               size_t *n, stk_err *err);
/* Adds delta to the integer at key (0 when absent); *after is the sum. */
int stk_kv_add(stk_kv *kv, const char *key, int64_t delta, int64_t *after,
               stk_err *err);
/* All `world` callers of the barrier `name` arrive, or a timeout error
 * says how many did. Each name is used once. */
int stk_kv_barrier(stk_kv *kv, const char *name, int world, int timeout_ms,
                   stk_err *err);

/* ---- collectives -------------------------------------------------------- */

typedef struct stk_comm stk_comm;

typedef enum stk_reduce { STK_SUM, STK_AVG } stk_reduce;

/* Joins the group of info->world ranks through the store: shared memory for
 * the CPU backend (all ranks on one machine, checked), NCCL for CUDA (the
 * unique id travels through the store; be's device is the rank's GPU).
 * timeout_ms bounds every wait; a peer that exits ends the wait with an
 * error naming it. */
int stk_comm_create(stk_backend *be, const stk_rank_info *info, stk_kv *kv,
                    int timeout_ms, stk_comm **out, stk_err *err);
/* Aborts rather than waits where a peer may be gone (ncclCommAbort). */
void stk_comm_destroy(stk_comm *c); /* NULL is a no-op */
/* Makes every rank's pending and future waits fail (an error path leaving
 * mid-collective); the peers see "another rank failed". */
void stk_comm_abort(stk_comm *c);
int stk_comm_rank(const stk_comm *c);
int stk_comm_world(const stk_comm *c);

/* In place on backend memory. Shared memory: the result is bitwise
 * identical on every rank (each element is reduced in rank order by one
 * rank); NCCL: as NCCL computes it. */
int stk_comm_allreduce(stk_comm *c, float *buf, size_t n, stk_reduce op,
                       stk_err *err);
int stk_comm_broadcast(stk_comm *c, void *buf, size_t bytes, int root,
                       stk_err *err);
/* Memory for n floats that the all-reduce sums without copying: on shared
 * memory, this rank's part of a segment every rank maps, so reducing a
 * range of it sums the parts where they lie (DDP's gradients). Every rank
 * calls it with the same n, once per group; the memory lives until
 * stk_comm_destroy. *out is NULL, and it is no error, where there is none:
 * NCCL, a world of one, or /dev/shm without room for world x n floats
 * (the caller keeps its own buffer, which the all-reduce copies). */
int stk_comm_resident(stk_comm *c, stk_kv *kv, size_t n, float **out,
                      stk_err *err);
int stk_comm_barrier(stk_comm *c, stk_err *err);

/* ---- DDP gradient buckets -------------------------------------------------- */

typedef struct stk_ddp stk_ddp;

/* Buckets over the flat gradient buffer grads[0, n): parameter ranges
 * (offsets ascending, as the model lays them out) grouped from the last
 * one backwards into buckets of about bucket_bytes, the first of them
 * first_bytes (PyTorch: 25 MB and 1 MB), so that the last layers' bucket
 * is reduced while the earlier layers' backward still runs. A thread of
 * its own (CPU) or a communication stream (CUDA) runs the all-reduces. */
int stk_ddp_create(stk_comm *c, float *grads, const size_t *param_offsets,
                   int nparams, size_t n, size_t bucket_bytes,
                   size_t first_bytes, stk_ddp **out, stk_err *err);
void stk_ddp_destroy(stk_ddp *d); /* NULL is a no-op */
int stk_ddp_buckets(const stk_ddp *d);
/* Parameter p's gradient is final: its bucket starts reducing once all of
 * its parameters are. Call in backward order. */
int stk_ddp_ready(stk_ddp *d, int param, stk_err *err);
/* Waits until every bucket ready so far is reduced, so that the calling
 * thread may use the group for a collective of its own within backward
 * (SyncBatchNorm's sums): matched on every rank, where buckets become
 * ready in the same order. */
int stk_ddp_drain(stk_ddp *d, stk_err *err);
/* Waits for every bucket, leaving the averaged gradients in place.
 * *waited: seconds spent waiting here, *busy: seconds the reductions took
 * (hidden share = 1 - waited / busy). */
int stk_ddp_finish(stk_ddp *d, double *waited, double *busy, stk_err *err);

/* ---- launcher ----------------------------------------------------------------- */

typedef struct stk_launch_opts {
    int nproc;             /* ranks on this node */
    const int *gpus;       /* nproc device ids (NULL: CPU ranks) */
    int nnodes, node_rank;
    const char *master_addr; /* NULL: 127.0.0.1 on one node */
    int master_port;       /* 0: a free port (one node only) */
    bool log_all_ranks;    /* relay every rank's output, not only rank 0's */
    int timeout_ms;        /* for the store's waits */
    char *const *argv;     /* the trainer command each rank runs */
} stk_launch_opts;

/* Runs the ranks of this node to completion. Returns 0 when all exit 0;
 * otherwise an error naming the first rank that failed, its exit status
 * and its last lines of output, after every other rank is stopped (none
 * is left behind). Ctrl-C and SIGTERM are passed to the ranks, which stop
 * at a step boundary; a second Ctrl-C kills them. *exit_code is what the
 * launcher should exit with. */
int stk_launch(const stk_launch_opts *o, int *exit_code, stk_err *err);

#ifdef __cplusplus
}
#endif

#endif
