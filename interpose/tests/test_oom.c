/* The malloc path after a miss: the OOM retry sequence with its counters,
 * the oversize release step, failure injection, the per-process cap, the
 * OOM report line, and age-based GC. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

/* Runs a malloc with stderr captured into out (the report line). */
/* One malloc; its OOM report (empty when it made none). */
static npa_error malloc_reporting(fixture *fx, size_t size, char *out, size_t out_len) {
    long reports = fx->fake.oom_reports;
    void *p = (void *)1;
    npa_error err = npa_malloc(fx->a, 0, size, NPA_ENTRY_EXACT, &p);
    CHECK(err == NPA_OK || p == NULL);
    CHECK(fx->fake.oom_reports - reports <= 1);
    snprintf(out, out_len, "%s", fx->fake.oom_reports > reports ? fx->fake.last_oom_report : "");
    return err;
}

static int count_char(const char *s, char c) {
    int n = 0;
    for (; *s; s++) n += *s == c;
    return n;
}

static void test_oom_sequence(void) {
    fixture fx;
    fixture_init(&fx, 20 * MiB, NULL);
    void *p12 = alloc_exact(&fx, 0, 12 * MiB);
    CHECK_EQ(npa_free(fx.a, p12, 0, NULL), NPA_FREE_OK);
    /* 14 MiB does not fit beside the cached 12 MiB: step 6 empties the cache. */
    void *p14 = alloc_exact(&fx, 0, 14 * MiB);
    CHECK(p14 != NULL);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(s.num_sync_all_streams, 1);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3); /* 12, 14 refused, 14 */
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK_EQ(s.num_device_alloc, 2);
    CHECK_EQ(s.num_device_free, 1);

    /* Nothing left to free: every step runs, then 207001 and one line. */
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 10 * MiB, line, sizeof line), NPA_ERR_OOM);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 1);
    CHECK_EQ(s.num_alloc_retries, 2);
    CHECK_EQ(s.num_sync_all_streams, 2);
    CHECK_EQ(fx.fake.raw_malloc_calls, 5);
    CHECK(strncmp(line, "out of memory on device 0: ", 27) == 0);
    CHECK_EQ(count_char(line, '\n'), 0); /* one line: the hook adds the prefix and the newline */
    CHECK(strstr(line, "requested 10485760 bytes") != NULL);
    CHECK(strstr(line, "allocated 14680064 bytes") != NULL);
    CHECK(strstr(line, "reserved 14680064 bytes") != NULL);
    CHECK(strstr(line, "device free 6291456 of 20971520 bytes") != NULL);
    CHECK(strstr(line, "the device itself is full") != NULL);
    CHECK(s.device_free_bytes == 6 * MiB);
    fixture_destroy(&fx);
}

/* A full device whose freed blocks still wait for their fence (a stream's
 * work was queued): the OOM retry synchronizes and hands them back, and the
 * malloc then finds its block among them instead of failing. */
static void test_the_oom_retry_looks_again_among_the_frees_it_drained(void) {
    fixture fx;
    fake_init(&fx.fake, 20 * MiB, false);
    fx.fake.fences = true; /* reuse_policy safe: a plain free waits for its fence */
    fixture_start(&fx, NULL);
    void *blocks[4];
    for (int i = 0; i < 4; i++) blocks[i] = alloc_exact(&fx, 0, 4 * MiB); /* one 20 MiB segment, 4 MiB left */
    CHECK_EQ(npa_free(fx.a, blocks[3], 0, NULL), NPA_FREE_OK);             /* pending, beside the 4 MiB left */
    void *p = alloc_exact(&fx, 0, 8 * MiB);
    CHECK(p == blocks[3]);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3); /* the segment, then the two refused growths around the retry */
    CHECK_EQ(s.num_pending_frees, 0);
    fixture_destroy(&fx);
}

static void test_oom_hints_fragmentation(void) {
    fixture fx;
    fixture_init(&fx, 20 * MiB, NULL);
    /* Two 2 MiB blocks hold one 20 MiB segment; freeing the first leaves
     * 18 MiB reserved but unallocated that no retry can give back. */
    void *a = alloc_exact(&fx, 0, 2 * MiB);
    alloc_exact(&fx, 0, 2 * MiB);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 17 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK(strstr(line, "max_split_size_mb") != NULL);
    CHECK(strstr(line, "per_process_memory_fraction") == NULL);
    fixture_destroy(&fx);
}

