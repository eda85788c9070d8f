/* Request sizing: the entry point's size contract, then torch's round_size,
 * then the segment size a miss asks the device for. Saturates at SIZE_MAX
 * instead of wrapping, so absurd sizes fail as OOM rather than as tiny blocks. */
#include "internal.h"

static size_t round_up(size_t size, size_t multiple) {
    if (size > SIZE_MAX - (multiple - 1)) return SIZE_MAX;
    return (size + multiple - 1) / multiple * multiple;
}

static unsigned floor_log2(size_t x) { return 63u - (unsigned)__builtin_clzll((unsigned long long)x); }

size_t npa_entry_size(npa_entry entry, size_t size) {
    switch (entry) {
    case NPA_ENTRY_MALLOC: {
        /* aclrtMalloc's own padding: up to 32, plus 32 bytes. */
        size_t aligned = round_up(size, 32);
        return aligned > SIZE_MAX - 32 ? SIZE_MAX : aligned + 32;
    }
    case NPA_ENTRY_ALIGN32:
        return round_up(size, 32);
    case NPA_ENTRY_EXACT:
    default:
        return size;
    }
}

/* torch: 16 power-of-two intervals from 1 MiB; smaller sizes use the first,
 * larger ones the last. */
static unsigned divisions_for(const npa_config *config, size_t size) {
    int index = (int)floor_log2(size) - 20;
    if (index < 0) index = 0;
    if (index > NPA_ROUNDUP_INTERVALS - 1) index = NPA_ROUNDUP_INTERVALS - 1;
    return config->roundup_power2_divisions[index];
}

/* torch's roundup_power2_next_division: the next of `divisions` equal steps
 * between the powers of two around size. Callers guarantee size > 512 *
 * divisions, so the step is at least 256 bytes (torch's zero-step case cannot
 * arise). */
static size_t next_power2_division(size_t size, unsigned divisions) {
    if ((size & (size - 1)) == 0) return size;
    size_t floor = (size_t)1 << floor_log2(size);
    size_t step = floor >> floor_log2(divisions);
    size_t down = size & ~(step - 1);
    if (down == size) return size;
    return down > SIZE_MAX - step ? SIZE_MAX : down + step;
}

/* Sizes under NPA_MIN_BLOCK_SIZE need no case of their own: interval 0's
 * divisions never apply below 512 * divisions, and round_up takes any size
 * from 1 to 512. Only 0 is lifted to 1, without a branch: whether a size is
 * below 512 follows the program's sizes, and as a branch it was mispredicted
 * on 43% of the calls over make bench's trace sizes (callgrind's branch
 * simulation). Without it the exported pair ran 45.8 ns against 47.7
 * (medians of 16 pinned rounds side by side, 2-core EPYC VM), for 4.5 more
 * instructions a pair. */
size_t npa_round_size_as(const npa_config *config, bool has_divisions, size_t size) {
    size |= size == 0;
    if (has_divisions) {
        unsigned divisions = divisions_for(config, size);
        if (divisions > 1 && size > NPA_MIN_BLOCK_SIZE * (size_t)divisions)
            return next_power2_division(size, divisions);
    }
    return round_up(size, NPA_MIN_BLOCK_SIZE);
}

bool npa_config_has_divisions(const npa_config *config) {
    for (int i = 0; i < NPA_ROUNDUP_INTERVALS; i++)
        if (config->roundup_power2_divisions[i] > 1) return true;
    return false;
}

size_t npa_round_size(const npa_config *config, size_t size) {
    return npa_round_size_as(config, npa_config_has_divisions(config), size);
}

size_t npa_segment_size(size_t rounded) {
    if (rounded <= NPA_SMALL_SIZE) return NPA_SMALL_BUFFER;
    if (rounded < NPA_MIN_LARGE_ALLOC) return NPA_LARGE_BUFFER;
    return round_up(rounded, NPA_ROUND_LARGE);
}
