/* Expandable segments over the fake device's virtual memory: growth by
 * pages at the end of a pool's reserved range, a second range when the
 * first has only holes, merging with the free
 * block there, reuse, best fit that spares the growable block, unmapping of
 * free pages by empty_cache and by the OOM retry (each after one counted
 * synchronize; a page whose release is refused stays mapped), torch's
 * stats, frees inside the reserved range, snapshot
 * views and trace events, plain segments when the backend has no VMM, and
 * expandable_segments switched at run time (pools holding both kinds).
 *
 * Device of 100 MiB: a range is 1 1/8 of it in whole pages, so the large
 * pool reserves ceil(112.5 / 20) = 6 pages of 20 MiB, the small pool
 * ceil(112.5 / 2) = 57 pages of 2 MiB. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

#define LARGE_RANGE (6 * 20 * MiB)

static void expandable_init(fixture *fx, size_t capacity, bool host_memory) {
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    fake_init(&fx->fake, capacity, host_memory);
    fx->fake.vmm = true;
    fixture_start(fx, &config);
}

static void free_ok(fixture *fx, void *p) { CHECK_EQ(npa_free(fx->a, p, 0, NULL), NPA_FREE_OK); }

/* The views of one visit, blocks of the first one kept. */
typedef struct view_log {
    size_t segments;
    npa_segment_view first;
    npa_block_view blocks[8];
} view_log;

static void log_view(const npa_segment_view *v, void *arg) {
    view_log *log = arg;
    if (log->segments++ == 0) {
        log->first = *v;
        size_t n = v->block_count < 8 ? v->block_count : 8;
        memcpy(log->blocks, v->blocks, n * sizeof *v->blocks);
    }
}

static view_log views_of(fixture *fx) {
    view_log log;
    memset(&log, 0, sizeof log);
    npa_visit_segments(fx->a, 0, log_view, &log);
    return log;
}

static void count_expandable(const npa_segment_view *v, void *arg) { *(size_t *)arg += v->is_expandable != 0; }

static void test_growth_by_pages_merges_with_tail(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, true);
    /* 5 MiB maps one 20 MiB page at the start of the large range. */
    char *a = alloc_exact(&fx, 0, 5 * MiB);
    CHECK_EQ(fx.fake.va_reserves, 1);
    CHECK_EQ(fx.fake.page_maps, 1);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 20 * MiB);
    CHECK_EQ(s.num_device_alloc, 1);
    CHECK_EQ(s.num_cache_misses, 1);

    /* 30 MiB: the 15 MiB free tail plus one more page, so it starts right
     * after a instead of in a segment of its own. */
    char *b = alloc_exact(&fx, 0, 30 * MiB);
    CHECK(b == a + 5 * MiB);
    CHECK_EQ(fx.fake.page_maps, 2);
    memset(a, 0xa5, 5 * MiB);
    memset(b, 0x5a, 30 * MiB); /* crosses the page boundary at 20 MiB */
    CHECK(a[5 * MiB - 1] == (char)0xa5 && b[0] == 0x5a && b[30 * MiB - 1] == 0x5a);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 40 * MiB);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 35 * MiB);
    CHECK_EQ(s.num_device_alloc, 2);
    /* torch counts no segment and no inactive split for expandable segments. */
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 40 * MiB);

    /* Reuse: a's block comes back without a map. */
    free_ok(&fx, a);
    char *again = alloc_exact(&fx, 0, 5 * MiB);
    CHECK(again == a);
    CHECK_EQ(fx.fake.page_maps, 2);
    CHECK_EQ(stats_of(&fx, 0).num_cache_hits, 1);

    /* The snapshot shows the mapped part only, as one expandable segment. */
    view_log log = views_of(&fx);
    CHECK_EQ(log.segments, 1);
    CHECK_EQ(log.first.is_expandable, 1);
    CHECK_EQ(log.first.is_small, 0);
    CHECK_EQ(log.first.address, (uintptr_t)a);
    CHECK_EQ(log.first.total_size, 40 * MiB);
    CHECK_EQ(log.first.allocated_size, 35 * MiB);
    CHECK_EQ(log.first.block_count, 3);
    CHECK_EQ(log.blocks[2].size, 5 * MiB);
    CHECK_EQ(log.blocks[2].state, NPA_BLOCK_INACTIVE);

    free_ok(&fx, again);
    free_ok(&fx, b);
    npa_empty_cache(fx.a, 0);
    fixture_destroy(&fx);
}