static void test_oversize_release_step(void) {
    npa_config c;
    npa_config_defaults(&c);
    c.max_split_size = 20 * MiB;
    fixture fx;
    fixture_init(&fx, 100 * MiB, &c);
    void *p30 = alloc_exact(&fx, 0, 30 * MiB);
    void *p40 = alloc_exact(&fx, 0, 40 * MiB);
    CHECK_EQ(npa_free(fx.a, p30, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p40, 0, NULL), NPA_FREE_OK);
    /* No cached block fits 50 MiB and the device lacks room: step 5 frees
     * the largest oversize blocks (40, then 30) and the retry succeeds
     * without any synchronize. */
    alloc_exact(&fx, 0, 50 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(s.num_alloc_retries, 0);
    CHECK_EQ(s.oversize_segments.current, 1);
    fixture_destroy(&fx);

    /* One cached oversize block big enough (but refused by the rounding
     * rule) is released on its own. */
    fixture_init(&fx, 80 * MiB, &c);
    void *p60 = alloc_exact(&fx, 0, 60 * MiB);
    void *p8 = alloc_exact(&fx, 0, 8 * MiB); /* a 20 MiB segment that must stay */
    CHECK_EQ(npa_free(fx.a, p60, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p8, 0, NULL), NPA_FREE_OK);
    alloc_exact(&fx, 0, 30 * MiB); /* 60 >= 30 + 20: not reusable; no room for 30 */
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 50 * MiB);
    fixture_destroy(&fx);
}

/* A request no emptying could serve says so, not that the device is full. */
static void test_hint_for_a_request_larger_than_the_device(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 120 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK(strstr(line, "the request is larger than the whole device") != NULL);
    CHECK(strstr(line, "itself is full") == NULL);
    fixture_destroy(&fx);
}

/* A request no pool can hold (above NPA_MAX_REQUEST, which malloc_on tells
 * apart before the lock by its rounded size): out of memory, reported and
 * counted, with no call to the runtime and no block. */
static void test_a_request_no_pool_can_hold_is_out_of_memory(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    const size_t sizes[] = {((size_t)1 << 60) + 1, (size_t)1 << 62, SIZE_MAX};
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        char line[1024];
        CHECK_EQ(malloc_reporting(&fx, sizes[i], line, sizeof line), NPA_ERR_OOM);
        CHECK(strstr(line, "out of memory") != NULL);
    }
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 3);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fx.fake.raw_malloc_calls, 0);
    fixture_destroy(&fx);
}

static void test_failure_injection_retries_once(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    fx.fake.fail_next_mallocs = 1;
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK(p != NULL);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_sync_all_streams, 1);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(s.num_cache_misses, 1);
    CHECK_EQ(fx.fake.raw_malloc_failures, 1);

    fx.fake.fail_next_mallocs = 2; /* both the first try and the retry fail */
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 4 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK_EQ(stats_of(&fx, 0).num_ooms, 1);
    CHECK(strstr(line, "the device refused the allocation though it reports that much free") != NULL);
    CHECK(strstr(line, "itself is full") == NULL); /* with a GiB free */
    fixture_destroy(&fx);
}

/* A runtime that fails for another reason than memory (a device lost, ACL
 * finalized by another thread meanwhile) gets no retry, no synchronize and
 * no OOM report: the malloc returns its error, as torch raises it; plain
 * segments and expandable ones alike. */
static void runtime_errors_are_not_out_of_memory(bool expandable) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.vmm = true;
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = expandable;
    fixture_start(&fx, &config);
    fx.fake.fail_next_mallocs = 1;
    fx.fake.fail_malloc_error = 507899; /* ACL_ERROR_RT_INTERNAL_ERROR */
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 4 * MiB, line, sizeof line), 507899);
    CHECK_EQ(line[0], '\0');
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(s.num_alloc_retries, 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK(alloc_exact(&fx, 0, 4 * MiB) != NULL); /* the next one is served */
    fixture_destroy(&fx);
}

static void test_runtime_errors_are_not_out_of_memory(void) {
    runtime_errors_are_not_out_of_memory(false);
    runtime_errors_are_not_out_of_memory(true);
}

