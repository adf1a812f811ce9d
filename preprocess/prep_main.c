/* prep - decode and transform a raw dataset once, in parallel, into a stoke
 * database (LMDB). A thin main over stk_prep_run(). */
#include "common/cli.h"
#include "preprocess/preprocess.h"
#include "store/store.h"

#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int interrupted; /* set on the signal watcher's thread */

static void on_stop(int sig, void *arg)
{
    (void)sig, (void)arg;
    interrupted = 1;
}

static const char usage[] =
    "usage: prep [options] RAW_DIR DB_DIR\n"
    "Decode RAW_DIR once, in parallel, into the stoke database DB_DIR.\n"
    "\n"
    "  --workers N        decoding threads (default: the CPUs it may use)\n"
    "  --format F         idx, cifar or folder (default: detected)\n"
    "  --size S           resize the shorter side to S and centre-crop SxS\n"
    "                     (default: native for idx/cifar, 64 for folders)\n"
    "  --short-side S     keep each image's aspect ratio: the shorter side\n"
    "                     resized to S (never enlarged without --upscale),\n"
    "                     the longer one capped by --max-side (default 2*S);\n"
    "                     records of varying size (folders only)\n"
    "  --max-side L       cap the longer side at L (alone: only the cap)\n"
    "  --upscale          enlarge images smaller than --short-side too\n"
    "  --encode E         raw (default) or jpeg: store each record as a JPEG\n"
    "  --quality Q        JPEG quality 1..100 (default 90)\n"
    "  --gray | --rgb     store 1 or 3 channels (default: the source's own;\n"
    "                     folders: rgb)\n"
    "  --holdout F        hold out the fraction F (0..1) of each class as\n"
    "                     the \"test\" split of a folder without split\n"
    "                     folders, chosen from each file's relative path\n"
    "                     and the seed: the same files on every machine\n"
    "  --holdout-seed S   seed of that choice (default 0)\n"
    "  --skip-bad         record unreadable samples in the metadata and go\n"
    "                     on, instead of stopping at the first one\n"
    "  --force            replace an existing complete database\n"
    "  --map-size BYTES   initial LMDB map size (default: estimated)\n"
    "  --map-max BYTES    the map grows up to this size (default: 1T)\n"
    "  --quiet            no progress output\n"
    "  -h, --help         this text\n";

typedef struct progress_state {
    int tty, quiet;
    double last;
} progress_state;

static void on_progress(const stk_prep_progress *p, void *arg)
{
    progress_state *ps = arg;
    double every = ps->tty ? 0.1 : 5.0;
    if (ps->quiet || (p->seconds - ps->last < every && p->done != p->total))
        return;
    ps->last = p->seconds;
    double rate = p->seconds > 0 ? p->done / p->seconds : 0;
    double eta = rate > 0 ? (p->total - p->done) / rate : 0;
    fprintf(stderr,
            "%sprep: [%s] %llu/%llu samples  %.0f/s  ETA %.0fs%s%s",
            ps->tty ? "\r" : "", p->split, (unsigned long long)p->done,
            (unsigned long long)p->total, rate, eta,
            p->skipped ? "  (skipped some)" : "", ps->tty ? "\033[K" : "\n");
}

static int parse_format(const char *s, stk_src_format *f)
{
    static const char *const names[] = {"idx", "cifar", "folder"};
    static const stk_src_format formats[] = {STK_SRC_IDX, STK_SRC_CIFAR,
                                             STK_SRC_FOLDER};
    int i;
    if (stk_cli_choice("prep", "--format", s, names, 3, &i))
        return -1;
    *f = formats[i];
    return 0;
}

/* --holdout: a fraction strictly between 0 and 1, kept as the double the
 * user wrote (the metadata records it). */
static int parse_holdout(const char *s, double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v > 0 && v < 1)) {
        fprintf(stderr,
                "prep: --holdout: expected a fraction between 0 and 1 "
                "(e.g. 0.1), got '%s'\n",
                s);
        return -1;
    }
    *out = v;
    return 0;
}

/* --holdout-seed: the metadata stores it as a JSON number, exact below
 * 2^53. */
static int parse_seed(const char *s, uint64_t *out)
{
    if (stk_cli_u64("prep", "--holdout-seed", s, out))
        return -1;
    if (*out >= (uint64_t)1 << 53) {
        fprintf(stderr, "prep: --holdout-seed: expected 0..2^53-1, got %s\n",
                s);
        return -1;
    }
    return 0;
}

