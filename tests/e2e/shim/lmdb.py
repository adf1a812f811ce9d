"""The part of python3-lmdb's API that stoke's tests use, over liblmdb through
ctypes: for a machine whose Python cannot import Debian's python3-lmdb (a
GPU image with another Python version; docs/gpu.md). It reads and writes
with liblmdb itself, as python3-lmdb does, so it stays independent of
stoke's C code. Put this folder first on PYTHONPATH only where `import lmdb`
fails: CI and Debian machines use the real module.

Covered: open(path, map_size, subdir, readonly, create, lock, max_dbs),
Environment.begin(db, write), open_db(key, txn, create), stat, info, sync,
close; Transaction.get, put, delete, cursor, stat, drop, commit, abort and
its context manager (commit, or abort on an exception); Cursor iteration,
first, next, key, value. Anything else raises AttributeError: a test that
needs more fails loudly instead of doing something else."""
import ctypes
import ctypes.util
import os

__version__ = "shim"

_name = ctypes.util.find_library("lmdb") or "liblmdb.so.0"
_lib = ctypes.CDLL(_name)

MDB_NOSUBDIR, MDB_RDONLY, MDB_NOLOCK = 0x4000, 0x20000, 0x400000
MDB_CREATE, MDB_NOTFOUND = 0x40000, -30798
MDB_FIRST, MDB_NEXT = 0, 8


class Error(Exception):
    pass


class NotFoundError(Error):
    pass


class _Val(ctypes.Structure):
    _fields_ = [("mv_size", ctypes.c_size_t), ("mv_data", ctypes.c_void_p)]


class _Stat(ctypes.Structure):
    _fields_ = [("ms_psize", ctypes.c_uint), ("ms_depth", ctypes.c_uint),
                ("ms_branch_pages", ctypes.c_size_t),
                ("ms_leaf_pages", ctypes.c_size_t),
                ("ms_overflow_pages", ctypes.c_size_t),
                ("ms_entries", ctypes.c_size_t)]


class _EnvInfo(ctypes.Structure):
    _fields_ = [("me_mapaddr", ctypes.c_void_p), ("me_mapsize", ctypes.c_size_t),
                ("me_last_pgno", ctypes.c_size_t), ("me_last_txnid", ctypes.c_size_t),
                ("me_maxreaders", ctypes.c_uint), ("me_numreaders", ctypes.c_uint)]


_P, _U, _I = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
for _fn, _args in {
        "mdb_env_create": [ctypes.POINTER(_P)],
        "mdb_env_set_mapsize": [_P, ctypes.c_size_t],
        "mdb_env_set_maxdbs": [_P, _U],
        "mdb_env_open": [_P, ctypes.c_char_p, _U, _I],
        "mdb_env_close": [_P],
        "mdb_env_stat": [_P, ctypes.POINTER(_Stat)],
        "mdb_env_info": [_P, ctypes.POINTER(_EnvInfo)],
        "mdb_env_sync": [_P, _I],
        "mdb_txn_begin": [_P, _P, _U, ctypes.POINTER(_P)],
        "mdb_txn_commit": [_P],
        "mdb_txn_abort": [_P],
        "mdb_dbi_open": [_P, ctypes.c_char_p, _U, ctypes.POINTER(_U)],
        "mdb_get": [_P, _U, ctypes.POINTER(_Val), ctypes.POINTER(_Val)],
        "mdb_put": [_P, _U, ctypes.POINTER(_Val), ctypes.POINTER(_Val), _U],
        "mdb_del": [_P, _U, ctypes.POINTER(_Val), ctypes.POINTER(_Val)],
        "mdb_drop": [_P, _U, _I],
        "mdb_stat": [_P, _U, ctypes.POINTER(_Stat)],
        "mdb_cursor_open": [_P, _U, ctypes.POINTER(_P)],
        "mdb_cursor_close": [_P],
        "mdb_cursor_get": [_P, ctypes.POINTER(_Val), ctypes.POINTER(_Val), _I],
}.items():
    getattr(_lib, _fn).argtypes = _args
    getattr(_lib, _fn).restype = None if _fn in ("mdb_env_close", "mdb_txn_abort",
                                                   "mdb_cursor_close") else _I
_lib.mdb_strerror.argtypes, _lib.mdb_strerror.restype = [_I], ctypes.c_char_p


def _check(rc, what):
    if rc == MDB_NOTFOUND:
        raise NotFoundError(f"{what}: MDB_NOTFOUND")
    if rc:
        raise Error(f"{what}: {_lib.mdb_strerror(rc).decode()}")


def _val(b):
    b = bytes(b)
    return _Val(len(b), ctypes.cast(ctypes.c_char_p(b), ctypes.c_void_p).value), b


def _bytes(v):
    return ctypes.string_at(v.mv_data, v.mv_size) if v.mv_size else b""


def _stat_dict(s):
    return {"psize": s.ms_psize, "depth": s.ms_depth, "branch_pages": s.ms_branch_pages,
            "leaf_pages": s.ms_leaf_pages, "overflow_pages": s.ms_overflow_pages,
            "entries": s.ms_entries}


class _Database:
    def __init__(self, dbi):
        self.dbi = dbi