static void test_fraction_cap(void) {
    npa_config c;
    npa_config_defaults(&c);
    c.per_process_memory_fraction = 0.5;
    fixture fx;
    fixture_init(&fx, 100 * MiB, &c);
    void *p40 = alloc_exact(&fx, 0, 40 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_limit_bytes, 50 * MiB);
    CHECK_EQ(s.device_total_bytes, 100 * MiB);

    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 20 * MiB, line, sizeof line), NPA_ERR_OOM);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 1);
    CHECK_EQ(s.num_alloc_retries, 1); /* the cap goes through the retry path first */
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1); /* the device was never asked past the cap */
    CHECK(strstr(line, "per_process_memory_fraction") != NULL);
    CHECK(strstr(line, "cap 52428800 bytes") != NULL);

    /* The retry's emptied cache makes room under the cap. */
    CHECK_EQ(npa_free(fx.a, p40, 0, NULL), NPA_FREE_OK);
    void *p46 = alloc_exact(&fx, 0, 46 * MiB);
    CHECK(p46 != NULL);
    CHECK_EQ(stats_of(&fx, 0).num_alloc_retries, 2);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 46 * MiB);
    fixture_destroy(&fx);
}

/* issue 11 item 7: a fraction whose cap is below the smallest segment
 * (1e-12 of 64 GiB rounds to 0 bytes, 1e-9 to 68) is refused with a
 * warning, as a bad value is: the default (no cap) is kept, never a cap of
 * "0 = none" picked silently. The smallest cap that can hold a segment is
 * kept. */
static void test_fraction_below_smallest_segment_is_refused(void) {
    const double refused[] = {1e-12, 1e-9, 1.9 / 65536.0}; /* 0 B, 68 B, 1.9 MiB of 64 GiB */
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++) {
        npa_config c;
        npa_config_defaults(&c);
        c.per_process_memory_fraction = refused[i];
        fixture fx;
        fixture_init(&fx, 64 * GiB, &c);
        alloc_exact(&fx, 0, 100 * MiB);
        npualloc_device_stats s = stats_of(&fx, 0);
        CHECK_EQ(s.reserved_limit_bytes, 0);
        CHECK_EQ(fx.fake.warnings, 1);
        CHECK(strstr(fx.fake.last_warning, "per_process_memory_fraction") != NULL);
        CHECK(strstr(fx.fake.last_warning, "refused there: device 0 runs without a cap") != NULL);
        fixture_destroy(&fx);
    }
    npa_config c;
    npa_config_defaults(&c);
    c.per_process_memory_fraction = 2.0 / 65536.0; /* exactly 2 MiB of 64 GiB */
    fixture fx;
    fixture_init(&fx, 64 * GiB, &c);
    void *p = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 1 * MiB, NPA_ENTRY_EXACT, &p), NPA_OK); /* one small segment fits */
    CHECK_EQ(stats_of(&fx, 0).reserved_limit_bytes, 2 * MiB);
    CHECK_EQ(fx.fake.warnings, 0);
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 3 * MiB, line, sizeof line), NPA_ERR_OOM);
    fixture_destroy(&fx);
}

/* torch's set_per_process_memory_fraction at run time, 100 MiB device: a
 * cap lowered under what is reserved refuses the next growth (the device is
 * never asked) while the cached blocks keep serving; raised again, growth
 * works; the stat follows; refused values change nothing. */
