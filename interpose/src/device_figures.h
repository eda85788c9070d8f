/* A device's figures as published since layout version 9 (npualloc_shm.h's
 * reading rule): its npualloc_device_stats plus the moves its threads'
 * caches made in their npualloc_thread_stats slots, without the device
 * lock. Header-only: the reader library (npualloc_reader_stats, which the
 * Python package, the CLI and the exporter go through) reads so, and the
 * core (npa_get_stats, the process's own figures) adds the slots by the
 * same rule, reading them with the caches frozen (stats.c). */
#ifndef NPA_DEVICE_FIGURES_H
#define NPA_DEVICE_FIGURES_H

#include "npualloc_shm.h"
#include "seqlock_read.h"

_Static_assert(offsetof(npualloc_device_stats, seq) == 0 && offsetof(npualloc_thread_stats, seq) == 0 &&
                   sizeof(npualloc_device_stats) % sizeof(uint64_t) == 0 &&
                   sizeof(npualloc_thread_stats) % sizeof(uint64_t) == 0,
               "each starts with its seq, and the copy moves whole words");
_Static_assert(NPUALLOC_POOL_LARGE == NPUALLOC_POOL_SMALL + 1 && NPUALLOC_THREAD_POOL_COUNT == 2,
               "a slot's pool p is the device's pool NPUALLOC_POOL_SMALL + p");

/* Unsigned: a foreign or hostile region may hold anything, so sums wrap,
 * never overflow. */
static inline void npa_stat_add_moves(npualloc_stat *stat, int64_t current, int64_t allocated)
{
    stat->current = (int64_t)((uint64_t)stat->current + (uint64_t)current);
    stat->allocated = (int64_t)((uint64_t)stat->allocated + (uint64_t)allocated);
}

/* Adds one slot to a copy of its device's figures, in the region's form
 * (before npualloc_stats_from_region): current and allocated into the [ALL]
 * entry and the slot pool's; peaks stay (the writer keeps the device's peaks
 * above what the sum can reach) and so does current_at_reset, so each
 * stat's implied freed grows by the slot's decreases. */
static inline void npa_device_figures_add_slot(npualloc_device_stats *figures, const npualloc_thread_stats *slot)
{
    static const size_t offsets[NPUALLOC_THREAD_STAT_COUNT] = {
        [NPUALLOC_THREAD_ALLOCATION] = offsetof(npualloc_device_stats, allocation),
        [NPUALLOC_THREAD_ALLOCATED_BYTES] = offsetof(npualloc_device_stats, allocated_bytes),
        [NPUALLOC_THREAD_ACTIVE] = offsetof(npualloc_device_stats, active),
        [NPUALLOC_THREAD_ACTIVE_BYTES] = offsetof(npualloc_device_stats, active_bytes),
        [NPUALLOC_THREAD_REQUESTED_BYTES] = offsetof(npualloc_device_stats, requested_bytes),
        [NPUALLOC_THREAD_INACTIVE_SPLIT] = offsetof(npualloc_device_stats, inactive_split),
        [NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES] = offsetof(npualloc_device_stats, inactive_split_bytes),
    };
    for (int pool = 0; pool < NPUALLOC_THREAD_POOL_COUNT; pool++)
        for (int i = 0; i < NPUALLOC_THREAD_STAT_COUNT; i++) {
            npualloc_stat *stat = (npualloc_stat *)((char *)figures + offsets[i]);
            npa_stat_add_moves(&stat[NPUALLOC_POOL_ALL], slot->current[pool][i], slot->allocated[pool][i]);
            npa_stat_add_moves(&stat[NPUALLOC_POOL_SMALL + pool], slot->current[pool][i], slot->allocated[pool][i]);
        }
    figures->num_cache_hits = (int64_t)((uint64_t)figures->num_cache_hits + (uint64_t)slot->num_cache_hits);
    if (slot->largest_held > figures->largest_free_block)
        figures->largest_free_block = slot->largest_held;
}

/* The device's seq, its copy, each of its NPUALLOC_THREAD_SLOTS slots
 * copied under its own seqlock and added in, then the device's seq again:
 * unchanged, the sum is of one device state (the ceilings its writer kept
 * fixed meanwhile bound what the slots held). At most attempts tries in
 * all, each copy that met a writer inside costing one (a yield before the
 * next); false when they ran out, *out then unspecified. The figures are in
 * the region's form: npualloc_stats_from_region next. */
static inline bool npa_read_device_figures(const npualloc_device_stats *device, const npualloc_thread_stats *slots,
                                           uint32_t attempts, npualloc_device_stats *out)
{
    npualloc_thread_stats slot;
    uint32_t tries = 0;
    while (tries < attempts) {
        if (tries++ > 0)
            sched_yield();
        uint64_t before = npa_seqlock_load(&device->seq, false, true);
        if (before & 1)
            continue;
        npa_seqlock_copy_words(out, device, sizeof *out);
        for (int i = 0; i < NPUALLOC_THREAD_SLOTS;) {
            if (npa_seqlock_try_copy(&slots[i].seq, false, &slots[i], &slot, sizeof slot)) {
                npa_device_figures_add_slot(out, &slot);
                i++;
            } else if (tries++ < attempts) {
                sched_yield();
            } else {
                return false;
            }
        }
        __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copies' loads before the seq's */
        if (npa_seqlock_load(&device->seq, false, false) == before)
            return true;
    }
    return false;
}

#endif
