/* The allocator core: pure caching policy (torch-aligned pools, rounding,
 * split/merge, GC, OOM retry, stats) over a small backend interface. It knows
 * nothing of ACL symbols, dlsym or shared memory: the hook layer gives it a
 * backend over the real runtime, C unit tests give it a fake one, the bench's
 * hot path (tools/bench/hotpath.c, --allocator core) a no-op one. */
#ifndef NPUALLOC_CORE_H
#define NPUALLOC_CORE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "config.h"
#include "npualloc_shm.h"

/* For a helper of the hit path that several callers share (the exported
 * entries, the recent cache's removal): inlined whatever the compiler's size
 * heuristics say, which would otherwise keep it a call with its own frame. */
#define NPA_ALWAYS_INLINE inline __attribute__((always_inline))

typedef int npa_error; /* an aclError value: 0 success, 207001 OOM, ... */

#define NPA_OK 0
#define NPA_ERR_INVALID_PARAM 100000   /* ACL_ERROR_INVALID_PARAM */
#define NPA_ERR_OOM 207001             /* ACL_ERROR_RT_MEMORY_ALLOCATION */
#define NPA_ERR_FREE 207002            /* ACL_ERROR_RT_MEMORY_FREE */

/* One frame of a recorded stack: its source file, line and function. */
typedef void (*npa_frame_visitor)(const char *filename, int line, const char *name, void *arg);

/* What the core asks of the device. Every function gets the backend's ctx. */
typedef struct npa_backend {
    void *ctx;
    /* Raw device memory. raw_malloc returns 207001 when the device is full. */
    npa_error (*raw_malloc)(void *ctx, int device, size_t size, void **ptr);
    npa_error (*raw_free)(void *ctx, int device, void *ptr);
    /* Wait until all work queued on every stream of the device has finished.
     * An error means it may not have: nothing freed meanwhile is reused. */
    npa_error (*synchronize)(void *ctx, int device);
    /* Device free/total bytes, for the fraction cap and the OOM message. */
    npa_error (*mem_get_info)(void *ctx, int device, size_t *free_bytes, size_t *total_bytes);

    /* Stream-safe reuse, optional (NULL: every free is reusable at once).
     * fence_record puts into *fence a mark of "everything queued so far on
     * every live stream of the device". NPA_OK with *fence NULL: no fence is
     * needed (eager right now, or the device was synchronized instead). An
     * error: neither a fence nor a synchronize could be had, so the frees it
     * was asked for stay pending (retried at the next poll). */
    npa_error (*fence_record)(void *ctx, int device, void **fence);
    /* Optional: fence_record whatever the reuse policy says (which decides
     * reuse, not release): for memory that goes back to the device once the
     * fence completes. NULL: fence_record stands in. */
    npa_error (*fence_record_always)(void *ctx, int device, void **fence);
    /* Optional: a word that says whether a free made now needs a fence:
     * above 0 it does; 0 or below (eager right now) and the block is
     * reusable at once instead of waiting for the next poll. NULL: every
     * free needs one. Read at each plain free, sequentially consistent (the
     * hook's auto policy pairs it with a first stream's creation): a word,
     * not a call, as the answer is one load (the hook's: a constant 0 under
     * eager, its live stream count under auto), and an indirect call there
     * cost a malloc+free pair 9 instructions (callgrind, `make bench`'s
     * hot path). */
    const atomic_int *fence_needed;
    int (*fence_done)(void *ctx, void *fence); /* 1 complete, 0 not yet; never blocks */
    /* Optional, for blocks recorded on other streams (npa_record_stream):
     * a fence of one event on each of the count streams named (handles as
     * the stream-aware caller gave them), whatever the reuse policy. NPA_OK
     * with *fence NULL: the device was synchronized instead. An error: no
     * fence, the blocks stay pending (retried at the next poll). NULL: such
     * blocks wait for a synchronize of the device instead. */
    npa_error (*fence_record_streams)(void *ctx, int device, const uintptr_t *streams, size_t count, void **fence);
    void (*fence_release)(void *ctx, void *fence);

    /* Optional: tells the user of a setting the core refused (message
     * without prefix or newline); the hook prints it once on stderr. */
    void (*warn)(void *ctx, const char *message);
    /* Optional: the report of an OOM about to be returned (message without
     * prefix or newline), called without the device lock. The aclrtMalloc
     * caller gets only an error code, so this says why; the hook prints the
     * first few and num_ooms counts them all. NULL: not reported. */
    void (*report_oom)(void *ctx, int device, const char *message);

    /* Where the stats of a device live (the shared-memory region), optional:
     * NULL or a NULL result makes the core keep them in its own memory. */
    npualloc_device_stats *(*stats_storage)(void *ctx, int device);
    /* Where the NPUALLOC_THREAD_SLOTS stat slots of a device's threads live
     * (the region's, beside its stats), optional, as stats_storage. */
    npualloc_thread_stats *(*thread_stats_storage)(void *ctx, int device);

    /* Virtual memory, for expandable_segments:True; optional, all four or
     * none (NULL: plain segments only). va_reserve reserves size bytes of
     * device address space (no memory behind it); page_map backs [addr, addr
     * + size) of a reservation with new physical memory (207001 when the
     * device is full) and names it by *handle; page_unmap undoes one
     * page_map of [addr, addr + size) (unmap, then free the physical
     * memory), and on an error leaves it mapped as it was; va_release gives
     * back a reservation with nothing mapped. */
    npa_error (*va_reserve)(void *ctx, int device, size_t size, void **base);
    npa_error (*page_map)(void *ctx, int device, void *addr, size_t size, void **handle);
    npa_error (*page_unmap)(void *ctx, int device, void *addr, size_t size, void *handle);
    npa_error (*va_release)(void *ctx, int device, void *base);

    /* Stacks in history, optional, both or none. capture_stack names by an
     * id the stack of the calling thread's call under way (0: none: stacks
     * off, the backend took none for this call, or nothing to capture), the
     * same id however often asked during that call; the core asks it for
     * each event it records but a snapshot's (a malloc's segment, alloc and
     * OOM events, and frees completed during it, share the malloc's stack,
     * as torch's share its context), under the device lock, so it must not
     * call back into the allocator. visit_stack hands the frames of an id
     * to visit, innermost first (snapshots). */
    uint32_t (*capture_stack)(void *ctx);
    void (*visit_stack)(void *ctx, uint32_t stack, npa_frame_visitor visit, void *arg);

    /* Copies between device and host memory (synchronous), for pausing a
     * process (npa_pause); optional, both or neither. */
    npa_error (*copy_to_host)(void *ctx, int device, void *host, const void *dev, size_t size);
    npa_error (*copy_to_device)(void *ctx, int device, void *dev, const void *host, size_t size);
} npa_backend;

