#!/usr/bin/env python3
"""make_folder.py OUT N [SIDE] [BAD]: an image folder OUT/<class>/<i>.jpg of
N Fashion-MNIST images upscaled to SIDE (default 64) RGB JPEGs, ten classes;
BAD > 0 adds that many corrupt files (a truncated JPEG, garbage named .png)."""
import os, sys
import numpy as np
from PIL import Image
import stoke_test as t

out, n = sys.argv[1], int(sys.argv[2])
side = int(sys.argv[3]) if len(sys.argv) > 3 else 64
bad = int(sys.argv[4]) if len(sys.argv) > 4 else 0
imgs = t.read_idx(os.path.join(t.FASHION, "train-images-idx3-ubyte.gz"))
labels = t.read_idx(os.path.join(t.FASHION, "train-labels-idx1-ubyte.gz"))
for i in range(n):
    d = os.path.join(out, f"class{labels[i]}")
    os.makedirs(d, exist_ok=True)
    g = imgs[i]
    rgb = np.stack([g, 255 - g // 2, np.roll(g, 3, axis=0)], -1)
    Image.fromarray(rgb, "RGB").resize((side, side), Image.BICUBIC).save(
        os.path.join(d, f"{i:06d}.jpg"), quality=90)
for b in range(bad):
    d = os.path.join(out, "class0")
    if b % 2 == 0:
        good = open(os.path.join(d, os.listdir(d)[0]), "rb").read()
        open(os.path.join(d, f"bad{b}.jpg"), "wb").write(good[: len(good) // 2])
    else:
        open(os.path.join(d, f"bad{b}.png"), "wb").write(b"\x89PNG\r\n\x1a\n" + os.urandom(300))
