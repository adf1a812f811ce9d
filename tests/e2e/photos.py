#!/usr/bin/env python3
"""A new user's path with their own photos: a folder of class folders (JPEG
photos of different sizes and aspect ratios, no train/test split),
`prep --holdout 0.2 --short-side S` (raw and --encode jpeg), `dbinfo`, then
`train --augment rrc` on each database. The run must train: its test
accuracy beats chance by a wide margin (each class's photos are crops of
one real photograph, so the classes are easy to tell apart), and the raw
and JPEG databases give the model the same kind of input (both runs learn).
"""
import json, os, shutil, subprocess, sys
import numpy as np
from PIL import Image
import stoke_test as t

tmp = os.environ["STK_TMP"]
bindir = os.environ["STK_BIN"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)

# Real photographs from Debian packages (python3-sklearn, python3-skimage),
# or STK_PHOTOS (bench/make_photos.py's photo_path)
sys.path.insert(0, os.path.join(os.environ["STK_SRC"], "bench"))
from make_photos import photo_path  # noqa: E402
SOURCES = {c: photo_path(f) for c, f in (("china", "china.jpg"), ("flower", "flower.jpg"),
                                         ("coffee", "coffee.png"), ("rocket", "rocket.jpg"))}
for cls, path in SOURCES.items():
    if not os.path.exists(path):
        sys.exit(f"FAIL: {path} is missing (scripts/deps.sh test installs "
                 f"python3-sklearn and python3-skimage)")

