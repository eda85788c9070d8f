/* Stream-safe reuse: frees wait in a batch, one fence per batch (recorded
 * once the batch is big enough, or when a malloc would miss), reuse only
 * after the fence completes (non-blocking poll), pending blocks stay active,
 * and the synchronizing paths drain everything. */
#include <stdint.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

static void fixture_with_fences_config(fixture *fx, size_t capacity, const npa_config *config) {
    fake_init(&fx->fake, capacity, false);
    fx->fake.fences = true;
    fixture_start(fx, config);
}

static void fixture_with_fences(fixture *fx, size_t capacity) { fixture_with_fences_config(fx, capacity, NULL); }

/* torch's rule (recent_blocks:0): a completed free merges with its free
 * neighbours. */
static void test_one_fence_per_batch(void) {
    fixture fx;
    npa_config merge = merge_at_free_config();
    fixture_with_fences_config(&fx, GiB, &merge);
    void *p = alloc_exact(&fx, 0, 1024);
    void *q = alloc_exact(&fx, 0, 1024);
    void *r = alloc_exact(&fx, 0, 1024);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(fx.fake.fence_records, 0); /* freeing records nothing */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 2);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 1);  /* the allocations ended... */
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 3);      /* ...but the blocks are still active */
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 3072);
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 2);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_INVALID); /* a pending block is not live */

    /* A malloc the cache serves otherwise leaves the batch open (later frees
     * share its fence) and must not reuse p or q. */
    void *t = alloc_exact(&fx, 0, 1024);
    CHECK_EQ(fx.fake.fence_records, 0);
    CHECK(t != p && t != q);
    CHECK_EQ((uintptr_t)t, (uintptr_t)r + 1024);
    npa_process_pending(fx.a, 0); /* closes the batch: one fence for both frees */
    CHECK_EQ(fx.fake.fence_records, 1);
    alloc_exact(&fx, 0, 1024);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.fence_records, 1); /* no new frees, no new fence */

    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 3);
    CHECK_EQ(fake_live_fences(&fx.fake), 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    void *reused = alloc_exact(&fx, 0, 2048); /* p and q merged */
    CHECK(reused == p);
    fixture_destroy(&fx);
}

static void test_batches_complete_independently(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    void *a = alloc_exact(&fx, 0, 1024);
    void *b = alloc_exact(&fx, 0, 1024);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* fence 1 covers a */
    fake_complete_fences(&fx.fake);
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* fence 2 covers b; fence 1 is done */
    CHECK_EQ(fx.fake.fence_records, 2);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 1);
    fixture_destroy(&fx);
}

static void test_eager_fence_frees_at_next_poll(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    fake_set_eager(&fx.fake, true);
    void *p = alloc_exact(&fx, 0, 1024);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    npa_process_pending(fx.a, 0);
    void *again = alloc_exact(&fx, 0, 1024);
    CHECK(again == p); /* no fence needed: reusable at once */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* A backend that says at free time that no fence is needed (eager right
 * now) gets the block back into its pool at once: no pending batch, no poll. */
static void test_free_skips_the_batch_when_no_fence_is_needed(void) {
    fixture fx;
    fixture_init_fenced_but_eager(&fx);
    void *p = alloc_exact(&fx, 0, 1024);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0); /* freed now, not at the next poll */
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 0);
    CHECK(alloc_exact(&fx, 0, 1024) == p);

    fake_set_eager(&fx.fake, false); /* a stream appeared: frees wait for their fence again */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    CHECK(alloc_exact(&fx, 0, 1024) != p);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.fence_records, 1);
    fixture_destroy(&fx);
}

/* issue 11 item 5: the program frees everything, then empties the cache.
 * As torch_npu's emptyCache, the call synchronizes and hands back every
 * pending free first, so after it nothing is active, pending or reserved. */
static void test_empty_cache_releases_every_freed_block(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    void *big = alloc_exact(&fx, 0, 12 * MiB);
    void *small = alloc_exact(&fx, 0, 4 * KiB);
    CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* one batch behind a fence that has not completed */
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK); /* and one still open */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 2);

    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(s.num_sync_all_streams, 1);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(fake_live_fences(&fx.fake), 0);
    CHECK_EQ(shape_of(&fx, 0).segments, 0);

    /* Nothing cached, nothing pending: nothing to wait for. */
    CHECK_EQ(npa_empty_cache(fx.a, -1), NPA_OK);
    CHECK_EQ(fx.fake.sync_calls, 1);
    fixture_destroy(&fx);
}

/* issue 11 item 6: a fence that can be neither recorded nor replaced by a
 * synchronize (the device cannot be entered) completes nothing. */
