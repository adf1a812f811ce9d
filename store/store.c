/* store.c - the LMDB environment: atomic creation, bulk append with map
 * growth, read-only opening and per-thread zero-copy readers. */
#include "store.h"

#include "store_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <lmdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define MIB ((size_t)1 << 20)
#define META_DB STK_META_DB
#define META_KEY "dataset"

struct split_count {
    char name[STK_SPLIT_NAME_MAX];
    uint64_t count;
    uint8_t *crc; /* crc32 of each record, uint32 little-endian */
    size_t crc_cap;
};

struct stk_store {
    MDB_env *env;
    size_t map_size;
    stk_store_opts opts;
    /* writing */
    bool writable, finished;
    char *final_dir, *partial_dir;
    int lock_fd;
    struct split_count counts[STK_MAX_SPLITS];
    int ncounts, cur;          /* cur: index into counts being appended */
    uint8_t *pend;             /* [u32 len][bytes]... for keys pend_first.. */
    size_t pend_len, pend_cap, pend_n;
    /* reading */
    stk_meta meta;
    MDB_dbi split_dbi[STK_MAX_SPLITS];
};

static int lmdb_fail(stk_err *err, int rc, const char *where, const char *dir)
{
    int code = STK_ESTORE;
    if (rc == ENOSPC || rc == EFBIG || rc == EDQUOT)
        code = STK_ENOSPACE;
    else if (rc == ENOMEM)
        code = STK_ENOMEM;
    return stk_fail(err, code, "%s: %s: %s", dir, where, mdb_strerror(rc));
}

static void free_store(stk_store *s)
{
    if (s->env)
        mdb_env_close(s->env);
    if (s->lock_fd >= 0)
        close(s->lock_fd);
    free(s->final_dir);
    free(s->partial_dir);
    free(s->pend);
    for (int i = 0; i < s->ncounts; i++)
        free(s->counts[i].crc);
    stk_meta_free(&s->meta);
    free(s);
}

static stk_store *alloc_store(void)
{
    stk_store *s = calloc(1, sizeof *s);
    if (s) {
        s->lock_fd = -1;
        s->cur = -1;
    }
    return s;
}

/* ---- creating ---------------------------------------------------------- */

/* ".NAME.partial" next to dir. */
static char *partial_path(const char *dir)
{
    char *a = strdup(dir), *b = strdup(dir);
    char *out = NULL;
    if (a && b) {
        size_t n = strlen(a);
        while (n > 1 && a[n - 1] == '/')
        {
            n--;
            a[n] = b[n] = '\0';
        }
        const char *parent = dirname(a), *base = basename(b);
        if (asprintf(&out, "%s/.%s.partial", parent, base) < 0)
            out = NULL;
    }
    free(a);
    free(b);
    return out;
}

enum dir_kind { DIR_ABSENT, DIR_EMPTY, DIR_LMDB, DIR_FOREIGN, DIR_NOT_DIR };

static enum dir_kind classify_dir(const char *dir)
{
    struct stat st;
    if (stat(dir, &st) != 0)
        return errno == ENOENT ? DIR_ABSENT : DIR_FOREIGN;
    if (!S_ISDIR(st.st_mode))
        return DIR_NOT_DIR;
    DIR *d = opendir(dir);
    if (!d)
        return DIR_FOREIGN;
    enum dir_kind kind = DIR_EMPTY;
    struct dirent *de;
    while ((de = readdir(d))) {
        const char *n = de->d_name;
        if (!strcmp(n, ".") || !strcmp(n, ".."))
            continue;
        if (!strcmp(n, "data.mdb") || !strcmp(n, "lock.mdb"))
            kind = kind == DIR_EMPTY ? DIR_LMDB : kind;
        else
            kind = DIR_FOREIGN;
    }
    closedir(d);
    return kind;
}

/* Decides whether dir may be replaced by a new database. force_hint
 * names the option that would allow it, in the caller's language. */
static int check_target(const char *dir, bool force, const char *force_hint,
                        stk_err *err)
{
    const char *hint = force_hint ? force_hint : "--force";
    switch (classify_dir(dir)) {
    case DIR_ABSENT:
    case DIR_EMPTY:
        return 0;
    case DIR_NOT_DIR:
        return stk_fail(err, STK_EEXIST, "%s: exists and is not a directory",
                        dir);
    case DIR_FOREIGN:
        return stk_fail(err, STK_EEXIST,
                        "%s: holds files other than data.mdb/lock.mdb; "
                        "refusing to replace it",
                        dir);
    case DIR_LMDB:
        break;
    }
    if (force)
        return 0;
    stk_store *old = NULL;
    stk_err why;
    if (stk_store_open_any(dir, &old, &why) != 0)
        return stk_fail(err, STK_EEXIST,
                        "%s: holds an LMDB database that stoke cannot open "
                        "(%s); pass %s to replace it",
                        dir, why.msg, hint);
    bool complete = old->meta.complete;
    stk_store_close(old);
    if (complete)
        return stk_fail(err, STK_EEXIST,
                        "%s: holds a complete stoke database; pass %s to "
                        "replace it",
                        dir, hint);
    return stk_fail(err, STK_EEXIST,
                    "%s: holds an LMDB database that is not a complete stoke "
                    "database; pass %s to replace it",
                    dir, hint);
}

