#!/usr/bin/env python3
"""Every training flag of `train` reaches the trainer and does what
docs/cli.md says: on a tiny IDX dataset (24 training samples of 4x4 pixels,
3 classes, batches of 8: 3 steps an epoch), a linear model started from
weights written here (--init-from) is trained through the command line,
and its last checkpoint (weights and optimizer state) and the lr of every
metrics line must match a reference computed here in float64 from the
documented rules: the sampler of docs/loader.md (stoke_test.permutation,
shared with the PyTorch peer tests), warm-up and the step, cosine, linear
and onecycle schedules, --clip (global L2 norm, applied at every step of
the SGD run and never in the AdamW run), SGD with --momentum, --nesterov
and --weight-decay, AdamW, --label-smoothing (PyTorch's CrossEntropyLoss:
every step's loss, and the test loss, with the same criterion) and
--no-decay-norm-bias (the bias not decayed, the weight decayed). A run
stopped by --max-steps and resumed with --resume auto ends with the same
bytes as an uninterrupted one.
Needs no PyTorch: the reference is numpy."""
import json, os, shutil, struct, subprocess, sys
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np

BIN = os.environ["STK_BIN"]
TR, TE, HW, CLS, BATCH, SEED = 24, 6, 4, 3, 8, 3
STEPS = TR // BATCH


def fail(msg):
    sys.exit("FAIL: " + msg)


def run(*cmd):
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if p.returncode:
        fail(f"{' '.join(map(str, cmd))} exited {p.returncode}:\n{p.stdout}{p.stderr}")
    if "Sanitizer" in p.stderr or "runtime error:" in p.stderr:
        fail(f"sanitizer report from {cmd[0]}:\n{p.stderr}")
    return p


# ---- data ------------------------------------------------------------------

