/* The shared-memory stats region (layout: npualloc_shm.h, API: region.h).
 *
 * Life of a region: the first allocator call creates <dir>/npualloc.<pid>,
 * dir being this user's private region directory (region_dir.c:
 * /dev/shm/npualloc-<euid> by default). The file is filled under a temporary
 * name and renamed into place, so a reader never sees a half-written header and
 * a leftover of an earlier process with our pid is replaced atomically. It is
 * unlinked at exit; exits that skip atexit leave a file that the next
 * process of the user removes as it creates its region or exits (reap.c),
 * as does `npualloc ls`, once its process is gone: its lock dropped
 * (region_lock.h) and its pid dead.
 *
 * Nothing here may crash or block the host: every failure warns once on stderr
 * and leaves the process without a region (the core then keeps its stats in
 * its own memory). */
#define _GNU_SOURCE
#include "region/region.h"
#include "hook/hook.h"
#include "random_suffix.h"
#include "region_lock.h"
#include "unlink_checked.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

enum region_state {
    REGION_UNTRIED = 0, /* no allocator call yet */
    REGION_LIVE,        /* mapped, file in place */
    REGION_OFF,         /* NPUALLOC_STATS=0 or creation failed */
    REGION_REMOVED,     /* unlinked at exit; the mapping stays valid for late writers */
    REGION_FORKED,      /* forked child: the parent's region is forgotten, create ours at the next call */
};

npualloc_region *_Atomic npa_region_current;
static _Atomic int g_state = REGION_UNTRIED;
/* Serialises creation, removal and config updates; never taken on the hot
 * path. In the lock order (hook/hook.h) only warn.c's seen_lock is taken under it. */
static pthread_mutex_t g_create_lock = PTHREAD_MUTEX_INITIALIZER;
/* One poller applies a command; the others go on with their allocation.
 * Taken with no lock of ours held; under it, device locks (hook/hook.h). */
static pthread_mutex_t g_command_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t g_owner_pid;
static char g_path[4096];
/* The region's directory, opened safely (region_dir.c) and kept open, and the
 * region's name in it: snapshot files are written and the region removed
 * through it, never through g_path, whose base may be a link (/dev/shm). */
static int g_dir_fd = -1;
static dev_t g_dir_dev;
static ino_t g_dir_ino;
static char g_name[32];
/* The region file's own inode: the name may come to hold another file
 * (a process with our pid in another pid namespace sharing the directory
 * renames its region over ours), which our exit must leave alone. */
static ino_t g_file_ino;
/* The region file, kept open for life with its lock (region_lock.h): it
 * tells readers this process lives, whatever pid namespace they are in.
 * -1 when none (no lock could be taken). */
static int g_file_fd = -1;
static char g_config[NPUALLOC_CONFIG_LEN];
static uint32_t g_runtime_device_count; /* 0: not known */
/* memory_stats()'s max_split_size of the config in force, which a device
 * slot holds before any allocator starts on that device (see fill_devices). */
static int64_t g_max_split_size = -1;
static atomic_flag g_warned = ATOMIC_FLAG_INIT;
static int g_hooks_registered;

static void warn_once(const char *what, const char *path, int err)
{
    if (atomic_flag_test_and_set(&g_warned))
        return;
    npa_warn_once("live stats disabled: %s%s%s%s%s", what, path ? " " : "", path ? path : "", err ? ": " : "",
                  err ? strerror(err) : "");
}

static int stats_disabled(void)
{
    const char *value = getenv("NPUALLOC_STATS");
    if (!value)
        return 0;
    return !strcmp(value, "0") || !strcasecmp(value, "false") || !strcasecmp(value, "off") ||
           !strcasecmp(value, "no");
}

int npa_process_start_time(pid_t pid, uint64_t *start_time, bool *exited)
{
    char path[64], buf[1024];
    if (pid == 0)
        snprintf(path, sizeof path, "/proc/self/stat"); /* ours even where /proc is another pid namespace's */
    else
        snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return errno;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    int err = n < 0 ? errno : 0;
    close(fd);
    if (n <= 0)
        return err ? err : EIO;
    buf[n] = '\0';
    /* Fields counted after the last ')': the command name may hold spaces. */
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ' || !p[2])
        return EIO;
    char state = p[2];
    long threads = 0;
    p++;
    for (int field = 3; field < 22 && p; field++) { /* p sits before field `field` */
        if (field == 20)
            threads = strtol(p + 1, NULL, 10);
        p = strchr(p + 1, ' ');
    }
    if (!p)
        return EIO;
    *exited = (state == 'Z' || state == 'X') && threads <= 1;
    *start_time = strtoull(p + 1, NULL, 10);
    return 0;
}

