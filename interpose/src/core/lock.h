/* The device lock: a word, taken by one compare-and-swap and given back by
 * one exchange when nobody waits, so the hit path pays two atomic
 * instructions and no call (glibc's mutex costs about 65 instructions per
 * lock and unlock pair, a tenth of a malloc+free pair). A thread that finds
 * it taken spins a bounded while, since a hit holds it for about a hundred
 * nanoseconds, far less than a futex sleep and wake-up (with a plain mutex
 * two threads on one device slept 1-5 times per 1000 pairs and ran 10x
 * slower), polling less and less often so the holder keeps it for many
 * calls (lock.c says why); then it sleeps on the word (futex), marking it
 * contended so the holder's release wakes one sleeper. Any thread may
 * release it (a pause takes the device locks and its resume gives them
 * back). */
#ifndef NPUALLOC_CORE_LOCK_H
#define NPUALLOC_CORE_LOCK_H

#include <stdbool.h>

typedef struct npa_lock {
    int state; /* 0 free, 1 held, 2 held and a thread may sleep on it; atomic */
} npa_lock;

void npa_lock_wait(npa_lock *l);
void npa_lock_wake(npa_lock *l);

static inline void npa_lock_acquire(npa_lock *l) {
    int expected = 0;
    if (!__atomic_compare_exchange_n(&l->state, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        npa_lock_wait(l);
}

static inline void npa_lock_release(npa_lock *l) {
    if (__atomic_exchange_n(&l->state, 0, __ATOMIC_RELEASE) == 2) npa_lock_wake(l);
}

#endif
