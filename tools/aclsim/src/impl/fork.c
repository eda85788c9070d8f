/* fork(). The child has one thread, the one that forked: every other thread
 * of the parent, each stream's worker among them, stays behind. Had one of
 * them held sim_lock at the fork, or waited on sim_progress, the child's
 * first runtime call would block for good. So fork waits for sim_lock (no
 * thread is then mid-update: the child's copy of the state is whole), and
 * the child lets go of what lived in the parent's threads: the streams
 * (their workers) and, with them, the events their queued records were to
 * complete. It keeps the rest: the initialised runtime, the devices set and
 * the forking thread's current one, the contexts, the device memory (a copy,
 * as the rest of the address space). The real runtime gives a child none of
 * its parent's streams; the sim keeps what a test's child needs to allocate.
 *
 * Registered when the library loads, before any handler a program (or a
 * preloaded allocator) registers later, so its prepare runs after theirs:
 * they take their locks first, the order in which their threads call in. */
#include "internal.h"

static void before_fork(void)
{
    pthread_mutex_lock(&sim_lock);
}

static void in_parent(void)
{
    pthread_mutex_unlock(&sim_lock);
}

static void in_child(void)
{
    /* Its waiters were the parent's threads and never leave: glibc's condvar
     * would have the child's next broadcast wait for them. */
    pthread_cond_init(&sim_progress, NULL);
    sim_streams_forget_after_fork();
    sim_events_forget_after_fork();
    pthread_mutex_unlock(&sim_lock);
}

__attribute__((constructor)) static void register_fork_handlers(void)
{
    pthread_atfork(before_fork, in_parent, in_child);
}
