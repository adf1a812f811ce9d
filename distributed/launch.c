/* launch.c - the launcher: one libuv loop that starts this node's ranks,
 * relays their output, passes signals on, and tears the group down when a
 * rank fails. Node 0's launcher also serves the rendezvous store (from a
 * thread of its own, store.c).
 *
 * Ranks run in a session of their own, so a Ctrl-C in the terminal reaches
 * only the launcher, which passes it on once; each rank asks the kernel to
 * kill it if the launcher dies (PR_SET_PDEATHSIG, in the trainer), so none
 * outlives it. On several nodes, a launcher whose rank fails tells the
 * others through the store ("launcher/stop/NODE"); each waits for that key
 * on a helper thread. */
#include "distributed.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

enum {
    TAIL_LINES = 8,     /* kept per rank, shown when it fails */
    LINE_MAX_BYTES = 1024,
    GRACE_MS = 3000,    /* after SIGTERM, before SIGKILL */
};

typedef struct relay {
    uv_pipe_t pipe;
    struct rank_proc *rp;
    FILE *to;          /* the launcher's stdout or stderr */
    char line[LINE_MAX_BYTES];
    size_t len;
    bool open;
} relay;

typedef struct rank_proc {
    uv_process_t proc;
    struct launcher *l;
    relay out, err;
    int rank;
    bool running;
    int64_t status;
    int signal;
    char tail[TAIL_LINES][LINE_MAX_BYTES];
    int ntail;
} rank_proc;

typedef struct launcher {
    uv_loop_t loop;
    uv_signal_t sigint, sigterm;
    uv_timer_t grace;
    uv_async_t remote; /* another node asked this one to stop */
    const stk_launch_opts *o;
    rank_proc *r;
    int n, running, open_handles;
    int failed;        /* index of the first rank that failed, -1 */
    int interrupts;
    bool stopping;     /* ranks were asked to stop */
    bool killing;      /* and the grace period ran out: SIGKILL sent */
    char remote_reason[512]; /* the loop thread's copy */
    uv_mutex_t mu;             /* guards pending_reason */
    char pending_reason[512];  /* written by the watcher thread */
    stk_kv *kv;        /* multi-node: to tell the other launchers */
    stk_kv *watch;     /* multi-node: the helper thread's connection */
    uv_thread_t watcher;
    bool watching;
} launcher;

/* ---- output --------------------------------------------------------------- */

static void keep_tail(rank_proc *rp, const char *line)
{
    if (rp->ntail == TAIL_LINES) {
        memmove(rp->tail[0], rp->tail[1], sizeof rp->tail[0] * (TAIL_LINES - 1));
        rp->ntail--;
    }
    snprintf(rp->tail[rp->ntail++], LINE_MAX_BYTES, "%s", line);
}

static void emit(relay *rl, bool complete)
{
    rank_proc *rp = rl->rp;
    rl->line[rl->len] = '\0';
    keep_tail(rp, rl->line);
    if (rp->rank == 0 || rp->l->o->log_all_ranks) {
        fprintf(rl->to, "[rank %d] %s%s", rp->rank, rl->line, complete ? "\n" : "");
        fflush(rl->to);
    }
    rl->len = 0;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *buf)
{
    (void)h;
    static char scratch[65536]; /* the loop's thread only, one read at a time */
    (void)hint;
    *buf = uv_buf_init(scratch, sizeof scratch);
}

static void on_handle_closed(uv_handle_t *h)
{
    launcher *l = h->data;
    l->open_handles--;
}

static void on_output(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    relay *rl = (relay *)s;
    if (n < 0) {
        if (rl->len)
            emit(rl, true);
        rl->open = false;
        uv_close((uv_handle_t *)s, on_handle_closed);
        return;
    }
    for (ssize_t i = 0; i < n; i++) {
        char c = buf->base[i];
        if (c == '\n' || c == '\r') {
            emit(rl, true);
            continue;
        }
        if (rl->len == LINE_MAX_BYTES - 1) /* a very long line: in pieces */
            emit(rl, true);
        rl->line[rl->len++] = c;
    }
}

