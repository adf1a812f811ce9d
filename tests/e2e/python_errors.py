#!/usr/bin/env python3
"""Bad input to the Python package (issue 16) raises a stoke.Error of the
right kind (DatabaseError, an OSError, for a missing, foreign or damaged
database; ArgumentError, a ValueError, for a bad argument) whose message
names the problem, never a crash: a missing database directory, a directory
that is not a database, a split that does not exist, batch_size 0, workers
out of range, rank >= world_size, an argument of the wrong type (a
TypeError naming it, never a silent int() of 1.5 or "256"), a record damaged in data.mdb (its size
field, its label: the error names the split and the key, iterating and
indexing), a state_dict of another configuration, a batch made by calling
the extension's batch type. No loader thread is left behind by a refusal."""
import os
import re
import shutil
import struct

import stoke_py as s
from stoke_py import check, np, raises, stoke

A, D = stoke.ArgumentError, stoke.DatabaseError


def damage(src, dst, key, offset, value, split_images):
    """A copy of database src whose record `key` (of the train split) has the
    4 bytes at offset (0 the label, 4 the size field) of its value replaced
    in data.mdb itself, found by its bytes."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "data.mdb")
    data = bytearray(open(path, "rb").read())
    image, label = split_images
    rec = struct.pack("<iI", label, image.size) + image.tobytes()
    at = data.find(rec)
    check(at >= 0 and data.find(rec, at + 1) < 0, "record %d not found once" % key)
    data[at + offset:at + offset + 4] = struct.pack("<I", value)
    open(path, "wb").write(bytes(data))


def iterate(db, **kw):
    for _ in stoke.Loader(db, **kw):
        pass


def main():
    s.scratch()
    base = s.threads()
    db, _ = s.fashion_db("fm", n=2000, ntest=500)

    # databases that are not there or not stoke's
    for e in (raises(D, "no-such-dir", stoke.open, "no-such-dir"),
              raises(D, "no-such-dir", stoke.Loader, "no-such-dir"),
              raises(D, "no-such-dir", iterate, "no-such-dir")):
        check(isinstance(e, OSError) and e.code == "STK_ENOENT", "%r %s" % (e, e.code))
    os.mkdir("empty")
    raises(D, "empty", stoke.open, "empty")
    os.mkdir("junk")
    open("junk/data.mdb", "wb").write(os.urandom(3 * 4096))
    raises(D, "junk", stoke.open, "junk")
    raises(D, "junk", stoke.Loader, "junk")
    open("afile", "w").write("x")
    raises(D, "afile", stoke.open, "afile")

    # arguments
    d = stoke.open(db)
    e = raises(A, r'no split "val" \(it has "train", "test"\)', d.__getitem__, "val")
    check(isinstance(e, ValueError), "ArgumentError is not a ValueError")
    raises(A, r'split "val"', stoke.Loader, db, split="val")
    raises(A, "batch_size", stoke.Loader, db, batch_size=0)
    raises(A, "batch", stoke.Loader, db, batch_size=-3)
    raises(A, "workers must be 0..64, not -1", stoke.Loader, db, workers=-1)
    raises(A, "workers", stoke.Loader, db, workers=stoke._stoke.MAX_WORKERS + 1)
    raises(A, "prefetch must be 2..1024, not 0", stoke.Loader, db, prefetch=0)
    raises(A, "prefetch must be 2..1024, not 1 ", stoke.Loader, db, prefetch=1)
    raises(A, "prefetch must be 2..1024, not 1025", stoke.Loader, db, prefetch=1025)
    raises(A, "rank 2 .*2", stoke.Loader, db, rank=2, world_size=2)
    raises(A, "rank", stoke.Loader, db, rank=-1, world_size=2)
    raises(A, "world_size must be >= 1, not 0", stoke.Loader, db, rank=0, world_size=0)
    raises(A, r"batch_size must be >= 1, not 1099511627776", stoke.Loader, db,
           batch_size=1 << 40)
    raises(A, r"crop_size must be >= 1, not 0", stoke.Loader, db, crop_size=0)
    raises(A, r"crop_ratio must be in \(0, 1\] .*, not -1", stoke.Loader, db,
           crop_ratio=-1)
    raises(A, "crop_ratio must be finite, not nan", stoke.Loader, db,
           crop_ratio=float("nan"))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = "x", "2"
    raises(A, "RANK='x' in the environment is not an integer", stoke.Loader, db)
    del os.environ["RANK"]
    raises(A, "WORLD_SIZE is set in the environment but RANK is not", stoke.Loader, db)
    del os.environ["WORLD_SIZE"]
    # what int() would round or parse is a TypeError naming the argument
    # (DataLoader refuses batch_size=1.5), not a silent 1
    for kw, pattern in ((dict(batch_size=1.5), "batch_size must be an integer, not float 1.5"),
                        (dict(batch_size="256"), "batch_size must be an integer, not str"),
                        (dict(batch_size=True), "batch_size must be an integer, not bool"),
                        (dict(batch_size=None), "batch_size must be an integer, not NoneType"),
                        (dict(seed=1.5), "seed must be an integer"),
                        (dict(workers=2.7), "workers must be an integer"),
                        (dict(crop_size=0.5), "crop_size must be an integer"),
                        (dict(prefetch=4.0), "prefetch must be an integer"),
                        (dict(rank=0.0, world_size=1), "rank must be an integer"),
                        (dict(split=5), "split must be a str"),
                        (dict(crop_ratio="0.9"), "crop_ratio must be a number"),
                        (dict(augment="rrc", rrc_scale=5), r"rrc_scale must be a pair \(lo, hi\)"),
                        (dict(augment="rrc", rrc_scale=("a", 1)), r"rrc_scale\[0\] must be a number")):
        try:
            stoke.Loader(db, **kw)
            raise AssertionError("Loader(%r) was accepted" % kw)
        except TypeError as e:
            check(re.search(pattern, str(e)), "Loader(%r): %r lacks /%s/" % (kw, str(e), pattern))
    run = stoke.Loader(db, workers=1)
    for fn, arg, pattern in ((run.set_epoch, "3", "epoch must be an integer, not str"),
                             (run.set_epoch, 1.5, "epoch must be an integer, not float"),
                             (run.load_state_dict, {"epoch": 1.7, "batch": 0},
                              "state_dict: epoch must be an integer"),
                             (run.load_state_dict, [0, 1], "state_dict must be a dict")):
        try:
            fn(arg)
            raise AssertionError("%s(%r) was accepted" % (fn.__name__, arg))
        except TypeError as e:
            check(re.search(pattern, str(e)), "%s(%r): %r" % (fn.__name__, arg, str(e)))
    raises(A, "state_dict: no 'epoch'", run.load_state_dict, {"batch": 0})
    run.close()
    try:
        stoke.prep("raw", "x.db", size=1.5)
        raise AssertionError("prep(size=1.5) was accepted")
    except TypeError as e:
        check("size must be an integer" in str(e), "prep(size=1.5): %s" % e)
    print("ok: bad arguments refused; wrong types are TypeErrors naming the argument")

    torch = s.need("torch")
    if not torch.cuda.is_available():
        raises(A, "pin_memory needs as_torch=True and PyTorch with CUDA",
               stoke.Loader, db, as_torch=True, pin_memory=True)
    # the ring through a Python allocator (pin_memory's path, with
    # ordinary memory here), and an allocator that fails: its exception
    def alloc(n):
        a = np.zeros(n, np.uint8)
        return a.ctypes.data, a
    ring = stoke._stoke.Ring(db, "test", 100, shuffle=False, workers=1, alloc=alloc)
    raw = ring.next()
    first = np.frombuffer(raw[0], np.uint8).reshape(100, 1, 28, 28)
    check(all(np.array_equal(first[i], d["test"][i][0]) for i in range(100)),
          "a ring from a Python allocator")
    # a batch comes from next() only: its type (a heap type, which would
    # otherwise take object's constructor) refuses to be called
    batch_type = type(raw[0])
    try:
        batch_type()
        raise AssertionError("%s() made a batch" % batch_type.__qualname__)
    except TypeError as e:
        check("cannot create" in str(e), "%s(): %r" % (batch_type.__qualname__, e))
        print("ok: %s() refused: %s" % (batch_type.__qualname__, e))
    del raw, first
    ring.close()
    # pin_memory's path as the Loader opens it: records streamed into the
    # ring (non-temporal stores, stream_stores), the same bytes
    ring = stoke._stoke.Ring(db, "test", 100, shuffle=False, workers=2, alloc=alloc,
                             stream_stores=True)
    for k in range(5):
        raw = ring.next()
        got = np.frombuffer(raw[0], np.uint8).reshape(100, 1, 28, 28)
        check(all(np.array_equal(got[i], d["test"][100 * k + i][0]) for i in range(100)),
              "batch %d of a ring written with streaming stores" % k)
        del raw, got
    ring.close()
    def no_memory(n):
        raise RuntimeError("no pinned memory here")
    try:
        stoke._stoke.Ring(db, "test", 100, alloc=no_memory)
        raise AssertionError("a failing allocator was not reported")
    except RuntimeError as e:
        check(str(e) == "no pinned memory here", "allocator error: %r" % e)
    print("ok: a ring through a Python allocator, with and without streaming stores; "
          "its failure is its exception")

    # state_dict of another configuration
    run = stoke.Loader(db, batch_size=100, seed=3, workers=1)
    it = iter(run)
    next(it), next(it)
    state = run.state_dict()
    del it
    run.close()
    for other, what in ((dict(seed=4), "seed"), (dict(batch_size=50), "batch_size"),
                        (dict(split="test"), "split"), (dict(shuffle=False), "shuffle"),
                        (dict(rank=1, world_size=2), "rank|world_size"),
                        (dict(uneven=True), "uneven")):
        kw = dict(batch_size=100, seed=3, workers=1)
        kw.update(other)
        raises(A, "state_dict: (%s) is" % what,
               stoke.Loader(db, **kw).load_state_dict, state)
    raises(A, "state_dict: batch 99 of an epoch of 20",
           stoke.Loader(db, batch_size=100, seed=3, workers=1).load_state_dict,
           dict(state, batch=99))
    print("ok: a state_dict of another configuration is refused")

    # a damaged record: its size field, its label out of the classes
    d = stoke.open(db)
    key = 1234
    damage(db, "size", key, 4, 783, d["train"][key])
    damage(db, "label", key, 0, 77, d["train"][key])
    for bad, pattern in (
            ("size", 'split "train": key 1234: the record\'s size field says '
                     '783 pixel bytes, the metadata\'s shape needs 784'),
            ("label", 'split "train": key 1234: label 77 is not one of the database.s '
                      '10 classes')):
        raises(D, pattern, iterate, bad, batch_size=64, workers=2)
        raises(D, pattern, iterate, bad, batch_size=64, workers=1, shuffle=False,
               as_torch=True)
        raises(D, pattern, stoke.open(bad)["train"].__getitem__, key)
        check(stoke.open(bad)["train"][key - 1][1] == d["train"][key - 1][1],
              "the record before the damaged one")
        # the other split still loads
        n = sum(len(y) for _, y in stoke.Loader(bad, split="test", workers=1))
        check(n == 500, "test split of a database damaged in train: %d" % n)
    print("ok: a damaged record is named by split and key")

    # a loader that raised is kept by the exception's traceback (a cycle
    # through the frames) until the collector runs; then nothing is left
    import gc
    gc.collect()
    left = s.settle(base)
    check(left == base, "%d threads left after the refusals (%d before)" % (left, base))
    print("ok: no thread left (%d)" % left)


if __name__ == "__main__":
    main()
