/* Per-thread caches (core/tcache.c): a thread's hits and their frees take
 * no device lock and write no device stat, yet the stats a reader sums stay
 * exact, peaks included (the ceilings), whatever the threads do meanwhile;
 * a block one thread's cache lent is freed by another, folded back when
 * its thread exits, shown allocated by snapshots; what a thread's stock
 * holds goes back for another thread's OOM retry and for empty_cache.
 * Failures inside helper threads are counted in their results, which the
 * main thread checks. */
#define _GNU_SOURCE /* pthread_timedjoin_np */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/internal.h"
#include "fake_backend.h"
#include "test_util.h"
#include "companion.h"

/* A warm cache: size allocated and freed a few times, so the stock holds
 * it and the ceilings cover it. */
static void warm(fixture *fx, size_t size) {
    for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx->a, alloc_exact(fx, 0, size), 0, NULL), NPA_FREE_OK);
}

static uint64_t device_seq(fixture *fx) {
    return __atomic_load_n(&npa_device_get(fx->a, 0, false)->stats->seq, __ATOMIC_ACQUIRE);
}

/* A thread alone on its device takes the device lock for everything (it
 * waits for nobody there), and its cache lends nothing: its stats are the
 * device's. A second thread turns the fast paths on; its exit, off again,
 * every figure back in the device's. */
static void test_fast_paths_need_two_threads(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    warm(&fx, 4096);
    uint64_t seq = device_seq(&fx);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(device_seq(&fx), seq + 2);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)p) != NULL);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    p = alloc_exact(&fx, 0, 4096);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)p) == NULL); /* lent */
    companion_stop(&c);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)p) != NULL); /* folded back: one thread left */
    CHECK_EQ(d->threads[0].current[0][NPUALLOC_THREAD_ALLOCATION], 0);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

/* A lone thread's stock keeps no index for the fast paths (its moves skip
 * addrs, pools and splits); the second thread's arrival writes it, so the
 * block the thread stocked alone is the one its next malloc gets, and a
 * pair on it is then the thread's own. Without the index the scans by
 * pool miss it, and best fit cuts another. */
static void test_a_lone_threads_stock_serves_the_fast_paths(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* stocked, the thread alone */
    companion c;
    companion_start(&c, &fx);
    void *q = alloc_exact(&fx, 0, 4096); /* slow: no ceilings yet */
    CHECK(q == p);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    uint64_t seq = device_seq(&fx);
    q = alloc_exact(&fx, 0, 4096);
    CHECK(q == p);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(device_seq(&fx), seq);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* Once warm, a pair is the thread's own: the device's seqlock does not
 * move, and the summed stats say what a torch allocator's would. */
static void test_a_warm_pair_leaves_the_device_alone(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    npualloc_device_stats before = stats_of(&fx, 0);
    uint64_t seq = device_seq(&fx);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(device_seq(&fx), seq);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, before.allocation[NPUALLOC_POOL_ALL].allocated + 1);
    CHECK_EQ(s.num_cache_hits, before.num_cache_hits + 1);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 2); /* the companion's block and the segment's tail */
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(device_seq(&fx), seq);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, s.allocation[NPUALLOC_POOL_ALL].allocated);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3); /* held whole, beside the tail */
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A thread whose small mallocs are fast and whose large ones are slow:
 * the large ones' figures come out of its own headroom and go back to it,
 * so its next small malloc is still a fast one, though it alone set every
 * peak (one block at a time: allocation's peak is 1). */
static void test_slow_mallocs_leave_the_fast_ones_fast(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    for (int i = 0; i < 3; i++) {
        warm(&fx, 4096);
        void *large = alloc_exact(&fx, 0, (size_t)(4 + i) * MiB);
        CHECK_EQ(fx.fake.calls_in_stats_section, 0);
        CHECK_EQ(npa_free(fx.a, large, 0, NULL), NPA_FREE_OK);
        /* Room for the next small block under the thread's ceilings: its
         * malloc takes no slow path for a grant. */
        const npa_tcache *t = npa_tcache_mine(fx.a, 0);
        CHECK(t->slot->current[0][NPUALLOC_THREAD_ACTIVE] + 1 <= t->ceiling[0][NPA_CEIL_BLOCKS]);
        CHECK(t->slot->current[0][NPUALLOC_THREAD_ACTIVE_BYTES] + 4096 <= t->ceiling[0][NPA_CEIL_BYTES]);
        uint64_t seq = device_seq(&fx);
        void *p = alloc_exact(&fx, 0, 4096);
        CHECK_EQ(device_seq(&fx), seq);
        CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
        CHECK_EQ(device_seq(&fx), seq);
    }
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].peak, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, 6 * MiB);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_SMALL].peak, 4096);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A slow malloc's block out of a pool, while the fast paths run, is lent
 * to the thread as a block of its stock would be, its figures the slow
 * path's, and its free is a fast one into the stock (the device's seqlock
 * stays) unless it sets a peak: the free of a block cut from a pool's tail
 * leaves one more inactive split block than ever before, a peak the slow
 * path sets. A block the stocks would not take back (above the large
 * stock's bytes) and one a miss cut from new memory stay the device's. */
static void test_a_pool_block_is_lent(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx); /* its 512 bytes held, its segment's tail in the pool */
    npa_device *d = npa_device_get(fx.a, 0, false);
    /* 8 KiB first: a malloc that sets a peak is the device's (no ceiling
     * covers it), and this one leaves the peaks room for the next. */
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 8192), 0, NULL), NPA_FREE_OK);
    void *p = alloc_exact(&fx, 0, 4096); /* cut from the tail */
    CHECK(npa_block_map_find(&d->live, (uintptr_t)p) == NULL);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, 8192);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3); /* the companion's block, the 8 KiB, the tail */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 3);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, (int64_t)(2 * MiB - 4096));
    CHECK_EQ(s.num_cache_hits, 2);
    CHECK_EQ(s.num_cache_misses, 1);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_tcache_mine(fx.a, 0)->stock.count, 2);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, s.allocation[NPUALLOC_POOL_ALL].allocated);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 4); /* held whole, beside the tail */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 4);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, (int64_t)(2 * MiB));

    /* 12 MiB, a segment of its own; held, then back in the pool whole when
     * a 14 MiB miss flushes the large stock first; served from there. */
    void *x = alloc_exact(&fx, 0, 12 * MiB);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)x) != NULL); /* a miss */
    CHECK_EQ(npa_free(fx.a, x, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 14 * MiB), 0, NULL), NPA_FREE_OK);
    void *y = alloc_exact(&fx, 0, 12 * MiB);
    CHECK(y == x);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)y) == NULL);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(12 * MiB));
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(12 * MiB));
    CHECK_EQ(s.allocation[NPUALLOC_POOL_LARGE].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].peak, (int64_t)(14 * MiB));
    uint64_t seq = device_seq(&fx);
    CHECK_EQ(npa_free(fx.a, y, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(device_seq(&fx), seq);

    size_t big = NPA_LARGE_STOCK_BYTES + 2 * MiB;
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, big), 0, NULL), NPA_FREE_OK); /* cached in the pool */
    void *r = alloc_exact(&fx, 0, big);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)r) != NULL);
    CHECK_EQ(npa_free(fx.a, r, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, s.allocation[NPUALLOC_POOL_ALL].allocated);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, (int64_t)big);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* Two threads, each warm on its own size, then holding it at once in
 * turn (barriers): the peak is exactly the two together, though each
 * thread's malloc may have been a fast one. */
