/* store.h - the stoke database: one LMDB environment per dataset.
 *
 * Layout (docs/formats.md has it byte by byte):
 *   DB_DIR/data.mdb, DB_DIR/lock.mdb  one LMDB environment
 *   named database "meta"             key "dataset" -> JSON metadata
 *   named database per split          key = sample index, 8-byte big-endian,
 *                                     dense from 0; value = encoded record
 *
 * A database is complete or it is not there. stk_store_create() builds it in
 * a hidden sibling directory (".NAME.partial", held with an exclusive flock)
 * and stk_store_finish() writes the metadata with "complete": true, syncs,
 * and renames it into place. Anything interrupted before that leaves only the
 * partial directory, which no reader accepts and the next create removes. */
#ifndef STK_STORE_H
#define STK_STORE_H

#include "common/common.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- record codec ------------------------------------------------------ */

/* Record value, format 1 (fixed-size raw databases): int32 label
 * (little-endian), uint32 payload byte count (little-endian), then the
 * payload: uint8 pixels in CHW order. */
#define STK_RECORD_HEADER 8
/* Format 2 (variable-size or encoded databases): int32 label, uint32
 * nbytes, uint32 height, uint32 width, then nbytes of payload: CHW pixels
 * (raw, nbytes == C*H*W) or the JPEG file (jpeg, H x W its size). */
#define STK_RECORD_HEADER_V2 16

typedef struct stk_record {
    int32_t label;
    uint32_t nbytes;      /* payload size */
    int height, width;    /* this record's image (fixed ones: the meta's) */
    const uint8_t *data;  /* payload; borrowed, see stk_reader_get() */
} stk_record;

/* Writes the STK_RECORD_HEADER-byte header of a record to dst, for writers
 * that place the payload themselves right after it. */
void stk_record_put_header(uint8_t *dst, int32_t label, uint32_t nbytes);

/* The same for a format 2 record (STK_RECORD_HEADER_V2 bytes). */
void stk_record_put_header_v2(uint8_t *dst, int32_t label, uint32_t nbytes,
                              uint32_t height, uint32_t width);

/* Writes header and payload to dst (STK_RECORD_HEADER + nbytes bytes). */
void stk_record_encode(uint8_t *dst, int32_t label, const uint8_t *pixels,
                       uint32_t nbytes);

/* Parses a format 1 record of len bytes; its payload must be exactly
 * expect bytes. out->data points into src; height and width are left 0
 * (the caller knows the shape). Returns 0 or STK_EFORMAT. */
int stk_record_decode(const void *src, size_t len, uint32_t expect,
                      stk_record *out);

struct stk_meta;

/* Parses a record of len bytes as the database m describes it (format 1
 * or 2, fixed or variable, raw or jpeg) and fills out (height and width
 * always). Returns 0, or STK_EFORMAT with why (n bytes) saying what does
 * not agree, e.g. "record is 20 bytes, its header says 16 + 8". */
int stk_record_parse(const void *src, size_t len, const struct stk_meta *m,
                     stk_record *out, char *why, size_t n);

/* Little-endian uint32 at p. */
void stk_put_le32(uint8_t *p, uint32_t v);
uint32_t stk_get_le32(const uint8_t *p);

/* zlib's crc32 of len bytes (Python's zlib.crc32): the checksum of each
 * record and of the metadata (docs/formats.md, "Checksums"). */
uint32_t stk_crc32(const void *data, size_t len);

/* Fills an 8-byte big-endian key for index i. */
void stk_key_encode(uint8_t key[8], uint64_t i);
uint64_t stk_key_decode(const uint8_t key[8]);

/* ---- metadata ---------------------------------------------------------- */

#define STK_MAX_SPLITS 8
#define STK_MAX_CHANNELS 4
#define STK_SPLIT_NAME_MAX 32

/* Limits on what metadata may describe (docs/formats.md); parsing refuses
 * anything beyond them, naming the field, before it sizes anything. */
#define STK_MAX_SIDE 65536                     /* height, width */
#define STK_MAX_SAMPLE_BYTES ((uint64_t)1 << 30) /* C*H*W */
#define STK_MAX_CLASSES (1 << 20)
/* records per split: its checksum list (4 bytes a record) is one LMDB value,
 * and LMDB values are under 4 GiB */
#define STK_MAX_RECORDS (((uint64_t)1 << 30) - 1)

typedef struct stk_split_meta {
    char name[STK_SPLIT_NAME_MAX];
    uint64_t count;            /* records, keys 0..count-1 */
    uint64_t *label_counts;    /* nclasses entries, owned by the meta */
    double mean[STK_MAX_CHANNELS]; /* per channel, pixel/255 */
    double std[STK_MAX_CHANNELS];
    uint64_t nskipped;         /* source files skipped with --skip-bad */
} stk_split_meta;

/* Record payload encodings (format 2). */
enum { STK_ENC_RAW = 0, STK_ENC_JPEG = 1 };

