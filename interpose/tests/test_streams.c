/* The stream-aware entry (npa_malloc_stream, npa_free_stream,
 * npa_record_stream): a block freed on its own stream is reusable at once
 * for that stream and for no other; a block recorded on other streams waits
 * for one event per such stream, per batch; the plain entry keeps its
 * fences; the stats stay exact. Stream handles are small ints here (the
 * fake backend's streams 0 .. FAKE_STREAMS-1). */
#include <stdint.h>

#include "check.h"
#include "core/internal.h"
#include "fake_backend.h"
#include "test_util.h"

/* A backend with fences on (reuse_policy safe: plain frees wait) and
 * per-stream fences, a device of capacity bytes. */
static void fixture_streams_of(fixture *fx, size_t capacity, const npa_config *config) {
    fake_init(&fx->fake, capacity, false);
    fx->fake.fences = true;
    fx->fake.stream_fences = true;
    fixture_start(fx, config);
}

static void fixture_streams(fixture *fx) { fixture_streams_of(fx, GiB, NULL); }

static void *alloc_flags(fixture *fx, uintptr_t stream, size_t size, npa_stream_flags flags) {
    void *p = NULL;
    CHECK_EQ(npa_malloc_stream(fx->a, 0, size, NPA_ENTRY_EXACT, stream, flags, &p), NPA_OK);
    return p;
}

static void *alloc_on(fixture *fx, uintptr_t stream, size_t size) {
    return alloc_flags(fx, stream, size, NPA_STREAM_ORDERED);
}

static void test_same_stream_reuse_is_immediate(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
    for (int i = 0; i < 100; i++) { /* a steady loop: the same block, no fence, no device call */
        void *q = alloc_on(&fx, 1, 4096);
        CHECK(q == p);
        CHECK_EQ(npa_free_stream(fx.a, q, 1, 0, NULL), NPA_FREE_OK);
    }
    CHECK_EQ(fx.fake.fence_records, 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(fx.fake.raw_malloc_calls, 1);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_cache_hits, 100);
    CHECK_EQ(s.num_cache_misses, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, 101);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, 101);

    /* The plain entry's frees still wait for the policy's fence. */
    void *plain = alloc_exact(&fx, 0, 4096);
    CHECK(plain != p);
    CHECK_EQ(npa_free(fx.a, plain, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    void *plain2 = alloc_exact(&fx, 0, 4096);
    CHECK(plain2 != plain);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.fence_records, 1);
    fixture_destroy(&fx);
}

static void note_stream(const npa_segment_view *v, void *arg) {
    uintptr_t *streams = arg;
    streams[v->stream == 0 ? 0 : 1] = v->stream;
}

/* A snapshot names the stream whose pools hold a segment, as torch's
 * segmentInfo.stream; aclrtMalloc's segments are stream 0. */
static void test_segment_views_name_their_stream(void) {
    fixture fx;
    fixture_streams(&fx);
    alloc_on(&fx, 3, 4096);
    alloc_exact(&fx, 0, 4096);
    uintptr_t streams[2] = {UINTPTR_MAX, UINTPTR_MAX}; /* [aclrtMalloc's, the stream's] */
    npa_visit_segments(fx.a, 0, note_stream, streams);
    CHECK_EQ(streams[0], 0);
    CHECK_EQ(streams[1], 3);
    fixture_destroy(&fx);
}

static void test_no_reuse_across_streams(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    /* Stream 2 may run ahead of stream 1's work on p: it never gets p's
     * segment, nor does the plain entry. */
    void *q = alloc_on(&fx, 2, 4096);
    void *r = alloc_exact(&fx, 0, 4096);
    CHECK(q != p && r != p && q != r);
    CHECK_EQ(fx.fake.raw_malloc_calls, 3); /* a segment per pool */
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_SMALL].current, 3);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 6 * MiB);
    /* p's whole segment is free in stream 1's pool: the largest free block
     * counts the pools of every stream. */
    CHECK_EQ(s.largest_free_block, 2 * MiB);
    /* Stream 0 is a stream like any other (the default stream's handle). */
    void *d0 = alloc_on(&fx, 0, 4096);
    CHECK(d0 != p && d0 != q && d0 != r);
    fixture_destroy(&fx);
}

static void test_free_on_another_stream_is_a_use(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_free_stream(fx.a, p, 3, 0, NULL), NPA_FREE_OK); /* ordered on stream 3 */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    void *q = alloc_on(&fx, 1, 4096);
    CHECK(q != p);
    CHECK_EQ(fx.fake.stream_fence_records, 1);
    CHECK_EQ(fx.fake.stream_events, 1);
    CHECK_EQ(fx.fake.stream_recorded[3], 1);
    fake_complete_stream(&fx.fake, 3);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

