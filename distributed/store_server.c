/* store_server.c - the rendezvous store's server: a TCP key-value server on
 * a libuv loop of its own thread (wire format: store_wire.h).
 *
 * Whoever can connect can make it hold memory, so everything a client can
 * grow is bounded (stk_store_limits): a request's key and value lengths are
 * checked as soon as they arrive, before a byte is kept for them; bytes
 * read go into one buffer of the loop's, and only the start of a request
 * still arriving is copied into its connection; that, the replies a client
 * has not read and its parked GETs count against its connection's budget
 * and all connections' together; keys and values against the store's. A
 * client over a limit is disconnected with one log line naming it and the
 * limit; the store and the other clients go on.
 *
 * Accounting invariant: every byte charged is uncharged by whoever frees
 * it (a reply's write callback, which libuv also calls for writes a close
 * cancels; a woken or dropped waiter; the closed connection's buffer), so
 * with no client connected, in-flight bytes are 0 (tested). */
#include "distributed.h"
#include "store_wire.h"

#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

/* What a key, a parked GET or a reply costs beyond its bytes (its struct
 * and the allocator's header): so that a million tiny ones count. */
enum { OVERHEAD = 64 };

enum { READ_CHUNK = 64 << 10 };

typedef struct kv_entry {
    struct kv_entry *next; /* in its hash bucket */
    uint8_t *val;
    uint32_t n, klen;
    uint64_t hash;
    char key[]; /* klen bytes, not NUL-terminated (a key may hold a NUL) */
} kv_entry;

typedef struct conn conn;

typedef struct waiter { /* a GET parked until its key exists */
    struct waiter *next;
    conn *c;
    uint64_t hash;
    uint32_t klen;
    char key[];
} waiter;

struct conn {
    uv_tcp_t tcp;
    struct stk_store_server *srv;
    uint8_t *part; /* the start of a request whose rest has not arrived */
    size_t len, cap;
    size_t pending; /* bytes charged to this connection */
    char peer[64];  /* address:port, for the log */
    bool reset;     /* dropped: closed with a reset (see close_conn) */
    conn *prev, *next;
};

struct stk_store_server {
    uv_loop_t loop;
    uv_tcp_t listener;
    uv_async_t stop;
    uv_thread_t thread;
    stk_store_limits lim;
    stk_store_log_fn log;
    void *log_arg;
    kv_entry **bucket; /* nbucket (a power of two) chains */
    size_t nbucket;
    waiter *waiters;
    conn *conns;
    /* written on the loop's thread only; atomic for stk_store_server_usage */
    atomic_size_t nkv, stored, inflight, peak, dropped;
    uint8_t chunk[READ_CHUNK]; /* what every read lands in */
};

/* ---- counting ---------------------------------------------------------------- */

static size_t get(atomic_size_t *a)
{
    return atomic_load_explicit(a, memory_order_relaxed);
}

static void put(atomic_size_t *a, size_t v)
{
    atomic_store_explicit(a, v, memory_order_relaxed);
}

static void close_conn(conn *c);

/* A key for the log: printable ASCII, at most 40 characters. */
static void printable(char *out, size_t size, const char *key, size_t klen)
{
    size_t n = 0;
    for (size_t i = 0; i < klen && n + 4 < size; i++) {
        if (i == 40) {
            memcpy(out + n, "...", 3);
            n += 3;
            break;
        }
        unsigned char ch = (unsigned char)key[i];
        out[n++] = ch >= 0x20 && ch < 0x7f ? (char)ch : '?'; /* any locale */
    }
    out[n] = '\0';
}

