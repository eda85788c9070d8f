/* Shared fixture for the core's unit tests: an allocator over a fake device,
 * plus helpers that read stats and segment shapes. Header-only so CHECK
 * counts in the including test. */
#ifndef NPUALLOC_TESTS_TEST_UTIL_H
#define NPUALLOC_TESTS_TEST_UTIL_H

#include <string.h>

#include "check.h"
#include "core.h"
#include "fake_backend.h"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)
#define GiB ((size_t)1 << 30)

typedef struct fixture {
    fake_backend fake;
    npa_allocator *a;
} fixture;

/* fake_init must precede setting fake options, so options go through this. */
static inline void fixture_start(fixture *fx, const npa_config *config) {
    npa_backend backend = fake_iface(&fx->fake);
    fx->a = npa_create(&backend, config);
    CHECK(fx->a != NULL);
}

static inline void fixture_init(fixture *fx, size_t capacity, const npa_config *config) {
    fake_init(&fx->fake, capacity, false);
    fixture_start(fx, config);
}

/* A runtime with fences whose reuse policy answers, at each free, that no
 * fence is needed now (eager): over 1 GiB, default config. */
static inline void fixture_init_fenced_but_eager(fixture *fx) {
    fake_init(&fx->fake, GiB, false);
    fx->fake.fences = true;
    fx->fake.answers_fence_needed = true;
    fake_set_eager(&fx->fake, true);
    fixture_start(fx, NULL);
}

static inline void fixture_destroy(fixture *fx) {
    npa_destroy(fx->a);
    CHECK_EQ(fx->fake.calls_in_stats_section, 0);
    fake_destroy(&fx->fake);
}

static inline void *alloc_exact(fixture *fx, int device, size_t size) {
    void *p = NULL;
    npa_error err = npa_malloc(fx->a, device, size, NPA_ENTRY_EXACT, &p);
    CHECK_EQ(err, NPA_OK);
    return p;
}

/* torch's rule, every free merged at once (the recent cache off), for the
 * tests of merging itself. */
static inline npa_config merge_at_free_config(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.recent_blocks = 0;
    return config;
}

static inline void check_stat(npualloc_stat st, int64_t current, int64_t peak, int64_t allocated, int64_t freed) {
    CHECK_EQ(st.current, current);
    CHECK_EQ(st.peak, peak);
    CHECK_EQ(st.allocated, allocated);
    CHECK_EQ(st.freed, freed);
}

static inline npualloc_device_stats stats_of(fixture *fx, int device) {
    npualloc_device_stats s;
    npa_get_stats(fx->a, device, &s);
    return s;
}

typedef struct segment_shape {
    size_t segments, blocks, inactive_bytes, pending_blocks;
} segment_shape;

static inline void count_shape(const npa_segment_view *v, void *arg) {
    segment_shape *shape = arg;
    shape->segments++;
    shape->blocks += v->block_count;
    for (size_t i = 0; i < v->block_count; i++) {
        if (v->blocks[i].state == NPA_BLOCK_INACTIVE) shape->inactive_bytes += v->blocks[i].size;
        if (v->blocks[i].state == NPA_BLOCK_ACTIVE_PENDING_FREE) shape->pending_blocks++;
    }
}

static inline segment_shape shape_of(fixture *fx, int device) {
    segment_shape shape;
    memset(&shape, 0, sizeof shape);
    npa_visit_segments(fx->a, device, count_shape, &shape);
    return shape;
}

/* What a device's blocks say (npa_visit_segments, plain segments), per pool
 * (NPUALLOC_POOL_*, [ALL] the sum of the two), to hold its stats against: an
 * inactive block is split when its segment has other blocks; active bytes
 * include pending frees, allocated bytes do not; largest_free is the biggest
 * inactive block. */
typedef struct block_totals {
    long long segments[NPUALLOC_POOL_COUNT], reserved_bytes[NPUALLOC_POOL_COUNT];
    long long allocated_blocks[NPUALLOC_POOL_COUNT];
    long long allocated_bytes[NPUALLOC_POOL_COUNT], active_bytes[NPUALLOC_POOL_COUNT];
    long long requested_bytes[NPUALLOC_POOL_COUNT];
    long long inactive_split[NPUALLOC_POOL_COUNT], inactive_split_bytes[NPUALLOC_POOL_COUNT];
    long long largest_free;
} block_totals;

static inline void add_to_pool(long long *stat, int pool, long long value) {
    stat[NPUALLOC_POOL_ALL] += value;
    stat[pool] += value;
}

static inline void add_segment(const npa_segment_view *v, void *arg) {
    block_totals *t = arg;
    int pool = v->is_small ? NPUALLOC_POOL_SMALL : NPUALLOC_POOL_LARGE;
    add_to_pool(t->segments, pool, 1);
    add_to_pool(t->reserved_bytes, pool, (long long)v->total_size);
    for (size_t i = 0; i < v->block_count; i++) {
        const npa_block_view *b = &v->blocks[i];
        if (b->state == NPA_BLOCK_INACTIVE) {
            if (v->block_count > 1) {
                add_to_pool(t->inactive_split, pool, 1);
                add_to_pool(t->inactive_split_bytes, pool, (long long)b->size);
            }
            if ((long long)b->size > t->largest_free) t->largest_free = (long long)b->size;
        } else {
            add_to_pool(t->active_bytes, pool, (long long)b->size);
            add_to_pool(t->requested_bytes, pool, (long long)b->requested_size);
            if (b->state == NPA_BLOCK_ACTIVE_ALLOCATED) {
                add_to_pool(t->allocated_blocks, pool, 1);
                add_to_pool(t->allocated_bytes, pool, (long long)b->size);
            }
        }
    }
}

static inline block_totals blocks_of(fixture *fx, int device) {
    block_totals t;
    memset(&t, 0, sizeof t);
    npa_visit_segments(fx->a, device, add_segment, &t);
    return t;
}

#endif
