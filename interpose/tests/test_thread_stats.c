/* A device's stats stay exact with threads, as issue 14's per-thread caches
 * (fast paths outside the device lock, per-thread stat slots) must keep
 * them. Each scenario runs its steps on worker threads that stay alive in
 * between (so a per-thread cache keeps what each one freed), one step at a
 * time, and after each the main thread holds the stats against what the
 * test itself counted: currents against the blocks the threads hold,
 * accumulated counts against their mallocs and frees, peaks against the
 * most they held together, the segment and split figures against the
 * snapshot. Then a reader races two and four allocating threads, asserting
 * what every read must satisfy. Through the public core API only (and the
 * reader library on the stats storage), so the tests hold whatever the
 * core does inside. */
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fake_backend.h"
#include "npualloc_reader.h"
#include "test_util.h"

#define ENTRY NPA_ENTRY_MALLOC /* make bench's entry: aclrtMalloc's */
#define WORKERS_MAX 4

/* --- what the test counts ----------------------------------------------- */

/* Blocks, their bytes and the bytes asked for, per pool (NPUALLOC_POOL_*,
 * [ALL] the sum of the other two). The bytes a malloc counts are its
 * block's, which for a large one may pass the request's rounded size by up
 * to 1 MiB (torch's rule: a block is split only when more than 1 MiB would
 * be left over), so what the test counts itself is the rounded size, a
 * lower bound; the bytes of the blocks held it reads from the snapshot. */
enum { BLOCKS, BYTES, REQUESTED, TALLIED };
typedef struct tally {
    int64_t of[TALLIED][NPUALLOC_POOL_COUNT];
} tally;

/* What one thread did: what it holds (a block it freed for another thread
 * counts as minus one), its mallocs and frees, and its frees refused, since
 * the last reset of the accumulated stats. */
typedef struct ledger {
    tally live, mallocs, frees;
    int64_t refused;
} ledger;

static void tally_add(tally *t, const npa_allocator *a, size_t size, int64_t sign) {
    size_t rounded = npa_round_size(npa_get_config(a), npa_entry_size(ENTRY, size));
    int pool = rounded <= MiB ? NPUALLOC_POOL_SMALL : NPUALLOC_POOL_LARGE; /* torch's kSmallSize */
    const int pools[] = {NPUALLOC_POOL_ALL, pool};
    for (int i = 0; i < 2; i++) {
        t->of[BLOCKS][pools[i]] += sign;
        t->of[BYTES][pools[i]] += sign * (int64_t)rounded;
        t->of[REQUESTED][pools[i]] += sign * (int64_t)size;
    }
}

static void tally_sum(tally *into, const tally *t) {
    for (int f = 0; f < TALLIED; f++)
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++) into->of[f][pool] += t->of[f][pool];
}

static void tally_max(tally *into, const tally *t) {
    for (int f = 0; f < TALLIED; f++)
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++)
            if (t->of[f][pool] > into->of[f][pool]) into->of[f][pool] = t->of[f][pool];
}

/* The stats a malloc raises and its free lowers, eager (no free waits for a
 * fence, so active follows allocated), with the figure each one follows. */
static const struct {
    size_t offset;
    int figure;
    const char *name;
} block_stats[] = {
    {offsetof(npualloc_device_stats, allocation), BLOCKS, "allocation"},
    {offsetof(npualloc_device_stats, active), BLOCKS, "active"},
    {offsetof(npualloc_device_stats, allocated_bytes), BYTES, "allocated_bytes"},
    {offsetof(npualloc_device_stats, active_bytes), BYTES, "active_bytes"},
    {offsetof(npualloc_device_stats, requested_bytes), REQUESTED, "requested_bytes"},
};
#define BLOCK_STATS (sizeof block_stats / sizeof *block_stats)

static const npualloc_stat *stat_at(const npualloc_device_stats *s, size_t offset) {
    return (const npualloc_stat *)((const char *)s + offset);
}

/* A large block's bytes past its request's rounded size: at most 1 MiB. */
static int64_t rounding_slack(const tally *t, int pool) {
    return pool == NPUALLOC_POOL_SMALL ? 0 : t->of[BLOCKS][NPUALLOC_POOL_LARGE] * (int64_t)MiB;
}

/* A CHECK that names the stat, its index (a pool, or the place in the stat
 * run; -1: none), the field and the range [low, low + slack]. */
