/* Memory snapshots written to files: on an OOM (oom_snapshot:PATH) and for
 * another process's `npualloc snapshot <pid>` (region.c names the file). The
 * content is torch's _snapshot() dict as a pickle (core/snapshot_pickle.c),
 * so the file is what torch.cuda.memory._dump_snapshot would have written.
 * Never called with a device lock held: building the snapshot takes them. */
#define _GNU_SOURCE /* renameat2 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hook.h"
#include "mount_maker.h"
#include "nomount.h"
#include "random_suffix.h"

/* A FIFO whose reader has not taken the whole snapshot after this long is
 * given up. In all, not without progress: a reader that takes a page now and
 * then (another user's, at a name the user chose in /tmp) kept an OOM'ing
 * allocation waiting 40 s for a 712 KB snapshot, and would have for minutes. */
#define WRITE_LIMIT_S 5
#define WRITE_LIMIT_MS (WRITE_LIMIT_S * 1000)
#define STRINGIFY(x) #x
#define AS_TEXT(x) STRINGIFY(x)

static int64_t monotonic_ms(void)
{
    struct timespec now = {0};
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

static int write_all(int fd, const char *p, size_t size)
{
    int64_t deadline = monotonic_ms() + WRITE_LIMIT_MS;
    while (size > 0) {
        ssize_t n = write(fd, p, size);
        if (n > 0) {
            p += n;
            size -= (size_t)n;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int64_t left = deadline - monotonic_ms();
            struct pollfd ready = {.fd = fd, .events = POLLOUT};
            if (left <= 0 || poll(&ready, 1, (int)left) == 0)
                return ETIMEDOUT;
        } else if (n < 0 && errno != EINTR) {
            return errno;
        }
    }
    return 0;
}

/* A snapshot write's errors of its own, outside errno's range: a
 * directory on the path is a symbolic link; the name leaves no room for the
 * temporary's suffix; every temporary name tried was taken; a directory on
 * the path has a mount on it that may be another user's. */
#define LINK_ON_THE_PATH 4096
#define NO_ROOM_FOR_TEMPORARY 4097
#define TEMPORARIES_TAKEN 4098
#define FOREIGN_MOUNT_ON_THE_PATH 4099

/* Opens the directory component in dir_fd, never through a link; a mount
 * on it is entered only when it is not another user's
 * (npa_mount_is_another_users). Any user may mount a FUSE file system of
 * theirs whose server never answers on a directory they may write, and
 * fusermount asks write access to that directory alone, not to the one
 * holding it (a 0777 directory inside root's 0755 one will do): the next
 * lookup in it, of the snapshot's name, waited for ever. So every mount met
 * is judged, wherever it is; that costs two procfs reads. The O_PATH open
 * lands on the mount's root without asking its file system anything, and
 * the mount judged is the very one landed on. ".." is never refused: it
 * climbs out of a mount. It lands on one only where a mount was stacked on
 * the directory above after the walk passed it, or above a working
 * directory inside another user's directory ("../x"); that is not guarded,
 * since either EXDEV looks the same. */
static int open_component(int dir_fd, const char *component, int *fd)
{
    const int flags = O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC;
    *fd = npa_openat_no_mount(dir_fd, component, flags, 0);
    if (*fd < 0 && errno == EXDEV) {
        *fd = openat(dir_fd, component, flags);
        if (*fd >= 0 && strcmp(component, "..") != 0 && npa_mount_is_another_users(*fd)) {
            close(*fd);
            return FOREIGN_MOUNT_ON_THE_PATH;
        }
    }
    return *fd >= 0 ? 0 : errno;
}

/* Opens the directory that holds path's last component (*name), never
 * through a link: each component is opened O_NOFOLLOW (open_component), so a
 * directory that another user replaced by a link (to one only root may
 * write, say) is refused rather than written into. */
static int open_parent(const char *path, const char **name, int *dir_fd)
{
    const char *slash = strrchr(path, '/');
    *name = slash ? slash + 1 : path;
    if (**name == '\0')
        return EISDIR;
    int fd = open(path[0] == '/' ? "/" : ".", O_PATH | O_DIRECTORY | O_CLOEXEC);
    for (const char *p = path; fd >= 0 && slash && p < slash;) {
        const char *end = memchr(p, '/', (size_t)(slash - p) + 1);
        char component[NAME_MAX + 1];
        size_t length = (size_t)(end - p);
        if (length > NAME_MAX) {
            close(fd);
            return ENAMETOOLONG;
        }
        memcpy(component, p, length);
        component[length] = '\0';
        p = end + 1;
        if (length == 0)
            continue; /* "//" or the leading "/" */
        int next;
        int err = open_component(fd, component, &next);
        if (err != 0) {
            struct stat seen;
            if (err == ENOTDIR && npa_lstatat_no_mount(fd, component, &seen) == 0 && S_ISLNK(seen.st_mode))
                err = LINK_ON_THE_PATH;
            close(fd);
            return err;
        }
        close(fd);
        fd = next;
    }
    if (fd < 0)
        return errno;
    *dir_fd = fd;
    return 0;
}

/* Places the temporary file at name: replacing only when name held our own
 * regular file (checked by the caller), never replacing anything else. */
static int place(int dir_fd, const char *tmp, const char *name, bool replace)
{
    if (replace)
        return renameat(dir_fd, tmp, dir_fd, name) == 0 ? 0 : errno;
    if (renameat2(dir_fd, tmp, dir_fd, name, RENAME_NOREPLACE) == 0)
        return 0;
    if (errno != EINVAL && errno != ENOSYS)
        return errno;
    /* A file system without RENAME_NOREPLACE: link() never replaces either. */
    if (linkat(dir_fd, tmp, dir_fd, name, 0) != 0)
        return errno;
    unlinkat(dir_fd, tmp, 0);
    return 0;
}

/* Tries at a new random name before giving up: each fails only when
 * something already sits at its name. */
#define TEMPORARY_TRIES 16

/* Creates "<name>.tmp.<pid>.<random>" (O_EXCL|O_NOFOLLOW, 0600) into *fd;
 * 0 or the error. Random, as anyone sees our pid: a directory another user
 * put at the predictable "<name>.tmp.<pid>" in /tmp kept every snapshot from
 * being written, and what is at a name we did not create is never removed. */
static int create_temporary(int dir_fd, const char *name, char tmp[NAME_MAX + 1], int *fd)
{
    for (int try = 0; try < TEMPORARY_TRIES; try++) {
        char suffix[9];
        npa_random_suffix(suffix);
        if ((size_t)snprintf(tmp, NAME_MAX + 1, "%s.tmp.%d.%s", name, (int)getpid(), suffix) > NAME_MAX)
            return NO_ROOM_FOR_TEMPORARY;
        *fd = openat(dir_fd, tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        if (*fd >= 0)
            return 0;
        if (errno != EEXIST)
            return errno;
    }
    return TEMPORARIES_TAKEN;
}

/* A new file under a temporary name moved into place, so a reader sees a
 * whole file or none. */
static int write_new(int dir_fd, const char *name, const void *data, size_t size, bool replace)
{
    char tmp[NAME_MAX + 1];
    int fd;
    int err = create_temporary(dir_fd, name, tmp, &fd);
    if (err != 0)
        return err;
    err = write_all(fd, data, size);
    if (close(fd) != 0 && err == 0)
        err = errno;
    if (err == 0)
        err = place(dir_fd, tmp, name, replace);
    if (err != 0)
        unlinkat(dir_fd, tmp, 0);
    return err;
}

/* What torch does with such a path: open it and write. Non-blocking, so a
 * FIFO without a reader is ENXIO rather than a hang, and the descriptor must
 * be the very file fstatat saw (not something swapped in meanwhile). A
 * device's ENXIO is no reader's: nothing is behind it, as behind the
 * whiteout (0:0) any user may make in /tmp. */
static int write_into(int dir_fd, const char *name, const struct stat *seen, const void *data, size_t size)
{
    int fd = npa_openat_no_mount(dir_fd, name, O_WRONLY | O_NONBLOCK | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC, 0);
    if (fd < 0)
        return errno == ENXIO && S_ISCHR(seen->st_mode) ? ENODEV : errno;
    struct stat opened;
    int err = fstat(fd, &opened) != 0 ? errno
              : opened.st_dev != seen->st_dev || opened.st_ino != seen->st_ino ? EEXIST
              : write_all(fd, data, size);
    close(fd);
    return err;
}

/* Where a snapshot goes, without ever destroying what is at the name:
 * nothing there: a new file; our own regular file: replaced by a new one;
 * our own FIFO or a character device (/dev/null): written to, as torch
 * would; anything else (a link, another user's file or FIFO, which anyone
 * may plant in /tmp to read the snapshot, a directory, a block device, a
 * socket, a mount point): refused, left as it is. Every step is taken in
 * the directory open_parent opened, so nothing on the way is a link. */
static int write_snapshot_in(int dir_fd, const char *name, const void *data, size_t size)
{
    struct stat seen;
    /* Never a stat through a file system mounted on the name (EXDEV): anyone
     * may mount a FUSE one on a file of theirs in /tmp, and its server need
     * never answer; the OOM'ing allocation waited for ever (an audit on 2026-11-26). */
    if (npa_lstatat_no_mount(dir_fd, name, &seen) != 0)
        return errno == ENOENT ? write_new(dir_fd, name, data, size, false) : errno;
    if (S_ISLNK(seen.st_mode))
        return ELOOP;
    if ((S_ISFIFO(seen.st_mode) || S_ISREG(seen.st_mode)) && seen.st_uid != geteuid())
        return EPERM;
    if (S_ISFIFO(seen.st_mode) || S_ISCHR(seen.st_mode))
        return write_into(dir_fd, name, &seen, data, size);
    if (!S_ISREG(seen.st_mode))
        return S_ISDIR(seen.st_mode) ? EISDIR : EINVAL;
    return write_new(dir_fd, name, data, size, true);
}

const char *npa_snapshot_strerror(int err)
{
    switch (err) {
    case ELOOP: return "it is a symbolic link (never followed; left as it is)";
    case LINK_ON_THE_PATH: return "a directory on its path is a symbolic link (never followed; nothing written)";
    case NO_ROOM_FOR_TEMPORARY:
        return "its name leaves no room for the temporary's suffix .tmp.<pid>.<8 hex digits> (nothing written)";
    case TEMPORARIES_TAKEN: return "every temporary name tried beside it was taken (left as they are; nothing written)";
    case FOREIGN_MOUNT_ON_THE_PATH:
        return "a directory on its path has a file system mounted on it that may be another user's (never "
               "entered; nothing written)";
    case EPERM: return "it belongs to another user (left as it is)";
    case EINVAL: return "not a regular file, FIFO or character device (left as it is)";
    case ENXIO: return "a FIFO with no reader (nothing written)";
    case ETIMEDOUT:
        return "the FIFO's reader did not take it within " AS_TEXT(WRITE_LIMIT_S) " s (snapshot incomplete)";
    case EEXIST: return "another file appeared at the name meanwhile (left as it is)";
    case EXDEV: return "a file system is mounted on it (never entered; left as it is)";
    default: return strerror(err);
    }
}

int npa_snapshot_write_at(npa_allocator *a, int dir_fd, const char *name)
{
    size_t size = 0;
    void *data = npa_snapshot_pickle(a, npa_hook_config(), &size);
    if (data == NULL)
        return ENOMEM;
    int err = write_snapshot_in(dir_fd, name, data, size);
    free(data);
    return err;
}

/* npa_snapshot_write_at for a path, refused when a directory on the way is
 * a link or has a mount on it that may be another user's (open_parent). */
static int write_to_path(npa_allocator *a, const char *path)
{
    const char *name;
    int dir_fd;
    int err = open_parent(path, &name, &dir_fd);
    if (err != 0)
        return err;
    err = npa_snapshot_write_at(a, dir_fd, name);
    close(dir_fd);
    return err;
}

void npa_oom_snapshot(npa_allocator *a)
{
    const char *path = npa_get_config(a)->oom_snapshot;
    if (path[0] == '\0')
        return;
    int err = write_to_path(a, path);
    if (err != 0)
        npa_warn_once("oom_snapshot: cannot write %s: %s", path, npa_snapshot_strerror(err));
    else
        npa_warn_once("out of memory: snapshot written to %s (python -m npualloc plot %s -o oom.png)", path, path);
}
