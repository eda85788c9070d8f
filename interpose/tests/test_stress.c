/* Stress: several threads on two devices allocate random sizes (1 B to
 * 64 MiB) from a fake device backed by real host memory (plain segments,
 * then expandable segments over host mappings, then both as one thread
 * switches expandable_segments at run time), fill each block with
 * its own pattern, check it before freeing, and register every live block so
 * an overlap between two live blocks is caught the moment it is handed out.
 * Frees go through fences that complete a little later (or, in one run,
 * need none, so small ones wait in the recent cache), and one thread also
 * empties caches, reads stats, walks segments and caps device 1 at a
 * quarter of it and lifts the cap again (set_per_process_memory_fraction)
 * while two others grow it meanwhile. Runs under
 * ASan and TSan (make ctest-asan / ctest-tsan); NPUALLOC_STRESS_OPS scales it. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

#define THREADS 4
#define DEVICES 2
#define SLOTS 16
#define DEFAULT_OPS 1200


typedef struct live_block {
    unsigned char *p;
    size_t size;
    uint64_t tag;
} live_block;

/* Every live block of every thread, for the overlap check. */
static struct {
    pthread_mutex_t lock;
    live_block blocks[THREADS * SLOTS];
    int count;
} registry = {.lock = PTHREAD_MUTEX_INITIALIZER};

static npa_allocator *allocator;
static int ops_per_thread;
/* Thread 0 switches expandable_segments every 100 operations: pools hold
 * both kinds of segment while other threads grow them. */
static bool switch_expandable;

typedef struct thread_result {
    long overlaps, corruptions, bad_frees, ooms, allocs;
} thread_result;

static bool register_block(live_block b) {
    bool overlap = false;
    pthread_mutex_lock(&registry.lock);
    for (int i = 0; i < registry.count; i++) {
        const live_block *o = &registry.blocks[i];
        if (b.p < o->p + o->size && o->p < b.p + b.size) overlap = true;
    }
    registry.blocks[registry.count++] = b;
    pthread_mutex_unlock(&registry.lock);
    return !overlap;
}

static void unregister_block(const unsigned char *p) {
    pthread_mutex_lock(&registry.lock);
    for (int i = 0; i < registry.count; i++) {
        if (registry.blocks[i].p == p) {
            registry.blocks[i] = registry.blocks[--registry.count];
            break;
        }
    }
    pthread_mutex_unlock(&registry.lock);
}

static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Log-uniform: mostly up to 1 MiB, one in twenty up to 64 MiB. */
static size_t random_size(uint64_t *state) {
    unsigned max_bits = next_random(state) % 20 == 0 ? 26 : 20;
    unsigned bits = (unsigned)(next_random(state) % (max_bits + 1));
    size_t base = (size_t)1 << bits;
    return base + next_random(state) % base;
}

static unsigned char pattern_byte(uint64_t tag) { return (unsigned char)(tag * 0x9e3779b97f4a7c15ULL >> 56); }

/* The tag at both ends, the pattern byte everywhere else. */
static void fill(const live_block *b) {
    memset(b->p, pattern_byte(b->tag), b->size);
    if (b->size >= 16) {
        memcpy(b->p, &b->tag, 8);
        memcpy(b->p + b->size - 8, &b->tag, 8);
    }
}

static bool intact(const live_block *b) {
    size_t from = 0, to = b->size;
    if (b->size >= 16) {
        if (memcmp(b->p, &b->tag, 8) != 0 || memcmp(b->p + b->size - 8, &b->tag, 8) != 0) return false;
        from = 8;
        to = b->size - 8;
    }
    if (from == to) return true;
    if (b->p[from] != pattern_byte(b->tag)) return false;
    /* Every byte equals its successor: all equal the first. */
    return memcmp(b->p + from, b->p + from + 1, to - from - 1) == 0;
}

typedef struct thread_arg {
    int index;
    thread_result result;
} thread_arg;

static void release_slot(live_block *slot, int device, uint64_t *rng, thread_result *r) {
    if (!intact(slot)) r->corruptions++;
    unregister_block(slot->p);
    /* Sometimes the wrong device as the hint: the block must still be found. */
    int hint = next_random(rng) % 4 == 0 ? (device + 1) % DEVICES : device;
    int owner = -1;
    if (npa_free(allocator, slot->p, hint, &owner) != NPA_FREE_OK || owner != device) r->bad_frees++;
    slot->p = NULL;
}

