"""fm_subset.py SRC DST N - a smaller Fashion-MNIST: the first N training
samples of SRC's IDX files, and the whole test split, into DST (raw IDX,
which prep reads like the gzipped originals)."""
import gzip
import os
import shutil
import sys

src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.makedirs(dst, exist_ok=True)
for kind, per in (("images-idx3", 28 * 28), ("labels-idx1", 1)):
    with gzip.open(os.path.join(src, "train-%s-ubyte.gz" % kind), "rb") as f:
        data = f.read()
    ndim = data[3]
    head = bytearray(data[:4 + 4 * ndim])
    head[4:8] = n.to_bytes(4, "big")
    body = data[4 + 4 * ndim:4 + 4 * ndim + n * per]
    assert len(body) == n * per
    with open(os.path.join(dst, "train-%s-ubyte" % kind), "wb") as f:
        f.write(bytes(head) + body)
    shutil.copy(os.path.join(src, "t10k-%s-ubyte.gz" % kind), dst)
