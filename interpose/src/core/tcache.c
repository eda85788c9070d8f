/* Per-thread caches (issue 14): two threads on one device each keep most of
 * one thread's rate only if their hits take no shared lock and write no
 * shared cache line. So each thread has, per device, a tcache: its own
 * recent cache (the stock, recent.c) and the blocks its fast malloc lent
 * out of it (a small array, not the device's live
 * map), served and taken back under the tcache's own lock, which nobody
 * else takes but under the device lock (a freeze: snapshots, empty_cache,
 * the OOM retry, a free of a block another thread's cache lent).
 *
 * Stats stay exact. What the fast paths change goes to the thread's slot
 * (npualloc_thread_stats), which readers add to the device's figures. The
 * peaks are kept by ceilings: a fast malloc may raise its slot's current
 * of a stat only up to the tcache's ceiling (else it declines), and the
 * device keeps R, the sum of its tcaches' ceilings, with
 *     device.current + R <= device.peak
 * for every stat a fast path raises, in the pool's entry and in [ALL]. So the
 * true total (device plus slots, each under its ceiling) never passes the
 * peak unseen. A slow-path malloc that would break this freezes the fast
 * paths, counts, sets each peak to the larger of it and the exact sum, and
 * shrinks the ceilings of each entry the peaks no longer cover to the slots'
 * figures, sharing out again what the peaks leave (npa_tcaches_refit). A fast
 * malloc short of headroom takes the slow path, which raises its ceilings
 * within what the peaks leave (grant). The stats a fast free raises,
 * inactive_split and its bytes, have ceilings too: a split block the cache
 * lends stays counted inactive in the device's figure and its slot says minus
 * it (a slot's figure there is never above 0), so the fast free that takes it
 * back raises the sum, up to the ceiling (at most 0: a ceiling below 0 holds
 * back the free of a block lent before the last refit). The device's figure
 * of these two, while blocks are lent, is more than the sum: a slow path's
 * increase of them never sets a peak from it alone (npa_split_stat_raise).
 * The stats the fast malloc raises are, per slot, exactly what it lent, never
 * below 0.
 *
 * While the fast paths run, a tcache holds plain large-pool blocks too, in a
 * stock of their own (t->large), and serves a large request from them where
 * torch's one best fit over the pool and the stock would take a held block:
 * the smallest held block B of at least the rounded size R with B - R not
 * above NPA_SMALL_SIZE (should_split hands such a block out whole), when no
 * free pool block comes before it (size, then address). The fast malloc
 * cannot search the pool: it serves B of R bytes as it is, a bigger B only
 * where the pool's summary shows no free block of [R, B] (take_large); the
 * slow path weighs B against the pool's best fit (take_large_held). Counted
 * as the slow path counts it (allocated and active B, requested R). Only
 * blocks below max_split_size (never split at or above it, and a request
 * below it never takes one), and only while garbage_collection_threshold is 0
 * and expandable_segments off: GC frees cached large blocks by age, which the
 * fast paths would neither tick nor see, and expandable pools split a block
 * to the page (setting either flushes the large stocks, alloc.c), and off
 * again when the fast paths stop. Whatever needs merged space gives them back
 * as it gives back the small ones: a miss of the large pool, before it asks
 * the device for memory, one at a time until best fit finds a block
 * (npa_tcaches_return_one); the OOM retry, empty_cache and a thread's exit,
 * all of them.
 *
 * A thread's caches are found from a thread-local keyed by the allocator's
 * id; an allocator that is no longer the thread's is found in the registry
 * of live ones (its caches folded back before the thread takes another's),
 * and so is the one a thread's exit folds its caches into (a pthread key's
 * destructor). A forked child forgets every allocator of its parent. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

__thread __attribute__((tls_model("initial-exec"))) npa_thread_caches npa_my_caches;

/* The live allocators, for a thread that leaves one (its exit, another
 * allocator): under registry_lock, taken before any device lock. */
static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static npa_allocator *live_allocators;
static uint64_t last_allocator_id;
static pthread_key_t exit_key;
static pthread_once_t exit_key_once = PTHREAD_ONCE_INIT;
static bool exit_key_made;

/* ---- the slot: the thread's own seqlock section -------------------------- */

