/* Work submitted to streams while other threads destroy them, for the
 * sanitizer builds: run it on an ASan or TSan build of the simulator.
 *
 * Submitters take a stream handle from a shared set of slots and queue work
 * on it through every call that names a stream (a memset, a copy, an event
 * record and wait, an aclnn op, a synchronize, now and then a destroy).
 * Beside them one thread keeps replacing the slots' streams and destroying
 * the old ones, plainly or by force, and every eighth round resets the
 * device by force, which destroys all its streams and ends every thread's
 * context there, while the submitters set the device again. A call naming a
 * stream destroyed before it must be refused (107000; 361001 for an aclnn
 * launch) and one whose thread's context ended 107002; nothing else may come
 * back, and the simulator must never touch a stream it has freed, which the
 * sanitizers report. A run whose submitters stop making calls fails rather
 * than hangs. */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "acl/acl.h"
#include "aclsim_ops.h"

#define SUBMITTERS 3
#define SLOTS 4
#define BUF_BYTES 4096
#define PROGRESS_CHECK_S 60
#define TEXT(x) #x
#define NUMBER_TEXT(x) TEXT(x)

static int rounds = 3000; /* each submitter's; argv[1] */
static _Atomic(aclrtStream) slots[SLOTS];
/* resets_begun when each slot's stream was made, stored after the stream: a
 * reader that loads it before the slot gets that stream's or an older's,
 * never more than the stream's. */
static atomic_int slot_made_at[SLOTS];
static atomic_int submitters_done, destroyer_rounds, resets_begun;
static atomic_int failures;
static atomic_long accepted, refused, refused_as_default;
/* The submitters' rounds: the destroyer's do not count, since it goes on
 * until the submitters are done, and what follows them is short. */
static atomic_long steps;

static void fail(const char *what, long detail)
{
    fprintf(stderr, "stream_race: %s (%ld)\n", what, detail);
    atomic_fetch_add(&failures, 1);
}

