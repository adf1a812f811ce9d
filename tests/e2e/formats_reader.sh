#!/usr/bin/env bash
# prep of Fashion-MNIST gives 60000 + 10000 records whose pixels and labels
# equal the IDX source bytes, read back by the Python reader of
# docs/formats.md (an independent implementation of the format); the class
# names do not depend on how RAW_DIR is spelled.
source "$STK_SRC/tests/e2e/lib.sh"
"$STK_BIN/prep" --workers 2 --quiet "$FASHION" db
$PY - <<'PY'
import numpy as np, stoke_test as t
r = t.formats_reader()
env, meta = r["open_stoke"]("db")
assert meta["record"]["shape"] == [1, 28, 28], meta["record"]
assert meta["classes"][0] == "T-shirt/top" and len(meta["classes"]) == 10
rng = np.random.default_rng(1)
for split, prefix, count in (("train", "train", 60000), ("test", "t10k", 10000)):
    assert meta["splits"][split]["count"] == count, meta["splits"][split]
    with env.begin(db=env.open_db(split.encode(), create=False)) as txn:
        assert txn.stat()["entries"] == count
    imgs = t.read_idx(f"{t.FASHION}/{prefix}-images-idx3-ubyte.gz")
    labels = t.read_idx(f"{t.FASHION}/{prefix}-labels-idx1-ubyte.gz")
    idx = list(rng.choice(count, 300, replace=False)) + [0, count - 1]
    for i in idx:
        label, px = r["read_sample"](env, meta, split, int(i))
        assert label == labels[i], (split, i, label, labels[i])
        assert np.array_equal(px[0], imgs[i]), (split, i)
    hist = np.bincount(labels, minlength=10).tolist()
    assert meta["splits"][split]["label_counts"] == hist
    mean = imgs.astype(np.float64).mean() / 255
    std = imgs.astype(np.float64).std() / 255
    assert abs(meta["splits"][split]["mean"][0] - mean) < 1e-9, (mean, meta)
    assert abs(meta["splits"][split]["std"][0] - std) < 1e-9, (std, meta)
    print(f"ok: {split}: {count} records, {len(idx)} sampled equal the IDX bytes, "
          f"mean {mean:.4f} std {std:.4f}")
PY
# Fashion-MNIST's class names whatever RAW_DIR's spelling: "." from inside
# its folder, and a link named otherwise, name the folder its path names
$PY "$STK_SRC/tests/e2e/fm_subset.py" "$FASHION" fashion-sub 300 100
ln -s fashion-sub fm
(cd fashion-sub && "$STK_BIN/prep" --quiet . ../db-dot) || fail "prep . in fashion-sub"
"$STK_BIN/prep" --quiet fm db-link || fail "prep fm"
# torchvision's layout, ROOT/FashionMNIST/raw; and a folder whose parent
# (not itself) says fashion is no Fashion-MNIST
mkdir -p tv/FashionMNIST fashion-proj && cp -r fashion-sub tv/FashionMNIST/raw \
  && cp -r fashion-sub fashion-proj/mnist
"$STK_BIN/prep" --quiet tv/FashionMNIST/raw db-tv || fail "prep tv/FashionMNIST/raw"
"$STK_BIN/prep" --quiet fashion-proj/mnist db-parent || fail "prep fashion-proj/mnist"
$PY - <<'PY'
import stoke_test as t
r = t.formats_reader()
for db in ("db-dot", "db-link", "db-tv"):
    env, meta = r["open_stoke"](db)
    assert meta["classes"][:2] == ["T-shirt/top", "Trouser"], (db, meta["classes"])
env, meta = r["open_stoke"]("db-parent")
assert meta["classes"][:2] == ["0", "1"], meta["classes"]
print("ok: prep ., prep LINK and torchvision's FashionMNIST/raw name Fashion-MNIST's "
      "classes; a parent folder's name does not")
PY

# and the documented reader's own command line
$PY -c 'import stoke_test as t, runpy, sys' >/dev/null
awk '/^```python/{f=1;next}/^```/{f=0}f' "$STK_SRC/docs/formats.md" > reader.py
out=$($PY reader.py db test 0)
grep -q "^Ankle boot (1, 28, 28)" <<<"$out" || fail "reader.py printed: $out"
ok "docs/formats.md reader: $out"

# dbinfo: the summary and a contact sheet whose first tile is sample 0
"$STK_BIN/dbinfo" db --grid sheet.png > info.txt
grep -q "split train: 60000 records" info.txt || fail "dbinfo: $(cat info.txt)"
grep -Eq "mean 0\.2860 +std 0\.3530" info.txt || fail "dbinfo mean/std: $(cat info.txt)"
$PY - <<'PY' || fail "contact sheet"
import numpy as np, stoke_test as t
from PIL import Image
im = np.asarray(Image.open("sheet.png"))
assert im.shape == (8 * 28 + 9 * 2,) * 2, im.shape
imgs = t.read_idx(f"{t.FASHION}/train-images-idx3-ubyte.gz")
assert np.array_equal(im[2:30, 2:30], imgs[0]) and np.array_equal(im[2:30, 32:60], imgs[1])
assert np.array_equal(im[2 + 7 * 30:30 + 7 * 30, 2 + 7 * 30:30 + 7 * 30], imgs[63])
print("ok: dbinfo --grid tiles equal samples 0, 1 and 63")
PY
