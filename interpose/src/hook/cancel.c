/* Thread cancellation held off while a thread holds any of our locks or
 * waits in the runtime for us (hook.h's npa_cancel_off): the state each
 * thread had before its outermost hold, and how deep it is. And the exit's
 * bounded retries: its wait for one of our locks. */
#include <errno.h>
#include <time.h>

#include "hook.h"

NPA_TLS unsigned npa_cancel_depth;
NPA_TLS int npa_cancel_saved;

#define EXIT_NAP_MS 10

bool npa_exit_wait_more(int *waited_ms)
{
    if (*waited_ms >= NPA_EXIT_WAIT_MS)
        return false;
    const struct timespec nap = {.tv_sec = 0, .tv_nsec = EXIT_NAP_MS * 1000L * 1000L};
    nanosleep(&nap, NULL);
    *waited_ms += EXIT_NAP_MS;
    return true;
}

int npa_mutex_lock_at_exit(pthread_mutex_t *m)
{
    /* Tried between relative sleeps, as the release of busy devices' caches
     * is: a deadline on the wall clock (pthread_mutex_timedlock) moved with
     * it, and a step back while the process exited (NTP, `date -s`)
     * stretched the wait by the step. The monotonic pthread_mutex_clocklock
     * is glibc 2.30's (Ascend hosts run 2.28), and the tools that wrap the
     * mutex calls do not all wrap it: valgrind's helgrind (3.19) reported
     * the unlock of every lock it took as one of a lock never taken. */
    npa_cancel_off();
    int waited_ms = 0;
    int err = pthread_mutex_trylock(m);
    while (err == EBUSY && npa_exit_wait_more(&waited_ms))
        err = pthread_mutex_trylock(m);
    if (err != 0)
        npa_cancel_on();
    return err;
}
