/* History recording: off by default, torch's actions and sizes in order, the
 * ring keeps the newest N and wraps, run-time restarts, OOM events carry the
 * device's free bytes, and the snapshot pickle is framed as pickle protocol 2. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

#define MAX_SEEN 64

typedef struct seen_trace {
    size_t count;
    npa_trace_view entries[MAX_SEEN];
} seen_trace;

static void collect(const npa_trace_view *e, void *arg) {
    seen_trace *seen = arg;
    if (seen->count < MAX_SEEN) seen->entries[seen->count] = *e;
    seen->count++;
}

static seen_trace trace_of(fixture *fx, int device) {
    seen_trace seen = {0};
    npa_visit_trace(fx->a, device, collect, &seen);
    return seen;
}

static void check_entry(const npa_trace_view *e, npa_trace_action action, uintptr_t addr, size_t size) {
    CHECK_EQ(e->action, action);
    CHECK_EQ(e->addr, addr);
    CHECK_EQ(e->size, size);
}

static npa_config history_config(size_t entries) {
    npa_config c;
    npa_config_defaults(&c);
    c.record_history = entries;
    return c;
}

static void test_off_by_default(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(trace_of(&fx, 0).count, 0);
    fixture_destroy(&fx);
}

static void test_actions_and_sizes_in_order(void) {
    npa_config c = history_config(100);
    fixture fx;
    fixture_init(&fx, GiB, &c);
    void *small = alloc_exact(&fx, 0, 1000);        /* a 2 MiB small segment, block of 1024 */
    void *large = alloc_exact(&fx, 0, 3 * MiB + 1); /* a 20 MiB large segment */
    CHECK_EQ(npa_free(fx.a, small, 0, NULL), NPA_FREE_OK);
    npa_empty_cache(fx.a, 0);                       /* the small segment goes back */

    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 7);
    check_entry(&t.entries[0], NPA_TRACE_SEGMENT_ALLOC, (uintptr_t)small, 2 * MiB);
    check_entry(&t.entries[1], NPA_TRACE_ALLOC, (uintptr_t)small, 1000); /* torch: the caller's size */
    check_entry(&t.entries[2], NPA_TRACE_SEGMENT_ALLOC, (uintptr_t)large, 20 * MiB);
    check_entry(&t.entries[3], NPA_TRACE_ALLOC, (uintptr_t)large, 3 * MiB + 1);
    check_entry(&t.entries[4], NPA_TRACE_FREE_REQUESTED, (uintptr_t)small, 1000);
    check_entry(&t.entries[5], NPA_TRACE_FREE_COMPLETED, (uintptr_t)small, 1000);
    check_entry(&t.entries[6], NPA_TRACE_SEGMENT_FREE, (uintptr_t)small, 2 * MiB);
    for (size_t i = 0; i < t.count; i++) {
        CHECK_EQ(t.entries[i].device, 0);
        CHECK(t.entries[i].time_us > 1600000000ll * 1000000); /* the Unix epoch, in microseconds */
        if (i > 0) CHECK(t.entries[i].time_us >= t.entries[i - 1].time_us);
    }
    CHECK_EQ(trace_of(&fx, 1).count, 0); /* devices keep their own rings */
    fixture_destroy(&fx);
}

/* Stream-safe reuse: the free is requested at once, completed when its fence is. */
static void test_free_completes_after_its_fence(void) {
    npa_config c = history_config(100);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fixture_start(&fx, &c);
    void *p = alloc_exact(&fx, 0, 4096);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    npa_process_pending(fx.a, 0);
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 3);
    check_entry(&t.entries[2], NPA_TRACE_FREE_REQUESTED, (uintptr_t)p, 4096);
    fake_complete_fences(&fx.fake);
    npa_process_pending(fx.a, 0);
    t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 4);
    check_entry(&t.entries[3], NPA_TRACE_FREE_COMPLETED, (uintptr_t)p, 4096);
    fixture_destroy(&fx);
}

static void test_ring_keeps_the_newest_and_wraps(void) {
    npa_config c = history_config(5);
    fixture fx;
    fixture_init(&fx, GiB, &c);
    void *first = alloc_exact(&fx, 0, 512); /* segment_alloc + alloc */
    CHECK_EQ(trace_of(&fx, 0).count, 2);
    size_t sizes[] = {600, 700, 800, 900, 1100, 1200, 1300}; /* seven more allocs: 9 events in a ring of 5 */
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) alloc_exact(&fx, 0, sizes[i]);
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 5);
    for (size_t i = 0; i < 5; i++) {
        CHECK_EQ(t.entries[i].action, NPA_TRACE_ALLOC);
        CHECK_EQ(t.entries[i].size, sizes[2 + i]); /* oldest first */
    }
    CHECK_EQ(npa_free(fx.a, first, 0, NULL), NPA_FREE_OK);
    t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 5);
    check_entry(&t.entries[4], NPA_TRACE_FREE_COMPLETED, (uintptr_t)first, 512);
    check_entry(&t.entries[3], NPA_TRACE_FREE_REQUESTED, (uintptr_t)first, 512);
    CHECK_EQ(t.entries[2].size, 1300);
    fixture_destroy(&fx);
}

