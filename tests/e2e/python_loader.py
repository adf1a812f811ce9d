#!/usr/bin/env python3
"""stoke.Loader (issue 16) against the order of docs/loader.md computed
here and the IDX files' bytes: each `for` is the next epoch without
set_epoch, epochs differ, set_epoch(e) repeats epoch e, RANK/WORLD_SIZE
give the defaults; a state_dict taken mid-epoch resumes with exactly the
remaining batches, then the next epoch; batches are views that are never
overwritten while held (keeping more than prefetch raises ArgumentError
naming copy=True; copy=True keeps any number); Ctrl-C during a slow
iteration raises KeyboardInterrupt at once and leaves no thread;
augment=True is train --augment's crop with H // 8 zero padding and flip,
drawn by Philox4x32-10 per (seed, epoch, sample), checked draw by draw."""
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import stoke_py as s
from stoke_py import check, np, raises, stoke

torch = s.need("torch")


def concat(batches):
    return (np.concatenate([b[0] for b in batches]),
            np.concatenate([b[1] for b in batches]))


def same(batches, X, Y, indices, what):
    x, y = concat(batches)
    indices = np.asarray(indices)
    check(x.shape == (len(indices),) + X.shape[1:],
          "%s: %s samples, %d expected" % (what, x.shape, len(indices)))
    check(np.array_equal(y, Y[indices]), "%s: labels differ" % what)
    check(np.array_equal(x, X[indices]), "%s: images differ" % what)


def epochs(db, X, Y):
    n = len(X)
    L = stoke.Loader(db, split="test", batch_size=256, seed=11, workers=2)
    check(len(L) == 40 and L.rank == 0 and L.world_size == 1, "len %d" % len(L))
    got = s.batches_of(L, 3)
    for e in range(3):
        same(got[e], X, Y, s.shard(n, 11, e), "epoch %d" % e)
        check([len(b[1]) for b in got[e]] == [256] * 39 + [16], "batch sizes")
    orders = [tuple(s.shard(n, 11, e)) for e in range(3)]
    check(len(set(orders)) == 3, "epochs 0, 1, 2 share an order")
    check(L.epoch == 3, "after 3 loops the epoch is %d" % L.epoch)
    L.set_epoch(1)
    same(s.batches_of(L)[0], X, Y, orders[1], "set_epoch(1)")
    same(s.batches_of(L)[0], X, Y, s.shard(n, 11, 2), "the loop after set_epoch(1)")
    for i, _ in enumerate(L):  # epoch 3, left after 5 batches
        if i == 4:
            break
    check(L.epoch == 4, "a loop left by break: next epoch %d, not 4" % L.epoch)
    same(s.batches_of(L)[0], X, Y, s.shard(n, 11, 4), "epoch 4 after a break")
    L.close()
    print("ok: each for is the next epoch (orders of docs/loader.md), "
          "set_epoch repeats one, break ends one")

    # other settings: no shuffle, drop_last, inline loading, torch tensors
    L = stoke.Loader(db, split="test", batch_size=300, shuffle=False, drop_last=True,
                     workers=0)
    check(len(L) == 33, "drop_last: %d batches" % len(L))
    same(s.batches_of(L)[0], X, Y, list(range(9900)), "shuffle=False drop_last")
    T = stoke.Loader(db, split="test", batch_size=256, seed=11, workers=3,
                     as_torch=True)
    tb = [(x, y) for x, y in ((a.clone(), b) for a, b in T)]
    check(all(x.dtype == torch.uint8 and y.dtype == torch.int64
              and x.shape[1:] == (1, 28, 28) for x, y in tb), "torch dtypes")
    same([(x.numpy(), y.numpy()) for x, y in tb], X, Y, orders[0], "as_torch")
    print("ok: shuffle=False, drop_last, workers=0 and as_torch give the "
          "expected bytes")

    # RANK / WORLD_SIZE (torchrun's variables) are the defaults
    env = dict(os.environ)
    try:
        os.environ.update(RANK="1", WORLD_SIZE="2")
        L = stoke.Loader(db, split="test", batch_size=500, seed=11, workers=1)
        check((L.rank, L.world_size, len(L)) == (1, 2, 10),
              "RANK=1 WORLD_SIZE=2: rank %d of %d" % (L.rank, L.world_size))
        same(s.batches_of(L)[0], X, Y, s.shard(n, 11, 0, 1, 2), "rank 1 of 2 (env)")
        L = stoke.Loader(db, split="test", batch_size=500, seed=11, rank=0)
        check((L.rank, L.world_size) == (0, 2), "rank=0 with WORLD_SIZE=2")
    finally:
        os.environ.clear()
        os.environ.update(env)
    print("ok: RANK and WORLD_SIZE are the defaults")