static void test_fraction_set_at_run_time(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    alloc_exact(&fx, 0, 40 * MiB);
    void *cached = alloc_exact(&fx, 0, 20 * MiB);
    CHECK_EQ(npa_free(fx.a, cached, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 0, 0.3), 0);
    const int64_t cap = (int64_t)(0.3 * (double)(100 * MiB));
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_limit_bytes, cap);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 60 * MiB); /* above the cap, and kept */

    CHECK(alloc_exact(&fx, 0, 20 * MiB) == cached); /* the cache serves past the cap */
    CHECK_EQ(npa_free(fx.a, cached, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(fx.fake.raw_malloc_calls, 2);

    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 30 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK_EQ(fx.fake.raw_malloc_calls, 2); /* refused by the cap, not by the device */
    CHECK(strstr(line, "per-process cap 31457280 bytes") != NULL);
    CHECK(strstr(line, "raise per_process_memory_fraction") != NULL);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_ooms, 1);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 40 * MiB); /* the retry gave the cache back */

    /* Outside [0, 1], NaN, a cap below the smallest segment (0 and 1e-9 of
     * 100 MiB), a bad device: refused, the cap as it was. */
    const double refused[] = {-0.1, 1.5, NAN, 0.0, 1e-9, 1.9 / 100.0};
    for (size_t i = 0; i < sizeof refused / sizeof *refused; i++)
        CHECK_EQ(npa_set_memory_fraction(fx.a, 0, refused[i]), -1);
    CHECK_EQ(npa_set_memory_fraction(fx.a, -1, 0.5), -1);
    CHECK_EQ(npa_set_memory_fraction(fx.a, NPUALLOC_MAX_DEVICES, 0.5), -1);
    CHECK_EQ(npa_set_memory_fraction(NULL, 0, 0.5), -1);
    CHECK_EQ(stats_of(&fx, 0).reserved_limit_bytes, cap);
    CHECK_EQ(malloc_reporting(&fx, 30 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK_EQ(fx.fake.warnings, 0); /* refusals are the caller's to report */

    CHECK_EQ(npa_set_memory_fraction(fx.a, 0, 1.0), 0); /* no cap, as the config's default */
    CHECK_EQ(stats_of(&fx, 0).reserved_limit_bytes, 0);
    alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 0, 0.9), 0); /* 70 reserved + 20 <= 90 */
    CHECK_EQ(stats_of(&fx, 0).reserved_limit_bytes, (int64_t)(0.9 * (double)(100 * MiB)));
    alloc_exact(&fx, 0, 20 * MiB);
    CHECK_EQ(fx.fake.raw_malloc_calls, 4);
    fixture_destroy(&fx);
}

/* A 100 MiB device under config fraction 0.5 whose runtime fails the next
 * failing_queries mem_get_info calls: the device is then made without a
 * size. */
static void start_sized_late(fixture *fx, int failing_queries) {
    npa_config c;
    npa_config_defaults(&c);
    c.per_process_memory_fraction = 0.5;
    fake_init(&fx->fake, 100 * MiB, false);
    fx->fake.fail_next_mem_infos = failing_queries;
    fixture_start(fx, &c);
}

/* A device made while the runtime could not tell its size (its first
 * mem_get_info failed) takes the config's cap at the first sample that can,
 * the one after its first growth: it ran uncapped for good before. 100 MiB
 * device, fraction 0.5. */
static void test_a_device_sized_late_takes_the_configs_cap(void) {
    fixture fx;
    start_sized_late(&fx, 1);
    alloc_exact(&fx, 0, 40 * MiB);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.device_total_bytes, 100 * MiB);
    CHECK_EQ(s.reserved_limit_bytes, 50 * MiB);
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 20 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK(strstr(line, "per-process cap 52428800 bytes") != NULL);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1); /* refused by the cap, not by the device */
    CHECK_EQ(fx.fake.warnings, 0);
    fixture_destroy(&fx);
}

/* A run-time fraction on a device made while the runtime could not tell
 * its size: the call asks again, so the fraction applies once the runtime
 * can tell (it was refused as a cap below 2 MiB), and while it cannot, every
 * fraction is refused, 1.0 too: a "no cap" taken then gave way to the
 * config's cap at the next sample. 100 MiB device, config fraction 0.5;
 * each device is made by a first allocation whose two askings (at its
 * creation, after its growth) fail. */
static void test_fraction_set_on_a_device_sized_late(void) {
    fixture fx;
    start_sized_late(&fx, 2);
    alloc_exact(&fx, 0, 30 * MiB);
    CHECK_EQ(stats_of(&fx, 0).device_total_bytes, 0);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 0, 0.3), 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_limit_bytes, (int64_t)(0.3 * (double)(100 * MiB)));
    CHECK_EQ(s.device_total_bytes, 100 * MiB);

    fx.fake.fail_next_mem_infos = 3; /* device 1, and the call's asking again */
    alloc_exact(&fx, 1, 30 * MiB);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 1, 1.0), -1);
    alloc_exact(&fx, 1, 30 * MiB); /* its growth samples: the size, and the config's cap */
    CHECK_EQ(stats_of(&fx, 1).reserved_limit_bytes, 50 * MiB);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 1, 1.0), 0);
    CHECK_EQ(stats_of(&fx, 1).reserved_limit_bytes, 0);
    alloc_exact(&fx, 1, 30 * MiB);
    CHECK_EQ(stats_of(&fx, 1).reserved_limit_bytes, 0);
    CHECK_EQ(fx.fake.warnings, 0);
    fixture_destroy(&fx);
}