static void read_cmdline(char *out, size_t len)
{
    out[0] = '\0';
    int fd = open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, out, len - 1);
    close(fd);
    if (n <= 0) {
        out[0] = '\0';
        return;
    }
    for (ssize_t i = 0; i < n; i++) /* NULs between arguments, newlines of `python -c` scripts */
        if ((unsigned char)out[i] < ' ')
            out[i] = ' ';
    while (n > 0 && out[n - 1] == ' ')
        n--;
    out[n] = '\0';
}

static void copy_text(char *dst, size_t len, const char *src)
{
    size_t n = strnlen(src, len - 1);
    memcpy(dst, src, n);
    memset(dst + n, 0, len - n);
}

/* The config text (NPUALLOC_CONFIG_LEN bytes) into the header under
 * config_seq, a word at a time with relaxed atomic stores, as
 * npualloc_reader_config copies it: C11 orders a store after the seqlock's
 * release fence only when it is atomic, and memcpy's plain stores the
 * compiler may move above the fence or split, leaving a reader a copy of
 * two configs with seq unchanged around it. */
static void store_config(npualloc_region_header *h, const char *text)
{
    _Static_assert(offsetof(npualloc_region_header, config) % sizeof(uint64_t) == 0 &&
                       NPUALLOC_CONFIG_LEN % sizeof(uint64_t) == 0,
                   "the config is whole words");
    uint64_t *to = (uint64_t *)(void *)h->config;
    for (size_t i = 0; i < NPUALLOC_CONFIG_LEN / sizeof *to; i++) {
        uint64_t word;
        memcpy(&word, text + i * sizeof word, sizeof word);
        __atomic_store_n(&to[i], word, __ATOMIC_RELAXED);
    }
}

