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

int main(void) {
    RUN(test_inactive_split_peak_counts_lent_blocks_out);
    RUN(test_inactive_split_peak_after_a_reset);
    RUN(test_empty_cache_unless_busy_never_waits_for_a_tcache);
    return check_report();
}
