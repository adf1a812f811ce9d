/* env.c - a rank's identity from its environment: the torchrun variables
 * the launcher sets, or SLURM's when srun starts the ranks itself. */
#include "distributed.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    DEFAULT_PORT = 29500, /* torchrun's */
    SLURM_PORTS = 15000   /* SLURM's default ports: 15000 + 0..9999 */
};

/* The integer in variable name; *found says whether it is set. */
static int env_int(const char *name, int lo, int hi, int *out, bool *found,
                   stk_err *err)
{
    const char *v = getenv(name);
    *found = v && *v;
    if (!*found)
        return 0;
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || *end || x < lo || x > hi)
        return stk_fail(err, STK_EINVAL,
                        "environment: %s=%s is not an integer in %d..%d", name, v,
                        lo, hi);
    *out = (int)x;
    return 0;
}

static int check(const stk_rank_info *r, stk_err *err)
{
    if (r->rank >= r->world)
        return stk_fail(err, STK_EINVAL,
                        "environment (%s): rank %d is not below the world size %d",
                        r->source, r->rank, r->world);
    if (r->local_rank >= r->local_world || r->local_world > r->world)
        return stk_fail(err, STK_EINVAL,
                        "environment (%s): local rank %d of %d does not fit a "
                        "world of %d",
                        r->source, r->local_rank, r->local_world, r->world);
    return 0;
}

/* MASTER_ADDR and MASTER_PORT; required: both must be set, else the
 * address defaults to this machine and the port to default_port. */
static int master(stk_rank_info *r, bool required, int default_port,
                  stk_err *err)
{
    const char *addr = getenv("MASTER_ADDR");
    bool found;
    int rc = env_int("MASTER_PORT", 1, 65535, &r->master_port, &found, err);
    if (rc)
        return rc;
    if (required && (!addr || !*addr || !found))
        return stk_fail(err, STK_EINVAL,
                        "environment: RANK and WORLD_SIZE are set but MASTER_ADDR "
                        "or MASTER_PORT is not; set both (the launcher does)");
    if (!found)
        r->master_port = default_port;
    snprintf(r->master_addr, sizeof r->master_addr, "%s",
             addr && *addr ? addr : "127.0.0.1");
    return 0;
}

static int from_torchrun(stk_rank_info *r, stk_err *err)
{
    bool f1, f2, f3, f4;
    int rc = env_int("RANK", 0, 1 << 20, &r->rank, &f1, err);
    if (!rc)
        rc = env_int("WORLD_SIZE", 1, 1 << 20, &r->world, &f2, err);
    if (!rc && f1 != f2)
        rc = stk_fail(err, STK_EINVAL,
                      "environment: %s is set without %s; set both or neither",
                      f1 ? "RANK" : "WORLD_SIZE", f1 ? "WORLD_SIZE" : "RANK");
    r->local_rank = r->rank;
    r->local_world = r->world;
    if (!rc)
        rc = env_int("LOCAL_RANK", 0, 1 << 20, &r->local_rank, &f3, err);
    if (!rc)
        rc = env_int("LOCAL_WORLD_SIZE", 1, 1 << 20, &r->local_world, &f4, err);
    if (!rc)
        rc = master(r, true, DEFAULT_PORT, err);
    return rc ? rc : check(r, err);
}

/* The leading count of a SLURM tasks-per-node list ("4(x2)", "4,3"):
 * this node's share when the nodes are alike. */
static int first_count(const char *v)
{
    long n = v ? strtol(v, NULL, 10) : 0;
    return n > 0 && n < (1 << 20) ? (int)n : 0;
}

/* Names the job step in r->run_id and sets *port to its default store
 * port: one per step, so that two steps on a node do not meet at one store
 * (15000 + a number below 10000, outside Linux's ephemeral ports, as
 * PyTorch Lightning's SLURM default). */
static int slurm_step(stk_rank_info *r, int *port, stk_err *err)
{
    bool fj, fs;
    int job = 0, step = 0;
    if (env_int("SLURM_JOB_ID", 0, INT_MAX, &job, &fj, err) ||
        env_int("SLURM_STEP_ID", 0, INT_MAX, &step, &fs, err))
        return STK_EINVAL;
    if (fj)
        snprintf(r->run_id, sizeof r->run_id, "SLURM job %d step %d", job, step);
    *port = SLURM_PORTS + (int)(((unsigned)job * 31u + (unsigned)step) % 10000u);
    return 0;
}

/* A task that srun started: srun sets the step's variables (a batch
 * script's shell has the job's, which say nothing about this process). */
static int from_slurm(stk_rank_info *r, stk_err *err)
{
    bool f1, f2, f3, f4;
    int nodes = 1;
    int rc = env_int("SLURM_PROCID", 0, 1 << 20, &r->rank, &f1, err);
    if (!rc)
        rc = env_int("SLURM_STEP_NUM_TASKS", 1, 1 << 20, &r->world, &f2, err);
    if (!rc)
        rc = env_int("SLURM_LOCALID", 0, 1 << 20, &r->local_rank, &f3, err);
    if (!rc)
        rc = env_int("SLURM_STEP_NUM_NODES", 1, 1 << 20, &nodes, &f4, err);
    if (!rc && (!f1 || !f2 || !f3))
        rc = stk_fail(err, STK_EINVAL,
                      "environment: SLURM_PROCID, SLURM_STEP_NUM_TASKS and "
                      "SLURM_LOCALID must all be set (run the ranks with srun)");
    int per = first_count(getenv("SLURM_STEP_TASKS_PER_NODE"));
    r->local_world = nodes == 1 ? r->world : per ? per : 1;
    int port = DEFAULT_PORT;
    if (!rc)
        rc = slurm_step(r, &port, err);
    if (!rc)
        rc = master(r, false, port, err);
    if (!rc && nodes > 1 && !getenv("MASTER_ADDR"))
        rc = stk_fail(err, STK_EINVAL,
                      "environment: a SLURM job over %d nodes needs "
                      "MASTER_ADDR (the first node's host name); e.g. export "
                      "MASTER_ADDR=$(scontrol show hostnames "
                      "\"$SLURM_JOB_NODELIST\" | head -n1)",
                      nodes);
    r->host_store = r->rank == 0; /* no launcher: rank 0 serves the store */
    return rc ? rc : check(r, err);
}

int stk_rank_from_env(stk_rank_info *out, stk_err *err)
{
    memset(out, 0, sizeof *out);
    out->world = out->local_world = 1;
    snprintf(out->master_addr, sizeof out->master_addr, "127.0.0.1");
    const char *rank = getenv("RANK"), *world = getenv("WORLD_SIZE");
    if ((rank && *rank) || (world && *world)) { /* empty: unset, as env_int */
        /* the stoke launcher sets the same variables, and says so */
        out->source = getenv("STOKE_LAUNCHER_PID") ? "stoke launcher"
                                                   : "torchrun variables";
        return from_torchrun(out, err);
    }
    const char *tasks = getenv("SLURM_STEP_NUM_TASKS");
    if (getenv("SLURM_PROCID") && tasks && strcmp(tasks, "1") != 0) {
        out->source = "SLURM";
        return from_slurm(out, err);
    }
    out->source = "single process";
    return 0;
}