def resume(db, X, Y):
    cfg = dict(split="test", batch_size=300, seed=5)
    for extra in ({}, {"augment": True}, {"drop_last": True, "as_torch": True}):
        kw = dict(cfg, **extra)
        ref = s.batches_of(stoke.Loader(db, workers=2, **kw), 3)
        for e, k in ((0, 7), (1, 1), (0, len(ref[0]))):
            run = stoke.Loader(db, workers=2, **kw)
            run.set_epoch(e)
            for i, _ in enumerate(run):
                if i + 1 == k:
                    state = run.state_dict()
                    break
            state = json.loads(json.dumps(state))  # as a checkpoint keeps it
            back = stoke.Loader(db, workers=1, prefetch=3, **kw)
            back.load_state_dict(state)
            rest = s.batches_of(back, 2)
            # after the epoch's last batch, the state is the next epoch's start
            want, nxt = ((ref[e][k:], ref[e + 1]) if k < len(ref[e])
                         else (ref[e + 1], ref[e + 2]))
            for got, exp, what in ((rest[0], want, "the rest"), (rest[1], nxt, "the next epoch")):
                check(len(got) == len(exp) and all(
                    np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
                    for a, b in zip(got, exp)),
                      "%s: resumed at epoch %d batch %d: %s differs (%d batches, %d expected)"
                      % (extra, e, k, what, len(got), len(exp)))
            run.load_state_dict(state)  # the same loader goes back too
            again = s.batches_of(run)[0]
            check(all(np.array_equal(a[0], b[0]) for a, b in zip(again, want))
                  and len(again) == len(want), "load_state_dict on the loader itself")
    # the plain run's remaining batches are the IDX records of the order
    want = s.shard(len(X), 5, 0)[7 * 300:]
    back = stoke.Loader(db, workers=1, **cfg)
    back.load_state_dict({"epoch": 0, "batch": 7})
    same(s.batches_of(back)[0], X, Y, want, "resumed epoch 0 at batch 7")
    print("ok: state_dict mid-epoch resumes with exactly the remaining "
          "batches, then the next epoch (plain, augment, drop_last + torch)")


