"""stoke for PyTorch users: a stoke database as a dataset, and its loader.

    import stoke
    stoke.prep("raw/", "db/")                  # decode once, write LMDB
    db = stoke.open("db/")                     # splits, shape, classes, mean/std
    image, label = db["train"][0]              # uint8 (C, H, W) array, int
    for images, labels in stoke.Loader("db/", batch_size=256, as_torch=True):
        ...                                    # uint8 (N, C, H, W), int64 (N,)

The loader's batches are views of its ring buffers, not copies: a batch
stays valid for as long as any view of it (an array, a tensor) is alive,
and its buffer is refilled only after the last view is gone (a batch kept
longer than the ring takes to come round gives its buffer up to the view:
the ring gets a new one). copy=True gives batches of their own instead.
docs/python.md has a whole training loop, its DDP variant and a comparison
with torch.utils.data.DataLoader.
"""
import collections
import collections.abc
import math
import numbers
import operator
import os
import sys

from . import _stoke
from ._stoke import ArgumentError, DatabaseError, Error

__all__ = ["open", "Database", "Split", "Loader", "prep", "Error",
           "ArgumentError", "DatabaseError"]
__version__ = "0.1.0"


def _numpy():
    """numpy, imported on first use rather than by `import stoke` (numpy's
    import takes about 100 ms, stoke's own a few): a Loader imports it while
    its workers, which need no GIL, fill the first batch."""
    import numpy
    return numpy


def _arg_error(msg):
    """A stoke.ArgumentError raised from Python, with its code as the C
    library's."""
    e = ArgumentError(msg)
    e.code = "STK_EINVAL"
    return e


def _integer(name, v):
    """v as an int; what int() would round or parse (1.5, "3", True) is a
    TypeError naming the argument, as DataLoader refuses batch_size=1.5."""
    if isinstance(v, bool) or not hasattr(type(v), "__index__"):
        raise TypeError("%s must be an integer, not %s %r"
                        % (name, type(v).__name__, v))
    return operator.index(v)


def _c_int(name, v, lo=-(1 << 31), hi=(1 << 31) - 1, why=""):
    """An integer argument the C library takes as an int, within lo..hi."""
    v = _integer(name, v)
    if not lo <= v <= hi:
        want = ">= %d" % lo if hi == (1 << 31) - 1 else "%d..%d" % (lo, hi)
        raise _arg_error("%s must be %s, not %d%s" % (name, want, v, why))
    return v


