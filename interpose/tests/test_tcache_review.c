/* Review of the per-thread caches (issue 14, h96a): cases that failed on
 * the first implementation (dc45998). */
#include <pthread.h>
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

/* inactive_split's peak is the most inactive split blocks there ever were.
 * A split block the thread's cache lends stays counted inactive in the
 * device's figure (its slot says -1), so a slow path that adds an inactive
 * split block raised the peak from the device's figure alone, one above
 * anything there ever was. The same sequence without per-thread caches
 * (the device's recent cache before issue 14) peaks at 2. */
static void test_inactive_split_peak_counts_lent_blocks_out(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
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
    fixture_destroy(&fx);
}

/* The same after reset_peak_memory_stats: the peak is set to the sum (the
 * lent block out), below the device's own figure, and the next inactive
 * split block a slow path adds raised it to the device's figure plus one. */
static void test_inactive_split_peak_after_a_reset(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
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
    fixture_destroy(&fx);
}

/* exit() from a signal handler that interrupted the thread's own fast path
 * (its tcache lock held): the hook's at_exit gives the cache back through
 * npa_empty_cache_unless_busy, which must never wait for a lock (the
 * device's it only tries). Its flush of every stock waited for the
 * thread's own tcache lock: the process never ended. Run in a child,
 * which an alarm ends if it hangs. */
static void test_empty_cache_unless_busy_never_waits_for_a_tcache(void) {
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        fixture fx;
        fixture_init(&fx, GiB, NULL);
        for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 4096), 0, NULL), NPA_FREE_OK);
        npa_tcache *t = npa_tcache_mine(fx.a, 0);
        CHECK(t != NULL);
        alarm(10);
        npa_lock_acquire(&t->lock); /* where the signal landed: inside npa_tcache_malloc */
        unsigned busy = npa_empty_cache_unless_busy(fx.a, 1u);
        npa_lock_release(&t->lock);
        _exit(busy == 1u && check_report() == 0 ? 0 : 3);
    }
    int status = 0;
    CHECK_EQ(waitpid(child, &status, 0), child);
    CHECK(!WIFSIGNALED(status)); /* SIGALRM: it hung */
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
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

int main(void) {
    RUN(test_inactive_split_peak_counts_lent_blocks_out);
    RUN(test_inactive_split_peak_after_a_reset);
    RUN(test_empty_cache_unless_busy_never_waits_for_a_tcache);
    RUN(test_the_33rd_thread);
    RUN(test_an_allocator_destroyed_under_threads_caches);
    return check_report();
}
