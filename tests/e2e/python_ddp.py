#!/usr/bin/env python3
"""stoke.Loader under data parallelism (issue 16): two processes, started
as torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and
joined in a gloo process group, take rank and world size from the group
and see every sample of an epoch exactly once between them, each rank its
DistributedSampler shard in the order of docs/loader.md, a different order
each epoch without set_epoch, and set_epoch(e) repeats epoch e. Without a
process group RANK/WORLD_SIZE are the defaults; an odd count is padded
(one sample twice), trimmed (drop_last) or split unevenly (uneven=True,
every sample once). Samples are told apart by the bytes of image and
label: the API is not widened for the test."""
import hashlib
import os
import socket
import subprocess
import sys
import time

import stoke_py as s
from stoke_py import check, np

CHILD = r"""
import hashlib, os, sys
import numpy as np
import stoke
db, mode, out = sys.argv[1:4]

def keys(batches):
    return [hashlib.blake2b(bytes(np.asarray(x[i])) + int(y[i]).to_bytes(8, "little"),
                            digest_size=8).hexdigest()
            for x, y in batches for i in range(len(y))]

res = {}
if mode == "gloo":
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env://, as under torchrun
    # the group, not the variables, must give rank and world from here on
    os.environ.update(RANK="0", WORLD_SIZE="1")
    L = stoke.Loader(db, split="test", batch_size=128, seed=21, workers=2,
                     as_torch=True)
    res["world"] = [L.rank, L.world_size, len(L)]
    for e in range(3):
        res["epoch%d" % e] = keys(L)
    L.set_epoch(1)
    res["again1"] = keys(L)
    res["epoch2b"] = keys(L)  # the loop after set_epoch(1): epoch 2
    n = torch.tensor([len(res["epoch0"])])
    dist.all_reduce(n)  # a real collective over the group
    res["total"] = int(n)
    dist.destroy_process_group()
else:  # RANK / WORLD_SIZE only, no process group; an odd count
    for kw in ("pad", "drop_last", "uneven"):
        L = stoke.Loader(db, split="train", batch_size=100, seed=4, workers=1,
                         **({} if kw == "pad" else {kw: True}))
        res["world"] = [L.rank, L.world_size]
        res[kw] = keys(L)
import json
json.dump(res, open(out, "w"))
"""


def key(x, y):
    return hashlib.blake2b(x.tobytes() + int(y).to_bytes(8, "little"),
                           digest_size=8).hexdigest()


def run_pair(db, mode):
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(
            [sys.executable, "-c", CHILD, db, mode, "%s%d.json" % (mode, r)], env=env))
    for p in procs:
        try:
            check(p.wait(timeout=240) == 0, "a %s rank failed (exit %d)" % (mode, p.returncode))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError("%s ranks hang" % mode)
    import json
    return [json.load(open("%s%d.json" % (mode, r))) for r in range(2)]


def main():
    s.scratch()
    t0 = time.monotonic()
    s.need("torch")
    db, raw = s.fashion_db("fm", n=2001, ntest=10000)
    X, Y = s.idx(raw, "test")
    keys = [key(X[i], Y[i]) for i in range(len(X))]
    n = len(keys)

    ranks = run_pair(db, "gloo")
    for r, res in enumerate(ranks):
        check(res["world"] == [r, 2, 40], "rank %d: (rank, world, batches) %s" % (r, res["world"]))
        check(res["total"] == n, "all_reduce of the samples seen: %d" % res["total"])
    orders = []
    for e in range(3):
        seen = ranks[0]["epoch%d" % e] + ranks[1]["epoch%d" % e]
        check(len(seen) == n and sorted(seen) == sorted(keys),
              "epoch %d: the two ranks do not see every sample exactly once" % e)
        for r in range(2):
            want = [keys[i] for i in s.shard(n, 21, e, r, 2)]
            check(ranks[r]["epoch%d" % e] == want,
                  "epoch %d rank %d: not its shard of docs/loader.md's order" % (e, r))
        orders.append(tuple(seen))
    check(len(set(orders)) == 3, "epochs 0, 1, 2 repeat an order")
    for r in range(2):
        check(ranks[r]["again1"] == ranks[r]["epoch1"], "set_epoch(1): rank %d differs" % r)
        check(ranks[r]["epoch2b"] == ranks[r]["epoch2"], "after set_epoch(1): rank %d" % r)
    print("ok: gloo, 2 ranks: every sample of each of 3 epochs exactly once "
          "between them, each rank its shard, new orders each epoch, set_epoch "
          "repeats one")

    Xt, Yt = s.idx(db + "-raw", "train")
    tkeys = [key(Xt[i], Yt[i]) for i in range(len(Xt))]
    m = len(tkeys)
    envs = run_pair(db, "env")
    for r, res in enumerate(envs):
        check(res["world"] == [r, 2], "RANK/WORLD_SIZE: rank %d got %s" % (r, res["world"]))
    for kw in ("pad", "drop_last", "uneven"):
        got = envs[0][kw] + envs[1][kw]
        for r in range(2):
            want = [tkeys[i] for i in s.shard(m, 4, 0, r, 2, **({} if kw == "pad" else {kw: True}))]
            check(envs[r][kw] == want, "%s rank %d: not its shard" % (kw, r))
        if kw == "uneven":
            check(sorted(got) == sorted(tkeys), "uneven: not every sample once")
        elif kw == "pad":
            first = tkeys[s.permutation(m, 4, 0)[0]]
            check(sorted(got) == sorted(tkeys + [first]), "pad: not all + the first again")
        else:
            check(len(got) == m - 1 and len(set(got) - set(tkeys)) == 0, "drop_last")
    print("ok: RANK/WORLD_SIZE without a group, 2001 samples: padded (one twice), "
          "drop_last (one left out), uneven (each once), each rank its shard")
    print("ok: python_ddp in %.1f s" % (time.monotonic() - t0))


if __name__ == "__main__":
    main()
