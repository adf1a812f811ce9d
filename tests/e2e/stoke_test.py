"""Helpers for the end-to-end tests: the Python reader of docs/formats.md
(executed from the document itself, so the documented code is what we test),
an independent IDX reader, image generators, the training order of
docs/loader.md and a safetensors reader/writer (F32 and I64) (numpy only, so that
tests without PyTorch use them too); need() for the Python modules the
tests use."""
import gzip, importlib, json, os, re, struct, sys

# Debian's dataset-fashion-mnist, unless STK_FASHION points elsewhere (as
# tests/e2e/lib.sh: scripts/gpu_check.sh on a machine without the package)
FASHION = os.environ.get("STK_FASHION", "/usr/share/datasets/fashion-mnist")

# The Debian package of each module the tests import (scripts/deps.sh test
# installs them all).
DEBIAN = {"numpy": "python3-numpy", "PIL": "python3-pil", "lmdb": "python3-lmdb",
          "torch": "python3-torch"}


def need(module):
    """Imports module, or exits 1 naming the Debian package to install: a
    missing dependency fails the test (only a missing GPU skips, 77)."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        sys.exit(f"FAIL: {sys.executable} cannot import {module} ({e}); install "
                 f"{DEBIAN.get(module, module)} (scripts/deps.sh test installs it)")


np = need("numpy")

SRC = os.environ.get("STK_SRC", os.path.join(os.path.dirname(__file__), "..", ".."))


MASK64 = (1 << 64) - 1


def splitmix64(state):
    """One SplitMix64 step: (new state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


def permutation(n, seed, epoch):
    """The training order of docs/loader.md for (seed, epoch) (world 1)."""
    _, s = splitmix64(seed & MASK64)
    state = s ^ ((epoch * 0xD1B54A32D192ED03) & MASK64)
    perm = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        state, r = splitmix64(state)
        m = r * bound
        low = m & MASK64
        if low < bound:
            threshold = (-bound & MASK64) % bound
            while low < threshold:
                state, r = splitmix64(state)
                m = r * bound
                low = m & MASK64
        j = m >> 64
        perm[i], perm[j] = perm[j], perm[i]
    return perm


# safetensors dtypes: F32 for every float tensor, I64 for integer ones
# (batchnorm's num_batches_tracked, a 0-dim int64 in PyTorch's state dict).
DTYPES = {"F32": "<f4", "I64": "<i8"}


def save_safetensors(path, arrays, metadata=None):
    """arrays: {name: numpy array}, written in the given order as I64 if
    integer, else F32, the header padded to 8 bytes."""
    header, blobs, off = {"__metadata__": metadata or {"format": "pt"}}, [], 0
    for name, v in arrays.items():
        kind = "I64" if np.issubdtype(np.asarray(v).dtype, np.integer) else "F32"
        a = np.array(v, dtype=DTYPES[kind], order="C")  # 0-dim stays 0-dim
        header[name] = {"dtype": kind, "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    js = json.dumps(header, separators=(",", ":")).encode()
    js += b" " * (-len(js) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(js)) + js + b"".join(blobs))


def load_safetensors(path):
    """({name: float32 or int64 numpy array (read-only view)}, the metadata
    dict)."""
    data = open(path, "rb").read()
    (n,) = struct.unpack_from("<Q", data, 0)
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, e in header.items():
        assert e["dtype"] in DTYPES, (path, name, e["dtype"])
        dt = np.dtype(DTYPES[e["dtype"]])
        b, en = e["data_offsets"]
        out[name] = np.frombuffer(data, dt, (en - b) // dt.itemsize,
                                  8 + n + b).reshape(e["shape"])
    return out, meta


def formats_reader():
    """Returns the namespace defined by the Python block of docs/formats.md."""
    text = open(os.path.join(SRC, "docs", "formats.md")).read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1, "docs/formats.md must hold exactly one python block"
    ns = {"__name__": "formats_reader"}
    exec(compile(blocks[0], "docs/formats.md", "exec"), ns)
    return ns


def write_idx(path, arr):
    """An uncompressed IDX file of an array as uint8."""
    arr = np.asarray(arr, np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack(">HBB", 0, 8, arr.ndim) +
                struct.pack(">" + "I" * arr.ndim, *arr.shape) + arr.tobytes())


def read_idx(path):
    """Independent IDX reader: numpy array of the file's dimensions."""
    data = open(path, "rb").read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    zero, dtype, ndim = struct.unpack_from(">HBB", data, 0)
    assert zero == 0 and dtype == 0x08, path
    dims = struct.unpack_from(">" + "I" * ndim, data, 4)
    return np.frombuffer(data, np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_images(n, seed=0):
    """n Fashion-MNIST training images (28x28 uint8), a real-data source for
    generated image folders."""
    imgs = read_idx(os.path.join(FASHION, "train-images-idx3-ubyte.gz"))
    rng = np.random.default_rng(seed)
    return imgs[rng.choice(len(imgs), n, replace=False)]


def write_png16(path, arr):
    """Minimal PNG writer for 16-bit gray (HxW) or RGB (HxWx3) arrays, which
    PIL cannot save."""
    import zlib
    arr = np.asarray(arr, dtype=">u2")
    h, w = arr.shape[:2]
    ctype = 0 if arr.ndim == 2 else 2
    raw = b"".join(b"\x00" + arr[y].tobytes() for y in range(h))
    def chunk(kind, data):
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))
    ihdr = struct.pack(">IIBBBBB", w, h, 16, ctype, 0, 0, 0)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
                chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def torchvision_fit(im, size, mode):
    """The reference pipeline: convert, Resize(size) (shorter side, PIL
    BILINEAR), CenterCrop(size), as CHW uint8 - what torchvision's
    ImageFolder + transforms produce."""
    from PIL import Image
    im = im.convert(mode)
    w, h = im.size
    if w <= h:
        ow, oh = size, int(size * h / w)
    else:
        ow, oh = int(size * w / h), size
    if (ow, oh) != (w, h):
        im = im.resize((ow, oh), Image.BILINEAR)
    left, top = int(round((ow - size) / 2.0)), int(round((oh - size) / 2.0))
    arr = np.asarray(im.crop((left, top, left + size, top + size)))
    return arr[None] if arr.ndim == 2 else arr.transpose(2, 0, 1)