/* Opens and exclusively locks path; returns the fd, or -1 with errno
 * EWOULDBLOCK when another process holds the lock. The lock is only good
 * if path still names the locked directory (it may have been replaced). */
static int lock_dir(const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat a, b;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || fstat(fd, &a) != 0 ||
        stat(path, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        int e = errno == EWOULDBLOCK ? EWOULDBLOCK : EAGAIN;
        close(fd);
        errno = e;
        return -1;
    }
    return fd;
}

/* Creates and locks the partial directory. A stale one (its lock free: the
 * run that made it was killed) is emptied and removed while we hold its
 * lock; a locked one belongs to a live run, whose work we never touch. */
static int make_partial(stk_store *s, stk_err *err)
{
    for (int attempt = 0; attempt < 8; attempt++) {
        if (mkdir(s->partial_dir, 0775) != 0 && errno != EEXIST)
            return stk_fail(err, stk_from_errno(errno), "%s: cannot create: %s",
                            s->partial_dir, strerror(errno));
        int fd = lock_dir(s->partial_dir);
        if (fd < 0 && errno == EWOULDBLOCK)
            return stk_fail(err, STK_EEXIST,
                            "%s: another prep is writing this database "
                            "(%s is locked)",
                            s->final_dir, s->partial_dir);
        if (fd < 0)
            continue; /* replaced under us: look again */
        DIR *d = opendir(s->partial_dir);
        int empty = 1;
        struct dirent *de;
        while (d && (de = readdir(d)))
            if (strcmp(de->d_name, ".") && strcmp(de->d_name, ".."))
                empty = 0;
        if (d)
            closedir(d);
        if (empty) {
            s->lock_fd = fd; /* ours, fresh */
            return 0;
        }
        int rc = stk_remove_flat_dir(s->partial_dir, err); /* stale */
        close(fd);
        if (rc)
            return rc;
    }
    return stk_fail(err, STK_EIO, "%s: cannot take the partial directory",
                    s->partial_dir);
}

/* The final directory must be on the same file system as its parent, or
 * the rename that publishes the database fails after all the work. */
static int check_same_fs(const char *dir, const char *partial, stk_err *err)
{
    struct stat a, b;
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", partial);
    if (stat(dir, &a) != 0)
        return 0;
    if (stat(dirname(parent), &b) == 0 && a.st_dev != b.st_dev)
        return stk_fail(err, STK_EINVAL,
                        "%s: is a mount point; a database cannot be renamed "
                        "onto it (use a directory inside it)",
                        dir);
    return 0;
}

static int open_env(stk_store *s, const char *dir, unsigned flags,
                    int max_readers, stk_err *err)
{
    int rc = mdb_env_create(&s->env);
    if (rc)
        return lmdb_fail(err, rc, "mdb_env_create", dir);
    if ((rc = mdb_env_set_maxdbs(s->env, STK_MAX_SPLITS + 2)) ||
        (rc = mdb_env_set_maxreaders(s->env, (unsigned)max_readers)) ||
        (s->map_size && (rc = mdb_env_set_mapsize(s->env, s->map_size))))
        return lmdb_fail(err, rc, "configuring the environment", dir);
    if ((rc = mdb_env_open(s->env, dir, flags, 0664)))
        return lmdb_fail(err, rc, "mdb_env_open", dir);
    MDB_envinfo info;
    mdb_env_info(s->env, &info);
    s->map_size = info.me_mapsize;
    return 0;
}

