#!/usr/bin/env python3
"""stoke.Loader's pinned ring on a GPU (docs/python.md, pin_memory): each
batch's copy (.cuda(non_blocking=True)) is queued behind a spin kernel
(torch.cuda._sleep, about a millisecond), so the loop runs ahead of the
GPU while the copies wait. A buffer may go back to the ring only once the
CUDA work queued while its batch was current has completed (the Loader's
event per batch); a buffer refilled early would put the wrong bytes on
the GPU. Three epochs of 20 batches through the default ring (refilled
many times, the records written with streaming stores): every byte and
label on the GPU equals the IDX files', in the order of docs/loader.md.
Skips (77) where PyTorch sees no CUDA device."""
import sys
import time

import stoke_py as s
from stoke_py import check, np, stoke

torch = s.need("torch")
if not torch.cuda.is_available():
    print("skip: PyTorch sees no CUDA device")
    sys.exit(77)

SEED, BATCH, SPIN = 7, 100, 2_000_000  # SPIN: GPU cycles, ~1 ms


def main():
    s.scratch()
    t0 = time.monotonic()
    db, raw = s.fashion_db("fm", 1000, 2000)
    X, Y = s.idx(raw, "test")
    L = stoke.Loader(db, split="test", batch_size=BATCH, seed=SEED, workers=2,
                     as_torch=True)
    check(L.pin_memory, "pin_memory should be the default where CUDA is there")
    for e in range(3):
        on_gpu = []
        host = time.monotonic()
        for x, y in L:
            torch.cuda._sleep(SPIN)  # the copy below waits for this
            on_gpu.append((x.cuda(non_blocking=True), y.cuda(non_blocking=True)))
        host = time.monotonic() - host
        gpu = time.monotonic()
        torch.cuda.synchronize()
        gpu = time.monotonic() - gpu
        xs = torch.cat([a for a, _ in on_gpu]).cpu().numpy()
        ys = torch.cat([b for _, b in on_gpu]).cpu().numpy()
        want = np.asarray(s.shard(len(X), SEED, e))
        check(np.array_equal(ys, Y[want]), "epoch %d: labels on the GPU differ" % e)
        bad = [k for k in range(len(on_gpu))
               if not np.array_equal(xs[k * BATCH:(k + 1) * BATCH],
                                     X[want[k * BATCH:(k + 1) * BATCH]])]
        check(not bad, "epoch %d: images on the GPU differ in batches %s "
              "(a buffer refilled before its copy ran?)" % (e, bad))
        print("epoch %d: %d batches byte-exact on the GPU; the loop took %.1f ms, "
              "the GPU %.1f ms more" % (e, len(on_gpu), host * 1e3, gpu * 1e3))
    L.close()
    print("ok: python_cuda: the pinned ring's batches arrive byte-exact behind "
          "spinning kernels (%.1f s)" % (time.monotonic() - t0))


if __name__ == "__main__":
    main()