static void test_recorded_block_waits_for_the_other_stream(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    void *keep = alloc_on(&fx, 1, 4096); /* keeps p's segment split, so p stays p */
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_OK);
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_OK); /* a set: recorded once */
    CHECK_EQ(npa_record_stream(fx.a, p, 1, 0), NPA_OK); /* its own stream: nothing to wait for */
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 1); /* the allocation ended... */
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2);     /* ...the block is still in use */
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 1);

    /* The next malloc records one event, on stream 2 only, and does not reuse p. */
    void *q = alloc_on(&fx, 1, 4096);
    CHECK(q != p);
    CHECK_EQ(fx.fake.stream_fence_records, 1);
    CHECK_EQ(fx.fake.stream_events, 1);
    CHECK_EQ(fx.fake.stream_recorded[1], 0);
    CHECK_EQ(fx.fake.stream_recorded[2], 1);
    CHECK_EQ(fx.fake.fence_records, 1); /* that one; no plain fence */

    /* Stream 1 finishing proves nothing about stream 2. */
    fake_complete_stream(&fx.fake, 1);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    CHECK_EQ(npa_free_stream(fx.a, q, 1, 0, NULL), NPA_FREE_OK);
    void *again = alloc_on(&fx, 1, 4096);
    CHECK(again == q); /* q was never recorded elsewhere: reused at once */
    CHECK(again != p);

    fake_complete_stream(&fx.fake, 2);
    npa_process_pending(fx.a, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2);
    CHECK_EQ(fake_live_fences(&fx.fake), 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    void *reused = alloc_on(&fx, 1, 4096);
    CHECK(reused == p);
    /* Reused, p starts a new life with no uses: freed, it is reusable at once. */
    CHECK_EQ(npa_free_stream(fx.a, reused, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    CHECK_EQ(npa_free_stream(fx.a, keep, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, again, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).active[NPUALLOC_POOL_ALL].current, 0);
    fixture_destroy(&fx);
}

static void test_one_event_per_stream_per_batch(void) {
    fixture fx;
    fixture_streams(&fx);
    void *blocks[6];
    for (int i = 0; i < 6; i++) {
        blocks[i] = alloc_on(&fx, 1, 4096);
        CHECK_EQ(npa_record_stream(fx.a, blocks[i], 2, 0), NPA_OK);
        if (i % 2) CHECK_EQ(npa_record_stream(fx.a, blocks[i], 3, 0), NPA_OK);
    }
    for (int i = 0; i < 6; i++) CHECK_EQ(npa_free_stream(fx.a, blocks[i], 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 6);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_fence_records, 1);
    CHECK_EQ(fx.fake.stream_events, 2); /* streams 2 and 3, once each, for six blocks */
    fake_complete_stream(&fx.fake, 2);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 6); /* stream 3 still runs */
    fake_complete_stream(&fx.fake, 3);
    npa_process_pending(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    /* Held whole in the recent cache, as blocks freed with no event to wait
     * for are: the six and their segment's tail. */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 7);
    CHECK_EQ(s.largest_free_block, 2 * MiB - 6 * 4096);
    fixture_destroy(&fx);
}

static void test_stats_exact(void) {
    fixture fx;
    fixture_streams(&fx);
    void *a = alloc_on(&fx, 1, 1000);
    void *b = alloc_on(&fx, 2, 3 * MiB);
    void *c = alloc_exact(&fx, 0, 2000);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 3);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_SMALL].current, 2);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_LARGE].current, 1);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 1024 + 3 * MiB + 2048);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 1000 + 3 * MiB + 2000);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 3);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB + 20 * MiB + 2 * MiB);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 3);
    CHECK_EQ(npa_record_stream(fx.a, b, 1, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, a, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, b, 2, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, c, 0, NULL), NPA_FREE_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.allocated_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2); /* b and c wait, a does not */
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 3 * MiB + 2048);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 3 * MiB + 2000);
    CHECK_EQ(s.num_pending_frees, 2);
    /* a, freed on its own stream, waits whole in the recent cache beside
     * its segment's tail (recent_blocks:0 would merge them). */
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 4);
    npa_process_pending(fx.a, 0); /* records the plain fence and one event on stream 1 (b's use) */
    CHECK_EQ(fx.fake.stream_recorded[1], 1);
    CHECK_EQ(fx.fake.stream_recorded[2], 0);
    fake_complete_stream(&fx.fake, 1);
    npa_process_pending(fx.a, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 1); /* c still waits for the plain fence */
    CHECK_EQ(s.num_pending_frees, 1);
    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.inactive_split[NPUALLOC_POOL_ALL].current, 4); /* a, c (held whole) and their segments' tails */
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].allocated, 3);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].freed, 3);
    CHECK_EQ(s.largest_free_block, 20 * MiB);

    /* empty_cache synchronizes and gives back every pool's segments. */
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    s = stats_of(&fx, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.num_device_free, 3);
    CHECK_EQ(s.largest_free_block, 0);
    CHECK_EQ(fake_used(&fx.fake, 0), 0);
    fixture_destroy(&fx);
}

