#!/usr/bin/env python3
"""The recipe features of `train` over real runs, on train_options' tiny
IDX dataset (24 training samples, batches of 8: 3 steps an epoch) and its
linear model:

- the learning rate of every step (metrics.jsonl, --log-every 1) of the
  linear, cosine and onecycle schedules against PyTorch's own schedulers
  stepped alike: SequentialLR(LinearLR warm-up, LinearLR to 0 or
  CosineAnnealingLR) and OneCycleLR(max_lr, total_steps,
  cycle_momentum=False), also with --accum 2 (fewer, larger steps);
- a small conv + batchnorm network (2-d and 1-d batchnorm, a dropout
  that --no-dropout makes the identity, a conv without bias) trained by
  SGD with --weight-decay --no-decay-norm-bias --label-smoothing against
  its PyTorch twin: two param groups (weight_decay 0 for biases and
  batchnorm weights), CrossEntropyLoss(label_smoothing), the model in
  training mode (batch statistics) at every step and in eval mode for the
  test loss: every step's loss, the weights, the running statistics and
  the test loss alike;
- RUN_DIR/curves.svg: after a run stopped by --max-steps in its third
  epoch it draws the two finished epochs; after --resume auto all of them
  (the earlier ones kept), with metrics.jsonl lines that do not parse
  skipped and a later line of an epoch replacing an earlier one. The SVG
  parses as XML, is self-contained, has a polyline per series with a point
  per epoch (per logged step for the lr), and each polyline is the series'
  values under one linear map (so it draws the right numbers).
"""
import json, os, shutil, sys
import xml.etree.ElementTree as ET
import stoke_test as t
import train_options as opts
import numpy as np

torch = t.need("torch")

BIN, STEPS, run, fail = opts.BIN, opts.STEPS, opts.run, opts.fail
SVG = "{http://www.w3.org/2000/svg}"


def train(out, *flags):
    return run(f"{BIN}/train", "--db", "db", "--model", "linear.txt", "--init-from",
        "init.safetensors", "--batch", opts.BATCH, "--seed", opts.SEED, "--workers", 1,
        "--threads", 1, "--quiet", "--log-every", 1, "--out", out, *flags)


def lines(out):
    """The lines of metrics.jsonl that parse (check_curves adds some that do not)."""
    out_ = []
    for l in open(f"{out}/metrics.jsonl", errors="replace"):
        try:
            out_.append(json.loads(l))
        except ValueError:
            pass
    return [l for l in out_ if isinstance(l, dict)]


# ---- schedules against torch.optim.lr_scheduler ------------------------------

