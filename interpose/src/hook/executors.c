/* aclnn executors. Phase 2 of an aclnn call destroys a plain executor itself;
 * only an executor made repeatable must be destroyed by the caller. Programs
 * that cannot tell the two apart either destroy every executor after phase 2
 * (a double free: the runtime aborts) or, like MindTorch v2, defer every
 * destroy to exit. We remember which executors were made repeatable: a destroy
 * of any other (or a second destroy) is a no-op that succeeds, and a real one
 * is forwarded once, after the work queued before it has finished, because the
 * executor may still be in use by a kernel in flight.
 *
 * That work is on the device the executor was made repeatable on, which we
 * remember: a program may destroy it from a thread with no device or
 * another one (a pool of threads, a deferred cleanup), and the destroying
 * thread's device says nothing of its launches. Made repeatable between its
 * phase 1 and its first launch, on the thread that launches it, the
 * executor is taken to run on the device current there (how else it could
 * be launched the reference does not say).
 *
 * Executors are known by address, and phase 2 frees a plain one, whose
 * address the runtime may give to the next executor: a late destroy of the
 * plain one after that one was made repeatable names it, and is forwarded,
 * as the runtime alone would take it. Telling the two apart needs every
 * operator's phase 1 and 2, which we do not see, and the program's policy
 * (a program that never destroys its plain executors owes no late destroy). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "hook.h"

#define TOMBSTONE ((aclOpExecutor *)(uintptr_t)1)

/* A repeatable executor and the device its launches run on: -1 when unknown
 * (no device where it was made repeatable). made_at orders it against a
 * teardown's synchronize of that device (npa_exec_settle), which runs
 * without exec_lock: one made before it began is settled, and then the
 * destroying thread's device is fenced, as that thread may have launched
 * it since. */
typedef struct repeatable {
    aclOpExecutor *executor;
    int device;
    uint64_t made_at;
} repeatable;

/* The device ids a settle tells apart (bit per device); beyond them, as
 * unknown. The runtime numbers a node's devices from 0. */
#define SETTLED_DEVICES 64

/* Open-addressing set of repeatable executors. */
static repeatable *set_slots;
static size_t set_cap, set_used, set_live; /* used counts tombstones too */
static uint64_t set_generation;            /* the last made_at given */
/* Per device, the last made_at a settle's synchronize covered. Kept apart
 * from the entries: a destroy between a settle's two holds takes its entry
 * out, and one the runtime refuses puts it back (made_at unchanged) after
 * the settle may have looked. */
static uint64_t settled_through[SETTLED_DEVICES];

/* deferred_at orders it against a forced drain's synchronize, which runs
 * without exec_lock: one deferred after that began may wait for work the
 * synchronize did not cover. */
typedef struct deferred {
    aclOpExecutor *executor;
    void *fence;
    int device;
    uint64_t made_at;
    uint64_t deferred_at;
} deferred;
static deferred *pending;
static size_t npending, cap_pending;
static uint64_t deferrals; /* the last deferred_at given */
/* A deferred destroy's device is one its fence was recorded on. */
_Static_assert(NPUALLOC_MAX_DEVICES <= SETTLED_DEVICES, "a device is a bit of a forced drain's mask");

/* Second in the lock order (hook.h): after init_lock, before device locks. */
static pthread_mutex_t exec_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t slot_of(const aclOpExecutor *e, size_t cap)
{
    uintptr_t x = (uintptr_t)e;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x & (cap - 1);
}

/* Rebuilt once live entries and tombstones fill half the table, at the size
 * the live ones need (a quarter full at most), not at twice the old size:
 * each destroy leaves a tombstone, so a program that makes and destroys
 * repeatable executors one at a time, at addresses that rarely repeat, fills
 * the table with them, and doubling at each rebuild grew it by 4-16 bytes
 * per executor ever made, with one live (64 MiB after 10 million). */
static int set_grow(void)
{
    size_t ncap = 64;
    while ((set_live + 1) * 4 > ncap)
        ncap *= 2;
    repeatable *ns = calloc(ncap, sizeof(*ns));
    if (ns == NULL)
        return -1;
    for (size_t i = 0; i < set_cap; i++) {
        aclOpExecutor *e = set_slots[i].executor;
        if (e == NULL || e == TOMBSTONE)
            continue;
        size_t s = slot_of(e, ncap);
        while (ns[s].executor != NULL)
            s = (s + 1) & (ncap - 1);
        ns[s] = set_slots[i];
    }
    free(set_slots);
    set_slots = ns;
    set_cap = ncap;
    set_used = set_live;
    return 0;
}

