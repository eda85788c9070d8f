/* The recent cache (core/recent.c): a small block freed with no fence
 * needed waits whole for the next malloc of its size. Its stats are a free
 * block's (checked against the blocks after every call of a random run), a
 * miss, an OOM retry and empty_cache get it back merged, a double free of it
 * is refused, a fenced free enters it only once its fence completed
 * (test_pending.c), it belongs to the device (a
 * thread's exit strands nothing, a forked child has its own copy), and
 * recent_blocks bounds it (0: torch's merge at every free). */
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "core/internal.h"
#include "fake_backend.h"
#include "test_util.h"

static void test_same_size_reuses_the_block_whole(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p1 = alloc_exact(&fx, 0, 1000);
    void *p2 = alloc_exact(&fx, 0, 3000);
    CHECK_EQ(npa_free(fx.a, p1, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    /* A free block that merged with nothing: not allocated, not active,
     * inactive split, reserved as before. */
    check_stat(s.allocation[NPUALLOC_POOL_SMALL], 1, 2, 2, 1);
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 3072, 4096, 4096, 1024);
    check_stat(s.active[NPUALLOC_POOL_ALL], 1, 2, 2, 1);
    check_stat(s.active_bytes[NPUALLOC_POOL_SMALL], 3072, 4096, 4096, 1024);
    check_stat(s.requested_bytes[NPUALLOC_POOL_ALL], 3000, 4000, 4000, 1000);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 2); /* p1's block and the tail */
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB - 3072);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB);
    CHECK_EQ(s.largest_free_block, 2 * MiB - 4096);
    segment_shape shape = shape_of(&fx, 0);
    CHECK_EQ(shape.blocks, 3);
    CHECK_EQ(shape.inactive_bytes, 2 * MiB - 3072); /* snapshots show it inactive */

    void *again = alloc_exact(&fx, 0, 1000); /* the same rounded size */
    CHECK(again == p1);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_cache_hits, 2); /* p1's first malloc grew the pool */
    check_stat(s.allocated_bytes[NPUALLOC_POOL_ALL], 4096, 4096, 5120, 1024);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 1);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB - 4096);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(npa_free(fx.a, again, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p2, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).allocation[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

static void test_double_free_of_a_held_block_is_refused(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_INVALID);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_invalid_frees, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

/* A small request the pool cannot serve merges the held blocks back before
 * asking the device: the segment they free serves it, no new segment. */
static void test_a_miss_merges_held_blocks_before_growing(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *quarter[4];
    for (int i = 0; i < 4; i++) quarter[i] = alloc_exact(&fx, 0, MiB / 2); /* one whole 2 MiB segment */
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    CHECK_EQ(npa_free(fx.a, quarter[1], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, quarter[2], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current, 2); /* held, not merged */
    void *whole = alloc_exact(&fx, 0, MiB); /* no block of 1 MiB until the two merge */
    CHECK(whole == quarter[1]);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.num_cache_hits, 4);
    fixture_destroy(&fx);
}

static void test_empty_cache_returns_held_memory(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 1000);
    void *q = alloc_exact(&fx, 0, 1000);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.largest_free_block, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    fixture_destroy(&fx);
}

/* A device whose small segments are cached, one of them held in the recent
 * cache: a large request's OOM retry gets it back and releases it too. */
static void test_oom_retry_releases_held_blocks(void) {
    fixture fx;
    fixture_init(&fx, 12 * MiB, NULL);
    void *p[4];
    for (int i = 0; i < 4; i++) p[i] = alloc_exact(&fx, 0, MiB); /* two small segments, two blocks each */
    CHECK_EQ(fx.fake.raw_malloc_calls, 2);
    /* 2 MiB of room: p[2] and p[3] stay held, p[0] and p[1] go back merged. */
    for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, p[i], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current, 2);
    void *big = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 10 * MiB, NPA_ENTRY_EXACT, &big), NPA_OK); /* 8 MiB free until both go */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_SMALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fx.fake.raw_free_calls, 2);
    fixture_destroy(&fx);
}

/* A free that needs a fence waits for it before it can enter. */
static void test_fenced_frees_do_not_enter(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fixture_start(&fx, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    void *q = alloc_exact(&fx, 0, 4096); /* p is pending: another block */
    CHECK(q != p);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2);
    fixture_destroy(&fx);
}