static void test_run_time_switch_restarts_the_ring(void) {
    fixture fx;
    fixture_init(&fx, GiB, NULL);
    alloc_exact(&fx, 0, 512);
    CHECK_EQ(npa_set_record_history(fx.a, 3), 0);
    CHECK_EQ(npa_get_config(fx.a)->record_history, 3);
    CHECK_EQ(trace_of(&fx, 0).count, 0); /* what happened before is not invented */
    void *p = alloc_exact(&fx, 0, 512);
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 1);
    check_entry(&t.entries[0], NPA_TRACE_ALLOC, (uintptr_t)p, 512);
    alloc_exact(&fx, 1, 512); /* a device created later records too */
    CHECK_EQ(trace_of(&fx, 1).count, 2);
    CHECK_EQ(trace_of(&fx, -1).count, 3);

    CHECK_EQ(npa_set_record_history(fx.a, 0), 0);
    alloc_exact(&fx, 0, 512);
    CHECK_EQ(trace_of(&fx, -1).count, 0);
    CHECK_EQ(npa_set_record_history(fx.a, SIZE_MAX / 2), -1); /* no such memory: all off, not half on */
    CHECK_EQ(npa_get_config(fx.a)->record_history, 0);
    alloc_exact(&fx, 0, 512);
    CHECK_EQ(trace_of(&fx, -1).count, 0);
    fixture_destroy(&fx);
}

/* torch's trace entries carry the stream of the block's pool: a block of
 * npa_malloc_stream's on stream 7 is 7 in its segment, alloc and free
 * events; a plain block's are 0 (they all read 0 once). */
static void test_events_carry_their_stream(void) {
    npa_config c = history_config(100);
    fixture fx;
    fake_init(&fx.fake, GiB, false);
    fx.fake.fences = true;
    fx.fake.stream_fences = true;
    fixture_start(&fx, &c);
    void *on = NULL;
    CHECK_EQ(npa_malloc_stream(fx.a, 0, 4096, NPA_ENTRY_EXACT, 7, NPA_STREAM_ORDERED, &on), NPA_OK);
    CHECK_EQ(npa_free_stream(fx.a, on, 7, 0, NULL), NPA_FREE_OK);
    void *plain = alloc_exact(&fx, 0, 4096);
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 6);
    static const npa_trace_action actions[] = {NPA_TRACE_SEGMENT_ALLOC, NPA_TRACE_ALLOC, NPA_TRACE_FREE_REQUESTED,
                                               NPA_TRACE_FREE_COMPLETED, NPA_TRACE_SEGMENT_ALLOC, NPA_TRACE_ALLOC};
    for (size_t i = 0; i < 6 && i < t.count; i++) {
        CHECK_EQ(t.entries[i].action, actions[i]);
        CHECK_EQ(t.entries[i].stream, i < 4 ? 7u : 0u);
    }
    CHECK_EQ(t.entries[5].addr, (uintptr_t)plain); /* its own segment: stream pools are not the plain one's */
    fixture_destroy(&fx);
}

static void test_oom_event_holds_free_bytes(void) {
    npa_config c = history_config(100);
    fixture fx;
    fixture_init(&fx, 64 * MiB, &c);
    void *p = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 100 * MiB, NPA_ENTRY_EXACT, &p), NPA_ERR_OOM);
    CHECK_EQ(fx.fake.oom_reports, 1);
    CHECK(strncmp(fx.fake.last_oom_report, "out of memory on device 0: ", 27) == 0);
    seen_trace t = trace_of(&fx, 0);
    CHECK(t.count >= 1);
    const npa_trace_view *oom = &t.entries[t.count - 1];
    check_entry(oom, NPA_TRACE_OOM, 64 * MiB, 100 * MiB); /* nothing used: all 64 MiB free */
    fixture_destroy(&fx);
}

