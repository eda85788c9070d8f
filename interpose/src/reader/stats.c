/* The reading side of the region's seqlocks: the device stats, whose
 * writer is npa_stats_begin/npa_stats_end (core/internal.h), the
 * memory_saver figures (hook/saver.c's publish), the header's config text
 * (region/region.c's npa_region_publish_config) and its pause state
 * (region/region.h's npa_region_publish_pause). Each writer makes seq odd,
 * fences (release), stores the figures, then makes seq even with a release
 * store. Here: seq with acquire, the copy, an acquire fence, seq again. The
 * acquire fence keeps the copy's loads before the second seq load; on
 * aarch64 nothing else would (x86-64 never reorders loads with loads). */
#include "npualloc_reader.h"

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

_Static_assert(offsetof(npualloc_device_stats, seq) == 0 && offsetof(npualloc_saver_stats, seq) == 0 &&
                   offsetof(npualloc_pause_state, seq) == 0,
               "each seqlocked struct starts with its seq");
_Static_assert(sizeof(npualloc_device_stats) % sizeof(uint64_t) == 0 &&
                   sizeof(npualloc_saver_stats) % sizeof(uint64_t) == 0 &&
                   sizeof(npualloc_pause_state) % sizeof(uint64_t) == 0 &&
                   offsetof(npualloc_region_header, pause) % sizeof(uint64_t) == 0 &&
                   offsetof(npualloc_region_header, config) % sizeof(uint64_t) == 0 &&
                   NPUALLOC_CONFIG_LEN % sizeof(uint64_t) == 0,
               "the copy moves whole words");

/* Word by word with relaxed atomic loads: a copy that races a writer is
 * thrown away, but each load still has to be a single, untorn access. The
 * writers store with relaxed atomics too, so ThreadSanitizer checks the copy:
 * a plain store into a seqlocked figure (which C11 does not order after the
 * writer's fence) is reported as a race with it (test_reader under
 * `make ctest-tsan`). */
static void copy_words(void *out, const void *source, size_t size)
{
    const uint64_t *from = source;
    unsigned char *to = out;
    for (size_t i = 0; i < size / sizeof(uint64_t); i++) {
        uint64_t word = __atomic_load_n(&from[i], __ATOMIC_RELAXED);
        memcpy(to + i * sizeof word, &word, sizeof word);
    }
}

/* A seqlock's counter: a uint64_t, or with narrow a uint32_t (the header's). */
static uint64_t load_seq(const void *seq, bool narrow, bool acquire)
{
    if (narrow)
        return acquire ? __atomic_load_n((const uint32_t *)seq, __ATOMIC_ACQUIRE)
                       : __atomic_load_n((const uint32_t *)seq, __ATOMIC_RELAXED);
    return acquire ? __atomic_load_n((const uint64_t *)seq, __ATOMIC_ACQUIRE)
                   : __atomic_load_n((const uint64_t *)seq, __ATOMIC_RELAXED);
}

/* The copy succeeded only if seq stayed the same even number around it; the
 * counter only grows, so the copy of a seq inside source is that number. */
static int32_t seqlock_copy(const void *seq, bool narrow, const void *source, void *out, size_t size,
                            uint32_t attempts)
{
    for (uint32_t attempt = 0; attempt < attempts; attempt++) {
        if (attempt > 0)
            sched_yield(); /* let a writer that was preempted inside finish */
        uint64_t before = load_seq(seq, narrow, true);
        if (before & 1)
            continue;
        copy_words(out, source, size);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (load_seq(seq, narrow, false) == before)
            return NPUALLOC_READ_OK;
    }
    return NPUALLOC_READ_BUSY;
}

int32_t npualloc_reader_stats(const npualloc_region *region, int32_t device, uint32_t attempts,
                              npualloc_device_stats *out)
{
    if (device < 0 || device >= NPUALLOC_MAX_DEVICES)
        return NPUALLOC_READ_BAD_DEVICE;
    const npualloc_device_stats *stats = &region->devices[device];
    int32_t status = seqlock_copy(&stats->seq, false, stats, out, sizeof *out, attempts);
    if (npualloc_reader_lost(region))
        return NPUALLOC_READ_LOST;
    if (status == NPUALLOC_READ_OK)
        npualloc_stats_from_region(out);
    return status;
}

int32_t npualloc_reader_saver_stats(const npualloc_region *region, int32_t device, uint32_t attempts,
                                    npualloc_saver_stats *out)
{
    if (device < 0 || device >= NPUALLOC_MAX_DEVICES)
        return NPUALLOC_READ_BAD_DEVICE;
    const npualloc_saver_stats *saver = &region->saver[device];
    int32_t status = seqlock_copy(&saver->seq, false, saver, out, sizeof *out, attempts);
    return npualloc_reader_lost(region) ? NPUALLOC_READ_LOST : status;
}

int32_t npualloc_reader_config(const npualloc_region *region, uint32_t attempts, char *out)
{
    const npualloc_region_header *h = &region->header;
    int32_t status = seqlock_copy(&h->config_seq, true, h->config, out, NPUALLOC_CONFIG_LEN, attempts);
    out[NPUALLOC_CONFIG_LEN - 1] = '\0'; /* a foreign region's text may have none */
    return npualloc_reader_lost(region) ? NPUALLOC_READ_LOST : status;
}

int32_t npualloc_reader_pause_state(const npualloc_region *region, uint32_t attempts, npualloc_pause_state *out)
{
    const npualloc_pause_state *pause = &region->header.pause;
    int32_t status = seqlock_copy(&pause->seq, false, pause, out, sizeof *out, attempts);
    return npualloc_reader_lost(region) ? NPUALLOC_READ_LOST : status;
}
