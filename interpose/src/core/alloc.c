/* The allocator's entry points: lifetime, per-device state, malloc (best fit
 * and split) and free (merge), the cache-emptying calls. The retry path lives
 * in oom.c, GC in gc.c, stream-safe deferral in pending.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

npa_allocator *npa_create(const npa_backend *backend, const npa_config *config) {
    if (!backend || !backend->raw_malloc || !backend->raw_free || !backend->synchronize || !backend->mem_get_info)
        return NULL;
    if ((backend->fence_record || backend->fence_record_streams) && !backend->fence_done) return NULL;
    if (!backend->capture_stack != !backend->visit_stack) return NULL;
    npa_allocator *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    a->backend = *backend;
    if (config) a->config = *config;
    else npa_config_defaults(&a->config);
    /* The config in force says what is true: no expandable segments on a
     * backend without VMM calls (the hook has warned), nor beside the keys
     * torch_npu excludes them with (the parser has warned). */
    a->config.expandable_segments = a->config.expandable_segments && npa_backend_has_vmm(backend) &&
                                    !npa_config_excludes_expandable(&a->config);
    a->has_divisions = npa_config_has_divisions(&a->config);
    pthread_mutex_init(&a->init_lock, NULL);
    npa_tcache_register_allocator(a);
    return a;
}

void npa_for_devices(npa_allocator *a, int device, void (*fn)(npa_allocator *, npa_device *, void *), void *arg) {
    if (!a) return;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        if (device >= 0 && i != device) continue;
        npa_device *d = npa_device_get(a, i, false);
        if (!d) continue;
        npa_lock_acquire(&d->lock);
        fn(a, d, arg);
        npa_lock_release(&d->lock);
    }
}

static bool pair_holds(const npa_device *d, const npa_pool_pair *p) {
    for (size_t i = 0; i < d->segments.count; i++) {
        const npa_pool *pool = d->segments.items[i].first->pool; /* a segment's blocks share a pool */
        if (pool == &p->small || pool == &p->large) return true;
    }
    return false;
}

/* Frees the stream pools no segment is left to: a destroyed stream's go,
 * and a live stream gets new ones on its next allocation. With
 * only_retired_by, only pools set aside that way (a malloc may hold a live
 * stream's pair, still empty). */
static void drop_empty_stream_pools(npa_device *d, uint64_t only_retired_by) {
    for (npa_pool_pair **link = &d->streams, *p; (p = *link);) {
        if ((!only_retired_by || p->small.retired_by == only_retired_by) && !pair_holds(d, p)) {
            *link = p->next;
            free(p);
        } else {
            link = &p->next;
        }
    }
}

/* torch_npu's emptyCache: synchronize (which also completes every
 * outstanding fence), hand back every pending free, then give back every
 * cached segment. aclrtFree frees at once and unmapping does not wait for
 * queued work either, so without the synchronize a cached block could go
 * back while a kernel still uses it; and without the drain the last frees
 * would stay behind until some later call. A device that cannot be
 * synchronized keeps its pending frees and its cache: nothing proves their
 * work is done. Returns the synchronize's error. */
static bool must_wait_before_release(const npa_device *d) {
    if (npa_pending_any(d) || npa_expandable_unmappable(d)) return true;
    for (size_t i = 0; i < d->segments.count; i++) {
        const npa_segment *seg = &d->segments.items[i];
        if (!seg->expandable && seg->first->phase == NPA_PHASE_FREE && !npa_block_is_split(seg->first))
            return true;
    }
    return false; /* nothing would go back but ranges with nothing mapped */
}

static npa_error release_locked(npa_allocator *a, npa_device *d) {
    npa_tcaches_flush(d);
    npa_error err = NPA_OK;
    if (must_wait_before_release(d)) {
        err = npa_synchronize_and_drain(a, d);
    } else { /* torch counts its release's synchronize_and_free_events, events to wait for or none */
        npa_stats_begin(d);
        npa_stat_add(&d->stats->num_sync_all_streams, 1);
        npa_stats_end(d);
    }
    if (err != NPA_OK) return err;
    npa_release_cached_segments(a, d, 0);
    drop_empty_stream_pools(d, 0);
    npa_stats_sample_device_memory(a, d, NULL, NULL);
    return NPA_OK;
}

static void device_destroy(npa_allocator *a, npa_device *d) {
    npa_lock_acquire(&d->lock);
    npa_tcaches_destroy(d);
    release_locked(a, d);
    /* Batches still waiting (the device could not be synchronized) belong to
     * work that may yet run: their blocks and segments stay with the device;
     * only the fences go. */
    for (int kind = 0; kind < NPA_BATCH_KINDS; kind++)
        for (npa_fence_batch *b = d->batches[kind], *next; b; b = next) {
            next = b->next;
            if (a->backend.fence_release) a->backend.fence_release(a->backend.ctx, b->fence);
            free(b->streams);
            free(b);
        }
    for (npa_fence_batch *b = d->spare_batches, *next; b; b = next) {
        next = b->next;
        free(b->streams);
        free(b);
    }
    /* Live blocks recorded on other streams, and blocks whose fence never
     * came, keep their stream sets until now. Ranges that keep live blocks
     * stay with the program, like plain segments: only their bookkeeping goes. */
    for (size_t i = 0; i < d->segments.count; i++) {
        for (npa_block *b = d->segments.items[i].first; b; b = b->next) {
            free(b->uses);
            b->uses = NULL;
        }
        if (d->segments.items[i].expandable) npa_expandable_forget(d->segments.items[i].expandable);
    }
    for (npa_pool_pair *p = d->streams, *next; p; p = next) {
        next = p->next;
        free(p);
    }
    free(d->fence_streams);
    npa_lock_release(&d->lock);
    npa_block_map_destroy(&d->live);
    npa_slab_destroy(&d->slab);
    npa_history_reset(&d->history, 0);
    free(d->segments.items);
    free(d);
}

void npa_destroy(npa_allocator *a) {
    if (!a) return;
    npa_tcache_unregister_allocator(a); /* no exiting thread folds into it from here */
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++)
        if (a->devices[i]) device_destroy(a, a->devices[i]);
    pthread_mutex_destroy(&a->init_lock);
    free(a);
}

/* The cap a fraction sets on a device of total_bytes, in *cap (0: none,
 * for 1.0 or a device of unknown size). Every allocation takes a segment (or
 * an expandable page) of at least NPA_SMALL_BUFFER, so a cap below that
 * would refuse everything, and one that rounds to 0 would read as "no cap":
 * a smaller fraction must never mean more memory, so such a fraction is
 * refused (false). */
static bool fraction_cap(double fraction, size_t total_bytes, size_t *cap) {
    *cap = 0;
    if (!(fraction < 1.0) || total_bytes == 0) return true;
    *cap = (size_t)(fraction * (double)total_bytes);
    return *cap >= NPA_SMALL_BUFFER;
}

