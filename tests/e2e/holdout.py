#!/usr/bin/env python3
"""prep --holdout: a folder of class folders without split folders gets a
"test" split holding round(F * n) files of each class (1..n-1), the files
docs/formats.md's rule names (recomputed here independently from the
relative paths and the seed), the same for 1 and 8 workers and across runs,
no file in both splits and none lost; the choice is recorded in the
metadata and shown by dbinfo; split folders, IDX data and bad fractions are
refused naming the flag."""
import json, os, shutil, subprocess, sys
import numpy as np
from PIL import Image
import stoke_test as t

tmp = os.environ["STK_TMP"]
bindir = os.environ["STK_BIN"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
env = dict(os.environ, SOURCE_DATE_EPOCH="1700000000")
MASK64 = (1 << 64) - 1

# Class folders of different sizes; a nested folder and a non-ASCII name
# make the relative path (not the file name) the hashed key.
CLASSES = {"cat": 23, "dog": 10, "emu": 3, "fox": 1}
files = {}  # relative path -> (label, pixel bytes)
for label, (cls, n) in enumerate(sorted(CLASSES.items())):
    for i in range(n):
        rel = f"{cls}/sub/{i}.png" if i % 5 == 4 else f"{cls}/img_\u00e9{i}.png"
        os.makedirs(os.path.join("raw", os.path.dirname(rel)), exist_ok=True)
        k = len(files)
        px = ((np.arange(256).reshape(16, 16) * 3 + k * 37) % 251).astype(np.uint8)
        px[0, 0], px[0, 1] = k, label  # a fingerprint: every file differs
        Image.fromarray(px, "L").save(os.path.join("raw", rel))
        files[rel] = (label, px.tobytes())
by_pixels = {v[1]: rel for rel, v in files.items()}


def rank(rel, seed):
    """docs/formats.md's holdout rule: splitmix64 finaliser of
    fnv1a64(relative path bytes) ^ seed."""
    h = 0xCBF29CE484222325
    for b in os.fsencode(rel):
        h = ((h ^ b) * 0x100000001B3) & MASK64
    h ^= seed
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 31)


def expected_test(fraction, seed):
    out = set()
    for cls, n in CLASSES.items():
        rels = sorted((r for r in files if r.startswith(cls + "/")),
                      key=lambda r: (rank(r, seed), os.fsencode(r)))
        k = 0 if n < 2 else min(max(int(fraction * n + 0.5), 1), n - 1)
        out.update(rels[:k])
    return out


def run(*args, code=0):
    p = subprocess.run([os.path.join(bindir, args[0]), *args[1:]], env=env,
                       capture_output=True, text=True)
    if p.returncode != code:
        sys.exit(f"FAIL: {' '.join(args)} exited {p.returncode}, expected "
                 f"{code}\n{p.stdout}{p.stderr}")
    return p.stdout + p.stderr


fr = t.formats_reader()


def split_files(db, split):
    """The relative paths of a split's records, in key order (each record
    found by its pixels), after checking each label."""
    e, meta = fr["open_stoke"](db)
    out = []
    for i in range(meta["splits"][split]["count"]):
        label, px = fr["read_sample"](e, meta, split, i)
        rel = by_pixels.get(px.tobytes())
        if rel is None:
            sys.exit(f"FAIL: {db} {split}/{i}: pixels of no source file")
        if label != files[rel][0]:
            sys.exit(f"FAIL: {db} {split}/{i} ({rel}): label {label}, "
                     f"expected {files[rel][0]}")
        out.append(rel)
    return meta, out


def check(db, fraction, seed):
    meta, test = split_files(db, "test")
    _, train = split_files(db, "train")
    want = expected_test(fraction, seed)
    if set(test) != want:
        sys.exit(f"FAIL: {db}: test holds {sorted(set(test) ^ want)} "
                 f"differently from the documented rule")
    if set(train) & set(test) or len(train) + len(test) != len(files) or \
            set(train) | set(test) != set(files):
        sys.exit(f"FAIL: {db}: the splits overlap or lose files")
    for split, rels in (("train", train), ("test", test)):
        if rels != sorted(rels, key=lambda r: (files[r][0], os.fsencode(r))):
            sys.exit(f"FAIL: {db} {split}: not in class, then path order")
    for cls, n in CLASSES.items():
        k = sum(r.startswith(cls + "/") for r in test)
        if n >= 2 and not 1 <= k <= n - 1:
            sys.exit(f"FAIL: {db}: class {cls} ({n} files) has {k} in test")
    h = meta.get("holdout", {})
    if h.get("fraction") != fraction or h.get("seed") != seed or \
            h.get("from") != "train" or h.get("to") != "test":
        sys.exit(f"FAIL: {db}: metadata holdout is {h}")
    return test


