/* The reading side of the region's seqlocks (seqlock_read.h says how): the
 * device stats with their threads' slots (device_figures.h), whose writers
 * are npa_stats_begin/npa_stats_end (core/internal.h) and the threads'
 * caches, the memory_saver figures (hook/saver.c's publish), the header's
 * config text (region/region.c's npa_region_publish_config) and its pause
 * state (region/region.h's npa_region_publish_pause). */
#include "device_figures.h"
#include "npualloc_reader.h"
#include "seqlock_read.h"

#include <stdbool.h>
#include <stddef.h>

_Static_assert(offsetof(npualloc_saver_stats, seq) == 0 && offsetof(npualloc_pause_state, seq) == 0,
               "each seqlocked struct starts with its seq");
_Static_assert(sizeof(npualloc_saver_stats) % sizeof(uint64_t) == 0 &&
                   sizeof(npualloc_pause_state) % sizeof(uint64_t) == 0 &&
                   offsetof(npualloc_region_header, pause) % sizeof(uint64_t) == 0 &&
                   offsetof(npualloc_region_header, config) % sizeof(uint64_t) == 0 &&
                   NPUALLOC_CONFIG_LEN % sizeof(uint64_t) == 0,
               "the copy moves whole words");

static int32_t seqlock_copy(const void *seq, bool narrow, const void *source, void *out, size_t size,
                            uint32_t attempts)
{
    return npa_seqlock_copy(seq, narrow, source, out, size, attempts) ? NPUALLOC_READ_OK : NPUALLOC_READ_BUSY;
}

int32_t npualloc_reader_stats(const npualloc_region *region, int32_t device, uint32_t attempts,
                              npualloc_device_stats *out)
{
    if (device < 0 || device >= NPUALLOC_MAX_DEVICES)
        return NPUALLOC_READ_BAD_DEVICE;
    bool read = npa_read_device_figures(&region->devices[device], region->threads[device], attempts, out);
    if (npualloc_reader_lost(region))
        return NPUALLOC_READ_LOST;
    if (!read)
        return NPUALLOC_READ_BUSY;
    npualloc_stats_from_region(out);
    return NPUALLOC_READ_OK;
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