/* Disconnects c with one log line: its peer, then why. */
static void drop(conn *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void drop(conn *c, const char *fmt, ...)
{
    stk_store_server *s = c->srv;
    if (uv_is_closing((uv_handle_t *)&c->tcp))
        return;
    if (s->log) {
        char line[512];
        int n = snprintf(line, sizeof line, "rendezvous store: disconnected %s: ",
                         c->peer);
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
        va_end(ap);
        s->log(s->log_arg, line);
    }
    put(&s->dropped, get(&s->dropped) + 1);
    c->reset = true;
    close_conn(c);
}

/* Charges n bytes to c and to all connections; over a limit c is dropped
 * (false), naming what wanted the bytes (and, for one connection over its
 * own limit, the hint). */
static bool charge(conn *c, size_t n, const char *what, const char *hint)
{
    stk_store_server *s = c->srv;
    size_t all = get(&s->inflight);
    if (c->pending + n > s->lim.pending) {
        drop(c, "%s would make %zu bytes held for this connection, over the "
                "limit of %zu a connection%s",
             what, c->pending + n, s->lim.pending, hint);
        return false;
    }
    if (all + n > s->lim.inflight) {
        drop(c, "%s would make %zu bytes held for all connections, over the "
                "limit of %zu",
             what, all + n, s->lim.inflight);
        return false;
    }
    c->pending += n;
    put(&s->inflight, all + n);
    if (all + n > get(&s->peak))
        put(&s->peak, all + n);
    return true;
}

static void uncharge(conn *c, size_t n)
{
    c->pending -= n;
    put(&c->srv->inflight, get(&c->srv->inflight) - n);
}

/* ---- keys ---------------------------------------------------------------------- */

static uint64_t hash_key(const char *key, size_t klen)
{
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < klen; i++)
        h = (h ^ (uint8_t)key[i]) * 1099511628211ull;
    return h;
}

static kv_entry *kv_find(stk_store_server *s, const char *key, uint32_t klen,
                         uint64_t h)
{
    for (kv_entry *e = s->bucket[h & (s->nbucket - 1)]; e; e = e->next)
        if (e->hash == h && e->klen == klen && !memcmp(e->key, key, klen))
            return e;
    return NULL;
}

/* Doubles the buckets once there are more keys than buckets; where memory
 * is short the chains just grow longer. */
static void kv_grow(stk_store_server *s)
{
    if (get(&s->nkv) < s->nbucket)
        return;
    size_t n = 2 * s->nbucket;
    kv_entry **b = calloc(n, sizeof *b);
    if (!b)
        return;
    for (size_t i = 0; i < s->nbucket; i++)
        while (s->bucket[i]) {
            kv_entry *e = s->bucket[i];
            s->bucket[i] = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
        }
    free(s->bucket);
    s->bucket = b;
    s->nbucket = n;
}

static size_t entry_bytes(size_t klen, size_t n) { return OVERHEAD + klen + n; }

/* Whether a value of n bytes under key (e: its entry, NULL when new) fits
 * the store's limits; drops c when not. */
static bool fits(conn *c, const kv_entry *e, const char *key, uint32_t klen,
                 uint32_t n)
{
    stk_store_server *s = c->srv;
    char name[48];
    size_t keys = get(&s->nkv), now = get(&s->stored);
    size_t after = now - (e ? entry_bytes(klen, e->n) : 0) + entry_bytes(klen, n);
    if (!e && keys + 1 > s->lim.keys) {
        printable(name, sizeof name, key, klen);
        drop(c, "key '%s' would be key number %zu, over the limit of %zu keys",
             name, keys + 1, s->lim.keys);
        return false;
    }
    if (after > s->lim.stored) {
        printable(name, sizeof name, key, klen);
        drop(c, "key '%s' would make the store hold %zu bytes of keys and "
                "values, over the limit of %zu",
             name, after, s->lim.stored);
        return false;
    }
    return true;
}

/* Stores a copy of val under key. 1: done, 0: out of memory, -1: over a
 * limit (c is dropped). *out: the entry. */
