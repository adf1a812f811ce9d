/* _stoke.c - the CPython extension under `import stoke`: a database
 * (stoke.open), the loader's ring of batches (stoke.Loader) and prep
 * (stoke.prep), over the C libraries in store/, loader/ and preprocess/.
 * The Python layer (stoke/__init__.py) shapes what these return into NumPy
 * arrays and torch tensors.
 *
 * Every call that can block releases the GIL, and waits are cut into
 * slices between which Ctrl-C is looked for, so that it raises
 * KeyboardInterrupt at once. A batch handed to Python is a Batch object
 * exporting the ring buffer it lives in: the buffer goes back to the ring
 * when the last view of it (an array, a tensor) is gone, so a view is
 * never overwritten under its holder. A batch still viewed when the ring
 * comes round to its buffer is detached (stk_loader_detach): the view
 * keeps the old buffer and the ring gets a new one. docs/python.md. */
#define PY_SSIZE_T_CLEAN
/* CPython's stable ABI: one _stoke.abi3.so imports under any CPython
 * from 3.11 (the first whose limited API has the buffer protocol);
 * python/CMakeLists.txt defines it too */
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000
#endif
#include <Python.h>

#include "loader/loader.h"
#include "preprocess/preprocess.h"
#include "store/store.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* How long a wait runs before Python gets to look for signals. */
#define WAIT_SLICE 0.05

/* The module's state: stoke.Error and its two kinds, ArgumentError (also
 * a ValueError: a bad argument, a split that does not exist) and
 * DatabaseError (also an OSError: a missing, incomplete or damaged
 * database, a failed write), and the module's types (heap types: the
 * limited API has no static ones). Set once when the module loads; each
 * type holds the module, so an object reaches the state through its type
 * (state_of). */
typedef struct {
    PyObject *error, *argument_error, *database_error;
    PyTypeObject *database_type, *ring_type, *batch_type;
} module_state;

static module_state *state_of(void *self)
{
    return PyType_GetModuleState(Py_TYPE((PyObject *)self));
}

/* Raises the stoke error for a C library failure, carrying its one-line
 * message and its code's name (e.code, "STK_ENOENT"). */
static PyObject *raise_stk(module_state *st, int code, const stk_err *err)
{
    const char *msg = err && err->msg[0] ? err->msg : stk_strerror(code);
    PyObject *type = code == STK_EINVAL || code == STK_ERANGE ||
                             code == STK_EUNSUPPORTED
                         ? st->argument_error
                         : st->database_error;
    if (code == STK_ENOMEM || !type) /* !type: the module is being freed */
        return PyErr_Format(code == STK_ENOMEM ? PyExc_MemoryError
                                               : PyExc_RuntimeError,
                            "%s", msg);
    /* a path in the message need not be UTF-8 */
    PyObject *text = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg),
                                          "backslashreplace");
    PyObject *e = text ? PyObject_CallFunctionObjArgs(type, text, NULL) : NULL;
    Py_XDECREF(text);
    if (!e)
        return NULL;
    PyObject *name = PyUnicode_FromString(stk_err_name(code));
    if (!name || PyObject_SetAttrString(e, "code", name) < 0) {
        Py_XDECREF(name);
        Py_DECREF(e);
        return NULL;
    }
    Py_DECREF(name);
    PyErr_SetObject(type, e);
    Py_DECREF(e);
    return NULL;
}

static PyObject *raise_arg(module_state *st, const char *fmt, ...)
{
    stk_err err;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err.msg, sizeof err.msg, fmt, ap);
    va_end(ap);
    return raise_stk(st, STK_EINVAL, &err);
}

/* ---- Database: the metadata and records of a database ----------------- */

typedef struct {
    PyObject_HEAD
    char *path;
    pid_t pid; /* the process that opened store (LMDB: not after fork) */
    stk_store *store;
    stk_view *views[STK_MAX_SPLITS]; /* opened on first use */
} DatabaseObject;

/* Opening keeps the GIL (milliseconds): close() from another thread
 * cannot free the store meanwhile. */
static int db_open_here(DatabaseObject *self)
{
    stk_err err = {0};
    stk_store *s = NULL;
    int rc = stk_store_open(self->path, 0, &s, &err);
    if (rc) {
        raise_stk(state_of(self), rc, &err);
        return -1;
    }
    self->store = s;
    self->pid = getpid();
    memset(self->views, 0, sizeof self->views);
    return 0;
}

/* The store, reopened in a child after fork: the parent's LMDB handles are
 * the parent's (LMDB: an environment must not be used after fork), so the
 * child leaves them alone, unclosed, and opens its own. */
static stk_store *db_store(DatabaseObject *self)
{
    if (!self->store) {
        raise_arg(state_of(self), "database %s is closed", self->path);
        return NULL;
    }
    if (self->pid != getpid() && db_open_here(self) < 0)
        return NULL;
    return self->store;
}

static int db_init(DatabaseObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"path", NULL};
    PyObject *path;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&", names,
                                     PyUnicode_FSConverter, &path))
        return -1;
    if (self->path) {
        PyErr_SetString(PyExc_TypeError, "Database is already initialised");
        Py_DECREF(path);
        return -1;
    }
    self->path = strdup(PyBytes_AsString(path));
    Py_DECREF(path);
    if (!self->path) {
        PyErr_NoMemory();
        return -1;
    }
    return db_open_here(self);
}