int stk_store_create(const char *dir, const stk_store_opts *opts,
                     stk_store **out, stk_err *err)
{
    *out = NULL;
    stk_store *s = alloc_store();
    if (!s)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
    s->opts = opts ? *opts : (stk_store_opts){0};
    if (!s->opts.map_size)
        s->opts.map_size = 64 * MIB;
    if (!s->opts.map_size_max)
        s->opts.map_size_max = MIB << 20; /* 1 TiB */
    if (!s->opts.txn_bytes)
        s->opts.txn_bytes = 64 * MIB;
    s->map_size = s->opts.map_size;
    s->writable = true;
    s->final_dir = strdup(dir);
    s->partial_dir = partial_path(dir);
    int rc = 0;
    if (!s->final_dir || !s->partial_dir)
        rc = stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
    if (!rc)
        rc = check_target(dir, s->opts.force, s->opts.force_hint, err);
    if (!rc)
        rc = check_same_fs(dir, s->partial_dir, err);
    if (!rc)
        rc = make_partial(s, err);
    if (!rc)
        rc = open_env(s, s->partial_dir, MDB_NOSYNC | MDB_NOTLS, 126, err);
    if (rc) {
        stk_store_close(s);
        return rc;
    }
    *out = s;
    return 0;
}

/* ---- appending --------------------------------------------------------- */

static int grow_map(stk_store *s, stk_err *err)
{
    if (s->map_size >= s->opts.map_size_max)
        return stk_fail(err, STK_ENOSPACE,
                        "%s: database map is full at %zu MiB (the limit; "
                        "raise --map-max)",
                        s->final_dir, s->map_size / MIB);
    size_t next = s->map_size * 2;
    if (next > s->opts.map_size_max)
        next = s->opts.map_size_max;
    int rc = mdb_env_set_mapsize(s->env, next);
    if (rc)
        return lmdb_fail(err, rc, "growing the map", s->final_dir);
    s->map_size = next;
    return 0;
}

/* One attempt at committing the pending records; MDB_MAP_FULL is returned
 * as is so that the caller can grow the map and replay. */
static int put_pending(stk_store *s, MDB_txn *txn)
{
    MDB_dbi dbi;
    int rc = mdb_dbi_open(txn, s->counts[s->cur].name, MDB_CREATE, &dbi);
    uint64_t key = s->counts[s->cur].count - s->pend_n;
    const uint8_t *p = s->pend;
    for (size_t i = 0; !rc && i < s->pend_n; i++, key++) {
        uint32_t len;
        memcpy(&len, p, 4);
        uint8_t kb[8];
        stk_key_encode(kb, key);
        MDB_val k = {8, kb}, v = {len, (void *)(p + 4)};
        rc = mdb_put(txn, dbi, &k, &v, MDB_APPEND);
        p += 4 + len;
    }
    return rc;
}

/* LMDB reports a short write as EIO; say what filled up when we can tell. */
static int write_fail(stk_store *s, int rc, const char *what, stk_err *err)
{
    struct rlimit rl;
    struct statvfs vfs;
    if (rc == EIO || rc == EFBIG || rc == ENOSPC) {
        if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY)
            return stk_fail(err, STK_ENOSPACE,
                            "%s: %s: %s (the file size limit, ulimit -f, is "
                            "%llu bytes)",
                            s->final_dir, what, mdb_strerror(rc),
                            (unsigned long long)rl.rlim_cur);
        if (statvfs(s->partial_dir, &vfs) == 0 &&
            (double)vfs.f_bavail * vfs.f_frsize < 2.0 * s->opts.txn_bytes)
            return stk_fail(err, STK_ENOSPACE,
                            "%s: %s: no space left on the device (%.1f MiB "
                            "free)",
                            s->final_dir, what,
                            (double)vfs.f_bavail * vfs.f_frsize / MIB);
    }
    return lmdb_fail(err, rc, what, s->final_dir);
}

static int flush(stk_store *s, stk_err *err)
{
    if (!s->pend_n)
        return 0;
    for (;;) {
        MDB_txn *txn;
        int rc = mdb_txn_begin(s->env, NULL, 0, &txn);
        if (rc)
            return lmdb_fail(err, rc, "mdb_txn_begin", s->final_dir);
        rc = put_pending(s, txn);
        if (rc)
            mdb_txn_abort(txn);
        else
            rc = mdb_txn_commit(txn);
        if (rc == MDB_MAP_FULL) {
            if ((rc = grow_map(s, err)))
                return rc;
            continue;
        }
        if (rc)
            return write_fail(s, rc, "writing records", err);
        s->pend_len = s->pend_n = 0;
        return 0;
    }
}

/* Keeps the record's crc32 for the checksum list written at finish. */
static int note_crc(stk_store *s, struct split_count *c, const void *rec,
                    size_t len, stk_err *err)
{
    size_t at = (size_t)c->count * 4;
    if (at + 4 > c->crc_cap) {
        size_t cap = c->crc_cap ? 2 * c->crc_cap : 4096;
        uint8_t *p = realloc(c->crc, cap);
        if (!p)
            return stk_fail(err, STK_ENOMEM, "%s: out of memory",
                            s->final_dir);
        c->crc = p;
        c->crc_cap = cap;
    }
    stk_put_le32(c->crc + at, stk_crc32(rec, len));
    return 0;
}

