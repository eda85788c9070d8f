/* Blocks recorded on other streams are asked for out of order (pending.c,
 * drain_batches: a batch waiting on a busy stream does not hold back later
 * ones). The property that must survive it: no block is handed out again
 * before every event its fence put on the streams it was recorded on has
 * completed, whatever order the streams complete in. Random sequences of
 * stream mallocs, record_streams, frees, polls and partial stream
 * completions over the fake backend, each handed-out block checked against
 * the blocks still unsafe. Written from a review's stress test. */
#include <stdlib.h>

#include "check.h"
#include "fake_backend.h"
#include "test_util.h"

#define SEEDS 8
#define OPS 5000
#define MAX_LIVE 1024

typedef struct live_block {
    uintptr_t addr;
    size_t size;
    uintptr_t stream;        /* allocated and freed on it */
    unsigned uses;           /* bit u: recorded on stream u */
} live_block;

/* A freed block recorded on other streams: unsafe until each of those
 * streams has completed the event recorded after its free. */
typedef struct unsafe_block {
    uintptr_t addr;
    size_t size;
    unsigned uses;
    unsigned long long needed[FAKE_STREAMS];
} unsafe_block;

static live_block live[MAX_LIVE];
static unsafe_block unsafe[MAX_LIVE * 4];
static size_t live_count, unsafe_count;
static long handed_out_unsafe;

static bool now_safe(const fake_backend *fake, const unsafe_block *u) {
    for (int s = 0; s < FAKE_STREAMS; s++)
        if ((u->uses >> s & 1) && fake->stream_completed[s] < u->needed[s]) return false;
    return true;
}

/* Forgets the blocks that became safe, then counts p's overlaps with the rest. */
static void check_handed_out(const fake_backend *fake, uintptr_t p, size_t size) {
    for (size_t i = 0; i < unsafe_count;)
        if (now_safe(fake, &unsafe[i])) unsafe[i] = unsafe[--unsafe_count];
        else i++;
    for (size_t i = 0; i < unsafe_count; i++)
        if (p < unsafe[i].addr + unsafe[i].size && unsafe[i].addr < p + size) handed_out_unsafe++;
}

static void allocate(fixture *fx) {
    static const size_t sizes[] = {512, 4096, 100000, 1 << 20, 3 << 20};
    uintptr_t stream = 1 + (uintptr_t)(rand() % 3);
    size_t size = sizes[rand() % 5];
    void *p = NULL;
    CHECK_EQ(npa_malloc_stream(fx->a, 0, size, NPA_ENTRY_EXACT, stream, 0, &p), NPA_OK);
    check_handed_out(&fx->fake, (uintptr_t)p, size);
    live[live_count++] = (live_block){.addr = (uintptr_t)p, .size = size, .stream = stream};
}

static void record(fixture *fx) {
    live_block *b = &live[rand() % live_count];
    uintptr_t other = 1 + (uintptr_t)(rand() % (FAKE_STREAMS - 1));
    if (other == b->stream) return;
    CHECK_EQ(npa_record_stream(fx->a, (void *)b->addr, other, 0), NPA_OK);
    b->uses |= 1u << other;
}

static void free_one(fixture *fx) {
    size_t i = (size_t)rand() % live_count;
    live_block b = live[i];
    live[i] = live[--live_count];
    CHECK_EQ(npa_free_stream(fx->a, (void *)b.addr, b.stream, 0, NULL), NPA_FREE_OK);
    if (b.uses) {
        unsafe_block u = {.addr = b.addr, .size = b.size, .uses = b.uses};
        for (int s = 0; s < FAKE_STREAMS; s++) u.needed[s] = fx->fake.stream_recorded[s] + 1;
        unsafe[unsafe_count++] = u;
    }
    if (rand() % 2) npa_process_pending(fx->a, 0);
}

/* Some of a stream's recorded events complete, in order. */
static void complete_some(fixture *fx) {
    int s = 1 + rand() % (FAKE_STREAMS - 1);
    unsigned long long done = fx->fake.stream_completed[s], recorded = fx->fake.stream_recorded[s];
    if (recorded > done && rand() % 4 != 0)
        fx->fake.stream_completed[s] = done + 1 + (unsigned long long)rand() % (recorded - done);
}

static void run_seed(unsigned seed) {
    fixture fx;
    fake_init(&fx.fake, 64 * GiB, false);
    fx.fake.fences = true;
    fx.fake.stream_fences = true;
    fixture_start(&fx, NULL);
    srand(seed);
    live_count = unsafe_count = 0;
    for (int op = 0; op < OPS; op++) {
        int r = rand() % 100;
        if (r < 30 && live_count < MAX_LIVE) allocate(&fx);
        else if (r < 50 && live_count) record(&fx);
        else if (r < 75 && live_count) free_one(&fx);
        else if (r < 90) complete_some(&fx);
        else npa_process_pending(fx.a, 0);
    }
    CHECK(fx.fake.stream_fence_records > 0); /* the sequences did fence */
    while (live_count) free_one(&fx);
    fixture_destroy(&fx);
}

static void test_no_block_is_handed_out_before_its_streams_are_done(void) {
    for (unsigned seed = 1; seed <= SEEDS; seed++) run_seed(seed);
    CHECK_EQ(handed_out_unsafe, 0);
}

int main(void) {
    RUN(test_no_block_is_handed_out_before_its_streams_are_done);
    return check_report();
}
