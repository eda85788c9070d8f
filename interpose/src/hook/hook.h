/* The hook layer's internal interface: the pieces of libnpualloc.so that sit
 * between the program's ACL calls and the allocator core. One concern per file:
 *   realacl.c   finding the real runtime's functions (never our own)
 *   dlsym.c     the exported dlsym that hands out our functions for handle lookups
 *   device.c    the device current on each thread, and switching to another one
 *   contexts.c  the device each context the program created is on
 *   streams.c   live streams per device and the event fences of stream-safe reuse
 *   executors.c aclnn executor destroys: skip double frees, defer the real ones
 *   lifecycle.c lazy init, the backend, reset/finalize, exit and fork
 *   exports.c   the aclrt* / acl* entry points the program calls, and npualloc.h's stream-aware ones
 *   api.c       npualloc.h, the in-process C API
 *   caching_alloc.c  npualloc.h's torch.cuda.caching_allocator_alloc/_delete (a named device and stream)
 *   snapshot.c  memory snapshots written to files (OOM, another process's request)
 *   vmm.c       physical memory mapped at reserved addresses, and back
 *   saver.c     pausable allocations (npualloc.memory_saver): pause and resume
 *   pause.c     `npualloc pause <pid>`: the whole process paused until resume
 *   warn.c      once-only stderr warnings
 *   cancel.c    thread cancellation held off under our locks; the exit's bounded lock wait
 *   pystack.c   Python stacks of recorded allocations (record_stacks:python)
 *
 * Lock order of libnpualloc.so, outermost first. A thread holding one of
 * these takes only locks further down the list; none is held across a call
 * back into the program, except by a pause (3), whose 4 and 5 stay held
 * until its resume, so allocator calls of other threads wait meanwhile.
 * Checked against every lock site (issue 11 item 16).
 *   0. first_stream_lock (streams.c): the first stream's creation, which
 *      synchronizes the devices in use; under it only 7, warn.c's seen_lock
 *      and the runtime.
 *      Not taken by fork_prepare: the child re-initialises it.
 *   1. init_lock (lifecycle.c): lazy init (the region is made only there:
 *      8 under it), finalize, exit, fork_prepare.
 *   2. exec_lock (executors.c): deferred executor destroys; under it a drain
 *      polls fences, forwards destroys and counts into a device's stats (5).
 *      A forced drain and a settle synchronize between two holds of it, not
 *      under it.
 *   3. command lock (region.c g_command_lock): one thread applies another
 *      process's command; under it empty_cache, resets, snapshots and a
 *      memory fraction take the device locks one at a time (5; a memory
 *      fraction may create its device: 4), and the config text (8).
 *      A pause (pause.c, core pausable.c) takes 4 and then every device
 *      lock (5) in ascending order and holds them until its resume.
 *      Never nested with 1 or 2: a command that set a run-time key keeps
 *      it for later allocators (1, npa_hook_remember_config) after 3 is
 *      released. Exit takes it (with none of ours held) to wait for a
 *      command's acknowledgement before the region goes.
 *   4. the allocator's device-table lock (core internal.h init_lock):
 *      device creation asks the runtime for memory info and may create the
 *      region (8); record_history and finalize's npa_detach_stats_storage
 *      take each device lock (5) under it, one at a time;
 *      the GC threshold and expandable_segments setters (their torch_npu
 *      rule checked against each other) take nothing under it.
 *   5. a device lock (core internal.h npa_device.lock, a futex word:
 *      core lock.h; any thread may release it): one device at a
 *      time, never two (except a pause: all, ascending, under 4; and
 *      aclrtDestroyStream takes each in turn, with none of ours held,
 *      before and after the runtime's destroy). It guards
 *      all of the device's state but its threads' caches (5a). Under it
 *      the core takes 5a and calls the backend: raw
 *      malloc/free, synchronize, mem info, VMM calls (the runtime), and
 *      fences, which take
 *   6. that device's stream lock (streams.c dev_streams.lock), held across
 *      aclrtCreateEvent/RecordEvent/DestroyEvent but released before a
 *      synchronize. Only fork_prepare holds several, in ascending order.
 *   5a. a thread's cache of a device (core tcache.c npa_tcache.lock, a
 *      futex word): its owner takes it alone on its fast paths, holding
 *      none of ours and taking nothing under it; otherwise only under that
 *      device's lock (5): one at a time (a block it lent taken back, a
 *      flush while the fast paths are off), or all of them in index order
 *      to freeze the fast paths (snapshots, the stats' reads, the peaks'
 *      ceilings), the freezing thread's own only tried (its fast path may
 *      be what a signal handler interrupted). Before 4 and 5 comes the
 *      core's registry of live allocators (tcache.c registry_lock): a
 *      thread that exits or moves to another allocator folds its caches
 *      back under it, taking each device lock (5) in turn; a device's
 *      exit_lock (core internal.h), a leaf under 5 or the registry lock,
 *      tells it the device is paused, its cache then left for the resume.
 *   6b. saver_lock (saver.c): the pausable allocations. Taken by a malloc
 *      or free of one, by memory_saver's pause/resume and by the region
 *      (8) writes of their figures, with none of 1-6 held, and by a pause
 *      of the whole process (3) after 4 and 5, held with them until its
 *      resume; under it the runtime (VMM calls, copies, a pause's
 *      synchronize; a free's runs outside it, and a pause, a resume or a
 *      second free of that block waits on free_ended, releasing it), a first
 *      lookup of a runtime function (7), warn and the region's create lock (8).
 *   7. open_lock (realacl.c): the first lookup of a runtime function.
 *   7b. stack_lock (pystack.c): taken with none of ours held (after the
 *      GIL) to capture a stack at a malloc entry, and under a device lock (5)
 *      when a snapshot reads stacks; under it only the Python API and
 *      malloc (its warnings wait for the release). The GIL is never waited
 *      for with any of ours held.
 *   8. the region's create lock (region.c g_create_lock): under it only
 *      warn.c's seen_lock (a region directory taken by another user is
 *      warned about while the region is created), a leaf that takes nothing.
 *   9. ref_lock (device.c): our aclrtSetDevice/aclrtResetDevice calls with
 *      the guard's record of a kept reference, and the program's
 *      aclrtResetDeviceForce's updates of the record before and after the
 *      runtime's call, never across it (its drain may wait for a host
 *      callback that calls us); taken under any of the others (the core's
 *      switches of device run under many), and under it only the runtime.
 *  10. context_lock (contexts.c): the device of each context created, and
 *      the default contexts handed out; a leaf, under it nothing, not even
 *      the runtime.
 * The runtime's own locks come after all of ours: it is called with 5 and 6
 * held and never calls back into the allocator.
 * fork_prepare takes 1, 2, every 6 (ascending), 6b, 7, 7b, seen_lock, 9 and
 * 10, in that order, so no thread is inside those sections when the address
 * space is copied (a fork during `npualloc pause` waits for the resume, 6b being
 * held); it leaves out 3, 4, 5 and g_create_lock, which the child never
 * takes from the parent's state (it builds a new allocator, and region.c
 * re-initialises its locks in the child). A region is never half made at
 * fork: it is made under 1, and the handlers are registered before the
 * first init takes 1 (npa_hook_init). Nothing of ours calls pthread_atfork
 * with one of these held: a glibc that holds its atfork lock across the
 * prepare handlers would never give it to us while a fork waits there. */