static inline void slot_open(npualloc_thread_stats *slot) {
    __atomic_store_n(&slot->seq, slot->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void slot_close(npualloc_thread_stats *slot) {
    __atomic_store_n(&slot->seq, slot->seq + 1, __ATOMIC_RELEASE);
}

static inline void slot_add(int64_t *field, int64_t delta) { npa_stat_store(field, *field + delta); }

/* One lent block's part of its slot's current, by NPUALLOC_THREAD_* index. */
static void lent_share(const npa_lent *lent, int64_t share[NPUALLOC_THREAD_STAT_COUNT]) {
    int64_t size = (int64_t)lent->size;
    share[NPUALLOC_THREAD_ALLOCATION] = share[NPUALLOC_THREAD_ACTIVE] = 1;
    share[NPUALLOC_THREAD_ALLOCATED_BYTES] = share[NPUALLOC_THREAD_ACTIVE_BYTES] = size;
    share[NPUALLOC_THREAD_REQUESTED_BYTES] = (int64_t)lent->requested;
    share[NPUALLOC_THREAD_INACTIVE_SPLIT] = lent->split ? -1 : 0;
    share[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES] = lent->split ? -size : 0;
}

static inline int pool_index(bool is_small) { return is_small ? 0 : 1; }

/* Whether large blocks may be held and served (the file's comment says
 * why): the settings written at run time, read as the slow path reads them. */
static inline bool large_stock_on(const npa_config *c) {
    double gc;
    __atomic_load(&c->garbage_collection_threshold, &gc, __ATOMIC_RELAXED);
    return gc <= 0.0 && !__atomic_load_n(&c->expandable_segments, __ATOMIC_RELAXED);
}

/* The slot's largest_held follows the stocks': inside a slot section. */
/* The biggest block either stock holds. */
static inline int64_t stocks_largest(const npa_tcache *t) {
    return (int64_t)(t->large.largest > t->stock.largest ? t->large.largest : t->stock.largest);
}

static inline void slot_note_largest(npa_tcache *t) {
    int64_t largest = stocks_largest(t);
    if (largest == t->largest_published) return;
    t->largest_published = largest;
    npa_stat_store(&t->slot->largest_held, largest);
}

/* The same in a section of its own, opened only when it changed: the slow
 * path's stock moves, most of which leave it as it was. */
static inline void slot_publish_largest(npa_tcache *t) {
    if (stocks_largest(t) == t->largest_published) return;
    slot_open(t->slot);
    slot_note_largest(t);
    slot_close(t->slot);
}

/* ---- the lent table ------------------------------------------------------ */

/* A dense array, scanned: a program holds few blocks of a thread's cache at
 * once (make bench's one), and the scan, stopped by its sentinel past the
 * last entry, is a predictable loop where an open-addressing table's
 * probes at hashed slots were mispredicted at almost every insert
 * (callgrind's branch simulation: 19,000 in 24,000 pairs). Not found:
 * lent_count. */
static inline unsigned lent_find(npa_tcache *t, uintptr_t addr) {
    t->lent[t->lent_count].addr = addr;
    unsigned i = 0;
    while (t->lent[i].addr != addr) i++;
    return i;
}

/* The entry past the last (the scan's sentinel), where the fast malloc
 * takes a stock's block in place before lend_next counts it: a copy from
 * the stack cost each fast malloc the entry's five words twice. */
static inline npa_lent *lent_next(npa_tcache *t) { return &t->lent[t->lent_count]; }

static inline void lent_remove(npa_tcache *t, unsigned at) { t->lent[at] = t->lent[--t->lent_count]; }

/* ---- the fast paths ------------------------------------------------------ */

/* A fast free of a lent split block of pool p makes it inactive again: its
 * slot's figure rises by one block of size, up to the ceilings (the pool's
 * and [ALL]'s). */
static inline bool split_under_ceilings(const npa_tcache *t, int p, int64_t size) {
    const int64_t *current = t->slot->current[p], *small = t->slot->current[0], *large = t->slot->current[1];
    const int64_t *ceiling = t->ceiling[p], *all = t->ceiling[NPA_CEIL_ALL];
    return current[NPUALLOC_THREAD_INACTIVE_SPLIT] + 1 <= ceiling[NPA_CEIL_SPLIT] &&
           current[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES] + size <= ceiling[NPA_CEIL_SPLIT_BYTES] &&
           small[NPUALLOC_THREAD_INACTIVE_SPLIT] + large[NPUALLOC_THREAD_INACTIVE_SPLIT] + 1 <= all[NPA_CEIL_SPLIT] &&
           small[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES] + large[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES] + size <=
               all[NPA_CEIL_SPLIT_BYTES];
}

/* The pool's ceilings and [ALL]'s (both pools' figures together). */
static inline bool under_ceilings(const npa_tcache *t, int p, int64_t size, int64_t requested) {
    const int64_t *current = t->slot->current[p], *small = t->slot->current[0], *large = t->slot->current[1];
    const int64_t *ceiling = t->ceiling[p], *all = t->ceiling[NPA_CEIL_ALL];
    return current[NPUALLOC_THREAD_ACTIVE] + 1 <= ceiling[NPA_CEIL_BLOCKS] &&
           current[NPUALLOC_THREAD_ACTIVE_BYTES] + size <= ceiling[NPA_CEIL_BYTES] &&
           current[NPUALLOC_THREAD_REQUESTED_BYTES] + requested <= ceiling[NPA_CEIL_REQUESTED] &&
           small[NPUALLOC_THREAD_ACTIVE] + large[NPUALLOC_THREAD_ACTIVE] + 1 <= all[NPA_CEIL_BLOCKS] &&
           small[NPUALLOC_THREAD_ACTIVE_BYTES] + large[NPUALLOC_THREAD_ACTIVE_BYTES] + size <= all[NPA_CEIL_BYTES] &&
           small[NPUALLOC_THREAD_REQUESTED_BYTES] + large[NPUALLOC_THREAD_REQUESTED_BYTES] + requested <=
               all[NPA_CEIL_REQUESTED];
}

/* The slot's moves of one block lent (sign 1) or taken back (-1), in one
 * section; straight-line, as the fast paths make them (a loop over
 * lent_share's figures cost a pair 100 instructions more, by callgrind).
 * Inline in every caller, where sign is a constant: the one out-of-line
 * copy GCC chose for its callers cost the fast malloc and the fast free 17
 * instructions each (the call, its saved register, the sign's tests and
 * multiplications). */
static NPA_ALWAYS_INLINE void slot_move(npa_tcache *t, int p, int64_t sign, int64_t size, int64_t requested, bool split) {
    npualloc_thread_stats *slot = t->slot;
    int64_t *current = slot->current[p], *allocated = slot->allocated[p];
    slot_open(slot);
    slot_add(&current[NPUALLOC_THREAD_ALLOCATION], sign);
    slot_add(&current[NPUALLOC_THREAD_ALLOCATED_BYTES], sign * size);
    slot_add(&current[NPUALLOC_THREAD_ACTIVE], sign);
    slot_add(&current[NPUALLOC_THREAD_ACTIVE_BYTES], sign * size);
    slot_add(&current[NPUALLOC_THREAD_REQUESTED_BYTES], sign * requested);
    if (sign > 0) { /* each stat's allocated counts its increases */
        slot_add(&allocated[NPUALLOC_THREAD_ALLOCATION], 1);
        slot_add(&allocated[NPUALLOC_THREAD_ALLOCATED_BYTES], size);
        slot_add(&allocated[NPUALLOC_THREAD_ACTIVE], 1);
        slot_add(&allocated[NPUALLOC_THREAD_ACTIVE_BYTES], size);
        slot_add(&allocated[NPUALLOC_THREAD_REQUESTED_BYTES], requested);
        slot_add(&slot->num_cache_hits, 1);
    }
    if (split) { /* an inactive split block of the device's while held */
        slot_add(&current[NPUALLOC_THREAD_INACTIVE_SPLIT], -sign);
        slot_add(&current[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES], -sign * size);
        if (sign < 0) {
            slot_add(&allocated[NPUALLOC_THREAD_INACTIVE_SPLIT], 1);
            slot_add(&allocated[NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES], size);
        }
    }
    slot_note_largest(t);
    slot_close(slot);
}

/* The block in lent_next(t) becomes the caller's: lent, counted in the slot. */
static NPA_ALWAYS_INLINE void lend_next(npa_tcache *t, size_t requested) {
    npa_lent *held = &t->lent[t->lent_count++];
    held->requested = requested;
    slot_move(t, pool_index(held->is_small), 1, (int64_t)held->size, (int64_t)requested, held->split);
}

/* A block out of a stock becomes the caller's (lend_next). */
static inline void lend(npa_tcache *t, const npa_lent *held, size_t requested) {
    *lent_next(t) = *held;
    lend_next(t, requested);
}

/* Whether the plain large pool held no free block of [lo, hi] bytes, read
 * without the device lock from its summary (npa_pool_summary). Bucketed: a
 * block below lo in lo's bucket, or above hi in hi's, counts too, which
 * only declines. Exact otherwise: the counts read with seq even and the
 * same after are what some stats section left, under the lock; a fast
 * malloc that read 0 before another thread's insert is ordered before
 * that insert, as the device lock would have ordered them, and the thread
 * reads its own earlier inserts (program order). */
static bool plain_large_clear(const npa_pool_summary *s, size_t lo, size_t hi) {
    size_t last = hi >> NPA_SUMMARY_SHIFT;
    if (last >= NPA_SUMMARY_BUCKETS) return false;
    /* npa_tcache_malloc's relaxed look at pending_any before the summary:
     * one that read it false (count_pending's release store) then reads the
     * counts its frees' completion left, or seq odd. Without the fence a
     * weakly ordered core (aarch64) may read the summary older than the
     * flag, a completed free in neither. */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    uint32_t seq = __atomic_load_n(&s->seq, __ATOMIC_ACQUIRE);
    uint32_t any = seq & 1;
    for (size_t i = lo >> NPA_SUMMARY_SHIFT; i <= last && !any; i++)
        any = __atomic_load_n(&s->counts[i], __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the counts before seq again */
    return !any && __atomic_load_n(&s->seq, __ATOMIC_RELAXED) == seq;
}

/* A large block of the stock for rounded bytes, if the byte ceiling still
 * allows it: the smallest held B with B - rounded at most 1 MiB (torch's
 * split rule), as torch's best fit would take it. A B of the rounded size
 * is torch's size whatever the pool holds; a bigger one only where the
 * pool holds none of [rounded, B] (B itself: a pool block of B's size at a
 * lower address would win the tie), else the slow path weighs the two
 * (take_large_held). Out of line: the fast malloc's callers kept it
 * inlined and paid its registers on every call. */
static __attribute__((noinline)) bool take_large(npa_tcache *t, size_t rounded, npa_lent *held) {
    const int64_t *small = t->slot->current[0], *large = t->slot->current[1];
    int64_t room = t->ceiling[1][NPA_CEIL_BYTES] - large[NPUALLOC_THREAD_ACTIVE_BYTES];
    int64_t room_all = t->ceiling[NPA_CEIL_ALL][NPA_CEIL_BYTES] - small[NPUALLOC_THREAD_ACTIVE_BYTES] -
                       large[NPUALLOC_THREAD_ACTIVE_BYTES];
    if (room_all < room) room = room_all;
    if (!t->large.count || room < (int64_t)rounded || !large_stock_on(t->config)) return false;
    unsigned at = npa_stock_find_fit(&t->large, rounded, (size_t)room);
    if (at == t->large.count ||
        (t->large.sizes[at] != rounded && !plain_large_clear(&t->device->large_summary, rounded, t->large.sizes[at])))
        return false;
    npa_stock_take_at(&t->large, at, held);
    return true;
}

bool npa_tcache_malloc(npa_tcache *t, size_t rounded, size_t requested, void **ptr) {
    npa_device *d = t->device;
    bool is_small = rounded <= NPA_SMALL_SIZE;
    const npa_pool *pool = is_small ? &d->plain.small : &d->plain.large;
    /* Frees waiting for a fence: a slow malloc polls them first (pending.c).
     * Both looked at before the lock, so a declined call costs it nothing;
     * enabled again under it, where its writers change it. */
    if (!__atomic_load_n(&t->enabled, __ATOMIC_RELAXED) || __atomic_load_n(&d->pending_any, __ATOMIC_RELAXED))
        return false;
    npa_lock_acquire(&t->lock);
    bool may = __atomic_load_n(&t->enabled, __ATOMIC_RELAXED) && t->lent_count < NPA_LENT_MAX &&
               under_ceilings(t, pool_index(is_small), (int64_t)rounded, (int64_t)requested);
    npa_lent *held = lent_next(t); /* may: an entry left for it */
    bool hit = may && (is_small ? npa_stock_take(&t->stock, pool, rounded, held, true) : take_large(t, rounded, held));
    if (hit) {
        lend_next(t, requested);
        *ptr = (void *)held->addr;
    }
    npa_lock_release(&t->lock);
    return hit;
}

bool npa_tcache_free(const npa_allocator *a, npa_tcache *t, uintptr_t addr) {
    if (!__atomic_load_n(&t->enabled, __ATOMIC_RELAXED) || npa_plain_fence_needed(a)) return false;
    npa_lock_acquire(&t->lock);
    unsigned at = lent_find(t, addr);
    /* The stock full makes an eviction, which merges into a pool; a bypass
     * sends the free to its pool: both the slow path's. */
    bool small = at < t->lent_count && t->lent[at].is_small;
    npa_recent *stock = small ? &t->stock : &t->large;
    bool done = at < t->lent_count && __atomic_load_n(&t->enabled, __ATOMIC_RELAXED) && stock->bypass == 0 &&
                npa_stock_has_room(stock, t->lent[at].size, small) && (small || large_stock_on(t->config)) &&
                (!t->lent[at].split || split_under_ceilings(t, pool_index(small), (int64_t)t->lent[at].size));
    if (done) {
        npa_lent held = t->lent[at];
        lent_remove(t, at);
        npa_device *d = t->device;
        npa_stock_hold(stock, &held, small ? &d->plain.small : &d->plain.large, true); /* lent: a plain pool's */
        slot_move(t, pool_index(small), -1, (int64_t)held.size, (int64_t)held.requested, held.split);
    }
    npa_lock_release(&t->lock);
    return done;
}

/* ---- ceilings ------------------------------------------------------------ */

/* A tcache's ceilings and the device's R are kept per entry: each pool's,
 * and NPA_CEIL_ALL for [ALL], which bounds the slot's two pools together.
 * [ALL]'s own, not the sum of the pools': a thread that holds one block at
 * a time, small or large (make bench), needs a block of headroom in each
 * pool but only one in [ALL], whose peak (one block a thread) would not
 * cover two. */

/* The slot's stat a group's ceiling bounds. */
static const int group_stat[NPA_CEILINGS] = {NPUALLOC_THREAD_ACTIVE, NPUALLOC_THREAD_ACTIVE_BYTES,
                                             NPUALLOC_THREAD_REQUESTED_BYTES, NPUALLOC_THREAD_INACTIVE_SPLIT,
                                             NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES};

/* The thread's figure of a group in entry e. */
static inline int64_t held_in(const npa_tcache *t, int e, int g) {
    const int64_t(*current)[NPUALLOC_THREAD_STAT_COUNT] = t->slot->current;
    int k = group_stat[g];
    return e == NPA_CEIL_ALL ? current[0][k] + current[1][k] : current[e][k];
}

/* t's ceiling of group g in entry e moves by by, and R with it: R is the
 * sum of the tcaches' ceilings. */
static inline void move_ceiling(npa_device *d, npa_tcache *t, int e, int g, int64_t by) {
    t->ceiling[e][g] += by;
    d->reserve[e][g] += by;
}

/* The least slack of a group's stats in one entry: peak - current - R.
 * Straight-line: every slow malloc and free asks it. */
static inline int64_t stat_slack(const npualloc_stat *st, int64_t reserve) { return st->peak - st->current - reserve; }

static int64_t entry_slack(const npa_device *d, int e, int group) {
    const npualloc_device_stats *s = d->stats;
    const npualloc_stat *first, *second; /* the group's stats, by entry */
    switch (group) {
    case NPA_CEIL_BLOCKS: first = s->allocation, second = s->active; break;
    case NPA_CEIL_BYTES: first = s->allocated_bytes, second = s->active_bytes; break;
    case NPA_CEIL_REQUESTED: first = second = s->requested_bytes; break;
    case NPA_CEIL_SPLIT: first = second = s->inactive_split; break;
    default: first = second = s->inactive_split_bytes;
    }
    int entry = e == NPA_CEIL_ALL ? NPUALLOC_POOL_ALL : NPUALLOC_POOL_SMALL + e;
    int64_t least = stat_slack(&first[entry], d->reserve[e][group]), left;
    if ((left = stat_slack(&second[entry], d->reserve[e][group])) < least) least = left;
    return least;
}

/* The least of the pool's and [ALL]'s, with v more added to current. */
static int64_t slack(const npa_device *d, int p, int group, int64_t v) {
    int64_t in_pool = entry_slack(d, p, group), in_all = entry_slack(d, NPA_CEIL_ALL, group);
    return (in_pool < in_all ? in_pool : in_all) - v;
}

bool npa_tcaches_fit(const npa_device *d, bool is_small, int64_t count, int64_t bytes, int64_t requested) {
    int p = pool_index(is_small);
    return slack(d, p, NPA_CEIL_BLOCKS, count) >= 0 && slack(d, p, NPA_CEIL_BYTES, bytes) >= 0 &&
           slack(d, p, NPA_CEIL_REQUESTED, requested) >= 0;
}

/* The most a ceiling is raised past what a lend needs: a stock's worth
 * (its blocks, its bytes), by entry ([ALL]: both stocks'). More headroom
 * would spare a thread only rare grants, and would make the slow path's
 * own mallocs freeze the tcaches more often (its figures may rise only as
 * far as the ceilings leave). inactive_split's: no more than to 0
 * (split_room), which lets every lent split block back. */
static const int64_t extra_at_most[NPA_CEIL_ENTRIES][NPA_CEILINGS] = {
    {NPA_RECENT_MAX, (int64_t)NPA_RECENT_BYTES, (int64_t)NPA_RECENT_BYTES, INT64_MAX, INT64_MAX},
    {NPA_LARGE_STOCK_MAX, (int64_t)NPA_LARGE_STOCK_BYTES, (int64_t)NPA_LARGE_STOCK_BYTES, INT64_MAX, INT64_MAX},
    {NPA_RECENT_MAX + NPA_LARGE_STOCK_MAX, (int64_t)(NPA_RECENT_BYTES + NPA_LARGE_STOCK_BYTES),
     (int64_t)(NPA_RECENT_BYTES + NPA_LARGE_STOCK_BYTES), INT64_MAX, INT64_MAX}};

/* How far a split group's ceiling may still rise: the slot's figure is
 * never above 0, so neither is a useful ceiling (more would only hold the
 * device's figure lower below the peaks). */
static inline int64_t split_room(const npa_tcache *t, int e, int g) { return -t->ceiling[e][g]; }

/* The calling thread's own tcache on d, with the device lock: its ceilings
 * need no lock of their own (only its owner's fast paths read them). */
static inline npa_tcache *own_tcache(const npa_device *d) { return npa_thread_tcache(d->allocator_id, d->id); }

/* A share of left for one of count tcaches, rounded up (one tcache's
 * grant: slack 1 between two threads must still give the one that asks a
 * block), or down (every tcache's at once: the shares must sum to no more
 * than left). */
static inline int64_t share_of(int e, int g, int64_t left, unsigned count, bool up) {
    int64_t share = (left + (up ? (int64_t)count - 1 : 0)) / (int64_t)count;
    return share < extra_at_most[e][g] ? share : extra_at_most[e][g];
}

/* Raises t's ceilings (the pool's and [ALL]'s) so that a lend of one block
 * of size (requested) fits, by what it needs plus a share of the slack left
 * (so a loop of mallocs and frees comes back here rarely), never past the
 * peaks. */
static bool grant(npa_device *d, npa_tcache *t, int p, int64_t size, int64_t requested) {
    const int64_t adds[NPA_CEIL_MALLOC] = {1, size, requested};
    const int entries[2] = {p, NPA_CEIL_ALL};
    int64_t need[2][NPA_CEIL_MALLOC], left[2][NPA_CEIL_MALLOC];
    for (int i = 0; i < 2; i++)
        for (int g = 0; g < NPA_CEIL_MALLOC; g++) {
            int e = entries[i];
            need[i][g] = held_in(t, e, g) + adds[g] - t->ceiling[e][g];
            if (need[i][g] < 0) need[i][g] = 0;
            left[i][g] = entry_slack(d, e, g);
            if (left[i][g] < need[i][g]) return false;
        }
    for (int i = 0; i < 2; i++)
        for (int g = 0; g < NPA_CEIL_MALLOC; g++) {
            int e = entries[i];
            int64_t rise = need[i][g] + share_of(e, g, left[i][g] - need[i][g], d->tcache_count, true);
            move_ceiling(d, t, e, g, rise);
        }
    return true;
}


/* Here and below, t is the calling thread's own, with the device lock
 * held: its lock is not taken. Only its owner's fast paths touch it
 * without the device lock, and the owner is the caller; anyone else
 * reaches it under the device lock. A slow pair took five such lock
 * pairs, ten atomic instructions, one pair in five of make bench's. */

/* The slow path's own mallocs and frees move the device's figures, which
 * its thread's headroom covers first: a malloc takes what it adds out of
 * the thread's ceilings (the pool's and [ALL]'s, which only lowers R), a
 * free gives the room back to them within what the peaks leave. Else a
 * thread whose slow and fast mallocs alternate (a block the stocks miss,
 * then one they hold) would freeze every tcache at each slow one, its own
 * ceilings leaving the device no room under a peak it set alone. */
/* Both out of line: called only while the fast paths run, and inlined
 * (LTO) their arrays' set-up ran before the test, on a lone thread's every
 * slow malloc and free (callgrind: 8 instructions a pair). */
__attribute__((noinline)) void npa_tcache_borrow(npa_device *d, npa_tcache *t, bool is_small, int64_t count,
                                                 int64_t bytes, int64_t requested) {
    const int64_t want[NPA_CEIL_MALLOC] = {count, bytes, requested};
    const int entries[2] = {pool_index(is_small), NPA_CEIL_ALL};
    for (int i = 0; i < 2; i++)
        for (int g = 0; g < NPA_CEIL_MALLOC; g++) {
            int e = entries[i];
            int64_t take = t->ceiling[e][g] - held_in(t, e, g);
            if (take > want[g]) take = want[g];
            if (take <= 0) continue;
            move_ceiling(d, t, e, g, -take);
        }
}

/* inactive_split's ceilings back up to 0, within the slack, in every
 * entry: the fast frees of the split blocks lent before the last refit go
 * fast again. */
static __attribute__((noinline, cold)) void regrant_split(npa_device *d, npa_tcache *t) {
    for (int e = 0; e < NPA_CEIL_ENTRIES; e++)
        for (int g = NPA_CEIL_SPLIT; g <= NPA_CEIL_SPLIT_BYTES; g++) {
            int64_t rise = split_room(t, e, g), left = entry_slack(d, e, g);
            if (rise > left) rise = left;
            if (rise <= 0) continue;
            move_ceiling(d, t, e, g, rise);
        }
}

/* The free's pool and [ALL] get back what the free made room for, no
 * more; the other pool, which the free left as it was, a share of its
 * slack (as a grant's), so that a thread whose large blocks go slow and
 * small ones fast (or the other way) keeps room in both: a refit after a
 * freeze shares a pool's slack of 1 between two threads as 0 each. */
__attribute__((noinline)) void npa_tcache_regrant(npa_device *d, npa_tcache *t, bool is_small, int64_t count,
                                                  int64_t bytes, int64_t requested) {
    const int64_t freed[NPA_CEIL_MALLOC] = {count, bytes, requested};
    const int p = pool_index(is_small);
    const int entries[3] = {p, NPA_CEIL_ALL, 1 - p};
    for (int i = 0; i < 3; i++)
        for (int g = 0; g < NPA_CEIL_MALLOC; g++) {
            int e = entries[i];
            int64_t rise = held_in(t, e, g) + extra_at_most[e][g] - t->ceiling[e][g];
            if (rise <= 0) continue;
            int64_t left = entry_slack(d, e, g);
            if (i < 2 && rise > freed[g]) rise = freed[g]; /* what this free made room for, no more */
            if (i == 2 && left > 0) left = share_of(e, g, left, d->tcache_count, true);
            if (rise > left) rise = left;
            if (rise <= 0) continue;
            move_ceiling(d, t, e, g, rise);
        }
    bool split_low = false;
    for (int e = 0; e < NPA_CEIL_ENTRIES; e++)
        split_low |= t->ceiling[e][NPA_CEIL_SPLIT] < 0 || t->ceiling[e][NPA_CEIL_SPLIT_BYTES] < 0;
    if (split_low) regrant_split(d, t);
}

/* The calling thread's own tcache is only tried: it is held only if a
 * signal handler's call (an exit's empty_cache) interrupted the thread's
 * own fast path, which never gives it back; it stays as it is
 * (frozen_without: npa_tcaches_flush leaves its stock), and its owner, the
 * caller, cannot move it meanwhile. Another thread's fast path always
 * gives its lock back. */
void npa_tcaches_freeze(npa_device *d) {
    if (d->freeze_depth++) return;
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        if (t->owner != &npa_my_caches) npa_lock_acquire(&t->lock);
        else if (!npa_lock_try_acquire(&t->lock)) d->frozen_without = t;
    }
}

static void unfreeze(npa_device *d) {
    for (unsigned i = NPUALLOC_THREAD_SLOTS; i-- > 0;)
        if (d->tcaches[i] && d->tcaches[i] != d->frozen_without) npa_lock_release(&d->tcaches[i]->lock);
    d->frozen_without = NULL;
}

void npa_tcaches_thaw(npa_device *d) {
    if (--d->freeze_depth) return;
    if (d->refit_due) { /* an increase of inactive_split passed the ceilings meanwhile */
        npa_stats_begin(d);
        npa_tcaches_refit(d, false);
        npa_stats_end(d);
    }
    unfreeze(d);
}

void npa_tcaches_thaw_at_close(npa_device *d) {
    d->freeze_at_close = false;
    if (d->refit_due) npa_tcaches_refit(d, false); /* the section still open */
    if (--d->freeze_depth == 0) unfreeze(d);
}

/* The device's stat a slot's NPUALLOC_THREAD_* index adds to. */
static npualloc_stat *slot_stat(npualloc_device_stats *s, int k, int entry) {
    npualloc_stat *const stats[NPUALLOC_THREAD_STAT_COUNT] = {
        s->allocation, s->allocated_bytes, s->active, s->active_bytes, s->requested_bytes,
        s->inactive_split, s->inactive_split_bytes};
    return &stats[k][entry];
}

void npa_tcaches_refit(npa_device *d, bool reset) {
    int64_t sum[NPUALLOC_THREAD_POOL_COUNT][NPUALLOC_THREAD_STAT_COUNT] = {{0}};
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        for (int p = 0; t && p < NPUALLOC_THREAD_POOL_COUNT; p++)
            for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++) sum[p][k] += t->slot->current[p][k];
    }
    for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++)
        for (int entry = 0; entry < NPUALLOC_POOL_COUNT; entry++) {
            npualloc_stat *st = slot_stat(d->stats, k, entry);
            int64_t total = st->current + (entry == NPUALLOC_POOL_ALL ? sum[0][k] + sum[1][k] : sum[entry - 1][k]);
            if (reset || total > st->peak) npa_stat_store(&st->peak, total);
        }
    d->refit_due = false;
    /* Only the entries whose ceilings the peaks no longer cover shrink to
     * the slots (all of them for a reset): a large malloc that passed the
     * large pool's peak leaves the small pool's ceilings as they were (shrunk
     * and shared again, an idle thread's share of a one-block slack left the
     * busy one half a block, and its next small malloc went slow). What the
     * peaks leave is shared out again (at most half of it), so the fast
     * paths do not all come back for a grant after a freeze. */
    for (int e = 0; e < NPA_CEIL_ENTRIES; e++) {
        bool covered = !reset;
        for (int g = 0; covered && g < NPA_CEILINGS; g++) covered = entry_slack(d, e, g) >= 0;
        if (covered) continue;
        for (int g = 0; g < NPA_CEILINGS; g++) {
            d->reserve[e][g] = 0;
            for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
                npa_tcache *t = d->tcaches[i];
                if (!t) continue;
                t->ceiling[e][g] = held_in(t, e, g);
                d->reserve[e][g] += t->ceiling[e][g];
            }
            int64_t share = d->lending ? share_of(e, g, entry_slack(d, e, g), d->tcache_count, false) : 0;
            for (unsigned i = 0; share > 0 && i < NPUALLOC_THREAD_SLOTS; i++) { /* off: every ceiling stays 0 */
                npa_tcache *t = d->tcaches[i];
                if (!t) continue;
                /* a split group's ceiling never above 0 (split_room) */
                int64_t rise = g < NPA_CEIL_MALLOC || share <= split_room(t, e, g) ? share : split_room(t, e, g);
                move_ceiling(d, t, e, g, rise);
            }
        }
    }
}

