/* The device lock's waits (lock.h): spin, then sleep on the futex. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lock.h"

/* How a waiter spins before it sleeps: it polls the word with exponential
 * backoff, 1, 2, 4 ... up to WAIT_BACKOFF_MAX pause instructions between
 * polls, WAIT_SPIN_PAUSES in all. Polling after every pause, as this did
 * before, took the lock at almost every release from the other core, and
 * each hand-off moved the device's state (pools, block map, recent cache,
 * about 14 cache lines of stats) between the two caches: two threads on one
 * device lost 88% of their per-thread rate in make bench's hot path (2-core
 * EPYC VM). Backing off lets the holder run many pairs on warm caches
 * before a waiter takes its turn: 48-59% lost over four runs of 4 rounds
 * (glibc 58-64% in the same rounds), four threads on the two cores 75-79%
 * (glibc 74-76%), each counted as the mean of the threads' own rates, as
 * the bench did then (it now counts until the last thread finished, which
 * reads about 56% and 79%), and the 90th percentile of a batch's time per pair fell
 * from 441 to 118-302 ns. The budget counts pause instructions, whose
 * length differs by CPU: 25 ns each on that VM (0.4 ms of spinning at
 * most), about 40 ns on recent Intel cores, a cycle or so where yield is a
 * hint only (many arm64 cores). A holder that keeps the lock longer (a raw
 * device malloc, a synchronize) finds the waiters asleep on the futex. */
#define WAIT_BACKOFF_MAX 1024
#define WAIT_SPIN_PAUSES 16384

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

void npa_lock_wait(npa_lock *l) {
    for (unsigned delay = 1, paused = 0; paused < WAIT_SPIN_PAUSES; delay *= delay < WAIT_BACKOFF_MAX ? 2 : 1) {
        for (unsigned k = 0; k < delay; k++) cpu_relax();
        paused += delay;
        int expected = 0;
        if (__atomic_load_n(&l->state, __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(&l->state, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return;
    }
    /* From here the word reads 2 while anyone may sleep on it: whoever takes
     * it this way keeps it 2, so its release wakes the next sleeper. */
    while (__atomic_exchange_n(&l->state, 2, __ATOMIC_ACQUIRE) != 0)
        syscall(SYS_futex, &l->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void npa_lock_wake(npa_lock *l) { syscall(SYS_futex, &l->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }
