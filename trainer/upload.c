/* upload.c - a batch's trip from its loader slot (page-locked) to the
 * device: the copies run on the copy stream into one of two device
 * buffers, so batch k uploads while batch k - 1 computes; compute waits for
 * the copy's event, the copy into a buffer waits for the compute that last
 * read it, and the slot goes back to the loader only once the host has seen
 * the copy's event complete. On the CPU the batch is used in place. */
#include "train_impl.h"

#include <string.h>

int uploader_init(uploader *u, stk_backend *be, size_t batch,
                  size_t sample_bytes, stk_err *err)
{
    memset(u, 0, sizeof *u);
    u->be = be;
    if (stk_backend_kind(be) == STK_DEV_CPU)
        return 0;
    int rc = 0;
    for (int i = 0; i < 2 && !rc; i++) {
        upload_buf *d = &u->buf[i];
        d->x = stk_dev_alloc(be, batch * sample_bytes, err);
        d->ids = d->x ? stk_dev_alloc(be, batch * sizeof *d->ids, err) : NULL;
        d->labels =
            d->ids ? stk_dev_alloc(be, batch * sizeof *d->labels, err) : NULL;
        rc = d->labels ? stk_event_create(be, &d->copied, err) : STK_ENOMEM;
        if (!rc)
            rc = stk_event_create(be, &d->consumed, err);
    }
    return rc;
}

void uploader_free(uploader *u)
{
    for (int i = 0; u->be && i < 2; i++) {
        upload_buf *d = &u->buf[i];
        stk_dev_free(u->be, d->x);
        stk_dev_free(u->be, d->ids);
        stk_dev_free(u->be, d->labels);
        stk_event_destroy(u->be, d->copied);
        stk_event_destroy(u->be, d->consumed);
    }
    memset(u, 0, sizeof *u);
}

/* The three copies of b into d, after the compute that last read d. */
static int upload_into(uploader *u, upload_buf *d, const stk_batch *b,
                       stk_err *err)
{
    stk_backend *be = u->be;
    size_t n = (size_t)b->n;
    int rc =
        d->read ? stk_stream_wait(be, STK_STREAM_COPY, d->consumed, err) : 0;
    if (!rc)
        rc = stk_upload(be, d->x, b->data, n * b->sample_bytes, err);
    if (!rc)
        rc = stk_upload(be, d->ids, b->indices, n * sizeof *b->indices, err);
    if (!rc)
        rc = stk_upload(be, d->labels, b->labels, n * sizeof *b->labels, err);
    if (!rc)
        rc = stk_event_record(be, d->copied, STK_STREAM_COPY, err);
    if (!rc)
        rc = stk_stream_wait(be, STK_STREAM_COMPUTE, d->copied, err);
    return rc;
}

int uploader_put(uploader *u, const stk_batch *b, batch_release_fn release,
                 void *ctx, stk_batch *dev, stk_err *err)
{
    int rc = uploader_settle(u, err); /* one batch held at a time */
    if (rc)
        return rc;
    *dev = *b;
    u->held = *b;
    u->release = release;
    u->ctx = ctx;
    u->holding = true;
    u->held_buf = NULL;
    if (stk_backend_kind(u->be) == STK_DEV_CPU)
        return 0;
    upload_buf *d = &u->buf[u->next];
    u->next ^= 1;
    u->held_buf = d; /* held from here: a failed copy still waits to settle */
    dev->data = d->x;
    dev->indices = d->ids;
    dev->labels = d->labels;
    rc = upload_into(u, d, b, err);
    if (rc) /* a copy may still read the slot: never given back (the run
               ends, and the loader's close frees it after the streams) */
        u->holding = false;
    return rc;
}

int uploader_used(uploader *u, stk_err *err)
{
    upload_buf *d = u->held_buf;
    if (!d) { /* the CPU's kernels read the slot in place, up to here
                 (were it given back already, the loader's refill of it
                 would race with these reads) */
        const stk_batch *b = &u->held;
        stk_san_read(b->data, (size_t)b->n * b->sample_bytes);
        stk_san_read(b->labels, (size_t)b->n * sizeof *b->labels);
        stk_san_read(b->indices, (size_t)b->n * sizeof *b->indices);
        return 0;
    }
    d->read = true;
    return stk_event_record(u->be, d->consumed, STK_STREAM_COMPUTE, err);
}

int uploader_settle(uploader *u, stk_err *err)
{
    if (!u->holding)
        return 0;
    int rc = u->held_buf ? stk_event_wait(u->be, u->held_buf->copied, err) : 0;
    u->holding = false;
    if (!rc) /* after a failed wait the copy may still read the slot: never
                given back (the run ends; the loader's close frees it) */
        u->release(u->ctx, &u->held);
    return rc;
}

/* ---- the ring's memory, pinned once per run ------------------------ */

/* The loaders of a run (one per epoch and evaluation) ask for the same
 * slots again: the blocks a closed loader frees stay here for the next, so
 * that cudaHostAlloc and cudaFreeHost (which waits for the whole device)
 * run once per run. Open and close, hence these, run on the trainer's
 * thread only. */
static void *ring_alloc(size_t bytes, void *ctx)
{
    pinned_ring *pr = ctx;
    for (int i = 0; i < pr->n; i++)
        if (!pr->block[i].used && pr->block[i].bytes >= bytes) {
            pr->block[i].used = true;
            return pr->block[i].p;
        }
    if (pr->n == PINNED_RING_MAX)
        return NULL;
    void *p = stk_pinned_alloc(pr->be, bytes);
    if (p)
        pr->block[pr->n++] = (pinned_block){p, bytes, true};
    return p;
}

static void ring_free(void *p, void *ctx)
{
    pinned_ring *pr = ctx;
    for (int i = 0; i < pr->n; i++)
        if (pr->block[i].p == p)
            pr->block[i].used = false;
}

stk_host_alloc pinned_ring_host(pinned_ring *pr, stk_backend *be)
{
    pr->be = be;
    return (stk_host_alloc){ring_alloc, ring_free, pr};
}

void pinned_ring_free(pinned_ring *pr)
{
    for (int i = 0; i < pr->n; i++)
        stk_pinned_free(pr->be, pr->block[i].p);
    pr->n = 0;
}
