/* peers.c - what became of a peer rank's process on this machine: the
 * shared-memory collectives and NCCL both name a rank that died or was
 * stopped, instead of waiting out --timeout without saying who. */
#include "comm_impl.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* From /proc/PID/stat ("pid (comm) S ..."): exited but not yet collected
 * by its parent (Z, X) counts as gone; stopped (T, t: SIGSTOP, a
 * debugger) is told apart from running. */
peer_state peer_state_of(int32_t pid)
{
    if (pid <= 0)
        return PEER_RUNNING; /* unknown: not ours to judge */
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return PEER_GONE;
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return PEER_RUNNING; /* no /proc: trust kill */
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *end = strrchr(buf, ')');
    if (!end || end[1] != ' ')
        return PEER_RUNNING;
    switch (end[2]) {
    case 'Z':
    case 'X':
        return PEER_GONE;
    case 'T':
    case 't':
        return PEER_STOPPED;
    default:
        return PEER_RUNNING;
    }
}

void machine_id(char *out, size_t n)
{
    char host[256] = "", boot[64] = "";
    gethostname(host, sizeof host - 1);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f))
            boot[0] = '\0';
        fclose(f);
        boot[strcspn(boot, "\n")] = '\0';
    }
    /* ranks in other pid namespaces (containers sharing the host's name)
     * cannot see each other's processes */
    char ns[64] = "";
    ssize_t len = readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
    ns[len > 0 ? len : 0] = '\0';
    snprintf(out, n, "%s %s %s", host, boot, ns);
}