typedef struct holder {
    fixture *fx;
    size_t size;
    pthread_barrier_t *barrier;
    long failures;
} holder;

static void *hold_in_turn(void *arg) {
    holder *h = arg;
    for (int i = 0; i < 8; i++) {
        void *p = NULL;
        h->failures += npa_malloc(h->fx->a, 0, h->size, NPA_ENTRY_EXACT, &p) != NPA_OK;
        h->failures += npa_free(h->fx->a, p, 0, NULL) != NPA_FREE_OK;
    }
    pthread_barrier_wait(h->barrier); /* both warm */
    void *p = NULL;
    h->failures += npa_malloc(h->fx->a, 0, h->size, NPA_ENTRY_EXACT, &p) != NPA_OK;
    pthread_barrier_wait(h->barrier); /* both hold */
    pthread_barrier_wait(h->barrier); /* the main thread looked */
    h->failures += npa_free(h->fx->a, p, 0, NULL) != NPA_FREE_OK;
    pthread_barrier_wait(h->barrier); /* both freed */
    pthread_barrier_wait(h->barrier); /* looked again */
    return NULL;
}

static void test_two_threads_peak_exactly_together(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 3);
    holder h[2] = {{.fx = &fx, .size = 3 * KiB, .barrier = &barrier},
                   {.fx = &fx, .size = 5 * KiB, .barrier = &barrier}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) CHECK_EQ(pthread_create(&threads[i], NULL, hold_in_turn, &h[i]), 0);
    pthread_barrier_wait(&barrier);
    npa_reset_peak_stats(fx.a, 0); /* nothing held: the peaks from here are the two holds' */
    pthread_barrier_wait(&barrier);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 8 * KiB);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, 8 * KiB);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_SMALL].peak, 2);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].peak, 8 * KiB);
    pthread_barrier_wait(&barrier);
    pthread_barrier_wait(&barrier);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].peak, 8 * KiB);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].peak, 2);
    pthread_barrier_wait(&barrier);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(pthread_join(threads[i], NULL), 0);
        CHECK_EQ(h[i].failures, 0);
    }
    pthread_barrier_destroy(&barrier);
    fixture_destroy(&fx);
}

/* Threads looping mallocs and frees (each holding a few blocks, small and
 * large) while a reader checks every summed read: no stat's current above
 * its peak or below 0, allocated never going back, and in the end, all
 * freed, the peak of allocated_bytes no more than what all threads could
 * hold. */
#define LOOP_SLOTS 4
typedef struct looper {
    fixture *fx;
    int seed;
    atomic_int *stop;
    long failures, pairs;
} looper;

static void *loop_pairs(void *arg) {
    looper *l = arg;
    void *held[LOOP_SLOTS] = {0};
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(l->seed + 1);
    while (!atomic_load(l->stop)) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        void **slot = &held[rng % LOOP_SLOTS];
        if (*slot) {
            l->failures += npa_free(l->fx->a, *slot, 0, NULL) != NPA_FREE_OK;
            *slot = NULL;
            __atomic_store_n(&l->pairs, l->pairs + 1, __ATOMIC_RELAXED); /* the main thread reads it */
        } else {
            /* A few small sizes (most mallocs hit) and, one in four, a large
             * one from 1 MiB + 512 to 3 MiB (its stock serves it with a block
             * up to 1 MiB bigger). */
            size_t size = (rng >> 40) % 4 ? 512 * (1 + (rng >> 20) % 8) : MiB + 512 * (1 + (rng >> 24) % 4096);
            l->failures += npa_malloc(l->fx->a, 0, size, NPA_ENTRY_EXACT, slot) != NPA_OK;
        }
    }
    for (int i = 0; i < LOOP_SLOTS; i++)
        if (held[i]) l->failures += npa_free(l->fx->a, held[i], 0, NULL) != NPA_FREE_OK;
    return NULL;
}

static long summed_stats_broken(const npualloc_device_stats *s, const npualloc_device_stats *last) {
    long broken = 0;
    const npualloc_stat *run = &s->allocation[0], *before = &last->allocation[0];
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) {
        broken += run[i].current > run[i].peak || run[i].current < 0;
        broken += (uint64_t)run[i].allocated < (uint64_t)before[i].allocated;
        broken += run[i].peak < before[i].peak;
    }
    return broken;
}

