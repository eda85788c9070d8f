/* Pausing the whole allocator (npa_pause / npa_resume, `npualloc pause`):
 * live blocks survive bit-exact at the same addresses, every page is
 * unmapped while paused (the fake device's memory is all free, and its
 * pages are PROT_NONE, so a touch would fault), free space is not copied, a
 * resume without device memory keeps everything paused and can be retried,
 * a pause whose unmap fails half way maps back what it unmapped with the
 * contents restored, a process with plain segments is refused untouched,
 * and one switched to expandable segments at run time pauses once its
 * plain segments hold no live block. */
#include <string.h>

#include "check.h"
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

int main(void) {
    RUN(test_pause_releases_everything_and_resume_restores);
    RUN(test_resume_without_memory_stays_paused_and_retries);
    RUN(test_an_unmap_failing_half_way_leaves_everything_mapped_and_intact);
    RUN(test_a_failed_pause_that_cannot_map_back_stays_paused_with_its_backup);
    RUN(test_a_device_that_cannot_synchronize_refuses_with_its_error);
    RUN(test_plain_segments_are_refused_untouched);
    RUN(test_switched_on_at_run_time_pausable_once_plain_blocks_are_freed);
    return check_report();
}