static void test_failed_fence_keeps_blocks_pending(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    void *p = alloc_exact(&fx, 0, 1024);
    alloc_exact(&fx, 0, 1024); /* keeps the segment split, so p's address is telling */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    fx.fake.fail_next_fences = 2;
    void *q = alloc_exact(&fx, 0, 1024);
    CHECK(q != p);
    npa_process_pending(fx.a, 0); /* its fence fails */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 1);
    npa_process_pending(fx.a, 0); /* fails again: still pending */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    CHECK_EQ(fx.fake.fence_records, 0);

    /* The device is back: the next poll fences the batch, and it completes. */
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.fence_records, 1);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    CHECK(alloc_exact(&fx, 0, 1024) == p);
    fixture_destroy(&fx);
}

/* issue 11 item 6: a synchronize that fails proves nothing, on every path
 * that synchronizes: empty_cache, the OOM retry, destroy. */
static void test_failed_synchronize_keeps_blocks_pending(void) {
    fixture fx;
    fixture_with_fences(&fx, 20 * MiB);
    void *p = alloc_exact(&fx, 0, 12 * MiB);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* fenced, not complete */

    fx.fake.fail_next_syncs = 1;
    CHECK_EQ(npa_empty_cache(fx.a, 0), 107002); /* the synchronize's own error */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1);
    CHECK_EQ(s.num_sync_all_streams, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 12 * MiB);
    CHECK_EQ(fx.fake.raw_free_calls, 0);

    /* The OOM path: its synchronize fails too, so the pending 12 MiB is
     * neither reused nor given back, and the request fails. */
    fx.fake.fail_next_syncs = 1;
    void *q = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 14 * MiB, NPA_ENTRY_EXACT, &q), NPA_ERR_OOM);
    CHECK_EQ(fx.fake.oom_reports, 1);
    CHECK(strncmp(fx.fake.last_oom_report, "out of memory on device 0: ", 27) == 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(fx.fake.raw_free_calls, 0);

    /* Once the device synchronizes, empty_cache releases it all. */
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    fixture_destroy(&fx);
}

static void test_oom_path_drains_pending(void) {
    fixture fx;
    fixture_with_fences(&fx, 20 * MiB);
    void *p = alloc_exact(&fx, 0, 12 * MiB);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    /* The pending 12 MiB blocks the device until step 6 synchronizes. */
    void *q = alloc_exact(&fx, 0, 14 * MiB);
    CHECK(q != NULL);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    fixture_destroy(&fx);
}

/* The fence path's cost: a fence is a runtime call per stream, so a poll
 * records one only once enough frees share it; a malloc that would
 * otherwise miss fences whatever is open and takes what completed. */
static void test_fence_waits_for_a_full_batch_or_a_miss(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fx.fake.auto_complete_polls = 1; /* a fence is done when first asked */
    fixture_start(&fx, NULL);
    enum { BATCH = 128 }; /* NPA_FENCE_BATCH_BLOCKS */
    static void *blocks[BATCH];
    for (int i = 0; i < BATCH; i++) blocks[i] = alloc_exact(&fx, 0, 4096);
    for (int i = 0; i < BATCH - 1; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    void *hit = alloc_exact(&fx, 0, 512); /* served from the cache: the batch stays open */
    CHECK_EQ(fx.fake.fence_records, 0);
    CHECK_EQ(npa_free(fx.a, hit, 0, NULL), NPA_FREE_OK); /* the 128th free */
    void *next = alloc_exact(&fx, 0, 512);
    CHECK_EQ(fx.fake.fence_records, 1); /* one fence for 128 frees */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0); /* and it completed when asked */
    (void)next;

    /* A miss: the open frees are fenced, and what completed is taken back,
     * before the pool grows (here the request needs the large pool anyway). */
    long mallocs = fx.fake.raw_malloc_calls;
    CHECK_EQ(npa_free(fx.a, blocks[BATCH - 1], 0, NULL), NPA_FREE_OK);
    void *big = alloc_exact(&fx, 0, 2 * MiB - 4096); /* no free block that big until the frees merge */
    CHECK_EQ(fx.fake.fence_records, 2);
    CHECK_EQ(fx.fake.raw_malloc_calls, mallocs + 1); /* the merged segment is a small one: a large request grows */
    CHECK(big != NULL);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* Large frees fence sooner: an open batch holds back at most a sixteenth
 * of the reserved bytes (at least 2 MiB), memory a miss would otherwise
 * have to grow by. */
static void test_fence_once_the_batch_holds_a_share_of_reserved(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fx.fake.auto_complete_polls = 1;
    fixture_start(&fx, NULL);
    enum { BLOCKS = 64 };
    static void *blocks[BLOCKS];
    for (int i = 0; i < BLOCKS; i++) blocks[i] = alloc_exact(&fx, 0, 4 * MiB);
    size_t reserved = (size_t)stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current;
    CHECK(reserved >= BLOCKS * 4 * MiB);
    int below = (int)(reserved / 16 / (4 * MiB)); /* frees that stay under the share */
    if (reserved / 16 % (4 * MiB) == 0) below--;
    CHECK(below >= 1 && below + 1 < BLOCKS);
    void *small = alloc_exact(&fx, 0, 512);
    for (int i = 0; i < below; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    small = alloc_exact(&fx, 0, 512); /* a hit: under the share, the batch stays open */
    CHECK_EQ(fx.fake.fence_records, 0);
    CHECK_EQ(npa_free(fx.a, blocks[below], 0, NULL), NPA_FREE_OK); /* reaches the share */
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    alloc_exact(&fx, 0, 512);
    CHECK_EQ(fx.fake.fence_records, 1); /* far fewer than 128 frees */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* With the recent cache (the default), completed frees are held whole, as
 * an eager free is: the next mallocs of their sizes take them back without
 * a best fit, a split or a merge. Never before their fence completed. */
static void test_completed_frees_are_reused_whole(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    void *p = alloc_exact(&fx, 0, 1024);
    void *q = alloc_exact(&fx, 0, 1024);
    void *keep = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* the fence for both */
    void *early = alloc_exact(&fx, 0, 1024);
    CHECK(early != p && early != q); /* still pending: the segment's tail serves it */
    CHECK_EQ(npa_free(fx.a, early, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 3);
    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0); /* p and q come back; early's fence is the one just recorded */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2); /* keep, and early still pending */
    /* Unmerged: p, q and the tail beyond early are three inactive blocks
     * (merged, p and q would be one). */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 3);
    CHECK_EQ(shape_of(&fx, 0).blocks, 5);
    void *first = alloc_exact(&fx, 0, 1024);
    void *second = alloc_exact(&fx, 0, 1024);
    CHECK((first == p && second == q) || (first == q && second == p));
    s = stats_of(&fx, 0);
    CHECK_EQ(shape_of(&fx, 0).blocks, 5); /* no split */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 1024 + 1024 + 4096);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 1024 + 1024 + 4096 + 1024);
    (void)keep;
    fixture_destroy(&fx);
}