/* How a caller reached the allocator: each entry point has its own size contract. */
typedef enum npa_entry {
    NPA_ENTRY_MALLOC = 0,  /* aclrtMalloc / aclrtMallocCached: round up to 32, then +32 */
    NPA_ENTRY_ALIGN32 = 1, /* aclrtMallocAlign32: round up to 32 */
    NPA_ENTRY_EXACT = 2,   /* tests: the size as given */
} npa_entry;

typedef enum npa_free_result {
    NPA_FREE_OK = 0,        /* a live block of ours: freed (or queued until its fence completes) */
    NPA_FREE_NOT_OURS = 1,  /* not inside any segment of ours: forward to the runtime */
    NPA_FREE_INVALID = 2,   /* inside one of our segments but not a live block start */
} npa_free_result;

typedef struct npa_allocator npa_allocator;

/* Block and segment views for snapshots, valid only inside the visitor call. */
typedef enum npa_block_state {
    NPA_BLOCK_ACTIVE_ALLOCATED = 0,
    NPA_BLOCK_ACTIVE_PENDING_FREE = 1,
    NPA_BLOCK_INACTIVE = 2,
} npa_block_state;

typedef struct npa_block_view {
    uintptr_t address;
    size_t size;
    size_t requested_size;
    npa_block_state state;
} npa_block_view;

typedef struct npa_segment_view {
    int device;
    uintptr_t address;
    size_t total_size;
    size_t allocated_size;
    size_t active_size;
    size_t requested_size;
    int is_small; /* segment_type "small" else "large" */
    int is_expandable; /* one mapped run of an expandable segment (torch reports each run) */
    uintptr_t stream;  /* the stream whose pools hold it (npa_malloc_stream), 0 for aclrtMalloc's */
    size_t block_count;
    const npa_block_view *blocks;
} npa_segment_view;