static uint64_t next_random(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* A call's outcome: taken, or refused for a stream destroyed or a context
 * ended before it; a thread whose context ended sets its device again.
 * Returns ret. */
static int tally(const char *call, int ret)
{
    if (ret == ACL_SUCCESS) {
        atomic_fetch_add(&accepted, 1);
        return ret;
    }
    if (ret == ACL_ERROR_RT_CONTEXT_NULL && aclrtSetDevice(0) != ACL_SUCCESS)
        fail("aclrtSetDevice after a reset", ret);
    if (ret == ACL_ERROR_RT_PARAM_INVALID || ret == ACL_ERROR_RT_CONTEXT_NULL) {
        atomic_fetch_add(&refused, 1);
        sched_yield(); /* the destroyer has new streams to make */
    } else {
        fail(call, ret);
    }
    return ret;
}

/* A destroy of a handle another thread may have destroyed first: refused
 * with 107000, or with 100000 where its address came back as the device's
 * new default stream (a handle is an address, and addresses are reused). A
 * default stream is made by the first aclrtSetDevice after a reset, so that
 * needs a reset begun after the handle was made (made_at: resets_begun
 * then, or less); a 100000 for any other handle is the simulator's error. */
static void tally_destroy(const char *call, int ret, int made_at)
{
    if (ret == ACL_ERROR_INVALID_PARAM && atomic_load(&resets_begun) > made_at) {
        atomic_fetch_add(&refused_as_default, 1);
        ret = ACL_ERROR_RT_PARAM_INVALID;
    } else if (ret == ACL_ERROR_INVALID_PARAM) {
        fail("a destroy of a stream made since the last reset began refused as the default stream", ret);
        return;
    }
    tally(call, ret);
}

/* A reset ends the thread's context: it sets its device again (tally) and
 * the synchronize is repeated there. */
static void synchronize_device(void)
{
    while (tally("aclrtSynchronizeDevice", aclrtSynchronizeDevice()) == ACL_ERROR_RT_CONTEXT_NULL)
        ;
}

/* An aclnn op on stream: a launch refuses a stream it cannot use with 361001
 * and leaves the executor to its caller. One taken has ended once the
 * device is synchronized (a destroy's or a reset's streams included), so the
 * next op's workspace is never this one's while it runs. */
static void launch_op(void *buf, void *workspace, int value, aclrtStream stream)
{
    uint64_t ws_size;
    aclOpExecutor *exec;
    aclnnStatus st = aclnnSimFillGetWorkspaceSize(buf, 64, value, &ws_size, &exec);
    if (st != ACLNN_SUCCESS) {
        fail("aclnnSimFillGetWorkspaceSize", st);
        return;
    }
    st = aclnnSimFill(workspace, ws_size, exec, stream);
    if (st == ACLNN_ERR_RUNTIME_ERROR) {
        aclDestroyAclOpExecutor(exec);
        atomic_fetch_add(&refused, 1);
        return;
    }
    if (tally("aclnnSimFill", st) == ACL_SUCCESS)
        synchronize_device();
}

static void *submitter(void *arg)
{
    uint64_t rng = 0x9e3779b97f4a7c15ull * ((uintptr_t)arg + 1);
    void *buf = NULL, *workspace = NULL;
    aclrtEvent recorded = NULL, waited = NULL;
    if (aclrtSetDevice(0) != ACL_SUCCESS || aclrtMalloc(&buf, BUF_BYTES, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS ||
        aclrtMalloc(&workspace, ACLSIM_OP_WORKSPACE_BYTES, ACL_MEM_MALLOC_HUGE_FIRST) != ACL_SUCCESS ||
        aclrtCreateEvent(&recorded) != ACL_SUCCESS || aclrtCreateEvent(&waited) != ACL_SUCCESS) {
        fail("submitter setup", 0);
        atomic_fetch_add(&submitters_done, 1);
        return NULL;
    }
    for (int round = 0; round < rounds; round++) {
        int slot = (int)(next_random(&rng) % SLOTS);
        int made_at = atomic_load(&slot_made_at[slot]);
        aclrtStream stream = atomic_load(&slots[slot]);
        switch (round % 7) {
        case 0:
            tally("aclrtMemsetAsync", aclrtMemsetAsync(buf, BUF_BYTES, round & 0xff, BUF_BYTES, stream));
            break;
        case 1:
            tally("aclrtMemcpyAsync", aclrtMemcpyAsync((char *)buf + BUF_BYTES / 2, BUF_BYTES / 2, buf,
                                                       BUF_BYTES / 2, ACL_MEMCPY_DEVICE_TO_DEVICE, stream));
            break;
        case 2: /* never waited for: a force destroy may drop it */
            tally("aclrtRecordEvent", aclrtRecordEvent(recorded, stream));
            break;
        case 3: /* recorded on the default stream, which no destroy drops, so the wait ends */
            tally("aclrtRecordEvent", aclrtRecordEvent(waited, NULL));
            tally("aclrtStreamWaitEvent", aclrtStreamWaitEvent(stream, waited));
            break;
        case 4:
            launch_op(buf, workspace, round, stream);
            break;
        case 5:
            tally("aclrtSynchronizeStream", aclrtSynchronizeStream(stream));
            break;
        case 6: /* races the destroyer's destroy of the same handle */
            if (next_random(&rng) % 16 == 0)
                tally_destroy("aclrtDestroyStream", aclrtDestroyStream(stream), made_at);
            break;
        }
        atomic_fetch_add(&steps, 1);
    }
    atomic_fetch_add(&submitters_done, 1);
    synchronize_device();
    aclrtDestroyEvent(recorded);
    aclrtDestroyEvent(waited);
    aclrtFree(workspace);
    aclrtFree(buf);
    return NULL;
}

/* Puts a new stream in the slot; returns the old one. */
static aclrtStream replace_stream(int slot)
{
    int made_at = atomic_load(&resets_begun);
    aclrtStream stream = NULL;
    int ret = aclrtCreateStream(&stream);
    if (ret != ACL_SUCCESS)
        fail("aclrtCreateStream", ret);
    aclrtStream old = atomic_exchange(&slots[slot], stream);
    atomic_store(&slot_made_at[slot], made_at);
    return old;
}

/* Until the submitters are done, replaces a slot's stream each round,
 * destroying the old one (a handle a submitter destroyed first is refused),
 * and every eighth round resets the device and replaces them all. */
static void *destroyer(void *arg)
{
    (void)arg;
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        fail("destroyer aclrtSetDevice", 0);
    for (int round = 0; atomic_load(&submitters_done) < SUBMITTERS; round++) {
        atomic_store(&destroyer_rounds, round + 1);
        if (round % 8 == 7) {
            atomic_fetch_add(&resets_begun, 1);
            int ret = aclrtResetDeviceForce(0);
            if (ret != ACL_SUCCESS)
                fail("aclrtResetDeviceForce", ret);
            if (aclrtSetDevice(0) != ACL_SUCCESS)
                fail("aclrtSetDevice after the reset", 0);
            for (int i = 0; i < SLOTS; i++) /* the reset destroyed the old ones */
                replace_stream(i);
            continue;
        }
        int made_at = atomic_load(&slot_made_at[round % SLOTS]);
        aclrtStream old = replace_stream(round % SLOTS);
        if (round & 1)
            tally_destroy("aclrtDestroyStreamForce", aclrtDestroyStreamForce(old), made_at);
        else
            tally_destroy("aclrtDestroyStream", aclrtDestroyStream(old), made_at);
    }
    return NULL;
}

/* SIGALRM, every PROGRESS_CHECK_S: a run that took no step since the last
 * check is hung (a call that never returns, or a thread that waits for one),
 * and would block make ctest for good: it fails here. Steps, not a deadline,
 * so a slow build (TSan, qemu) only takes longer. */
static void check_progress(int sig)
{
    (void)sig;
    static long last = -1;
    long now = atomic_load(&steps);
    if (now == last) {
        static const char hung[] = "stream_race: neither a submitter round nor the run ended in " NUMBER_TEXT(
            PROGRESS_CHECK_S) " s: hung\n";
        (void)!write(STDERR_FILENO, hung, sizeof hung - 1);
        _exit(1);
    }
    last = now;
    alarm(PROGRESS_CHECK_S);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        rounds = atoi(argv[1]);
    signal(SIGALRM, check_progress);
    alarm(PROGRESS_CHECK_S);
    if (aclInit(NULL) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS) {
        fprintf(stderr, "stream_race: cannot start the runtime\n");
        return 1;
    }
    for (int i = 0; i < SLOTS; i++)
        replace_stream(i);
    pthread_t threads[SUBMITTERS + 1];
    for (uintptr_t i = 0; i < SUBMITTERS; i++)
        pthread_create(&threads[i], NULL, submitter, (void *)i);
    pthread_create(&threads[SUBMITTERS], NULL, destroyer, NULL);
    for (int i = 0; i <= SUBMITTERS; i++)
        pthread_join(threads[i], NULL);
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        fail("final aclrtSetDevice", 0);
    for (int i = 0; i < SLOTS; i++)
        tally_destroy("aclrtDestroyStream", aclrtDestroyStream(atomic_load(&slots[i])), atomic_load(&slot_made_at[i]));
    long taken = atomic_load(&accepted), no = atomic_load(&refused);
    printf("stream_race: %d submitters x %d rounds, %d destroyer rounds: %ld calls taken, %ld refused "
           "(%ld destroys as the default stream)\n",
           SUBMITTERS, rounds, atomic_load(&destroyer_rounds), taken, no, atomic_load(&refused_as_default));
    if (taken == 0 || no == 0)
        fail("the race was not run: every call taken or every call refused", taken);
    aclFinalize();
    return atomic_load(&failures) == 0 ? 0 : 1;
}