/* ---- stopping ------------------------------------------------------------- */

static void signal_all(launcher *l, int sig)
{
    for (int i = 0; i < l->n; i++)
        if (l->r[i].running)
            uv_process_kill(&l->r[i].proc, sig);
}

static void on_grace_over(uv_timer_t *t)
{
    launcher *l = t->data;
    l->killing = true;
    signal_all(l, SIGKILL);
}

/* Asks every running rank to stop, and kills what is left after the grace
 * period. */
static void stop_all(launcher *l, int sig)
{
    if (l->stopping)
        return;
    l->stopping = true;
    signal_all(l, sig);
    uv_timer_start(&l->grace, on_grace_over, GRACE_MS, 0);
}

static void tell_other_nodes(launcher *l, const char *why)
{
    if (!l->kv)
        return;
    for (int node = 0; node < l->o->nnodes; node++) {
        if (node == l->o->node_rank)
            continue;
        char key[64];
        snprintf(key, sizeof key, "launcher/stop/%d", node);
        stk_err e;
        stk_kv_set(l->kv, key, why, strlen(why), &e); /* best effort */
    }
}

static void on_proc_closed(uv_handle_t *h)
{
    rank_proc *rp = h->data;
    rp->l->open_handles--;
}

static void on_exit_cb(uv_process_t *p, int64_t status, int sig)
{
    rank_proc *rp = p->data;
    launcher *l = rp->l;
    rp->running = false;
    rp->status = status;
    rp->signal = sig;
    l->running--;
    uv_close((uv_handle_t *)p, on_proc_closed);
    bool bad = status != 0 || sig != 0;
    /* a rank that stopped because of a Ctrl-C (or a second one's SIGKILL)
     * did not fail */
    bool interrupted = (l->interrupts > 0 && (status == 130 || sig == SIGINT)) ||
                       (l->interrupts > 1 && sig == SIGKILL);
    /* the cause: the first rank to fail, unless it only exited with an
     * error and a rank dies of a signal that is not the launcher's (a rank
     * that sees its peer die in a collective exits with status 1, maybe
     * before the launcher hears of the peer's SIGKILL) */
    bool ours = l->stopping && (sig == SIGTERM || (sig == SIGKILL && l->killing));
    if (bad && !interrupted && !ours && sig && l->failed >= 0 &&
        !l->r[l->failed].signal)
        l->failed = (int)(rp - l->r);
    if (bad && !interrupted && l->failed < 0 && !l->remote_reason[0]) {
        l->failed = (int)(rp - l->r);
        char why[256];
        snprintf(why, sizeof why, "rank %d on node %d failed", rp->rank,
                 l->o->node_rank);
        stop_all(l, SIGTERM); /* first: telling the others may take a while */
        tell_other_nodes(l, why);
    }
    if (l->running == 0) {
        uv_timer_stop(&l->grace);
        uv_signal_stop(&l->sigint);
        uv_signal_stop(&l->sigterm);
    }
}

static void on_signal(uv_signal_t *s, int sig)
{
    launcher *l = s->data;
    if (sig == SIGINT && ++l->interrupts > 1) {
        fprintf(stderr, "train: second Ctrl-C: killing the ranks\n");
        signal_all(l, SIGKILL);
        return;
    }
    if (sig == SIGTERM)
        l->interrupts++;
    /* the ranks stop together at a step boundary; rank 0 checkpoints */
    signal_all(l, sig);
}

static void on_remote(uv_async_t *a)
{
    launcher *l = a->data;
    uv_mutex_lock(&l->mu);
    memcpy(l->remote_reason, l->pending_reason, sizeof l->remote_reason);
    uv_mutex_unlock(&l->mu);
    if (l->remote_reason[0] && l->running > 0)
        stop_all(l, SIGTERM);
}

