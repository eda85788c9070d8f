/* The ACL entry points the program calls. Allocations and frees are served by
 * the caching allocator; the device and stream calls are forwarded and noted
 * (the current device per thread, the live streams), and aclrtResetDevice /
 * aclFinalize give our cache back before the runtime tears the device down.
 *
 * The hit path of aclrtMalloc/aclrtFree is: one acquire load (the allocator),
 * one thread-local load (the device), the region's pointer and command words,
 * npa_entry_work (aclrtMalloc also the runtime's malloc, found), then the
 * core, called from the exported function itself: the general path (setting
 * up what is missing, serving what the cache does not) is out of line, so
 * the exported function keeps no callee-saved registers for it. */
#include "hook.h"
#include "npualloc.h"
#include "region/region.h"

atomic_uint npa_entry_work;

/* Policies we serve from our segments (all HUGE_FIRST). P2P, 1 GB pages and
 * the memory-type / read-only flags ask for memory of another kind: those
 * calls go to the runtime whole, and their frees come back as not ours. */
static inline int cacheable_policy(aclrtMemMallocPolicy policy)
{
    return (unsigned)policy <= ACL_MEM_MALLOC_NORMAL_ONLY;
}

/* What npa_entry_work asks of a malloc entry, out of line and opaque to the
 * caller (noipa: no inlining, and no knowledge of which registers it keeps),
 * so that the hit path is the same machine code whether or not the idle
 * features are built in. 1: the memory saver served the allocation (its
 * result in *served). */
static __attribute__((noipa, cold)) int entry_work(unsigned work, int device, size_t size, void **devPtr,
                                                      aclError *served)
{
    if (work & NPA_WORK_EXECUTORS)
        npa_exec_drain(NPA_DRAIN_DONE);
#ifndef NPA_BENCH_WITHOUT_IDLE_FEATURES /* tools/bench.mk: the baseline that shows what these two cost unused */
    if (npa_saver_region >= 0) { /* inside npualloc.memory_saver.region() */
        int err = npa_saver_malloc(device, size, devPtr);
        if (err >= 0) {
            *served = err;
            return 1;
        }
    }
    if (work & NPA_WORK_PYSTACK)
        npa_pystack_take();
#else
    (void)device, (void)size, (void)devPtr, (void)served;
#endif
    return 0;
}

/* The stream a stream-aware caller allocates on, and how it uses the block. */
typedef struct stream_use {
    uintptr_t stream;
    npa_stream_flags flags;
} stream_use;

/* The cache's part of a malloc entry, once its checks passed. on: NULL for
 * the ACL entry points (no stream known: the reuse policy's fences), else
 * the stream-aware caller's stream. */
static NPA_ALWAYS_INLINE aclError cached_malloc(npa_allocator *a, int device, void **devPtr, size_t size,
                                                npa_entry entry, const stream_use *on)
{
    npa_error err = on != NULL ? npa_malloc_stream(a, device, size, entry, on->stream, on->flags, devPtr)
                               : npa_malloc(a, device, size, entry, devPtr);
    if (NPA_UNLIKELY(err == NPA_ERR_OOM))
        npa_oom_snapshot(a); /* outside the device lock, before the program sees the error */
    return err;
}

/* A malloc entry in general: sets up what is missing (the allocator, the
 * thread's device, the region or its command, the entry work), then serves
 * the call from the cache or hands it to the runtime. */