static void test_small_pool_pages(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, false);
    char *p = alloc_exact(&fx, 0, 1000);
    char *q = alloc_exact(&fx, 0, 1 * MiB);
    CHECK(q == p + 1024); /* small blocks split at any 512-byte multiple */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_SMALL].current, 2 * MiB);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 0);
    /* 1 MiB more needs the next page; the free 1023 KiB tail joins it. */
    char *r = alloc_exact(&fx, 0, 1 * MiB);
    CHECK(r == q + MiB);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_SMALL].current, 4 * MiB);
    free_ok(&fx, p);
    free_ok(&fx, q);
    free_ok(&fx, r);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

/* torch's best fit ranks the block before unmapped space by how far it can
 * grow, so an equally fitting block elsewhere is taken first. */
static void test_best_fit_spares_growable_block(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, false);
    char *a = alloc_exact(&fx, 0, 4 * MiB);
    char *b = alloc_exact(&fx, 0, 8 * MiB);
    char *c = alloc_exact(&fx, 0, 2 * MiB);
    CHECK(b == a + 4 * MiB && c == b + 8 * MiB); /* the free tail is 14..20 MiB */
    free_ok(&fx, b);
    char *d = alloc_exact(&fx, 0, 5 * MiB); /* 6 MiB tail and 8 MiB hole both fit */
    CHECK(d == b);
    free_ok(&fx, a);
    free_ok(&fx, c);
    free_ok(&fx, d);
    fixture_destroy(&fx);
}

