/* Expandable segments (expandable_segments:True), torch's answer to
 * fragmentation. Instead of segments sized for the request that created
 * them, a pool owns one reserved range of address space and maps pages of
 * physical memory at the end of what it uses, so the free block at the end
 * grows into a bigger one rather than a new segment beside it. Free pages
 * are unmapped when memory is short or the cache is emptied (the caller
 * synchronizes first: unmapping does not wait for queued work).
 *
 * Each pool of each device (the plain pools and each stream's,
 * npa_malloc_stream) reserves a range of 1 1/8 of the device or its cap
 * when it first grows, and another, as torch's find_expandable_block, when
 * none of its ranges has room for a request (their free space only in
 * pieces); a range with nothing mapped goes back when the cache is
 * released. Stats
 * follow torch: reserved_bytes moves with mapped bytes, and the segment and
 * inactive_split stats leave expandable segments out; num_device_alloc and
 * num_device_free count pages (one physical allocation each) where torch
 * counts map and unmap calls, so that they match the runtime's count of
 * physical allocations and balance once everything is unmapped. */
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

/* A reservation of 1 1/8 of the memory the device allows, as torch_npu:
 * pages unmapped in the middle (after an OOM) can leave holes too small for
 * a request, which then needs room past them. NULL with vmm_refused set when
 * the device refuses; NULL alone when host memory ran out. */
static npa_expandable *reserve(npa_allocator *a, npa_device *d, npa_pool *pool) {
    size_t page_size = pool->is_small ? NPA_SMALL_BUFFER : NPA_LARGE_BUFFER;
    if (d->allowed_bytes == 0) npa_stats_sample_device_memory(a, d, NULL, NULL); /* the size, if it can tell now */
    size_t allowed = d->allowed_bytes;
    if (allowed == 0) { /* the device's size is unknown: nothing to size the range by */
        pool->vmm_refused = true;
        return NULL;
    }
    size_t wanted = allowed + allowed / 8;
    size_t page_count = wanted / page_size + (wanted % page_size != 0);
    npa_expandable *es = calloc(1, sizeof *es);
    void **pages = calloc(page_count, sizeof *pages);
    npa_block *whole = npa_slab_get(&d->slab);
    void *base = NULL;
    if (!es || !pages || !whole) goto fail;
    if (a->backend.va_reserve(a->backend.ctx, d->id, page_count * page_size, &base) != NPA_OK || !base) {
        pool->vmm_refused = true;
        goto fail;
    }
    whole->addr = (uintptr_t)base;
    whole->size = page_count * page_size;
    whole->is_small = pool->is_small;
    whole->pool = pool;
    whole->in_expandable = true;
    whole->phase = NPA_PHASE_UNMAPPED;
    npa_segment *seg = npa_segments_add(&d->segments, whole->addr, whole->size, whole);
    if (!seg) {
        a->backend.va_release(a->backend.ctx, d->id, base);
        goto fail;
    }
    seg->expandable = es;
    *es = (npa_expandable){.base = whole->addr, .page_size = page_size, .page_count = page_count, .pages = pages};
    return es;
fail:
    free(es);
    free(pages);
    if (whole) npa_slab_put(&d->slab, whole);
    return NULL;
}

static void release_range(npa_allocator *a, npa_device *d, size_t index) {
    npa_segment *seg = &d->segments.items[index];
    npa_expandable *es = seg->expandable;
    npa_block *whole = seg->first;
    a->backend.va_release(a->backend.ctx, d->id, (void *)es->base);
    npa_segments_remove(&d->segments, index);
    npa_slab_put(&d->slab, whole);
    npa_expandable_forget(es);
}

static bool allocatable(const npa_block *b) {
    return b && (b->phase == NPA_PHASE_FREE || b->phase == NPA_PHASE_UNMAPPED);
}

static bool has_room(const npa_block *b, size_t size) {
    size_t bytes = 0;
    for (; bytes < size && allocatable(b); b = b->next) bytes += b->size;
    return bytes >= size;
}

