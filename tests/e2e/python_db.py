#!/usr/bin/env python3
"""stoke.open and stoke.prep (issue 16): every record of Fashion-MNIST read
through stoke.open equals the IDX files' bytes and label, the metadata
(shape, classes, counts, per-class counts, mean and std) equals numpy's over
the IDX pixels; a split is a map-style dataset that
torch.utils.data.DataLoader reads with 2 fork workers (the LMDB environment
reopened in each) and through pickling (spawn workers), giving the images of
direct indexing; stoke.prep writes the same database as the prep command
and refuses a missing raw directory with a stoke.Error."""
import os
import pickle
import signal
import subprocess
import time
import warnings

import stoke_py as s
from stoke_py import check, np, raises, stoke

torch = s.need("torch")
# records are writable arrays of their own: torch's warning about a
# read-only one (DataLoader's collate, torch.from_numpy) fails the test
warnings.filterwarnings("error", "The given NumPy array is not writable")


def records_equal_idx(db, raw):
    """Every record of both splits against the IDX files."""
    for split in ("train", "test"):
        images, labels = s.idx(raw, split)
        sp = db[split]
        check(len(sp) == len(images), "%s: %d records, the IDX files %d"
              % (split, len(sp), len(images)))
        for i in range(len(sp)):
            image, label = sp[i]
            if label != labels[i] or not np.array_equal(image, images[i]):
                raise AssertionError("%s[%d] differs from the IDX files "
                                     "(label %d, IDX %d)" % (split, i, label, labels[i]))
        image, label = sp[-1]
        check(np.array_equal(image, images[-1]) and label == labels[-1],
              "%s[-1] is not the last record" % split)
        check(image.dtype == np.uint8 and image.shape == (1, 28, 28)
              and image.flags.c_contiguous, "%s: %s %s" % (split, image.dtype, image.shape))
        check(image.flags.writeable and image.flags.owndata is False,
              "a record's array is read-only")
        torch.from_numpy(image)  # no warning (an error here)
        image[0, 0, 0] ^= 1  # its own bytes: the next read is the stored one
        check(np.array_equal(sp[-1][0], images[-1]), "a write reached the store")
        check(type(label) is int, "label is a %s" % type(label).__name__)
        meta = db.meta["splits"][split]
        check(meta["label_counts"] == np.bincount(labels, minlength=10).tolist(),
              "%s: label_counts %s" % (split, meta["label_counts"]))
        px = images.astype(np.float64) / 255
        for got, want, what in ((sp.mean()[0], px.mean(), "mean"),
                                (sp.std()[0], px.std(), "std")):
            check(abs(got - want) < 1e-6, "%s %s: %r, numpy %r" % (split, what, got, want))
        print("ok: %s: %d records equal the IDX bytes and labels; mean %.6f "
              "std %.6f as numpy's" % (split, len(sp), sp.mean()[0], sp.std()[0]))
    for i in (len(db["test"]), -len(db["test"]) - 1):
        try:
            db["test"][i]
            raise AssertionError("index %d did not raise" % i)
        except IndexError as e:
            check(str(e).endswith("not index %d" % i), "message: %s" % e)
            print("ok: IndexError:", e)
    try:
        db["test"]["3"]
        raise AssertionError("a string index did not raise")
    except TypeError as e:
        print("ok: TypeError:", e)


def metadata(db):
    check(db.shape == (1, 28, 28), "shape %r" % (db.shape,))
    check(db.classes == ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"],
          "classes %r" % db.classes)
    check(db.num_classes == 10 and db.splits == ["train", "test"]
          and db.counts() == {"train": 60000, "test": 10000} and len(db) == 2
          and "test" in db and "val" not in db, repr(db))
    check(db.mean() == db["train"].mean() and db.std("test") == db["test"].std(),
          "Database.mean/std against Split's")
    print("ok: metadata:", db)


def dataloader_fork(db):
    """DataLoader(db["test"], num_workers=2), fork: the same images and labels
    as direct indexing, in a shuffled order of our own."""
    sp = db["test"]
    want = np.stack([sp[i][0] for i in range(len(sp))])
    want_y = np.array([sp[i][1] for i in range(len(sp))])
    order = np.random.default_rng(5).permutation(len(sp)).tolist()
    for epoch in range(2):  # the workers come back for a second epoch
        dl = torch.utils.data.DataLoader(sp, batch_size=250, num_workers=2,
                                         sampler=order,
                                         multiprocessing_context="fork")
        got = [(x.numpy(), y.numpy()) for x, y in dl]
        x = np.concatenate([g[0] for g in got])
        y = np.concatenate([g[1] for g in got])
        check(x.shape == (len(sp), 1, 28, 28) and x.dtype == np.uint8,
              "DataLoader batch %s %s" % (x.shape, x.dtype))
        check(np.array_equal(x, want[order]) and np.array_equal(y, want_y[order]),
              "DataLoader (fork, 2 workers) images differ from direct indexing")
    print("ok: DataLoader(db['test'], num_workers=2) (fork): %d samples equal "
          "direct indexing, 2 epochs" % len(sp))


def dataloader_spawn(db):
    """A split pickles by path (spawn workers open the database anew)."""
    sp = db["test"]
    back = pickle.loads(pickle.dumps(sp))
    check(len(back) == len(sp) and back.name == "test", repr(back))
    for i in (0, 4321, len(sp) - 1):
        check(np.array_equal(back[i][0], sp[i][0]) and back[i][1] == sp[i][1],
              "unpickled split differs at %d" % i)
    dbb = pickle.loads(pickle.dumps(db))
    check(dbb.counts() == db.counts() and dbb.path == db.path, repr(dbb))
    dl = torch.utils.data.DataLoader(sp, batch_size=500, num_workers=2,
                                     sampler=range(3000),
                                     multiprocessing_context="spawn")
    x = np.concatenate([x.numpy() for x, _ in dl])
    want = np.stack([sp[i][0] for i in range(3000)])
    check(np.array_equal(x, want), "DataLoader (spawn) images differ")
    print("ok: a pickled split reads the same records; DataLoader (spawn, 2 "
          "workers) too")


