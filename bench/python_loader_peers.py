#!/usr/bin/python3
"""The Python side of bench/python_loader_bench.sh (issue 16): the stoke
package's Loader against torch.utils.data.DataLoader set-ups, on the train
split of a stoke database.

    python_loader_peers.py make DB WORK
    python_loader_peers.py check DB WORK
    python_loader_peers.py iter TOOL WORKERS DB WORK [--batch 256] [--seconds 2] [--seed 0]
    python_loader_peers.py train TOOL WORKERS DB WORK [--batch 128] [--steps 300]
                           [--warmup 20] [--threads 2] [--seed 0]
    python_loader_peers.py first TOOL WORKERS DB WORK [--batch 256]

make   writes the train split of DB (read through stoke.open) under WORK in
       the "preprocess once" forms the DataLoader peers read:
         peer-pkl/train/<i>.pkl  one pickle((array, label)) per sample
         peer-lmdb/              python3-lmdb, pickle((array, label)) values
                                 (bench/loader_peers.py writes both)
         peer-array.pkl          one pickle((images, labels)): the whole
                                 split as a uint8 (N, C, H, W) array
       Each is kept when already there.
check  compares every 7th sample of each peer with DB.
iter   whole epochs of TOOL, until --seconds have passed (at least one);
       one JSON line: samples/s from before the loader is made to the last
       batch, the time to the first batch, epochs, samples.
train  a PyTorch training loop, tests/e2e/torch_ref.py's cnn, SGD (lr 0.02,
       momentum 0.9), torch.set_num_threads(--threads), batches normalised
       as stoke's trainer does; --warmup steps, then --steps timed. One JSON
       line: stall = time in next() / whole step time over the timed steps,
       samples/s of the loop, the longest wait.
first  a fresh `/usr/bin/python3 -c` process that times from before the
       import of its loader (stoke, or torch for the peers) to the first
       batch in hand; one JSON line, with the child's whole wall time.

TOOL:
  stoke        stoke.Loader(DB, batch_size, workers=WORKERS): NumPy batches
  stoke-torch  the same, as_torch=True (uint8 and int64 tensors)
  pickle       DataLoader over peer-pkl (each __getitem__ opens and unpickles
               a file: loader_peers.py's PickleDataset)
  lmdb         DataLoader over peer-lmdb (loader_peers.py's LmdbDataset: the
               environment opened lazily in each worker)
  array        DataLoader over peer-array.pkl, unpickled into memory when the
               dataset is made (not timed); __getitem__ = (images[i], label)
  dataset      DataLoader over the stoke package's map-style dataset,
               stoke.open(DB)["train"] (not a peer: what a user gets by
               swapping only the dataset)
  memory       (train only) no loader: the split in a uint8 tensor, each
               batch gathered by a random index in the loop, as
               bench/train_peers.py does; the step time without a loader
DataLoader: shuffle=True, num_workers=WORKERS, pin_memory=False (no GPU),
persistent_workers=False (the defaults). The stoke package is imported from
PYTHONPATH (build/python). Run with Debian's /usr/bin/python3.
"""
import argparse
import json
import os
import pickle
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)

PEERS = ("pickle", "lmdb", "array")


def paths(work):
    return {"pickle": os.path.join(work, "peer-pkl"),
            "lmdb": os.path.join(work, "peer-lmdb"),
            "array": os.path.join(work, "peer-array.pkl")}


# ------------------------------------------------------------ make, check

