/* test_distributed - the rendezvous store (set, get that waits, add, barrier,
 * timeouts, a taken port, a barrier on a silent store, a hostile client
 * over each of its limits dropped while a good one goes on), the
 * shared-memory collectives between forked
 * rank processes (all-reduce bitwise equal to the rank-order sum on every
 * rank, average, broadcast, a peer that dies, a resident buffer summed in
 * place), the DDP bucket plan, and
 * the CPU ranks' binding to disjoint CPUs. */
#include "unit.h"

#include "distributed/comm_impl.h" /* NCCL on a world of one */
#include "distributed/distributed.h"
#include "tests/fork_ranks.h"

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <time.h>

static stk_store_server *serve(int *port)
{
    stk_store_server *s;
    stk_err err;
    assert_int_equal(stk_store_server_start("127.0.0.1", 0, port, &s, &err), 0);
    assert_true(*port > 0);
    return s;
}

/* The timeout bounds the connect and every SET and ADD reply: generous, as
 * a server thread descheduled for seconds is slow, not wrong. */
static stk_kv *client(int port)
{
    stk_kv *kv;
    stk_err err;
    assert_int_equal(stk_kv_connect("127.0.0.1", port, 30000, &kv, &err), 0);
    return kv;
}

typedef struct getter {
    int port;
    char got[64];
    int rc;
} getter;

static void *get_later(void *arg)
{
    getter *g = arg;
    stk_kv *kv = client(g->port);
    void *v;
    size_t n;
    stk_err err;
    g->rc = stk_kv_get(kv, "late", 5000, &v, &n, &err);
    if (!g->rc) {
        snprintf(g->got, sizeof g->got, "%.*s", (int)n, (char *)v);
        free(v);
    }
    stk_kv_close(kv);
    return NULL;
}

static void store_set_get_add(void **state)
{
    (void)state;
    int port;
    stk_store_server *s = serve(&port);
    stk_kv *kv = client(port);
    stk_err err;
    void *v;
    size_t n;
    /* a GET parked before its key exists is answered by the SET */
    getter g = {port, "", -1};
    pthread_t t;
    pthread_create(&t, NULL, get_later, &g);
    struct timespec pause = {0, 100 * 1000 * 1000};
    nanosleep(&pause, NULL);
    assert_int_equal(stk_kv_set(kv, "late", "value", 5, &err), 0);
    pthread_join(t, NULL);
    assert_int_equal(g.rc, 0);
    assert_string_equal(g.got, "value");
    /* binary values round trip; a SET replaces: the second value wins,
     * longer or shorter than the first */
    uint8_t blob[300];
    for (int i = 0; i < 300; i++)
        blob[i] = (uint8_t)(i * 7);
    assert_int_equal(stk_kv_set(kv, "blob", "first", 5, &err), 0);
    assert_int_equal(stk_kv_set(kv, "blob", blob, sizeof blob, &err), 0);
    assert_int_equal(stk_kv_get(kv, "blob", 30000, &v, &n, &err), 0);
    assert_int_equal(n, sizeof blob);
    assert_memory_equal(v, blob, sizeof blob);
    free(v);
    assert_int_equal(stk_kv_set(kv, "late", "v2", 2, &err), 0);
    assert_int_equal(stk_kv_get(kv, "late", 30000, &v, &n, &err), 0);
    assert_int_equal(n, 2);
    assert_memory_equal(v, "v2", 2);
    free(v);
    stk_store_usage u;
    stk_store_server_usage(s, &u);
    assert_int_equal(u.keys, 2); /* "late" and "blob", each once */
    int64_t after;
    assert_int_equal(stk_kv_add(kv, "count", 5, &after, &err), 0);
    assert_int_equal(after, 5);
    assert_int_equal(stk_kv_add(kv, "count", -2, &after, &err), 0);
    assert_int_equal(after, 3);
    /* ADD on a value that is not a counter is refused */
    assert_int_equal(stk_kv_add(kv, "blob", 1, &after, &err), STK_EINVAL);
    stk_kv_close(kv);
    stk_store_server_stop(s);
}

static void store_timeouts_and_taken_port(void **state)
{
    (void)state;
    int port;
    stk_store_server *s = serve(&port);
    stk_kv *kv = client(port);
    stk_err err;
    void *v;
    size_t n;
    double t0 = stk_now();
    assert_int_equal(stk_kv_get(kv, "never", 300, &v, &n, &err), STK_ETIMEDOUT);
    assert_true(stk_now() - t0 < 2.0);
    assert_non_null(strstr(err.msg, "'never'"));
    stk_kv_close(kv);
    /* a barrier that only one of two ranks reaches */
    kv = client(port);
    assert_int_equal(stk_kv_barrier(kv, "lonely", 2, 300, &err), STK_ETIMEDOUT);
    assert_non_null(strstr(err.msg, "1 of 2 ranks"));
    stk_kv_close(kv);
    /* the same port again */
    stk_store_server *again;
    int bound;
    assert_int_equal(stk_store_server_start("127.0.0.1", port, &bound, &again, &err),
                     STK_EEXIST);
    assert_non_null(strstr(err.msg, "already in use"));
    stk_store_server_stop(s);
    /* nothing listens any more */
    t0 = stk_now();
    assert_int_equal(stk_kv_connect("127.0.0.1", port, 300, &kv, &err), STK_ETIMEDOUT);
    assert_non_null(strstr(err.msg, "cannot reach the rendezvous store"));
}

/* A barrier whose ADD gets no answer (a socket that listens, and never
 * reads or replies) says so, as any request does; "N of M ranks arrived"
 * is only for a store that answers while the other ranks never come. */
static void store_barrier_on_a_silent_store(void **state)
{
    (void)state;
    int mute = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    assert_int_equal(bind(mute, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(mute, 1), 0); /* the kernel completes the connect */
    assert_int_equal(getsockname(mute, (struct sockaddr *)&a, &len), 0);
    stk_kv *kv;
    stk_err err;
    assert_int_equal(stk_kv_connect("127.0.0.1", ntohs(a.sin_port), 300, &kv, &err), 0);
    assert_int_equal(stk_kv_barrier(kv, "quiet", 2, 300, &err), STK_ETIMEDOUT);
    print_message("barrier: %s\n", err.msg);
    assert_non_null(strstr(err.msg, "did not answer within 0.3 s"));
    assert_non_null(strstr(err.msg, "'quiet/count'"));
    assert_null(strstr(err.msg, "ranks arrived"));
    stk_kv_close(kv);
    close(mute);
}

/* ---- hostile clients: each limit, and the store goes on ----------------- */

/* The store's log lines, kept for the checks. */
typedef struct logbook {
    pthread_mutex_t mu;
    int lines;
    char last[512];
} logbook;

static void note(void *arg, const char *line)
{
    logbook *b = arg;
    pthread_mutex_lock(&b->mu);
    b->lines++;
    snprintf(b->last, sizeof b->last, "%s", line);
    pthread_mutex_unlock(&b->mu);
}

static stk_store_server *serve_limited(const stk_store_limits *lim, logbook *b,
                                       int *port)
{
    stk_store_server *s;
    stk_err err;
    pthread_mutex_init(&b->mu, NULL);
    b->lines = 0;
    b->last[0] = '\0';
    assert_int_equal(stk_store_server_open("127.0.0.1", 0, lim, note, b, port, &s,
                                           &err),
                     0);
    return s;
}

static void stop_limited(stk_store_server *s, logbook *b)
{
    stk_store_server_stop(s);
    pthread_mutex_destroy(&b->mu);
}

/* A raw TCP connection to the store, speaking bytes of our choosing. */
static int raw_client(int port, int *local_port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *local_port = ntohs(a.sin_port);
    return fd;
}

/* How long a hostile-client case waits for the server to do something: a
 * server thread descheduled for seconds (the sanitizers, ctest -j on a
 * loaded machine) is slow, not wrong; the deadline only ends a hang. */
#define PATIENCE_S 60.0

/* Waits a moment between polls of the server's state, leaving the CPU to
 * the server thread. */
static void pause_briefly(void)
{
    struct timespec pause = {0, 10 * 1000 * 1000};
    nanosleep(&pause, NULL);
}

/* Sends all n bytes, however long the peer takes to read them (a request
 * cut short would make the next one's head land inside it, and the server
 * drop the client for the wrong reason): true once all are sent, false
 * once the peer is gone. A peer that neither reads nor closes within
 * PATIENCE_S fails the test. */
static bool raw_send(int fd, const void *buf, size_t n)
{
    const uint8_t *p = buf;
    double end = stk_now() + PATIENCE_S;
    while (n) {
        struct pollfd pf = {fd, POLLOUT, 0};
        if (poll(&pf, 1, 100) <= 0) {
            if (stk_now() > end)
                fail_msg("the store neither read nor closed for %.0f s", PATIENCE_S);
            continue;
        }
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (k <= 0)
            return false;
        p += k;
        n -= (size_t)k;
    }
    return true;
}

/* A request's head: op, key length, the key (key NULL: klen bytes of 'k'),
 * value length. */
static size_t raw_head(uint8_t *out, uint8_t op, const char *key, uint32_t klen,
                       uint32_t vlen)
{
    out[0] = op;
    memcpy(out + 1, &klen, 4);
    if (key)
        memcpy(out + 5, key, klen);
    else
        memset(out + 5, 'k', klen);
    memcpy(out + 5 + klen, &vlen, 4);
    return 9 + (size_t)klen;
}

/* Whether the server closes fd within PATIENCE_S (what it sent is read
 * away). */
static bool closed_by_server(int fd)
{
    static uint8_t sink[1 << 16];
    double end = stk_now() + PATIENCE_S;
    while (stk_now() < end) {
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, 100) <= 0)
            continue;
        ssize_t k = recv(fd, sink, sizeof sink, 0);
        if (k == 0 || (k < 0 && errno != EINTR && errno != EAGAIN))
            return true;
    }
    return false;
}

static stk_store_usage usage(stk_store_server *s)
{
    stk_store_usage u;
    stk_store_server_usage(s, &u);
    return u;
}

/* Waits up to PATIENCE_S for the server to have dropped `want` clients. */
static size_t dropped(stk_store_server *s, size_t want)
{
    double end = stk_now() + PATIENCE_S;
    while (usage(s).dropped < want && stk_now() < end)
        pause_briefly();
    return usage(s).dropped;
}

/* Waits up to PATIENCE_S for the server to hold at least n bytes for
 * clients. */
static void holds(stk_store_server *s, size_t n)
{
    double end = stk_now() + PATIENCE_S;
    while (usage(s).inflight < n && stk_now() < end)
        pause_briefly();
    assert_true(usage(s).inflight >= n);
}

/* The store dropped the raw client on local_port, its nth, with one log
 * line naming it and holding `what` and `more` (NULL: nothing more); fd is
 * closed. */