static void db_close_here(DatabaseObject *self)
{
    if (self->store && self->pid == getpid()) {
        for (int i = 0; i < STK_MAX_SPLITS; i++)
            stk_view_close(self->views[i]);
        stk_store_close(self->store);
    }
    self->store = NULL;
    memset(self->views, 0, sizeof self->views);
}

/* Frees an instance of one of the module's heap types, then lets go of
 * the type, which each instance holds. */
static void free_instance(PyObject *self)
{
    PyTypeObject *type = Py_TYPE(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(type, Py_tp_free);
    tp_free(self);
    Py_DECREF(type);
}

static void db_dealloc(DatabaseObject *self)
{
    db_close_here(self);
    free(self->path);
    free_instance((PyObject *)self);
}

static PyObject *db_close(DatabaseObject *self, PyObject *unused)
{
    (void)unused;
    db_close_here(self);
    Py_RETURN_NONE;
}

/* An ArgumentError for a split the database does not have, listing the
 * ones it has. */
static PyObject *raise_no_split(module_state *st, const char *path,
                                const stk_meta *m, const char *split)
{
    char have[STK_MAX_SPLITS * (STK_SPLIT_NAME_MAX + 4)] = "";
    for (int i = 0; i < m->nsplits; i++) {
        strcat(have, i ? ", \"" : "\"");
        strcat(have, m->splits[i].name);
        strcat(have, "\"");
    }
    return raise_arg(st, "database %s has no split \"%s\" (it has %s)", path,
                     split, have);
}

/* The view of a split, by name; an unknown name is an ArgumentError that
 * lists the splits there are. */
static stk_view *db_view(DatabaseObject *self, const char *split)
{
    stk_store *s = db_store(self);
    if (!s)
        return NULL;
    const stk_meta *m = stk_store_meta(s);
    int k = stk_meta_split(m, split);
    if (k < 0) {
        raise_no_split(state_of(self), self->path, m, split);
        return NULL;
    }
    if (!self->views[k]) {
        stk_err err = {0};
        stk_view *v = NULL; /* with the GIL, as db_open_here */
        int rc = stk_view_open(s, split, &v, &err);
        if (rc) {
            raise_stk(state_of(self), rc, &err);
            return NULL;
        }
        self->views[k] = v;
    }
    return self->views[k];
}

/* The C*H*W pixels of a record as a bytearray (an array over it is
 * writable, as torch.from_numpy wants): its payload when raw, decoded with
 * prep's decoder when JPEG. */
static PyObject *record_bytes(module_state *st, const stk_meta *m,
                              const stk_record *rec)
{
    if (m->encoding == STK_ENC_RAW)
        return PyByteArray_FromStringAndSize((const char *)rec->data,
                                             (Py_ssize_t)rec->nbytes);
    size_t n = (size_t)m->channels * rec->height * rec->width;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)n);
    if (!out)
        return NULL;
    stk_decoder *d = NULL; /* a handle per call: tjInitDecompress is cheap */
    stk_err err = {0};
    int rc = stk_decoder_create(&d, &err);
    if (!rc)
        rc = stk_record_pixels(d, m, rec,
                               (uint8_t *)PyByteArray_AsString(out), &err);
    stk_decoder_destroy(d);
    if (rc) {
        Py_DECREF(out);
        return raise_stk(st, rc, &err);
    }
    return out;
}

/* get(split, index) -> (bytearray of the C*H*W pixels, label, H, W) */
static PyObject *db_get(DatabaseObject *self, PyObject *args)
{
    const char *split;
    unsigned long long index;
    if (!PyArg_ParseTuple(args, "sK", &split, &index))
        return NULL;
    stk_view *v = db_view(self, split);
    if (!v)
        return NULL;
    if (index >= stk_view_count(v)) {
        PyErr_Format(PyExc_IndexError,
                     "split \"%s\" of %s has %llu records, not index %llu",
                     split, self->path,
                     (unsigned long long)stk_view_count(v), index);
        return NULL;
    }
    stk_record rec;
    stk_err err = {0};
    int rc = stk_view_get(v, index, &rec, &err);
    if (rc)
        return raise_stk(state_of(self), rc, &err);
    /* a label beyond the classes, refused as the loader refuses it: a
     * dataset must not hand a damaged record to a loss function */
    int nclasses = stk_store_meta(self->store)->nclasses;
    if (rec.label < 0 || rec.label >= nclasses) {
        stk_fail(&err, STK_EFORMAT,
                 "split \"%s\": key %llu: label %d is not one of the "
                 "database's %d classes (0..%d)",
                 split, index, (int)rec.label, nclasses, nclasses - 1);
        return raise_stk(state_of(self), STK_EFORMAT, &err);
    }
    PyObject *px =
        record_bytes(state_of(self), stk_store_meta(self->store), &rec);
    return px ? Py_BuildValue("(Niii)", px, (int)rec.label, rec.height,
                              rec.width)
              : NULL;
}

static PyObject *doubles(const double *v, int n)
{
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        PyObject *f = PyFloat_FromDouble(v[i]);
        if (!f) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SetItem(list, i, f);
    }
    return list;
}