/* torch's find_expandable_block: the lowest unmapped stretch (with the free
 * block before it) where free and unmapped space together fit size; the
 * lowest address keeps the segment one block as it refills. */
static npa_block *find_candidate(npa_block *first, size_t size) {
    for (npa_block *u = first; u; u = u->next) {
        if (u->phase != NPA_PHASE_UNMAPPED) continue;
        npa_block *c = allocatable(u->prev) ? u->prev : u;
        if (has_room(c, size)) return c;
    }
    return NULL;
}

/* Unmaps page i; one the runtime refuses to release stays mapped, its
 * handle kept (the backend's contract: an error changes nothing), and is
 * used again by the next map_pages over it. */
static bool unmap_page(npa_allocator *a, npa_device *d, npa_expandable *es, size_t i) {
    npa_error err = a->backend.page_unmap(a->backend.ctx, d->id, (void *)(es->base + i * es->page_size),
                                          es->page_size, es->pages[i]);
    if (err == NPA_OK) {
        es->pages[i] = NULL;
        return true;
    }
    if (a->backend.warn) {
        char message[160];
        snprintf(message, sizeof message, "releasing a %zu-byte page of device %d failed (error %d): it stays mapped",
                 es->page_size, d->id, err);
        a->backend.warn(a->backend.ctx, message);
    }
    return false;
}

/* Maps pages [begin, end): all or none (the error of the map that failed).
 * A page still mapped (its release was refused) is already there; one
 * whose undo is refused stays mapped too, inside the unmapped block, until
 * npa_expandable_release_free. */
static npa_error map_pages(npa_allocator *a, npa_device *d, npa_expandable *es, size_t begin, size_t end) {
    for (size_t i = begin; i < end; i++) {
        void *addr = (void *)(es->base + i * es->page_size);
        npa_error err = es->pages[i] ? NPA_OK : a->backend.page_map(a->backend.ctx, d->id, addr, es->page_size,
                                                                     &es->pages[i]);
        if (err == NPA_OK) continue;
        es->pages[i] = NULL;
        while (i-- > begin) unmap_page(a, d, es, i);
        return err;
    }
    return NPA_OK;
}

/* torch's map_block: maps the pages covering the first size bytes of the
 * unmapped block u, merges them with free neighbours and puts the result in
 * the pool; NULL when the cap or the device refused. */
static npa_block *map_block(npa_allocator *a, npa_device *d, npa_expandable *es, npa_block *u, size_t size,
                            npa_refusal *why) {
    size_t pages = (size + es->page_size - 1) / es->page_size;
    size_t bytes = pages * es->page_size; /* u spans whole pages, so bytes <= u->size */
    npa_block *rest = bytes < u->size ? npa_slab_get(&d->slab) : NULL;
    if (bytes < u->size && !rest) return NULL;
    size_t begin = (u->addr - es->base) / es->page_size;
    npa_error err = map_pages(a, d, es, begin, begin + pages);
    if (err != NPA_OK) {
        npa_refusal_note(why, err);
        if (rest) npa_slab_put(&d->slab, rest);
        return NULL;
    }
    uintptr_t addr = u->addr;
    if (rest) {
        *rest = (npa_block){.addr = u->addr + bytes, .size = u->size - bytes, .prev = u, .next = u->next,
                            .phase = NPA_PHASE_UNMAPPED, .is_small = u->is_small, .pool = u->pool,
                            .in_expandable = true};
        if (u->next) u->next->prev = rest;
        u->next = rest;
        u->size = bytes;
    }
    u->phase = NPA_PHASE_FREE;
    npa_pool *pool = u->pool;
    npa_block *b = u;
    if (b->prev && b->prev->phase == NPA_PHASE_FREE) {
        b = b->prev;
        npa_pool_remove(pool, b);
        npa_block_absorb(d, b, u);
    }
    if (b->next && b->next->phase == NPA_PHASE_FREE) {
        npa_pool_remove(pool, b->next);
        npa_block_absorb(d, b, b->next);
    }
    npualloc_device_stats *s = d->stats;
    npa_stats_begin(d);
    npa_pool_insert(pool, b);
    npa_pool_stat_increase(s->reserved_bytes, b->is_small, (int64_t)bytes);
    npa_stat_add(&s->num_device_alloc, (int64_t)pages);
    npa_stats_end(d);
    npa_history_note(d, pool, NPA_TRACE_SEGMENT_MAP, addr, bytes);
    return b;
}

