/* common.c - error table, file helpers, clock and streaming copy shared by
 * all modules. */
#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

const char *stk_strerror(int code)
{
    switch (code) {
#define STK_ERR_TEXT(name, val, text)                                          \
    case val:                                                                  \
        return text;
        STK_ERRNO_MAP(STK_ERR_TEXT)
#undef STK_ERR_TEXT
    case 0:
        return "success";
    default:
        return "unknown error";
    }
}

const char *stk_err_name(int code)
{
    switch (code) {
#define STK_ERR_NAME(name, val, text)                                          \
    case val:                                                                  \
        return "STK_" #name;
        STK_ERRNO_MAP(STK_ERR_NAME)
#undef STK_ERR_NAME
    case 0:
        return "STK_OK";
    default:
        return "STK_UNKNOWN";
    }
}

int stk_fail(stk_err *err, int code, const char *fmt, ...)
{
    if (err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
        err->code = code;
    }
    return code;
}

int stk_from_errno(int e)
{
    switch (e) {
    case ENOENT:
    case ENOTDIR:
        return STK_ENOENT;
    case ENOMEM:
        return STK_ENOMEM;
    case EEXIST:
    case ENOTEMPTY:
        return STK_EEXIST;
    case ENOSPC:
    case EFBIG:
    case EDQUOT:
        return STK_ENOSPACE;
    case EINVAL:
        return STK_EINVAL;
    default:
        return STK_EIO;
    }
}

static const char *file_kind(mode_t m)
{
    return S_ISDIR(m)    ? "a directory"
           : S_ISFIFO(m) ? "a FIFO"
           : S_ISSOCK(m) ? "a socket"
           : S_ISCHR(m)  ? "a character device"
           : S_ISBLK(m)  ? "a block device"
                         : "not a file";
}

static int not_regular(const char *path, mode_t m, stk_err *err)
{
    return stk_fail(err, STK_EFORMAT, "%s: not a regular file (%s)", path,
                    file_kind(m));
}

/* Keeps fd, opened O_NONBLOCK, only when fstat finds a regular file, and
 * then clears O_NONBLOCK; else closes it. Returns fd or a negative code. */
static int keep_regular(int fd, const char *path, struct stat *st,
                        stk_err *err)
{
    int rc = 0, fl;
    if (fstat(fd, st) != 0)
        rc = stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                      strerror(errno));
    else if (!S_ISREG(st->st_mode))
        rc = not_regular(path, st->st_mode, err);
    else if ((fl = fcntl(fd, F_GETFL)) < 0 ||
             fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        rc = stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                      strerror(errno));
    if (rc)
        close(fd);
    return rc ? rc : fd;
}

int stk_open_regular(const char *path, struct stat *st, stk_err *err)
{
    /* stat first: a device is refused without being opened (opening one
     * can have effects of its own). The open that follows is O_NONBLOCK in
     * case the path became a FIFO in between: opening a FIFO for reading
     * would otherwise wait for a writer for ever. On a regular file the flag
     * changes nothing, and it is cleared below. fstat checks what was
     * really opened. */
    if (stat(path, st) != 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                        strerror(errno));
    if (!S_ISREG(st->st_mode))
        return not_regular(path, st->st_mode, err);
    int fd;
    do
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                        strerror(errno));
    return keep_regular(fd, path, st, err);
}

int stk_open_output(const char *path, int flags, stk_err *err)
{
    /* As stk_open_regular: an existing path that is not a regular file is
     * refused without being opened, and the open is O_NONBLOCK for a FIFO
     * swapped in meanwhile (a write-only open of a FIFO without a reader
     * fails with ENXIO; with one it opens, and fstat refuses it). O_TRUNC is
     * held back until fstat has seen a regular file. */
    struct stat st;
    if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
        return not_regular(path, st.st_mode, err);
    int fd;
    do
        fd = open(path, (flags & ~O_TRUNC) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK,
                  0666);
    while (fd < 0 && errno == EINTR);
    if (fd < 0) {
        int e = errno;
        if (stat(path, &st) == 0 && !S_ISREG(st.st_mode))
            return not_regular(path, st.st_mode, err); /* ENXIO, EISDIR */
        return stk_fail(err, stk_from_errno(e), "%s: %s", path, strerror(e));
    }
    if ((fd = keep_regular(fd, path, &st, err)) < 0)
        return fd;
    if ((flags & O_TRUNC) && ftruncate(fd, 0) != 0) {
        int e = errno;
        close(fd);
        return stk_fail(err, stk_from_errno(e), "%s: %s", path, strerror(e));
    }
    return fd;
}

/* A stdio stream over fd (mode "r" or "w"), or NULL with fd closed; a
 * negative fd is a failure already reported. */
