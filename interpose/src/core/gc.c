/* torch's garbage_collect_cached_blocks: when reserved memory passes
 * threshold * allowed, free whole cached large-pool segments whose age (pool
 * searches since they were cached) is at least the average, pass after pass
 * with the average of what is left, until enough is reclaimed. It frees only
 * idle cached memory, so it never synchronizes. */
#include "internal.h"

static uint64_t age_of(const npa_device *d, const npa_block *b) { return d->plain.large.search_count - b->age_base; }

/* Expandable segments are left to the OOM path and empty_cache, which unmap
 * their free pages after a synchronize (GC never synchronizes), and so are
 * the pools of streams: their free blocks were reusable at once for their
 * stream, so work queued there may still use them. */
static bool collectable(const npa_block *b) {
    return !b->is_small && b->phase == NPA_PHASE_FREE && !npa_block_is_split(b) && !b->in_expandable &&
           !b->pool->on_stream;
}

void npa_gc(npa_allocator *a, npa_device *d) {
    double threshold = npa_gc_threshold(a);
    if (threshold <= 0.0 || d->allowed_bytes == 0) return;
    size_t limit = (size_t)(threshold * (double)d->allowed_bytes);
    size_t reserved = (size_t)d->stats->reserved_bytes[NPUALLOC_POOL_ALL].current;
    if (reserved <= limit) return;
    size_t target = reserved - limit;

    uint64_t total_age = 0;
    size_t count = 0;
    for (size_t i = 0; i < d->segments.count; i++) {
        const npa_block *b = d->segments.items[i].first;
        if (collectable(b)) {
            total_age += age_of(d, b);
            count++;
        }
    }

    size_t reclaimed = 0;
    bool freed_any = true;
    while (reclaimed < target && freed_any && count > 0) {
        double age_threshold = (double)total_age / (double)count;
        freed_any = false;
        /* Every block at or above the average goes in this pass, even past
         * the target, so GC does not fire again right away (as torch). */
        for (size_t i = d->segments.count; i-- > 0;) {
            npa_block *b = d->segments.items[i].first;
            if (!collectable(b) || (double)age_of(d, b) < age_threshold) continue;
            uint64_t age = age_of(d, b);
            size_t size = b->size;
            if (!npa_segment_release(a, d, b)) continue;
            reclaimed += size;
            total_age -= age;
            count--;
            freed_any = true;
        }
    }
}
