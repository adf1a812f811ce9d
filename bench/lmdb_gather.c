/* lmdb_gather.c - where the loader's time per sample goes, measured with
 * liblmdb directly on a stoke database (bench/loader_bench.sh, part C).
 *
 *   cc -O2 -o lmdb_gather bench/lmdb_gather.c -llmdb -lpthread
 *   lmdb_gather DB_DIR [--split train] [--batch 256] [--epochs 5] [--threads 1]
 *
 * Each epoch visits every record of the split once in a shuffled order, in
 * batches, copying each record's pixels into a batch buffer that is reused
 * (like a ring slot), inside one read-only transaction per batch
 * (mdb_txn_renew / mdb_txn_reset, as the loader does). Five ways, run
 * interleaved, each the median epoch of --epochs (at most 64), printed as one
 * JSON object (samples/s and GB/s of pixels):
 *   serial     per sample: mdb_get, read the 8-byte header, memcpy the
 *              pixels: what stoke's loader does today (loader.c store_get)
 *   lookup     mdb_get only, the value never touched: the B-tree's share
 *   twopass    mdb_get every sample of the batch first, keeping the pointers
 *              and prefetching each value's first cache line, then read the
 *              headers and copy: the record misses overlap instead of queueing
 *              behind each other
 *   sorted     twopass with the lookups done in key order (the batch's
 *              indices sorted, each copied to its own position), so that
 *              neighbouring keys share B-tree pages
 *   table      no lookups in the epoch: the address of every value is taken
 *              once, by one cursor walk in a read transaction kept open for
 *              the whole run (keys are dense 0..n-1; table_build_ms is that
 *              walk), then each batch prefetches its values' first lines and
 *              copies, as in twopass
 * With --threads N the batches are split among N threads, each with its own
 * transaction, and the figures are aggregate. The environment is opened
 * MDB_RDONLY | MDB_NOTLS; stoke's store also sets MDB_NOLOCK, which makes no
 * measurable difference here (one transaction per 256 samples). */
#define _GNU_SOURCE
#include <lmdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { SERIAL, LOOKUP, TWOPASS, SORTED, TABLE, NWAYS };
static const char *names[NWAYS] = {"serial", "lookup", "twopass", "sorted", "table"};

static MDB_env *env;
static MDB_dbi dbi;
static uint64_t count, *perm;
static const uint8_t **table; /* every value's address, from one cursor walk */
static size_t nbytes;
static int batch = 256, nthreads = 1;

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "lmdb_gather: %s: %s\n", what, mdb_strerror(rc));
    exit(1);
}