static PyObject *split_dict(const stk_meta *m, const stk_split_meta *s)
{
    PyObject *counts = PyList_New(m->nclasses);
    for (int i = 0; counts && i < m->nclasses; i++) {
        PyObject *c = PyLong_FromUnsignedLongLong(s->label_counts[i]);
        if (!c) {
            Py_CLEAR(counts);
            break;
        }
        PyList_SetItem(counts, i, c);
    }
    if (!counts)
        return NULL;
    return Py_BuildValue("{s:K,s:N,s:N,s:N,s:K}", "count",
                         (unsigned long long)s->count, "mean",
                         doubles(s->mean, m->channels), "std",
                         doubles(s->std, m->channels), "label_counts", counts,
                         "skipped", (unsigned long long)s->nskipped);
}

/* meta() -> the metadata as a dict (docs/formats.md names its fields) */
static PyObject *db_meta(DatabaseObject *self, PyObject *unused)
{
    (void)unused;
    stk_store *st = db_store(self);
    if (!st)
        return NULL;
    const stk_meta *m = stk_store_meta(st);
    PyObject *classes = PyList_New(m->nclasses), *splits = PyDict_New();
    if (!classes || !splits)
        goto fail;
    for (int i = 0; i < m->nclasses; i++) {
        PyObject *name = PyUnicode_FromString(m->classes[i]);
        if (!name)
            goto fail;
        PyList_SetItem(classes, i, name);
    }
    for (int k = 0; k < m->nsplits; k++) {
        PyObject *d = split_dict(m, &m->splits[k]);
        if (!d || PyDict_SetItemString(splits, m->splits[k].name, d) < 0) {
            Py_XDECREF(d);
            goto fail;
        }
        Py_DECREF(d);
    }
    PyObject *side = m->variable ? Py_None : NULL; /* shape (C, None, None) */
    return Py_BuildValue(
        "{s:s,s:(iNN),s:N,s:N,s:s,s:s,s:s,s:s,s:O,s:s,s:i,s:i,s:i}", "path",
        self->path, "shape", m->channels,
        side ? Py_NewRef(side) : PyLong_FromLong(m->height),
        side ? Py_NewRef(side) : PyLong_FromLong(m->width), "classes", classes,
        "splits", splits, "source_path", m->source_path ? m->source_path : "",
        "source_format", m->source_format ? m->source_format : "", "tool",
        m->tool ? m->tool : "", "created", m->created ? m->created : "",
        "variable", m->variable ? Py_True : Py_False, "encoding",
        m->encoding == STK_ENC_JPEG ? "jpeg" : "raw", "quality", m->quality,
        "short_side", m->short_side, "max_side", m->max_side);
fail:
    Py_XDECREF(classes);
    Py_XDECREF(splits);
    return NULL;
}