def make(db_dir, work):
    import numpy as np
    import stoke
    from loader_peers import write_lmdb, write_pkl
    split = stoke.open(db_dir)["train"]
    n = len(split)

    def samples():  # writable copies: the peers' arrays are their own
        for i in range(n):
            image, label = split[i]
            yield image.copy(), label

    p = paths(work)
    write_pkl(samples(), p["pickle"])
    sample_bytes = int(np.prod(split.shape))
    write_lmdb(samples(), p["lmdb"], map_size=max(1 << 30, 2 * n * (sample_bytes + 512)))
    if not os.path.exists(p["array"]):
        images = np.empty((n,) + split.shape, np.uint8)
        labels = np.empty(n, np.int64)
        for i in range(n):
            images[i], labels[i] = split[i]
        with open(p["array"] + ".tmp", "wb") as f:
            pickle.dump((images, labels), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.rename(p["array"] + ".tmp", p["array"])


def check(db_dir, work):
    import numpy as np
    import stoke
    split = stoke.open(db_dir)["train"]
    ds = {t: dataset(t, work) for t in PEERS}
    n = bad = 0
    for i in range(0, len(split), 7):
        image, label = split[i]
        for t, d in ds.items():
            x, y = d[i]
            bad += not (int(y) == label and np.array_equal(np.asarray(x), image))
        n += 1
    lens = {t: len(d) for t, d in ds.items()}
    bad += sum(v != len(split) for v in lens.values())
    print("check: %d of %d train samples (%s) compared with %s, %d differ"
          % (n, len(split), "x".join(map(str, split.shape)), ", ".join(PEERS), bad))
    return 1 if bad else 0


# ------------------------------------------------------------ the loaders

def dataset(tool, work, db_dir=None):
    from loader_peers import datasets
    import torch.utils.data as tud
    PickleDataset, LmdbDataset = datasets()
    p = paths(work)
    if tool == "dataset":  # stoke's own map-style dataset
        import stoke
        import warnings
        # default_collate copies the read-only records (torch warns once)
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return stoke.open(db_dir)["train"]
    if tool == "pickle":
        return PickleDataset(os.path.join(p["pickle"], "train"))
    if tool == "lmdb":
        return LmdbDataset(p["lmdb"])
    if tool == "array":
        class ArrayDataset(tud.Dataset):
            """The split in memory, one pickled array."""

            def __init__(self, path):
                with open(path, "rb") as f:
                    self.images, self.labels = pickle.load(f)

            def __len__(self):
                return len(self.labels)

            def __getitem__(self, i):
                return self.images[i], int(self.labels[i])
        return ArrayDataset(p["array"])
    raise SystemExit("python_loader_peers: no peer %r" % tool)


def loader_factory(tool, workers, db_dir, work, batch, seed):
    """A function making the loader, and the number of samples an epoch
    has; a peer's dataset is made here, before any timing."""
    if tool in ("stoke", "stoke-torch"):
        import stoke
        # before the timing, as for the peers (torch imports numpy); stoke
        # itself imports numpy only when a Loader or a record needs it
        __import__("torch" if tool == "stoke-torch" else "numpy")
        n = len(stoke.open(db_dir)["train"])
        return (lambda: stoke.Loader(db_dir, batch_size=batch, workers=workers,
                                     seed=seed, as_torch=tool == "stoke-torch")), n
    import torch
    from torch.utils.data import DataLoader
    ds = dataset(tool, work, db_dir)
    torch.manual_seed(seed)
    return (lambda: DataLoader(ds, batch_size=batch, shuffle=True,
                               num_workers=workers, pin_memory=False)), len(ds)


def close(loader):
    if hasattr(loader, "close"):
        loader.close()


def cpu_seconds():
    """user + system CPU seconds of this process and its waited-for
    children (DataLoader workers are joined at the end of each epoch)."""
    import resource
    return sum(r.ru_utime + r.ru_stime for r in (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN)))


