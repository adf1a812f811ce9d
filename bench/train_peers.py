"""train_peers.py - the PyTorch side of bench/train_bench.sh (issue 4), and
the helpers that turn stoke's metrics.jsonl and the runs into the report.

  train_peers.py torch MODEL BATCH THREADS DB [--seconds S] [--warmup N]
                 [--blas-threads N] [--no-mkldnn]
      trains tests/e2e/torch_ref.py's MODEL (cnn | mlp | resnet20) on the
      train split of the stoke database DB with PyTorch on the CPU, T threads,
      and prints one JSON line: steady-state samples/s, the BLAS library the
      process maps and its peak RSS (ru_maxrss). --steps N times exactly N
      steps instead of --seconds (the memory runs).
  train_peers.py stoke RUN_DIR BATCH SKIP_STEPS [--train-count N]
      one JSON line: steady-state samples/s and data stall of a stoke run,
      from RUN_DIR/metrics.jsonl, the first SKIP_STEPS steps left out.
  train_peers.py flops MODEL
      forward FLOPs per sample of MODEL (analytic), as JSON.
  train_peers.py maxrss FILE
      one JSON line of a stoke memory run: FILE holds /usr/bin/time -f %M's
      peak RSS in KiB.
  train_peers.py report RESULTS.jsonl
      the markdown tables and the target verdicts.

Run with Debian's interpreter (/usr/bin/python3: python3-torch, numpy, lmdb).
"""
import argparse, collections, json, os, re, resource, statistics, sys, time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


# ---- FLOPs ---------------------------------------------------------------------

def conv_flops(cout, cin, k, hout):
    return 2 * cout * cin * k * k * hout * hout


def resnet_layers(widths, blocks, size=28, channels=1, classes=10):
    """The conv and linear FLOPs of tests/e2e/torch_ref.py's ResNet (stoke's
    resnet20/resnet18): 3x3 stem, stages of BasicBlocks (two 3x3 convs, a
    1x1 stride-2 downsample where the shape changes), global pool, fc. A 3x3
    pad-1 stride-2 convolution maps h to (h + 1) // 2."""
    layers = {"conv1": conv_flops(widths[0], channels, 3, size)}
    cin, h = widths[0], size
    for i, w in enumerate(widths):
        for b in range(blocks):
            stride = 2 if i > 0 and b == 0 else 1
            ho = (h + 1) // 2 if stride == 2 else h
            name = "layer%d.%d." % (i + 1, b)
            layers[name + "conv1"] = conv_flops(w, cin, 3, ho)
            layers[name + "conv2"] = conv_flops(w, w, 3, ho)
            if stride != 1 or cin != w:
                layers[name + "downsample.0"] = conv_flops(w, cin, 1, ho)
            cin, h = w, ho
    layers["fc"] = 2 * cin * classes
    return layers


def forward_flops(model):
    """Multiply-adds x 2 of the conv and linear layers of one sample's forward
    pass (pooling, activations, batchnorm, additions, dropout, bias and loss
    not counted)."""
    if model == "resnet20":
        layers, first = resnet_layers((16, 32, 64), 3), "conv1"
    elif model == "resnet18":
        layers, first = resnet_layers((64, 128, 256, 512), 2), "conv1"
    elif model == "cnn":
        conv1 = 2 * 32 * 1 * 3 * 3 * 26 * 26        # 1x28x28 -> 32x26x26
        conv2 = 2 * 64 * 32 * 3 * 3 * 11 * 11       # 32x13x13 -> 64x11x11
        fc1 = 2 * 1600 * 500                        # 64x5x5 -> 500
        fc2 = 2 * 500 * 10
        layers = {"conv1": conv1, "conv2": conv2, "fc1": fc1, "fc2": fc2}
        first = "conv1"
    elif model == "mlp":
        layers = {"fc1": 2 * 784 * 256, "fc2": 2 * 256 * 128, "fc3": 2 * 128 * 10}
        first = "fc1"
    else:
        raise SystemExit("unknown model " + model)
    fwd = sum(layers.values())
    return {"model": model, "layers": layers, "forward": fwd,
            # the convention of the issue: forward + 2 x forward for backward
            "step": 3 * fwd,
            # the work a training step needs: the first layer's input gradient
            # is never computed (by stoke or by PyTorch)
            "step_needed": 3 * fwd - layers[first]}


