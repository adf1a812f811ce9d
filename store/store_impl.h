/* store_impl.h - private to store/: the structural check of data.mdb that
 * stk_store_open runs before liblmdb reads the file (check.c), and raw
 * reads for the verification (verify.c). */
#ifndef STK_STORE_IMPL_H
#define STK_STORE_IMPL_H

#include "store.h"

#include "common/common.h"

#include <lmdb.h>
#include <stdint.h>
#include <sys/types.h>

/* What the check read from the meta page that liblmdb will use. */
typedef struct stk_lmdb_facts {
    uint64_t psize;     /* page size */
    uint64_t last_pgno; /* last page in use */
    uint64_t txnid;     /* the newer meta page's transaction id */
} stk_lmdb_facts;

/* Checks data.mdb (open as fd, size bytes) of database dir before
 * mdb_env_open: both meta pages, the file's size against the last page the
 * newer meta counts ("DIR: data.mdb is truncated (N of M bytes)"), and every
 * branch and leaf page reachable from the main database and every named
 * database. Returns 0, or STK_EFORMAT with a message naming the database,
 * page and problem. */
int stk_lmdb_check_file(const char *dir, int fd, off_t size,
                        stk_lmdb_facts *facts, stk_err *err);

/* After mdb_env_open: checks that liblmdb chose the meta page the check
 * read (same page size, last page and transaction), so the pages checked are
 * the pages it reads. This holds for an environment opened with MDB_NOLOCK,
 * as stk_store_open does: every read transaction then takes the newer meta
 * page. With a lock file a reader takes the meta page of the last committed
 * transaction id (txnid & 1), which this comparison would not see. */
int stk_lmdb_check_env(MDB_env *env, const char *dir,
                       const stk_lmdb_facts *facts, stk_err *err);

/* A copy (malloc'd, caller frees) of the value under key in the named
 * database db of an opened store. STK_ENOENT when the database or the key
 * is not there. */
int stk_store_get_copy(stk_store *s, const char *db, const char *key,
                       uint8_t **copy, size_t *len, stk_err *err);

/* Key of the metadata's checksum in the meta database: crc32 of the
 * "dataset" value, uint32 little-endian. */
#define STK_META_CRC_KEY "dataset.crc32"

#endif