static PyMethodDef db_methods[] = {
    {"get", (PyCFunction)db_get, METH_VARARGS,
     "get(split, index) -> (pixels: bytes, label: int, height, width)"},
    {"meta", (PyCFunction)db_meta, METH_NOARGS, "meta() -> dict"},
    {"close", (PyCFunction)db_close, METH_NOARGS,
     "close(): frees the LMDB handles (later calls raise)"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot db_slots[] = {
    {Py_tp_doc, (void *)"Database(path): a complete stoke database, read-only"},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_init, (void *)db_init},
    {Py_tp_dealloc, (void *)db_dealloc},
    {Py_tp_methods, db_methods},
    {0, NULL}};

static PyType_Spec db_spec = {
    .name = "stoke._stoke.Database",
    .basicsize = sizeof(DatabaseObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = db_slots,
};

/* ---- Ring: the loader's workers and ring of batches -------------------- */

typedef struct {
    PyObject_HEAD
    stk_store *store;
    stk_loader *loader;
    PyObject *alloc; /* Python allocator of ring memory (pinned), or NULL */
    PyObject *keep;  /* address -> what keeps that memory */
    int held;        /* Batch objects alive */
    int busy;        /* next() calls waiting with the GIL released */
    uint64_t taken;  /* batches taken since open: the next is in buffer
                        taken % slots */
    int slots;
    struct BatchObject **in_slot; /* the Batch viewing each buffer, or NULL
                                     (borrowed: a Batch clears its own) */
    bool closing;    /* close() asked; done when held and busy reach 0 */
    pid_t pid;       /* the process whose threads these are (not a fork) */
    int c, h, w;
} RingObject;

/* A ring used in a child after fork: its workers are the parent's threads,
 * which the child does not have. */
static bool ring_forked(const RingObject *self)
{
    return self->pid != getpid();
}

static void ring_close_now(RingObject *self)
{
    PyMem_Free(self->in_slot);
    self->in_slot = NULL;
    if (!ring_forked(self)) { /* a child leaves the parent's alone */
        stk_loader_close(self->loader); /* calls host_free: GIL held */
        stk_store_close(self->store);
    }
    self->loader = NULL;
    self->store = NULL;
    Py_CLEAR(self->keep);
    Py_CLEAR(self->alloc);
}

/* The ring memory through the Python allocator: it returns (address,
 * keeper); the keeper lives in self->keep until host_free. Called by
 * stk_loader_open and stk_loader_close, with the GIL held. */
static void *host_alloc(size_t bytes, void *ctx)
{
    RingObject *self = ctx;
    PyObject *r = PyObject_CallFunction(self->alloc, "n", (Py_ssize_t)bytes);
    if (!r)
        return NULL;
    void *p = NULL;
    PyObject *addr = NULL;
    if (PyTuple_Check(r) && PyTuple_Size(r) == 2)
        addr = PyTuple_GetItem(r, 0);
    if (addr && PyLong_Check(addr))
        p = PyLong_AsVoidPtr(addr);
    if (p && PyDict_SetItem(self->keep, addr, PyTuple_GetItem(r, 1)) < 0)
        p = NULL;
    if (!p && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError,
                        "the loader's allocator must return (address, keeper)");
    Py_DECREF(r);
    return p;
}

static void host_free(void *p, void *ctx)
{
    RingObject *self = ctx;
    if (!p) /* a slot a failed open never allocated */
        return;
    PyObject *type, *value, *tb; /* an exception in flight stays */
    PyErr_Fetch(&type, &value, &tb);
    PyObject *addr = PyLong_FromVoidPtr(p);
    if (!addr || PyDict_DelItem(self->keep, addr) < 0)
        PyErr_Clear();
    Py_XDECREF(addr);
    PyErr_Restore(type, value, tb);
}

static int ring_init(RingObject *self, PyObject *args, PyObject *kw)
{
    static char *names[] = {"path",    "split",       "batch_size",
                            "shuffle", "drop_last",   "seed",
                            "workers", "prefetch",    "rank",
                            "world",   "start_epoch", "start_batch",
                            "uneven",  "pad",         "flip",
                            "alloc",   "transform",   "crop_size",
                            "crop_ratio", "scale_lo", "scale_hi",
                            "stream_stores", NULL};
    PyObject *path, *alloc = Py_None;
    const char *split = "train", *transform = "none";
    int shuffle = 1, drop_last = 0, uneven = 0, flip = 0, crop_size = 0,
        stream = 0;
    double crop_ratio = 0, scale[2] = {0, 0};
    unsigned long long seed = 0, start_epoch = 0, start_batch = 0;
    stk_loader_opts o = {.batch_size = 0};
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "O&si|ppKiiiiKKpipOsidddp", names, PyUnicode_FSConverter,
            &path, &split, &o.batch_size, &shuffle, &drop_last, &seed,
            &o.workers, &o.prefetch, &o.rank, &o.world, &start_epoch,
            &start_batch, &uneven, &o.aug_pad, &flip, &alloc, &transform,
            &crop_size, &crop_ratio, &scale[0], &scale[1], &stream))
        return -1;
    bool rrc = !strcmp(transform, "rrc");
    if (!rrc && strcmp(transform, "none") && strcmp(transform, "centre")) {
        Py_DECREF(path);
        raise_arg(state_of(self),
                  "transform must be none, rrc or centre, not \"%s\"",
                  transform);
        return -1;
    }
    if (self->loader || self->store || self->keep || self->alloc ||
        self->closing) {
        Py_DECREF(path);
        PyErr_SetString(PyExc_TypeError, "Ring is already initialised");
        return -1;
    }
    o.split = split;
    o.shuffle = shuffle;
    o.drop_last = drop_last;
    o.uneven = uneven;
    o.aug_flip = flip;
    o.seed = seed;
    o.start_epoch = start_epoch;
    o.start_batch = start_batch;
    o.stream_stores = stream;
    if (alloc != Py_None) {
        if (!(self->keep = PyDict_New())) {
            Py_DECREF(path);
            return -1;
        }
        Py_INCREF(alloc);
        self->alloc = alloc;
        o.host = (stk_host_alloc){host_alloc, host_free, self};
    }
    stk_err err = {0};
    int rc;
    const char *where = PyBytes_AsString(path); /* a call: once */
    Py_BEGIN_ALLOW_THREADS
    rc = stk_store_open(where, 0, &self->store, &err);
    Py_END_ALLOW_THREADS
    if (rc) {
        Py_DECREF(path);
        raise_stk(state_of(self), rc, &err);
        return -1;
    }
    const stk_meta *m = stk_store_meta(self->store);
    if (stk_meta_split(m, split) < 0) {
        raise_no_split(state_of(self), where, m, split);
        Py_DECREF(path);
        stk_store_close(self->store);
        self->store = NULL;
        return -1;
    }
    if (rrc || strcmp(transform, "none") || m->variable || crop_size ||
        crop_ratio > 0) { /* images of one size, sized as train sizes them */
        rc = stk_loader_crop_plan(m, crop_size, crop_ratio,
                                  where, &o.xform, &err);
        if (!rc && rrc)
            o.xform = (stk_loader_xform){.kind = STK_XFORM_RRC,
                                         .size = o.xform.size, .flip = true,
                                         .scale = {scale[0], scale[1]}};
        if (rc) {
            Py_DECREF(path);
            raise_stk(state_of(self), rc, &err);
            stk_store_close(self->store);
            self->store = NULL;
            return -1;
        }
    }
    Py_DECREF(path);
    if (o.aug_pad == -1) /* train --augment's padding, H / 8 */
        o.aug_pad = m->height / 8;
    if (self->alloc) { /* the allocator is Python: keep the GIL */
        rc = stk_loader_open(self->store, &o, &self->loader, &err);
    } else {
        Py_BEGIN_ALLOW_THREADS
        rc = stk_loader_open(self->store, &o, &self->loader, &err);
        Py_END_ALLOW_THREADS
    }
    if (rc) {
        if (!PyErr_Occurred())
            raise_stk(state_of(self), rc, &err);
        stk_store_close(self->store);
        self->store = NULL;
        return -1;
    }
    self->pid = getpid();
    self->slots = stk_loader_slots(self->loader);
    self->in_slot = PyMem_Calloc((size_t)self->slots, sizeof *self->in_slot);
    if (!self->in_slot) {
        ring_close_now(self);
        PyErr_NoMemory();
        return -1;
    }
    self->c = m->channels;
    self->h = o.xform.kind ? o.xform.size : m->height;
    self->w = o.xform.kind ? o.xform.size : m->width;
    return 0;
}