#ifndef NPUALLOC_HOOK_H
#define NPUALLOC_HOOK_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>

#include "acl/acl.h"
#include "aclnn/acl_meta.h"
#include "core.h"

/* Only what carries this leaves the library (it is built -fvisibility=hidden). */
#define NPA_EXPORT __attribute__((visibility("default")))
#define NPA_HIDDEN __attribute__((visibility("hidden")))
/* Thread-locals read on the allocation path: a fixed offset from the thread
 * pointer instead of a __tls_get_addr call. */
#define NPA_TLS __thread __attribute__((tls_model("initial-exec")))
#define NPA_LIKELY(x) __builtin_expect(!!(x), 1)
#define NPA_UNLIKELY(x) __builtin_expect(!!(x), 0)

/* ---- cancel.c ------------------------------------------------------------- */

/* A thread that pthread_cancel (deferred, the default) stops at a
 * cancellation point of ours, a runtime call that waits or a write, a
 * dlopen or an open, unwinds with whatever lock of ours it held, and every
 * later allocator call waits for it for good (an audit's thread cancelled
 * in its first aclrtMalloc: the region's open, under init_lock). So
 * cancellation is off while a thread holds one of our mutexes (the
 * npa_mutex_ calls) or calls the runtime for the core, under a device lock
 * (npa_device_enter to npa_device_leave, the fence query, a warning's
 * write): a cancel sent meanwhile acts at the program's next cancellation
 * point. Nested holds count; the outermost restores the thread's state. */