typedef void (*npa_segment_visitor)(const npa_segment_view *segment, void *arg);

/* Trace events (history recording, torch's device_traces actions). */
typedef enum npa_trace_action {
    NPA_TRACE_ALLOC = 0,
    NPA_TRACE_FREE_REQUESTED = 1,
    NPA_TRACE_FREE_COMPLETED = 2,
    NPA_TRACE_SEGMENT_ALLOC = 3,
    NPA_TRACE_SEGMENT_FREE = 4,
    NPA_TRACE_OOM = 5,
    NPA_TRACE_SEGMENT_MAP = 6,   /* pages mapped into an expandable segment */
    NPA_TRACE_SEGMENT_UNMAP = 7, /* pages unmapped from one */
    NPA_TRACE_SNAPSHOT = 8,      /* a snapshot listed the segments: addr 0, size the active bytes it listed */
} npa_trace_action;

/* One event of a device's trace, valid only inside the visitor call. For
 * NPA_TRACE_OOM addr holds the device's free bytes (torch's device_free).
 * Sizes are torch's: the caller's request for alloc/free events, the rounded
 * request for an OOM, the whole segment for segment events, the pages'
 * range for map/unmap events. */
typedef struct npa_trace_view {
    int device;
    npa_trace_action action;
    uintptr_t addr;
    size_t size;
    int64_t time_us;         /* microseconds since the Unix epoch, as torch */
    uintptr_t stream;        /* the stream of the pool the block is in (npa_malloc_stream's), 0: none */
    uint32_t stack;          /* the backend's capture_stack id, 0: none */
    bool stack_in_trace;     /* false: recorded under record_context:state, for blocks and segments only */
} npa_trace_view;

typedef void (*npa_trace_visitor)(const npa_trace_view *entry, void *arg);

npa_allocator *npa_create(const npa_backend *backend, const npa_config *config);
/* Frees every cached segment; live blocks stay with the program (they are
 * returned to the runtime only by the runtime's own teardown). */
void npa_destroy(npa_allocator *a);

/* Size after the entry point's contract and torch rounding (what a block of
 * this request occupies). Pure; exposed for tests. */
size_t npa_entry_size(npa_entry entry, size_t size);
size_t npa_round_size(const npa_config *config, size_t size);

npa_error npa_malloc(npa_allocator *a, int device, size_t size, npa_entry entry, void **ptr);
/* hint_device: the caller's current device, looked at first. *device_out
 * (may be NULL) receives the block's device on NPA_FREE_OK. */
npa_free_result npa_free(npa_allocator *a, void *ptr, int hint_device, int *device_out);

/* The stream-aware entry (torch's allocator interface: malloc(size,
 * stream), free, record_stream). A block allocated on a stream comes from
 * that stream's own pools and, freed, goes straight back to them: the
 * stream runs in order, so whatever it runs next with the block runs after
 * the work that used it. Only a block recorded on other streams waits,
 * for one event per such stream. The caller promises torch's contract: the
 * block is used on its stream only, or the other streams are recorded.
 * stream: an opaque handle (0 is valid: the device's default stream). */
typedef enum npa_stream_flags {
    NPA_STREAM_ORDERED = 0,     /* every use of the block is ordered on its stream (torch's contract) */
    /* The caller may also write the block from the host (a synchronous
     * memcpy or memset, which no stream orders) as soon as it has it: a free
     * then waits for an event on the block's own stream too, so the block is
     * not handed out while work queued before the free may still read it. */
    NPA_STREAM_HOST_WRITES = 1,
} npa_stream_flags;
npa_error npa_malloc_stream(npa_allocator *a, int device, size_t size, npa_entry entry, uintptr_t stream,
                            npa_stream_flags flags, void **ptr);
/* Frees ptr, ordered on stream: a stream other than the block's own counts
 * as a use (as if recorded). A block of the plain entry freed here is
 * freed as npa_free frees it (the reuse policy's fences). */
