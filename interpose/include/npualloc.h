/* npualloc's in-process C API, exported by libnpualloc.so beside the ACL
 * symbols it interposes. The Python package calls these (cffi ABI mode) when it
 * runs inside a preloaded process; other processes read the shared-memory
 * region instead (npualloc_shm.h). Every function is safe to call before the
 * allocator has seen its first allocation. */
#ifndef NPUALLOC_H
#define NPUALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "npualloc_shm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* cffi:begin */
/* 1 when calls are being served by the caching allocator (not disabled). */
int npualloc_is_active(void);
/* A consistent copy of one device's stats; returns 0, or -1 for a bad device. */
int npualloc_get_stats(int device, npualloc_device_stats *out);
void npualloc_empty_cache(int device);          /* device < 0: every device */
void npualloc_reset_peak_stats(int device);
void npualloc_reset_accumulated_stats(int device);
/* The config in force, canonical "key:value,..." text; returns its length. */
size_t npualloc_get_config(char *buf, size_t len);
/* Applies the keys that can change at run time (garbage_collection_threshold,
 * record_history, record_stacks, record_context, expandable_segments: how
 * pools grow from now on, the segments already made staying as they are);
 * returns the number of rejected keys (each warned once). */
int npualloc_set_config(const char *text);
/* garbage_collection_threshold at run time, 0 turning GC off (which a config
 * string cannot say: torch's parser refuses 0); returns 0, or -1 when refused
 * (out of [0, 1), or beside expandable_segments: warned once). */
int npualloc_set_gc_threshold(double threshold);
/* torch.cuda.set_per_process_memory_fraction(fraction, device): from now on
 * the device's reserved memory grows only up to fraction of its memory
 * (what is reserved already stays, above it too; 1.0: no cap). The allocator
 * is made now if it is not yet. Returns 0, or -1 when refused (fraction
 * outside [0, 1], a device the runtime does not answer for, a cap below
 * 2 MiB: warned once, nothing changed). */
int npualloc_set_memory_fraction(double fraction, int device);
/* aclrtGetMemInfo(ACL_HBM_MEM) for a device, through the real runtime; an aclError. */
int npualloc_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);
/* The devices the runtime sees (aclrtGetDeviceCount), -1 when it cannot say:
 * torch raises for a device index past them, and the Python API does too. */
int npualloc_device_count(void);
/* The device current on the calling thread, as its allocations see it: what
 * npualloc tracks, else (none set through it yet, or forgotten at a reset,
 * which leaves a device current while references remain) the runtime's
 * answer; -1 if none. */
int npualloc_current_device(void);
/* The memory snapshot torch.cuda.memory._snapshot() returns ({"segments",
 * "device_traces", "allocator_settings"}), as pickle protocol 2 bytes that use
 * no globals; device_traces hold events only while record_history is on.
 * Returns a buffer of *size bytes to release with npualloc_free_snapshot, or
 * NULL when host memory ran out. */
void *npualloc_snapshot(size_t *size);
void npualloc_free_snapshot(void *snapshot);
/* The memory saver (npualloc.memory_saver, torch_memory_saver's API). From
 * now on the calling thread's allocations are pausable and carry tag (NULL:
 * ordinary again); with enable_cpu_backup a pause copies them to host memory
 * and resume brings the contents back. 0, or -1 when the tag is 64 bytes or
 * longer. Tags are names, not slots: any number may be used over a run. */
int npualloc_saver_region(const char *tag, int enable_cpu_backup);
/* Pause: synchronize, back up, then unmap and free the physical memory of
 * the tag's allocations (NULL: every tag), keeping their addresses. Resume:
 * map new physical memory at the same addresses and restore the backups. 0,
 * or an aclError with the reason, a sentence, in why (why_len bytes). */
