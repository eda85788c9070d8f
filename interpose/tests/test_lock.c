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
    const npa_lock_spin *spin;
    int acquired;
    int state_when_taken; /* the word's value while it held the lock */
} waiter;

static void *wait_for_lock(void *arg) {
    waiter *w = arg;
    npa_lock_wait_with(w->lock, w->spin);
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

static uint64_t clock_now(read_clock *c) { return __atomic_load_n(&c->now, __ATOMIC_RELAXED); }

#define SPIN_STALL 1000
#define SPIN_ALL 50000

/* The test's thread holds the lock and one waiter thread waits for it,
 * spinning by the read clock unless the test sets another spin. */
typedef struct contest {
    npa_lock lock;
    read_clock clock;
    npa_lock_spin spin;
    waiter w;
    pthread_t thread;
} contest;

static void contest_init(contest *c) {
    *c = (contest){.clock = {.lock = &c->lock}};
    c->spin = (npa_lock_spin){.clock_ns = read_clock_ns, .ctx = &c->clock, .first_poll_ns = 1, .max_poll_ns = 64,
                              .stall_ns = SPIN_STALL, .spin_ns = SPIN_ALL};
}

/* Takes the lock, then starts the waiter. */
static void contest_start(contest *c) {
    npa_lock_acquire(&c->lock);
    c->w = (waiter){.lock = &c->lock, .spin = &c->spin};
    CHECK_EQ(pthread_create(&c->thread, NULL, wait_for_lock, &c->w), 0);
}

/* Gives the lock back: the waiter takes it, gives it back and ends. */
static void contest_finish(contest *c) {
    npa_lock_release(&c->lock);
    CHECK_EQ(pthread_join(c->thread, NULL), 0);
    CHECK_EQ(c->w.acquired, 1);
    CHECK_EQ(__atomic_load_n(&c->lock.state, __ATOMIC_RELAXED), 0);
}

/* A holder that keeps the lock, with the library's own spin and clock: the
 * waiter's spin ends and it marks the word contended (2) and sleeps, which an
 * endless spin never would; the release then wakes it. */
static void test_a_waiter_stops_spinning_and_is_woken(void) {
    contest c;
    contest_init(&c);
    c.spin = npa_lock_default_spin;
    contest_start(&c);
    await_state(&c.lock, 2);
    CHECK_EQ(__atomic_load_n(&c.w.acquired, __ATOMIC_ACQUIRE), 0);
    contest_finish(&c);
}

/* A holder that gives nothing back (preempted, or in a raw device call): the
 * waiter sleeps once it has seen no release for the stall time, long before
 * its spin time is out. Having slept, it takes the lock as contended (2), so
 * that its own release would wake a sleeper the holder's release did not. */
static void test_a_waiter_sleeps_when_the_holder_stalls(void) {
    contest c;
    contest_init(&c);
    contest_start(&c);
    await_state(&c.lock, 2);
    uint64_t slept_at = clock_now(&c.clock);
    CHECK(slept_at >= SPIN_STALL);
    CHECK(slept_at < SPIN_STALL + 4 * 64); /* the stall seen within a few polls */
    contest_finish(&c);
    CHECK_EQ(c.w.state_when_taken, 2);
}

/* A spinning waiter marks the held word (3), and the holder's release that
 * finds the mark counts itself, which is how the waiter sees the holder run;
 * the releases of an unmarked word count nothing. */
static void test_a_release_the_waiter_asked_for_is_counted(void) {
    contest c;
    contest_init(&c);
    c.spin.stall_ns = c.spin.spin_ns = UINT64_MAX; /* it spins until it takes the lock */
    npa_lock_acquire(&c.lock);
    npa_lock_release(&c.lock);
    CHECK_EQ(c.lock.releases, 0);
    contest_start(&c);
    await_state(&c.lock, 3);
    contest_finish(&c);
    CHECK_EQ(c.w.state_when_taken, 1);
    CHECK_EQ(__atomic_load_n(&c.lock.releases, __ATOMIC_RELAXED), 1);
}

/* A holder that keeps giving the lock back and taking it again before the
 * waiter polls: the waiter spins its whole time, then sleeps. */
static void test_a_waiter_spins_while_the_holder_runs(void) {
    contest c;
    contest_init(&c);
    c.clock.holder_runs = 1;
    contest_start(&c);
    await_state(&c.lock, 2);
    CHECK(clock_now(&c.clock) >= SPIN_ALL);
    contest_finish(&c);
}

/* Woken by a release whose holder took the lock back before the sleeper ran
 * (the word back at 1, as a running holder leaves it), the sleeper marks the
 * word 2 again at once, without spinning (its clock is not read), so the
 * holder's next release wakes it again. */
static void test_a_woken_waiter_sleeps_again_at_once(void) {
    contest c;
    contest_init(&c);
    contest_start(&c);
    await_state(&c.lock, 2);
    uint64_t woken_at = clock_now(&c.clock);
    __atomic_store_n(&c.lock.state, 1, __ATOMIC_RELEASE); /* given back and taken again, */
    npa_lock_released_contended(&c.lock, 2);               /* the sleeper woken by that release */
    await_state(&c.lock, 2);
    CHECK_EQ(clock_now(&c.clock), woken_at);
    CHECK_EQ(__atomic_load_n(&c.w.acquired, __ATOMIC_ACQUIRE), 0);
    contest_finish(&c);
    CHECK_EQ(c.w.state_when_taken, 2);
}

/* A clock that stands still (a failed read, or a coarse clocksource between
 * its ticks): the waiter neither sleeps nor stops polling, so it takes the
 * lock once it is free. Counts the reads, so the test knows it spins. */
static uint64_t still_clock_ns(void *ctx) {
    __atomic_add_fetch((uint64_t *)ctx, 1, __ATOMIC_RELAXED);
    return 7;
}

static void test_a_clock_that_stands_still_still_lets_the_waiter_poll(void) {
    contest c;
    contest_init(&c);
    c.spin.clock_ns = still_clock_ns;
    c.spin.ctx = &c.clock.now;
    contest_start(&c);
    await_state(&c.lock, 3); /* it polled, and marked the word */
    npa_lock_release(&c.lock);
    for (long yields = 0; !__atomic_load_n(&c.w.acquired, __ATOMIC_ACQUIRE) && yields < 100000000; yields++)
        sched_yield();
    CHECK_EQ(__atomic_load_n(&c.w.acquired, __ATOMIC_ACQUIRE), 1);
    if (__atomic_load_n(&c.w.acquired, __ATOMIC_ACQUIRE)) CHECK_EQ(pthread_join(c.thread, NULL), 0);
    else pthread_detach(c.thread); /* stuck between clock reads: the failed check ends the test */
    CHECK(clock_now(&c.clock) > 1);
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