npa_block *npa_expandable_alloc(npa_allocator *a, npa_device *d, npa_pool *pool, size_t size, npa_refusal *why) {
    /* torch's alloc_block checks the per-process cap before it grows, on the
     * request's allocation size (the plain segment it would take), not on
     * the pages it then maps: a request the cap admits may map past it, and
     * one it refuses is refused even when a page or two would do. */
    size_t want = npa_segment_size(size);
    size_t reserved = (size_t)d->stats->reserved_bytes[NPUALLOC_POOL_ALL].current;
    why->cap_hit = d->limit_bytes && (want > d->limit_bytes || reserved > d->limit_bytes - want);
    if (why->cap_hit) return NULL;
    npa_expandable *es = NULL;
    npa_block *c = NULL;
    /* torch walks the pool's unmapped blocks in address order: the ranges
     * in the segment table's order, each range's blocks in its own. */
    for (size_t i = 0; i < d->segments.count && !c; i++) {
        npa_segment *seg = &d->segments.items[i];
        if (!seg->expandable || seg->first->pool != pool) continue;
        es = seg->expandable;
        c = find_candidate(seg->first, size);
    }
    if (!c) {
        if (!(es = reserve(a, d, pool))) return NULL;
        size_t index = npa_segments_find(&d->segments, es->base);
        /* Bigger than a whole range: no range will do, so none is kept. */
        if (!(c = find_candidate(d->segments.items[index].first, size))) {
            release_range(a, d, index);
            return NULL;
        }
    }
    /* c is unmapped [-> ...], or free -> unmapped [-> ...]: map until c fits. */
    if (c->phase == NPA_PHASE_UNMAPPED && !(c = map_block(a, d, es, c, c->size < size ? c->size : size, why)))
        return NULL;
    while (c->size < size) {
        npa_block *next = c->next;
        size_t missing = size - c->size;
        if (!(c = map_block(a, d, es, next, next->size < missing ? next->size : missing, why))) return NULL;
    }
    npa_stats_begin(d);
    npa_pool_remove(pool, c);
    npa_stats_end(d);
    return c;
}

size_t npa_expandable_reach(const npa_block *b) {
    return b->size + (b->next && b->next->phase == NPA_PHASE_UNMAPPED ? b->next->size : 0);
}

/* The whole pages inside a block, [*begin, *end) as page indices. */
static bool whole_pages(const npa_expandable *es, const npa_block *b, size_t *begin, size_t *end) {
    *begin = (b->addr - es->base + es->page_size - 1) / es->page_size;
    *end = (b->addr + b->size - es->base) / es->page_size;
    return *begin < *end;
}

bool npa_expandable_unmappable(const npa_device *d) {
    for (size_t i = 0; i < d->segments.count; i++) {
        const npa_expandable *es = d->segments.items[i].expandable;
        if (!es) continue;
        size_t begin, end;
        for (const npa_block *b = d->segments.items[i].first; b; b = b->next)
            if (b->phase == NPA_PHASE_FREE && whole_pages(es, b, &begin, &end)) return true;
    }
    return false;
}

static npa_block *linked_after(npa_block *b, npa_block *n, uintptr_t addr, size_t size, npa_block_phase phase) {
    *n = (npa_block){.addr = addr, .size = size, .prev = b, .next = b->next, .phase = (uint8_t)phase,
                     .is_small = b->is_small, .pool = b->pool, .in_expandable = true};
    if (b->next) b->next->prev = n;
    b->next = n;
    return n;
}

/* torch's unmap_block: unmaps the whole pages inside the free block b; what
 * is left of b on either side stays free. Returns the block now holding b's
 * last byte, so the caller can walk on from it. */
