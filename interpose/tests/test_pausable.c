/* Pausing the whole allocator (npa_pause / npa_resume, `npualloc pause`):
 * live blocks survive bit-exact at the same addresses, every page is
 * unmapped while paused (the fake device's memory is all free, and its
 * pages are PROT_NONE, so a touch would fault), free space is not copied, a
 * resume without device memory keeps everything paused and can be retried,
 * a pause whose unmap fails half way maps back what it unmapped with the
 * contents restored, a process with plain segments is refused untouched,
 * and one switched to expandable segments at run time pauses once its
 * plain segments hold no live block. */
#define _GNU_SOURCE /* pthread_timedjoin_np */
#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

#include "check.h"
#include "core/internal.h"
#include "fake_backend.h"
#include "test_util.h"

static void start(fixture *fx, bool expandable) {
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = expandable;
    fake_init(&fx->fake, 200 * MiB, true);
    fx->fake.vmm = true;
    fixture_start(fx, &config);
}

static void fill(char *p, size_t size, int seed) {
    for (size_t i = 0; i < size; i += 4096) p[i] = (char)(seed + i / 4096);
}

static bool same(const char *p, size_t size, int seed) {
    for (size_t i = 0; i < size; i += 4096)
        if (p[i] != (char)(seed + i / 4096)) return false;
    return true;
}

static void test_pause_releases_everything_and_resume_restores(void) {
    fixture fx;
    start(&fx, true);
    char *big = alloc_exact(&fx, 0, 30 * MiB), *small = alloc_exact(&fx, 0, 100 * 1024);
    char *gone = alloc_exact(&fx, 0, 8 * MiB);
    fill(big, 30 * MiB, 1);
    fill(small, 100 * 1024, 2);
    CHECK_EQ(npa_free(fx.a, gone, 0, NULL), NPA_FREE_OK);
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);             /* every page given back */
    size_t unmapped, backup;
    npa_paused_bytes(paused, &unmapped, &backup);
    CHECK_EQ(backup, npa_round_size(npa_get_config(fx.a), 30 * MiB) + npa_round_size(npa_get_config(fx.a), 100 * 1024));
    CHECK(unmapped >= backup);
    long copies = fx.fake.copies;
    CHECK_EQ(copies, 2);                             /* the live blocks only, not the freed one */
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    CHECK_EQ(fake_used(&fx.fake, 0), unmapped);
    CHECK(same(big, 30 * MiB, 1) && same(small, 100 * 1024, 2));
    /* The allocator runs on: its locks are released. */
    CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

static void test_resume_without_memory_stays_paused_and_retries(void) {
    fixture fx;
    start(&fx, true);
    char *p = alloc_exact(&fx, 0, 50 * MiB);
    fill(p, 50 * MiB, 3);
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    long maps = fx.fake.page_maps;
    fx.fake.capacity = 30 * MiB;                     /* room for one 20 MiB page, not three */
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_ERR_OOM);
    CHECK(strstr(why, "the backup is kept") != NULL);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);             /* what it mapped went back: all or none */
    CHECK(fx.fake.page_maps > maps);
    fx.fake.capacity = 200 * MiB;
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    CHECK(same(p, 50 * MiB, 3));
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

static void test_an_unmap_failing_half_way_leaves_everything_mapped_and_intact(void) {
    fixture fx;
    start(&fx, true);
    char *big = alloc_exact(&fx, 0, 30 * MiB), *small = alloc_exact(&fx, 0, 100 * 1024);
    fill(big, 30 * MiB, 5);
    fill(small, 100 * 1024, 6);
    size_t used = fake_used(&fx.fake, 0);
    fx.fake.fail_after_unmaps = 1;                   /* the first page goes, the second is refused */
    fx.fake.fail_next_unmaps = 1;
    long maps = fx.fake.page_maps;
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_ERR_FREE);
    CHECK(strstr(why, "unmapping") != NULL);
    CHECK_EQ(fx.fake.fail_next_unmaps, 0);
    CHECK_EQ(fx.fake.page_maps, maps + 1);           /* the one page unmapped was mapped back */
    CHECK_EQ(fake_used(&fx.fake, 0), used);
    CHECK(same(big, 30 * MiB, 5) && same(small, 100 * 1024, 6)); /* its contents copied back */
    /* Not left locked, and a later pause works. */
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    CHECK(same(big, 30 * MiB, 5) && same(small, 100 * 1024, 6));
    CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

/* The same failure half way, when the page it unmapped cannot be mapped back
 * (another process took the memory meanwhile): freeing the backup would lose
 * the block, so it stays paused with its backup, the locks held, and a
 * resume brings everything back. */