extern NPA_TLS unsigned npa_cancel_depth;
extern NPA_TLS int npa_cancel_saved;
static inline void npa_cancel_off(void)
{
    if (npa_cancel_depth++ == 0)
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &npa_cancel_saved);
}
static inline void npa_cancel_on(void)
{
    if (--npa_cancel_depth == 0)
        pthread_setcancelstate(npa_cancel_saved, NULL);
}
static inline void npa_mutex_lock(pthread_mutex_t *m)
{
    npa_cancel_off();
    pthread_mutex_lock(m);
}
static inline void npa_mutex_unlock(pthread_mutex_t *m)
{
    pthread_mutex_unlock(m);
    npa_cancel_on();
}
static inline int npa_mutex_trylock(pthread_mutex_t *m)
{
    npa_cancel_off();
    int busy = pthread_mutex_trylock(m);
    if (busy)
        npa_cancel_on();
    return busy;
}

/* The exit's wait for a lock another thread holds (a command being
 * applied, a pause until its resume), and the most it waits: the exiting
 * thread itself may hold the lock, interrupted by a signal whose handler
 * calls exit, and would wait for good. 0 when taken. */
#define NPA_EXIT_WAIT_MS 1000
int npa_mutex_lock_at_exit(pthread_mutex_t *m);
/* One pause of an exit's bounded retries (npa_mutex_lock_at_exit's, the
 * release of busy devices' caches): a relative sleep, which a step of the
 * wall clock does not stretch, counted in *waited_ms; false, without
 * sleeping, once NPA_EXIT_WAIT_MS have been waited. */
bool npa_exit_wait_more(int *waited_ms);

/* ---- realacl.c ------------------------------------------------------------ */

/* Every runtime function the hook layer calls or hands out. The first
 * NPA_FN_INTERPOSED_COUNT are also exported by us, in this order. */
typedef enum npa_fn {
    NPA_FN_aclInit,
    NPA_FN_aclFinalize,
    NPA_FN_aclrtSetDevice,
    NPA_FN_aclrtResetDevice,
    NPA_FN_aclrtResetDeviceForce,
    NPA_FN_aclrtCreateContext,
    NPA_FN_aclrtSetCurrentContext,
    NPA_FN_aclrtDestroyContext,
    NPA_FN_aclrtGetCurrentContext,
    NPA_FN_aclrtMalloc,
    NPA_FN_aclrtMallocAlign32,
    NPA_FN_aclrtMallocCached,
    NPA_FN_aclrtFree,
    NPA_FN_aclrtFreeWithDevSync,
    NPA_FN_aclrtCreateStream,
    NPA_FN_aclrtDestroyStream,
    NPA_FN_aclrtDestroyStreamForce,
    NPA_FN_aclrtCreateStreamWithConfig,
    NPA_FN_aclnnFinalize,
    NPA_FN_aclSetAclOpExecutorRepeatable,
    NPA_FN_aclDestroyAclOpExecutor,
    NPA_FN_INTERPOSED_COUNT,
    /* Called by the hook layer only. */
    NPA_FN_aclrtGetDevice = NPA_FN_INTERPOSED_COUNT,
    NPA_FN_aclrtSynchronizeDevice,
    NPA_FN_aclrtGetMemInfo,
    NPA_FN_aclrtCreateEvent,
    NPA_FN_aclrtRecordEvent,
    NPA_FN_aclrtQueryEventStatus,
    NPA_FN_aclrtDestroyEvent,
    /* The virtual memory API, for expandable segments (optional). */
    NPA_FN_aclrtReserveMemAddress,
    NPA_FN_aclrtReleaseMemAddress,
    NPA_FN_aclrtMallocPhysical,
    NPA_FN_aclrtFreePhysical,
    NPA_FN_aclrtMapMem,
    NPA_FN_aclrtUnmapMem,
    NPA_FN_aclrtMemcpy, /* the memory saver's host backups */
    NPA_FN_aclrtGetDeviceCount, /* npualloc_device_count */
    NPA_FN_COUNT
} npa_fn;

