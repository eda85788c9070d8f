/* Opening a name in a directory without crossing into a file system mounted
 * on it. Any user may mount a FUSE file system of their own on a file or
 * directory they own (fusermount), also at a name they know another user's
 * process will open or stat (the region directory's name in /dev/shm, an
 * oom_snapshot path in /tmp); its server need never answer, and the open or
 * stat then waits for ever (killable only). openat2's RESOLVE_NO_XDEV refuses
 * such a name with EXDEV before the mounted file system is asked anything.
 * Where openat2 is missing (Linux before 5.6) or filtered (a container's
 * seccomp profile), plain openat: what the code did before. Header-only: the
 * interposer and the reader library both use it. */
#ifndef NPA_NOMOUNT_H
#define NPA_NOMOUNT_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437 /* one number on every architecture (the common table of new system calls) */
#endif
#define NPA_RESOLVE_NO_XDEV 0x01

/* openat(dir_fd, name, flags, mode), or -1 with errno EXDEV when a file
 * system is mounted on name (or on the way to it). */
static inline int npa_openat_no_mount(int dir_fd, const char *name, int flags, mode_t mode)
{
    struct {
        uint64_t flags, mode, resolve;
    } how = {(uint64_t)(unsigned)flags, (flags & O_CREAT) ? (uint64_t)mode : 0, NPA_RESOLVE_NO_XDEV};
    long fd = syscall(SYS_openat2, dir_fd, name, &how, sizeof how);
    if (fd >= 0 || (errno != ENOSYS && errno != EPERM))
        return (int)fd;
    return openat(dir_fd, name, flags, mode);
}

/* fstatat(dir_fd, name, out, AT_SYMLINK_NOFOLLOW) that never asks a file
 * system mounted on name: -1 with errno EXDEV for such a name. */
static inline int npa_lstatat_no_mount(int dir_fd, const char *name, struct stat *out)
{
    int fd = npa_openat_no_mount(dir_fd, name, O_PATH | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int result = fstat(fd, out);
    int err = errno;
    close(fd);
    errno = err;
    return result;
}

#endif