static void test_snapshot_pickle_framing(void) {
    npa_config c = history_config(10);
    fixture fx;
    fixture_init(&fx, GiB, &c);
    alloc_exact(&fx, 0, 4096);
    size_t size = 0;
    unsigned char *data = npa_snapshot_pickle(fx.a, &c, &size);
    CHECK(data != NULL);
    CHECK(size > 100);
    if (data) {
        CHECK_EQ(data[0], 0x80); /* PROTO 2 */
        CHECK_EQ(data[1], 2);
        CHECK_EQ(data[size - 1], '.'); /* STOP */
    }
    free(data);
    unsigned char *empty = npa_snapshot_pickle(NULL, &c, &size); /* before the first allocation */
    CHECK(empty != NULL && size > 10);
    free(empty);
    fixture_destroy(&fx);
}

/* torch's snapshot() records a snapshot event once it has listed the
 * segments (addr 0, size the active bytes listed), so the traces of later
 * snapshots show where each fell (npualloc replay ends an iteration there).
 * The pickle holds the trace read before that event. */
static void test_a_snapshot_leaves_its_event_in_the_trace(void) {
    npa_config c = history_config(10);
    fixture fx;
    fixture_init(&fx, GiB, &c);
    void *p = alloc_exact(&fx, 0, 4096);
    void *q = alloc_exact(&fx, 0, 3 * MiB);
    alloc_exact(&fx, 0, 1024);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(trace_of(&fx, 0).count, 7); /* 2 segments, 3 allocs, the free's request and completion */
    size_t size = 0;
    free(npa_snapshot_pickle(fx.a, &c, &size));
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 8);
    check_entry(&t.entries[7], NPA_TRACE_SNAPSHOT, 0, 4096 + 1024); /* the 3 MiB block was freed */
    CHECK_EQ(t.entries[7].stream, 0);
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    free(npa_snapshot_pickle(fx.a, &c, &size));
    t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 10); /* its ring holds the last 10 */
    check_entry(&t.entries[9], NPA_TRACE_SNAPSHOT, 0, 1024);
    fixture_destroy(&fx);

    fixture_init(&fx, GiB, NULL); /* history off: nothing recorded */
    alloc_exact(&fx, 0, 4096);
    free(npa_snapshot_pickle(fx.a, &c, &size));
    CHECK_EQ(trace_of(&fx, 0).count, 0);
    fixture_destroy(&fx);
}

/* A backend that names the stack of the call under way call_stack, as the
 * hook's pystack names the Python stack taken at the entry. */
static uint32_t call_stack;

static uint32_t capture_call_stack(void *ctx) {
    (void)ctx;
    return call_stack;
}

static void visit_no_frames(void *ctx, uint32_t stack, npa_frame_visitor visit, void *arg) {
    (void)ctx, (void)stack, (void)visit, (void)arg;
}

/* fixture_start with that backend: fake options set after fake_init. */
static void start_with_call_stacks(fixture *fx, const npa_config *config) {
    npa_backend backend = fake_iface(&fx->fake);
    backend.capture_stack = capture_call_stack;
    backend.visit_stack = visit_no_frames;
    fx->a = npa_create(&backend, config);
    CHECK(fx->a != NULL);
}

/* Every event carries the stack of the call it happened in, as torch's
 * carry the context of theirs: a malloc's segment, alloc and OOM events its
 * own, a free's its own (none when the backend took none: the snapshot then
 * falls back on the alloc's), a free completed during a later malloc that
 * malloc's (torch's process_events), a segment given back by a malloc's
 * OOM retry that malloc's (torch's release_cached_blocks); a snapshot's
 * none. */
static void test_events_carry_the_stack_of_their_call(void) {
    npa_config c = history_config(100);
    fixture fx;
    fake_init(&fx.fake, 64 * MiB, false);
    fx.fake.fences = true; /* reuse_policy safe: a free completes at a later malloc */
    start_with_call_stacks(&fx, &c);
    call_stack = 7;
    void *p = alloc_exact(&fx, 0, 4096);
    call_stack = 0;
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    fake_complete_fences(&fx.fake);
    call_stack = 9;
    void *q = NULL;
    CHECK_EQ(npa_malloc(fx.a, 0, 100 * MiB, NPA_ENTRY_EXACT, &q), NPA_ERR_OOM);
    size_t size = 0;
    free(npa_snapshot_pickle(fx.a, &c, &size));
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 7);
    /* The OOM's retry gave the segment back: during that malloc too. */
    static const npa_trace_action actions[] = {NPA_TRACE_SEGMENT_ALLOC, NPA_TRACE_ALLOC, NPA_TRACE_FREE_REQUESTED,
                                               NPA_TRACE_FREE_COMPLETED, NPA_TRACE_SEGMENT_FREE, NPA_TRACE_OOM,
                                               NPA_TRACE_SNAPSHOT};
    static const uint32_t stacks[] = {7, 7, 0, 9, 9, 9, 0};
    for (size_t i = 0; i < 7 && i < t.count; i++) {
        CHECK_EQ(t.entries[i].action, actions[i]);
        CHECK_EQ(t.entries[i].stack, stacks[i]);
    }
    call_stack = 0;
    fixture_destroy(&fx);
}