class Environment:
    def __init__(self, path, map_size=10485760, subdir=True, readonly=False,
                 create=True, lock=True, max_dbs=0, **ignored):
        self.readonly = readonly
        env = _P()
        _check(_lib.mdb_env_create(ctypes.byref(env)), "mdb_env_create")
        self._env = env
        _check(_lib.mdb_env_set_mapsize(env, map_size), "mdb_env_set_mapsize")
        _check(_lib.mdb_env_set_maxdbs(env, max_dbs), "mdb_env_set_maxdbs")
        if subdir and create and not readonly:
            os.makedirs(path, exist_ok=True)
        flags = (0 if subdir else MDB_NOSUBDIR) | (MDB_RDONLY if readonly else 0) | \
            (0 if lock else MDB_NOLOCK)
        rc = _lib.mdb_env_open(env, os.fsencode(path), flags, 0o644)
        if rc:
            _lib.mdb_env_close(env)
            self._env = None
            _check(rc, f"mdb_env_open({path})")
        self._main = _Database(1)  # MAIN_DBI (0 is liblmdb's free-page list)

    def begin(self, db=None, write=False, **ignored):
        return Transaction(self, db or self._main, write)

    def open_db(self, key=None, txn=None, create=True, **ignored):
        flags = MDB_CREATE if create and not self.readonly else 0
        own = txn is None
        t = txn or Transaction(self, self._main, not self.readonly)
        dbi = _U()
        try:
            _check(_lib.mdb_dbi_open(t._txn, key, flags, ctypes.byref(dbi)),
                   f"mdb_dbi_open({key!r})")
        except Exception:
            if own:
                t.abort()
            raise
        if own:
            t.commit()
        return _Database(dbi.value)

    def stat(self):
        s = _Stat()
        _check(_lib.mdb_env_stat(self._env, ctypes.byref(s)), "mdb_env_stat")
        return _stat_dict(s)

    def info(self):
        i = _EnvInfo()
        _check(_lib.mdb_env_info(self._env, ctypes.byref(i)), "mdb_env_info")
        return {"map_addr": i.me_mapaddr or 0, "map_size": i.me_mapsize,
                "last_pgno": i.me_last_pgno, "last_txnid": i.me_last_txnid,
                "max_readers": i.me_maxreaders, "num_readers": i.me_numreaders}

    def sync(self, force=False):
        _check(_lib.mdb_env_sync(self._env, int(force)), "mdb_env_sync")

    def close(self):
        if self._env:
            _lib.mdb_env_close(self._env)
            self._env = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open(path, **kw):  # noqa: A001 (python3-lmdb's name)
    return Environment(path, **kw)


class Transaction:
    def __init__(self, env, db, write):
        self.env, self.db, self.write = env, db, write
        txn = _P()
        _check(_lib.mdb_txn_begin(env._env, None, 0 if write else MDB_RDONLY,
                                  ctypes.byref(txn)), "mdb_txn_begin")
        self._txn = txn

    def _dbi(self, db):
        return (db or self.db).dbi

    def get(self, key, default=None, db=None):
        k, _keep = _val(key)
        v = _Val()
        rc = _lib.mdb_get(self._txn, self._dbi(db), ctypes.byref(k), ctypes.byref(v))
        if rc == MDB_NOTFOUND:
            return default
        _check(rc, "mdb_get")
        return _bytes(v)

    def put(self, key, value, db=None, **ignored):
        (k, _kk), (v, _vk) = _val(key), _val(value)
        _check(_lib.mdb_put(self._txn, self._dbi(db), ctypes.byref(k), ctypes.byref(v), 0),
               "mdb_put")
        return True

    def delete(self, key, db=None, **ignored):
        k, _keep = _val(key)
        rc = _lib.mdb_del(self._txn, self._dbi(db), ctypes.byref(k), None)
        if rc == MDB_NOTFOUND:
            return False
        _check(rc, "mdb_del")
        return True

    def stat(self, db=None):
        s = _Stat()
        _check(_lib.mdb_stat(self._txn, self._dbi(db), ctypes.byref(s)), "mdb_stat")
        return _stat_dict(s)

    def drop(self, db, delete=True):
        _check(_lib.mdb_drop(self._txn, db.dbi, 1 if delete else 0), "mdb_drop")

    def cursor(self, db=None):
        return Cursor(self, self._dbi(db))

    def commit(self):
        if self._txn:
            txn, self._txn = self._txn, None
            _check(_lib.mdb_txn_commit(txn), "mdb_txn_commit")

    def abort(self):
        if self._txn:
            txn, self._txn = self._txn, None
            _lib.mdb_txn_abort(txn)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        self.commit() if exc_type is None else self.abort()


class Cursor:
    def __init__(self, txn, dbi):
        self.txn = txn  # keeps the transaction alive
        cur = _P()
        _check(_lib.mdb_cursor_open(txn._txn, dbi, ctypes.byref(cur)), "mdb_cursor_open")
        self._cur, self._k, self._v = cur, _Val(), _Val()
        self._ok = self._placed = False  # on a record; ever positioned

    def _op(self, op):
        rc = _lib.mdb_cursor_get(self._cur, ctypes.byref(self._k), ctypes.byref(self._v), op)
        if rc != MDB_NOTFOUND:
            _check(rc, "mdb_cursor_get")
        self._ok, self._placed = rc == 0, True
        return self._ok

    def first(self):
        return self._op(MDB_FIRST)

    def next(self):
        # as python3-lmdb: an unpositioned cursor starts at the first
        # record, one past the last stays there
        return self._op(MDB_NEXT if self._placed else MDB_FIRST)

    def key(self):
        return _bytes(self._k) if self._ok else b""

    def value(self):
        return _bytes(self._v) if self._ok else b""

    def __iter__(self):
        ok = self.first()
        while ok:
            yield self.key(), self.value()
            ok = self._op(MDB_NEXT)

    def close(self):
        if self._cur:
            _lib.mdb_cursor_close(self._cur)
            self._cur = None

    def __del__(self):
        # a write transaction's end frees its cursors; a read-only one's not
        if getattr(self, "_cur", None) and (self.txn._txn or not self.txn.write):
            _lib.mdb_cursor_close(self._cur)
