/* common.h - what every stoke module shares: error codes, the error record
 * that carries a one-line message naming the file, key or flag, and a few
 * file-system and time helpers that several modules need.
 *
 * Fallible calls return 0 or a negative STK_E* code and, when the caller
 * passes a non-NULL stk_err, fill it with the code and a message. Library code
 * never prints and never exits; a tool's main decides what to do. */
#ifndef STK_COMMON_H
#define STK_COMMON_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One table for every error code: name, value, default text. */
#define STK_ERRNO_MAP(X)                                                       \
    X(EINVAL, -1, "invalid argument")                                          \
    X(ENOMEM, -2, "out of memory")                                             \
    X(EIO, -3, "input/output error")                                           \
    X(ENOENT, -4, "no such file or directory")                                 \
    X(EEXIST, -5, "already exists")                                            \
    X(EFORMAT, -6, "malformed input")                                          \
    X(ESTORE, -7, "database error")                                            \
    X(EINCOMPLETE, -8, "database is incomplete")                               \
    X(ENOSPACE, -9, "no space left")                                           \
    X(ECANCELED, -10, "canceled")                                              \
    X(ENODEV, -11, "no such device")                                           \
    X(ERANGE, -12, "out of range")                                             \
    X(EUNSUPPORTED, -13, "not supported")                                      \
    X(ETIMEDOUT, -14, "timed out")                                             \
    X(EPEER, -15, "a peer process failed")

enum {
#define STK_ERR_ENUM(name, val, text) STK_##name = val,
    STK_ERRNO_MAP(STK_ERR_ENUM)
#undef STK_ERR_ENUM
};

/* Caller-owned error record; msg always NUL-terminated. */
typedef struct stk_err {
    int code;
    char msg[512];
} stk_err;

/* Short text for a code ("database is incomplete"); never NULL. */
const char *stk_strerror(int code);
/* Symbolic name for a code ("STK_EINCOMPLETE"); never NULL. */
const char *stk_err_name(int code);

/* Fills err (when non-NULL) with code and a printf-style message; returns
 * code so that callers can write `return stk_fail(err, STK_EIO, ...)`. */
