#!/usr/bin/env python3
"""Aspect-keeping and JPEG records (format 2, docs/formats.md): a folder of
photos of varied sizes prepared with --short-side (raw and jpeg), --max-side
alone and --size with --encode jpeg, read back by the Python reader of
docs/formats.md and checked against PIL: raw records equal PIL's BILINEAR
resize of the original within 1 level at torchvision's Resize(S, max_size)
size, JPEG records decode (PIL) close to that, stoke's Python reader decodes
them exactly as PIL does, and 1 and 3 workers write identical files."""
import filecmp, io, os, shutil, subprocess, sys
import stoke_test as t

np = t.need("numpy")
t.need("PIL")
from PIL import Image

tmp = os.environ["STK_TMP"]
bindir = os.environ["STK_BIN"]
prep, dbinfo = os.path.join(bindir, "prep"), os.path.join(bindir, "dbinfo")
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
os.chdir(tmp)
os.environ["SOURCE_DATE_EPOCH"] = "1700000000"

sys.path.insert(0, os.path.join(os.environ["STK_SRC"], "bench"))
from make_photos import photo_path  # noqa: E402  (Debian's or STK_PHOTOS)
PHOTOS = [photo_path(n) for n in ("astronaut.png", "chelsea.png", "coffee.png", "camera.png",
                                  "rocket.jpg", "china.jpg", "flower.jpg")]
PHOTOS = [p for p in PHOTOS if os.path.exists(p)]
if len(PHOTOS) < 3:
    sys.exit("FAIL: the sample photos of python3-skimage / python3-sklearn are missing")

# (w, h): landscape, portrait, square, one smaller than S (kept as is),
# a long strip (the max-side cap binds), odd sizes
SIZES = [(120, 90), (90, 120), (100, 100), (40, 30), (300, 60), (61, 157),
         (77, 77), (200, 131), (53, 250)]
