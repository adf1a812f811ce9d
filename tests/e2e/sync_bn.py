#!/usr/bin/env python3
"""--sync-bn: 2 CPU ranks of batch 64 compute what 1 rank of batch 128
does. resnet20 on the first 2560 Fashion-MNIST training images, 20 SGD
steps, no augmentation (resnet20 has no dropout): the loader gives rank r
every 2nd sample of the seeded order (docs/distributed.md), so the two
ranks' batches of a step are together the single rank's batch, and with
the statistics summed over the ranks every batchnorm sees the same 128
samples. Each step's loss within 1e-4 (relative) and, after the 20 steps,
every weight, running statistic within 1e-4 and num_batches_tracked equal.
Without --sync-bn the same 2 x 64 runs differ from the first step (each
rank normalises with its own 64 samples), which shows the comparison can
fail. A model without batchnorm trains under --sync-bn, with a line saying
it has nothing to synchronise."""
import os, shutil, subprocess, sys, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
import torch_ref as ref

tmp = os.environ["STK_TMP"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
t0 = time.time()
BIN = os.environ["STK_BIN"]
STEPS, TOL = 20, 1e-4
subprocess.run([sys.executable, os.path.join(os.environ["STK_SRC"], "tests/e2e/fm_subset.py"),
                ref.FASHION, "raw", str(STEPS * 128), "128"], check=True)
subprocess.run([os.path.join(BIN, "prep"), "--quiet", "raw", "db"], check=True)
COMMON = ["--model", "resnet20", "--threads", "1", "--workers", "1", "--optim", "sgd",
          "--lr", "0.05", "--momentum", "0.9", "--warmup", "0", "--schedule", "constant",
          "--seed", "11", "--epochs", "1", "--log-every", "1"]


def losses(lines):
    return [l["loss"] for l in lines if l["type"] == "step"]


def final(run):
    d = os.path.join(run, "checkpoints")
    last = sorted(n for n in os.listdir(d) if n.startswith("step-"))[-1]
    return t.load_safetensors(os.path.join(d, last, "model.safetensors"))[0]


one = ref.train("db", "one128", *COMMON, "--batch", "128")
two = ref.train("db", "sync2x64", *COMMON, "--batch", "64", "--nproc", "2", "--sync-bn",
                "--bucket-mb", "0.05")  # many buckets, reduced amid the batchnorms' sums
plain = ref.train("db", "plain2x64", *COMMON, "--batch", "64", "--nproc", "2", "--max-steps", "2")
ref_loss, got = losses(one), losses(two)
assert len(ref_loss) == STEPS and len(got) == STEPS, (len(ref_loss), len(got))
worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref_loss))
assert worst < TOL, (worst, got, ref_loss)
apart = max(abs(a - b) / abs(b) for a, b in zip(losses(plain), ref_loss))
assert apart > 10 * TOL, ("without --sync-bn the losses should differ", apart)

a, b = final("sync2x64"), final("one128")
assert sorted(a) == sorted(b)
worst_w, where = 0.0, None
for k, want in b.items():
    if want.dtype == np.int64:
        assert a[k] == want == STEPS, (k, a[k], want)
        continue
    d = float(np.max(np.abs(a[k].astype(np.float64) - want) / np.maximum(1.0, np.abs(want))))
    if d > worst_w:
        worst_w, where = d, k
assert worst_w < TOL, (where, worst_w)
print(f"ok: --sync-bn 2 x 64 follows 1 x 128 over {STEPS} steps: largest relative loss "
      f"difference {worst:.2e}; weights and running statistics within {worst_w:.2e} "
      f"(at {where}); without --sync-bn the losses part by {apart:.2e}")

p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "cnn", "--model", "cnn",
                    "--threads", "1", "--workers", "1", "--batch", "64", "--nproc", "2",
                    "--sync-bn", "--max-steps", "1"], capture_output=True, text=True)
assert p.returncode == 0 and "--sync-bn: the model has no batchnorm layer" in p.stdout + p.stderr, \
    (p.returncode, p.stdout, p.stderr)
print(f"ok: --sync-bn on the cnn trains and says it has nothing to synchronise "
      f"({time.time() - t0:.1f} s)")
