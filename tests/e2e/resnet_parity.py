#!/usr/bin/env python3
"""resnet20 against its PyTorch twin (torch_ref.resnet20), on the first
STEPS * BATCH Fashion-MNIST training images (one epoch of STEPS steps, in
the order of docs/loader.md) and the first NTEST test images, without
augmentation, SGD with momentum and weight decay at a constant rate:

- from the same initial weights (the twin's, torch.manual_seed(INIT),
  saved as safetensors with its buffers and given to train --init-from),
  every one of the STEPS losses (metrics.jsonl, --log-every 1) within
  LOSS_TOL relative of PyTorch's; after them every weight within 1e-4 and
  every running statistic within 1e-5 of the twin's, num_batches_tracked
  STEPS; the twin's eval-mode logits on the test images with stoke's
  weights within 1e-4 of those with its own; stoke's test loss that of
  the twin with stoke's weights and its accuracy the same count of
  correct answers (a sample whose two best logits are within rounding of
  each other may go either way). Twice: plain cross-entropy with every
  parameter decayed, and --label-smoothing 0.1 --no-decay-norm-bias
  (PyTorch: label_smoothing=0.1, a param group without decay for the
  biases and batchnorm weights).
- stoke's checkpoint (the newest model.safetensors and best.safetensors)
  loads into the twin with load_state_dict(strict=True), every tensor of
  the same dtype and shape (num_batches_tracked an int64 scalar).
- a state dict trained by PyTorch (the twin after its STEPS steps, running
  statistics and counters included) starts a stoke run through
  --init-from: after one step, stoke's loss, every parameter's momentum
  buffer (the gradient plus the decay: optim.safetensors) and the running
  statistics are PyTorch's from the same state and batch, the counters
  STEPS + 1. This one also says which layer parts first if the losses do.

A failure of the losses reruns the twin in float64 and says whether stoke
or PyTorch's float32 is the one that parts from it."""
import copy, os, shutil, subprocess, sys, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
torch = t.need("torch")  # a missing python3-torch fails, it does not skip
import torch.nn.functional as F
import torch_ref as ref

STEPS, BATCH, NTEST, SEED, INIT = 50, 32, 1000, 5, 3
LR, MOMENTUM, WD = 0.002, 0.9, 5e-4
LOSS_TOL, WEIGHT_TOL, STAT_TOL, LOGIT_TOL, EVAL_TOL = 1e-4, 1e-4, 1e-5, 1e-4, 2e-5
SGD = ["--optim", "sgd", "--lr", LR, "--momentum", MOMENTUM, "--weight-decay", WD,
       "--schedule", "constant", "--warmup", 0]
# (name, extra flags, label smoothing, biases and batchnorm weights undecayed)
CASES = [("sgd", [], 0.0, False),
         ("smoothing", ["--label-smoothing", 0.1, "--no-decay-norm-bias"], 0.1, True)]
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")

tmp = os.environ["STK_TMP"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
torch.set_num_threads(2)
t0 = time.time()
failed = []

subprocess.run([sys.executable, os.path.join(os.environ["STK_SRC"], "tests/e2e/fm_subset.py"),
                ref.FASHION, "raw", str(STEPS * BATCH), str(NTEST)], check=True)
subprocess.run([os.path.join(os.environ["STK_BIN"], "prep"), "--quiet", "raw", "db"], check=True)
x_train, y_train, meta = ref.load_split("db", "train")
x_test, y_test, _ = ref.load_split("db", "test")
CLASSES = len(meta["classes"])
norm = ref.normalizer(meta)
perm = ref.permutation(len(y_train), SEED, 0)
batches = [(norm(x_train[perm[k * BATCH:(k + 1) * BATCH]]),
            torch.from_numpy(y_train[perm[k * BATCH:(k + 1) * BATCH]])) for k in range(STEPS)]
test_x, test_y = norm(x_test), torch.from_numpy(y_test)


def twin(state=None, dtype=torch.float32):
    model = ref.resnet20(classes=CLASSES, channels=x_train.shape[1])
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.to(dtype)


def sgd(model, no_decay):
    """PyTorch's SGD; with no_decay, decay only for conv and linear weights."""
    if not no_decay:
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    names = ref_groups(model)
    groups = [{"params": [p for n, p in model.named_parameters() if n not in names]},
              {"params": [p for n, p in model.named_parameters() if n in names],
               "weight_decay": 0.0}]
    return torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM, weight_decay=WD)


def ref_groups(model):
    """The parameters --no-decay-norm-bias leaves undecayed: biases and
    batchnorm weights (every 1-d parameter of a resnet)."""
    return {n for n, p in model.named_parameters() if p.ndim == 1}


def twin_train(state, smoothing, no_decay, dtype, steps=STEPS):
    """The twin trained from state over the first steps batches: (model, its
    optimizer, the losses)."""
    model = twin(state, dtype)
    opt = sgd(model, no_decay)
    model.train()
    losses = []
    for x, y in batches[:steps]:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.to(dtype)), y, label_smoothing=smoothing)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, np.array(losses)