/* made_at 0: made repeatable now; else the executor's own, given back. */
static void set_insert(aclOpExecutor *e, int device, uint64_t made_at)
{
    if (device >= SETTLED_DEVICES)
        device = -1;
    if (made_at == 0)
        made_at = ++set_generation;
    if ((set_used + 1) * 2 > set_cap && set_grow() != 0) {
        npa_warn_once("out of host memory tracking aclnn executors; destroying one will be skipped");
        return;
    }
    size_t s = slot_of(e, set_cap);
    size_t tomb = SIZE_MAX;
    for (; set_slots[s].executor != NULL; s = (s + 1) & (set_cap - 1)) {
        if (set_slots[s].executor == e) {
            /* made repeatable twice: still one destroy to forward, and
             * its launches on the device of the later making */
            if (made_at > set_slots[s].made_at)
                set_slots[s] = (repeatable){e, device, made_at};
            return;
        }
        if (set_slots[s].executor == TOMBSTONE && tomb == SIZE_MAX)
            tomb = s;
    }
    if (tomb != SIZE_MAX) {
        s = tomb;
    } else {
        set_used++;
    }
    set_slots[s] = (repeatable){e, device, made_at};
    set_live++;
}

/* Whether e was repeatable; if so *device is its launches' device, -1
 * once a settle covered them, and *made_at its generation. */
static int set_remove(aclOpExecutor *e, int *device, uint64_t *made_at)
{
    if (set_cap == 0)
        return 0;
    for (size_t s = slot_of(e, set_cap); set_slots[s].executor != NULL; s = (s + 1) & (set_cap - 1))
        if (set_slots[s].executor == e) {
            int d = set_slots[s].device;
            *made_at = set_slots[s].made_at;
            *device = d >= 0 && *made_at <= settled_through[d] ? -1 : d;
            set_slots[s].executor = TOMBSTONE;
            set_live--;
            return 1;
        }
    return 0;
}

/* A destroy where no device is current (a thread that never set one, or
 * after a reset) counts on the lowest-numbered device the process used
 * (none used: not counted): counting on device 0 made npualloc's state for
 * it, which asks the device's memory by entering it, in a process that may
 * never have touched device 0. After aclFinalize (none serving) only a
 * device with state already counts: making one would call the runtime. */
static void count(int device, npa_counter counter)
{
    npa_allocator *a = npa_hook_allocator_any();
    bool serving = atomic_load_explicit(&npa_serving, memory_order_acquire) != NULL;
    unsigned seen = npa_devices_seen();
    if (device < 0 && seen != 0)
        device = __builtin_ctz(seen);
    if (a != NULL && device >= 0)
        npa_count(a, device, counter, 1, serving);
}

static aclnnStatus forward_destroy(aclOpExecutor *e, int device)
{
    __typeof__(&aclDestroyAclOpExecutor) destroy = NPA_REAL(aclDestroyAclOpExecutor);
    aclnnStatus ret = destroy != NULL ? destroy(e) : npa_no_runtime_error(NPA_FN_aclDestroyAclOpExecutor);
    count(device, NPA_COUNTER_EXECUTOR_DESTROYS_FORWARDED);
    return ret;
}

/* A destroy forwarded while the caller waits: the runtime's answer is the
 * caller's. One it refused leaves the executor live there, and the caller,
 * told so, may destroy it again: it stays repeatable to us, so that the
 * retry reaches the runtime instead of being skipped as a second destroy. */
static aclnnStatus destroy_now(aclOpExecutor *e, int device, uint64_t made_at)
{
    aclnnStatus ret = forward_destroy(e, device);
    if (ret != ACLNN_SUCCESS) {
        npa_mutex_lock(&exec_lock);
        set_insert(e, device, made_at);
        npa_mutex_unlock(&exec_lock);
    }
    return ret;
}

/* Neither a fence nor a synchronize: a kernel in flight may still use the
 * executor, and destroying it could crash the host. Keeping it costs only
 * host memory. */
static aclnnStatus keep(int device)
{
    npa_warn_once("cannot fence or synchronize device %d: an aclnn executor is kept, not destroyed", device);
    return ACLNN_SUCCESS;
}