static int kv_put(conn *c, const char *key, uint32_t klen, const void *val,
                  uint32_t n, kv_entry **out)
{
    stk_store_server *s = c->srv;
    uint64_t h = hash_key(key, klen);
    kv_entry *e = kv_find(s, key, klen, h);
    if (!fits(c, e, key, klen, n))
        return -1;
    uint8_t *copy = malloc(n ? n : 1);
    if (!copy)
        return 0;
    memcpy(copy, val, n);
    size_t stored = get(&s->stored);
    if (!e) {
        if (!(e = malloc(sizeof *e + klen))) {
            free(copy);
            return 0;
        }
        memcpy(e->key, key, klen);
        e->klen = klen;
        e->hash = h;
        e->val = NULL;
        e->n = 0;
        e->next = s->bucket[h & (s->nbucket - 1)];
        s->bucket[h & (s->nbucket - 1)] = e;
        put(&s->nkv, get(&s->nkv) + 1);
        kv_grow(s);
    } else {
        stored -= entry_bytes(klen, e->n);
    }
    free(e->val);
    e->val = copy;
    e->n = n;
    put(&s->stored, stored + entry_bytes(klen, n));
    *out = e;
    return 1;
}

/* ---- replies ------------------------------------------------------------------- */

static void free_write(uv_write_t *w, int status)
{
    (void)status; /* also called, with UV_ECANCELED, for a closed stream */
    uncharge((conn *)w->handle, (size_t)(uintptr_t)w->data);
    free(w);
}

/* Queues a reply: a status byte, then up to two pieces; false when c is
 * going (dropped over its budget, or the write failed). */
static bool reply(conn *c, uint8_t status, const void *a, size_t na,
                  const void *b, size_t nb)
{
    if (uv_is_closing((uv_handle_t *)&c->tcp))
        return false;
    size_t size = sizeof(uv_write_t) + 1 + na + nb;
    if (!charge(c, OVERHEAD + size, "a reply",
                " (a client that does not read its replies?)"))
        return false;
    uv_write_t *w = malloc(size);
    if (!w) {
        uncharge(c, OVERHEAD + size);
        close_conn(c);
        return false;
    }
    w->data = (void *)(uintptr_t)(OVERHEAD + size);
    uint8_t *p = (uint8_t *)(w + 1);
    p[0] = status;
    if (na)
        memcpy(p + 1, a, na);
    if (nb)
        memcpy(p + 1 + na, b, nb);
    uv_buf_t buf = uv_buf_init((char *)p, (unsigned)(1 + na + nb));
    if (uv_write(w, (uv_stream_t *)&c->tcp, &buf, 1, free_write)) {
        uncharge(c, OVERHEAD + size);
        free(w);
        close_conn(c);
        return false;
    }
    return true;
}

static bool reply_value(conn *c, const kv_entry *e)
{
    uint32_t n = e->n;
    return reply(c, STORE_OK, &n, sizeof n, e->val, n);
}

static size_t waiter_bytes(const waiter *w) { return OVERHEAD + w->klen; }

/* A key appeared: answers the GETs parked on it. They are taken off the
 * list first: a reply can drop its connection, which takes that
 * connection's other waiters off the list. */
static void wake_waiters(stk_store_server *s, const kv_entry *e)
{
    waiter *woken = NULL, **w = &s->waiters;
    while (*w) {
        waiter *x = *w;
        if (x->hash == e->hash && x->klen == e->klen &&
            !memcmp(x->key, e->key, e->klen)) {
            *w = x->next;
            x->next = woken;
            woken = x;
        } else {
            w = &x->next;
        }
    }
    while (woken) {
        waiter *x = woken;
        woken = x->next;
        uncharge(x->c, waiter_bytes(x));
        reply_value(x->c, e);
        free(x);
    }
}

static void drop_waiters(stk_store_server *s, conn *c)
{
    waiter **w = &s->waiters;
    while (*w) {
        if ((*w)->c == c) {
            waiter *gone = *w;
            *w = gone->next;
            uncharge(c, waiter_bytes(gone));
            free(gone);
        } else {
            w = &(*w)->next;
        }
    }
}

