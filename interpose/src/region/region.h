/* The shared-memory stats region of this process (layout: npualloc_shm.h).
 * Created lazily on the first allocator call, removed at exit; a process that
 * never allocates leaves nothing behind. */
#ifndef NPUALLOC_REGION_H
#define NPUALLOC_REGION_H

#include <stdatomic.h>
#include <stdbool.h>
#include <sys/types.h>

#include "core.h"

/* Creates the region on first use (idempotent, thread-safe). NULL when
 * NPUALLOC_STATS=0 or creation failed (warned once); callers carry on. */
npualloc_region *npa_region_get(void);
/* Where the core should keep a device's stats: inside the region, or NULL. */
npualloc_device_stats *npa_region_device_stats(int device);
/* Where a device's threads keep their stat slots: inside the region, or NULL. */
npualloc_thread_stats *npa_region_thread_stats(int device);
/* Where saver.c publishes a device's memory_saver figures, or NULL. */
npualloc_saver_stats *npa_region_saver_stats(int device);
/* Records the config in force in a (its canonical text) in the header;
 * every change of it (creation, set_config, a command) comes here. */
void npa_region_publish_config(const npa_allocator *a);
/* Records the devices the runtime sees (count < 0: not known, left 0) in
 * the header, now or when the region is made. */
void npa_region_publish_device_count(int count);
/* The region once created; NULL before, after a fork, or when there is none. */
extern npualloc_region *_Atomic npa_region_current;

static inline int npa_region_command_pending(npualloc_region *r)
{
    return __atomic_load_n(&r->command.request_seq, __ATOMIC_RELAXED) !=
           __atomic_load_n(&r->command.ack_seq, __ATOMIC_RELAXED);
}

/* Request seq (seen in request_seq, acquire) closed for the process
 * (npualloc_shm.h): TAKEN, to apply and acknowledge; WITHDRAWN by its
 * requester, which acknowledged it: nothing to do; DAMAGED when closed_seq
 * was neither the request before nor this one nor a later one (a region
 * someone rewrote): acknowledge it as NPUALLOC_CMD_EINVAL unapplied. A
 * damaged slot is closed at seq, mended for the next request. */
typedef enum { NPA_COMMAND_TAKEN, NPA_COMMAND_WITHDRAWN, NPA_COMMAND_DAMAGED } npa_command_claim;

static inline npa_command_claim npa_region_take_command(npualloc_region *r, uint64_t seq)
{
    /* One compare-and-swap decides between the process and the requester's;
     * the fields were made visible by request_seq's acquire already. Not an
     * exchange: a process that stalled after seeing seq may come when its
     * requester has withdrawn seq and later requests too, and writing seq
     * back would reopen the last of them, to be taken and applied though its
     * requester was told it never would be. */
    uint64_t closed = seq - 1;
    if (__atomic_compare_exchange_n(&r->command.closed_seq, &closed, seq, 0, __ATOMIC_ACQUIRE, __ATOMIC_ACQUIRE))
        return NPA_COMMAND_TAKEN;
    /* The acquire pairs with the withdrawal's release: a later request
     * closed_seq names is seen in request_seq. */
    uint64_t requested = __atomic_load_n(&r->command.request_seq, __ATOMIC_RELAXED);
    if (closed - seq <= requested - seq) /* seq <= closed <= requested, in the counter's wrap-around */
        return NPA_COMMAND_WITHDRAWN;
    __atomic_store_n(&r->command.closed_seq, seq, __ATOMIC_RELAXED);
    return NPA_COMMAND_DAMAGED;
}

/* The process's answer to request seq: the status, then ack_seq with
 * release (the requester loads it with acquire before the status). */
static inline void npa_region_acknowledge(npualloc_region *r, uint64_t seq, int32_t status)
{
    __atomic_store_n(&r->command.ack_status, status, __ATOMIC_RELAXED);
    __atomic_store_n(&r->command.ack_seq, seq, __ATOMIC_RELEASE);
}

/* The pause state and its byte counts, which readers copy as one
 * (npualloc_reader_pause_state): under their seqlock, odd while they change.
 * Written only by the thread applying a pause (pause.c, under the command
 * lock): one writer. */
static inline void npa_region_publish_pause(npualloc_region *r, uint32_t state, uint64_t paused, uint64_t backup)
{
    npualloc_pause_state *p = &r->header.pause;
    uint64_t seq = __atomic_load_n(&p->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&p->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&p->state, state, __ATOMIC_RELAXED);
    __atomic_store_n(&p->paused_bytes, paused, __ATOMIC_RELAXED);
    __atomic_store_n(&p->backup_bytes, backup, __ATOMIC_RELAXED);
    __atomic_store_n(&p->seq, seq + 2, __ATOMIC_RELEASE);
}

/* NPUALLOC_CMD_PAUSE, applied by the thread that polls it (pause.c): the
 * process's device memory released, then waits for NPUALLOC_CMD_RESUME,
 * answering every other request itself; *seq becomes the resume's. */
int32_t npa_pause_command(npa_allocator *a, npualloc_region *r, uint64_t *seq);

/* Creates the region if it is due, applies a pending command. */
void npa_region_poll_slow(npa_allocator *allocator);

/* Called at every allocator entry, so it is inline: once the region exists
 * and no command waits (npa_region_steady), it costs three loads and no
 * call. Otherwise it creates the region, or applies the command and
 * acknowledges it. */
static inline int npa_region_steady(void)
{
    npualloc_region *r = atomic_load_explicit(&npa_region_current, memory_order_acquire);
    return r != NULL && !npa_region_command_pending(r);
}

static inline void npa_region_poll(npa_allocator *allocator)
{
    if (__builtin_expect(npa_region_steady(), 1))
        return;
    npa_region_poll_slow(allocator);
}
/* Opens this user's private region directory (region_dir.c), making it when
 * needed, and writes its path to path; a name another user took is warned
 * about once and replaced by a directory of our own. -1 with errno set when
 * no directory of ours can be had. */
int npa_region_dir_open(char *path, size_t len);
/* Where the users' region directories are: $NPUALLOC_SHM_DIR or /dev/shm. */
const char *npa_region_base(void);
/* Field 22 of /proc/<pid>/stat (pid 0: this process), the start time in
 * clock ticks since boot, and whether the process has exited: a zombie
 * (field 3, its main thread's state, Z or X) with no other thread (field
 * 20, the thread count, which counts that main thread: one that called
 * pthread_exit reads Z while the others run on, holding the descriptors).
 * 0, or the errno of the open (ENOENT: no such process) or EIO. */
int npa_process_start_time(pid_t pid, uint64_t *start_time, bool *exited);
/* Removes from the region directory dir_fd the regions of this user's
 * processes that ended without removing theirs (os._exit, a crash,
 * SIGKILL) (reap.c). */
void npa_region_reap(int dir_fd);
/* At exit: unlink the file, once a command being applied is acknowledged. */
void npa_region_remove(void);
/* In a forked child: forget the parent's region without touching its file. */
void npa_region_forget_after_fork(void);

#endif
