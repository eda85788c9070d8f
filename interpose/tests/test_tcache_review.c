/* Review of the per-thread caches (issue 14): cases that failed on the
 * implementation as of 910ce5f. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "core/internal.h"
#include "fake_backend.h"
#include "test_util.h"
#include "companion.h"

/* A companion (companion.h) beside this thread, its cache's block given
 * back at once: the device starts empty. */
static void start_companion_empty(companion *c, fixture *fx) {
    companion_start(c, fx);
    CHECK_EQ(npa_empty_cache(fx->a, 0), NPA_OK);
}

/* inactive_split's peak is the most inactive split blocks there ever were.
 * A split block the thread's cache lends stays counted inactive in the
 * device's figure (its slot says -1), so a slow path that adds an inactive
 * split block raised the peak from the device's figure alone, one above
 * anything there ever was. The same sequence without per-thread caches
 * (the device's recent cache before issue 14) peaks at 2. */
static void test_inactive_split_peak_counts_lent_blocks_out(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    start_companion_empty(&c, &fx);
    void *p = alloc_exact(&fx, 0, 4096);      /* a new small segment: its tail is an inactive split block */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* held in the stock: 2 inactive split blocks */
    p = alloc_exact(&fx, 0, 4096);            /* lent out of the stock: 1 (the tail) */
    void *q = alloc_exact(&fx, 0, 8192);      /* cut out of the tail: still 1 */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK); /* held: 2 (the tail and q) */
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 2);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 2);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].peak, 2);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].peak, (int64_t)(2 * MiB)); /* p held beside the tail */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* The same after reset_peak_memory_stats: the peak is set to the sum (the
 * lent block out), below the device's own figure, and the next inactive
 * split block a slow path adds raised it to the device's figure plus one. */
static void test_inactive_split_peak_after_a_reset(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    start_companion_empty(&c, &fx);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, 4096); /* lent */
    npa_reset_peak_stats(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 1);
    void *q = alloc_exact(&fx, 0, 8192);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK); /* 2 */
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 2);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 2);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* reset_peak_memory_stats with a split block lent: the peak became the
 * sum (the lent block out of the device's figure), and the fast free that
 * puts the block back in the stock raised the sum past it, unseen: a
 * reader saw inactive_split's current above its peak. */
static void test_inactive_split_never_passes_its_peak_after_a_reset(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    start_companion_empty(&c, &fx);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, 4096); /* lent */
    npa_reset_peak_stats(fx.a, 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* the fast path: back in the stock */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 2);
    CHECK(s.inactive_split[NPUALLOC_POOL_ALL].current <= s.inactive_split[NPUALLOC_POOL_ALL].peak);
    CHECK(s.inactive_split[NPUALLOC_POOL_SMALL].current <= s.inactive_split[NPUALLOC_POOL_SMALL].peak);
    CHECK(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current <= s.inactive_split_bytes[NPUALLOC_POOL_ALL].peak);
    companion_stop(&c);
    fixture_destroy(&fx);
}

/* exit() from a signal handler that interrupted the thread's own fast path
 * (its tcache lock held): the hook's at_exit gives the cache back through
 * npa_empty_cache_unless_busy, which must never wait for a lock (the
 * device's it only tries). Its flush of every stock waited for the
 * thread's own tcache lock: the process never ended. Since a004cdb
 * the flush only tries the caller's own tcache and leaves its stock: the
 * device is emptied otherwise (0, not busy). Alone and beside another
 * thread's cache (the fast paths on). Run in a child, which an alarm ends
 * if it hangs. */
static void test_empty_cache_unless_busy_never_waits_for_a_tcache(void) {
    for (int with_companion = 0; with_companion < 2; with_companion++) {
        pid_t child = fork();
        CHECK(child >= 0);
        if (child == 0) {
            fixture fx;
            fixture_init(&fx, GiB, NULL);
            companion c;
            if (with_companion) start_companion_empty(&c, &fx);
            for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 4096), 0, NULL), NPA_FREE_OK);
            npa_tcache *t = npa_tcache_mine(fx.a, 0);
            CHECK(t != NULL && t->stock.count > 0);
            alarm(10);
            npa_lock_acquire(&t->lock); /* where the signal landed: inside npa_tcache_malloc */
            unsigned busy = npa_empty_cache_unless_busy(fx.a, 1u);
            bool left = t->stock.count > 0;
            npa_lock_release(&t->lock);
            if (with_companion) companion_stop(&c);
            _exit(busy == 0u && left && check_report() == 0 ? 0 : 3);
        }
        int status = 0;
        CHECK_EQ(waitpid(child, &status, 0), child);
        CHECK(!WIFSIGNALED(status)); /* SIGALRM: it hung */
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
}


