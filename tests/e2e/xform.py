#!/usr/bin/env python3
"""The C transforms (preprocess/transform.c, through tests/tools/xform_tool)
against torchvision 0.14 and PIL: RandomResizedCrop's box from torchvision's
own get_params with its draws patched to given uniforms (fallbacks too), the
resized crop's pixels (F.resized_crop on a PIL image), the flip, Resize +
CenterCrop, and JPEG decoding against PIL's."""
import io, os, shutil, subprocess, sys
from unittest import mock
import numpy as np
import torch
from PIL import Image
import torchvision.transforms as T
import torchvision.transforms.functional as F

tmp = os.environ["STK_TMP"]
tool = os.path.join(os.environ["STK_BIN"], "xform_tool")
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
rng = np.random.default_rng(17)
fails = 0


def check(ok, what):
    global fails
    if not ok:
        fails += 1
        print("FAIL:", what)


def tv_box(h, w, scale, ratio, u):
    """torchvision's RandomResizedCrop.get_params, its draws patched to
    consume u in order: uniform_(a, b) = a + u (b - a), randint = floor(u n)."""
    it = iter(u)
    used = [0]

    class Draw:
        def uniform_(self, a, b):
            used[0] += 1
            return torch.tensor(float(a) + next(it) * (float(b) - float(a)),
                                dtype=torch.float64)

    def randint(lo, hi, size):
        used[0] += 1
        return torch.tensor([lo + int(np.floor(next(it) * (hi - lo)))])

    img = torch.empty(3, h, w)
    with mock.patch("torch.empty", lambda *a, **k: Draw()), \
            mock.patch("torch.randint", randint):
        i, j, bh, bw = T.RandomResizedCrop.get_params(img, scale, ratio)
    return used[0], i, j, bh, bw


# ---- the box -------------------------------------------------------------
cases, want = [], []
for n in range(3000):
    h, w = (int(v) for v in rng.integers(1, 700, 2))
    if n % 5 == 0:  # thin images and wide scales exercise the fallbacks
        h, w = (int(h), 1 + int(w) % 6) if n % 2 else (1 + int(h) % 6, int(w))
    scale = (0.08, 1.0) if n % 3 else (float(rng.uniform(0.01, 0.5)),
                                        float(rng.uniform(0.5, 1.0)))
    ratio = (3 / 4, 4 / 3) if n % 4 else (float(rng.uniform(0.2, 1)),
                                           float(rng.uniform(1, 5)))
    u = rng.random(22)
    u[rng.random(22) < 0.05] = 0.0  # edges of the draws
    cases.append(" ".join(map(repr, [h, w, *scale, *ratio, *u.tolist()])))
    want.append(tv_box(h, w, scale, ratio, u.tolist()))
out = subprocess.run([tool, "box"], input="\n".join(cases) + "\n",
                     capture_output=True, text=True, check=True).stdout
got = [tuple(map(int, line.split())) for line in out.splitlines()]
check(len(got) == len(want), f"box: {len(got)} answers for {len(want)} cases")
bad = [(c, g, w_) for c, g, w_ in zip(cases, got, want) if g != w_]
check(not bad, f"box: {len(bad)} of {len(want)} differ, first {bad[:2]}")
fallbacks = sum(1 for g in want if g[0] == 20)
check(fallbacks > 50, f"box: only {fallbacks} fallback cases exercised")
print(f"box: {len(want)} cases ({fallbacks} fallbacks) equal get_params")