def run_iter(a):
    make_loader, n = loader_factory(a.tool, a.workers, a.db, a.work, a.batch, a.seed)
    samples = epochs = 0
    first = None
    cpu0 = cpu_seconds()
    t0 = time.perf_counter()
    loader = make_loader()
    while True:
        for x, y in loader:
            if first is None:
                first = time.perf_counter() - t0
                shape, dtype = tuple(x.shape), str(x.dtype)
            samples += len(y)
        epochs += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= a.seconds:
            break
    stats = getattr(loader, "stats", None)
    close(loader)
    cpu = cpu_seconds() - cpu0
    if samples != epochs * n:
        raise SystemExit("python_loader_peers: %s gave %d samples in %d epochs of %d"
                         % (a.tool, samples, epochs, n))
    out = {"tool": a.tool, "workers": a.workers, "batch": a.batch, "samples": samples,
           "epochs": epochs, "elapsed_s": elapsed, "samples_per_s": samples / elapsed,
           "first_batch_s": first, "batch_shape": shape, "dtype": dtype,
           "cpu_s": cpu, "samples_per_cpu_s": samples / cpu}
    if stats:
        out["stoke_stats"] = {k: stats[k] for k in ("stall", "first_batch", "busy")}
    print(json.dumps(out))


def run_train(a):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
    sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
    os.environ.setdefault("STK_SRC", ROOT)
    import torch
    import torch.nn.functional as F
    import torch_ref
    import stoke

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    db = stoke.open(a.db)
    mean = torch.tensor(db.mean(), dtype=torch.float32).view(1, -1, 1, 1)
    inv = (1.0 / torch.tensor([s if s > 0 else 1 for s in db.std()],
                              dtype=torch.float32)).view(1, -1, 1, 1)
    model = torch_ref.CNN()
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    if a.tool == "memory":
        with open(paths(a.work)["array"], "rb") as f:
            images, labels = pickle.load(f)
        X, Y = torch.from_numpy(images), torch.from_numpy(labels)
        g = torch.Generator().manual_seed(a.seed)

        def batches():
            while True:
                perm = torch.randperm(len(Y), generator=g)
                for k in range(0, len(Y) - a.batch + 1, a.batch):
                    idx = perm[k:k + a.batch]
                    yield X[idx], Y[idx]
        loader = None
    else:
        make_loader, _ = loader_factory(a.tool, a.workers, a.db, a.work, a.batch, a.seed)
        loader = make_loader()

        def batches():
            while True:  # epoch after epoch, as a training loop does
                yield from loader

    it = batches()
    wait = total = longest = 0.0
    first = None
    for s in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        x, y = next(it)
        t1 = time.perf_counter()
        if not isinstance(x, torch.Tensor):  # (stoke without as_torch)
            x, y = torch.from_numpy(x), torch.from_numpy(y)
        xb = x.float().div_(255).sub_(mean).mul_(inv)
        loss = F.cross_entropy(model(xb), y.long())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        t2 = time.perf_counter()
        if first is None:
            first = t1 - t0
        if s >= a.warmup:
            wait += t1 - t0
            total += t2 - t0
            longest = max(longest, t1 - t0)
    stats = getattr(loader, "stats", None)
    if loader is not None:
        close(loader)
    out = {"tool": a.tool, "workers": a.workers, "batch": a.batch, "threads": a.threads,
           "steps": a.steps, "warmup": a.warmup, "stall": wait / total,
           "wait_s": wait, "step_s": total / a.steps, "longest_wait_s": longest,
           "first_wait_s": first, "samples_per_s": a.steps * a.batch / total,
           "loss": float(loss), "torch_threads": torch.get_num_threads()}
    if stats:
        out["stoke_stats"] = {k: stats[k] for k in ("stall", "busy")}
    print(json.dumps(out))