/* The real function, resolved once and cached; NULL when no runtime provides it
 * (warned once per function; the caller returns npa_no_runtime_error). */
void *npa_real_slow(npa_fn fn);
extern _Atomic(void *) npa_real_fns[NPA_FN_COUNT];
static inline void *npa_real(npa_fn fn)
{
    void *p = atomic_load_explicit(&npa_real_fns[fn], memory_order_acquire);
    return NPA_LIKELY(p != NULL) ? p : npa_real_slow(fn);
}
#define NPA_REAL(name) ((__typeof__(&name))npa_real(NPA_FN_##name))
/* The same for a function an older runtime may lack: NULL without a warning. */
void *npa_real_optional(npa_fn fn);
/* The error a call returns when the runtime cannot be found. */
int npa_no_runtime_error(npa_fn fn);

/* For dlsym: the npa_fn of an interposed name (-1 if not ours), our own
 * function for it, and recording a real one found through a handle. */
int npa_interposed_index(const char *name);
void *npa_self_fn(int index);
void npa_real_offer(int index, void *fn);
/* The real dlsym (dlvsym of the newest glibc version that exists), NULL if
 * none; npa_real_dlsym calls it (RTLD_NEXT then means "after libnpualloc"). */
typedef void *(*npa_dlsym_fn)(void *, const char *);
npa_dlsym_fn npa_get_real_dlsym(void);
void *npa_real_dlsym(void *handle, const char *name);

/* ---- device.c ------------------------------------------------------------- */

/* A device index npualloc keeps state for (region slots, bit masks, tables). */
static inline bool npa_device_in_range(int device)
{
    return device >= 0 && device < NPUALLOC_MAX_DEVICES;
}

extern NPA_TLS int npa_tls_device; /* -1: not known on this thread yet */
int npa_thread_device_slow(void);
/* The device current on this thread: the recorded one, else asked of the
 * runtime once; -1 when the thread has none. */
static inline int npa_thread_device(void)
{
    int d = npa_tls_device;
    return NPA_LIKELY(d >= 0) ? d : npa_thread_device_slow();
}
void npa_device_set_current(int device); /* after a successful SetDevice */
void npa_device_forget_current(void);    /* after ResetDevice */
/* Devices that have been current on some thread (bit per device). */
unsigned npa_devices_seen(void);
/* The devices the runtime sees (aclrtGetDeviceCount); -1 when it cannot say. */
int npa_runtime_device_count(void);
/* A reference on device taken (delta 1: before the program's SetDevice or
 * CreateContext, undone with -1 when it failed) or dropped (-1: after a
 * context's destroy) where device.c does not see the runtime's call. */
void npa_device_ref_count(int device, int delta);
/* The devices (bit per device, 64) that a reference dropped now may
 * release: those holding at most one by the calls npualloc saw, and those
 * beyond the ones it counts; device >= 0: that device's bit alone. */
uint64_t npa_devices_at_last_reference(int device);
void npa_devices_released(void); /* at aclFinalize: no reference is left */
unsigned npa_device_force_resets(int device); /* aclrtResetDeviceForce calls begun on it */

/* ---- contexts.c ----------------------------------------------------------- */

/* After the program's aclrtCreateContext: the context is on device, whose
 * force resets begun before the call were force_resets. */
void npa_context_created(aclrtContext context, int device, unsigned force_resets);
/* After the program's aclrtGetCurrentContext: one not created through us
 * is its device's default context. */
