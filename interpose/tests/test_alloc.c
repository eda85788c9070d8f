/* Malloc/free behaviour: best fit, split and merge in both pools, the
 * oversize rules, alignment, device isolation, invalid and foreign frees,
 * empty_cache and the snapshot visitor. */
#include <stdint.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

static void test_small_split_and_merge(void) {
    npa_config config = merge_at_free_config();
    fixture fx;
    fixture_init(&fx, GiB, &config);
    void *p1 = alloc_exact(&fx, 0, 1000);
    void *p2 = alloc_exact(&fx, 0, 1000);
    CHECK_EQ((uintptr_t)p2, (uintptr_t)p1 + 1024); /* the remainder is the best fit, lowest address */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_SMALL].current, 2 * MiB);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_SMALL].current, 2048);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_SMALL].current, 2 * MiB - 2048);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);

    CHECK_EQ(npa_free(fx.a, p1, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 2); /* p1's block and the tail */
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_SMALL].current, 2 * MiB - 1024);
    CHECK_EQ(s.largest_free_block, 2 * MiB - 2048);

    CHECK_EQ(npa_free(fx.a, p2, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 0); /* merged back into one whole segment */
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.largest_free_block, 2 * MiB);
    segment_shape shape = shape_of(&fx, 0);
    CHECK_EQ(shape.segments, 1);
    CHECK_EQ(shape.blocks, 1);
    fixture_destroy(&fx);
}

static void test_small_split_needs_512_remainder(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    char *a = alloc_exact(&fx, 0, MiB);
    char *b = alloc_exact(&fx, 0, MiB - 512); /* leaves exactly 512 B: still split off */
    char *c = alloc_exact(&fx, 0, 512);
    CHECK_EQ((uintptr_t)b, (uintptr_t)a + MiB);
    CHECK_EQ((uintptr_t)c, (uintptr_t)a + 2 * MiB - 512);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current, 0);
    fixture_destroy(&fx);
}

static void test_large_split_rules(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 3 * MiB); /* < 10 MiB: a 20 MiB segment, split */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 20 * MiB);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, 3 * MiB);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_LARGE].current, 17 * MiB);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);

    /* A remainder of exactly 1 MiB is not split off: the whole block goes. */
    p = alloc_exact(&fx, 0, 19 * MiB);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, 20 * MiB);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_LARGE].current, 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);

    /* More than 1 MiB left: split. */
    p = alloc_exact(&fx, 0, 18 * MiB + 512 * KiB);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, 18 * MiB + 512 * KiB);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_LARGE].current, 1536 * KiB);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);

    /* >= 10 MiB: a segment of the request rounded to 2 MiB, nothing to split. */
    p = alloc_exact(&fx, 0, 21 * MiB + 1);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 20 * MiB + 22 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, 2);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

static void test_large_merge_three_way(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *a = alloc_exact(&fx, 0, 2 * MiB);
    void *b = alloc_exact(&fx, 0, 2 * MiB);
    void *c = alloc_exact(&fx, 0, 2 * MiB);
    CHECK_EQ((uintptr_t)b, (uintptr_t)a + 2 * MiB);
    CHECK_EQ((uintptr_t)c, (uintptr_t)b + 2 * MiB);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, c, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(shape_of(&fx, 0).blocks, 3); /* a | b | c+tail */
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    segment_shape shape = shape_of(&fx, 0);
    CHECK_EQ(shape.blocks, 1);
    CHECK_EQ(shape.inactive_bytes, 20 * MiB);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

static void test_best_fit_by_size_then_address(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p12 = alloc_exact(&fx, 0, 12 * MiB);
    void *p14a = alloc_exact(&fx, 0, 14 * MiB);
    void *p16 = alloc_exact(&fx, 0, 16 * MiB);
    void *p14b = alloc_exact(&fx, 0, 14 * MiB);
    void *all[] = {p12, p14a, p16, p14b};
    for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, all[i], 0, NULL), NPA_FREE_OK);
    long calls = fx.fake.raw_malloc_calls;
    void *q = alloc_exact(&fx, 0, 13 * MiB);
    CHECK_EQ((uintptr_t)q, (uintptr_t)(p14a < p14b ? p14a : p14b)); /* smallest fit, then lowest address */
    void *r = alloc_exact(&fx, 0, 13 * MiB);
    CHECK_EQ((uintptr_t)r, (uintptr_t)(p14a < p14b ? p14b : p14a));
    CHECK_EQ(fx.fake.raw_malloc_calls, calls); /* both were cache hits */
    CHECK_EQ(stats_of(&fx, 0).num_cache_hits, 2);
    fixture_destroy(&fx);
}