/* 33 threads on one device: 32 get a cache, the 33rd takes the slow path
 * for everything; the sums stay exact and every slot is zero once they
 * exit. */
#define MANY 33
typedef struct many_arg {
    fixture *fx;
    pthread_barrier_t *barrier;
    long failures;
} many_arg;

static void *hold_one(void *arg) {
    many_arg *m = arg;
    for (int i = 0; i < 4; i++) {
        void *p = NULL;
        m->failures += npa_malloc(m->fx->a, 0, 4096, NPA_ENTRY_EXACT, &p) != NPA_OK;
        m->failures += npa_free(m->fx->a, p, 0, NULL) != NPA_FREE_OK;
    }
    void *p = NULL;
    m->failures += npa_malloc(m->fx->a, 0, 4096, NPA_ENTRY_EXACT, &p) != NPA_OK;
    pthread_barrier_wait(m->barrier); /* all hold */
    pthread_barrier_wait(m->barrier); /* looked */
    m->failures += npa_free(m->fx->a, p, 0, NULL) != NPA_FREE_OK;
    return NULL;
}

static void test_the_33rd_thread(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, MANY + 1);
    many_arg m[MANY];
    pthread_t ids[MANY];
    for (int i = 0; i < MANY; i++) {
        m[i] = (many_arg){.fx = &fx, .barrier = &barrier};
        CHECK_EQ(pthread_create(&ids[i], NULL, hold_one, &m[i]), 0);
    }
    pthread_barrier_wait(&barrier);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK_EQ(d->tcache_count, NPUALLOC_THREAD_SLOTS);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, MANY);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, (int64_t)(MANY * 4096));
    CHECK(s.allocation[NPUALLOC_POOL_ALL].peak >= MANY);
    pthread_barrier_wait(&barrier);
    for (int i = 0; i < MANY; i++) {
        CHECK_EQ(pthread_join(ids[i], NULL), 0);
        CHECK_EQ(m[i].failures, 0);
    }
    CHECK_EQ(d->tcache_count, 0);
    for (int i = 0; i < NPUALLOC_THREAD_SLOTS; i++)
        for (int p = 0; p < 2; p++)
            for (int k = 0; k < NPUALLOC_THREAD_STAT_COUNT; k++) CHECK_EQ(d->threads[i].current[p][k], 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].peak, MANY);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, s.allocation[NPUALLOC_POOL_ALL].allocated);
    pthread_barrier_destroy(&barrier);
    fixture_destroy(&fx);
}

/* An allocator destroyed while threads hold caches in it (lent blocks, a
 * stock), then another made: the threads go on with the new one and exit
 * (their exit must not touch the destroyed one). For ASan. */
typedef struct switcher {
    fixture **fx;
    pthread_barrier_t *barrier;
    long failures;
} switcher;

static void *use_two_allocators(void *arg) {
    switcher *w = arg;
    for (int round = 0; round < 2; round++) {
        npa_allocator *a = (*w->fx)->a;
        for (int i = 0; i < 4; i++) {
            void *p = NULL;
            w->failures += npa_malloc(a, 0, 4096, NPA_ENTRY_EXACT, &p) != NPA_OK;
            w->failures += npa_free(a, p, 0, NULL) != NPA_FREE_OK;
        }
        void *kept = NULL;
        w->failures += npa_malloc(a, 0, 4096, NPA_ENTRY_EXACT, &kept) != NPA_OK; /* lent, never freed */
        pthread_barrier_wait(w->barrier); /* holding */
        pthread_barrier_wait(w->barrier); /* the allocator is gone, another made */
    }
    return NULL;
}

