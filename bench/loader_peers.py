#!/usr/bin/python3
"""The PyTorch DataLoader set-ups that stoke's loader is compared with
(bench/loader_bench.sh).

    /usr/bin/python3 bench/loader_peers.py make IDX_DIR WORK_DIR
    /usr/bin/python3 bench/loader_peers.py check STOKE_DB WORK_DIR
    /usr/bin/python3 bench/loader_peers.py time MODE WORKERS WORK_DIR [--batch 256] [--seed 0]

make   writes the Fashion-MNIST train split (60000 samples) twice under
       WORK_DIR, the usual "preprocess once" ways:
         peer-pkl/train/<index>.pkl   one file per sample, pickle((array, label))
         peer-lmdb/                   python3-lmdb environment, key = 8-digit
                                      ASCII index, value = pickle((array, label))
       array is numpy uint8 of shape (1, 28, 28), label a Python int. Each is
       built under a temporary name and renamed into place when complete;
       one that is already there is kept.

check  compares the train split of a stoke database (prep of the same IDX
       files) with peer-lmdb record by record, and with every 97th file of
       peer-pkl, so that every loader is timed on the same samples.

time   runs one epoch of
         DataLoader(dataset, batch_size=256, shuffle=True, num_workers=WORKERS,
                    pin_memory=True)   (persistent_workers=False, the default)
       over MODE "pickle" (__getitem__ opens and unpickles one file) or
       "lmdb" (__getitem__ does a get in a read-only transaction; the
       environment is opened lazily, in the process that first reads, with
       readonly=True, lock=False, readahead=False, meminit=False, as the
       usual advice for DataLoader workers goes). Batches are uint8 tensors
       (no float conversion: stoke delivers uint8 too). Prints one JSON line:
         first_batch_s   iter() to the first batch
         elapsed_s       iter() to the last batch of the epoch
         shutdown_s      iter() to StopIteration (includes joining workers)
         samples_per_s   samples / elapsed_s
       plus what torch did with pin_memory and any warnings it raised.
"""
import json
import os
import pickle
import shutil
import sys
import time
import warnings

import numpy as np

from idx import read_idx


# ------------------------------------------------------------------- make

def key(i):
    return b"%08d" % i


