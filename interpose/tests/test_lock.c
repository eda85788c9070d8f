/* The device lock (core/lock.h): mutual exclusion under contention, a
 * waiter that spins only a bounded while before it sleeps on the word, and
 * the sleeper woken by the release. Counts and states only: no timing (the
 * spin's own times are read from a clock that counts the waiter's reads). */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#include "check.h"
#include "core/lock.h"

#define CONTENDERS 4
#define ROUNDS 200000

typedef struct shared {
    npa_lock lock;
    uint64_t counter; /* plain: only the lock keeps its increments whole */
    int inside;       /* threads between acquire and release: must stay 0 or 1 */
    int overlaps;
} shared;

static void *contend(void *arg) {
    shared *s = arg;
    for (int i = 0; i < ROUNDS; i++) {
        npa_lock_acquire(&s->lock);
        if (__atomic_add_fetch(&s->inside, 1, __ATOMIC_RELAXED) != 1) __atomic_add_fetch(&s->overlaps, 1, __ATOMIC_RELAXED);
        s->counter++;
        __atomic_sub_fetch(&s->inside, 1, __ATOMIC_RELAXED);
        npa_lock_release(&s->lock);
    }
    return NULL;
}

static void test_contended_increments_are_all_kept(void) {
    shared s = {0};
    pthread_t threads[CONTENDERS];
    for (int i = 0; i < CONTENDERS; i++) CHECK_EQ(pthread_create(&threads[i], NULL, contend, &s), 0);
    for (int i = 0; i < CONTENDERS; i++) CHECK_EQ(pthread_join(threads[i], NULL), 0);
    CHECK_EQ(s.counter, (uint64_t)CONTENDERS * ROUNDS);
    CHECK_EQ(s.overlaps, 0);
    CHECK_EQ(__atomic_load_n(&s.lock.state, __ATOMIC_RELAXED), 0);
}

typedef struct waiter {
    npa_lock *lock;
    const npa_lock_spin *spin; /* NULL: npa_lock_acquire's own */
    int acquired;
    int state_when_taken; /* the word's value while it held the lock */
} waiter;

static void *wait_for_lock(void *arg) {
    waiter *w = arg;
    if (w->spin) npa_lock_wait_with(w->lock, w->spin);
    else npa_lock_acquire(w->lock);
    __atomic_store_n(&w->state_when_taken, __atomic_load_n(&w->lock->state, __ATOMIC_RELAXED), __ATOMIC_RELAXED);
    __atomic_store_n(&w->acquired, 1, __ATOMIC_RELEASE);
    npa_lock_release(w->lock);
    return NULL;
}

/* Yields until the word reads `state`, a bounded number of times, so a waiter
 * that never gets there fails the test rather than hanging it. */
static void await_state(npa_lock *lock, int state) {
    for (long yields = 0; __atomic_load_n(&lock->state, __ATOMIC_ACQUIRE) != state; yields++) {
        if (yields == 100000000) {
            CHECK(!"the lock's word never reached the state awaited");
            return;
        }
        sched_yield();
    }
}

/* The waiter's clock for the spin tests: one nanosecond each time the waiter
 * reads it, so a spin's length is counted in its reads whatever the machine's
 * speed. While holder_runs, it also counts a release every 10 reads, as a
 * holder running hits gives the lock back and takes it again. */
typedef struct read_clock {
    uint64_t now; /* atomic */
    npa_lock *lock;
    int holder_runs; /* atomic */
} read_clock;

static uint64_t read_clock_ns(void *ctx) {
    read_clock *c = ctx;
    uint64_t now = __atomic_add_fetch(&c->now, 1, __ATOMIC_RELAXED);
    if (__atomic_load_n(&c->holder_runs, __ATOMIC_RELAXED) && now % 10 == 0)
        __atomic_add_fetch(&c->lock->releases, 1, __ATOMIC_RELAXED);
    return now;
}

#define SPIN_STALL 1000
#define SPIN_ALL 50000

static npa_lock_spin read_clock_spin(read_clock *c) {
    return (npa_lock_spin){.clock_ns = read_clock_ns, .ctx = c, .first_poll_ns = 1, .max_poll_ns = 64,
                           .stall_ns = SPIN_STALL, .spin_ns = SPIN_ALL};
}

static uint64_t clock_now(read_clock *c) { return __atomic_load_n(&c->now, __ATOMIC_RELAXED); }

/* A holder that keeps the lock: the waiter's spin ends and it marks the
 * word contended (2) and sleeps, which an endless spin never would; the
 * release then wakes it. The main thread waits for the mark by yielding
 * (a bounded number of times, so a waiter that never sleeps fails the test
 * rather than hanging it), so the test cannot pass on time alone. */
static void test_a_waiter_stops_spinning_and_is_woken(void) {
    npa_lock lock = {0};
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 2);
    CHECK_EQ(__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE), 0);
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
    CHECK_EQ(__atomic_load_n(&lock.state, __ATOMIC_RELAXED), 0);
}

/* A holder that gives nothing back (preempted, or in a raw device call): the
 * waiter sleeps once it has seen no release for the stall time, long before
 * its spin time is out. Having slept, it takes the lock as contended (2), so
 * that its own release would wake a sleeper the holder's release did not. */