/* A slow path's increase of inactive_split or its bytes, counted, with
 * the fast paths running, took the device's figure past a peak
 * (npa_split_stat_raise). The device's figure counts the split blocks lent
 * as inactive (their slots take them out), so it is only an upper bound of
 * the sum: the peak is kept by the ceilings, as the fast malloc's stats'
 * are. The increase stays if device.current + R is within the peak
 * (pool's entry and [ALL], each with its own R); else the calling thread's
 * own headroom there is used first (lowering its ceiling lowers R), else
 * every tcache freezes until the outermost section ends
 * (npa_tcaches_thaw_at_close refits), and meanwhile each such increase
 * raises the peak to the device's figure plus the frozen slots', so that
 * one a later decrease in the section takes back is counted too. Device
 * lock, a stats section open. */
static void split_past_peak(npa_device *d, int g, bool is_small) {
    npualloc_stat *st = g == NPA_CEIL_SPLIT ? d->stats->inactive_split : d->stats->inactive_split_bytes;
    int p = pool_index(is_small), k = group_stat[g];
    const int entries[2] = {NPA_CEIL_ALL, p};
    npa_tcache *mine = own_tcache(d);
    if (mine == d->frozen_without) mine = NULL; /* its fast path interrupted (npa_tcaches_freeze): left as it is */
    bool short_left = false;
    for (int i = 0; i < 2; i++) {
        int e = entries[i];
        int64_t short_by = -entry_slack(d, e, g);
        if (short_by <= 0) continue;
        int64_t take = mine ? mine->ceiling[e][g] - held_in(mine, e, g) : 0;
        if (take > short_by) take = short_by;
        if (take > 0) move_ceiling(d, mine, e, g, -take);
        if (take < short_by) short_left = true;
    }
    if (!short_left) return;
    if (d->freeze_depth == 0) {
        npa_tcaches_freeze(d);
        d->freeze_at_close = true;
        d->largest_moved = true; /* the closing's slow way */
    }
    d->refit_due = true;
    int64_t sum[NPUALLOC_THREAD_POOL_COUNT] = {0};
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        const npa_tcache *t = d->tcaches[i];
        for (int q = 0; t && q < NPUALLOC_THREAD_POOL_COUNT; q++) sum[q] += t->slot->current[q][k];
    }
    for (int e = 0; e < 2; e++) {
        npualloc_stat *s = &st[e == 0 ? NPUALLOC_POOL_ALL : NPUALLOC_POOL_SMALL + p];
        int64_t total = s->current + (e == 0 ? sum[0] + sum[1] : sum[p]);
        if (total > s->peak) npa_stat_store(&s->peak, total);
    }
}