/* ---- connections ------------------------------------------------------------------ */

static void on_closed(uv_handle_t *h)
{
    conn *c = (conn *)h;
    if (c->cap)
        uncharge(c, c->cap);
    free(c->part);
    free(c);
}

static void close_conn(conn *c)
{
    if (uv_is_closing((uv_handle_t *)&c->tcp))
        return;
    stk_store_server *s = c->srv;
    drop_waiters(s, c);
    if (c->prev)
        c->prev->next = c->next;
    else
        s->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    /* a dropped client is reset: the kernel discards what it still held
     * for it at once, instead of trickling out megabytes (beyond the
     * store's own limits) to a client that reads a few bytes at a time */
    if (!c->reset || uv_tcp_close_reset(&c->tcp, on_closed))
        uv_close((uv_handle_t *)&c->tcp, on_closed);
}

/* ---- requests --------------------------------------------------------------------- */

static bool handle_add(conn *c, const char *key, uint32_t klen,
                       const uint8_t *val, uint32_t n)
{
    stk_store_server *s = c->srv;
    int64_t delta, now = 0;
    if (n != sizeof delta)
        return reply(c, STORE_NOT_COUNTER, NULL, 0, NULL, 0);
    memcpy(&delta, val, sizeof delta);
    kv_entry *e = kv_find(s, key, klen, hash_key(key, klen));
    if (e && e->n != sizeof now)
        return reply(c, STORE_NOT_COUNTER, NULL, 0, NULL, 0);
    if (e)
        memcpy(&now, e->val, sizeof now);
    now = (int64_t)((uint64_t)now + (uint64_t)delta); /* wraps, defined */
    int put_rc = kv_put(c, key, klen, &now, sizeof now, &e);
    if (put_rc <= 0)
        return put_rc == 0 && reply(c, STORE_NO_MEMORY, NULL, 0, NULL, 0);
    bool ok = reply(c, STORE_OK, &now, sizeof now, NULL, 0);
    wake_waiters(s, e);
    return ok;
}

static bool handle_get(conn *c, const char *key, uint32_t klen)
{
    stk_store_server *s = c->srv;
    uint64_t h = hash_key(key, klen);
    kv_entry *e = kv_find(s, key, klen, h);
    if (e)
        return reply_value(c, e);
    if (!charge(c, OVERHEAD + klen, "a parked GET",
                " (GETs of keys that nobody sets?)"))
        return false;
    waiter *w = malloc(sizeof *w + klen);
    if (!w) {
        uncharge(c, OVERHEAD + klen);
        close_conn(c);
        return false;
    }
    memcpy(w->key, key, klen);
    w->klen = klen;
    w->hash = h;
    w->c = c;
    w->next = s->waiters;
    s->waiters = w;
    return true;
}

/* Executes one request; false when c is going. */
static bool handle(conn *c, uint8_t op, const char *key, uint32_t klen,
                   const uint8_t *val, uint32_t n)
{
    if (op == OP_GET)
        return handle_get(c, key, klen);
    if (op == OP_ADD)
        return handle_add(c, key, klen, val, n);
    kv_entry *e;
    int put_rc = kv_put(c, key, klen, val, n, &e);
    if (put_rc <= 0)
        return put_rc == 0 && reply(c, STORE_NO_MEMORY, NULL, 0, NULL, 0);
    bool ok = reply(c, STORE_OK, NULL, 0, NULL, 0);
    wake_waiters(c->srv, e);
    return ok;
}

/* The size of the request that p[0, n) starts, once its lengths have
 * arrived (0 before); each length is checked as soon as it is there, so
 * that no byte is kept for a request over a limit. SIZE_MAX: c is
 * dropped. */