static void ring_dealloc(RingObject *self)
{
    /* no Batch is alive (each holds the ring), nor a next() (it holds
     * self): nothing uses the ring any more */
    if (self->loader || self->store)
        ring_close_now(self);
    Py_XDECREF(self->keep);
    Py_XDECREF(self->alloc);
    free_instance((PyObject *)self);
}

/* Ends the loader once nothing uses it: now, or when the last batch view
 * or waiting next() is gone. */
static void ring_settle(RingObject *self)
{
    if (self->closing && !self->held && !self->busy && self->loader)
        ring_close_now(self);
}

/* The workers stop now (Ctrl-C leaves no thread behind, even while the
 * loop variable still holds its batch); the ring's memory goes when the
 * last view of it does. */
static void ring_stop(RingObject *self)
{
    if (!self->loader || self->busy || ring_forked(self))
        return; /* a next() in another thread stops it on its way out */
    stk_loader *l = self->loader;
    self->busy++; /* no ring_settle frees it meanwhile, no second stop */
    Py_BEGIN_ALLOW_THREADS
    stk_loader_stop(l); /* waits for the batch each worker fills */
    Py_END_ALLOW_THREADS
    self->busy--;
}

static PyObject *ring_close(RingObject *self, PyObject *unused)
{
    (void)unused;
    self->closing = true;
    if (self->held)
        ring_stop(self);
    ring_settle(self);
    Py_RETURN_NONE;
}

/* ---- Batch: one batch's images, a view into the ring ------------------- */

typedef struct BatchObject {
    PyObject_HEAD
    RingObject *ring; /* strong: the ring outlives its batches */
    stk_batch b;      /* b.slot < 0: detached, its buffer its own */
} BatchObject;

static void batch_dealloc(BatchObject *self)
{
    RingObject *r = self->ring;
    if (r && ring_forked(r)) { /* the parent's loader: its lock may be held
                                  by a thread the child does not have */
        r->held--;
        Py_DECREF(r);
    } else if (r) {
        if (self->b.slot < 0) {
            stk_loader_free_detached(r->loader, &self->b);
        } else {
            r->in_slot[self->b.slot] = NULL;
            stk_loader_release(r->loader, &self->b);
        }
        r->held--;
        ring_settle(r);
        Py_DECREF(r);
    }
    free_instance((PyObject *)self);
}

/* The images as n*C*H*W bytes (uint8 N, C, H, W), writable: the batch is
 * its holder's until every view of it is gone. */
static int batch_getbuffer(BatchObject *self, Py_buffer *view, int flags)
{
    size_t len = (size_t)self->b.n * self->b.sample_bytes;
    return PyBuffer_FillInfo(view, (PyObject *)self, self->b.data,
                             (Py_ssize_t)len, 0, flags);
}

/* Made by Ring.next() only: Python cannot create one. */
static PyType_Slot batch_slots[] = {
    {Py_tp_doc, (void *)"the images of one batch, in the loader's ring until "
                        "every view of them is gone"},
    {Py_tp_dealloc, (void *)batch_dealloc},
    {Py_bf_getbuffer, (void *)batch_getbuffer},
    {0, NULL}};