/* Both stats: which one passed is not said, and the other's check costs
 * nothing when it fits. */
void npa_split_past_peak(npa_device *d, bool is_small) {
    split_past_peak(d, NPA_CEIL_SPLIT, is_small);
    split_past_peak(d, NPA_CEIL_SPLIT_BYTES, is_small);
}

/* ---- folding back -------------------------------------------------------- */

/* The lent block in slot at of t goes back to the device: its share of the
 * slot moves to the device's figures (no peak can move: the ceiling it was
 * under goes down by as much), and it is live there. Device lock, t's
 * lock, a stats section open. */
static npa_block *unlend(npa_device *d, npa_tcache *t, unsigned at) {
    npa_block *b = t->lent[at].block;
    int64_t share[NPUALLOC_THREAD_STAT_COUNT];
    lent_share(&t->lent[at], share);
    b->requested = t->lent[at].requested;
    lent_remove(t, at);
    int p = pool_index(b->is_small);
    npualloc_thread_stats *slot = t->slot;
    slot_open(slot);
    for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++) {
        slot_add(&slot->current[p][k], -share[k]);
        npa_stat_add(&slot_stat(d->stats, k, p + 1)->current, share[k]);
        npa_stat_add(&slot_stat(d->stats, k, NPUALLOC_POOL_ALL)->current, share[k]);
    }
    slot_close(slot);
    const int entries[2] = {p, NPA_CEIL_ALL};
    for (int i = 0; i < 2; i++)
        for (int g = 0; g < NPA_CEILINGS; g++) {
            int e = entries[i];
            int64_t moved = share[group_stat[g]];
            /* inactive_split's share is minus the block: its ceiling rises as
             * far as its slot, but never past 0 (split_room) */
            if (g >= NPA_CEIL_MALLOC && moved < -split_room(t, e, g)) moved = -split_room(t, e, g);
            move_ceiling(d, t, e, g, -moved);
        }
    b->phase = NPA_PHASE_ALLOCATED;
    npa_block_map_insert(&d->live, b);
    return b;
}