static int select_split(stk_store *s, const char *split, stk_err *err)
{
    if (s->cur >= 0 && !strcmp(s->counts[s->cur].name, split))
        return 0;
    for (int i = 0; i < s->ncounts; i++)
        if (!strcmp(s->counts[i].name, split))
            return stk_fail(err, STK_EINVAL,
                            "%s: split \"%s\" was already finished",
                            s->final_dir, split);
    stk_err why;
    if (stk_split_name_ok(split, &why))
        return stk_fail(err, STK_EINVAL, "%s: %s", s->final_dir, why.msg);
    if (s->ncounts == STK_MAX_SPLITS)
        return stk_fail(err, STK_EINVAL, "%s: more than %d splits (\"%s\")",
                        s->final_dir, STK_MAX_SPLITS, split);
    int rc = flush(s, err);
    if (rc)
        return rc;
    s->cur = s->ncounts++;
    snprintf(s->counts[s->cur].name, STK_SPLIT_NAME_MAX, "%s", split);
    return 0;
}

int stk_store_append(stk_store *s, const char *split, const void *rec,
                     size_t len, stk_err *err)
{
    if (!s->writable || s->finished)
        return stk_fail(err, STK_EINVAL, "store is not open for writing");
    if (len > UINT32_MAX)
        return stk_fail(err, STK_EINVAL, "record of %zu bytes is too large",
                        len);
    int rc = select_split(s, split, err);
    if (rc)
        return rc;
    if (s->counts[s->cur].count == STK_MAX_RECORDS)
        return stk_fail(err, STK_EINVAL,
                        "%s: split \"%s\" would hold more than %llu records",
                        s->final_dir, split,
                        (unsigned long long)STK_MAX_RECORDS);
    if ((rc = note_crc(s, &s->counts[s->cur], rec, len, err)))
        return rc;
    if (s->pend_len + 4 + len > s->pend_cap) {
        size_t cap = s->pend_cap ? s->pend_cap : MIB;
        while (cap < s->pend_len + 4 + len)
            cap *= 2;
        uint8_t *p = realloc(s->pend, cap);
        if (!p)
            return stk_fail(err, STK_ENOMEM, "%s: out of memory",
                            s->final_dir);
        s->pend = p;
        s->pend_cap = cap;
    }
    uint32_t l32 = (uint32_t)len;
    memcpy(s->pend + s->pend_len, &l32, 4);
    memcpy(s->pend + s->pend_len + 4, rec, len);
    s->pend_len += 4 + len;
    s->pend_n++;
    s->counts[s->cur].count++;
    return s->pend_len >= s->opts.txn_bytes ? flush(s, err) : 0;
}

uint64_t stk_store_count(const stk_store *s, const char *split)
{
    for (int i = 0; i < s->ncounts; i++)
        if (!strcmp(s->counts[i].name, split))
            return s->counts[i].count;
    return 0;
}

/* Puts the checksum list of every split written and the metadata's own
 * checksum (docs/formats.md, "Checksums"). */
static int put_checksums(stk_store *s, MDB_txn *txn, MDB_dbi meta_dbi,
                         const char *json)
{
    MDB_dbi dbi;
    int rc = mdb_dbi_open(txn, STK_CHECKSUM_DB, MDB_CREATE, &dbi);
    for (int i = 0; !rc && i < s->ncounts; i++) {
        const struct split_count *c = &s->counts[i];
        MDB_val k = {strlen(c->name), (void *)c->name},
                v = {(size_t)c->count * 4, c->crc};
        rc = mdb_put(txn, dbi, &k, &v, 0);
    }
    uint8_t crc[4];
    stk_put_le32(crc, stk_crc32(json, strlen(json)));
    MDB_val k = {strlen(STK_META_CRC_KEY), STK_META_CRC_KEY}, v = {4, crc};
    return rc ? rc : mdb_put(txn, meta_dbi, &k, &v, 0);
}

static int write_meta(stk_store *s, const stk_meta *meta, stk_err *err)
{
    stk_meta m = *meta;
    m.complete = true;
    m.checksums = true;
    char *json = stk_meta_to_json(&m);
    if (!json)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", s->final_dir);
    int rc;
    for (;;) {
        MDB_txn *txn;
        MDB_dbi dbi;
        if ((rc = mdb_txn_begin(s->env, NULL, 0, &txn)))
            break;
        MDB_val k = {strlen(META_KEY), META_KEY}, v = {strlen(json), json};
        rc = mdb_dbi_open(txn, META_DB, MDB_CREATE, &dbi);
        if (!rc)
            rc = mdb_put(txn, dbi, &k, &v, 0);
        if (!rc)
            rc = put_checksums(s, txn, dbi, json);
        if (rc)
            mdb_txn_abort(txn);
        else
            rc = mdb_txn_commit(txn);
        if (rc != MDB_MAP_FULL || (rc = grow_map(s, err)))
            break;
    }
    free(json);
    if (rc < 0) /* grow_map already described the failure */
        return rc;
    return rc ? write_fail(s, rc, "writing metadata", err) : 0;
}