static size_t request_size(conn *c, const uint8_t *p, size_t n)
{
    const stk_store_limits *lim = &c->srv->lim;
    if (p[0] != OP_SET && p[0] != OP_GET && p[0] != OP_ADD) {
        drop(c, "sent %d where a request starts (1 SET, 2 GET, 3 ADD): not a "
                "store client",
             p[0]);
        return SIZE_MAX;
    }
    uint32_t klen, vlen;
    if (n < 5)
        return 0;
    memcpy(&klen, p + 1, 4);
    if (klen == 0) {
        drop(c, "an empty key (keys are 1 to %zu bytes)", lim->key);
        return SIZE_MAX;
    }
    if (klen > lim->key) {
        drop(c, "a key of %u bytes, over the limit of %zu bytes a key", klen,
             lim->key);
        return SIZE_MAX;
    }
    if (n < 9 + (size_t)klen)
        return 0;
    memcpy(&vlen, p + 5 + klen, 4);
    if (vlen > lim->value) {
        char name[48];
        printable(name, sizeof name, (const char *)p + 5, klen);
        drop(c, "a value of %u bytes for key '%s', over the limit of %zu "
                "bytes a value",
             vlen, name, lim->value);
        return SIZE_MAX;
    }
    return 9 + (size_t)klen + vlen;
}

/* Runs the complete requests at the start of p[0, n). Returns the bytes
 * they took, or SIZE_MAX when c is going; *next: the size of the request
 * left unfinished (0: not known yet). */
static size_t run_requests(conn *c, const uint8_t *p, size_t n, size_t *next)
{
    size_t at = 0;
    *next = 0;
    while (at < n) {
        size_t size = request_size(c, p + at, n - at);
        if (size == SIZE_MAX)
            return SIZE_MAX;
        if (size == 0 || n - at < size) {
            *next = size;
            break;
        }
        const uint8_t *r = p + at;
        uint32_t klen, vlen;
        memcpy(&klen, r + 1, 4);
        memcpy(&vlen, r + 5 + klen, 4);
        /* a reply to a GET parked on this connection can drop it too */
        if (!handle(c, r[0], (const char *)r + 5, klen, r + 9 + klen, vlen) ||
            uv_is_closing((uv_handle_t *)&c->tcp))
            return SIZE_MAX;
        at += size;
    }
    return at;
}

/* Makes room for need bytes in c->part, charged to c: a quarter more at a
 * time, so that what is held stays close to what arrived, and never more
 * than the request's size (most; 0: not known yet). */
static bool reserve(conn *c, size_t need, size_t most)
{
    if (need <= c->cap)
        return true;
    size_t cap = c->cap + c->cap / 4;
    if (cap < need)
        cap = need;
    if (most >= need && cap > most)
        cap = most;
    if (!charge(c, cap - c->cap, "a request in progress", ""))
        return false;
    uint8_t *b = realloc(c->part, cap);
    if (!b) {
        uncharge(c, cap - c->cap);
        close_conn(c);
        return false;
    }
    c->part = b;
    c->cap = cap;
    return true;
}

/* Keeps the unfinished request rest[0, n) for the next read; frees the
 * buffer when there is none (an idle connection holds nothing). */
static void keep(conn *c, const uint8_t *rest, size_t n, size_t size)
{
    if (n == 0) {
        if (c->cap)
            uncharge(c, c->cap);
        free(c->part);
        c->part = NULL;
        c->len = c->cap = 0;
    } else if (c->len) { /* rest lies in c->part already */
        memmove(c->part, rest, n);
        c->len = n;
    } else if (reserve(c, n, size)) {
        memcpy(c->part, rest, n);
        c->len = n;
    }
}

static void on_alloc(uv_handle_t *h, size_t hint, uv_buf_t *out)
{
    (void)hint;
    /* one buffer for every connection: on_read takes what it needs from
     * it before the loop reads anything else */
    stk_store_server *s = ((conn *)h)->srv;
    *out = uv_buf_init((char *)s->chunk, sizeof s->chunk);
}

