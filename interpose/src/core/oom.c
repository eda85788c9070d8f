/* The malloc path after a best-fit miss, step for step as torch:
 * (3) GC if a threshold is set, (4) a new segment or more pages for the
 * pool's expandable segment, (5) on failure free cached
 * oversize blocks and retry, (6) on failure synchronize, drain every pending
 * free, free every cached unsplit segment and retry; (7) report the OOM. */
#include <stdio.h>

#include "internal.h"

/* torch's release_available_cached_blocks: one cached oversize block big
 * enough for the request, else the largest ones until enough is freed.
 * Oversize blocks are never split, so each is a whole segment. */
static bool release_oversize_blocks(npa_allocator *a, npa_device *d, npa_pool *pool, size_t size) {
    size_t max_split = a->config.max_split_size;
    if (max_split == SIZE_MAX) return false;
    size_t key = size < max_split ? max_split : size;
    npa_block *b = npa_pool_lower_bound(pool, key);
    if (!b && !(pool->largest && pool->largest->size >= max_split)) return false; /* nothing to give back */
    /* A stream's free block may still be used by work queued on it (it was
     * reusable at once for that stream, not for the device), and aclrtFree
     * does not wait for it: synchronize first, as torch_npu's
     * release_available_cached_blocks does (npuSynchronizeDevice, not
     * counted in num_sync_all_streams), then give back this stream's
     * oversize blocks only, as torch. Skipping the step instead sent every
     * stream-aware caller with max_split_size_mb to step 6, which gives back
     * every cached segment of every stream and counts a retry. */
    if (pool->on_stream && a->backend.synchronize(a->backend.ctx, d->id) != NPA_OK) return false;
    if (b) return npa_segment_release(a, d, b);
    size_t released = 0;
    while (released < key && (b = pool->largest) && b->size >= max_split) {
        size_t block_size = b->size;
        if (!npa_segment_release(a, d, b)) break;
        released += block_size;
    }
    return released >= key;
}

/* Step 4: the pool's expandable segment grows by just what the request
 * needs (torch maps rounded bytes there, not a segment size), else a new
 * plain segment; a device that refuses address space gets plain ones.
 * expandable_segments is read afresh at each growth: set at run time, it
 * changes how the pool grows from then on, and the segments it already has,
 * of either kind, stay in it as they are (a pool may hold both). */
static npa_block *new_memory(npa_allocator *a, npa_device *d, npa_pool *pool, size_t rounded, npa_refusal *why) {
    if (npa_expandable_on(a) && !pool->vmm_refused) {
        npa_block *b = npa_expandable_alloc(a, d, pool, rounded, why);
        if (b || !pool->vmm_refused) return b;
    }
    return npa_segment_alloc(a, d, npa_segment_size(rounded), pool, why);
}

static npa_block *grow_steps(npa_allocator *a, npa_device *d, npa_pool *pool, size_t rounded, npa_refusal *why) {
    if (npa_gc_threshold(a) > 0.0) npa_gc(a, d);
    npa_block *b = new_memory(a, d, pool, rounded, why);
    if (b || why->error != NPA_OK) return b;
    if (release_oversize_blocks(a, d, pool, rounded) && (b = new_memory(a, d, pool, rounded, why))) return b;
    if (why->error != NPA_OK) return NULL;
    /* A device that cannot be synchronized keeps its pending frees (their
     * work may still run) and its cache: the retry then gets what it gets. */
    npa_tcaches_flush(d);
    if (npa_synchronize_and_drain(a, d) == NPA_OK) npa_release_cached_segments(a, d, 0);
    npa_stats_begin(d);
    npa_stat_add(&d->stats->num_alloc_retries, 1);
    npa_stats_end(d);
    return new_memory(a, d, pool, rounded, why);
}

npa_block *npa_grow(npa_allocator *a, npa_device *d, npa_pool *pool, size_t rounded, npa_refusal *why) {
    npa_block *b = grow_steps(a, d, pool, rounded, why);
    /* The device's free memory changed hands here (segments in, maybe some
     * out): re-read it so `npualloc stats` shows the live figure. Asking the
     * runtime, rather than adding up our own deltas, also counts other
     * processes and the runtime's own padding; it costs one query on a path
     * that has just made a raw allocation (tens of microseconds), and
     * nothing on a cache hit. An OOM samples in npa_oom_report instead. */
    if (b) npa_stats_sample_device_memory(a, d, NULL, NULL);
    return b;
}

/* The config key that would most likely have avoided this OOM. The last
 * raw malloc asked for a segment (rounded up: up to 20 MiB more than the
 * request) or pages, so a device reporting the rounded size free may still
 * have refused it: that is not a full device. */
static const char *oom_hint(bool cap_hit, size_t rounded, size_t allocated, size_t reserved, size_t device_free,
                            size_t device_total) {
    if (cap_hit) return "the per-process cap was hit: raise per_process_memory_fraction";
    if (device_total && rounded > device_total) return "the request is larger than the whole device";
    if (reserved - allocated >= rounded)
        return "reserved but unallocated memory is large (fragmentation): try max_split_size_mb";
    if (device_free >= rounded)
        return "the device refused the allocation though it reports that much free (the segment it would take "
               "is larger, or the runtime failed it): a smaller request may fit";
    return "the device itself is full: free tensors or lower the batch size";
}

void npa_oom_report(npa_allocator *a, npa_device *d, const npa_pool *pool, size_t requested, size_t rounded,
                    bool cap_hit, char *msg, size_t msg_len) {
    size_t free_bytes, total_bytes;
    npa_stats_sample_device_memory(a, d, &free_bytes, &total_bytes);
    npualloc_device_stats figures;
    npa_device_figures(d, &figures);
    size_t allocated = (size_t)figures.allocated_bytes[NPUALLOC_POOL_ALL].current;
    size_t reserved = (size_t)figures.reserved_bytes[NPUALLOC_POOL_ALL].current;

    /* torch's OOM event: the rounded size, and the device's free bytes as addr. */
    npa_history_note(d, pool, NPA_TRACE_OOM, (uintptr_t)free_bytes, rounded == SIZE_MAX ? requested : rounded);
    npa_stats_begin(d);
    npa_stat_add(&d->stats->num_ooms, 1);
    npa_stats_end(d);

    char cap[64] = "";
    if (d->limit_bytes) snprintf(cap, sizeof cap, ", per-process cap %zu bytes", d->limit_bytes);
    snprintf(msg, msg_len,
             "out of memory on device %d: requested %zu bytes (%zu after rounding); "
             "allocated %zu bytes, reserved %zu bytes (%zu reserved but unallocated), "
             "device free %zu of %zu bytes%s; %s",
             d->id, requested, rounded, allocated, reserved, reserved - allocated, free_bytes, total_bytes, cap,
             oom_hint(cap_hit, rounded, allocated, reserved, free_bytes, total_bytes));
}
