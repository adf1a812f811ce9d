#!/usr/bin/python3
"""Make a deterministic folder of photo-sized JPEGs from real photographs.

    /usr/bin/python3 bench/make_photos.py OUT_DIR [COUNT] [--side N] [--seed S]
                                          [--quality Q] [--workers W]

Writes OUT_DIR/<class>/<index>.jpg, COUNT files (default 4000) in ten class
folders, one per real photograph shipped by Debian (python3-sklearn's and
python3-skimage's sample images): file i is class i % 10, a random crop of
that class's photograph (25-100% of its area, aspect 3:5 to 5:3) resized to
a longer side of 0.8-1.3 x N (default 500: about 500x400 on average), flipped half
the time, each channel scaled by 0.9-1.1, saved as JPEG quality Q (default
90). Every draw comes from numpy's Philox keyed by (seed, i), so the files
are the same for any worker count (bytes too, with the same PIL/libjpeg).
Built under OUT_DIR.tmp and renamed into place when complete: OUT_DIR
either holds all COUNT files or does not exist. Tests use a small one:
`make_photos.py DIR 60 --side 96`.
"""
import argparse
import multiprocessing
import os
import shutil
import sys

import numpy as np
from PIL import Image

SK = "/usr/lib/python3/dist-packages/sklearn/datasets/images"
SKI = "/usr/lib/python3/dist-packages/skimage/data"


def photo_path(name):
    """A sample photograph: Debian's python3-sklearn has china.jpg and
    flower.jpg, python3-skimage the others; STK_PHOTOS, where set, is a
    folder holding them by name (scripts/gpu_pack.sh packs one for GPU
    machines without those packages). The tests use this too."""
    folder = os.environ.get("STK_PHOTOS") or (
        SK if name in ("china.jpg", "flower.jpg") else SKI)
    return os.path.join(folder, name)


SOURCES = [  # (class folder, photograph); sorted folder order = class order
    ("0_china", photo_path("china.jpg")), ("1_flower", photo_path("flower.jpg")),
    ("2_astronaut", photo_path("astronaut.png")),
    ("3_chelsea", photo_path("chelsea.png")), ("4_coffee", photo_path("coffee.png")),
    ("5_rocket", photo_path("rocket.jpg")),
    ("6_motorcycle_left", photo_path("motorcycle_left.png")),
    ("7_motorcycle_right", photo_path("motorcycle_right.png")),
    ("8_hubble", photo_path("hubble_deep_field.jpg")),
    ("9_retina", photo_path("retina.jpg")),
]

_photos = None  # each worker's decoded sources, loaded once


def load_sources():
    missing = [p for _, p in SOURCES if not os.path.exists(p)]
    if missing:
        sys.exit(f"make_photos: missing {missing[0]}: apt-get install -y "
                 "python3-sklearn python3-skimage")
    return [Image.open(p).convert("RGB") for _, p in SOURCES]


def init_worker():
    global _photos
    _photos = load_sources()
    for im in _photos:
        im.load()


def make_one(job):
    i, out, side, seed, quality = job
    rng = np.random.Generator(np.random.Philox(key=[seed, i]))
    c = i % len(SOURCES)
    src = _photos[c]
    sw, sh = src.size
    area = sw * sh * rng.uniform(0.25, 1.0)
    aspect = np.exp(rng.uniform(np.log(3 / 5), np.log(5 / 3)))
    cw = int(min(sw, round(np.sqrt(area * aspect))))
    ch = int(min(sh, round(np.sqrt(area / aspect))))
    x, y = int(rng.integers(0, sw - cw + 1)), int(rng.integers(0, sh - ch + 1))
    long_side = side * rng.uniform(0.8, 1.3)
    scale = long_side / max(cw, ch)
    size = (max(1, round(cw * scale)), max(1, round(ch * scale)))
    im = src.resize(size, Image.BILINEAR, box=(x, y, x + cw, y + ch), reducing_gap=2.0)
    flip, gain = rng.random() < 0.5, rng.uniform(0.9, 1.1, 3)
    if flip:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    # colour shift as a per-channel table: far cheaper than float pixels
    lut = np.clip(np.arange(256) * gain[:, None] + 0.5, 0, 255).astype(np.uint8)
    im = im.point(lut.ravel().tolist())
    path = os.path.join(out, SOURCES[c][0], f"{i:06d}.jpg")
    im.save(path, quality=quality)
    return os.path.getsize(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("count", nargs="?", type=int, default=4000)
    ap.add_argument("--side", type=int, default=500, help="nominal longer side")
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.count < 1 or args.side < 8:
        sys.exit("make_photos: COUNT must be >= 1 and --side >= 8")

    out = os.path.abspath(args.out)
    if os.path.exists(out):
        sys.exit(f"make_photos: {out} exists")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, _ in SOURCES:
        os.makedirs(os.path.join(tmp, name))
    jobs = [(i, tmp, args.side, args.seed, args.quality) for i in range(args.count)]
    if args.workers > 1:
        with multiprocessing.Pool(args.workers, initializer=init_worker) as pool:
            sizes = pool.map(make_one, jobs, chunksize=32)
    else:
        init_worker()
        sizes = [make_one(j) for j in jobs]
    os.rename(tmp, out)
    print(f"make_photos: {args.count} JPEGs in {out}, {sum(sizes)} bytes "
          f"({sum(sizes) / args.count:.0f} per image)", file=sys.stderr)


if __name__ == "__main__":
    main()
