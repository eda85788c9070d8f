/* The device lock: a word, taken by one compare-and-swap and given back by
 * one exchange when nobody waits, so the hit path pays two atomic
 * instructions and no call (glibc's mutex costs about 65 instructions per
 * lock and unlock pair, a tenth of a malloc+free pair). A thread that finds
 * it taken spins a bounded while, since a hit holds it for about a hundred
 * nanoseconds, far less than a futex sleep and wake-up (with a plain mutex
 * two threads on one device slept 1-5 times per 1000 pairs and ran 10x
 * slower), polling less and less often so the holder keeps it for many
 * calls (lock.c says why); then it sleeps on the word (futex), marking it
 * contended so the holder's release wakes one sleeper. It sleeps at once when
 * the holder has stopped giving the lock back (preempted, or in a raw device
 * call), since spinning then only keeps the holder off a shared CPU. Any
 * thread may release it (a pause takes the device locks and its resume gives
 * them back). */
#ifndef NPUALLOC_CORE_LOCK_H
#define NPUALLOC_CORE_LOCK_H

#include <stdbool.h>
#include <stdint.h>

typedef struct npa_lock {
    int state;         /* 0 free, 1 held, 2 held and a thread may sleep on it, 3 held and a
                          thread spins waiting for it; atomic */
    unsigned releases; /* releases that found it at 2 or 3, so a spinning waiter sees that
                          the holder runs (lock.c); atomic */
} npa_lock;

/* How a waiter spins: the clock it reads and its times in nanoseconds
 * (lock.c's npa_lock_default_spin; the tests pass a clock of their own). A
 * clock that stands still keeps the waiter polling, never sleeping. */
typedef struct npa_lock_spin {
    uint64_t (*clock_ns)(void *ctx);
    void *ctx;
    uint64_t first_poll_ns; /* the first wait between polls of the word, doubled each poll */
    uint64_t max_poll_ns;   /* up to this */
    uint64_t stall_ns;      /* no release seen for this long: the holder is not running */
    uint64_t spin_ns;       /* spin this long in all, then sleep */
} npa_lock_spin;

extern const npa_lock_spin npa_lock_default_spin;

/* Kept out of line and out of the hit path's code (cold), even by LTO:
 * inlined, they changed the hit path's register allocation and cost about 1
 * ns a pair with the same instructions (callgrind 709 a pair either way). */
__attribute__((noinline, cold)) void npa_lock_wait_with(npa_lock *l, const npa_lock_spin *spin);
__attribute__((noinline, cold)) void npa_lock_released_contended(npa_lock *l, int state);

static inline void npa_lock_acquire(npa_lock *l) {
    int expected = 0;
    if (!__atomic_compare_exchange_n(&l->state, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
        npa_lock_wait_with(l, &npa_lock_default_spin);
}

/* One attempt, no wait: for the exit, which must not wait on a lock its own
 * thread may hold (exit called from a signal handler that interrupted it). */
static inline bool npa_lock_try_acquire(npa_lock *l) {
    int expected = 0;
    return __atomic_compare_exchange_n(&l->state, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED);
}

/* A wait of at most about ns nanoseconds (a futex sleep: the holder's
 * release wakes it): for a thread's exit, which must not wait for good on a
 * device a pause holds (tcache.c's leave_device looks between two waits). */
__attribute__((noinline, cold)) bool npa_lock_acquire_within(npa_lock *l, long ns);

static inline void npa_lock_release(npa_lock *l) {
    int state = __atomic_exchange_n(&l->state, 0, __ATOMIC_RELEASE);
    if (state >= 2) npa_lock_released_contended(l, state);
}

#endif