static void expect_dropped(stk_store_server *s, logbook *b, int fd, int local_port,
                           size_t nth, const char *what, const char *more)
{
    assert_int_equal(dropped(s, nth), nth);
    assert_true(closed_by_server(fd));
    close(fd);
    char peer[64];
    snprintf(peer, sizeof peer, "client 127.0.0.1:%d: ", local_port);
    pthread_mutex_lock(&b->mu);
    int lines = b->lines;
    char last[512];
    snprintf(last, sizeof last, "%s", b->last);
    pthread_mutex_unlock(&b->mu);
    print_message("log: %s\n", last);
    assert_int_equal(lines, (int)nth); /* one line a client */
    assert_non_null(strstr(last, peer));
    assert_non_null(strstr(last, what));
    assert_true(!more || strstr(last, more));
}

/* A client that behaves: sets a fresh key and reads it back, and reads a
 * key set before the hostile one came. */
static void still_serves(stk_kv *kv, int round)
{
    stk_err err;
    char key[32], val[32];
    snprintf(key, sizeof key, "good/%d", round);
    snprintf(val, sizeof val, "value %d", round);
    assert_int_equal(stk_kv_set(kv, key, val, strlen(val), &err), 0);
    void *v;
    size_t n;
    assert_int_equal(stk_kv_get(kv, key, 30000, &v, &n, &err), 0);
    assert_int_equal(n, strlen(val));
    assert_memory_equal(v, val, n);
    free(v);
    assert_int_equal(stk_kv_get(kv, "good/before", 30000, &v, &n, &err), 0);
    assert_int_equal(n, 6);
    free(v);
}

/* Waits up to PATIENCE_S for nothing to be held for connections (the
 * hostile ones are gone; a good client between requests holds nothing). */
static void inflight_back_to_zero(stk_store_server *s)
{
    double end = stk_now() + PATIENCE_S;
    while (usage(s).inflight && stk_now() < end)
        pause_briefly();
    assert_int_equal(usage(s).inflight, 0);
}

/* Timeouts are generous: under the sanitizers, on a busy machine, an
 * 8 MiB value takes a while through the store. */
static stk_kv *good_client(int port)
{
    stk_kv *kv;
    stk_err err;
    assert_int_equal(stk_kv_connect("127.0.0.1", port, 30000, &kv, &err), 0);
    assert_int_equal(stk_kv_set(kv, "good/before", "before", 6, &err), 0);
    return kv;
}

/* Keys over 4096 bytes, a length prefix of 2^32 - 1 or 2^60 (the wire's
 * lengths are 32-bit: 2^60's low half reads as an empty key), a byte that
 * starts no request: each dropped at its head, nothing kept for it. */
static void store_drops_huge_keys_and_prefixes(void **state)
{
    (void)state;
    int port, lp;
    logbook b;
    stk_store_limits lim = stk_store_default_limits();
    assert_int_equal(lim.key, 4096); /* the documented defaults */
    assert_int_equal(lim.value, 8 << 20);
    assert_int_equal(lim.keys, 1 << 20);
    assert_int_equal(lim.stored, 256u << 20);
    assert_int_equal(lim.pending, 32u << 20);
    assert_int_equal(lim.inflight, 512u << 20);
    stk_store_server *s = serve_limited(NULL, &b, &port);
    stk_kv *kv = good_client(port);
    static uint8_t req[9 + 4097];
    /* a key of 4097 bytes, with its bytes sent */
    int fd = raw_client(port, &lp);
    raw_send(fd, req, raw_head(req, 1, NULL, 4097, 1));
    expect_dropped(s, &b, fd, lp, 1, "a key of 4097 bytes, over the limit of 4096",
                   NULL);
    still_serves(kv, 1);
    /* a key length of 2^32 - 1, then a stream of bytes that would be it */
    fd = raw_client(port, &lp);
    uint8_t head[9] = {1, 0xff, 0xff, 0xff, 0xff};
    raw_send(fd, head, 5);
    memset(req, 'x', sizeof req);
    for (int i = 0; i < 64 && raw_send(fd, req, sizeof req); i++)
        ;
    expect_dropped(s, &b, fd, lp, 2, "a key of 4294967295 bytes", NULL);
    still_serves(kv, 2);
    /* 2^60 as a 64-bit little-endian length: its low 32 bits are 0 */
    fd = raw_client(port, &lp);
    uint64_t huge = (uint64_t)1 << 60;
    head[0] = 2;
    memcpy(head + 1, &huge, 8);
    raw_send(fd, head, 9);
    expect_dropped(s, &b, fd, lp, 3, "an empty key", NULL);
    still_serves(kv, 3);
    /* not a request at all */
    fd = raw_client(port, &lp);
    raw_send(fd, "GET / HTTP/1.0\r\n\r\n", 18);
    expect_dropped(s, &b, fd, lp, 4, "sent 71 where a request starts",
                   "not a store client");
    still_serves(kv, 4);
    assert_true(usage(s).peak < 64 << 10); /* none made it keep anything */
    inflight_back_to_zero(s);
    stk_kv_close(kv);
    stop_limited(s, &b);
}

/* A value of 8 MiB is stored; one byte more is dropped at its length, and
 * so is a length of 2^32 - 1, before any of it is kept. */
