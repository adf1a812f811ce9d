#!/usr/bin/env python3
"""tests/e2e/shim/lmdb.py (python3-lmdb's API over liblmdb through ctypes,
for GPU machines whose Python cannot import Debian's module; docs/gpu.md)
against python3-lmdb itself: a stoke database read through both gives the
same metadata, entry counts, keys and records; a database written through
the shim (puts, a delete, a dropped sub-database, an aborted transaction)
reads back through python3-lmdb as written, and the other way round."""
import importlib.util, json, os, shutil, struct, subprocess
import stoke_test as t

real = t.need("lmdb")
SHIM = os.path.join(t.SRC, "tests", "e2e", "shim", "lmdb.py")
if os.path.samefile(real.__file__, SHIM):
    print(f"SKIP: `import lmdb` is the shim itself here ({SHIM}): no python3-lmdb "
          "to compare it with")
    raise SystemExit(77)
spec = importlib.util.spec_from_file_location("lmdb_shim", SHIM)
shim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(shim)

tmp = os.environ["STK_TMP"]
shutil.rmtree(tmp, ignore_errors=True)
os.makedirs(tmp)
db = os.path.join(tmp, "fm")
subprocess.run([os.path.join(os.environ["STK_BIN"], "prep"), "--quiet", "--workers", "2",
                t.FASHION, db], check=True)


def snapshot(mod, path):
    """metadata, per split: entries, every 997th (key, value), all keys' sum"""
    env = mod.open(path, readonly=True, lock=False, max_dbs=16)
    out = {}
    with env.begin() as txn:
        out["meta"] = json.loads(txn.get(b"dataset", db=env.open_db(b"meta", txn=txn)))
        assert txn.get(b"no such key", db=env.open_db(b"meta", txn=txn)) is None
    for split in out["meta"]["splits"]:
        with env.begin(db=env.open_db(split.encode())) as txn:
            rows = list(txn.cursor())
            out[split] = (txn.stat()["entries"], len(rows), rows[::997],
                          sum(struct.unpack(">Q", k)[0] for k, _ in rows),
                          txn.get(struct.pack(">Q", 12345)))
    env.close()
    return out


a, b = snapshot(real, db), snapshot(shim, db)
assert a == b, "the shim reads the stoke database differently from python3-lmdb"
assert a["train"][0] == 60000 and a["train"][1] == 60000, a["train"][:2]
print("ok: read: the same metadata, counts, keys and records through both")


def write(mod, path):
    env = mod.open(path, max_dbs=4)
    x, y = env.open_db(b"x"), env.open_db(b"y")
    with env.begin(write=True, db=x) as txn:
        for i in range(300):
            txn.put(struct.pack(">Q", i), bytes([i % 251]) * (i * 37 % 5000))
        txn.delete(struct.pack(">Q", 7))
    with env.begin(write=True, db=y) as txn:
        txn.put(b"gone", b"1")
    with env.begin(write=True) as txn:
        txn.drop(env.open_db(b"y", txn=txn), delete=True)
    try:
        with env.begin(write=True, db=x) as txn:
            txn.put(b"aborted", b"1")
            raise KeyError("abort")
    except KeyError:
        pass
    env.close()


def read(mod, path):
    env = mod.open(path, readonly=True, lock=False, max_dbs=4)
    with env.begin() as txn:
        names = [k for k, _ in txn.cursor()]
    with env.begin(db=env.open_db(b"x", txn=None)) as txn:
        rows = list(txn.cursor())
    env.close()
    return names, rows


for writer, reader in ((shim, real), (real, shim)):
    path = os.path.join(tmp, "w-" + writer.__name__)
    write(writer, path)
    names, rows = read(reader, path)
    assert names == [b"x"], names
    want = [(struct.pack(">Q", i), bytes([i % 251]) * (i * 37 % 5000))
            for i in range(300) if i != 7]
    assert rows == want, f"{writer.__name__} -> {reader.__name__}: rows differ"
print("ok: write: puts, a delete, a drop and an abort read back the same both ways")