def views(db, X, Y):
    order = s.shard(len(X), 1, 0)
    for as_torch in (False, True):
        L = stoke.Loader(db, split="test", batch_size=500, seed=1, workers=2,
                         prefetch=4, as_torch=as_torch)
        kept = []
        for x, y in L:  # every batch kept: the ring detaches their buffers
            kept.append((x, y, np.array(x), np.array(y)))
        check(len(kept) == 20, "%d batches, not 20" % len(kept))
        for i, (x, y, xc, yc) in enumerate(kept):
            check(np.array_equal(np.asarray(x), xc) and np.array_equal(np.asarray(y), yc),
                  "kept batch %d was overwritten" % i)
        same([(k[2], k[3]) for k in kept], X, Y, order, "kept batches")
        print("ok: %s: all 20 batches kept (prefetch 4) keep their bytes"
              % ("torch" if as_torch else "numpy"))
        x = kept[1][0]
        del kept
        L.close()
        gc.collect()
        check(np.array_equal(np.asarray(x), X[order[500:1000]]),
              "a batch kept past close() changed")
        del L
        gc.collect()
        junk = [np.full((500, 1, 28, 28), 255, np.uint8) for _ in range(8)]
        check(np.array_equal(np.asarray(x), X[order[500:1000]]),
              "a batch kept past the loader's end changed")
        del x, junk
    # one batch kept while the loop goes on for a whole epoch: intact,
    # and the epoch complete (its buffer detached when the ring came round)
    L = stoke.Loader(db, split="test", batch_size=250, seed=1, workers=2, prefetch=3)
    first, n = None, 0
    for i, (x, y) in enumerate(L):
        if first is None:
            first = x
        check(np.array_equal(first, X[order[:250]]), "the first batch, kept")
        n += len(y)
    check(n == len(X), "%d samples in the epoch, not %d" % (n, len(X)))
    del first, x
    same(s.batches_of(L)[0], X, Y, s.shard(len(X), 1, 1), "the next epoch")
    print("ok: a batch kept over a whole epoch is intact; the epoch goes on")
    # one iteration at a time: a loop that starts while a peek's generator
    # is alive ends that iteration (as a break would) and runs the next
    # epoch in full, past the ring's size; the peek then raises instead of
    # taking every other batch (they shared the ring before)
    L = stoke.Loader(db, split="test", batch_size=500, seed=1, workers=2, prefetch=2)
    peek = iter(L)
    next(peek)
    seen = s.batches_of(L)[0]
    same(seen, X, Y, s.shard(len(X), 1, 1), "a loop beside a live peek (epoch 1)")
    try:
        next(peek)
        check(False, "the ended peek went on")
    except RuntimeError as e:
        check("one iteration at a time" in str(e), "message: %s" % e)
    nested = [len(y) for _, y in L]  # epoch 2 runs, untouched by the peek
    check(sum(nested) == len(X), "after the ended peek: %d samples" % sum(nested))
    # a nested loop over the same loader: the inner one ends the outer
    outer = 0
    try:
        for _ in L:
            outer += 1
            for _ in L:
                pass
    except RuntimeError:
        pass
    check(outer == 1 and L.epoch == 5, "nested loops: outer ran %d batches, "
          "next epoch %d" % (outer, L.epoch))
    # set_epoch during an iteration ends it too
    it = iter(L)
    next(it)
    L.set_epoch(0)
    try:
        next(it)
        check(False, "set_epoch left the iteration running")
    except RuntimeError:
        pass
    same(s.batches_of(L)[0], X, Y, order, "set_epoch(0) after an ended iteration")
    # close() during an iteration ends it as a break would: its iterator
    # raises (not AttributeError from a ring that is gone), the next loop
    # runs the next epoch on a new ring
    it = iter(L)
    next(it)
    L.close()
    try:
        next(it)
        check(False, "close() left the iteration running")
    except RuntimeError as e:
        check("close()" in str(e), "message: %s" % e)
    check(L.epoch == 2, "after close() mid-epoch 1 the next epoch is %d" % L.epoch)
    same(s.batches_of(L)[0], X, Y, s.shard(len(X), 1, 2), "the loop after close()")
    # close() from another thread while the loop waits in the ring
    L = stoke.Loader(db, split="test", batch_size=5, seed=1, workers=1, prefetch=2)
    closer = threading.Timer(0.05, L.close)
    closer.start()
    taken = 0
    try:
        for _ in L:
            taken += 1
            time.sleep(0.001)
        check(False, "close() from another thread: the loop ended after %d" % taken)
    except RuntimeError as e:
        check("close()" in str(e), "message: %s" % e)
    closer.join()

    # the two instants a thread's close() can meet the loop, made exact: a
    # ring whose next() runs close() before it waits (the ring closes under
    # the waiting loop) or after it took a batch (as the ring hands it over)
    class CloseIn:
        def __init__(self, loader, after):
            self.loader, self.real, self.after = loader, loader._ring, after

        def next(self):
            if not self.after:
                self.loader.close()
            raw = self.real.next()
            if self.after:
                self.loader.close()
            return raw

        def __getattr__(self, name):
            return getattr(self.real, name)

    for after in (False, True):
        it = iter(L)
        next(it)
        L._ring = CloseIn(L, after)
        try:
            next(it)
            check(False, "close() %s the ring's hand-over: a batch came out"
                  % ("at" if after else "before"))
        except RuntimeError as e:
            check("close()" in str(e), "message: %s" % e)
        check(L._ring is None, "close() left a ring")
    print("ok: close() ends a running iteration (%d of 2000 batches taken), "
          "also from another thread, while it waits and as a batch is "
          "handed over" % taken)
    del peek, it
    # copy=True: keep them all
    L = stoke.Loader(db, split="test", batch_size=500, seed=1, workers=2,
                     prefetch=2, copy=True)
    kept = list(L)
    check(all(x.flags.owndata and x.flags.writeable for x, _ in kept), "copies")
    same(kept, X, Y, order, "copy=True, all batches kept")
    kept[0][0][:] = 0  # ours to write
    same(s.batches_of(L)[0], X, Y, s.shard(len(X), 1, 1), "copy=True, next epoch")
    print("ok: copy=True keeps all 20 batches of prefetch 2")


