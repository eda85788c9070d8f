/* A companion thread for the tests of the per-thread caches (core
 * tcache.c). Header-only, as test_util.h, so CHECK counts in the including
 * test. */
#ifndef NPUALLOC_TESTS_COMPANION_H
#define NPUALLOC_TESTS_COMPANION_H

#include <pthread.h>

#include "test_util.h"

/* The fast paths run only while two threads have a cache on the device: a
 * companion thread makes one (a malloc and a free) and stays until told. */
typedef struct companion {
    fixture *fx;
    pthread_t thread;
    pthread_barrier_t barrier;
    long failures;
} companion;

static inline void *keep_company(void *arg) {
    companion *c = arg;
    c->failures += npa_free(c->fx->a, alloc_exact(c->fx, 0, 512), 0, NULL) != NPA_FREE_OK;
    pthread_barrier_wait(&c->barrier); /* its cache made */
    pthread_barrier_wait(&c->barrier); /* told to go */
    return NULL;
}

static inline void companion_start(companion *c, fixture *fx) {
    c->fx = fx;
    c->failures = 0;
    pthread_barrier_init(&c->barrier, NULL, 2);
    CHECK_EQ(pthread_create(&c->thread, NULL, keep_company, c), 0);
    pthread_barrier_wait(&c->barrier);
}

static inline void companion_stop(companion *c) {
    pthread_barrier_wait(&c->barrier);
    CHECK_EQ(pthread_join(c->thread, NULL), 0);
    CHECK_EQ(c->failures, 0);
    pthread_barrier_destroy(&c->barrier);
}

#endif
