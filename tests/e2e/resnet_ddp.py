#!/usr/bin/env python3
"""Batchnorm's state in checkpoints and under data parallelism (resnet20 on
a small Fashion-MNIST: 384 training images, 256 test images, CPU ranks):

- 2 and 3 ranks, 2 epochs: every epoch line says 0 values differ across
  the ranks (weights, running statistics and num_batches_tracked, compared
  bit for bit after rank 0's buffers were broadcast); the checkpoint's
  running statistics are finite and moved away from 0 and 1, and each
  num_batches_tracked is the steps taken;
- that checkpoint is PyTorch's state dict: the twin of
  tests/e2e/torch_ref.py takes it with load_state_dict(strict=True) (same
  names, dtypes, shapes; num_batches_tracked an int64 scalar) and, in eval
  mode, makes the predictions behind the run's test accuracy;
- a run stopped after 5 steps and resumed ends with the same bits as an
  uninterrupted one (buffers and counters restored);
- --init-from takes the running statistics and counters of a state dict
  (a step from statistics raised by d moves them to 0.9 d above the
  step from the default ones, the counter from 1000 to 1001), starts them
  at 0 and 1 from a file that holds none (saying so), and refuses a file
  that holds some but not all, naming the missing tensor."""
import os, subprocess, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
torch = t.need("torch")  # a missing python3-torch fails, it does not skip
import torch_ref as ref

t0 = time.time()
BIN = os.environ["STK_BIN"]
ref.fresh_subset_db(384, 256)
COMMON = ["--model", "resnet20", "--threads", "1", "--workers", "1", "--batch", "32",
          "--optim", "sgd", "--lr", "0.05", "--warmup", "0", "--seed", "5"]


def checkpoint(run):
    """The newest checkpoint's model.safetensors: ({name: array}, metadata)."""
    d = os.path.join(run, "checkpoints")
    steps = sorted(n for n in os.listdir(d) if n.startswith("step-"))
    return t.load_safetensors(os.path.join(d, steps[-1], "model.safetensors"))[0]


def epochs(lines):
    return [l for l in lines if l["type"] == "epoch"]


def bn_names(sd):
    return sorted(k[:-len(".running_mean")] for k in sd if k.endswith(".running_mean"))


# ---- n ranks: identical weights and buffers, rank 0's in the checkpoint -------
x_test, y_test, meta = ref.load_split("db", "test")
norm = ref.normalizer(meta)
for n in (2, 3):
    run = f"w{n}"
    lines = ref.train("db", run, *COMMON, "--epochs", "2", "--nproc", str(n))
    ep = epochs(lines)
    assert [(e["world"], e["params_differing_across_ranks"]) for e in ep] == [(n, 0)] * 2, ep
    sd = checkpoint(run)
    steps = ep[-1]["step"]
    names = bn_names(sd)
    assert len(names) == 21, names  # resnet20: the stem, 2 per block, 2 projections
    for b in names:
        mean, var = sd[b + ".running_mean"], sd[b + ".running_var"]
        count = sd[b + ".num_batches_tracked"]
        assert count.dtype == np.int64 and count.shape == () and count == steps, (b, count)
        assert np.isfinite(mean).all() and np.isfinite(var).all(), b
        assert np.abs(mean).max() > 1e-3 and np.abs(var - 1).max() > 1e-3, (b, mean, var)
        assert (var > 0).all(), (b, var)

    # the PyTorch twin takes it whole, and predicts as the run evaluated
    twin = ref.resnet20(classes=10, channels=1)
    want = twin.state_dict()
    assert sorted(want) == sorted(sd), set(want) ^ set(sd)
    for k, v in want.items():
        assert tuple(v.shape) == sd[k].shape and (v.dtype == torch.int64) == (sd[k].dtype == np.int64), k
    twin.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=True)
    twin.eval()
    with torch.no_grad():
        pred = twin(norm(x_test)).argmax(1).numpy()
    hits = int((pred == y_test).sum())
    stoke_hits = round(ep[-1]["test_acc"] * len(y_test))
    assert ep[-1]["test_samples"] == len(y_test) and abs(hits - stoke_hits) <= 1, (hits, stoke_hits)
    print(f"ok: {n} ranks x 2 epochs ({steps} steps): 0 values differ across ranks after each "
          f"epoch; {len(names)} batchnorms' statistics moved, counters {steps}; the checkpoint "
          f"loads into PyTorch (strict) and predicts {hits}/{len(y_test)} (stoke {stoke_hits})")