def torch_lrs(schedule, lr, warmup, total):
    """The lr of each of total optimizer steps, as PyTorch's schedulers give it."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    S = torch.optim.lr_scheduler
    if schedule == "onecycle":
        sched = S.OneCycleLR(opt, max_lr=lr, total_steps=total, cycle_momentum=False)
    else:
        # stoke's warm-up: step s uses lr * (s + 1) / warmup
        ramp = S.LinearLR(opt, start_factor=1 / warmup, end_factor=1, total_iters=warmup - 1)
        decay = (S.LinearLR(opt, start_factor=1, end_factor=0, total_iters=total - warmup)
                 if schedule == "linear" else S.CosineAnnealingLR(opt, T_max=total - warmup))
        sched = S.SequentialLR(opt, [ramp, decay], milestones=[warmup])
    out = []
    for _ in range(total):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def check_schedules():
    epochs, lr, warmup = 7, 0.3, 4
    for schedule, accum in (("linear", 1), ("cosine", 1), ("onecycle", 1), ("onecycle", 2),
                            ("linear", 2)):
        out = f"sched-{schedule}-{accum}"
        flags = ["--optim", "sgd", "--lr", lr, "--epochs", epochs, "--schedule", schedule,
                 "--accum", accum]
        if schedule != "onecycle":
            flags += ["--warmup", warmup]
        train(out, *flags)
        per = -(-STEPS // accum)  # steps an epoch
        want = torch_lrs(schedule, lr, warmup, per * epochs)
        got = [l["lr"] for l in lines(out) if l["type"] == "step"]
        if len(got) != len(want) or not np.allclose(got, want, rtol=2e-5, atol=1e-9):
            fail(f"--schedule {schedule} --accum {accum}: lr per step {got}, "
                 f"PyTorch's {want}")
        ends = [l["lr"] for l in lines(out) if l["type"] == "epoch"]
        if not np.allclose(ends, want[per - 1::per], rtol=2e-5, atol=1e-9):
            fail(f"--schedule {schedule}: the epoch lines' lr {ends}, PyTorch's "
                 f"{want[per - 1::per]}")
        print(f"ok: --schedule {schedule} --accum {accum}: the lr of all {len(want)} steps "
              f"as PyTorch's scheduler")


# ---- batchnorm, no decay on norms and biases, label smoothing: PyTorch's twin ----

BN_MODEL = """conv1: conv 4 3 pad=1 bias=false
bn1: batchnorm
relu
conv2: conv 5 3 pad=1
dropout 0.5
globalpool
flatten
fc1: linear 6
bn2: batchnorm
relu
fc: linear classes
"""


class Twin(torch.nn.Module):
    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 5, 3, padding=1)
        self.fc1 = nn.Linear(5, 6)
        self.bn2 = nn.BatchNorm1d(6)
        self.fc = nn.Linear(6, opts.CLS)

    def forward(self, x):
        x = self.conv2(torch.relu(self.bn1(self.conv1(x)))).mean(dim=(2, 3))
        return self.fc(torch.relu(self.bn2(self.fc1(x))))


def check_batchnorm_recipe(split):
    torch.manual_seed(7)
    twin = Twin().double()
    with open("bn.txt", "w") as f:
        f.write(BN_MODEL)
    # float32 weights, then float64 in the twin: the reference is exact
    init = {k: v.float().numpy() for k, v in twin.state_dict().items()
            if not k.endswith(("running_mean", "running_var", "num_batches_tracked"))}
    t.save_safetensors("bn-init.safetensors", init)
    twin.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in init.items()},
                         strict=False)
    lr, mom, wd, eps, epochs = 0.1, 0.9, 0.05, 0.1, 2
    no_decay = [p for n, p in twin.named_parameters() if n.endswith(".bias") or ".bn" in "." + n]
    decay = [p for n, p in twin.named_parameters() if all(p is not q for q in no_decay)]
    if len(decay) != 4 or len(no_decay) != 7:
        fail(f"the twin's groups: {len(decay)} decayed, {len(no_decay)} not")
    opt = torch.optim.SGD([{"params": decay}, {"params": no_decay, "weight_decay": 0}],
                          lr=lr, momentum=mom, weight_decay=wd)
    crit = torch.nn.CrossEntropyLoss(label_smoothing=eps)
    x, y = split["train"]
    x = torch.from_numpy(x.reshape(-1, 1, opts.HW, opts.HW))
    losses = []
    twin.train()
    for epoch in range(epochs):
        idx = t.permutation(opts.TR, opts.SEED, epoch)
        for k in range(STEPS):
            rows = idx[k * opts.BATCH:(k + 1) * opts.BATCH]
            loss = crit(twin(x[rows]), torch.from_numpy(y[rows]).long())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    twin.eval()
    xt, yt = split["test"]
    with torch.no_grad():
        test_loss = crit(twin(torch.from_numpy(xt.reshape(-1, 1, opts.HW, opts.HW))),
                         torch.from_numpy(yt).long()).item()
    run(f"{BIN}/train", "--db", "db", "--model", "bn.txt", "--init-from", "bn-init.safetensors",
        "--batch", opts.BATCH, "--seed", opts.SEED, "--workers", 1, "--threads", 1, "--quiet",
        "--log-every", 1, "--out", "bn", "--optim", "sgd", "--lr", lr, "--momentum", mom,
        "--weight-decay", wd, "--no-decay-norm-bias", "--label-smoothing", eps,
        "--schedule", "constant", "--warmup", 0, "--no-dropout", "--epochs", epochs)
    got = [l["loss"] for l in lines("bn") if l["type"] == "step"]
    if not np.allclose(got, losses, rtol=2e-5, atol=2e-6):
        fail(f"batchnorm recipe: loss per step {got}, PyTorch's {losses}")
    got_test = [l for l in lines("bn") if l["type"] == "epoch"][-1]["test_loss"]
    if not np.isclose(got_test, test_loss, rtol=2e-5, atol=2e-6):
        fail(f"batchnorm recipe: test loss (eval mode) {got_test}, PyTorch's {test_loss}")
    ck = t.load_safetensors(f"bn/checkpoints/step-{STEPS * epochs:08d}/model.safetensors")[0]
    worst = 0
    for name, want in twin.state_dict().items():
        want = want.numpy().astype(np.float64)
        have = ck[name].astype(np.float64)
        err = np.abs(have - want).max() / (np.abs(want).max() + 1e-3)
        worst = max(worst, err)
        if err > 2e-5:
            fail(f"batchnorm recipe: {name} differs from PyTorch's by {err:.2e} "
                 f"(relative to its largest value)\n{have}\n{want}")
    print(f"ok: conv + batchnorm 2-d/1-d, SGD --no-decay-norm-bias --label-smoothing "
          f"--no-dropout: {len(losses)} losses, weights and running statistics and the "
          f"eval-mode test loss as PyTorch's two param groups (largest difference "
          f"{worst:.1e})")


# ---- curves.svg ----------------------------------------------------------------

def polylines(path):
    """{id: [(x, y), ...]} of an SVG that must be self-contained."""
    text = open(path).read()
    for bad in ("<script", "href", "url(", "@import", "@font-face"):
        if bad in text:
            fail(f"{path} is not self-contained: it holds {bad!r}")
    root = ET.fromstring(text)  # raises (fails the test) if it is no XML
    if root.tag != SVG + "svg":
        fail(f"{path}: the root is {root.tag}, not svg")
    words = " ".join(e.text or "" for e in root.iter(SVG + "text"))
    for w in ("loss", "accuracy", "learning rate", "epoch", "train", "test"):
        if w not in words:
            fail(f"{path}: no text {w!r} (titles, axis labels, legend)")
    out = {}
    for e in root.iter(SVG + "polyline"):
        if e.get("id") in out:
            fail(f"{path}: two polylines {e.get('id')}")
        pts = [tuple(map(float, p.split(","))) for p in e.get("points").split()]
        out[e.get("id")] = pts
    return out


def check_series(path, name, pts, xs, values):
    """The points are at xs, and their heights one linear map of values
    (greater values higher)."""
    if len(pts) != len(values):
        fail(f"{path}: {name} has {len(pts)} points, the metrics {len(values)} values")
    px, py = np.array(pts).T
    if len(values) > 1:
        a, b = np.polyfit(xs, px, 1)
        if a <= 0 or np.abs(a * np.array(xs) + b - px).max() > 0.02:
            fail(f"{path}: {name}'s x coordinates {list(px)} are not epochs {xs}")
    if len(set(values)) > 1:
        a, b = np.polyfit(values, py, 1)
        worst = np.abs(a * np.array(values) + b - py).max()
        if a >= 0 or worst > 0.05:
            fail(f"{path}: {name}'s heights {list(py)} do not draw {values} "
                 f"(off by {worst:.3f} px)")


def check_svg(out, epochs):
    path = f"{out}/curves.svg"
    if os.path.exists(path + ".tmp"):
        fail(f"{path}.tmp left behind")
    series = polylines(path)
    ep = {}
    for l in lines(out):  # the last line of an epoch wins
        if l.get("type") == "epoch":
            ep[l["epoch"]] = l
    if sorted(ep) != list(range(1, epochs + 1)):
        fail(f"{out}/metrics.jsonl: epochs {sorted(ep)}, expected 1..{epochs}")
    xs = list(range(1, epochs + 1))
    for name in ("train_loss", "test_loss", "train_acc", "test_acc"):
        if name not in series:
            fail(f"{path}: no polyline {name} (has {sorted(series)})")
        check_series(path, name, series[name], xs, [ep[e][name] for e in xs])
    steps = {}
    for l in lines(out):
        if l.get("type") == "step" and l["step"] <= ep[epochs]["step"]:
            steps[l["step"]] = l["lr"]
    check_series(path, "lr", series["lr"], [s / STEPS for s in sorted(steps)],
                 [steps[s] for s in sorted(steps)])
    return series


def check_curves():
    flags = ["--optim", "sgd", "--lr", 0.5, "--epochs", 5, "--schedule", "onecycle"]
    train("curves", *flags, "--max-steps", 2 * STEPS + 1)  # stops in epoch 3
    s = check_svg("curves", 2)
    print(f"ok: curves.svg after 2 of 5 epochs (stopped in the third): "
          f"{len(s['train_loss'])} points a series, {len(s['lr'])} lr points")
    # what a resume must read past: a torn line, a line of another kind, and
    # epoch 2 written again (as by a run killed between its epoch line and
    # its checkpoint), whose values replace the first ones
    with open("curves/metrics.jsonl", "a") as f:
        again = [l for l in lines("curves") if l["type"] == "epoch"][-1]
        again["train_loss"] *= 0.5
        again["test_acc"] = 0.125
        f.write('{"type":"epoch","epoch":\n[1,2]\n\x00garbage\n' + json.dumps(again) + "\n")
    train("curves", *flags, "--resume", "auto")
    check_svg("curves", 5)
    # a FIFO where curves.svg or its temporary file go never blocks a run
    # (resumed from epoch 5 for a sixth)
    shutil.copytree("curves/checkpoints", "curves-ck")
    for name in ("curves.svg", "curves.svg.tmp"):
        shutil.rmtree("curves/checkpoints")
        shutil.copytree("curves-ck", "curves/checkpoints")
        os.remove("curves/curves.svg")
        os.mkfifo(f"curves/{name}")
        train("curves", *flags, "--epochs", 6, "--resume", "auto")
        if not os.path.isfile("curves/curves.svg") or os.path.exists("curves/curves.svg.tmp"):
            fail(f"a FIFO at {name}: curves.svg is not a regular file, or the .tmp stayed")
    # a picture that cannot be drawn (a directory where its temporary file
    # goes) is a warning: the epoch is trained and checkpointed all the same
    shutil.rmtree("curves/checkpoints")
    shutil.copytree("curves-ck", "curves/checkpoints")
    if os.path.exists("curves/curves.svg.tmp"):
        os.remove("curves/curves.svg.tmp")
    os.makedirs("curves/curves.svg.tmp/x")
    p = train("curves", *flags, "--epochs", 6, "--resume", "auto")
    if "warning: curves.svg not drawn" not in p.stderr or "curves.svg.tmp" not in p.stderr:
        fail(f"no warning naming curves.svg.tmp when it cannot be written:\n{p.stderr}")
    if not any(l.get("type") == "epoch" and l["epoch"] == 6 for l in lines("curves")) or \
            not any(d.startswith("step-") and int(d[5:]) >= 6 * STEPS
                    for d in os.listdir("curves/checkpoints")):
        fail("an undrawable curves.svg stopped the run before epoch 6's checkpoint: "
             f"{sorted(os.listdir('curves/checkpoints'))}")
    print(f"ok: curves.svg after --resume auto: all 5 epochs (the first 2 kept, epoch 2 "
          f"as its later line), lines that do not parse skipped; a FIFO at curves.svg or its .tmp "
          f"never blocks; an undrawable one is a warning, the epoch still checkpointed")


def main():
    tmp = os.environ["STK_TMP"]
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    os.chdir(tmp)
    split = opts.make_db()
    with open("linear.txt", "w") as f:
        f.write("flatten\nhead: linear classes\n")
    rng = np.random.default_rng(5)
    t.save_safetensors("init.safetensors",
                       {"head.weight": rng.uniform(-0.3, 0.3, (opts.CLS, opts.HW * opts.HW)),
                        "head.bias": rng.uniform(-0.3, 0.3, opts.CLS)})
    check_schedules()
    check_batchnorm_recipe(split)
    check_curves()


if __name__ == "__main__":
    main()