# The child of `first`: DB, WORK, BATCH, WORKERS and BENCH are filled in.
FIRST = {
    "stoke": """
import time
t0 = time.perf_counter()
import stoke
t1 = time.perf_counter()
loader = stoke.Loader(DB, batch_size=BATCH, workers=WORKERS, as_torch=AS_TORCH)
images, labels = next(iter(loader))
t2 = time.perf_counter()
""",
    "peer": """
import time
t0 = time.perf_counter()
import torch
from torch.utils.data import DataLoader
t1 = time.perf_counter()
import sys
sys.path.insert(0, BENCH)
from python_loader_peers import dataset
loader = DataLoader(dataset(TOOL, WORK, DB), batch_size=BATCH, shuffle=True,
                    num_workers=WORKERS)
images, labels = next(iter(loader))
t2 = time.perf_counter()
""",
    "stoke-numpy": """
import numpy  # as in any PyTorch program (torch imports it): not timed
import time
t0 = time.perf_counter()
import stoke
t1 = time.perf_counter()
loader = stoke.Loader(DB, batch_size=BATCH, workers=WORKERS)
images, labels = next(iter(loader))
t2 = time.perf_counter()
""",
    "numpy": """
import time
t0 = time.perf_counter()
import numpy
t1 = t2 = time.perf_counter()
images = numpy.empty(0)
""",
    "report": """
import json
loader = globals().get("loader")
print(json.dumps({"import_s": t1 - t0, "first_batch_s": t2 - t0,
                  "shape": list(images.shape),
                  "loader_workers": getattr(loader, "workers",
                                            getattr(loader, "num_workers", None))}))
""",
}


def run_first(a):
    kind = {"stoke-torch": "stoke"}.get(a.tool, a.tool)
    kind = kind if kind in FIRST else "peer"
    head = "DB, WORK, BATCH, WORKERS, BENCH, TOOL, AS_TORCH = %r, %r, %d, %r, %r, %r, %r\n" % (
        a.db, a.work, a.batch, a.workers, BENCH, a.tool, a.tool == "stoke-torch")
    code = head + FIRST[kind] + FIRST["report"]
    t0 = time.perf_counter()
    r = subprocess.run(["/usr/bin/python3", "-c", code], stdout=subprocess.PIPE, check=True)
    wall = time.perf_counter() - t0
    out = json.loads(r.stdout)
    out.update(tool=a.tool, workers=a.workers, batch=a.batch, process_s=wall)
    print(json.dumps(out))


# ------------------------------------------------------------ the report

NAMES = {"stoke": "stoke.Loader (NumPy)", "stoke-torch": "stoke.Loader (as_torch)",
         "sweep": "C loader (sweep)", "pickle": "DataLoader, pickle files",
         "array": "DataLoader, one pickled array", "lmdb": "DataLoader, python3-lmdb",
         "dataset": "DataLoader, stoke.open(db)[\"train\"]",
         "memory": "no loader (tensor in memory)", "numpy": "`import numpy` alone",
         "stoke-numpy": "stoke.Loader (NumPy), numpy imported before"}
DATA = {"fm": "Fashion-MNIST train, 60000 x 1x28x28",
        "jpeg224": "JPEG folder prepared to 3x224x224"}
SHORT = {"fm": "Fashion-MNIST", "jpeg224": "JPEG folder at 3x224x224"}