static void test_an_allocator_destroyed_under_threads_caches(void) {
    fixture fx[2], *current = &fx[0];
    fixture_init(&fx[0], GiB, NULL);
    pthread_barrier_t barrier;
    pthread_barrier_init(&barrier, NULL, 3);
    switcher w[2] = {{.fx = &current, .barrier = &barrier}, {.fx = &current, .barrier = &barrier}};
    pthread_t ids[2];
    for (int i = 0; i < 2; i++) CHECK_EQ(pthread_create(&ids[i], NULL, use_two_allocators, &w[i]), 0);
    pthread_barrier_wait(&barrier);
    fixture_destroy(&fx[0]);
    fixture_init(&fx[1], GiB, NULL);
    current = &fx[1];
    pthread_barrier_wait(&barrier);
    pthread_barrier_wait(&barrier);
    fixture_destroy(&fx[1]); /* the threads hold their caches in it still */
    pthread_barrier_wait(&barrier);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(pthread_join(ids[i], NULL), 0);
        CHECK_EQ(w[i].failures, 0);
    }
    pthread_barrier_destroy(&barrier);
}

/* Everything that freezes or folds the caches, from a control thread,
 * while looping threads hit them, trade blocks (foreign frees) and exit
 * and come back (new threads), under a reader: no stat's current above its
 * peak or below 0 in any summed read, and the ceilings' rule kept at each
 * look (ceilings_broken). For TSAN too. */
typedef struct chaos {
    fixture *fx;
    atomic_int *stop;
    void *_Atomic *mailbox; /* a block handed to the next thread that looks */
    int seed;
    long failures;
} chaos;

static void *chaos_loop(void *arg) {
    chaos *c = arg;
    uint64_t rng = 0x9e3779b97f4a7c15ull * (uint64_t)(c->seed + 7);
    while (!atomic_load(c->stop)) {
        void *held[6] = {0};
        for (int i = 0; i < 400; i++) {
            rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
            void **slot = &held[rng % 6];
            if (*slot) {
                if (rng % 17 == 0) *slot = atomic_exchange(c->mailbox, *slot); /* another thread frees it */
                if (*slot) c->failures += npa_free(c->fx->a, *slot, 0, NULL) != NPA_FREE_OK;
                *slot = NULL;
            } else {
                size_t size = rng % 29 == 0 ? 3 * MiB : 512 * (1 + (rng >> 20) % 8);
                c->failures += npa_malloc(c->fx->a, 0, size, NPA_ENTRY_EXACT, slot) != NPA_OK;
            }
        }
        for (int i = 0; i < 6; i++)
            if (held[i]) c->failures += npa_free(c->fx->a, held[i], 0, NULL) != NPA_FREE_OK;
        if (rng % 3 == 0) break; /* exits: its caches fold back; the main thread starts another */
    }
    return NULL;
}

static void count_nothing(const npa_segment_view *v, void *arg) { (void)v, (void)arg; }

/* The device's two stats a ceiling group bounds (tcache.c, entry_slack). */
static void group_stats(const npualloc_device_stats *s, int g, const npualloc_stat *st[2]) {
    switch (g) {
    case NPA_CEIL_BLOCKS: st[0] = s->allocation, st[1] = s->active; break;
    case NPA_CEIL_BYTES: st[0] = s->allocated_bytes, st[1] = s->active_bytes; break;
    case NPA_CEIL_REQUESTED: st[0] = st[1] = s->requested_bytes; break;
    case NPA_CEIL_SPLIT: st[0] = st[1] = s->inactive_split; break;
    default: st[0] = st[1] = s->inactive_split_bytes;
    }
}

/* The rule the peaks rest on (tcache.c), looked at frozen: in each entry
 * and group, R is the sum of the tcaches' ceilings, each slot's figure is
 * within its ceiling (a split group's ceiling at most 0), and the device's
 * figure of the group's stats plus R is within their peaks. A break can
 * hide from a reader until a fast path uses the headroom it gave. */