static void test_a_waiter_sleeps_when_the_holder_stalls(void) {
    npa_lock lock = {0};
    read_clock clock = {.lock = &lock};
    npa_lock_spin spin = read_clock_spin(&clock);
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock, .spin = &spin};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 2);
    uint64_t slept_at = clock_now(&clock);
    CHECK(slept_at >= SPIN_STALL);
    CHECK(slept_at < SPIN_STALL + 4 * 64); /* the stall seen within a few polls */
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
    CHECK_EQ(w.state_when_taken, 2);
    CHECK_EQ(__atomic_load_n(&lock.state, __ATOMIC_RELAXED), 0);
}

/* A spinning waiter marks the held word (3), and the holder's release that
 * finds the mark counts itself, which is how the waiter sees the holder run;
 * the releases of an unmarked word count nothing. */
static void test_a_release_the_waiter_asked_for_is_counted(void) {
    npa_lock lock = {0};
    read_clock clock = {.lock = &lock};
    npa_lock_spin spin = read_clock_spin(&clock);
    spin.stall_ns = spin.spin_ns = UINT64_MAX; /* it spins until it takes the lock */
    npa_lock_acquire(&lock);
    npa_lock_release(&lock);
    CHECK_EQ(lock.releases, 0);
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock, .spin = &spin};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 3);
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
    CHECK_EQ(w.state_when_taken, 1);
    CHECK_EQ(__atomic_load_n(&lock.releases, __ATOMIC_RELAXED), 1);
    CHECK_EQ(__atomic_load_n(&lock.state, __ATOMIC_RELAXED), 0);
}

/* A holder that keeps giving the lock back and taking it again before the
 * waiter polls: the waiter spins its whole time, then sleeps. */
static void test_a_waiter_spins_while_the_holder_runs(void) {
    npa_lock lock = {0};
    read_clock clock = {.lock = &lock, .holder_runs = 1};
    npa_lock_spin spin = read_clock_spin(&clock);
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock, .spin = &spin};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 2);
    CHECK(clock_now(&clock) >= SPIN_ALL);
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
}

/* Woken by a release whose holder took the lock back before the sleeper ran
 * (the word back at 1, as a running holder leaves it), the sleeper marks the
 * word 2 again at once, without spinning (its clock is not read), so the
 * holder's next release wakes it again. */
static void test_a_woken_waiter_sleeps_again_at_once(void) {
    npa_lock lock = {0};
    read_clock clock = {.lock = &lock};
    npa_lock_spin spin = read_clock_spin(&clock);
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock, .spin = &spin};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 2);
    uint64_t woken_at = clock_now(&clock);
    __atomic_store_n(&lock.state, 1, __ATOMIC_RELEASE); /* given back and taken again, */
    npa_lock_released_contended(&lock, 2);               /* the sleeper woken by that release */
    await_state(&lock, 2);
    CHECK_EQ(clock_now(&clock), woken_at);
    CHECK_EQ(__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE), 0);
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
    CHECK_EQ(w.state_when_taken, 2);
    CHECK_EQ(__atomic_load_n(&lock.state, __ATOMIC_RELAXED), 0);
}

/* A clock that stands still (a failed read, or a coarse clocksource between
 * its ticks): the waiter neither sleeps nor stops polling, so it takes the
 * lock once it is free. Counts the reads, so the test knows it spins. */
static uint64_t still_clock_ns(void *ctx) {
    __atomic_add_fetch((uint64_t *)ctx, 1, __ATOMIC_RELAXED);
    return 7;
}

static void test_a_clock_that_stands_still_still_lets_the_waiter_poll(void) {
    npa_lock lock = {0};
    uint64_t reads = 0;
    npa_lock_spin spin = {.clock_ns = still_clock_ns, .ctx = &reads, .first_poll_ns = 1, .max_poll_ns = 64,
                          .stall_ns = SPIN_STALL, .spin_ns = SPIN_ALL};
    npa_lock_acquire(&lock);
    waiter w = {.lock = &lock, .spin = &spin};
    pthread_t thread;
    CHECK_EQ(pthread_create(&thread, NULL, wait_for_lock, &w), 0);
    await_state(&lock, 3); /* it polled, and marked the word */
    npa_lock_release(&lock);
    for (long yields = 0; !__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE) && yields < 100000000; yields++)
        sched_yield();
    CHECK_EQ(__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE), 1);
    if (__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE)) CHECK_EQ(pthread_join(thread, NULL), 0);
    else pthread_detach(thread); /* stuck between clock reads: the failed check ends the test */
    CHECK(__atomic_load_n(&reads, __ATOMIC_RELAXED) > 1);
}

int main(void) {
    RUN(test_contended_increments_are_all_kept);
    RUN(test_a_waiter_stops_spinning_and_is_woken);
    RUN(test_a_waiter_sleeps_when_the_holder_stalls);
    RUN(test_a_release_the_waiter_asked_for_is_counted);
    RUN(test_a_waiter_spins_while_the_holder_runs);
    RUN(test_a_woken_waiter_sleeps_again_at_once);
    RUN(test_a_clock_that_stands_still_still_lets_the_waiter_poll);
    return check_report();
}
