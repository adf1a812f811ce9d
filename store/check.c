/* check.c - a structural check of data.mdb before liblmdb reads it.
 *
 * liblmdb 0.9 trusts its file. The page size in the meta page is used as a
 * divisor; page numbers index the map unchecked; node offsets, key sizes and
 * overflow page numbers are read from a page and followed. So a file cut
 * short faults (SIGBUS) on the first page past its end, and a few changed
 * bytes in a page send a cursor outside the map (SIGSEGV) or, through a
 * node flagged as duplicate data, into a NULL sub-cursor. Only a few things
 * are checked by liblmdb itself (magic and version of the meta pages, a
 * non-leaf page at the bottom of a search: MDB_CORRUPTED).
 *
 * Before any LMDB call reads a tree, stk_store_open runs this check:
 *  - both meta pages, read with pread: magic, format version 1, a page size
 *    that is a power of two (liblmdb divides by it before checking);
 *  - the file holds every page up to the last one the newer meta counts;
 *  - every branch and leaf page reachable from the main database and from
 *    each named database: its header (number, type, lower/upper bounds),
 *    every node inside the page, child and overflow page numbers below the
 *    last page, no page reached twice, leaves at the recorded depth, and the
 *    page and entry counts of each database equal to what was walked.
 * Overflow pages (large values) are checked by number only: reading one
 * header per record would touch the whole file. Branch and leaf pages are
 * the ones a view's cursor walk reads anyway.
 *
 * The offsets below are LMDB's data format version 1 (lmdb 0.9.x, mdb.c:
 * MDB_page, MDB_node, MDB_db, MDB_meta) for 64-bit hosts, in the host's byte
 * order as liblmdb writes it. stk_lmdb_check_env then confirms that
 * liblmdb picked the meta page checked here. */
#include "store_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

_Static_assert(sizeof(size_t) == 8, "LMDB's page numbers are 64-bit here");

/* MDB_page header: pgno u64, pad u16, flags u16, lower u16, upper u16 */
#define PAGEHDRSZ 16u
/* MDB_node header: lo u16, hi u16, flags u16, ksize u16 */
#define NODESIZE 8u
/* MDB_db: pad u32, flags u16, depth u16, branch, leaf, overflow, entries,
 * root u64 */
#define DBSIZE 48u
/* MDB_meta: magic u32, version u32, address, mapsize, dbs[2], last_pg,
 * txnid */
#define META_BYTES 136u
#define MDB_MAGIC 0xBEEFC0DEu
#define MDB_DATA_VERSION 1u
#define P_BRANCH 0x01u
#define P_LEAF 0x02u
#define P_META 0x08u
#define F_BIGDATA 0x01u
#define F_SUBDATA 0x02u
#define P_INVALID UINT64_MAX
#define CURSOR_STACK 32 /* liblmdb's deepest tree */
#define MAX_KEY 511u    /* liblmdb's default MDB_MAXKEYSIZE */
#define MIN_PSIZE 512u
#define MAX_PSIZE 65536u

static uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static uint32_t rd32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static uint64_t rd64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* MDB_db, as stored in a meta page or a named database's node. */
typedef struct db_rec {
    uint16_t flags, depth;
    uint64_t branch, leaf, overflow, entries, root;
} db_rec;

static db_rec read_db(const uint8_t *p)
{
    return (db_rec){.flags = rd16(p + 4),
                    .depth = rd16(p + 6),
                    .branch = rd64(p + 8),
                    .leaf = rd64(p + 16),
                    .overflow = rd64(p + 24),
                    .entries = rd64(p + 32),
                    .root = rd64(p + 40)};
}

/* ---- meta pages -------------------------------------------------------- */

typedef struct meta_page {
    uint32_t psize;
    db_rec main;
    uint64_t last_pgno, txnid;
} meta_page;

static int truncated(const char *dir, off_t size, uint64_t need,
                     const char *least, stk_err *err)
{
    return stk_fail(err, STK_EFORMAT,
                    "%s: data.mdb is truncated (%lld of %s%llu bytes)", dir,
                    (long long)size, least, (unsigned long long)need);
}