static void on_read(uv_stream_t *st, ssize_t nread, const uv_buf_t *buf)
{
    conn *c = (conn *)st;
    if (nread < 0) {
        close_conn(c);
        return;
    }
    const uint8_t *p = (const uint8_t *)buf->base;
    size_t n = (size_t)nread;
    if (n == 0)
        return;
    if (c->len) { /* the rest of a request begun earlier */
        /* request_size: its head was checked when it arrived */
    if (!reserve(c, c->len + n, request_size(c, c->part, c->len)))
            return;
        memcpy(c->part + c->len, p, n);
        c->len += n;
        p = c->part;
        n = c->len;
    }
    size_t size, used = run_requests(c, p, n, &size);
    if (used != SIZE_MAX)
        keep(c, p + used, n - used, size);
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
    struct sockaddr_storage peer;
    int len = sizeof peer;
    char ip[48] = "?";
    int port = 0;
    if (!uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&peer, &len)) {
        if (peer.ss_family == AF_INET6) {
            uv_ip6_name((struct sockaddr_in6 *)&peer, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in6 *)&peer)->sin6_port);
        } else {
            uv_ip4_name((struct sockaddr_in *)&peer, ip, sizeof ip);
            port = ntohs(((struct sockaddr_in *)&peer)->sin_port);
        }
    }
    snprintf(c->peer, sizeof c->peer, "client %s:%d", ip, port);
    uv_tcp_nodelay(&c->tcp, 1);
    c->next = s->conns;
    if (s->conns)
        s->conns->prev = c;
    s->conns = c;
    uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
}

/* ---- life cycle ----------------------------------------------------------------- */

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
    for (size_t i = 0; s->bucket && i < s->nbucket; i++)
        while (s->bucket[i]) {
            kv_entry *e = s->bucket[i];
            s->bucket[i] = e->next;
            free(e->val);
            free(e);
        }
    free(s->bucket);
    while (s->waiters) {
        waiter *w = s->waiters;
        s->waiters = w->next;
        free(w);
    }
    free(s);
}

static int bind_error(const char *host, int port, int rc, stk_err *err)
{
    if (rc == UV_EADDRINUSE)
        return stk_fail(err, STK_EEXIST,
                        "--master-port %d: the port is already in use on %s "
                        "(another training job's store?); choose another port "
                        "(on one node, leaving --master-port out takes a free "
                        "one)",
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

stk_store_limits stk_store_default_limits(void)
{
    return (stk_store_limits){
        .key = STORE_MAX_KEY,
        .value = STORE_MAX_VALUE,
        .keys = (size_t)1 << 20,
        .stored = (size_t)256 << 20,
        .pending = (size_t)32 << 20,
        .inflight = (size_t)512 << 20,
    };
}

int stk_store_server_open(const char *host, int port,
                          const stk_store_limits *limits, stk_store_log_fn log,
                          void *log_arg, int *bound, stk_store_server **out,
                          stk_err *err)
{
    *out = NULL;
    stk_store_server *s = calloc(1, sizeof *s);
    if (s)
        s->bucket = calloc(s->nbucket = 64, sizeof *s->bucket);
    if (!s || !s->bucket) {
        free(s);
        return stk_fail(err, STK_ENOMEM, "rendezvous store: out of memory");
    }
    s->lim = limits ? *limits : stk_store_default_limits();
    s->log = log;
    s->log_arg = log_arg;
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

static void log_stderr(void *arg, const char *line)
{
    (void)arg;
    fprintf(stderr, "%s\n", line);
}

int stk_store_server_start(const char *host, int port, int *bound,
                           stk_store_server **out, stk_err *err)
{
    return stk_store_server_open(host, port, NULL, log_stderr, NULL, bound, out,
                                 err);
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

void stk_store_server_usage(stk_store_server *s, stk_store_usage *out)
{
    *out = (stk_store_usage){
        .keys = get(&s->nkv),
        .stored = get(&s->stored),
        .inflight = get(&s->inflight),
        .peak = get(&s->peak),
        .dropped = get(&s->dropped),
    };
}
