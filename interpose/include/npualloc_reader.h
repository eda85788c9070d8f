/* Reading another process's stats region and posting it commands: the C side
 * of `npualloc stats/ls/empty-cache/...` and of the Python API's pid= calls
 * (libnpualloc_reader.so, loaded by npualloc/region.py through cffi).
 *
 * It exists for the memory ordering: the allocator publishes with C11
 * release stores and fences (core/internal.h's seqlock, region.c's command
 * slot), and only C atomics give the matching acquire loads on CPUs that
 * reorder loads, such as the aarch64 (Kunpeng) hosts of Ascend NPUs.
 * Everything between the cffi markers must stay parseable by cffi's cdef,
 * after npualloc_shm.h's section. */
#ifndef NPUALLOC_READER_H
#define NPUALLOC_READER_H

#include <stdint.h>

#include "npualloc_shm.h"

#pragma GCC visibility push(default)
/* cffi:begin */
/* What npualloc_reader_open found; the caller words each one for its user. */
#define NPUALLOC_OPEN_OK 0
#define NPUALLOC_OPEN_ERRNO 1          /* open(2) failed: .error (ENOENT, EACCES, ELOOP for a link ...) */
#define NPUALLOC_OPEN_NOT_REGULAR 2    /* a FIFO, device, directory ...: .mode, .uid; never read */
#define NPUALLOC_OPEN_OTHER_OWNER 3    /* the file's owner (.uid) is not the process's user */
#define NPUALLOC_OPEN_TRUNCATED 4      /* .size < sizeof(npualloc_region) */
#define NPUALLOC_OPEN_MAP_FAILED 5     /* fstat or mmap failed: .error */
#define NPUALLOC_OPEN_BAD_MAGIC 6
#define NPUALLOC_OPEN_BAD_VERSION 7    /* .version: another npualloc's layout */
#define NPUALLOC_OPEN_BAD_SIZE 8       /* .declared_size != sizeof(npualloc_region) */
#define NPUALLOC_OPEN_BAD_DEVICES 9    /* header.device_count > NPUALLOC_MAX_DEVICES */
#define NPUALLOC_OPEN_SHRANK 10        /* the file shrank while being opened (.size is what it had before) */
#define NPUALLOC_OPEN_TOO_MANY 11      /* NPUALLOC_READER_OPEN_MAX regions are open already: close one */
/* Regions a process may have open at once: each is guarded against its file
 * shrinking under the mapping (npualloc_reader_lost), in a fixed table. */
#define NPUALLOC_READER_OPEN_MAX 256

/* npualloc_reader_stats results. */
#define NPUALLOC_READ_OK 0
#define NPUALLOC_READ_BUSY 1           /* every attempt met a writer inside its seqlock */
#define NPUALLOC_READ_BAD_DEVICE 2
#define NPUALLOC_READ_LOST 3           /* the file shrank under the mapping (npualloc_reader_lost) */

/* npualloc_reader_post results. */
#define NPUALLOC_POST_OK 0
#define NPUALLOC_POST_READ_ONLY 1      /* the file was opened read-only */
#define NPUALLOC_POST_SEQ_EXHAUSTED 2  /* request_seq is at 2^64-1: no process counts that far */
#define NPUALLOC_POST_BUSY 3           /* the last command is not acknowledged yet: nothing was written */

/* One opened region file. The mapping covers exactly sizeof(npualloc_region)
 * bytes and exists only once every check passed. */
typedef struct npualloc_region_file {
    int32_t fd;                /* -1 once closed; the requesters' flock is taken on it */
    int32_t error;             /* errno of a failed open, fstat or mmap */
    uint32_t mode;             /* fstat: st_mode */
    uint32_t uid;              /* fstat: st_uid */
    int64_t size;              /* fstat: st_size */
    uint32_t version;          /* header.version found (NPUALLOC_OPEN_BAD_VERSION) */
    int32_t writable;
    uint64_t declared_size;    /* header.size found (NPUALLOC_OPEN_BAD_SIZE) */
    npualloc_region *region;   /* NULL unless NPUALLOC_OPEN_OK */
} npualloc_region_file;

