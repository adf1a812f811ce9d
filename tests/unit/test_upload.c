/* test_upload - the trainer's uploads (trainer/upload.c) on a fake device:
 * a CPU backend whose copy stream only moves bytes when the fake device
 * gets to it (a compute op that waits for it, or the host waiting for its
 * event), and which records what the host has seen complete. It proves
 * the loader never gets a slot back before the host has seen its copy
 * complete, that compute reads a batch only behind its copy, and that a
 * copy never overwrites a device buffer compute may still read. */
#include "unit.h"

#include "kernels/backend_impl.h"
#include "trainer/train_impl.h"

enum { QUEUE = 256, BATCHES = 12, N = 5, SAMPLE = 7 };

typedef struct pending_copy {
    void *dst;
    const void *src;
    size_t n;
} pending_copy;

typedef struct fake_event {
    int stream; /* -1: never recorded */
    int mark;   /* copy stream: uploads queued; compute: reads done */
} fake_event;

/* The fake device (one per test process: ops get only the backend). */
static struct {
    backend_ops ops;
    pending_copy q[QUEUE];
    int queued, performed, observed; /* uploads queued, done, seen done */
    int compute_after;               /* uploads compute waits for */
    int copy_after; /* compute reads the copy stream waits for */
    int reads;      /* compute reads so far */
    const void *read_buf[2];
    int read_at[2]; /* the read that last touched each buffer */
    int host_allocs;
    int violations;
    char why[256];
} fk;

static void violation(const char *what, int k)
{
    if (!fk.violations++)
        snprintf(fk.why, sizeof fk.why, "%s (batch %d)", what, k);
}

static int fake_event_create(stk_backend *be, stk_event **out, stk_err *err)
{
    (void)be, (void)err;
    fake_event *e = malloc(sizeof *e);
    *e = (fake_event){-1, 0};
    *out = (stk_event *)e;
    return 0;
}

static void fake_event_destroy(stk_backend *be, stk_event *ev)
{
    (void)be;
    free(ev);
}

static int fake_record(stk_backend *be, stk_event *ev, stk_stream_id s,
                       stk_err *err)
{
    (void)be, (void)err;
    fake_event *e = (fake_event *)ev;
    e->stream = (int)s;
    e->mark = s == STK_STREAM_COPY ? fk.queued : fk.reads;
    return 0;
}

static int fake_stream_wait(stk_backend *be, stk_stream_id s, stk_event *ev,
                            stk_err *err)
{
    (void)be, (void)err;
    fake_event *e = (fake_event *)ev;
    if (e->stream < 0)
        return 0;
    int *after = s == STK_STREAM_COPY ? &fk.copy_after : &fk.compute_after;
    *after = e->mark > *after ? e->mark : *after;
    return 0;
}

static void perform(int upto)
{
    for (; fk.performed < upto; fk.performed++)
        memcpy(fk.q[fk.performed].dst, fk.q[fk.performed].src,
               fk.q[fk.performed].n);
}

static int fake_query(stk_backend *be, stk_event *ev, bool *done, stk_err *err)
{
    (void)be, (void)err;
    fake_event *e = (fake_event *)ev;
    *done = e->stream != STK_STREAM_COPY || fk.performed >= e->mark;
    if (*done && e->stream == STK_STREAM_COPY && e->mark > fk.observed)
        fk.observed = e->mark;
    return 0;
}

static int fake_wait(stk_backend *be, stk_event *ev, stk_err *err)
{
    (void)be, (void)err;
    fake_event *e = (fake_event *)ev;
    if (e->stream == STK_STREAM_COPY) {
        perform(e->mark);
        fk.observed = e->mark > fk.observed ? e->mark : fk.observed;
    }
    return 0;
}

static int fake_upload(stk_backend *be, void *dst, const void *src, size_t n,
                       stk_err *err)
{
    (void)be, (void)err;
    for (int i = 0; i < 2; i++)
        if (fk.read_buf[i] == dst && fk.read_at[i] > fk.copy_after)
            violation("a copy overwrites a buffer compute may still read", -1);
    assert_true(fk.queued < QUEUE);
    fk.q[fk.queued++] = (pending_copy){dst, src, n};
    return 0;
}

static void *fake_host_alloc(stk_backend *be, size_t bytes)
{
    fk.host_allocs++;
    return stk_cpu_ops.host_alloc(be, bytes);
}

/* A CPU backend dressed as a device with the fake streams. */
static stk_backend *fake_backend(void)
{
    stk_backend *be;
    stk_err err;
    assert_int_equal(stk_backend_create(STK_DEV_CPU, 0, 1, &be, &err), 0);
    memset(&fk, 0, sizeof fk);
    fk.ops = stk_cpu_ops;
    fk.ops.event_create = fake_event_create;
    fk.ops.event_destroy = fake_event_destroy;
    fk.ops.event_record = fake_record;
    fk.ops.stream_wait = fake_stream_wait;
    fk.ops.event_query = fake_query;
    fk.ops.event_wait = fake_wait;
    fk.ops.upload = fake_upload;
    fk.ops.host_alloc = fake_host_alloc;
    be->ops = &fk.ops;
    be->kind = STK_DEV_CUDA;
    return be;
}

/* The loader's ring of two slots. */
typedef struct ring {
    uint8_t data[2][N * SAMPLE];
    int32_t labels[2][N];
    uint64_t ids[2][N];
    bool busy[2];
    int mark[BATCHES]; /* uploads queued once batch k was put */
    int released;      /* batches given back, in order */
} ring;

