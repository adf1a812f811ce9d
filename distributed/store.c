/* store.c - the rendezvous store's blocking client (the server:
 * store_server.c; the wire format: store_wire.h). */
#include "distributed.h"
#include "store_wire.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

struct stk_kv {
    int fd;         /* open until stk_kv_close, so that stk_kv_interrupt
                       from another thread never meets a reused number */
    bool dead;      /* an error or timeout left the stream unusable */
    bool answered;  /* a reply of this protocol came: it is a stoke store */
    double first_ms; /* when the first request went out (0: none yet) */
    int timeout_ms; /* bounds SET and ADD too: a store that vanished with
                       its machine never answers */
    char where[300]; /* host:port, for messages */
};

static double now_ms(void) { return stk_now() * 1000.0; }

/* One non-blocking connect to ai, bounded by ms. */
static int try_connect(const struct addrinfo *ai, int ms, int *fd_out)
{
    int fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK,
                    ai->ai_protocol);
    if (fd < 0)
        return errno;
    int e = 0;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        e = errno;
        if (e == EINPROGRESS) {
            struct pollfd p = {fd, POLLOUT, 0};
            int n = poll(&p, 1, ms > 0 ? ms : 1);
            socklen_t len = sizeof e;
            if (n <= 0)
                e = ETIMEDOUT;
            else if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &e, &len) != 0)
                e = errno;
        }
    }
    if (e) {
        close(fd);
        return e;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    *fd_out = fd;
    return 0;
}

int stk_kv_connect(const char *host, int port, int timeout_ms, stk_kv **out,
                   stk_err *err)
{
    *out = NULL;
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    /* IPv4: the store listens on an IPv4 address */
    struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM},
                    *ai = NULL;
    int g = getaddrinfo(host, service, &hints, &ai);
    if (g)
        return stk_fail(err, STK_EINVAL,
                        "rendezvous store: cannot resolve MASTER_ADDR %s: %s", host,
                        gai_strerror(g));
    double deadline = now_ms() + timeout_ms;
    int fd = -1, e = 0;
    while (fd < 0) {
        for (const struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
            /* a few seconds per address: one that drops packets must not
             * use up the whole timeout */
            double left = deadline - now_ms();
            e = try_connect(a, left < 2000 ? (int)left : 2000, &fd);
        }
        if (fd >= 0 || now_ms() >= deadline)
            break;
        struct timespec pause = {0, 50 * 1000 * 1000};
        nanosleep(&pause, NULL); /* the server may not be up yet */
    }
    freeaddrinfo(ai);
    if (fd < 0)
        return stk_fail(err, STK_ETIMEDOUT,
                        "cannot reach the rendezvous store at %s:%d within %g s "
                        "(%s); is node 0's launcher (or, under SLURM, rank 0) "
                        "running, and are MASTER_ADDR and MASTER_PORT the same "
                        "on every node? (ranks that another tool started with "
                        "RANK and WORLD_SIZE find no stoke store: start them "
                        "with train --nproc, --nnodes or --gpus)",
                        host, port, timeout_ms / 1000.0, strerror(e));
    stk_kv *kv = calloc(1, sizeof *kv);
    if (!kv) {
        close(fd);
        return stk_fail(err, STK_ENOMEM, "rendezvous store: out of memory");
    }
    kv->fd = fd;
    kv->timeout_ms = timeout_ms > 0 ? timeout_ms : 1;
    snprintf(kv->where, sizeof kv->where, "%s:%d", host, port);
    *out = kv;
    return 0;
}

void stk_kv_interrupt(stk_kv *kv)
{
    if (kv)
        shutdown(kv->fd, SHUT_RDWR); /* the blocked poll or recv returns */
}

void stk_kv_close(stk_kv *kv)
{
    if (!kv)
        return;
    if (kv->fd >= 0)
        close(kv->fd);
    free(kv);
}

/* The stream cannot be used again (a reply may be half read or still to
 * come): every later call fails; the descriptor stays open until close. */
static void retire(stk_kv *kv)
{
    kv->dead = true;
}

