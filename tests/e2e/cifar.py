#!/usr/bin/env python3
"""prep of CIFAR-10 and CIFAR-100 binary batches (synthetic, in the exact
published layout) stores every record's bytes and label unchanged, as CHW
uint8 3x32x32, with the class names of the batch metadata; a missing train
batch is refused by name."""
import os, shutil, subprocess
import numpy as np
import stoke_test as t

tmp = os.environ["STK_TMP"]
prep = os.path.join(os.environ["STK_BIN"], "prep")
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
rng = np.random.default_rng(7)
r = t.formats_reader()

def batch(n, label_bytes):
    labels = rng.integers(0, 10 if label_bytes == 1 else 100, (n, label_bytes), dtype=np.uint8)
    pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    return labels, pixels, np.concatenate([labels, pixels], 1).tobytes()

# CIFAR-10 inside the archive's folder, given its parent
os.makedirs("c10/cifar-10-batches-bin")
names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
open("c10/cifar-10-batches-bin/batches.meta.txt", "w").write("\n".join(names) + "\n\n")
expect = {"train": [], "test": []}
files = [(f"data_batch_{b}.bin", "train", n) for b, n in enumerate([100, 120, 80, 100, 100], 1)]
for name, split, n in files + [("test_batch.bin", "test", 150)]:
    labels, pixels, raw = batch(n, 1)
    open(f"c10/cifar-10-batches-bin/{name}", "wb").write(raw)
    expect[split] += list(zip(labels[:, 0], pixels))
subprocess.run([prep, "--quiet", "--workers", "2", "c10", "db10"], check=True)
env, meta = r["open_stoke"]("db10")
assert meta["classes"] == names and meta["record"]["shape"] == [3, 32, 32]
for split in ("train", "test"):
    assert meta["splits"][split]["count"] == len(expect[split])
    for i, (label, px) in enumerate(expect[split]):
        got_label, got = r["read_sample"](env, meta, split, i)
        assert got_label == label and np.array_equal(got.reshape(-1), px), (split, i)
print("ok: CIFAR-10: 500 + 150 records equal the batch bytes")

# a train batch missing (a download or copy cut short) is an error naming
# it, not a smaller train split, and nothing is written
shutil.copytree("c10/cifar-10-batches-bin", "gap")
os.remove("gap/data_batch_3.bin")
p = subprocess.run([prep, "--quiet", "gap", "dbgap"], capture_output=True, text=True)
assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
assert "gap/data_batch_3.bin: missing (CIFAR-10 has data_batch_1.bin .. data_batch_5.bin)" in p.stderr, p.stderr
assert not os.path.exists("dbgap") and not os.path.exists(".dbgap.partial"), os.listdir(".")
print("ok: CIFAR-10 without data_batch_3.bin:", p.stderr.strip())

# CIFAR-100: the fine label (second byte) is stored
os.makedirs("c100")
fine = [f"fine{i}" for i in range(100)]
open("c100/fine_label_names.txt", "w").write("\n".join(fine) + "\n")
expect = {}
for name, split, n in [("train.bin", "train", 250), ("test.bin", "test", 50)]:
    labels, pixels, raw = batch(n, 2)
    open(f"c100/{name}", "wb").write(raw)
    expect[split] = list(zip(labels[:, 1], pixels))
subprocess.run([prep, "--quiet", "c100", "db100"], check=True)
env, meta = r["open_stoke"]("db100")
assert meta["classes"] == fine
for split in ("train", "test"):
    for i, (label, px) in enumerate(expect[split]):
        got_label, got = r["read_sample"](env, meta, split, i)
        assert got_label == label and np.array_equal(got.reshape(-1), px), (split, i)
print("ok: CIFAR-100: fine labels and bytes equal the batches")
