/* What this user's processes that ended without removing it left in the
 * region directory. A process that leaves through os._exit (as
 * multiprocessing's and other forked workers end), a crash or SIGKILL skips
 * atexit, and its region stayed until someone ran `npualloc ls`: a job
 * forking many such children filled /dev/shm with them. So did, one file
 * each, every process killed while it made its region (its temporary,
 * .npualloc.<pid>.tmp.<8 hex>, region.c) and every remover killed with a
 * name moved aside (.npualloc.<pid>.reap.<8 hex>, unlink_checked.h): the
 * random names never meet again. Each process looks when it creates its
 * region and again at its exit: the next process of the user removes them,
 * and so does a parent that outlives such children.
 *
 * The directory is ours alone (0700, region_dir.c), yet what is in it is
 * taken for foreign: a name goes only when it is a regular file of our euid,
 * opened without following a link or waiting on a FIFO, whose lock nobody
 * holds (region_lock.h: a live process holds its region's, and its
 * temporary's from before it has a name, in whatever pid namespace it is)
 * and whose pid names no process here, or a zombie with no thread left
 * (one whose main thread called pthread_exit still runs): for a region, the
 * pid in its header, which also tells one started at another time (a
 * region whose lock could not be taken goes by the pid alone, as `ls`
 * removes it); for a temporary or an aside name, the pid in the name,
 * alone. A temporary made where O_TMPFILE is missing is unlocked at its
 * name until the call after its creation, so one of a live pid stays, as a
 * live region left aside stays, locked (`ls` puts it back). `ls` takes
 * the same names by the same rule (npualloc/region.py's LEFTOVER_NAME,
 * PID_MAX and process_gone; the snapshot files go with `ls` only): a pid
 * as getpid gives it (1 to INT32_MAX, no leading zero), an exited zombie
 * gone.
 * What is unlinked is that inode (unlink_checked.h): a process that reused
 * the pid may have renamed its fresh region over it. */
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

/* What a name in the region directory stands for. */
typedef enum left_kind {
    LEFT_NONE,   /* not a name npualloc gives */
    LEFT_REGION, /* npualloc.<pid> */
    LEFT_PART,   /* .npualloc.<pid>.tmp or .reap, then .<8 hex> (nothing as npualloc named them before 2026-11-27) */
} left_kind;

/* The pid at digits, as the kernel writes pids (no leading zero, no sign),
 * with *end past it; 0 when there is none. */
static pid_t pid_at(const char *digits, const char **end)
{
    if (*digits < '1' || *digits > '9')
        return 0;
    char *after;
    errno = 0;
    long pid = strtol(digits, &after, 10);
    *end = after;
    return errno == 0 && pid <= INT32_MAX ? (pid_t)pid : 0;
}

/* Whether rest is empty or a dot and random_suffix.h's 8 hex digits. */
static bool suffix_or_none(const char *rest)
{
    if (*rest == '\0')
        return true;
    if (*rest != '.')
        return false;
    for (int i = 1; i <= 8; i++)
        if ((rest[i] < '0' || rest[i] > '9') && (rest[i] < 'a' || rest[i] > 'f'))
            return false;
    return rest[9] == '\0';
}

/* What name is, and the pid it gives in *pid. */
static left_kind left_by(const char *name, pid_t *pid)
{
    static const char region[] = "npualloc.", part[] = ".npualloc.";
    const char *end;
    if (strncmp(name, region, sizeof region - 1) == 0) {
        *pid = pid_at(name + sizeof region - 1, &end);
        return *pid > 0 && *end == '\0' ? LEFT_REGION : LEFT_NONE;
    }
    if (strncmp(name, part, sizeof part - 1) != 0 || (*pid = pid_at(name + sizeof part - 1, &end)) <= 0)
        return LEFT_NONE;
    if (strncmp(end, ".tmp", 4) == 0)
        end += 4;
    else if (strncmp(end, ".reap", 5) == 0)
        end += 5;
    else
        return LEFT_NONE;
    return suffix_or_none(end) ? LEFT_PART : LEFT_NONE;
}

/* Whether the process with pid has ended, as it tells here: no such
 * process, or one /proc keeps from us (another user's: ours are readable),
 * one that exited (npa_process_start_time: a zombie with no thread left),
 * or, where its start_time is known (not 0), one started at another time.
 * Unknown (unreadable) is alive. */
static bool ended(pid_t pid, uint64_t start_time)
{
    uint64_t now_start_time;
    bool exited;
    int err = npa_process_start_time(pid, &now_start_time, &exited);
    if (err == ENOENT || err == ESRCH || err == EACCES)
        return true;
    return err == 0 && (exited || (start_time != 0 && now_start_time != start_time));
}

/* name opened for a look, when it is a regular file of our euid whose lock
 * nobody holds (*opened: its stat); -1 for anything else. */
static int open_unheld(int dir_fd, const char *name, struct stat *opened)
{
    int fd = npa_openat_no_mount(dir_fd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd >= 0 && !(fstat(fd, opened) == 0 && S_ISREG(opened->st_mode) && opened->st_uid == geteuid() &&
                     npa_region_locked(fd) == 0)) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static void reap_region(int dir_fd, const char *name, pid_t pid)
{
    struct stat opened;
    int fd = open_unheld(dir_fd, name, &opened);
    if (fd < 0)
        return;
    npualloc_region_header h;
    bool gone = opened.st_size == (off_t)sizeof(npualloc_region) && pread(fd, &h, sizeof h, 0) == (ssize_t)sizeof h &&
                h.magic == NPUALLOC_SHM_MAGIC && h.version == NPUALLOC_SHM_VERSION && h.pid == pid &&
                ended(h.pid, h.start_time);
    close(fd);
    if (gone)
        (void)npa_unlink_checked(dir_fd, name, opened.st_dev, opened.st_ino);
}

/* A temporary or an aside name: what it holds tells nothing of whose it
 * is (a temporary may be empty yet, an aside name holds what another
 * process left), its name does. Whether it found pid alive. */
static bool reap_part(int dir_fd, const char *name, pid_t pid)
{
    struct stat opened;
    int fd = open_unheld(dir_fd, name, &opened);
    if (fd < 0)
        return false;
    close(fd);
    if (!ended(pid, 0))
        return true;
    (void)npa_unlink_checked(dir_fd, name, opened.st_dev, opened.st_ino);
    return false;
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
    /* The last pid a temporary or an aside name was found alive by: its
     * other names stay unlooked at, as they would have stayed, so that a
     * live process's many (a job's leftovers beside one long run) cost
     * one read of /proc in all, not one each. Only a live verdict is kept: one
     * that ends meanwhile is reaped at the next walk, while a gone one
     * kept could remove the unlocked temporary (O_TMPFILE missing) of a
     * process that took its pid meanwhile. */
    pid_t alive = 0;
    _Alignas(dir_entry) char entries[2048];
    for (long n; (n = syscall(SYS_getdents64, list_fd, entries, sizeof entries)) > 0;) {
        unsigned short length;
        for (long at = 0; at < n; at += length) {
            memcpy(&length, entries + at + offsetof(dir_entry, length), sizeof length);
            const char *name = entries + at + offsetof(dir_entry, name);
            pid_t pid;
            left_kind kind = left_by(name, &pid);
            if (kind != LEFT_NONE && (pid == self || (kind == LEFT_PART && pid == alive)))
                continue;
            if (kind == LEFT_REGION)
                reap_region(dir_fd, name, pid);
            else if (kind == LEFT_PART && reap_part(dir_fd, name, pid))
                alive = pid;
        }
    }
    close(list_fd);
}