/* Reads and checks meta page i (at offset off). */
static int read_meta(const char *dir, int fd, off_t size, int i, off_t off,
                     meta_page *m, stk_err *err)
{
    uint8_t buf[PAGEHDRSZ + META_BYTES];
    if (size < off + (off_t)sizeof buf)
        return truncated(dir, size, (uint64_t)off + sizeof buf, "at least ",
                         err);
    ssize_t got;
    do
        got = pread(fd, buf, sizeof buf, off);
    while (got < 0 && errno == EINTR);
    if (got != (ssize_t)sizeof buf)
        return stk_fail(err, STK_EIO,
                        "%s: data.mdb: cannot read meta page "
                        "%d: %s",
                        dir, i, got < 0 ? strerror(errno) : "short read");
    const uint8_t *mm = buf + PAGEHDRSZ;
    if (!(rd16(buf + 10) & P_META) || rd32(mm) != MDB_MAGIC)
        return stk_fail(err, STK_EFORMAT,
                        "%s: data.mdb is not an LMDB file (meta page %d has "
                        "no LMDB magic)",
                        dir, i);
    if (rd32(mm + 4) != MDB_DATA_VERSION)
        return stk_fail(err, STK_EFORMAT,
                        "%s: data.mdb: meta page %d has LMDB data format %u, "
                        "expected %u",
                        dir, i, rd32(mm + 4), MDB_DATA_VERSION);
    m->psize = rd32(mm + 24); /* mm_dbs[FREE_DBI].md_pad */
    m->main = read_db(mm + 24 + DBSIZE);
    m->last_pgno = rd64(mm + 24 + 2 * DBSIZE);
    m->txnid = rd64(mm + 24 + 2 * DBSIZE + 8);
    if (m->psize < MIN_PSIZE || m->psize > MAX_PSIZE ||
        (m->psize & (m->psize - 1)))
        return stk_fail(err, STK_EFORMAT,
                        "%s: data.mdb is damaged (meta page %d: page size %u "
                        "is not a power of two in %u..%u)",
                        dir, i, m->psize, MIN_PSIZE, MAX_PSIZE);
    return 0;
}

/* Both meta pages, and the one liblmdb uses: the newer (mdb_env_pick_meta:
 * the larger transaction id, page 0 on a tie). */
static int read_metas(const char *dir, int fd, off_t size, meta_page *use,
                      stk_err *err)
{
    meta_page m[2] = {{0}, {0}};
    int rc = read_meta(dir, fd, size, 0, 0, &m[0], err);
    if (!rc) /* liblmdb reads page 1 at page 0's page size */
        rc = read_meta(dir, fd, size, 1, (off_t)m[0].psize, &m[1], err);
    if (rc)
        return rc;
    if (m[1].psize != m[0].psize)
        return stk_fail(err, STK_EFORMAT,
                        "%s: data.mdb is damaged (the meta pages disagree on "
                        "the page size: %u and %u)",
                        dir, m[0].psize, m[1].psize);
    *use = m[m[0].txnid < m[1].txnid];
    uint64_t ps = use->psize;
    if (use->last_pgno >= (uint64_t)INT64_MAX / ps)
        return stk_fail(err, STK_EFORMAT,
                        "%s: data.mdb is damaged (the meta page's last page "
                        "%llu is past any file)",
                        dir, (unsigned long long)use->last_pgno);
    uint64_t need = (use->last_pgno + 1) * ps;
    if ((uint64_t)size < need)
        return truncated(dir, size, need, "", err);
    return 0;
}

/* ---- the tree walk ----------------------------------------------------- */

typedef struct walker {
    const uint8_t *map;
    uint64_t psize, npages;
    uint8_t *seen; /* one bit per page: no page is reached twice */
    const char *dir;
    stk_err *err;
} walker;

/* Counts of one database's walk, compared with its MDB_db at the end. */
typedef struct tree {
    char name[64]; /* "main database" or database "NAME" */
    bool main;
    int depth;
    uint64_t branch, leaf, overflow, entries;
} tree;

static int damaged(walker *w, const tree *t, uint64_t pgno, const char *fmt,
                   ...) __attribute__((format(printf, 4, 5)));

static int damaged(walker *w, const tree *t, uint64_t pgno, const char *fmt,
                   ...)
{
    char why[200];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    return stk_fail(w->err, STK_EFORMAT,
                    "%s: data.mdb is damaged (%s, page %llu: %s)", w->dir,
                    t->name, (unsigned long long)pgno, why);
}

/* Marks pages [pgno, pgno + n) as reached; fails if one is out of the file
 * or was reached before. */