static void test_oversize_rules(void) {
    npa_config c;
    npa_config_defaults(&c);
    c.max_split_size = 40 * MiB;
    fixture fx;
    fixture_init(&fx, GiB, &c);
    void *big = alloc_exact(&fx, 0, 100 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.oversize_allocations.current, 1);
    CHECK_EQ(s.oversize_segments.current, 1);
    CHECK_EQ(s.max_split_size, 40 * MiB);
    CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).oversize_allocations.current, 0);

    /* Below max_split: never a block >= max_split. */
    void *small = alloc_exact(&fx, 0, 30 * MiB);
    CHECK(small != big);
    CHECK_EQ(fx.fake.raw_malloc_calls, 2);
    /* At or above max_split: only a block within max_non_split_rounding (20 MiB). */
    void *mid = alloc_exact(&fx, 0, 70 * MiB);
    CHECK(mid != big);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3);
    void *fits = alloc_exact(&fx, 0, 90 * MiB);
    CHECK(fits == big);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_LARGE].current, 30 * MiB + 70 * MiB + 100 * MiB); /* unsplit */
    CHECK_EQ(s.oversize_allocations.current, 2);
    CHECK_EQ(s.oversize_segments.current, 2);
    fixture_destroy(&fx);
}

static void test_alignment(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    size_t sizes[] = {1, 31, 33, 100, 511, 513, 4097, 65536 + 7, MiB - 1, MiB + 1, 5 * MiB + 3, 11 * MiB + 9};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        void *p = NULL;
        CHECK_EQ(npa_malloc(fx.a, 0, sizes[i], NPA_ENTRY_MALLOC, &p), NPA_OK);
        CHECK(((uintptr_t)p & 511) == 0);
    }
    fixture_destroy(&fx);
}

static void test_invalid_params(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = (void *)1;
    CHECK_EQ(npa_malloc(fx.a, 0, 0, NPA_ENTRY_MALLOC, &p), NPA_ERR_INVALID_PARAM);
    CHECK(p == NULL);
    CHECK_EQ(npa_malloc(fx.a, 0, 16, NPA_ENTRY_MALLOC, NULL), NPA_ERR_INVALID_PARAM);
    CHECK_EQ(npa_malloc(fx.a, NPUALLOC_MAX_DEVICES, 16, NPA_ENTRY_MALLOC, &p), NPA_ERR_INVALID_PARAM);
    CHECK_EQ(npa_malloc(fx.a, -1, 16, NPA_ENTRY_MALLOC, &p), NPA_ERR_INVALID_PARAM);
    CHECK_EQ(fx.fake.raw_malloc_calls, 0);
    /* The size contract is applied: 1 byte through aclrtMalloc is a 512 B block. */
    CHECK_EQ(npa_malloc(fx.a, 0, 1, NPA_ENTRY_MALLOC, &p), NPA_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 512);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(s.in_use, 1);
    fixture_destroy(&fx);
}

static void test_devices_are_separate(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p0 = alloc_exact(&fx, 0, 4096);
    void *p3 = alloc_exact(&fx, 3, 4096);
    CHECK_EQ(fake_used(&fx.fake, 0), 2 * MiB);
    CHECK_EQ(fake_used(&fx.fake, 3), 2 * MiB);
    CHECK_EQ(stats_of(&fx, 1).in_use, 0); /* never touched */
    int device = -1;
    CHECK_EQ(npa_free(fx.a, p3, 0, &device), NPA_FREE_OK); /* wrong hint: still found */
    CHECK_EQ(device, 3);
    CHECK_EQ(stats_of(&fx, 3).allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 1);
    /* Device 0 needs a second small segment although device 3's is cached. */
    alloc_exact(&fx, 0, MiB);
    alloc_exact(&fx, 0, MiB);
    CHECK_EQ(fake_used(&fx.fake, 0), 4 * MiB);
    CHECK_EQ(fake_used(&fx.fake, 3), 2 * MiB);
    CHECK_EQ(npa_free(fx.a, p0, 0, &device), NPA_FREE_OK);
    CHECK_EQ(device, 0);
    fixture_destroy(&fx);
}

