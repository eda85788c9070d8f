/* A device's figures since region layout version 9 (device_figures.h),
 * through npualloc_reader_stats: its npualloc_device_stats plus its threads'
 * slots, each slot copied under its own seqlock, the device's seq checked
 * around them all. Regions and slots written by hand here, and by writer
 * threads following the writers' protocol; the process's own figures
 * (npa_get_stats, the OOM report) in test_stats.c and test_oom.c. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "check.h"
#include "npualloc_reader.h"

#define DEVICE 2

static npualloc_region region; /* static: 147 KiB */

/* The reader library yields before each retry. This definition, in the
 * executable, is the one its calls reach, so a test can act between two
 * tries as a writer would, without timing: the hook runs on the yields of
 * the thread that armed it; every other call goes straight to the kernel. */
static void (*yield_hook)(void);
static pthread_t hook_thread;
static int hooked_yields;

int sched_yield(void) {
    if (yield_hook && pthread_equal(pthread_self(), hook_thread)) {
        hooked_yields++;
        yield_hook();
    }
    return (int)syscall(SYS_sched_yield);
}

static void arm_yield_hook(void (*hook)(void)) {
    hook_thread = pthread_self();
    hooked_yields = 0;
    yield_hook = hook;
}

/* The slot stats in the spec's order, restated here rather than taken from
 * the code under test: the fields of out each NPUALLOC_THREAD_* adds to. */
static npualloc_stat *slot_stat_field(npualloc_device_stats *out, int stat) {
    npualloc_stat *const fields[NPUALLOC_THREAD_STAT_COUNT] = {
        out->allocation,      out->allocated_bytes, out->active,       out->active_bytes,
        out->requested_bytes, out->inactive_split,  out->inactive_split_bytes,
    };
    return fields[stat];
}

static void check_figure(npualloc_stat stat, int64_t current, int64_t peak, int64_t allocated, int64_t freed) {
    CHECK_EQ(stat.current, current);
    CHECK_EQ(stat.peak, peak);
    CHECK_EQ(stat.allocated, allocated);
    CHECK_EQ(stat.freed, freed);
}

/* Every torch stat of the device at its own values: current 1000 i + 10,
 * peak 1000 i + 900, allocated 1000 i + 500, current_at_reset 3. */
static void write_device(npualloc_device_stats *device) {
    npualloc_stat *run = device->allocation;
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++)
        run[i] = (npualloc_stat){.current = 1000 * i + 10, .peak = 1000 * i + 900, .allocated = 1000 * i + 500,
                                 .current_at_reset = 3};
    device->seq = 6;
    device->num_cache_hits = 40;
    device->largest_free_block = 4096;
}