/* Checks that the counts the caller describes are the ones written, and
 * that every written split is described. */
static int check_counts(stk_store *s, const stk_meta *meta, stk_err *err)
{
    for (int i = 0; i < s->ncounts; i++)
        if (stk_meta_split(meta, s->counts[i].name) < 0)
            return stk_fail(err, STK_EINVAL,
                            "%s: split \"%s\" was written but the metadata "
                            "does not describe it",
                            s->final_dir, s->counts[i].name);
    for (int i = 0; i < meta->nsplits; i++) {
        uint64_t have = stk_store_count(s, meta->splits[i].name);
        if (have != meta->splits[i].count)
            return stk_fail(err, STK_EINVAL,
                            "%s: metadata says split \"%s\" has %llu records "
                            "but %llu were written",
                            s->final_dir, meta->splits[i].name,
                            (unsigned long long)meta->splits[i].count,
                            (unsigned long long)have);
    }
    return 0;
}

/* Moves the finished partial directory to the final name and makes the
 * rename durable. An existing database there (allowed by --force) is
 * swapped out atomically; *old_left is set when it still has to be removed
 * (from the partial path) after the parent directory is synced. */
static int publish(stk_store *s, bool *old_left, stk_err *err)
{
    *old_left = classify_dir(s->final_dir) == DIR_LMDB;
    int rc = *old_left ? renameat2(AT_FDCWD, s->partial_dir, AT_FDCWD,
                                   s->final_dir, RENAME_EXCHANGE)
                       : rename(s->partial_dir, s->final_dir);
    if (rc != 0) {
        *old_left = false;
        return stk_fail(err, stk_from_errno(errno),
                        "%s: cannot move %s into place: %s", s->final_dir,
                        s->partial_dir, strerror(errno));
    }
    s->finished = true;
    char parent[4096];
    snprintf(parent, sizeof parent, "%s", s->partial_dir);
    return stk_fsync_dir(dirname(parent), err);
}

/* Reads the finished partial database back the way every reader will
 * (structural check, metadata, every record against its checksum) before
 * it is published. */
static int verify_written(stk_store *s, stk_err *err)
{
    stk_store *r;
    stk_err e = {0};
    stk_verify_report rep;
    int rc = stk_store_open(s->partial_dir, 0, &r, &e);
    if (!rc) {
        rc = stk_store_verify_until(r, s->opts.cancel, &rep, &e);
        stk_store_close(r);
    }
    if (rc == STK_ECANCELED)
        return stk_fail(err, rc, "interrupted");
    return rc ? stk_fail(err, rc,
                         "%s: the database written does not verify: %s",
                         s->final_dir, e.msg)
              : 0;
}

int stk_store_finish(stk_store *s, const stk_meta *meta, stk_err *err)
{
    if (!s->writable || s->finished)
        return stk_fail(err, STK_EINVAL, "store is not open for writing");
    int rc = flush(s, err);
    if (!rc)
        rc = check_counts(s, meta, err);
    if (!rc && (rc = mdb_env_sync(s->env, 1)))
        rc = write_fail(s, rc, "syncing records", err);
    if (!rc)
        rc = write_meta(s, meta, err);
    if (!rc && (rc = mdb_env_sync(s->env, 1)))
        rc = write_fail(s, rc, "syncing metadata", err);
    if (rc)
        return rc;
    mdb_env_close(s->env);
    s->env = NULL;
    if (fsync(s->lock_fd) != 0) /* the entries of data.mdb and lock.mdb */
        return stk_fail(err, stk_from_errno(errno), "%s: fsync failed: %s",
                        s->partial_dir, strerror(errno));
    if (s->opts.verify && (rc = verify_written(s, err)))
        return rc;
    bool old_left;
    rc = publish(s, &old_left, err);
    /* the new database is in place even if removing the old one fails */
    if (old_left && stk_remove_flat_dir(s->partial_dir, rc ? NULL : err))
        rc = rc ? rc : STK_EIO;
    return rc;
}

/* ---- opening ----------------------------------------------------------- */

