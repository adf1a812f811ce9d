/* store.c - the rendezvous store: a TCP key-value server on a libuv loop
 * of its own thread, and a blocking client.
 *
 * Wire format (little-endian): a request is op (u8), key length (u32),
 * key, value length (u32), value. Replies start with a status byte
 * (0 = ok); GET adds the value's length and bytes, ADD the new int64.
 * A GET on a missing key is parked until some SET or ADD creates it; the
 * client bounds its own wait and drops the connection on timeout, which
 * discards the parked request. */
#include "dist.h"

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
#include <uv.h>

enum { OP_SET = 1, OP_GET = 2, OP_ADD = 3 };
enum { MAX_KEY = 4096, MAX_VALUE = 64 << 20 };

/* ---- server -------------------------------------------------------------- */

typedef struct kv_entry {
    char *key;
    uint8_t *val;
    uint32_t n;
} kv_entry;

typedef struct conn {
    uv_tcp_t tcp;
    struct stk_store_server *srv;
    uint8_t *buf;
    size_t len, cap;
    struct conn *next;
} conn;

typedef struct waiter {
    conn *c;
    char *key;
    struct waiter *next;
} waiter;

struct stk_store_server {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t stop;
    uv_thread_t thread;
    kv_entry *kv;
    size_t nkv, cap;
    waiter *waiters;
    conn *conns;
};

static kv_entry *kv_find(stk_store_server *s, const char *key)
{
    for (size_t i = 0; i < s->nkv; i++)
        if (!strcmp(s->kv[i].key, key))
            return &s->kv[i];
    return NULL;
}

/* Stores a copy of val under key; false when out of memory. */
static bool kv_put(stk_store_server *s, const char *key, const uint8_t *val,
                   uint32_t n)
{
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy)
        return false;
    memcpy(copy, val, n);
    kv_entry *e = kv_find(s, key);
    if (!e) {
        if (s->nkv == s->cap) {
            size_t cap = s->cap ? 2 * s->cap : 64;
            kv_entry *kv = realloc(s->kv, cap * sizeof *kv);
            if (!kv) {
                free(copy);
                return false;
            }
            s->kv = kv;
            s->cap = cap;
        }
        e = &s->kv[s->nkv];
        if (!(e->key = strdup(key))) {
            free(copy);
            return false;
        }
        e->val = NULL;
        s->nkv++;
    }
    free(e->val);
    e->val = copy;
    e->n = n;
    return true;
}

static void free_write(uv_write_t *w, int status)
{
    (void)status;
    free(w);
}

static void close_conn(conn *c);

/* Queues a reply: a status byte, then up to two pieces. */
static void reply(conn *c, uint8_t status, const void *a, size_t na,
                  const void *b, size_t nb)
{
    uv_write_t *w = malloc(sizeof *w + 1 + na + nb);
    if (!w) {
        close_conn(c);
        return;
    }
    uint8_t *p = (uint8_t *)(w + 1);
    p[0] = status;
    if (na)
        memcpy(p + 1, a, na);
    if (nb)
        memcpy(p + 1 + na, b, nb);
    uv_buf_t buf = uv_buf_init((char *)p, (unsigned)(1 + na + nb));
    if (uv_write(w, (uv_stream_t *)&c->tcp, &buf, 1, free_write)) {
        free(w);
        close_conn(c);
    }
}

static void reply_value(conn *c, const kv_entry *e)
{
    uint32_t n = e->n;
    reply(c, 0, &n, sizeof n, e->val, n);
}

/* A key appeared: answers the GETs parked on it. */
static void wake_waiters(stk_store_server *s, const kv_entry *e)
{
    waiter **w = &s->waiters;
    while (*w) {
        if (!strcmp((*w)->key, e->key)) {
            waiter *done = *w;
            *w = done->next;
            reply_value(done->c, e);
            free(done->key);
            free(done);
        } else {
            w = &(*w)->next;
        }
    }
}