static long ceilings_broken(npa_device *d) {
    static const int slot_stat[NPA_CEILINGS] = {NPUALLOC_THREAD_ACTIVE, NPUALLOC_THREAD_ACTIVE_BYTES,
                                                NPUALLOC_THREAD_REQUESTED_BYTES, NPUALLOC_THREAD_INACTIVE_SPLIT,
                                                NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES};
    long broken = 0;
    npa_lock_acquire(&d->lock);
    npa_tcaches_freeze(d);
    for (int e = 0; e < NPA_CEIL_ENTRIES; e++)
        for (int g = 0; g < NPA_CEILINGS; g++) {
            int k = slot_stat[g], entry = e == NPA_CEIL_ALL ? NPUALLOC_POOL_ALL : NPUALLOC_POOL_SMALL + e;
            int64_t reserve = 0;
            for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
                const npa_tcache *t = d->tcaches[i];
                if (!t) continue;
                const int64_t(*current)[NPUALLOC_THREAD_STAT_COUNT] = t->slot->current;
                int64_t held = e == NPA_CEIL_ALL ? current[0][k] + current[1][k] : current[e][k];
                broken += held > t->ceiling[e][g] || (g >= NPA_CEIL_MALLOC && t->ceiling[e][g] > 0);
                reserve += t->ceiling[e][g];
            }
            broken += reserve != d->reserve[e][g];
            const npualloc_stat *st[2];
            group_stats(d->stats, g, st);
            for (int j = 0; j < 2; j++) broken += st[j][entry].current + reserve > st[j][entry].peak;
        }
    npa_tcaches_thaw(d);
    npa_lock_release(&d->lock);
    return broken;
}