def write_pkl(samples, pkl):
    """pkl/train/<index>.pkl, one pickle((array, label)) per sample of the
    iterable samples; built under pkl.tmp and renamed into place, kept when
    pkl is already there."""
    if os.path.isdir(pkl):
        return
    t0 = time.perf_counter()
    tmp = pkl + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(os.path.join(tmp, "train"))
    n = 0
    for n, s in enumerate(samples, 1):
        with open(os.path.join(tmp, "train", "%d.pkl" % (n - 1)), "wb") as f:
            pickle.dump(s, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.rename(tmp, pkl)
    print("loader_peers: wrote %s (%d files) in %.1f s" % (pkl, n, time.perf_counter() - t0),
          file=sys.stderr)


def write_lmdb(samples, db, map_size=1 << 30):
    """A python3-lmdb environment at db: key = 8-digit ASCII index, value =
    pickle((array, label)), and b"__len__"; built and kept as write_pkl's."""
    import lmdb
    if os.path.isdir(db):
        return
    t0 = time.perf_counter()
    tmp = db + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    env = lmdb.open(tmp, map_size=map_size, subdir=True)
    n = 0
    with env.begin(write=True) as txn:
        for n, s in enumerate(samples, 1):
            txn.put(key(n - 1), pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
        txn.put(b"__len__", b"%d" % n)
    env.sync()
    env.close()
    os.rename(tmp, db)
    print("loader_peers: wrote %s (%d records) in %.1f s" % (db, n, time.perf_counter() - t0),
          file=sys.stderr)


def make(idx_dir, work):
    images = read_idx(os.path.join(idx_dir, "train-images-idx3-ubyte.gz"))
    labels = read_idx(os.path.join(idx_dir, "train-labels-idx1-ubyte.gz"))
    n = len(images)
    assert n == len(labels) == 60000, n
    samples = [(images[i].reshape(1, 28, 28).copy(), int(labels[i])) for i in range(n)]
    write_pkl(samples, os.path.join(work, "peer-pkl"))
    write_lmdb(samples, os.path.join(work, "peer-lmdb"))


def check(stoke_db, work):
    import lmdb
    a = lmdb.open(stoke_db, readonly=True, lock=False, max_dbs=64)
    b = lmdb.open(os.path.join(work, "peer-lmdb"), readonly=True, lock=False)
    n = bad = 0
    with a.begin() as ta, b.begin() as tb:
        meta = json.loads(ta.get(b"dataset", db=a.open_db(b"meta", txn=ta)))
        shape = tuple(meta["record"]["shape"])
        hdr = meta["record"]["header_bytes"]
        count = meta["splits"]["train"]["count"]
        dt = a.open_db(b"train", txn=ta)
        for i in range(count):
            rec = ta.get(i.to_bytes(8, "big"), db=dt)
            label = int.from_bytes(rec[:4], "little", signed=True)
            px = np.frombuffer(rec, dtype=np.uint8, offset=hdr).reshape(shape)
            arr, lab = pickle.loads(tb.get(key(i)))
            same = lab == label and np.array_equal(arr, px)
            if i % 97 == 0:
                with open(os.path.join(work, "peer-pkl", "train", "%d.pkl" % i), "rb") as f:
                    parr, plab = pickle.load(f)
                same = same and plab == label and np.array_equal(parr, px)
            n += 1
            bad += not same
        if int(tb.get(b"__len__")) != count:
            bad += 1
    print("check: %d train samples, %d differ between the stoke database and the peers' data"
          % (n, bad))
    return 1 if bad else 0


# ------------------------------------------------------------------- time

def datasets():
    import torch.utils.data as tud

    class PickleDataset(tud.Dataset):
        """One pickle file per sample."""

        def __init__(self, root):
            self.root = root
            self.n = len(os.listdir(root))

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            with open(os.path.join(self.root, "%d.pkl" % i), "rb") as f:
                return pickle.load(f)

    class LmdbDataset(tud.Dataset):
        """python3-lmdb, the environment opened lazily in each worker."""

        def __init__(self, path):
            import lmdb
            self.path = path
            env = lmdb.open(path, readonly=True, lock=False, readahead=False,
                            meminit=False)
            with env.begin() as txn:
                self.n = int(txn.get(b"__len__"))
            env.close()
            self.env = None

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            if self.env is None:
                import lmdb
                self.env = lmdb.open(self.path, readonly=True, lock=False,
                                     readahead=False, meminit=False)
            with self.env.begin(write=False) as txn:
                return pickle.loads(txn.get(key(i)))

    return PickleDataset, LmdbDataset


def time_one(mode, workers, work, batch, seed):
    import torch
    from torch.utils.data import DataLoader
    PickleDataset, LmdbDataset = datasets()
    if mode == "pickle":
        ds = PickleDataset(os.path.join(work, "peer-pkl", "train"))
    elif mode == "lmdb":
        ds = LmdbDataset(os.path.join(work, "peer-lmdb"))
    else:
        raise SystemExit("loader_peers: MODE is pickle or lmdb, not %r" % mode)
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers,
                            pin_memory=True)
        samples = nbatches = 0
        pinned = []
        t0 = time.perf_counter()
        it = iter(loader)
        t_first = t_last = None
        for x, y in it:
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
                pin_effective = bool(getattr(it, "_pin_memory", None))
            if x.dtype != torch.uint8 or tuple(x.shape[1:]) != (1, 28, 28) or len(y) != len(x):
                raise SystemExit("loader_peers: unexpected batch %s %s" % (x.dtype, tuple(x.shape)))
            if nbatches < 2:
                pinned.append(bool(x.is_pinned()))
            samples += len(x)
            nbatches += 1
        t_stop = time.perf_counter()
    if samples != len(ds):
        raise SystemExit("loader_peers: %d samples in the epoch, expected %d" % (samples, len(ds)))
    elapsed = t_last - t0
    print(json.dumps({
        "tool": mode, "workers": workers, "batch": batch, "samples": samples,
        "batches": nbatches, "first_batch_s": t_first - t0, "elapsed_s": elapsed,
        "shutdown_s": t_stop - t0, "samples_per_s": samples / elapsed,
        "bytes_per_s": samples * 784 / elapsed,
        "pin_memory_arg": True, "pin_memory_effective": pin_effective,
        "batch_is_pinned": any(pinned), "cuda_available": torch.cuda.is_available(),
        "warnings": sorted({"%s: %s" % (w.category.__name__, w.message) for w in caught}),
    }))


def main(argv):
    if len(argv) == 3 and argv[0] == "make":
        make(argv[1], argv[2])
        return
    if len(argv) == 3 and argv[0] == "check":
        sys.exit(check(argv[1], argv[2]))
    if len(argv) >= 4 and argv[0] == "time":
        mode, workers, work = argv[1], int(argv[2]), argv[3]
        opts = {"--batch": 256, "--seed": 0}
        rest = argv[4:]
        while rest:
            if len(rest) < 2 or rest[0] not in opts:
                raise SystemExit(__doc__)
            opts[rest[0]] = int(rest[1])
            rest = rest[2:]
        time_one(mode, workers, work, opts["--batch"], opts["--seed"])
        return
    raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
