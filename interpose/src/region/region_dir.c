/* The directory that holds this user's regions (and the snapshot files
 * written for a requester): <base>/npualloc-<euid>, base being
 * $NPUALLOC_SHM_DIR or /dev/shm.
 *
 * The base is writable by every user, so any name in it may have been taken
 * first by someone else: a file, a link, a FIFO or a directory of theirs.
 * Nothing is ever created or written through such a name. A directory is used
 * only when it is one (opened O_DIRECTORY|O_NOFOLLOW, so a link is never
 * followed), when fstat of that descriptor says it is ours and private (owner
 * euid, no access for group or others), and every file in it is opened
 * relative to that descriptor. Another user cannot rename or remove it (the
 * base is sticky) nor add anything to it (0700).
 *
 * When the name is taken, the process warns once, naming the owner, and keeps
 * its live stats in a directory of its own beside it:
 * <base>/npualloc-<euid>.XXXXXX (random, created with mkdir's O_EXCL
 * semantics; one left by an earlier process is reused), which readers find
 * the same way, checking it the same way (npualloc/region.py). */
#define _GNU_SOURCE
#include "region/region.h"
#include "hook/hook.h"
#include "nomount.h"

#include <dirent.h>
#include <stdbool.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#define FALLBACK_SUFFIX_LEN 6
#define FALLBACK_TRIES 64

/* The user name of uid from /etc/passwd, read directly rather than through
 * NSS, whose modules (LDAP, sssd) could block or load libraries inside the
 * host's first allocation. Empty when not found. */
static void user_name(uid_t uid, char *out, size_t len)
{
    out[0] = '\0';
    FILE *f = fopen("/etc/passwd", "re");
    if (!f)
        return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *uid_field = strchr(line, ':');
        uid_field = uid_field ? strchr(uid_field + 1, ':') : NULL;
        if (!uid_field)
            continue;
        char *end;
        unsigned long value = strtoul(uid_field + 1, &end, 10);
        if (end == uid_field + 1 || *end != ':' || value != (unsigned long)uid)
            continue;
        size_t n = (size_t)(strchr(line, ':') - line);
        if (n >= len)
            n = len - 1;
        memcpy(out, line, n);
        out[n] = '\0';
        break;
    }
    fclose(f);
}

static const char *kind_of(mode_t mode)
{
    return S_ISLNK(mode) ? "a symbolic link" : S_ISDIR(mode) ? "a directory" : S_ISFIFO(mode) ? "a FIFO"
           : S_ISREG(mode) ? "a file" : "a special file";
}

/* Opens name in base if it is a private directory of ours. Otherwise -1,
 * and *seen says what is there (st_mode 0 when nothing is, or lstat failed);
 * errno EXDEV: a file system is mounted on the name, and neither it nor
 * anything in it was asked a thing. Another user may squat the name with a
 * directory of theirs and mount a FUSE file system on it whose server never
 * answers: an open or stat of it waited for ever, and with it the first
 * allocation of every process of ours (found by an audit on 2026-11-26). */
static int open_private_dir(int base_fd, const char *name, struct stat *seen)
{
    memset(seen, 0, sizeof *seen);
    int fd = npa_openat_no_mount(base_fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0);
    if (fd < 0) {
        int err = errno;
        if (err == EXDEV || npa_lstatat_no_mount(base_fd, name, seen) != 0) {
            if (errno == EXDEV)
                err = EXDEV; /* mounted meanwhile */
            memset(seen, 0, sizeof *seen);
        }
        errno = err;
        return -1;
    }
    if (fstat(fd, seen) != 0 || seen->st_uid != geteuid() || (seen->st_mode & 077) != 0) {
        close(fd);
        errno = EPERM;
        return -1;
    }
    return fd;
}

/* mkdirat's mode passes through the umask, which may cut the owner's own
 * bits too: umask 0477 left 0300, which even we cannot open to read, so no
 * region was ever made, and each later process met the same directory. Sets
 * 0700 on name when it is a directory of ours open to nobody else, through an
 * O_PATH descriptor (which needs no permission on it) named as
 * /proc/self/fd/N, so the chmod reaches that very directory, never what a link
 * put at the name points at: glibc's fchmodat(AT_SYMLINK_NOFOLLOW) does the
 * same, from 2.32 only. Without /proc the bits stay as they are. */
static void restore_owner_bits(int base_fd, const char *name)
{
    int fd = npa_openat_no_mount(base_fd, name, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0)
        return;
    struct stat st;
    if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && (st.st_mode & 077) == 0 &&
        (st.st_mode & 0700) != 0700) {
        char path[40];
        snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
        (void)chmod(path, 0700); /* a failure shows in open_private_dir */
    }
    close(fd);
}