void npa_context_handed_out(aclrtContext context);
/* npa_context_device's answer for a default context. */
#define NPA_CONTEXT_DEFAULT (-2)
/* The device of a context created through us (and *force_resets, as
 * given), NPA_CONTEXT_DEFAULT for a default one, else -1. */
int npa_context_device(aclrtContext context, unsigned *force_resets);
void npa_context_destroyed(aclrtContext context); /* after its destroy succeeded */
void npa_contexts_forget(void);                   /* at aclFinalize */
void npa_contexts_lock_for_fork(void);
void npa_contexts_unlock_after_fork(void);

/* Making `device` current for one runtime call and restoring afterwards.
 * keep: the leave leaves the device's reference in place (a guard's). */
typedef struct npa_devswitch {
    int device, prev, switched, keep;
    unsigned force_resets;   /* the device's force resets begun, when the switch took its reference */
    bool force_reset_running; /* and whether one was under way then */
} npa_devswitch;
aclError npa_device_enter(int device, npa_devswitch *s);
void npa_device_leave(npa_devswitch *s);
/* torch's device guard, for a call that names its device
 * (npualloc_caching_allocator_alloc): the device is current on the thread,
 * for the runtime and for our record (so the entry points serve it there),
 * until the leave makes the previous one current again. What is allocated
 * under it outlives it, and the reset that drops a device's last reference
 * tears the device down with its memory, so the first guard into each device
 * keeps the reference its enter took, as torch_npu's guard initialises a
 * device for the rest of the run, until a reset of the device: then the
 * next guard keeps one again. A thread that had no device keeps the kept
 * one current. */
typedef struct npa_device_guard {
    npa_devswitch sw;
    int prev_record;
} npa_device_guard;
aclError npa_device_guard_enter(int device, npa_device_guard *g);
void npa_device_guard_leave(npa_device_guard *g);
/* The program's aclrtResetDevice (force 0) or aclrtResetDeviceForce, real
 * being the runtime's, with the guard's record: any successful reset
 * forgets the kept reference (a force reset drops it whatever the count; a
 * plain one may have: a thread left on the kept device resetting it), so
 * the next guard keeps one again; at worst the device then holds one
 * reference more, kept initialised until a force reset, never one fewer. */
aclError npa_device_reset(aclError (*real)(int32_t), int32_t device, bool force);
void npa_device_lock_for_fork(void);
void npa_device_forget_after_fork(void);
void npa_device_unlock_after_fork(void);

/* ---- streams.c ------------------------------------------------------------ */

void npa_streams_add(int device, aclrtStream stream);
/* Around the runtime's destroy: dying untracks the stream and counts it as
 * dying on its device (fences over that device's streams synchronize until
 * it is dead); dead, with what dying returned, ends the count, tracks a
 * refused stream again, and once destroyed settles the events that fences
 * recorded on it before: none of its work is left to run, and an event
 * behind work aclrtDestroyStreamForce dropped may never complete. */
typedef struct npa_stream_death {
    int tracked;             /* 1 + the device it was live on, 0 when not tracked */
    uint64_t fences_before;  /* fences recorded before it was untracked */
} npa_stream_death;
npa_stream_death npa_streams_dying(aclrtStream stream);
void npa_streams_dead(npa_stream_death death, aclrtStream stream, int destroyed);
/* After aclrtResetDeviceForce: the device's streams are destroyed with it,
 * no longer live, and no fence waits for their events. */
void npa_streams_device_released(int device);
/* A fence over every live stream of the device and its default stream,
 * whatever the reuse policy (the executors need one always; and it is
 * backend.fence_record_always, ctx unused), into *fence. ACL_SUCCESS with
 * *fence NULL only when the fence could not be recorded and the device was
 * synchronized instead. An error (the device cannot be entered, or the
 * synchronize failed) leaves *fence NULL and proves nothing: the caller
 * must go on treating the work as queued. */
npa_error npa_fence_record_always(void *ctx, int device, void **fence);
/* backend.fence_record_streams: one event on each stream named (blocks of
 * the stream-aware entry recorded on other streams), whatever the policy;
 * falls back to a synchronize as npa_fence_record_always does. */