def forked(db, X, Y):
    """A loader (with a batch view held) used in a forked child: the child
    iterates a ring of its own (the workers are the parent's threads; it
    hung waiting for them), the parent's goes on untouched."""
    L = stoke.Loader(db, split="test", batch_size=500, seed=3, workers=2)
    it = iter(L)
    held, _ = next(it)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(20)  # a hang kills the child: the parent fails
            L.set_epoch(2)
            x, y = concat(s.batches_of(L)[0])
            order = s.shard(len(X), 3, 2)
            ok = np.array_equal(x, X[order]) and np.array_equal(y, Y[order])
            code = 0 if ok and np.array_equal(held, X[s.shard(len(X), 3, 0)[:500]]) else 2
            L.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    check(status == 0, "the forked child: wait status %d (2: wrong bytes, "
          "14: SIGALRM, it hung)" % status)
    check(np.array_equal(held, X[s.shard(len(X), 3, 0)[:500]]), "the parent's view")
    del held
    rest = concat([(np.array(a), np.array(b)) for a, b in it])
    want = s.shard(len(X), 3, 0)[500:]
    check(np.array_equal(rest[0], X[want]), "the parent's epoch after the fork")
    L.close()
    print("ok: a loader used in a forked child iterates a ring of its own")


CHILD = r"""
import os, sys, time
import numpy, stoke  # numpy's own (OpenBLAS) threads counted in base
base = len(os.listdir("/proc/self/task"))
L = stoke.Loader(sys.argv[1], batch_size=60000, workers=1, prefetch=2,
                 augment=True)
catch = sys.argv[2] == "catch"
print("READY", flush=True)
try:
    while True:
        for x, y in L:
            pass
except KeyboardInterrupt:
    t = time.monotonic()
    if not catch:
        raise
    # the interrupted loop closed the ring: its workers are gone
    end = time.monotonic() + 2
    while len(os.listdir("/proc/self/task")) > base and time.monotonic() < end:
        time.sleep(0.005)
    print("INTERRUPTED %.6f threads %d of %d" % (
        t, len(os.listdir("/proc/self/task")), base), flush=True)
    sum(len(y) for _, y in stoke.Loader(sys.argv[1], split="test"))
    print("AGAIN", flush=True)
"""