def _real(name, v):
    """A finite float argument; strings and bools are a TypeError."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError("%s must be a number, not %s %r"
                        % (name, type(v).__name__, v))
    v = float(v)
    if not math.isfinite(v):
        raise _arg_error("%s must be finite, not %r" % (name, v))
    return v


def _no_split(path, split, splits):
    return _arg_error('database %s has no split "%s" (it has %s)' % (
        path, split, ", ".join('"%s"' % s for s in splits)))


def open(db_dir):  # noqa: A001 - stoke.open, as the docs name it
    """Opens a complete stoke database (read-only): a Database."""
    return Database(db_dir)


class Database:
    """A stoke database: its splits by name (db["train"]), the sample shape,
    the class names, per-split counts and per-channel mean and std (of the
    pixel values over 255, as torchvision's Normalize wants them).

    Safe to use after fork (DataLoader workers): a child reopens the LMDB
    environment on first use; pickling (spawn) carries the path only."""

    def __init__(self, db_dir):
        self.path = os.fspath(db_dir)
        self._db = _stoke.Database(self.path)
        self._meta = self._db.meta()
        self._splits = {}

    # -- what the database holds --
    @property
    def shape(self):
        """(C, H, W) of every sample; (C, None, None) when variable."""
        return tuple(self._meta["shape"])

    @property
    def variable(self):
        """True when each record has its own height and width
        (prep --short-side / --max-side)."""
        return self._meta["variable"]

    @property
    def encoding(self):
        """"raw" or "jpeg" (prep --encode): how records are stored; split[i]
        gives decoded pixels either way."""
        return self._meta["encoding"]

    @property
    def classes(self):
        """Class names, by label."""
        return list(self._meta["classes"])

    @property
    def num_classes(self):
        return len(self._meta["classes"])

    @property
    def splits(self):
        """Split names, in the database's order."""
        return list(self._meta["splits"])

    @property
    def meta(self):
        """The whole metadata (docs/formats.md) as a dict."""
        return self._meta

    def counts(self):
        """{split: records}"""
        return {k: v["count"] for k, v in self._meta["splits"].items()}

    def mean(self, split="train"):
        """Per-channel mean of a split's pixels / 255."""
        return tuple(self._split_meta(split)["mean"])

    def std(self, split="train"):
        """Per-channel standard deviation of a split's pixels / 255."""
        return tuple(self._split_meta(split)["std"])

    def _split_meta(self, split):
        return _split_meta(self.path, self._meta, split)

    def __getitem__(self, split):
        if split not in self._splits:
            self._split_meta(split)
            self._splits[split] = Split(self, split)
        return self._splits[split]

    def __contains__(self, split):
        return split in self._meta["splits"]

    def __iter__(self):
        return iter(self.splits)

    def __len__(self):
        return len(self.splits)

    def __repr__(self):
        c, h, w = self.shape
        size = "%dx%dx%d" % (c, h, w) if h else "%d channels, variable size" % c
        if self.encoding != "raw":
            size += ", " + self.encoding
        return "stoke.Database(%r: %s, %s, %d classes)" % (
            self.path, ", ".join("%s %d" % kv for kv in self.counts().items()),
            size, self.num_classes)

    # -- lifetime --
    def close(self):
        """Frees the LMDB handles; the database is unusable afterwards."""
        self._db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __getstate__(self):
        return {"path": self.path}

    def __setstate__(self, state):
        self.__init__(state["path"])


def _split_meta(path, meta, split):
    """meta's entry for split; a split that is not there is an ArgumentError
    naming the ones that are."""
    try:
        return meta["splits"][split]
    except (KeyError, TypeError):
        raise _no_split(path, split, meta["splits"]) from None


class Split:
    """One split of a database as a map-style dataset: split[i] is
    (image, label), the image a read-only uint8 NumPy array (C, H, W): the
    record's own H x W in a variable-size database, decoded (in C, with
    prep's libjpeg-turbo decoder) in a JPEG one.
    torch.utils.data.DataLoader accepts it, with workers too."""

    def __init__(self, db, name):
        self._dbw = db
        self.name = name
        self.shape = db.shape
        self._len = db.meta["splits"][name]["count"]

    def __len__(self):
        return self._len

    def __getitem__(self, i):
        try:
            i = i.__index__()
        except AttributeError:
            raise TypeError("split indices are integers, not %s"
                            % type(i).__name__) from None
        given = i
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError('split "%s" has %d records, not index %d'
                             % (self.name, self._len, given))
        pixels, label, h, w = self._dbw._db.get(self.name, i)
        np = _numpy()
        image = np.frombuffer(pixels, dtype=np.uint8).reshape(self.shape[0], h, w)
        return image, label

    @property
    def labels(self):
        """label_counts: records per class."""
        return list(self._dbw.meta["splits"][self.name]["label_counts"])

    def mean(self):
        return self._dbw.mean(self.name)

    def std(self):
        return self._dbw.std(self.name)

    def __repr__(self):
        return "stoke.Split(%r of %r, %d records)" % (
            self.name, self._dbw.path, self._len)

    def __getstate__(self):
        return {"path": self._dbw.path, "name": self.name}

    def __setstate__(self, state):
        self.__init__(Database(state["path"]), state["name"])


def _pinned_alloc(torch):
    """The ring's memory page-locked through torch (a function of torch
    alone: a bound method would tie the loader into a cycle through the C
    ring, which the collector cannot see)."""
    def alloc(nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return t.data_ptr(), t
    return alloc


def _u64(name, v):
    v = _integer(name, v)
    if not 0 <= v < 1 << 64:
        raise _arg_error("%s must be 0..2**64-1, not %d" % (name, v))
    return v


class _EpochEnd(Exception):
    """The ring's epoch ended (Loader._next)."""


class _Ended(Exception):
    """The iteration was ended while its batch came (Loader._next)."""


def _default_workers():
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(4, cpus))


def _world(rank, world_size):
    """rank and world size: as given, else the torch.distributed process
    group (when torch is imported and one is initialised), else the
    RANK / WORLD_SIZE variables torchrun sets, else 0 of 1."""
    if rank is not None and world_size is not None:
        return _c_int("rank", rank), _c_int("world_size", world_size)
    r = w = None
    torch = sys.modules.get("torch")  # no import: it takes a second
    if torch is not None:
        dist = getattr(torch, "distributed", None)
        if dist is not None and dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
    if r is None:
        given = [k for k in ("RANK", "WORLD_SIZE") if os.environ.get(k)]
        if len(given) == 1:  # torchrun sets both; train refuses one alone
            missing = "WORLD_SIZE" if given == ["RANK"] else "RANK"
            raise _arg_error("%s is set in the environment but %s is not "
                             "(torchrun sets both; rank= and world_size= "
                             "override them)" % (given[0], missing))
        r, w = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return (_c_int("rank", rank) if rank is not None else r,
            _c_int("world_size", world_size) if world_size is not None else w)


def _env_int(name, default):
    """An integer variable of the environment (torchrun's RANK, ...)."""
    v = os.environ.get(name)
    if not v:  # unset or empty, as train reads it
        return default
    try:
        v = int(v)
    except ValueError:
        raise _arg_error("%s=%r in the environment is not an integer (torchrun "
                         "sets it; rank= and world_size= override it)"
                         % (name, v)) from None
    return _c_int(name, v)


class Loader:
    """Batches of a split, shuffled by (seed, epoch) as DistributedSampler
    shuffles, loaded by `workers` C threads into a ring of `prefetch`
    buffers ahead of the loop.

    Iterating yields (images, labels): a uint8 array (N, C, H, W) and an
    int32 array (N,), or with as_torch=True a uint8 tensor and an int64
    tensor. Each `for` over the loader is the next epoch (0, 1, 2, ...)
    unless set_epoch() or load_state_dict() says otherwise: there is no
    set_epoch trap. rank and world_size default to the torch.distributed
    process group, else RANK and WORLD_SIZE, else 0 of 1; each rank sees
    its own shard, padded to equal lengths (drop_last trims instead;
    uneven=True gives every sample exactly once over the ranks, for
    evaluation).

    augment=True (or "crop") applies train --augment's transform in the
    workers: a random crop with H // 8 pixels of zero padding and a
    horizontal flip, drawn per (seed, epoch, sample). augment="rrc" is
    torchvision's RandomResizedCrop(crop_size, scale=rrc_scale) and a
    horizontal flip (train --augment rrc), for photos. Images come out
    crop_size x crop_size whenever a crop size is asked for, rrc is, or the
    database keeps each image's aspect ratio (prep --short-side): without
    rrc through the evaluation transform Resize(crop_size / crop_ratio) +
    CenterCrop(crop_size). crop_size defaults to the stored side, or 0.875
    of the stored shorter side (prep --short-side 256: 224); crop_ratio to
    0.875 there (torchvision's 224/256) and to crop_size / stored side on
    fixed-size databases. Batches of JPEG records (prep --encode jpeg) are
    decoded by the workers.

    Batches are views of the ring, never overwritten while viewed (see the
    module's doc); copy=True gives copies instead. pin_memory (default: when as_torch and CUDA are there)
    allocates the ring page-locked through torch, so that .to("cuda",
    non_blocking=True) copies without staging; a buffer then goes back to
    the ring only after the CUDA work queued while it was current is done.
    """

    def __init__(self, db_dir, split="train", batch_size=256, shuffle=True,
                 drop_last=False, seed=0, workers=None, prefetch=None,
                 rank=None, world_size=None, augment=False, as_torch=False,
                 copy=False, pin_memory=None, uneven=False, crop_size=None,
                 crop_ratio=None, rrc_scale=(0.08, 1.0)):
        self.path = os.fspath(db_dir)
        if not isinstance(split, str):
            raise TypeError("split must be a str such as \"train\", not %s %r"
                            % (type(split).__name__, split))
        self.split = split
        self.batch_size = _c_int("batch_size", batch_size, 1)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.uneven = bool(uneven)
        self.seed = _u64("seed", seed)
        self.workers = (_default_workers() if workers is None else
                        _c_int("workers", workers, 0, _stoke.MAX_WORKERS))
        self.rank, self.world_size = _world(rank, world_size)
        kinds = {False: "none", None: "none", True: "crop", "none": "none",
                 "crop": "crop", "rrc": "rrc"}
        if not isinstance(augment, (bool, str, type(None))) or augment not in kinds:
            raise _arg_error("augment must be False, True, \"crop\" or "
                             "\"rrc\", not %r" % (augment,))
        self.augment = kinds[augment]
        # None is the default; 0 would mean it too in C, so it is refused
        self.crop_size = (0 if crop_size is None else
                          _c_int("crop_size", crop_size, 1))
        self.crop_ratio = 0.0 if crop_ratio is None else _real(
            "crop_ratio", crop_ratio)
        if crop_ratio is not None and not 0 < self.crop_ratio <= 1:
            raise _arg_error("crop_ratio must be in (0, 1] (torchvision's "
                             "224/256 is 0.875), not %r" % (crop_ratio,))
        try:
            lo, hi = rrc_scale
        except (TypeError, ValueError):
            raise TypeError("rrc_scale must be a pair (lo, hi) of numbers, "
                            "not %r" % (rrc_scale,)) from None
        self.rrc_scale = (_real("rrc_scale[0]", lo), _real("rrc_scale[1]", hi))
        self.as_torch = bool(as_torch)
        self.copy = bool(copy)
        if prefetch is None:
            prefetch = max(4, 2 * self.workers)
        # the C loader's 0 means its default; with 1 buffer, a `for`
        # holding its batch could never take the next
        self.prefetch = _c_int("prefetch", prefetch, 2, 1024,
                               " (a loop holds one batch while the next loads)")
        if self.world_size < 1:  # the C loader's 0 means 1
            raise _arg_error("world_size must be >= 1, not %d"
                             % self.world_size)
        self._torch = None
        if self.as_torch:
            import torch
            self._torch = torch
        if pin_memory is None:
            pin_memory = bool(self._torch is not None
                              and self._torch.cuda.is_available())
        self.pin_memory = bool(pin_memory)
        if self.pin_memory and (self._torch is None
                                or not self._torch.cuda.is_available()):
            raise _arg_error("pin_memory needs as_torch=True and PyTorch "
                             "with CUDA")
        self._epoch, self._batch = 0, 0  # the next batch an iteration takes
        self._inflight = collections.deque()  # (batch, CUDA event)
        self._pending = None  # the pinned batch the loop holds now
        self._live = None  # the running iteration's token (one at a time)
        self._live_pid = None  # (its epoch is self._epoch until it ends)
        self._ring = None
        self._open_ring()  # the store is opened (and checked) once, here
        self._np = _numpy()  # while the workers fill the first batches
        info = self._ring.info()
        self.shape, self._len = tuple(info["shape"]), info["batches"]

    # -- the ring --
    def _open_ring(self):
        self._close_ring()
        self._inflight.clear()
        self._ring = _stoke.Ring(
            self.path, self.split, self.batch_size, shuffle=self.shuffle,
            drop_last=self.drop_last, seed=self.seed, workers=self.workers,
            prefetch=self.prefetch, rank=self.rank, world=self.world_size,
            start_epoch=self._epoch, start_batch=self._batch,
            uneven=self.uneven,
            pad=-1 if self.augment == "crop" else 0,  # -1: H // 8
            flip=self.augment == "crop",
            transform="rrc" if self.augment == "rrc" else "none",
            crop_size=self.crop_size, crop_ratio=self.crop_ratio,
            scale_lo=self.rrc_scale[0], scale_hi=self.rrc_scale[1],
            alloc=_pinned_alloc(self._torch) if self.pin_memory else None,
            # the pinned ring's batches go to the GPU's copy engine, which
            # reads lines still dirty in a worker's cache slowly; a copy
            # (copy=True) reads them on the CPU, from the cache
            stream_stores=self.pin_memory and not self.copy)
        self._ring_at = (self._epoch, self._batch)
        self._ring_pid = os.getpid()

    def _close_ring(self):
        if self._ring is not None:
            self._ring.close()  # the workers first: nothing refills now
            if self._pending is not None:
                self._retire(self._pending)
                self._pending = None
            for _, ev in self._inflight:  # copies still reading buffers
                ev.synchronize()
            self._inflight.clear()
            self._ring = None

    def _retire(self, batch):
        """Keeps a pinned batch's buffer until the CUDA work queued so far
        (its copy to the GPU among it) is done."""
        ev = self._torch.cuda.Event()
        ev.record()
        self._inflight.append((batch, ev))
        while self._inflight and (len(self._inflight) > self.prefetch
                                  or self._inflight[0][1].query()):
            self._inflight.popleft()[1].synchronize()

    def _convert(self, raw):
        batch, labels, indices, _, _ = raw
        np = self._np
        images = np.frombuffer(batch, dtype=np.uint8).reshape(
            (len(labels) // 4,) + self.shape)
        labels = np.frombuffer(labels, dtype=np.int32)
        if self.copy:
            images = images.copy()
        if self._torch is None:  # the labels' bytes are read-only: a copy
            return images, labels.copy()
        return (self._torch.from_numpy(images),
                self._torch.from_numpy(labels.astype(np.int64)))

    # -- iteration --
    def _next(self, epoch, token):
        """The iteration's next batch, converted; _EpochEnd at the end;
        _Ended when close() in another thread ended the iteration while it
        waited in the ring or as the ring handed the batch over (its
        position is not ours then)."""
        if self._pending is not None:  # the loop is back: its copy of the
            self._retire(self._pending)  # last pinned batch is queued
            self._pending = None
        try:
            raw = self._ring.next()
        except (Error, AttributeError):  # the ring closed under it (None)
            if self._live is not token:
                raise _Ended from None
            raise
        if self._live is not token:
            raise _Ended
        if raw is None:
            raise _EpochEnd
        self._batch = raw[4] + 1
        self._ring_at = (epoch, self._batch)
        if self.pin_memory and not self.copy:
            self._pending = raw[0]
        return self._convert(raw)

    def __iter__(self):
        # One iteration at a time: one that starts while another is still
        # running (an iterator kept suspended, a nested loop) ends that one
        # as a `break` would, and runs the next epoch; the old iterator
        # then raises instead of taking every other batch from the ring.
        # (A forked child's copy of the parent's iteration is not its own.)
        token = object()
        self._end_live(next_epoch=True)  # even if the ring fails to open
        # a forked child gets a ring of its own (the workers are the
        # parent's threads), as Database reopens LMDB there
        if (self._ring is None or self._ring_pid != os.getpid()
                or self._ring_at != (self._epoch, self._batch)):
            self._open_ring()
        self._live, self._live_pid = token, os.getpid()
        epoch = self._epoch
        done = False
        try:
            while True:
                # no local keeps the batch: a generator left suspended (a
                # peek with next(it)) must not hold a ring buffer
                yield self._take(token, epoch)
        except _EpochEnd:
            done = True
        except KeyboardInterrupt:
            self._close_ring()  # stops the workers
            raise
        finally:
            if self._live is token:
                self._live = None
                # the next iteration is the next epoch, whether this one ran
                # to its end or the loop left it (break): DataLoader's
                # behaviour
                self._epoch, self._batch = epoch + 1, 0
                # a loop left early may still hold its last batch (the loop
                # variable), whose buffer this ring would need back:
                # whatever comes next (load_state_dict to here too) gets a
                # new ring
                self._ring_at = (epoch + 1, 0) if done else None

    def __len__(self):
        """Batches per epoch for this rank."""
        return self._len

    def _take(self, token, epoch):
        """The next batch of the iteration `token`, which raises once
        another iteration, set_epoch(), load_state_dict() or close() has
        ended it (also while it waited in the ring: close() from another
        thread)."""
        try:
            if self._live is not token:
                raise _Ended
            return self._next(epoch, token)
        except _Ended:
            raise RuntimeError(
                "stoke.Loader: this iteration (epoch %d) was ended by a newer "
                "iteration, set_epoch(), load_state_dict() or close() on the "
                "same loader; a loader runs one iteration at a time: make a "
                "second Loader for two at once" % epoch) from None

    def _end_live(self, next_epoch=False):
        """Ends a running iteration (its iterator raises if used again);
        next_epoch: as a break would, so the next iteration runs the next
        epoch (a forked child's copy of its parent's iteration is not its
        own: it moves nothing)."""
        if self._live is not None:
            if next_epoch and self._live_pid == os.getpid():
                self._epoch, self._batch = self._epoch + 1, 0
            self._live, self._ring_at = None, None

    def set_epoch(self, epoch):
        """Makes the next iteration epoch `epoch` (from its first batch); an
        iteration still running ends."""
        epoch = _u64("epoch", epoch)
        self._end_live()
        self._epoch, self._batch = epoch, 0

    @property
    def epoch(self):
        """The epoch the next iteration runs."""
        return self._epoch

    def state_dict(self):
        """Where the loader stands: inside an iteration, the batch after the
        last one taken; load_state_dict() on a loader with the same data
        settings continues from exactly there."""
        return {"epoch": self._epoch, "batch": self._batch,
                "seed": self.seed, "batch_size": self.batch_size,
                "shuffle": self.shuffle, "drop_last": self.drop_last,
                "rank": self.rank, "world_size": self.world_size,
                "uneven": self.uneven, "split": self.split,
                "batches": self._len}

    def load_state_dict(self, state):
        """The next iteration continues from state (see state_dict)."""
        if not isinstance(state, collections.abc.Mapping):
            raise TypeError("state_dict must be a dict (Loader.state_dict()), "
                            "not %s" % type(state).__name__)
        mine = self.state_dict()
        for k in ("seed", "batch_size", "shuffle", "drop_last", "rank",
                  "world_size", "uneven", "split", "batches"):
            if k in state and state[k] != mine[k]:
                raise _arg_error(
                    "state_dict: %s is %r, this loader's is %r: the batches "
                    "would not continue the saved run" % (k, state[k], mine[k]))
        for k in ("epoch", "batch"):
            if k not in state:
                raise _arg_error("state_dict: no %r (Loader.state_dict() has "
                                 "it)" % k)
        epoch = _u64("state_dict: epoch", state["epoch"])
        batch = _integer("state_dict: batch", state["batch"])
        if not 0 <= batch <= self._len:
            raise _arg_error("state_dict: batch %d of an epoch of %d"
                             % (batch, self._len))
        if batch == self._len:
            epoch, batch = epoch + 1, 0
        self._end_live()
        self._epoch, self._batch = epoch, batch

    @property
    def stats(self):
        """samples/s, stall (the share of time the loop waited for a batch),
        the time to the first batch, each worker's busy seconds and the
        times the loop woke idle workers (wakes), since the ring was
        opened."""
        if self._ring is None:
            return {}
        return self._ring.stats()

    def close(self):
        """Stops the workers; the ring's memory goes once no batch view is
        left. A running iteration ends as a break would (its iterator
        raises if used again); iterating again reopens the ring for the
        next epoch."""
        self._end_live(next_epoch=True)
        self._close_ring()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self._close_ring()
        except Exception:
            pass


def _progress_bar(stream):
    last = [0.0]

    def show(split, done, total, skipped, seconds):
        if seconds - last[0] < 0.1 and done < total:
            return
        last[0] = seconds
        width = 30
        filled = int(width * done / total) if total else width
        rate = done / seconds if seconds > 0 else 0
        stream.write("\rprep: [%s%s] %d/%d %s %.0f samples/s%s" % (
            "#" * filled, "." * (width - filled), done, total, split, rate,
            " (%d skipped)" % skipped if skipped else ""))
        stream.flush()
    return show


def _created():
    import datetime  # here: 'import stoke' stays quick
    sde = os.environ.get("SOURCE_DATE_EPOCH")
    t = (datetime.datetime.fromtimestamp(int(sde), datetime.timezone.utc)
         if sde and sde.isdigit() else datetime.datetime.now(datetime.timezone.utc))
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def prep(raw_dir, db_dir, workers=None, size=None, channels=None,
         format="auto", force=False, skip_bad=False, progress=None,
         short_side=None, max_side=None, upscale=False, encode="raw",
         quality=None, holdout=None, holdout_seed=0):
    """Converts a raw dataset (IDX, CIFAR binaries, or a folder of images
    with one sub-folder per class) into a stoke database at db_dir, as the
    prep command does, with the same guarantees: db_dir is complete or left
    as it was. workers: decoding threads (default: one per CPU); size: the
    output side for folders (default 64); channels: 1 or 3 (default: the
    source's). short_side, max_side, upscale: keep each image's aspect ratio
    (prep --short-side/--max-side/--upscale, folders only, not with size);
    encode: "raw" or "jpeg", quality: JPEG quality 1..100 (default 90).
    holdout: a fraction (e.g. 0.1) of each class of a folder
    without split folders kept apart as the "test" split, chosen from each
    file's relative path and holdout_seed (the same files on any machine).
    progress: None draws a bar on a terminal, False nothing, or
    a callable(split, done, total, skipped, seconds). Returns a summary.
    """
    if workers is None:
        try:
            workers = len(os.sched_getaffinity(0))
        except AttributeError:
            workers = os.cpu_count() or 1

    def count(name, v):  # None: the default, which C takes as 0
        return 0 if v is None else _c_int(name, v)
    if progress is None:
        progress = _progress_bar(sys.stderr) if sys.stderr.isatty() else False
    summary = _stoke.prep(
        os.fspath(raw_dir), os.fspath(db_dir), workers=count("workers", workers),
        size=count("size", size), channels=count("channels", channels),
        format=format, force=bool(force), skip_bad=bool(skip_bad),
        created=_created(), progress=progress or None,
        short_side=count("short_side", short_side),
        max_side=count("max_side", max_side), upscale=bool(upscale),
        encode=encode, quality=count("quality", quality),
        holdout=0.0 if holdout is None else _real("holdout", holdout),
        holdout_seed=_u64("holdout_seed", holdout_seed))
    if progress and getattr(progress, "__name__", "") == "show":
        sys.stderr.write("\n")
    if summary["warning"]:
        import warnings
        warnings.warn("stoke.prep: " + summary["warning"], stacklevel=2)
    return summary
