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
static atomic_int submitters_done, destroyer_rounds;
static atomic_int failures;
static atomic_long accepted, refused;
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
 * with 107000, or with 100000 where its address came back as a device's new
 * default stream after a reset (a handle is an address, and addresses are
 * reused). */
static void tally_destroy(const char *call, int ret)
{
    tally(call, ret == ACL_ERROR_INVALID_PARAM ? ACL_ERROR_RT_PARAM_INVALID : ret);
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
        aclrtStream stream = atomic_load(&slots[next_random(&rng) % SLOTS]);
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
                tally_destroy("aclrtDestroyStream", aclrtDestroyStream(stream));
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

static aclrtStream new_stream(void)
{
    aclrtStream stream = NULL;
    int ret = aclrtCreateStream(&stream);
    if (ret != ACL_SUCCESS)
        fail("aclrtCreateStream", ret);
    return stream;
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
            int ret = aclrtResetDeviceForce(0);
            if (ret != ACL_SUCCESS)
                fail("aclrtResetDeviceForce", ret);
            if (aclrtSetDevice(0) != ACL_SUCCESS)
                fail("aclrtSetDevice after the reset", 0);
            for (int i = 0; i < SLOTS; i++) /* the reset destroyed the old ones */
                atomic_store(&slots[i], new_stream());
            continue;
        }
        aclrtStream old = atomic_exchange(&slots[round % SLOTS], new_stream());
        if (round & 1)
            tally_destroy("aclrtDestroyStreamForce", aclrtDestroyStreamForce(old));
        else
            tally_destroy("aclrtDestroyStream", aclrtDestroyStream(old));
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
        atomic_store(&slots[i], new_stream());
    pthread_t threads[SUBMITTERS + 1];
    for (uintptr_t i = 0; i < SUBMITTERS; i++)
        pthread_create(&threads[i], NULL, submitter, (void *)i);
    pthread_create(&threads[SUBMITTERS], NULL, destroyer, NULL);
    for (int i = 0; i <= SUBMITTERS; i++)
        pthread_join(threads[i], NULL);
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        fail("final aclrtSetDevice", 0);
    for (int i = 0; i < SLOTS; i++)
        tally_destroy("aclrtDestroyStream", aclrtDestroyStream(atomic_load(&slots[i])));
    long taken = atomic_load(&accepted), no = atomic_load(&refused);
    printf("stream_race: %d submitters x %d rounds, %d destroyer rounds: %ld calls taken, %ld refused\n",
           SUBMITTERS, rounds, atomic_load(&destroyer_rounds), taken, no);
    if (taken == 0 || no == 0)
        fail("the race was not run: every call taken or every call refused", taken);
    aclFinalize();
    return atomic_load(&failures) == 0 ? 0 : 1;
}
