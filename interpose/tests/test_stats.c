/* Stats update rules (torch's Stat: current/peak/allocated/freed per pool),
 * the resets, npualloc's own counters, and publication into backend storage
 * under the seqlock. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

static void test_update_rules_per_pool(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *s1 = alloc_exact(&fx, 0, 1000);     /* small: 1024 */
    void *s2 = alloc_exact(&fx, 0, 2000);     /* small: 2048 */
    void *l1 = alloc_exact(&fx, 0, 3 * MiB);  /* large: 3 MiB */
    CHECK_EQ(npa_free(fx.a, s1, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_SMALL], 2048, 3072, 3072, 1024);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_LARGE], 3 * MiB, 3 * MiB, 3 * MiB, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 2048 + 3 * MiB, 3072 + 3 * MiB, 3072 + 3 * MiB, 1024);
    check_stat(s.allocation[NPUALLOC_POOL_ALL], 2, 3, 3, 1);
    check_stat(s.requested_bytes[NPUALLOC_POOL_SMALL], 2000, 3000, 3000, 1000);
    check_stat(s.active_bytes[NPUALLOC_POOL_SMALL], 2048, 3072, 3072, 1024);
    check_stat(s.segment[NPUALLOC_POOL_ALL], 2, 2, 2, 0);
    check_stat(s.reserved_bytes[NPUALLOC_POOL_LARGE], 20 * MiB, 20 * MiB, 20 * MiB, 0);
    CHECK_EQ(s.num_device_alloc, 2);
    CHECK_EQ(s.num_cache_misses, 2);
    CHECK_EQ(s.num_cache_hits, 1);
    CHECK_EQ(s.max_split_size, -1);

    npa_reset_peak_stats(fx.a, 0);
    s = stats_of(&fx, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_SMALL], 2048, 2048, 3072, 1024);
    check_stat(s.allocation[NPUALLOC_POOL_ALL], 2, 2, 3, 1);

    npa_reset_accumulated_stats(fx.a, 0);
    s = stats_of(&fx, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_SMALL], 2048, 2048, 0, 0);
    check_stat(s.reserved_bytes[NPUALLOC_POOL_ALL], 22 * MiB, 22 * MiB, 0, 0);
    CHECK_EQ(s.num_device_alloc, 0);
    CHECK_EQ(s.num_cache_hits, 0);
    CHECK_EQ(s.num_cache_misses, 0);

    CHECK_EQ(npa_free(fx.a, s2, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, l1, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 0, 2048 + 3 * MiB, 0, 2048 + 3 * MiB);
    check_stat(s.active[NPUALLOC_POOL_ALL], 0, 2, 0, 2);
    check_stat(s.requested_bytes[NPUALLOC_POOL_ALL], 0, 2000 + 3 * MiB, 0, 2000 + 3 * MiB);
    fixture_destroy(&fx);
}