/* The latest creation time SOURCE_DATE_EPOCH may give: 9999-12-31
 * 23:59:59 UTC, the last second with a four-digit year. */
#define MAX_EPOCH 253402300799LL

/* Creation time: $SOURCE_DATE_EPOCH when set and not empty (reproducible
 * output), else now. The variable must be whole seconds since 1970 (digits
 * only, as `date +%s` prints them, 0..MAX_EPOCH); anything else is refused
 * rather than recorded as a made-up time. Returns 0 or -1 (printed). */
static int created_time(char *buf, size_t n)
{
    const char *sde = getenv("SOURCE_DATE_EPOCH");
    time_t t = time(NULL);
    if (sde && *sde) {
        char *end;
        errno = 0;
        long long v = strtoll(sde, &end, 10);
        if (sde[strspn(sde, "0123456789")] != '\0' || *end || errno ||
            v > MAX_EPOCH) {
            fprintf(stderr,
                    "prep: SOURCE_DATE_EPOCH: expected whole seconds since "
                    "1970 (0..%lld), got '%s'\n",
                    MAX_EPOCH, sde);
            return -1;
        }
        t = (time_t)v;
    }
    struct tm tm;
    if (!gmtime_r(&t, &tm) || !strftime(buf, n, "%Y-%m-%dT%H:%M:%SZ", &tm)) {
        fprintf(stderr, "prep: cannot format the creation time %lld\n",
                (long long)t);
        return -1;
    }
    return 0;
}