/* Parses the "dataset" JSON; errors are prefixed with the directory. */
static int parse_meta(stk_store *s, const char *dir, const MDB_val *v,
                      stk_err *err)
{
    stk_err e = {0};
    int rc = stk_meta_from_json(v->mv_data, v->mv_size, &s->meta, &e);
    return rc ? stk_fail(err, rc, "%s: %s", dir, e.msg) : 0;
}

/* Opens each split's database and checks its size against the metadata. */
static int open_splits(stk_store *s, MDB_txn *txn, const char *dir,
                       stk_err *err)
{
    for (int i = 0; i < s->meta.nsplits; i++) {
        const stk_split_meta *sp = &s->meta.splits[i];
        MDB_stat st;
        int rc = mdb_dbi_open(txn, sp->name, 0, &s->split_dbi[i]);
        if (!rc)
            rc = mdb_stat(txn, s->split_dbi[i], &st);
        if (rc == MDB_NOTFOUND && sp->count == 0)
            continue; /* an empty split never got a database */
        if (rc == MDB_NOTFOUND)
            return stk_fail(err, STK_EFORMAT,
                            "%s: split \"%s\" is listed in the metadata but "
                            "its database is missing",
                            dir, sp->name);
        if (rc)
            return stk_fail(err, STK_EFORMAT, "%s: split \"%s\": %s", dir,
                            sp->name, mdb_strerror(rc));
        if (st.ms_entries != sp->count)
            return stk_fail(err, STK_EFORMAT,
                            "%s: split \"%s\" holds %zu records, metadata "
                            "says %llu",
                            dir, sp->name, st.ms_entries,
                            (unsigned long long)sp->count);
    }
    return 0;
}

static int load_meta(stk_store *s, const char *dir, stk_err *err)
{
    MDB_txn *txn;
    MDB_dbi dbi;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (rc)
        return lmdb_fail(err, rc, "mdb_txn_begin", dir);
    MDB_val k = {strlen(META_KEY), META_KEY}, v;
    rc = mdb_dbi_open(txn, META_DB, 0, &dbi);
    if (!rc)
        rc = mdb_get(txn, dbi, &k, &v);
    if (rc == MDB_NOTFOUND)
        rc = stk_fail(err, STK_EINCOMPLETE,
                      "%s: no stoke metadata (an interrupted prep, or not a "
                      "stoke database)",
                      dir);
    else if (rc)
        rc = lmdb_fail(err, rc, "reading metadata", dir);
    else
        rc = parse_meta(s, dir, &v, err);
    if (!rc)
        rc = open_splits(s, txn, dir, err);
    if (rc) {
        mdb_txn_abort(txn);
        return rc;
    }
    /* committing makes the dbi handles usable by later transactions */
    rc = mdb_txn_commit(txn);
    return rc ? lmdb_fail(err, rc, "mdb_txn_commit", dir) : 0;
}

/* Opens DIR/data.mdb only if it is a regular file (a FIFO would block
 * liblmdb's open for ever) and checks its structure before liblmdb reads
 * it (check.c): a damaged file is refused here instead of crashing a
 * reader later. */
static int check_file(const char *dir, stk_lmdb_facts *facts, stk_err *err)
{
    char path[4096];
    struct stat st;
    if (stk_path_join(path, sizeof path, dir, "data.mdb"))
        return stk_fail(err, STK_ERANGE, "%s: path too long", dir);
    stk_err e = {0};
    int fd = stk_open_regular(path, &st, &e);
    if (fd == STK_ENOENT)
        return stk_fail(err, STK_ENOENT,
                        "%s: not a stoke database (no data.mdb)", dir);
    if (fd < 0)
        return stk_fail(err, fd, "%s", e.msg);
    int rc = stk_lmdb_check_file(dir, fd, st.st_size, facts, err);
    close(fd);
    return rc;
}

int stk_store_open_any(const char *dir, stk_store **out, stk_err *err)
{
    return stk_store_open(dir, -1, out, err);
}

int stk_store_open(const char *dir, int max_readers, stk_store **out,
                   stk_err *err)
{
    *out = NULL;
    stk_lmdb_facts facts;
    int rc = check_file(dir, &facts, err);
    if (rc)
        return rc;
    stk_store *s = alloc_store();
    if (!s)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", dir);
    bool any = max_readers < 0;
    /* A published database is never written again (a --force rebuild
     * writes new files), so readers need no lock table: MDB_NOLOCK lifts
     * the reader-slot limit shared with other processes, leaves no stale
     * slots when a rank dies and opens where lock.mdb is not writable.
     * (stk_lmdb_check_env relies on MDB_NOLOCK: see store_impl.h.) */
    rc = open_env(s, dir, MDB_RDONLY | MDB_NOTLS | MDB_NOLOCK,
                  max_readers > 0 ? max_readers : 512, err);
    if (!rc)
        rc = stk_lmdb_check_env(s->env, dir, &facts, err);
    if (!rc)
        rc = load_meta(s, dir, err);
    if (!rc && !any && !s->meta.complete)
        rc = stk_fail(err, STK_EINCOMPLETE,
                      "%s: database is incomplete (prep did not finish)", dir);
    if (rc) {
        free_store(s);
        return rc;
    }
    *out = s;
    return 0;
}