def make_db():
    rng = np.random.default_rng(11)
    os.makedirs("idx", exist_ok=True)
    for prefix, n in (("train", TR), ("t10k", TE)):
        t.write_idx(f"idx/{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, HW, HW)))
        t.write_idx(f"idx/{prefix}-labels-idx1-ubyte", rng.permutation(np.arange(n) % CLS))
    run(f"{BIN}/prep", "--quiet", "idx", "db")
    r = t.formats_reader()
    env, meta = r["open_stoke"]("db")
    # the trainer's transform, in float32: (pixel / 255 - mean) * (1 / std)
    st = meta["splits"]["train"]
    mean, inv = np.float32(st["mean"][0]), np.float32(1) / np.float32(st["std"][0])
    split = {}
    for name, n in (("train", TR), ("test", TE)):
        x = np.stack([r["read_sample"](env, meta, name, i)[1] for i in range(n)])
        y = np.array([r["read_sample"](env, meta, name, i)[0] for i in range(n)])
        xf = (x.reshape(n, -1).astype(np.float32) / np.float32(255) - mean) * inv
        split[name] = (xf.astype(np.float64), y)
    return split


# ---- the reference -----------------------------------------------------------

def onecycle(lr, step, total):
    """OneCycleLR's defaults written out: pct_start 0.3, cos, div_factor 25,
    final_div_factor 1e4, three_phase False."""
    def anneal(a, b, pct):
        return b + (a - b) / 2 * (np.cos(np.pi * pct) + 1)
    up, end = 0.3 * total - 1, total - 1
    if step <= up:
        return anneal(lr / 25, lr, step / up)
    return anneal(lr, lr / 25 / 1e4, (step - up) / (end - up))


def lr_at(o, step, total, epoch):
    if o["schedule"] == "onecycle":
        return onecycle(o["lr"], step, total)
    if step < o["warmup"]:
        return o["lr"] * (step + 1) / o["warmup"]
    if o["schedule"] == "step":
        return o["lr"] * o["gamma"] ** (epoch // o["step_size"])
    if o["schedule"] == "cosine":
        span = total - o["warmup"]
        return o["lr"] * 0.5 * (1 + np.cos(np.pi * min(step - o["warmup"], span) / span))
    if o["schedule"] == "linear":
        span = total - o["warmup"]
        return o["lr"] * (1 - min(step - o["warmup"], span) / span)
    return o["lr"]


def loss_grad(p, xb, yb, eps):
    """PyTorch's CrossEntropyLoss(label_smoothing=eps) of a linear model:
    the mean loss and dloss/dlogits, the target (1 - eps) on the label plus
    eps / classes on every class."""
    z = xb @ p[:CLS * HW * HW].reshape(CLS, -1).T + p[CLS * HW * HW:]
    logp = z - z.max(axis=1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(axis=1, keepdims=True))
    target = (1 - eps) * np.eye(CLS)[yb] + eps / CLS
    loss = -(target * logp).sum(axis=1).mean()
    return loss, (np.exp(logp) - target) / len(yb)


def reference(o, x, y, w, b):
    """Weights, optimizer state, each step's lr, gradient norm and loss."""
    p = np.concatenate([w.ravel(), b])
    s1, s2 = np.zeros_like(p), np.zeros_like(p)
    total, step, lrs, norms, losses = STEPS * o["epochs"], 0, [], [], []
    # --no-decay-norm-bias: the bias (head.bias) is not decayed
    decay = np.full_like(p, o["weight_decay"])
    if o.get("no_decay_norm_bias"):
        decay[CLS * HW * HW:] = 0
    for epoch in range(o["epochs"]):
        idx = t.permutation(TR, SEED, epoch)
        for k in range(STEPS):
            rows = idx[k * BATCH:(k + 1) * BATCH]
            xb, yb = x[rows], y[rows]
            loss, d = loss_grad(p, xb, yb, o.get("label_smoothing", 0))
            losses.append(loss)
            g = np.concatenate([(d.T @ xb).ravel(), d.sum(axis=0)])
            norm = np.sqrt((g * g).sum())
            norms.append(norm)
            if o.get("clip", 0) > 0 and norm > o["clip"]:
                g = g * (o["clip"] / (norm + 1e-6))
            lr = lr_at(o, step, total, epoch)
            lrs.append(lr)
            if o["optim"] == "sgd":
                dd = g + decay * p
                s1 = dd if step == 0 else o["momentum"] * s1 + dd
                p = p - lr * (dd + o["momentum"] * s1 if o.get("nesterov") else s1)
            else:
                t_ = step + 1
                p = p * (1 - lr * decay)
                s1 = 0.9 * s1 + 0.1 * g
                s2 = 0.999 * s2 + 0.001 * g * g
                p = p - lr * (s1 / (1 - 0.9 ** t_)) / (np.sqrt(s2 / (1 - 0.999 ** t_)) + 1e-8)
            step += 1
    return p, s1, s2, lrs, norms, losses


# ---- runs --------------------------------------------------------------------

def flags(o):
    f = ["--optim", o["optim"], "--lr", o["lr"], "--weight-decay", o["weight_decay"],
         "--schedule", o["schedule"], "--warmup", o["warmup"], "--epochs", o["epochs"]]
    if o["optim"] == "sgd":
        f += ["--momentum", o["momentum"]] + (["--nesterov"] if o.get("nesterov") else [])
    if o["schedule"] == "step":
        f += ["--step-size", o["step_size"], "--gamma", o["gamma"]]
    if o.get("clip"):
        f += ["--clip", o["clip"]]
    if o.get("label_smoothing"):
        f += ["--label-smoothing", o["label_smoothing"]]
    if o.get("no_decay_norm_bias"):
        f += ["--no-decay-norm-bias"]
    if o["schedule"] == "onecycle":  # its own warm-up: --warmup is refused
        f.remove("--warmup")
        f.remove(o["warmup"])
    return f


def train(out, o, *extra):
    run(f"{BIN}/train", "--db", "db", "--model", "linear.txt", "--init-from", "init.safetensors",
        "--batch", BATCH, "--seed", SEED, "--workers", 1, "--threads", 1, "--no-dropout",
        "--quiet", "--log-every", 1, "--out", out, *flags(o), *extra)


def close(name, got, want):
    scale = np.abs(want).max()
    bad = np.abs(got - want) > 3e-5 * np.abs(want) + 3e-6 * scale
    if bad.any():
        i = int(np.argmax(bad))
        fail(f"{name}[{i}] is {got[i]:.9g}, the reference {want[i]:.9g}")


def check(out, o, split, w, b):
    x, y = split["train"]
    p, s1, s2, lrs, norms, losses = reference(o, x, y, w, b)
    ck = f"{out}/checkpoints/step-{STEPS * o['epochs']:08d}"
    model = {k: v.astype(np.float64) for k, v in
             t.load_safetensors(f"{ck}/model.safetensors")[0].items()}
    optim = {k: v.astype(np.float64) for k, v in
             t.load_safetensors(f"{ck}/optim.safetensors")[0].items()}
    close("weights", np.concatenate([model["head.weight"].ravel(), model["head.bias"]]), p)
    names = ["momentum_buffer"] if o["optim"] == "sgd" else ["exp_avg", "exp_avg_sq"]
    for name, want in zip(names, (s1, s2)):
        got = np.concatenate([optim[f"head.weight.{name}"].ravel(), optim[f"head.bias.{name}"]])
        close(name, got, want)
    lines = [json.loads(l) for l in open(f"{out}/metrics.jsonl")]
    got_lr = [l["lr"] for l in lines if l["type"] == "step"]
    if len(got_lr) != len(lrs) or not np.allclose(got_lr, lrs, rtol=2e-5, atol=1e-9):
        fail(f"{out}: lr per step {got_lr}, the reference {lrs}")
    # every step's loss (lines of one step each, printed to 6 decimals)
    got_loss = [l["loss"] for l in lines if l["type"] == "step"]
    if not np.allclose(got_loss, losses, rtol=1e-5, atol=2e-6):
        fail(f"{out}: loss per step {got_loss}, the reference {losses}")
    # the test loss of the last epoch: the same criterion on the final weights
    test_loss = loss_grad(p, *split["test"], o.get("label_smoothing", 0))[0]
    got = [l for l in lines if l["type"] == "epoch"][-1]["test_loss"]
    if not np.isclose(got, test_loss, rtol=1e-5, atol=2e-6):
        fail(f"{out}: test loss {got}, the reference {test_loss}")
    return norms


def main():
    tmp = os.environ["STK_TMP"]
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    os.chdir(tmp)
    split = make_db()
    with open("linear.txt", "w") as f:
        f.write("flatten\nhead: linear classes\n")
    rng = np.random.default_rng(5)
    w = rng.uniform(-0.3, 0.3, (CLS, HW * HW))
    b = rng.uniform(-0.3, 0.3, CLS)
    t.save_safetensors("init.safetensors", {"head.weight": w, "head.bias": b})
    w, b = w.astype(np.float32).astype(np.float64), b.astype(np.float32).astype(np.float64)

    sgd = {"optim": "sgd", "lr": 0.2, "momentum": 0.8, "nesterov": True, "weight_decay": 0.05,
           "clip": 0.05, "schedule": "step", "step_size": 2, "gamma": 0.5, "warmup": 2,
           "epochs": 5}
    norms = check_run("sgd", sgd, split, w, b)
    if min(norms) <= 2 * sgd["clip"]:
        fail(f"the SGD run must clip every step: smallest gradient norm {min(norms)}")
    print(f"ok: SGD --momentum --nesterov --weight-decay --clip (every step) --schedule step "
          f"--step-size --gamma --warmup: {STEPS * sgd['epochs']} steps as the reference")

    adamw = {"optim": "adamw", "lr": 0.05, "weight_decay": 0.1, "clip": 1000,
             "schedule": "cosine", "warmup": 3, "epochs": 4}
    norms = check_run("adamw", adamw, split, w, b)
    if max(norms) >= adamw["clip"]:
        fail(f"the AdamW run must never clip: largest gradient norm {max(norms)}")
    print(f"ok: AdamW --weight-decay --clip (never reached) --schedule cosine --warmup: "
          f"{STEPS * adamw['epochs']} steps as the reference")

    # the recipe flags: label smoothing in loss, gradient and test loss; no
    # decay on the bias; the linear and onecycle schedules
    sgd_ls = dict(sgd, label_smoothing=0.2, no_decay_norm_bias=True, schedule="linear",
                  weight_decay=0.5, clip=0)
    check_run("sgd-ls", sgd_ls, split, w, b)
    print(f"ok: SGD --label-smoothing 0.2 --no-decay-norm-bias --schedule linear --warmup: "
          f"{STEPS * sgd_ls['epochs']} steps, their losses and the test loss as the reference")
    adamw_ls = dict(adamw, label_smoothing=0.1, no_decay_norm_bias=True,
                    schedule="onecycle", weight_decay=0.5)
    check_run("adamw-ls", adamw_ls, split, w, b)
    print(f"ok: AdamW --label-smoothing 0.1 --no-decay-norm-bias --schedule onecycle: "
          f"{STEPS * adamw_ls['epochs']} steps, their losses and the test loss as the reference")

    # stopped mid-epoch, resumed: the same bytes as the uninterrupted run
    for name, o in (("sgd", sgd), ("adamw", adamw)):
        train(f"{name}-parts", o, "--max-steps", 4)
        train(f"{name}-parts", o, "--resume", "auto")
        for f in ("model", "optim"):
            ck = f"checkpoints/step-{STEPS * o['epochs']:08d}/{f}.safetensors"
            if open(f"{name}/{ck}", "rb").read() != open(f"{name}-parts/{ck}", "rb").read():
                fail(f"{name}: --max-steps 4 then --resume auto ends with another {ck}")
    print("ok: --max-steps 4 then --resume auto ends with the bytes of the uninterrupted "
          "run (SGD and AdamW)")


def check_run(name, o, split, w, b):
    train(name, o)
    return check(name, o, split, w, b)


if __name__ == "__main__":
    main()