/* A block freed on its own stream is held too, and serves that stream only. */
static void test_held_blocks_serve_their_own_stream_only(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fx.fake.stream_fences = true;
    fixture_start(&fx, NULL);
    void *a = NULL, *b = NULL, *c = NULL;
    CHECK_EQ(npa_malloc_stream(fx.a, 0, 4096, NPA_ENTRY_EXACT, 1, NPA_STREAM_ORDERED, &a), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, a, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current, 2); /* held whole */
    CHECK_EQ(npa_malloc_stream(fx.a, 0, 4096, NPA_ENTRY_EXACT, 2, NPA_STREAM_ORDERED, &b), NPA_OK);
    CHECK(b != a);
    /* Both held, stream 1's first: stream 2's malloc passes it for its own. */
    CHECK_EQ(npa_free_stream(fx.a, b, 2, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_malloc_stream(fx.a, 0, 4096, NPA_ENTRY_EXACT, 2, NPA_STREAM_ORDERED, &c), NPA_OK);
    CHECK(c == b);
    CHECK_EQ(npa_malloc_stream(fx.a, 0, 4096, NPA_ENTRY_EXACT, 1, NPA_STREAM_ORDERED, &c), NPA_OK);
    CHECK(c == a);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* At most recent_blocks blocks: the oldest goes back to its pool, merged. */
static void test_bounded_by_recent_blocks(void) {
    npa_config config;
    npa_config_defaults(&config);
    CHECK_EQ(config.recent_blocks, 16);
    config.recent_blocks = 2;
    fixture fx;
    fixture_init(&fx, GiB, &config);
    void *p[4];
    for (int i = 0; i < 4; i++) p[i] = alloc_exact(&fx, 0, 512 * (size_t)(i + 1));
    void *keep = alloc_exact(&fx, 0, 512); /* p[3] is not next to the tail */
    for (int i = 0; i < 4; i++) CHECK_EQ(npa_free(fx.a, p[i], 0, NULL), NPA_FREE_OK);
    /* p[0] went back when p[2] came, then p[1] when p[3] came: merged into one. */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_SMALL].current, 4);
    CHECK_EQ(s.inactive_split_bytes[NPUALLOC_POOL_SMALL].current, 2 * MiB - 512);
    CHECK_EQ(shape_of(&fx, 0).blocks, 5);
    CHECK(alloc_exact(&fx, 0, 512 * 4) == p[3]);
    CHECK(alloc_exact(&fx, 0, 512 * 3) == p[2]);
    CHECK(alloc_exact(&fx, 0, 512) == p[0]); /* from the pool: the merged block of p[0] and p[1] */
    (void)keep;
    fixture_destroy(&fx);
}

/* largest_free_block counts the held blocks (the thread's slot shows its
 * stock's largest): an eviction that takes the largest out lowers it, and
 * a held block bigger than the rest raises it, each at the free that does
 * it. The segment is full of live blocks but for the held ones, so the
 * pool shows no free block of its own once the evicted one is taken. */
static void test_largest_free_block_follows_the_evictions(void) {
    npa_config config;
    npa_config_defaults(&config);
    config.recent_blocks = 2;
    fixture fx;
    fixture_init(&fx, GiB, &config);
    void *big = alloc_exact(&fx, 0, 64 * KiB), *b = alloc_exact(&fx, 0, 4 * KiB), *c = alloc_exact(&fx, 0, 4 * KiB);
    void *fill[2];
    for (int i = 0; i < 2; i++) fill[i] = alloc_exact(&fx, 0, (2 * MiB - 72 * KiB) / 2);
    CHECK_EQ(stats_of(&fx, 0).largest_free_block, 0);
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).largest_free_block, 4 * KiB);
    CHECK_EQ(npa_free(fx.a, big, 0, NULL), NPA_FREE_OK); /* the stock's largest rises */
    CHECK_EQ(stats_of(&fx, 0).largest_free_block, 64 * KiB);
    CHECK(alloc_exact(&fx, 0, 4 * KiB) == b); /* from the stock, which holds big alone then */
    CHECK_EQ(npa_free(fx.a, c, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, b, 0, NULL), NPA_FREE_OK); /* evicts big, the oldest: the stock's largest falls */
    CHECK_EQ(stats_of(&fx, 0).largest_free_block, 64 * KiB); /* big, in the pool now, merged with nothing */
    CHECK(alloc_exact(&fx, 0, 64 * KiB) == big); /* from the pool, which has no other free block */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.largest_free_block, 4 * KiB);
    CHECK_EQ(s.largest_free_block, blocks_of(&fx, 0).largest_free);
    (void)fill;
    fixture_destroy(&fx);
}

/* The cache belongs to a thread: what a thread held when it exited goes
 * back to the pool, merged (its segment whole again), and the stats count
 * none of it held any more. */
typedef struct freeing_thread {
    fixture *fx;
    void *blocks[3];
} freeing_thread;

static void *free_and_exit(void *arg) {
    freeing_thread *ft = arg;
    for (int i = 0; i < 3; i++) ft->blocks[i] = alloc_exact(ft->fx, 0, 4096 * (size_t)(i + 1));
    for (int i = 0; i < 3; i++) CHECK_EQ(npa_free(ft->fx->a, ft->blocks[i], 0, NULL), NPA_FREE_OK);
    return NULL;
}

