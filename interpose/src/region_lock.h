/* Whether the process of a region file still lives, as the kernel tells it.
 * A process holds its region file open for life with an open file
 * description lock (F_OFD_SETLK) over it, which the kernel drops with the
 * last descriptor of that description: at the end of the process, however it
 * ends (exit, os._exit, a crash, SIGKILL). Anyone who can open the file can
 * ask, whichever pid namespace each side is in, where a pid names a process
 * of its own namespace only: the region npualloc.1 of a container's first
 * process names init on the host. Independent of the requesters' flock on
 * the same file (Linux keeps the two kinds apart, NFS aside). Header-only:
 * the interposer and the reader library both use it. */
#ifndef NPA_REGION_LOCK_H
#define NPA_REGION_LOCK_H

#include <fcntl.h>

/* A shared lock over the whole file, on fd's open file description; 0 when
 * taken (-1 with errno: a kernel before 3.15, a file system without locks). */
static inline int npa_region_lock(int fd)
{
    struct flock lock = {.l_type = F_RDLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    return fcntl(fd, F_OFD_SETLK, &lock);
}

/* 1 when some process holds a lock on the file fd is open on (its region's
 * process, alive), 0 when none does, -1 when the kernel cannot tell. A
 * query, which takes nothing: fd may be read-only. */
static inline int npa_region_locked(int fd)
{
    struct flock lock = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = 0, .l_len = 0};
    if (fcntl(fd, F_OFD_GETLK, &lock) != 0)
        return -1;
    return lock.l_type != F_UNLCK;
}

#endif