static int take_pages(walker *w, const tree *t, uint64_t from, uint64_t pgno,
                      uint64_t n)
{
    if (pgno < 2 || pgno >= w->npages || n > w->npages - pgno)
        return from == pgno
                   ? stk_fail(w->err, STK_EFORMAT,
                              "%s: data.mdb is damaged (%s: root page %llu "
                              "is outside pages 2..%llu)",
                              w->dir, t->name, (unsigned long long)pgno,
                              (unsigned long long)(w->npages - 1))
                   : damaged(w, t, from,
                             "points to page %llu, outside pages 2..%llu",
                             (unsigned long long)pgno,
                             (unsigned long long)(w->npages - 1));
    for (uint64_t p = pgno; p < pgno + n; p++) {
        if (w->seen[p / 8] & (1u << (p % 8)))
            return damaged(w, t, from, "page %llu is reached twice",
                           (unsigned long long)p);
        w->seen[p / 8] |= (uint8_t)(1u << (p % 8));
    }
    return 0;
}

static int walk_tree(walker *w, const char *name, size_t name_len,
                     const db_rec *db);
static int walk_page(walker *w, tree *t, uint64_t from, uint64_t pgno,
                     int level);

/* One node of a leaf page: a value inline, on overflow pages, or (in the
 * main database) a named database to walk in turn. */
static int leaf_node(walker *w, tree *t, uint64_t pgno, const uint8_t *node,
                     size_t room)
{
    uint16_t flags = rd16(node + 4), ksize = rd16(node + 6);
    uint64_t dsize = rd16(node) | (uint64_t)rd16(node + 2) << 16;
    if (ksize < 1 || ksize > MAX_KEY)
        return damaged(w, t, pgno, "a key of %u bytes", ksize);
    bool big = flags == F_BIGDATA, sub = flags == F_SUBDATA && t->main;
    if (flags != 0 && !big && !sub)
        return damaged(w, t, pgno, "a node with flags 0x%x", flags);
    uint64_t stored = big ? 8 : dsize;
    if (NODESIZE + ksize + stored > room)
        return damaged(w, t, pgno,
                       "a node of %llu bytes overruns the page "
                       "(%zu left)",
                       (unsigned long long)(NODESIZE + ksize + stored), room);
    const uint8_t *data = node + NODESIZE + ksize;
    t->entries++;
    if (big) {
        uint64_t n = (PAGEHDRSZ - 1 + dsize) / w->psize + 1; /* OVPAGES */
        t->overflow += n;
        return take_pages(w, t, pgno, rd64(data), n);
    }
    if (!sub)
        return 0;
    if (dsize != DBSIZE)
        return damaged(w, t, pgno, "a database record of %llu bytes",
                       (unsigned long long)dsize);
    db_rec db = read_db(data);
    return walk_tree(w, (const char *)node + NODESIZE, ksize, &db);
}

/* The nodes of one page, every one inside the page. */
static int walk_nodes(walker *w, tree *t, uint64_t pgno, const uint8_t *p,
                      unsigned n, unsigned upper, bool leaf, int level)
{
    for (unsigned i = 0; i < n; i++) {
        unsigned off = rd16(p + PAGEHDRSZ + 2 * i);
        if (off < upper || off % 2 || off + NODESIZE > w->psize)
            return damaged(w, t, pgno,
                           "node %u at offset %u is outside the "
                           "page's node area",
                           i, off);
        const uint8_t *node = p + off;
        size_t room = w->psize - off;
        int rc;
        if (leaf) {
            rc = leaf_node(w, t, pgno, node, room);
        } else {
            uint16_t ksize = rd16(node + 6);
            if (ksize > MAX_KEY || NODESIZE + ksize > room)
                return damaged(w, t, pgno,
                               "node %u's key of %u bytes overruns "
                               "the page",
                               i, ksize);
            uint64_t child = rd16(node) | (uint64_t)rd16(node + 2) << 16 |
                             (uint64_t)rd16(node + 4) << 32; /* NODEPGNO */
            rc = walk_page(w, t, pgno, child, level + 1);
        }
        if (rc)
            return rc;
    }
    return 0;
}

/* A branch page above the recorded depth, a leaf at it; from is the
 * branch page that points to it (the root: itself). */
static int walk_page(walker *w, tree *t, uint64_t from, uint64_t pgno,
                     int level)
{
    int rc = take_pages(w, t, from, pgno, 1);
    if (rc)
        return rc;
    const uint8_t *p = w->map + pgno * w->psize;
    bool leaf = level == t->depth;
    uint16_t flags = rd16(p + 10), lower = rd16(p + 12), upper = rd16(p + 14);
    if (rd64(p) != pgno)
        return damaged(w, t, pgno, "its header says page %llu",
                       (unsigned long long)rd64(p));
    if (flags != (leaf ? P_LEAF : P_BRANCH))
        return damaged(w, t, pgno, "page flags 0x%x where a %s page is due",
                       flags, leaf ? "leaf" : "branch");
    if (lower < PAGEHDRSZ + 2 || lower > upper || upper > w->psize ||
        (lower - PAGEHDRSZ) % 2)
        return damaged(w, t, pgno,
                       "free-space bounds %u..%u are not inside "
                       "the page",
                       lower, upper);
    if (leaf)
        t->leaf++;
    else
        t->branch++;
    return walk_nodes(w, t, pgno, p, (lower - PAGEHDRSZ) / 2u, upper, leaf,
                      level);
}

