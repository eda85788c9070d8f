/* Thread cancellation held off while a thread holds any of our locks or
 * waits in the runtime for us (hook.h's npa_cancel_off): the state each
 * thread had before its outermost hold, and how deep it is. */
#include "hook.h"

#include <time.h>

NPA_TLS unsigned npa_cancel_depth;
NPA_TLS int npa_cancel_saved;

int npa_mutex_lock_at_exit(pthread_mutex_t *m)
{
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += NPA_EXIT_WAIT_MS / 1000;
    deadline.tv_nsec += (long)(NPA_EXIT_WAIT_MS % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) {
        deadline.tv_sec++;
        deadline.tv_nsec -= 1000000000L;
    }
    npa_cancel_off();
    int err = pthread_mutex_timedlock(m, &deadline);
    if (err != 0)
        npa_cancel_on();
    return err;
}