npa_error npa_fence_record_streams(void *ctx, int device, const uintptr_t *streams, size_t count, void **fence);
/* The backend's fence_needed word for config's reuse_policy (core.h). */
const atomic_int *npa_fence_needed_word(const npa_config *config);
npa_error npa_fence_record(void *ctx, int device, void **fence); /* backend: honours reuse_policy */
int npa_fence_done(void *ctx, void *fence);
void npa_fence_release(void *ctx, void *fence);
/* device < 0: all; before reset/finalize, and at exit (at_exit: a device
 * whose lock stays taken keeps its events). */
void npa_streams_destroy_events(int device, bool at_exit);
void npa_streams_forget_after_fork(void);
void npa_streams_lock_for_fork(void);
void npa_streams_unlock_after_fork(void);

/* ---- executors.c ---------------------------------------------------------- */

/* What an allocator entry must look at besides allocating, in one word, so
 * that a program using none of it pays one relaxed load and one branch per
 * call (make bench section 1 measures it against a build without the
 * memory_saver and record_stacks tests): deferred executor destroys
 * (executors.c), record_stacks switched on (pystack.c: a malloc takes the
 * caller's stack) and with record_context:all (a free takes it too), and
 * how many threads are inside a memory_saver region (saver.c, counted from
 * bit 8). A bit may read set when its work is already gone (the entry then
 * finds nothing to do); it never reads clear while its work is there. */
#define NPA_WORK_EXECUTORS 1u
#define NPA_WORK_PYSTACK 2u
#define NPA_WORK_FREE_PYSTACK 4u
#define NPA_WORK_SAVER_REGION (1u << 8)
extern atomic_uint npa_entry_work;
static inline void npa_entry_work_mark(unsigned bit, bool on)
{
    if (on)
        atomic_fetch_or_explicit(&npa_entry_work, bit, memory_order_relaxed);
    else
        atomic_fetch_and_explicit(&npa_entry_work, ~bit, memory_order_relaxed);
}
static inline unsigned npa_entry_work_load(void)
{
    return atomic_load_explicit(&npa_entry_work, memory_order_relaxed);
}

/* Deferred executor destroys forwarded: those whose fences completed, unless
 * another thread drains (NPA_DRAIN_DONE); every one deferred before it
 * began, synchronizing for the rest (NPA_DRAIN_ALL; one deferred during
 * its synchronize waits for its fence, as one deferred after it). */
typedef enum npa_drain { NPA_DRAIN_DONE, NPA_DRAIN_ALL } npa_drain;
void npa_exec_drain(npa_drain how);
/* Before the runtime may tear devices down (a reset, a context's destroy,
 * aclFinalize; devices: bit per device, those the teardown may release):
 * each of them that repeatable executors were made on is synchronized, and
 * they forget it. A destroy after the teardown must not enter the device
 * again to fence their launches (on real hardware a full init and teardown
 * of the device, for each destroy). A device that cannot be synchronized
 * keeps them: their destroys fence it. A device the teardown leaves up
 * (not its last reference) is left out: its executors may be launched
 * again, and their destroys fence it. */
void npa_exec_settle(uint64_t devices);
static inline void npa_exec_poll(void)
{
    if (NPA_UNLIKELY(npa_entry_work_load() & NPA_WORK_EXECUTORS))
        npa_exec_drain(NPA_DRAIN_DONE);
}
void npa_exec_forget_after_fork(void);
void npa_exec_lock_for_fork(void);
void npa_exec_unlock_after_fork(void);

/* ---- lifecycle.c ---------------------------------------------------------- */

/* The allocator serving calls: NULL before init (see npa_hook_allocator),
 * when disabled, after aclFinalize. */
extern _Atomic(npa_allocator *) npa_serving;
npa_allocator *npa_hook_init(void);
/* The allocator for the next malloc, initialising on the first call. */
static inline npa_allocator *npa_hook_allocator(void)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    return NPA_LIKELY(a != NULL) ? a : npa_hook_init();
}
/* The allocator whatever its state (stats stay readable after aclFinalize). */
npa_allocator *npa_hook_allocator_any(void);
int npa_hook_disabled(void); /* NPUALLOC_DISABLE / PYTORCH_NO_CUDA_MEMORY_CACHING */
/* The config from the environment, parsed once (its warnings printed once). */
const npa_config *npa_hook_config(void);
/* Where a user sets it: the variable it came from (MindTorch's before
 * torch's), `npualloc run --conf`, or PYTORCH_NPU_ALLOC_CONF when none is set. */