static void test_chaos_under_a_reader(void) {
    fixture fx;
    fixture_init(&fx, 4 * GiB, NULL);
    atomic_int stop = 0;
    void *_Atomic mailbox = NULL;
    enum { N = 3 };
    chaos c[N];
    pthread_t ids[N];
    int seeds = 0;
    for (int i = 0; i < N; i++) {
        c[i] = (chaos){.fx = &fx, .stop = &stop, .mailbox = &mailbox, .seed = seeds++};
        CHECK_EQ(pthread_create(&ids[i], NULL, chaos_loop, &c[i]), 0);
    }
    long broken = 0, failures = 0;
    for (int round = 0; round < 20000 || seeds < 200; round++) {
        npa_device *d = npa_device_get(fx.a, 0, false);
        if (d && ceilings_broken(d) && broken++ < 5) fprintf(stderr, "the ceilings' rule broken at round %d\n", round);
        npualloc_device_stats s = stats_of(&fx, 0);
        const npualloc_stat *run = &s.allocation[0];
        for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) {
            if (run[i].current > run[i].peak || run[i].current < 0) {
                if (broken < 5) fprintf(stderr, "stat %d: current %lld peak %lld\n", i, (long long)run[i].current, (long long)run[i].peak);
                broken++;
            }
        }
        switch (round % 9) {
        case 0: npa_reset_peak_stats(fx.a, 0); break;
        case 1: npa_visit_segments(fx.a, 0, count_nothing, NULL); break;
        case 2: npa_empty_cache(fx.a, 0); break;
        case 3: npa_reset_accumulated_stats(fx.a, 0); break;
        case 4: CHECK_EQ(npa_set_record_history(fx.a, round % 2 ? 64 : 0), 0); break;
        case 5: CHECK_EQ(npa_set_record_history(fx.a, 0), 0); break;
        default: break;
        }
        for (int i = 0; i < N; i++) /* a thread that left: joined, another started */
            if (pthread_tryjoin_np(ids[i], NULL) == 0) {
                failures += c[i].failures;
                c[i] = (chaos){.fx = &fx, .stop = &stop, .mailbox = &mailbox, .seed = seeds++};
                CHECK_EQ(pthread_create(&ids[i], NULL, chaos_loop, &c[i]), 0);
            }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < N; i++) {
        CHECK_EQ(pthread_join(ids[i], NULL), 0);
        failures += c[i].failures;
    }
    void *left = atomic_exchange(&mailbox, NULL);
    if (left) CHECK_EQ(npa_free(fx.a, left, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(failures, 0);
    CHECK_EQ(broken, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

typedef struct lender2 {
    fixture *fx;
    void *block;
    long failures;
} lender2;

/* A thread with caches on two devices: a block one lent freed with the
 * other device as the hint (the slow path finds it), its exit folding both
 * back. */
static void *two_devices(void *arg) {
    lender2 *l = arg;
    for (int dev = 0; dev < 2; dev++)
        for (int i = 0; i < 4; i++) {
            void *p = NULL;
            l->failures += npa_malloc(l->fx->a, dev, 4096, NPA_ENTRY_EXACT, &p) != NPA_OK;
            l->failures += npa_free(l->fx->a, p, dev, NULL) != NPA_FREE_OK;
        }
    void *p0 = NULL, *p1 = NULL, *kept = NULL;
    l->failures += npa_malloc(l->fx->a, 0, 4096, NPA_ENTRY_EXACT, &p0) != NPA_OK;
    l->failures += npa_malloc(l->fx->a, 1, 4096, NPA_ENTRY_EXACT, &p1) != NPA_OK;
    l->failures += npa_malloc(l->fx->a, 1, 4096, NPA_ENTRY_EXACT, &kept) != NPA_OK;
    int where = -1;
    l->failures += npa_free(l->fx->a, p1, 0, &where) != NPA_FREE_OK; /* the wrong hint */
    l->failures += where != 1;
    l->failures += npa_free(l->fx->a, p0, 1, &where) != NPA_FREE_OK;
    l->failures += where != 0;
    l->failures += npa_free(l->fx->a, p0, 0, NULL) != NPA_FREE_INVALID;
    l->block = kept; /* lent on device 1 at exit */
    return NULL;
}

static void test_a_thread_on_two_devices(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    lender2 l = {.fx = &fx};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, two_devices, &l), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(l.failures, 0);
    for (int dev = 0; dev < 2; dev++) {
        npa_device *d = npa_device_get(fx.a, dev, false);
        CHECK_EQ(d->tcache_count, 0);
        npualloc_device_stats s = stats_of(&fx, dev);
        CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, dev == 1 ? 1 : 0);
        CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].peak, dev == 1 ? 2 : 1);
        CHECK_EQ(s.num_invalid_frees, dev == 0 ? 1 : 0);
    }
    CHECK_EQ(npa_free(fx.a, l.block, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 1).allocation[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

static uint64_t device_seq(fixture *fx) {
    return __atomic_load_n(&npa_device_get(fx->a, 0, false)->stats->seq, __ATOMIC_ACQUIRE);
}

/* inactive_split's ceilings: after reset_peak_memory_stats with a
 * split block lent, its slot's ceiling there is its slot's figure, so the
 * block's free may not raise the sum past the peak by the fast path: it
 * goes slow, and the peak becomes the exact 2 (the block back in the stock
 * beside the tail), not 3 (the device's figure with a block lent). Another
 * round of the same size stays exact. */
static void test_a_free_past_a_split_ceiling_goes_slow(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    companion c;
    start_companion_empty(&c, &fx);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    p = alloc_exact(&fx, 0, 4096); /* lent: 1 inactive split block, the tail */
    void *q = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK); /* held: 2, the peak */
    q = alloc_exact(&fx, 0, 4096); /* lent: 1 */
    npa_reset_peak_stats(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_ALL].peak, 1);
    uint64_t seq = device_seq(&fx);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK(device_seq(&fx) != seq); /* the slow path's */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 2);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 2);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].peak, 2);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].peak, s.inactive_split_bytes[NPUALLOC_POOL_ALL].current);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK); /* 3 */
    p = alloc_exact(&fx, 0, 4096);                    /* 2 */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* 3 */
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].peak, 3);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].peak, s.inactive_split_bytes[NPUALLOC_POOL_ALL].current);
    companion_stop(&c);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_inactive_split_peak_counts_lent_blocks_out);
    RUN(test_inactive_split_peak_after_a_reset);
    RUN(test_inactive_split_never_passes_its_peak_after_a_reset);
    RUN(test_empty_cache_unless_busy_never_waits_for_a_tcache);
    RUN(test_the_33rd_thread);
    RUN(test_an_allocator_destroyed_under_threads_caches);
    RUN(test_chaos_under_a_reader);
    RUN(test_a_thread_on_two_devices);
    RUN(test_a_free_past_a_split_ceiling_goes_slow);
    return check_report();
}
