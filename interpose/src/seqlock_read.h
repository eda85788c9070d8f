/* The reading side of the region's seqlocks. Each writer makes seq odd,
 * fences (release), stores the figures with relaxed atomics, then makes seq
 * even with a release store. Here: seq with acquire, the copy, an acquire
 * fence, seq again. The acquire fence keeps the copy's loads before the
 * second seq load; on aarch64 nothing else would (x86-64 never reorders
 * loads with loads). Header-only: the reader library (another process's
 * region) reads so, and the core copies its own frozen slots with the same
 * word copy (npa_get_stats). */
#ifndef NPA_SEQLOCK_READ_H
#define NPA_SEQLOCK_READ_H

#include <sched.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Word by word with relaxed atomic loads: a copy that races a writer is
 * thrown away, but each load still has to be a single, untorn access. The
 * writers store with relaxed atomics too, so ThreadSanitizer checks the copy:
 * a plain store into a seqlocked figure (which C11 does not order after the
 * writer's fence) is reported as a race with it (test_reader under
 * `make ctest-tsan`). */
static inline void npa_seqlock_copy_words(void *out, const void *source, size_t size)
{
    const uint64_t *from = source;
    unsigned char *to = out;
    for (size_t i = 0; i < size / sizeof(uint64_t); i++) {
        uint64_t word = __atomic_load_n(&from[i], __ATOMIC_RELAXED);
        memcpy(to + i * sizeof word, &word, sizeof word);
    }
}

/* A seqlock's counter: a uint64_t, or with narrow a uint32_t (the header's). */
static inline uint64_t npa_seqlock_load(const void *seq, bool narrow, bool acquire)
{
    if (narrow)
        return acquire ? __atomic_load_n((const uint32_t *)seq, __ATOMIC_ACQUIRE)
                       : __atomic_load_n((const uint32_t *)seq, __ATOMIC_RELAXED);
    return acquire ? __atomic_load_n((const uint64_t *)seq, __ATOMIC_ACQUIRE)
                   : __atomic_load_n((const uint64_t *)seq, __ATOMIC_RELAXED);
}

/* The copy succeeded only if seq stayed the same even number around it; the
 * counter only grows, so the copy of a seq inside source is that number.
 * One try: false when a writer was inside. */
static inline bool npa_seqlock_try_copy(const void *seq, bool narrow, const void *source, void *out, size_t size)
{
    uint64_t before = npa_seqlock_load(seq, narrow, true);
    if (before & 1)
        return false;
    npa_seqlock_copy_words(out, source, size);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    return npa_seqlock_load(seq, narrow, false) == before;
}

/* At most attempts tries, a yield between two (to let a writer that was
 * preempted inside finish). */
static inline bool npa_seqlock_copy(const void *seq, bool narrow, const void *source, void *out, size_t size,
                                    uint32_t attempts)
{
    for (uint32_t attempt = 0; attempt < attempts; attempt++) {
        if (attempt > 0)
            sched_yield();
        if (npa_seqlock_try_copy(seq, narrow, source, out, size))
            return true;
    }
    return false;
}

#endif