static void store_drops_huge_values(void **state)
{
    (void)state;
    int port, lp;
    logbook b;
    stk_store_server *s = serve_limited(NULL, &b, &port);
    stk_kv *kv = good_client(port);
    stk_err err;
    size_t big = 8 << 20;
    uint8_t *val = malloc(big + 1);
    memset(val, 7, big + 1);
    assert_int_equal(stk_kv_set(kv, "big", val, big, &err), 0); /* the limit: fine */
    void *v;
    size_t n;
    assert_int_equal(stk_kv_get(kv, "big", 30000, &v, &n, &err), 0);
    assert_int_equal(n, big);
    free(v);
    /* the client refuses to send one byte more, naming the limit */
    assert_int_equal(stk_kv_set(kv, "bigger", val, big + 1, &err), STK_EINVAL);
    assert_non_null(strstr(err.msg, "at most 8388608 bytes"));
    uint32_t lens[2] = {(8u << 20) + 1, 0xffffffffu};
    for (int i = 0; i < 2; i++) {
        size_t before = usage(s).stored;
        int fd = raw_client(port, &lp);
        uint8_t head[9 + 3];
        raw_send(fd, head, raw_head(head, 1, NULL, 3, lens[i]));
        raw_send(fd, val, 1 << 20); /* the start of the value */
        char what[64];
        snprintf(what, sizeof what, "a value of %u bytes for key 'kkk'", lens[i]);
        expect_dropped(s, &b, fd, lp, (size_t)i + 1, what,
                       "over the limit of 8388608 bytes a value");
        still_serves(kv, i);
        /* only good/i came: 64 + "good/i" + "value i" */
        assert_int_equal(usage(s).stored, before + 64 + 6 + 7);
    }
    /* the 8 MiB SET and GET themselves; never a second value's worth */
    assert_true(usage(s).peak < (9u << 20));
    free(val);
    inflight_back_to_zero(s);
    stk_kv_close(kv);
    stop_limited(s, &b);
}

/* The store's own limits: keys in all, then bytes stored (small limits:
 * the defaults would take a million requests). A good client still reads
 * and replaces what is there. */
static void store_drops_too_many_keys_and_bytes(void **state)
{
    (void)state;
    int port, lp;
    logbook b;
    stk_store_limits lim = stk_store_default_limits();
    lim.keys = 100;
    stk_store_server *s = serve_limited(&lim, &b, &port);
    stk_kv *kv = good_client(port); /* key 1 */
    stk_err err;
    /* a client that sets keys without reading its replies, until dropped */
    int fd = raw_client(port, &lp);
    for (int i = 0; i < 200; i++) {
        char key[16];
        uint8_t req[32];
        snprintf(key, sizeof key, "flood/%03d", i);
        if (!raw_send(fd, req, raw_head(req, 1, key, 9, 0)))
            break;
    }
    expect_dropped(s, &b, fd, lp, 1, "key 'flood/099' would be key number 101",
                   "over the limit of 100 keys");
    assert_int_equal(usage(s).keys, 100);
    /* what is there can still be read and replaced */
    void *v;
    size_t n;
    assert_int_equal(stk_kv_get(kv, "flood/042", 30000, &v, &n, &err), 0);
    free(v);
    assert_int_equal(stk_kv_set(kv, "good/before", "before", 6, &err), 0);
    assert_int_equal(stk_kv_set(kv, "good/new", "x", 1, &err), STK_EPEER);
    assert_non_null(strstr(err.msg, "over one of its limits"));
    stk_kv_close(kv);
    stop_limited(s, &b);

    /* bytes: values of 4 KiB until the store would hold over 32 KiB */
    lim = stk_store_default_limits();
    lim.stored = 32 << 10;
    s = serve_limited(&lim, &b, &port);
    kv = good_client(port);
    fd = raw_client(port, &lp);
    static uint8_t req[9 + 16 + 4096];
    for (int i = 0; i < 16; i++) {
        char key[17];
        snprintf(key, sizeof key, "bytes/%010d", i);
        size_t len = raw_head(req, 1, key, 16, 4096);
        memset(req + len, i, 4096);
        if (!raw_send(fd, req, len + 4096))
            break;
    }
    expect_dropped(s, &b, fd, lp, 1, "key 'bytes/0000000007' would make the store hold",
                   "bytes of keys and values, over the limit of 32768");
    stk_store_usage u = usage(s);
    assert_true(u.stored <= lim.stored);
    assert_int_equal(u.keys, 1 + 7); /* good/before, and 7 x (64 + 16 + 4096) */
    still_serves(kv, 1);
    inflight_back_to_zero(s);
    stk_kv_close(kv);
    stop_limited(s, &b);
}

/* A client that asks for an 8 MiB value again and again and never reads
 * the replies, and one that parks GETs without end: each is dropped when
 * 32 MiB would be held for it, and the store never holds much more. */
static void store_drops_a_client_that_never_reads(void **state)
{
    (void)state;
    int port, lp;
    logbook b;
    stk_store_server *s = serve_limited(NULL, &b, &port);
    stk_kv *kv = good_client(port);
    stk_err err;
    size_t big = 8 << 20;
    uint8_t *val = calloc(1, big);
    assert_int_equal(stk_kv_set(kv, "big", val, big, &err), 0);
    free(val);
    int fd = raw_client(port, &lp);
    int rcvbuf = 4096; /* the kernel keeps little of the replies for us */
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    uint8_t get[9 + 3];
    size_t len = raw_head(get, 2, "big", 3, 0);
    for (int i = 0; i < 256 && usage(s).dropped == 0; i++) /* 2 GiB of replies */
        if (!raw_send(fd, get, len))
            break;
    expect_dropped(s, &b, fd, lp, 1, "a reply would make",
                   "for this connection, over the limit of 33554432 a connection");
    still_serves(kv, 1);
    assert_true(usage(s).peak <= (33u << 20));

    /* GETs parked on keys that never come: 4 KiB keys, until 32 MiB */
    fd = raw_client(port, &lp);
    static uint8_t park[9 + 4096];
    for (int i = 0; i < 10000; i++) {
        size_t plen = raw_head(park, 2, NULL, 4096, 0);
        char id[16];
        snprintf(id, sizeof id, "%015d", i);
        memcpy(park + 5, id, 15);
        if (!raw_send(fd, park, plen))
            break;
    }
    expect_dropped(s, &b, fd, lp, 2, "a parked GET would make",
                   "over the limit of 33554432 a connection");
    still_serves(kv, 2);
    assert_true(usage(s).peak <= (33u << 20));
    inflight_back_to_zero(s);
    stk_kv_close(kv);
    stop_limited(s, &b);
}