int stk_fail(stk_err *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Maps an errno value to the closest STK_E* code. */
int stk_from_errno(int e);

/* Opens path read-only when it is a regular file, filling *st, and returns
 * the descriptor (close-on-exec). Anything else (a FIFO, a device, a socket,
 * a directory) is refused with "PATH: not a regular file (a FIFO)" before it
 * can block, so no caller waits for ever on a FIFO named like a data file.
 * Returns a negative STK_E* code on failure. */
struct stat;
int stk_open_regular(const char *path, struct stat *st, stk_err *err);

/* The same as a stdio stream opened for reading ("r"); NULL on failure. */
FILE *stk_fopen_regular(const char *path, stk_err *err);

/* Opens path for writing with open(2)'s flags (O_WRONLY or O_RDWR, with
 * O_CREAT, O_APPEND, O_TRUNC as wanted; created 0666 less the umask) and
 * returns the descriptor (close-on-exec), never blocking: an existing path
 * that is not a regular file (a FIFO, a device, a socket, a directory) is
 * refused with "PATH: not a regular file (a FIFO)" before anything is
 * written to it, so no tool waits for ever on a FIFO named as its output
 * (and a regular file is truncated only once it is known to be one).
 * Returns a negative STK_E* code on failure. */
int stk_open_output(const char *path, int flags, stk_err *err);

/* The same as a stdio stream opened with "w" (created or truncated); NULL
 * on failure. */
FILE *stk_fopen_output(const char *path, stk_err *err);

/* Reads a whole regular file into a malloc'd buffer (caller frees). */
int stk_read_file(const char *path, uint8_t **data, size_t *len, stk_err *err);

/* A regular file read front to back, inflated on the fly when it starts
 * with the gzip magic (concatenated members read as one, as gunzip does).
 * It holds a 64 KiB input buffer and zlib's state, whatever the file
 * inflates to: the caller decides how much to read, so a small file that
 * inflates to gigabytes (a gzip bomb) costs only what the caller asks for. */
typedef struct stk_zfile stk_zfile;

/* Opens path (see stk_open_regular). On failure *out is NULL. */
int stk_zfile_open(const char *path, stk_zfile **out, stk_err *err);

/* Reads up to n bytes of content into buf; *got < n only at its end.
 * Damaged gzip data fails with "PATH: gzip data is truncated" or
 * "PATH: gzip data is corrupt (zlib's reason)". */
int stk_zfile_read(stk_zfile *f, void *buf, size_t n, size_t *got,
                   stk_err *err);

/* 1 when the file is gzip, else 0. */
int stk_zfile_is_gzip(const stk_zfile *f);

/* The file's size on disk (compressed size for gzip). */
uint64_t stk_zfile_disk_size(const stk_zfile *f);

void stk_zfile_close(stk_zfile *f); /* NULL is a no-op */

/* Removes a directory that holds only plain files (no recursion into
 * subdirectories); a missing directory is not an error. */
int stk_remove_flat_dir(const char *path, stk_err *err);

/* fsyncs a directory so that a rename inside it is durable. */
int stk_fsync_dir(const char *path, stk_err *err);

/* Monotonic clock in seconds. */
double stk_now(void);

/* The CPUs this process may run on (its affinity mask; 1 at least). */
int stk_usable_cpus(void);

/* Starts fn(arg) on a new thread named name, or "name index" where index
 * >= 0 (cut to 15 characters: what top -H, gdb and /proc/PID/task/TID/comm
 * show, and what the Python tests count), with SIGINT, SIGTERM, SIGHUP and
 * SIGQUIT blocked in it: the kernel hands those to a thread that expects
 * them (train's main thread, prep's stk-signals; under TSan a signal a
 * prep worker took as it was about to exit was lost). The mask is
 * inherited by what the thread starts, and by the programs it runs: a
 * thread that runs a user's code unblocks them. The caller's own mask is
 * left as it was. Returns 0 or pthread_create's error number. */
int stk_thread_start(pthread_t *t, void *(*fn)(void *), void *arg,
                     const char *name, int index);

/* Unblocks, in the calling thread, the stop signals stk_thread_start
 * blocked: for a thread that runs a user's code. */
void stk_thread_allow_stop_signals(void);

/* A program's Ctrl-C and SIGTERM, taken by a thread of their own: see
 * stk_stop_watch_start. */
typedef struct stk_stop_watch {
    void (*on_stop)(int sig, void *arg); /* runs on the watching thread */
    void *arg;
} stk_stop_watch;

/* Blocks SIGINT and SIGTERM in the calling thread (and so in every thread
 * it starts later) and starts a thread, "stk-signals", that waits for
 * them (sigwait) and calls w->on_stop for each. No handler runs
 * asynchronously: a signal that comes while every thread blocks it waits
 * in the kernel for the watcher (under TSan, a handler's deferred run was
 * lost in 2 of 40 prep runs). For a program's main thread, before it
 * starts others, in a process with no thread yet: one a library started
 * as it loaded would take them with no handler, and die (OpenBLAS starts
 * its pool so, which is why train keeps a handler; prep links none). w
 * must outlive the process (a static). Returns 0 or an errno value. */
int stk_stop_watch_start(stk_stop_watch *w);

/* One step of a spin-wait: a pause that lets the core's other hardware
 * thread run and tells the CPU the loop is a wait. */
static inline void stk_cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Copies n bytes from src to dst (not overlapping) as memcpy does, but
 * with non-temporal (streaming) stores where that pays: the 16-byte-aligned
 * middle of dst on x86 (movntdq), the unaligned head and tail and copies
 * under 256 bytes with memcpy; a plain memcpy elsewhere. The written lines
 * go to memory, not into this core's cache: for buffers a device's copy
 * engine reads next, which reads lines still dirty in a CPU's cache more
 * slowly (docs/loader.md). The stores are weakly ordered: call
 * stk_stream_fence before publishing dst to another thread or device. */
void stk_copy_stream(void *dst, const void *src, size_t n);

/* Orders this thread's earlier stk_copy_stream stores before its later
 * stores (sfence on x86; nothing where stk_copy_stream is a memcpy). */
void stk_stream_fence(void);

/* Tell the sanitizers of this build that the calling thread has, by now,
 * read (or written) p[0..n): for accesses they cannot see. Those are the
 * non-temporal stores of stk_copy_stream, and, in a ThreadSanitizer build,
 * every access of the CPU kernels (kernels/cpu.c and cpu_gemm.c, left
 * uninstrumented there: kernels/CMakeLists.txt says why) where their
 * memory passes between threads. ASan checks the range is addressable;
 * TSan records the access, so a conflicting one on another thread without
 * a happens-before edge is a race. Nothing in a build without them. */
void stk_san_read(const void *p, size_t n);
void stk_san_wrote(void *p, size_t n);

/* Joins dir and name into out (size n); returns STK_ERANGE when too long. */
int stk_path_join(char *out, size_t n, const char *dir, const char *name);

/* The length of s[0, n) less a UTF-8 character that a cut at n splits
 * (s[n] one of its continuation bytes), so that a name shortened for a
 * message stays valid text; bytes that are not UTF-8 are cut where asked.
 * n is at most strlen(s). */
size_t stk_utf8_fit(const char *s, size_t n);

/* snprintf that, where it must cut, cuts before a UTF-8 character rather
 * than through it. Returns what snprintf returns. */
int stk_snprintf_text(char *buf, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Version string of the stoke tools. */
#define STK_VERSION "0.1.0"

#ifdef __cplusplus
}
#endif

#endif