def stoke(out, init, flags, *extra):
    """train from init with flags: (metrics lines, the newest checkpoint
    directory)."""
    lines = ref.train("db", out, "--model", "resnet20", "--init-from", init, "--epochs", 1,
                      "--batch", BATCH, "--seed", SEED, "--workers", 1, "--threads", 2,
                      "--log-every", 1, *SGD, *flags, *extra)
    d = os.path.join(out, "checkpoints")
    return lines, os.path.join(d, sorted(n for n in os.listdir(d) if n.startswith("step-"))[-1])


def load_strict(path):
    """The twin with stoke's file, after checking every name, dtype and shape
    against the twin's state dict (load_state_dict would convert a float
    num_batches_tracked silently)."""
    state, _ = ref.load_safetensors(path)
    want = twin().state_dict()
    assert sorted(state) == sorted(want), f"{path}: names differ: {sorted(set(state) ^ set(want))}"
    for k, v in want.items():
        assert state[k].dtype == v.dtype and state[k].shape == v.shape, \
            (path, k, state[k].dtype, tuple(state[k].shape), v.dtype, tuple(v.shape))
    return twin(state), state


def deviations(got, want):
    """{name: (kind, deviation)}: parameters relative to the tensor's largest
    value, running statistics absolute below 1 and relative above, counters
    the difference."""
    out = {}
    for k, w in want.items():
        g = got[k].double().numpy()
        w = w.detach().double().numpy()
        if k.endswith("num_batches_tracked"):
            out[k] = ("counter", abs(float(g - w)))
        elif k.endswith(BUFFERS):
            out[k] = ("statistic", float((np.abs(g - w) / np.maximum(np.abs(w), 1)).max()))
        else:
            out[k] = ("weight", float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-12)))
    return out


def worst(devs, kind):
    name = max((k for k in devs if devs[k][0] == kind), key=lambda k: devs[k][1])
    return name, devs[name][1]


def logits(model):
    model.eval()
    with torch.no_grad():
        return torch.cat([model(test_x[i:i + 500].to(next(model.parameters()).dtype))
                          for i in range(0, len(test_x), 500)]).double()


def check_losses(name, got, want, state, smoothing, no_decay):
    rel = np.abs(got - want) / np.abs(want)
    w = int(rel.argmax())
    print(f"{name}: {STEPS} losses, largest relative deviation {rel.max():.2e} at step {w + 1} "
          f"(stoke {got[w]:.6f}, PyTorch {want[w]:.6f}); step 1 {got[0]:.6f} / {want[0]:.6f}, "
          f"step {STEPS} {got[-1]:.6f} / {want[-1]:.6f}")
    if rel.max() <= LOSS_TOL:
        return
    first = int(np.argmax(rel > LOSS_TOL))
    _, _, exact = twin_train(state, smoothing, no_decay, torch.float64)
    d_stoke = np.abs(got - exact) / exact
    d_torch = np.abs(want - exact) / exact
    failed.append(f"{name}: loss of step {first + 1} beyond {LOSS_TOL:g} (stoke {got[first]:.6f}, "
                  f"PyTorch {want[first]:.6f}); against PyTorch in float64 stoke parts by "
                  f"{d_stoke.max():.1e}, PyTorch's float32 by {d_torch.max():.1e}: " +
                  ("stoke deviates" if d_stoke.max() > LOSS_TOL >= d_torch.max() else
                   "PyTorch's float32 deviates too: this start is chaotic here"
                   if d_torch.max() > LOSS_TOL else "each within the tolerance of float64"))


def check_state(name, run, model, steps, weight_tol=WEIGHT_TOL):
    """stoke's checkpoint in run against the twin model after steps steps."""
    loaded, state = load_strict(os.path.join(run, "model.safetensors"))
    devs = deviations(state, model.state_dict())
    wn, wd = worst(devs, "weight")
    sn, sd = worst(devs, "statistic")
    counts = {int(state[k]) for k in state if k.endswith("num_batches_tracked")}
    print(f"{name}: after {steps} steps the largest weight deviation {wd:.1e} ({wn}), running "
          f"statistic {sd:.1e} ({sn}); num_batches_tracked {sorted(counts)}")
    if wd > weight_tol:
        failed.append(f"{name}: after {steps} steps {wn} is {wd:.1e} from PyTorch's (relative "
                      f"to its largest value); beyond {weight_tol:g}: " + top(devs, "weight"))
    if sd > STAT_TOL:
        failed.append(f"{name}: after {steps} steps {sn} is {sd:.1e} from PyTorch's; beyond "
                      f"{STAT_TOL:g}: " + top(devs, "statistic"))
    if counts != {steps}:
        failed.append(f"{name}: num_batches_tracked {sorted(counts)}, PyTorch's {steps}")
    return loaded


def top(devs, kind, n=4):
    ks = sorted((k for k in devs if devs[k][0] == kind), key=lambda k: -devs[k][1])[:n]
    return ", ".join(f"{k} {devs[k][1]:.1e}" for k in ks)