npa_free_result npa_free_stream(npa_allocator *a, void *ptr, uintptr_t stream, int hint_device, int *device_out);
/* torch's record_stream: the live block at ptr is also used on stream, so
 * once freed it waits for the work queued there until the free. NPA_OK
 * (also for a block of the plain entry: its fences already cover every
 * stream), NPA_ERR_INVALID_PARAM when ptr is no live block of ours. Host
 * memory running out for the record makes the block's free wait for a
 * synchronize of the device instead. */
npa_error npa_record_stream(npa_allocator *a, void *ptr, uintptr_t stream, int hint_device);
/* Around the runtime's destroy of stream (which waits for the work queued
 * on it). retire, before it, sets the stream's pools aside (no allocation
 * from them again), makes other blocks' uses of the stream unknown (a
 * synchronize stands in for an event there) and returns this destroy's
 * token. destroyed(token), once the destroy succeeded, settles those uses,
 * gives what the set-aside pools cache back to the device, frees pools
 * nothing is left in and marks the others gone (their blocks go back as
 * they are freed, after a fence); not_destroyed(token), after a failed
 * destroy, gives the pools back to the stream, which lives on (its uses
 * stay unknown). */
uint64_t npa_stream_retire(npa_allocator *a, uintptr_t stream);
void npa_stream_destroyed(npa_allocator *a, uint64_t token);
void npa_stream_not_destroyed(npa_allocator *a, uint64_t token);

/* torch_npu's emptyCache, on one device (device < 0: all): synchronize the
 * device, hand back every pending free (so every block the program has freed
 * is released by this call), then give every cached unsplit segment and
 * every whole free page of expandable segments back to the device. Also
 * what aclrtResetDevice/aclFinalize get before the runtime tears down. A
 * device that cannot be synchronized keeps its pending frees and its cache
 * (nothing proves their work is done): the first such error is returned. */
npa_error npa_empty_cache(npa_allocator *a, int device);
/* Whether npa_empty_cache would synchronize the device now (pending frees,
 * or something to give back); false for a device with no state. A caller
 * may synchronize first with no lock held, so that the synchronize under
 * the device's lock, which other threads' mallocs and frees there wait
 * for, covers only what was queued meanwhile. */
bool npa_empty_cache_would_synchronize(npa_allocator *a, int device);
/* The same at exit, on the devices in the mask whose lock is free now (the
 * exiting thread may hold one, interrupted by a signal whose handler
 * exits): returns the mask of those it left, their locks taken. */
unsigned npa_empty_cache_unless_busy(npa_allocator *a, unsigned devices);
/* Drain pending frees whose fences completed (non-blocking). */
void npa_process_pending(npa_allocator *a, int device);

/* Stats: a consistent copy (largest_free_block filled in). */
void npa_get_stats(npa_allocator *a, int device, npualloc_device_stats *out);
void npa_reset_peak_stats(npa_allocator *a, int device);
void npa_reset_accumulated_stats(npa_allocator *a, int device);
/* Re-read a device's free memory from the runtime into its stats (the
 * figure `npualloc stats` shows; device < 0: every device) after memory
 * changed hands outside the cache: memory_saver's allocations, frees,
 * pauses and resumes. Takes each device lock; a device the allocator never
 * used is left alone. */
void npa_sample_device_memory(npa_allocator *a, int device);
/* The allocator stops writing the backend's stats storage: each device
 * keeps on in a copy of its own, and devices created later keep theirs. For
 * an allocator that stops serving while another may take over the storage
 * (a new runtime session's): each seqlock must have one writer, and two
 * allocators' devices have two locks and two section counts. */
void npa_detach_stats_storage(npa_allocator *a);
/* In a forked child: the parent's allocators are the parent's. No thread
 * of the child folds its caches back into one of them, which could wait
 * for a lock held by a thread that did not come along (core/tcache.c). */
void npa_forget_threads_after_fork(void);

/* Change the GC threshold at run time (0 turns GC off). -1, warned through
 * the backend, when a threshold is asked for while expandable segments are
 * on (torch_npu's rule). */
int npa_set_gc_threshold(npa_allocator *a, double threshold);
/* torch's set_per_process_memory_fraction, per device (created here if it
 * is not yet, as an allocation would, once the fraction is taken): growth
 * past fraction of the device's memory then fails as an OOM, while what is
 * reserved already stays, above the cap too; 1.0 takes the cap off. -1,
 * nothing changed (no device set up), for a fraction outside [0, 1], a bad
 * device, one of unknown size, or a cap below the smallest segment (2 MiB),
 * which would refuse everything. */