/* Half a request, held for ever: it costs what was sent, within the
 * connection's budget; clients that do it together meet the budget of all
 * connections (small limits: 2 MiB a connection, 4 MiB in all). */
static void store_bounds_half_sent_requests(void **state)
{
    (void)state;
    int port, lp[3], fd[3];
    logbook b;
    stk_store_limits lim = stk_store_default_limits();
    lim.pending = 2 << 20;
    lim.inflight = 4 << 20;
    stk_store_server *s = serve_limited(&lim, &b, &port);
    stk_kv *kv = good_client(port);
    uint8_t head[9 + 4];
    size_t hlen = raw_head(head, 1, NULL, 4, 8u << 20); /* announces 8 MiB */
    size_t part = 1536 << 10;
    uint8_t *bytes = calloc(1, part);
    /* one connection: 1.5 MiB of it is held, not the 8 MiB announced */
    fd[0] = raw_client(port, &lp[0]);
    raw_send(fd[0], head, hlen);
    raw_send(fd[0], bytes, part);
    holds(s, part);
    assert_true(usage(s).inflight <= part + part / 4 + 16);
    still_serves(kv, 1);
    /* past 2 MiB of its 8 MiB: dropped */
    raw_send(fd[0], bytes, part);
    expect_dropped(s, &b, fd[0], lp[0], 1, "a request in progress would make",
                   "for this connection, over the limit of 2097152");
    inflight_back_to_zero(s);
    /* three connections, 1400 KiB each: two fit in 4 MiB, not three. Each
     * announces one byte more than it sends, which caps what is held for
     * it at what it sent (+ 1), so that the wait below sees all of it. */
    part = 1400 << 10;
    hlen = raw_head(head, 1, NULL, 4, (uint32_t)part + 1);
    for (int i = 0; i < 3; i++) {
        fd[i] = raw_client(port, &lp[i]);
        raw_send(fd[i], head, hlen);
        raw_send(fd[i], bytes, part);
        if (i < 2)
            holds(s, (size_t)(i + 1) * (hlen + part));
    }
    expect_dropped(s, &b, fd[2], lp[2], 2, "a request in progress would make",
                   "for all connections, over the limit of 4194304");
    still_serves(kv, 2);
    assert_true(usage(s).peak <= lim.inflight);
    close(fd[0]);
    close(fd[1]);
    free(bytes);
    inflight_back_to_zero(s);
    stk_kv_close(kv);
    stop_limited(s, &b);
}

/* ---- collectives between forked ranks ---------------------------------- */

enum { N = 2500001 }; /* spans several 4 MiB chunks, and an odd tail */

static float value(int rank, size_t i)
{
    return sinf((float)i * 0.001f + (float)rank) * (float)(rank + 1) + 1e-3f * (float)(i % 97);
}

/* The resident buffer: a sub-range summed in place leaves the rest alone,
 * both give the rank-order sum's bits; a buffer /dev/shm cannot hold is
 * none, on every rank, and no error. */
static int resident_checks(stk_comm *c, stk_kv *kv, int rank, int world,
                           const float *want)
{
    stk_err err;
    float *x, *none;
    struct statvfs v;
    size_t huge = statvfs("/dev/shm", &v) ? 0 : (size_t)v.f_bavail * v.f_frsize / 4;
    if (stk_comm_resident(c, kv, huge, &none, &err) || none) {
        fprintf(stderr, "rank %d: a resident buffer larger than /dev/shm\n", rank);
        return 20;
    }
    if (stk_comm_resident(c, kv, N, &x, &err) || !x) {
        fprintf(stderr, "rank %d: no resident buffer: %s\n", rank, err.msg);
        return 21;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    enum { HEAD = 1000 };
    if (stk_comm_allreduce(c, x + HEAD, N - HEAD, STK_SUM, &err))
        return 22;
    for (size_t i = 0; i < N; i++)
        if (memcmp(&x[i], i < HEAD ? &(float){value(rank, i)} : &want[i], sizeof *x)) {
            fprintf(stderr, "rank %d: resident sum differs at %zu\n", rank, i);
            return 23;
        }
    if (stk_comm_allreduce(c, x, HEAD, STK_AVG, &err))
        return 24;
    for (size_t i = 0; i < HEAD; i++)
        if (x[i] != want[i] * (1.0f / (float)world))
            return 25;
    return 0;
}

/* One rank: joins, all-reduces, checks against the rank-order sum. */
static int rank_main(int rank, int world, int port, int die_rank)
{
    stk_err err;
    stk_backend *be;
    stk_kv *kv;
    stk_comm *c;
    stk_rank_info ri = {.rank = rank, .world = world, .local_rank = rank,
                        .local_world = world};
    if (stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err) ||
        stk_kv_connect("127.0.0.1", port, 5000, &kv, &err) ||
        stk_comm_create(be, &ri, kv, 5000, &c, &err)) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 10;
    }
    if (rank == die_rank)
        _exit(3); /* a rank that dies before the collective */
    float *x = malloc(N * sizeof *x), *want = malloc(N * sizeof *want);
    for (size_t i = 0; i < N; i++) {
        x[i] = value(rank, i);
        want[i] = value(0, i);
        for (int r = 1; r < world; r++)
            want[i] += value(r, i);
    }
    double t0 = stk_now();
    int rc = stk_comm_allreduce(c, x, N, STK_SUM, &err);
    if (die_rank >= 0) { /* the survivors: an error naming the dead rank */
        char expect[32];
        snprintf(expect, sizeof expect, "rank %d", die_rank);
        bool named = rc == STK_EPEER && strstr(err.msg, expect);
        if (!named)
            fprintf(stderr, "rank %d: rc %d: %s\n", rank, rc, err.msg);
        rc = named && stk_now() - t0 < 5 ? 0 : 11;
        free(x);
        free(want);
        stk_comm_destroy(c);
        stk_kv_close(kv);
        stk_backend_destroy(be);
        return rc;
    }
    if (rc || memcmp(x, want, N * sizeof *x)) {
        fprintf(stderr, "rank %d: all-reduce sum differs (%s)\n", rank, rc ? err.msg : "");
        return 12;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    rc = stk_comm_allreduce(c, x, N, STK_AVG, &err);
    for (size_t i = 0; !rc && i < N; i++)
        if (x[i] != want[i] * (1.0f / (float)world))
            rc = 13;
    if (rc) {
        fprintf(stderr, "rank %d: average differs\n", rank);
        return 13;
    }
    for (size_t i = 0; i < N; i++)
        x[i] = value(rank, i);
    if (stk_comm_broadcast(c, x, N * sizeof *x, world - 1, &err) ||
        stk_comm_barrier(c, &err))
        return 14;
    for (size_t i = 0; i < N; i++)
        if (x[i] != value(world - 1, i))
            return 15;
    if ((rc = resident_checks(c, kv, rank, world, want)))
        return rc;
    free(x);
    free(want);
    stk_comm_destroy(c);
    stk_kv_close(kv);
    stk_backend_destroy(be);
    return 0;
}