static void expect_within(int line, const char *stat, int index, const char *field, int64_t actual, int64_t low,
                          int64_t slack) {
    if (actual >= low && actual <= low + slack) return;
    check_failures++;
    fprintf(stderr, "%s:%d: %s[%d].%s == %lld, expected %lld", __FILE__, line, stat, index, field,
            (long long)actual, (long long)low);
    if (slack != 0) fprintf(stderr, " to %lld", (long long)(low + slack));
    fputc('\n', stderr);
}

/* expect_within with no slack: a CHECK_EQ that names what it checks. */
static void expect(int line, const char *stat, int index, const char *field, int64_t actual, int64_t expected) {
    expect_within(line, stat, index, field, actual, expected, 0);
}

/* --- worker threads, one job at a time ------------------------------------ */

typedef struct worker worker;
typedef void (*job_fn)(worker *w, void *arg);

struct worker {
    char name;         /* 'A', 'B' ...: in failure messages */
    npa_allocator *a;
    ledger ledger;     /* its thread writes it while a job runs, the main thread reads it between jobs */
    int failures;      /* EXPECTs that failed in its jobs, checked by the main thread after each */
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    job_fn job;        /* posted and not done yet; NULL: idle */
    void *arg;
    bool stop, stopped;
};

/* In a job: a failed condition is counted for the main thread to find. */
#define EXPECT(w, cond)                                                                                 \
    do {                                                                                                \
        if (!(cond)) {                                                                                  \
            (w)->failures++;                                                                            \
            fprintf(stderr, "%s:%d: failed on thread %c: %s\n", __FILE__, __LINE__, (w)->name, #cond); \
        }                                                                                               \
    } while (0)

static void *worker_main(void *opaque) {
    worker *w = opaque;
    pthread_mutex_lock(&w->lock);
    for (;;) {
        while (!w->job && !w->stop) pthread_cond_wait(&w->changed, &w->lock);
        if (!w->job) break;
        job_fn job = w->job;
        void *arg = w->arg;
        pthread_mutex_unlock(&w->lock);
        job(w, arg);
        pthread_mutex_lock(&w->lock);
        w->job = NULL;
        pthread_cond_broadcast(&w->changed);
    }
    pthread_mutex_unlock(&w->lock);
    return NULL;
}

static void worker_start(worker *w, char name, npa_allocator *a) {
    memset(w, 0, sizeof *w);
    w->name = name;
    w->a = a;
    pthread_mutex_init(&w->lock, NULL);
    pthread_cond_init(&w->changed, NULL);
    CHECK_EQ(pthread_create(&w->thread, NULL, worker_main, w), 0);
}

static void worker_post(worker *w, job_fn job, void *arg) {
    pthread_mutex_lock(&w->lock);
    w->job = job;
    w->arg = arg;
    pthread_cond_broadcast(&w->changed);
    pthread_mutex_unlock(&w->lock);
}

static bool worker_busy(worker *w) {
    pthread_mutex_lock(&w->lock);
    bool busy = w->job != NULL;
    pthread_mutex_unlock(&w->lock);
    return busy;
}

/* Waits until the job posted is done; its failures fail the test. */
static void worker_wait(worker *w) {
    pthread_mutex_lock(&w->lock);
    while (w->job) pthread_cond_wait(&w->changed, &w->lock);
    int failed_on_the_thread = w->failures;
    w->failures = 0;
    pthread_mutex_unlock(&w->lock);
    CHECK_EQ(failed_on_the_thread, 0);
}

/* The thread exits (whatever its cache holds is its exit's to settle); its
 * ledger stays. */
static void worker_stop(worker *w) {
    if (w->stopped) return;
    pthread_mutex_lock(&w->lock);
    w->stop = true;
    pthread_cond_broadcast(&w->changed);
    pthread_mutex_unlock(&w->lock);
    CHECK_EQ(pthread_join(w->thread, NULL), 0);
    pthread_cond_destroy(&w->changed);
    pthread_mutex_destroy(&w->lock);
    w->stopped = true;
}

/* --- jobs: blocks taken and given back ------------------------------------ */

#define SET_MAX 8
/* Sizes, up to the first 0, and the last blocks taken for them (kept after
 * they are given back, for the double frees). */
typedef struct block_set {
    size_t sizes[SET_MAX];
    void *blocks[SET_MAX];
} block_set;

static void take(worker *w, void **block, size_t size) {
    npa_error err = npa_malloc(w->a, 0, size, ENTRY, block);
    EXPECT(w, err == NPA_OK);
    if (err != NPA_OK) {
        *block = NULL;
        return;
    }
    tally_add(&w->ledger.live, w->a, size, 1);
    tally_add(&w->ledger.mallocs, w->a, size, 1);
}

static void give(worker *w, void *block, size_t size) {
    EXPECT(w, npa_free(w->a, block, 0, NULL) == NPA_FREE_OK);
    tally_add(&w->ledger.live, w->a, size, -1);
    tally_add(&w->ledger.frees, w->a, size, 1);
}

static void take_set(worker *w, void *arg) {
    block_set *set = arg;
    for (int i = 0; i < SET_MAX && set->sizes[i]; i++) take(w, &set->blocks[i], set->sizes[i]);
}

static void give_set(worker *w, void *arg) {
    block_set *set = arg;
    for (int i = 0; i < SET_MAX && set->sizes[i]; i++) give(w, set->blocks[i], set->sizes[i]);
}

/* Frees the set's blocks again, freed already: each one refused. */
static void give_set_again(worker *w, void *arg) {
    block_set *set = arg;
    for (int i = 0; i < SET_MAX && set->sizes[i]; i++) {
        EXPECT(w, npa_free(w->a, set->blocks[i], 0, NULL) == NPA_FREE_INVALID);
        w->ledger.refused++;
    }
}

/* --- a scene: one allocator, its workers, and the checks between steps ---- */

typedef struct scene {
    fixture fx;
    worker workers[WORKERS_MAX];
    int count;
    tally peak; /* the most the workers held together since the last peak reset (held_now) */
} scene;

/* region: where the device's stats are kept, for readers of it (NULL: the
 * fake backend's own storage). */
static void scene_start(scene *sc, size_t capacity, int workers, npualloc_region *region) {
    memset(sc, 0, sizeof *sc);
    fake_init(&sc->fx.fake, capacity, false);
    if (region) { /* the device's figures and its threads' slots, where a reader finds them */
        sc->fx.fake.stats[0] = &region->devices[0];
        sc->fx.fake.threads[0] = region->threads[0];
    }
    fixture_start(&sc->fx, NULL);
    sc->count = workers;
    for (int i = 0; i < workers; i++) worker_start(&sc->workers[i], (char)('A' + i), sc->fx.a);
}

static void scene_stop(scene *sc) {
    for (int i = 0; i < sc->count; i++) worker_stop(&sc->workers[i]);
    fixture_destroy(&sc->fx);
}

static ledger scene_ledger(const scene *sc) {
    ledger sum;
    memset(&sum, 0, sizeof sum);
    for (int i = 0; i < sc->count; i++) {
        tally_sum(&sum.live, &sc->workers[i].ledger.live);
        tally_sum(&sum.mallocs, &sc->workers[i].ledger.mallocs);
        tally_sum(&sum.frees, &sc->workers[i].ledger.frees);
        sum.refused += sc->workers[i].ledger.refused;
    }
    return sum;
}

/* What the workers hold together now: blocks and requested bytes by the
 * test's count, bytes by the snapshot's (checked against each other by
 * check_figures). */
static tally held_now(const scene *sc, const block_totals *blocks) {
    tally held = scene_ledger(sc).live;
    for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++) held.of[BYTES][pool] = blocks->allocated_bytes[pool];
    return held;
}

