#!/usr/bin/env python3
"""From the same initial weights (written by PyTorch as safetensors, loaded
with --init-from) and the same batches (the sampler of docs/loader.md,
reimplemented in torch_ref.py), with dropout off, stoke's first 50 training
losses of cnn and mlp, with SGD + momentum and with AdamW, match PyTorch's
(float32, one thread) within 1e-4 relative. Prints the largest deviation of
each run.

Most initialisations make 50 steps of the cnn chaotic: a ReLU or max-pool
decision flips on a rounding difference and the losses part by 1e-4 to
1e-2, PyTorch against itself included. So each case's init is one where
PyTorch agrees with itself within 1e-5 when only the rounding changes:
float32 against float64, the batch as two micro-batches with their
gradients added (another summation order of every weight gradient, as
stoke's cache-sized pieces are), and convolutions without oneDNN. A
deviation beyond 1e-4 is then stoke's. The inits below were found that way
(for torch 1.13). For the cnn, 18 of the 22 inits 100-121 failed these
checks with SGD at lr 0.01, and all 35 of 100-134 with AdamW at lr 1e-3
(init 100, which this test used before, among them: PyTorch with two
micro-batches parts from itself by 1.6e-4 and 7.8e-4); with AdamW at lr
1e-4, 4 of the 11 inits 100-110 pass. Which ones depends on the CPU (its
BLAS kernels round differently): on this project's 2-CPU VM (torch
1.13.0a0) AdamW's init 100 parted from float64 by 1.2e-4, and of 100-106
only 102, 103 and 104 held. So each case lists candidate inits and uses the
first that passes PyTorch's own checks on the machine at hand; the check of
stoke against PyTorch is the same whichever it is."""
import copy, os, shutil, sys, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
torch = t.need("torch")  # a missing python3-torch fails, it does not skip
import torch.nn.functional as F
import torch_ref as ref

STEPS, BATCH, SEED, TOL, REF_TOL = 50, 64, 5, 1e-4, 1e-5
SGD = (["--optim", "sgd", "--lr", "0.01", "--momentum", "0.9"],
       lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))


def adamw(lr):
    return (["--optim", "adamw", "--lr", str(lr), "--weight-decay", "0.01"],
            lambda p: torch.optim.AdamW(p, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                        weight_decay=0.01))


# (model, optimizer, torch.manual_seed of the initial weights, settings)
CASES = [("cnn", "sgd", (110, 104, 116), SGD),
         ("cnn", "adamw", (104, 102, 103, 100), adamw(1e-4)),
         ("mlp", "sgd", (100, 101, 102), SGD),
         ("mlp", "adamw", (100, 101, 102), adamw(1e-3))]
# The built-in cnn without its dropout layers, as a model file (docs/models.md):
# used only to narrow down a cnn failure.
CNN_NO_DROPOUT = """conv1: conv 32 3
pool 2
relu
conv2: conv 64 3
pool 2
relu
flatten
fc1: linear 500
relu
fc2: linear classes
"""