const char *npa_hook_config_source(void);
/* The config keys npualloc_set_config may change at run time. */
typedef enum npa_runtime_key {
    NPA_KEY_GC_THRESHOLD,
    NPA_KEY_RECORD_HISTORY,
    NPA_KEY_RECORD_STACKS,
    NPA_KEY_RECORD_CONTEXT,
    NPA_KEY_EXPANDABLE_SEGMENTS,
} npa_runtime_key;
/* A run-time key set before the first allocation: the allocator is created
 * with it; -1 when torch_npu's rule refuses it (warned through warn). When
 * an allocator exists by now, *allocator names it and the caller applies
 * the key there instead. */
int npa_hook_preinit_config(const npa_config *parsed, npa_runtime_key key, npa_config_warn_fn warn,
                            npa_allocator **allocator);
/* A run-time key the allocator took: the config a later allocator starts
 * with (a forked child's, a new runtime session's) takes it too, so the
 * settings in force stay process-wide, as torch's. */
void npa_hook_remember_config(const npa_config *parsed, npa_runtime_key key);
/* backend.synchronize: wait for all work queued on the device. */
npa_error npa_hook_synchronize(int device);
/* backend.mem_get_info and npualloc_mem_get_info: the device's HBM free and
 * total bytes, asked on that device. */
npa_error npa_hook_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes);
/* torch's set_per_process_memory_fraction on one device of a (NULL: this
 * process's allocator, made if it is not yet, once the arguments passed),
 * for npualloc_set_memory_fraction and another process's command alike: 0,
 * or -1 with why (a phrase) and nothing changed: a fraction outside [0, 1],
 * a bad device or one the runtime cannot tell the size of, no allocator, a
 * cap below the smallest segment. */
int npa_hook_set_memory_fraction(npa_allocator *a, int device, double fraction, const char **why);
/* force: aclrtResetDeviceForce, which releases the device whatever its
 * references; a plain reset settles its executors only where it may be
 * the device's last (npa_devices_at_last_reference). */
void npa_hook_before_reset(int device, bool force);
/* The repeatable executors settled on the context's device (-1, a context
 * we do not know: on every device; none for NPA_CONTEXT_DEFAULT) where the
 * destroy may drop its last reference, then every device's cache given
 * back, under init_lock (1). */
void npa_hook_before_context_destroy(int device);
void npa_hook_before_finalize(void);
void npa_hook_after_init(void);
/* atexit and pthread_atfork, registered once the process uses the NPU
 * through us (so a process that never does pays nothing). */
void npa_hook_register_handlers(void);
void npa_realacl_lock_for_fork(void);
void npa_realacl_unlock_after_fork(void);

/* ---- vmm.c ---------------------------------------------------------------- */

/* New physical memory of the device mapped at [addr, addr + size) of a
 * reservation, named by *handle; and the reverse, unmap then free. An error
 * changes nothing (a failed free maps the handle back). The device is entered. */
aclError npa_vmm_map(int device, void *addr, size_t size, void **handle);
aclError npa_vmm_unmap(void *addr, size_t size, void *handle);

/* ---- saver.c -------------------------------------------------------------- */

/* The memory saver region of this thread: -1 outside one (the allocation
 * path tests only this), else its enable_cpu_backup (0 or 1). */
extern NPA_TLS int npa_saver_region;
/* An allocation inside a region: its own VMM range on the device, tagged.
 * -1 when this runtime has no virtual memory API (the caller serves it as
 * an ordinary allocation), else an aclError. */
int npa_saver_malloc(int device, size_t size, void **ptr);
/* A free of a pausable allocation: 1 (freed, *err its result), 0 not one. */
int npa_saver_free(void *ptr, aclError *err);
/* `npualloc pause <pid>` (pause.c): every pausable allocation not paused
 * already is backed up and released, all or none; on success saver_lock
 * stays held (no saver call of any thread runs) until npa_saver_command_done.
 * Its resume maps back what the command released (retryable). */