/* With every worker idle: each current is what the workers hold, each
 * accumulated count what they did (bytes within the rounding's slack), and
 * the blocks held, segment and split figures are what the snapshot shows. */
static void check_figures(scene *sc, int line) {
    ledger sum = scene_ledger(sc);
    npualloc_device_stats s = stats_of(&sc->fx, 0);
    block_totals blocks = blocks_of(&sc->fx, 0);
    for (size_t i = 0; i < BLOCK_STATS; i++) {
        const npualloc_stat *st = stat_at(&s, block_stats[i].offset);
        const char *name = block_stats[i].name;
        int f = block_stats[i].figure;
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++) {
            if (f == BYTES) { /* current: against the snapshot, below */
                expect_within(line, name, pool, "allocated", st[pool].allocated, sum.mallocs.of[f][pool],
                              rounding_slack(&sum.mallocs, pool));
                expect_within(line, name, pool, "freed", st[pool].freed, sum.frees.of[f][pool],
                              rounding_slack(&sum.frees, pool));
                continue;
            }
            expect(line, name, pool, "current", st[pool].current, sum.live.of[f][pool]);
            expect(line, name, pool, "allocated", st[pool].allocated, sum.mallocs.of[f][pool]);
            expect(line, name, pool, "freed", st[pool].freed, sum.frees.of[f][pool]);
        }
    }
    for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++) {
        expect(line, "blocks held (snapshot)", pool, "", blocks.allocated_blocks[pool], sum.live.of[BLOCKS][pool]);
        expect_within(line, "bytes held (snapshot)", pool, "", blocks.allocated_bytes[pool],
                      sum.live.of[BYTES][pool], rounding_slack(&sum.live, pool));
    }
    const struct {
        const npualloc_stat *stat;
        const long long *blocks;
        const char *name;
    } seen[] = {
        {s.segment, blocks.segments, "segment"},
        {s.reserved_bytes, blocks.reserved_bytes, "reserved_bytes"},
        {s.allocated_bytes, blocks.allocated_bytes, "allocated_bytes"},
        {s.active_bytes, blocks.active_bytes, "active_bytes"},
        {s.requested_bytes, blocks.requested_bytes, "requested_bytes"},
        {s.inactive_split, blocks.inactive_split, "inactive_split"},
        {s.inactive_split_bytes, blocks.inactive_split_bytes, "inactive_split_bytes"},
    };
    for (size_t i = 0; i < sizeof seen / sizeof *seen; i++)
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++)
            expect(line, seen[i].name, pool, "current (snapshot)", seen[i].stat[pool].current, seen[i].blocks[pool]);
    expect(line, "largest_free_block", -1, "(snapshot)", s.largest_free_block, blocks.largest_free);
    expect(line, "num_invalid_frees", -1, "", s.num_invalid_frees, sum.refused);
    expect(line, "num_cache_hits + num_cache_misses", -1, "", s.num_cache_hits + s.num_cache_misses,
           s.allocation[NPUALLOC_POOL_ALL].allocated);
}