static void test_invalid_and_foreign_frees(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    char *p = alloc_exact(&fx, 0, 4096);
    char *q = alloc_exact(&fx, 0, 4096);
    npualloc_device_stats before = stats_of(&fx, 0);
    CHECK_EQ(npa_free(fx.a, p + 512, 0, NULL), NPA_FREE_INVALID); /* interior */
    CHECK_EQ(npa_free(fx.a, q + 8192, 0, NULL), NPA_FREE_INVALID); /* inside the cached tail */
    npualloc_device_stats after = stats_of(&fx, 0);
    CHECK_EQ(after.num_invalid_frees, 2);
    CHECK_EQ(after.allocated_bytes[NPUALLOC_POOL_ALL].current, before.allocated_bytes[NPUALLOC_POOL_ALL].current);
    CHECK_EQ(after.allocation[NPUALLOC_POOL_ALL].freed, 0);

    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_INVALID); /* double free */
    after = stats_of(&fx, 0);
    CHECK_EQ(after.num_invalid_frees, 3);
    CHECK_EQ(after.allocation[NPUALLOC_POOL_ALL].current, 1);

    int foreign;
    CHECK_EQ(npa_free(fx.a, &foreign, 0, NULL), NPA_FREE_NOT_OURS);
    CHECK_EQ(npa_free(fx.a, NULL, 0, NULL), NPA_FREE_NOT_OURS);
    CHECK_EQ(npa_free(fx.a, p - 1, 5, NULL), NPA_FREE_NOT_OURS); /* just below the segment, bad hint */
    CHECK_EQ(stats_of(&fx, 0).num_foreign_frees, 1); /* NULL and unknown hints count nowhere */
    CHECK_EQ(fx.fake.raw_free_calls, 0);
    fixture_destroy(&fx);
}

static void test_empty_cache(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *small = alloc_exact(&fx, 0, 4096);
    void *large_a = alloc_exact(&fx, 0, 12 * MiB);
    void *large_b = alloc_exact(&fx, 0, 3 * MiB);
    void *large_c = alloc_exact(&fx, 0, 3 * MiB); /* shares large_b's segment */
    CHECK_EQ(npa_free(fx.a, large_a, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, large_b, 0, NULL), NPA_FREE_OK);
    npa_empty_cache(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 1); /* only the whole 12 MiB segment could go */
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB + 20 * MiB);
    CHECK_EQ(s.num_device_free, 1);
    CHECK_EQ(s.segment[NPUALLOC_POOL_LARGE].freed, 1);

    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, large_c, 0, NULL), NPA_FREE_OK);
    npa_empty_cache(fx.a, -1);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.largest_free_block, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    /* Each call synchronized first: aclrtFree does not wait for queued work. */
    CHECK_EQ(fx.fake.sync_calls, 2);
    fixture_destroy(&fx);
}

typedef struct visit_log {
    int segments;
    npa_segment_view first;
    npa_block_view blocks[8];
    size_t block_count;
} visit_log;

static void record_segment(const npa_segment_view *v, void *arg) {
    visit_log *log = arg;
    if (log->segments++ == 0) {
        log->first = *v;
        log->block_count = v->block_count < 8 ? v->block_count : 8;
        memcpy(log->blocks, v->blocks, log->block_count * sizeof *v->blocks);
    }
}

static void test_snapshot_blocks_in_address_order(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p1 = alloc_exact(&fx, 0, 1000);
    void *p2 = alloc_exact(&fx, 0, 3000);
    CHECK_EQ(npa_free(fx.a, p1, 0, NULL), NPA_FREE_OK);
    visit_log log = {0};
    npa_visit_segments(fx.a, 0, record_segment, &log);
    CHECK_EQ(log.segments, 1);
    CHECK_EQ(log.first.is_small, 1);
    CHECK_EQ(log.first.total_size, 2 * MiB);
    CHECK_EQ(log.first.allocated_size, 3072);
    CHECK_EQ(log.first.active_size, 3072);
    CHECK_EQ(log.first.requested_size, 3000);
    CHECK_EQ(log.block_count, 3);
    CHECK_EQ(log.blocks[0].address, (uintptr_t)p1);
    CHECK_EQ(log.blocks[0].state, NPA_BLOCK_INACTIVE);
    CHECK_EQ(log.blocks[1].address, (uintptr_t)p2);
    CHECK_EQ(log.blocks[1].state, NPA_BLOCK_ACTIVE_ALLOCATED);
    CHECK_EQ(log.blocks[1].requested_size, 3000);
    CHECK_EQ(log.blocks[2].address, (uintptr_t)p2 + 3072);
    CHECK_EQ(log.blocks[0].size + log.blocks[1].size + log.blocks[2].size, 2 * MiB);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_small_split_and_merge);
    RUN(test_small_split_needs_512_remainder);
    RUN(test_large_split_rules);
    RUN(test_large_merge_three_way);
    RUN(test_best_fit_by_size_then_address);
    RUN(test_oversize_rules);
    RUN(test_alignment);
    RUN(test_invalid_params);
    RUN(test_devices_are_separate);
    RUN(test_invalid_and_foreign_frees);
    RUN(test_empty_cache);
    RUN(test_snapshot_blocks_in_address_order);
    return check_report();
}