static void test_empty_cache_unmaps_free_pages(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, true);
    char *a = alloc_exact(&fx, 0, 5 * MiB);
    char *b = alloc_exact(&fx, 0, 30 * MiB);
    /* Nothing to unmap: no synchronize, though counted as torch counts its
     * release's synchronize_and_free_events (with no event to wait for). */
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(fx.fake.page_unmaps, 0);
    CHECK_EQ(stats_of(&fx, 0).num_sync_all_streams, 1);

    /* b's 30 MiB and the 5 MiB tail merge into 5..40 MiB: only the page at
     * 20..40 is whole, the first page keeps a. */
    free_ok(&fx, b);
    npa_empty_cache(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(s.num_sync_all_streams, 2);
    CHECK_EQ(fx.fake.page_unmaps, 1);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 20 * MiB);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].peak, 40 * MiB);
    CHECK_EQ(s.num_device_free, 1);
    CHECK_EQ(fake_used(&fx.fake, 0), 20 * MiB);
    CHECK(a[0] == 0 && a[5 * MiB - 1] == 0); /* a's page stayed mapped */
    view_log log = views_of(&fx);
    CHECK_EQ(log.segments, 1);
    CHECK_EQ(log.first.total_size, 20 * MiB);
    CHECK_EQ(log.first.block_count, 2);
    CHECK_EQ(log.blocks[1].size, 15 * MiB);

    /* Growing again fills from the free block: 35 MiB lands where b was. */
    char *c = alloc_exact(&fx, 0, 35 * MiB);
    CHECK(c == b);
    CHECK_EQ(stats_of(&fx, 0).num_device_alloc, 3);
    free_ok(&fx, c);

    /* All free: every page goes and so does the range. */
    free_ok(&fx, a);
    npa_empty_cache(fx.a, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.num_device_alloc, 3);
    CHECK_EQ(s.num_device_free, 3);
    CHECK_EQ(s.num_sync_all_streams, 3);
    CHECK_EQ(fx.fake.va_releases, 1);
    CHECK_EQ(fx.fake.page_count, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(views_of(&fx).segments, 0);
    /* The next allocation reserves a new range. */
    free_ok(&fx, alloc_exact(&fx, 0, 5 * MiB));
    CHECK_EQ(fx.fake.va_reserves, 2);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* A page the runtime refuses to release stays mapped, counted and free:
 * the hole ends before it, and the pages come back to use and go later. */
static void test_a_page_whose_release_is_refused_stays_mapped(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, true);
    char *a = alloc_exact(&fx, 0, 50 * MiB); /* three 20 MiB pages */
    free_ok(&fx, a);
    fx.fake.fail_after_unmaps = 1;           /* the first page goes, the second is refused */
    fx.fake.fail_next_unmaps = 1;
    npa_empty_cache(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 40 * MiB);
    CHECK_EQ(s.num_device_free, 1);
    CHECK_EQ(fake_used(&fx.fake, 0), 40 * MiB);
    CHECK(strstr(fx.fake.last_warning, "stays mapped") != NULL);
    long maps = fx.fake.page_maps;
    char *b = alloc_exact(&fx, 0, 50 * MiB);  /* the first page mapped again, joined to the two still there */
    CHECK(b == a);
    CHECK_EQ(fx.fake.page_maps, maps + 1);
    memset(b, 1, 50 * MiB);                  /* every page really mapped (an unmapped one would fault) */
    free_ok(&fx, b);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fx.fake.page_count, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* A map that fails part way undoes the pages it mapped; one whose release
 * the runtime refuses stays mapped inside the unmapped block, counted by no
 * stat. Releasing the range with it would lose the page for good: the range
 * goes only once that page has gone too, tried again at each release. */
static void test_a_page_left_by_a_failed_map_is_released_before_its_range(void) {
    for (int refusals = 1; refusals <= 2; refusals++) {
        fixture fx;
        expandable_init(&fx, 30 * MiB, false);
        fx.fake.fail_next_unmaps = refusals; /* the undo, then the OOM retry's release */
        void *p = NULL;
        /* Two 20 MiB pages: the second does not fit, the first is undone. */
        CHECK_EQ(npa_malloc(fx.a, 0, 30 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
        CHECK_EQ(fx.fake.fail_next_unmaps, 0);
        CHECK_EQ(fx.fake.page_count, 0);
        CHECK_EQ(fake_used(&fx.fake, 0), 0);
        CHECK_EQ(fx.fake.va_releases, refusals == 1 ? 1 : 0); /* a refused page keeps its range */
        npa_empty_cache(fx.a, 0);
        CHECK_EQ(fx.fake.va_releases, fx.fake.va_reserves);
        CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(fx.fake.bad_frees, 0);
        fixture_destroy(&fx);
    }
}

/* The small pool's free pages are what the large pool needs: the OOM retry
 * synchronizes, unmaps them and maps again. */
static void test_oom_retry_unmaps_free_pages(void) {
    fixture fx;
    expandable_init(&fx, 60 * MiB, false);
    void *small[20];
    for (int i = 0; i < 20; i++) small[i] = alloc_exact(&fx, 0, 1 * MiB); /* two per 2 MiB page */
    for (int i = 0; i < 20; i++) free_ok(&fx, small[i]);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_SMALL].current, 20 * MiB);

    /* 50 MiB needs three 20 MiB pages; the third does not fit beside the
     * small pool's 20 MiB, so the first two are undone, then the retry. */
    void *big = alloc_exact(&fx, 0, 50 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_sync_all_streams, 1);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 60 * MiB);
    CHECK_EQ(fx.fake.page_maps, 10 + 3 + 3);
    CHECK_EQ(fx.fake.page_unmaps, 2 + 10);
    CHECK_EQ(s.num_device_alloc, 10 + 3); /* pages undone within a failed map are not counted */
    CHECK_EQ(s.num_device_free, 10);
    /* The small range, all unmapped, and the large one, left empty by the
     * failed map, went back; the retry reserved the large one again. */
    CHECK_EQ(fx.fake.va_releases, 2);
    CHECK_EQ(fx.fake.va_reserves, 3);
    free_ok(&fx, big);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    fixture_destroy(&fx);
}