def mdb(db):
    with open(os.path.join(db, "data.mdb"), "rb") as f:
        return f.read()


# 1 and 8 workers, and a second run: the same files, the same bytes
run("prep", "--quiet", "--size", "16", "--gray", "--holdout", "0.25",
    "--workers", "1", "raw", "db1")
run("prep", "--quiet", "--size", "16", "--gray", "--holdout", "0.25",
    "--workers", "8", "raw", "db8")
run("prep", "--quiet", "--size", "16", "--gray", "--holdout", "0.25",
    "--workers", "1", "raw", "db1b")
test0 = check("db1", 0.25, 0)
if mdb("db1") != mdb("db8") or mdb("db1") != mdb("db1b"):
    sys.exit("FAIL: --holdout gave different data.mdb for 1 and 8 workers "
             "or across runs")
# proportions: cat 23 -> 6, dog 10 -> 3 (2.5 rounds up), emu 3 -> 1, fox -> 0
counts = {c: sum(r.startswith(c + "/") for r in test0) for c in CLASSES}
if counts != {"cat": 6, "dog": 3, "emu": 1, "fox": 0}:
    sys.exit(f"FAIL: held out per class {counts}")
info = run("dbinfo", "db1")
if "holdout   0.25" not in info or "--holdout-seed 0" not in info:
    sys.exit(f"FAIL: dbinfo does not show the holdout:\n{info}")

# another seed: another choice, by the same rule
run("prep", "--quiet", "--size", "16", "--gray", "--holdout", "0.25",
    "--holdout-seed", "7", "--workers", "2", "raw", "db7")
if check("db7", 0.25, 7) == test0:
    sys.exit("FAIL: --holdout-seed 7 chose the same files as seed 0")

# the Python package does the same
try:
    import stoke
except ImportError:
    stoke = None
if stoke is not None:
    stoke.prep("raw", "dbpy", workers=3, size=16, channels=1, holdout=0.25,
               progress=False)
    meta_py, _ = split_files("dbpy", "test")
    if split_files("dbpy", "test")[1] != split_files("db1", "test")[1]:
        sys.exit("FAIL: stoke.prep(holdout=0.25) chose other files than prep")
    try:
        stoke.prep("raw", "dbbad", holdout=1.5, progress=False)
        sys.exit("FAIL: stoke.prep(holdout=1.5) did not raise")
    except stoke.ArgumentError as e:
        if "--holdout" not in str(e) and "holdout" not in str(e):
            sys.exit(f"FAIL: stoke.prep(holdout=1.5) says {e}")

# --skip-bad finds a bad file only after --holdout divided the files: emu's
# one held-out file is empty, so emu has no test record; prep says so
# (warning, exit 0) instead of breaking the rule silently
shutil.copytree("raw", "rawbad")
emu_test = [r for r in expected_test(0.25, 0) if r.startswith("emu/")]
assert len(emu_test) == 1, emu_test
open(os.path.join("rawbad", emu_test[0]), "wb").close()
out = run("prep", "--holdout", "0.25", "--skip-bad", "--size", "16", "rawbad", "dbskip")
if ('prep: warning: "emu": 1 class(es) with no record in one split: their files there '
        "were skipped (--skip-bad) after --holdout divided them") not in out:
    sys.exit(f"FAIL: an emptied class of the holdout: {out}")
# also a class of two files, one a side, whose held-out file is bad (it
# had been left out: the warning counted the records written, not files)
shutil.copytree("raw", "rawtwo")
os.makedirs(os.path.join("rawtwo", "gnu"))
two = ["gnu/a.png", "gnu/b.png"]
for rel in two:
    shutil.copy(os.path.join("raw", "cat", "img_\u00e90.png"), os.path.join("rawtwo", rel))
held = min(two, key=lambda r: (rank(r, 0), os.fsencode(r)))
open(os.path.join("rawtwo", held), "wb").close()
out = run("prep", "--holdout", "0.25", "--skip-bad", "--size", "16", "rawtwo", "dbtwo")
if 'prep: warning: "gnu": 1 class(es) with no record in one split' not in out:
    sys.exit(f"FAIL: a class of two files emptied in test: {out}")
if "warning" in run("prep", "--holdout", "0.25", "--skip-bad", "--size", "16", "raw", "dbok"):
    sys.exit("FAIL: a warning without a skipped file")