static __attribute__((noinline)) aclError malloc_setup(void **devPtr, size_t size, aclrtMemMallocPolicy policy,
                                                       npa_entry entry, npa_fn fn, const stream_use *on)
{
    npa_allocator *a = npa_hook_allocator();
    /* NULL devPtr and size 0 are the runtime's to refuse, with its own code. */
    if (a != NULL && devPtr != NULL && size != 0 && cacheable_policy(policy)) {
        int device = npa_thread_device();
        if (npa_device_in_range(device)) {
            if (npa_real(NPA_FN_aclrtMalloc) == NULL)
                return npa_no_runtime_error(fn);
            npa_region_poll(a);
            unsigned work = npa_entry_work_load();
            aclError served = ACL_SUCCESS;
            if (work != 0 && entry_work(work, device, size, devPtr, &served))
                return served;
            aclError err = cached_malloc(a, device, devPtr, size, entry, on);
            if (work & NPA_WORK_PYSTACK) /* the stack was this call's only (entry_work) */
                npa_pystack_drop();
            return err;
        }
        /* No device on this thread: the runtime reports that better than we can. */
    }
    __typeof__(&aclrtMalloc) real = (__typeof__(&aclrtMalloc))npa_real(fn);
    return real ? real(devPtr, size, policy) : npa_no_runtime_error(fn);
}

/* Whether a malloc entry finds everything set up: the allocator serving,
 * the thread's device known (device, from npa_tls_device), the runtime's
 * malloc found, the region made and no command waiting in it. */
static inline bool entry_ready(npa_allocator *a, int device)
{
    return a != NULL && npa_device_in_range(device) &&
           atomic_load_explicit(&npa_real_fns[NPA_FN_aclrtMalloc], memory_order_acquire) != NULL &&
           npa_region_steady();
}

/* Every malloc entry: when a program is in its steady state (entry_ready,
 * no entry work) and the call is one the cache serves, straight to the
 * core, keeping only the allocator across the call (for an OOM's
 * snapshot); anything else takes malloc_setup by a tail call, which checks
 * it all again and sets up what is missing. */
static NPA_ALWAYS_INLINE aclError malloc_entry(void **devPtr, size_t size, aclrtMemMallocPolicy policy,
                                               npa_entry entry, npa_fn fn, const stream_use *on)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    int device = npa_tls_device;
    if (NPA_LIKELY(entry_ready(a, device) && devPtr != NULL && size != 0 && cacheable_policy(policy) &&
                   npa_entry_work_load() == 0))
        return cached_malloc(a, device, devPtr, size, entry, on);
    return malloc_setup(devPtr, size, policy, entry, fn, on);
}

NPA_EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_entry(devPtr, size, policy, NPA_ENTRY_MALLOC, NPA_FN_aclrtMalloc, NULL);
}

NPA_EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_entry(devPtr, size, policy, NPA_ENTRY_ALIGN32, NPA_FN_aclrtMallocAlign32, NULL);
}

/* Same size contract as aclrtMalloc (the cached flavour only differs in the
 * host-side cache attribute of the mapping, which device memory ignores). */
NPA_EXPORT aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return malloc_entry(devPtr, size, policy, NPA_ENTRY_MALLOC, NPA_FN_aclrtMallocCached, NULL);
}

/* Frees: ours go back to the cache; a pointer we never made goes to the
 * runtime (torch_npu and MindTorch allocate through paths we may not see); a
 * pointer inside our segments that is not a live block (a double free, an
 * interior pointer) is refused with the runtime's free error. */
static aclError refuse_invalid_free(void *devPtr)
{
    /* One line for the first; the rest are counted (num_invalid_frees), since
     * a loop that double-frees would otherwise flood stderr. */
    static atomic_flag warned = ATOMIC_FLAG_INIT;
    if (!atomic_flag_test_and_set(&warned))
        npa_warn_once("aclrtFree(%p): not a live allocation (double free or interior pointer); refused with %d, "
                      "further ones are only counted",
                      devPtr, ACL_ERROR_RT_MEMORY_FREE);
    return ACL_ERROR_RT_MEMORY_FREE;
}

/* Both free entry points take (void *): a free the cache does not own goes
 * to the runtime's own entry, whole. */
typedef aclError (*npa_free_fn)(void *);

static aclError free_by_runtime(void *devPtr, npa_fn fn)
{
    npa_free_fn real = (npa_free_fn)npa_real(fn);
    return real ? real(devPtr) : npa_no_runtime_error(fn);
}

/* A free the cache refused (NPA_FREE_INVALID) or does not own: out of line,
 * so the hit path keeps nothing for it but devPtr. */