/* fraction_cap for a fraction set at run time, which a device of unknown
 * size refuses: it has nothing to take a fraction of. */
static bool fraction_fits(double fraction, size_t total_bytes, size_t *cap) {
    return fraction_cap(fraction, total_bytes, cap) && total_bytes != 0;
}

/* The per-process cap (0: none) and what GC measures against; the caller
 * publishes reserved_limit_bytes (npa_stats_init for a new device). */
static void set_limit(npa_device *d, size_t cap) {
    d->limit_bytes = cap;
    d->allowed_bytes = cap ? cap : d->total_bytes;
}

/* set_limit on a device in use: reserved_limit_bytes follows under the
 * seqlock. */
static void publish_limit(npa_device *d, size_t cap) {
    set_limit(d, cap);
    npa_stats_begin(d);
    npa_stat_store(&d->stats->reserved_limit_bytes, (int64_t)cap);
    npa_stats_end(d);
}

/* per_process_memory_fraction of the config on a new device. A refused
 * fraction is refused as a bad value is, with a warning, and the default
 * (no cap) is kept: for this device only, since the cap depends on the
 * device's size, so the setting itself stays (and the config string shows
 * it) for devices it fits. */
static size_t config_cap(npa_allocator *a, int id, size_t total_bytes) {
    double fraction = a->config.per_process_memory_fraction;
    size_t cap;
    if (fraction_cap(fraction, total_bytes, &cap)) return cap;
    if (a->backend.warn) {
        char message[256];
        snprintf(message, sizeof message,
                 "per_process_memory_fraction:%g caps device %d at %zu bytes, below the smallest segment (%zu "
                 "bytes), so nothing could be allocated; refused there: device %d runs without a cap (the setting "
                 "stays as given, for devices it fits)",
                 fraction, id, cap, NPA_SMALL_BUFFER, id);
        a->backend.warn(a->backend.ctx, message);
    }
    return 0;
}

static npa_device *device_create(npa_allocator *a, int id) {
    npa_device *d = aligned_alloc(_Alignof(npa_device), sizeof *d); /* local_threads' alignment */
    if (!d) return NULL;
    memset(d, 0, sizeof *d);
    if (!npa_block_map_init(&d->live, 256)) {
        free(d);
        return NULL;
    }
    d->id = id;
    d->plain.small.is_small = true;
    d->plain.small.largest_moved = d->plain.large.largest_moved = &d->largest_moved;
    npa_pool_summary_stop(&d->plain.large, &d->large_summary); /* until the device lends (npa_tcaches_settle) */
    for (int kind = 0; kind < NPA_BATCH_KINDS; kind++) d->batches_tail[kind] = &d->batches[kind];
    d->backend = &a->backend;
    d->config = &a->config;
    d->allocator_id = a->id;
    npa_history_reset(&d->history, __atomic_load_n(&a->config.record_history, __ATOMIC_RELAXED));

    size_t free_bytes = 0, total_bytes = 0;
    if (a->backend.mem_get_info(a->backend.ctx, id, &free_bytes, &total_bytes) != NPA_OK) free_bytes = total_bytes = 0;
    d->total_bytes = total_bytes;
    set_limit(d, config_cap(a, id, total_bytes));

    d->stats = a->backend.stats_storage ? a->backend.stats_storage(a->backend.ctx, id) : NULL;
    if (!d->stats) d->stats = &d->local_stats;
    d->threads = a->backend.thread_stats_storage ? a->backend.thread_stats_storage(a->backend.ctx, id) : NULL;
    if (!d->threads) d->threads = d->local_threads;
    npa_stats_init(a, d, free_bytes);
    return d;
}

void npa_device_size_known(npa_allocator *a, npa_device *d, size_t total_bytes) {
    d->total_bytes = total_bytes;
    publish_limit(d, config_cap(a, d->id, total_bytes));
}

