#!/usr/bin/env python3
"""Resident memory and threads of the Python package (issue 16): 200
epochs of a Loader (the test split, batches as torch tensors) leave the
resident set where it was after epoch 10; 300 loaders opened, iterated in
part and closed or dropped, and 200,000 reads of the map-style dataset,
leave it flat too; a loader's workers are threads of the process while it
runs and none is left after close(), after del, after a loop left by
break, or while a batch view outlives the loader."""
import gc
import time

import stoke_py as s
from stoke_py import check, np, stoke

torch = s.need("torch")
SLACK_KIB = 2048  # allocator noise; a leak of one batch (200 KB) per epoch is 40 MB


def epochs_flat(db, base):
    L = stoke.Loader(db, split="test", batch_size=256, seed=3, workers=2,
                     as_torch=True)
    check(s.threads() == base + 2, "2 workers: %d threads, %d before" % (s.threads(), base))
    t = time.monotonic()
    rss = {}
    total = 0
    for e in range(1, 201):
        for x, y in L:
            total += int(y.sum()) + int(x[:, 0, 14, 14].sum())
        if e in (10, 100, 200):
            gc.collect()
            rss[e] = s.rss_kib()
    took = time.monotonic() - t
    st = L.stats
    check(st["samples"] == 200 * 10000 and st["batches"] == 200 * 40 and
          isinstance(st["wakes"], int) and st["wakes"] >= 0, "stats: %r" % st)
    grow = rss[200] - rss[10]
    check(grow < SLACK_KIB, "200 epochs: resident %d KiB after epoch 10, %d after "
          "200 (+%d KiB)" % (rss[10], rss[200], grow))
    L.close()
    left = s.settle(base)
    check(left == base, "after close(): %d threads, %d before" % (left, base))
    print("ok: 200 epochs (%.1f s, %.0f samples/s): resident %d KiB after epoch 10, "
          "%d after 100, %d after 200 (%+d KiB); no thread after close()"
          % (took, 2e6 / took, rss[10], rss[100], rss[200], grow))


def loaders_flat(db, base):
    rss = {}
    for i in range(1, 301):
        L = stoke.Loader(db, split="test", batch_size=500, seed=i, workers=2,
                         prefetch=3, augment=i % 2 == 0, as_torch=i % 3 == 0)
        for j, (x, y) in enumerate(L):
            if j == i % 5:
                break
        if i % 4 == 0:
            L.close()
        elif i % 4 == 1:
            kept = x  # a view that outlives the loader
        del L, x, y
        if i in (30, 300):
            gc.collect()
            rss[i] = s.rss_kib()
        if i % 4 == 1:
            check(s.settle(base) == base, "a view kept past del: %d threads" % s.threads())
            check(np.asarray(kept).shape[0] == 500, "the kept view")
            del kept
    grow = rss[300] - rss[30]
    check(grow < SLACK_KIB, "300 loaders: resident %d KiB after 30, %d after 300"
          % (rss[30], rss[300]))
    left = s.settle(base)
    check(left == base, "after 300 loaders: %d threads, %d before" % (left, base))
    print("ok: 300 loaders opened, left and closed or dropped: resident %d KiB "
          "after 30, %d after 300 (%+d KiB); no thread left" % (rss[30], rss[300], grow))


def dataset_flat(db):
    sp = stoke.open(db)["test"]
    rss = {}
    total = 0
    for r in range(1, 21):
        for i in range(len(sp)):
            total += sp[i][1]
        if r in (2, 20):
            gc.collect()
            rss[r] = s.rss_kib()
    grow = rss[20] - rss[2]
    check(grow < SLACK_KIB, "200,000 reads: resident %d KiB, then %d" % (rss[2], rss[20]))
    print("ok: 200,000 reads of db['test'][i]: resident %d KiB, then %d (%+d KiB)"
          % (rss[2], rss[20], grow))


def main():
    s.scratch()
    t0 = time.monotonic()
    db, _ = s.fashion_db("fm", n=1000)
    torch.zeros(1)  # torch's own threads start before the counts
    base = s.threads()
    epochs_flat(db, base)
    loaders_flat(db, base)
    dataset_flat(db)
    print("ok: python_memory in %.1f s" % (time.monotonic() - t0))


if __name__ == "__main__":
    main()