static __attribute__((noinline)) aclError free_not_cached(npa_free_result freed, void *devPtr, npa_fn fn)
{
    if (freed == NPA_FREE_INVALID)
        return refuse_invalid_free(devPtr);
    aclError err;
    if (npa_saver_free(devPtr, &err))
        return err;
    return free_by_runtime(devPtr, fn);
}

static NPA_ALWAYS_INLINE aclError free_through_cache(npa_allocator *a, void *devPtr, int device, npa_fn fn,
                                                     const uintptr_t *stream)
{
    if (a != NULL && devPtr != NULL) {
        npa_free_result freed = stream != NULL ? npa_free_stream(a, devPtr, *stream, device, NULL)
                                               : npa_free(a, devPtr, device, NULL);
        return NPA_LIKELY(freed == NPA_FREE_OK) ? ACL_SUCCESS : free_not_cached(freed, devPtr, fn);
    }
    return free_by_runtime(devPtr, fn);
}

/* free_through_cache with the caller's stack taken for the free's events
 * under record_context:all. */
static aclError free_with_stack(npa_allocator *a, void *devPtr, int device, npa_fn fn, const uintptr_t *stream)
{
    bool stack = a != NULL && devPtr != NULL && npa_pystack_take_for_free();
    aclError err = free_through_cache(a, devPtr, device, fn, stream);
    if (stack)
        npa_pystack_drop();
    return err;
}

/* A free entry in general: the region's command and the deferred executor
 * destroys first, then the cache. */
static __attribute__((noinline)) aclError free_setup(void *devPtr, npa_fn fn, const uintptr_t *stream)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (a != NULL && devPtr != NULL) {
        npa_region_poll(a);
        npa_exec_poll();
    }
    return free_with_stack(a, devPtr, npa_tls_device, fn, stream);
}

/* aclrtFree and the stream-aware free: with the region steady, no executor
 * destroys waiting and no stack to take, straight to the cache (as
 * malloc_entry). */
static NPA_ALWAYS_INLINE aclError free_entry(void *devPtr, npa_fn fn, const uintptr_t *stream)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (NPA_LIKELY(a != NULL && devPtr != NULL && npa_region_steady() &&
                   !(npa_entry_work_load() & (NPA_WORK_EXECUTORS | NPA_WORK_FREE_PYSTACK))))
        return free_through_cache(a, devPtr, npa_tls_device, fn, stream);
    return free_setup(devPtr, fn, stream);
}

NPA_EXPORT aclError aclrtFree(void *devPtr)
{
    return free_entry(devPtr, NPA_FN_aclrtFree, NULL);
}

/* The runtime's version synchronizes the device, then frees. For a block of
 * ours the synchronize is what the caller asked for (everything queued is
 * done, so the block is reusable at once) and the block goes to the cache; a
 * foreign pointer gets the runtime's own call, whole. The synchronize comes
 * first because ownership is only known by freeing, and a block back in the
 * cache before the sync could be handed to another thread while work still
 * uses it: a foreign pointer pays one extra synchronize for that. */
NPA_EXPORT aclError aclrtFreeWithDevSync(void *devPtr)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    int device = -1;
    if (a != NULL && devPtr != NULL) {
        device = npa_thread_device();
        npa_region_poll(a);
        if (device >= 0) {
            aclError err = npa_hook_synchronize(device);
            if (err != ACL_SUCCESS)
                return err;
        }
    }
    return free_with_stack(a, devPtr, device, NPA_FN_aclrtFreeWithDevSync, NULL);
}

/* npualloc.h's stream-aware entry: aclrtMalloc's contract (size rounding,
 * the calling thread's device, an aclError), plus the stream torch's
 * allocator interface passes. Served like aclrtMalloc when the cache is
 * off (the runtime's own malloc and free: nothing to record). Each has two
 * exported forms, pointers and integers (for cffi), over one body here:
 * calling the exported one would go through the PLT. */