/* A device nothing allocated on yet is created with its cap, as torch's
 * per-device allocator has one from the start. */
static void test_fraction_set_before_the_device_is_used(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    /* Refused, it sets nothing up: no device stats, no region slot in use. */
    CHECK_EQ(npa_set_memory_fraction(fx.a, 1, 1e-9), -1);
    fx.fake.fail_next_mem_infos = 1;
    CHECK_EQ(npa_set_memory_fraction(fx.a, 1, 0.5), -1);
    CHECK_EQ(stats_of(&fx, 1).in_use, 0);
    CHECK_EQ(npa_set_memory_fraction(fx.a, 1, 0.5), 0);
    npualloc_device_stats s = stats_of(&fx, 1);
    CHECK_EQ(s.reserved_limit_bytes, 50 * MiB);
    CHECK_EQ(s.device_total_bytes, 100 * MiB);
    alloc_exact(&fx, 1, 40 * MiB);
    char line[1024];
    void *p = NULL;
    CHECK_EQ(npa_malloc(fx.a, 1, 20 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
    CHECK_EQ(stats_of(&fx, 0).reserved_limit_bytes, 0); /* per device: device 0 has none */
    CHECK_EQ(malloc_reporting(&fx, 60 * MiB, line, sizeof line), NPA_OK);
    fixture_destroy(&fx);
}

/* Four cached large segments with ages A 7, B 4, C 2, E 1 pool searches at
 * the moment the next miss runs GC; returns their addresses in that order. */
static void build_aged_cache(fixture *fx, void *out[4]) {
    void *a = alloc_exact(fx, 0, 12 * MiB);
    void *b = alloc_exact(fx, 0, 14 * MiB);
    void *c = alloc_exact(fx, 0, 16 * MiB);
    void *e = alloc_exact(fx, 0, 18 * MiB);
    CHECK_EQ(npa_free(fx->a, e, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx->a, a, 0, NULL), NPA_FREE_OK);
    /* Each cycle is one large-pool search that hits e and re-caches it. */
    for (int cycle = 0; cycle < 6; cycle++) {
        void *again = alloc_exact(fx, 0, 18 * MiB);
        CHECK(again == e);
        CHECK_EQ(npa_free(fx->a, again, 0, NULL), NPA_FREE_OK);
        if (cycle == 2) CHECK_EQ(npa_free(fx->a, b, 0, NULL), NPA_FREE_OK);
        if (cycle == 4) CHECK_EQ(npa_free(fx->a, c, 0, NULL), NPA_FREE_OK);
    }
    out[0] = a;
    out[1] = b;
    out[2] = c;
    out[3] = e;
}

typedef struct cached_set {
    uintptr_t addrs[8];
    int count;
} cached_set;

static void note_segment(const npa_segment_view *v, void *arg) {
    cached_set *set = arg;
    if (set->count < 8) set->addrs[set->count++] = v->address;
}

static bool still_cached(fixture *fx, void *p) {
    cached_set set = {.count = 0};
    npa_visit_segments(fx->a, 0, note_segment, &set);
    for (int i = 0; i < set.count; i++)
        if (set.addrs[i] == (uintptr_t)p) return true;
    return false;
}

static void test_gc_frees_oldest_first_and_stops(void) {
    npa_config c;
    npa_config_defaults(&c);
    /* 200 MiB device, 0.25: GC once reserved > 50 MiB. Reserved is 60:
     * target 10 MiB. Average age 3.5 frees A (7) and B (4) in one pass. */
    c.garbage_collection_threshold = 0.25;
    fixture fx;
    fixture_init(&fx, 200 * MiB, &c);
    void *blocks[4];
    build_aged_cache(&fx, blocks);
    CHECK_EQ(fx.fake.raw_free_calls, 0); /* no GC while the pool still hit */
    alloc_exact(&fx, 0, 20 * MiB);      /* a miss: GC runs first */
    CHECK(!still_cached(&fx, blocks[0]));
    CHECK(!still_cached(&fx, blocks[1]));
    CHECK(still_cached(&fx, blocks[2]));
    CHECK(still_cached(&fx, blocks[3]));
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    CHECK_EQ(fx.fake.sync_calls, 0); /* GC never synchronizes */
    CHECK_EQ(stats_of(&fx, 0).num_sync_all_streams, 0);
    fixture_destroy(&fx);

    /* 0.1: limit 20 MiB, target 40 MiB. Pass 1 frees A, B (26 MiB); pass 2
     * (average of C and E: 1.5) frees C, reaching 42: E stays. */
    c.garbage_collection_threshold = 0.1;
    fixture_init(&fx, 200 * MiB, &c);
    build_aged_cache(&fx, blocks);
    alloc_exact(&fx, 0, 20 * MiB);
    CHECK(!still_cached(&fx, blocks[2]));
    CHECK(still_cached(&fx, blocks[3]));
    CHECK_EQ(fx.fake.raw_free_calls, 3);
    CHECK_EQ(fx.fake.sync_calls, 0);
    fixture_destroy(&fx);

    /* Off (the default): nothing is collected. */
    fixture_init(&fx, 200 * MiB, NULL);
    build_aged_cache(&fx, blocks);
    alloc_exact(&fx, 0, 20 * MiB);
    CHECK_EQ(fx.fake.raw_free_calls, 0);
    fixture_destroy(&fx);
}

static void test_gc_frees_blocks_of_exactly_average_age(void) {
    npa_config c;
    npa_config_defaults(&c);
    c.garbage_collection_threshold = 0.2; /* limit 40 MiB of 200; 44 reserved: target 4 MiB */
    fixture fx;
    fixture_init(&fx, 200 * MiB, &c);
    void *a = alloc_exact(&fx, 0, 12 * MiB);
    void *b = alloc_exact(&fx, 0, 14 * MiB);
    void *e = alloc_exact(&fx, 0, 18 * MiB);
    CHECK_EQ(npa_free(fx.a, e, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    for (int cycle = 0; cycle < 2; cycle++) {
        CHECK(alloc_exact(&fx, 0, 18 * MiB) == e);
        CHECK_EQ(npa_free(fx.a, e, 0, NULL), NPA_FREE_OK);
        if (cycle == 0) CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    }
    /* At the miss: ages A 3, B 2, E 1; the average is 2, and B goes too
     * although A alone would have met the target. */
    alloc_exact(&fx, 0, 20 * MiB);
    CHECK(!still_cached(&fx, a));
    CHECK(!still_cached(&fx, b));
    CHECK(still_cached(&fx, e));
    fixture_destroy(&fx);
}

static void test_gc_threshold_set_at_run_time(void) {
    fixture fx;
    fixture_init(&fx, 200 * MiB, NULL);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 1.5), -1);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.25), 0);
    CHECK(npa_get_config(fx.a)->garbage_collection_threshold == 0.25);
    void *blocks[4];
    build_aged_cache(&fx, blocks);
    alloc_exact(&fx, 0, 20 * MiB);
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    fixture_destroy(&fx);
}