npa_block *npa_tcaches_reclaim(npa_device *d, uintptr_t addr) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        npa_lock_acquire(&t->lock);
        unsigned at = lent_find(t, addr);
        npa_block *b = NULL;
        if (at < t->lent_count) {
            npa_stats_begin(d);
            b = unlend(d, t, at);
            npa_stats_end(d);
        }
        npa_lock_release(&t->lock);
        if (b) return b;
    }
    return NULL;
}

/* The stocks that which names back to their pools (NPA_FLUSH_*). */
static void flush_stocks(npa_device *d, npa_tcache *t, unsigned which) {
    if (which & NPA_FLUSH_SMALL) npa_stock_flush(d, &t->stock);
    if (which & NPA_FLUSH_LARGE) npa_stock_flush(d, &t->large);
    slot_publish_largest(t);
}

static void flush_stock(npa_device *d, npa_tcache *t) { flush_stocks(d, t, NPA_FLUSH_SMALL | NPA_FLUSH_LARGE); }

bool npa_tcaches_return_one(npa_device *d, unsigned which) {
    npa_tcache *from = NULL;
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t || t == d->frozen_without) continue; /* its stocks left as they are (npa_tcaches_freeze) */
        const npa_recent *r = which == NPA_FLUSH_SMALL ? &t->stock : &t->large;
        if (r->count && (!from || r->bytes > (which == NPA_FLUSH_SMALL ? from->stock : from->large).bytes))
            from = t;
    }
    if (!from) return false;
    npa_stock_return_oldest(d, which == NPA_FLUSH_SMALL ? &from->stock : &from->large);
    slot_publish_largest(from);
    return true;
}