static inline aclError malloc_stream(void **ptr, size_t size, uintptr_t stream, int flags)
{
    if ((flags & ~NPUALLOC_STREAM_HOST_WRITES) != 0)
        return ACL_ERROR_INVALID_PARAM;
    _Static_assert(NPUALLOC_STREAM_HOST_WRITES == NPA_STREAM_HOST_WRITES, "one meaning for the flag");
    stream_use on = {stream, (npa_stream_flags)flags};
    return malloc_entry(ptr, size, ACL_MEM_MALLOC_HUGE_FIRST, NPA_ENTRY_MALLOC, NPA_FN_aclrtMalloc, &on);
}

static inline aclError free_stream(void *ptr, uintptr_t stream)
{
    return free_entry(ptr, NPA_FN_aclrtFree, &stream);
}

NPA_EXPORT int npualloc_malloc_stream(void **ptr, size_t size, void *stream, int flags)
{
    return malloc_stream(ptr, size, (uintptr_t)stream, flags);
}

NPA_EXPORT int npualloc_free_stream(void *ptr, void *stream)
{
    return free_stream(ptr, (uintptr_t)stream);
}

/* The error of the calling thread's last npualloc_malloc_stream_addr: a
 * thread-local, as errno, so the address can be the return value. */
static NPA_TLS int malloc_stream_error;

NPA_EXPORT uintptr_t npualloc_malloc_stream_addr(size_t size, uintptr_t stream, int flags)
{
    void *ptr = NULL;
    malloc_stream_error = malloc_stream(&ptr, size, stream, flags);
    return malloc_stream_error == ACL_SUCCESS ? (uintptr_t)ptr : 0;
}

NPA_EXPORT int npualloc_malloc_stream_error(void)
{
    return malloc_stream_error;
}

NPA_EXPORT int npualloc_free_stream_addr(uintptr_t ptr, uintptr_t stream)
{
    return free_stream((void *)ptr, stream);
}

NPA_EXPORT int npualloc_record_stream(void *ptr, void *stream)
{
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (a == NULL)
        return ACL_SUCCESS; /* the runtime's blocks: it frees them at once, recorded or not */
    if (ptr != NULL && npa_record_stream(a, ptr, (uintptr_t)stream, npa_tls_device) == NPA_OK)
        return ACL_SUCCESS;
    npa_warn_once("npualloc_record_stream(%p): not a live allocation of npualloc's; refused with %d", ptr,
                  ACL_ERROR_INVALID_PARAM);
    return ACL_ERROR_INVALID_PARAM;
}

NPA_EXPORT aclError aclrtSetDevice(int32_t deviceId)
{
    __typeof__(&aclrtSetDevice) real = NPA_REAL(aclrtSetDevice);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtSetDevice);
    /* Counted before the call: a reset meanwhile must not take it for the last. */
    npa_device_ref_count(deviceId, 1);
    aclError err = real(deviceId);
    if (err == ACL_SUCCESS)
        npa_device_set_current(deviceId);
    else
        npa_device_ref_count(deviceId, -1);
    return err;
}

/* aclrtResetDevice, or aclrtResetDeviceForce (which releases the device
 * whatever its reference count): either may tear the device down. */
static aclError reset_device(aclError (*real)(int32_t), enum npa_fn fn, int32_t deviceId)
{
    if (real == NULL)
        return npa_no_runtime_error(fn);
    if (!npa_hook_disabled())
        npa_hook_before_reset(deviceId, fn == NPA_FN_aclrtResetDeviceForce);
    aclError err = npa_device_reset(real, deviceId, fn == NPA_FN_aclrtResetDeviceForce);
    /* The device may or may not still be current (SetDevice is counted): ask
     * the runtime again on this thread's next allocation. */
    npa_device_forget_current();
    return err;
}

NPA_EXPORT aclError aclrtResetDevice(int32_t deviceId)
{
    return reset_device(NPA_REAL(aclrtResetDevice), NPA_FN_aclrtResetDevice, deviceId);
}

