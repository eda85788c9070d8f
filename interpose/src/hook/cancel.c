/* Thread cancellation held off while a thread holds any of our locks or
 * waits in the runtime for us (hook.h's npa_cancel_off): the state each
 * thread had before its outermost hold, and how deep it is. And the exit's
 * bounded wait for one of our locks. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <time.h>

#include "hook.h"

NPA_TLS unsigned npa_cancel_depth;
NPA_TLS int npa_cancel_saved;

/* pthread_mutex_clocklock, found at run time: glibc has it from 2.30 only,
 * and Ascend hosts run 2.28 (openEuler 20.03, Kylin V10), where a library
 * linked against it would not load. Looked up before the exit, once: a
 * dlsym in an exit handler waits for the loader's lock, which another
 * thread may hold. NULL where the C library has none, and where it comes
 * from another library than the pthread_mutex_timedlock we would call: a
 * library that interposes our mutex calls and not this one would never see
 * the lock taken (ThreadSanitizer of GCC 12 reports its unlock). */
typedef int (*npa_clocklock_fn)(pthread_mutex_t *, clockid_t, const struct timespec *);
static _Atomic(npa_clocklock_fn) clocklock;
static pthread_once_t clocklock_once = PTHREAD_ONCE_INIT;

static void find_clocklock(void)
{
    void *found = npa_real_dlsym(RTLD_DEFAULT, "pthread_mutex_clocklock");
    void *timed = npa_real_dlsym(RTLD_DEFAULT, "pthread_mutex_timedlock");
    Dl_info found_in, timed_in;
    if (found != NULL && timed != NULL && dladdr(found, &found_in) && dladdr(timed, &timed_in) &&
        found_in.dli_fbase == timed_in.dli_fbase)
        atomic_store_explicit(&clocklock, (npa_clocklock_fn)found, memory_order_release);
}

void npa_exit_wait_prepare(void)
{
    pthread_once(&clocklock_once, find_clocklock);
}

int npa_mutex_lock_at_exit(pthread_mutex_t *m)
{
    /* The deadline is on the monotonic clock where the C library can wait
     * on it: a realtime one moves with the wall clock, and a step back while
     * the process exits (NTP, `date -s`) stretched the wait by the step. */
    npa_clocklock_fn monotonic_lock = atomic_load_explicit(&clocklock, memory_order_acquire);
    struct timespec deadline;
    clock_gettime(monotonic_lock ? CLOCK_MONOTONIC : CLOCK_REALTIME, &deadline);
    deadline.tv_sec += NPA_EXIT_WAIT_MS / 1000;
    deadline.tv_nsec += (long)(NPA_EXIT_WAIT_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    npa_cancel_off();
    int err = monotonic_lock ? monotonic_lock(m, CLOCK_MONOTONIC, &deadline) : pthread_mutex_timedlock(m, &deadline);
    if (err != 0)
        npa_cancel_on();
    return err;
}