/* While the fast paths run, frozen, not one lock after another. A held
 * block's return never raises inactive_split (it was counted inactive,
 * and it merges with its free neighbours into one block), but an increase
 * past the ceilings would freeze (npa_split_past_peak), which one held
 * lock would deadlock: the walk does not rest on that. Off, nothing
 * freezes, and a lone thread's small-pool misses pay for one lock, not a
 * freeze's two walks.
 * Either way the calling thread's own tcache is only tried (see
 * npa_tcaches_freeze), and its stocks left as they are when held. */
bool npa_tcaches_flush_some(npa_device *d, unsigned which) {
    bool flushed = false, lending = d->lending;
    if (lending) npa_tcaches_freeze(d);
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        if (lending) {
            if (t == d->frozen_without) continue;
        } else if (t->owner != &npa_my_caches) {
            npa_lock_acquire(&t->lock);
        } else if (!npa_lock_try_acquire(&t->lock)) {
            continue;
        }
        if (((which & NPA_FLUSH_SMALL) && t->stock.count) || ((which & NPA_FLUSH_LARGE) && t->large.count)) {
            flush_stocks(d, t, which);
            flushed = true;
        }
        if (!lending) npa_lock_release(&t->lock);
    }
    if (lending) npa_tcaches_thaw(d);
    return flushed;
}

/* What npa_tcache_take does with the block it found: lent, as a fast
 * malloc would lend it, so that its free takes the fast path too, unless t
 * is off or full, the pool a stream's, or the peaks leave no slack for t's
 * ceilings. */
static NPA_ALWAYS_INLINE npa_block *lend_or_hand(npa_device *d, npa_tcache *t, const npa_pool *pool, npa_lent *held,
                                                size_t requested, bool *lent) {
    int p = pool_index(pool->is_small);
    *lent = __atomic_load_n(&t->enabled, __ATOMIC_RELAXED) && t->lent_count < NPA_LENT_MAX && !pool->on_stream &&
            (under_ceilings(t, p, (int64_t)held->size, (int64_t)requested) ||
             grant(d, t, p, (int64_t)held->size, (int64_t)requested));
    if (*lent) {
        lend(t, held, requested);
    } else {
        slot_publish_largest(t);
    }
    return held->block;
}

/* The large stock's part, out of line (the small one's callers paid its
 * registers, by callgrind). Empty while the fast paths are off. A held
 * block serves only where it comes before the pool's best fit (rival) in
 * the pool's order, as in torch's one search over both. */
static __attribute__((noinline)) npa_block *take_large_held(npa_device *d, npa_tcache *t, const npa_pool *pool,
                                                            size_t size, size_t requested, const npa_block *rival,
                                                            bool *lent) {
    npa_lent held;
    if (!t->large.count || pool != &d->plain.large || !large_stock_on(t->config) ||
        !npa_stock_take_fit(&t->large, size, rival ? rival->size : SIZE_MAX, rival ? rival->addr : 0, &held))
        return NULL;
    return lend_or_hand(d, t, pool, &held, requested, lent);
}

npa_block *npa_tcache_take(npa_device *d, npa_tcache *t, const npa_pool *pool, size_t size, size_t requested,
                           const npa_block *rival, bool *lent) {
    if (__builtin_expect(!pool->is_small, 0)) return take_large_held(d, t, pool, size, requested, rival, lent);
    npa_lent held;
    if (!t->stock.count || !npa_stock_take(&t->stock, pool, size, &held, true)) return NULL;
    return lend_or_hand(d, t, pool, &held, requested, lent);
}

/* A large block the large stock may hold: a plain pool's, below
 * max_split_size, while the fast paths run (a lone thread's slow path is
 * as before) and large_stock_on. Never bypassed (recent.c's judgement):
 * make bench's large sizes push one block in eight out unused with 8
 * blocks and 32 MiB (one in four with 4 and 16 MiB), which would bypass
 * it, while an eviction costs only the merge the free's slow path would
 * have made anyway. */
static bool large_admits(const npa_device *d, const npa_recent *r, const npa_block *b, size_t size) {
    return d->lending && r->capacity != 0 && !b->is_small && !b->in_expandable && b->pool == &d->plain.large &&
           size <= NPA_LARGE_STOCK_BYTES && size < d->config->max_split_size && large_stock_on(d->config);
}