static void test_a_thread_that_exits_leaves_nothing_stranded(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    freeing_thread ft = {.fx = &fx};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, free_and_exit, &ft), 0);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0); /* merged: the segment is one free block */
    CHECK_EQ(s.largest_free_block, 2 * MiB);
    CHECK_EQ(s.num_cache_hits, 2);                            /* its two cache hits, folded into the device's */
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, 3);
    CHECK(alloc_exact(&fx, 0, 8192) == ft.blocks[0]);         /* cut from the merged block */
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB); /* the live block keeps it */
    fixture_destroy(&fx);
}

/* A child forked while the parent holds blocks in the cache has its own
 * copy of them: it reuses one, and its empty_cache returns them all; the
 * parent's are untouched. A failed check in the child fails the test. */
static void test_fork_while_blocks_are_held(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    void *q = alloc_exact(&fx, 0, 8192);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    fflush(stderr);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        int before = check_failures;
        CHECK(alloc_exact(&fx, 0, 4096) == p);
        CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
        CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(fx.fake.raw_free_calls, 1);
        _exit(check_failures == before ? 0 : 1);
    }
    int status = 0;
    CHECK_EQ(waitpid(child, &status, 0), child);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB); /* the parent's cache is its own */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3);
    CHECK(alloc_exact(&fx, 0, 8192) == q);
    fixture_destroy(&fx);
}

/* Random mallocs and frees, the cache filling, evicting, hit and missed:
 * after every call the stats equal what the blocks themselves say. Fenced:
 * frees enter the cache as their fences complete (each at its second
 * query), a batch at a time. */
static void run_stats_match_the_blocks(bool fenced) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = fenced;
    fx.fake.auto_complete_polls = 2;
    fixture_start(&fx, NULL);
    void *slots[24] = {0};
    uint64_t rng = 0x2545f4914f6cdd1dULL;
    int mismatches = 0;
    for (int op = 0; op < 4000; op++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        void **slot = &slots[rng % 24];
        if (*slot) {
            CHECK_EQ(npa_free(fx.a, *slot, 0, NULL), NPA_FREE_OK);
            *slot = NULL;
        } else {
            size_t size = (size_t)1 << (rng >> 8) % 22; /* 1 B to 2 MiB: mostly small blocks */
            *slot = alloc_exact(&fx, 0, size + (rng >> 32) % size);
        }
        block_totals blocks = blocks_of(&fx, 0);
        npualloc_device_stats s = stats_of(&fx, 0);
        const int all = NPUALLOC_POOL_ALL;
        mismatches += s.inactive_split[all].current != blocks.inactive_split[all] ||
                      s.inactive_split_bytes[all].current != blocks.inactive_split_bytes[all] ||
                      s.active_bytes[all].current != blocks.active_bytes[all] ||
                      s.allocated_bytes[all].current != blocks.allocated_bytes[all] ||
                      s.largest_free_block != blocks.largest_free;
    }
    CHECK_EQ(mismatches, 0);
    CHECK(stats_of(&fx, 0).num_cache_hits > 1000);
    fixture_destroy(&fx);
}

static void test_stats_match_the_blocks(void) {
    run_stats_match_the_blocks(false);
    run_stats_match_the_blocks(true);
}

/* Two neighbouring quarters of a fresh 2 MiB segment freed: held whole,
 * they are two inactive split blocks; freed past the cache, one merged
 * block. Everything is freed and given back after, so it can be asked
 * again. */
