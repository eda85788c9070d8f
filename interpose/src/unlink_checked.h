/* Removing a name in a region directory only while it is the very file that
 * was checked. The name can change hands at any moment: a process with the
 * same pid number (reused, or in another pid namespace sharing the
 * directory) renames its fresh region over a leftover, and an unlink by
 * name after the last look removed that live region instead, its process
 * running on unseen. There is no "unlink if this inode": the name is moved
 * aside to a name of this move's own (.npualloc.<pid>.reap.<8 hex>, never
 * replacing one) and what was moved is looked at: the checked inode is
 * unlinked, anything else goes back (never over what took the name
 * meanwhile). A process killed in between leaves the aside name, which
 * the next process's reaper (reap.c) or `npualloc ls` removes once that
 * pid is gone (a live region there stays, locked: `ls` puts it back); the
 * suffix keeps such a leftover from blocking every later move of a process
 * given that pid (a fixed .npualloc.<pid>.reap did, for its whole life). Header-only: the
 * interposer and the reader library both use it. */
#ifndef NPA_UNLINK_CHECKED_H
#define NPA_UNLINK_CHECKED_H

#include "nomount.h"
#include "random_suffix.h"

#include <errno.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

/* Aside names tried before giving up: each fails only when something
 * already sits at its name. */
#define NPA_ASIDE_TRIES 4

/* 0 when name, still the file (dev, ino), was removed; -1 otherwise. A
 * directory (one the user put at a leftover's name) is never moved:
 * unlinkat refused it at the aside name, where it stayed, under a new name
 * at each try. */
static inline int npa_unlink_checked(int dir_fd, const char *name, dev_t dev, ino_t ino)
{
    struct stat seen;
    if (npa_lstatat_no_mount(dir_fd, name, &seen) != 0 || seen.st_dev != dev || seen.st_ino != ino ||
        S_ISDIR(seen.st_mode))
        return -1; /* it changed hands during the checks, or cannot be unlinked */
    char aside[48];
    int moved = -1;
    for (int try = 0; moved != 0 && try < NPA_ASIDE_TRIES; try++) {
        char suffix[9];
        npa_random_suffix(suffix);
        snprintf(aside, sizeof aside, ".npualloc.%d.reap.%s", (int)getpid(), suffix);
        moved = renameat2(dir_fd, name, dir_fd, aside, RENAME_NOREPLACE);
        if (moved != 0 && errno != EEXIST)
            break;
    }
    if (moved != 0)
        /* A file system without it (EINVAL: NFS; ENOSYS: Linux before
         * 3.15): by name, as before, rather than never. */
        return errno == EINVAL || errno == ENOSYS ? unlinkat(dir_fd, name, 0) : -1;
    if (npa_lstatat_no_mount(dir_fd, aside, &seen) == 0 && seen.st_dev == dev && seen.st_ino == ino)
        return unlinkat(dir_fd, aside, 0);
    (void)renameat2(dir_fd, aside, dir_fd, name, RENAME_NOREPLACE);
    return -1;
}

#endif
