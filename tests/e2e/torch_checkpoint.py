#!/usr/bin/env python3
"""stoke's checkpoints are PyTorch state dicts: after one epoch of mlp (all
of Fashion-MNIST) and of cnn (the first 12000 training images, to stay
fast), RUN_DIR/best.safetensors and the newest checkpoint's
model.safetensors load into the equivalent torch.nn.Module with
load_state_dict(strict=True), and that module's accuracy on the 10000 test
images equals the test_acc of the last epoch line of metrics.jsonl (at most
2 predictions may differ through float summation order), which counted
10000 samples. And train --init-from accepts DDP-style "module."-prefixed
names: from such a file, the first step's loss is PyTorch's on the same
batch with those weights."""
import os, shutil, struct, subprocess, sys, time
import stoke_test as t  # first: it names the package of a missing numpy
import numpy as np
torch = t.need("torch")  # a missing python3-torch fails, it does not skip
import torch.nn as nn
import torch.nn.functional as F
import torch_ref as ref

SEED, BATCH, MAX_DIFF = 7, 64, 2

tmp = os.environ["STK_TMP"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
t0 = time.time()


full = ref.make_db("db_full")
# cnn: a Fashion-MNIST with the first 12000 training images and the full test set
os.makedirs("fashion_12k")
for part, n in (("train", 12000), ("t10k", None)):
    for kind in ("images-idx3", "labels-idx1"):
        a = t.read_idx(f"{ref.FASHION}/{part}-{kind}-ubyte.gz")
        t.write_idx(f"fashion_12k/{part}-{kind}-ubyte", a[:n] if n else a)
subprocess.run([os.path.join(os.environ["STK_BIN"], "prep"), "--quiet", "fashion_12k",
                "db_12k"], check=True)


def predict(model, x, norm):
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(norm(x[i:i + 1000])) for i in range(0, len(x), 1000)])
    return logits


def newest_checkpoint(run):
    d = os.path.join(run, "checkpoints")
    steps = sorted(n for n in os.listdir(d) if n.startswith("step-"))
    assert steps, f"{d}: no checkpoint"
    return os.path.join(d, steps[-1], "model.safetensors")