int npualloc_saver_pause(const char *tag, char *why, size_t why_len);
int npualloc_saver_resume(const char *tag, char *why, size_t why_len);
/* Bytes of the tag's pausable allocations (NULL: every tag): all of them,
 * the paused ones, and the host backups held; an out pointer that is NULL
 * is left out. */
int npualloc_saver_bytes(const char *tag, size_t *allocated, size_t *paused, size_t *backup);
/* The saver's figures for one device (as the region publishes them): 0, or
 * -1 for a device out of range. */
int npualloc_get_saver_stats(int device, npualloc_saver_stats *out);
/* The stream-aware entry, for callers that know the stream of each
 * allocation (torch's allocator interface: malloc(size, stream), free,
 * record_stream; MindTorch's pass-through uses it). Sizes, device (the
 * calling thread's current one) and errors are aclrtMalloc's. A block
 * freed on the stream it was allocated on is reusable at once, for that
 * stream only: the caller promises it is used on that stream alone, or
 * names the other streams with npualloc_record_stream; those frees wait for
 * one event per such stream, per batch of frees. A free ordered on another
 * stream counts as a use of it. aclrtMalloc/aclrtFree callers keep
 * reuse_policy's fences. flags: 0, or NPUALLOC_STREAM_HOST_WRITES when the
 * caller may write a new block from the host (aclrtMemcpy, aclrtMemset: no
 * stream orders those) before the stream's earlier work is done: then its
 * free also waits for an event on its own stream. */
#define NPUALLOC_STREAM_HOST_WRITES 1
int npualloc_malloc_stream(void **ptr, size_t size, void *stream, int flags);
int npualloc_free_stream(void *ptr, void *stream);
/* 0, or ACL_ERROR_INVALID_PARAM (100000) when ptr is no live allocation of
 * npualloc's (warned once). */
int npualloc_record_stream(void *ptr, void *stream);
/* npualloc_malloc_stream and npualloc_free_stream with addresses as
 * integers, same contract, for bindings where making a pointer argument
 * costs about as much as the call (cffi: ffi.new for the result and
 * ffi.cast for each pointer, 0.1-0.2 us each; the MindTorch pass-through
 * calls these on every tensor). The malloc returns the block's address, or
 * 0 when it fails: npualloc_malloc_stream_error() then gives the aclError
 * (it is the calling thread's last npualloc_malloc_stream_addr's, 0 after
 * a success). */
uintptr_t npualloc_malloc_stream_addr(size_t size, uintptr_t stream, int flags);
int npualloc_malloc_stream_error(void);
int npualloc_free_stream_addr(uintptr_t ptr, uintptr_t stream);
/* torch.cuda.caching_allocator_alloc(size, device, stream): the stream
 * entry (npualloc_malloc_stream, NPUALLOC_STREAM_HOST_WRITES) on device,
 * under torch's device guard: the calling thread's current device is the
 * same afterwards (a thread that had none is left on device), and device
 * stays initialised, as torch_npu's guard leaves it. Size 0 gives NULL, as
 * torch's. 0, or an aclError (ACL_ERROR_INVALID_PARAM for a device out of
 * 0..NPUALLOC_MAX_DEVICES-1). */
int npualloc_caching_allocator_alloc(void **ptr, size_t size, int device, void *stream);
/* torch.cuda.caching_allocator_delete(ptr): frees a live block of npualloc's
 * on the stream it was allocated on (no stream named; from any thread and
 * device). NULL is a no-op. 0, or ACL_ERROR_RT_MEMORY_FREE (207002) when ptr
 * is no live block of npualloc's: nothing is freed, never handed to the
 * runtime (inside npualloc's memory it counts as an invalid free), before
 * the process's first allocation too (a forked child's). With the cache off
 * (NPUALLOC_DISABLE, after aclFinalize), the runtime's aclrtFree and its
 * answer, as the allocation was the runtime's. */
int npualloc_caching_allocator_delete(void *ptr);
/* cffi:end */

#ifdef __cplusplus
}
#endif

#endif