NPA_EXPORT aclError aclrtResetDeviceForce(int32_t deviceId)
{
    aclError err = reset_device(NPA_REAL(aclrtResetDeviceForce), NPA_FN_aclrtResetDeviceForce, deviceId);
    /* Released for certain (a plain reset only at its last reference, which
     * we cannot see): its streams are no longer live, and fences record on
     * the device's streams again if one taken down by a plain reset had made
     * them synchronize (streams.c's unfenceable). */
    if (err == ACL_SUCCESS && !npa_hook_disabled())
        npa_streams_device_released(deviceId);
    return err;
}

/* A context belongs to one device, and creating one or making it current
 * makes that device the thread's current one without aclrtSetDevice: the
 * device is asked of the runtime again, so allocations land where the
 * runtime's would (MindTorch's pass-through trusts this record to skip
 * re-activating a device that is already current). */
static aclError note_context_device(aclError err)
{
    if (err == ACL_SUCCESS) {
        npa_device_forget_current();
        npa_thread_device_slow();
    }
    return err;
}

NPA_EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    __typeof__(&aclrtCreateContext) real = NPA_REAL(aclrtCreateContext);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtCreateContext);
    npa_device_ref_count(deviceId, 1); /* a context holds a reference on its device */
    unsigned force_resets = npa_device_force_resets(deviceId);
    aclError err = real(context, deviceId);
    if (err != ACL_SUCCESS)
        npa_device_ref_count(deviceId, -1);
    else if (!npa_hook_disabled())
        npa_context_created(*context, deviceId, force_resets);
    return note_context_device(err);
}

NPA_EXPORT aclError aclrtSetCurrentContext(aclrtContext context)
{
    __typeof__(&aclrtSetCurrentContext) real = NPA_REAL(aclrtSetCurrentContext);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtSetCurrentContext);
    return note_context_device(real(context));
}

/* Passed through, noting a default context handed out: the program may
 * destroy it, which the runtime refuses, and which must not be taken for
 * a teardown (contexts.c). */
NPA_EXPORT aclError aclrtGetCurrentContext(aclrtContext *context)
{
    __typeof__(&aclrtGetCurrentContext) real = NPA_REAL(aclrtGetCurrentContext);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtGetCurrentContext);
    aclError err = real(context);
    if (err == ACL_SUCCESS && context != NULL && *context != NULL && !npa_hook_disabled())
        npa_context_handed_out(*context);
    return err;
}

/* A context holds a reference on its device, and destroying the last one
 * resets the device, freeing every segment of ours on it: cached ones would
 * be handed out again after it. Which device a context is on the runtime
 * does not say without making it current, and the one its creation named
 * (contexts.c) settles only that device's repeatable executors; every
 * device's cache is still given back first, as at aclFinalize (live blocks
 * stay the program's, as at aclrtResetDevice): a context we misjudged
 * would leave dead segments in the cache. Contexts are destroyed at
 * teardown, rarely: the cost is the segments mallocs made again. */
NPA_EXPORT aclError aclrtDestroyContext(aclrtContext context)
{
    __typeof__(&aclrtDestroyContext) real = NPA_REAL(aclrtDestroyContext);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtDestroyContext);
    bool ours = !npa_hook_disabled();
    unsigned force_resets = 0;
    int device = ours ? npa_context_device(context, &force_resets) : -1;
    if (ours)
        npa_hook_before_context_destroy(device);
    aclError err = real(context);
    if (ours && err == ACL_SUCCESS) {
        npa_context_destroyed(context);
        /* A force reset since its creation dropped its reference already:
         * dropped again, the count fell below what the program holds, and
         * its next teardown there counted as perhaps the last. */
        if (npa_device_force_resets(device) == force_resets)
            npa_device_ref_count(device, -1);
    }
    npa_device_forget_current(); /* the current context may have been this one */
    return err;
}

NPA_EXPORT aclError aclInit(const char *configPath)
{
    __typeof__(&aclInit) real = NPA_REAL(aclInit);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclInit);
    aclError err = real(configPath);
    if (err == ACL_SUCCESS)
        npa_hook_after_init();
    return err;
}