# ---- pixels --------------------------------------------------------------
def image(w, h, mode):
    """Smooth gradients plus noise, so resampling errors show."""
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255.0 / w, y * 255.0 / h, (x + y) % 64 * 4.0], -1)
    a = np.clip(a + rng.normal(0, 20, a.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(a, "RGB").convert(mode)


def run(args):
    return subprocess.run([tool, *args], capture_output=True,
                          check=True).stdout


def chw(pil, c):
    a = np.asarray(pil.convert("RGB" if c == 3 else "L"))
    return a.reshape(a.shape[0], a.shape[1], c).transpose(2, 0, 1)


worst = 0
for n in range(40):
    w, h = (int(v) for v in rng.integers(8, 520, 2))
    mode = "RGB" if n % 4 else "L"
    src = image(w, h, mode)
    path = os.path.join(tmp, f"im{n}.png")
    src.save(path)
    size = int(rng.choice([7, 32, 64, 224]))
    u = rng.random(22).tolist()
    _, top, left, bh, bw = tv_box(h, w, (0.08, 1.0), (3 / 4, 4 / 3), u)
    flip = n % 2
    out_c = 3 if n % 8 else 1
    ref = F.resized_crop(src, top, left, bh, bw, [size, size],
                         T.InterpolationMode.BILINEAR)
    if flip:
        ref = F.hflip(ref)
    ref = chw(ref, out_c).astype(int)
    for layout in ("hwc", "chw"):
        got = np.frombuffer(run(["crop", path, layout, *map(str, [
            top, left, bh, bw, size, flip, out_c])]), np.uint8)
        got = got.reshape(out_c, size, size).astype(int)
        d = int(np.abs(got - ref).max())
        worst = max(worst, d)
        check(d <= 1, f"crop {w}x{h} {mode} box {top},{left},{bh}x{bw} -> "
                      f"{size} flip {flip} {layout}: differs by {d}")
    # eval: Resize(R) + CenterCrop(S)
    s = int(rng.choice([16, 32, 224]))
    r = int(s / 0.875) if n % 3 else s + int(rng.integers(0, 40))
    ref = chw(T.CenterCrop(s)(T.Resize(r)(src)), out_c).astype(int)
    got = np.frombuffer(run(["centre", path, "chw" if n % 2 else "hwc",
                             str(r), str(s), str(out_c)]), np.uint8)
    d = int(np.abs(got.reshape(out_c, s, s).astype(int) - ref).max())
    worst = max(worst, d)
    check(d <= 1, f"centre {w}x{h} {mode} R {r} S {s}: differs by {d}")
print(f"pixels: resized crops, flips and centre crops within {worst} of "
      "torchvision")

# ---- JPEG decode: full scale equals PIL's ---------------------------------
for n, (w, h, q, sub, prog) in enumerate([(500, 375, 90, 2, False),
                                          (333, 221, 75, 1, True),
                                          (64, 97, 95, 0, False)]):
    path = os.path.join(tmp, f"j{n}.jpg")
    image(w, h, "RGB").save(path, quality=q, subsampling=sub,
                            progressive=prog)
    raw = run(["decode", path])
    head, px = raw.split(b"\n", 1)
    gw, gh, gc = map(int, head.split())
    ref = np.asarray(Image.open(path).convert("RGB"))
    got = np.frombuffer(px, np.uint8).reshape(gh, gw, gc)
    check(got.shape == ref.shape and np.array_equal(got, ref),
          f"JPEG {w}x{h} q{q} subsampling {sub}: not PIL's pixels")
print("JPEG: full-scale decodes equal PIL's")


# ---- JPEG decode with DCT scaling -----------------------------------------
def decodebox(path, size, box):
    head, px = run(["decodebox", path, str(size), *map(str, box)]).split(
        b"\n", 1)
    w, h, c, *b = map(int, head.split())
    return np.frombuffer(px, np.uint8).reshape(h, w, c), b


path = os.path.join(tmp, "j0.jpg")  # 500 x 375
full = np.asarray(Image.open(path).convert("RGB"))
# (size, box, the scale num/8 expected): no scaling unless the output is at
# most half the box; else the smallest n/8 <= 1/2 whose box still covers it
for size, box, num in [(224, (0, 0, 375, 500), 8), (188, (0, 0, 375, 500), 8),
                       (187, (0, 0, 375, 500), 4), (64, (0, 0, 375, 500), 2),
                       (40, (0, 0, 375, 500), 1),
                       (30, (37, 101, 200, 150), 2),
                       (50, (37, 101, 200, 150), 3),
                       (75, (37, 101, 200, 150), 4),
                       (76, (37, 101, 200, 150), 8)]:
    px, b = decodebox(path, size, box)
    f = 8 / num
    want_hw = (-(-375 * num // 8), -(-500 * num // 8))  # TJSCALED
    check(px.shape[:2] == want_hw, f"decodebox {size} {box}: decoded "
          f"{px.shape[:2]}, expected {num}/8 = {want_hw}")
    if num == 8:
        check(np.array_equal(px, full) and tuple(b) == box,
              f"decodebox {size} {box}: not the full decode")
        continue
    if num in (1, 2, 4):  # PIL's draft scales by 1/2, 1/4, 1/8 only
        ref = Image.open(path)
        ref.draft("RGB", (500 * num // 8, 375 * num // 8))
        ref = np.asarray(ref.convert("RGB"))
        check(ref.shape == px.shape and np.array_equal(ref, px),
              f"decodebox {num}/8: not PIL's draft pixels")
    top, left, bh, bw = b
    check(bh >= size and bw >= size and top * f <= box[0] and
          left * f <= box[1] and (top + bh) * f >= box[0] + box[2] and
          (left + bw) * f >= box[1] + box[3],
          f"decodebox {size} {box}: scaled box {b} does not cover it")
    # the resized crop from the scaled decode is close to the full one's
    path_s = os.path.join(tmp, "scaled.png")
    Image.fromarray(px).save(path_s)
    a = np.frombuffer(run(["crop", path_s, "hwc", *map(str, [
        top, left, bh, bw, size, 0, 3])]), np.uint8).astype(int)
    r = np.frombuffer(run(["crop", path, "hwc", *map(str, [
        *box, size, 0, 3])]), np.uint8).astype(int)
    err = np.abs(a - r).mean()
    check(err < 6, f"decodebox {size} {box}: crop from {num}/8 is {err:.2f} "
          "levels from the full decode's on average")
    print(f"JPEG {num}/8, box {box} -> {size}: crop within {err:.2f} levels "
          f"(mean) of the full decode's" + (", PIL's draft pixels"
                                            if num in (1, 2, 4) else ""))

sys.exit(1 if fails else 0)