static void test_inactive_split_rules(void) {
    npa_config config = merge_at_free_config();
    fixture fx;
    fixture_init(&fx, GiB, &config);
    void *a = alloc_exact(&fx, 0, 4096);
    void *b = alloc_exact(&fx, 0, 4096);
    /* Taking from an already split inactive block shrinks it by 4096. */
    npualloc_device_stats s = stats_of(&fx, 0);
    check_stat(s.inactive_split_bytes[NPUALLOC_POOL_SMALL], 2 * MiB - 8192, 2 * MiB - 4096, 2 * MiB - 4096, 4096);
    check_stat(s.inactive_split[NPUALLOC_POOL_SMALL], 1, 1, 1, 0);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    /* An already split block taken whole leaves the inactive set. */
    void *again = alloc_exact(&fx, 0, 4096);
    CHECK(again == a);
    s = stats_of(&fx, 0);
    check_stat(s.inactive_split[NPUALLOC_POOL_SMALL], 1, 2, 2, 1);
    CHECK_EQ(npa_free(fx.a, again, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

static void test_storage_and_seqlock(void) {
    static npualloc_device_stats shared[2];
    memset(shared, 0, sizeof shared);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.stats[0] = NULL; /* device 0: no storage */
    fx.fake.stats[1] = &shared[1];
    npa_config config = merge_at_free_config(); /* the largest free block is the whole segment again */
    fixture_start(&fx, &config);
    CHECK_EQ(shared[1].in_use, 0); /* nothing before first use */
    void *p = alloc_exact(&fx, 1, 4096);
    CHECK_EQ(shared[1].in_use, 1);
    CHECK_EQ(shared[1].allocated_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ(shared[1].seq % 2, 0);
    uint64_t seq = shared[1].seq;
    CHECK(seq > 0);
    CHECK_EQ(npa_free(fx.a, p, 1, NULL), NPA_FREE_OK);
    CHECK(shared[1].seq > seq);
    CHECK_EQ(shared[1].seq % 2, 0);
    /* The storage keeps freed implied (current_at_reset in its place); the
     * copy handed out has it. */
    CHECK_EQ(shared[1].allocated_bytes[NPUALLOC_POOL_ALL].current_at_reset, 0);
    npualloc_device_stats copy = stats_of(&fx, 1);
    CHECK_EQ(copy.allocated_bytes[NPUALLOC_POOL_ALL].freed, 4096);
    npualloc_device_stats expected = shared[1];
    npualloc_stats_from_region(&expected);
    CHECK(memcmp(&copy, &expected, sizeof copy) == 0);
    CHECK_EQ(shared[1].largest_free_block, 2 * MiB);
    CHECK_EQ(shared[0].seq, 0); /* device 0 keeps its own storage untouched */

    /* A device with no storage keeps its stats itself. */
    alloc_exact(&fx, 0, 4096);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(shared[0].seq, 0);
    fixture_destroy(&fx);
}

/* An allocator that stops serving (aclFinalize) leaves the storage to the
 * next one: from then on it writes a copy of its own, so each seqlock keeps
 * one writer, and devices it creates later never take the storage. */
static void test_detached_allocator_leaves_the_storage_alone(void) {
    static npualloc_device_stats shared[2];
    memset(shared, 0, sizeof shared);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.stats[0] = &shared[0];
    fx.fake.stats[1] = &shared[1];
    fixture_start(&fx, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    npa_detach_stats_storage(fx.a);
    npualloc_device_stats before = shared[0];
    uint64_t seq = before.seq;
    CHECK_EQ(seq % 2, 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npa_count(fx.a, 0, NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED, 1, true);
    npa_count(fx.a, 1, NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED, 1, true); /* creates device 1 */
    CHECK(memcmp(&shared[0], &before, sizeof before) == 0);
    CHECK_EQ(shared[1].seq, 0);
    CHECK_EQ(shared[1].in_use, 0);
    npualloc_device_stats own = stats_of(&fx, 0); /* carried on in its copy */
    CHECK_EQ(own.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(own.allocated_bytes[NPUALLOC_POOL_ALL].freed, 4096);
    CHECK_EQ(own.num_executor_destroys_skipped, 1);
    CHECK_EQ(stats_of(&fx, 1).num_executor_destroys_skipped, 1);
    fixture_destroy(&fx);
}

static void test_unused_device_reads_as_zero(void) {
    npa_config c;
    npa_config_defaults(&c);
    c.max_split_size = 64 * MiB;
    fixture fx;
    fixture_init(&fx, GiB, &c);
    npualloc_device_stats s = stats_of(&fx, 7);
    CHECK_EQ(s.in_use, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, 0);
    CHECK_EQ(s.max_split_size, 64 * MiB);
    npa_reset_peak_stats(fx.a, 7); /* harmless, creates nothing */
    CHECK_EQ(stats_of(&fx, 7).in_use, 0);
    fixture_destroy(&fx);
}

static void test_hook_counters(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    npa_count(fx.a, 2, NPA_COUNTER_EXECUTOR_DESTROYS_FORWARDED, 3, true);
    npa_count(fx.a, 2, NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED, 1, true);
    npa_count(fx.a, 2, NPA_COUNTER_EXECUTOR_DESTROYS_FORWARDED, 2, true);
    npa_count(fx.a, NPUALLOC_MAX_DEVICES, NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED, 1, true); /* ignored */
    npualloc_device_stats s = stats_of(&fx, 2);
    CHECK_EQ(s.num_executor_destroys_forwarded, 5);
    CHECK_EQ(s.num_executor_destroys_skipped, 1);
    CHECK_EQ(s.seq % 2, 0);
    npa_set_record_history(fx.a, 123);
    CHECK_EQ(npa_get_config(fx.a)->record_history, 123);
    fixture_destroy(&fx);
}

/* issue 11 item 8: the device's free memory in the stats follows segments
 * as they are reserved and given back (it was sampled only once). */
static void test_device_free_bytes_follow_segments(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 100 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.device_total_bytes, GiB);
    CHECK_EQ(s.device_free_bytes, GiB - 100 * MiB);
    void *q = alloc_exact(&fx, 0, 200 * MiB);
    CHECK_EQ(stats_of(&fx, 0).device_free_bytes, GiB - 300 * MiB);
    void *hit = NULL;
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_malloc(fx.a, 0, 200 * MiB, NPA_ENTRY_EXACT, &hit), NPA_OK); /* a hit: no segment moved */
    CHECK_EQ(stats_of(&fx, 0).device_free_bytes, GiB - 300 * MiB);
    CHECK_EQ(npa_free(fx.a, hit, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(stats_of(&fx, 0).device_free_bytes, GiB);
    fixture_destroy(&fx);
}

/* The accumulated counts only grow until a reset: allocated_bytes passes
 * INT64_MAX after 9.2 EB of allocations (107 days at 1 TB/s). It wraps, as
 * the readers take it, never a signed overflow (UBSan stops the ASan build
 * there), and freed stays right modulo 2^64. */
static void test_accumulated_counts_wrap_at_int64_max(void) {
    static npualloc_device_stats shared[1];
    memset(shared, 0, sizeof shared);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.stats[0] = &shared[0];
    fixture_start(&fx, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    /* As after 9.2 EB: 4096 bytes allocated and freed, then the rest. */
    shared[0].allocated_bytes[NPUALLOC_POOL_ALL].allocated = INT64_MAX - 1023;
    shared[0].allocated_bytes[NPUALLOC_POOL_ALL].current_at_reset = 0;
    p = alloc_exact(&fx, 0, 4096);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].allocated, INT64_MIN + 3072);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 4096);
    CHECK_EQ((uint64_t)s.allocated_bytes[NPUALLOC_POOL_ALL].freed, (uint64_t)INT64_MAX - 1023);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

/* A malloc served from the recent cache and a free that makes room there
 * (the oldest held block goes back to its pool, through the merge: a
 * section nested in the free's) each make one seqlock section: seq moves by 2 and is even
 * between them (npa_stats_begin_outermost's depth). */
static void test_malloc_and_free_are_one_section_each(void) {
    static npualloc_device_stats shared;
    memset(&shared, 0, sizeof shared);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.stats[0] = &shared;
    npa_config config;
    npa_config_defaults(&config);
    config.recent_blocks = 1;
    fixture_start(&fx, &config);
    void *p = alloc_exact(&fx, 0, 4096), *q = alloc_exact(&fx, 0, 8192);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK); /* held */
    uint64_t seq = shared.seq;
    CHECK_EQ(seq % 2, 0);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK); /* held; p back in its pool */
    CHECK_EQ(shared.seq, seq + 2);
    CHECK_EQ(shared.inactive_split[NPUALLOC_POOL_ALL].current, 3); /* p, q and the segment's tail */
    CHECK(alloc_exact(&fx, 0, 8192) == q); /* from the cache */
    CHECK_EQ(shared.seq, seq + 4);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(shared.seq, seq + 6);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_update_rules_per_pool);
    RUN(test_inactive_split_rules);
    RUN(test_storage_and_seqlock);
    RUN(test_detached_allocator_leaves_the_storage_alone);
    RUN(test_unused_device_reads_as_zero);
    RUN(test_hook_counters);
    RUN(test_device_free_bytes_follow_segments);
    RUN(test_accumulated_counts_wrap_at_int64_max);
    RUN(test_malloc_and_free_are_one_section_each);
    return check_report();
}