def check_eval(name, lines, loaded, model, smoothing):
    """stoke's test metrics against the twin with stoke's weights, and the
    twin's logits with stoke's weights against those with its own."""
    ep = [l for l in lines if l["type"] == "epoch"][-1]
    assert ep["test_samples"] == NTEST, ep
    mine, theirs = logits(model), logits(loaded)
    dev = float((mine - theirs).abs().max() / mine.abs().max())
    loss = F.cross_entropy(theirs, test_y, label_smoothing=smoothing).item()
    pred = theirs.argmax(1)
    hits = int((pred == test_y).sum())
    top2 = theirs.topk(2, 1).values
    ties = int(((top2[:, 0] - top2[:, 1]) <= 1e-5 * theirs.abs().max()).sum())
    stoke_hits = round(ep["test_acc"] * NTEST)
    print(f"{name}: eval-mode logits of the twin with stoke's weights within {dev:.1e} of its "
          f"own; test loss stoke {ep['test_loss']:.6f}, twin with stoke's weights {loss:.6f}; "
          f"correct stoke {stoke_hits}, twin {hits}/{NTEST} ({ties} near ties)")
    if dev > LOGIT_TOL:
        failed.append(f"{name}: eval-mode logits {dev:.1e} apart (beyond {LOGIT_TOL:g})")
    if abs(loss - ep["test_loss"]) > EVAL_TOL * loss:
        failed.append(f"{name}: stoke's test loss {ep['test_loss']:.6f}, the twin's on the same "
                      f"weights {loss:.6f} (eval mode: the running statistics)")
    if abs(hits - stoke_hits) > ties:
        failed.append(f"{name}: stoke counted {stoke_hits} correct, the twin on the same weights "
                      f"{hits} ({ties} near ties)")


def check_one_step(trained):
    """From a state dict trained by PyTorch: one step of stoke and of PyTorch."""
    path = "torch_trained.safetensors"
    ref.save_safetensors(path, trained.state_dict())
    state, _ = ref.load_safetensors(path)
    model, opt, want = twin_train(state, 0.0, False, torch.float32, steps=1)
    lines, run = stoke("one_step", path, [], "--max-steps", 1)
    got = [l["loss"] for l in lines if l["type"] == "step"]
    rel = abs(got[0] - want[0]) / want[0]
    bufs, _ = ref.load_safetensors(os.path.join(run, "optim.safetensors"))
    grads = {n: ("grad", float((bufs[n + ".momentum_buffer"].double() -
                                opt.state[p]["momentum_buffer"].double()).norm() /
                               opt.state[p]["momentum_buffer"].double().norm()))
             for n, p in model.named_parameters()}
    gn, gd = worst(grads, "grad")
    print(f"from PyTorch's trained state dict (--init-from): step 1 loss stoke {got[0]:.6f} "
          f"PyTorch {want[0]:.6f} ({rel:.1e}); largest gradient deviation {gd:.1e} ({gn})")
    if rel > LOSS_TOL:
        failed.append(f"one step from PyTorch's trained state: loss {got[0]:.6f}, PyTorch's "
                      f"{want[0]:.6f} (the forward pass in training mode)")
    if gd > WEIGHT_TOL:
        failed.append(f"one step from PyTorch's trained state: gradients (momentum buffers) "
                      f"apart beyond {WEIGHT_TOL:g} (L2, relative), the layer nearest the input "
                      f"first to part is where the backward differs: " + top(grads, "grad", 6))
    check_state("one step from PyTorch's trained state", run, model, STEPS + 1)


torch.manual_seed(INIT)
init_state = twin().state_dict()
ref.save_safetensors("init.safetensors", init_state)
for name, flags, smoothing, no_decay in CASES:
    model, _, want = twin_train(init_state, smoothing, no_decay, torch.float32)
    lines, run = stoke(name, "init.safetensors", flags)
    got = np.array([l["loss"] for l in lines if l["type"] == "step"])
    assert len(got) == STEPS, f"{name}: {len(got)} step lines, expected {STEPS}"
    check_losses(name, got, want, init_state, smoothing, no_decay)
    loaded = check_state(name, run, model, STEPS)
    best, _ = load_strict(os.path.join(name, "best.safetensors"))
    assert all(torch.equal(a, b) for a, b in zip(best.state_dict().values(),
                                                  loaded.state_dict().values())), \
        f"{name}: after one epoch best.safetensors should be the checkpoint's model"
    check_eval(name, lines, loaded, model, smoothing)
    if name == "sgd":
        check_one_step(model)

print(f"({time.time() - t0:.1f} s)")
if failed:
    sys.exit("FAIL: resnet20 parts from its PyTorch twin:\n  " + "\n  ".join(failed))
print(f"ok: resnet20 and its PyTorch twin: {STEPS} losses within {LOSS_TOL:g}, weights, running "
      f"statistics, eval-mode logits and test metrics alike, with and without label smoothing "
      f"and decay of norms and biases; stoke's checkpoints load strictly into the twin; "
      f"PyTorch's trained state dict starts a stoke run")