/* With every worker idle after a step that only took or only gave back
 * blocks (so the most held during it was at one of its ends): each peak is
 * the most the workers held together at the end of a step so far. */
static void check_peaks(scene *sc, int line) {
    block_totals blocks = blocks_of(&sc->fx, 0);
    tally held = held_now(sc, &blocks);
    tally_max(&sc->peak, &held);
    npualloc_device_stats s = stats_of(&sc->fx, 0);
    for (size_t i = 0; i < BLOCK_STATS; i++) {
        const npualloc_stat *st = stat_at(&s, block_stats[i].offset);
        for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++)
            expect(line, block_stats[i].name, pool, "peak", st[pool].peak, sc->peak.of[block_stats[i].figure][pool]);
    }
}

/* One step: the job on w's thread, then every figure checked. */
static void run_step(scene *sc, worker *w, job_fn job, void *arg, int line) {
    worker_post(w, job, arg);
    worker_wait(w);
    check_figures(sc, line);
    check_peaks(sc, line);
}
#define STEP(sc, w, job, arg) run_step(sc, w, job, arg, __LINE__)

/* Peaks reset with blocks held: each one reads what is held now, every stat
 * of the run (segments, reserved and split figures too). */
static void reset_peaks(scene *sc, int line) {
    npa_reset_peak_stats(sc->fx.a, 0);
    block_totals blocks = blocks_of(&sc->fx, 0);
    sc->peak = held_now(sc, &blocks);
    npualloc_device_stats s = stats_of(&sc->fx, 0);
    const npualloc_stat *run = &s.allocation[0];
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++)
        expect(line, "the run's stat", i, "peak - current", run[i].peak - run[i].current, 0);
    check_peaks(sc, line);
}

/* Accumulated counts reset with blocks held: every one reads 0, currents stay. */
static void reset_accumulated(scene *sc, int line) {
    npa_reset_accumulated_stats(sc->fx.a, 0);
    for (int i = 0; i < sc->count; i++) {
        ledger *l = &sc->workers[i].ledger;
        memset(&l->mallocs, 0, sizeof l->mallocs);
        memset(&l->frees, 0, sizeof l->frees);
        l->refused = 0;
    }
    npualloc_device_stats s = stats_of(&sc->fx, 0);
    const npualloc_stat *run = &s.allocation[0];
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) {
        expect(line, "the run's stat", i, "allocated", run[i].allocated, 0);
        expect(line, "the run's stat", i, "freed", run[i].freed, 0);
    }
    check_figures(sc, line);
}

/* --- the scenarios ---------------------------------------------------------- */

/* Peaks are the most the threads held together, exactly, also when the
 * blocks that make the peak come from each thread's cache: A takes and
 * gives back X1 and X2, B takes and gives back Y, then A takes X1 and B Y
 * again, each the sizes it freed itself. Y outweighs X2 in every pool, in
 * blocks, bytes and requested bytes, so the peak X1 + Y passes A's own most
 * (X1 + X2) and B's (Y): neither a sum of per-thread peaks (X1 + X2 + Y) nor
 * their largest is the answer. Then peaks reset while A holds part of X1:
 * each reads what is held, and B's Y, again from its cache, raises them by
 * exactly Y. Every step is checked (check_peaks). */