static PyType_Spec batch_spec = {
    .name = "stoke._stoke.Batch",
    .basicsize = sizeof(BatchObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = batch_slots,
};

static PyObject *ring_closed(RingObject *self)
{
    return raise_arg(state_of(self), "the loader is closed");
}

/* The loader, if this process may use it; NULL with an exception. */
static stk_loader *ring_loader(RingObject *self)
{
    if (!self->loader) {
        ring_closed(self);
        return NULL;
    }
    if (ring_forked(self)) {
        raise_arg(state_of(self),
                  "a loader cannot be used in a child process after fork "
                  "(its threads are the parent's): create one there");
        return NULL;
    }
    return self->loader;
}

/* next() -> None at the end of an epoch (the next call starts the next
 * one), else (images: Batch, labels: bytes of int32, indices: bytes of
 * uint64, epoch, index). */
static PyObject *ring_next(RingObject *self, PyObject *unused)
{
    (void)unused;
    if (self->closing || !self->loader)
        return ring_closed(self);
    if (!ring_loader(self))
        return NULL;
    if (self->busy)
        return raise_arg(state_of(self),
                         "the loader's next() is already waiting in another "
                         "thread; one thread takes a loader's batches");
    stk_batch b;
    stk_err err = {0};
    int rc = 0;
    self->busy++;
    /* the buffer the next batch goes to, if a batch there is still
     * viewed: that batch keeps it, the ring gets a fresh one (held
     * strongly: the allocator may run Python that drops the last view) */
    size_t k = (size_t)(self->taken % (uint64_t)self->slots);
    BatchObject *old = self->in_slot[k];
    if (old) {
        Py_INCREF((PyObject *)old);
        self->in_slot[k] = NULL;
        rc = stk_loader_detach(self->loader, &old->b, &err);
        if (rc)
            self->in_slot[k] = old;
        Py_DECREF(old);
    }
    for (bool wait = !rc; wait;) { /* not when the detach failed */
        Py_BEGIN_ALLOW_THREADS
        rc = stk_loader_next_for(self->loader, &b, WAIT_SLICE, &err);
        Py_END_ALLOW_THREADS
        wait = rc == STK_ETIMEDOUT && !self->closing &&
               PyErr_CheckSignals() == 0;
    }
    self->busy--;
    if (rc == 1)
        self->taken++;
    if (rc == 1 && self->closing) /* closed from another thread meanwhile */
        stk_loader_release(self->loader, &b);
    if (self->closing) {
        ring_stop(self);
        ring_settle(self);
        return PyErr_Occurred() ? NULL : ring_closed(self);
    }
    if (rc == STK_ETIMEDOUT) /* a signal handler raised */
        return NULL;
    if (rc < 0)
        return raise_stk(state_of(self), rc, &err);
    if (rc == 0)
        Py_RETURN_NONE;
    BatchObject *bo = PyObject_New(BatchObject, state_of(self)->batch_type);
    if (!bo) {
        stk_loader_release(self->loader, &b);
        return NULL;
    }
    Py_INCREF((PyObject *)self);
    bo->ring = self;
    bo->b = b;
    self->held++;
    self->in_slot[b.slot] = bo;
    return Py_BuildValue("(Ny#y#KK)", (PyObject *)bo, (const char *)b.labels,
                         (Py_ssize_t)b.n * 4, (const char *)b.indices,
                         (Py_ssize_t)b.n * 8, (unsigned long long)b.epoch,
                         (unsigned long long)b.index);
}

static PyObject *ring_position(RingObject *self, PyObject *unused)
{
    (void)unused;
    if (!ring_loader(self))
        return NULL;
    stk_loader_pos p = stk_loader_position(self->loader);
    return Py_BuildValue("(KK)", (unsigned long long)p.epoch,
                         (unsigned long long)p.batch);
}

static PyObject *ring_stats(RingObject *self, PyObject *unused)
{
    (void)unused;
    if (!ring_loader(self))
        return NULL;
    stk_loader_stats s;
    stk_loader_stats_get(self->loader, &s);
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:d,s:d,s:d,s:d,s:d,s:d,s:K,s:i,s:N}", "batches",
        (unsigned long long)s.batches, "samples",
        (unsigned long long)s.samples, "bytes", (unsigned long long)s.bytes,
        "elapsed", s.elapsed, "first_batch", s.first_batch, "wait", s.wait,
        "samples_per_s", s.samples_per_s, "bytes_per_s", s.bytes_per_s,
        "stall", s.stall, "wakes", (unsigned long long)s.wakes, "workers",
        s.workers, "busy", doubles(s.busy, s.workers));
}

static PyObject *ring_info(RingObject *self, PyObject *unused)
{
    (void)unused;
    if (!self->loader)
        return ring_closed(self);
    return Py_BuildValue("{s:K,s:i,s:(iii)}", "batches",
                         (unsigned long long)stk_loader_batches(self->loader),
                         "slots", stk_loader_slots(self->loader), "shape",
                         self->c, self->h, self->w);
}

static PyMethodDef ring_methods[] = {
    {"next", (PyCFunction)ring_next, METH_NOARGS,
     "next() -> None at an epoch's end, else (images, labels, indices, "
     "epoch, index)"},
    {"position", (PyCFunction)ring_position, METH_NOARGS,
     "position() -> (epoch, batch) of the next batch"},
    {"stats", (PyCFunction)ring_stats, METH_NOARGS, "stats() -> dict"},
    {"info", (PyCFunction)ring_info, METH_NOARGS,
     "info() -> {batches per epoch, slots, shape}"},
    {"close", (PyCFunction)ring_close, METH_NOARGS,
     "close(): stops the workers and frees the ring once no batch view "
     "is left"},
    {NULL, NULL, 0, NULL}};

static PyType_Slot ring_slots[] = {
    {Py_tp_doc, (void *)"Ring(path, split, batch_size, ...): the loader's "
                        "workers and its ring of batches (stoke.Loader "
                        "wraps it)"},
    {Py_tp_new, (void *)PyType_GenericNew},
    {Py_tp_init, (void *)ring_init},
    {Py_tp_dealloc, (void *)ring_dealloc},
    {Py_tp_methods, ring_methods},
    {0, NULL}};