static void *worker(void *opaque) {
    thread_arg *arg = opaque;
    thread_result *r = &arg->result;
    int device = arg->index % DEVICES;
    uint64_t rng = 0x1234567ULL * (uint64_t)(arg->index + 1);
    live_block slots[SLOTS] = {0};
    for (int op = 0; op < ops_per_thread; op++) {
        live_block *slot = &slots[next_random(&rng) % SLOTS];
        if (slot->p) {
            release_slot(slot, device, &rng, r);
            continue;
        }
        size_t size = random_size(&rng);
        void *p = NULL;
        if (npa_malloc(allocator, device, size, NPA_ENTRY_MALLOC, &p) != NPA_OK) {
            r->ooms++;
            continue;
        }
        r->allocs++;
        *slot = (live_block){.p = p, .size = size, .tag = ((uint64_t)arg->index << 48) | (uint64_t)op};
        if (!register_block(*slot)) r->overlaps++;
        fill(slot);
        if (arg->index == 0 && op % 100 == 0) {
            if (switch_expandable) npa_set_expandable_segments(allocator, op / 100 % 2 == 0);
            CHECK_EQ(npa_set_memory_fraction(allocator, 1, op / 100 % 2 == 0 ? 0.25 : 1.0), 0);
            npa_empty_cache(allocator, -1);
            npualloc_device_stats s;
            npa_get_stats(allocator, 1, &s);
            if (s.allocated_bytes[NPUALLOC_POOL_ALL].current > s.reserved_bytes[NPUALLOC_POOL_ALL].current)
                r->corruptions++;
            segment_shape shape = {0};
            npa_visit_segments(allocator, -1, count_shape, &shape);
        }
    }
    for (int i = 0; i < SLOTS; i++)
        if (slots[i].p) release_slot(&slots[i], device, &rng, r);
    return NULL;
}

static void run_stress(bool expandable, bool fenced, size_t capacity) {
    const char *env = getenv("NPUALLOC_STRESS_OPS");
    ops_per_thread = env ? atoi(env) : DEFAULT_OPS;
    fake_backend fake;
    fake_init(&fake, capacity, true);
    fake.fences = fenced;
    fake.auto_complete_polls = 2; /* a fence completes at its second query */
    fake.vmm = expandable;
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = expandable;
    npa_backend backend = fake_iface(&fake);
    allocator = npa_create(&backend, &config);
    CHECK(allocator != NULL);

    pthread_t threads[THREADS];
    thread_arg args[THREADS];
    for (int i = 0; i < THREADS; i++) {
        args[i] = (thread_arg){.index = i};
        CHECK_EQ(pthread_create(&threads[i], NULL, worker, &args[i]), 0);
    }
    thread_result total = {0};
    for (int i = 0; i < THREADS; i++) {
        pthread_join(threads[i], NULL);
        total.overlaps += args[i].result.overlaps;
        total.corruptions += args[i].result.corruptions;
        total.bad_frees += args[i].result.bad_frees;
        total.ooms += args[i].result.ooms;
        total.allocs += args[i].result.allocs;
    }
    CHECK_EQ(fake.oom_reports, total.ooms); /* OOMs are expected under contention: each one is reported */
    CHECK_EQ(total.overlaps, 0);
    CHECK_EQ(total.corruptions, 0);
    CHECK_EQ(total.bad_frees, 0);
    CHECK(total.allocs > (long)ops_per_thread); /* most mallocs succeeded */
    CHECK_EQ(fake.calls_in_stats_section, 0);

    npa_empty_cache(allocator, -1);
    for (int d = 0; d < DEVICES; d++) {
        npualloc_device_stats s;
        npa_get_stats(allocator, d, &s);
        CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(s.num_pending_frees, 0);
        CHECK_EQ(s.num_invalid_frees, 0);
        CHECK_EQ(s.num_device_alloc, s.num_device_free);
        CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, s.allocation[NPUALLOC_POOL_ALL].freed);
        CHECK_EQ(fake_used(&fake, d), 0);
    }
    CHECK_EQ(fake.bad_frees, 0);
    CHECK_EQ(fake_live_fences(&fake), 0);
    CHECK_EQ(fake.page_count, 0);
    CHECK_EQ(fake.va_reserves, fake.va_releases);
    CHECK(!expandable || fake.page_maps > 0);
    CHECK(!switch_expandable || fake.raw_malloc_calls > 0);
    fprintf(stderr, "stress%s%s: %d threads, %ld allocations, %ld OOMs, %ld fences, %ld pages mapped, %ld plain "
           "segments\n", switch_expandable ? " (expandable segments switched at run time)" :
           expandable ? " (expandable segments)" : "", fenced ? "" : " (eager: the recent cache)", THREADS,
           total.allocs, total.ooms, fake.fence_records, fake.page_maps, fake.raw_malloc_calls);
    npa_destroy(allocator);
    fake_destroy(&fake);
}

static void test_threads_random_sizes(void) { run_stress(false, true, 320 * MiB); }
/* No fences: small frees wait in the recent cache, which misses, OOM
 * retries and the empty_cache thread keep merging back. */
static void test_threads_random_sizes_eager(void) { run_stress(false, false, 320 * MiB); }
/* Tighter, so OOM retries unmap pages while other threads map them. */
static void test_threads_random_sizes_expandable(void) { run_stress(true, true, 160 * MiB); }
static void test_threads_random_sizes_expandable_switched(void) {
    switch_expandable = true;
    run_stress(true, true, 160 * MiB);
    switch_expandable = false;
}

int main(void) {
    RUN(test_threads_random_sizes);
    RUN(test_threads_random_sizes_eager);
    RUN(test_threads_random_sizes_expandable);
    RUN(test_threads_random_sizes_expandable_switched);
    return check_report();
}