static void test_each_slot_adds_to_its_pool_and_all(void) {
    memset(&region, 0, sizeof region);
    write_device(&region.devices[DEVICE]);
    npualloc_thread_stats *slots = region.threads[DEVICE];
    for (int pool = 0; pool < NPUALLOC_THREAD_POOL_COUNT; pool++)
        for (int stat = 0; stat < NPUALLOC_THREAD_STAT_COUNT; stat++) {
            slots[0].current[pool][stat] = 100 * (pool + 1) + stat;
            slots[0].allocated[pool][stat] = 10000 * (pool + 1) + stat;
            slots[NPUALLOC_THREAD_SLOTS - 1].current[pool][stat] = -(stat + 1); /* a thread that freed more */
        }
    slots[0].seq = 2;
    slots[5].seq = 8;
    slots[5].num_cache_hits = 2;
    slots[5].largest_held = 8192;
    slots[0].num_cache_hits = 1;
    slots[0].largest_held = 1024;
    region.threads[DEVICE + 1][0].current[0][0] = 77; /* another device's: not added */

    npualloc_device_stats out;
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 1, &out), NPUALLOC_READ_OK);
    npualloc_device_stats device = region.devices[DEVICE];
    for (int stat = 0; stat < NPUALLOC_THREAD_STAT_COUNT; stat++) {
        const npualloc_stat *mine = slot_stat_field(&device, stat);
        npualloc_stat *sum = slot_stat_field(&out, stat);
        int64_t all_current = mine[NPUALLOC_POOL_ALL].current, all_allocated = mine[NPUALLOC_POOL_ALL].allocated;
        for (int pool = 0; pool < NPUALLOC_THREAD_POOL_COUNT; pool++) {
            const npualloc_stat d = mine[NPUALLOC_POOL_SMALL + pool];
            int64_t moved = 100 * (pool + 1) + stat - (stat + 1), allocated = 10000 * (pool + 1) + stat;
            /* the peak stays the device's; freed stays allocated - current + current_at_reset */
            check_figure(sum[NPUALLOC_POOL_SMALL + pool], d.current + moved, d.peak, d.allocated + allocated,
                         d.allocated + allocated - (d.current + moved) + 3);
            all_current += moved;
            all_allocated += allocated;
        }
        check_figure(sum[NPUALLOC_POOL_ALL], all_current, mine[NPUALLOC_POOL_ALL].peak, all_allocated,
                     all_allocated - all_current + 3);
    }
    /* What no slot carries is the device's alone. */
    for (int pool = 0; pool < NPUALLOC_POOL_COUNT; pool++) {
        check_figure(out.segment[pool], device.segment[pool].current, device.segment[pool].peak,
                     device.segment[pool].allocated, 493);
        check_figure(out.reserved_bytes[pool], device.reserved_bytes[pool].current, device.reserved_bytes[pool].peak,
                     device.reserved_bytes[pool].allocated, 493);
    }
    check_figure(out.oversize_segments, device.oversize_segments.current, device.oversize_segments.peak,
                 device.oversize_segments.allocated, 493);
    CHECK_EQ(out.num_cache_hits, 43);
    CHECK_EQ(out.largest_free_block, 8192); /* a slot's stock holds the biggest */
    CHECK_EQ(out.seq, 6);

    slots[5].largest_held = 100;
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.largest_free_block, 4096); /* the device's pools hold the biggest */

    /* A hostile region's sums wrap (UBSan builds check: no overflow). */
    region.devices[DEVICE].allocation[NPUALLOC_POOL_SMALL].current = INT64_MAX;
    slots[0].current[0][NPUALLOC_THREAD_ALLOCATION] = 1;
    slots[NPUALLOC_THREAD_SLOTS - 1].current[0][NPUALLOC_THREAD_ALLOCATION] = 0;
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.allocation[NPUALLOC_POOL_SMALL].current, INT64_MIN);
}

static void test_a_slot_with_a_writer_inside_for_good_is_busy(void) {
    memset(&region, 0, sizeof region);
    write_device(&region.devices[DEVICE]);
    region.threads[DEVICE][17].seq = 5;
    npualloc_device_stats out;
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 50, &out), NPUALLOC_READ_BUSY);
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 0, &out), NPUALLOC_READ_BUSY);
    region.threads[DEVICE][17].seq = 6;
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 1, &out), NPUALLOC_READ_OK);
}

/* Slot 9 has a writer inside when the reader comes; while the reader
 * waits for it, the device's writer closes a section (seq 6 -> 8, a new
 * figure) and slot 9's writer finishes. The device copy the reader made
 * is stale: the sum must come from a fresh one. */
static void device_section_while_slot_9_is_written(void) {
    if (hooked_yields > 1) return;
    npualloc_device_stats *device = &region.devices[DEVICE];
    device->allocation[NPUALLOC_POOL_ALL].current = 7;
    device->seq = 8;
    region.threads[DEVICE][9].current[1][NPUALLOC_THREAD_ALLOCATION] = 3;
    region.threads[DEVICE][9].seq = 2;
}

static void start_retry_scenario(void) {
    memset(&region, 0, sizeof region);
    region.devices[DEVICE].seq = 6;
    region.devices[DEVICE].allocation[NPUALLOC_POOL_ALL].current = 1;
    region.threads[DEVICE][9].seq = 1;
    arm_yield_hook(device_section_while_slot_9_is_written);
}

static void test_a_device_section_during_the_slots_copy_is_retried(void) {
    npualloc_device_stats out;
    start_retry_scenario();
    int32_t status = npualloc_reader_stats(&region, DEVICE, 3, &out);
    yield_hook = NULL;
    CHECK_EQ(status, NPUALLOC_READ_OK);
    CHECK_EQ(hooked_yields, 2); /* one waiting for slot 9, one before the retry */
    CHECK_EQ(out.allocation[NPUALLOC_POOL_ALL].current, 7 + 3);
    CHECK_EQ(out.allocation[NPUALLOC_POOL_LARGE].current, 3);
    CHECK_EQ(out.seq, 8);

    /* Two attempts: the wait for slot 9 took the second, so the stale copy
     * is refused and none is left to retry with. */
    start_retry_scenario();
    status = npualloc_reader_stats(&region, DEVICE, 2, &out);
    yield_hook = NULL;
    CHECK_EQ(status, NPUALLOC_READ_BUSY);
    CHECK_EQ(hooked_yields, 1);
}