static npa_block *unmap_block(npa_allocator *a, npa_device *d, npa_expandable *es, npa_block *b) {
    size_t begin, end;
    if (!whole_pages(es, b, &begin, &end)) return b;
    uintptr_t start = es->base + begin * es->page_size, stop = es->base + end * es->page_size;
    uintptr_t b_end = b->addr + b->size;
    bool keep_before = start > b->addr;
    /* The piece after the hole is needed when the pages end before b does,
     * or when the runtime refuses to release one (the hole ends there). */
    npa_block *hole = keep_before ? npa_slab_get(&d->slab) : b;
    npa_block *after = npa_slab_get(&d->slab);
    size_t unmapped = begin;
    while (hole && after && unmapped < end && unmap_page(a, d, es, unmapped)) unmapped++;
    if (unmapped == begin) { /* no host memory for the pieces, or nothing released: it stays mapped */
        if (keep_before && hole) npa_slab_put(&d->slab, hole);
        if (after) npa_slab_put(&d->slab, after);
        return b;
    }
    end = unmapped;
    stop = es->base + end * es->page_size;
    bool keep_after = stop < b_end;
    if (!keep_after) npa_slab_put(&d->slab, after);
    npa_pool *pool = b->pool;
    npualloc_device_stats *s = d->stats;
    npa_stats_begin(d);
    npa_pool_remove(pool, b);
    npa_stats_end(d);
    npa_stats_begin(d);
    if (keep_after) npa_pool_insert(pool, linked_after(b, after, stop, b_end - stop, NPA_PHASE_FREE));
    if (keep_before) {
        linked_after(b, hole, start, stop - start, NPA_PHASE_UNMAPPED);
        b->size = start - b->addr;
        npa_pool_insert(pool, b);
    } else {
        b->size = stop - start;
        b->phase = NPA_PHASE_UNMAPPED;
    }
    if (hole->prev && hole->prev->phase == NPA_PHASE_UNMAPPED) {
        npa_block *lower = hole->prev;
        npa_block_absorb(d, lower, hole);
        hole = lower;
    }
    if (hole->next && hole->next->phase == NPA_PHASE_UNMAPPED) npa_block_absorb(d, hole, hole->next);
    npa_pool_stat_decrease(s->reserved_bytes, hole->is_small, (int64_t)(stop - start));
    npa_stat_add(&s->num_device_free, (int64_t)(end - begin));
    npa_stats_end(d);
    npa_history_note(d, hole->pool, NPA_TRACE_SEGMENT_UNMAP, start, stop - start);
    return keep_after ? after : hole;
}

/* Pages left mapped inside unmapped blocks: map_pages's undo could not
 * release them (the runtime refused). They hold device memory no block and
 * no stat counts, so each release tries them again; false while one stays. */
static bool unmap_left_pages(npa_allocator *a, npa_device *d, npa_expandable *es, npa_block *first) {
    bool all_gone = true;
    for (npa_block *b = first; b; b = b->next) {
        size_t begin, end; /* an unmapped block spans whole pages */
        if (b->phase != NPA_PHASE_UNMAPPED || !whole_pages(es, b, &begin, &end)) continue;
        for (size_t i = begin; i < end; i++)
            if (es->pages[i] && !unmap_page(a, d, es, i)) all_gone = false;
    }
    return all_gone;
}

void npa_expandable_release_free(npa_allocator *a, npa_device *d, size_t index) {
    npa_expandable *es = d->segments.items[index].expandable;
    npa_block *first = d->segments.items[index].first;
    for (npa_block *b = first; b; b = b->next)
        if (b->phase == NPA_PHASE_FREE) b = unmap_block(a, d, es, b);
    bool all_gone = unmap_left_pages(a, d, es, first);
    /* torch's release_expandable_segment: nothing mapped, the range goes too
     * (torch keeps a range that was never mapped; npualloc gives it back as
     * well, so an emptied cache holds no address space either). A page
     * still mapped keeps the range, and its handle, for the next release. */
    if (all_gone && first->phase == NPA_PHASE_UNMAPPED && !first->next) release_range(a, d, index);
}

void npa_expandable_forget(npa_expandable *es) {
    free(es->pages);
    free(es);
}