static void warn_taken(const char *base, const char *name, const struct stat *seen, bool mounted)
{
    if (mounted) {
        npa_warn_once("%s/%s has a file system mounted on it (never entered), not this process's region "
                      "directory: its live stats go to a directory of its own beside it", base, name);
        return;
    }
    char owner[64];
    user_name(seen->st_uid, owner, sizeof owner);
    const char *why = seen->st_uid != geteuid()   ? ""
                      : (seen->st_mode & 077) != 0 ? " (ours, but open to group or others)"
                                                   : " (ours, but its owner's bits cut and /proc not there to restore them)";
    npa_warn_once("%s/%s is %s owned by uid %u%s%s%s%s, not this process's region directory: its live stats go to "
                  "a directory of its own beside it",
                  base, name, kind_of(seen->st_mode), (unsigned)seen->st_uid, owner[0] ? " (" : "", owner,
                  owner[0] ? ")" : "", why);
}

/* One of ours left by an earlier process whose name was taken too. */
static int reuse_fallback(int base_fd, const char *prefix, char *name, size_t len)
{
    int list_fd = dup(base_fd);
    DIR *dir = list_fd < 0 ? NULL : fdopendir(list_fd);
    if (!dir) {
        if (list_fd >= 0)
            close(list_fd);
        return -1;
    }
    size_t prefix_len = strlen(prefix);
    int fd = -1;
    for (struct dirent *e; fd < 0 && (e = readdir(dir)) != NULL;) {
        if (strncmp(e->d_name, prefix, prefix_len) != 0 || strlen(e->d_name) != prefix_len + FALLBACK_SUFFIX_LEN ||
            strlen(e->d_name) >= len)
            continue;
        struct stat seen;
        fd = open_private_dir(base_fd, e->d_name, &seen);
        if (fd >= 0)
            strcpy(name, e->d_name);
    }
    closedir(dir);
    return fd;
}

static int make_fallback(int base_fd, const char *prefix, char *name, size_t len)
{
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    for (int attempt = 0; attempt < FALLBACK_TRIES; attempt++) {
        unsigned char random_bytes[FALLBACK_SUFFIX_LEN];
        if (getrandom(random_bytes, sizeof random_bytes, 0) != (ssize_t)sizeof random_bytes)
            return -1;
        char suffix[FALLBACK_SUFFIX_LEN + 1];
        for (int i = 0; i < FALLBACK_SUFFIX_LEN; i++)
            suffix[i] = alphabet[random_bytes[i] % (sizeof alphabet - 1)];
        suffix[FALLBACK_SUFFIX_LEN] = '\0';
        if ((size_t)snprintf(name, len, "%s%s", prefix, suffix) >= len) {
            errno = ENAMETOOLONG;
            return -1;
        }
        if (mkdirat(base_fd, name, 0700) != 0) {
            if (errno == EEXIST)
                continue; /* taken too: draw again */
            return -1;
        }
        restore_owner_bits(base_fd, name);
        struct stat seen;
        return open_private_dir(base_fd, name, &seen);
    }
    errno = EEXIST;
    return -1;
}

const char *npa_region_base(void)
{
    const char *base = getenv("NPUALLOC_SHM_DIR");
    return base && *base ? base : "/dev/shm";
}

int npa_region_dir_open(char *path, size_t len)
{
    const char *base = npa_region_base();
    /* The base itself may be a link (/dev/shm -> /run/shm on some systems):
     * it is the administrator's, or the user's own choice. */
    int base_fd = open(base, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (base_fd < 0)
        return -1;
    char name[64], prefix[sizeof name + 1]; /* room for name and its dot, as the compiler checks */
    snprintf(name, sizeof name, "npualloc-%u", (unsigned)geteuid());
    snprintf(prefix, sizeof prefix, "%s.", name);
    (void)mkdirat(base_fd, name, 0700); /* EEXIST: made by an earlier process (or taken) */
    restore_owner_bits(base_fd, name);  /* also mends one an earlier build left cut */
    struct stat seen;
    int fd = open_private_dir(base_fd, name, &seen);
    bool mounted = fd < 0 && errno == EXDEV;
    if (fd < 0 && (seen.st_mode != 0 || mounted)) {
        warn_taken(base, name, &seen, mounted);
        fd = reuse_fallback(base_fd, prefix, name, sizeof name);
        if (fd < 0)
            fd = make_fallback(base_fd, prefix, name, sizeof name);
    }
    int err = errno;
    close(base_fd);
    if (fd >= 0 && (size_t)snprintf(path, len, "%s/%s", base, name) >= len) {
        close(fd);
        fd = -1;
        err = ENAMETOOLONG;
    }
    errno = err;
    return fd;
}
