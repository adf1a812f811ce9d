#!/usr/bin/python3
"""The seeds' status quo for photos, and the photo benchmark's report.

    photo_peers.py time PHOTO_DIR WORKERS [--batch 256] [--warmup 2]
                        [--batches 16] [--crop 224] [--seed S]
    photo_peers.py bytes PHOTO_DIR [DB_DIR ...]
    photo_peers.py report RESULTS.jsonl

time: torchvision ImageFolder(PHOTO_DIR) + RandomResizedCrop(crop) +
  RandomHorizontalFlip + PILToTensor (uint8, no float conversion: stoke's
  loader hands out uint8 too) in DataLoader(batch_size, shuffle=True,
  num_workers=WORKERS, drop_last=True, persistent_workers=True), epochs
  chained. --warmup batches are drawn untimed (worker start, page cache),
  then --batches are timed; prints one JSON line: samples_per_s over the
  timed batches, first_batch_s from iter() to the first batch.
bytes: one JSON line: the original files' bytes per image, and for each
  stoke database its data.mdb bytes per record (the count: the sum of its
  metadata's split counts).
report: the markdown tables of bench/photo_bench.sh from its results.
"""
import argparse
import collections
import json
import os
import statistics
import sys
import time


def cmd_time(args):
    import torch
    from torch.utils.data import DataLoader
    from torchvision import datasets, transforms

    torch.manual_seed(args.seed)
    tf = transforms.Compose([transforms.RandomResizedCrop(args.crop),
                             transforms.RandomHorizontalFlip(),
                             transforms.PILToTensor()])
    ds = datasets.ImageFolder(args.photos, transform=tf)
    if len(ds) < args.batch:
        sys.exit(f"photo_peers: {args.photos} has {len(ds)} images, fewer than a batch")
    dl = DataLoader(ds, batch_size=args.batch, shuffle=True, drop_last=True,
                    num_workers=args.workers, persistent_workers=args.workers > 0)

    def batches():
        while True:
            yield from dl

    it = batches()
    t0 = time.perf_counter()
    x, _ = next(it)
    first = time.perf_counter() - t0
    if tuple(x.shape[1:]) != (3, args.crop, args.crop) or x.dtype != torch.uint8:
        sys.exit(f"photo_peers: batch of {tuple(x.shape)} {x.dtype}, not uint8 3x{args.crop}x{args.crop}")
    for _ in range(args.warmup - 1):
        next(it)
    pids = [p.pid for p in getattr(dl._iterator, "_workers", [])]
    t0, c0 = time.perf_counter(), cpu_seconds(pids)
    n = 0
    for _ in range(args.batches):
        x, _ = next(it)
        n += x.shape[0]
    dt, cpu = time.perf_counter() - t0, cpu_seconds(pids) - c0
    print(json.dumps({"tool": "torch", "workers": args.workers, "samples_per_s": n / dt,
                      "samples_per_cpu_s": n / cpu, "first_batch_s": first, "samples": n,
                      "elapsed_s": dt, "cpu_s": cpu, "images": len(ds)}))


def cpu_seconds(pids):
    """CPU seconds of this process and of the worker processes: a measure
    that the other engineers' load on this machine disturbs far less than
    the wall clock."""
    total = time.process_time()
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def db_records(db):
    import lmdb  # the metadata lives in the environment (docs/formats.md)
    env = lmdb.open(db, readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        meta = json.loads(txn.get(b"dataset", db=env.open_db(b"meta", txn=txn)))
    env.close()
    return sum(s["count"] for s in meta["splits"].values())


def cmd_bytes(args):
    files = [os.path.join(d, f) for d, _, fs in os.walk(args.photos) for f in fs]
    out = {"images": len(files),
           "original_per_image": sum(os.path.getsize(f) for f in files) / len(files)}
    for db in args.dbs:
        n = db_records(db)
        out[os.path.basename(db.rstrip("/"))] = {
            "records": n, "data_mdb_per_record": os.path.getsize(os.path.join(db, "data.mdb")) / n}
    print(json.dumps(out))


def cmd_report(args):
    rows = [json.loads(line) for line in open(args.results)]
    runs, per_cpu = collections.defaultdict(list), collections.defaultdict(list)
    for r in rows:
        if "samples_per_s" in r:
            runs[(r["tool"], r["workers"])].append(r["samples_per_s"])
            if "samples_per_cpu_s" in r:
                per_cpu[(r["tool"], r["workers"])].append(r["samples_per_cpu_s"])
    tools = [t for t in ("stoke-raw", "stoke-jpeg", "torch") if any(k[0] == t for k in runs)]
    med = {k: statistics.median(v) for k, v in runs.items()}
    cell = lambda k: (f"{med[k]:.0f} ({min(runs[k]):.0f}-{max(runs[k]):.0f})"
                      if k in runs else "-")
    print("\nSamples/s producing 3x224x224 uint8 random-resized-crops, batch 256, "
          "median (min-max):\n")
    ratios = [t for t in tools if t != "torch"]
    print("| workers | " + " | ".join(tools) + "".join(f" | {t} / torch" for t in ratios) + " |")
    print("|---:|" + "---:|" * (len(tools) + len(ratios)))
    for w in sorted({k[1] for k in runs}):
        line = f"| {w} | " + " | ".join(cell((t, w)) for t in tools)
        for t in ratios:
            ok = (t, w) in med and ("torch", w) in med
            line += f" | {med[(t, w)] / med[('torch', w)]:.1f}x" if ok else " | -"
        print(line + " |")
    print("\nTargets: stoke-raw / torch >= 10x, stoke-jpeg / torch >= 3x.")
    for k, v in sorted(per_cpu.items()):
        print(f"\n{k[0]}, {k[1]} workers: {statistics.median(v):.0f} samples per CPU second "
              f"(main process and workers; {min(v):.0f}-{max(v):.0f})")
    for r in rows:
        if "original_per_image" in r:
            print(f"\nDisk bytes per image ({r['images']} images):\n")
            print("| what | bytes per image | / original |\n|---|---:|---:|")
            o = r["original_per_image"]
            print(f"| original JPEG files | {o:.0f} | 1.00 |")
            for k, v in r.items():
                if isinstance(v, dict):
                    b = v["data_mdb_per_record"]
                    print(f"| {k}/data.mdb / {v['records']} records | {b:.0f} | {b / o:.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("photos")
    t.add_argument("workers", type=int)
    t.add_argument("--batch", type=int, default=256)
    t.add_argument("--warmup", type=int, default=2)
    t.add_argument("--batches", type=int, default=16)
    t.add_argument("--crop", type=int, default=224)
    t.add_argument("--seed", type=int, default=0)
    b = sub.add_parser("bytes")
    b.add_argument("photos")
    b.add_argument("dbs", nargs="*")
    r = sub.add_parser("report")
    r.add_argument("results")
    args = ap.parse_args()
    {"time": cmd_time, "bytes": cmd_bytes, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