static int parse_args(int argc, char **argv, stk_prep_opts *o, int *quiet)
{
    enum { O_SKIP = 256, O_FORCE, O_MAPSIZE, O_MAPMAX, O_QUIET, O_GRAY, O_RGB,
           O_HOLDOUT, O_HSEED, O_SHORT, O_MAXSIDE, O_UPSCALE, O_ENCODE,
           O_QUALITY };
    static const char *const encodings[] = {"raw", "jpeg"};
    bool seeded = false; /* --holdout-seed given */
    static const struct option longs[] = {
        {"workers", required_argument, 0, 'w'},
        {"format", required_argument, 0, 'f'},
        {"size", required_argument, 0, 's'},
        {"short-side", required_argument, 0, O_SHORT},
        {"max-side", required_argument, 0, O_MAXSIDE},
        {"upscale", no_argument, 0, O_UPSCALE},
        {"encode", required_argument, 0, O_ENCODE},
        {"quality", required_argument, 0, O_QUALITY},
        {"gray", no_argument, 0, O_GRAY},
        {"rgb", no_argument, 0, O_RGB},
        {"holdout", required_argument, 0, O_HOLDOUT},
        {"holdout-seed", required_argument, 0, O_HSEED},
        {"skip-bad", no_argument, 0, O_SKIP},
        {"force", no_argument, 0, O_FORCE},
        {"map-size", required_argument, 0, O_MAPSIZE},
        {"map-max", required_argument, 0, O_MAPMAX},
        {"quiet", no_argument, 0, O_QUIET},
        {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    opterr = 0;
    int ch;
    while ((ch = getopt_long(argc, argv, ":h", longs, NULL)) != -1) {
        int bad = 0;
        switch (ch) {
        case 'w': bad = stk_cli_int("prep", "--workers", optarg, 1, 256, &o->workers); break;
        case 'f': bad = parse_format(optarg, &o->source.format); break;
        case 's': bad = stk_cli_int("prep", "--size", optarg, 1, 4096, &o->source.size); break;
        case O_SHORT: bad = stk_cli_int("prep", "--short-side", optarg, 1, 4096, &o->source.short_side); break;
        case O_MAXSIDE: bad = stk_cli_int("prep", "--max-side", optarg, 1, 8192, &o->source.max_side); break;
        case O_UPSCALE: o->source.upscale = true; break;
        case O_ENCODE: bad = stk_cli_choice("prep", "--encode", optarg, encodings, 2, &o->encoding); break;
        case O_QUALITY: bad = stk_cli_int("prep", "--quality", optarg, 1, 100, &o->quality); break;
        case O_GRAY: o->source.channels = 1; break;
        case O_RGB: o->source.channels = 3; break;
        case O_HOLDOUT: bad = parse_holdout(optarg, &o->source.holdout); break;
        case O_HSEED: bad = parse_seed(optarg, &o->source.holdout_seed); seeded = true; break;
        case O_SKIP: o->skip_bad = true; break;
        case O_FORCE: o->force = true; break;
        case O_MAPSIZE: bad = stk_cli_bytes("prep", "--map-size", optarg, &o->map_size); break;
        case O_MAPMAX: bad = stk_cli_bytes("prep", "--map-max", optarg, &o->map_size_max); break;
        case O_QUIET: *quiet = 1; break;
        case 'h': fputs(usage, stdout); exit(0);
        case ':':
            fprintf(stderr, "prep: %s needs a value\n", argv[optind - 1]);
            return -1;
        default:
            fprintf(stderr, "prep: unknown option '%s' (see prep --help)\n",
                    argv[optind - 1]);
            return -1;
        }
        if (bad)
            return -1;
    }
    if (argc - optind != 2) {
        fprintf(stderr, "prep: expected RAW_DIR and DB_DIR (see prep "
                        "--help)\n");
        return -1;
    }
    for (int i = 0; i < 2; i++)
        if (!*argv[optind + i]) {
            fprintf(stderr, "prep: %s is empty (see prep --help)\n",
                    i ? "DB_DIR" : "RAW_DIR");
            return -1;
        }
    stk_err err = {0}; /* flags that exclude or need each other (a seed
                          of 0, the default, only the parser sees given) */
    if (seeded && !o->source.holdout)
        stk_fail(&err, STK_EINVAL, "--holdout-seed needs --holdout");
    if (err.code || stk_prep_opts_check(o, &err)) {
        fprintf(stderr, "prep: %s\n", err.msg);
        return -1;
    }
    return 0;
}

static void print_summary(const char *db, const stk_prep_summary *s)
{
    if (s->height)
        printf("prep: wrote %s (%dx%dx%d uint8%s):", db, s->channels,
               s->height, s->width,
               s->encoding == STK_ENC_JPEG ? ", as JPEG" : "");
    else
        printf("prep: wrote %s (%d channels, variable size%s):", db,
               s->channels, s->encoding == STK_ENC_JPEG ? ", as JPEG" : "");
    uint64_t skipped = 0;
    for (int k = 0; k < s->nsplits; k++) {
        printf("%s %s %llu", k ? "," : "", s->split[k],
               (unsigned long long)s->count[k]);
        skipped += s->skipped[k];
    }
    double sec = s->seconds > 0 ? s->seconds : 1e-9;
    printf(" in %.2f s (%.0f samples/s, %.1f MB/s, %.0f bytes/record)\n",
           s->seconds, s->samples / sec, s->bytes / sec / 1e6,
           s->samples ? (double)s->bytes / s->samples : 0.0);
    if (skipped)
        printf("prep: skipped %llu bad file(s); `dbinfo %s` lists them\n",
               (unsigned long long)skipped, db);
    for (const char *w = s->warning; *w;) { /* one line each */
        size_t n = strcspn(w, "\n");
        fprintf(stderr, "prep: warning: %.*s\n", (int)n, w);
        w += n + (w[n] == '\n');
    }
}

int main(int argc, char **argv)
{
    int ncpu = stk_usable_cpus(); /* under taskset or a cpuset, not the host's */
    char created[32];
    progress_state ps = {isatty(2), 0, 0.0};
    stk_prep_opts o = {
        .workers = ncpu > 256 ? 256 : ncpu,
        .created = created,
        .cancel = &interrupted,
        .progress = on_progress,
        .progress_arg = &ps,
    };
    if (parse_args(argc, argv, &o, &ps.quiet) ||
        created_time(created, sizeof created))
        return 2;
    const char *raw = argv[optind], *db = argv[optind + 1];
    static stk_stop_watch watch = {.on_stop = on_stop};
    int e = stk_stop_watch_start(&watch);
    if (e) {
        fprintf(stderr, "prep: error: cannot watch for Ctrl-C: %s\n", strerror(e));
        return 1;
    }
    signal(SIGXFSZ, SIG_IGN); /* a file-size limit shows up as EFBIG */
    stk_prep_summary sum;
    stk_err err = {0};
    int rc = stk_prep_run(raw, db, &o, &sum, &err);
    if (ps.tty && !ps.quiet)
        fputs("\n", stderr);
    if (rc == STK_ECANCELED) {
        fprintf(stderr, "prep: interrupted; %s was left as it was\n", db);
        return 130;
    }
    if (rc) {
        fprintf(stderr, "prep: error: %s\n", err.msg);
        return 1;
    }
    print_summary(db, &sum);
    return 0;
}
