/* The recent cache: programs free and allocate the same small sizes over and
 * over (a step's activations, workspaces), so a small block freed with no
 * fence needed is held whole for the next malloc of its rounded size. That
 * pair skips the pool's best-fit search, the split, the merge and the block
 * structs they move: the hit path becomes a scan of a few sizes.
 *
 * A held block is free for every purpose but reuse by another size: the
 * stats count it as the pool counts a free block that merged with nothing
 * (reserved, not allocated, not active; an inactive split block when its
 * segment is split), largest_free_block sees it, snapshots show it
 * inactive, history records its free as completed. Only the merge waits, so
 * inactive_split can read up to capacity blocks more than torch's would
 * (recent_blocks:0 turns the cache off). Whatever needs merged free space
 * returns every held block to its pool first: a small-pool miss before it
 * asks the device for memory, the OOM retry, empty_cache, reset. A free
 * that needs a fence or a stream's event (stream-safe reuse) comes here
 * only once that has completed (pending.c); a block freed on its own stream
 * comes at once, and serves only that stream's pool again. When most of
 * what it holds is pushed out unused, it steps aside for a while (evict,
 * below). The put is inline (internal.h): the eager free path and the
 * fence's completion both make it, and as a call it cost an eager pair 7
 * instructions. */
#include "internal.h"

/* Unlinks slot i; the last slot moves into it. Inlined into every caller:
 * on the hit path (npa_recent_take) a call would cost more than its body. */
static NPA_ALWAYS_INLINE npa_block *remove_at(npa_device *d, unsigned i) {
    npa_recent *r = &d->recent;
    npa_block *b = r->blocks[i];
    size_t size = r->sizes[i];
    unsigned last = --r->count;
    r->sizes[i] = r->sizes[last];
    r->blocks[i] = r->blocks[last];
    r->stamps[i] = r->stamps[last];
    r->bytes -= size;
    if (size == r->largest) {
        r->largest = 0;
        d->largest_moved = true;
        for (unsigned k = 0; k < r->count; k++)
            if (r->sizes[k] > r->largest) r->largest = r->sizes[k];
    }
    return b;
}

static unsigned oldest(const npa_recent *r) {
    unsigned at = 0;
    for (unsigned i = 1; i < r->count; i++)
        if (r->stamps[i] < r->stamps[at]) at = i;
    return at;
}

/* Whether holding pays. A program that frees a group of small blocks and
 * then allocates other sizes pushes most of what it put here out again
 * unused: each such block paid a put, an eviction and a merge it would have
 * had anyway, and while held it kept its neighbours in the pool from
 * merging, so the pool's searches walked more fragments (make bench's
 * harness, frees in groups of 16: 86 ns a pair against 60 ns with
 * recent_blocks:0, the difference mostly mispredicted branches in the treap
 * walks, the cache's scan and its evictions, by callgrind's branch
 * simulation). So every NPA_RECENT_JUDGED evictions the cache is judged
 * (internal.h's constants): when more than one block in
 * NPA_RECENT_EVICTED_SHARE of those put since the last verdict was evicted,
 * the next NPA_RECENT_BYPASS frees go straight to their pools (torch's
 * rule, as with recent_blocks:0), then puts resume and it is judged again.
 * Only evictions count: the flush before a pool asks the device for memory
 * says the pool needs merged space, not that the cache thrashes (counting
 * it bypassed the cache for a program that frees what it allocated at once,
 * its best case). Judged here, so the hit path pays nothing but a free's
 * test of the bypass. */
static void evict(npa_device *d, unsigned i) {
    npa_recent *r = &d->recent;
    npa_pool_return(d, remove_at(d, i));
    if (++r->evicted < NPA_RECENT_JUDGED) return;
    if ((uint64_t)r->evicted * NPA_RECENT_EVICTED_SHARE > r->clock - r->judged_clock) r->bypass = NPA_RECENT_BYPASS;
    r->judged_clock = r->clock;
    r->evicted = 0;
}

void npa_recent_make_room(npa_device *d, size_t size) {
    npa_recent *r = &d->recent;
    while (r->count == r->capacity || r->bytes + size > NPA_RECENT_BYTES) evict(d, oldest(r));
}

/* The size searched for is written past the last block, so the scan stops
 * on it without testing the bound at each slot (half the instructions of
 * the hit path's longest loop); finding it there means no block matched. */
npa_block *npa_recent_take(npa_device *d, const npa_pool *pool, size_t size) {
    npa_recent *r = &d->recent;
    r->sizes[r->count] = size;
    for (unsigned i = 0;; i++) {
        if (r->sizes[i] != size) continue;
        if (i == r->count) return NULL;
        if (r->blocks[i]->pool == pool) return remove_at(d, i);
    }
}

void npa_recent_flush(npa_device *d) {
    npa_recent *r = &d->recent;
    if (r->count == 0) return;
    npa_stats_begin(d);
    while (r->count > 0) npa_pool_return(d, remove_at(d, oldest(r)));
    npa_stats_end(d);
}