static void run_threads_under_a_reader(int threads) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    atomic_int stop = 0;
    looper loopers[4];
    pthread_t ids[4];
    for (int i = 0; i < threads; i++) {
        loopers[i] = (looper){.fx = &fx, .seed = i, .stop = &stop};
        CHECK_EQ(pthread_create(&ids[i], NULL, loop_pairs, &loopers[i]), 0);
    }
    npualloc_device_stats last = stats_of(&fx, 0), s;
    long broken = 0, reads = 0, pairs = 0;
    for (; reads < 20000 || pairs < 20000 * threads; reads++) {
        s = stats_of(&fx, 0);
        broken += summed_stats_broken(&s, &last);
        last = s;
        if (reads % 1000 == 0) {
            pairs = 0;
            for (int i = 0; i < threads; i++) pairs += __atomic_load_n(&loopers[i].pairs, __ATOMIC_RELAXED);
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < threads; i++) {
        CHECK_EQ(pthread_join(ids[i], NULL), 0);
        CHECK_EQ(loopers[i].failures, 0);
    }
    CHECK_EQ(broken, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK(s.allocated_bytes[NPUALLOC_POOL_ALL].peak <= (int64_t)(threads * LOOP_SLOTS * 4 * MiB));
    CHECK(s.allocation[NPUALLOC_POOL_ALL].peak <= threads * LOOP_SLOTS);
    CHECK(s.num_cache_hits > 1000);
    fixture_destroy(&fx);
}

static void test_threads_under_a_reader(void) {
    run_threads_under_a_reader(2);
    run_threads_under_a_reader(4);
}

/* A block another thread's cache lent: its free is the device's (found in
 * that cache, folded back), and a second free of it is refused. */
typedef struct lender {
    fixture *fx;
    void *block;
    pthread_barrier_t *barrier;
    long failures;
} lender;

static void *lend_and_wait(void *arg) {
    lender *l = arg;
    for (int i = 0; i < 4; i++) l->failures += npa_free(l->fx->a, alloc_exact(l->fx, 0, 4096), 0, NULL) != NPA_FREE_OK;
    l->block = alloc_exact(l->fx, 0, 4096);
    pthread_barrier_wait(l->barrier); /* lent */
    pthread_barrier_wait(l->barrier); /* freed by the main thread */
    return NULL;
}

static void test_a_foreign_free_and_its_double_free(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    lender l = {.fx = &fx, .barrier = &barrier};
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 512), 0, NULL), NPA_FREE_OK); /* this thread's cache: two */
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, lend_and_wait, &l), 0);
    pthread_barrier_wait(&barrier);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)l.block) == NULL); /* lent: no live block of the device's */
    CHECK_EQ(npa_record_stream(fx.a, l.block, 3, 0), NPA_OK);         /* a plain block: nothing to note */
    CHECK_EQ(npa_free(fx.a, l.block, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, l.block, 0, NULL), NPA_FREE_INVALID);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_invalid_frees, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    pthread_barrier_wait(&barrier);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    pthread_barrier_destroy(&barrier);
    fixture_destroy(&fx);
}

/* A held block freed twice by its own thread, the first time through the
 * fast path: the second is refused, nothing counted twice. */
static void test_a_double_free_after_a_fast_free(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    void *p = alloc_exact(&fx, 0, 4096);
    uint64_t seq = device_seq(&fx);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(device_seq(&fx), seq); /* the fast path's */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_INVALID);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_invalid_frees, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3); /* the companion's held too */
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A thread that exits holding a lent block and a stock: the block becomes
 * the device's (freed by another thread after), the stock merged back. */
static void *lend_and_exit(void *arg) {
    lender *l = arg;
    for (int i = 0; i < 4; i++) l->failures += npa_free(l->fx->a, alloc_exact(l->fx, 0, 4096), 0, NULL) != NPA_FREE_OK;
    l->block = alloc_exact(l->fx, 0, 4096);
    void *held = alloc_exact(l->fx, 0, 8192);
    l->failures += npa_free(l->fx->a, held, 0, NULL) != NPA_FREE_OK; /* in the stock */
    return NULL;
}

static void test_an_exiting_thread_folds_back(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    lender l = {.fx = &fx};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, lend_and_exit, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK_EQ(d->tcache_count, 0);
    CHECK(npa_block_map_find(&d->live, (uintptr_t)l.block) != NULL);
    for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++) CHECK_EQ(d->threads[0].current[0][k], 0);
    CHECK_EQ(d->threads[0].num_cache_hits, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, 6);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 1); /* the rest of the segment, merged */
    CHECK_EQ(npa_free(fx.a, l.block, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, 6);
    fixture_destroy(&fx);
}

/* Another thread's stock holds the device's memory: the OOM retry and
 * empty_cache get it back. */
static void *fill_stock(void *arg) {
    lender *l = arg;
    void *p[2];
    for (int i = 0; i < 2; i++) p[i] = alloc_exact(l->fx, 0, MiB); /* one small segment */
    for (int i = 0; i < 2; i++) l->failures += npa_free(l->fx->a, p[i], 0, NULL) != NPA_FREE_OK;
    pthread_barrier_wait(l->barrier); /* held in the stock */
    pthread_barrier_wait(l->barrier); /* the main thread is done */
    return NULL;
}

static void run_other_stock(bool oom) {
    fixture fx;
    fixture_init(&fx, oom ? 10 * MiB : GiB, NULL);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 2);
    lender l = {.fx = &fx, .barrier = &barrier};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, fill_stock, &l), 0);
    pthread_barrier_wait(&barrier);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current, 2);
    if (oom) { /* 8 MiB left until the small segment goes */
        void *big = NULL;
        CHECK_EQ(npa_malloc(fx.a, 0, 10 * MiB, NPA_ENTRY_EXACT, &big), NPA_OK);
        CHECK_EQ(stats_of(&fx, 0).num_alloc_retries, 1);
    } else {
        CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    }
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.largest_free_block, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    pthread_barrier_wait(&barrier);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    pthread_barrier_destroy(&barrier);
    fixture_destroy(&fx);
}

static void test_another_threads_stock_goes_back(void) {
    run_other_stock(true);
    run_other_stock(false);
}

/* An exit's empty_cache from a signal handler that interrupted the
 * thread's own fast path (its tcache's lock held, as here by hand) gives
 * back what it can and returns: it must not wait for the lock its own
 * thread holds. The other threads' stocks go back as ever. */