/* A batch completes all at once, but only a recent cache's worth of it is
 * held whole: the rest merges into the pool at once rather than each block
 * pushing the one before out of the cache. */
static void test_only_a_cache_worth_of_a_batch_is_held(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.recent_blocks = 2;
    fixture fx;
    fixture_with_fences_config(&fx, GiB, &config);
    void *blocks[6];
    for (int i = 0; i < 6; i++) blocks[i] = alloc_exact(&fx, 0, 512);
    void *keep = alloc_exact(&fx, 0, 512);
    for (int i = 0; i < 6; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0);
    /* The two freed last are held; the first four merged into one block. */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 4);
    CHECK_EQ(shape_of(&fx, 0).blocks, 5);
    CHECK(alloc_exact(&fx, 0, 512) == blocks[5] || alloc_exact(&fx, 0, 512) == blocks[4]);
    (void)keep;
    fixture_destroy(&fx);
}

/* A fence that is not done is asked again only after a back-off of
 * mallocs that doubles up to 64, not at every malloc; a malloc that would
 * miss asks at once and takes the completed block instead of growing. */
static void test_polls_back_off_while_a_fence_runs(void) {
    fixture fx;
    fixture_with_fences(&fx, GiB);
    void *p = alloc_exact(&fx, 0, 1 * MiB);
    void *q = alloc_exact(&fx, 0, 1 * MiB); /* the rest of p's segment */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* p's fence, not done */
    long queries = fx.fake.fence_queries;
    enum { POLLS = 200 };
    static void *small[POLLS];
    for (int i = 0; i < POLLS; i++) {
        small[i] = alloc_exact(&fx, 0, 8 * KiB);
        CHECK(small[i] < p || small[i] >= (void *)((char *)p + MiB)); /* never p before its fence */
    }
    /* The flush's query found it running; then asked at mallocs 2, 5, 10,
     * 19, 36, 69, 134 and 199: eight queries where asking at every malloc
     * made 200. */
    CHECK_EQ(fx.fake.fence_queries - queries, 8);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);

    /* Done now, but the polls wait out their back-off: the next malloc
     * that the pool cannot serve asks at once and takes p, no growth. */
    fake_complete_fences(&fx.fake);
    long mallocs = fx.fake.raw_malloc_calls;
    void *again = alloc_exact(&fx, 0, 1 * MiB);
    CHECK(again == p);
    CHECK_EQ(fx.fake.raw_malloc_calls, mallocs);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    (void)q;
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_one_fence_per_batch);
    RUN(test_completed_frees_are_reused_whole);
    RUN(test_only_a_cache_worth_of_a_batch_is_held);
    RUN(test_polls_back_off_while_a_fence_runs);
    RUN(test_fence_waits_for_a_full_batch_or_a_miss);
    RUN(test_fence_once_the_batch_holds_a_share_of_reserved);
    RUN(test_batches_complete_independently);
    RUN(test_eager_fence_frees_at_next_poll);
    RUN(test_free_skips_the_batch_when_no_fence_is_needed);
    RUN(test_empty_cache_releases_every_freed_block);
    RUN(test_failed_fence_keeps_blocks_pending);
    RUN(test_failed_synchronize_keeps_blocks_pending);
    RUN(test_oom_path_drains_pending);
    return check_report();
}