static void test_frees_inside_the_range(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, false);
    char *a = alloc_exact(&fx, 0, 5 * MiB);
    CHECK_EQ(npa_free(fx.a, a + 512, 0, NULL), NPA_FREE_INVALID);          /* interior */
    CHECK_EQ(npa_free(fx.a, a + 6 * MiB, 0, NULL), NPA_FREE_INVALID);      /* free, mapped */
    CHECK_EQ(npa_free(fx.a, a + 50 * MiB, 0, NULL), NPA_FREE_INVALID);     /* reserved, unmapped */
    CHECK_EQ(npa_free(fx.a, a + LARGE_RANGE - 1, 0, NULL), NPA_FREE_INVALID);
    CHECK_EQ(npa_free(fx.a, a + LARGE_RANGE, 0, NULL), NPA_FREE_NOT_OURS); /* past the range */
    free_ok(&fx, a);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_INVALID); /* double free */
    CHECK_EQ(stats_of(&fx, 0).num_invalid_frees, 5);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_NOT_OURS); /* the range is gone */
    fixture_destroy(&fx);
}

typedef struct trace_log {
    size_t count;
    npa_trace_view entries[16];
} trace_log;

static void log_trace(const npa_trace_view *e, void *arg) {
    trace_log *log = arg;
    if (log->count < 16) log->entries[log->count] = *e;
    log->count++;
}

static void test_trace_records_map_and_unmap(void) {
    fixture fx;
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    config.record_history = 16;
    fake_init(&fx.fake, 100 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, &config);
    char *a = alloc_exact(&fx, 0, 25 * MiB);
    free_ok(&fx, a);
    npa_empty_cache(fx.a, 0);
    trace_log log = {0};
    npa_visit_trace(fx.a, 0, log_trace, &log);
    /* map, alloc, free_requested, free_completed, unmap: no segment_alloc/free */
    CHECK_EQ(log.count, 5);
    CHECK_EQ(log.entries[0].action, NPA_TRACE_SEGMENT_MAP);
    CHECK_EQ(log.entries[0].addr, (uintptr_t)a);
    CHECK_EQ(log.entries[0].size, 40 * MiB);
    CHECK_EQ(log.entries[1].action, NPA_TRACE_ALLOC);
    CHECK_EQ(log.entries[4].action, NPA_TRACE_SEGMENT_UNMAP);
    CHECK_EQ(log.entries[4].addr, (uintptr_t)a);
    CHECK_EQ(log.entries[4].size, 40 * MiB);
    fixture_destroy(&fx);
}

static size_t expandable_views(fixture *fx) {
    size_t expandable = 0;
    npa_visit_segments(fx->a, 0, count_expandable, &expandable);
    return expandable;
}

static bool config_says_expandable(fixture *fx) {
    char text[512];
    npa_config_format(npa_get_config(fx->a), text, sizeof text);
    return strstr(text, "expandable_segments:True") != NULL;
}

/* expandable_segments at run time: a pool grown plain, then switched on,
 * grows by pages while its plain segment stays; switched off again, it grows
 * plain segments and leaves the mapped space it has be (torch), until on
 * again. Stats stay exact across both switches, and empty_cache gives back
 * both kinds. Device of 200 MiB. */