/* What a server that never answered as a stoke store is likely to be. */
static int not_ours(stk_kv *kv, const char *what, stk_err *err)
{
    retire(kv);
    return stk_fail(err, STK_EPEER,
                    "the server at %s (%s) never answered as a stoke store "
                    "does: is it one? (torchrun's TCPStore speaks another "
                    "protocol: start stoke's ranks with train --nproc, "
                    "--nnodes or --gpus, or with srun; a stoke store also "
                    "disconnects a first request over one of its limits)",
                    kv->where, what);
}

static int lost(stk_kv *kv, const char *what, stk_err *err)
{
    /* closed at once on the first request: another protocol's server (a
     * blocking GET that waited for its key and then lost the store is no
     * such case) */
    if (!kv->answered && kv->first_ms && now_ms() - kv->first_ms < 1000)
        return not_ours(kv, what, err);
    retire(kv);
    return stk_fail(err, STK_EPEER,
                    "lost the rendezvous store at %s (%s); the launcher or rank 0 "
                    "has probably exited, or the store disconnected this "
                    "client over one of its limits (its log says which)",
                    kv->where, what);
}

/* Sends or receives n bytes, waiting at most until deadline (ms; < 0:
 * forever). 0, STK_ETIMEDOUT, or STK_EPEER when the connection is gone. */
static int io_all(stk_kv *kv, void *buf, size_t n, bool out, double deadline,
                  stk_err *err)
{
    uint8_t *p = buf;
    while (n) {
        int wait = deadline < 0 ? 1000 : (int)(deadline - now_ms());
        if (deadline >= 0 && wait <= 0)
            return STK_ETIMEDOUT;
        struct pollfd pf = {kv->fd, out ? POLLOUT : POLLIN, 0};
        int r = poll(&pf, 1, wait);
        if (r < 0 && errno != EINTR)
            return lost(kv, strerror(errno), err);
        if (r <= 0)
            continue;
        ssize_t k = out ? send(kv->fd, p, n, MSG_NOSIGNAL) : recv(kv->fd, p, n, 0);
        /* a reset is how the store disconnects a client over a limit */
        if (k == 0 || (k < 0 && (errno == ECONNRESET || errno == EPIPE)))
            return lost(kv, "connection closed", err);
        if (k < 0) {
            if (errno == EAGAIN || errno == EINTR)
                continue;
            return lost(kv, strerror(errno), err);
        }
        p += k;
        n -= (size_t)k;
    }
    return 0;
}

static int request(stk_kv *kv, uint8_t op, const char *key, const void *val,
                   size_t n, stk_err *err)
{
    if (kv->dead)
        return stk_fail(err, STK_EPEER,
                        "rendezvous store at %s: connection closed after an "
                        "earlier error", kv->where);
    size_t klen = strlen(key);
    if (klen == 0 || klen > STORE_MAX_KEY)
        return stk_fail(err, STK_EINVAL,
                        "rendezvous store: a key of %zu bytes ('%.40s'); keys "
                        "are 1 to %d bytes", klen, key, STORE_MAX_KEY);
    if (n > STORE_MAX_VALUE)
        return stk_fail(err, STK_EINVAL,
                        "rendezvous store: a value of %zu bytes for key '%s'; "
                        "values are at most %d bytes", n, key,
                        STORE_MAX_VALUE);
    uint8_t head[5];
    uint32_t klen32 = (uint32_t)klen, n32 = (uint32_t)n; /* both checked */
    if (!kv->first_ms)
        kv->first_ms = now_ms();
    head[0] = op;
    memcpy(head + 1, &klen32, 4);
    int rc = io_all(kv, head, sizeof head, true, -1, err);
    if (!rc)
        rc = io_all(kv, (void *)key, klen, true, -1, err);
    if (!rc)
        rc = io_all(kv, &n32, 4, true, -1, err);
    if (!rc && n)
        rc = io_all(kv, (void *)val, n, true, -1, err);
    return rc;
}

/* The status byte of a reply. */
static int status(stk_kv *kv, const char *key, double deadline, stk_err *err)
{
    uint8_t st;
    int rc = io_all(kv, &st, 1, false, deadline, err);
    if (rc)
        return rc;
    if (st > STORE_NO_MEMORY && !kv->answered)
        return not_ours(kv, "an unknown status byte", err);
    kv->answered = true;
    if (st == STORE_OK)
        return 0;
    if (st == STORE_NO_MEMORY)
        return stk_fail(err, STK_ENOMEM,
                        "rendezvous store at %s: out of memory storing key '%s'",
                        kv->where, key);
    return stk_fail(err, STK_EINVAL,
                    "rendezvous store: the server refused the request on key "
                    "'%s' (status %d%s)",
                    key, st, st == STORE_NOT_COUNTER ? ": not a counter" : "");
}