/* exec_lock held: the destroys whose wait is over forwarded (their fence
 * done, or a synchronize of their device that began after they were
 * deferred succeeded: synced, bit per device, for those deferred by
 * deferred_through), the rest kept. Returns a refusal's error. */
static aclnnStatus forward_waited(uint64_t synced, uint64_t deferred_through)
{
    size_t kept = 0;
    aclnnStatus refused = ACLNN_SUCCESS;
    for (size_t i = 0; i < npending; i++) {
        deferred *d = &pending[i];
        bool synchronized = d->deferred_at <= deferred_through && (synced & (1ull << d->device));
        if (!synchronized && !npa_fence_done(NULL, d->fence)) {
            pending[kept++] = *d;
            continue;
        }
        npa_fence_release(NULL, d->fence);
        aclnnStatus ret = forward_destroy(d->executor, d->device);
        if (ret != ACLNN_SUCCESS) {
            /* Still live in the runtime: a later destroy of it goes there. */
            set_insert(d->executor, d->device, d->made_at);
            refused = ret;
        }
    }
    npending = kept;
    npa_entry_work_mark(NPA_WORK_EXECUTORS, kept != 0);
    return refused;
}

/* Without exec_lock (a forced drain's and a settle's, between their two
 * holds): each of devices synchronized; the bits of those that succeeded. */
static uint64_t synchronize_devices(uint64_t devices)
{
    uint64_t synced = 0;
    for (int d = 0; d < SETTLED_DEVICES; d++)
        if ((devices & (1ull << d)) && npa_hook_synchronize(d) == ACL_SUCCESS)
            synced |= 1ull << d;
    return synced;
}

/* Forced: a synchronize stands in for each fence not done, but only one
 * that succeeded proves the kernels using the executor are done. It runs
 * without exec_lock, as a settle's does: a thread making an executor
 * repeatable or destroying one meanwhile (both take the lock) waited for
 * all the device's queued work, and a host callback the synchronize waits
 * for doing either would wait for good. */
void npa_exec_drain(npa_drain how)
{
    uint64_t synced = 0, deferred_through = 0;
    if (how == NPA_DRAIN_ALL) {
        npa_mutex_lock(&exec_lock);
        uint64_t waiting = 0;
        for (size_t i = 0; i < npending; i++)
            if (!npa_fence_done(NULL, pending[i].fence))
                waiting |= 1ull << pending[i].device;
        deferred_through = deferrals;
        npa_mutex_unlock(&exec_lock);
        synced = synchronize_devices(waiting);
        npa_mutex_lock(&exec_lock);
    } else if (npa_mutex_trylock(&exec_lock) != 0) {
        return; /* another thread is draining: the allocation path never waits here */
    }
    aclnnStatus refused = forward_waited(synced, deferred_through);
    npa_mutex_unlock(&exec_lock);
    /* Its caller was told 0 when the destroy was deferred. */
    if (refused != ACLNN_SUCCESS)
        npa_warn_once("the runtime refused a deferred aclnn executor destroy (error %d); the executor is left "
                      "live, and its next destroy goes to the runtime again",
                      refused);
}

/* The synchronizes run without exec_lock: a host callback the device waits
 * for may make an executor repeatable or destroy one, which takes the lock,
 * and would wait for it for good. An executor made repeatable meanwhile
 * keeps its device: its launch may have come after the synchronize began. */
void npa_exec_settle(uint64_t devices)
{
    npa_mutex_lock(&exec_lock);
    uint64_t made_on = 0, made_before = set_generation;
    for (size_t i = 0; i < set_cap; i++) {
        int d = set_slots[i].device;
        aclOpExecutor *e = set_slots[i].executor;
        /* One a settle covered already may be on a device reset for good:
         * its synchronize would enter the device again. */
        if (e != NULL && e != TOMBSTONE && d >= 0 && set_slots[i].made_at > settled_through[d] &&
            (devices & (1ull << d)))
            made_on |= 1ull << d;
    }
    npa_mutex_unlock(&exec_lock);
    uint64_t settled = synchronize_devices(made_on);
    if (settled == 0)
        return;
    npa_mutex_lock(&exec_lock);
    for (int d = 0; d < SETTLED_DEVICES; d++)
        if ((settled & (1ull << d)) && settled_through[d] < made_before)
            settled_through[d] = made_before;
    npa_mutex_unlock(&exec_lock);
}