static void fill_header(npualloc_region *r)
{
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    npualloc_region_header *h = &r->header;
    h->version = NPUALLOC_SHM_VERSION;
    h->size = sizeof(npualloc_region);
    h->pid = (int32_t)getpid();
    h->uid = (uint32_t)geteuid();
    bool exited;
    (void)npa_process_start_time(0, &h->start_time, &exited); /* left 0, unknown, when unreadable */
    h->created_unix_ns = (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
    copy_text(h->config, sizeof h->config, g_config);
    h->runtime_device_count = g_runtime_device_count;
    read_cmdline(h->cmdline, sizeof h->cmdline);
    h->magic = NPUALLOC_SHM_MAGIC;
}

/* Every device slot as torch shows a device nothing was allocated on: all 0
 * but max_split_size, the setting. A slot of a device never used, or used
 * only by memory_saver, read 0 there from outside, -1 or the setting inside;
 * npa_stats_init writes the same value when the device starts. */
static void fill_devices(npualloc_region *r)
{
    for (int d = 0; d < NPUALLOC_MAX_DEVICES; d++)
        r->devices[d].max_split_size = g_max_split_size;
}

static npualloc_region *publish_region(int dir_fd, const char *name);

/* Creates, fills and publishes the file. */
static npualloc_region *map_new_region(void)
{
    char dir[sizeof g_path - 32];
    int dir_fd = npa_region_dir_open(dir, sizeof dir);
    if (dir_fd < 0) {
        warn_once("cannot make a private region directory in", npa_region_base(), errno);
        return NULL;
    }
    char name[32];
    snprintf(name, sizeof name, "npualloc.%d", (int)getpid());
    snprintf(g_path, sizeof g_path, "%s/%s", dir, name);
    npualloc_region *r = publish_region(dir_fd, name);
    struct stat opened;
    if (r && fstat(dir_fd, &opened) == 0) {
        g_dir_fd = dir_fd;
        g_dir_dev = opened.st_dev;
        g_dir_ino = opened.st_ino;
        memcpy(g_name, name, sizeof g_name);
        npa_region_reap(dir_fd);
    } else {
        close(dir_fd);
    }
    return r;
}

/* Tries at a new random name before giving up: each fails only when
 * something already sits at its name. */
#define TEMPORARY_TRIES 16
#define TEMPORARY_NAME_LEN 48 /* .npualloc.<pid>.tmp.<8 hex> */

/* Gives the region's temporary a name of its own, .npualloc.<pid>.tmp.<8 hex
 * digits>, in tmp: links nameless, a file made with O_TMPFILE, there, or,
 * with nameless -1, creates one there (O_EXCL | O_NOFOLLOW, mode 0600). The
 * descriptor, or -1 with errno. A name of its own: at a fixed one, what was
 * found there went as an earlier process's leftover, yet it may be the
 * temporary a process with our pid in another pid namespace sharing the
 * directory is filling (whose rename then published ours half made). A
 * killed process's leftover goes with the next process's reaper (reap.c)
 * or `npualloc ls`. */
static int name_temporary(int dir_fd, int nameless, char tmp[TEMPORARY_NAME_LEN])
{
    char self[32]; /* linkat by descriptor (AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH */
    snprintf(self, sizeof self, "/proc/self/fd/%d", nameless);
    for (int try = 0; try < TEMPORARY_TRIES; try++) {
        char suffix[9];
        npa_random_suffix(suffix);
        snprintf(tmp, TEMPORARY_NAME_LEN, ".npualloc.%d.tmp.%s", (int)getpid(), suffix);
        int fd = nameless;
        if (nameless < 0)
            fd = openat(dir_fd, tmp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
        else if (linkat(AT_FDCWD, self, dir_fd, tmp, AT_SYMLINK_FOLLOW) != 0)
            fd = -1;
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    return -1; /* errno: EEXIST */
}

/* Whether name in dir_fd is fd's file, which name_temporary linked there
 * through /proc/self/fd/N: that leads to it only where /proc is procfs. In
 * a chroot whose /proc is a plain directory, or under a file system mounted
 * over /proc, it may be a link to any file, which linkat followed: that
 * file was published as the region, the process filling its own unseen,
 * and its link stayed after exit. Such a link is removed (that inode only:
 * unlink_checked.h). */
static bool linked_itself(int dir_fd, const char *name, int fd)
{
    struct stat own, seen;
    if (npa_lstatat_no_mount(dir_fd, name, &seen) != 0)
        return false;
    if (fstat(fd, &own) == 0 && seen.st_dev == own.st_dev && seen.st_ino == own.st_ino)
        return true;
    (void)npa_unlink_checked(dir_fd, name, seen.st_dev, seen.st_ino);
    return false;
}

/* fd, a file made with O_TMPFILE now linked at name, opened again there and
 * locked as fd is (the new lock taken before fd's goes with it): a
 * descriptor of the nameless file shows in /proc/<pid>/fd, and so in lsof,
 * as "#<inode> (deleted)" for life, not as the region it becomes. fd itself
 * where that fails. */
static int reopen_at_name(int dir_fd, const char *name, int fd, bool locked)
{
    struct stat was, now;
    int named = openat(dir_fd, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (named < 0)
        return fd;
    if (fstat(fd, &was) != 0 || fstat(named, &now) != 0 || now.st_dev != was.st_dev || now.st_ino != was.st_ino ||
        (locked && npa_region_lock(named) != 0)) {
        close(named);
        return fd;
    }
    close(fd);
    return named;
}

/* The region's temporary in dir_fd, named in tmp, and in *locked whether
 * it holds its lock (region_lock.h), taken before the file has a name: `ls`
 * and the reaper (reap.c) remove a temporary of a pid dead in their
 * namespace when nobody holds it (ours may be another's), and one created
 * at its name was unlocked there until the lock was taken. Created at its
 * name, locked just after, only where the file system has no O_TMPFILE or
 * no procfs at /proc links it. Without a lock (an old kernel) readers go by
 * the pid alone. */
static int create_temporary(int dir_fd, char tmp[TEMPORARY_NAME_LEN], bool *locked)
{
    int fd = openat(dir_fd, ".", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0) {
        *locked = npa_region_lock(fd) == 0;
        /* Before it is opened again by name: a umask of 0477 left it 0200. */
        if (fchmod(fd, 0600) == 0 && name_temporary(dir_fd, fd, tmp) >= 0 && linked_itself(dir_fd, tmp, fd))
            return reopen_at_name(dir_fd, tmp, fd, *locked);
        close(fd);
    }
    fd = name_temporary(dir_fd, -1, tmp);
    *locked = fd >= 0 && npa_region_lock(fd) == 0;
    return fd;
}

/* Publishings tried before giving up: one more only while a reaper takes
 * each temporary (publish_region). */
#define PUBLISH_TRIES 4

/* Creates, fills and renames into place name in dir_fd (ours: region_dir.c):
 * the region; NULL having warned; or NULL with *taken when the temporary
 * was gone at the rename. */
static npualloc_region *publish_once(int dir_fd, const char *name, bool *taken)
{
    char tmp[TEMPORARY_NAME_LEN];
    bool locked;
    int fd = create_temporary(dir_fd, tmp, &locked);
    if (fd < 0) {
        warn_once("cannot create", g_path, errno);
        return NULL;
    }
    struct stat created;
    /* fallocate, not ftruncate: on a full tmpfs touching a sparse page would
     * raise SIGBUS in the host; here it fails cleanly instead. */
    int err = fchmod(fd, 0600) || fstat(fd, &created) ? errno : posix_fallocate(fd, 0, sizeof(npualloc_region));
    npualloc_region *r = err ? MAP_FAILED
                             : mmap(NULL, sizeof(npualloc_region), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (!err && r == MAP_FAILED)
        err = errno;
    if (err) {
        close(fd);
        warn_once("cannot size or map", g_path, err);
        unlinkat(dir_fd, tmp, 0);
        return NULL;
    }
    if (!locked) {
        close(fd);
        fd = -1;
    }
    fill_header(r);
    fill_devices(r);
    g_file_ino = created.st_ino;
    if (renameat(dir_fd, tmp, dir_fd, name)) {
        *taken = errno == ENOENT;
        if (!*taken)
            warn_once("cannot publish", g_path, errno);
        munmap(r, sizeof(npualloc_region));
        unlinkat(dir_fd, tmp, 0);
        if (fd >= 0)
            close(fd);
        return NULL;
    }
    g_file_fd = fd;
    return r;
}

/* publish_once, again while its temporary was taken: one made at its name
 * (no O_TMPFILE) is unlocked there until the next call, and the reaper of
 * any process in another pid namespace sharing the directory, where our pid
 * names no process, may remove it meanwhile as a gone process's (reap.c,
 * `ls`), even once it is locked, having looked before. */
static npualloc_region *publish_region(int dir_fd, const char *name)
{
    bool taken = true;
    for (int try = 0; taken && try < PUBLISH_TRIES; try++) {
        taken = false;
        npualloc_region *r = publish_once(dir_fd, name, &taken);
        if (r)
            return r;
    }
    if (taken)
        warn_once("cannot publish", g_path, ENOENT);
    return NULL;
}

static void remove_at_exit(void)
{
    npa_region_remove();
}

npualloc_region *npa_region_get(void)
{
    npualloc_region *r = atomic_load_explicit(&npa_region_current, memory_order_acquire);
    if (r)
        return r;
    /* LIVE with no region seen yet: the creator's two stores may be read
     * in either order, so look again under the lock. */
    int state = atomic_load_explicit(&g_state, memory_order_relaxed);
    if (state != REGION_UNTRIED && state != REGION_FORKED && state != REGION_LIVE)
        return NULL;

    npa_mutex_lock(&g_create_lock);
    r = atomic_load_explicit(&npa_region_current, memory_order_relaxed);
    state = atomic_load_explicit(&g_state, memory_order_relaxed);
    if (!r && (state == REGION_UNTRIED || state == REGION_FORKED)) {
        r = stats_disabled() ? NULL : map_new_region();
        if (r) {
            g_owner_pid = getpid();
            if (!g_hooks_registered) {
                /* Inherited by forked children, so registered once per image.
                 * The hook layer's at_exit may call it too: idempotent. No
                 * fork handler here: the region is made only by the hook's
                 * first init, under init_lock, after the hook registered
                 * its fork handlers (lifecycle.c), whose fork_prepare takes
                 * init_lock, so no fork copies a region half made, and
                 * whose child handler forgets the region. (pthread_atfork
                 * here, under init_lock, would wait for the atfork lock
                 * that glibc 2.28 to 2.35 hold across the prepare handlers,
                 * sourceware bug 24595, held by a fork waiting in
                 * fork_prepare for init_lock: neither would go on.) */
                g_hooks_registered = 1;
                atexit(remove_at_exit);
            }
            atomic_store_explicit(&g_state, REGION_LIVE, memory_order_relaxed);
            atomic_store_explicit(&npa_region_current, r, memory_order_release);
        } else {
            atomic_store_explicit(&g_state, REGION_OFF, memory_order_relaxed);
        }
    }
    npa_mutex_unlock(&g_create_lock);
    return r;
}

/* The region, with device counted in header.device_count; NULL when none. */
static npualloc_region *region_for_device(int device)
{
    if (device < 0 || device >= NPUALLOC_MAX_DEVICES)
        return NULL;
    npualloc_region *r = npa_region_get();
    if (!r)
        return NULL;
    uint32_t wanted = (uint32_t)device + 1;
    uint32_t seen = __atomic_load_n(&r->header.device_count, __ATOMIC_RELAXED);
    while (seen < wanted &&
           !__atomic_compare_exchange_n(&r->header.device_count, &seen, wanted, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
        ;
    return r;
}

npualloc_device_stats *npa_region_device_stats(int device)
{
    npualloc_region *r = region_for_device(device);
    return r ? &r->devices[device] : NULL;
}

npualloc_thread_stats *npa_region_thread_stats(int device)
{
    npualloc_region *r = region_for_device(device);
    return r ? r->threads[device] : NULL;
}

npualloc_saver_stats *npa_region_saver_stats(int device)
{
    npualloc_region *r = region_for_device(device);
    return r ? &r->saver[device] : NULL;
}

void npa_region_publish_config(const npa_allocator *a)
{
    if (!a)
        return;
    char canonical[NPUALLOC_CONFIG_LEN];
    /* Formatted under the lock: else of two threads that each changed a
     * key, the one that formatted first (the older config) could write last
     * and leave it in the header. Formatting takes no lock. */
    npa_mutex_lock(&g_create_lock);
    npa_config_format(npa_get_config(a), canonical, sizeof canonical);
    copy_text(g_config, sizeof g_config, canonical);
    g_max_split_size = npa_config_max_split_stat(npa_get_config(a)); /* not a run-time key: a region made later has it */
    npualloc_region *r = atomic_load_explicit(&npa_region_current, memory_order_relaxed);
    if (r) { /* readers see it whole or retry (npualloc_reader_config): the stats' seqlock protocol */
        npualloc_region_header *h = &r->header;
        uint32_t seq = __atomic_load_n(&h->config_seq, __ATOMIC_RELAXED);
        __atomic_store_n(&h->config_seq, seq + 1, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_RELEASE);
        store_config(h, g_config);
        __atomic_store_n(&h->config_seq, seq + 2, __ATOMIC_RELEASE);
    }
    npa_mutex_unlock(&g_create_lock);
}

void npa_region_publish_device_count(int count)
{
    if (count <= 0)
        return;
    npa_mutex_lock(&g_create_lock);
    g_runtime_device_count = (uint32_t)count;
    npualloc_region *r = atomic_load_explicit(&npa_region_current, memory_order_relaxed);
    if (r) /* a lone word: a reader sees 0 (not known) or the count */
        __atomic_store_n(&r->header.runtime_device_count, g_runtime_device_count, __ATOMIC_RELAXED);
    npa_mutex_unlock(&g_create_lock);
}

static int device_in_use(const npualloc_region *r, int device)
{
    return __atomic_load_n(&r->devices[device].in_use, __ATOMIC_RELAXED) != 0;
}

/* Whether descriptor fd still is the file (dev, ino) we opened: the program
 * may close descriptors it did not open, and the number may then name a file
 * of its own, which nothing of ours may write to or close. */
static bool still_ours(int fd, dev_t dev, ino_t ino)
{
    struct stat now;
    return fd >= 0 && fstat(fd, &now) == 0 && now.st_dev == dev && now.st_ino == ino;
}

/* g_dir_fd while it is still the region's directory, else -1. */
static int region_dir_fd(void)
{
    return still_ours(g_dir_fd, g_dir_dev, g_dir_ino) ? g_dir_fd : -1;
}

/* The snapshot files written for requesters, oldest first (inode 0: none).
 * A requester that gave up waiting (an idle process answers after its
 * timeout) never removes its file, and a week of such commands would fill
 * /dev/shm: each write removes the file of two writes back, and exit removes
 * both. A requester reads its file after the acknowledgement, so one that
 * stalls there while two more snapshots are taken, or while the process
 * exits, finds it gone (and says the process ended, in the exit's case).
 * Guarded by g_command_lock. */
static struct {
    uint64_t seq;
    ino_t ino;
} g_snapshots[2];

/* <region>.snapshot.<the region file's inode>.<seq>: the requester reads
 * the inode off the file it posted through. At <region>.snapshot.<seq>
 * alone, a process with our pid in another pid namespace sharing the
 * directory, its commands numbered from 1 as ours are, answered over our
 * file before our requester read it, which then read that process's
 * snapshot and removed it. Two live regions never share an inode, both
 * held open on the one file system. */
#define SNAPSHOT_NAME_LEN (sizeof g_name + sizeof ".snapshot.." + 2 * 20)

static void snapshot_name(char *name, size_t len, uint64_t seq)
{
    snprintf(name, len, "%s.snapshot.%llu.%llu", g_name, (unsigned long long)g_file_ino, (unsigned long long)seq);
}

/* Removes the file of g_snapshots[i] if it is still the one we wrote (its
 * requester may have removed it, and the name taken by another file since:
 * a process with our pid in another pid namespace places its snapshots
 * there, at any moment, so the inode goes, not the name: unlink_checked.h). */
static void forget_snapshot(int dir_fd, int i)
{
    char name[SNAPSHOT_NAME_LEN];
    snapshot_name(name, sizeof name, g_snapshots[i].seq);
    if (g_snapshots[i].ino != 0)
        (void)npa_unlink_checked(dir_fd, name, g_dir_dev, g_snapshots[i].ino);
    g_snapshots[i].ino = 0;
}

/* The snapshot file a requester finds beside the region (snapshot_name). */
static int32_t write_snapshot(npa_allocator *a, uint64_t seq)
{
    char name[SNAPSHOT_NAME_LEN];
    snapshot_name(name, sizeof name, seq);
    int dir_fd = region_dir_fd();
    int err = dir_fd < 0 ? 0 : npa_snapshot_write_at(a, dir_fd, name);
    struct stat written;
    if (dir_fd >= 0 && err == 0 && fstatat(dir_fd, name, &written, AT_SYMLINK_NOFOLLOW) == 0) {
        forget_snapshot(dir_fd, 0);
        g_snapshots[0] = g_snapshots[1];
        g_snapshots[1].seq = seq;
        g_snapshots[1].ino = written.st_ino;
    }
    const char *why = dir_fd < 0 ? "the program closed the region directory's descriptor (nothing written)"
                      : err != 0 ? npa_snapshot_strerror(err)
                                 : NULL;
    if (why) {
        /* g_path ends in g_name, the name's start: its directory, then the name. */
        npa_warn_once("snapshot for another process: cannot write %.*s%s: %s", (int)(strlen(g_path) - strlen(g_name)),
                      g_path, name, why);
        return NPUALLOC_CMD_EFAILED;
    }
    return NPUALLOC_CMD_OK;
}

/* A run-time key a command set: kept for later allocators (a forked child's,
 * a new runtime session's) as npualloc_set_config keeps it, once the
 * command lock is released (init_lock is never taken under it). */
typedef struct kept_key {
    bool taken;
    npa_runtime_key key;
    npa_config parsed;
} kept_key;

/* *seq: the request applied; a pause moves it on to the resume that ended it. */
static int32_t apply_command(npa_allocator *a, npualloc_region *r, uint64_t *seq, int32_t code, int32_t device,
                             double arg, kept_key *keep)
{
    if (code == NPUALLOC_CMD_PAUSE)
        return npa_pause_command(a, r, seq);
    if (code == NPUALLOC_CMD_RESUME)
        return NPUALLOC_CMD_ENOTPAUSED;
    if (code == NPUALLOC_CMD_SNAPSHOT)
        return write_snapshot(a, *seq);
    if (code == NPUALLOC_CMD_RECORD_HISTORY) {
        /* Through the config parser, so its limit on entries applies here too. */
        char item[64];
        npa_config parsed;
        npa_config_defaults(&parsed);
        if (!(arg >= 0.0 && arg < 1e15 && arg == (double)(uint64_t)arg))
            return NPUALLOC_CMD_EINVAL;
        snprintf(item, sizeof item, "record_history:%llu", (unsigned long long)arg);
        if (npa_config_parse(&parsed, item, NULL, NULL) != 0)
            return NPUALLOC_CMD_EINVAL;
        if (npa_set_record_history(a, parsed.record_history) != 0)
            return NPUALLOC_CMD_EFAILED;
        *keep = (kept_key){.taken = true, .key = NPA_KEY_RECORD_HISTORY, .parsed = parsed};
        npa_region_publish_config(a);
        return NPUALLOC_CMD_OK;
    }
    if (code == NPUALLOC_CMD_SET_GC_THRESHOLD) {
        if (!(arg >= 0.0 && arg < 1.0)) /* also rejects NaN */
            return NPUALLOC_CMD_EINVAL;
        if (npa_set_gc_threshold(a, arg) != 0)
            return NPUALLOC_CMD_EFAILED;
        *keep = (kept_key){.taken = true, .key = NPA_KEY_GC_THRESHOLD};
        npa_config_defaults(&keep->parsed);
        keep->parsed.garbage_collection_threshold = arg;
        npa_region_publish_config(a);
        return NPUALLOC_CMD_OK;
    }
    if (code == NPUALLOC_CMD_SET_MEMORY_FRACTION) {
        /* Per device, like torch's, so not in the config text: the cap shows
         * as the device's reserved_limit_bytes. */
        const char *why;
        return npa_hook_set_memory_fraction(a, device, arg, &why) == 0 ? NPUALLOC_CMD_OK : NPUALLOC_CMD_EINVAL;
    }
    if (code != NPUALLOC_CMD_EMPTY_CACHE && code != NPUALLOC_CMD_RESET_PEAK && code != NPUALLOC_CMD_RESET_ACCUMULATED)
        return NPUALLOC_CMD_EUNKNOWN;
    if (device < -1 || device >= NPUALLOC_MAX_DEVICES)
        return NPUALLOC_CMD_EINVAL;
    /* Only devices that allocated through npualloc have anything to act on;
     * touching the others could make the core set up state for them. */
    int32_t status = NPUALLOC_CMD_OK;
    for (int d = device < 0 ? 0 : device; d < (device < 0 ? NPUALLOC_MAX_DEVICES : device + 1); d++) {
        if (!device_in_use(r, d))
            continue;
        if (code == NPUALLOC_CMD_EMPTY_CACHE) {
            /* A device that could not be synchronized kept its cache: the
             * requester must not be told it was emptied, and the process's
             * stderr says why, as the requester's error points there. */
            npa_error err = npa_empty_cache(a, d);
            if (err != NPA_OK) {
                npa_warn_once("empty_cache from another process: device %d could not be synchronized "
                              "(error %d): its cache and pending frees are kept", d, err);
                status = NPUALLOC_CMD_EFAILED;
            }
        } else if (code == NPUALLOC_CMD_RESET_PEAK) {
            npa_reset_peak_stats(a, d);
        } else {
            npa_reset_accumulated_stats(a, d);
        }
    }
    return status;
}

void npa_region_poll_slow(npa_allocator *allocator)
{
    npualloc_region *r = npa_region_get();
    if (!r || !allocator || !npa_region_command_pending(r))
        return;
    npualloc_command *cmd = &r->command;
    if (npa_mutex_trylock(&g_command_lock) != 0)
        return; /* another thread is applying it */
    uint64_t requested = __atomic_load_n(&cmd->request_seq, __ATOMIC_ACQUIRE);
    kept_key keep = {.taken = false};
    npa_command_claim claim = NPA_COMMAND_WITHDRAWN;
    if (requested != __atomic_load_n(&cmd->ack_seq, __ATOMIC_RELAXED))
        claim = npa_region_take_command(r, requested);
    if (claim == NPA_COMMAND_DAMAGED) {
        npa_region_acknowledge(r, requested, NPUALLOC_CMD_EINVAL);
    } else if (claim == NPA_COMMAND_TAKEN) {
        /* Read once: the requester is another process and may rewrite them. */
        int32_t code = __atomic_load_n(&cmd->code, __ATOMIC_RELAXED);
        int32_t device = __atomic_load_n(&cmd->device, __ATOMIC_RELAXED);
        double arg;
        __atomic_load(&cmd->arg, &arg, __ATOMIC_RELAXED);
        int32_t status = apply_command(allocator, r, &requested, code, device, arg, &keep);
        npa_region_acknowledge(r, requested, status);
    }
    npa_mutex_unlock(&g_command_lock);
    if (keep.taken)
        npa_hook_remember_config(&keep.parsed, keep.key);
}

void npa_region_remove(void)
{
    /* A command being applied is acknowledged before the process goes: a
     * resume lets an exit that waited for it through the moment the locks
     * are given back, before the resuming thread writes its answer, and the
     * requester would then wait out its timeout for a command that worked. */
    /* Only at exit, and never past NPA_EXIT_WAIT_MS: the exiting thread
     * may hold either lock (a signal handler calling exit), and then the
     * file stays for `npualloc ls` to remove. */
    if (npa_mutex_lock_at_exit(&g_command_lock) == 0) {
        int dir_fd = g_owner_pid == getpid() ? region_dir_fd() : -1;
        for (int i = 0; dir_fd >= 0 && i < 2; i++)
            forget_snapshot(dir_fd, i);
        npa_mutex_unlock(&g_command_lock);
    }
    if (npa_mutex_lock_at_exit(&g_create_lock) != 0)
        return;
    int state = atomic_load_explicit(&g_state, memory_order_relaxed);
    if (state == REGION_LIVE && g_owner_pid == getpid()) {
        /* The fd stays open: a command may still be writing through it. Only
         * our own file goes, and only through the directory we made it in:
         * with that closed by the program, the file stays for `npualloc ls`
         * to remove (its pid is dead), as g_path may lead through links.
         * Our inode, not the name: a process with our pid in another pid
         * namespace sharing the directory may rename its fresh region over
         * the name at any moment, this one included (unlink_checked.h). */
        int dir_fd = region_dir_fd();
        if (dir_fd >= 0) {
            (void)npa_unlink_checked(dir_fd, g_name, g_dir_dev, g_file_ino);
            npa_region_reap(dir_fd); /* what children that left through _exit left */
        }
        atomic_store_explicit(&g_state, REGION_REMOVED, memory_order_relaxed);
    } else if (state == REGION_UNTRIED || state == REGION_FORKED) {
        /* Exiting: an allocator call from a late destructor must not create a file. */
        atomic_store_explicit(&g_state, REGION_OFF, memory_order_relaxed);
    }
    npa_mutex_unlock(&g_create_lock);
}

void npa_region_forget_after_fork(void)
{
    /* A parent thread may have held these at fork time; it does not exist here. */
    pthread_mutex_init(&g_create_lock, NULL);
    pthread_mutex_init(&g_command_lock, NULL);
    memset(g_snapshots, 0, sizeof g_snapshots); /* the parent's files, for the parent to remove */
    npualloc_region *r = atomic_load_explicit(&npa_region_current, memory_order_relaxed);
    if (!r || g_owner_pid == getpid())
        return; /* nothing inherited, or already forgotten */
    /* The parent's descriptors, each closed only while its number still is
     * that file: the directory (the child's region opens its own) and the
     * region file (held here, its lock would say the parent lives for as
     * long as this child does). */
    if (region_dir_fd() >= 0)
        close(g_dir_fd);
    g_dir_fd = -1;
    if (still_ours(g_file_fd, g_dir_dev, g_file_ino))
        close(g_file_fd);
    g_file_fd = -1;
    /* Replace the shared mapping with private zero pages instead of
     * unmapping it: nothing in the child may reach the parent's region, and a
     * stray pointer into it must not fault. The child's new allocator gets a
     * region of its own at its first call. */
    mmap(r, sizeof *r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    atomic_store_explicit(&npa_region_current, NULL, memory_order_relaxed);
    int state = atomic_load_explicit(&g_state, memory_order_relaxed);
    atomic_store_explicit(&g_state, state == REGION_LIVE ? REGION_FORKED : REGION_OFF, memory_order_relaxed);
}