/* Opens name in the directory dir_fd (AT_FDCWD: the current one; the
 * caller checked the directory) with O_NONBLOCK | O_NOFOLLOW, so a planted
 * FIFO cannot block us and a link cannot lead elsewhere; fstats the
 * descriptor before any read; then checks owner (owner_uid: the process's
 * user), magic and version (read first, so another layout's region is a
 * version mismatch, not a truncated file), size, header size and device
 * count, in that order.
 * Returns an NPUALLOC_OPEN_* code; on failure nothing stays open. */
int32_t npualloc_reader_open(int32_t dir_fd, const char *name, uint32_t owner_uid, int32_t writable,
                             npualloc_region_file *file);
/* Unmaps and closes; idempotent. */
void npualloc_reader_close(npualloc_region_file *file);
/* Whether the region file name in dir_fd, of that inode, is held by a
 * living process (its lock, region_lock.h), in whatever pid namespace: 1
 * held, 0 not (its process is gone, or it could take no lock), -1 when it
 * cannot be told (no such file, another file, not a regular one). Opened as
 * npualloc_reader_open opens. */
int32_t npualloc_reader_locked(int32_t dir_fd, const char *name, uint64_t inode);
/* Removes the name in dir_fd while it is the file (device, inode) the
 * caller checked, never one renamed over it since (unlink_checked.h): 0
 * removed, -1 not (gone, another file now, or no rename without replace). */
int32_t npualloc_reader_unlink_checked(int32_t dir_fd, const char *name, uint64_t device, uint64_t inode);
/* Whether the mount whose root mount_root is (an O_PATH descriptor of it)
 * may be another user's: 1 it may (another user's FUSE mount, or it cannot
 * be told), 0 not. Read from /proc/self alone, never asking the mounted
 * file system (the rule: interpose/src/mount_maker.h, as the interposer
 * judges an oom_snapshot path). */
int32_t npualloc_reader_mount_is_another_users(int32_t mount_root);

/* A consistent copy of one device's stats: copied between two reads of an
 * even, unchanged seq, at most `attempts` times (a yield between two). BUSY
 * when every attempt met a writer inside; *out is then unspecified. */
int32_t npualloc_reader_stats(const npualloc_region *region, int32_t device, uint32_t attempts,
                              npualloc_device_stats *out);
/* The same for one device's memory_saver figures (their own seqlock). */
int32_t npualloc_reader_saver_stats(const npualloc_region *region, int32_t device, uint32_t attempts,
                                    npualloc_saver_stats *out);
/* The same for the header's config text, into out's NPUALLOC_CONFIG_LEN
 * bytes, NUL-terminated. */
int32_t npualloc_reader_config(const npualloc_region *region, uint32_t attempts, char *out);
/* The same for the header's pause state (NPUALLOC_RUNNING, ...) with the
 * byte counts of that same state. */
int32_t npualloc_reader_pause_state(const npualloc_region *region, uint32_t attempts, npualloc_pause_state *out);

/* 1 once the region's file shrank under the mapping (its owner truncated it
 * after the checks): the access that found it read zeros instead of ending
 * the reader with SIGBUS, and nothing read from the mapping since means
 * anything. Check it after reading the header or any field directly. */
int32_t npualloc_reader_lost(const npualloc_region *region);

/* The sequence number of the last command posted to the process. */
uint64_t npualloc_reader_request_seq(const npualloc_region *region);
/* Stores code, device and arg, then publishes them by request_seq + 1 with
 * release ordering; *seq gets the new number. The caller serialises
 * requesters (flock on file->fd). NPUALLOC_POST_BUSY, writing nothing,
 * while the last command posted is unacknowledged (the process may be
 * reading its fields): wait for it, then post again. */
int32_t npualloc_reader_post(npualloc_region_file *file, int32_t code, int32_t device, double arg, uint64_t *seq);
/* Withdraws request seq unless the process took it already (npualloc_shm.h):
 * 1 when withdrawn (it will never be applied, and is acknowledged as
 * NPUALLOC_CMD_WITHDRAWN, so the next post is not BUSY), 0 when the process
 * took it (it is being applied: wait for its answer) or the file is
 * read-only. The caller serialises requesters, as for post. */
int32_t npualloc_reader_withdraw(npualloc_region_file *file, uint64_t seq);
/* 1 once the process acknowledged seq (ack_seq >= seq), *status then holds
 * its NPUALLOC_CMD_* answer; 0 while it has not. */
int32_t npualloc_reader_acked(const npualloc_region *region, uint64_t seq, int32_t *status);
/* cffi:end */
#pragma GCC visibility pop

#endif