/* Walks one database from its root and compares what it found with the
 * counts in its record. */
static int walk_tree(walker *w, const char *name, size_t name_len,
                     const db_rec *db)
{
    tree t = {.main = name == NULL, .depth = db->depth};
    if (t.main) {
        snprintf(t.name, sizeof t.name, "main database");
    } else {
        char clean[40];
        size_t n = name_len < sizeof clean - 1 ? name_len : sizeof clean - 1;
        for (size_t i = 0; i < n; i++)
            clean[i] = name[i] > 0x20 && name[i] < 0x7f ? name[i] : '?';
        clean[n] = '\0';
        snprintf(t.name, sizeof t.name, "database \"%s\"", clean);
    }
    /* stoke opens every database, the main one too, without flags; flags
     * (DUPSORT, INTEGERKEY, ...) would make liblmdb read the pages in
     * another layout than this walk checked */
    if (db->flags != 0)
        return damaged(w, &t, db->root,
                       "database flags 0x%x (stoke writes "
                       "none)",
                       db->flags);
    int rc = 0;
    if (db->root == P_INVALID) {
        if (db->depth || db->entries)
            return damaged(w, &t, 0, "no root but depth %u, %llu entries",
                           db->depth, (unsigned long long)db->entries);
    } else if (db->depth < 1 || db->depth > CURSOR_STACK) {
        return damaged(w, &t, db->root, "a tree depth of %u", db->depth);
    } else {
        rc = walk_page(w, &t, db->root, db->root, 1);
    }
    if (!rc && (t.entries != db->entries || t.leaf != db->leaf ||
                t.branch != db->branch || t.overflow != db->overflow))
        rc =
            damaged(w, &t, db->root,
                    "its record counts %llu entries and %llu "
                    "pages, the tree holds %llu and %llu",
                    (unsigned long long)db->entries,
                    (unsigned long long)(db->leaf + db->branch + db->overflow),
                    (unsigned long long)t.entries,
                    (unsigned long long)(t.leaf + t.branch + t.overflow));
    return rc;
}

int stk_lmdb_check_file(const char *dir, int fd, off_t size,
                        stk_lmdb_facts *facts, stk_err *err)
{
    meta_page m = {0}; /* read_metas fills it; -O3 cannot tell */
    int rc = read_metas(dir, fd, size, &m, err);
    if (rc)
        return rc;
    *facts = (stk_lmdb_facts){m.psize, m.last_pgno, m.txnid};
    walker w = {
        .psize = m.psize, .npages = m.last_pgno + 1, .dir = dir, .err = err};
    size_t map_len = (size_t)(w.npages * w.psize);
    void *map = mmap(NULL, map_len, PROT_READ, MAP_SHARED, fd, 0);
    w.seen = calloc(w.npages / 8 + 1, 1);
    if (map == MAP_FAILED || !w.seen)
        rc = stk_fail(
            err, map == MAP_FAILED ? stk_from_errno(errno) : STK_ENOMEM,
            "%s: data.mdb: cannot map %zu bytes to check it: %s", dir, map_len,
            map == MAP_FAILED ? strerror(errno) : "out of memory");
    else {
        w.map = map;
        rc = walk_tree(&w, NULL, 0, &m.main);
    }
    free(w.seen);
    if (map != MAP_FAILED)
        munmap(map, map_len);
    return rc;
}

int stk_lmdb_check_env(MDB_env *env, const char *dir,
                       const stk_lmdb_facts *facts, stk_err *err)
{
    MDB_envinfo info;
    MDB_stat st;
    if (mdb_env_info(env, &info) || mdb_env_stat(env, &st) ||
        st.ms_psize != facts->psize || info.me_last_pgno != facts->last_pgno ||
        info.me_last_txnid != facts->txnid)
        return stk_fail(err, STK_EUNSUPPORTED,
                        "%s: data.mdb: liblmdb (%s) reads a different meta "
                        "page than the check did (page size %u, last page "
                        "%zu); its layout is not the one stoke knows",
                        dir, mdb_version(NULL, NULL, NULL), st.ms_psize,
                        info.me_last_pgno);
    return 0;
}