# ---- a resume restores the buffers and counters ---------------------------------
one = COMMON + ["--epochs", "1", "--log-every", "1"]
ref.train("db", "whole", *one)
ref.train("db", "parts", *one, "--max-steps", "5")
p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "parts", "--quiet",
                    "--resume", "auto", *one], capture_output=True, text=True)
assert p.returncode == 0, p.stderr
a, b = checkpoint("whole"), checkpoint("parts")
assert sorted(a) == sorted(b)
for k in a:
    assert a[k].tobytes() == b[k].tobytes(), k
print(f"ok: stopped after 5 steps and resumed, the run ends with the same bits "
      f"({len(a)} tensors, buffers and counters included)")

# ---- --init-from: all the statistics, none, or refused ----------------------------
torch.manual_seed(0)
base = {k: v.clone() for k, v in ref.resnet20(classes=10, channels=1).state_dict().items()}
raised = {k: (v + 5 if k.endswith("running_mean") else v + 4 if k.endswith("running_var")
              else torch.tensor(1000) if k.endswith("num_batches_tracked") else v)
          for k, v in base.items()}
ref.save_safetensors("base.safetensors", base)
ref.save_safetensors("raised.safetensors", raised)
step = ["db", None, *COMMON, "--epochs", "1", "--max-steps", "1"]
got = {}
for name in ("base", "raised"):
    step[1] = "init_" + name
    ref.train(*step, "--init-from", name + ".safetensors")
    got[name] = checkpoint("init_" + name)
for k in base:
    d = got["raised"][k].astype(np.float64) - got["base"][k]
    if k.endswith("running_mean") or k.endswith("running_var"):
        want = 0.9 * (5 if k.endswith("running_mean") else 4)
        assert np.abs(d - want).max() < 1e-5, (k, np.abs(d - want).max())
    elif k.endswith("num_batches_tracked"):
        assert got["base"][k] == 1 and got["raised"][k] == 1001, k
    else:
        assert not d.any(), k  # training-mode batchnorm: the same step
params_only = {k: v for k, v in base.items()
               if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
ref.save_safetensors("params.safetensors", params_only)
p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "init_params",
                    *COMMON, "--epochs", "1", "--max-steps", "1", "--init-from",
                    "params.safetensors"], capture_output=True, text=True)
assert p.returncode == 0 and "holds no batchnorm running statistics: they start at 0 and 1" in p.stderr, p.stderr
fresh = checkpoint("init_params")
for k in base:
    assert fresh[k].tobytes() == got["base"][k].tobytes(), k  # base holds 0, 1 and 0
partial = dict(base)
del partial["layer2.1.bn2.running_var"]
ref.save_safetensors("partial.safetensors", partial)
p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "init_partial",
                    *COMMON, "--epochs", "1", "--init-from", "partial.safetensors"],
                   capture_output=True, text=True)
assert p.returncode == 1 and 'no tensor "layer2.1.bn2.running_var" (the file holds 41 of the ' \
    "model's 42 batchnorm running statistics)" in p.stderr, (p.returncode, p.stderr)
negative = dict(base)
negative["layer3.0.bn1.running_var"] = base["layer3.0.bn1.running_var"].clone()
negative["layer3.0.bn1.running_var"][5] = -0.25
ref.save_safetensors("negative.safetensors", negative)
p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "init_negative",
                    *COMMON, "--epochs", "1", "--init-from", "negative.safetensors"],
                   capture_output=True, text=True)
assert p.returncode == 1 and '"layer3.0.bn1.running_var" element 5 is -0.25, a variance' \
    in p.stderr, (p.returncode, p.stderr)
# a tensor the model lacks (another model's state dict, a head of another
# size's extra layer): refused, as load_state_dict(strict=True) refuses it
extra = dict(base)
extra["layer4.0.conv1.weight"] = torch.zeros(4, 4, 3, 3)
ref.save_safetensors("extra.safetensors", extra)
p = subprocess.run([os.path.join(BIN, "train"), "--db", "db", "--out", "init_extra",
                    *COMMON, "--epochs", "1", "--init-from", "extra.safetensors"],
                   capture_output=True, text=True)
assert p.returncode == 1 and 'extra.safetensors: holds "layer4.0.conv1.weight", which the ' \
    "model has no tensor for" in p.stderr, (p.returncode, p.stderr)
assert not os.path.exists("init_extra/checkpoints/BEST"), "a refused --init-from trained"
print("ok: --init-from takes a state dict's running statistics and counters, starts them "
      "fresh from a file without any (saying so), refuses a file with some or with a "
      "negative variance, or with a tensor the model lacks")
print(f"ok: resnet_ddp ({time.time() - t0:.1f} s)")
