/* common.c - error table, file helpers and clock shared by all modules. */
#include "common.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

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

int stk_open_regular(const char *path, struct stat *st, stk_err *err)
{
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
     * writer for ever; on a regular file the flag changes nothing, and it
     * is cleared below so that reads behave as usual. */
    int fd;
    do
        fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return stk_fail(err, stk_from_errno(errno), "%s: %s", path,
                        strerror(errno));
    if (fstat(fd, st) != 0) {
        int e = errno;
        close(fd);
        return stk_fail(err, stk_from_errno(e), "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(st->st_mode)) {
        close(fd);
        return stk_fail(err, STK_EFORMAT, "%s: not a regular file (%s)", path,
                        S_ISDIR(st->st_mode)    ? "a directory"
                        : S_ISFIFO(st->st_mode) ? "a FIFO"
                        : S_ISSOCK(st->st_mode) ? "a socket"
                        : S_ISCHR(st->st_mode)  ? "a character device"
                        : S_ISBLK(st->st_mode)  ? "a block device"
                                                : "not a file");
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int e = errno;
        close(fd);
        return stk_fail(err, stk_from_errno(e), "%s: %s", path, strerror(e));
    }
    return fd;
}

FILE *stk_fopen_regular(const char *path, stk_err *err)
{
    struct stat st;
    int fd = stk_open_regular(path, &st, err);
    if (fd < 0)
        return NULL;
    FILE *f = fdopen(fd, "r");
    if (!f) {
        stk_fail(err, stk_from_errno(errno), "%s: %s", path, strerror(errno));
        close(fd);
    }
    return f;
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

/* Inflates a gzip member (or several, as gunzip does) into a growing buffer. */
static int gunzip(const char *path, const uint8_t *src, size_t n,
                  uint8_t **data, size_t *len, stk_err *err)
{
    size_t cap = n * 4 + 1024, used = 0;
    uint8_t *out = malloc(cap);
    if (!out)
        return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit2(&zs, 15 + 16) != Z_OK) {
        free(out);
        return stk_fail(err, STK_ENOMEM, "%s: zlib init failed", path);
    }
    zs.next_in = (Bytef *)src;
    int rc = Z_OK;
    size_t consumed = 0;
    for (;;) {
        if (used == cap) {
            uint8_t *bigger = realloc(out, cap * 2);
            if (!bigger) {
                rc = Z_MEM_ERROR;
                break;
            }
            out = bigger;
            cap *= 2;
        }
        size_t in_left = n - consumed;
        zs.avail_in = in_left > UINT32_MAX ? UINT32_MAX : (uInt)in_left;
        zs.next_in = (Bytef *)src + consumed;
        size_t out_left = cap - used;
        zs.avail_out = out_left > UINT32_MAX ? UINT32_MAX : (uInt)out_left;
        zs.next_out = out + used;
        uInt before_in = zs.avail_in, before_out = zs.avail_out;
        rc = inflate(&zs, Z_NO_FLUSH);
        consumed += before_in - zs.avail_in;
        used += before_out - zs.avail_out;
        if (rc == Z_STREAM_END) {
            if (consumed == n)
                break;
            inflateReset(&zs); /* concatenated members */
            rc = Z_OK;
            continue;
        }
        if (rc == Z_BUF_ERROR && consumed == n) /* input ended mid-stream */
            break;
        if (rc != Z_OK && rc != Z_BUF_ERROR)
            break;
    }
    inflateEnd(&zs);
    if (rc != Z_STREAM_END) {
        free(out);
        if (rc == Z_MEM_ERROR)
            return stk_fail(err, STK_ENOMEM, "%s: out of memory", path);
        return stk_fail(err, STK_EFORMAT,
                        "%s: gzip data is %s", path,
                        rc == Z_BUF_ERROR ? "truncated" : "corrupt");
    }
    *data = out;
    *len = used;
    return 0;
}

int stk_read_maybe_gz(const char *path, uint8_t **data, size_t *len,
                      stk_err *err)
{
    uint8_t *raw;
    size_t n;
    int rc = stk_read_file(path, &raw, &n, err);
    if (rc)
        return rc;
    if (n < 2 || raw[0] != 0x1f || raw[1] != 0x8b) {
        *data = raw;
        *len = n;
        return 0;
    }
    rc = gunzip(path, raw, n, data, len, err);
    free(raw);
    return rc;
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

int stk_path_join(char *out, size_t n, const char *dir, const char *name)
{
    size_t dl = strlen(dir);
    const char *sep = (dl && dir[dl - 1] == '/') ? "" : "/";
    int w = snprintf(out, n, "%s%s%s", dir, sep, name);
    return (w < 0 || (size_t)w >= n) ? STK_ERANGE : 0;
}