int npa_set_memory_fraction(npa_allocator *a, int device, double fraction);
/* expandable_segments at run time, as torch's _set_allocator_settings: how
 * pools grow from now on (pages mapped into one range per pool, or plain
 * segments); the segments already made stay as they are. -1, warned through
 * the backend and nothing changed, when on is refused: max_split_size_mb or
 * a GC threshold is in force (torch_npu's rule), or the backend has no VMM
 * calls. */
int npa_set_expandable_segments(npa_allocator *a, bool on);
const npa_config *npa_get_config(const npa_allocator *a);
/* Change record_history at run time: every device's trace restarts with room
 * for max_entries events (0 turns recording off). -1, with recording left
 * off everywhere, when host memory for the rings cannot be had. */
int npa_set_record_history(npa_allocator *a, size_t max_entries);
/* record_stacks and record_context at run time: the backend's
 * capture_stack honours them; the core keeps them for the config it reports. */
void npa_set_record_stacks(npa_allocator *a, bool on);
void npa_set_record_context(npa_allocator *a, npa_record_context context);

/* Counters only the hook layer sees, added to a device's stats (under its
 * lock, like every other stat, so readers of the region see them too). A
 * device with no state yet gets it only when make is set: making it asks
 * the backend for the device's memory. */
typedef enum npa_counter {
    NPA_COUNTER_EXECUTOR_DESTROYS_FORWARDED = 0, /* num_executor_destroys_forwarded */
    NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED = 1,   /* num_executor_destroys_skipped */
} npa_counter;
void npa_count(npa_allocator *a, int device, npa_counter counter, int64_t delta, bool make);

/* Visit every segment of a device (device < 0: all) under its lock. */
void npa_visit_segments(npa_allocator *a, int device, npa_segment_visitor visitor, void *arg);
/* Visit a device's recorded events (device < 0: all), oldest first, under its lock. */
void npa_visit_trace(npa_allocator *a, int device, npa_trace_visitor visitor, void *arg);

/* Pausing the whole allocator (`npualloc pause <pid>`): synchronizes every
 * device, copies every allocated block to host memory, unmaps every page of
 * every expandable segment (the addresses stay reserved), and returns with
 * the allocator's table lock and every device lock held, so any thread that
 * enters the allocator waits until npa_resume. Refused (nothing changed)
 * for a process with plain segments, without VMM or copy calls, or when
 * host memory for the backup cannot be had; a failure half way maps back
 * what it unmapped. When that cannot be mapped back (or refilled) the
 * error is returned with *paused set: it stays paused with its backup and
 * the locks held, as after a failed npa_resume, which must follow. Any
 * other error leaves *paused as it was. why (len bytes) gets a sentence
 * saying why. */
typedef struct npa_paused npa_paused;
npa_error npa_pause(npa_allocator *a, npa_paused **paused, char *why, size_t len);
/* The same re-read of every device's free memory, while `paused` holds the
 * device locks: once memory_saver's blocks were released (or some mapped
 * back by a resume that failed) too. */
void npa_paused_sample_device_memory(npa_allocator *a, const npa_paused *paused);
/* Maps new pages where pages were and copies the blocks back; on success
 * re-reads every device's free memory (memory_saver's blocks, resumed
 * first, included), releases the locks and frees paused. On failure (the device is full:
 * another process holds the memory) everything stays paused, the backup is
 * kept, and it can be called again. */
npa_error npa_resume(npa_allocator *a, npa_paused *paused, char *why, size_t len);
/* Device bytes released by the pause, and host bytes holding the backup. */
void npa_paused_bytes(const npa_paused *paused, size_t *unmapped, size_t *backup);

/* The snapshot torch.cuda.memory._snapshot() returns, {"segments",
 * "device_traces", "allocator_settings"}, as pickle protocol 2 bytes (no
 * globals: any unpickler loads it, memory_viz included). Each device is
 * read under one hold of its lock, so its segments and trace agree. config:
 * for allocator_settings when a is NULL (nothing allocated yet: empty lists).
 * A malloc'd buffer the caller frees, or NULL when host memory ran out. */
void *npa_snapshot_pickle(npa_allocator *a, const npa_config *config, size_t *size);

#endif