const stk_meta *stk_store_meta(const stk_store *s) { return &s->meta; }

size_t stk_store_map_size(const stk_store *s) { return s->map_size; }

void stk_store_close(stk_store *s)
{
    if (!s)
        return;
    if (s->writable && !s->finished && s->partial_dir && s->lock_fd >= 0) {
        if (s->env)
            mdb_env_close(s->env);
        s->env = NULL;
        stk_remove_flat_dir(s->partial_dir, NULL);
    }
    free_store(s);
}

int stk_store_get_copy(stk_store *s, const char *db, const char *key,
                       uint8_t **copy, size_t *len, stk_err *err)
{
    *copy = NULL;
    *len = 0;
    MDB_txn *txn;
    MDB_dbi dbi;
    MDB_val k = {strlen(key), (void *)key}, v;
    int rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &txn);
    if (rc)
        return stk_fail(err, STK_ESTORE, "read transaction: %s",
                        mdb_strerror(rc));
    if (!(rc = mdb_dbi_open(txn, db, 0, &dbi)))
        rc = mdb_get(txn, dbi, &k, &v);
    if (!rc && !(*copy = malloc(v.mv_size ? v.mv_size : 1)))
        rc = ENOMEM;
    if (!rc) {
        memcpy(*copy, v.mv_data, v.mv_size);
        *len = v.mv_size;
    }
    mdb_txn_abort(txn);
    if (rc == MDB_NOTFOUND)
        return stk_fail(err, STK_ENOENT, "no \"%s\" in database \"%s\"", key,
                        db);
    return rc ? stk_fail(err, rc == ENOMEM ? STK_ENOMEM : STK_ESTORE,
                         "reading \"%s\" of database \"%s\": %s", key, db,
                         mdb_strerror(rc))
              : 0;
}

/* ---- record lookups, shared by readers and views ------------------------ */

static int check_index(const char *split, uint64_t index, uint64_t count,
                       stk_err *err)
{
    if (index < count)
        return 0;
    return stk_fail(err, STK_ERANGE,
                    "split \"%s\": key %llu is out of range (%llu records)",
                    split, (unsigned long long)index,
                    (unsigned long long)count);
}

/* The index of split in the store's metadata, or STK_ENOENT. */
static int find_split(const stk_store *s, const char *split, stk_err *err)
{
    int i = stk_meta_split(&s->meta, split);
    return i >= 0 ? i
                  : stk_fail(err, STK_ENOENT,
                             "split \"%s\" is not in the database", split);
}

/* Decodes a stored value; a bad one names the split, the key and which
 * size disagrees with what. */
static int decode_value(const char *split, uint64_t index, const void *data,
                        size_t len, const stk_meta *m, stk_record *rec,
                        stk_err *err)
{
    char why[200];
    if (!stk_record_parse(data, len, m, rec, why, sizeof why))
        return 0;
    return stk_fail(err, STK_EFORMAT, "split \"%s\": key %llu: %s", split,
                    (unsigned long long)index, why);
}

/* ---- readers ----------------------------------------------------------- */

struct stk_reader {
    stk_store *s;
    MDB_dbi dbi;
    MDB_txn *txn;
    bool live;
    const stk_meta *meta;
    uint64_t count;
    char split[STK_SPLIT_NAME_MAX];
};

int stk_reader_open(stk_store *s, const char *split, stk_reader **out,
                    stk_err *err)
{
    *out = NULL;
    int i = find_split(s, split, err);
    if (i < 0)
        return i;
    stk_reader *r = calloc(1, sizeof *r);
    if (!r)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    r->s = s;
    r->dbi = s->split_dbi[i];
    r->meta = &s->meta;
    r->count = s->meta.splits[i].count;
    snprintf(r->split, sizeof r->split, "%s", split);
    *out = r;
    return 0;
}

static int reader_txn(stk_reader *r, stk_err *err)
{
    if (r->live)
        return 0;
    int rc = r->txn ? mdb_txn_renew(r->txn)
                    : mdb_txn_begin(r->s->env, NULL, MDB_RDONLY, &r->txn);
    if (rc)
        return stk_fail(err, STK_ESTORE, "split \"%s\": read transaction: %s",
                        r->split, mdb_strerror(rc));
    r->live = true;
    return 0;
}