def ctrl_c(db):
    """SIGINT to a process waiting for a slow loader (workers=1 augmenting
    batches of 60000: 97% of its time is spent waiting for the next)."""
    for mode in ("catch", "raise", "catch", "raise"):
        p = subprocess.Popen([sys.executable, "-c", CHILD, db, mode],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        check(p.stdout.readline().strip() == "READY", "the child did not start")
        time.sleep(0.8 if mode == "catch" else 1.3)  # a few batches in
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError("SIGINT: the child hangs")
        gone = time.monotonic() - sent
        if mode == "catch":
            check(p.returncode == 0 and "AGAIN" in out, "child: %d %s %s" % (p.returncode, out, err))
            words = out.split()
            caught = float(words[words.index("INTERRUPTED") + 1]) - sent
            left, base = int(words[words.index("threads") + 1]), int(words[words.index("of") + 1])
            check(0 <= caught < 0.5, "KeyboardInterrupt %.3f s after SIGINT" % caught)
            check(left == base, "%d threads after Ctrl-C, %d before the loader" % (left, base))
            print("ok: SIGINT: KeyboardInterrupt after %.1f ms, no loader "
                  "thread left, a new loader works" % (caught * 1000))
        else:
            check(p.returncode in (-signal.SIGINT, 130) and "KeyboardInterrupt" in err,
                  "uncaught Ctrl-C: exit %d, %s" % (p.returncode, err[-300:]))
            check(gone < 1.0, "the process took %.2f s to exit after SIGINT" % gone)
            print("ok: SIGINT uncaught: exit %d after %.0f ms" % (p.returncode, gone * 1000))


def augment(db, X, Y):
    n, pad = len(X), 28 // 8
    seen = {}
    for seed, e in ((9, 0), (9, 1), (10, 0)):
        L = stoke.Loader(db, split="test", batch_size=1000, seed=seed, augment=True,
                         workers=2)
        L.set_epoch(e)
        x, y = concat(s.batches_of(L)[0])
        idx = np.array(s.shard(n, seed, e))
        check(np.array_equal(y, Y[idx]), "augment changed labels")
        dy, dx, mirror = s.aug_draws(seed, e, idx, pad)
        for i in range(n):
            want = s.crop_flip(X[idx[i]], dy[i], dx[i], mirror[i])
            if not np.array_equal(x[i], want):
                raise AssertionError(
                    "seed %d epoch %d sample %d: not its Philox draw (dy %d dx %d "
                    "flip %d)" % (seed, e, idx[i], dy[i], dx[i], mirror[i]))
        check(set(dy) == set(dx) == set(range(-pad, pad + 1))
              and 0.45 < mirror.mean() < 0.55, "draws do not cover the crops and flips")
        seen[(seed, e)] = x[np.argsort(idx)]
    # without the draws: each image is one of the 2 * 7 * 7 crops and flips
    first = seen[(9, 0)]
    for i in range(300):
        check(any(np.array_equal(first[i], s.crop_flip(X[i], a, b, m))
                  for a in range(-pad, pad + 1) for b in range(-pad, pad + 1)
                  for m in (False, True)), "sample %d is no crop/flip of its image" % i)
    for a, b in (((9, 0), (9, 1)), ((9, 0), (10, 0))):
        differ = np.mean([not np.array_equal(p, q) for p, q in zip(seen[a], seen[b])])
        check(differ > 0.9, "%s and %s: only %.2f of the images differ" % (a, b, differ))
    again = stoke.Loader(db, split="test", batch_size=700, seed=9, augment=True,
                         workers=1)
    again.set_epoch(1)
    x, _ = concat(s.batches_of(again)[0])
    check(np.array_equal(x[np.argsort(s.shard(n, 9, 1))], seen[(9, 1)]),
          "augment is not the same for the same (seed, epoch) with another batch size")
    print("ok: augment=True: every image is its Philox4x32-10 crop (pad %d) and "
          "flip, the same for (seed, epoch), different across epochs and seeds" % pad)


def main():
    s.scratch()
    t0 = time.monotonic()
    db, raw = s.fashion_db("fm")
    X, Y = s.idx(raw, "test")
    for part in (epochs, resume, views, forked, augment):
        t = time.monotonic()
        part(db, X, Y)
        print("   (%s: %.1f s)" % (part.__name__, time.monotonic() - t))
    t = time.monotonic()
    ctrl_c(db)
    print("   (ctrl_c: %.1f s)" % (time.monotonic() - t))
    print("ok: python_loader in %.1f s" % (time.monotonic() - t0))


if __name__ == "__main__":
    main()