rng = np.random.default_rng(17)
PER_CLASS = 40
for cls, path in SOURCES.items():
    src = Image.open(path).convert("RGB")
    os.makedirs(os.path.join("photos", cls))
    for i in range(PER_CLASS):
        # a random crop of the photograph, rescaled to a photo-like size
        # with its own aspect ratio (some portrait, some landscape)
        w0, h0 = src.size
        cw = int(rng.integers(w0 // 3, w0 // 2))
        ch = int(cw * rng.uniform(0.6, 1.4))
        ch = min(ch, h0)
        x, y = int(rng.integers(0, w0 - cw + 1)), int(rng.integers(0, h0 - ch + 1))
        side = int(rng.integers(48, 90))
        scale = side / min(cw, ch)
        im = src.crop((x, y, x + cw, y + ch)).resize(
            (max(1, round(cw * scale)), max(1, round(ch * scale))), Image.BILINEAR)
        im.save(os.path.join("photos", cls, f"IMG_{i:04d}.jpg"), quality=90)


def run(*args, code=0):
    p = subprocess.run([os.path.join(bindir, args[0]), *args[1:]],
                       capture_output=True, text=True)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected "
                 f"{code}\n{p.stdout}{p.stderr}")
    return p.stdout + p.stderr


# Without a split the trainer says what to do.
run("prep", "--quiet", "--short-side", "40", "photos", "nosplit")
out = run("train", "--db", "nosplit", "--epochs", "1", "--out", "r0", code=1)
if "--holdout" not in out:
    sys.exit(f"FAIL: train on a database without a test split does not "
             f"suggest prep --holdout:\n{out}")

accs = {}
for enc in ("raw", "jpeg"):
    db = f"db-{enc}"
    run("prep", "--quiet", "--holdout", "0.2", "--short-side", "40",
        "--encode", enc, "--workers", "2", "photos", db)
    info = run("dbinfo", db)
    if "holdout" not in info:
        sys.exit(f"FAIL: dbinfo {db} does not show the holdout:\n{info}")
    runs = f"run-{enc}"
    run("train", "--db", db, "--model", "cnn", "--augment", "rrc",
        "--crop-size", "32", "--rrc-scale", "0.35,1", "--epochs", "6",
        "--batch", "16", "--optim", "adamw", "--lr", "0.003", "--workers", "2",
        "--threads", "1", "--quiet", "--out", runs)
    with open(os.path.join(runs, "metrics.jsonl")) as f:
        lines = [json.loads(l) for l in f if l.strip()]
    ep = [l for l in lines if "test_acc" in l]
    if not ep:
        sys.exit(f"FAIL: {runs}/metrics.jsonl has no test accuracy")
    accs[enc] = max(l["test_acc"] for l in ep)
    print(f"{enc}: test accuracy by epoch",
          [round(l["test_acc"], 3) for l in ep])
# sweep times the same transforms, on the records and on the original files
# of the held-out split (the database's holdout recomputed over the folder)
out = run("sweep", "--db", "db-jpeg", "--workers", "0,1", "--batch", "16",
          "--raw", "photos", "--split", "test")
if "transform rrc (to 35)" not in out or "\nraw " not in out:
    sys.exit(f"FAIL: sweep on an aspect-keeping JPEG database:\n{out}")
out = run("sweep", "--db", "db-raw", "--workers", "1", "--eval",
          "--crop-size", "24", "--json", "sweep.json")
with open("sweep.json") as f:
    js = json.load(f)
if "transform eval (to 24)" not in out or js["transform"] != "eval" or \
        js["sample_shape"] != [3, 24, 24]:
    sys.exit(f"FAIL: sweep --eval:\n{out}\n{js}")
# an ImageNet-style tree (train/ and val/ folders): train evaluates on val
for split, keep in (("train", range(0, PER_CLASS, 2)), ("val", range(1, PER_CLASS, 8))):
    for cls in SOURCES:
        os.makedirs(os.path.join("tree", split, cls))
        for i in keep:
            shutil.copy(os.path.join("photos", cls, f"IMG_{i:04d}.jpg"),
                        os.path.join("tree", split, cls))
run("prep", "--quiet", "--short-side", "40", "tree", "db-tree")
run("train", "--db", "db-tree", "--model", "mlp", "--crop-size", "24",
    "--epochs", "1", "--batch", "16", "--quiet", "--out", "run-tree")
with open(os.path.join("run-tree", "metrics.jsonl")) as f:
    if not any("test_acc" in json.loads(l) for l in f if l.strip()):
        sys.exit("FAIL: train on a train/val tree did not evaluate on val")

# the Python package: the same transforms from stoke.Loader
try:
    import stoke
except ImportError:
    stoke = None
if stoke is not None:
    import torchvision.transforms as T
    db = stoke.open("db-raw")
    test = stoke.Loader("db-raw", split="test", batch_size=8, shuffle=False,
                        workers=1)
    if test.shape != (3, 35, 35):
        sys.exit(f"FAIL: stoke.Loader on an aspect-keeping database: shape "
                 f"{test.shape}, expected (3, 35, 35)")
    centre = T.Compose([T.Resize(40), T.CenterCrop(35)])  # 35 / 0.875
    worst, k = 0, 0
    for images, labels in stoke.Loader("db-raw", split="test", batch_size=8,
                                       shuffle=False, workers=2):
        for img, label in zip(images, labels):
            rec, want_label = db["test"][k]
            pil = Image.fromarray(np.ascontiguousarray(rec.transpose(1, 2, 0)))
            want = np.asarray(centre(pil)).transpose(2, 0, 1).astype(int)
            worst = max(worst, int(np.abs(img.astype(int) - want).max()))
            if label != want_label:
                sys.exit(f"FAIL: Loader test/{k}: label {label}, not {want_label}")
            k += 1
    if k != len(db["test"]) or worst > 1:
        sys.exit(f"FAIL: stoke.Loader's centre crops of {k} records differ "
                 f"from torchvision's Resize + CenterCrop by {worst} levels")
    runs = []
    for _ in range(2):
        ld = stoke.Loader("db-jpeg", batch_size=16, augment="rrc", crop_size=24,
                          rrc_scale=(0.3, 1), seed=5, workers=2)
        runs.append([(im.copy(), lb.copy()) for im, lb in ld])
        if runs[-1][0][0].shape != (16, 3, 24, 24):
            sys.exit(f"FAIL: rrc batch shape {runs[-1][0][0].shape}")
    if any(not np.array_equal(a[0], b[0]) for a, b in zip(*runs)):
        sys.exit("FAIL: stoke.Loader(augment='rrc') differs between two runs")
    try:
        stoke.Loader("db-raw", augment="bogus")
        sys.exit("FAIL: augment='bogus' accepted")
    except stoke.ArgumentError as e:
        if "augment" not in str(e):
            sys.exit(f"FAIL: augment='bogus': {e}")
    print(f"ok: stoke.Loader: centre crops of {k} test records within "
          f"{worst} of torchvision; rrc batches repeat for a seed")
for enc, acc in accs.items():
    # 4 classes: chance is 0.25
    if acc < 0.6:
        sys.exit(f"FAIL: train --augment rrc on the {enc} database reached "
                 f"{acc:.3f} test accuracy (chance 0.25)")
print("ok: photos -> prep --holdout --short-side (raw, jpeg) -> train "
      "--augment rrc learns", accs)