static void test_bad_pointers(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_record_stream(fx.a, (char *)p + 512, 2, 0), NPA_ERR_INVALID_PARAM); /* interior */
    int outside = 0;
    CHECK_EQ(npa_record_stream(fx.a, &outside, 2, 0), NPA_ERR_INVALID_PARAM);         /* not ours */
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_INVALID);                 /* double free */
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_ERR_INVALID_PARAM);                /* freed */
    CHECK_EQ(npa_free_stream(fx.a, &outside, 1, 0, NULL), NPA_FREE_NOT_OURS);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_invalid_frees, 1);
    CHECK_EQ(s.num_foreign_frees, 1);
    CHECK_EQ(s.allocation[NPUALLOC_POOL_ALL].current, 0);
    /* A plain block recorded on a stream needs nothing more than its fence. */
    void *plain = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_record_stream(fx.a, plain, 2, 0), NPA_OK);
    CHECK_EQ(npa_free(fx.a, plain, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_fence_records, 0);
    CHECK_EQ(fx.fake.fence_records, 1);
    fixture_destroy(&fx);
}

/* A caller that writes new blocks from the host (a synchronous memcpy runs
 * at once, whatever its stream still has queued): the free waits for an
 * event on the block's own stream, one per stream per batch. */
static void test_host_writes_wait_for_their_own_stream(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_flags(&fx, 1, 4096, NPA_STREAM_HOST_WRITES);
    void *q = alloc_flags(&fx, 1, 4096, NPA_STREAM_HOST_WRITES);
    void *r = alloc_flags(&fx, 1, 4096, NPA_STREAM_HOST_WRITES);
    CHECK_EQ(npa_record_stream(fx.a, q, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, q, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 2);
    void *s = alloc_flags(&fx, 1, 4096, NPA_STREAM_HOST_WRITES);
    CHECK(s != p && s != q);
    CHECK_EQ(fx.fake.stream_fence_records, 1);
    CHECK_EQ(fx.fake.stream_events, 2); /* streams 1 and 2, once each */
    fake_complete_stream(&fx.fake, 1);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 2); /* q's stream 2 still runs: the batch waits */
    fake_complete_stream(&fx.fake, 2);
    /* A malloc's poll asks again only after a back-off once a query found
     * the batch running (pending.c); processing asks now. */
    npa_process_pending(fx.a, 0);
    void *again = alloc_flags(&fx, 1, 4096, NPA_STREAM_ORDERED);
    CHECK(again == p || again == q);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    /* The flag is the allocation's: allocated ordered, p is reusable at once. */
    CHECK_EQ(npa_free_stream(fx.a, again, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    CHECK_EQ(npa_free_stream(fx.a, r, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, s, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 2);
    fixture_destroy(&fx);
}

/* A backend without per-stream fences: a recorded block waits for a
 * synchronize instead, counted as one, outside any stats section (the
 * fixture's destroy checks that no backend call found one open). */
static void test_without_stream_fences_a_synchronize_stands_in(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fixture_start(&fx, NULL);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    void *q = alloc_on(&fx, 1, 4096);
    CHECK(q == p);
    CHECK_EQ(fx.fake.sync_calls, 1);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_sync_all_streams, 1);
    CHECK_EQ(s.num_pending_frees, 0);

    /* A synchronize that fails proves nothing: the block stays pending. */
    CHECK_EQ(npa_record_stream(fx.a, q, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, q, 1, 0, NULL), NPA_FREE_OK);
    fx.fake.fail_next_syncs = 1;
    void *r = alloc_on(&fx, 1, 4096);
    CHECK(r != q);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* A failed stream fence (the device cannot be entered) keeps the blocks
 * pending until a later poll records one. */
static void test_failed_stream_fence_keeps_blocks_pending(void) {
    fixture fx;
    fixture_streams(&fx);
    void *p = alloc_on(&fx, 1, 4096);
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    fx.fake.fail_next_fences = 1;
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_fence_records, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    fake_complete_fences(&fx.fake); /* nothing was recorded: proves nothing */
    npa_process_pending(fx.a, 0);   /* records now */
    CHECK_EQ(fx.fake.stream_fence_records, 1);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    fake_complete_stream(&fx.fake, 2);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* GC never synchronizes, so it leaves a stream's cached segments alone
 * (work queued on the stream may still use them); the OOM path's
 * synchronize gives them back. */
static void test_gc_leaves_stream_pools_to_the_oom_path(void) {
    fixture fx;
    npa_config config;
    npa_config_defaults(&config);
    config.garbage_collection_threshold = 0.5;
    fixture_streams_of(&fx, 100 * MiB, &config);
    void *p = alloc_on(&fx, 1, 60 * MiB);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    void *q = alloc_on(&fx, 2, 12 * MiB); /* reserved 60 > 50: GC runs, and may not take p */
    CHECK(q != NULL);
    CHECK_EQ(fx.fake.raw_free_calls, 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    void *r = alloc_on(&fx, 2, 30 * MiB); /* does not fit beside p: the OOM path frees it after a sync */
    CHECK(r != NULL);
    CHECK_EQ(fx.fake.sync_calls, 1);
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 1);
    CHECK_EQ(s.num_ooms, 0);
    fixture_destroy(&fx);
}

/* fixture_streams with virtual memory offered, expandable segments on or
 * off, and reuse_policy eager (plain frees wait for nothing) or safe, asked
 * as the hook's backend is asked. */
static void fixture_streams_vmm(fixture *fx, bool expandable, bool eager) {
    fake_init(&fx->fake, GiB, false);
    fx->fake.fences = true;
    fake_set_eager(&fx->fake, eager);
    fx->fake.answers_fence_needed = true;
    fx->fake.stream_fences = true;
    fx->fake.vmm = true;
    npa_config config;
    npa_config_defaults(&config);
    config.expandable_segments = expandable;
    fixture_start(fx, &config);
}

static size_t stream_pairs(fixture *fx) {
    size_t n = 0;
    for (const npa_pool_pair *p = npa_device_get(fx->a, 0, false)->streams; p; p = p->next) n++;
    return n;
}

static void destroy_stream(fixture *fx, uintptr_t stream) {
    uint64_t token = npa_stream_retire(fx->a, stream);
    npa_stream_destroyed(fx->a, token); /* the runtime's destroy, which waits for the stream, in between */
}

/* A destroyed stream's work is done (aclrtDestroyStream waits for it): its
 * cached memory goes back to the device at once, plain and expandable, and
 * its pools go once no block is left in them. A program that makes a stream
 * per step neither reserves nor keeps pools per step. */
static void destroyed_streams_cache_goes_back(bool expandable) {
    fixture fx;
    fixture_streams_vmm(&fx, expandable, false);
    for (int step = 0; step < 50; step++) { /* handles 1 and 2 by turns, as a runtime reuses them */
        uintptr_t stream = 1 + (uintptr_t)step % 2;
        CHECK_EQ(npa_free_stream(fx.a, alloc_on(&fx, stream, 4096), stream, 0, NULL), NPA_FREE_OK);
        CHECK_EQ(npa_free_stream(fx.a, alloc_on(&fx, stream, 30 * MiB), stream, 0, NULL), NPA_FREE_OK);
        destroy_stream(&fx, stream);
        CHECK_EQ(stream_pairs(&fx), 0);
        CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    }
    CHECK_EQ(fx.fake.raw_malloc_calls, fx.fake.raw_free_calls);
    CHECK_EQ(fx.fake.page_count, 0);
    CHECK_EQ(fx.fake.va_reserves, fx.fake.va_releases);
    CHECK_EQ(fx.fake.sync_calls, 0); /* the destroy already waited */

    /* A block still live, and one waiting for another stream's event, keep
     * their segments and the pools. The live one freed later on the same
     * handle is handed out to no one and waits, as a plain block, for the
     * fence over every stream: the handle may name a new stream by then,
     * whose use would read as the block's own. Once both have waited, their
     * segment goes back with no synchronize, and their pools go. */
    void *live = alloc_on(&fx, 3, 4096), *recorded = alloc_on(&fx, 3, 1 * MiB);
    CHECK_EQ(npa_record_stream(fx.a, recorded, 4, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, recorded, 3, 0, NULL), NPA_FREE_OK);
    destroy_stream(&fx, 3);
    CHECK_EQ(stream_pairs(&fx), 1);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB); /* one small segment or page */
    long events = fx.fake.stream_events, plain_fences = fx.fake.fence_records - fx.fake.stream_fence_records;
    CHECK_EQ(npa_free_stream(fx.a, live, 3, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_events, events + 1); /* stream 4's, for the recorded block only */
    CHECK_EQ(fx.fake.fence_records - fx.fake.stream_fence_records, plain_fences + 1); /* live's */
    void *other = alloc_on(&fx, 3, 4096);         /* a new stream 3 gets new pools */
    CHECK(other != live);
    CHECK_EQ(npa_free_stream(fx.a, other, 3, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stream_pairs(&fx), 2);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 4 * MiB);
    fx.fake.completed_epoch = fx.fake.recorded_epoch; /* the plain fences only */
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 4 * MiB); /* recorded still waits for 4 */
    fake_complete_stream(&fx.fake, 4);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB); /* the new stream 3's */
    CHECK_EQ(stream_pairs(&fx), 1);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(stream_pairs(&fx), 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.num_device_alloc, s.num_device_free);

    /* The runtime hands the handle to a new stream as soon as its destroy
     * returns, before npualloc is told: the new stream gets pools of its own,
     * and what it freed on itself, its work perhaps still queued, stays. */
    void *kept = alloc_on(&fx, 5, 4096), *spare = alloc_on(&fx, 5, 4096);
    CHECK_EQ(npa_free_stream(fx.a, spare, 5, 0, NULL), NPA_FREE_OK);
    uint64_t token = npa_stream_retire(fx.a, 5);
    void *fresh = alloc_on(&fx, 5, 4096);
    CHECK(fresh != spare && fresh != kept);
    CHECK_EQ(npa_free_stream(fx.a, fresh, 5, 0, NULL), NPA_FREE_OK);
    long raw_frees = fx.fake.raw_free_calls, unmaps = fx.fake.page_unmaps;
    npa_stream_destroyed(fx.a, token);
    CHECK_EQ(fx.fake.raw_free_calls, raw_frees); /* neither kept's segment nor the new stream's */
    CHECK_EQ(fx.fake.page_unmaps, unmaps);
    CHECK(alloc_on(&fx, 5, 4096) == fresh);
    CHECK_EQ(stream_pairs(&fx), 2);
    CHECK_EQ(npa_free_stream(fx.a, fresh, 5, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, kept, 5, 0, NULL), NPA_FREE_OK);
    /* An empty cache leaves no empty pools, a live stream's included: its
     * next allocation makes them again. */
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);
    CHECK_EQ(stream_pairs(&fx), 0);
    CHECK_EQ(npa_free_stream(fx.a, alloc_on(&fx, 5, 4096), 5, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(stream_pairs(&fx), 1);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* Blocks recorded on a stream that is then destroyed: no event is ever
 * recorded on its handle. While the destroy runs, the stream's work may
 * still use them, so a synchronize stands in for its event; once the
 * runtime returned, that work is done and nothing stands in: unless the
 * destroy failed (the stream lives on), or a use could not be noted. */
static void test_no_event_on_a_destroyed_stream_a_block_was_recorded_on(void) {
    fixture fx;
    fixture_streams(&fx);
    void *during = alloc_on(&fx, 1, 4096), *after = alloc_on(&fx, 1, 4096);
    void *also = alloc_on(&fx, 1, 4096), *refused = alloc_on(&fx, 1, 4096);
    for (void **p = (void *[]){during, after, also, NULL}; *p; p++) CHECK_EQ(npa_record_stream(fx.a, *p, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, during, 1, 0, NULL), NPA_FREE_OK);
    uint64_t token = npa_stream_retire(fx.a, 2);
    CHECK_EQ(npa_record_stream(fx.a, also, 3, 0), NPA_OK); /* not noted beside the unknown use: it stays unknown */
    long syncs = fx.fake.sync_calls;
    npa_process_pending(fx.a, 0);                           /* during's batch, while the destroy runs */
    CHECK_EQ(fx.fake.sync_calls, syncs + 1);
    npa_stream_destroyed(fx.a, token);
    syncs = fx.fake.sync_calls;
    CHECK_EQ(npa_free_stream(fx.a, after, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.sync_calls, syncs);                    /* settled: nothing left to wait for */
    CHECK_EQ(fx.fake.stream_events, 0);
    CHECK_EQ(npa_free_stream(fx.a, also, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.sync_calls, syncs + 1);                /* stream 3's use was not noted */

    CHECK_EQ(npa_record_stream(fx.a, refused, 4, 0), NPA_OK);
    npa_stream_not_destroyed(fx.a, npa_stream_retire(fx.a, 4)); /* stream 4 lives on, its use forgotten */
    CHECK_EQ(npa_free_stream(fx.a, refused, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.sync_calls, syncs + 2);
    CHECK_EQ(fx.fake.stream_events, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    fixture_destroy(&fx);
}

/* A program that allocates through the plain entry only destroys its
 * streams without touching the cache: the recent blocks stay held. */
static void test_a_stream_without_pools_destroyed_leaves_the_cache_alone(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false); /* no fences: plain frees are reusable at once, into the recent cache */
    fixture_start(&fx, NULL);
    CHECK_EQ(npa_free(fx.a, alloc_exact(&fx, 0, 4096), 0, NULL), NPA_FREE_OK);
    unsigned held = npa_tcache_mine(fx.a, 0)->stock.count; /* this thread's cache */
    CHECK(held > 0);
    destroy_stream(&fx, 3);
    CHECK_EQ(npa_tcache_mine(fx.a, 0)->stock.count, held);
    fixture_destroy(&fx);
}

static void test_a_destroyed_streams_cache_goes_back(void) {
    destroyed_streams_cache_goes_back(false);
    destroyed_streams_cache_goes_back(true);
}

/* A block per short-lived stream, freed after that stream's destroy: each
 * goes back to the device once free, after a fence over every live stream
 * whatever the reuse policy, so the reservation is one step's, not a
 * segment more per step until an OOM retry. No event names a destroyed
 * handle and nothing synchronizes. Under eager too: the runtime may have
 * given the handle to a new stream that still writes the block, recorded
 * (or freed on) under the handle that reads as the block's own (a review's
 * simulator program: the segment freed under the running op). */
static void blocks_outliving_their_stream(bool eager, bool expandable) {
    fixture fx;
    fixture_streams_vmm(&fx, expandable, eager);
    for (int step = 0; step < 50; step++) {
        uintptr_t stream = 1 + (uintptr_t)step % 2;
        void *outliving = alloc_on(&fx, stream, 1 * MiB);
        destroy_stream(&fx, stream);
        CHECK_EQ(npa_record_stream(fx.a, outliving, stream, 0), NPA_OK); /* a new stream with the handle */
        CHECK_EQ(npa_free_stream(fx.a, outliving, stream, 0, NULL), NPA_FREE_OK);
        CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
        long raw_frees = fx.fake.raw_free_calls, unmaps = fx.fake.page_unmaps;
        npa_process_pending(fx.a, 0); /* records the fence: nothing goes back before it completes */
        CHECK_EQ(fx.fake.raw_free_calls, raw_frees);
        CHECK_EQ(fx.fake.page_unmaps, unmaps);
        fake_complete_fences(&fx.fake);
        npa_process_pending(fx.a, 0);
        npualloc_device_stats s = stats_of(&fx, 0);
        CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 0);
        CHECK_EQ(stream_pairs(&fx), 0);
    }
    CHECK_EQ(fx.fake.fence_records_always, 50);
    CHECK_EQ(fx.fake.stream_events, 0);
    CHECK_EQ(fx.fake.sync_calls, 0);
    CHECK_EQ(fx.fake.raw_malloc_calls, fx.fake.raw_free_calls);
    CHECK_EQ(fx.fake.page_count, 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

static void test_blocks_outliving_their_stream_go_back_once_freed(void) {
    blocks_outliving_their_stream(false, false);
    blocks_outliving_their_stream(false, true);
    blocks_outliving_their_stream(true, false);
    blocks_outliving_their_stream(true, true);
}

/* What the destroys of other threads and failed destroys must not do. */
static void test_a_destroy_releases_only_what_it_set_aside(void) {
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fake_set_eager(&fx.fake, true); /* reuse_policy eager: plain frees need no fence, so only a block's uses hold it */
    fx.fake.stream_fences = true;
    fixture_start(&fx, NULL);

    /* A block recorded on stream 4 and freed while its own stream's destroy
     * runs still waits for 4's event: the destroy waits for its own stream
     * only. */
    void *recorded = alloc_on(&fx, 3, 4096);
    CHECK_EQ(npa_record_stream(fx.a, recorded, 4, 0), NPA_OK);
    uint64_t token = npa_stream_retire(fx.a, 3);
    CHECK_EQ(npa_free(fx.a, recorded, 0, NULL), NPA_FREE_OK); /* aclrtFree, from a thread the destroy races */
    long raw_frees = fx.fake.raw_free_calls;
    npa_stream_destroyed(fx.a, token);
    CHECK_EQ(fx.fake.raw_free_calls, raw_frees);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_fence_records, 1); /* on stream 4 */
    CHECK_EQ(fx.fake.stream_events, 1);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);

    /* A destroy the runtime refuses leaves the stream its pools: ten of them
     * reserve one segment, not ten. */
    for (int step = 0; step < 10; step++) {
        CHECK_EQ(npa_free_stream(fx.a, alloc_on(&fx, 6, 4096), 6, 0, NULL), NPA_FREE_OK);
        npa_stream_not_destroyed(fx.a, npa_stream_retire(fx.a, 6));
    }
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 2 * MiB);
    CHECK_EQ(stream_pairs(&fx), 1);
    CHECK_EQ(npa_empty_cache(fx.a, 0), NPA_OK);

    /* Thread A destroys stream 7; the runtime gives the handle to a new
     * stream, which frees a block on itself (its work still queued), and
     * thread B starts destroying that one before A's release runs: A's
     * release takes A's pools only. */
    void *old = alloc_on(&fx, 7, 4096);
    CHECK_EQ(npa_free_stream(fx.a, old, 7, 0, NULL), NPA_FREE_OK);
    uint64_t first = npa_stream_retire(fx.a, 7);
    CHECK_EQ(npa_free_stream(fx.a, alloc_on(&fx, 7, 4096), 7, 0, NULL), NPA_FREE_OK);
    uint64_t second = npa_stream_retire(fx.a, 7);
    raw_frees = fx.fake.raw_free_calls;
    npa_stream_destroyed(fx.a, first);
    CHECK_EQ(fx.fake.raw_free_calls, raw_frees + 1); /* old's segment only */
    npa_stream_destroyed(fx.a, second);
    CHECK_EQ(fx.fake.raw_free_calls, raw_frees + 2);
    CHECK_EQ(stream_pairs(&fx), 0);

    /* A block written from the host waits for its own stream when freed;
     * once that stream's destroy began, the destroy waits for it instead
     * (no event on a handle that names nothing). */
    void *written = alloc_flags(&fx, 8, 4096, NPA_STREAM_HOST_WRITES);
    long events = fx.fake.stream_fence_records;
    token = npa_stream_retire(fx.a, 8);
    CHECK_EQ(npa_free(fx.a, written, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(fx.fake.stream_fence_records, events);
    npa_stream_destroyed(fx.a, token);
    CHECK_EQ(stats_of(&fx, 0).reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(fx.fake.bad_frees, 0);
    fixture_destroy(&fx);
}

/* A block recorded on a busy stream must not hold back later blocks
 * recorded on other streams whose work is done: torch keeps one queue of
 * events per stream "to avoid head-of-line delays" (process_events). A
 * later batch whose streams include all of a waiting one's is skipped
 * without a query (its events are behind that one's on the same streams). */
static void test_a_busy_stream_does_not_hold_back_other_streams_blocks(void) {
    fixture fx;
    fixture_streams(&fx);
    void *a = alloc_on(&fx, 1, 4096);
    void *b = alloc_on(&fx, 3, 4096);
    void *c = alloc_on(&fx, 1, 8192);
    CHECK_EQ(npa_record_stream(fx.a, a, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, a, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* a waits for stream 2 */
    CHECK_EQ(npa_record_stream(fx.a, b, 4, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, b, 3, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* b waits for stream 4 */
    CHECK_EQ(npa_record_stream(fx.a, c, 2, 0), NPA_OK);
    CHECK_EQ(npa_record_stream(fx.a, c, 4, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, c, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* c waits for streams 2 and 4 */
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 3);

    fake_complete_stream(&fx.fake, 4); /* stream 2 still runs */
    long queries = fx.fake.fence_queries;
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 2); /* b is back, behind a */
    CHECK_EQ(fx.fake.fence_queries - queries, 2);  /* a's and b's fences; c's (streams 2 and 4) not asked */
    void *again = alloc_on(&fx, 3, 4096);
    CHECK(again == b);

    fake_complete_stream(&fx.fake, 2);
    npa_process_pending(fx.a, 0);
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 0);
    CHECK_EQ(stats_of(&fx, 0).active[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(npa_free_stream(fx.a, again, 3, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

/* torch's step 5 (release_available_cached_blocks) on a stream's pool:
 * the requesting stream's cached oversize blocks go back, after a
 * synchronize (torch_npu's; its free blocks may still be in use on the
 * stream), with no retry counted and other streams' cache left alone. */
static void test_oversize_blocks_of_the_stream_go_back_before_a_retry(void) {
    fixture fx;
    npa_config config;
    npa_config_defaults(&config);
    config.max_split_size = 20 * MiB;
    fixture_streams_of(&fx, 100 * MiB, &config);
    void *p = alloc_on(&fx, 1, 60 * MiB);
    void *r = alloc_on(&fx, 2, 30 * MiB);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, r, 2, 0, NULL), NPA_FREE_OK);
    /* 60 MiB is 20 MiB or more above 30 MiB: not reused; 30 MiB more does not fit */
    void *q = alloc_on(&fx, 1, 30 * MiB);
    CHECK(q != NULL);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_alloc_retries, 0);
    CHECK_EQ(s.num_sync_all_streams, 0);
    CHECK_EQ(s.num_device_free, 1);                         /* p's segment only */
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 2);      /* r's stays cached for stream 2 */
    CHECK_EQ(fx.fake.sync_calls, 1);                        /* before giving p back */
    CHECK_EQ(fx.fake.raw_free_calls, 1);
    CHECK(alloc_on(&fx, 2, 30 * MiB) == r);
    fixture_destroy(&fx);
}

/* A block recorded only on a stream destroyed since: once the destroy has
 * returned nothing waits for that stream (README), so the block freed on
 * its own stream is free at once, as torch frees a block with no stream
 * uses: inactive in the stats, merged, and taken by the next malloc of its
 * stream. The destroy used to leave it an empty set of uses, which sent its
 * free to wait for a fence on no stream, recorded at the next poll and
 * drained when a poll's back-off let it: until then the stats counted it
 * active, and a malloc meanwhile cut new memory instead of reusing it. */
static void test_a_use_on_a_destroyed_stream_leaves_nothing_to_wait_for(void) {
    fixture fx;
    fixture_streams_vmm(&fx, true, true);
    /* A block waiting for stream 2: a batch of stream events stays queued throughout. */
    void *waiting = alloc_on(&fx, 0, 1000);
    CHECK_EQ(npa_record_stream(fx.a, waiting, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, waiting, 0, 0, NULL), NPA_FREE_OK);
    alloc_on(&fx, 0, 1000);
    void *p = alloc_on(&fx, 0, 1000);
    CHECK_EQ(npa_record_stream(fx.a, p, 1, 0), NPA_OK);
    destroy_stream(&fx, 1);
    npa_process_pending(fx.a, 0);
    long stream_fences = fx.fake.stream_fence_records;
    CHECK_EQ(npa_free_stream(fx.a, p, 0, 0, NULL), NPA_FREE_OK);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 1); /* waiting only */
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 2);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 2048);
    CHECK(alloc_on(&fx, 0, 1000) == p);
    CHECK_EQ(fx.fake.stream_fence_records, stream_fences); /* no fence for it */
    fixture_destroy(&fx);
}

/* Blocks waiting for one stream complete in the order they were freed, as
 * torch's process_events takes each stream's events oldest first: the
 * inactive_split stats' peak and totals depend on it. In a plain segment
 * of stream 1, [a | b | c | free tail], b and c recorded on stream 0 and
 * freed in that order: b merges with nothing (two inactive blocks), then c
 * joins b and the tail (one). Newest first, c took the tail and b joined
 * it, and the stats never saw the second inactive block. */
static void test_blocks_waiting_for_a_stream_complete_oldest_first(void) {
    fixture fx;
    npa_config config = merge_at_free_config();
    fixture_streams_of(&fx, GiB, &config);
    alloc_on(&fx, 1, 1000);
    void *b = alloc_on(&fx, 1, 1000), *c = alloc_on(&fx, 1, 1000);
    CHECK_EQ(npa_record_stream(fx.a, b, 0, 0), NPA_OK);
    CHECK_EQ(npa_record_stream(fx.a, c, 0, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, b, 1, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free_stream(fx.a, c, 1, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0); /* one batch, one event on stream 0 */
    CHECK_EQ(fx.fake.stream_events, 1);
    fake_complete_stream(&fx.fake, 0);
    npa_process_pending(fx.a, 0);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    check_stat(s.inactive_split[NPUALLOC_POOL_ALL], 1, 2, 2, 1);
    check_stat(s.inactive_split_bytes[NPUALLOC_POOL_ALL], 2 * MiB - 1024, 2 * MiB - 1024, 2 * MiB + 1024, 2048);
    fixture_destroy(&fx);
}

/* torch's malloc starts with process_events, which asks each stream's
 * oldest event: a block recorded on a stream whose work has finished is
 * free (inactive, out of the active stats) once the next malloc returns,
 * whether or not that malloc could use it. The polls' back-off (for the
 * plain frees' fences) held such a block active for up to 64 mallocs more
 * after a query had found its stream busy. */
static void test_a_block_whose_streams_finished_is_free_after_the_next_malloc(void) {
    fixture fx;
    npa_config config = merge_at_free_config();
    fixture_streams_of(&fx, GiB, &config);
    void *p = alloc_on(&fx, 1, 4096);
    void *q = alloc_on(&fx, 1, 8192);
    CHECK_EQ(npa_free_stream(fx.a, q, 1, 0, NULL), NPA_FREE_OK); /* cached for stream 1 */
    CHECK_EQ(npa_record_stream(fx.a, p, 2, 0), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, p, 1, 0, NULL), NPA_FREE_OK);
    for (int i = 0; i < 4; i++) { /* stream 2 still runs: each of these mallocs finds p's event not done */
        void *r = alloc_on(&fx, 1, 8192);
        CHECK(r == q);
        CHECK_EQ(npa_free_stream(fx.a, r, 1, 0, NULL), NPA_FREE_OK);
    }
    CHECK_EQ(stats_of(&fx, 0).num_pending_frees, 1);

    fake_complete_stream(&fx.fake, 2);
    void *r = alloc_on(&fx, 1, 8192); /* as torch: p goes back first, merged with q, and serves it */
    CHECK(r == p);
    npualloc_device_stats s = stats_of(&fx, 0);
    CHECK_EQ(s.num_pending_frees, 0);
    CHECK_EQ(s.active[NPUALLOC_POOL_ALL].current, 1);
    CHECK_EQ(s.active_bytes[NPUALLOC_POOL_ALL].current, 8192);
    CHECK_EQ(s.requested_bytes[NPUALLOC_POOL_ALL].current, 8192);
    CHECK_EQ(shape_of(&fx, 0).pending_blocks, 0);
    CHECK_EQ(npa_free_stream(fx.a, r, 1, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_same_stream_reuse_is_immediate);
    RUN(test_segment_views_name_their_stream);
    RUN(test_no_reuse_across_streams);
    RUN(test_free_on_another_stream_is_a_use);
    RUN(test_recorded_block_waits_for_the_other_stream);
    RUN(test_one_event_per_stream_per_batch);
    RUN(test_stats_exact);
    RUN(test_bad_pointers);
    RUN(test_host_writes_wait_for_their_own_stream);
    RUN(test_without_stream_fences_a_synchronize_stands_in);
    RUN(test_failed_stream_fence_keeps_blocks_pending);
    RUN(test_gc_leaves_stream_pools_to_the_oom_path);
    RUN(test_a_destroyed_streams_cache_goes_back);
    RUN(test_a_destroy_releases_only_what_it_set_aside);
    RUN(test_blocks_outliving_their_stream_go_back_once_freed);
    RUN(test_no_event_on_a_destroyed_stream_a_block_was_recorded_on);
    RUN(test_a_stream_without_pools_destroyed_leaves_the_cache_alone);
    RUN(test_a_busy_stream_does_not_hold_back_other_streams_blocks);
    RUN(test_oversize_blocks_of_the_stream_go_back_before_a_retry);
    RUN(test_a_use_on_a_destroyed_stream_leaves_nothing_to_wait_for);
    RUN(test_blocks_waiting_for_a_stream_complete_oldest_first);
    RUN(test_a_block_whose_streams_finished_is_free_after_the_next_malloc);
    return check_report();
}