for name, db in (("mlp", full), ("cnn", "db_12k")):
    run = f"run_{name}"
    lines = ref.train(db, run, "--model", name, "--epochs", 1, "--batch", BATCH,
                      "--seed", SEED, "--workers", 2)
    last = [l for l in lines if l["type"] == "epoch"][-1]
    assert last["test_samples"] == 10000, last
    x_test, y_test, meta = ref.load_split(db, "test")
    assert len(y_test) == 10000
    norm = ref.normalizer(meta)
    stoke_hits = round(last["test_acc"] * 10000)

    best, _ = ref.load_safetensors(os.path.join(run, "best.safetensors"))
    newest, _ = ref.load_safetensors(newest_checkpoint(run))
    assert best.keys() == newest.keys() and all(torch.equal(best[k], newest[k]) for k in best), \
        "after one epoch, best.safetensors should be the newest checkpoint's model"
    model = ref.MODELS[name](classes=len(meta["classes"]))
    model.load_state_dict(best, strict=True)
    logits = predict(model, x_test, norm)
    hits = int((logits.argmax(1) == torch.from_numpy(y_test)).sum())
    loss = F.cross_entropy(logits, torch.from_numpy(y_test)).item()
    print(f"{name}: stoke test_acc {last['test_acc']:.4f} ({stoke_hits}/10000), PyTorch on "
          f"best.safetensors {hits}/10000: {abs(hits - stoke_hits)} differ; test loss stoke "
          f"{last['test_loss']:.6f} PyTorch {loss:.6f}")
    assert abs(hits - stoke_hits) <= MAX_DIFF, (name, hits, stoke_hits)
    assert abs(loss - last["test_loss"]) <= 1e-4 * last["test_loss"], (name, loss, last["test_loss"])

    # DDP-style names: what torch saves from a wrapper holding the model as .module
    wrapper = nn.Module()
    wrapper.module = model
    prefixed = wrapper.state_dict()
    assert all(k.startswith("module.") for k in prefixed), list(prefixed)
    ref.save_safetensors(f"{name}_module.safetensors", prefixed)
    check = nn.Module()
    check.module = ref.MODELS[name](classes=len(meta["classes"]))
    check.module.load_state_dict(newest, strict=True)
    check.load_state_dict(ref.load_safetensors(f"{name}_module.safetensors")[0], strict=True)

    # train --evaluate: stoke's test accuracy and loss of weights PyTorch
    # saved (these, and a fresh torch initialisation) are PyTorch's
    torch.manual_seed(3)
    fresh = ref.MODELS[name](classes=len(meta["classes"]))
    ref.save_safetensors(f"{name}_fresh.safetensors", fresh.state_dict())
    fl = predict(fresh, x_test, norm)
    wants = {f"{name}_module.safetensors": (hits, loss),
             f"{name}_fresh.safetensors": (
                 int((fl.argmax(1) == torch.from_numpy(y_test)).sum()),
                 F.cross_entropy(fl, torch.from_numpy(y_test)).item())}
    for path, (want_hits, want_loss) in wants.items():
        p = subprocess.run([os.path.join(os.environ["STK_BIN"], "train"), "--db", db,
                            "--model", name, "--evaluate", "--init-from", path, "--quiet"],
                           capture_output=True, text=True)
        words = p.stdout.split()
        assert p.returncode == 0 and "accuracy" in words, (path, p.returncode, p.stdout, p.stderr)
        acc = float(words[words.index("accuracy") + 1].rstrip("%,"))
        got_loss = float(words[words.index("loss") + 1])
        print(f"{name}: train --evaluate {path}: {acc:.2f}% loss {got_loss:.4f}; PyTorch "
              f"{want_hits / 100:.2f}% loss {want_loss:.4f}")
        assert abs(round(acc * 100) - want_hits) <= MAX_DIFF, (path, acc, want_hits)
        assert abs(got_loss - want_loss) <= max(1e-4 * want_loss, 1e-4), (path, got_loss, want_loss)
    assert not os.path.exists("runs"), "train --evaluate wrote its default --out"

    # stoke starts from it: step 1's loss is PyTorch's on the first batch
    x_train, y_train, _ = ref.load_split(db, "train")
    first = np.array(ref.permutation(len(y_train), SEED, 0)[:BATCH])
    model.eval()
    with torch.no_grad():
        want = F.cross_entropy(model(norm(x_train[first])), torch.from_numpy(y_train[first])).item()
    got = {}
    for kind, path in (("module.", f"{name}_module.safetensors"),
                       ("plain", os.path.join(run, "best.safetensors"))):
        l = ref.train(db, f"init_{name}_{kind}", "--model", name, "--init-from", path,
                      "--max-steps", 1, "--log-every", 1, "--no-dropout", "--batch", BATCH,
                      "--seed", SEED, "--workers", 1)
        got[kind] = [x for x in l if x["type"] == "step"][0]["loss"]
    print(f"{name}: --init-from module.-prefixed: step 1 loss {got['module.']:.6f}, plain "
          f"{got['plain']:.6f}, PyTorch {want:.6f}")
    assert got["module."] == got["plain"], got
    assert abs(got["module."] - want) <= 1e-5 * want, (got, want)

    # a name that is neither the parameter's nor "module." + it is refused
    bad = {("model." + k[len("module."):] if k == f"module.{next(iter(best))}" else k): v
           for k, v in prefixed.items()}
    ref.save_safetensors("bad.safetensors", bad)
    p = subprocess.run([os.path.join(os.environ["STK_BIN"], "train"), "--db", db, "--model", name,
                        "--init-from", "bad.safetensors", "--max-steps", "1", "--out", "bad_run",
                        "--quiet"], capture_output=True, text=True)
    assert p.returncode != 0 and f'no tensor "{next(iter(best))}"' in p.stderr, (p.returncode, p.stderr)

print(f"ok: mlp and cnn checkpoints load into PyTorch with the same test accuracy; "
      f"module.-prefixed weights load into train ({time.time() - t0:.1f} s)")