def report(path):
    import collections
    import statistics
    rows = [json.loads(line) for line in open(path)]
    med = statistics.median

    def rng(v, f="%.0f", k=1.0):
        v = [k * x for x in v]
        return (f + " (" + f + "-" + f + ")") % (med(v), min(v), max(v))

    def verdict(ok):
        return "met" if ok else "**NOT met**"

    targets = []
    loads = [r["load1"] for r in rows]
    print("\n1-minute load average at the runs: median %.2f, %.2f-%.2f\n"
          % (med(loads), min(loads), max(loads)))
    firsts = [r for r in rows if r["part"] == "C" and r["tool"] == "stoke"]
    default_w = firsts[0]["loader_workers"] if firsts else 2

    A = collections.defaultdict(list)
    for r in rows:
        if r["part"] == "A":
            A[r["data"], r["tool"], r["workers"]].append(r)
    for d in [d for d in DATA if any(k[0] == d for k in A)]:
        tools = [t for t in NAMES if any(k[:2] == (d, t) for k in A)]
        W = sorted({k[2] for k in A if k[0] == d})
        sps = {(t, w): med([r["samples_per_s"] for r in A[d, t, w]])
               for t in tools for w in W if A[d, t, w]}
        reps = max(len(v) for k, v in A.items() if k[0] == d)
        print("### A. Iteration: %s, batch 256, shuffled\n" % DATA[d])
        print("samples/s, median (min-max) of %d runs:\n" % reps)
        print("| workers | " + " | ".join(NAMES[t] for t in tools) + " |")
        print("|---:|" + "---:|" * len(tools))
        for w in W:
            print("| %d | " % w + " | ".join(
                rng([r["samples_per_s"] for r in A[d, t, w]]) if A[d, t, w] else "-"
                for t in tools) + " |")
        print("\nTime to the first batch, ms, median (max):\n")
        print("| workers | " + " | ".join(NAMES[t] for t in tools) + " |")
        print("|---:|" + "---:|" * len(tools))
        for w in W:
            print("| %d | " % w + " | ".join(
                "%.1f (%.1f)" % (1e3 * med([r["first_batch_s"] for r in A[d, t, w]]),
                                 1e3 * max(r["first_batch_s"] for r in A[d, t, w]))
                if A[d, t, w] else "-" for t in tools) + " |")
        peers = [(sps[t, w], t, w) for t in ("pickle", "array", "lmdb") for w in W
                 if (t, w) in sps]
        best, bt, bw = max(peers)
        cpu_tools = [t for t in tools if all("samples_per_cpu_s" in r
                                             for w in W for r in A[d, t, w])]
        if cpu_tools:
            print("\nSamples per CPU second (user + system, the DataLoader's worker "
                  "processes included), median; less sensitive to a loaded machine "
                  "than samples/s:\n")
            print("| workers | " + " | ".join(NAMES[t] for t in cpu_tools) + " |")
            print("|---:|" + "---:|" * len(cpu_tools))
            for w in W:
                print("| %d | " % w + " | ".join(
                    "%.0f" % med([r["samples_per_cpu_s"] for r in A[d, t, w]])
                    if A[d, t, w] else "-" for t in cpu_tools) + " |")
        print("\nThe best DataLoader set-up: %s, %d workers, %.0f samples/s (median).\n"
              % (NAMES[bt], bw, best))
        print("| workers | stoke.Loader (NumPy) / best DataLoader | (as_torch) / best DataLoader "
              "| stoke.Loader (NumPy) / C loader |")
        print("|---:|---:|---:|---:|")
        for w in W:
            print("| %d | %.1fx | %.1fx | %s |" % (
                w, sps["stoke", w] / best, sps["stoke-torch", w] / best,
                "%.2f" % (sps["stoke", w] / sps["sweep", w]) if ("sweep", w) in sps else "-"))
        print()
        for t in ("stoke", "stoke-torch"):
            r = sps[t, default_w] / best
            targets.append("%s, %s, %d workers (the default here): %.1fx the best DataLoader "
                           "(target >= 10x): %s; at 0/1/2/4 workers: %s" % (
                               SHORT[d], NAMES[t], default_w,
                               r, verdict(r >= 10), ", ".join(
                                   "%.1fx" % (sps[t, w] / best) for w in W)))

    B = collections.defaultdict(list)
    for r in rows:
        if r["part"] == "B":
            B[r["tool"], r["workers"]].append(r)
    if B:
        x = next(iter(B.values()))[0]
        print("### B. Data stall in a PyTorch training loop: cnn, Fashion-MNIST, batch %d, "
              "%d threads\n" % (x["batch"], x["threads"]))
        print("%d warm-up steps, then %d steps timed; stall = time in next() / step time; "
              "median (min-max) of %d runs:\n" % (x["warmup"], x["steps"], len(B[x["tool"], x["workers"]])))
        print("| loader | workers | stall | wait per step, ms | step, ms | samples/s | longest wait, ms |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        order = {t: i for i, t in enumerate(NAMES)}
        for (t, w), rs in sorted(B.items(), key=lambda kv: (order[kv[0][0]], kv[0][1])):
            print("| %s | %s | %s | %s | %s | %s | %s |" % (
                NAMES[t], "-" if t == "memory" else w,
                rng([r["stall"] for r in rs], "%.2f%%", 100),
                rng([r["wait_s"] / r["steps"] for r in rs], "%.3f", 1e3),
                rng([r["step_s"] for r in rs], "%.1f", 1e3),
                rng([r["samples_per_s"] for r in rs]),
                "%.1f" % (1e3 * max(r["longest_wait_s"] for r in rs))))
        print()
        for (t, w), rs in sorted(B.items()):
            if t == "stoke-torch":
                st = med([r["stall"] for r in rs])
                targets.append("Training-loop stall, stoke.Loader (as_torch), %d workers: %.2f%% "
                               "(target < 1%%): %s" % (w, 100 * st, verdict(st < 0.01)))

    C = collections.defaultdict(list)
    for r in rows:
        if r["part"] == "C":
            C[r["data"], r["tool"]].append(r)
    if C:
        print("### C. Import to first batch in a fresh `/usr/bin/python3 -c` process\n")
        print("From before the import (of stoke; of torch for the DataLoaders) to the first "
              "batch in hand, batch 256, the loader's defaults (stoke: %s workers; DataLoader: "
              "0 workers); ms, median (min-max) of %d runs; \"process\" is the whole child, "
              "interpreter start and exit included.\n"
              % (default_w, max(len(v) for v in C.values())))
        print("| data | what | import | first batch | process |")
        print("|---|---|---:|---:|---:|")
        for d in DATA:
            for t in ("stoke", "stoke-numpy", "numpy", "stoke-torch", "lmdb", "pickle"):
                rs = C.get((d, t))
                if rs:
                    print("| %s | %s | %s | %s | %s |" % (
                        d, NAMES[t], rng([r["import_s"] for r in rs], "%.1f", 1e3),
                        rng([r["first_batch_s"] for r in rs], "%.1f", 1e3),
                        rng([r["process_s"] for r in rs], "%.0f", 1e3)))
        print()
        for d in DATA:
            rs = C.get((d, "stoke"))
            if rs:
                fb = med([r["first_batch_s"] for r in rs])
                npy = med([r["import_s"] for r in C.get((d, "numpy"), rs)])
                own = med([r["first_batch_s"] for r in C.get((d, "stoke-numpy"), rs)])
                targets.append("Import to first batch, %s: %.1f ms (target < 50 ms): %s "
                               "(`import numpy` alone: %.1f ms; with numpy imported "
                               "before, as torch does: %.1f ms, %s)" % (
                                   SHORT[d], 1e3 * fb, verdict(fb < 0.05), 1e3 * npy,
                                   1e3 * own, "under 50 ms" if own < 0.05 else "over 50 ms"))
    print("### Targets\n")
    for t in targets:
        print("- " + t)


def main():
    ap = argparse.ArgumentParser(description="see the module's doc")
    ap.add_argument("cmd", choices=("make", "check", "iter", "train", "first", "report"))
    ap.add_argument("args", nargs="+")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.cmd == "report" and len(a.args) == 1:
        report(a.args[0])
        return
    if a.cmd in ("make", "check"):
        if len(a.args) != 2:
            raise SystemExit(__doc__)
        if a.cmd == "make":
            make(*a.args)
        else:
            sys.exit(check(*a.args))
        return
    if len(a.args) != 4:
        raise SystemExit(__doc__)
    a.tool, a.workers, a.db, a.work = a.args[0], int(a.args[1]), a.args[2], a.args[3]
    if a.workers < 0:  # stoke.Loader's default
        a.workers = None
    if a.batch is None:
        a.batch = 128 if a.cmd == "train" else 256
    {"iter": run_iter, "train": run_train, "first": run_first}[a.cmd](a)


if __name__ == "__main__":
    main()
