/* peers.c - what became of a peer rank's process on this machine: the
 * shared-memory collectives and NCCL both name a rank that died or was
 * stopped, instead of waiting out --timeout without saying who. */
#include "comm_impl.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* State letter and start time of pid from /proc/PID/stat ("pid (comm) S
 * ppid ..."; comm may hold spaces and parentheses, so the fields are counted
 * from the last ')'). Returns 0, or -1 when the file cannot be read. */
static int read_stat(int32_t pid, char *state, uint64_t *start)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    const char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ')
        return -1;
    *state = p[2];
    *start = 0;
    for (int field = 3; field <= 22 && (p = strchr(p + 1, ' ')); field++)
        ; /* p is at the space before field 22 */
    if (p)
        *start = strtoull(p + 1, NULL, 10);
    return 0;
}

peer_id peer_self(void)
{
    peer_id me = {(int32_t)getpid(), 0};
    char state;
    if (read_stat(me.pid, &state, &me.start))
        me.start = 0;
    return me;
}

/* Exited but not yet collected by its parent (Z, X) counts as gone; stopped
 * (T, t: SIGSTOP, a debugger) is told apart from running. */
peer_state peer_state_of(peer_id p)
{
    if (p.pid <= 0)
        return PEER_RUNNING; /* unknown: not ours to judge */
    if (kill(p.pid, 0) != 0 && errno == ESRCH)
        return PEER_GONE;
    char state;
    uint64_t start;
    if (read_stat(p.pid, &state, &start))
        return PEER_RUNNING; /* no /proc: trust kill */
    if (p.start && start && start != p.start)
        return PEER_GONE; /* the pid now names another process */
    switch (state) {
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