/* A reply that did not come within the client's timeout. */
static int no_reply(stk_kv *kv, const char *key, stk_err *err)
{
    retire(kv);
    return stk_fail(err, STK_ETIMEDOUT,
                    "the rendezvous store at %s did not answer within %g s "
                    "(request on key '%s'); its machine may be gone",
                    kv->where, kv->timeout_ms / 1000.0, key);
}

int stk_kv_set(stk_kv *kv, const char *key, const void *val, size_t n,
               stk_err *err)
{
    int rc = request(kv, OP_SET, key, val, n, err);
    if (!rc)
        rc = status(kv, key, now_ms() + kv->timeout_ms, err);
    return rc == STK_ETIMEDOUT ? no_reply(kv, key, err) : rc;
}

int stk_kv_get(stk_kv *kv, const char *key, int timeout_ms, void **val,
               size_t *n, stk_err *err)
{
    *val = NULL;
    *n = 0;
    double deadline = now_ms() + timeout_ms;
    int rc = request(kv, OP_GET, key, NULL, 0, err);
    uint32_t len = 0;
    if (!rc)
        rc = status(kv, key, deadline, err);
    if (!rc)
        rc = io_all(kv, &len, 4, false, deadline, err);
    if (!rc && len > STORE_MAX_VALUE) /* not our store: never size by it */
        rc = lost(kv, "it answered with a value over the limit", err);
    uint8_t *buf = NULL;
    if (!rc && !(buf = malloc(len + 1))) {
        retire(kv); /* the unread value would desynchronise the stream */
        rc = stk_fail(err, STK_ENOMEM, "rendezvous store: out of memory");
    }
    if (!rc)
        rc = io_all(kv, buf, len, false, deadline, err);
    if (rc == STK_ETIMEDOUT) {
        retire(kv); /* the late reply would desynchronise the stream */
        free(buf);
        return stk_fail(err, STK_ETIMEDOUT,
                        "timed out after %g s waiting for key '%s' in the "
                        "rendezvous store at %s",
                        timeout_ms / 1000.0, key, kv->where);
    }
    if (rc) {
        free(buf);
        return rc;
    }
    buf[len] = 0; /* a string value may be used as one */
    *val = buf;
    *n = len;
    return 0;
}

int stk_kv_add(stk_kv *kv, const char *key, int64_t delta, int64_t *after,
               stk_err *err)
{
    double deadline = now_ms() + kv->timeout_ms;
    int rc = request(kv, OP_ADD, key, &delta, sizeof delta, err);
    if (!rc)
        rc = status(kv, key, deadline, err);
    if (!rc)
        rc = io_all(kv, after, sizeof *after, false, deadline, err);
    return rc == STK_ETIMEDOUT ? no_reply(kv, key, err) : rc;
}

int stk_kv_barrier(stk_kv *kv, const char *name, int world, int timeout_ms,
                   stk_err *err)
{
    char count[STORE_MAX_KEY / 2], done[STORE_MAX_KEY / 2];
    snprintf(count, sizeof count, "%s/count", name);
    snprintf(done, sizeof done, "%s/done", name);
    int64_t arrived = 0;
    int rc = stk_kv_add(kv, count, 1, &arrived, err);
    if (!rc && arrived == world)
        rc = stk_kv_set(kv, done, "1", 1, err);
    if (rc) /* the store itself failed or went silent: err says how */
        return rc;
    void *v;
    size_t n;
    rc = stk_kv_get(kv, done, timeout_ms, &v, &n, err);
    if (rc == STK_ETIMEDOUT) /* the store answers; the other ranks did not come */
        return stk_fail(err, STK_ETIMEDOUT,
                        "timed out after %g s at '%s': %lld of %d ranks "
                        "arrived when this one did; the others never came "
                        "(check that every node started, with the same "
                        "--nnodes and --nproc)",
                        timeout_ms / 1000.0, name, (long long)arrived, world);
    if (!rc)
        free(v);
    return rc;
}