static int rank_entry(int rank, int world, int port, void *die_rank)
{
    return rank_main(rank, world, port, *(int *)die_rank);
}

/* Runs `world` ranks; returns how many exited other than expected. */
static int run_ranks(int world, int die_rank)
{
    int st[8];
    assert_int_equal(stk_fork_ranks(world, rank_entry, &die_rank, st), 0);
    int bad = 0;
    for (int r = 0; r < world; r++) {
        int want = r == die_rank ? 3 : 0;
        if (!WIFEXITED(st[r]) || WEXITSTATUS(st[r]) != want) {
            print_message("rank %d: status %d\n", r,
                          WIFEXITED(st[r]) ? WEXITSTATUS(st[r]) : -1);
            bad++;
        }
    }
    return bad;
}

static void shm_collectives_two_ranks(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(2, -1), 0);
}

static void shm_collectives_three_ranks(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(3, -1), 0);
}

static void shm_dead_peer_ends_the_wait(void **state)
{
    (void)state;
    assert_int_equal(run_ranks(3, 1), 0);
}

/* A rank that stops answering (rank 1 sleeps 2.5 s instead of joining
 * the barrier): the others give up after their 1 s timeout naming it,
 * and rank 1, back, finds the group aborted instead of counting their
 * stale arrivals as a completed barrier. */
static int stuck_entry(int rank, int world, int port, void *arg)
{
    (void)arg;
    stk_err err;
    stk_backend *be;
    stk_kv *kv;
    stk_comm *c;
    stk_rank_info ri = {.rank = rank, .world = world, .local_rank = rank,
                        .local_world = world};
    if (stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err) ||
        stk_kv_connect("127.0.0.1", port, 5000, &kv, &err) ||
        stk_comm_create(be, &ri, kv, 1000, &c, &err)) {
        fprintf(stderr, "rank %d: %s\n", rank, err.msg);
        return 10;
    }
    int ok = 0;
    if (stk_comm_barrier(c, &err)) /* all there: passes */
        ok = 11;
    double t0 = stk_now();
    if (rank == 1)
        usleep(2500 * 1000);
    int rc = ok ? ok : stk_comm_barrier(c, &err);
    double took = stk_now() - t0;
    if (!ok && rank != 1 &&
        !(rc && strstr(err.msg, "rank 1 (pid ") &&
          strstr(err.msg, "did not reach a collective within 1 s") && took > 0.9 &&
          took < 2.4))
        ok = 12;
    if (!ok && rank == 1 && !(rc == STK_EPEER && strstr(err.msg, "rank 1 did not reach")))
        ok = 13;
    if (ok && ok != 11)
        fprintf(stderr, "rank %d: rc %d after %.1f s: %s\n", rank, rc, took, err.msg);
    stk_comm_destroy(c);
    stk_kv_close(kv);
    stk_backend_destroy(be);
    return ok;
}

static void shm_stuck_peer_named(void **state)
{
    (void)state;
    int st[3];
    assert_int_equal(stk_fork_ranks(3, stuck_entry, NULL, st), 0);
    for (int r = 0; r < 3; r++) {
        assert_true(WIFEXITED(st[r]));
        assert_int_equal(WEXITSTATUS(st[r]), 0);
    }
}

/* ---- NCCL on one GPU ------------------------------------------------------ */

/* NCCL's paths that need no second GPU, on a world of one: DDP's buckets
 * queued by its thread behind their marks and waited for through their
 * events (a group that says 2 ranks starts the thread; NCCL's average over
 * one rank is the input, bit for bit), over two steps so that the events
 * are reused; the blocking collectives; and an error (a bucket never
 * marked) that aborts the communicator, so that the next call fails at
 * once. Exits 77 without a GPU. */