static void test_switched_at_run_time(void) {
    fixture fx;
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, NULL);
    CHECK(!npa_get_config(fx.a)->expandable_segments);
    char *a = alloc_exact(&fx, 0, 5 * MiB); /* a plain 20 MiB segment */
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(fx.fake.va_reserves, 0);

    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    CHECK(npa_get_config(fx.a)->expandable_segments);
    CHECK(config_says_expandable(&fx));
    /* 30 MiB fits neither the plain segment's 15 MiB tail nor anything
     * else: the pool reserves its range and maps two 20 MiB pages. */
    char *b = alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(fx.fake.va_reserves, 1);
    CHECK_EQ(fx.fake.page_maps, 2);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_LARGE].current, 60 * MiB);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 1); /* torch counts the plain one only */
    CHECK_EQ(s.num_device_alloc, 3);

    CHECK_EQ(npa_set_expandable_segments(fx.a, false), 0);
    CHECK(!config_says_expandable(&fx));
    /* Off: 30 MiB fits neither free tail (15 MiB plain, 10 MiB mapped), and
     * the range is not grown: a new plain segment. */
    char *c = alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, 2);
    CHECK_EQ(fx.fake.page_maps, 2);
    /* The mapped space already there stays the pool's but is left be while
     * off, as torch's get_free_block: b's 30 MiB and the 10 MiB after it
     * would serve 35 MiB; a new plain segment (36 MiB) does. */
    free_ok(&fx, b);
    char *d = alloc_exact(&fx, 0, 35 * MiB);
    CHECK(d != b);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3);
    CHECK_EQ(fx.fake.page_maps, 2);
    /* On again: the expandable block serves the next 35 MiB. */
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    char *e = alloc_exact(&fx, 0, 35 * MiB);
    CHECK(e == b);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3);
    CHECK_EQ(fx.fake.page_maps, 2);

    s = stats_of(&fx, 0);
    check_stat(s.reserved_bytes[NPUALLOC_POOL_ALL], 126 * MiB, 126 * MiB, 126 * MiB, 0);
    /* d's 36 MiB block is not split: 1 MiB is left, not more than the small-pool limit. */
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 106 * MiB, 106 * MiB, 136 * MiB, 30 * MiB);
    check_stat(s.segment[NPUALLOC_POOL_ALL], 3, 3, 3, 0);
    CHECK_EQ(s.num_device_alloc, 5);
    CHECK_EQ(s.num_cache_misses, 4);
    CHECK_EQ(s.num_cache_hits, 1);
    CHECK_EQ(shape_of(&fx, 0).segments, 4);
    CHECK_EQ(expandable_views(&fx), 1);

    free_ok(&fx, a);
    free_ok(&fx, c);
    free_ok(&fx, d);
    free_ok(&fx, e);
    npa_empty_cache(fx.a, 0);
    s = stats_of(&fx, 0);
    check_stat(s.reserved_bytes[NPUALLOC_POOL_ALL], 0, 126 * MiB, 126 * MiB, 126 * MiB);
    check_stat(s.segment[NPUALLOC_POOL_ALL], 0, 3, 3, 3);
    CHECK_EQ(s.num_device_free, 5);
    CHECK_EQ(fx.fake.raw_free_calls, 3);
    CHECK_EQ(fx.fake.page_unmaps, 2);
    CHECK_EQ(fx.fake.va_releases, 1);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* The OOM retry over a pool that holds both kinds: the cached plain segment
 * is freed and the free page unmapped, then the range maps what the request
 * needs. Device of 60 MiB. */
static void test_oom_retry_over_both_kinds(void) {
    fixture fx;
    fake_init(&fx.fake, 60 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, NULL);
    free_ok(&fx, alloc_exact(&fx, 0, 5 * MiB)); /* a cached plain 20 MiB segment */
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    void *big = alloc_exact(&fx, 0, 25 * MiB);  /* two pages: 60 MiB in use */
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    free_ok(&fx, big);
    /* 50 MiB: the range's 40 MiB free plus a third page, which the plain
     * segment's 20 MiB leaves no room for: the retry frees it, and unmaps
     * the free pages on the way. */
    big = alloc_exact(&fx, 0, 50 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 60 * MiB);
    CHECK_EQ(s.num_device_alloc - s.num_device_free, 3); /* the three pages mapped now */
    CHECK_EQ(fake_used(&fx.fake, 0), 60 * MiB);
    free_ok(&fx, big);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* torch_npu's rule, both ways round, and a backend without VMM: each refusal
 * warns and changes nothing. */
static void test_switch_refused(void) {
    fixture fx;
    npa_config config;
    npa_config_defaults(&config);
    config.max_split_size = 64 * MiB;
    fake_init(&fx.fake, 100 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, &config);
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), -1);
    CHECK(strstr(fx.fake.last_warning, "max_split_size_mb") != NULL);
    CHECK(!npa_get_config(fx.a)->expandable_segments);
    free_ok(&fx, alloc_exact(&fx, 0, 5 * MiB));
    CHECK_EQ(fx.fake.va_reserves, 0);
    fixture_destroy(&fx);

    fake_init(&fx.fake, 100 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, NULL);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.5), 0);
    long warnings = fx.fake.warnings;
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), -1);
    CHECK_EQ(fx.fake.warnings, warnings + 1);
    CHECK(strstr(fx.fake.last_warning, "garbage_collection_threshold") != NULL);
    CHECK(!npa_get_config(fx.a)->expandable_segments);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.0), 0);
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    /* The other way round: no threshold while expandable segments are on. */
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.5), -1);
    CHECK_EQ(fx.fake.warnings, warnings + 2);
    CHECK(npa_get_config(fx.a)->garbage_collection_threshold == 0.0);
    CHECK(npa_get_config(fx.a)->expandable_segments);
    free_ok(&fx, alloc_exact(&fx, 0, 5 * MiB));
    CHECK_EQ(fx.fake.va_reserves, 1);
    npa_empty_cache(fx.a, 0);
    fixture_destroy(&fx);

    fixture_init(&fx, 100 * MiB, NULL); /* no VMM */
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), -1);
    CHECK(strstr(fx.fake.last_warning, "virtual memory") != NULL);
    CHECK(!npa_get_config(fx.a)->expandable_segments);
    CHECK_EQ(npa_set_expandable_segments(fx.a, false), 0);
    fixture_destroy(&fx);
}