static PyType_Spec ring_spec = {
    .name = "stoke._stoke.Ring",
    .basicsize = sizeof(RingObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = ring_slots,
};

/* ---- prep ---------------------------------------------------------------- */

typedef struct prep_call {
    const char *raw, *db;
    stk_prep_opts o;
    stk_prep_summary sum;
    stk_err err;
    int rc;
    atomic_int cancel;
    PyObject *progress; /* callable(split, done, total, skipped, seconds) */
    PyObject *raised;   /* what the callback raised: prep raises it */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done;
} prep_call;

/* From prep's writer thread: the Python callback, under the GIL. A
 * callback that raises stops the run (the exception is reported). */
static void on_progress(const stk_prep_progress *p, void *arg)
{
    prep_call *c = arg;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *r = PyObject_CallFunction(
        c->progress, "sKKKd", p->split ? p->split : "",
        (unsigned long long)p->done, (unsigned long long)p->total,
        (unsigned long long)p->skipped, p->seconds);
    if (!r && !c->raised) {
        PyObject *type, *tb;
        PyErr_Fetch(&type, &c->raised, &tb);
        PyErr_NormalizeException(&type, &c->raised, &tb);
        if (c->raised && tb)
            PyException_SetTraceback(c->raised, tb);
        Py_XDECREF(type);
        Py_XDECREF(tb);
        c->cancel = 1;
    }
    PyErr_Clear();
    Py_XDECREF(r);
    PyGILState_Release(g);
}

static void *prep_thread(void *v)
{
    prep_call *c = v;
    /* it runs the caller's progress callback: a subprocess started there
     * must take Ctrl-C and SIGTERM as usual */
    stk_thread_allow_stop_signals();
    c->rc = stk_prep_run(c->raw, c->db, &c->o, &c->sum, &c->err);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    pthread_cond_signal(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Waits for the prep thread in slices, Ctrl-C asking it to stop (it
 * leaves the database directory as it was); returns -1 when a signal
 * handler raised. */
static int prep_wait(prep_call *c, pthread_t t)
{
    int raised = 0;
    for (bool done = false; !done;) {
        Py_BEGIN_ALLOW_THREADS
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += (long)(WAIT_SLICE * 1e9);
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&c->mu);
        if (!c->done)
            pthread_cond_timedwait(&c->cv, &c->mu, &ts);
        done = c->done;
        pthread_mutex_unlock(&c->mu);
        Py_END_ALLOW_THREADS
        if (!done && !raised && PyErr_CheckSignals() < 0) {
            raised = 1;
            c->cancel = 1;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
    return raised ? -1 : 0;
}

static PyObject *summary_dict(const stk_prep_summary *s)
{
    PyObject *splits = PyDict_New();
    for (int k = 0; splits && k < s->nsplits; k++) {
        PyObject *v = Py_BuildValue("{s:K,s:K}", "count",
                                    (unsigned long long)s->count[k], "skipped",
                                    (unsigned long long)s->skipped[k]);
        if (!v || PyDict_SetItemString(splits, s->split[k], v) < 0)
            Py_CLEAR(splits);
        Py_XDECREF(v);
    }
    if (!splits)
        return NULL;
    /* file and class names in the warning need not be UTF-8 (Linux file
     * names are bytes): escaped, as raise_stk escapes paths */
    PyObject *warning = PyUnicode_DecodeUTF8(s->warning, strlen(s->warning),
                                             "backslashreplace");
    if (!warning) {
        Py_DECREF(splits);
        return NULL;
    }
    return Py_BuildValue("{s:N,s:K,s:K,s:d,s:(iii),s:s,s:N}", "splits",
                         splits, "samples", (unsigned long long)s->samples,
                         "bytes", (unsigned long long)s->bytes, "seconds",
                         s->seconds, "shape", s->channels, s->height,
                         s->width, "encoding",
                         s->encoding == STK_ENC_JPEG ? "jpeg" : "raw",
                         "warning", warning);
}

static int parse_format(module_state *st, const char *name,
                        stk_src_format *out)
{
    static const char *names[] = {"auto", "idx", "cifar", "folder"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(name, names[i])) {
            *out = (stk_src_format)i;
            return 0;
        }
    raise_arg(st, "format must be auto, idx, cifar or folder, not \"%s\"",
              name);
    return -1;
}

/* prep(raw_dir, db_dir, workers, size, channels, format, force, skip_bad,
 *      created, progress) -> summary dict */
static PyObject *py_prep(PyObject *mod, PyObject *args, PyObject *kw)
{
    module_state *st = PyModule_GetState(mod);
    static char *names[] = {"raw_dir",  "db_dir",   "workers",    "size",
                            "channels", "format",   "force",      "skip_bad",
                            "created",  "progress", "short_side", "max_side",
                            "upscale",  "encode",   "quality",    "holdout",
                            "holdout_seed", NULL};
    PyObject *raw, *db, *progress = Py_None;
    const char *format = "auto", *created = NULL, *encode = "raw";
    prep_call c = {.o = {.workers = 1}};
    int force = 0, skip_bad = 0, upscale = 0;
    unsigned long long hseed = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kw, "O&O&|iiisppzOiipsidK", names, PyUnicode_FSConverter,
            &raw, PyUnicode_FSConverter, &db, &c.o.workers, &c.o.source.size,
            &c.o.source.channels, &format, &force, &skip_bad, &created,
            &progress, &c.o.source.short_side, &c.o.source.max_side, &upscale,
            &encode, &c.o.quality, &c.o.source.holdout, &hseed))
        return NULL;
    c.o.source.holdout_seed = hseed;
    PyObject *result = NULL;
    c.o.source.upscale = upscale;
    if (parse_format(st, format, &c.o.source.format) < 0)
        goto out;
    if (strcmp(encode, "raw") && strcmp(encode, "jpeg")) {
        raise_arg(st, "encode must be \"raw\" or \"jpeg\", not \"%s\"", encode);
        goto out;
    }
    c.o.encoding = strcmp(encode, "jpeg") ? STK_ENC_RAW : STK_ENC_JPEG;
    c.raw = PyBytes_AsString(raw);
    c.db = PyBytes_AsString(db);
    c.o.force = force;
    c.o.force_hint = "force=True";
    c.o.skip_bad = skip_bad;
    c.o.created = created;
    c.o.cancel = &c.cancel;
    if (progress != Py_None) {
        c.progress = progress;
        c.o.progress = on_progress;
        c.o.progress_arg = &c;
    }
    pthread_mutex_init(&c.mu, NULL);
    pthread_cond_init(&c.cv, NULL);
    pthread_t t;
    if (stk_thread_start(&t, prep_thread, &c, "stk-prep call", -1)) {
        PyErr_SetString(PyExc_OSError, "prep: cannot start a thread");
    } else if (prep_wait(&c, t) < 0) {
        Py_CLEAR(c.raised); /* the KeyboardInterrupt wins */
    } else if (c.raised) {
        PyErr_SetObject((PyObject *)Py_TYPE(c.raised), c.raised);
        Py_CLEAR(c.raised);
    } else {
        if (c.rc == STK_ECANCELED && !PyErr_Occurred())
            raise_arg(st, "prep was canceled; %s was left as it was", c.db);
        else if (c.rc)
            raise_stk(st, c.rc, &c.err);
        else
            result = summary_dict(&c.sum);
    }
    pthread_cond_destroy(&c.cv);
    pthread_mutex_destroy(&c.mu);
out:
    Py_DECREF(raw);
    Py_DECREF(db);
    return result;
}

/* ---- the module ---------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"prep", (PyCFunction)(void (*)(void))py_prep,
     METH_VARARGS | METH_KEYWORDS,
     "prep(raw_dir, db_dir, workers=1, size=0, channels=0, format='auto', "
     "force=False, skip_bad=False, created=None, progress=None, "
     "short_side=0, max_side=0, upscale=False, encode='raw', quality=0, "
     "holdout=0, holdout_seed=0) -> summary"},
    {NULL, NULL, 0, NULL}};

static PyObject *new_error(const char *name, PyObject *bases, const char *doc)
{
    return PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
}

static int add_errors(PyObject *m, module_state *st)
{
    st->error = new_error("stoke.Error", NULL,
                          "A stoke failure: str(e) is the C library's one-line "
                          "message, e.code its name (\"STK_ENOENT\").");
    PyObject *b1 =
        st->error ? PyTuple_Pack(2, st->error, PyExc_ValueError) : NULL;
    PyObject *b2 = st->error ? PyTuple_Pack(2, st->error, PyExc_OSError) : NULL;
    if (b1)
        st->argument_error = new_error(
            "stoke.ArgumentError", b1,
            "A bad argument: a split that does not exist, a batch size of "
            "0, a rank outside the world (also a ValueError).");
    if (b2)
        st->database_error = new_error(
            "stoke.DatabaseError", b2,
            "A database that is missing, incomplete or damaged, or a failed "
            "read or write (also an OSError).");
    Py_XDECREF(b1);
    Py_XDECREF(b2);
    if (!st->argument_error || !st->database_error)
        return -1;
    /* the module takes references of its own; the state's stay for
     * raise_stk */
    if (PyModule_AddObjectRef(m, "Error", st->error) < 0 ||
        PyModule_AddObjectRef(m, "ArgumentError", st->argument_error) < 0 ||
        PyModule_AddObjectRef(m, "DatabaseError", st->database_error) < 0)
        return -1;
    return 0;
}

/* A heap type of the module, held by the state (*out) and, when name is
 * given, by the module's attribute of that name too. */
static int add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **out,
                    const char *name)
{
    *out = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (!*out)
        return -1;
    return name ? PyModule_AddObjectRef(m, name, (PyObject *)*out) : 0;
}