static FILE *stream(int fd, const char *mode, const char *path, stk_err *err)
{
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, mode);
    if (!f) {
        stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
        close(fd);
    }
    return f;
}

FILE *stk_fopen_output(const char *path, stk_err *err)
{
    return stream(stk_open_output(path, O_WRONLY | O_CREAT | O_TRUNC, err),
                  "w", path, err);
}

FILE *stk_fopen_regular(const char *path, stk_err *err)
{
    struct stat st;
    return stream(stk_open_regular(path, &st, err), "r", path, err);
}

int stk_read_file(const char *path, uint8_t **data, size_t *len, stk_err *err)
{
    *data = NULL;
    *len = 0;
    struct stat st;
    int fd = stk_open_regular(path, &st, err);
    if (fd < 0)
        return fd;
    size_t n = (size_t)st.st_size;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) {
        close(fd);
        return stk_fail(err, STK_ENOMEM, "%s: cannot allocate %zu bytes",
                        path, n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            free(buf);
            close(fd);
            return stk_fail(err, stk_from_errno(e), "%s: read failed: %s",
                            path, r < 0 ? strerror(e) : "file shrank");
        }
        got += (size_t)r;
    }
    close(fd);
    *data = buf;
    *len = n;
    return 0;
}

/* ---- stk_zfile: a file read front to back, gunzipped on the fly -------- */

struct stk_zfile {
    int fd;
    int gz;         /* 1: the content is inflated from the file */
    int member_end; /* the last inflate() ended a gzip member */
    int eof;        /* read() has returned 0 */
    uint64_t disk_size;
    z_stream zs;
    char *path;
    uint8_t in[64 * 1024];
};

/* read() that a signal cannot turn into a failure. */
static ssize_t read_retry(int fd, void *buf, size_t n)
{
    ssize_t r;
    do
        r = read(fd, buf, n);
    while (r < 0 && errno == EINTR);
    return r;
}

int stk_zfile_open(const char *path, stk_zfile **out, stk_err *err)
{
    *out = NULL;
    stk_zfile *f = calloc(1, sizeof *f);
    if (!f || !(f->path = strdup(path))) {
        free(f);
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    }
    struct stat st;
    f->fd = stk_open_regular(path, &st, err);
    if (f->fd < 0) {
        int rc = f->fd;
        f->fd = -1;
        stk_zfile_close(f);
        return rc;
    }
    f->disk_size = (uint64_t)st.st_size;
    ssize_t r = read_retry(f->fd, f->in, sizeof f->in);
    if (r < 0) {
        int e = errno;
        stk_zfile_close(f);
        return stk_fail(err, stk_from_errno(e), "%s: read failed: %s", path,
                        strerror(e));
    }
    f->zs.next_in = f->in;
    f->zs.avail_in = (uInt)r;
    f->eof = r == 0;
    f->gz = r >= 2 && f->in[0] == 0x1f && f->in[1] == 0x8b;
    if (f->gz && inflateInit2(&f->zs, 15 + 16) != Z_OK) {
        f->gz = 0; /* nothing for inflateEnd to free */
        stk_zfile_close(f);
        return stk_fail(err, STK_ENOMEM, "%s: zlib init failed", path);
    }
    *out = f;
    return 0;
}

/* Refills the input buffer once it is used up; sets eof at the end. */
static int zfile_fill(stk_zfile *f, stk_err *err)
{
    if (f->zs.avail_in || f->eof)
        return 0;
    ssize_t r = read_retry(f->fd, f->in, sizeof f->in);
    if (r < 0)
        return stk_fail(err, stk_from_errno(errno), "%s: read failed: %s",
                        f->path, strerror(errno));
    f->zs.next_in = f->in;
    f->zs.avail_in = (uInt)r;
    f->eof = r == 0;
    return 0;
}

/* Plain file: the buffered bytes first, then straight from the file. */
static int zfile_read_raw(stk_zfile *f, uint8_t *buf, size_t n, size_t *got,
                          stk_err *err)
{
    while (*got < n) {
        int rc = zfile_fill(f, err);
        if (rc)
            return rc;
        if (!f->zs.avail_in)
            break; /* the end of the file */
        size_t k = n - *got < f->zs.avail_in ? n - *got : f->zs.avail_in;
        memcpy(buf + *got, f->zs.next_in, k);
        f->zs.next_in += k;
        f->zs.avail_in -= (uInt)k;
        *got += k;
    }
    return 0;
}

