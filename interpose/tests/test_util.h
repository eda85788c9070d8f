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

#endif