rng = np.random.default_rng(7)
files = []
for k, cls in enumerate(("cat", "dog", "ship")):
    os.makedirs(f"raw/{cls}")
    for j, (w, h) in enumerate(SIZES):
        src = Image.open(PHOTOS[(3 * k + j) % len(PHOTOS)]).convert("RGB")
        x0, y0 = rng.integers(0, src.width // 4), rng.integers(0, src.height // 4)
        im = src.crop((x0, y0, src.width - rng.integers(0, src.width // 4),
                       src.height - rng.integers(0, src.height // 4))).resize((w, h), Image.LANCZOS)
        path = f"raw/{cls}/{j:02d}." + ("jpg" if j % 2 else "png")
        im.save(path, **({"quality": 92} if j % 2 else {}))
        files.append((k, path))


def target(w, h, s, m, upscale=False):
    """torchvision's Resize(s, max_size=m) size, never enlarged unless asked."""
    short, long_ = min(w, h), max(w, h)
    ns, nl = (s, s * long_ // short) if s else (short, long_)
    if m and nl > m:
        ns, nl = max(m * ns // nl, 1), m
    if not upscale and nl >= long_:
        ns, nl = short, long_
    return (ns, nl) if w <= h else (nl, ns)


def run(*args):
    subprocess.run([prep, "--quiet", *args], check=True)


r = t.formats_reader()
S, L = 48, 96
results = {}
for enc in ("raw", "jpeg"):
    db = f"db_{enc}"
    run("--workers", "3", "--short-side", str(S), "--encode", enc, "raw", db)
    env, meta = r["open_stoke"](db)
    rec = meta["record"]
    assert meta["format_version"] == 2 and rec["header_bytes"] == 16, rec
    assert rec["shape"] == [3, None, None] and rec["variable"] is True, rec
    assert rec["encoding"] == enc and rec["short_side"] == S and rec["max_side"] == L, rec
    assert (rec.get("quality") == 90) == (enc == "jpeg"), rec
    worst, nbytes = 0, 0
    for i, (label, path) in enumerate(files):
        orig = Image.open(path).convert("RGB")
        w, h = target(orig.width, orig.height, S, L)
        ref = np.asarray(orig.resize((w, h), Image.BILINEAR)).transpose(2, 0, 1).astype(int)
        lab, rh, rw, payload = r["read_record"](env, meta, "train", i)
        assert (lab, rh, rw) == (label, h, w), (path, lab, rh, rw, label, h, w)
        nbytes += 16 + len(payload)
        _, px = r["read_sample"](env, meta, "train", i)
        assert px.shape == (3, h, w), (path, px.shape)
        if enc == "raw":
            d = np.abs(px.astype(int) - ref).max()
            assert d <= 1, (path, d)
        else:
            assert payload[:2] == b"\xff\xd8", path
            d = np.abs(px.astype(int) - ref).mean()
            assert d < 8, (path, d)  # quality 90, 4:2:0, 48-pixel photos
        worst = max(worst, d)
    results[enc] = (nbytes / len(files), worst, meta["splits"]["train"]["mean"])
    print(f"ok: --short-side {S} --encode {enc}: {len(files)} records at torchvision's "
          f"sizes, worst difference to PIL {worst:.2f}, {nbytes / len(files):.0f} bytes/record")

# mean and std of the stored pixels: a JPEG database's are those of its
# decoded records (docs/formats.md), as PIL decodes them
for enc in ("raw", "jpeg"):
    env, meta = r["open_stoke"](f"db_{enc}")
    px = np.concatenate([r["read_sample"](env, meta, "train", i)[1].reshape(3, -1)
                         for i in range(len(files))], 1).astype(np.float64) / 255
    sp = meta["splits"]["train"]
    assert np.abs(px.mean(1) - sp["mean"]).max() < 1e-9, (enc, px.mean(1), sp["mean"])
    assert np.abs(px.std(1) - sp["std"]).max() < 1e-9, (enc, px.std(1), sp["std"])
print("ok: mean/std in the metadata are those of the stored (decoded) pixels")
print(f"disk bytes per image (records, 16-byte header included): raw {results['raw'][0]:.0f}, "
      f"jpeg {results['jpeg'][0]:.0f}, originals "
      f"{sum(os.path.getsize(p) for _, p in files) / len(files):.0f}")

# stoke's own Python reader decodes JPEG records exactly as PIL decodes the bytes
sys.path.insert(0, os.path.join(bindir, "..", "python"))
try:
    import stoke
except ImportError:
    stoke = None
if stoke is not None and hasattr(stoke, "open"):
    db = stoke.open("db_jpeg")
    assert db.variable and db.encoding == "jpeg", (db.variable, db.encoding)
    env, meta = r["open_stoke"]("db_jpeg")
    for i in range(len(files)):
        img, label = db["train"][i]
        _, h, w, payload = r["read_record"](env, meta, "train", i)
        pil = np.asarray(Image.open(io.BytesIO(payload)).convert("RGB")).transpose(2, 0, 1)
        assert img.shape == (3, h, w) and np.array_equal(np.asarray(img), pil), (i, img.shape)
        assert np.asarray(img).flags.writeable  # its own decoded pixels
    print(f"ok: stoke.open(...)['train'][i] decodes all {len(files)} JPEG records exactly as PIL")

# determinism: 1 and 3 workers write the same bytes (JPEG too)
run("--workers", "1", "--short-side", str(S), "--encode", "jpeg", "raw", "db_jpeg1")
assert filecmp.cmp("db_jpeg/data.mdb", "db_jpeg1/data.mdb", shallow=False)
print("ok: --encode jpeg: 1 and 3 workers give identical data.mdb")

# --max-side alone caps the longer side only; --upscale enlarges
run("--max-side", "100", "raw", "db_cap")
run("--short-side", "64", "--upscale", "--gray", "raw", "db_up")
for db, s, m, up, c in (("db_cap", 0, 100, False, 3), ("db_up", 64, 128, True, 1)):
    env, meta = r["open_stoke"](db)
    assert meta["record"]["shape"] == [c, None, None] and meta["record"]["max_side"] == m
    for i, (label, path) in enumerate(files):
        orig = Image.open(path)
        w, h = target(orig.width, orig.height, s, m, up)
        _, rh, rw, _ = r["read_record"](env, meta, "train", i)
        assert (rh, rw) == (h, w), (db, path, rh, rw, h, w)
print("ok: --max-side alone and --short-side --upscale sizes")

# fixed size, JPEG: format 2 with a shape, every record 32x32
run("--size", "32", "--encode", "jpeg", "--quality", "75", "raw", "db_fixjpeg")
env, meta = r["open_stoke"]("db_fixjpeg")
assert meta["record"]["shape"] == [3, 32, 32] and meta["record"]["variable"] is False
assert meta["record"]["quality"] == 75
for i in range(len(files)):
    _, px = r["read_sample"](env, meta, "train", i)
    assert px.shape == (3, 32, 32)
print("ok: --size 32 --encode jpeg --quality 75")

out = subprocess.run([dbinfo, "db_raw", "--verify"], capture_output=True, text=True)
assert out.returncode == 0, out.stdout + out.stderr
assert "variable" in out.stdout, out.stdout
print("ok: dbinfo --verify:", [l for l in out.stdout.splitlines() if "record" in l][:2])
out = subprocess.run([dbinfo, "db_jpeg", "--verify"], capture_output=True, text=True)
assert out.returncode == 0 and "jpeg" in out.stdout, out.stdout + out.stderr

# refusals, each naming what is wrong
for args, pat, code in ((["--size", "32", "--short-side", "48"], "--size", 2),
                        (["--quality", "80"], "--encode jpeg", 2),
                        (["--short-side", "48", "--max-side", "20"], "--max-side 20", 2),
                        (["--short-side", "48", "--format", "idx"],
                         "--format idx: --short-side/--max-side apply to image folders", 2),
                        (["--holdout", "0.1", "--format", "cifar"],
                         "--format cifar: --holdout needs a folder of class folders", 2)):
    p = subprocess.run([prep, "--quiet", *args, "raw", "db_bad"], capture_output=True, text=True)
    assert p.returncode == code and (pat is None or pat in p.stderr), (args, p.returncode, p.stderr)
p = subprocess.run([prep, "--quiet", "--short-side", "20", t.FASHION, "db_bad"],
                   capture_output=True, text=True)
assert p.returncode == 1 and "image folders" in p.stderr, p.stderr
if stoke is not None:  # loads, cropped to one size (0.875 * 48 = 42)
    ld = stoke.Loader("db_jpeg", "train", batch_size=4)
    assert ld.shape == (3, 42, 42), ld.shape
    images, _ = next(iter(ld))
    assert images.shape == (4, 3, 42, 42), images.shape
print("ok: refusals (prep's flags); stoke.Loader crops a format 2 database to one size")

# a fixed-size, non-square JPEG database (IDX images of 40x30): dbinfo --grid
# fits each record to a square tile, within its buffer
os.makedirs("idx_wide")
rng = np.random.default_rng(2)
t.write_idx("idx_wide/train-images-idx3-ubyte", rng.integers(0, 256, (12, 30, 40)))
t.write_idx("idx_wide/train-labels-idx1-ubyte", np.arange(12) % 3)
run("--workers", "2", "--encode", "jpeg", "idx_wide", "db_wide")
out = subprocess.run([dbinfo, "db_wide", "--grid", "wide.png"], capture_output=True, text=True)
assert out.returncode == 0 and os.path.getsize("wide.png") > 0, out.stdout + out.stderr
wide = np.asarray(Image.open("wide.png"))
assert wide.shape[0] == wide.shape[1], wide.shape  # square tiles, not 30x40
print("ok: dbinfo --grid on a non-square fixed JPEG database:", wide.shape)