/* No VMM in the backend: expandable_segments asks in vain, plain segments,
 * and the config in force says so. */
static void test_without_vmm_plain_segments(void) {
    fixture fx;
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    fixture_init(&fx, 100 * MiB, &config);
    CHECK(!npa_get_config(fx.a)->expandable_segments);
    void *a = alloc_exact(&fx, 0, 5 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(fx.fake.va_reserves, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 20 * MiB);
    CHECK_EQ(views_of(&fx).first.is_expandable, 0);
    free_ok(&fx, a);
    fixture_destroy(&fx);
}

/* torch's should_split asks the setting in force, not the block's
 * segment: once expandable_segments is on, a plain 20 MiB block serving
 * 19.5 MiB is split, its 512 KiB tail an inactive split block. */
static void test_split_rule_follows_the_setting(void) {
    fixture fx;
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, NULL);
    char *a = alloc_exact(&fx, 0, 3 * MiB); /* a plain 20 MiB segment */
    free_ok(&fx, a);
    CHECK_EQ(npa_set_expandable_segments(fx.a, true), 0);
    char *b = alloc_exact(&fx, 0, 20 * MiB - 512 * KiB);
    CHECK(b == a);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 20 * MiB - 512 * KiB);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, 512 * KiB);
    free_ok(&fx, b);
    fixture_destroy(&fx);
}

/* torch checks the per-process cap before growing, on the request's
 * allocation size, not on the pages it maps (a differential audit against a
 * model of torch's expandable segments). 200 MiB device. */
static void test_cap_checked_on_the_request_as_torch(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    config.per_process_memory_fraction = 0.5; /* 100 MiB */
    fixture fx;
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, &config);
    alloc_exact(&fx, 0, 70 * MiB); /* four 20 MiB pages mapped */
    void *p = NULL;
    /* 80 MiB mapped + 26 MiB asked > 100, though one more page would fit */
    CHECK_EQ(npa_malloc(fx.a, 0, 25 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 80 * MiB);
    fixture_destroy(&fx);

    config.per_process_memory_fraction = 0.45; /* 90 MiB */
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, &config);
    alloc_exact(&fx, 0, 80 * MiB);
    /* 80 + 10 <= 90: admitted, and the page it maps takes reserved past the cap */
    CHECK_EQ(npa_malloc(fx.a, 0, 10 * MiB, NPA_ENTRY_EXACT, &p), NPA_OK);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 100 * MiB);
    fixture_destroy(&fx);
}

/* A range is sized by the cap in force when it is reserved: one reserved
 * under a cap of 20 MiB (two 20 MiB pages) cannot hold what a raised cap
 * allows, and the pool then reserves another, sized by the new cap, as
 * torch does when none of its ranges has room. 200 MiB device. */
static void test_a_raised_cap_grows_past_the_first_range(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    config.per_process_memory_fraction = 0.1;
    fixture fx;
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fixture_start(&fx, &config);
    alloc_exact(&fx, 0, 15 * MiB);
    void *p = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 15 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
    CHECK_EQ(fx.fake.va_reserves, 1);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 0, 1.0), 0);
    alloc_exact(&fx, 0, 150 * MiB); /* more than the first range's 40 MiB */
    CHECK_EQ(fx.fake.va_reserves, 2);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 180 * MiB);
    CHECK_EQ(stats_of(&fx, 0).num_ooms, 1);
    fixture_destroy(&fx);
}