static int zfile_read_gz(stk_zfile *f, uint8_t *buf, size_t n, size_t *got,
                         stk_err *err)
{
    while (*got < n) {
        int rc = zfile_fill(f, err);
        if (rc)
            return rc;
        if (f->member_end) {
            if (!f->zs.avail_in)
                break; /* the last member ended with the file */
            inflateReset(&f->zs); /* another member follows */
            f->member_end = 0;
        }
        size_t want = n - *got > UINT32_MAX ? UINT32_MAX : n - *got;
        f->zs.next_out = buf + *got;
        f->zs.avail_out = (uInt)want;
        int zr = inflate(&f->zs, Z_NO_FLUSH);
        *got += want - f->zs.avail_out;
        if (zr == Z_STREAM_END)
            f->member_end = 1;
        else if (zr == Z_MEM_ERROR)
            return stk_fail(err, STK_ENOMEM, "%s: out of memory", f->path);
        else if (zr == Z_BUF_ERROR && f->eof) /* input ended mid-member */
            return stk_fail(err, STK_EFORMAT, "%s: gzip data is truncated",
                            f->path);
        else if (zr != Z_OK && zr != Z_BUF_ERROR)
            return stk_fail(err, STK_EFORMAT, "%s: gzip data is corrupt (%s)",
                            f->path, f->zs.msg ? f->zs.msg : "bad data");
    }
    return 0;
}

int stk_zfile_read(stk_zfile *f, void *buf, size_t n, size_t *got,
                   stk_err *err)
{
    *got = 0;
    return f->gz ? zfile_read_gz(f, buf, n, got, err)
                 : zfile_read_raw(f, buf, n, got, err);
}

int stk_zfile_is_gzip(const stk_zfile *f) { return f->gz; }

uint64_t stk_zfile_disk_size(const stk_zfile *f) { return f->disk_size; }

void stk_zfile_close(stk_zfile *f)
{
    if (!f)
        return;
    if (f->gz)
        inflateEnd(&f->zs);
    if (f->fd >= 0)
        close(f->fd);
    free(f->path);
    free(f);
}

int stk_remove_flat_dir(const char *path, stk_err *err)
{
    DIR *d = opendir(path);
    if (!d) {
        if (errno == ENOENT)
            return 0;
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                        strerror(errno));
    }
    struct dirent *de;
    char p[4096];
    int rc = 0;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (stk_path_join(p, sizeof p, path, de->d_name) || unlink(p) != 0) {
            rc = stk_fail(err, STK_EIO, "%s: cannot remove: %s", p,
                          strerror(errno));
            break;
        }
    }
    closedir(d);
    if (!rc && rmdir(path) != 0)
        rc = stk_fail(err, stk_from_errno(errno), "%s: cannot remove: %s",
                      path, strerror(errno));
    return rc;
}

int stk_fsync_dir(const char *path, stk_err *err)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                        strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    if (rc != 0)
        return stk_fail(err, stk_from_errno(e), "%s: fsync failed: %s", path,
                        strerror(e));
    return 0;
}

double stk_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int stk_usable_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0)
        return CPU_COUNT(&set);
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? (int)n : 1;
}

static sigset_t int_term(void)
{
    sigset_t s;
    sigemptyset(&s);
    sigaddset(&s, SIGINT);
    sigaddset(&s, SIGTERM);
    return s;
}

static sigset_t stop_signals(void)
{
    sigset_t s = int_term();
    sigaddset(&s, SIGHUP);
    sigaddset(&s, SIGQUIT);
    return s;
}

void stk_thread_allow_stop_signals(void)
{
    sigset_t stop = stop_signals();
    pthread_sigmask(SIG_UNBLOCK, &stop, NULL);
}

static void *watch_main(void *arg)
{
    stk_stop_watch *w = arg;
    sigset_t s = int_term();
    for (;;) {
        int sig;
        if (sigwait(&s, &sig) == 0)
            w->on_stop(sig, w->arg);
    }
    return NULL;
}

int stk_stop_watch_start(stk_stop_watch *w)
{
    sigset_t s = int_term();
    pthread_t t;
    int e = pthread_sigmask(SIG_BLOCK, &s, NULL);
    if (!e)
        e = stk_thread_start(&t, watch_main, w, "stk-signals", -1);
    if (!e)
        pthread_detach(t); /* it waits until the process ends */
    return e;
}

int stk_thread_start(pthread_t *t, void *(*fn)(void *), void *arg,
                     const char *name, int index)
{
    sigset_t stop = stop_signals(), old;
    /* a new thread inherits its creator's mask: block, create, restore */
    pthread_sigmask(SIG_BLOCK, &stop, &old);
    int e = pthread_create(t, NULL, fn, arg);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e)
        return e;
    char full[32];
    if (index >= 0)
        snprintf(full, sizeof full, "%s %d", name, index);
    else
        snprintf(full, sizeof full, "%s", name);
    full[15] = '\0'; /* the kernel's limit */
    pthread_setname_np(*t, full); /* a name is a help, not a need */
    return 0;
}