/* torch's record_trace keeps an event's context only under ALLOC or ALL:
 * one recorded under record_context:state keeps its stack for the
 * snapshot's blocks and segments, and the trace shows none; the context in
 * force when each event was recorded decides, as in torch's entries. */
static void test_state_context_keeps_stacks_out_of_the_trace(void) {
    npa_config c = history_config(100);
    c.record_context = NPA_CONTEXT_STATE;
    fixture fx;
    fake_init(&fx.fake, 64 * MiB, false);
    start_with_call_stacks(&fx, &c);
    call_stack = 7;
    void *p = alloc_exact(&fx, 0, 4096);
    npa_set_record_context(fx.a, NPA_CONTEXT_ALLOC);
    void *q = alloc_exact(&fx, 0, 4096);
    call_stack = 0;
    seen_trace t = trace_of(&fx, 0);
    CHECK_EQ(t.count, 3); /* segment_alloc and alloc under state, alloc under alloc */
    for (size_t i = 0; i < 3 && i < t.count; i++) {
        CHECK_EQ(t.entries[i].stack, 7);
        CHECK_EQ(t.entries[i].stack_in_trace, i == 2);
    }
    CHECK_EQ(npa_free(fx.a, p, 0, NULL), NPA_FREE_OK);
    CHECK_EQ(npa_free(fx.a, q, 0, NULL), NPA_FREE_OK);
    fixture_destroy(&fx);
}

/* Recording, snapshots and run-time switches from several threads at once
 * (run under ThreadSanitizer by make ctest-tsan). */
typedef struct churn_arg {
    fixture *fx;
    int device;
} churn_arg;

static void *churn(void *arg) {
    churn_arg *c = arg;
    void *held[8] = {0};
    for (int i = 0; i < 4000; i++) {
        int slot = i % 8;
        if (held[slot]) CHECK_EQ(npa_free(c->fx->a, held[slot], c->device, NULL), NPA_FREE_OK);
        held[slot] = NULL;
        CHECK_EQ(npa_malloc(c->fx->a, c->device, (size_t)(512 + (i * 7919) % (3 * MiB)), NPA_ENTRY_EXACT,
                            &held[slot]), NPA_OK);
    }
    for (int slot = 0; slot < 8; slot++)
        if (held[slot]) npa_free(c->fx->a, held[slot], c->device, NULL);
    return NULL;
}

static void count_events(const npa_trace_view *e, void *arg) {
    (void)e;
    (*(size_t *)arg)++;
}

static void test_concurrent_recording_and_snapshots(void) {
    npa_config c = history_config(64);
    fixture fx;
    fixture_init(&fx, GiB, &c);
    churn_arg args[2] = {{&fx, 0}, {&fx, 1}};
    pthread_t threads[2];
    for (int i = 0; i < 2; i++) pthread_create(&threads[i], NULL, churn, &args[i]);
    for (int i = 0; i < 200; i++) {
        size_t size = 0;
        free(npa_snapshot_pickle(fx.a, &c, &size));
        size_t events = 0;
        npa_visit_trace(fx.a, -1, count_events, &events);
        CHECK(events <= 2 * 64);
        if (i % 50 == 0) CHECK_EQ(npa_set_record_history(fx.a, (size_t)(i % 100 ? 16 : 64)), 0);
    }
    for (int i = 0; i < 2; i++) pthread_join(threads[i], NULL);
    fixture_destroy(&fx);
}

int main(void) {
    RUN(test_off_by_default);
    RUN(test_actions_and_sizes_in_order);
    RUN(test_free_completes_after_its_fence);
    RUN(test_ring_keeps_the_newest_and_wraps);
    RUN(test_run_time_switch_restarts_the_ring);
    RUN(test_events_carry_their_stream);
    RUN(test_oom_event_holds_free_bytes);
    RUN(test_snapshot_pickle_framing);
    RUN(test_a_snapshot_leaves_its_event_in_the_trace);
    RUN(test_events_carry_the_stack_of_their_call);
    RUN(test_state_context_keeps_stacks_out_of_the_trace);
    RUN(test_concurrent_recording_and_snapshots);
    return check_report();
}