static int nccl_one_entry(int rank, int world, int port, void *arg)
{
    (void)arg;
    stk_err err = {0};
    int count = 0;
    if (stk_cuda_device_count(&count, &err))
        return err.code == STK_ENODEV ? 77 : 10;
    stk_backend *be;
    stk_kv *kv;
    nccl_comm *n;
    if (stk_backend_create(STK_DEV_CUDA, 0, 0, &be, &err) ||
        stk_kv_connect("127.0.0.1", port, 5000, &kv, &err) ||
        nccl_create(be, rank, world, kv, 10000, &n, &err)) {
        fprintf(stderr, "nccl: %s\n", err.msg);
        return 11;
    }
    stk_comm c = {.be = be, .rank = 0, .world = 2, .nccl = n};
    enum { P = 4 };
    const size_t sizes[P] = {1000, 70000, 300, 40000};
    size_t off[P], total = 0;
    for (int p = 0; p < P; p++) {
        off[p] = total;
        total += sizes[p];
    }
    size_t bytes = total * sizeof(float);
    float *host = malloc(bytes), *back = malloc(bytes);
    for (size_t i = 0; i < total; i++)
        host[i] = (float)(i % 1000) * 0.5f - 7.0f;
    float *g = stk_dev_alloc(be, bytes, &err);
    stk_ddp *d = NULL;
    int rc = g ? stk_ddp_create(&c, g, off, P, total, 64u << 10, 4u << 10, &d, &err) : 12;
    if (!rc && stk_ddp_buckets(d) < 3)
        rc = stk_fail(&err, 13, "%d buckets, expected 3 or more", stk_ddp_buckets(d));
    for (int step = 0; !rc && step < 2; step++) {
        double waited, busy;
        memset(back, 0, bytes);
        rc = stk_copy_to_dev(be, g, host, bytes, &err); /* before the marks */
        for (int p = P - 1; !rc && p >= 0; p--)
            rc = stk_ddp_ready(d, p, &err);
        if (!rc)
            rc = stk_ddp_finish(d, &waited, &busy, &err);
        if (!rc)
            rc = stk_copy_to_host(be, back, g, bytes, &err);
        if (!rc)
            rc = stk_sync(be, &err);
        if (!rc && memcmp(back, host, bytes))
            rc = stk_fail(&err, 14, "step %d: the averaged buckets differ", step);
        if (!rc && !(busy >= 0 && waited >= 0))
            rc = stk_fail(&err, 15, "step %d: waited %g, busy %g", step, waited, busy);
    }
    stk_ddp_destroy(d);
    if (!rc)
        rc = stk_comm_allreduce(&c, g, total, STK_SUM, &err);
    if (!rc)
        rc = stk_comm_broadcast(&c, g, bytes, 0, &err);
    if (!rc)
        rc = stk_comm_barrier(&c, &err);
    if (!rc) { /* an error aborts the communicator; every later call fails */
        stk_err e1, e2;
        int r1 = nccl_queue_allreduce(n, 100, g, 10, STK_SUM, &e1);
        int r2 = nccl_allreduce(n, g, 10, STK_SUM, &e2);
        if (r1 != STK_EINVAL || !strstr(e1.msg, "bucket 100 was never marked") ||
            r2 != STK_EPEER || !strstr(e2.msg, "aborted after an earlier error"))
            rc = stk_fail(&err, 16, "after an error: %d '%s', then %d '%s'", r1,
                          r1 ? e1.msg : "", r2, r2 ? e2.msg : "");
    }
    if (rc)
        fprintf(stderr, "nccl: %s\n", err.msg);
    nccl_destroy(n);
    if (g)
        stk_dev_free(be, g);
    free(host);
    free(back);
    stk_kv_close(kv);
    stk_backend_destroy(be);
    return rc ? 20 : 0;
}

static void nccl_paths_on_one_gpu(void **state)
{
    (void)state;
    int st[1];
    assert_int_equal(stk_fork_ranks(1, nccl_one_entry, NULL, st), 0);
    assert_true(WIFEXITED(st[0]));
    if (WEXITSTATUS(st[0]) == 77) {
        printf("SKIP: no GPU\n");
        exit(77);
    }
    assert_int_equal(WEXITSTATUS(st[0]), 0);
}

/* ---- the bucket plan ------------------------------------------------------ */

static void ddp_buckets_last_layers_first(void **state)
{
    (void)state;
    /* the cnn's parameters: conv1 w/b, conv2 w/b, fc1 w/b, fc2 w/b */
    size_t sizes[8] = {288, 32, 18432, 64, 800000, 500, 5000, 10}, off[8], n = 0;
    for (int i = 0; i < 8; i++) {
        off[i] = n;
        n += sizes[i];
    }
    stk_err err;
    stk_backend *be;
    stk_comm *c;
    stk_rank_info one = {.world = 1, .local_world = 1};
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err), 0);
    assert_int_equal(stk_comm_create(be, &one, NULL, 1000, &c, &err), 0);
    float *g = calloc(n, sizeof *g);
    stk_ddp *d;
    /* 1 MB first bucket, then 25 MB: fc2+fc1, then the convolutions */
    assert_int_equal(stk_ddp_create(c, g, off, 8, n, 25u << 20, 1u << 20, &d, &err), 0);
    assert_int_equal(stk_ddp_buckets(d), 2);
    stk_ddp_destroy(d);
    /* 64 KB buckets: fc2 (20 KB) needs fc1 too, fc1 alone is over, then
     * conv2 closes one, and conv1 the last */
    assert_int_equal(stk_ddp_create(c, g, off, 8, n, 64u << 10, 64u << 10, &d, &err), 0);
    assert_int_equal(stk_ddp_buckets(d), 3);
    stk_ddp_destroy(d);
    size_t bad[2] = {0, 0};
    assert_int_equal(stk_ddp_create(c, g, bad, 2, n, 1, 1, &d, &err), STK_EINVAL);
    free(g);
    stk_comm_destroy(c);
    stk_backend_destroy(be);
}