/* A device made while the runtime could not tell its size has nothing to
 * size a range by: its first growth asks again, and gets its range, rather
 * than giving the pool up to plain segments for good. */
static void test_a_range_once_the_device_can_tell_its_size(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = true;
    fixture fx;
    fake_init(&fx.fake, 200 * MiB, false);
    fx.fake.vmm = true;
    fx.fake.fail_next_mem_infos = 1;
    fixture_start(&fx, &config);
    alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(fx.fake.va_reserves, 1);
    CHECK_EQ(fx.fake.raw_malloc_calls, 0);
    CHECK_EQ(stats_of(&fx, 0).device_total_bytes, 200 * MiB);
    fixture_destroy(&fx);
}

/* torch's find_expandable_block reserves another range for a pool when no
 * unmapped stretch of its ranges has room: with 40 MiB of the device free
 * but the first range's free space in 20 MiB holes, a 40 MiB request is
 * served from a second range, without an OOM retry. */
static void test_a_second_range_when_the_first_has_only_holes(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, false);
    char *page[5];
    for (int i = 0; i < 5; i++) page[i] = alloc_exact(&fx, 0, 20 * MiB); /* pages 0-4 of 6 */
    free_ok(&fx, page[1]);
    free_ok(&fx, page[3]);
    npa_empty_cache(fx.a, 0); /* unmaps pages 1 and 3: holes of 20 MiB at 1, 3 and 5 */
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 60 * MiB);

    char *big = alloc_exact(&fx, 0, 40 * MiB);
    uintptr_t first_base = (uintptr_t)page[0];
    CHECK((uintptr_t)big < first_base || (uintptr_t)big >= first_base + LARGE_RANGE);
    CHECK_EQ(fx.fake.va_reserves, 2);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 0);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 100 * MiB);
    size_t ranges = 0;
    npa_visit_segments(fx.a, 0, count_expandable, &ranges);
    CHECK_EQ(ranges, 4); /* mapped runs: pages 0, 2 and 4 of the first range, the second's first two */

    for (int i = 0; i < 5; i += 2) free_ok(&fx, page[i]);
    free_ok(&fx, big);
    npa_empty_cache(fx.a, 0);
    CHECK_EQ(fx.fake.va_releases, 2);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    fixture_destroy(&fx);
}

/* A request larger than a whole range fits in no range: the one reserved
 * to look goes back at once, so the failed request leaves none behind. */
static void test_no_range_kept_for_a_request_larger_than_one(void) {
    fixture fx;
    expandable_init(&fx, 100 * MiB, false);
    void *p = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, LARGE_RANGE + 20 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
    CHECK(fx.fake.va_reserves > 0);
    CHECK_EQ(fx.fake.va_releases, fx.fake.va_reserves);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_growth_by_pages_merges_with_tail);
    RUN(test_small_pool_pages);
    RUN(test_best_fit_spares_growable_block);
    RUN(test_empty_cache_unmaps_free_pages);
    RUN(test_a_page_whose_release_is_refused_stays_mapped);
    RUN(test_a_page_left_by_a_failed_map_is_released_before_its_range);
    RUN(test_oom_retry_unmaps_free_pages);
    RUN(test_frees_inside_the_range);
    RUN(test_trace_records_map_and_unmap);
    RUN(test_switched_at_run_time);
    RUN(test_split_rule_follows_the_setting);
    RUN(test_cap_checked_on_the_request_as_torch);
    RUN(test_a_raised_cap_grows_past_the_first_range);
    RUN(test_a_range_once_the_device_can_tell_its_size);
    RUN(test_a_second_range_when_the_first_has_only_holes);
    RUN(test_no_range_kept_for_a_request_larger_than_one);
    RUN(test_oom_retry_over_both_kinds);
    RUN(test_switch_refused);
    RUN(test_without_vmm_plain_segments);
    return check_report();
}
