#!/usr/bin/env python3
"""An image folder of real PNG/JPEG files in many colour types and sizes
prepares correctly: labels follow the sorted class folders, samples follow
sorted paths, and pixels agree with PIL (Debian python3-pil) decoding +
torchvision-style resize/crop exactly (same fixed-point resampling)."""
import os, shutil, subprocess, sys
import numpy as np
from PIL import Image
import stoke_test as t

tmp = os.environ["STK_TMP"]
prep = os.path.join(os.environ["STK_BIN"], "prep")
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)

faces = t.fashion_images(40, seed=3)
rng = np.random.default_rng(4)


def rgb(i, w, h):
    """A colour image made from a Fashion-MNIST sample, size w x h."""
    g = faces[i % len(faces)].astype(np.float64)
    arr = np.stack([g, 255 - 0.6 * g, np.roll(g, 5, axis=1)], -1)
    arr = np.clip(arr + rng.normal(0, 8, arr.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(arr, "RGB").resize((w, h), Image.BICUBIC)


SIZES = [(64, 64), (50, 37), (37, 50), (100, 30), (24, 24), (20, 20), (33, 90)]
KINDS = ["L.png", "LA.png", "RGB.png", "RGBA.png", "P.png", "1.png",
         "I16.png", "RGB16.png", "base.jpg", "prog.jpeg", "gray.jpg", "cmyk.jpg"]


def save(im, path, kind):
    """Saves im as kind; returns the image PIL should see when reading it back
    (16-bit files: the high byte, as the 8-bit reference)."""
    if kind == "I16.png":
        a = np.asarray(im.convert("L")).astype(np.uint16) * 257 + rng.integers(0, 200, im.size[::-1])
        t.write_png16(path, a)
        return Image.fromarray((a >> 8).astype(np.uint8), "L")
    if kind == "RGB16.png":
        a = np.asarray(im).astype(np.uint16) * 257 + rng.integers(0, 200, (im.size[1], im.size[0], 3))
        t.write_png16(path, a)
        return Image.fromarray((a >> 8).astype(np.uint8), "RGB")
    mode = {"L.png": "L", "LA.png": "LA", "RGB.png": "RGB", "RGBA.png": "RGBA",
            "P.png": "P", "1.png": "1", "gray.jpg": "L", "cmyk.jpg": "CMYK"}.get(kind, "RGB")
    out = im.convert(mode) if mode != "P" else im.convert("P", palette=Image.ADAPTIVE)
    if kind == "RGBA.png" or kind == "LA.png":
        out.putalpha(Image.fromarray(rng.integers(0, 256, im.size[::-1]).astype(np.uint8)))
    opts = {"quality": 90} if path.endswith(("jpg", "jpeg")) else {}
    if kind == "prog.jpeg":
        opts["progressive"] = True
    out.save(path, **opts)
    return Image.open(path)


# RAW/<split>/<class>/...: classes "a_png", "b_jpeg", "c_nested" in train; val
# adds a class "d_val_only" to check the union of class names.
plan = []
n = 0
for split, classes in (("train", ["a_png", "b_jpeg", "c_nested"]), ("val", ["a_png", "d_val_only"])):
    for cls in classes:
        kinds = [k for k in KINDS if k.endswith("png") == (cls != "b_jpeg")] if cls != "d_val_only" else ["base.jpg", "L.png"]
        for j, kind in enumerate(kinds):
            w, h = SIZES[(n + j) % len(SIZES)]
            sub = os.path.join("raw", split, cls, "deeper" if cls == "c_nested" and j % 2 else "")
            os.makedirs(sub, exist_ok=True)
            path = os.path.join(sub, f"{n:03d}_{kind}")
            plan.append((split, cls, path, save(rgb(n, w, h), path, kind), kind))
            n += 1
open("raw/train/a_png/notes.txt", "w").write("not an image, ignored\n")

classes = sorted({p[1] for p in plan})
worst = {}
for mode, flag, size in (("RGB", "--rgb", 24), ("L", "--gray", 16)):
    db = f"db_{mode}"
    subprocess.run([prep, "--workers", "3", "--quiet", flag, "--size", str(size), "raw", db], check=True)
    r = t.formats_reader()
    env, meta = r["open_stoke"](db)
    assert meta["classes"] == classes, meta["classes"]
    assert meta["split_order"] == ["train", "val"], meta["split_order"]
    assert meta["record"]["shape"] == [len(mode), size, size], meta["record"]
    for split in ("train", "val"):
        items = sorted((p for p in plan if p[0] == split), key=lambda p: (p[1], p[2]))
        assert meta["splits"][split]["count"] == len(items), (split, len(items))
        for i, (_, cls, path, ref_im, kind) in enumerate(items):
            label, px = r["read_sample"](env, meta, split, i)
            assert classes[label] == cls, (path, classes[label], cls)
            ref = t.torchvision_fit(ref_im, size, mode)
            diff = np.abs(px.astype(int) - ref.astype(int))
            worst[(mode, kind)] = max(worst.get((mode, kind), 0), int(diff.max()))
            # Same fixed-point arithmetic as PIL: equal, not just close.
            assert diff.max() == 0, f"{path} ({mode}): max diff {diff.max()} mean {diff.mean():.3f}"
    print(f"ok: {mode} --size {size}: {n} files, all equal to PIL")
print("largest difference per colour type:", dict(sorted(worst.items())))