tmp = os.environ["STK_TMP"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
torch.set_num_threads(1)
t0 = time.time()

db = ref.make_db("db")
x_train, y_train, meta = ref.load_split(db, "train")
norm = ref.normalizer(meta)
perm = ref.permutation(len(y_train), SEED, 0)
batches = []
for k in range(STEPS):
    idx = np.array(perm[k * BATCH:(k + 1) * BATCH])
    batches.append((norm(x_train[idx]), torch.from_numpy(y_train[idx])))


def torch_losses(model, make_opt, dtype, split=1, mkldnn=True):
    """PyTorch's losses; split > 1 runs each batch as that many micro-batches
    with their gradients added, mkldnn=False its convolutions without
    oneDNN (im2col + BLAS): the same training, other roundings."""
    model = copy.deepcopy(model).to(dtype)
    opt = make_opt(model.parameters())
    model.train()
    out = []
    with torch.backends.mkldnn.flags(enabled=mkldnn):
        for x, y in batches:
            opt.zero_grad()
            total = 0.0
            for xs, ys in zip(x.chunk(split), y.chunk(split)):
                loss = F.cross_entropy(model(xs.to(dtype)), ys) * (len(ys) / len(y))
                loss.backward()
                total += loss.item()
            opt.step()
            out.append(total)
    return np.array(out)


def stoke_losses(model_arg, init, flags, out):
    lines = ref.train(db, out, "--model", model_arg, "--init-from", init,
                      "--no-dropout", "--schedule", "constant", "--warmup", "0",
                      "--log-every", "1", "--max-steps", STEPS, "--batch", BATCH,
                      "--workers", "1", "--threads", "1", "--seed", SEED, *flags)
    steps = [l for l in lines if l["type"] == "step"]
    assert [l["step"] for l in steps] == list(range(1, STEPS + 1)), [l["step"] for l in steps]
    return np.array([l["loss"] for l in steps])


def well_conditioned(name, oname, seed, make_opt):
    """PyTorch's float32 losses from init seed, the init file, and how far
    PyTorch parts from itself under other roundings; None when that is
    beyond REF_TOL (a chaotic start: no comparison can be made from it)."""
    torch.manual_seed(seed)
    model = ref.MODELS[name](classes=len(meta["classes"]), dropout=False)
    init = f"init_{name}_{seed}.safetensors"
    ref.save_safetensors(init, model.state_dict())
    want = torch_losses(model, make_opt, torch.float32)
    spread = 0.0
    for what, kw in (("float64", {"dtype": torch.float64}),
                     ("two micro-batches", {"split": 2}),
                     ("no oneDNN", {"mkldnn": False})):
        other = torch_losses(model, make_opt, **{"dtype": torch.float32, **kw})
        dev = np.abs(want - other) / np.abs(other)
        if dev.max() > REF_TOL:
            print(f"note: {name}/{oname} from init {seed} is chaotic here: PyTorch "
                  f"float32 and {what} differ by {dev.max():.1e} (step "
                  f"{dev.argmax() + 1}); trying the next init")
            return None
        spread = max(spread, dev.max())
    return want, init, spread


failed = []
for name, oname, seeds, (flags, make_opt) in CASES:
    found = None
    for seed in seeds:
        found = well_conditioned(name, oname, seed, make_opt)
        if found:
            break
    assert found, (f"test setup: {name}/{oname} is chaotic from every init of "
                   f"{seeds} on this machine; add candidates")
    want, init, spread = found
    got = stoke_losses(name, init, flags, f"run_{name}_{oname}")
    rel = np.abs(got - want) / np.abs(want)
    w = int(rel.argmax())
    print(f"{name}/{oname}: max relative deviation {rel.max():.2e} at step {w + 1} "
          f"(stoke {got[w]:.6f}, torch {want[w]:.6f}); PyTorch against its own "
          f"roundings {spread:.1e}; step 1: stoke {got[0]:.6f} torch {want[0]:.6f}; "
          f"step {STEPS}: stoke {got[-1]:.6f} torch {want[-1]:.6f}")
    if rel.max() <= TOL:
        continue
    first = int(np.argmax(rel > TOL))
    msg = (f"{name}/{oname}: step {first + 1} is the first beyond {TOL:g} (stoke "
           f"{got[first]:.6f}, torch {want[first]:.6f}, rel {rel[first]:.2e}); step 1 "
           f"{'agrees' if rel[0] <= TOL else 'differs'}, so "
           f"{'the update (gradient or optimizer)' if rel[0] <= TOL else 'the forward pass or the batch'} differs")
    if name == "cnn":
        open("cnn_no_dropout.model", "w").write(CNN_NO_DROPOUT)
        alt = stoke_losses("cnn_no_dropout.model", init, flags, f"run_cnn_nodrop_{oname}")
        d = np.max(np.abs(alt - want) / np.abs(want))
        msg += (f"\n    the same network without dropout layers (a model file) deviates "
                f"{d:.2e}: " + ("so --no-dropout does not switch the dropout layers fully "
                                "off (the backward pass still applies them?)" if d <= TOL
                                else "so something besides the dropout layers differs"))
    failed.append(msg)

print(f"({time.time() - t0:.1f} s)")
if failed:
    sys.exit("FAIL: stoke's losses differ from PyTorch's:\n  " + "\n  ".join(failed))
print(f"ok: cnn and mlp x sgd and adamw: {STEPS} losses within {TOL:g} relative of PyTorch's")
