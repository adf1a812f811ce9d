#!/usr/bin/env python3
"""The photo benchmark's pieces (issue 17): bench/make_photos.py makes the
same files for any worker count, a different set for another seed, ten
classes in the layout and sizes it promises, and refuses to overwrite;
bench/photo_peers.py's torchvision peer yields uint8 crops of the asked
size, its byte counts read a stoke database's record count, and its report
computes the ratios to torch."""
import filecmp
import json
import os
import shutil
import subprocess
import sys

from PIL import Image

tmp = os.environ["STK_TMP"]
src = os.environ["STK_SRC"]
prep = os.path.join(os.environ["STK_BIN"], "prep")
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
py = os.environ.get("STK_PYTHON", "/usr/bin/python3")  # as lib.sh
make = [py, os.path.join(src, "bench/make_photos.py")]
peers = [py, os.path.join(src, "bench/photo_peers.py")]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"FAIL: {' '.join(cmd)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def files(d):
    return sorted(os.path.relpath(os.path.join(p, f), d) for p, _, fs in os.walk(d) for f in fs)


def check(cond, what):
    if not cond:
        sys.exit(f"FAIL: {what}")


a, b, c = (os.path.join(tmp, n) for n in ("a", "b", "c"))
run(make + [a, "60", "--side", "96", "--workers", "1"])
run(make + [b, "60", "--side", "96", "--workers", "2"])
run(make + [c, "60", "--side", "96", "--seed", "18"])
names = files(a)
check(names == files(b), "workers 1 and 2 made different file lists")
_, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
check(not mismatch and not errors, f"workers 1 and 2 differ in {mismatch + errors}")
check(filecmp.cmpfiles(a, c, names, shallow=False)[1], "seed 18 made the same bytes as seed 17")

classes = sorted(os.listdir(a))
check(len(classes) == 10 and len(names) == 60, f"{len(classes)} classes, {len(names)} files")
for n in names:
    cls, f = n.split("/")
    i = int(f.split(".")[0])
    check(classes.index(cls) == i % 10, f"{n}: file {i} in class {cls}")
    im = Image.open(os.path.join(a, n))
    check(im.format == "JPEG" and im.mode == "RGB", f"{n}: {im.format} {im.mode}")
    check(76 <= max(im.size) <= 125, f"{n}: longer side {max(im.size)} outside 0.8-1.3 x 96")

r = subprocess.run(make + [a, "10"], capture_output=True, text=True)
check(r.returncode != 0 and a in r.stderr, f"an existing folder was not refused: {r.stderr!r}")

for w in (0, 1):
    out = json.loads(run(peers + ["time", a, str(w), "--batch", "16", "--batches", "2",
                                  "--crop", "32"]))
    check(out["workers"] == w and out["samples"] == 32 and out["images"] == 60
          and out["samples_per_s"] > 0 and out["cpu_s"] > 0, f"peer, {w} workers: {out}")

db = os.path.join(tmp, "db")
run([prep, "--quiet", "--size", "32", a, db])
out = json.loads(run(peers + ["bytes", a, db]))
sizes = [os.path.getsize(os.path.join(a, n)) for n in names]
check(out["images"] == 60 and abs(out["original_per_image"] - sum(sizes) / 60) < 1e-6,
      f"original bytes: {out}")
check(out["db"]["records"] == 60 and out["db"]["data_mdb_per_record"] >= 8 + 3 * 32 * 32,
      f"database bytes: {out}")

results = os.path.join(tmp, "results.jsonl")
with open(results, "w") as f:
    for tool, w, rate in [("stoke-raw", 1, 3000), ("stoke-jpeg", 1, 900), ("torch", 1, 300),
                          ("torch", 1, 100), ("torch", 1, 500)]:
        f.write(json.dumps({"tool": tool, "workers": w, "samples_per_s": rate}) + "\n")
report = run(peers + ["report", results])
check("| 1 | 3000 (3000-3000) | 900 (900-900) | 300 (100-500) | 10.0x | 3.0x |" in report,
      f"report:\n{report}")
print("photo harness: ok")