def prep_from_python(raw, db_cmd):
    """stoke.prep on a subset against the prep command on the same files."""
    sub, _ = s.fashion_db("cmd", n=3000, ntest=1000)
    calls, blocked = [], []

    def progress(*a):  # and the signals blocked where it runs (SigBlk)
        calls.append(a)
        with open("/proc/thread-self/status") as f:
            blocked.append(int(next(l for l in f if l.startswith("SigBlk:")).split()[1], 16))
    summary = stoke.prep("cmd-raw", "py", workers=2, progress=progress)
    check(summary["splits"] == {"train": {"count": 3000, "skipped": 0},
                                "test": {"count": 1000, "skipped": 0}}
          and summary["shape"] == (1, 28, 28), "summary %r" % summary)
    done = [c[1] for c in calls]
    check(calls and calls[-1][1:3] == (4000, 4000) and done == sorted(done)
          and {c[0] for c in calls} == {"train", "test"},
          "progress calls %r" % calls[-3:])
    stop = sum(1 << (n - 1) for n in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM))
    check(not any(b & stop for b in blocked), "the progress callback ran with "
          "stop signals blocked (SigBlk %s): what it starts would ignore Ctrl-C"
          % sorted({hex(b) for b in blocked}))
    a, b = stoke.open("cmd"), stoke.open("py")
    ma = {k: v for k, v in a.meta.items() if k not in ("path", "created")}
    mb = {k: v for k, v in b.meta.items() if k not in ("path", "created")}
    check(ma == mb, "metadata differ:\n%r\n%r" % (ma, mb))
    for split in ("train", "test"):
        for i in range(len(a[split])):
            x, y = a[split][i], b[split][i]
            if y[1] != x[1] or not np.array_equal(x[0], y[0]):
                raise AssertionError("stoke.prep: %s[%d] differs from prep's" % (split, i))
    r = subprocess.run([os.path.join(os.environ["STK_BIN"], "dbinfo"), "py",
                        "--verify"], capture_output=True, text=True)
    check(r.returncode == 0 and "4000 records: ok" in r.stdout,
          "dbinfo --verify on stoke.prep's database: %s%s" % (r.stdout, r.stderr))
    print("ok: stoke.prep wrote the prep command's database (4000 records, "
          "metadata); %d progress calls" % len(calls))
    e = raises(stoke.DatabaseError, "no-such-raw", stoke.prep, "no-such-raw", "x")
    check(isinstance(e, OSError) and not os.path.exists("x"), "after a failed prep")
    raises(stoke.Error, r"py: holds a complete stoke database; pass force=True to "
           "replace it", stoke.prep, "cmd-raw", "py")  # exists, no force
    stoke.prep("cmd-raw", "py", force=True, progress=False)
    check(stoke.open("py").counts() == {"train": 3000, "test": 1000}, "force")
    print("ok: stoke.prep refuses a missing raw dir and an existing database")


# The child's progress callback says when prep is under way and holds
# prep's writer 50 ms a call (about 60 calls), so that the run lasts
# seconds on any machine (a full Fashion-MNIST prep alone took 0.4 s on a
# fast one and finished before the signal came).
PREP_CHILD = r"""
import sys, time, stoke
started = []
def slow(split, done, total, skipped, seconds):
    if not started:
        started.append(1)
        print("STARTED", flush=True)
    time.sleep(0.05)
print("READY", flush=True)
try:
    stoke.prep(sys.argv[1], sys.argv[2], workers=1, progress=slow)
    print("FINISHED")
except KeyboardInterrupt:
    print("INTERRUPTED %.6f" % time.monotonic(), flush=True)
"""


def prep_ctrl_c():
    """SIGINT during stoke.prep: KeyboardInterrupt at once, no database."""
    import signal
    import sys
    p = subprocess.Popen([sys.executable, "-c", PREP_CHILD, s.FASHION, "cut"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    check(p.stdout.readline().strip() == "READY", "the prep child did not start")
    check(p.stdout.readline().strip() == "STARTED", "the prep child's prep did not start")
    sent = time.monotonic()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    check(p.returncode == 0 and "INTERRUPTED" in out, "prep child: %s %s" % (out, err[-500:]))
    took = float(out.split()[-1]) - sent
    # prep raises once its threads have stopped and cleaned up (a chunk in
    # flight): ~50 ms here idle, 1.1 s seen under a load of 7 on 2 cores
    check(took < 3, "KeyboardInterrupt %.3f s after SIGINT" % took)
    left = [f for f in os.listdir(".") if f.startswith("cut") or f.startswith(".cut")]
    check(not left, "an interrupted prep left %s" % left)
    print("ok: Ctrl-C in stoke.prep: KeyboardInterrupt after %.0f ms, nothing left"
          % (took * 1000))


def main():
    s.scratch()
    t0 = time.monotonic()
    db_dir, raw = s.fashion_db("fm")
    db = stoke.open(db_dir)
    metadata(db)
    records_equal_idx(db, raw)
    dataloader_fork(db)
    dataloader_spawn(db)
    prep_from_python(raw, db_dir)
    prep_ctrl_c()
    db.close()
    raises(stoke.ArgumentError, "closed", db["train"].__getitem__, 0)
    print("ok: python_db in %.1f s" % (time.monotonic() - t0))


if __name__ == "__main__":
    main()