static void drop_waiters(stk_store_server *s, const conn *c)
{
    waiter **w = &s->waiters;
    while (*w) {
        if ((*w)->c == c) {
            waiter *gone = *w;
            *w = gone->next;
            free(gone->key);
            free(gone);
        } else {
            w = &(*w)->next;
        }
    }
}

static void on_closed(uv_handle_t *h)
{
    conn *c = (conn *)h;
    free(c->buf);
    free(c);
}

static void close_conn(conn *c)
{
    if (uv_is_closing((uv_handle_t *)&c->tcp))
        return;
    stk_store_server *s = c->srv;
    drop_waiters(s, c);
    for (conn **p = &s->conns; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    uv_close((uv_handle_t *)&c->tcp, on_closed);
}

static void handle_add(conn *c, const char *key, const uint8_t *val,
                       uint32_t n)
{
    stk_store_server *s = c->srv;
    int64_t delta, now = 0;
    if (n != sizeof delta) {
        reply(c, 1, NULL, 0, NULL, 0);
        return;
    }
    memcpy(&delta, val, sizeof delta);
    kv_entry *e = kv_find(s, key);
    if (e && e->n != sizeof now) {
        reply(c, 1, NULL, 0, NULL, 0);
        return;
    }
    if (e)
        memcpy(&now, e->val, sizeof now);
    now += delta;
    if (!kv_put(s, key, (const uint8_t *)&now, sizeof now)) {
        reply(c, 2, NULL, 0, NULL, 0);
        return;
    }
    reply(c, 0, &now, sizeof now, NULL, 0);
    wake_waiters(s, kv_find(s, key));
}

/* Executes one request; false ends the connection. */
static bool handle(conn *c, uint8_t op, const char *key, const uint8_t *val,
                   uint32_t n)
{
    stk_store_server *s = c->srv;
    if (op == OP_SET) {
        if (!kv_put(s, key, val, n)) {
            reply(c, 2, NULL, 0, NULL, 0);
            return true;
        }
        reply(c, 0, NULL, 0, NULL, 0);
        wake_waiters(s, kv_find(s, key));
    } else if (op == OP_GET) {
        kv_entry *e = kv_find(s, key);
        if (e) {
            reply_value(c, e);
            return true;
        }
        waiter *w = malloc(sizeof *w);
        if (!w || !(w->key = strdup(key))) {
            free(w);
            return false;
        }
        w->c = c;
        w->next = s->waiters;
        s->waiters = w;
    } else if (op == OP_ADD) {
        handle_add(c, key, val, n);
    } else {
        return false;
    }
    return true;
}

/* Runs every complete request in c's buffer; false on a malformed one. */
static bool drain(conn *c)
{
    size_t at = 0;
    for (;;) {
        const uint8_t *p = c->buf + at;
        size_t left = c->len - at;
        uint32_t klen, vlen;
        if (left < 5)
            break;
        memcpy(&klen, p + 1, 4);
        if (klen == 0 || klen > MAX_KEY)
            return false;
        if (left < 9 + (size_t)klen)
            break;
        memcpy(&vlen, p + 5 + klen, 4);
        if (vlen > MAX_VALUE)
            return false;
        if (left < 9 + (size_t)klen + vlen)
            break;
        char key[MAX_KEY + 1];
        memcpy(key, p + 5, klen);
        key[klen] = '\0';
        if (!handle(c, p[0], key, p + 9 + klen, vlen))
            return false;
        at += 9 + (size_t)klen + vlen;
        if (uv_is_closing((uv_handle_t *)&c->tcp))
            return true; /* a reply failed: the connection is going */
    }
    memmove(c->buf, c->buf + at, c->len - at);
    c->len -= at;
    return true;
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *out)
{
    conn *c = (conn *)h;
    if (c->cap - c->len < 65536) {
        size_t cap = c->cap ? c->cap * 2 : 65536 + hint;
        uint8_t *b = realloc(c->buf, cap);
        if (!b) {
            *out = uv_buf_init(NULL, 0);
            return;
        }
        c->buf = b;
        c->cap = cap;
    }
    *out = uv_buf_init((char *)c->buf + c->len, (unsigned)(c->cap - c->len));
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    conn *c = (conn *)st;
    if (nread < 0) {
        close_conn(c);
        return;
    }
    c->len += (size_t)nread;
    if (!drain(c))
        close_conn(c);
}

static void on_connection(uv_stream_t *server, int status)
{
    stk_store_server *s = server->data;
    if (status < 0)
        return;
    conn *c = calloc(1, sizeof *c);
    if (!c)
        return;
    c->srv = s;
    uv_tcp_init(&s->loop, &c->tcp);
    if (uv_accept(server, (uv_stream_t *)&c->tcp)) {
        uv_close((uv_handle_t *)&c->tcp, on_closed);
        return;
    }
    uv_tcp_nodelay(&c->tcp, 1);
    c->next = s->conns;
    s->conns = c;
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

static void on_stop(uv_async_t *a)
{
    stk_store_server *s = a->data;
    while (s->conns)
        close_conn(s->conns);
    uv_close((uv_handle_t *)&s->listener, NULL);
    uv_close((uv_handle_t *)&s->stop, NULL);
}

static void serve(void *arg)
{
    stk_store_server *s = arg;
    uv_run(&s->loop, UV_RUN_DEFAULT);
}

static void free_server(stk_store_server *s)
{
    for (size_t i = 0; i < s->nkv; i++) {
        free(s->kv[i].key);
        free(s->kv[i].val);
    }
    free(s->kv);
    while (s->waiters) {
        waiter *w = s->waiters;
        s->waiters = w->next;
        free(w->key);
        free(w);
    }
    free(s);
}

static int bind_error(const char *host, int port, int rc, stk_err *err)
{
    if (rc == UV_EADDRINUSE)
        return stk_fail(err, STK_EEXIST,
                        "--master-port %d: the port is already in use on %s "
                        "(another training job's store?); choose another port, "
                        "or leave --master-port out to take a free one",
                        port, host);
    return stk_fail(err, STK_EIO, "rendezvous store: cannot listen on %s:%d: %s",
                    host, port, uv_strerror(rc));
}

/* Binds and listens on the loop's thread-to-be; the caller's thread. */
static int listen_on(stk_store_server *s, const char *host, int port,
                     int *bound, stk_err *err)
{
    struct sockaddr_storage addr;
    uv_tcp_init(&s->loop, &s->listener); /* first: the error path closes it */
    s->listener.data = s;
    int rc = uv_ip4_addr(host, port, (struct sockaddr_in *)&addr);
    if (rc)
        rc = uv_ip6_addr(host, port, (struct sockaddr_in6 *)&addr);
    if (rc)
        return stk_fail(err, STK_EINVAL,
                        "rendezvous store: %s is not an IP address to listen on",
                        host);
    rc = uv_tcp_bind(&s->listener, (const struct sockaddr *)&addr, 0);
    if (!rc)
        rc = uv_listen((uv_stream_t *)&s->listener, 1024, on_connection);
    if (rc)
        return bind_error(host, port, rc, err);
    struct sockaddr_storage got;
    int len = sizeof got;
    uv_tcp_getsockname(&s->listener, (struct sockaddr *)&got, &len);
    *bound = ntohs(got.ss_family == AF_INET6
                       ? ((struct sockaddr_in6 *)&got)->sin6_port
                       : ((struct sockaddr_in *)&got)->sin_port);
    return 0;
}

int stk_store_server_start(const char *host, int port, int *bound,
                           stk_store_server **out, stk_err *err)
{
    *out = NULL;
    stk_store_server *s = calloc(1, sizeof *s);
    if (!s)
        return stk_fail(err, STK_ENOMEM, "rendezvous store: out of memory");
    uv_loop_init(&s->loop);
    signal(SIGPIPE, SIG_IGN); /* a client gone mid-reply: an error, not death */
    int rc = listen_on(s, host, port, bound, err);
    if (!rc) {
        uv_async_init(&s->loop, &s->stop, on_stop);
        s->stop.data = s;
        if (uv_thread_create(&s->thread, serve, s)) {
            uv_close((uv_handle_t *)&s->stop, NULL);
            rc = stk_fail(err, STK_EIO, "rendezvous store: cannot start its thread");
        }
    }
    if (rc) {
        uv_close((uv_handle_t *)&s->listener, NULL);
        uv_run(&s->loop, UV_RUN_DEFAULT);
        uv_loop_close(&s->loop);
        free_server(s);
        return rc;
    }
    *out = s;
    return 0;
}

void stk_store_server_stop(stk_store_server *s)
{
    if (!s)
        return;
    uv_async_send(&s->stop);
    uv_thread_join(&s->thread);
    uv_loop_close(&s->loop);
    free_server(s);
}

/* ---- client ------------------------------------------------------------- */

struct stk_kv {
    int fd;         /* open until stk_kv_close, so that stk_kv_interrupt
                       from another thread never meets a reused number */
    bool dead;      /* an error or timeout left the stream unusable */
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
                        "cannot reach the rendezvous store at %s:%d within %d s "
                        "(%s); is node 0's launcher (or rank 0) running, and are "
                        "MASTER_ADDR and MASTER_PORT the same on every node?",
                        host, port, timeout_ms / 1000, strerror(e));
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

static int lost(stk_kv *kv, const char *what, stk_err *err)
{
    retire(kv);
    return stk_fail(err, STK_EPEER,
                    "lost the rendezvous store at %s (%s); the launcher or rank 0 "
                    "has probably exited",
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
        if (k == 0)
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
                   uint32_t n, stk_err *err)
{
    if (kv->dead)
        return stk_fail(err, STK_EPEER,
                        "rendezvous store at %s: connection closed after an "
                        "earlier error", kv->where);
    uint32_t klen = (uint32_t)strlen(key);
    if (klen == 0 || klen > MAX_KEY || n > MAX_VALUE)
        return stk_fail(err, STK_EINVAL, "rendezvous store: key '%s' or its value "
                        "is too long", key);
    uint8_t head[5];
    head[0] = op;
    memcpy(head + 1, &klen, 4);
    int rc = io_all(kv, head, sizeof head, true, -1, err);
    if (!rc)
        rc = io_all(kv, (void *)key, klen, true, -1, err);
    if (!rc)
        rc = io_all(kv, &n, 4, true, -1, err);
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
    return st ? stk_fail(err, STK_EINVAL,
                         "rendezvous store: the server refused the request on "
                         "key '%s' (status %d)",
                         key, st)
              : 0;
}

/* A reply that did not come within the client's timeout. */
static int no_reply(stk_kv *kv, const char *key, stk_err *err)
{
    retire(kv);
    return stk_fail(err, STK_ETIMEDOUT,
                    "the rendezvous store at %s did not answer within %d s "
                    "(request on key '%s'); its machine may be gone",
                    kv->where, kv->timeout_ms / 1000, key);
}

int stk_kv_set(stk_kv *kv, const char *key, const void *val, size_t n,
               stk_err *err)
{
    int rc = request(kv, OP_SET, key, val, (uint32_t)n, err);
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
                        "timed out after %.0f s waiting for key '%s' in the "
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
    char count[MAX_KEY / 2], done[MAX_KEY / 2];
    snprintf(count, sizeof count, "%s/count", name);
    snprintf(done, sizeof done, "%s/done", name);
    int64_t arrived;
    int rc = stk_kv_add(kv, count, 1, &arrived, err);
    if (!rc && arrived == world)
        rc = stk_kv_set(kv, done, "1", 1, err);
    void *v;
    size_t n;
    if (!rc)
        rc = stk_kv_get(kv, done, timeout_ms, &v, &n, err);
    if (rc == STK_ETIMEDOUT)
        return stk_fail(err, STK_ETIMEDOUT,
                        "timed out after %.0f s at '%s': %lld of %d ranks "
                        "arrived when this one did; the others never came "
                        "(check that every node started, with the same "
                        "--nnodes and --nproc)",
                        timeout_ms / 1000.0, name, (long long)arrived, world);
    if (!rc)
        free(v);
    return rc;
}