aclError npa_saver_command_pause(char *why, size_t len);
aclError npa_saver_command_resume(char *why, size_t len);
/* saver_lock held (the command's): the bytes the command released that are
 * released still, and their backup. A resume that failed may have mapped
 * some back. */
void npa_saver_command_paused_bytes(size_t *released, size_t *backup);
void npa_saver_command_hold(void); /* saver_lock alone, for a pause that released nothing of ours */
void npa_saver_command_done(void);
void npa_saver_lock_for_fork(void);
void npa_saver_unlock_after_fork(void);
void npa_saver_forget_after_fork(void); /* in the child, saver_lock held */

/* ---- snapshot.c ----------------------------------------------------------- */

/* Writes the torch snapshot pickle to name in the directory dir_fd (the
 * region's, opened safely); 0 or an errno value. A new or our own regular
 * file is written atomically (mode 0600); our own FIFO or a character device
 * is written to; anything else is refused (snapshot.c says how). Takes the
 * device locks: call with none held. */
int npa_snapshot_write_at(npa_allocator *a, int dir_fd, const char *name);
/* The reason for a snapshot write's error, for its warning. */
const char *npa_snapshot_strerror(int err);
/* After an OOM: the snapshot to oom_snapshot's path, if one is configured. */
void npa_oom_snapshot(npa_allocator *a);

/* ---- warn.c --------------------------------------------------------------- */

/* "npualloc: <message>\n" on stderr in one write, at most once per distinct
 * message text (a process may hit the same problem millions of times), and at
 * most NPA_WARNINGS_PER_SITE distinct texts from one call site, the last
 * saying that later ones are not shown: a site whose text carries what the
 * program passed (npualloc_record_stream's pointer, a snapshot request's
 * number) prints a few lines, not one per call, and leaves the others theirs. */
#define NPA_WARNINGS_PER_SITE 8
typedef struct {
    unsigned shown; /* distinct texts printed; under warn.c's seen_lock */
} npa_warn_site;
/* site NULL: no per-site limit (npa_warn_forwarded). */
void npa_warn_once_at(npa_warn_site *site, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define npa_warn_once(...)                                                                                  \
    do {                                                                                                    \
        static npa_warn_site npa_warn_site_;                                                                \
        npa_warn_once_at(&npa_warn_site_, __VA_ARGS__);                                                     \
    } while (0)
/* Once per distinct text, for a site that forwards messages made elsewhere
 * (the core's, the config parser's): they are of many kinds, each bounded
 * where it is made, and one limit for all would let one kind hide another. */
#define npa_warn_forwarded(...) npa_warn_once_at(NULL, __VA_ARGS__)

/* ---- pystack.c ------------------------------------------------------------ */

/* record_stacks: at a malloc entry, with no npualloc lock held, the
 * caller's Python stack is taken for the core's capture_stack (the backend's
 * capture_stack / visit_stack), when npa_entry_work says it is on; the
 * entry drops it once the core returned, so no later call finds it. */
void npa_pystack_take(void); /* NPA_WORK_PYSTACK set: record_stacks is on */
void npa_pystack_drop(void);
/* A free-side entry (a free, empty_cache) under record_context:all takes
 * the caller's stack for its events, as torch's free and emptyCache gather
 * their context; true when it took one, which it drops once done. */
static inline bool npa_pystack_take_for_free(void)
{
    if (!(npa_entry_work_load() & NPA_WORK_FREE_PYSTACK))
        return false;
    npa_pystack_take();
    return true;
}
uint32_t npa_pystack_capture(void *ctx);
void npa_pystack_visit(void *ctx, uint32_t stack, npa_frame_visitor visit, void *arg);
/* The entry work of record_stacks (at mallocs) and record_context:all (at
 * frees too), from the config in force. */
void npa_pystack_enable(const npa_config *config);
void npa_pystack_lock_for_fork(void);
void npa_pystack_unlock_after_fork(void);
void npa_warn_lock_for_fork(void);
void npa_warn_unlock_after_fork(void);

#endif
