#!/usr/bin/env python3
"""--sync-bn: 2 CPU ranks of batch 64 compute what 1 rank of batch 128
does. The loader gives rank r every 2nd sample of the seeded order
(docs/distributed.md), so the two ranks' batches of a step are together
the single rank's batch; with the statistics (and backward's sums) summed
over the ranks every batchnorm sees the same 128 samples, and only the
order of the float sums differs. No augmentation, no dropout, SGD with
momentum, many small DDP buckets (reduced amid the batchnorms' sums).

- A conv/batchnorm-2d/pool network with a linear/batchnorm-1d head, 20
  steps on the first 2560 Fashion-MNIST images: each step's loss within
  1e-4 (relative), and after the 20 steps every weight and running
  statistic within 1e-4 and num_batches_tracked equal. Without --sync-bn
  the same 2 x 64 run is far apart (each rank normalises with its own 64
  samples), which shows the comparison can fail.
- resnet20, the first 2 steps alike (learning rate 0.005). Not 20: resnet20 from its random
  initialisation is chaotic at float precision on this data (PyTorch in
  float32 and in float64 on the same batches part by 1e-4 in the loss
  within 5 to 12 steps, at any learning rate from 5e-4 to 5e-2; a ReLU
  whose input is within 1e-6 of 0 flips its mask), so two float32
  computations that only sum in another order part as fast.
- A model without batchnorm trains under --sync-bn, with a line saying it
  has nothing to synchronise."""
import os, subprocess, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
import torch_ref as ref

t0 = time.time()
BIN = os.environ["STK_BIN"]
STEPS, TOL = 20, 1e-4
ref.fresh_subset_db(STEPS * 128, 128)
with open("bn.model", "w") as f:
    f.write("conv1: conv 16 3 pad=1 bias=false\nbn1: batchnorm\nrelu\npool 2\n"
            "conv2: conv 32 3 pad=1 bias=false\nbn2: batchnorm\nrelu\npool 2\nflatten\n"
            "fc1: linear 64 bias=false\nbn3: batchnorm\nrelu\nfc2: linear classes\n")
COMMON = ["--threads", "1", "--workers", "1", "--optim", "sgd", "--lr", "0.05",
          "--momentum", "0.9", "--warmup", "0", "--schedule", "constant", "--seed", "11",
          "--epochs", "1", "--log-every", "1", "--bucket-mb", "0.01"]


def losses(lines):
    return [l["loss"] for l in lines if l["type"] == "step"]


def final(run):
    d = os.path.join(run, "checkpoints")
    last = sorted(n for n in os.listdir(d) if n.startswith("step-"))[-1]
    return t.load_safetensors(os.path.join(d, last, "model.safetensors"))[0]


def apart(run, reference, steps):
    """Largest relative loss difference over the steps, and the largest
    difference of a weight or running statistic (relative above 1), with
    its tensor; counters must be equal."""
    got, want = losses(ref.metrics(run)), losses(ref.metrics(reference))
    assert len(got) == steps and len(want) == steps, (len(got), len(want))
    loss = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    a, b = final(run), final(reference)
    assert sorted(a) == sorted(b)
    worst, where = 0.0, None
    for k, w in b.items():
        if w.dtype == np.int64:
            assert a[k] == w == steps, (k, a[k], w)
            continue
        d = float(np.max(np.abs(a[k].astype(np.float64) - w) / np.maximum(1.0, np.abs(w))))
        if d > worst:
            worst, where = d, k
    return loss, worst, where


def compare(name, model, steps, contrast, lr="0.05"):
    """2 x 64 --sync-bn against 1 x 128 over `steps` steps; with contrast,
    2 x 64 without --sync-bn must be far from it."""
    run = [*COMMON, "--model", model, "--max-steps", str(steps), "--lr", lr]
    ref.train("db", name + "-1x128", *run, "--batch", "128")
    ref.train("db", name + "-sync", *run, "--batch", "64", "--nproc", "2", "--sync-bn")
    loss, weights, where = apart(name + "-sync", name + "-1x128", steps)
    assert loss < TOL and weights < TOL, (model, loss, weights, where)
    msg = (f"ok: {name}: --sync-bn 2 x 64 follows 1 x 128 over {steps} steps: largest "
           f"relative loss difference {loss:.1e}, weights and running statistics within "
           f"{weights:.1e} ({where})")
    if contrast:
        ref.train("db", name + "-plain", *run, "--batch", "64", "--nproc", "2")
        loss_p, weights_p, where_p = apart(name + "-plain", name + "-1x128", steps)
        assert loss_p > 10 * TOL and weights_p > 100 * TOL, (loss_p, weights_p)
        msg += f"; without --sync-bn {loss_p:.1e} and {weights_p:.1e} ({where_p})"
    print(msg)


compare("bn.model", "bn.model", STEPS, contrast=True, lr="0.02")
compare("resnet20", "resnet20", 2, contrast=False, lr="0.005")

p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "cnn", "--model", "cnn",
                    "--threads", "1", "--workers", "1", "--batch", "64", "--nproc", "2",
                    "--sync-bn", "--max-steps", "1"], capture_output=True, text=True)
assert p.returncode == 0 and "--sync-bn: the model has no batchnorm layer" in p.stdout + p.stderr, \
    (p.returncode, p.stdout, p.stderr)
print(f"ok: --sync-bn on the cnn trains and says it has nothing to synchronise "
      f"({time.time() - t0:.1f} s)")