print("ok: a class that --skip-bad left without test records is named")
# what a folder holds that prep passes over is said, not silent: files of
# other types (ImageFolder reads .webp and .bmp too) and a class folder
# without an image (ImageFolder refuses it; here it keeps its index)
shutil.copytree("raw", "rawx")
open(os.path.join("rawx", "cat", "x.webp"), "wb").write(b"RIFF")
os.makedirs(os.path.join("rawx", "gnu", "empty"))
out = run("prep", "--size", "16", "rawx", "dbpassed")
for want in ("prep: warning: 1 file(s) that are not .png, .jpg or .jpeg were passed over "
             "(the first: rawx/cat/x.webp)",
             'prep: warning: "gnu": 1 class(es) with no image in train (kept, with their indices)'):
    if want not in out:
        sys.exit(f"FAIL: {want!r} not in\n{out}")
if "warning" in run("prep", "--size", "16", "raw", "dbquiet"):
    sys.exit("FAIL: a warning for a folder with nothing passed over")
# long UTF-8 names are shortened between characters, never through one
# (run() decodes strictly)
shutil.copytree("raw", "rawu8")
open(os.path.join("rawu8", "cat", "\u00e9" * 100 + ".webp"), "wb").write(b"RIFF")
os.makedirs(os.path.join("rawu8", "a" + "\u03b6" * 30, "empty"))  # byte 40 inside a character
out = run("prep", "--size", "16", "rawu8", "dbutf8")
for want in ("(the first: rawu8/cat/" + "\u00e9" * 94 + ")",
             '"a' + "\u03b6" * 19 + '...": 1 class(es) with no image in train'):
    if want not in out:
        sys.exit(f"FAIL: {want!r} not in\n{out}")
# names that are not UTF-8 (Linux file names are bytes) reach stoke.prep's
# warning escaped, after the database is written, not as a UnicodeDecodeError
if stoke is not None:
    import warnings
    shutil.copytree("raw", "rawb")
    os.makedirs(b"rawb/caf\xe9/empty")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        summary = stoke.prep("rawb", "dbbytes", size=16, progress=False)
    if '"caf\\xe9": 1 class(es) with no image in train' not in summary["warning"] \
            or not seen:
        sys.exit(f"FAIL: a class name that is not UTF-8: {summary['warning']!r}")
print("ok: files of other types and classes without an image are named")

# refusals: each names the flag, nothing is written
for bad in ("0", "1", "1.5", "-0.1", "abc", "0.1x"):
    out = run("prep", "--holdout", bad, "raw", "dbx", code=2)
    if "--holdout" not in out:
        sys.exit(f"FAIL: --holdout {bad}: {out}")
out = run("prep", "--holdout-seed", str(1 << 53), "--holdout", "0.1", "raw",
          "dbx", code=2)
if "--holdout-seed" not in out:
    sys.exit(f"FAIL: --holdout-seed 2^53: {out}")
for seed in ("3", "0"):  # it was ignored
    out = run("prep", "--holdout-seed", seed, "raw", "dbx", code=2)
    if "prep: --holdout-seed needs --holdout" not in out:
        sys.exit(f"FAIL: --holdout-seed {seed} without --holdout: {out}")
os.makedirs("split/train/a"); os.makedirs("split/test/a")
shutil.copy(os.path.join("raw", "cat/img_\u00e90.png"), "split/train/a/x.png")
shutil.copy(os.path.join("raw", "cat/img_\u00e91.png"), "split/test/a/x.png")
out = run("prep", "--holdout", "0.1", "split", "dbx", code=1)
if "split folders" not in out or "--holdout" not in out:
    sys.exit(f"FAIL: --holdout over split folders: {out}")
if os.path.exists(t.FASHION):
    out = run("prep", "--holdout", "0.1", t.FASHION, "dbx", code=1)
    if "--holdout" not in out or "IDX" not in out:
        sys.exit(f"FAIL: --holdout over IDX: {out}")
os.makedirs("single/a"); os.makedirs("single/b")
shutil.copy(os.path.join("raw", "fox/img_\u00e90.png"), "single/a/x.png")
shutil.copy(os.path.join("raw", "emu/img_\u00e90.png"), "single/b/x.png")
out = run("prep", "--holdout", "0.5", "single", "dbx", code=1)
if "holds out no file" not in out:
    sys.exit(f"FAIL: --holdout with one file per class: {out}")
if os.path.exists("dbx"):
    sys.exit("FAIL: a refused prep left dbx behind")
print("ok: --holdout picks the documented files, identical for 1 and 8 "
      "workers and across runs; refusals name the flag")