static int module_exec(PyObject *m)
{
    module_state *st = PyModule_GetState(m);
    if (add_errors(m, st) < 0 ||
        add_type(m, &db_spec, &st->database_type, "Database") < 0 ||
        add_type(m, &ring_spec, &st->ring_type, "Ring") < 0 ||
        add_type(m, &batch_spec, &st->batch_type, NULL) < 0 ||
        PyModule_AddIntConstant(m, "MAX_WORKERS", STK_LOADER_MAX_WORKERS) < 0)
        return -1; /* the state is cleared with the module */
    return 0;
}

/* Each type holds the module (PyType_FromModuleAndSpec) and the state
 * holds the types: the collector sees that cycle through these. */
static int module_traverse(PyObject *m, visitproc visit, void *arg)
{
    module_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    Py_VISIT(st->error);
    Py_VISIT(st->argument_error);
    Py_VISIT(st->database_error);
    Py_VISIT(st->database_type);
    Py_VISIT(st->ring_type);
    Py_VISIT(st->batch_type);
    return 0;
}

static int module_clear(PyObject *m)
{
    module_state *st = PyModule_GetState(m);
    if (!st)
        return 0;
    Py_CLEAR(st->error);
    Py_CLEAR(st->argument_error);
    Py_CLEAR(st->database_error);
    Py_CLEAR(st->database_type);
    Py_CLEAR(st->ring_type);
    Py_CLEAR(st->batch_type);
    return 0;
}

static void module_free(void *m)
{
    module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, (void *)module_exec},
                                          {0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "stoke._stoke",
    .m_doc = "stoke's C core; use the stoke package",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__stoke(void)
{
    return PyModuleDef_Init(&module);
}