static uint8_t byte_of(int k, int i)
{
    return (uint8_t)(k * 31 + i);
}

static void release(void *ctx, stk_batch *b)
{
    ring *r = ctx;
    int k = (int)b->index;
    if (fk.observed < r->mark[k])
        violation("a slot went back before the host saw its copy complete", k);
    if (k != r->released)
        violation("slots went back out of order", k);
    r->released++;
    memset(b->data, 0xee,
           (size_t)b->n * b->sample_bytes); /* the loader refills it */
    r->busy[k % 2] = false;
}

/* What a kernel does: runs the copies it waits for, then reads. */
static void compute_reads(const stk_batch *dev, int k)
{
    if (fk.compute_after < fk.queued)
        violation("compute does not wait for the batch's copy", k);
    perform(fk.compute_after);
    for (int i = 0; i < N * SAMPLE; i++)
        if (dev->data[i] != byte_of(k, i))
            violation("compute read bytes that are not the batch's", k);
    for (int i = 0; i < N; i++)
        if (dev->labels[i] != k * 10 + i ||
            dev->indices[i] != (uint64_t)(k * 100 + i))
            violation("compute read labels or ids that are not the batch's",
                      k);
    fk.reads++;
    int which = fk.read_buf[0] == dev->data || !fk.read_buf[0] ? 0 : 1;
    fk.read_buf[which] = dev->data;
    fk.read_at[which] = fk.reads;
}

/* The trainer's loop: settle, next, put, compute, used. */
static void slots_return_after_their_copies(void **state)
{
    (void)state;
    stk_backend *be = fake_backend();
    stk_err err;
    uploader u;
    ring r = {0};
    assert_int_equal(uploader_init(&u, be, N, SAMPLE, &err), 0);
    for (int k = 0; k < BATCHES; k++) {
        assert_int_equal(uploader_settle(&u, &err), 0);
        int s = k % 2;
        assert_false(r.busy[s]); /* the loader fills only a free slot */
        r.busy[s] = true;
        for (int i = 0; i < N * SAMPLE; i++)
            r.data[s][i] = byte_of(k, i);
        for (int i = 0; i < N; i++)
            r.labels[s][i] = k * 10 + i, r.ids[s][i] = (uint64_t)(k * 100 + i);
        stk_batch b = {0,         (uint64_t)k, N,        SAMPLE,
                       r.data[s], r.labels[s], r.ids[s], s},
                  dev;
        assert_int_equal(uploader_put(&u, &b, release, &r, &dev, &err), 0);
        assert_ptr_not_equal(dev.data, b.data); /* a device copy */
        r.mark[k] = fk.queued;
        compute_reads(&dev, k);
        assert_int_equal(uploader_used(&u, &err), 0);
    }
    assert_int_equal(uploader_settle(&u, &err), 0);
    assert_int_equal(r.released, BATCHES);
    if (fk.violations)
        fail_msg("%d violation(s), the first: %s", fk.violations, fk.why);
    uploader_free(&u);
    stk_backend_destroy(be);
}

/* The host never waits for compute: settling waits for the held batch's
 * copy only, and put returns with the copy still queued. */
static void put_does_not_wait(void **state)
{
    (void)state;
    stk_backend *be = fake_backend();
    stk_err err;
    uploader u;
    ring r = {0};
    assert_int_equal(uploader_init(&u, be, N, SAMPLE, &err), 0);
    stk_batch b = {0, 0, N, SAMPLE, r.data[0], r.labels[0], r.ids[0], 0}, dev;
    r.busy[0] = true;
    assert_int_equal(uploader_put(&u, &b, release, &r, &dev, &err), 0);
    assert_int_equal(fk.performed, 0);
    assert_int_equal(r.released, 0);
    assert_int_equal(uploader_settle(&u, &err), 0);
    assert_int_equal(r.released, 1);
    assert_int_equal(fk.observed, 3); /* data, ids, labels */
    uploader_free(&u);
    stk_backend_destroy(be);
}

/* Loaders of one run (an epoch, then an evaluation, then an epoch) take
 * the same pinned blocks: each is allocated once. */
static void ring_is_pinned_once(void **state)
{
    (void)state;
    stk_backend *be = fake_backend();
    pinned_ring pr = {0};
    stk_host_alloc h = pinned_ring_host(&pr, be);
    void *first[3];
    for (int round = 0; round < 3; round++) {
        void *p[3];
        for (int i = 0; i < 3; i++) {
            p[i] = h.alloc(1000, h.ctx);
            assert_non_null(p[i]);
            if (round == 0)
                first[i] = p[i];
        }
        for (int i = 0; i < 3; i++) {
            bool known = false;
            for (int j = 0; j < 3; j++)
                known |= p[i] == first[j];
            assert_true(known);
            assert_true(i == 0 || p[i] != p[0]);
        }
        for (int i = 0; i < 3; i++)
            h.free(p[i], h.ctx);
    }
    assert_int_equal(fk.host_allocs, 3);
    void *bigger = h.alloc(5000, h.ctx); /* no block fits: a new one */
    assert_non_null(bigger);
    assert_int_equal(fk.host_allocs, 4);
    pinned_ring_free(&pr);
    stk_backend_destroy(be);
}

static const struct CMUnitTest tests[] = {
    cmocka_unit_test(slots_return_after_their_copies),
    cmocka_unit_test(put_does_not_wait),
    cmocka_unit_test(ring_is_pinned_once),
};

UNIT_MAIN(tests)
