#!/usr/bin/python3
"""The common Python ways of preprocessing a dataset, as peers of `prep`.

    /usr/bin/python3 bench/prep_peers.py MODE DATASET WORKERS SRC OUT

MODE     pickle  multiprocessing.Pool(WORKERS); every worker writes one pickle
                 file per sample, OUT/<split>/<index>.pkl = pickle((array, label))
         lmdb    multiprocessing.Pool(WORKERS) decodes, imap (ordered,
                 chunksize 64) hands the pickled (array, label) back to the
                 parent, which writes them to LMDB (python3-lmdb, one named
                 database per split, key = 8-digit index, default sync, one
                 commit every 10000 samples)
DATASET  idx     SRC holds the Fashion-MNIST IDX .gz files; the parent decodes
                 them with gzip + numpy; a sample is a 1x28x28 uint8 array
         folder  SRC/<class>/*.jpg, one split "train"; a sample is: PIL open,
                 convert RGB, resize shorter side to 32 (BILINEAR), centre
                 crop 32x32, numpy uint8 CHW (3x32x32)

Prints one line: "peer: mode=... dataset=... workers=N samples=N seconds=S
samples_per_s=R". The seconds are measured inside the process, from the
start of main() to the finished output; the benchmark driver times the whole
process from outside as well and uses that.
"""
import multiprocessing as mp
import os
import pickle
import sys
import time

import numpy as np

from idx import read_idx

SIZE = 32
CHUNK = 64
TXN_SAMPLES = 10000

# Set in the parent before the pool forks, inherited by the workers.
SPLITS = []     # [(split name, images array or list of paths, labels)]
OUT = None


# ----------------------------------------------------------------- datasets

def load_idx(src):
    splits = []
    for split, stem in (("train", "train"), ("test", "t10k")):
        images = read_idx(os.path.join(src, stem + "-images-idx3-ubyte.gz"))
        labels = read_idx(os.path.join(src, stem + "-labels-idx1-ubyte.gz"))
        assert len(images) == len(labels)
        splits.append((split, images, labels))
    return splits


def load_folder(src):
    classes = sorted(e.name for e in os.scandir(src)
                     if e.is_dir() and not e.name.startswith("."))
    paths, labels = [], []
    for label, c in enumerate(classes):
        d = os.path.join(src, c)
        for name in sorted(os.listdir(d)):
            if name.lower().endswith((".jpg", ".jpeg", ".png")) and not name.startswith("."):
                paths.append(os.path.join(d, name))
                labels.append(label)
    return [("train", paths, np.array(labels, dtype=np.int64))]


# ------------------------------------------------------------- one sample

def sample_idx(s, i):
    _, images, labels = SPLITS[s]
    return images[i].reshape(1, 28, 28).copy(), int(labels[i])


def sample_folder(s, i):
    from PIL import Image
    _, paths, labels = SPLITS[s]
    with Image.open(paths[i]) as im:
        im = im.convert("RGB")
        w, h = im.size
        if w <= h:
            nw, nh = SIZE, max(1, int(SIZE * h / w))
        else:
            nw, nh = max(1, int(SIZE * w / h)), SIZE
        im = im.resize((nw, nh), Image.BILINEAR)
        left = int(round((nw - SIZE) / 2.0))
        top = int(round((nh - SIZE) / 2.0))
        im = im.crop((left, top, left + SIZE, top + SIZE))
        arr = np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()
    return arr, int(labels[i])


SAMPLE = None


def encode(task):
    s, i = task
    return pickle.dumps(SAMPLE(s, i), protocol=pickle.HIGHEST_PROTOCOL)


def write_pickle(task):
    s, i = task
    with open(os.path.join(OUT, SPLITS[s][0], "%08d.pkl" % i), "wb") as f:
        pickle.dump(SAMPLE(s, i), f, protocol=pickle.HIGHEST_PROTOCOL)
    return 1


def tasks(s):
    return ((s, i) for i in range(len(SPLITS[s][2])))


# ------------------------------------------------------------------- main

def main():
    global SPLITS, OUT, SAMPLE
    if len(sys.argv) != 6 or sys.argv[1] not in ("pickle", "lmdb") or \
            sys.argv[2] not in ("idx", "folder"):
        sys.exit(__doc__)
    t0 = time.perf_counter()
    mode, dataset, workers, src, OUT = sys.argv[1], sys.argv[2], int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    if dataset == "idx":
        SPLITS, SAMPLE = load_idx(src), sample_idx
    else:
        SPLITS, SAMPLE = load_folder(src), sample_folder
    os.makedirs(OUT, exist_ok=True)
    total = 0

    ctx = mp.get_context("fork")
    if mode == "pickle":
        for split, _, _ in SPLITS:
            os.makedirs(os.path.join(OUT, split), exist_ok=True)
        with ctx.Pool(workers) as pool:
            for s in range(len(SPLITS)):
                total += sum(pool.imap_unordered(write_pickle, tasks(s), chunksize=CHUNK))
    else:
        import lmdb
        env = lmdb.open(OUT, map_size=1 << 34, max_dbs=len(SPLITS) + 1)
        with ctx.Pool(workers) as pool:
            for s, (split, _, _) in enumerate(SPLITS):
                db = env.open_db(split.encode())
                txn = env.begin(write=True, db=db)
                for i, value in enumerate(pool.imap(encode, tasks(s), chunksize=CHUNK)):
                    txn.put(b"%08d" % i, value)
                    total += 1
                    if total % TXN_SAMPLES == 0:
                        txn.commit()
                        txn = env.begin(write=True, db=db)
                txn.commit()
        env.close()
    dt = time.perf_counter() - t0
    print("peer: mode=%s dataset=%s workers=%d samples=%d seconds=%.3f samples_per_s=%.0f"
          % (mode, dataset, workers, total, dt, total / dt))


if __name__ == "__main__":
    main()
