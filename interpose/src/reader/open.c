/* Opening another process's region file without trusting it: the descriptor
 * is checked before a byte is read, the header before the mapping is handed
 * out, and nothing here can block on what another user planted at the name. */
#define _GNU_SOURCE /* O_PATH (nomount.h), renameat2 (unlink_checked.h) */
#include "npualloc_reader.h"
#include "guard.h"
#include "mount_maker.h"
#include "nomount.h"
#include "region_lock.h"
#include "unlink_checked.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

static int32_t refuse(npualloc_region_file *file, int32_t code)
{
    npualloc_reader_close(file);
    return code;
}

/* The header is the other process's memory: one load per field, each read once. */
static int32_t check_header(npualloc_region_file *file)
{
    npualloc_region_header *h = &file->region->header;
    if (__atomic_load_n(&h->magic, __ATOMIC_RELAXED) != NPUALLOC_SHM_MAGIC)
        return NPUALLOC_OPEN_BAD_MAGIC;
    file->version = __atomic_load_n(&h->version, __ATOMIC_RELAXED);
    if (file->version != NPUALLOC_SHM_VERSION)
        return NPUALLOC_OPEN_BAD_VERSION;
    file->declared_size = __atomic_load_n(&h->size, __ATOMIC_RELAXED);
    if (file->declared_size != sizeof(npualloc_region))
        return NPUALLOC_OPEN_BAD_SIZE;
    if (__atomic_load_n(&h->device_count, __ATOMIC_RELAXED) > NPUALLOC_MAX_DEVICES)
        return NPUALLOC_OPEN_BAD_DEVICES;
    return NPUALLOC_OPEN_OK;
}

/* Magic, then version, read before the size is judged: every layout starts
 * with them, so another npualloc's region (of another size) is reported as an
 * incompatible version, not as truncated. A file too short to hold them is
 * left to the size check. */
static int32_t check_prefix(npualloc_region_file *file)
{
    npualloc_region_header prefix;
    const size_t length = offsetof(npualloc_region_header, config_seq);
    if (file->size < (off_t)length)
        return NPUALLOC_OPEN_OK;
    if (pread(file->fd, &prefix, length, 0) != (ssize_t)length)
        return NPUALLOC_OPEN_SHRANK;
    if (prefix.magic != NPUALLOC_SHM_MAGIC)
        return NPUALLOC_OPEN_BAD_MAGIC;
    file->version = prefix.version;
    return file->version == NPUALLOC_SHM_VERSION ? NPUALLOC_OPEN_OK : NPUALLOC_OPEN_BAD_VERSION;
}

int32_t npualloc_reader_open(int32_t dir_fd, const char *name, uint32_t owner_uid, int32_t writable,
                             npualloc_region_file *file)
{
    memset(file, 0, sizeof *file);
    file->writable = writable != 0;
    /* O_NONBLOCK: opening a FIFO planted at the name must not wait for a
     * writer (it is refused after the fstat); O_NOFOLLOW: nor may a link
     * lead to some other file; no mount crossed (EXDEV): a FUSE file system
     * mounted on the name after the caller read /proc/self/mountinfo could
     * keep the open waiting for ever. */
    file->fd =
        npa_openat_no_mount(dir_fd, name, (writable ? O_RDWR : O_RDONLY) | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
    if (file->fd < 0) {
        file->error = errno;
        return NPUALLOC_OPEN_ERRNO;
    }
    struct stat info;
    if (fstat(file->fd, &info) != 0) {
        file->error = errno;
        return refuse(file, NPUALLOC_OPEN_MAP_FAILED);
    }
    file->mode = info.st_mode;
    file->uid = info.st_uid;
    file->size = info.st_size;
    if (!S_ISREG(info.st_mode))
        return refuse(file, NPUALLOC_OPEN_NOT_REGULAR);
    /* A region is its process's user's file (0600): anything else was planted. */
    if (info.st_uid != owner_uid)
        return refuse(file, NPUALLOC_OPEN_OTHER_OWNER);
    int32_t verdict = check_prefix(file);
    if (verdict != NPUALLOC_OPEN_OK)
        return refuse(file, verdict);
    /* Mapping more than the file holds would fault on the first touch past its end. */
    if (info.st_size < (off_t)sizeof(npualloc_region))
        return refuse(file, NPUALLOC_OPEN_TRUNCATED);
    void *map = mmap(NULL, sizeof(npualloc_region), writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED,
                     file->fd, 0);
    if (map == MAP_FAILED) {
        file->error = errno;
        return refuse(file, NPUALLOC_OPEN_MAP_FAILED);
    }
    file->region = map;
    if (npa_reader_guard(map) != 0)
        return refuse(file, NPUALLOC_OPEN_TOO_MANY); /* before a byte of it is read */
    verdict = check_header(file);
    if (npualloc_reader_lost(map))
        verdict = NPUALLOC_OPEN_SHRANK;
    return verdict == NPUALLOC_OPEN_OK ? verdict : refuse(file, verdict);
}

void npualloc_reader_close(npualloc_region_file *file)
{
    if (file->region) {
        npa_reader_unguard(file->region);
        munmap(file->region, sizeof(npualloc_region));
        file->region = NULL;
    }
    if (file->fd >= 0)
        close(file->fd);
    file->fd = -1;
}

int32_t npualloc_reader_locked(int32_t dir_fd, const char *name, uint64_t inode)
{
    /* As npualloc_reader_open opens, read-only: a query takes no lock. */
    int fd = npa_openat_no_mount(dir_fd, name, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct stat info;
    int32_t locked =
        fstat(fd, &info) == 0 && S_ISREG(info.st_mode) && info.st_ino == inode ? npa_region_locked(fd) : -1;
    close(fd);
    return locked;
}

int32_t npualloc_reader_unlink_checked(int32_t dir_fd, const char *name, uint64_t device, uint64_t inode)
{
    return npa_unlink_checked(dir_fd, name, (dev_t)device, (ino_t)inode);
}

int32_t npualloc_reader_mount_is_another_users(int32_t mount_root)
{
    return npa_mount_is_another_users(mount_root) ? 1 : 0;
}
