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
 * asks the device for memory (while the device lends, one block at a time
 * until best fit finds one: npa_stock_return_oldest), the OOM retry,
 * empty_cache, reset. A free
 * that needs a fence or a stream's event (stream-safe reuse) comes here
 * only once that has completed (pending.c); a block freed on its own stream
 * comes at once, and serves only that stream's pool again. When most of
 * what it holds is pushed out unused, it steps aside for a while (evict,
 * below). Each thread keeps its own per device, the stock of its tcache
 * (tcache.c), whose fast paths take from it and put into it without the
 * device lock; here are the moves that need it. The hit path's moves (a
 * take, a put, the fast free's hold) are inline in internal.h: as calls
 * they cost a lone thread's pair 60 instructions by callgrind. */
#include "internal.h"

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
static void evict(npa_device *d, npa_recent *r, unsigned i) {
    npa_pool_return(d, npa_stock_remove_at(r, i, true));
    if (r->unjudged || ++r->evicted < NPA_RECENT_JUDGED) return;
    if ((uint64_t)r->evicted * NPA_RECENT_EVICTED_SHARE > r->clock - r->judged_clock) r->bypass = NPA_RECENT_BYPASS;
    r->judged_clock = r->clock;
    r->evicted = 0;
}

void npa_stock_make_room(npa_device *d, npa_recent *r, size_t size, bool is_small) {
    while (!npa_stock_has_room(r, size, is_small)) evict(d, r, oldest(r));
}

/* npa_stock_put's for the large stock (internal.h's inline one is the
 * small stock's, is_small a constant there): full, since the large stock
 * holds blocks only while the device lends. Out of line: inlined beside the
 * small one, it cost the small one's callers their inlining (callgrind: 14
 * instructions a pair more). */
__attribute__((noinline)) void npa_stock_put_large(npa_device *d, npa_recent *r, npa_block *b) {
    npa_stock_make_room(d, r, b->size, false);
    npa_stock_hold_freed(d, r, b, false, true);
}

/* A few blocks at most: a plain scan, each block that fits and comes first
 * so far becoming the bound the next must come before. */
static unsigned find_before(const npa_recent *r, size_t size, size_t before_size, uintptr_t before_addr) {
    unsigned at = r->count;
    for (unsigned i = 0; i < r->count; i++) {
        size_t s = r->sizes[i];
        if (s >= size && s - size <= NPA_SMALL_SIZE &&
            (s < before_size || (s == before_size && r->addrs[i] < before_addr))) {
            before_size = s;
            before_addr = r->addrs[i];
            at = i;
        }
    }
    return at;
}

unsigned npa_stock_find_fit(const npa_recent *r, size_t size, size_t most) {
    return find_before(r, size, most, UINTPTR_MAX);
}

void npa_stock_take_at(npa_recent *r, unsigned at, npa_lent *held) {
    *held = (npa_lent){.addr = r->addrs[at], .size = r->sizes[at], .split = r->splits[at], .is_small = false};
    held->block = npa_stock_remove_at(r, at, true);
}

bool npa_stock_take_fit(npa_recent *r, size_t size, size_t before_size, uintptr_t before_addr, npa_lent *held) {
    unsigned at = find_before(r, size, before_size, before_addr);
    if (at == r->count) return false;
    npa_stock_take_at(r, at, held);
    return true;
}

void npa_stock_return_oldest(npa_device *d, npa_recent *r) {
    npa_stats_begin(d);
    npa_pool_return(d, npa_stock_remove_at(r, oldest(r), true));
    npa_stats_end(d);
}

void npa_stock_flush(npa_device *d, npa_recent *r) {
    if (r->count == 0) return;
    npa_stats_begin(d);
    while (r->count > 0) npa_stock_return_oldest(d, r);
    npa_stats_end(d);
}