static void test_peaks_are_what_the_threads_held_together(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, 2, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1];
    block_set x1_kept = {.sizes = {1000, 3 * MiB + 100}}, x1_given = {.sizes = {40000, 7 * MiB}};
    block_set x2 = {.sizes = {2000, 5 * MiB}};
    block_set y = {.sizes = {3000, 60000, 4 * MiB, 6 * MiB}};
    STEP(&sc, a, take_set, &x1_kept);
    STEP(&sc, a, take_set, &x1_given);
    STEP(&sc, a, take_set, &x2);
    STEP(&sc, a, give_set, &x1_kept);
    STEP(&sc, a, give_set, &x1_given);
    STEP(&sc, a, give_set, &x2);
    STEP(&sc, b, take_set, &y);
    STEP(&sc, b, give_set, &y);
    STEP(&sc, a, take_set, &x1_kept);
    STEP(&sc, a, take_set, &x1_given);
    STEP(&sc, b, take_set, &y); /* the peak: X1 + Y */

    STEP(&sc, a, give_set, &x1_given);
    STEP(&sc, b, give_set, &y);
    reset_peaks(&sc, __LINE__); /* A holds x1_kept */
    STEP(&sc, b, take_set, &y);
    STEP(&sc, b, give_set, &y);
    STEP(&sc, a, give_set, &x1_kept);
    scene_stop(&sc);
}

/* Accumulated counts reset while threads hold blocks (taken from their
 * caches): from there allocated and freed count only what came after, by
 * whichever thread, and currents never move. */
static void test_accumulated_counts_reset_with_blocks_held(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, 2, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1];
    block_set sa = {.sizes = {1000, 12288, 2 * MiB + 100}}, sb = {.sizes = {192, 49152, 9 * MiB}};
    STEP(&sc, a, take_set, &sa);
    STEP(&sc, a, give_set, &sa);
    STEP(&sc, a, take_set, &sa);
    STEP(&sc, b, take_set, &sb);
    reset_accumulated(&sc, __LINE__);
    STEP(&sc, a, give_set, &sa);
    STEP(&sc, b, give_set, &sb);
    STEP(&sc, b, take_set, &sb);
    STEP(&sc, a, take_set, &sa);
    STEP(&sc, a, give_set, &sb); /* each frees the other's */
    STEP(&sc, b, give_set, &sa);
    scene_stop(&sc);
}

/* Blocks one thread took from its own cache, freed by another thread (and
 * the other way round): the figures stay the sum of what both did, every
 * step, and the blocks freed so serve either thread again without ever
 * being handed out twice (a block held twice would show in the snapshot's
 * figures against the stats'). */
static void test_blocks_freed_by_another_thread(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, 2, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1];
    block_set sa = {.sizes = {1000, 3000, 65536, 3 * MiB + 100}};
    block_set sb = {.sizes = {2000, 12288, 1 * MiB, 12 * MiB}};
    STEP(&sc, a, take_set, &sa);
    STEP(&sc, a, give_set, &sa);
    STEP(&sc, a, take_set, &sa); /* A's cache lent them */
    STEP(&sc, b, take_set, &sb);
    STEP(&sc, b, give_set, &sb);
    STEP(&sc, b, take_set, &sb);
    STEP(&sc, b, give_set, &sa);
    STEP(&sc, a, give_set, &sb);
    STEP(&sc, a, take_set, &sb); /* the sizes the other thread freed */
    STEP(&sc, b, take_set, &sa);
    STEP(&sc, a, give_set, &sb);
    STEP(&sc, b, give_set, &sa);
    scene_stop(&sc);
}

/* A second free of a block that was freed and waits in a cache is refused
 * (NPA_FREE_INVALID) and counted in num_invalid_frees, by the thread that
 * freed it or by another, also when another thread freed it the first
 * time; and the refused frees put nothing in any cache: the blocks taken
 * after are all distinct (the snapshot's figures against the stats'). */
