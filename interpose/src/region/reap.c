/* The regions of this user's processes that ended without removing theirs.
 * A process that leaves through os._exit (as multiprocessing's and other
 * forked workers end), a crash or SIGKILL skips atexit, and its file stayed in
 * the region directory until someone ran `npualloc ls`: a job forking many
 * such children filled /dev/shm with them. Each process looks when it creates
 * its region and again at its exit: the next process of the user removes
 * them, and so does a parent that outlives such children.
 *
 * The directory is ours alone (0700, region_dir.c), yet what is in it is
 * taken for foreign: a name goes only when it is a regular file of our euid,
 * opened without following a link or waiting on a FIFO, a region of this
 * layout whose process is gone twice over: its lock is free (region_lock.h:
 * it lives in no pid namespace) and its pid names no process here, a zombie,
 * or one started at another time (a region whose lock could not be taken
 * goes by the pid alone, as `ls` removes it). What is unlinked is that inode
 * (unlink_checked.h): a process that reused the pid may have renamed its
 * fresh region over it. */
#define _GNU_SOURCE
#include "region/region.h"
#include "nomount.h"
#include "region_lock.h"
#include "unlink_checked.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The pid a region's name gives, npualloc.<pid> as the kernel writes pids
 * (no leading zero, no sign), or 0 for any other name. */
static pid_t region_pid(const char *name)
{
    static const char prefix[] = "npualloc.";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0)
        return 0;
    const char *digits = name + sizeof prefix - 1;
    if (*digits < '1' || *digits > '9')
        return 0;
    char *end;
    errno = 0;
    long pid = strtol(digits, &end, 10);
    return *end == '\0' && errno == 0 && pid <= INT32_MAX ? (pid_t)pid : 0;
}

/* Whether the process that wrote h has ended, as its pid tells here: no such
 * process, or one /proc keeps from us (another user's: ours are readable),
 * a zombie, or one started at another time. Unknown (unreadable) is alive. */
static bool ended(const npualloc_region_header *h)
{
    uint64_t start_time;
    char state;
    int err = npa_process_start_time(h->pid, &start_time, &state);
    if (err == ENOENT || err == ESRCH || err == EACCES)
        return true;
    return err == 0 && (state == 'Z' || state == 'X' || (h->start_time != 0 && start_time != h->start_time));
}

static void reap_one(int dir_fd, const char *name, pid_t pid)
{
    int fd = npa_openat_no_mount(dir_fd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0)
        return;
    struct stat opened;
    npualloc_region_header h;
    bool gone = fstat(fd, &opened) == 0 && S_ISREG(opened.st_mode) && opened.st_uid == geteuid() &&
                opened.st_size == (off_t)sizeof(npualloc_region) && npa_region_locked(fd) == 0 &&
                pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h && h.magic == NPUALLOC_SHM_MAGIC &&
                h.version == NPUALLOC_SHM_VERSION && h.pid == pid && ended(&h);
    close(fd);
    if (gone)
        (void)npa_unlink_checked(dir_fd, name, opened.st_dev, opened.st_ino);
}

/* What getdents64 writes, one entry after another (the kernel's struct). */
typedef struct dir_entry {
    uint64_t ino;
    int64_t next_offset;
    unsigned short length;
    unsigned char type;
    char name[];
} dir_entry;

void npa_region_reap(int dir_fd)
{
    /* Its own description: reading moves the offset, shared by a dup. Read
     * with getdents64 into the stack, not readdir, whose DIR opendir
     * mallocs: this runs at exit, also in an exit() called by a signal
     * handler on a thread the signal caught inside malloc, which then
     * waited for the lock that thread holds, for ever. */
    int list_fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (list_fd < 0)
        return;
    pid_t self = getpid();
    _Alignas(dir_entry) char entries[2048];
    for (long n; (n = syscall(SYS_getdents64, list_fd, entries, sizeof entries)) > 0;) {
        unsigned short length;
        for (long at = 0; at < n; at += length) {
            memcpy(&length, entries + at + offsetof(dir_entry, length), sizeof length);
            const char *name = entries + at + offsetof(dir_entry, name);
            pid_t pid = region_pid(name);
            if (pid > 0 && pid != self)
                reap_one(dir_fd, name, pid);
        }
    }
    close(list_fd);
}