static int64_t inactive_after_freeing_two_quarters(fixture *fx) {
    void *quarter[4];
    for (int i = 0; i < 4; i++) quarter[i] = alloc_exact(fx, 0, MiB / 2);
    CHECK_EQ(npa_free(fx->a, quarter[1], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx->a, quarter[2], 0, NULL), NPA_FREE_OK);
    int64_t inactive = stats_of(fx, 0).inactive_split[NPUALLOC_POOL_SMALL].current;
    CHECK_EQ(npa_free(fx->a, quarter[0], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx->a, quarter[3], 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_empty_cache(fx->a, 0), NPA_OK);
    npualloc_device_stats s = stats_of(fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    return inactive;
}

/* A program that frees groups of sizes it does not allocate next: every
 * block the cache holds is pushed out unused. After NPA_RECENT_JUDGED such
 * evictions the cache steps aside: frees merge at once, as torch's, and the
 * stats stay exact; NPA_RECENT_BYPASS frees later it holds blocks again. */
static void test_a_thrashing_cache_steps_aside(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    CHECK_EQ(inactive_after_freeing_two_quarters(&fx), 2);
    size_t next_size = 512;
    for (int group = 0; group < 3; group++) { /* 16 puts each; the 2nd and 3rd evict 16 each */
        void *blocks[NPA_RECENT_MAX];
        for (int i = 0; i < NPA_RECENT_MAX; i++, next_size += 512) blocks[i] = alloc_exact(&fx, 0, next_size);
        for (int i = 0; i < NPA_RECENT_MAX; i++) CHECK_EQ(npa_free(fx.a, blocks[i], 0, NULL), NPA_FREE_OK);
    }
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(inactive_after_freeing_two_quarters(&fx), 1);

    for (int i = 0; i < NPA_RECENT_BYPASS; i++) {
        void *p = alloc_exact(&fx, 0, 4096);
        CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    }
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(inactive_after_freeing_two_quarters(&fx), 2);
    fixture_destroy(&fx);
}

/* The flush before a pool grows returns held blocks unused too, but says
 * the pool needs merged space, not that holding is wasted: a program whose
 * every step ends in one keeps its cache. */
static void test_a_miss_that_merges_held_blocks_is_not_thrashing(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    for (int step = 0; step < 4 * NPA_RECENT_JUDGED; step++) {
        void *quarter[4];
        for (int i = 0; i < 4; i++) quarter[i] = alloc_exact(&fx, 0, MiB / 2);
        CHECK_EQ(npa_free(fx.a, quarter[1], 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_free(fx.a, quarter[2], 0, NULL), NPA_FREE_OK);
        void *whole = alloc_exact(&fx, 0, MiB); /* the held quarters merge for it */
        CHECK(whole == quarter[1]);
        CHECK_EQ(npa_free(fx.a, whole, 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_free(fx.a, quarter[0], 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_free(fx.a, quarter[3], 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    }
    CHECK_EQ(fx.fake.raw_malloc_calls, 4 * NPA_RECENT_JUDGED);
    CHECK_EQ(inactive_after_freeing_two_quarters(&fx), 2);
    fixture_destroy(&fx);
}

/* recent_blocks:0 is torch's rule: every free merges at once. */
static void test_off_merges_every_free(void) {
    npa_config config;
    npa_config_defaults(&config);
    CHECK_EQ(npa_config_parse(&config, "recent_blocks:0", NULL, NULL), 0);
    fixture fx;
    fixture_init(&fx, GiB, &config);
    void *p = alloc_exact(&fx, 0, 1000);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.largest_free_block, 2 * MiB);
    fixture_destroy(&fx);
}

/* recent_blocks:0 cuts where torch cuts: a block freed beside a segment's
 * free tail merges with it, and a smaller request of another size is cut at
 * its start, leaving the rest whole for the next request (the differential
 * audit's sequence: one 2 MiB segment, as torch's model). With the cache on,
 * the freed block is held and the request is cut from the tail instead: the
 * README's bounded difference. */
static void test_off_cuts_where_torch_does(void) {
    npa_config config;
    npa_config_defaults(&config);
    CHECK_EQ(npa_config_parse(&config, "recent_blocks:0", NULL, NULL), 0);
    for (int on = 0; on < 2; on++) {
        fixture fx;
        fixture_init(&fx, GiB, on ? NULL : &config);
        alloc_exact(&fx, 0, 800256);
        alloc_exact(&fx, 0, 8704);
        char *freed = alloc_exact(&fx, 0, 463360);
        CHECK_EQ(npa_free(fx.a, freed, 0, NULL), NPA_FREE_OK); /* beside the segment's free tail */
        char *small = alloc_exact(&fx, 0, 2560);
        char *next = alloc_exact(&fx, 0, 829440);
        if (!on) {
            CHECK(small == freed);
            CHECK(next == freed + 2560);
        }
        CHECK_EQ(stats_of(&fx, 0).segment[NPUALLOC_POOL_ALL].current, on ? 2 : 1);
        fixture_destroy(&fx);
    }
}

int main(void) {
    RUN(test_same_size_reuses_the_block_whole);
    RUN(test_double_free_of_a_held_block_is_refused);
    RUN(test_a_miss_merges_held_blocks_before_growing);
    RUN(test_empty_cache_returns_held_memory);
    RUN(test_oom_retry_releases_held_blocks);
    RUN(test_fenced_frees_do_not_enter);
    RUN(test_held_blocks_serve_their_own_stream_only);
    RUN(test_bounded_by_recent_blocks);
    RUN(test_largest_free_block_follows_the_evictions);
    RUN(test_off_merges_every_free);
    RUN(test_off_cuts_where_torch_does);
    RUN(test_a_thrashing_cache_steps_aside);
    RUN(test_a_miss_that_merges_held_blocks_is_not_thrashing);
    RUN(test_stats_match_the_blocks);
    RUN(test_a_thread_that_exits_leaves_nothing_stranded);
    RUN(test_fork_while_blocks_are_held);
    return check_report();
}