/* torch's GC clock counts pool searches only while a threshold is set:
 * blocks cached before it was set are all of one age, so they go together.
 * Counting every search made the older one alone go (A: aged by the 30 MiB
 * search), and the 18 MiB request then took a segment of its own. */
static void test_blocks_cached_before_the_threshold_are_of_one_age(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    void *a = alloc_exact(&fx, 0, 16 * MiB);
    void *b = alloc_exact(&fx, 0, 16 * MiB);
    alloc_exact(&fx, 0, 16 * MiB);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    alloc_exact(&fx, 0, 30 * MiB); /* a search that finds nothing, GC off */
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.65), 0); /* limit 65 MiB; 78 reserved */
    alloc_exact(&fx, 0, 18 * MiB);
    CHECK(!still_cached(&fx, a));
    CHECK(!still_cached(&fx, b));
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 64 * MiB);
    fixture_destroy(&fx);
}

/* torch handles the frees whose events completed before its one search of
 * a malloc (process_events, then get_free_block). A miss here fences the
 * frees still open and looks again: B, freed before this malloc on an idle
 * device, is as old as A, cached just before it, and the malloc counts one
 * search. Counted twice, with B handed back between the two, A read 2 and
 * B 1: the average (1.5) kept B, where torch's (1) frees both. */