NPA_EXPORT aclError aclFinalize(void)
{
    __typeof__(&aclFinalize) real = NPA_REAL(aclFinalize);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclFinalize);
    if (!npa_hook_disabled())
        npa_hook_before_finalize();
    return real();
}

/* A stream created by any of the runtime's constructors is one more stream a
 * freed block's fence must cover (stream-safe reuse). */
static aclError note_created_stream(aclError err, aclrtStream *stream)
{
    if (err == ACL_SUCCESS && stream != NULL && !npa_hook_disabled()) {
        npa_hook_register_handlers();
        npa_streams_add(npa_thread_device(), *stream);
    }
    return err;
}

NPA_EXPORT aclError aclrtCreateStream(aclrtStream *stream)
{
    __typeof__(&aclrtCreateStream) real = NPA_REAL(aclrtCreateStream);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtCreateStream);
    return note_created_stream(real(stream), stream);
}

/* What MindTorch v2 and torch_npu create their streams with. */
NPA_EXPORT aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag)
{
    __typeof__(&aclrtCreateStreamWithConfig) real = NPA_REAL(aclrtCreateStreamWithConfig);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtCreateStreamWithConfig);
    return note_created_stream(real(stream, priority, flag), stream);
}

/* aclrtDestroyStream, which waits for the stream's queued work, or
 * aclrtDestroyStreamForce, which drops what has not run: either way none of
 * its work is left to run once it returns. */
static aclError destroy_stream(aclError (*real)(aclrtStream), enum npa_fn fn, aclrtStream stream)
{
    if (real == NULL)
        return npa_no_runtime_error(fn);
    /* The runtime's destroy waits, between our dying and dead: cancelled
     * there, the device's fences would synchronize for good (hook.h's
     * npa_cancel_off). */
    npa_cancel_off();
    /* Untracked first, so no fence records on a stream being destroyed;
     * until the runtime's destroy returns, the device's fences synchronize
     * instead, which waits for the stream's work. */
    npa_stream_death death = npa_streams_dying(stream);
    /* The default stream (NULL) is the runtime's to refuse: its pools stay. */
    npa_allocator *a = stream != NULL ? atomic_load_explicit(&npa_serving, memory_order_acquire) : NULL;
    uint64_t token = npa_stream_retire(a, (uintptr_t)stream);
    aclError err = real(stream);
    npa_streams_dead(death, stream, err == ACL_SUCCESS);
    if (err == ACL_SUCCESS)
        npa_stream_destroyed(a, token);
    else
        npa_stream_not_destroyed(a, token);
    npa_cancel_on();
    return err;
}

NPA_EXPORT aclError aclrtDestroyStream(aclrtStream stream)
{
    return destroy_stream(NPA_REAL(aclrtDestroyStream), NPA_FN_aclrtDestroyStream, stream);
}

NPA_EXPORT aclError aclrtDestroyStreamForce(aclrtStream stream)
{
    return destroy_stream(NPA_REAL(aclrtDestroyStreamForce), NPA_FN_aclrtDestroyStreamForce, stream);
}

#define SELF(n) extern __typeof__(n) npa_self_##n __attribute__((alias(#n), visibility("hidden")));
SELF(aclInit) SELF(aclFinalize) SELF(aclrtSetDevice) SELF(aclrtResetDevice) SELF(aclrtResetDeviceForce)
SELF(aclrtCreateContext)
SELF(aclrtSetCurrentContext) SELF(aclrtDestroyContext) SELF(aclrtGetCurrentContext) SELF(aclrtMalloc)
SELF(aclrtMallocAlign32) SELF(aclrtMallocCached) SELF(aclrtFree) SELF(aclrtFreeWithDevSync)
SELF(aclrtCreateStream) SELF(aclrtDestroyStream) SELF(aclrtDestroyStreamForce) SELF(aclrtCreateStreamWithConfig)
#undef SELF