typedef struct stk_meta {
    int channels, height, width; /* height, width 0 when variable */
    int encoding;              /* STK_ENC_RAW or STK_ENC_JPEG */
    bool variable;             /* each record has its own height x width */
    int short_side, max_side;  /* prep's sizing of variable records (0 when
                                  unused); every H, W <= max_side */
    int quality;               /* JPEG quality, 0 for raw */
    int nclasses;
    char **classes;            /* nclasses names, owned */
    int nsplits;
    stk_split_meta splits[STK_MAX_SPLITS];
    char *source_path;         /* owned */
    char *source_format;       /* "idx", "cifar" or "folder", owned */
    char *tool;                /* "stoke prep 0.1.0", owned */
    char *created;             /* ISO 8601 UTC, owned */
    char *skipped_json;        /* JSON object split -> [{file, error}], owned,
                                  may be NULL */
    double holdout;            /* prep --holdout: the share of each class
                                  moved from "train" to "test"; 0 = none */
    uint64_t holdout_seed;     /* its seed, below 2^53 (a JSON number) */
    bool complete;
    bool checksums;            /* the "checksums" database is there (every
                                  database this stoke writes) */
} stk_meta;

/* Frees everything a meta owns and zeroes it; NULL is a no-op. */
void stk_meta_free(stk_meta *m);

/* Serialises to JSON (malloc'd, caller frees) or parses it. Parsing checks
 * every field it needs and names the first one that is missing or wrong. */
char *stk_meta_to_json(const stk_meta *m);
int stk_meta_from_json(const char *json, size_t len, stk_meta *m,
                       stk_err *err);

/* True when every record is raw pixels of one shape (format 1): only
 * then do records have a size known from the metadata. */
bool stk_meta_fixed(const stk_meta *m);

/* Payload bytes per record of a fixed database (stk_meta_fixed):
 * channels * height * width, at most STK_MAX_SAMPLE_BYTES in any parsed
 * metadata; 0 for a variable-size or encoded one. */
uint32_t stk_meta_sample_bytes(const stk_meta *m);

/* Record header bytes: STK_RECORD_HEADER for fixed databases, else
 * STK_RECORD_HEADER_V2. */
size_t stk_meta_header_bytes(const stk_meta *m);

/* Named databases of the environment besides the splits. */
#define STK_META_DB "meta"
#define STK_CHECKSUM_DB "checksums"

/* 0 when name may name a split: 1..STK_SPLIT_NAME_MAX-1 bytes, no control
 * characters, not a reserved database name; else STK_EINVAL saying why. */
int stk_split_name_ok(const char *name, stk_err *err);

/* A channel's mean and std on the 0..1 scale (pixel / 255) from the
 * integer sum and sum of squares of its n pixel values (0 and 0 when n is
 * 0): the metadata's numbers, computed the same way by prep and verify. */
void stk_channel_stats(uint64_t sum, uint64_t sumsq, double n, double *mean,
                       double *std);

/* Index of a split by name, or -1. */
int stk_meta_split(const stk_meta *m, const char *name);

/* ---- names in the UTF-8 metadata (text.c) ----------------------------- */

/* Length (1..4) of the valid UTF-8 sequence at s (n bytes available), or 0
 * when s starts with a byte that is not part of one (Python's strict
 * decoder: no overlong forms, no surrogates, nothing above U+10FFFF). */
size_t stk_utf8_len(const char *s, size_t n);

/* Copies the name s into out (cap bytes, always NUL-terminated; a name that
 * does not fit is cut at a whole character or escape) with control
 * characters, C1 codes, bytes that are not UTF-8 and '\' written as \xHH,
 * so that printing a name from the file system cannot drive a terminal.
 * 4 * strlen(s) + 1 bytes always suffice. Returns out. */
char *stk_text_printable(char *out, size_t cap, const char *s);

/* A copy of JSON text (malloc'd; NULL when out of memory) in which every
 * byte that is not part of a valid UTF-8 sequence is written as the escape
 * \udcXX (PEP 383 surrogateescape, as Python's json.dumps(os.fsdecode(b))
 * writes it), so the text is valid UTF-8 and names keep their exact bytes.
 * Bytes outside strings are ASCII in any JSON, so only strings change. */
char *stk_json_escape_bytes(const char *text);

/* The reverse, for a parser that refuses lone surrogates (cJSON): a copy of
 * len bytes of JSON text (malloc'd, NUL-terminated) in which each escape
 * \udc80..\udcff that does not complete a surrogate pair becomes the raw
 * byte 0x80..0xff again. */
char *stk_json_unescape_bytes(const char *json, size_t len);

/* ---- the store --------------------------------------------------------- */

typedef struct stk_store stk_store;

typedef struct stk_store_opts {
    size_t map_size;        /* initial map size in bytes; 0 = 64 MiB */
    size_t map_size_max;    /* growth stops here; 0 = 1 TiB */
    size_t txn_bytes;       /* commit after this many pending bytes;
                               0 = 64 MiB */
    bool force;             /* replace an existing complete database */
    const char *force_hint; /* how the user says force in refusals; NULL =
                               "--force" (Python: "force=True") */
    bool verify;            /* stk_store_finish reopens the database and
                               runs stk_store_verify before publishing it */
    const atomic_int *cancel; /* non-zero stops that verify
                                            (STK_ECANCELED); may be NULL */
} stk_store_opts;