static void test_an_exit_inside_the_own_fast_path_returns(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    npa_tcache *t = npa_tcache_mine(fx.a, 0);
    CHECK(t != NULL && t->stock.count > 0);
    npa_lock_acquire(&t->lock);
    CHECK_EQ(npa_empty_cache_unless_busy(fx.a, 1), 0);
    CHECK(t->stock.count > 0); /* left as it was */
    npa_lock_release(&t->lock);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A lent block is an allocated block in a snapshot, with its requested
 * size; a stock block an inactive one. */
typedef struct found_block {
    uintptr_t addr;
    npa_block_view view;
    bool found;
} found_block;

static void find_block(const npa_segment_view *v, void *arg) {
    found_block *f = arg;
    for (size_t i = 0; i < v->block_count; i++)
        if (v->blocks[i].address == f->addr) {
            f->view = v->blocks[i];
            f->found = true;
        }
}

static void test_snapshots_show_lent_blocks_allocated(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4000);
    void *p = alloc_exact(&fx, 0, 4000);
    found_block f = {.addr = (uintptr_t)p};
    npa_visit_segments(fx.a, 0, find_block, &f);
    CHECK(f.found);
    CHECK_EQ(f.view.state, NPA_BLOCK_ACTIVE_ALLOCATED);
    CHECK_EQ(f.view.requested_size, 4000);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    f.found = false;
    npa_visit_segments(fx.a, 0, find_block, &f);
    CHECK(f.found);
    CHECK_EQ(f.view.state, NPA_BLOCK_INACTIVE);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* reset_accumulated_memory_stats with a block lent: the sum's allocated
 * and freed read 0, and freeing the block after counts one free. */
static void test_reset_accumulated_with_a_lent_block(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    void *p = alloc_exact(&fx, 0, 4096);
    npa_reset_accumulated_stats(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    check_stat(s.allocation[NPUALLOC_POOL_SMALL], 1, 1, 0, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 4096, 4096, 0, 0);
    CHECK_EQ(s.num_cache_hits, 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    check_stat(s.allocation[NPUALLOC_POOL_SMALL], 0, 1, 0, 1);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 0, 4096, 0, 4096);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* Recording history turns the fast paths off: every event goes through
 * the device lock and is recorded. */
static void count_events(const npa_trace_view *v, void *arg) {
    (void)v;
    ++*(int *)arg;
}

static void test_history_turns_the_fast_paths_off(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    void *p = alloc_exact(&fx, 0, 4096); /* lent: recording must fold it back */
    CHECK_EQ(npa_set_record_history(fx.a, 100), 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 4096), 0, NULL), NPA_FREE_OK);
    int events = 0;
    npa_visit_trace(fx.a, 0, count_events, &events);
    CHECK_EQ(events, 5); /* the lent block's free requested and completed, then alloc, free requested, completed */
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* ---- the large stock ------------------------------------------------------ */

/* The calling thread's cache on device 0. */
static npa_tcache *my_tcache(fixture *fx) { return npa_tcache_mine(fx->a, 0); }

/* Allocates and frees each size, all held at once, so that the thread's
 * large stock holds them (the frees in the order given). */
static void hold_large(fixture *fx, const size_t *sizes, int count, void **addrs) {
    void *p[16];
    for (int i = 0; i < count; i++) p[i] = alloc_exact(fx, 0, sizes[i]);
    for (int i = 0; i < count; i++) {
        if (addrs) addrs[i] = p[i];
        CHECK_EQ(npa_free(fx->a, p[i], 0, NULL), NPA_FREE_OK);
    }
}

/* A held large block B serves a request R as torch's pool hands a block
 * out whole: R <= B and B - R not above 1 MiB, the smallest such B; its
 * figures are the slow path's (allocated and active B, requested R). A
 * warm pair takes no device lock for B of R's rounded size, or a bigger B
 * where the pool holds no block between R and B, which torch would hand
 * out instead (test_held_large_blocks_weighed_against_the_pool). Anything
 * else goes to the pool. */
static void test_large_blocks_serve_as_torch_would(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    void *held[2];
    hold_large(&fx, (const size_t[]){3 * MiB, 5 * MiB / 2}, 2, held);
    CHECK_EQ(my_tcache(&fx)->large.count, 2);
    /* 2.4 MiB: both fit; the smaller, 2.5 MiB, serves it. */
    void *p = alloc_exact(&fx, 0, 12 * MiB / 5);
    CHECK(p == held[1]);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(5 * MiB / 2));
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(5 * MiB / 2));
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(12 * MiB / 5));
    CHECK_EQ(s.allocation[NPUALLOC_POOL_LARGE].current, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    /* Warm: the pool holds nothing of 2.25 to 2.5 MiB (the segment's 14.5
     * MiB rest), so the fast path serves 2.25 MiB (rounded already) from
     * the 2.5 MiB block, as it does a pair of the block's own size: no
     * device lock. */
    uint64_t seq = device_seq(&fx);
    CHECK(npa_tcache_malloc(my_tcache(&fx), 9 * MiB / 4, 9 * MiB / 4, &p));
    CHECK(p == held[1]);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, 5 * MiB / 2);
    CHECK(p == held[1]);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(device_seq(&fx), seq);
    /* 2 MiB - 512: 3 MiB would leave more than 1 MiB (torch splits it), and
     * 2.5 MiB leaves exactly 0.5 MiB + 512: served by the 2.5 MiB block. */
    p = alloc_exact(&fx, 0, 2 * MiB - 512);
    CHECK(p == held[1]);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    /* 1.25 MiB: 2.5 MiB would leave 1.25 MiB, above 1 MiB: from the pool,
     * split to the request. */
    p = alloc_exact(&fx, 0, 5 * MiB / 4);
    CHECK(p != held[0] && p != held[1]);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(5 * MiB / 4));
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    /* 3.5 MiB: none is big enough. */
    p = alloc_exact(&fx, 0, 7 * MiB / 2);
    CHECK(p != held[0] && p != held[1]);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, s.allocation[NPUALLOC_POOL_ALL].freed);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].peak, (int64_t)(11 * MiB / 2)); /* the two held at first */
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A thread's large stock holds at most NPA_LARGE_STOCK_MAX blocks and
 * NPA_LARGE_STOCK_BYTES bytes (the oldest go back to the pool), and no
 * block bigger than that. */
