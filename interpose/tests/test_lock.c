/* The device lock (core/lock.h): mutual exclusion under contention, a
 * waiter that spins only a bounded while before it sleeps on the word, and
 * the sleeper woken by the release. Counts and states only: no timing. */
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
    int acquired;
} waiter;

static void *wait_for_lock(void *arg) {
    waiter *w = arg;
    npa_lock_acquire(w->lock);
    __atomic_store_n(&w->acquired, 1, __ATOMIC_RELEASE);
    npa_lock_release(w->lock);
    return NULL;
}

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
    for (long yields = 0; __atomic_load_n(&lock.state, __ATOMIC_ACQUIRE) != 2; yields++) {
        if (yields == 100000000) { /* a waiter that never sleeps: fail, not hang */
            CHECK(!"the waiter never marked the lock contended");
            break;
        }
        sched_yield();
    }
    CHECK_EQ(__atomic_load_n(&w.acquired, __ATOMIC_ACQUIRE), 0);
    npa_lock_release(&lock);
    CHECK_EQ(pthread_join(thread, NULL), 0);
    CHECK_EQ(w.acquired, 1);
    CHECK_EQ(__atomic_load_n(&lock.state, __ATOMIC_RELAXED), 0);
}

int main(void) {
    RUN(test_contended_increments_are_all_kept);
    RUN(test_a_waiter_stops_spinning_and_is_woken);
    return check_report();
}