static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void shuffle(uint64_t seed)
{
    for (uint64_t i = 0; i < count; i++)
        perm[i] = i;
    for (uint64_t i = count - 1; i > 0; i--) {
        uint64_t j = splitmix(&seed) % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
}

static void key_encode(uint8_t k[8], uint64_t i)
{
    for (int b = 7; b >= 0; b--, i >>= 8)
        k[b] = (uint8_t)i;
}

static int cmp_dbl(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

typedef struct job {
    int way, id;
    uint8_t *dst;
    int32_t *labels;
    const uint8_t **ptr;
    uint64_t *order; /* (index << 16 | position) for the sorted way */
    volatile uint64_t sink;
} job;

static const uint8_t *get(MDB_txn *txn, uint64_t index)
{
    uint8_t kb[8];
    key_encode(kb, index);
    MDB_val k = {8, kb}, v;
    int rc = mdb_get(txn, dbi, &k, &v);
    if (rc)
        die("mdb_get", rc);
    if (v.mv_size != 8 + nbytes) {
        fprintf(stderr, "lmdb_gather: record of %zu bytes\n", v.mv_size);
        exit(1);
    }
    return v.mv_data;
}

static void copy_one(job *j, int pos, const uint8_t *p)
{
    uint32_t n;
    memcpy(&n, p + 4, 4);
    if (n != nbytes)
        exit(1);
    memcpy(&j->labels[pos], p, 4);
    memcpy(j->dst + (size_t)pos * nbytes, p + 8, nbytes);
}

static void *run(void *arg)
{
    job *j = arg;
    MDB_txn *txn;
    int rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    if (rc)
        die("mdb_txn_begin", rc);
    mdb_txn_reset(txn);
    uint64_t nb = (count + batch - 1) / batch;
    for (uint64_t b = j->id; b < nb; b += nthreads) {
        if ((rc = mdb_txn_renew(txn)))
            die("mdb_txn_renew", rc);
        uint64_t first = b * batch;
        int n = (int)(count - first < (uint64_t)batch ? count - first : (uint64_t)batch);
        const uint64_t *idx = perm + first;
        switch (j->way) {
        case SERIAL:
            for (int i = 0; i < n; i++)
                copy_one(j, i, get(txn, idx[i]));
            break;
        case LOOKUP:
            for (int i = 0; i < n; i++)
                j->sink += (uintptr_t)get(txn, idx[i]);
            break;
        case TWOPASS:
            for (int i = 0; i < n; i++) {
                j->ptr[i] = get(txn, idx[i]);
                __builtin_prefetch(j->ptr[i]);
            }
            for (int i = 0; i < n; i++)
                copy_one(j, i, j->ptr[i]);
            break;
        case SORTED:
            for (int i = 0; i < n; i++)
                j->order[i] = idx[i] << 16 | (uint64_t)i;
            qsort(j->order, n, sizeof *j->order, cmp_u64);
            for (int i = 0; i < n; i++) {
                j->ptr[i] = get(txn, j->order[i] >> 16);
                __builtin_prefetch(j->ptr[i]);
            }
            for (int i = 0; i < n; i++)
                copy_one(j, (int)(j->order[i] & 0xffff), j->ptr[i]);
            break;
        case TABLE:
            for (int i = 0; i < n; i++)
                __builtin_prefetch(table[idx[i]]);
            for (int i = 0; i < n; i++)
                copy_one(j, i, table[idx[i]]);
            break;
        }
        mdb_txn_reset(txn);
    }
    mdb_txn_abort(txn);
    return NULL;
}

int main(int argc, char **argv)
{
    const char *dir = NULL, *split = "train";
    int epochs = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--split") && i + 1 < argc)
            split = argv[++i];
        else if (!strcmp(argv[i], "--batch") && i + 1 < argc)
            batch = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--epochs") && i + 1 < argc)
            epochs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            nthreads = atoi(argv[++i]);
        else if (!dir && argv[i][0] != '-')
            dir = argv[i];
        else {
            fprintf(stderr, "usage: lmdb_gather DB_DIR [--split S] [--batch N] [--epochs N] [--threads N]\n");
            return 2;
        }
    }
    if (!dir || batch < 1 || batch > 65535 || epochs < 1 || nthreads < 1 || nthreads > 64) {
        fprintf(stderr, "usage: lmdb_gather DB_DIR [--split S] [--batch N] [--epochs N] [--threads N]\n");
        return 2;
    }
    int rc;
    if ((rc = mdb_env_create(&env)) || (rc = mdb_env_set_maxdbs(env, 64)) ||
        (rc = mdb_env_set_maxreaders(env, 126)) ||
        (rc = mdb_env_open(env, dir, MDB_RDONLY | MDB_NOTLS, 0664)))
        die(dir, rc);
    MDB_txn *txn;
    if ((rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn)) ||
        (rc = mdb_dbi_open(txn, split, 0, &dbi)))
        die(split, rc);
    MDB_stat st;
    mdb_stat(txn, dbi, &st);
    count = st.ms_entries;
    MDB_val k = {8, (uint8_t[8]){0}}, v;
    if ((rc = mdb_get(txn, dbi, &k, &v)))
        die("first record", rc);
    nbytes = v.mv_size - 8;
    if ((rc = mdb_txn_commit(txn))) /* keeps dbi open (an abort would close it) */
        die("mdb_txn_commit", rc);
    perm = malloc(count * sizeof *perm);

    job jobs[64];
    pthread_t th[64];
    for (int t = 0; t < nthreads; t++) {
        jobs[t].id = t;
        jobs[t].dst = aligned_alloc(4096, ((size_t)batch * nbytes + 4095) / 4096 * 4096);
        jobs[t].labels = malloc(batch * sizeof(int32_t));
        jobs[t].ptr = malloc(batch * sizeof *jobs[t].ptr);
        jobs[t].order = malloc(batch * sizeof *jobs[t].order);
        memset(jobs[t].dst, 0, (size_t)batch * nbytes);
    }
    /* warm: every page of the map touched once (page cache + page tables) */
    shuffle(1);
    jobs[0].way = SERIAL;
    int keep = nthreads;
    nthreads = 1;
    run(&jobs[0]);
    nthreads = keep;

    /* the table: one cursor walk, the transaction stays open until the end */
    double t0 = now();
    MDB_txn *keep_txn;
    MDB_cursor *cur;
    table = malloc(count * sizeof *table);
    if ((rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &keep_txn)) ||
        (rc = mdb_cursor_open(keep_txn, dbi, &cur)))
        die("table", rc);
    uint64_t n = 0;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc;
         rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT), n++) {
        uint64_t key = 0;
        for (int b = 0; b < 8; b++)
            key = key << 8 | ((const uint8_t *)k.mv_data)[b];
        if (k.mv_size != 8 || key != n || v.mv_size != 8 + nbytes) {
            fprintf(stderr, "lmdb_gather: keys are not dense 0..n-1\n");
            return 1;
        }
        table[n] = v.mv_data;
    }
    mdb_cursor_close(cur);
    double table_ms = (now() - t0) * 1e3;

    double times[NWAYS][64];
    if (epochs > 64)
        epochs = 64;
    for (int e = 0; e < epochs; e++)
        for (int w = 0; w < NWAYS; w++) { /* ways interleaved */
            shuffle(100 + e);
            t0 = now();
            for (int t = 0; t < nthreads; t++) {
                jobs[t].way = w;
                if (nthreads == 1)
                    run(&jobs[t]);
                else
                    pthread_create(&th[t], NULL, run, &jobs[t]);
            }
            for (int t = 0; nthreads > 1 && t < nthreads; t++)
                pthread_join(th[t], NULL);
            times[w][e] = now() - t0;
        }
    double med[NWAYS];
    for (int w = 0; w < NWAYS; w++) {
        qsort(times[w], epochs, sizeof(double), cmp_dbl);
        med[w] = epochs % 2 ? times[w][epochs / 2]
                            : (times[w][epochs / 2 - 1] + times[w][epochs / 2]) / 2;
    }
    printf("{\"db\": \"%s\", \"split\": \"%s\", \"samples\": %llu, \"record_bytes\": %zu, "
           "\"batch\": %d, \"threads\": %d, \"epochs\": %d, \"table_build_ms\": %.2f",
           dir, split, (unsigned long long)count, nbytes, batch, nthreads, epochs, table_ms);
    for (int w = 0; w < NWAYS; w++)
        printf(", \"%s_sps\": %.0f, \"%s_gbs\": %.3f", names[w], count / med[w], names[w],
               count * (double)nbytes / med[w] / 1e9);
    printf("}\n");
    mdb_txn_abort(keep_txn);
    mdb_env_close(env);
    return 0;
}
