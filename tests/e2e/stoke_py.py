"""Helpers for the tests of the Python package (python_*.py): a scratch
directory, Fashion-MNIST databases made by the prep command, the expected
batches of a Loader (the order of docs/loader.md, computed here), the
augmentation's draws (a numpy Philox4x32-10), and the process's resident
memory and threads from /proc."""
import os
import re
import subprocess
import sys
import time

from stoke_test import FASHION, SRC, need, np, permutation, read_idx

stoke = need("stoke")
TMP = os.environ.get("STK_TMP") or sys.exit("run through ctest (STK_TMP)")
PREP = os.path.join(os.environ["STK_BIN"], "prep")


def scratch():
    """Empties this test's STK_TMP and enters it."""
    import shutil
    shutil.rmtree(TMP, ignore_errors=True)
    os.makedirs(TMP)
    os.chdir(TMP)
    if not os.path.isdir(FASHION):
        sys.exit("FAIL: %s is missing (scripts/deps.sh installs "
                 "dataset-fashion-mnist)" % FASHION)


def fashion_db(db, n=None, ntest=None):
    """A database of Fashion-MNIST (whole, or its first n training and
    ntest test samples) made by the prep command; returns (db, raw dir)."""
    raw = FASHION
    if n is not None:
        raw = db + "-raw"
        args = [sys.executable, os.path.join(SRC, "tests", "e2e", "fm_subset.py"),
                FASHION, raw, str(n)] + ([str(ntest)] if ntest else [])
        subprocess.run(args, check=True)
    subprocess.run([PREP, "--quiet", raw, db], check=True)
    return db, raw


def idx(raw, split):
    """(images (N, 1, 28, 28) uint8, labels (N,)) of a split's IDX files."""
    part = "train" if split == "train" else "t10k"
    def path(kind):
        p = os.path.join(raw, "%s-%s-ubyte" % (part, kind))
        return p if os.path.exists(p) else p + ".gz"
    images = read_idx(path("images-idx3"))
    return images[:, None], read_idx(path("labels-idx1")).astype(np.int64)


def shard(n, seed, epoch, rank=0, world=1, shuffle=True, drop_last=False,
          uneven=False):
    """The sample indices rank takes in an epoch (docs/loader.md)."""
    order = permutation(n, seed, epoch) if shuffle else list(range(n))
    if uneven:
        total = n
    elif drop_last:
        total = world * (n // world)
    else:
        total = world * -(-n // world)
    return [order[g % n] for g in range(rank, total, world)]


def batches_of(loader, epochs=1):
    """Each epoch's batches as copies: [[(images, labels)...]...]."""
    out = []
    for _ in range(epochs):
        out.append([(np.array(x), np.array(y)) for x, y in loader])
    return out


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def raises(kind, pattern, fn, *args, **kw):
    """fn(*args, **kw) must raise kind (a stoke.Error) whose message matches
    pattern; returns the exception."""
    try:
        fn(*args, **kw)
    except kind as e:
        check(isinstance(e, stoke.Error), "%r is not a stoke.Error" % e)
        check(re.search(pattern, str(e)),
              "%s: message %r lacks /%s/" % (type(e).__name__, str(e), pattern))
        print("ok: %s: %s" % (type(e).__name__, e))
        return e
    except Exception as e:
        raise AssertionError("expected %s /%s/, got %s: %s"
                             % (kind.__name__, pattern, type(e).__name__, e))
    raise AssertionError("expected %s /%s/, nothing was raised"
                         % (kind.__name__, pattern))


def rss_kib():
    """Resident memory of this process (/proc/self/statm), KiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def threads():
    """stoke's threads in this process: those whose name (common's
    stk_thread_start) starts with "stk-". Not every thread: a CUDA build
    of PyTorch starts threads of its own between two counts."""
    n = 0
    for t in os.listdir("/proc/self/task"):
        try:
            with open("/proc/self/task/%s/comm" % t) as f:
                n += f.read().startswith("stk-")
        except FileNotFoundError:  # a thread that left while we looked
            pass
    return n


def settle(target, timeout=5.0):
    """Threads, once they are down to target (a thread that was told to
    stop takes a moment to leave /proc) or the timeout passed."""
    end = time.monotonic() + timeout
    while threads() > target and time.monotonic() < end:
        time.sleep(0.01)
    return threads()


# ---- the augmentation's draws (kernels/ops_inline.h, loader/loader.c) ----

M32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(ctr, k0, k1):
    """Philox4x32-10 on counters ctr (4 uint64 arrays holding 32-bit words)
    with key (k0, k1): stk_philox4x32_10, vectorised."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & M32 for c in ctr)
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(0x9E3779B9)) & M32
            k1 = (k1 + np.uint64(0xBB67AE85)) & M32
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & M32)
    return c0, c1, c2, c3


def aug_key(seed):
    """stk_loader_aug_key."""
    return ((seed & 0xFFFFFFFF) ^ 0x243F6A88,
            ((seed >> 32) & 0xFFFFFFFF) ^ 0x5BD1E995 ^ 0x85A308D3)


def aug_draws(seed, epoch, samples, pad, flip=True):
    """(dy, dx, mirror) arrays of stk_transform_draw for sample indices."""
    s = np.asarray(samples, np.uint64)
    e = np.uint64(epoch)
    r = philox4x32_10((s & M32, s >> np.uint64(32),
                       np.full_like(s, e & M32), np.full_like(s, e >> np.uint64(32))),
                      *aug_key(seed))
    span = np.uint64(2 * pad + 1)
    dy = (r[0] % span).astype(np.int64) - pad if pad else np.zeros(len(s), np.int64)
    dx = (r[1] % span).astype(np.int64) - pad if pad else np.zeros(len(s), np.int64)
    mirror = (r[2] & np.uint64(1)).astype(bool) & bool(flip)
    return dy, dx, mirror


def crop_flip(img, dy, dx, mirror):
    """img (C, H, W) read through a crop offset (zero outside) and a
    horizontal flip, as the loader's augment() writes it."""
    c, h, w = img.shape
    src = img
    if mirror:  # out[y, x] = img[y + dy, w - 1 - x + dx]: flipped, -dx
        src, dx = img[:, :, ::-1], -dx
    out = np.zeros_like(img)
    ys, xs = slice(max(0, -dy), min(h, h - dy)), slice(max(0, -dx), min(w, w - dx))
    out[:, ys, xs] = src[:, max(0, dy):min(h, h + dy), max(0, dx):min(w, w + dx)]
    return out
