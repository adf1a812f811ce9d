"""idx.py - the IDX (MNIST-style) reader the benchmark scripts share."""
import gzip

import numpy as np


def read_idx(path):
    """Reads a (gzipped) unsigned-byte IDX file into a numpy array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if data[:3] != b"\0\0\x08":
        raise ValueError("%s: not an unsigned-byte IDX file" % path)
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)
