#!/usr/bin/python3
"""Checks that a benchmarked tool wrote everything it was asked to.

    /usr/bin/python3 bench/check_output.py count KIND OUT
        KIND prep|pickle|lmdb. Prints "samples=N shape=CxHxW" (N summed over
        the splits) or exits non-zero when OUT is incomplete or malformed.
    /usr/bin/python3 bench/check_output.py compare PREP_DB LMDB_OUT
        Compares every sample of a prep database with the lmdb peer's output
        of the same source (labels and pixels) and prints how many differ.

Run outside the timed part of the benchmark.
"""
import json
import os
import pickle
import sys

import lmdb
import numpy as np


def named_dbs(env):
    with env.begin() as txn:
        return [k.decode() for k, _ in txn.cursor()]


def prep_splits(path):
    """Yields (split, count, first value decoded) for a prep database."""
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=64)
    with env.begin() as txn:
        meta = json.loads(txn.get(b"dataset", db=env.open_db(b"meta", txn=txn)))
        if not meta.get("complete"):
            sys.exit("%s: not marked complete" % path)
        shape = tuple(meta["record"]["shape"])
        hdr = meta["record"]["header_bytes"]
        out = []
        for split in meta["split_order"]:
            db = env.open_db(split.encode(), txn=txn)
            n = txn.stat(db)["entries"]
            if n != meta["splits"][split]["count"]:
                sys.exit("%s/%s: %d records, meta says %d"
                         % (path, split, n, meta["splits"][split]["count"]))
            first = txn.get((0).to_bytes(8, "big"), db=db)
            if len(first) != hdr + int(np.prod(shape)):
                sys.exit("%s/%s: record of %d bytes" % (path, split, len(first)))
            out.append((split, n))
    env.close()
    return out, shape


def peer_lmdb_splits(path):
    env = lmdb.open(path, readonly=True, lock=False, max_dbs=64)
    out, shape = [], None
    with env.begin() as txn:
        for split in named_dbs(env):
            db = env.open_db(split.encode(), txn=txn)
            n = txn.stat(db)["entries"]
            arr, _ = pickle.loads(txn.get(b"%08d" % 0, db=db))
            last, _ = pickle.loads(txn.get(b"%08d" % (n - 1), db=db))
            shape = arr.shape
            assert arr.dtype == np.uint8 and last.shape == shape
            out.append((split, n))
    env.close()
    return out, shape


def peer_pickle_splits(path):
    out, shape = [], None
    for split in sorted(os.listdir(path)):
        names = [n for n in os.listdir(os.path.join(path, split)) if n.endswith(".pkl")]
        for name in (min(names), max(names)):
            with open(os.path.join(path, split, name), "rb") as f:
                arr, _ = pickle.load(f)
            assert arr.dtype == np.uint8 and (shape is None or arr.shape == shape)
            shape = arr.shape
        out.append((split, len(names)))
    return out, shape


def compare(prep_db, peer_db):
    a = lmdb.open(prep_db, readonly=True, lock=False, max_dbs=64)
    b = lmdb.open(peer_db, readonly=True, lock=False, max_dbs=64)
    total = bad_label = bad_px = 0
    max_diff = 0
    with a.begin() as ta, b.begin() as tb:
        meta = json.loads(ta.get(b"dataset", db=a.open_db(b"meta", txn=ta)))
        shape = tuple(meta["record"]["shape"])
        hdr = meta["record"]["header_bytes"]
        for split in meta["split_order"]:
            da, db = a.open_db(split.encode(), txn=ta), b.open_db(split.encode(), txn=tb)
            for i in range(meta["splits"][split]["count"]):
                rec = ta.get(i.to_bytes(8, "big"), db=da)
                label = int.from_bytes(rec[:4], "little", signed=True)
                px = np.frombuffer(rec, dtype=np.uint8, offset=hdr).reshape(shape)
                arr, lab = pickle.loads(tb.get(b"%08d" % i, db=db))
                total += 1
                bad_label += lab != label
                if not np.array_equal(arr, px):
                    bad_px += 1
                    max_diff = max(max_diff, int(np.abs(arr.astype(int) - px).max()))
    print("compare: %d samples, %d labels differ, %d images differ (max |diff| %d)"
          % (total, bad_label, bad_px, max_diff))
    return 0 if bad_label == 0 and bad_px == 0 else 1


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "count":
        kind, path = sys.argv[2], sys.argv[3]
        splits, shape = {"prep": prep_splits, "lmdb": peer_lmdb_splits,
                         "pickle": peer_pickle_splits}[kind](path)
        print("samples=%d shape=%s splits=%s" % (
            sum(n for _, n in splits), "x".join(map(str, shape)),
            ",".join("%s:%d" % s for s in splits)))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "compare":
        return compare(sys.argv[2], sys.argv[3])
    sys.exit(__doc__)


if __name__ == "__main__":
    sys.exit(main())
