#!/usr/bin/python3
"""Make a deterministic image folder of JPEG files from Fashion-MNIST.

    /usr/bin/python3 bench/make_jpeg_folder.py OUT_DIR [COUNT] [--side N] [--idx-dir DIR]

Writes OUT_DIR/<class>/<index>.jpg for the first COUNT samples (default 20000)
of Fashion-MNIST (train, then test when COUNT > 60000): each 28x28 grey image
is upscaled to NxN (--side, default 64; PIL BILINEAR), converted to RGB and
saved as JPEG quality 90. Class folders are "<label>_<name>" so that their
sorted order is the label order. The folder is built under OUT_DIR.tmp and
renamed into place when complete, so OUT_DIR either holds all COUNT files or
does not exist.
"""
import argparse
import os
import shutil
import sys

import numpy as np

from idx import read_idx
from PIL import Image

CLASSES = ["0_tshirt_top", "1_trouser", "2_pullover", "3_dress", "4_coat",
           "5_sandal", "6_shirt", "7_sneaker", "8_bag", "9_ankle_boot"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("count", nargs="?", type=int, default=20000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--idx-dir", default="/usr/share/datasets/fashion-mnist")
    args = ap.parse_args()

    d = args.idx_dir
    images = np.concatenate([read_idx(os.path.join(d, "train-images-idx3-ubyte.gz")),
                             read_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz"))])
    labels = np.concatenate([read_idx(os.path.join(d, "train-labels-idx1-ubyte.gz")),
                             read_idx(os.path.join(d, "t10k-labels-idx1-ubyte.gz"))])
    if not 0 < args.count <= len(images):
        sys.exit("count must be in 1..%d" % len(images))

    out = args.out.rstrip("/")
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    for c in CLASSES:
        os.makedirs(os.path.join(tmp, c))
    for i in range(args.count):
        side = (args.side, args.side)
        img = Image.fromarray(images[i], mode="L").resize(side, Image.BILINEAR)
        img.convert("RGB").save(os.path.join(tmp, CLASSES[labels[i]], "%05d.jpg" % i),
                                "JPEG", quality=90)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    print("make_jpeg_folder: wrote %d JPEG files (%dx%d RGB, q90) to %s"
          % (args.count, args.side, args.side, out))


if __name__ == "__main__":
    main()
