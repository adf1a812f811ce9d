/* fork_ranks.h - rank processes of one machine around a rendezvous store,
 * for the tests and the benchmark of the collectives. */
#ifndef STK_FORK_RANKS_H
#define STK_FORK_RANKS_H

#include "distributed/distributed.h"

#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

typedef int (*stk_rank_fn)(int rank, int world, int port, void *arg);

/* Forks `world` processes that exit with fn(rank, world, port, arg), serves
 * their store, and waits for them: status[r] is rank r's wait status (-1:
 * not started). The ranks are forked before the store's server thread
 * starts and read its port from a pipe: a child forked while that thread
 * holds a lock (malloc's, TSan's allocator's) would wait on it for ever.
 * 0, or -1 when the store or a process could not start. */
static inline int stk_fork_ranks(int world, stk_rank_fn fn, void *arg, int *status)
{
    enum { MOST = 64, NO_PORT = 120 };
    pid_t pid[MOST];
    int fd[2];
    if (world < 1 || world > MOST || pipe(fd))
        return -1;
    fflush(NULL);
    for (int r = 0; r < world; r++)
        if ((pid[r] = fork()) == 0) {
            int port = -1;
            close(fd[1]);
            if (read(fd[0], &port, sizeof port) != sizeof port || port <= 0)
                _exit(NO_PORT);
            _exit(fn(r, world, port, arg));
        }
    close(fd[0]);
    stk_err err;
    stk_store_server *srv = NULL;
    int port = -1;
    if (stk_store_server_start("127.0.0.1", 0, &port, &srv, &err))
        fprintf(stderr, "stk_fork_ranks: %s\n", err.msg);
    for (int r = 0; r < world; r++) /* -1 when there is no store */
        if (write(fd[1], &port, sizeof port) != sizeof port)
            break;
    close(fd[1]);
    int bad = !srv;
    for (int r = 0; r < world; r++)
        if (pid[r] < 0 || waitpid(pid[r], &status[r], 0) < 0) {
            status[r] = -1;
            bad = 1;
        }
    stk_store_server_stop(srv);
    return bad ? -1 : 0;
}

#endif