NPA_EXPORT aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor)
{
    __typeof__(&aclSetAclOpExecutorRepeatable) real = NPA_REAL(aclSetAclOpExecutorRepeatable);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclSetAclOpExecutorRepeatable);
    aclnnStatus ret = real(executor);
    if (ret == ACLNN_SUCCESS && executor != NULL && !npa_hook_disabled()) {
        /* As a destroy does: no runtime call of ours after aclFinalize. */
        int device = npa_hook_allocator() != NULL ? npa_thread_device() : npa_tls_device;
        npa_hook_register_handlers();
        npa_mutex_lock(&exec_lock);
        set_insert(executor, device, 0);
        npa_mutex_unlock(&exec_lock);
    }
    npa_exec_poll();
    return ret;
}

NPA_EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor)
{
    if (executor == NULL || npa_hook_disabled()) {
        __typeof__(&aclDestroyAclOpExecutor) real = NPA_REAL(aclDestroyAclOpExecutor);
        return real ? real(executor) : npa_no_runtime_error(NPA_FN_aclDestroyAclOpExecutor);
    }
    /* An executor means the process uses the NPU: create the allocator (and
     * its stats) now if no allocation did, so the destroy is counted. None
     * serves after aclFinalize, which waited for the work, and then nothing
     * of ours calls the runtime (not even to ask the device); nor when none
     * could be made, and then calls go to the runtime as without us. */
    bool serving = npa_hook_allocator() != NULL;
    int current = serving ? npa_thread_device() : npa_tls_device;
    int device = -1;
    uint64_t made_at = 0;
    npa_mutex_lock(&exec_lock);
    int repeatable = set_remove(executor, &device, &made_at);
    npa_mutex_unlock(&exec_lock);
    if (!repeatable) {
        /* Phase 2 destroyed it already, or this is a second destroy. */
        count(current, NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED);
        return ACLNN_SUCCESS;
    }
    if (device < 0)
        device = current;
    void *fence = NULL;
    if (serving && device >= 0 && npa_fence_record_always(NULL, device, &fence) != ACL_SUCCESS)
        return keep(device);
    if (fence == NULL) {
        /* Not serving, no device known for its launches (none where it
         * was made repeatable, or a teardown synchronized it, and none on
         * this thread), or the fence synchronized the device instead:
         * nothing left to wait for. */
        return destroy_now(executor, device, made_at);
    }
    npa_mutex_lock(&exec_lock);
    if (npending == cap_pending) {
        size_t ncap = cap_pending ? cap_pending * 2 : 16;
        deferred *np = realloc(pending, ncap * sizeof(*np));
        if (np == NULL) {
            /* No room to defer it: wait now, as a forced drain does. */
            npa_mutex_unlock(&exec_lock);
            bool done = npa_fence_done(NULL, fence) || npa_hook_synchronize(device) == ACL_SUCCESS;
            npa_fence_release(NULL, fence);
            if (!done)
                return keep(device);
            return destroy_now(executor, device, made_at);
        }
        pending = np;
        cap_pending = ncap;
    }
    pending[npending++] = (deferred){executor, fence, device, made_at, ++deferrals};
    npa_entry_work_mark(NPA_WORK_EXECUTORS, true);
    npa_mutex_unlock(&exec_lock);
    npa_exec_poll();
    return ACLNN_SUCCESS;
}

NPA_EXPORT aclnnStatus aclnnFinalize(void)
{
    __typeof__(&aclnnFinalize) real = NPA_REAL(aclnnFinalize);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclnnFinalize);
    /* The deferred destroys must reach the runtime while it still exists. */
    npa_exec_drain(NPA_DRAIN_ALL);
    return real();
}

#define SELF(n) extern __typeof__(n) npa_self_##n __attribute__((alias(#n), visibility("hidden")));
SELF(aclSetAclOpExecutorRepeatable) SELF(aclDestroyAclOpExecutor) SELF(aclnnFinalize)
#undef SELF

void npa_exec_lock_for_fork(void)
{
    npa_mutex_lock(&exec_lock);
}

void npa_exec_unlock_after_fork(void)
{
    npa_mutex_unlock(&exec_lock);
}

void npa_exec_forget_after_fork(void)
{
    /* The parent owns its executors: the child must not destroy them. */
    if (set_slots != NULL)
        for (size_t i = 0; i < set_cap; i++)
            set_slots[i] = (repeatable){NULL, -1, 0};
    set_used = set_live = 0;
    npending = 0;
    npa_entry_work_mark(NPA_WORK_EXECUTORS, false);
}
