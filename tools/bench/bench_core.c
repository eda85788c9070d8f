/* Micro-benchmark of the allocator core's hit path: one npa_malloc + npa_free
 * of a cached size, single-threaded, over a no-op backend with no fences
 * (eager reuse). Prints the median, p10 and p90 of per-pair time over many
 * batches. Not a test: timings depend on the machine. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "core.h"

static uintptr_t next_fake_addr = (uintptr_t)1 << 44;

static npa_error bump_malloc(void *ctx, int device, size_t size, void **ptr) {
    (void)ctx, (void)device;
    *ptr = (void *)next_fake_addr;
    next_fake_addr += (size + ((size_t)2 << 20)) & ~(((size_t)2 << 20) - 1);
    return NPA_OK;
}
static npa_error noop_free(void *ctx, int device, void *ptr) { return (void)ctx, (void)device, (void)ptr, NPA_OK; }
static npa_error noop_sync(void *ctx, int device) { return (void)ctx, (void)device, NPA_OK; }
static npa_error fixed_info(void *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
    (void)ctx, (void)device;
    *free_bytes = *total_bytes = (size_t)64 << 30;
    return NPA_OK;
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int compare_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

#define BATCHES 200
#define PAIRS_PER_BATCH 20000

int main(void) {
    npa_backend backend = {.raw_malloc = bump_malloc, .raw_free = noop_free, .synchronize = noop_sync,
                           .mem_get_info = fixed_info};
    npa_allocator *a = npa_create(&backend, NULL);
    /* A realistic cache: a few dozen live blocks of mixed sizes around the
     * one being cycled, so the pool trees are not trivially small. */
    void *live[64];
    for (int i = 0; i < 64; i++) npa_malloc(a, 0, (size_t)(i + 1) * 3000, NPA_ENTRY_MALLOC, &live[i]);
    for (int i = 0; i < 64; i += 2) npa_free(a, live[i], 0, NULL);

    const size_t sizes[] = {4096, 200000, 3u << 20}; /* small split, small, large */
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        double per_pair[BATCHES];
        for (int b = 0; b < BATCHES; b++) {
            double start = now_ns();
            for (int i = 0; i < PAIRS_PER_BATCH; i++) {
                void *p;
                npa_malloc(a, 0, sizes[s], NPA_ENTRY_MALLOC, &p);
                npa_free(a, p, 0, NULL);
            }
            per_pair[b] = (now_ns() - start) / PAIRS_PER_BATCH;
        }
        qsort(per_pair, BATCHES, sizeof *per_pair, compare_double);
        printf("hit path malloc+free %8zu B: median %.1f ns  p10 %.1f ns  p90 %.1f ns\n", sizes[s],
               per_pair[BATCHES / 2], per_pair[BATCHES / 10], per_pair[BATCHES * 9 / 10]);
    }
    npualloc_device_stats stats;
    npa_get_stats(a, 0, &stats);
    printf("cache hits %lld, misses %lld\n", (long long)stats.num_cache_hits, (long long)stats.num_cache_misses);
    npa_destroy(a);
    return 0;
}