static void test_a_miss_that_looks_again_counts_one_search(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fx.fake.auto_complete_polls = 1; /* the device is idle: a fence is done once asked */
    npa_config c;
    npa_config_defaults(&c);
    c.garbage_collection_threshold = 0.9; /* the clock runs; nothing to collect below 921 MiB */
    fixture_start(&fx, &c);
    void *a = alloc_exact(&fx, 0, 12 * MiB);
    void *b = alloc_exact(&fx, 0, 12 * MiB);
    alloc_exact(&fx, 0, 200 * MiB); /* B alone does not fill a batch (a sixteenth of 224 MiB) */
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* A is cached */
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK); /* B waits for its fence, unasked */
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.21), 0); /* limit 215 MiB; 224 reserved */
    alloc_exact(&fx, 0, 30 * MiB);
    CHECK(!still_cached(&fx, a));
    CHECK(!still_cached(&fx, b));
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    fixture_destroy(&fx);
}

/* torch's malloc searches its pool once (get_free_block) and, after the OOM
 * retry, asks the device only; npualloc looks in the pool once more there,
 * a look torch has no search for, so it must not tick the GC clock. A has
 * been cached since before an OOM (one whose synchronize failed, so the
 * retry kept the cache), P since after it, and one hit of E came between
 * them: torch's ages at the next miss are A 3, P 2, E 1, average 2, and A
 * and P go in one pass. Counted, the look made A 4: the average (7/3) kept
 * P, A alone met the target, and P stayed cached. */
static void test_the_look_after_the_oom_retry_is_no_gc_search(void) {
    fixture fx;
    fixture_init(&fx, 100 * MiB, NULL);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.9), 0); /* the clock runs; nothing to collect below 90 MiB */
    void *a = alloc_exact(&fx, 0, 12 * MiB);
    void *p = alloc_exact(&fx, 0, 14 * MiB);
    void *e = alloc_exact(&fx, 0, 18 * MiB);
    CHECK_EQ(npa_free(fx.a, a, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, e, 0, NULL), NPA_FREE_OK);
    fx.fake.fail_next_syncs = 1;
    char line[1024];
    CHECK_EQ(malloc_reporting(&fx, 80 * MiB, line, sizeof line), NPA_ERR_OOM);
    CHECK_EQ(stats_of(&fx, 0).num_alloc_retries, 1);
    CHECK(still_cached(&fx, a)); /* the retry could not synchronize: the cache stayed */
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK(alloc_exact(&fx, 0, 18 * MiB) == e);
    CHECK_EQ(npa_free(fx.a, e, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_set_gc_threshold(fx.a, 0.35), 0); /* limit 35 MiB; 44 reserved: target 9 */
    alloc_exact(&fx, 0, 30 * MiB);
    CHECK(!still_cached(&fx, a));
    CHECK(!still_cached(&fx, p));
    CHECK(still_cached(&fx, e));
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_oom_sequence);
    RUN(test_the_oom_retry_looks_again_among_the_frees_it_drained);
    RUN(test_oom_hints_fragmentation);
    RUN(test_oversize_release_step);
    RUN(test_failure_injection_retries_once);
    RUN(test_hint_for_a_request_larger_than_the_device);
    RUN(test_a_request_no_pool_can_hold_is_out_of_memory);
    RUN(test_runtime_errors_are_not_out_of_memory);
    RUN(test_fraction_cap);
    RUN(test_fraction_below_smallest_segment_is_refused);
    RUN(test_fraction_set_at_run_time);
    RUN(test_fraction_set_before_the_device_is_used);
    RUN(test_a_device_sized_late_takes_the_configs_cap);
    RUN(test_fraction_set_on_a_device_sized_late);
    RUN(test_gc_frees_oldest_first_and_stops);
    RUN(test_gc_frees_blocks_of_exactly_average_age);
    RUN(test_gc_threshold_set_at_run_time);
    RUN(test_blocks_cached_before_the_threshold_are_of_one_age);
    RUN(test_a_miss_that_looks_again_counts_one_search);
    RUN(test_the_look_after_the_oom_retry_is_no_gc_search);
    return check_report();
}