/* Starts a new database that will appear at dir when finished. Refuses a dir
 * that holds a complete database (unless opts->force) or anything that is not
 * a stoke database. On failure *out is NULL and nothing is left behind. */
int stk_store_create(const char *dir, const stk_store_opts *opts,
                     stk_store **out, stk_err *err);

/* Appends one encoded record to split (created on first use) under the next
 * dense key. Records are buffered and committed in large MDB_APPEND
 * transactions; on MDB_MAP_FULL the map doubles (up to map_size_max) and the
 * transaction is replayed. Splits may be written one after the other only. */
int stk_store_append(stk_store *s, const char *split, const void *rec,
                     size_t len, stk_err *err);

/* Records appended so far to split. */
uint64_t stk_store_count(const stk_store *s, const char *split);

/* Commits what is pending, writes meta (with complete = true), syncs and
 * moves the database into place. The store must still be closed after. */
int stk_store_finish(stk_store *s, const stk_meta *meta, stk_err *err);

/* Opens a complete database read-only (MDB_RDONLY | MDB_NOTLS |
 * MDB_NOLOCK: a published database is never written again, so any number
 * of threads and processes read it without a shared reader table; the
 * max_readers hint is kept for a future locked mode, 0 = 512). Refuses an
 * incomplete one. */
int stk_store_open(const char *dir, int max_readers, stk_store **out,
                   stk_err *err);

/* Opens any stoke database read-only, complete or not, for inspection;
 * meta->complete tells which. */
int stk_store_open_any(const char *dir, stk_store **out, stk_err *err);

/* The metadata of an opened store; lives as long as the store. */
const stk_meta *stk_store_meta(const stk_store *s);

/* Current LMDB map size in bytes. */
size_t stk_store_map_size(const stk_store *s);

/* Closes the store. A created store that was not finished is discarded: its
 * partial directory is removed. NULL is a no-op. */
void stk_store_close(stk_store *s);

/* ---- verification (verify.c) ------------------------------------------- */

#define STK_VERIFY_KEPT 8

typedef struct stk_verify_report {
    uint64_t records;   /* records read */
    uint64_t problems;  /* problems found */
    bool checksums;     /* checksums were compared (a database written
                           before them has none) */
    char first[STK_VERIFY_KEPT][320]; /* the first problems, each naming
                                         split and key */
} stk_verify_report;

/* Reads every record of every split of an opened store and checks it: keys
 * dense from 0, the record's size field and length against the shape, the
 * label in 0..nclasses-1, its crc32 against the checksum list; then per
 * split the count, label_counts, mean and std against the metadata, and the
 * metadata against its own checksum. Returns 0 when all agree, STK_EFORMAT
 * when something does not (err holds the first problem and rep all of
 * them), another code when the database could not be read. */
int stk_store_verify(stk_store *s, stk_verify_report *rep, stk_err *err);

/* The same, stopping with STK_ECANCELED soon after *cancel becomes non-zero
 * (reading a large database takes a while; a Ctrl-C must not wait for it).
 * cancel may be NULL. */
int stk_store_verify_until(stk_store *s, const atomic_int *cancel,
                           stk_verify_report *rep, stk_err *err);

/* ---- views: a whole split, addressed by index, for many threads ------- */

typedef struct stk_view stk_view;

/* Takes one read-only snapshot of split for the view's lifetime and indexes
 * the address and length of every record with one cursor walk (the records
 * themselves are not read). A published database never changes, so the
 * snapshot costs nothing to hold. Any number of threads may call
 * stk_view_get and stk_view_prefetch at once. */
int stk_view_open(stk_store *s, const char *split, stk_view **out,
                  stk_err *err);

uint64_t stk_view_count(const stk_view *v);

/* Record index, zero-copy: rec->data points into the map and stays valid
 * until stk_view_close. A record of the wrong size is an error naming the
 * split and key. */
int stk_view_get(const stk_view *v, uint64_t index, stk_record *rec,
                 stk_err *err);

/* Hints that record index is read soon: starts loading its first `bytes`
 * bytes (at most the record's), one cache line at a time. */
void stk_view_prefetch(const stk_view *v, uint64_t index, size_t bytes);

/* NULL is a no-op. */
void stk_view_close(stk_view *v);

/* ---- readers: one per thread ------------------------------------------- */

typedef struct stk_reader stk_reader;

/* A read-only cursor over one split of an opened store. */
int stk_reader_open(stk_store *s, const char *split, stk_reader **out,
                    stk_err *err);

/* Looks up record index. rec->data points into the LMDB map (zero-copy) and
 * stays valid until the next stk_reader_release() or close. Opens or renews
 * the read transaction as needed. Errors name the split and key. */
int stk_reader_get(stk_reader *r, uint64_t index, stk_record *rec,
                   stk_err *err);

/* Ends the current snapshot (mdb_txn_reset) so LMDB can reuse pages;
 * the next get renews it. */
void stk_reader_release(stk_reader *r);

/* NULL is a no-op. */
void stk_reader_close(stk_reader *r);

#endif