npa_device *npa_device_create_slow(npa_allocator *a, int device) {
    pthread_mutex_lock(&a->init_lock);
    npa_device *d = a->devices[device];
    if (!d) {
        d = device_create(a, device);
        if (d) __atomic_store_n(&a->devices[device], d, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&a->init_lock);
    return d;
}

double npa_gc_threshold(const npa_allocator *a) {
    double t;
    __atomic_load(&a->config.garbage_collection_threshold, &t, __ATOMIC_RELAXED);
    return t;
}

/* torch's setMemoryFraction: later growth is checked against the new cap;
 * what is reserved already stays, even above it. Under the device lock, as
 * every reader of the cap (a growth, GC, an OOM report) holds it. A device
 * made while the runtime could not tell its size asks again first. One
 * whose size is still unknown cannot be capped, and is refused, as a cap
 * below a segment is: 1.0 too, since the first sample that tells the size
 * would replace that "no cap" with the config's cap. */
int npa_set_memory_fraction(npa_allocator *a, int device, double fraction) {
    if (!a || !(fraction >= 0.0 && fraction <= 1.0) || device < 0 || device >= NPUALLOC_MAX_DEVICES) return -1;
    size_t cap;
    npa_device *d = npa_device_get(a, device, false);
    if (!d) { /* made only for a fraction it takes: a refused one sets nothing up (stats, region slot) */
        size_t free_bytes, total_bytes = 0;
        if (a->backend.mem_get_info(a->backend.ctx, device, &free_bytes, &total_bytes) != NPA_OK ||
            !fraction_fits(fraction, total_bytes, &cap) || !(d = npa_device_get(a, device, true)))
            return -1;
    }
    npa_lock_acquire(&d->lock);
    if (d->total_bytes == 0) npa_stats_sample_device_memory(a, d, NULL, NULL);
    bool fits = fraction_fits(fraction, d->total_bytes, &cap);
    if (fits) publish_limit(d, cap);
    npa_lock_release(&d->lock);
    return fits ? 0 : -1;
}

static void warn_backend(void *arg, const char *message, npa_config_kept kept) {
    (void)kept; /* its messages say what stays */
    const npa_allocator *a = arg;
    if (a->backend.warn) a->backend.warn(a->backend.ctx, message);
}

static void flush_large_stocks_on(npa_allocator *a, npa_device *d, void *unused) {
    (void)a, (void)unused;
    npa_tcaches_flush_some(d, NPA_FLUSH_LARGE);
}

/* The two setters check torch_npu's rule against each other's key: under
 * init_lock, so two threads cannot each pass the check and end with both.
 * Either one set stops the threads' caches holding large blocks (tcache.c:
 * GC frees them by age, an expandable pool splits to the page), so what
 * they hold goes back to the pools, where GC sees it, cached since now as
 * torch's clock (which ticks only while a threshold is set) would have it. */
int npa_set_gc_threshold(npa_allocator *a, double threshold) {
    if (!a || !(threshold >= 0.0 && threshold < 1.0)) return -1;
    pthread_mutex_lock(&a->init_lock);
    bool set = npa_config_set_gc_threshold(&a->config, threshold, warn_backend, a);
    pthread_mutex_unlock(&a->init_lock);
    if (set && threshold > 0.0) npa_for_devices(a, -1, flush_large_stocks_on, NULL);
    return set ? 0 : -1;
}

int npa_set_expandable_segments(npa_allocator *a, bool on) {
    if (!a) return -1;
    if (on && !npa_backend_has_vmm(&a->backend)) {
        warn_backend(a, "expandable_segments:True needs the runtime's virtual memory API, which it lacks; "
                        "plain segments stay in use", NPA_KEPT_SAID);
        return -1;
    }
    pthread_mutex_lock(&a->init_lock);
    bool set = npa_config_set_expandable(&a->config, on, warn_backend, a);
    pthread_mutex_unlock(&a->init_lock);
    if (set && on) npa_for_devices(a, -1, flush_large_stocks_on, NULL);
    return set ? 0 : -1;
}

const npa_config *npa_get_config(const npa_allocator *a) { return a ? &a->config : NULL; }

/* torch's get_free_block: only the lower_bound is considered; the oversize
 * rules keep small requests off blocks >= max_split_size and stop large ones
 * from taking a block more than max_non_split_rounding bigger. */
static npa_block *best_fit(const npa_allocator *a, npa_pool *pool, size_t size) {
    const npa_config *c = &a->config;
    npa_block *b = npa_pool_lower_bound(pool, size);
    if (b && b->in_expandable) {
        if (npa_expandable_on(a)) {
            /* An expandable block ranks by how far it can grow, so the block
             * before unmapped space is kept for a request that needs to grow it. */
            for (npa_block *next; b->in_expandable && (next = npa_pool_next(pool, b)) &&
                                  npa_expandable_reach(next) < npa_expandable_reach(b);)
                b = next;
        } else {
            /* Switched off at run time: torch honours that by taking plain
             * blocks only (the next in size order), leaving expandable ones be. */
            do b = npa_pool_next(pool, b);
            while (b && b->in_expandable);
        }
    }
    if (!b) return NULL;
    if (size < c->max_split_size && b->size >= c->max_split_size) return NULL;
    if (size >= c->max_split_size && b->size - size >= c->max_non_split_rounding) return NULL; /* no overflow */
    return b;
}

/* torch's rule asks the setting in force, not the block's segment: a plain
 * large block is split finely once expandable_segments is switched on, and
 * an expandable one by the large-pool rule once it is off. */
static bool should_split(const npa_allocator *a, const npa_block *b, size_t size) {
    size_t remaining = b->size - size;
    if (b->is_small || npa_expandable_on(a)) return remaining >= NPA_MIN_BLOCK_SIZE;
    return size < a->config.max_split_size && remaining > NPA_SMALL_SIZE;
}

/* The allocation's stats (alloc_found_block's), inside its section. */
static NPA_ALWAYS_INLINE void count_alloc(const npa_allocator *a, npualloc_device_stats *s, bool is_small,
                                          int64_t bytes, size_t requested, bool cache_hit) {
    npa_pool_stat_increase(s->allocation, is_small, 1);
    npa_pool_stat_increase(s->allocated_bytes, is_small, bytes);
    npa_pool_stat_increase(s->active, is_small, 1);
    npa_pool_stat_increase(s->active_bytes, is_small, bytes);
    npa_pool_stat_increase(s->requested_bytes, is_small, (int64_t)requested);
    if ((size_t)bytes >= a->config.max_split_size) npa_stat_increase(&s->oversize_allocations, 1);
    npa_stat_add(cache_hit ? &s->num_cache_hits : &s->num_cache_misses, 1);
}

/* count_alloc while the device lends: with threads' caches counting beside
 * the device, the device's own figures may rise only as far as their
 * ceilings leave below the peaks (tcache.c), the calling thread's own
 * headroom used first; else every tcache is frozen, the figures counted,
 * the ceilings refitted. Else the fast paths stop while the peaks are set
 * exactly. Out of line: a lone thread's malloc pays the test of d->lending
 * alone. */
static __attribute__((noinline)) void count_alloc_lending(npa_allocator *a, npa_device *d, bool is_small,
                                                           int64_t bytes, size_t requested, bool cache_hit) {
    npa_tcache *mine = npa_tcache_mine(a, d->id);
    if (mine) npa_tcache_borrow(d, mine, is_small, 1, bytes, (int64_t)requested);
    bool frozen = !npa_tcaches_fit(d, is_small, 1, bytes, (int64_t)requested) ||
                  d->freeze_at_close; /* the split before it froze (npa_stats_end_outermost) */
    if (frozen) npa_tcaches_freeze(d);
    count_alloc(a, d->stats, is_small, bytes, requested, cache_hit);
    if (frozen) {
        npa_tcaches_refit(d, false);
        npa_tcaches_thaw(d);
        if (d->freeze_at_close) npa_tcaches_thaw_at_close(d);
    }
}

/* torch's alloc_found_block's cut: b is out of its pool; rest (NULL: no
 * cut) takes its tail past size, back into the pool, inside a stats
 * section. inactive_split leaves expandable segments out, as torch: their
 * free pages can always be given back. */
static NPA_ALWAYS_INLINE void cut_found_block(npa_device *d, npa_block *b, npa_block *rest, size_t size) {
    npualloc_device_stats *s = d->stats;
    bool already_split = npa_block_is_split(b);
    bool counts_split = !b->in_expandable;
    if (rest) {
        rest->addr = b->addr + size;
        rest->size = b->size - size;
        rest->is_small = b->is_small;
        rest->in_expandable = b->in_expandable;
        rest->phase = NPA_PHASE_FREE;
        rest->prev = b;
        rest->next = b->next;
        if (b->next) b->next->prev = rest;
        b->next = rest;
        b->size = size;
        rest->pool = b->pool;
        npa_pool_insert(b->pool, rest);
        if (counts_split && already_split) {
            /* An inactive split block shrinks by the part handed out. */
            npa_pool_stat_decrease(s->inactive_split_bytes, b->is_small, (int64_t)size);
        } else if (counts_split) {
            npa_split_stat_increase(d, s->inactive_split_bytes, b->is_small, (int64_t)rest->size);
            npa_split_stat_increase(d, s->inactive_split, b->is_small, 1);
        }
    } else if (counts_split && already_split) {
        npa_pool_stat_decrease(s->inactive_split_bytes, b->is_small, (int64_t)b->size);
        npa_pool_stat_decrease(s->inactive_split, b->is_small, 1);
    }
}

/* torch's alloc_found_block: b is out of its pool; split off the tail if
 * the rules allow, then account the allocation. */
static NPA_ALWAYS_INLINE void alloc_found_block(npa_allocator *a, npa_device *d, npa_block *b, size_t size,
                                                size_t requested, bool cache_hit, bool lending) {
    npualloc_device_stats *s = d->stats;
    npa_block *rest = should_split(a, b, size) ? npa_slab_get(&d->slab) : NULL;
    npa_stats_begin_outermost(d);
    cut_found_block(d, b, rest, size);

    b->phase = NPA_PHASE_ALLOCATED;
    b->requested = requested;
    npa_block_map_insert(&d->live, b);

    /* Read once: as far as the compiler knows, a stat's store (int64_t) may
     * change the block's size (size_t), so it reloaded it after each one
     * (19 instructions a pair, with the free's below, counted by callgrind). */
    bool is_small = b->is_small;
    int64_t bytes = (int64_t)b->size;
    if (lending) count_alloc_lending(a, d, is_small, bytes, requested, cache_hit);
    else count_alloc(a, s, is_small, bytes, requested, cache_hit);
    npa_stats_end_outermost(d);
}

/* The pools of a stream, made on its first allocation and moved to the
 * front on each use (a program allocates on one or two streams at a time);
 * NULL when host memory ran out. */
static npa_pool_pair *stream_pools(npa_device *d, uintptr_t stream) {
    for (npa_pool_pair **link = &d->streams, *p; (p = *link); link = &p->next) {
        if (p->small.stream != stream || p->small.retired_by) continue;
        if (link != &d->streams) {
            *link = p->next;
            p->next = d->streams;
            d->streams = p;
        }
        return p;
    }
    npa_pool_pair *p = calloc(1, sizeof *p);
    if (!p) return NULL;
    p->small = (npa_pool){.is_small = true, .on_stream = true, .stream = stream, .largest_moved = &d->largest_moved};
    p->large = (npa_pool){.on_stream = true, .stream = stream, .largest_moved = &d->largest_moved};
    p->next = d->streams;
    d->streams = p;
    return p;
}

/* Blocks of other streams recorded on the stream being destroyed: an event
 * there once it is gone would name nothing (on CANN, a freed stream), and
 * until the destroy is done its work may still use them, so a synchronize
 * stands in for that stream's event when they are freed (or now, for those
 * freed and waiting for the batch's events to be recorded). */
static void forget_uses_on(npa_device *d, uintptr_t stream, uint64_t token) {
    for (size_t i = 0; i < d->segments.count; i++)
        for (npa_block *b = d->segments.items[i].first; b; b = b->next) {
            npa_stream_set *set = b->uses;
            for (size_t k = 0; set && k < set->count; k++)
                if (set->streams[k] == stream) {
                    set->streams[k] = set->streams[--set->count];
                    b->unknown_by = b->uses_unknown ? NPA_UNKNOWN_STAYS : token;
                    b->uses_unknown = true;
                    if (set->count == 0) { /* no use left: once settled, its free waits for nothing */
                        free(set);
                        b->uses = NULL;
                    }
                    break;
                }
        }
}

/* Clears the marks forget_uses_on left for token alone. */
static void settle_uses_on(npa_device *d, uint64_t token) {
    for (size_t i = 0; i < d->segments.count; i++)
        for (npa_block *b = d->segments.items[i].first; b; b = b->next)
            if (b->uses_unknown && b->unknown_by == token) {
                b->uses_unknown = false;
                b->unknown_by = 0;
            }
}

/* A destroy of a stream: its handle, and the token set-aside pools get. */
typedef struct stream_retire {
    uintptr_t stream;
    uint64_t token;
} stream_retire;

static void retire_on(npa_allocator *a, npa_device *d, void *arg) {
    (void)a;
    const stream_retire *r = arg;
    for (npa_pool_pair *p = d->streams; p; p = p->next)
        if (p->small.stream == r->stream && !p->small.retired_by) p->small.retired_by = p->large.retired_by = r->token;
    forget_uses_on(d, r->stream, r->token);
}

/* Around aclrtDestroyStream, which waits for the stream's queued work.
 * Before it, the stream's pools are set aside under a token of this
 * destroy: they serve no allocation (a stream the runtime gives the same
 * handle afterwards gets new ones). */
uint64_t npa_stream_retire(npa_allocator *a, uintptr_t stream) {
    if (!a) return 0;
    stream_retire r = {.stream = stream, .token = __atomic_add_fetch(&a->retire_tokens, 1, __ATOMIC_RELAXED)};
    npa_for_devices(a, -1, retire_on, &r);
    return r.token;
}

/* Gives back the idle segments of the pools retired_by names and frees
 * those pools once empty. */
static void release_retired(npa_allocator *a, npa_device *d, uint64_t retired_by) {
    int64_t freed = d->stats->num_device_free;
    npa_release_cached_segments(a, d, retired_by);
    drop_empty_stream_pools(d, retired_by);
    if (d->stats->num_device_free != freed) npa_stats_sample_device_memory(a, d, NULL, NULL);
}

/* Called where blocks may have gone back to their pools, outside any stats
 * section (a release calls the backend): the segments of gone streams that
 * their last blocks left free go back now, since nothing allocates from
 * them again. */
static inline void release_gone_freed(npa_allocator *a, npa_device *d) {
    if (__builtin_expect(!d->gone_freed, 1)) return;
    d->gone_freed = false;
    release_retired(a, d, NPA_STREAM_GONE);
}

static bool holds_retired(const npa_device *d, uint64_t token) {
    for (const npa_pool_pair *p = d->streams; p; p = p->next)
        if (p->small.retired_by == token) return true;
    return false;
}

/* The destroy returned: the stream's work is done. The blocks whose uses
 * it alone made unknown need no synchronize any more, and what its
 * set-aside pools cache is idle (freed on the stream before its destroy
 * waited, or since through its uses' events), so it goes back to the
 * device now, as an empty_cache would give it, rather than wait for a
 * stream that will not come (a program making a stream per step would
 * otherwise reserve a segment per step). Only this destroy's pools: those
 * of a stream given the same handle since, and being destroyed in turn,
 * may still be in use. Pools with live blocks are marked gone: their
 * blocks go back as they are freed (free_into_gone_pool). Most streams
 * never had pools (their programs allocate through aclrtMalloc): the cache
 * is then left alone. */
static void destroyed_on(npa_allocator *a, npa_device *d, void *arg) {
    uint64_t token = *(const uint64_t *)arg;
    settle_uses_on(d, token);
    if (!holds_retired(d, token)) return;
    npa_tcaches_flush(d);
    release_retired(a, d, token);
    for (npa_pool_pair *p = d->streams; p; p = p->next)
        if (p->small.retired_by == token) p->small.retired_by = p->large.retired_by = NPA_STREAM_GONE;
}

void npa_stream_destroyed(npa_allocator *a, uint64_t token) {
    if (token) npa_for_devices(a, -1, destroyed_on, &token);
}

static void not_destroyed_on(npa_allocator *a, npa_device *d, void *arg) {
    (void)a;
    uint64_t token = *(const uint64_t *)arg;
    for (npa_pool_pair *p = d->streams; p; p = p->next)
        if (p->small.retired_by == token) p->small.retired_by = p->large.retired_by = 0;
}

void npa_stream_not_destroyed(npa_allocator *a, uint64_t token) {
    if (token) npa_for_devices(a, -1, not_destroyed_on, &token);
}

/* Best fit after a miss while the fast paths run: the threads' held blocks
 * of the pool's class go back one at a time (npa_tcaches_return_one) until
 * one fits, all of them when none does, as a lone thread's miss flushes
 * them all. A flush of every stock made each thread's next mallocs miss
 * what it had held: in make bench's two threads, more than half the
 * small stocks' misses came after one. */
static __attribute__((noinline)) npa_block *best_fit_returning(npa_allocator *a, npa_device *d, npa_pool *pool,
                                                               size_t rounded) {
    unsigned which = pool->is_small ? NPA_FLUSH_SMALL : NPA_FLUSH_LARGE;
    npa_block *b = NULL;
    npa_tcaches_freeze(d);
    while (!b && npa_tcaches_return_one(d, which)) b = best_fit(a, pool, rounded);
    npa_tcaches_thaw(d);
    return b;
}

/* While the device lends, a block best fit found for the calling thread t
 * is lent to it as a block of its stock would be (npa_tcache_lend_found),
 * cut first as the malloc cuts it: its free is then a fast one into the
 * stock, where from d->live it took the device lock (make bench's two
 * threads: half the calls that took it). Only a block t's stock would take
 * back, whose lend t's ceilings allow: decided before the cut, so that
 * otherwise b goes on as it was (alloc_found_block cuts and counts it). */
static __attribute__((noinline)) npa_block *lend_found_block(npa_allocator *a, npa_device *d, npa_tcache *t,
                                                             npa_block *b, size_t size, size_t requested,
                                                             bool *lent) {
    bool cuts = should_split(a, b, size);
    npa_block *rest = cuts ? npa_slab_get(&d->slab) : NULL;
    if (cuts && !rest) return b; /* no host memory for the cut: alloc_found_block's way */
    if (!npa_tcache_lends_found(d, t, b, cuts ? size : b->size, requested)) {
        if (rest) npa_slab_put(&d->slab, rest);
        return b;
    }
    npa_stats_begin(d);
    cut_found_block(d, b, rest, size);
    npa_tcache_lend_found(d, t, b, requested);
    npa_stats_end(d);
    *lent = true;
    return b;
}

/* A free block of pool for rounded bytes: a block held by the calling
 * thread's cache t (of exactly that size, or for the plain large pool one
 * torch would hand out whole that comes before the pool's best fit, by
 * size then address: torch's one search over both; *lent: lent to the
 * caller for requested bytes, npa_tcache_take; while the device lends, a
 * block best fit finds may be lent too, lend_found_block), else best fit,
 * else best fit once the threads' held blocks are merged back (they may fit
 * it together with their neighbours: a miss of either pool gives back the
 * stocks of its blocks before the pool asks the device for memory, while
 * lending one block at a time until one fits, best_fit_returning); NULL on
 * a miss. Held blocks are not merged before a cut: a block beside one is cut at its own
 * start where torch, with the two merged, cuts at the held block's (the
 * layouts can differ by what the threads' caches hold: up to 2 MiB of small
 * blocks a thread, and while the device lends up to 32 MiB of large ones;
 * README). Merging them first cost a malloc of a size the cache does not
 * hold a pool return each: 25% of the hot path's rate. ticks: the look is
 * one of torch's searches (get_free_block), counted on the GC clock. */
static NPA_ALWAYS_INLINE npa_block *take_cached_block(npa_allocator *a, npa_device *d, npa_tcache *t, npa_pool *pool,
                                           size_t rounded, size_t requested, bool ticks, bool lending,
                                           bool *lent) {
    npa_block *fit = NULL;
    bool fitted = false; /* fit is the pool's best fit, looked up once for both */
    if (lending) { /* it may be lent; the large stock holds blocks only while the device lends */
        if (t) {
            if (!pool->is_small) {
                fit = best_fit(a, pool, rounded);
                fitted = true;
            }
            npa_block *b = npa_tcache_take(d, t, pool, rounded, requested, fit, lent);
            if (b) return b;
        }
    } else if (t && pool->is_small) { /* npa_tcache_take's, with t not lending: inline, as main's hit (an empty
                                       * stock's scan stops at once) */
        npa_lent held;
        if (npa_stock_take(&t->stock, pool, rounded, &held, false)) return held.block; /* largest published */
    }
    /* torch's GC clock: a search counts only while the threshold is set, so
     * what was cached before it is all of one age. */
    if (ticks && npa_gc_threshold(a) > 0.0) pool->search_count++;
    npa_block *b = fitted ? fit : best_fit(a, pool, rounded);
    /* Best fit left the held blocks of the pool's size class as they were
     * (a small block never serves a large request, nor a large one a small). */
    if (!b && lending) b = best_fit_returning(a, d, pool, rounded);
    else if (!b && pool->is_small && npa_tcaches_flush_some(d, NPA_FLUSH_SMALL)) b = best_fit(a, pool, rounded);
    if (b) npa_pool_remove(pool, b);
    if (lending && b && t) b = lend_found_block(a, d, t, b, rounded, requested, lent);
    return b;
}

/* The stream a stream-aware malloc allocates on, and how it uses the block. */
typedef struct stream_request {
    uintptr_t stream;
    npa_stream_flags flags;
} stream_request;

/* The calling thread's cache serves a plain malloc (on NULL) if it can,
 * with no device lock (tcache.c): only while the device lends, which malloc_on
 * asks first, so that a lone thread pays one test for it and no call. The
 * device by its index, not d->id: that field shares the device lock's cache
 * line, which every slow call of another thread writes, and the fast paths
 * read no line the lock's holder writes. */
static __attribute__((noinline)) bool malloc_fast(npa_allocator *a, int device, const void *on, size_t size,
                                                  size_t rounded, void **ptr) {
    if (on) return false; /* asked here: on is no constant in malloc_on's one out-of-line copy */
    npa_tcache *t = npa_tcache_serving(a, device);
    return t && size <= NPA_MAX_REQUEST && npa_tcache_malloc(t, rounded, size, ptr);
}

static NPA_ALWAYS_INLINE npa_error malloc_locked(npa_allocator *a, npa_device *d, npa_tcache *t, int device,
                                                 size_t size, size_t rounded, const stream_request *on, void **ptr,
                                                 bool lending);
static npa_error malloc_locked_lending(npa_allocator *a, npa_device *d, npa_tcache *t, int device, size_t size,
                                       size_t rounded, const stream_request *on, void **ptr);

/* on: NULL for a plain malloc. One pointer, not the stream, its flags and
 * whether there is one: with six arguments or fewer nothing goes through
 * the stack (x86-64 and aarch64 pass six and eight in registers), which
 * cost each malloc 3 instructions by callgrind (make bench's hot path). */
static inline npa_error malloc_on(npa_allocator *a, int device, size_t size, npa_entry entry,
                                  const stream_request *on, void **ptr) {
    if (!ptr) return NPA_ERR_INVALID_PARAM;
    *ptr = NULL;
    if (!a || size == 0 || (unsigned)entry > NPA_ENTRY_EXACT) return NPA_ERR_INVALID_PARAM;
    npa_device *d = npa_device_get(a, device, true);
    if (!d) return device < 0 || device >= NPUALLOC_MAX_DEVICES ? NPA_ERR_INVALID_PARAM : NPA_ERR_OOM;
    /* Rounded before the lock, which the config's rounding needs not (no
     * key of it changes at run time): one call for both paths, which LTO
     * inlines, as on main, where two left it a call (6 instructions a pair).
     * SIZE_MAX for a request no pool can hold, which malloc_locked asks of
     * rounded, not size again; an if, expected, not a conditional
     * expression, for which GCC laid the rounding out of line (two jumps):
     * 4.4 instructions a lone thread's pair by callgrind. */
    size_t rounded = SIZE_MAX;
    if (__builtin_expect(size <= NPA_MAX_REQUEST, 1))
        rounded = npa_round_size_as(&a->config, a->has_divisions, npa_entry_size(entry, size));
    if (__builtin_expect(__atomic_load_n(&d->lending, __ATOMIC_RELAXED), 0) &&
        malloc_fast(a, device, on, size, rounded, ptr))
        return NPA_OK;

    npa_tcache *t = npa_tcache_get(a, d);
    npa_lock_acquire(&d->lock);
    npa_pending_poll(a, d);
    release_gone_freed(a, d);
    if (__builtin_expect(d->lending, 0)) return malloc_locked_lending(a, d, t, device, size, rounded, on, ptr);
    return malloc_locked(a, d, t, device, size, rounded, on, ptr, false);
}

/* malloc_on's under the device lock after the poll (released before it
 * returns), for t the calling thread's tcache or NULL; lending: the device's, which a
 * lone thread's malloc tests once (malloc_on) for everything here. */
static NPA_ALWAYS_INLINE npa_error malloc_locked(npa_allocator *a, npa_device *d, npa_tcache *t, int device,
                                                 size_t size, size_t rounded, const stream_request *on, void **ptr,
                                                 bool lending) {
    npa_block *b = NULL;
    bool cache_hit = false, lent = false;
    npa_refusal why = {0};
    npa_pool *pool = NULL; /* none for a request no pool can hold */
    if (rounded != SIZE_MAX) { /* size <= NPA_MAX_REQUEST: malloc_on rounded it */
        /* Without host memory for a stream's pools the block is served as a
         * plain one: fenced when freed, which is safe on any stream. */
        npa_pool_pair *pair = on != NULL ? stream_pools(d, on->stream) : &d->plain;
        if (!pair) pair = &d->plain;
        pool = rounded <= NPA_SMALL_SIZE ? &pair->small : &pair->large;
        uint64_t searches_before = pool->search_count;
        b = take_cached_block(a, d, t, pool, rounded, size, true, lending, &lent);
        if (!b && npa_pending_any(d)) { /* what is pending may be done by now: fence the open frees, look again */
            /* torch hands back the frees whose events completed before its
             * one search of a malloc (process_events): the look before them
             * is taken back from the GC clock, and the next one counts. Put
             * back as it was, not decremented: a decrement reads the GC
             * threshold again, and GC switched on at run time between the
             * reads took back a search never counted (one search lost; were
             * it switched off again before the next look, the clock stayed
             * below the ages of blocks cached at the count, which wrap). */
            pool->search_count = searches_before;
            npa_pending_flush(a, d);
            release_gone_freed(a, d);
            b = take_cached_block(a, d, t, pool, rounded, size, true, lending, &lent);
        }
        cache_hit = b != NULL;
        /* The OOM retry (in npa_grow) synchronized and handed back every
         * pending free, which torch, whose frees rarely wait, need not look
         * at again; here every free may have been waiting, and one may fit.
         * torch has no search there, so the GC clock does not tick. */
        if (!b && !(b = npa_grow(a, d, pool, rounded, &why)) && why.error == NPA_OK) {
            b = take_cached_block(a, d, t, pool, rounded, size, false, lending, &lent);
            cache_hit = b != NULL;
        }
    }
    if (!b && why.error != NPA_OK) { /* not out of memory: the runtime's error, as torch raises it */
        npa_lock_release(&d->lock);
        return why.error;
    }
    if (!b) {
        char msg[512];
        npa_oom_report(a, d, pool, size, rounded, why.cap_hit, msg, sizeof msg);
        npa_lock_release(&d->lock);
        if (a->backend.report_oom)
            a->backend.report_oom(a->backend.ctx, device, msg);
        return NPA_ERR_OOM;
    }
    if (lent) { /* the thread's cache counted it */
        *ptr = (void *)b->addr;
        npa_lock_release(&d->lock);
        return NPA_OK;
    }
    alloc_found_block(a, d, b, rounded, size, cache_hit, lending);
    /* The request first: a plain entry (aclrtMalloc) has none, and its
     * block's pool then need not be asked; the other order cost each malloc
     * 3 more instructions by callgrind (make bench's hot path). */
    b->fence_own = on != NULL && (on->flags & NPA_STREAM_HOST_WRITES) && b->pool->on_stream;
    npa_history_note(d, b->pool, NPA_TRACE_ALLOC, b->addr, size);
    *ptr = (void *)b->addr;
    npa_lock_release(&d->lock);
    return NPA_OK;
}

static __attribute__((noinline)) npa_error malloc_locked_lending(npa_allocator *a, npa_device *d, npa_tcache *t,
                                                                 int device, size_t size, size_t rounded,
                                                                 const stream_request *on, void **ptr) {
    return malloc_locked(a, d, t, device, size, rounded, on, ptr, true);
}

npa_error npa_malloc(npa_allocator *a, int device, size_t size, npa_entry entry, void **ptr) {
    return malloc_on(a, device, size, entry, NULL, ptr);
}

npa_error npa_malloc_stream(npa_allocator *a, int device, size_t size, npa_entry entry, uintptr_t stream,
                            npa_stream_flags flags, void **ptr) {
    const stream_request on = {.stream = stream, .flags = flags};
    return malloc_on(a, device, size, entry, &on, ptr);
}

/* torch's free_block without the allocation's end: merge with free
 * neighbours (the lower block survives, so a segment's first block keeps
 * its struct), back into its pool. counted: b is already counted as an
 * inactive split block (a recent block). */
static void merge_into_pool(npa_device *d, npa_block *b, bool counted) {
    npualloc_device_stats *s = d->stats;
    npa_pool *pool = b->pool;
    int64_t inactive_blocks = 0, inactive_bytes = 0;
    if (counted && npa_block_is_split(b)) {
        inactive_blocks = -1;
        inactive_bytes = -(int64_t)b->size;
    }

    npa_block *prev = b->prev;
    if (prev && prev->phase == NPA_PHASE_FREE) {
        npa_pool_remove(pool, prev);
        inactive_blocks -= 1;
        inactive_bytes -= (int64_t)prev->size;
        npa_block_absorb(d, prev, b);
        b = prev;
    }
    npa_block *next = b->next;
    if (next && next->phase == NPA_PHASE_FREE) {
        npa_pool_remove(pool, next);
        inactive_blocks -= 1;
        inactive_bytes -= (int64_t)next->size;
        npa_block_absorb(d, b, next);
    }
    b->phase = NPA_PHASE_FREE;
    b->requested = 0;
    npa_pool_insert(pool, b);
    if (pool->retired_by == NPA_STREAM_GONE) d->gone_freed = true;
    if (npa_block_is_split(b)) {
        inactive_blocks += 1;
        inactive_bytes += (int64_t)b->size;
    }
    if (b->in_expandable) inactive_blocks = inactive_bytes = 0; /* left out, as in alloc_found_block */

    npa_stats_begin(d);
    if (inactive_blocks > 0) npa_split_stat_increase(d, s->inactive_split, b->is_small, inactive_blocks);
    else if (inactive_blocks < 0) npa_pool_stat_decrease(s->inactive_split, b->is_small, -inactive_blocks);
    if (inactive_bytes > 0) npa_split_stat_increase(d, s->inactive_split_bytes, b->is_small, inactive_bytes);
    else if (inactive_bytes < 0) npa_pool_stat_decrease(s->inactive_split_bytes, b->is_small, -inactive_bytes);
    npa_stats_end(d);
}

void npa_pool_return(npa_device *d, npa_block *b) { merge_into_pool(d, b, true); }

/* torch's free_block: the block stops being active and joins its pool. */
void npa_free_block(npa_allocator *a, npa_device *d, npa_block *b) {
    (void)a;
    npualloc_device_stats *s = d->stats;
    bool is_small = b->is_small;
    size_t size = b->size;
    size_t requested = b->requested;
    npa_history_note(d, b->pool, NPA_TRACE_FREE_COMPLETED, b->addr, requested);
    npa_stats_begin(d);
    merge_into_pool(d, b, false);
    npa_pool_stat_decrease(s->active, is_small, 1);
    npa_pool_stat_decrease(s->active_bytes, is_small, (int64_t)size);
    npa_pool_stat_decrease(s->requested_bytes, is_small, (int64_t)requested);
    npa_stats_end(d);
}

void npa_block_absorb(npa_device *d, npa_block *lower, npa_block *upper) {
    lower->size += upper->size;
    lower->next = upper->next;
    if (upper->next) upper->next->prev = lower;
    npa_slab_put(&d->slab, upper);
}

/* Notes that b (of a stream's pool) is used on stream too. Without host
 * memory for the note, its free waits for a synchronize instead. */
static void note_use(npa_block *b, uintptr_t stream) {
    if (stream == b->pool->stream) return;
    if (b->uses_unknown) { /* not noted: a synchronize stands in for it too, whatever settles meanwhile */
        b->unknown_by = NPA_UNKNOWN_STAYS;
        return;
    }
    npa_stream_set *set = b->uses;
    for (size_t i = 0; set && i < set->count; i++)
        if (set->streams[i] == stream) return;
    if (!set || set->count == set->capacity) {
        size_t capacity = set ? set->capacity * 2 : 2;
        npa_stream_set *grown = realloc(set, sizeof *set + capacity * sizeof set->streams[0]);
        if (!grown) {
            b->uses_unknown = true;
            b->unknown_by = NPA_UNKNOWN_STAYS;
            return;
        }
        if (!set) grown->count = 0;
        grown->capacity = capacity;
        b->uses = set = grown;
    }
    set->streams[set->count++] = stream;
}

/* A block of a stream whose destroy returned: that stream's work is done,
 * but the runtime may have given its handle to a new stream, and a use
 * there, recorded or freed on under that handle, reads as the block's own.
 * So it waits, with the plain frees, for a fence over every live stream,
 * whatever the reuse policy (eager decides reuse, and this memory goes back
 * to the device once free: release_gone_freed). */
static void free_into_gone_pool(npa_allocator *a, npa_device *d, npa_block *b) {
    if (a->backend.fence_record) npa_pending_add_gone(d, b);
    else npa_free_block(a, d, b); /* a backend with no fences has no streams to wait for */
}

/* torch's free: the allocation ends now. A plain block becomes reusable now
 * or once the fence of its batch completes (the reuse policy); a stream's
 * block now, or once its other streams' events complete. */
static NPA_ALWAYS_INLINE void free_allocated_as(npa_allocator *a, npa_device *d, npa_tcache *t, npa_block *b,
                                                bool lending) {
    npualloc_device_stats *s = d->stats;
    npa_history_note(d, b->pool, NPA_TRACE_FREE_REQUESTED, b->addr, b->requested);
    npa_stats_begin_outermost(d);
    bool is_small = b->is_small;
    size_t size = b->size, requested = lending ? b->requested : 0;
    if (__builtin_expect(b->pool->retired_by == NPA_STREAM_GONE, 0)) {
        free_into_gone_pool(a, d, b);
    } else if (b->pool->on_stream && (b->uses || b->uses_unknown || npa_block_fences_own(b))) {
        npa_pending_add_uses(a, d, b);
    } else if (!b->pool->on_stream && npa_plain_fence_needed(a)) {
        npa_pending_add(d, b);
    } else if (t && npa_tcache_keep(d, t, b, lending)) { /* reusable at once: on its own stream, or eager */
    } else {
        npa_free_block(a, d, b);
    }
    /* After the block's way is chosen, which reads it and the device: a
     * stat's store is atomic, and GCC reloads the fields read after one (it
     * may alias them). Readers see the section's stats whole, in no order. */
    npa_pool_stat_decrease(s->allocation, is_small, 1);
    npa_pool_stat_decrease(s->allocated_bytes, is_small, (int64_t)size);
    if (size >= a->config.max_split_size) npa_stat_decrease(&s->oversize_allocations, 1);
    if (lending) {
        if (t) /* the room this free made, for the thread's fast mallocs */
            npa_tcache_regrant(d, t, is_small, 1, (int64_t)size, (int64_t)requested);
        if (d->freeze_at_close) npa_tcaches_thaw_at_close(d); /* the way chosen froze (npa_stats_end_outermost) */
    }
    npa_stats_end_outermost(d);
}

/* The free while the device lends, out of line: a lone thread's pays the
 * test of d->lending alone (free_allocated). */
static __attribute__((noinline)) void free_allocated_lending(npa_allocator *a, npa_device *d, npa_tcache *t,
                                                              npa_block *b) {
    free_allocated_as(a, d, t, b, true);
}

static NPA_ALWAYS_INLINE void free_allocated(npa_allocator *a, npa_device *d, npa_tcache *t, npa_block *b) {
    if (__builtin_expect(d->lending, 0)) free_allocated_lending(a, d, t, b);
    else free_allocated_as(a, d, t, b, false);
}

/* What a call does to the live block it names. */
typedef enum block_op { OP_FREE, OP_FREE_ON_STREAM, OP_RECORD } block_op;

/* Which device owns ptr: 1 done, 0 not in this device, -1 inside one of its
 * segments but not a live block start. */
static NPA_ALWAYS_INLINE int op_on_device(npa_allocator *a, npa_device *d, uintptr_t addr, block_op op, uintptr_t stream) {
    npa_lock_acquire(&d->lock);
    int result = 0;
    npa_block *b = op == OP_RECORD ? npa_block_map_find(&d->live, addr) : npa_block_map_take(&d->live, addr);
    if (!b && d->tcache_count && npa_tcaches_reclaim(d, addr)) /* lent by a thread's cache: the device's again */
        b = op == OP_RECORD ? npa_block_map_find(&d->live, addr) : npa_block_map_take(&d->live, addr);
    if (b) {
        if (op != OP_FREE && b->pool->on_stream) note_use(b, stream);
        if (op != OP_RECORD) free_allocated(a, d, npa_tcache_mine(a, d->id), b);
        release_gone_freed(a, d);
        result = 1;
    } else if (npa_segments_find(&d->segments, addr) >= 0) {
        if (op != OP_RECORD) {
            npa_stats_begin(d);
            npa_stat_add(&d->stats->num_invalid_frees, 1);
            npa_stats_end(d);
        }
        result = -1;
    }
    npa_lock_release(&d->lock);
    return result;
}

static __attribute__((noinline)) npa_free_result free_fast(npa_allocator *a, void *ptr, int device, int *device_out);

/* fast: a free (OP_FREE) the hinted device's fast free may take (free_fast),
 * not one it declined. */
static NPA_ALWAYS_INLINE npa_free_result block_op_any_device(npa_allocator *a, void *ptr, int hint_device, int *device_out,
                                           block_op op, uintptr_t stream, bool fast) {
    if (!a || !ptr) return NPA_FREE_NOT_OURS;
    bool hint_valid = hint_device >= 0 && hint_device < NPUALLOC_MAX_DEVICES;
    int first = hint_valid ? hint_device : 0;
    for (int i = -1; i < NPUALLOC_MAX_DEVICES; i++) {
        int dev = i < 0 ? first : i;
        if (i >= 0 && dev == first) continue;
        npa_device *d = npa_device_get(a, dev, false);
        if (!d) continue;
        if (fast && __builtin_expect(__atomic_load_n(&d->lending, __ATOMIC_RELAXED), 0) && i < 0 &&
            dev == hint_device) /* the hinted device's own (a valid hint) */
            return free_fast(a, ptr, dev, device_out);
        int found = op_on_device(a, d, (uintptr_t)ptr, op, stream);
        if (found < 0) return NPA_FREE_INVALID;
        if (found > 0) {
            if (device_out) *device_out = dev;
            return NPA_FREE_OK;
        }
    }
    npa_device *hint = hint_valid && op != OP_RECORD ? npa_device_get(a, hint_device, false) : NULL;
    if (hint) {
        npa_lock_acquire(&hint->lock);
        npa_stats_begin(hint);
        npa_stat_add(&hint->stats->num_foreign_frees, 1);
        npa_stats_end(hint);
        npa_lock_release(&hint->lock);
    }
    return NPA_FREE_NOT_OURS;
}

/* npa_free's way when the fast free declined, out of line (npa_free's own
 * copy, a lone thread's, stays inline). */
static __attribute__((noinline)) npa_free_result free_locked(npa_allocator *a, void *ptr, int hint_device,
                                                             int *device_out) {
    return block_op_any_device(a, ptr, hint_device, device_out, OP_FREE, 0, false);
}

/* A block the calling thread's cache lent goes back there with no device
 * lock (tcache.c), else the free takes the lock's way, out of line: asked
 * only while the hinted device lends, and handed the whole call (a tail
 * call), so that the fast free's result goes back as it is. By index, as
 * malloc_fast. */
static __attribute__((noinline)) npa_free_result free_fast(npa_allocator *a, void *ptr, int device, int *device_out) {
    npa_tcache *t = npa_tcache_serving(a, device);
    if (t && npa_tcache_free(a, t, (uintptr_t)ptr)) { /* not NULL: the lent table's empty slots say 0 */
        if (device_out) *device_out = device;
        return NPA_FREE_OK;
    }
    return free_locked(a, ptr, device, device_out);
}

npa_free_result npa_free(npa_allocator *a, void *ptr, int hint_device, int *device_out) {
    return block_op_any_device(a, ptr, hint_device, device_out, OP_FREE, 0, true);
}

npa_free_result npa_free_stream(npa_allocator *a, void *ptr, uintptr_t stream, int hint_device, int *device_out) {
    return block_op_any_device(a, ptr, hint_device, device_out, OP_FREE_ON_STREAM, stream, false);
}

npa_error npa_record_stream(npa_allocator *a, void *ptr, uintptr_t stream, int hint_device) {
    return block_op_any_device(a, ptr, hint_device, NULL, OP_RECORD, stream, false) == NPA_FREE_OK ? NPA_OK
                                                                                             : NPA_ERR_INVALID_PARAM;
}

/* arg: the first error of the devices released so far. */
static void release_on(npa_allocator *a, npa_device *d, void *arg) {
    npa_error err = release_locked(a, d), *first = arg;
    if (*first == NPA_OK) *first = err;
}

npa_error npa_empty_cache(npa_allocator *a, int device) {
    npa_error first = NPA_OK;
    npa_for_devices(a, device, release_on, &first);
    return first;
}

bool npa_empty_cache_would_synchronize(npa_allocator *a, int device) {
    npa_device *d = a ? npa_device_get(a, device, false) : NULL;
    if (!d) return false;
    npa_lock_acquire(&d->lock);
    npa_tcaches_flush(d); /* as the release would first: their blocks may free a segment */
    bool wait = must_wait_before_release(d);
    npa_lock_release(&d->lock);
    return wait;
}

unsigned npa_empty_cache_unless_busy(npa_allocator *a, unsigned devices) {
    unsigned busy = 0;
    for (int i = 0; a && i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = devices & (1u << i) ? npa_device_get(a, i, false) : NULL;
        if (!d) continue;
        if (!npa_lock_try_acquire(&d->lock)) {
            busy |= 1u << i;
            continue;
        }
        release_locked(a, d);
        npa_lock_release(&d->lock);
    }
    return busy;
}

static void flush_pending(npa_allocator *a, npa_device *d, void *unused) {
    (void)unused;
    npa_pending_flush(a, d);
    release_gone_freed(a, d);
}

void npa_process_pending(npa_allocator *a, int device) { npa_for_devices(a, device, flush_pending, NULL); }