static void test_double_frees_of_cached_blocks_are_refused(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, 2, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1];
    block_set s = {.sizes = {1000, 40000, 3 * MiB + 100}}, again = {.sizes = {1000, 40000, 3 * MiB + 100}};
    STEP(&sc, a, take_set, &s);
    STEP(&sc, a, give_set, &s);
    STEP(&sc, a, give_set_again, &s);
    STEP(&sc, b, give_set_again, &s);
    STEP(&sc, a, take_set, &s); /* from A's cache */
    STEP(&sc, b, give_set, &s);
    STEP(&sc, a, give_set_again, &s);
    STEP(&sc, b, give_set_again, &s);
    STEP(&sc, a, take_set, &s);
    STEP(&sc, a, take_set, &again);
    STEP(&sc, a, give_set, &again);
    STEP(&sc, b, take_set, &again);
    CHECK_EQ(stats_of(&sc.fx, 0).num_invalid_frees, 12);
    STEP(&sc, b, give_set, &s);
    STEP(&sc, a, give_set, &again);
    scene_stop(&sc);
}

/* A thread that exits holding blocks, some taken from its cache, and
 * others freed into it: its blocks stay live (another thread taking the
 * same sizes gets other blocks) and freeable by another thread, what it
 * cached serves others, the figures stay exact at every step, and once
 * everything is freed and the cache emptied every segment is given back:
 * reserved 0, as many raw frees as raw mallocs, the device's memory all
 * free. Then B exits the same way and C frees what it held. */
static void test_a_thread_that_exits_holding_blocks(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, 3, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1], *c = &sc.workers[2];
    block_set live = {.sizes = {1000, 50000, 3 * MiB + 100}}, cached = {.sizes = {3000, 7000, 5 * MiB}};
    block_set same_sizes = {.sizes = {1000, 50000, 3 * MiB + 100}};
    STEP(&sc, a, take_set, &live);
    STEP(&sc, a, give_set, &live);
    STEP(&sc, a, take_set, &live); /* from A's cache */
    STEP(&sc, a, take_set, &cached);
    STEP(&sc, a, give_set, &cached);
    worker_stop(a);
    check_figures(&sc, __LINE__);
    STEP(&sc, b, take_set, &same_sizes);
    STEP(&sc, b, give_set, &live);
    STEP(&sc, b, take_set, &cached);
    STEP(&sc, b, give_set, &same_sizes);
    worker_stop(b); /* holding cached's blocks, with same_sizes' freed */
    check_figures(&sc, __LINE__);
    STEP(&sc, c, give_set, &cached);

    CHECK_EQ(npa_empty_cache(sc.fx.a, 0), NPA_OK);
    check_figures(&sc, __LINE__);
    npualloc_device_stats s = stats_of(&sc.fx, 0);
    CHECK_EQ(s.reserved_bytes[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.segment[NPUALLOC_POOL_ALL].current, 0);
    CHECK_EQ(s.num_device_free, s.num_device_alloc);
    CHECK_EQ(s.largest_free_block, 0);
    CHECK(sc.fx.fake.raw_malloc_calls > 0);
    CHECK_EQ(sc.fx.fake.raw_free_calls, sc.fx.fake.raw_malloc_calls);
    CHECK_EQ(sc.fx.fake.bad_frees, 0);
    CHECK_EQ(fake_used(&sc.fx.fake, 0), 0);
    scene_stop(&sc);
}

/* A device too small for both: what thread A freed and its cache may hold
 * is found by thread B's malloc that needs the memory (merged back for it,
 * or released by the OOM retry), while A lives on. merged: the small pool's
 * miss merges what the caches hold before it grows, so no OOM retry is
 * needed either. */
static void run_needed_memory(size_t capacity, block_set held, block_set needed, bool merged) {
    scene sc;
    scene_start(&sc, capacity, 2, NULL);
    worker *a = &sc.workers[0], *b = &sc.workers[1];
    STEP(&sc, a, take_set, &held);
    STEP(&sc, a, give_set, &held);
    STEP(&sc, b, take_set, &needed);
    npualloc_device_stats s = stats_of(&sc.fx, 0);
    CHECK_EQ(s.num_ooms, 0);
    CHECK_EQ(sc.fx.fake.oom_reports, 0);
    if (merged) CHECK_EQ(s.num_alloc_retries, 0);
    STEP(&sc, b, give_set, &needed);
    scene_stop(&sc);
}

static void test_memory_a_thread_cached_serves_another(void) {
    /* A's three small blocks fill one 2 MiB segment; its two large ones, one 20 MiB segment. */
    const block_set small = {.sizes = {600 * KiB, 600 * KiB, 600 * KiB}}, large = {.sizes = {8 * MiB, 8 * MiB}};
    /* Small for small: on a 2 MiB device, 900 KiB fits only where A's blocks were, merged. */
    run_needed_memory(2 * MiB, small, (block_set){.sizes = {900 * KiB}}, true);
    /* Large for large: on a 20 MiB device, 16 MiB fits only where A's blocks were. */
    run_needed_memory(20 * MiB, large, (block_set){.sizes = {16 * MiB}}, false);
    /* Small for large: A's small segment must go for B's 20 MiB one. */
    run_needed_memory(20 * MiB, small, (block_set){.sizes = {18 * MiB + 1}}, false);
    /* Large for small: A's large segment must go for B's small one. */
    run_needed_memory(20 * MiB, large, (block_set){.sizes = {600 * KiB}}, false);
}