/* Out of line, as take_large_held. */
__attribute__((noinline)) bool npa_tcache_keep_large(npa_device *d, npa_tcache *t, npa_block *b) {
    if (!large_admits(d, &t->large, b, b->size)) return false;
    npa_stock_put_large(d, &t->large, b);
    slot_publish_largest(t);
    return true;
}

/* npa_recent_admits' and large_admits' rules without a bypass's count
 * (the free, when it comes, counts), then lend_or_hand's. Before the cut,
 * so that grant's ceilings are in place before anything the cut and the
 * evictions count (a refit they need waits for the section's close). */
bool npa_tcache_lends_found(npa_device *d, npa_tcache *t, const npa_block *b, size_t kept, size_t requested) {
    if (!t->enabled || t->lent_count >= NPA_LENT_MAX) return false;
    bool small = b->pool == &d->plain.small;
    if (small ? t->stock.capacity == 0 || t->stock.bypass != 0 || b->in_expandable || kept > NPA_RECENT_BYTES
              : !large_admits(d, &t->large, b, kept))
        return false;
    int p = pool_index(small);
    return under_ceilings(t, p, (int64_t)kept, (int64_t)requested) ||
           grant(d, t, p, (int64_t)kept, (int64_t)requested);
}

/* b, cut, is lent, and counted in the device's figures as the stock
 * counts a block it holds (a free block that merged with nothing): lent
 * first, so that a peak this sets is the sum's with b's slot taking it out
 * (else an inactive_split peak one block above any the threads reached).
 * Its phase before all, so that the evictions making room for its return
 * never merge it. A stats section open. */
void npa_tcache_lend_found(npa_device *d, npa_tcache *t, npa_block *b, size_t requested) {
    bool small = b->is_small, split = npa_block_is_split(b);
    b->phase = NPA_PHASE_RECENT;
    b->requested = 0;
    npa_stock_make_room(d, small ? &t->stock : &t->large, b->size, small);
    lend(t, &(npa_lent){.addr = b->addr, .block = b, .size = b->size, .split = split, .is_small = small}, requested);
    if (split) {
        npualloc_device_stats *s = d->stats;
        npa_split_stat_increase(d, s->inactive_split, small, 1);
        npa_split_stat_increase(d, s->inactive_split_bytes, small, (int64_t)b->size);
    }
}

void npa_tcache_publish_largest(npa_tcache *t) { slot_publish_largest(t); } /* the inline stock moves' (internal.h) */

/* Everything t holds back to the device: t's lock held, a stats section open. */
static void empty_tcache(npa_device *d, npa_tcache *t) {
    while (t->lent_count > 0) unlend(d, t, t->lent_count - 1);
    flush_stock(d, t);
}

/* The plain large pool's summary (npa_pool_summary) is kept only while the
 * device lends: only the fast malloc reads it, and a lone thread's every
 * large pool change and section close paid for it (12 instructions a pair
 * of make bench's hot path, by callgrind). Called inside the freeze of
 * npa_tcaches_settle, where no reader can be at work: the one reader,
 * take_large, runs under its tcache's lock, after it reads t->enabled again
 * there, and t->enabled changes only in npa_tcaches_settle, under the
 * device lock (which every writer of the summary holds) and a freeze,
 * which holds every tcache's lock until the thaw. The caller's own may be
 * frozen_without (a signal handler interrupted its own fast path): that
 * path goes on only after this returns, in program order, and reads a
 * rebuilt summary or a stopped one, odd, and declines. A rebuild is thus
 * seen by every fast path that sees t->enabled set: the thaw's lock
 * releases order it before the next acquire of each lock, on a weakly
 * ordered core (aarch64) too. The summary's seq guarantees as much without
 * the locks: stopped, it stays odd (the pool's summary pointer NULL, the
 * closers leave it); started, the counts are rebuilt while it is odd, and
 * only the section's close makes it even, a release store after them, so
 * a reader that sees it even (acquire) reads them. */
static void follow_lending(npa_device *d, bool lending) {
    npa_pool *pool = &d->plain.large;
    if (lending == (pool->summary != NULL)) return;
    if (lending) npa_pool_summary_start(pool, &d->large_summary);
    else npa_pool_summary_stop(pool, &d->large_summary);
}

/* The fast paths run only while two threads or more have a cache on the
 * device: a lone thread gains nothing from them that the device lock costs
 * it (nobody waits for that lock), and their ceilings and slots would cost
 * its slow calls (make bench: 52 against 43 ns a pair). Off, nothing is
 * lent and every ceiling is 0, so the slow path's stats are today's. */
void npa_tcaches_settle(npa_device *d) {
    bool quiet = d->history.capacity == 0 && !d->paused;
    bool lending = quiet && d->tcache_count >= 2;
    npa_stats_begin(d);
    npa_tcaches_freeze(d);
    follow_lending(d, lending);
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        if (!lending) {
            while (t->lent_count > 0) unlend(d, t, t->lent_count - 1);
            memset(t->ceiling, 0, sizeof t->ceiling);
        }
        if (lending && !t->enabled) npa_stock_index(&t->stock); /* a lone thread's stock kept no index */
        __atomic_store_n(&t->enabled, lending, __ATOMIC_RELAXED);
    }
    if (!lending) memset(d->reserve, 0, sizeof d->reserve);
    /* Off only once every lent block is back: every slot is 0 from here,
     * and the device's figures are the sums (npa_split_stat_increase).
     * Atomic: malloc_on reads it unlocked. */
    __atomic_store_n(&d->lending, lending, __ATOMIC_RELAXED);
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        if (!quiet) flush_stock(d, t);
        else if (!lending && t->large.count) flush_stocks(d, t, NPA_FLUSH_LARGE); /* held only while lending */
    }
    npa_tcaches_thaw(d);
    npa_stats_end(d);
}

/* The slot's counts of increases and its hits go to the device's. */
static void fold_accumulated(npa_device *d, npa_tcache *t) {
    npualloc_thread_stats *slot = t->slot;
    slot_open(slot);
    for (int p = 0; p < NPUALLOC_THREAD_POOL_COUNT; p++)
        for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++) {
            int64_t x = slot->allocated[p][k];
            if (!x) continue;
            for (int e = 0; e < 2; e++) {
                npualloc_stat *st = slot_stat(d->stats, k, e ? NPUALLOC_POOL_ALL : p + 1);
                npa_stat_store(&st->allocated, (int64_t)((uint64_t)st->allocated + (uint64_t)x));
            }
            npa_stat_store(&slot->allocated[p][k], 0);
        }
    npa_stat_add(&d->stats->num_cache_hits, slot->num_cache_hits);
    npa_stat_store(&slot->num_cache_hits, 0);
    slot_close(slot);
}

void npa_tcaches_fold_accumulated(npa_device *d) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++)
        if (d->tcaches[i]) fold_accumulated(d, d->tcaches[i]);
}

void npa_tcaches_add_slot_currents_at_reset(npa_device *d) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        const npa_tcache *t = d->tcaches[i];
        for (int p = 0; t && p < NPUALLOC_THREAD_POOL_COUNT; p++)
            for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++)
                for (int e = 0; e < 2; e++)
                    npa_stat_add(&slot_stat(d->stats, k, e ? NPUALLOC_POOL_ALL : p + 1)->current_at_reset,
                                 t->slot->current[p][k]);
    }
}

/* t leaves the device, everything it held and counted folded back, its
 * slot all zero for the next thread. Device lock held. */