/* Multi-node: waits on this node's stop key; set by a launcher whose rank
 * failed, or by this launcher itself (empty) when it is done. */
static void watch_main(void *arg)
{
    launcher *l = arg;
    char key[64];
    snprintf(key, sizeof key, "launcher/stop/%d", l->o->node_rank);
    void *v;
    size_t n;
    stk_err e;
    if (stk_kv_get(l->watch, key, 1 << 30, &v, &n, &e) == 0) {
        if (n) {
            uv_mutex_lock(&l->mu);
            snprintf(l->pending_reason, sizeof l->pending_reason, "%s", (char *)v);
            uv_mutex_unlock(&l->mu);
            uv_async_send(&l->remote);
        }
        free(v);
    }
}

/* ---- starting ------------------------------------------------------------- */

static int env_add(char ***env, int *n, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static int env_add(char ***env, int *n, const char *fmt, ...)
{
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char **e = realloc(*env, (size_t)(*n + 2) * sizeof *e);
    if (!e)
        return STK_ENOMEM;
    *env = e;
    if (!(e[*n] = strdup(buf)))
        return STK_ENOMEM;
    e[++*n] = NULL;
    return 0;
}

static bool ours(const char *var)
{
    static const char *const names[] = {"RANK=", "LOCAL_RANK=", "WORLD_SIZE=",
                                        "LOCAL_WORLD_SIZE=", "MASTER_ADDR=",
                                        "MASTER_PORT=", "STOKE_LAUNCHER_PID="};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (!strncmp(var, names[i], strlen(names[i])))
            return true;
    return false;
}

extern char **environ;

/* This process's environment without the rank variables, plus rank k's. */
static char **rank_env(const launcher *l, int local, const char *addr, int port)
{
    const stk_launch_opts *o = l->o;
    char **env = NULL;
    int n = 0, rc = 0;
    for (char **e = environ; *e && !rc; e++)
        if (!ours(*e))
            rc = env_add(&env, &n, "%s", *e);
    if (!rc)
        rc = env_add(&env, &n, "RANK=%d", o->node_rank * o->nproc + local);
    if (!rc)
        rc = env_add(&env, &n, "LOCAL_RANK=%d", local);
    if (!rc)
        rc = env_add(&env, &n, "WORLD_SIZE=%d", o->nnodes * o->nproc);
    if (!rc)
        rc = env_add(&env, &n, "LOCAL_WORLD_SIZE=%d", o->nproc);
    if (!rc)
        rc = env_add(&env, &n, "MASTER_ADDR=%s", addr);
    if (!rc)
        rc = env_add(&env, &n, "MASTER_PORT=%d", port);
    if (!rc)
        rc = env_add(&env, &n, "STOKE_LAUNCHER_PID=%d", (int)uv_os_getpid());
    if (rc) {
        for (int i = 0; i < n; i++)
            free(env[i]);
        free(env);
        return NULL;
    }
    return env;
}

static void free_env(char **env)
{
    for (char **e = env; e && *e; e++)
        free(*e);
    free(env);
}

static int spawn_rank(launcher *l, int local, const char *addr, int port,
                      stk_err *err)
{
    rank_proc *rp = &l->r[local];
    rp->l = l;
    rp->rank = l->o->node_rank * l->o->nproc + local;
    relay *pipes[2] = {&rp->out, &rp->err};
    for (int i = 0; i < 2; i++) {
        uv_pipe_init(&l->loop, &pipes[i]->pipe, 0);
        pipes[i]->pipe.data = l;
        pipes[i]->rp = rp;
        pipes[i]->to = i ? stderr : stdout;
        l->open_handles++;
    }
    uv_stdio_container_t stdio[3] = {
        {.flags = UV_IGNORE},
        {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE, .data.stream = (uv_stream_t *)&rp->out.pipe},
        {.flags = UV_CREATE_PIPE | UV_WRITABLE_PIPE, .data.stream = (uv_stream_t *)&rp->err.pipe}};
    char **env = rank_env(l, local, addr, port);
    if (!env)
        return stk_fail(err, STK_ENOMEM, "launcher: out of memory");
    uv_process_options_t po = {.exit_cb = on_exit_cb,
                               .file = "/proc/self/exe",
                               .args = (char **)l->o->argv,
                               .env = env,
                               .flags = UV_PROCESS_DETACHED,
                               .stdio_count = 3,
                               .stdio = stdio};
    rp->proc.data = rp;
    int rc = uv_spawn(&l->loop, &rp->proc, &po);
    free_env(env);
    if (rc) {
        for (int i = 0; i < 2; i++)
            uv_close((uv_handle_t *)&pipes[i]->pipe, on_handle_closed);
        l->open_handles++; /* uv_spawn initialised the handle even so */
        uv_close((uv_handle_t *)&rp->proc, on_proc_closed);
        return stk_fail(err, STK_EIO, "launcher: cannot start rank %d: %s",
                        rp->rank, uv_strerror(rc));
    }
    l->open_handles++; /* the process handle */
    rp->running = true;
    l->running++;
    for (int i = 0; i < 2; i++) {
        pipes[i]->open = true;
        uv_read_start((uv_stream_t *)&pipes[i]->pipe, on_alloc, on_output);
    }
    return 0;
}

/* ---- the result ----------------------------------------------------------- */

static void describe_exit(const rank_proc *rp, char *buf, size_t n)
{
    if (rp->signal)
        snprintf(buf, n, "was killed by signal %d (%s)", rp->signal,
                 strsignal(rp->signal));
    else
        snprintf(buf, n, "exited with status %lld", (long long)rp->status);
}

static int outcome(launcher *l, int *exit_code, stk_err *err)
{
    if (l->failed >= 0) {
        rank_proc *rp = &l->r[l->failed];
        char how[128];
        describe_exit(rp, how, sizeof how);
        fprintf(stderr, "train: rank %d %s; its last lines of output:%s\n", rp->rank,
                how, rp->ntail ? "" : " (none)");
        for (int i = 0; i < rp->ntail; i++)
            fprintf(stderr, "  [rank %d] %s\n", rp->rank, rp->tail[i]);
        *exit_code = rp->signal ? 128 + rp->signal : (int)(rp->status ? rp->status : 1);
        if (l->n == 1)
            return stk_fail(err, STK_EPEER, "rank %d %s", rp->rank, how);
        return stk_fail(err, STK_EPEER, "rank %d %s; %s on this node %s stopped",
                        rp->rank, how, l->n == 2 ? "the other rank" : "the other ranks",
                        l->n == 2 ? "was" : "were");
    }
    if (l->remote_reason[0]) {
        *exit_code = 1;
        return stk_fail(err, STK_EPEER, "stopped this node's ranks: %s",
                        l->remote_reason);
    }
    *exit_code = 0;
    for (int i = 0; i < l->n; i++)
        if (l->r[i].status || l->r[i].signal) {
            rank_proc *rp = &l->r[i];
            *exit_code = rp->signal ? 128 + rp->signal : (int)rp->status;
        }
    return 0;
}

/* ---- setup -------------------------------------------------------------------- */

static int serve_store(const stk_launch_opts *o, stk_store_server **srv,
                       int *port, stk_err *err)
{
    /* one node: loopback only; several: every interface */
    const char *bind_to = o->nnodes > 1 ? "0.0.0.0" : "127.0.0.1";
    return stk_store_server_start(bind_to, o->master_port, port, srv, err);
}

static int check_opts(const stk_launch_opts *o, stk_err *err)
{
    if (o->nproc < 1 || o->nnodes < 1 || o->node_rank < 0 ||
        o->node_rank >= o->nnodes)
        return stk_fail(err, STK_EINVAL,
                        "--node-rank %d must be below --nnodes %d, with at least "
                        "one rank per node",
                        o->node_rank, o->nnodes);
    if (o->nnodes > 1 && (!o->master_port || !o->master_addr))
        return stk_fail(err, STK_EINVAL,
                        "--nnodes %d needs --master-addr (node 0's address) and "
                        "--master-port (a fixed port, the same on every node)",
                        o->nnodes);
    return 0;
}

/* Multi-node: a connection to tell the others, one for the helper. */
static int connect_nodes(launcher *l, const char *addr, int port, stk_err *err)
{
    int rc = stk_kv_connect(addr, port, l->o->timeout_ms, &l->kv, err);
    if (!rc)
        rc = stk_kv_connect(addr, port, l->o->timeout_ms, &l->watch, err);
    if (!rc && uv_thread_create(&l->watcher, watch_main, l) == 0)
        l->watching = true;
    return rc;
}

static void release_watcher(launcher *l)
{
    if (l->watching) {
        /* locally: a store that is gone (with its machine) answers nothing */
        stk_kv_interrupt(l->watch);
        uv_thread_join(&l->watcher);
    }
    stk_kv_close(l->kv);
}

int stk_launch(const stk_launch_opts *o, int *exit_code, stk_err *err)
{
    *exit_code = 2; /* options that cannot work are bad usage */
    int rc = check_opts(o, err);
    if (rc)
        return rc;
    *exit_code = 1;
    launcher l;
    memset(&l, 0, sizeof l);
    l.o = o;
    l.n = o->nproc;
    l.failed = -1;
    if (!(l.r = calloc((size_t)l.n, sizeof *l.r)))
        return stk_fail(err, STK_ENOMEM, "launcher: out of memory");
    stk_store_server *srv = NULL;
    int port = o->master_port;
    /* one node: the store listens on loopback, whatever --master-addr says */
    const char *addr = o->master_addr && o->nnodes > 1 ? o->master_addr : "127.0.0.1";
    signal(SIGPIPE, SIG_IGN); /* a closed output pipe must not kill the ranks */
    uv_mutex_init(&l.mu);
    if (o->node_rank == 0)
        rc = serve_store(o, &srv, &port, err);
    uv_loop_init(&l.loop);
    uv_signal_init(&l.loop, &l.sigint);
    uv_signal_init(&l.loop, &l.sigterm);
    uv_timer_init(&l.loop, &l.grace);
    uv_async_init(&l.loop, &l.remote, on_remote);
    l.sigint.data = l.sigterm.data = l.grace.data = l.remote.data = &l;
    if (!rc && o->nnodes > 1)
        rc = connect_nodes(&l, addr, port, err);
    if (!rc) {
        uv_signal_start(&l.sigint, on_signal, SIGINT);
        uv_signal_start(&l.sigterm, on_signal, SIGTERM);
    }
    for (int i = 0; i < l.n && !rc; i++)
        rc = spawn_rank(&l, i, addr, port, err);
    if (rc) {
        stop_all(&l, SIGKILL);
        tell_other_nodes(&l, "a launcher could not start its ranks");
    }
    while (l.running > 0 || l.open_handles > 0)
        if (!uv_run(&l.loop, UV_RUN_ONCE) && l.running == 0)
            break;
    uv_signal_stop(&l.sigint);
    uv_signal_stop(&l.sigterm);
    uv_timer_stop(&l.grace);
    if (!rc)
        rc = outcome(&l, exit_code, err);
    release_watcher(&l);
    stk_kv_close(l.watch);
    uv_close((uv_handle_t *)&l.sigint, NULL);
    uv_close((uv_handle_t *)&l.sigterm, NULL);
    uv_close((uv_handle_t *)&l.grace, NULL);
    uv_close((uv_handle_t *)&l.remote, NULL);
    uv_run(&l.loop, UV_RUN_DEFAULT);
    uv_loop_close(&l.loop);
    uv_mutex_destroy(&l.mu);
    stk_store_server_stop(srv);
    free(l.r);
    return rc;
}
