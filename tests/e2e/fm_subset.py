"""fm_subset.py SRC DST N [NTEST] - a smaller Fashion-MNIST: the first N
training samples of SRC's IDX files, and the whole test split (or its first
NTEST samples), into DST (raw IDX, which prep reads like the gzipped
originals)."""
import gzip
import os
import shutil
import sys

src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ntest = int(sys.argv[4]) if len(sys.argv) > 4 else None


def first(part, kind, per, count):
    """The IDX file SRC/part-kind with its first count samples, into DST."""
    with gzip.open(os.path.join(src, "%s-%s-ubyte.gz" % (part, kind)), "rb") as f:
        data = f.read()
    ndim = data[3]
    head = bytearray(data[:4 + 4 * ndim])
    head[4:8] = count.to_bytes(4, "big")
    body = data[4 + 4 * ndim:4 + 4 * ndim + count * per]
    assert len(body) == count * per
    with open(os.path.join(dst, "%s-%s-ubyte" % (part, kind)), "wb") as f:
        f.write(bytes(head) + body)


os.makedirs(dst, exist_ok=True)
for kind, per in (("images-idx3", 28 * 28), ("labels-idx1", 1)):
    first("train", kind, per, n)
    if ntest is None:
        shutil.copy(os.path.join(src, "t10k-%s-ubyte.gz" % kind), dst)
    else:
        first("t10k", kind, per, ntest)
