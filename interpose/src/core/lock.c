/* The device lock's waits (lock.h): spin, then sleep on the futex. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "lock.h"

static uint64_t monotonic_ns(void *ctx) {
    (void)ctx;
    struct timespec now = {0}; /* a failed read stands still, which RELAXES_PER_POLL_MAX bounds */
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (uint64_t)now.tv_sec * 1000000000u + (uint64_t)now.tv_nsec;
}

/* A waiter polls the word with exponential backoff, 25 ns, 50 ns ... up to
 * 25.6 us between polls, 0.4 ms in all. Polling continually, as this did
 * once, took the lock at almost every release from the other core, and each
 * hand-off moved the device's state (pools, block map, recent cache, about
 * 14 cache lines of stats) between the two caches: two threads on one device
 * lost 88% of their per-thread rate in make bench's hot path (2-core EPYC
 * VM). Backing off lets the holder run many pairs on warm caches before a
 * waiter takes its turn: 48-59% lost over four runs of 4 rounds (glibc
 * 58-64% in the same rounds), four threads on the two cores 75-79% (glibc
 * 74-76%), each counted as the mean of the threads' own rates, as the bench
 * did then (it now counts until the last thread finished, which reads about
 * 56% and 79%), and the 90th percentile of a batch's time per pair fell from
 * 441 to 118-302 ns. The times are read from the clock: counted in pause
 * instructions, as they were, they depended on the CPU (25 ns a pause on that
 * VM, about 40 ns on recent Intel cores), and on arm64, the Ascend hosts'
 * CPUs, where yield (all there was) is a hint most cores discard like a nop,
 * a waiter would poll almost continually and sleep within microseconds, as
 * the one behind the 88% above did (reasoned, not measured: no arm64 machine
 * here).
 *
 * A holder gives the lock back every few hundred nanoseconds while it runs
 * hits, so 5 us without a release means it is not running: preempted (its
 * CPU may be this waiter's own, which then only keeps it waiting) or in a
 * long call (a raw device malloc, a synchronize). The waiter sleeps then.
 * It sees the releases without costing the hit path anything: at each poll
 * it marks a held word 3, and the release that finds the mark counts itself
 * in `releases` (the holder's next take clears it, so the next poll marks it
 * again). Side by side with the lock before (same VM, 2026-11-25): two
 * threads pinned to one CPU lost 51% per thread instead of 55% (two runs of 8
 * rounds); on the two CPUs four threads lost 78% instead of 79% (glibc 78%),
 * two threads 56% as before, and the 90th percentile of a batch's time per
 * pair fell from 139 to 99 ns with two threads and from 195 to 129 ns with
 * four (6 runs of 6 rounds); waits got no longer (the longest 0.4-0.5 ms with
 * two threads, 0.5-1.0 ms before; 4.7-9.4 ms with four, 4.7-9.0 before). */
const npa_lock_spin npa_lock_default_spin = {
    .clock_ns = monotonic_ns,
    .first_poll_ns = 25,
    .max_poll_ns = 25600,
    .stall_ns = 5000,
    .spin_ns = 409600,
};

/* A short stall between reads of the clock. On arm64 yield is a hint that
 * most cores without SMT discard like a nop; Arm advises isb, which waits for
 * the pipeline to drain (Rust's and Go's spin hints changed to it). */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("isb" ::: "memory");
#endif
}

/* At most this many relaxes between two polls (25.6 us of pauses on the
 * EPYC VM): a clock that stands still between its ticks (a VM on the jiffies
 * clocksource ticks every few milliseconds) must not keep a waiter from
 * seeing the lock free. */
#define RELAXES_PER_POLL_MAX 1024

/* Spins until it takes the lock (true) or until the spin says to sleep
 * (false). */
static bool spin_for(npa_lock *l, const npa_lock_spin *spin) {
    uint64_t start = spin->clock_ns(spin->ctx), release_seen_at = start;
    unsigned releases_seen = __atomic_load_n(&l->releases, __ATOMIC_RELAXED);
    for (uint64_t gap = spin->first_poll_ns;; gap = gap < spin->max_poll_ns / 2 ? 2 * gap : spin->max_poll_ns) {
        uint64_t now, poll_at = spin->clock_ns(spin->ctx) + gap;
        for (unsigned relaxes = 0; (now = spin->clock_ns(spin->ctx)) < poll_at && relaxes < RELAXES_PER_POLL_MAX;
             relaxes++)
            cpu_relax();
        int state = __atomic_load_n(&l->state, __ATOMIC_RELAXED);
        if (state == 0 &&
            __atomic_compare_exchange_n(&l->state, &state, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return true;
        if (state == 1) /* ask the holder's next release to count itself */
            __atomic_compare_exchange_n(&l->state, &state, 3, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        unsigned releases = __atomic_load_n(&l->releases, __ATOMIC_RELAXED);
        if (releases != releases_seen) {
            releases_seen = releases;
            release_seen_at = now;
        } else if (now - release_seen_at >= spin->stall_ns) {
            return false;
        }
        if (now - start >= spin->spin_ns) return false;
    }
}

/* The word reads 2 while anyone may sleep on it, so a thread that has slept
 * takes it as 2: its release wakes the next sleeper, whom the holder's last
 * release did not. Woken and finding the lock taken again, a thread marks it
 * 2 and sleeps at once, so each of the holder's releases wakes it until it
 * gets its turn: a system call on the holder's every release meanwhile, which
 * slows the holder and so ends the wait. Spinning again instead (tried)
 * spared the holder those calls but let it keep the lock: with two threads
 * the longest wait grew from 0.4-0.6 ms to 0.8-1.9 ms (4 runs each, 500
 * batches of the bench's harness, a clock around each wait). */
void npa_lock_wait_with(npa_lock *l, const npa_lock_spin *spin) {
    if (spin_for(l, spin)) return;
    while (__atomic_exchange_n(&l->state, 2, __ATOMIC_ACQUIRE) != 0)
        syscall(SYS_futex, &l->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

bool npa_lock_acquire_within(npa_lock *l, long ns) {
    if (__atomic_exchange_n(&l->state, 2, __ATOMIC_ACQUIRE) == 0) return true;
    struct timespec wait = {.tv_sec = ns / 1000000000, .tv_nsec = ns % 1000000000};
    syscall(SYS_futex, &l->state, FUTEX_WAIT_PRIVATE, 2, &wait, NULL, 0);
    return __atomic_exchange_n(&l->state, 2, __ATOMIC_ACQUIRE) == 0;
}

void npa_lock_released_contended(npa_lock *l, int state) {
    __atomic_add_fetch(&l->releases, 1, __ATOMIC_RELAXED);
    if (state == 2) syscall(SYS_futex, &l->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}