static void test_large_stock_bounds(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    size_t sizes[NPA_LARGE_STOCK_MAX + 1];
    for (int i = 0; i <= NPA_LARGE_STOCK_MAX; i++) sizes[i] = 2 * MiB;
    hold_large(&fx, sizes, NPA_LARGE_STOCK_MAX + 1, NULL);
    npa_tcache *t = my_tcache(&fx);
    CHECK_EQ(t->large.count, NPA_LARGE_STOCK_MAX);
    CHECK_EQ(t->large.bytes, NPA_LARGE_STOCK_MAX * 2 * MiB);
    size_t big[7] = {5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB, 5 * MiB};
    hold_large(&fx, big, 7, NULL);
    CHECK(t->large.bytes <= NPA_LARGE_STOCK_BYTES);
    CHECK_EQ(t->large.count, 6); /* 30 MiB: a seventh 5 MiB block would pass 32 */
    npa_empty_cache(fx.a, 0);
    hold_large(&fx, (const size_t[]){NPA_LARGE_STOCK_BYTES + 512}, 1, NULL);
    CHECK_EQ(t->large.count, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* While the fast paths run, a miss of a pool gives the held blocks back
 * one at a time until best fit finds one: the oldest held block (the
 * first freed) merges with the segment's tail into room for 12 MiB, and
 * the other two stay held, where a flush of every stock left none. The
 * segment serves it: no new memory, the figures exact. */
static void test_a_miss_takes_back_only_what_fits(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    void *x[3];
    for (int i = 0; i < 3; i++) x[i] = alloc_exact(&fx, 0, 3 * MiB); /* a 20 MiB segment, 11 MiB left */
    for (int i = 3; i-- > 0;) CHECK_EQ(npa_free(fx.a, x[i], 0, NULL), NPA_FREE_OK); /* the tail's neighbour first */
    npa_tcache *t = my_tcache(&fx);
    CHECK_EQ(t->large.count, 3);
    long grows = fx.fake.raw_malloc_calls;
    void *p = alloc_exact(&fx, 0, 12 * MiB);
    CHECK(p == x[2]);
    CHECK_EQ(fx.fake.raw_malloc_calls, grows);
    CHECK_EQ(t->large.count, 2);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(12 * MiB));
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(20 * MiB));
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_LARGE].current, 3); /* the two held, the 2 MiB tail */
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(8 * MiB));
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, s.allocation[NPUALLOC_POOL_ALL].allocated);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* What a thread's large stock holds goes back to the pool before the large
 * pool asks the device for memory, for empty_cache, when a GC threshold or
 * expandable segments are set at run time (and nothing is held from then
 * on), when the fast paths stop (one thread left) and at a thread's exit. */
static void *hold_and_exit(void *arg) {
    lender *l = arg;
    void *p = alloc_exact(l->fx, 0, 3 * MiB);
    l->failures += npa_free(l->fx->a, p, 0, NULL) != NPA_FREE_OK;
    l->failures += npa_tcache_mine(l->fx->a, 0)->large.count != 1;
    return NULL;
}

static void test_large_stock_flushes(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, NULL);
    companion c;
    companion_start(&c, &fx);
    npa_tcache *t = NULL;
    /* A miss of the large pool: the 20 MiB segment's blocks, all held,
     * merge back whole before a 25 MiB request grows the pool. */
    hold_large(&fx, (const size_t[]){8 * MiB, 8 * MiB}, 2, NULL);
    t = my_tcache(&fx);
    CHECK_EQ(t->large.count, 2);
    long grows = fx.fake.raw_malloc_calls;
    void *p = alloc_exact(&fx, 0, 25 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, grows + 1);
    CHECK_EQ(t->large.count, 0);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_LARGE].current, 0); /* merged: 20 MiB whole */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(t->large.count, 1); /* 25 MiB: held */
    /* empty_cache. */
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 2);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(t->large.count, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_LARGE].current, 0);
    /* A GC threshold set at run time: flushed, and nothing held since. */
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 1);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.5), 0);
    CHECK_EQ(t->large.count, 0);
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 0);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.0), 0);
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 1);
    /* Expandable segments switched on: the same. */
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    CHECK_EQ(t->large.count, 0);
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 0);
    CHECK_EQ(npa_set_expandable_segments(fx.a, false), 0);
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 1);
    /* Another thread's exit: its stock folds back. */
    lender l = {.fx = &fx};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, hold_and_exit, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    /* The companion leaves: one thread, no fast paths, nothing held large. */
    companion_stop(&c);
    CHECK_EQ(t->large.count, 0);
    hold_large(&fx, (const size_t[]){3 * MiB}, 1, NULL);
    CHECK_EQ(t->large.count, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_LARGE].current, 0); /* every block merged back */
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

/* torch's pool serves a large request from its best fit, the smallest free
 * block of at least the request's size, over every free block (the held
 * ones included, which torch does not hold apart); only then does
 * should_split decide whether it is cut. A held block B with B - R <= 1 MiB
 * must not be served while the pool has a smaller block that fits: torch
 * would have served (and counted) that one. Here the pool holds 4.5 MiB
 * (Y, 2 MiB, freed by a thread with no cache, merged with nothing: X is
 * held, G allocated) and the stock X (2.5 MiB): torch (X merged into Y's
 * block) cuts 2 MiB at Y's address, allocated_bytes G + 2 MiB; the large
 * stock serves X, allocated_bytes G + 2.5 MiB. */
static void *free_without_cache(void *arg) {
    lender *l = arg;
    l->failures += npa_tcache_mine(l->fx->a, 0) != NULL;
    l->failures += npa_free(l->fx->a, l->block, 0, NULL) != NPA_FREE_OK;
    return NULL;
}

static void test_a_held_large_block_yields_to_the_pools_best_fit(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    void *y = alloc_exact(&fx, 0, 2 * MiB), *x = alloc_exact(&fx, 0, 5 * MiB / 2),
         *g = alloc_exact(&fx, 0, 31 * MiB / 2); /* the 20 MiB segment's rest */
    CHECK_EQ(npa_free(fx.a, x, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(my_tcache(&fx)->large.count, 1);
    lender l = {.fx = &fx, .block = y};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, free_without_cache, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    void *p = alloc_exact(&fx, 0, 2 * MiB);
    CHECK(p == y); /* torch: Y's block (4.5 MiB with X) cut at its start */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(35 * MiB / 2)); /* torch's: G + 2 MiB */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, g, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* The slow path weighs the held blocks against the pool's best fit P as
 * torch's one search would (size, then address): P serves when it is
 * smaller than the held block B, or as big and at a lower address; B
 * serves otherwise, P staying in the pool. The fast path serves B of the
 * request's rounded size whatever the pool holds: torch's figures
 * (allocated, active), though torch would take a pooled block of that
 * size at a lower address (README: the layout's difference); a bigger B
 * only where the pool's summary shows no block from R to B. One 20 MiB
 * segment: the first block, the second, the rest allocated; the pooled
 * one freed by a thread with no cache (merged with nothing), the held one
 * by this thread (into its large stock). */
typedef struct weighing {
    size_t pooled, held, request;
    bool pooled_first, pool_serves, fast;
} weighing;

static void weigh_once(const weighing *w) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    size_t first = w->pooled_first ? w->pooled : w->held, second = w->pooled_first ? w->held : w->pooled;
    size_t rest = 20 * MiB - first - second;
    void *a = alloc_exact(&fx, 0, first), *b = alloc_exact(&fx, 0, second), *g = alloc_exact(&fx, 0, rest);
    void *pooled = w->pooled_first ? a : b, *held = w->pooled_first ? b : a;
    CHECK_EQ(npa_free(fx.a, held, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(my_tcache(&fx)->large.count, 1);
    lender l = {.fx = &fx, .block = pooled};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, free_without_cache, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    void *p = NULL; /* the fast path first, as npa_malloc asks it (request: rounded already) */
    CHECK_EQ(npa_tcache_malloc(my_tcache(&fx), w->request, w->request, &p), w->fast);
    if (!p) p = alloc_exact(&fx, 0, w->request);
    CHECK(p == (w->pool_serves ? pooled : held));
    CHECK_EQ(my_tcache(&fx)->large.count, w->pool_serves ? 1 : 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, (int64_t)(rest + (w->pool_serves ? w->pooled : w->held)));
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, (int64_t)(rest + (w->pool_serves ? w->pooled : w->held)));
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, g, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

static void test_held_large_blocks_weighed_against_the_pool(void) {
    const size_t r = 9 * MiB / 4; /* 2.25 MiB, rounded already */
    const weighing cases[] = {
        /* P between R and B: P, whatever the addresses; the fast path declines. */
        {.pooled = 5 * MiB / 2, .held = 3 * MiB, .request = r, .pooled_first = false, .pool_serves = true},
        /* as big as B, at a lower address: P, torch's tie. */
        {.pooled = 5 * MiB / 2, .held = 5 * MiB / 2, .request = r, .pooled_first = true, .pool_serves = true},
        /* as big, at a higher address: B, lent; P stays. */
        {.pooled = 5 * MiB / 2, .held = 5 * MiB / 2, .request = r, .pooled_first = false, .pool_serves = false},
        /* bigger than B: B, by the fast path (the pool's summary clear from R to B). */
        {.pooled = 3 * MiB, .held = 5 * MiB / 2, .request = r, .pooled_first = true, .pool_serves = false, .fast = true},
        /* B of R's size: the fast path's, P unseen (torch: P, as big, lower). */
        {.pooled = 5 * MiB / 2, .held = 5 * MiB / 2, .request = 5 * MiB / 2, .pooled_first = true, .fast = true},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) weigh_once(&cases[i]);
}

/* Two held blocks of one size: the one at the lower address serves, as in
 * the pool's order, whichever the stock took first. */
static void test_held_large_blocks_tie_by_address(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    void *low = alloc_exact(&fx, 0, 5 * MiB / 2), *high = alloc_exact(&fx, 0, 5 * MiB / 2);
    CHECK((uintptr_t)low < (uintptr_t)high);
    CHECK_EQ(npa_free(fx.a, high, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, low, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(my_tcache(&fx)->large.count, 2);
    void *p = alloc_exact(&fx, 0, 9 * MiB / 4); /* the slow path's */
    CHECK(p == low);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, 5 * MiB / 2); /* the fast path's */
    CHECK(p == low);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* The free blocks of a pool's subtree counted into buckets as the pool's
 * summary counts them. */
static void count_subtree(const npa_block *b, uint32_t counts[NPA_SUMMARY_BUCKETS]) {
    for (; b; b = b->right) {
        if (b->size >> NPA_SUMMARY_SHIFT < NPA_SUMMARY_BUCKETS) counts[b->size >> NPA_SUMMARY_SHIFT]++;
        count_subtree(b->left, counts);
    }
}

static void check_summary(fixture *fx) {
    const npa_device *d = my_tcache(fx)->device;
    static uint32_t counts[NPA_SUMMARY_BUCKETS];
    memset(counts, 0, sizeof counts);
    count_subtree(d->plain.large.root, counts);
    CHECK_EQ(d->large_summary.seq & 1, 0); /* settled by each call's section */
    CHECK(memcmp(counts, d->large_summary.counts, sizeof counts) == 0);
}

/* The plain large pool's summary counts its free blocks as they are, after
 * splits, merges (with and without the stock), the stock's evictions and
 * empty_cache; 64 MiB and up are not counted. */
static void test_the_large_summary_follows_the_pool(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    static const size_t sizes[] = {5 * MiB / 2, 3 * MiB, 9 * MiB / 4, 7 * MiB, 70 * MiB, 2 * MiB + 512, 12 * MiB};
    enum { n = sizeof sizes / sizeof sizes[0] };
    void *p[n];
    for (int round = 0; round < 3; round++) {
        for (int i = 0; i < n; i++) {
            p[i] = alloc_exact(&fx, 0, sizes[(i + round) % n]);
            check_summary(&fx);
        }
        for (int i = 0; i < n; i += 2) {
            CHECK_EQ(npa_free(fx.a, p[i], 0, NULL), NPA_FREE_OK);
            check_summary(&fx);
        }
        for (int i = 1; i < n; i += 2) {
            CHECK_EQ(npa_free(fx.a, p[i], 0, NULL), NPA_FREE_OK);
            check_summary(&fx);
        }
    }
    npa_empty_cache(fx.a, 0);
    check_summary(&fx);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* The summary is kept only while the device lends: a lone thread's pool
 * changes skip it (seq left odd, so no fast path could trust it), and the
 * start of lending rebuilds it from the pool. In one 20 MiB segment: P (2.5
 * MiB) freed while alone must count, so that the fast path declines a 2.25
 * MiB malloc the held B (3 MiB) would serve (torch's best fit: P); then P,
 * counted when lending stopped, is cut again while alone from its merge
 * with B, and must not count: the fast path serves B. */
static void test_lending_rebuilds_the_large_summary(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    const size_t r = 9 * MiB / 4, pooled_size = 5 * MiB / 2, held_size = 3 * MiB;
    void *pooled = alloc_exact(&fx, 0, pooled_size), *held = alloc_exact(&fx, 0, held_size);
    void *rest = alloc_exact(&fx, 0, 20 * MiB - pooled_size - held_size);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK_EQ(npa_free(fx.a, pooled, 0, NULL), NPA_FREE_OK); /* to the pool, alone */
    CHECK(d->plain.large.summary == NULL);
    CHECK_EQ(d->large_summary.seq & 1, 1);
    companion c;
    companion_start(&c, &fx);
    check_summary(&fx);
    CHECK_EQ(npa_free(fx.a, held, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(my_tcache(&fx)->large.count, 1);
    void *p = NULL;
    CHECK(!npa_tcache_malloc(my_tcache(&fx), r, r, &p));
    if (p) CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, r);
    CHECK(p == pooled);
    lender l = {.fx = &fx, .block = p}; /* back to the pool, not to a stock */
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, free_without_cache, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    check_summary(&fx);
    companion_stop(&c); /* B back to the pool, merged with P */
    CHECK(d->plain.large.summary == NULL);
    CHECK_EQ(d->large_summary.seq & 1, 1);
    CHECK(alloc_exact(&fx, 0, pooled_size) == pooled);
    CHECK(alloc_exact(&fx, 0, held_size) == held); /* the pool holds no large block now */
    companion_start(&c, &fx);
    check_summary(&fx);
    CHECK_EQ(npa_free(fx.a, held, 0, NULL), NPA_FREE_OK);
    bool fast = npa_tcache_malloc(my_tcache(&fx), r, r, &p);
    CHECK(fast);
    if (!fast) p = alloc_exact(&fx, 0, r);
    CHECK(p == held);
    void *blocks[] = {p, pooled, rest};
    for (int i = 0; i < 3; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

/* A thread with no cache of its own runs the poll that completes the
 * pending frees (npa_process_pending), flagging when it returns. */
typedef struct poller {
    fixture *fx;
    int done; /* atomic */
} poller;

static void *poll_pending(void *arg) {
    poller *p = arg;
    npa_process_pending(p->fx->a, 0);
    __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

/* A free whose fence completed is torch's pick at the next malloc
 * (process_events, then best fit): the fast path, which cannot see pending
 * frees, declines while any is pending (pending_any), so that flag may say
 * none only once the completed blocks are in their pools, where the plain
 * large pool's summary shows them. The poll that completes a small block S
 * and then P (2.25 MiB) is held between the two: S's merge raises
 * inactive_split past its peak (reset before), which freezes every tcache,
 * and the companion's, first in index order, is held here. There a fast
 * 2.25 MiB malloc with B (2.5 MiB) held must decline (torch: P): P is
 * pending no more, and not yet in the pool. */
static void test_a_completed_free_is_in_the_pool_before_nothing_is_pending(void) {
    fixture fx;
    fixture_init_fenced_but_eager(&fx);
    companion c;
    companion_start(&c, &fx);
    const size_t r = 9 * MiB / 4, held_size = 5 * MiB / 2;
    void *pooled = alloc_exact(&fx, 0, r), *held = alloc_exact(&fx, 0, held_size);
    void *rest = alloc_exact(&fx, 0, 20 * MiB - r - held_size); /* the segment's tail: P merges with nothing */
    void *x = alloc_exact(&fx, 0, 4096), *s = alloc_exact(&fx, 0, 4096), *y = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, held, 0, NULL), NPA_FREE_OK);
    npa_tcache *mine = my_tcache(&fx);
    CHECK_EQ(mine->large.count, 1);
    npa_reset_peak_stats(fx.a, 0);
    /* A slow pair on B gives this thread's ceilings its room again. */
    CHECK(alloc_exact(&fx, 0, held_size) == held);
    CHECK_EQ(npa_free(fx.a, held, 0, NULL), NPA_FREE_OK);
    fake_set_eager(&fx.fake, false);
    CHECK_EQ(npa_free(fx.a, s, 0, NULL), NPA_FREE_OK);      /* pending, the older */
    CHECK_EQ(npa_free(fx.a, pooled, 0, NULL), NPA_FREE_OK); /* pending */
    npa_process_pending(fx.a, 0);                           /* their fence recorded, not done */
    fake_complete_fences(&fx.fake);
    void *p = NULL;
    CHECK(!npa_tcache_malloc(mine, r, r, &p)); /* pending */
    npa_device *d = npa_device_get(fx.a, 0, false);
    npa_tcache *other = d->tcaches[0];
    CHECK(other != NULL && other != mine); /* the companion's, frozen first */
    if (other == NULL || other == mine) return;
    npa_lock_acquire(&other->lock);
    poller poll = {.fx = &fx};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, poll_pending, &poll), 0);
    while (__atomic_load_n(&other->lock.state, __ATOMIC_ACQUIRE) == 1 && !__atomic_load_n(&poll.done, __ATOMIC_ACQUIRE))
        sched_yield();
    CHECK(!__atomic_load_n(&poll.done, __ATOMIC_ACQUIRE)); /* it froze inside the poll */
    bool fast = npa_tcache_malloc(mine, r, r, &p);
    npa_lock_release(&other->lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK(!fast);
    if (fast) CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, r); /* torch's best fit: P, from the pool */
    CHECK(p == pooled);
    void *blocks[] = {p, x, y, rest};
    for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

static void *read_own_stats(void *arg) {
    fixture *fx = arg;
    static npualloc_device_stats out;
    npa_get_stats(fx->a, 0, &out);
    return &out;
}

/* The process's own npa_get_stats holds the device lock, so it freezes the
 * threads' caches and reads their slots with no writer inside: exact, at
 * once, whatever their seqlocks say. It retried a slot's seqlock without
 * bound, so a thread that its every look met inside its fast path starved
 * it (here a slot's seq left odd, as such a look sees it; the join's bound
 * only ends the old behaviour, which never returned). */
static void test_own_stats_never_wait_on_a_slot(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    warm(&fx, 4096);
    void *p = alloc_exact(&fx, 0, 4096); /* lent: this thread's slot counts it */
    npualloc_device_stats expected = stats_of(&fx, 0);
    CHECK_EQ(expected.allocation[NPUALLOC_POOL_ALL].current, 1);
    npa_device *d = npa_device_get(fx.a, 0, false);
    npualloc_thread_stats *slot = NULL;
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++)
        if (d->tcaches[i] && d->tcaches[i] != npa_tcache_mine(fx.a, 0)) slot = d->tcaches[i]->slot;
    CHECK(slot != NULL);
    if (!slot) return;
    uint64_t seq = __atomic_load_n(&slot->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&slot->seq, seq + 1, __ATOMIC_RELAXED);
    pthread_t reader;
    CHECK_EQ(pthread_create(&reader, NULL, read_own_stats, &fx), 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5;
    void *got = NULL;
    int joined = pthread_timedjoin_np(reader, &got, &until);
    CHECK_EQ(joined, 0);
    __atomic_store_n(&slot->seq, seq, __ATOMIC_RELAXED);
    if (joined == ETIMEDOUT) CHECK_EQ(pthread_join(reader, &got), 0);
    const npualloc_device_stats *read = got;
    CHECK(read && memcmp(read, &expected, sizeof expected) == 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* A signal handler's npa_get_stats on a thread whose own fast path it
 * interrupted (its tcache's lock held, its slot's seq odd): the freeze only
 * tries that lock and reads the slot as it stands, where the seqlock's
 * retries met that writer inside for good. */
static void *read_inside_own_fast_path(void *arg) {
    fixture *fx = arg;
    warm(fx, 4096);
    npa_tcache *t = npa_tcache_mine(fx->a, 0);
    if (!t) return NULL;
    npa_lock_acquire(&t->lock);
    uint64_t seq = __atomic_load_n(&t->slot->seq, __ATOMIC_RELAXED);
    __atomic_store_n(&t->slot->seq, seq + 1, __ATOMIC_RELAXED);
    static npualloc_device_stats out;
    npa_get_stats(fx->a, 0, &out);
    __atomic_store_n(&t->slot->seq, seq, __ATOMIC_RELAXED);
    npa_lock_release(&t->lock);
    return &out;
}

static void test_own_stats_inside_own_fast_path(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    companion_start(&c, &fx);
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, read_inside_own_fast_path, &fx), 0);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5; /* the old read never returned: the test's bound, then its process ends failed */
    void *got = NULL;
    int joined = pthread_timedjoin_np(thread, &got, &until);
    CHECK_EQ(joined, 0);
    if (joined != 0) {
        fprintf(stderr, "FAILED: test_own_stats_inside_own_fast_path (the read never returned)\n");
        _exit(1);
    }
    const npualloc_device_stats *read = got;
    CHECK(read != NULL);
    if (read) CHECK_EQ(read->num_cache_hits, stats_of(&fx, 0).num_cache_hits);
    companion_stop(&c);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_fast_paths_need_two_threads);
    RUN(test_a_lone_threads_stock_serves_the_fast_paths);
    RUN(test_a_warm_pair_leaves_the_device_alone);
    RUN(test_slow_mallocs_leave_the_fast_ones_fast);
    RUN(test_a_pool_block_is_lent);
    RUN(test_two_threads_peak_exactly_together);
    RUN(test_threads_under_a_reader);
    RUN(test_a_foreign_free_and_its_double_free);
    RUN(test_a_double_free_after_a_fast_free);
    RUN(test_an_exiting_thread_folds_back);
    RUN(test_another_threads_stock_goes_back);
    RUN(test_an_exit_inside_the_own_fast_path_returns);
    RUN(test_snapshots_show_lent_blocks_allocated);
    RUN(test_reset_accumulated_with_a_lent_block);
    RUN(test_history_turns_the_fast_paths_off);
    RUN(test_large_blocks_serve_as_torch_would);
    RUN(test_large_stock_bounds);
    RUN(test_a_miss_takes_back_only_what_fits);
    RUN(test_large_stock_flushes);
    RUN(test_own_stats_never_wait_on_a_slot);
    RUN(test_own_stats_inside_own_fast_path);
    RUN(test_a_held_large_block_yields_to_the_pools_best_fit);
    RUN(test_held_large_blocks_weighed_against_the_pool);
    RUN(test_the_large_summary_follows_the_pool);
    RUN(test_lending_rebuilds_the_large_summary);
    RUN(test_held_large_blocks_tie_by_address);
    RUN(test_a_completed_free_is_in_the_pool_before_nothing_is_pending);
    return check_report();
}