/* --- threads churning --------------------------------------------------------- */

#define CHURN_SLOTS 16
#define ROUNDS 12
#define OPS_PER_ROUND 1000

/* make bench's commonest sizes (tools/bench/trace_sizes.txt), every thread's, */
static const size_t shared_sizes[] = {16, 192, 12288, 12288, 49152, 2359296};
/* and each thread's own: about one call in five is above 1 MiB, as there. */
static const size_t own_sizes[WORKERS_MAX][3] = {
    {8, 3072, 9437184}, {4, 36864, 4194304}, {256, 2048, 1572864}, {1024, 786432, 8388608}};

/* One worker's random mallocs and frees over its slots, each slot with a
 * size of its own (so the size just freed is soon taken again, from the
 * thread's cache), over more slots each round (so what the threads hold
 * together keeps reaching new peaks, through cache hits too). */
typedef struct churn {
    int rounds;
    uint64_t rng;
    void *blocks[CHURN_SLOTS];
    size_t sizes[CHURN_SLOTS];
} churn;

static uint64_t next_random(uint64_t *state) {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

static void churn_round(worker *w, void *arg) {
    churn *c = arg;
    int slots = c->rounds + 4 < CHURN_SLOTS ? c->rounds + 4 : CHURN_SLOTS;
    for (int op = 0; op < OPS_PER_ROUND; op++) {
        int slot = (int)(next_random(&c->rng) % (uint64_t)slots);
        if (c->blocks[slot]) {
            give(w, c->blocks[slot], c->sizes[slot]);
            c->blocks[slot] = NULL;
        } else {
            take(w, &c->blocks[slot], c->sizes[slot]);
        }
    }
    c->rounds++;
}

static void churn_release(worker *w, void *arg) {
    churn *c = arg;
    for (int slot = 0; slot < CHURN_SLOTS; slot++)
        if (c->blocks[slot]) give(w, c->blocks[slot], c->sizes[slot]);
    memset(c->blocks, 0, sizeof c->blocks);
}

static void churn_init(churn *c, int index) {
    memset(c, 0, sizeof *c);
    c->rng = 0x9e3779b97f4a7c15ULL * (uint64_t)(index + 1);
    for (int slot = 0; slot < CHURN_SLOTS; slot++) {
        uint64_t r = next_random(&c->rng);
        c->sizes[slot] = r % 3 == 0 ? own_sizes[index][r / 3 % 3] : shared_sizes[r / 3 % 6];
    }
}

/* After threads that allocated and freed concurrently went idle, holding
 * blocks and with blocks in their caches: every current is what they hold,
 * allocated and freed what they did, the split figures what the snapshot
 * shows; and again once they freed everything. */
static void test_figures_are_exact_once_threads_are_idle(void) {
    scene sc;
    scene_start(&sc, 64 * GiB, WORKERS_MAX, NULL);
    churn churns[WORKERS_MAX];
    for (int i = 0; i < WORKERS_MAX; i++) churn_init(&churns[i], i);
    for (int round = 0; round < ROUNDS / 3; round++) {
        for (int i = 0; i < WORKERS_MAX; i++) worker_post(&sc.workers[i], churn_round, &churns[i]);
        for (int i = 0; i < WORKERS_MAX; i++) worker_wait(&sc.workers[i]);
        check_figures(&sc, __LINE__);
    }
    for (int i = 0; i < WORKERS_MAX; i++) worker_post(&sc.workers[i], churn_release, &churns[i]);
    for (int i = 0; i < WORKERS_MAX; i++) worker_wait(&sc.workers[i]);
    check_figures(&sc, __LINE__);
    CHECK_EQ(stats_of(&sc.fx, 0).allocation[NPUALLOC_POOL_ALL].current, 0);
    scene_stop(&sc);
}

/* What a read of the stats must show while threads allocate and free (no
 * reset runs): every current in [0, peak], each pooled stat's [ALL] the sum
 * of its pools', and since the reader's previous read no peak, allocated or
 * freed lower, nor the counts of raw and cached mallocs. Returns the
 * figures that broke it, the first one told on stderr. */
static int broken_figures(const npualloc_device_stats *s, const npualloc_device_stats *last, const char *reader) {
    int broken = 0;
    const npualloc_stat *run = &s->allocation[0], *was = &last->allocation[0];
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) {
        bool pooled_all = i < 9 * NPUALLOC_POOL_COUNT && i % NPUALLOC_POOL_COUNT == NPUALLOC_POOL_ALL;
        bool bad = run[i].current < 0 || run[i].current > run[i].peak || run[i].peak < was[i].peak ||
                   run[i].allocated < was[i].allocated || run[i].freed < was[i].freed ||
                   (pooled_all && run[i].current != run[i + 1].current + run[i + 2].current);
        if (bad && broken++ == 0)
            fprintf(stderr, "%s read: stat %d of the run: current %lld peak %lld allocated %lld freed %lld, "
                    "before: peak %lld allocated %lld freed %lld\n", reader, i, (long long)run[i].current,
                    (long long)run[i].peak, (long long)run[i].allocated, (long long)run[i].freed,
                    (long long)was[i].peak, (long long)was[i].allocated, (long long)was[i].freed);
    }
    if (s->num_cache_hits < last->num_cache_hits || s->num_cache_misses < last->num_cache_misses ||
        s->num_device_alloc < last->num_device_alloc || s->num_device_free < last->num_device_free) {
        if (broken++ == 0) fprintf(stderr, "%s read: a count of mallocs went down\n", reader);
    }
    return broken;
}

