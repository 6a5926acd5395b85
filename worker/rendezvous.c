/* rendezvous.c - how the ranks of a group learn each other's comm addresses without the
 * coordinator: a shared directory (--rendezvous-dir), one file per rank written atomically
 * (write a temporary file, fsync, rename), polled until every rank's file is there or the
 * deadline passes (the error names the ranks that never joined).  For single-host tests
 * and network-namespace "nodes" that share a file system; production groups rendezvous
 * through the coordinator's control session (ctl.c).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "file.h"
#include "worker.h"

#define PEER_ADDR_MAX (64 * 1024)

static uint64_t now_msec(void)
{
    return (uint64_t)clk_now_ms();
}

void worker_peers_done(struct worker_peers *p)
{
    if (!p)
        return;
    for (int i = 0; i < p->world_size && i < 256; i++)
        free(p->addr[i]);
    memset(p, 0, sizeof(*p));
}

static void rdv_path(char *buf, size_t n, const char *dir, const char *group, int rank)
{
    snprintf(buf, n, "%s/%s.rank-%d", dir, group, rank);
}

int worker_rendezvous_dir(const char *dir, const char *group, int rank, int world_size,
                          const void *addr, size_t len, int timeout_msec,
                          struct worker_peers *ret, struct err_buf *e)
{
    char path[4096], tmp[4200], missing[512];
    uint64_t deadline = now_msec() + (uint64_t)(timeout_msec > 0 ? timeout_msec : 0);
    int fd, i, n_missing;
    ssize_t w;

    memset(ret, 0, sizeof(*ret));
    ret->world_size = world_size;
    rdv_path(path, sizeof(path), dir, group, rank);
    snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0)
        return err_set(e, -errno, "rendezvous: cannot create %s: %s", tmp, strerror(errno));
    w = write(fd, addr, len);
    if (w != (ssize_t)len || fsync(fd) < 0) {
        close(fd);
        unlink(tmp);
        return err_set(e, -EIO, "rendezvous: cannot write %s", tmp);
    }
    close(fd);
    if (rename(tmp, path) < 0) {
        int r = -errno;

        unlink(tmp);
        return err_set(e, r, "rendezvous: cannot publish %s: %s", path, strerror(-r));
    }
    for (;;) {
        n_missing = 0;
        missing[0] = 0;
        for (i = 0; i < world_size; i++) {
            char *buf;
            int r;

            if (ret->addr[i])
                continue;
            rdv_path(path, sizeof(path), dir, group, i);
            r = file_read_all(path, PEER_ADDR_MAX, FILE_REGULAR | FILE_NOFOLLOW, &buf, &ret->len[i]);
            if (r == 0 && ret->len[i] == 0) {
                free(buf);
                r = -EMSGSIZE;      /* being written? the rename makes that impossible */
            }
            if (r == 0)
                ret->addr[i] = buf;
            if (r == -ENOENT) {
                size_t used = strlen(missing);

                n_missing++;
                snprintf(missing + used, sizeof(missing) - used, "%s%d", used ? ", " : "", i);
                continue;
            }
            if (r < 0) {
                worker_peers_done(ret);
                return err_set(e, -EBADMSG, "rendezvous: address of rank %d (%s): %s", i, path,
                               strerror(-r));
            }
        }
        if (!n_missing)
            return 0;
        if (now_msec() >= deadline) {
            worker_peers_done(ret);
            return err_set(e, -ETIMEDOUT, "rendezvous of group %s timed out after %d ms: "
                           "rank%s %s of %d never joined", group, timeout_msec,
                           n_missing > 1 ? "s" : "", missing, world_size);
        }
        usleep(10 * 1000);
    }
}

void worker_rendezvous_dir_clean(const char *dir, const char *group, int rank)
{
    char path[4096];

    rdv_path(path, sizeof(path), dir, group, rank);
    unlink(path);
}