/* The CPU this thread is bound to after binding local rank `rank` of two
 * within `cpus` (-2: more than one); the thread's affinity is restored. */
static int bound_cpu(const cpu_set_t *cpus, int rank, int threads, int *bound)
{
    stk_rank_info ri = {.rank = rank, .world = 2, .local_rank = rank,
                        .local_world = 2};
    stk_err err;
    cpu_set_t orig, got;
    assert_int_equal(sched_getaffinity(0, sizeof orig, &orig), 0);
    assert_int_equal(sched_setaffinity(0, sizeof *cpus, cpus), 0);
    *bound = stk_rank_bind_cpus(&ri, threads, &err);
    assert_int_equal(sched_getaffinity(0, sizeof got, &got), 0);
    assert_int_equal(sched_setaffinity(0, sizeof orig, &orig), 0);
    int cpu = -1;
    for (int c = 0; c < CPU_SETSIZE; c++)
        if (CPU_ISSET(c, &got))
            cpu = CPU_COUNT(&got) == 1 ? c : -2;
    return cpu;
}

static void cpu_ranks_bound_to_disjoint_cpus(void **state)
{
    (void)state;
    cpu_set_t all, two;
    assert_int_equal(sched_getaffinity(0, sizeof all, &all), 0);
    CPU_ZERO(&two); /* the first two CPUs this process may use */
    for (int c = 0, n = 0; c < CPU_SETSIZE && n < 2; c++)
        if (CPU_ISSET(c, &all)) {
            CPU_SET(c, &two);
            n++;
        }
    int b0, b1, b2;
    int c0 = bound_cpu(&two, 0, 1, &b0), c1 = bound_cpu(&two, 1, 1, &b1);
    int c2 = bound_cpu(&two, 1, 2, &b2); /* 2 ranks x 2 threads */
    if (CPU_COUNT(&two) < 2) { /* one CPU: two ranks never fit */
        assert_true(b0 == 0 && b1 == 0 && c0 == c1);
        return;
    }
    assert_true(b0 == 1 && b1 == 1);
    assert_true(c0 >= 0 && c1 >= 0 && c0 != c1);
    assert_true(CPU_ISSET(c0, &two) && CPU_ISSET(c1, &two));
    assert_int_equal(b2, 0); /* left alone: both CPUs still allowed */
    assert_int_equal(c2, -2);
    stk_rank_info one = {.world = 1, .local_world = 1};
    stk_err err;
    assert_int_equal(stk_rank_bind_cpus(&one, 1, &err), 0);
}

/* A pid names one process: its own start time tells it from a later
 * process that reuses the number; stopped and exited are told apart. */
static void peers_tell_a_reused_pid(void **state)
{
    (void)state;
    peer_id me = peer_self();
    assert_int_equal(me.pid, getpid());
    assert_true(me.start > 0);
    assert_int_equal(peer_state_of(me), PEER_RUNNING);
    assert_int_equal(peer_state_of((peer_id){me.pid, me.start + 1}), PEER_GONE);
    assert_int_equal(peer_state_of((peer_id){0, 0}), PEER_RUNNING);
    int fd[2];
    assert_int_equal(pipe(fd), 0);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        peer_id c, self = peer_self();
        memset(&c, 0, sizeof c); /* the padding too: all of it is written */
        c.pid = self.pid;
        c.start = self.start;
        if (write(fd[1], &c, sizeof c) != (ssize_t)sizeof c)
            _exit(1);
        for (;;)
            pause();
    }
    peer_id c;
    assert_int_equal(read(fd[0], &c, sizeof c), (ssize_t)sizeof c);
    close(fd[0]);
    close(fd[1]);
    assert_int_equal(c.pid, child);
    assert_int_equal(peer_state_of(c), PEER_RUNNING);
    kill(child, SIGSTOP);
    for (int i = 0; i < 2000 && peer_state_of(c) != PEER_STOPPED; i++)
        pause_briefly();
    assert_int_equal(peer_state_of(c), PEER_STOPPED);
    kill(child, SIGKILL);
    for (int i = 0; i < 2000 && peer_state_of(c) != PEER_GONE; i++)
        pause_briefly(); /* a zombie counts as gone before it is reaped */
    assert_int_equal(peer_state_of(c), PEER_GONE);
    assert_int_equal(waitpid(child, NULL, 0), child);
    assert_int_equal(peer_state_of(c), PEER_GONE);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(store_set_get_add),
    cmocka_unit_test(store_timeouts_and_taken_port),
    cmocka_unit_test(store_barrier_on_a_silent_store),
    cmocka_unit_test(store_drops_huge_keys_and_prefixes),
    cmocka_unit_test(store_drops_huge_values),
    cmocka_unit_test(store_drops_too_many_keys_and_bytes),
    cmocka_unit_test(store_drops_a_client_that_never_reads),
    cmocka_unit_test(store_bounds_half_sent_requests),
    cmocka_unit_test(shm_collectives_two_ranks),
    cmocka_unit_test(shm_collectives_three_ranks),
    cmocka_unit_test(shm_dead_peer_ends_the_wait),
    cmocka_unit_test(shm_stuck_peer_named),
    cmocka_unit_test(peers_tell_a_reused_pid),
    cmocka_unit_test(nccl_paths_on_one_gpu),
    cmocka_unit_test(ddp_buckets_last_layers_first),
    cmocka_unit_test(cpu_ranks_bound_to_disjoint_cpus),
};

UNIT_MAIN(tests)