# ---- the PyTorch peer -------------------------------------------------------------

def blas_in_process():
    """What BLAS this process maps (from /proc/self/maps) and, when it is
    OpenBLAS, its configuration (openblas_get_config via ctypes)."""
    import ctypes
    libs = set()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and re.search(r"blas|lapack|mkl|libgomp|libomp|dnnl",
                                              parts[5]):
                libs.add(parts[5])
    blas = [l for l in sorted(libs) if "blas" in os.path.basename(l)]
    cfg = cfg_threads = None
    for l in blas:
        # torch loads libblas.so.3 RTLD_LOCAL; dlopen of the mapped file
        # returns the handle of the copy already loaded
        try:
            lib = ctypes.CDLL(l)
            fn = lib.openblas_get_config
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        cfg = fn().decode()
        nt = lib.openblas_get_num_threads
        nt.restype = ctypes.c_int
        cfg_threads = nt()
        break
    if cfg:
        kind = "OpenBLAS"
    elif any("/blas/" in l for l in blas):
        kind = "reference BLAS"
    else:
        kind = "unknown"
    return {"blas_kind": kind, "blas_libs": blas, "mapped_libs": sorted(libs),
            "openblas_config": cfg, "openblas_threads": cfg_threads}


def run_torch(a):
    bt = a.blas_threads or a.threads
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(a.threads)
    os.environ["OPENBLAS_NUM_THREADS"] = str(bt)
    sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
    os.environ.setdefault("STK_SRC", ROOT)
    import torch
    import torch.nn.functional as F
    import torch_ref

    torch.set_num_threads(a.threads)
    if a.no_mkldnn:
        # convolutions through im2col + BLAS (OpenBLAS) instead of oneDNN
        torch.backends.mkldnn.enabled = False
    torch.manual_seed(a.seed)
    x_np, y_np, meta = torch_ref.load_split(a.db, "train")
    X = torch.from_numpy(x_np)                    # uint8 [N, 1, 28, 28], in memory
    Y = torch.from_numpy(y_np)
    st = meta["splits"]["train"]
    mean = torch.tensor(st["mean"], dtype=torch.float32).view(1, -1, 1, 1)
    inv = (1.0 / torch.tensor([s if s > 0 else 1 for s in st["std"]],
                              dtype=torch.float32)).view(1, -1, 1, 1)
    model = torch_ref.MODELS[a.model]()
    model.train()                                 # dropout on, as stoke's default
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9, weight_decay=0)
    n, b = X.shape[0], a.batch
    steps_per_epoch = n // b                      # full batches only
    g = torch.Generator().manual_seed(a.seed)
    perm, pos = torch.randperm(n, generator=g), 0

    def step():
        nonlocal perm, pos
        if pos == steps_per_epoch:
            perm, pos = torch.randperm(n, generator=g), 0
        idx = perm[pos * b:(pos + 1) * b]
        pos += 1
        # stoke's transform: (pixel / 255 - mean) * (1 / std), per batch
        xb = X[idx].float().div_(255).sub_(mean).mul_(inv)
        yb = Y[idx]
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    for _ in range(a.warmup):
        step()
    t0 = time.perf_counter()
    steps = 0
    while True:
        step()
        steps += 1
        el = time.perf_counter() - t0
        if (a.steps and steps >= a.steps) or (not a.steps and el >= a.seconds):
            break
    out = {"tool": ("torch" if bt == a.threads else "torch-blas%d" % bt) +
           ("-nomkldnn" if a.no_mkldnn else ""), "blas_threads": bt,
           "model": a.model, "batch": b, "threads": a.threads,
           "samples_per_s": steps * b / el, "steps": steps, "seconds": el,
           "warmup_steps": a.warmup, "torch": torch.__version__,
           "torch_threads": torch.get_num_threads(),
           "mkldnn": torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled,
           "optimizer": "SGD(lr=0.02, momentum=0.9)",
           "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    if a.steps:
        out["kind"] = "memory"
    out.update(blas_in_process())
    print(json.dumps(out))


# ---- stoke's metrics --------------------------------------------------------------

def stoke_steady(a):
    """Steady-state samples/s and stall of a run. The step lines carry the
    loader's samples/s and stall since the epoch's loader was opened
    (cumulative), the epoch lines the same over the whole epoch; each line is
    turned into (elapsed, wait) since its epoch's start and the differences
    between lines give per-window times. Windows that end within the first
    SKIP steps are left out; later epochs count from their start (loader
    open and first batch included; evaluation between epochs is not)."""
    lines = [json.loads(l) for l in open(os.path.join(a.run, "metrics.jsonl"))]
    b, ntrain = a.batch, a.train_count
    per_epoch = -(-ntrain // b)
    ep_start = {1: 0}
    for d in lines:
        if d["type"] == "epoch":
            ep_start[d["epoch"] + 1] = d["step"]
    prev_epoch = None
    windows = []
    last = None
    for d in lines:
        e = d["epoch"]
        s0 = ep_start[e]
        k = d["step"] - s0
        samples = ntrain if k == per_epoch else k * b
        el = samples / d["samples_per_s"]
        wait = d["stall"] * el
        if e != prev_epoch:
            last = (s0, 0.0, 0.0)
            prev_epoch = e
        step = d["step"]
        if step > last[0]:
            windows.append({"epoch": e, "from": last[0], "to": step,
                            "samples": samples - (last[0] - s0) * b,
                            "seconds": el - last[1], "wait": wait - last[2]})
        last = (step, el, wait)
    keep = [w for w in windows if w["to"] > a.skip and w["from"] >= a.skip]
    if not keep:
        raise SystemExit("no steady-state windows in " + a.run)
    S = sum(w["samples"] for w in keep)
    T = sum(w["seconds"] for w in keep)
    W = sum(w["wait"] for w in keep)
    rates = [w["samples"] / w["seconds"] for w in keep]
    # (stall is printed to 4 decimals: a sum can come out a hair below 0)
    print(json.dumps({"tool": "stoke", "samples_per_s": S / T, "stall": max(0.0, W / T),
                      "seconds": T, "samples": S, "windows": len(keep),
                      "window_min": min(rates), "window_max": max(rates),
                      "epochs": max(w["epoch"] for w in keep)}))


# ---- report -------------------------------------------------------------------------

def report(a):
    rows = [json.loads(l) for l in open(a.results)]
    med = statistics.median
    R = collections.defaultdict(list)
    peak = collections.defaultdict(list)
    mem = collections.defaultdict(list)
    for r in rows:
        if r.get("kind") == "memory":
            mem[r["tool"], r["model"], r["batch"]].append(r["maxrss_kb"])
        elif r["tool"] == "sgemm":
            peak[r["threads"]].append(r["best_gflops"])
        else:
            R[r["tool"], r.get("workers"), r["model"], r["threads"]].append(r)
    pk = {t: max(v) for t, v in peak.items()}
    pkmed = {t: med(v) for t, v in peak.items()}
    # the models in the results, in the order of the issues
    batch = {k[2]: v[0]["batch"] for k, v in R.items() if k[0] == "stoke"}
    models = [(m, batch[m]) for m in ("cnn", "mlp", "resnet20", "resnet18") if m in batch]
    threads = sorted({k[3] for k in R})
    reps = max(len(v) for v in R.values())
    fl = {m: forward_flops(m) for m, _ in models}

    def sps(tool, w, m, t):
        return med([r["samples_per_s"] for r in R[tool, w, m, t]])

    def rng(tool, w, m, t):
        v = [r["samples_per_s"] for r in R[tool, w, m, t]]
        return "%.0f (%.0f-%.0f)" % (med(v), min(v), max(v))

    variants = ("torch", "torch-blas1", "torch-keep", "torch-blas1-keep")
    label = {"torch": "", "torch-blas1": " (BLAS 1 thread)", "torch-keep": " (malloc keeping)",
             "torch-blas1-keep": " (BLAS 1 thread, malloc keeping)"}

    def torch_best(m, t):
        """PyTorch's fastest setup at (m, t): OPENBLAS_NUM_THREADS = t or 1,
        glibc's malloc as is or keeping freed memory."""
        v = [(x, None, m, t) for x in variants if R.get((x, None, m, t))]
        return max(v, key=lambda k: sps(*k))

    print("OpenBLAS SGEMM peak (bench/sgemm_peak.c, 2048x2048x2048 cblas_sgemm, best of 7 "
          "calls per round; best of %d rounds, median of the rounds' bests in brackets):\n"
          % len(next(iter(peak.values()))))
    print("| threads | GFLOP/s |")
    print("|---:|---:|")
    for t in sorted(pk):
        print("| %d | %.1f (%.1f) |" % (t, pk[t], pkmed[t]))
    print("\nFLOPs per sample (analytic, conv 2*Cout*Cin*k*k*Hout*Wout, linear 2*in*out; "
          "a training step counted as 3 x forward):\n")
    print("| model | forward MFLOP | step MFLOP (3x) | step MFLOP needed (no input grad of layer 1) |")
    print("|---|---:|---:|---:|")
    for m, _ in models:
        print("| %s | %.3f | %.3f | %.3f |" % (m, fl[m]["forward"] / 1e6, fl[m]["step"] / 1e6,
                                               fl[m]["step_needed"] / 1e6))
    print("\nTraining throughput, samples/s, median of %d runs (min-max); stoke with "
          "`--workers 1`; GFLOP/s = step FLOPs x samples/s; %% of peak against the SGEMM "
          "peak (best) at the same thread count; stall = share of stoke's step time spent "
          "waiting for a batch (median); \"needed FLOPs\" leaves out the first layer's input "
          "gradient, which neither tool computes:\n" % reps)
    print("| model | batch | threads | stoke samples/s | PyTorch samples/s | stoke / PyTorch "
          "| stoke GFLOP/s | % of peak | PyTorch GFLOP/s | % of peak | stoke % of peak, needed FLOPs "
          "| stoke stall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    verdict = []
    for m, b in models:
        for t in threads:
            tk = torch_best(m, t)
            s, p = sps("stoke", 1, m, t), sps(*tk)
            gs, gp = fl[m]["step"] * s / 1e9, fl[m]["step"] * p / 1e9
            stall = med([r["stall"] for r in R["stoke", 1, m, t]])
            print("| %s | %d | %d | %s | %s%s | %.2fx | %.1f | %.0f%% | %.1f | %.0f%% | %.0f%% "
                  "| %.2f%% |" % (
                      m, b, t, rng("stoke", 1, m, t), rng(*tk),
                      label[tk[0]], s / p, gs,
                      100 * gs / pk[t], gp, 100 * gp / pk[t],
                      100 * fl[m]["step_needed"] * s / 1e9 / pk[t], 100 * stall))
            verdict.append((m, t, s, p, gs, stall))
    print("\nPyTorch's setups (torch.set_num_threads(T) and OMP_NUM_THREADS=T in all), "
          "samples/s, median (min-max); the table above uses the fastest:\n")
    print("| model | threads | OPENBLAS_NUM_THREADS=T | OPENBLAS_NUM_THREADS=1 "
          "| OPENBLAS_NUM_THREADS=1, malloc keeping |")
    print("|---|---:|---:|---:|---:|")
    for m, b in models:
        for t in threads:
            blas1 = "torch" if t == 1 else "torch-blas1"
            cells = [rng(x, None, m, t) if R.get((x, None, m, t)) else "-"
                     for x in ("torch", blas1, blas1 + "-keep")]
            print("| %s | %d | %s |" % (m, t, " | ".join(cells)))
    if any(k[0] == "stoke" and k[1] == 2 for k in R):
        print("\nstoke with `--workers 2` (two loader threads) against `--workers 1`, "
              "median (min-max):\n")
        print("| model | threads | workers 1 | workers 2 | ratio | stall w1 | stall w2 |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for m, b in models:
            for t in threads:
                if not R.get(("stoke", 2, m, t)):
                    continue
                s1, s2 = sps("stoke", 1, m, t), sps("stoke", 2, m, t)
                print("| %s | %d | %s | %s | %.2f | %.2f%% | %.2f%% |" % (
                    m, t, rng("stoke", 1, m, t), rng("stoke", 2, m, t), s2 / s1,
                    100 * med([r["stall"] for r in R["stoke", 1, m, t]]),
                    100 * med([r["stall"] for r in R["stoke", 2, m, t]])))
    tr = [r for k, v in R.items() if k[0].startswith("torch") for r in v]
    print("\nPyTorch's BLAS, from /proc/self/maps of every PyTorch run: %s; libraries %s; "
          "openblas_get_config() = %s; (threads, openblas_get_num_threads()): %s; "
          "(threads, torch.get_num_threads()): %s; optimizer %s." % (
              sorted({r["blas_kind"] for r in tr}),
              sorted({l for r in tr for l in r["blas_libs"]}),
              sorted({str(r["openblas_config"]) for r in tr}),
              sorted({(r["threads"], r["openblas_threads"]) for r in tr}),
              sorted({(r["threads"], r["torch_threads"]) for r in tr}),
              sorted({r["optimizer"] for r in tr})))
    st = [r for k, v in R.items() if k[0] == "stoke" for r in v]
    print("\nTimed: stoke %.1f-%.1f s of steady-state steps per run (%d-%d log windows), "
          "PyTorch %.1f-%.1f s per run." % (
              min(r["seconds"] for r in st), max(r["seconds"] for r in st),
              min(r["windows"] for r in st), max(r["windows"] for r in st),
              min(r["seconds"] for r in tr), max(r["seconds"] for r in tr)))

    if mem:
        memory_table(mem, models)

    print("\n## Targets\n")
    for m, t, s, p, gs, stall in verdict:
        if m == "cnn":
            print("- cnn, %d thread%s: stoke >= 1.5x PyTorch: %.2fx (%.0f vs %.0f samples/s), %s"
                  % (t, "s" if t > 1 else "", s / p, s, p, "met" if s >= 1.5 * p else "NOT met"))
    for m, t, s, p, gs, stall in verdict:
        if m == "mlp":
            print("- mlp, %d thread%s: stoke >= PyTorch: %.2fx (%.0f vs %.0f samples/s), %s"
                  % (t, "s" if t > 1 else "", s / p, s, p, "met" if s >= p else "NOT met"))
    for m, t, s, p, gs, stall in verdict:
        if m.startswith("resnet"):
            print("- %s, %d thread%s: stoke >= 1.5x PyTorch: %.2fx (%.0f vs %.0f samples/s), %s; "
                  "%.0f%% of the SGEMM peak over the whole step (%.1f of %.1f GFLOP/s)"
                  % (m, t, "s" if t > 1 else "", s / p, s, p,
                     "met" if s >= 1.5 * p else "NOT met", 100 * gs / pk[t], gs, pk[t]))
    for m, t, s, p, gs, stall in verdict:
        if m.startswith("resnet"):
            continue  # issue 4's 40% target is the cnn's and the mlp's
        print("- %s, %d thread%s: >= 40%% of the SGEMM peak over the whole step: %.0f%% "
              "(%.1f of %.1f GFLOP/s), %s" % (m, t, "s" if t > 1 else "", 100 * gs / pk[t], gs,
                                              pk[t], "met" if gs >= 0.4 * pk[t] else "NOT met"))
    for m, t, s, p, gs, stall in verdict:
        print("- %s, %d thread%s: data stall < 2%% of step time: %.2f%%, %s" % (
            m, t, "s" if t > 1 else "", 100 * stall, "met" if stall < 0.02 else "NOT met"))


def memory_table(mem, models):
    """Peak RSS (ru_maxrss) of the memory runs: each tool at 1 thread, the
    same number of samples at a large and a small batch; per sample =
    (peak at the large batch - peak at the small) / (batch difference), which
    leaves out what does not grow with the batch (code, libraries, PyTorch's
    copy of the split, stoke's LMDB pages: the same samples are read)."""
    med = statistics.median
    print("\nPeak memory, 1 thread, ru_maxrss of the process (stoke: /usr/bin/time -f %%M of "
          "train; PyTorch: resource.getrusage in the peer, glibc's malloc as is), median of "
          "%d runs; per sample = (peak at the large batch - peak at the small) / (batch "
          "difference), both runs over the same number of samples:\n"
          % max(len(v) for v in mem.values()))
    print("| model | batches | stoke peak MiB | PyTorch peak MiB | stoke KiB/sample "
          "| PyTorch KiB/sample | stoke / PyTorch |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for m, _ in models:
        bs = sorted({k[2] for k in mem if k[1] == m})
        if len(bs) < 2 or not all(mem.get((tool, m, b)) for tool in ("stoke", "torch")
                                  for b in bs):
            continue
        lo, hi = bs[0], bs[-1]
        pk = {tool: med(mem[tool, m, hi]) for tool in ("stoke", "torch")}
        per = {tool: (pk[tool] - med(mem[tool, m, lo])) / (hi - lo) for tool in ("stoke", "torch")}
        print("| %s | %d - %d | %.0f (%.0f at %d) | %.0f (%.0f at %d) | %.1f | %.1f | %.2f |" % (
            m, hi, lo, pk["stoke"] / 1024, med(mem["stoke", m, lo]) / 1024, lo,
            pk["torch"] / 1024, med(mem["torch", m, lo]) / 1024, lo,
            per["stoke"], per["torch"], per["stoke"] / per["torch"]))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("torch")
    p.add_argument("model", choices=["cnn", "mlp", "resnet20", "resnet18"])
    p.add_argument("batch", type=int)
    p.add_argument("threads", type=int)
    p.add_argument("db")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--steps", type=int, default=0,
                   help="time exactly this many steps (default: --seconds)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--blas-threads", type=int, default=0,
                   help="OPENBLAS_NUM_THREADS (default: THREADS)")
    p.add_argument("--no-mkldnn", action="store_true",
                   help="torch.backends.mkldnn.enabled = False (not used by train_bench.sh)")
    p = sub.add_parser("stoke")
    p.add_argument("run")
    p.add_argument("batch", type=int)
    p.add_argument("skip", type=int)
    p.add_argument("--train-count", type=int, default=60000)
    p = sub.add_parser("flops")
    p.add_argument("model")
    p = sub.add_parser("maxrss")
    p.add_argument("file")
    p = sub.add_parser("report")
    p.add_argument("results")
    a = ap.parse_args()
    if a.cmd == "torch":
        run_torch(a)
    elif a.cmd == "stoke":
        stoke_steady(a)
    elif a.cmd == "maxrss":
        kb = int(open(a.file).read().split()[-1])
        print(json.dumps({"tool": "stoke", "kind": "memory", "maxrss_kb": kb}))
    elif a.cmd == "flops":
        print(json.dumps(forward_flops(a.model)))
    else:
        report(a)


if __name__ == "__main__":
    main()
