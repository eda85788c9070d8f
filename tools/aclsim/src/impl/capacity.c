/* Device capacity, shared by the processes of the machine as a real NPU's
 * HBM is. With NPUSIM_SHARED_DIR set, each device has an accounting file
 * there (device<N>): a table of per-process records {pid, start time, bytes
 * in use}. A process writes only its own record (one atomic store per
 * change, so dying mid-update leaves an old or a new figure, never a torn
 * one); records whose process is gone (no such pid, or a pid reused by a
 * process that started at another time) are ignored and reused. Charging
 * memory holds the file's flock, so two processes never both take the last
 * bytes. Without NPUSIM_SHARED_DIR the capacity is the process's own.
 *
 * Lock order: sim_lock, then a file's flock. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define SHARE_MAGIC 0x4e50555343415031ull /* "NPUSCAP1" */
#define SHARE_SLOTS 256

struct share_slot {
    _Atomic int32_t pid;          /* 0: free */
    int32_t unused;
    _Atomic uint64_t start_ticks; /* the process's start time (/proc/<pid>/stat field 22) */
    _Atomic uint64_t used_bytes;
};
struct share_file {
    _Atomic uint64_t magic;
    struct share_slot slots[SHARE_SLOTS];
};

struct share {
    int fd;                       /* -1: not opened yet */
    pid_t owner;                  /* the process that opened it (a forked child reopens) */
    struct share_file *file;
    int slot;
};
static struct share shares[64];   /* by device id; config caps devices at 64 */

static uint64_t start_ticks_of(pid_t pid)
{
    char path[64], text[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, text, sizeof text - 1);
    close(fd);
    if (n <= 0)
        return 0;
    text[n] = '\0';
    char *p = strrchr(text, ')'); /* the command name may hold spaces and parentheses */
    unsigned long long ticks = 0;
    /* After ")": state is field 3, start time field 22. */
    if (p == NULL || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u %*d %*d %*d %*d %*d %*d %llu",
                            &ticks) != 1)
        return 0;
    return ticks;
}

static int slot_alive(const struct share_slot *s)
{
    pid_t pid = atomic_load_explicit(&s->pid, memory_order_acquire);
    if (pid <= 0)
        return 0;
    if (kill(pid, 0) != 0 && errno == ESRCH)
        return 0;
    return start_ticks_of(pid) == atomic_load_explicit(&s->start_ticks, memory_order_relaxed);
}

/* flock held. Claims a free or dead record for this process. */
static void claim_slot(struct share *sh, uint64_t used)
{
    for (int i = 0; i < SHARE_SLOTS; i++) {
        struct share_slot *s = &sh->file->slots[i];
        if (atomic_load_explicit(&s->pid, memory_order_relaxed) != 0 && slot_alive(s))
            continue;
        atomic_store_explicit(&s->pid, 0, memory_order_relaxed);
        atomic_store_explicit(&s->used_bytes, used, memory_order_relaxed);
        atomic_store_explicit(&s->start_ticks, start_ticks_of(getpid()), memory_order_relaxed);
        atomic_store_explicit(&s->pid, getpid(), memory_order_release);
        sh->slot = i;
        return;
    }
    sim_fatal("NPUSIM_SHARED_DIR: more than %d live processes share a device", SHARE_SLOTS);
}

/* sim_lock held. The device's share, opened and with a record of this
 * process; NULL when capacity is private (no NPUSIM_SHARED_DIR). */
static struct share *share_of(int32_t id, uint64_t used)
{
    const char *dir = sim_config()->shared_dir;
    if (dir == NULL)
        return NULL;
    struct share *sh = &shares[id];
    if (sh->file != NULL && sh->owner == getpid())
        return sh;
    if (sh->file != NULL) { /* a forked child: the parent's record and open file are the parent's */
        munmap(sh->file, sizeof *sh->file);
        close(sh->fd);
        sh->file = NULL;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/device%d", dir, (int)id);
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        sim_fatal("NPUSIM_SHARED_DIR: cannot use %s as a regular file: %s", path, strerror(errno));
    flock(fd, LOCK_EX);
    if (st.st_size < (off_t)sizeof(struct share_file) && ftruncate(fd, sizeof(struct share_file)) != 0)
        sim_fatal("NPUSIM_SHARED_DIR: cannot size %s: %s", path, strerror(errno));
    struct share_file *file = mmap(NULL, sizeof *file, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (file == MAP_FAILED)
        sim_fatal("NPUSIM_SHARED_DIR: cannot map %s: %s", path, strerror(errno));
    uint64_t magic = atomic_load_explicit(&file->magic, memory_order_acquire);
    if (magic == 0)
        atomic_store_explicit(&file->magic, SHARE_MAGIC, memory_order_release);
    else if (magic != SHARE_MAGIC)
        sim_fatal("NPUSIM_SHARED_DIR: %s is not a device accounting file", path);
    *sh = (struct share){.fd = fd, .owner = getpid(), .file = file};
    claim_slot(sh, used);
    flock(fd, LOCK_UN);
    return sh;
}

/* What the other live processes use. careful: look at whether each record's
 * process still lives (reads /proc), else trust the records. */
static uint64_t others_used(const struct share *sh, int careful)
{
    uint64_t sum = 0;
    for (int i = 0; i < SHARE_SLOTS; i++) {
        const struct share_slot *s = &sh->file->slots[i];
        if (i == sh->slot || atomic_load_explicit(&s->pid, memory_order_acquire) == 0)
            continue;
        uint64_t used = atomic_load_explicit(&s->used_bytes, memory_order_relaxed);
        if (used != 0 && (!careful || slot_alive(s)))
            sum += used;
    }
    return sum;
}

int sim_capacity_charge(int32_t id, uint64_t bytes)
{
    struct sim_device *d = sim_device(id);
    uint64_t hbm = sim_config()->hbm_bytes;
    struct share *sh = share_of(id, d->used_bytes);
    if (sh == NULL) {
        if (d->used_bytes + bytes > hbm)
            return 0;
        d->used_bytes += bytes;
        return 1;
    }
    flock(sh->fd, LOCK_EX);
    /* Dead processes are looked for only when the figures say no. */
    int ok = others_used(sh, 0) + d->used_bytes + bytes <= hbm ||
             others_used(sh, 1) + d->used_bytes + bytes <= hbm;
    if (ok) {
        d->used_bytes += bytes;
        atomic_store_explicit(&sh->file->slots[sh->slot].used_bytes, d->used_bytes, memory_order_release);
    }
    flock(sh->fd, LOCK_UN);
    return ok;
}

void sim_capacity_release(int32_t id, uint64_t bytes)
{
    struct sim_device *d = sim_device(id);
    d->used_bytes -= bytes;
    struct share *sh = share_of(id, d->used_bytes);
    if (sh != NULL)
        atomic_store_explicit(&sh->file->slots[sh->slot].used_bytes, d->used_bytes, memory_order_release);
}

uint64_t sim_capacity_used(int32_t id)
{
    struct sim_device *d = sim_device(id);
    struct share *sh = share_of(id, d->used_bytes);
    uint64_t used = d->used_bytes + (sh != NULL ? others_used(sh, 1) : 0);
    return used < sim_config()->hbm_bytes ? used : sim_config()->hbm_bytes;
}
