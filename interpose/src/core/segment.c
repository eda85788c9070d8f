/* Segments: the device allocations behind the pools. Adding or removing one
 * is a raw backend call (slow anyway), so the table is a sorted array: binary
 * search for lookups, memmove for changes. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Index of the first segment whose base is above addr. */
static size_t upper_index(const npa_segment_table *t, uintptr_t addr) {
    size_t lo = 0, hi = t->count;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (t->items[mid].base <= addr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

npa_segment *npa_segments_add(npa_segment_table *t, uintptr_t base, size_t size, npa_block *first) {
    if (t->count == t->capacity) {
        size_t capacity = t->capacity ? t->capacity * 2 : 16;
        npa_segment *items = realloc(t->items, capacity * sizeof *items);
        if (!items) return NULL;
        t->items = items;
        t->capacity = capacity;
    }
    size_t i = upper_index(t, base);
    memmove(&t->items[i + 1], &t->items[i], (t->count - i) * sizeof *t->items);
    t->items[i] = (npa_segment){.base = base, .size = size, .first = first};
    t->count++;
    return &t->items[i];
}

void npa_segments_remove(npa_segment_table *t, size_t index) {
    memmove(&t->items[index], &t->items[index + 1], (t->count - index - 1) * sizeof *t->items);
    t->count--;
}

ptrdiff_t npa_segments_find(const npa_segment_table *t, uintptr_t addr) {
    size_t i = upper_index(t, addr);
    if (i == 0) return -1;
    const npa_segment *s = &t->items[i - 1];
    return addr - s->base < s->size ? (ptrdiff_t)(i - 1) : -1;
}

npa_block *npa_segment_alloc(npa_allocator *a, npa_device *d, size_t size, npa_pool *pool, npa_refusal *why) {
    bool is_small = pool->is_small;
    npualloc_device_stats *s = d->stats;
    size_t reserved = (size_t)s->reserved_bytes[NPUALLOC_POOL_ALL].current;
    why->cap_hit = d->limit_bytes && (size > d->limit_bytes || reserved > d->limit_bytes - size);
    if (why->cap_hit) return NULL;

    npa_block *b = npa_slab_get(&d->slab);
    if (!b) return NULL;
    void *ptr = NULL;
    npa_error err = a->backend.raw_malloc(a->backend.ctx, d->id, size, &ptr);
    if (err != NPA_OK || !ptr) {
        npa_refusal_note(why, err);
        npa_slab_put(&d->slab, b);
        return NULL;
    }
    b->addr = (uintptr_t)ptr;
    b->size = size;
    b->is_small = is_small;
    b->pool = pool;
    b->phase = NPA_PHASE_FREE;
    if (!npa_segments_add(&d->segments, b->addr, size, b)) {
        a->backend.raw_free(a->backend.ctx, d->id, ptr);
        npa_slab_put(&d->slab, b);
        return NULL;
    }

    npa_stats_begin(d);
    npa_pool_stat_increase(s->segment, is_small, 1);
    npa_pool_stat_increase(s->reserved_bytes, is_small, (int64_t)size);
    if (size >= a->config.max_split_size) npa_stat_increase(&s->oversize_segments, 1);
    npa_stat_add(&s->num_device_alloc, 1);
    npa_stats_end(d);
    npa_history_note(d, b->pool, NPA_TRACE_SEGMENT_ALLOC, b->addr, size);
    return b;
}

bool npa_segment_release(npa_allocator *a, npa_device *d, npa_block *b) {
    /* An expandable segment's pages go by npa_expandable_release_free. */
    if (b->phase != NPA_PHASE_FREE || npa_block_is_split(b) || b->in_expandable) return false;
    ptrdiff_t index = npa_segments_find(&d->segments, b->addr);
    if (index < 0) return false;

    npa_pool_remove(b->pool, b);
    npa_history_note(d, b->pool, NPA_TRACE_SEGMENT_FREE, b->addr, b->size);
    a->backend.raw_free(a->backend.ctx, d->id, (void *)b->addr);
    npa_segments_remove(&d->segments, (size_t)index);

    npualloc_device_stats *s = d->stats;
    npa_stats_begin(d);
    npa_pool_stat_decrease(s->segment, b->is_small, 1);
    npa_pool_stat_decrease(s->reserved_bytes, b->is_small, (int64_t)b->size);
    if (b->size >= a->config.max_split_size) npa_stat_decrease(&s->oversize_segments, 1);
    npa_stat_add(&s->num_device_free, 1);
    npa_stats_end(d);
    npa_slab_put(&d->slab, b);
    return true;
}

void npa_release_cached_segments(npa_allocator *a, npa_device *d, uint64_t only_retired_by) {
    /* Backwards, so removing entry i leaves the unvisited ones in place. */
    for (size_t i = d->segments.count; i-- > 0;) {
        if (only_retired_by && d->segments.items[i].first->pool->retired_by != only_retired_by) continue;
        if (d->segments.items[i].expandable) npa_expandable_release_free(a, d, i);
        else npa_segment_release(a, d, d->segments.items[i].first);
    }
}