static void test_a_failed_pause_that_cannot_map_back_stays_paused_with_its_backup(void) {
    fixture fx;
    start(&fx, true);
    char *big = alloc_exact(&fx, 0, 30 * MiB);
    fill(big, 30 * MiB, 7);
    size_t used = fake_used(&fx.fake, 0);
    fx.fake.fail_after_unmaps = 1;                   /* the first page goes, the second is refused */
    fx.fake.fail_next_unmaps = 1;
    fx.fake.fail_next_mallocs = 1;                   /* and the first cannot be mapped back */
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_ERR_FREE);
    CHECK(paused != NULL);                           /* not dropped: paused, with the backup */
    CHECK(strstr(why, "stays paused") != NULL);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    if (paused) {
        CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
        CHECK_EQ(fake_used(&fx.fake, 0), used);
        CHECK(same(big, 30 * MiB, 7));
        CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK);
    }
    fixture_destroy(&fx);
}

/* The pause empties the cache first; a device that cannot synchronize
 * refuses it with the runtime's own error, for the requester to act on. */
static void test_a_device_that_cannot_synchronize_refuses_with_its_error(void) {
    fixture fx;
    start(&fx, true);
    char *live = alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 40 * MiB), 0, NULL), NPA_FREE_OK); /* whole free pages to give back */
    fx.fake.fail_next_syncs = 1;
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), 107002);
    CHECK(strstr(why, "could not be synchronized (error 107002)") != NULL);
    CHECK(paused == NULL);
    /* Nothing was paused and the locks are free: it pauses once it can. */
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    CHECK_EQ(npa_free(fx.a, live, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

static void test_plain_segments_are_refused_untouched(void) {
    fixture fx;
    start(&fx, false);
    char *p = alloc_exact(&fx, 0, 5 * MiB);
    fill(p, 5 * MiB, 4);
    size_t used = fake_used(&fx.fake, 0);
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_ERR_INVALID_PARAM);
    CHECK(strstr(why, "expandable_segments:True") != NULL);
    CHECK_EQ(fake_used(&fx.fake, 0), used);
    CHECK(same(p, 5 * MiB, 4));
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* not left locked */
    fixture_destroy(&fx);
}

/* expandable_segments switched on at run time: a plain segment with a live
 * block keeps the process unpausable; once its block is freed, the pause
 * (which empties the cache first) gives it back and pauses the rest. */
static void test_switched_on_at_run_time_pausable_once_plain_blocks_are_freed(void) {
    fixture fx;
    start(&fx, false);
    char *plain = alloc_exact(&fx, 0, 5 * MiB);
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    char *mapped = alloc_exact(&fx, 0, 30 * MiB);
    fill(mapped, 30 * MiB, 5);
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_ERR_INVALID_PARAM);
    CHECK(strstr(why, "1 plain segment with live blocks") != NULL);
    CHECK_EQ(npa_free(fx.a, plain, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    CHECK(same(mapped, 30 * MiB, 5));
    CHECK_EQ(npa_free(fx.a, mapped, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}


/* A worker thread whose cache served hits (the fast paths run: two threads
 * have caches) and that ends while the allocator is paused. */
typedef struct worker {
    fixture *fx;
    pthread_barrier_t barrier;
    long failures;
} worker;

static void *hit_then_wait(void *arg) {
    worker *w = arg;
    for (int i = 0; i < 8; i++) w->failures += npa_free(w->fx->a, alloc_exact(w->fx, 0, 512), 0, NULL) != NPA_FREE_OK;
    pthread_barrier_wait(&w->barrier); /* its hits made */
    pthread_barrier_wait(&w->barrier); /* paused: end now */
    return NULL;
}

/* This thread's cache and w's thread, which made its hits and waits for
 * the second barrier to end. */
static pthread_t start_worker_after_hits(fixture *fx, worker *w) {
    CHECK_EQ(npa_free(fx->a, alloc_exact(fx, 0, 512), 0, NULL), NPA_FREE_OK);
    *w = (worker){.fx = fx};
    pthread_barrier_init(&w->barrier, NULL, 2);
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, hit_then_wait, w), 0);
    pthread_barrier_wait(&w->barrier);
    return thread;
}

/* A thread's exit folds its caches back; one that ends while the allocator
 * is paused must not wait for the resume (its pthread key's destructor ran
 * into the device lock the pause holds, so a program that joined it before
 * resuming hung for good). Its cache is taken back at the resume, every
 * figure as before: nothing lost, nothing counted twice. The join waits a
 * bounded while, so the old behaviour fails here instead of hanging. */
static void test_a_thread_ending_while_paused_is_joined_before_the_resume(void) {
    fixture fx;
    start(&fx, true);
    worker w;
    pthread_t thread = start_worker_after_hits(&fx, &w);
    npualloc_device_stats before;
    npa_get_stats(fx.a, 0, &before);
    CHECK(before.num_cache_hits >= 8);
    char why[256];
    npa_paused *paused = NULL;
    CHECK_EQ(npa_pause(fx.a, &paused, why, sizeof why), NPA_OK);
    pthread_barrier_wait(&w.barrier);
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += 5; /* a bound for the failure only: the fix joins at once */
    int joined = pthread_timedjoin_np(thread, NULL, &until);
    CHECK_EQ(joined, 0);
    CHECK_EQ(npa_resume(fx.a, paused, why, sizeof why), NPA_OK);
    if (joined == ETIMEDOUT) CHECK_EQ(pthread_join(thread, NULL), 0); /* the resume let it go */
    CHECK_EQ(w.failures, 0);
    pthread_barrier_destroy(&w.barrier);
    npa_device *d = npa_device_get(fx.a, 0, false);
    CHECK_EQ(d->tcache_count, 1); /* its cache is gone, its slot all zero */
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        if (d->tcaches[i]) continue;
        static const npualloc_thread_stats zero;
        CHECK(memcmp((const char *)&d->threads[i] + sizeof zero.seq, (const char *)&zero + sizeof zero.seq,
                     sizeof zero - sizeof zero.seq) == 0);
    }
    npualloc_device_stats after;
    npa_get_stats(fx.a, 0, &after);
    CHECK_EQ(after.num_cache_hits, before.num_cache_hits);
    for (int e = 0; e < NPUALLOC_POOL_COUNT; e++) {
        CHECK_EQ(after.allocation[e].allocated, before.allocation[e].allocated);
        CHECK_EQ(after.allocation[e].current, 0);
        CHECK_EQ(after.allocation[e].peak, before.allocation[e].peak);
        CHECK_EQ(after.allocated_bytes[e].allocated, before.allocated_bytes[e].allocated);
        CHECK_EQ(after.requested_bytes[e].allocated, before.requested_bytes[e].allocated);
        CHECK_EQ(after.active_bytes[e].current, 0);
    }
    fixture_destroy(&fx);
}

/* Not paused, only busy: the ending thread waits for the device lock and
 * folds its cache back itself, every figure as before. The lock's word
 * turns 2 once it sleeps on it; the holder then lets it go. */
static void test_a_thread_ending_while_the_device_is_busy_folds_its_cache_itself(void) {
    fixture fx;
    start(&fx, true);
    worker w;
    pthread_t thread = start_worker_after_hits(&fx, &w);
    npualloc_device_stats before;
    npa_get_stats(fx.a, 0, &before);
    npa_device *d = npa_device_get(fx.a, 0, false);
    npa_lock_acquire(&d->lock);
    pthread_barrier_wait(&w.barrier);
    int joined = EBUSY; /* or it ended without waiting, which the count below refuses */
    while (__atomic_load_n(&d->lock.state, __ATOMIC_RELAXED) != 2 &&
           (joined = pthread_tryjoin_np(thread, NULL)) == EBUSY)
        sched_yield();
    npa_lock_release(&d->lock);
    if (joined != 0) CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.failures, 0);
    pthread_barrier_destroy(&w.barrier);
    CHECK_EQ(d->tcache_count, 1);
    npualloc_device_stats after;
    npa_get_stats(fx.a, 0, &after);
    CHECK_EQ(after.num_cache_hits, before.num_cache_hits);
    CHECK_EQ(after.allocation[NPUALLOC_POOL_ALL].allocated, before.allocation[NPUALLOC_POOL_ALL].allocated);
    CHECK_EQ(after.allocation[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_pause_releases_everything_and_resume_restores);
    RUN(test_resume_without_memory_stays_paused_and_retries);
    RUN(test_an_unmap_failing_half_way_leaves_everything_mapped_and_intact);
    RUN(test_a_failed_pause_that_cannot_map_back_stays_paused_with_its_backup);
    RUN(test_a_device_that_cannot_synchronize_refuses_with_its_error);
    RUN(test_plain_segments_are_refused_untouched);
    RUN(test_switched_on_at_run_time_pausable_once_plain_blocks_are_freed);
    RUN(test_a_thread_ending_while_paused_is_joined_before_the_resume);
    RUN(test_a_thread_ending_while_the_device_is_busy_folds_its_cache_itself);
    return check_report();
}