/* Two writers as the allocator has them: the device's (under the device
 * lock, now and then: it yields after each update) and a thread's cache in
 * its slot (a hot loop), each raising allocation by one and allocated_bytes
 * by 512 per update, under its seqlock, until the reader has read enough.
 * A torn copy of either breaks allocated_bytes == 512 * allocation; a sum
 * of copies each newer than the last read's never goes down. */
#define READS 10000
#define SLOT 11

static atomic_int writers_stop;

static void write_begin(uint64_t *seq) {
    __atomic_store_n(seq, *seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static void write_end(uint64_t *seq) { __atomic_store_n(seq, *seq + 1, __ATOMIC_RELEASE); }

static void write_pair(uint64_t *seq, int64_t *allocation, int64_t *allocated_bytes, int64_t n) {
    write_begin(seq);
    __atomic_store_n(allocation, n, __ATOMIC_RELAXED);
    __atomic_store_n(allocated_bytes, 512 * n, __ATOMIC_RELAXED);
    write_end(seq);
}

static void *device_writer(void *updates) {
    npualloc_device_stats *device = &region.devices[DEVICE];
    int64_t n = 0;
    while (!atomic_load(&writers_stop)) {
        n++;
        write_pair(&device->seq, &device->allocation[NPUALLOC_POOL_ALL].current,
                   &device->allocated_bytes[NPUALLOC_POOL_ALL].current, n);
        sched_yield();
    }
    *(int64_t *)updates = n;
    return NULL;
}

static void *slot_writer(void *updates) {
    npualloc_thread_stats *slot = &region.threads[DEVICE][SLOT];
    int64_t n = 0;
    while (!atomic_load(&writers_stop)) {
        n++;
        write_pair(&slot->seq, &slot->current[0][NPUALLOC_THREAD_ALLOCATION],
                   &slot->current[0][NPUALLOC_THREAD_ALLOCATED_BYTES], n);
    }
    *(int64_t *)updates = n;
    return NULL;
}

static void test_sums_stay_whole_under_writers(void) {
    memset(&region, 0, sizeof region);
    atomic_store(&writers_stop, 0);
    pthread_t writers[2];
    int64_t updates[2] = {-1, -1};
    CHECK_EQ(pthread_create(&writers[0], NULL, device_writer, &updates[0]), 0);
    CHECK_EQ(pthread_create(&writers[1], NULL, slot_writer, &updates[1]), 0);
    int64_t last = 0;
    long torn = 0, backwards = 0, reads = 0;
    npualloc_device_stats out;
    for (int call = 0; call < READS; call++) {
        if (npualloc_reader_stats(&region, DEVICE, 1000, &out) != NPUALLOC_READ_OK) continue;
        int64_t allocations = out.allocation[NPUALLOC_POOL_ALL].current;
        torn += out.allocated_bytes[NPUALLOC_POOL_ALL].current != 512 * allocations;
        backwards += allocations < last;
        last = allocations;
        reads++;
    }
    atomic_store(&writers_stop, 1);
    for (int i = 0; i < 2; i++) CHECK_EQ(pthread_join(writers[i], NULL), 0);
    CHECK_EQ(torn, 0);
    CHECK_EQ(backwards, 0);
    CHECK(reads > 0);
    CHECK_EQ(npualloc_reader_stats(&region, DEVICE, 1, &out), NPUALLOC_READ_OK);
    CHECK_EQ(out.allocation[NPUALLOC_POOL_ALL].current, updates[0] + updates[1]);
    CHECK_EQ(out.allocation[NPUALLOC_POOL_SMALL].current, updates[1]); /* the slot's pool 0 */
    CHECK_EQ(out.allocated_bytes[NPUALLOC_POOL_ALL].current, 512 * (updates[0] + updates[1]));
}

int main(void) {
    RUN(test_each_slot_adds_to_its_pool_and_all);
    RUN(test_a_slot_with_a_writer_inside_for_good_is_busy);
    RUN(test_a_device_section_during_the_slots_copy_is_retried);
    RUN(test_sums_stay_whole_under_writers);
    return check_report();
}