static void retire(npa_device *d, npa_tcache *t) {
    /* Every tcache frozen, not t alone, as npa_tcaches_flush_some while
     * lending: t's returns never raise inactive_split, but an increase
     * that froze under t's lock alone would deadlock. */
    npa_stats_begin(d);
    npa_tcaches_freeze(d);
    empty_tcache(d, t);
    fold_accumulated(d, t);
    for (int e = 0; e < NPA_CEIL_ENTRIES; e++)
        for (int g = 0; g < NPA_CEILINGS; g++) d->reserve[e][g] -= t->ceiling[e][g];
    d->tcaches[t->index] = NULL;
    d->tcache_count--;
    if (t == d->frozen_without) d->frozen_without = NULL; /* its lock not taken */
    else npa_lock_release(&t->lock);
    npa_tcaches_thaw(d); /* the others, refit if need be */
    npa_stats_end(d);
    free(t);
    npa_tcaches_settle(d); /* maybe one thread left */
}

void npa_tcaches_fold_all(npa_device *d) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        if (!t) continue;
        empty_tcache(d, t);
        fold_accumulated(d, t);
    }
}

void npa_tcaches_point_slots(npa_device *d) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++)
        if (d->tcaches[i]) d->tcaches[i]->slot = &d->threads[i];
}

void npa_tcaches_destroy(npa_device *d) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++)
        if (d->tcaches[i]) retire(d, d->tcaches[i]);
}

const npa_lent *npa_tcaches_find_lent(const npa_device *d, uintptr_t addr) {
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npa_tcache *t = d->tcaches[i];
        unsigned at = t ? lent_find(t, addr) : 0;
        if (t && at < t->lent_count) return &t->lent[at];
    }
    return NULL;
}

/* ---- threads and allocators ---------------------------------------------- */

static npa_allocator *live_allocator(uint64_t id) {
    for (npa_allocator *a = live_allocators; a; a = a->next_live)
        if (a->id == id) return a;
    return NULL;
}

void npa_tcaches_set_paused(npa_device *d, bool paused) {
    npa_lock_acquire(&d->exit_lock);
    d->paused = paused;
    npa_lock_release(&d->exit_lock);
    /* Resumed: no exit leaves its tcache from here on (leave_device) */
    for (unsigned i = 0; !paused && i < NPUALLOC_THREAD_SLOTS; i++)
        if (d->tcaches[i] && d->tcaches[i]->owner_gone) retire(d, d->tcaches[i]);
    npa_tcaches_settle(d);
}

/* How long an exit waits for a device lock before it looks again whether a
 * pause holds it: a pause that began while it waited wakes nobody. */
#define EXIT_LOOK_NS 1000000

/* The calling thread's t goes back to d: now, or, while a pause holds the
 * device lock, at the resume. Its exit must not wait for the resume (a
 * program may join it first), and leaving t costs nothing meanwhile: the
 * pause's settle took back every block t lent or held and zeroed its
 * ceilings, and nothing fills it while paused. Only the counts its slot
 * keeps (allocated, hits) wait for the resume's fold, which readers add
 * meanwhile as they did. */
static void leave_device(npa_device *d, npa_tcache *t) {
    while (!npa_lock_try_acquire(&d->lock)) {
        npa_lock_acquire(&d->exit_lock);
        bool paused = d->paused;
        if (paused) t->owner_gone = true;
        npa_lock_release(&d->exit_lock);
        if (paused) return;
        if (npa_lock_acquire_within(&d->lock, EXIT_LOOK_NS)) break;
    }
    retire(d, t);
    npa_lock_release(&d->lock);
}

/* The calling thread's caches go back to their devices: its exit, or its
 * move to another allocator. Under registry_lock. */
static void leave_allocator(void) {
    npa_thread_caches *mine = &npa_my_caches;
    npa_allocator *a = mine->allocator ? live_allocator(mine->allocator) : NULL;
    for (int i = 0; a && i < NPUALLOC_MAX_DEVICES; i++)
        if (mine->of_device[i]) leave_device(mine->of_device[i]->device, mine->of_device[i]);
    memset(mine, 0, sizeof *mine);
}

static void thread_exits(void *value) {
    (void)value;
    pthread_mutex_lock(&registry_lock);
    leave_allocator();
    pthread_mutex_unlock(&registry_lock);
}

static void make_exit_key(void) { exit_key_made = pthread_key_create(&exit_key, thread_exits) == 0; }

void npa_tcache_register_allocator(npa_allocator *a) {
    pthread_mutex_lock(&registry_lock);
    a->id = ++last_allocator_id;
    a->next_live = live_allocators;
    live_allocators = a;
    pthread_mutex_unlock(&registry_lock);
}

void npa_tcache_unregister_allocator(npa_allocator *a) {
    pthread_mutex_lock(&registry_lock);
    for (npa_allocator **link = &live_allocators; *link; link = &(*link)->next_live)
        if (*link == a) {
            *link = a->next_live;
            break;
        }
    pthread_mutex_unlock(&registry_lock);
    if (npa_my_caches.allocator == a->id) memset(&npa_my_caches, 0, sizeof npa_my_caches);
}

void npa_forget_threads_after_fork(void) {
    registry_lock = (pthread_mutex_t)PTHREAD_MUTEX_INITIALIZER;
    live_allocators = NULL;
    memset(&npa_my_caches, 0, sizeof npa_my_caches);
}

/* Binds the calling thread to a: false when it cannot have caches there. */
static bool bind_thread(npa_allocator *a) {
    npa_thread_caches *mine = &npa_my_caches;
    if (mine->allocator == a->id) return true;
    pthread_once(&exit_key_once, make_exit_key);
    if (!exit_key_made) return false;
    pthread_mutex_lock(&registry_lock);
    leave_allocator();
    bool bound = pthread_setspecific(exit_key, mine) == 0;
    if (bound) mine->allocator = a->id;
    pthread_mutex_unlock(&registry_lock);
    return bound;
}

npa_tcache *npa_tcache_get(npa_allocator *a, npa_device *d) {
    npa_tcache *t = npa_tcache_mine(a, d->id);
    if (t || a->config.recent_blocks == 0 || !bind_thread(a) || (npa_my_caches.refused & (1u << d->id)))
        return t;
    /* Line pairs of its own: its owner writes it on every fast call. */
    size_t size = (sizeof *t + NPA_APART - 1) & ~(size_t)(NPA_APART - 1);
    t = aligned_alloc(NPA_APART, size);
    if (!t) return NULL;
    memset(t, 0, size);
    t->device = d;
    t->owner = &npa_my_caches;
    t->config = d->config;
    t->stock.capacity = a->config.recent_blocks < NPA_RECENT_MAX ? a->config.recent_blocks : NPA_RECENT_MAX;
    t->large.capacity = NPA_LARGE_STOCK_MAX;
    t->large.unjudged = true;
    npa_lock_acquire(&d->lock);
    unsigned index = 0;
    while (index < NPUALLOC_THREAD_SLOTS && d->tcaches[index]) index++;
    if (index < NPUALLOC_THREAD_SLOTS) {
        t->index = index;
        t->slot = &d->threads[index];
        d->tcaches[index] = t;
        d->tcache_count++;
        npa_tcaches_settle(d); /* maybe a second thread */
    }
    npa_lock_release(&d->lock);
    if (index == NPUALLOC_THREAD_SLOTS) { /* torch's rule for this thread: every free to its pool */
        free(t);
        npa_my_caches.refused |= 1u << d->id;
        return NULL;
    }
    npa_my_caches.of_device[d->id] = t;
    return t;
}