/* The two ways to read: the process's own copy, and a reader's copy of the
 * region's storage (npualloc_reader_stats, as `npualloc stats` reads). */
typedef struct reads {
    const npualloc_region *region;
    npualloc_device_stats own, region_copy; /* the last of each */
    long count, broken;
} reads;

/* One read each way; quiet: no writer may be inside (the region copy must
 * succeed at once). */
static void read_both(fixture *fx, reads *r, bool quiet) {
    npualloc_device_stats s = stats_of(fx, 0);
    r->broken += broken_figures(&s, &r->own, "own");
    r->own = s;
    int32_t status = npualloc_reader_stats(r->region, 0, quiet ? 1 : 1000, &s);
    if (quiet) CHECK_EQ(status, NPUALLOC_READ_OK);
    if (status == NPUALLOC_READ_OK) {
        r->broken += broken_figures(&s, &r->region_copy, "region");
        r->region_copy = s;
    }
    r->count++;
}

/* The main thread reads while `threads` workers churn, round after round;
 * each round ends with one more read once they are idle. */
static void run_reader_race(int threads) {
    npualloc_region *region = calloc(1, sizeof *region);
    CHECK(region != NULL);
    scene sc;
    scene_start(&sc, 64 * GiB, threads, region);
    churn churns[WORKERS_MAX];
    for (int i = 0; i < threads; i++) churn_init(&churns[i], i);
    reads r = {.region = region};
    for (int round = 0; round < ROUNDS; round++) {
        for (int i = 0; i < threads; i++) worker_post(&sc.workers[i], churn_round, &churns[i]);
        for (int i = 0; i < threads; i++)
            while (worker_busy(&sc.workers[i])) read_both(&sc.fx, &r, false);
        for (int i = 0; i < threads; i++) worker_wait(&sc.workers[i]);
        read_both(&sc.fx, &r, true);
    }
    CHECK_EQ(r.broken, 0);
    CHECK(r.count >= ROUNDS);
    CHECK(memcmp(&r.own, &r.region_copy, sizeof r.own) == 0); /* the last, quiet reads agree */
    for (int i = 0; i < threads; i++) worker_post(&sc.workers[i], churn_release, &churns[i]);
    for (int i = 0; i < threads; i++) worker_wait(&sc.workers[i]);
    scene_stop(&sc);
    free(region);
}

static void test_a_reader_racing_two_threads(void) { run_reader_race(2); }
static void test_a_reader_racing_four_threads(void) { run_reader_race(4); }

int main(void) {
    RUN(test_peaks_are_what_the_threads_held_together);
    RUN(test_accumulated_counts_reset_with_blocks_held);
    RUN(test_blocks_freed_by_another_thread);
    RUN(test_double_frees_of_cached_blocks_are_refused);
    RUN(test_a_thread_that_exits_holding_blocks);
    RUN(test_memory_a_thread_cached_serves_another);
    RUN(test_figures_are_exact_once_threads_are_idle);
    RUN(test_a_reader_racing_two_threads);
    RUN(test_a_reader_racing_four_threads);
    return check_report();
}
