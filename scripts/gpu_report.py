"""gpu_report.py BENCH_JSON [PLAIN_JSON [ROUND_JSON...]] < rows - the
benchmark part of gpu_check.sh's report (markdown on stdout).

BENCH_JSON is gpu_bench's line (records streamed into the loader's ring,
its default on a GPU); PLAIN_JSON, if given (a missing or empty file is
skipped), its line with --stores plain, printed beside it; ROUND_JSONs
are further rounds of either (uploads are noisy: the rounds' best shares
by stores, and their median, which the target is judged on when there
are several); each stdin row is "MODEL BATCH GPUS EPOCH_JSON", EPOCH_JSON
the last epoch line of that run's metrics.jsonl.
FLOPs per sample come from bench/train_peers.py (conv and linear
multiply-adds x 2, a training step 3 x forward)."""
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
from train_peers import forward_flops  # noqa: E402


def rates(bench):
    """"w: GB/s" for each worker count."""
    return ", ".join("%s: %.2f" % kv for kv in bench.get("loader", {}).items())


def load(path):
    """A gpu_bench JSON, or None where its run failed (missing, empty)."""
    if os.path.isfile(path) and os.path.getsize(path):
        return json.load(open(path))
    return None


def rounds(runs):
    """{stores: [best share of each round]} over every run given."""
    by = {}
    for r in runs:
        by.setdefault(r.get("stores", "unknown"), []).append(r["loader_share"])
    return by


def main():
    bench = json.load(open(sys.argv[1]))
    runs = [bench] + [r for r in map(load, sys.argv[2:]) if r]
    by = rounds(runs)
    peak = bench["sgemm_tflops"] * 1e12
    share = bench["loader_share"]
    several = len(by.get(bench.get("stores"), [])) > 1
    if several:  # judged on the median round of the first run's stores
        share_judged = statistics.median(by[bench["stores"]])
    else:
        share_judged = share
    print("Uploads (%s, batches of %d bytes, %s stores): the loader into its "
          "pinned ring, "
          "each batch uploaded from its slot on the copy stream, **%.2f GB/s** "
          "at its best, %d workers (GB/s by workers: %s), against %.2f GB/s for "
          "the same copies from one pinned buffer: **%.0f%%** (target >= 80%%: "
          "%s); the same copies from %d buffers in turn (the ring's bytes): "
          "%.2f GB/s (%.0f%%); 64 MiB pinned copies: %.2f GB/s. %s" % (
              bench["device"], bench["batch_bytes"],
              bench.get("stores", "unknown"), bench["loader_gbs"],
              bench["workers"], rates(bench), bench["copy_gbs"], 100 * share,
              ("met" if share_judged >= 0.8 else "**not met**") +
              (" by the median round, %.0f%%" % (100 * share_judged) if several else ""),
              bench["ring"],
              bench["copy_ring_gbs"], 100 * bench["loader_gbs"] / bench["copy_ring_gbs"],
              bench["copy_big_gbs"],
              "cuBLAS SGEMM %d^3: **%.1f TFLOP/s**." % (bench["sgemm_n"], bench["sgemm_tflops"])
              if peak else "No SGEMM (`--gemm 0`)."))
    plain = load(sys.argv[2]) if len(sys.argv) > 2 else None  # it may have failed
    if plain:
        print()
        print("The same with the records written into the ring with %s "
              "stores (`--stores %s`), beside the first run's %s stores: "
              "%.2f GB/s at %d workers, %.0f%% of %.2f GB/s of copies "
              "(the first run: %.2f GB/s, %.0f%%). GB/s by workers: %s (%s), "
              "%s (%s)." % (
                  plain.get("stores", "plain"), plain.get("stores", "plain"),
                  bench.get("stores", "unknown"),
                  plain["loader_gbs"], plain["workers"],
                  100 * plain["loader_share"], plain["copy_gbs"],
                  bench["loader_gbs"], 100 * share,
                  rates(bench), bench.get("stores", "first"),
                  rates(plain), plain.get("stores", "plain")))
    if len(runs) > 2:
        print()
        print("Rounds, each run's best share of same-size pinned copies: " + "; ".join(
            "%s stores %s (median %.0f%%)" % (
                k, ", ".join("%.0f%%" % (100 * v) for v in vs), 100 * statistics.median(vs))
            for k, vs in sorted(by.items())) + ".")
    print()
    print("| model | batch per GPU | GPUs | samples/s | data wait (stall) | "
          "TFLOP/s | % of SGEMM peak | test acc | scaling |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    single = {}
    for line in sys.stdin:
        if not line.strip():
            continue
        model, batch, gpus, epoch = line.split(" ", 3)
        d = json.loads(epoch)
        sps = d["samples_per_s"]
        flops = forward_flops(model)["step"] * sps
        if gpus == "1":
            single[(model, batch)] = sps
        base = single.get((model, batch))
        scale = "%.2fx" % (sps / base) if gpus != "1" and base else ""
        print("| %s | %s | %s | %.0f | %.2f%% | %.2f | %s | %.2f%% | %s |" % (
            model, batch, gpus, sps, 100 * d["stall"], flops / 1e12,
            "%.1f%%" % (100 * flops / peak) if peak else "n/a",
            100 * d["test_acc"], scale))


if __name__ == "__main__":
    main()
