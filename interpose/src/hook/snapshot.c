/* Memory snapshots written to files: on an OOM (oom_snapshot:PATH) and for
 * another process's `npualloc snapshot <pid>` (region.c names the file). The
 * content is torch's _snapshot() dict as a pickle (core/snapshot_pickle.c),
 * so the file is what torch.cuda.memory._dump_snapshot would have written.
 * Never called with a device lock held: building the snapshot takes them. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "hook.h"
#include "region/region.h"

/* Written under a temporary name and renamed into place, so a reader sees a
 * whole file or none; O_EXCL|O_NOFOLLOW so a planted file or link is never
 * written through. */
static int write_whole(const char *path, const void *data, size_t size)
{
    char tmp[4096];
    if ((size_t)snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid()) >= sizeof(tmp))
        return ENAMETOOLONG;
    int fd = npa_create_private_file(tmp, O_WRONLY);
    if (fd < 0)
        return errno;
    int err = 0;
    for (const char *p = data; size > 0 && err == 0;) {
        ssize_t n = write(fd, p, size);
        if (n > 0) {
            p += n;
            size -= (size_t)n;
        } else if (n < 0 && errno != EINTR) {
            err = errno;
        }
    }
    if (close(fd) != 0 && err == 0)
        err = errno;
    if (err == 0 && rename(tmp, path) != 0)
        err = errno;
    if (err != 0)
        unlink(tmp);
    return err;
}

int npa_snapshot_write(npa_allocator *a, const char *path)
{
    size_t size = 0;
    void *data = npa_snapshot_pickle(a, npa_hook_config(), &size);
    if (data == NULL)
        return ENOMEM;
    int err = write_whole(path, data, size);
    free(data);
    return err;
}

void npa_oom_snapshot(npa_allocator *a)
{
    const char *path = npa_get_config(a)->oom_snapshot;
    if (path[0] == '\0')
        return;
    int err = npa_snapshot_write(a, path);
    if (err != 0)
        npa_warn_once("oom_snapshot: cannot write %s: %s", path, strerror(err));
    else
        npa_warn_once("out of memory: snapshot written to %s (python -m npualloc plot %s -o oom.png)", path, path);
}