int stk_path_join(char *out, size_t n, const char *dir, const char *name)
{
    size_t dl = strlen(dir);
    const char *sep = (dl && dir[dl - 1] == '/') ? "" : "/";
    int w = snprintf(out, n, "%s%s%s", dir, sep, name);
    return (w < 0 || (size_t)w >= n) ? STK_ERANGE : 0;
}

size_t stk_utf8_fit(const char *s, size_t n)
{
    size_t p = n; /* back over the continuation bytes at n to their lead */
    while (p > 0 && n - p < 3 && ((unsigned char)s[p] & 0xC0) == 0x80)
        p--;
    unsigned char lead = (unsigned char)s[p];
    size_t len = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2; /* its length */
    return p < n && lead >= 0xC0 && len > n - p ? p : n;
}

int stk_snprintf_text(char *buf, size_t cap, const char *fmt, ...)
{
    va_list ap, again;
    va_start(ap, fmt);
    va_copy(again, ap);
    int w = vsnprintf(buf, cap, fmt, ap);
    char *all = w >= 0 && cap && (size_t)w >= cap ? malloc((size_t)w + 1) : NULL;
    if (all) { /* the whole text says whether the cut splits a character */
        vsnprintf(all, (size_t)w + 1, fmt, again);
        buf[stk_utf8_fit(all, cap - 1)] = '\0';
        free(all);
    }
    va_end(again);
    va_end(ap);
    return w;
}

/* Under this a streamed copy does not pay: the head and tail are most of
 * it, and a few lines left in the cache cost the reader little. */
enum { STREAM_MIN = 256 };

void stk_copy_stream(void *dst, const void *src, size_t n)
{
#if defined(__SSE2__)
    if (n >= STREAM_MIN) {
        stk_san_wrote(dst, n); /* the sanitizers do not see movntdq */
        uint8_t *d = dst;
        const uint8_t *s = src;
        size_t head = (size_t)(-(uintptr_t)d & 15); /* to dst's alignment */
        memcpy(d, s, head);
        d += head, s += head, n -= head;
        /* a line (64 bytes) a round: the write-combining buffer fills
         * whole and goes out as one write */
        for (; n >= 64; d += 64, s += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)s);
            __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
            _mm_stream_si128((__m128i *)d, a);
            _mm_stream_si128((__m128i *)(d + 16), b);
            _mm_stream_si128((__m128i *)(d + 32), c);
            _mm_stream_si128((__m128i *)(d + 48), e);
        }
        for (; n >= 16; d += 16, s += 16, n -= 16)
            _mm_stream_si128((__m128i *)d,
                             _mm_loadu_si128((const __m128i *)s));
        memcpy(d, s, n); /* the tail */
        return;
    }
#endif
    memcpy(dst, src, n);
}

/* Which sanitizer instruments this file: GCC names them with macros,
 * clang with __has_feature. */
#if defined(__SANITIZE_THREAD__)
#define STK_SAN_THREAD 1
#elif defined(__SANITIZE_ADDRESS__)
#define STK_SAN_ADDRESS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define STK_SAN_THREAD 1
#elif __has_feature(address_sanitizer)
#define STK_SAN_ADDRESS 1
#endif
#endif

/* The runtimes' entry points that instrumented code calls (their stable
 * ABI, not in the public headers; declared as GCC's builtins are) */
#if defined(STK_SAN_THREAD)
void __tsan_read_range(void *addr, long size);
void __tsan_write_range(void *addr, long size);
#elif defined(STK_SAN_ADDRESS)
#include <sanitizer/asan_interface.h>
void __asan_report_load_n(void *addr, long size);
void __asan_report_store_n(void *addr, long size);
#endif

/* p[0..n) read (write 0) or written (1) by this thread by now */
static void san_access(void *p, size_t n, int write)
{
#if defined(STK_SAN_THREAD)
    (write ? __tsan_write_range : __tsan_read_range)(p, (long)n);
#elif defined(STK_SAN_ADDRESS)
    char *bad = __asan_region_is_poisoned(p, n);
    if (bad) /* reports from the first bad byte, and ends the process */
        (write ? __asan_report_store_n : __asan_report_load_n)(
            bad, (long)(n - (size_t)(bad - (char *)p)));
#else
    (void)p, (void)n, (void)write;
#endif
}

void stk_san_read(const void *p, size_t n) { san_access((void *)p, n, 0); }

void stk_san_wrote(void *p, size_t n) { san_access(p, n, 1); }

void stk_stream_fence(void)
{
#if defined(__SSE2__)
    /* non-temporal stores may pass later stores (a release of the buffer,
     * an unlock): sfence makes them visible first */
    _mm_sfence();
#endif
}
