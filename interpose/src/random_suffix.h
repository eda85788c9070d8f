/* Eight hex digits for a name that must not collide with one that another
 * process (or an earlier one with our pid) left or is using: snapshot
 * temporaries, names moved aside for removal. Header-only: the interposer
 * and the reader library both use it. */
#ifndef NPA_RANDOM_SUFFIX_H
#define NPA_RANDOM_SUFFIX_H

#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/random.h>
#include <time.h>

/* From getrandom(); where it fails (no entropy yet, a filter), from the
 * clock and a counter: still unlikely to be planted in advance, and a
 * collision only costs a try. */
static inline void npa_random_suffix(char out[9])
{
    static _Atomic uint32_t counter;
    uint32_t bits;
    if (getrandom(&bits, sizeof bits, GRND_NONBLOCK) != (ssize_t)sizeof bits) {
        struct timespec now = {0};
        clock_gettime(CLOCK_MONOTONIC, &now);
        bits = (uint32_t)now.tv_nsec * 2654435761u ^ (uint32_t)now.tv_sec ^
               atomic_fetch_add_explicit(&counter, 0x9e3779b9u, memory_order_relaxed);
    }
    snprintf(out, 9, "%08x", bits);
}

#endif