int stk_reader_get(stk_reader *r, uint64_t index, stk_record *rec,
                   stk_err *err)
{
    int rc = check_index(r->split, index, r->count, err);
    if (!rc)
        rc = reader_txn(r, err);
    if (rc)
        return rc;
    uint8_t kb[8];
    stk_key_encode(kb, index);
    MDB_val k = {8, kb}, v;
    rc = mdb_get(r->txn, r->dbi, &k, &v);
    if (rc)
        return stk_fail(err, rc == MDB_NOTFOUND ? STK_EFORMAT : STK_ESTORE,
                        "split \"%s\": key %llu: %s", r->split,
                        (unsigned long long)index, mdb_strerror(rc));
    return decode_value(r->split, index, v.mv_data, v.mv_size, r->meta, rec,
                        err);
}

void stk_reader_release(stk_reader *r)
{
    if (r->live)
        mdb_txn_reset(r->txn);
    r->live = false;
}

void stk_reader_close(stk_reader *r)
{
    if (!r)
        return;
    if (r->txn)
        mdb_txn_abort(r->txn);
    free(r);
}

/* ---- views ------------------------------------------------------------- */

typedef struct view_entry {
    const uint8_t *data;
    size_t len;
} view_entry;

struct stk_view {
    MDB_txn *txn;
    uint64_t count;
    const stk_meta *meta;
    view_entry *e;
    char split[STK_SPLIT_NAME_MAX];
};

/* Walks the split's keys in order, checking they are dense from 0. */
static int view_index(stk_view *v, MDB_dbi dbi, stk_err *err)
{
    MDB_cursor *cur;
    int rc = mdb_cursor_open(v->txn, dbi, &cur);
    if (rc)
        return stk_fail(err, STK_ESTORE, "split \"%s\": %s", v->split,
                        mdb_strerror(rc));
    MDB_val k, d;
    uint64_t i = 0;
    for (rc = mdb_cursor_get(cur, &k, &d, MDB_FIRST); !rc && i < v->count;
         rc = mdb_cursor_get(cur, &k, &d, MDB_NEXT), i++) {
        if (k.mv_size != 8 || stk_key_decode(k.mv_data) != i)
            break;
        v->e[i].data = d.mv_data;
        v->e[i].len = d.mv_size;
    }
    mdb_cursor_close(cur);
    if (i != v->count)
        return stk_fail(err, STK_EFORMAT,
                        "split \"%s\": key %llu is missing or out of order",
                        v->split, (unsigned long long)i);
    return 0;
}

int stk_view_open(stk_store *s, const char *split, stk_view **out,
                  stk_err *err)
{
    *out = NULL;
    int k = find_split(s, split, err);
    if (k < 0)
        return k;
    stk_view *v = calloc(1, sizeof *v);
    if (!v)
        return stk_fail(err, STK_ENOMEM, "out of memory");
    snprintf(v->split, sizeof v->split, "%s", split);
    v->count = s->meta.splits[k].count;
    v->meta = &s->meta;
    v->e = malloc((v->count ? v->count : 1) * sizeof *v->e);
    int rc = v->e ? mdb_txn_begin(s->env, NULL, MDB_RDONLY, &v->txn)
                  : STK_ENOMEM;
    if (rc)
        rc = stk_fail(err, rc == STK_ENOMEM ? rc : STK_ESTORE,
                      "split \"%s\": cannot open a snapshot", split);
    else if (v->count)
        rc = view_index(v, s->split_dbi[k], err);
    if (rc) {
        stk_view_close(v);
        return rc;
    }
    *out = v;
    return 0;
}

uint64_t stk_view_count(const stk_view *v) { return v->count; }

int stk_view_get(const stk_view *v, uint64_t index, stk_record *rec,
                 stk_err *err)
{
    int rc = check_index(v->split, index, v->count, err);
    return rc ? rc
              : decode_value(v->split, index, v->e[index].data,
                             v->e[index].len, v->meta, rec, err);
}

void stk_view_prefetch(const stk_view *v, uint64_t index, size_t bytes)
{
    if (index >= v->count)
        return;
    const uint8_t *p = v->e[index].data;
    size_t n = bytes < v->e[index].len ? bytes : v->e[index].len;
    /* from p's line on: a record is rarely line-aligned, and steps from p
     * itself could miss its last line */
    uintptr_t line = (uintptr_t)p & ~(uintptr_t)63;
    for (; line < (uintptr_t)p + n; line += 64)
        __builtin_prefetch((const void *)line);
}

void stk_view_close(stk_view *v)
{
    if (!v)
        return;
    if (v->txn)
        mdb_txn_abort(v->txn);
    free(v->e);
    free(v);
}
