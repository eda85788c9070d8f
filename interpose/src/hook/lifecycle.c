/* Lazy init, the backend over the real runtime, and the ends of a process's
 * life with the NPU: aclrtResetDevice, aclFinalize, exit and fork.
 *
 * Loading the library does nothing: no constructor, no file. The allocator,
 * its stats region and the exit/fork handlers appear on the first allocation
 * (or the first stream, executor or caching_allocator_delete), so a process
 * that never touches the NPU pays nothing and leaves nothing behind. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "hook.h"
#include "region/region.h"

_Atomic(npa_allocator *) npa_serving;
static _Atomic(npa_allocator *) any_allocator;

enum { ST_UNINIT, ST_ACTIVE, ST_FINALIZED };
static int state; /* under init_lock */
/* First in the lock order (hook.h): taken with no other lock of ours held. */
static pthread_mutex_t init_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- environment ---------------------------------------------------------- */

static int env_true(const char *name)
{
    const char *v = getenv(name);
    return v && (strcmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
                 strcasecmp(v, "on") == 0);
}

static atomic_int disabled_cache; /* 0 not read yet, 1 enabled, 2 disabled */

int npa_hook_disabled(void)
{
    int d = atomic_load_explicit(&disabled_cache, memory_order_relaxed);
    if (NPA_LIKELY(d != 0))
        return d == 2;
    d = env_true("NPUALLOC_DISABLE") || env_true("PYTORCH_NO_CUDA_MEMORY_CACHING") ? 2 : 1;
    atomic_store_explicit(&disabled_cache, d, memory_order_relaxed);
    return d == 2;
}

static npa_config config;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static const char *config_var;

/* The variable is parsed over the defaults (load_config). */
static void config_warn(void *arg, const char *message, npa_config_kept kept)
{
    (void)arg;
    static const char *const what_stays[] = {
        [NPA_KEPT_SAID] = "", [NPA_KEPT_BEFORE] = " (default kept)", [NPA_KEPT_EARLIER] = " (earlier value kept)"};
    npa_warn_forwarded("%s: %s%s", config_var, message, what_stays[kept]);
}

/* `npualloc run --conf` and `npualloc replay --conf` set the variable and
 * say so (NPUALLOC_CONF_FROM=run|replay): warnings name what the user typed.
 * run+variable: run added its --conf after the keys the user had set in
 * var, so a bad entry may be in either. Called once (config_once). */
static const char *config_source(const char *var)
{
    static char both[64];
    const char *from = getenv("NPUALLOC_CONF_FROM");
    if (from != NULL && strcmp(from, "run") == 0)
        return "npualloc run --conf";
    if (from != NULL && strcmp(from, "run+variable") == 0) {
        snprintf(both, sizeof both, "%s and npualloc run --conf", var);
        return both;
    }
    if (from != NULL && strcmp(from, "replay") == 0)
        return "npualloc replay --conf";
    return var;
}

/* The first of the variables set to something: one set empty counts as
 * unset, as MindTorch reads its own (an empty MINDTORCH_NPU_ALLOC_CONF
 * falls through to PYTORCH_CUDA_ALLOC_CONF there), so `VAR= prog` or a
 * launcher's `export VAR=$UNSET` does not hide a config set further down. */
static void load_config(void)
{
    npa_config_defaults(&config);
    static const char *const vars[] = {"MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF",
                                       "PYTORCH_CUDA_ALLOC_CONF"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *text = getenv(vars[i]);
        if (text != NULL && text[0] != '\0') {
            config_var = config_source(vars[i]);
            npa_config_parse(&config, text, config_warn, NULL);
            npa_pystack_enable(&config);
            break;
        }
    }
}

const npa_config *npa_hook_config(void)
{
    pthread_once(&config_once, load_config);
    return &config;
}

const char *npa_hook_config_source(void)
{
    pthread_once(&config_once, load_config);
    return config_var != NULL ? config_var : "PYTORCH_NPU_ALLOC_CONF";
}

/* Under init_lock. Atomic stores: npualloc_get_config reads this config
 * without the lock before the allocator exists. The entries' stack work
 * follows the two stack keys together, under the lock, so two threads
 * setting one each cannot leave it as neither config says. */
static void store_key(const npa_config *parsed, npa_runtime_key key)
{
    if (key == NPA_KEY_GC_THRESHOLD)
        __atomic_store(&config.garbage_collection_threshold, &parsed->garbage_collection_threshold,
                       __ATOMIC_RELAXED);
    else if (key == NPA_KEY_EXPANDABLE_SEGMENTS)
        __atomic_store_n(&config.expandable_segments, parsed->expandable_segments, __ATOMIC_RELAXED);
    else if (key == NPA_KEY_RECORD_HISTORY)
        __atomic_store_n(&config.record_history, parsed->record_history, __ATOMIC_RELAXED);
    else if (key == NPA_KEY_RECORD_CONTEXT)
        __atomic_store_n(&config.record_context, parsed->record_context, __ATOMIC_RELAXED);
    else
        __atomic_store_n(&config.record_stacks, parsed->record_stacks, __ATOMIC_RELAXED);
    if (key == NPA_KEY_RECORD_STACKS || key == NPA_KEY_RECORD_CONTEXT)
        npa_pystack_enable(&config);
}

int npa_hook_preinit_config(const npa_config *parsed, npa_runtime_key key, npa_config_warn_fn warn,
                            npa_allocator **allocator)
{
    npa_hook_config();
    bool applied = true;
    npa_mutex_lock(&init_lock);
    npa_allocator *a = atomic_load_explicit(&any_allocator, memory_order_acquire);
    if (a == NULL) {
        if (key == NPA_KEY_GC_THRESHOLD)
            applied = npa_config_set_gc_threshold(&config, parsed->garbage_collection_threshold, warn, NULL);
        else if (key == NPA_KEY_EXPANDABLE_SEGMENTS)
            applied = npa_config_set_expandable(&config, parsed->expandable_segments, warn, NULL);
        else
            store_key(parsed, key);
    }
    npa_mutex_unlock(&init_lock);
    *allocator = a;
    return applied ? 0 : -1;
}

void npa_hook_remember_config(const npa_config *parsed, npa_runtime_key key)
{
    npa_mutex_lock(&init_lock);
    store_key(parsed, key);
    npa_mutex_unlock(&init_lock);
}

/* ---- the backend ---------------------------------------------------------- */

static npa_error be_raw_malloc(void *ctx, int device, size_t size, void **ptr)
{
    (void)ctx;
    /* A segment is asked for exactly, as torch_npu asks: aclrtMalloc would
     * charge 32 bytes past the core's 2 MiB multiple, and a device of two
     * segments' size then held one. The blocks inside keep their own pad. */
    __typeof__(&aclrtMalloc) real = NPA_REAL(aclrtMallocAlign32);
    if (real == NULL)
        real = NPA_REAL(aclrtMalloc);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtMalloc);
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = real(ptr, size, ACL_MEM_MALLOC_HUGE_FIRST);
    npa_device_leave(&sw);
    return err;
}

static npa_error be_raw_free(void *ctx, int device, void *ptr)
{
    (void)ctx;
    __typeof__(&aclrtFree) real = NPA_REAL(aclrtFree);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtFree);
    /* aclrtFree needs a context on the calling thread, and empty_cache or a
     * reset may free another device's segments. */
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = real(ptr);
    npa_device_leave(&sw);
    return err;
}

npa_error npa_hook_synchronize(int device)
{
    __typeof__(&aclrtSynchronizeDevice) real = NPA_REAL(aclrtSynchronizeDevice);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtSynchronizeDevice);
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = real();
    npa_device_leave(&sw);
    return err;
}

static npa_error be_synchronize(void *ctx, int device)
{
    (void)ctx;
    return npa_hook_synchronize(device);
}

npa_error npa_hook_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    __typeof__(&aclrtGetMemInfo) real = NPA_REAL(aclrtGetMemInfo);
    if (real == NULL)
        return npa_no_runtime_error(NPA_FN_aclrtGetMemInfo);
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = real(ACL_HBM_MEM, free_bytes, total_bytes);
    npa_device_leave(&sw);
    return err;
}

static npa_error be_mem_get_info(void *ctx, int device, size_t *free_bytes, size_t *total_bytes)
{
    (void)ctx;
    return npa_hook_mem_get_info(device, free_bytes, total_bytes);
}

static void be_warn(void *ctx, const char *message)
{
    (void)ctx;
    npa_warn_forwarded("%s", message);
}

/* The first few OOMs' reports, each on a line of its own (a program that
 * catches OOMs, a batch-size search, would print one per try for hours);
 * num_ooms counts every one. */
static void be_report_oom(void *ctx, int device, const char *message)
{
    (void)ctx, (void)device;
    npa_warn_once("%s", message);
}

static npualloc_device_stats *be_stats_storage(void *ctx, int device)
{
    (void)ctx;
    return npa_region_device_stats(device);
}

static npualloc_thread_stats *be_thread_stats_storage(void *ctx, int device)
{
    (void)ctx;
    return npa_region_thread_stats(device);
}

/* Virtual memory, for expandable segments: torch_npu's calls. A page is one
 * physical allocation of HBM huge pages mapped at its address, so any page
 * can be unmapped alone. */
static npa_error be_va_reserve(void *ctx, int device, size_t size, void **base)
{
    (void)ctx;
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtReserveMemAddress)(base, size, 0, NULL, 0);
    npa_device_leave(&sw);
    if (err != ACL_SUCCESS)
        npa_warn_once("aclrtReserveMemAddress failed on device %d (error %d): it uses plain segments instead of "
                      "expandable ones",
                      device, err);
    return err;
}

static npa_error be_page_map(void *ctx, int device, void *addr, size_t size, void **handle)
{
    (void)ctx;
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = npa_vmm_map(device, addr, size, handle);
    npa_device_leave(&sw);
    return err;
}

static npa_error be_page_unmap(void *ctx, int device, void *addr, size_t size, void *handle)
{
    (void)ctx;
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = npa_vmm_unmap(addr, size, handle);
    npa_device_leave(&sw);
    return err;
}

static npa_error be_va_release(void *ctx, int device, void *base)
{
    (void)ctx;
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtReleaseMemAddress)(base);
    npa_device_leave(&sw);
    return err;
}

/* Copies for pausing a process (npa_pause): the device is entered, as the
 * pausing thread may have another current. */
static npa_error copy_entered(int device, void *dst, const void *src, size_t size, aclrtMemcpyKind kind)
{
    npa_devswitch sw;
    npa_error err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtMemcpy)(dst, size, src, size, kind);
    npa_device_leave(&sw);
    return err;
}

static npa_error be_copy_to_host(void *ctx, int device, void *host, const void *dev, size_t size)
{
    (void)ctx;
    return copy_entered(device, host, dev, size, ACL_MEMCPY_DEVICE_TO_HOST);
}

static npa_error be_copy_to_device(void *ctx, int device, void *dev, const void *host, size_t size)
{
    (void)ctx;
    return copy_entered(device, dev, host, size, ACL_MEMCPY_HOST_TO_DEVICE);
}

static const npa_backend backend = {
    .ctx = NULL,
    .raw_malloc = be_raw_malloc,
    .raw_free = be_raw_free,
    .synchronize = be_synchronize,
    .mem_get_info = be_mem_get_info,
    .fence_record = npa_fence_record,
    .fence_record_always = npa_fence_record_always,
    .fence_done = npa_fence_done,
    .fence_release = npa_fence_release,
    .fence_record_streams = npa_fence_record_streams,
    .warn = be_warn,
    .report_oom = be_report_oom,
    .stats_storage = be_stats_storage,
    .thread_stats_storage = be_thread_stats_storage,
    .capture_stack = npa_pystack_capture,
    .visit_stack = npa_pystack_visit,
};

/* ---- init ----------------------------------------------------------------- */

/* The backend for the config: with the virtual memory calls whenever the
 * runtime has them all, since expandable_segments may be switched on at run
 * time (npualloc_set_config); the core grows plain segments while it is off. */
static npa_backend backend_for(const npa_config *c)
{
    npa_backend b = backend;
    b.ctx = (void *)c; /* the config in force: npa_fence_record reads its reuse policy */
    b.fence_needed = npa_fence_needed_word(c);
    static const npa_fn vmm[] = {NPA_FN_aclrtReserveMemAddress, NPA_FN_aclrtReleaseMemAddress,
                                 NPA_FN_aclrtMallocPhysical,    NPA_FN_aclrtFreePhysical,
                                 NPA_FN_aclrtMapMem,            NPA_FN_aclrtUnmapMem};
    for (size_t i = 0; i < sizeof(vmm) / sizeof(vmm[0]); i++) {
        if (npa_real_optional(vmm[i]) == NULL) {
            if (c->expandable_segments)
                npa_warn_once("expandable_segments:True needs the runtime's virtual memory API "
                              "(aclrtReserveMemAddress, aclrtMallocPhysical, aclrtMapMem, ...), which it lacks; "
                              "plain segments are used");
            return b;
        }
    }
    b.va_reserve = be_va_reserve;
    b.page_map = be_page_map;
    b.page_unmap = be_page_unmap;
    b.va_release = be_va_release;
    if (npa_real_optional(NPA_FN_aclrtMemcpy) != NULL) { /* what `npualloc pause` needs beside the VMM calls */
        b.copy_to_host = be_copy_to_host;
        b.copy_to_device = be_copy_to_device;
    }
    return b;
}

npa_allocator *npa_hook_init(void)
{
    if (npa_hook_disabled())
        return NULL;
    /* Before the first init, not after: a thread forking during it (the
     * region made, its directory and locked file open, init_lock held)
     * must wait in fork_prepare, else its child kept those descriptors
     * and a held init_lock, its first allocation waiting for good. */
    npa_hook_register_handlers();
    npa_mutex_lock(&init_lock);
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (a == NULL && state == ST_UNINIT) {
        const npa_config *c = npa_hook_config();
        npa_backend b = backend_for(c);
        a = npa_create(&b, c);
        npa_region_publish_config(a); /* what the core put in force (none without an allocator) */
        /* For readers in other processes, which refuse a device past it
         * as the process's own calls do (memory.py _own_device). */
        npa_region_publish_device_count(npa_runtime_device_count());
        /* Made once the config is known, so a reader that finds the file
         * never sees it without one (backend_for's lookups took long enough
         * for exports_stress's reader to copy an empty config), and before
         * the core asks where its stats live. */
        npa_region_get();
        if (a != NULL) {
            atomic_store_explicit(&any_allocator, a, memory_order_release);
            atomic_store_explicit(&npa_serving, a, memory_order_release);
            state = ST_ACTIVE;
        } else {
            npa_warn_once("cannot create the allocator (out of host memory?); calls go to the runtime uncached");
        }
    }
    npa_mutex_unlock(&init_lock);
    return a;
}

npa_allocator *npa_hook_allocator_any(void)
{
    return atomic_load_explicit(&any_allocator, memory_order_acquire);
}

/* Before the runtime may tear devices down (bit per device): the deferred
 * executor destroys forwarded, and the repeatable executors made on them
 * settled. */
static void settle_executors(uint64_t devices)
{
    npa_exec_drain(NPA_DRAIN_ALL);
    npa_exec_settle(devices);
}

/* npa_empty_cache, its device synchronized first with no lock held where
 * the release would synchronize: the release does so again under the
 * device's lock, and every other thread's malloc and free on the device
 * waited there for all of its queued work; now only for what was queued
 * during the first. A first synchronize that fails changes nothing: the
 * release's own decides what goes back. */
static void empty_cache_synchronized_first(npa_allocator *a, int device)
{
    if (npa_empty_cache_would_synchronize(a, device))
        (void)npa_hook_synchronize(device);
    npa_empty_cache(a, device);
}

/* Give a device's cache back before the runtime tears it down: deferred
 * executor destroys first (they may still wait on that device's streams) and
 * the repeatable executors made on it settled, then pending frees and cached
 * segments, then our idle events. */
void npa_hook_before_reset(int device, bool force)
{
    settle_executors(force && device >= 0 && device < 64 ? 1ull << device : npa_devices_at_last_reference(device));
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (a != NULL)
        empty_cache_synchronized_first(a, device);
    npa_streams_destroy_events(device, false);
}

/* Every device's cache back. At exit no device lock is waited for past
 * NPA_EXIT_WAIT_MS (another thread's pause holds them until its resume; the
 * exiting thread itself may hold one, interrupted on the hit path by a
 * signal whose handler calls exit: an audit's SIGTERM handler hung 6 exits
 * in 20 for good), and deferred executor destroys are left to the
 * runtime's teardown, as what stays behind is: forwarding one counts into
 * a device's stats under its lock, which waited for a pause for good. */
static void release_everything(npa_allocator *a, bool at_exit)
{
    if (a != NULL && !at_exit) {
        unsigned seen = npa_devices_seen();
        for (int d = 0; d < NPUALLOC_MAX_DEVICES; d++)
            if (seen & (1u << d))
                empty_cache_synchronized_first(a, d);
    } else if (a != NULL) {
        int waited_ms = 0;
        unsigned left = npa_empty_cache_unless_busy(a, npa_devices_seen());
        while (left != 0 && npa_exit_wait_more(&waited_ms))
            left = npa_empty_cache_unless_busy(a, left);
    }
    npa_streams_destroy_events(-1, at_exit);
}

void npa_hook_before_context_destroy(int device)
{
    npa_mutex_lock(&init_lock);
    if (state == ST_ACTIVE || state == ST_UNINIT) {
        /* A default context's destroy the runtime refuses: settled, the
         * executors forgot a device still running their launches. Its cache
         * is given back all the same, in case a runtime took it down. */
        settle_executors(device == NPA_CONTEXT_DEFAULT ? 0 : npa_devices_at_last_reference(device));
        release_everything(atomic_load_explicit(&npa_serving, memory_order_acquire), false);
    }
    npa_mutex_unlock(&init_lock);
}

/* After this nothing of ours calls the runtime: later allocator calls pass
 * straight through (the runtime answers them as it would without us), until
 * an aclInit starts a new session with a fresh cache. */
void npa_hook_before_finalize(void)
{
    npa_mutex_lock(&init_lock);
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    int live = state != ST_FINALIZED;
    if (live) {
        settle_executors(~0ull);
        release_everything(a, false);
        npa_contexts_forget();
        npa_devices_released();
        atomic_store_explicit(&npa_serving, NULL, memory_order_release);
        /* The next session's allocator writes the region's stats from its
         * first call on; this one (still reached by npa_hook_allocator_any
         * and by calls already inside it) must no longer: two writers of one
         * seqlock, under two device locks, can leave seq odd for good. */
        npa_detach_stats_storage(a);
        state = ST_FINALIZED;
    }
    npa_mutex_unlock(&init_lock);
}

void npa_hook_after_init(void)
{
    npa_mutex_lock(&init_lock);
    /* A new runtime session: the old cache's segments died with the last
     * one, so the next allocation builds a new allocator. */
    if (state == ST_FINALIZED)
        state = ST_UNINIT;
    npa_mutex_unlock(&init_lock);
}

/* ---- exit and fork -------------------------------------------------------- */

/* Runs before the runtime's own teardown (the runtime registers its handlers
 * at load or aclInit, before our first allocation). A program that never
 * finalized gets its cache returned, so the runtime sees no leak of ours. */
static void at_exit(void)
{
    /* A pause (pause.c) holds the device locks until its resume, and the
     * exiting thread may hold any of ours (release_everything): no lock is
     * waited for past NPA_EXIT_WAIT_MS here (README). A thread that holds
     * one of our mutexes or is in a runtime call for us (a signal handler's
     * exit interrupted it there) leaves everything to the runtime. */
    if (npa_cancel_depth > 0) {
        npa_region_remove();
        return;
    }
    if (npa_mutex_trylock(&init_lock) != 0)
        return; /* another thread is mid-init or mid-finalize: never hang exit */
    if (state == ST_ACTIVE || state == ST_UNINIT)
        release_everything(atomic_load_explicit(&npa_serving, memory_order_acquire), true);
    npa_mutex_unlock(&init_lock);
    npa_region_remove();
}

static void fork_prepare(void)
{
    /* No thread may be inside one of our critical sections when the address
     * space is copied, or the child would inherit a lock nobody releases.
     * Taken in the lock order of hook.h. The core's own locks need no such
     * care: the child never touches the parent's allocator again. */
    npa_mutex_lock(&init_lock);
    npa_exec_lock_for_fork();
    npa_streams_lock_for_fork();
    npa_saver_lock_for_fork();
    npa_realacl_lock_for_fork();
    npa_pystack_lock_for_fork();
    npa_warn_lock_for_fork();
    npa_device_lock_for_fork();
    npa_contexts_lock_for_fork();
}

static void fork_parent(void)
{
    npa_contexts_unlock_after_fork();
    npa_device_unlock_after_fork();
    npa_warn_unlock_after_fork();
    npa_pystack_unlock_after_fork();
    npa_realacl_unlock_after_fork();
    npa_saver_unlock_after_fork();
    npa_streams_unlock_after_fork();
    npa_exec_unlock_after_fork();
    npa_mutex_unlock(&init_lock);
}

static void fork_child(void)
{
    /* The child starts with an empty cache of its own: the parent's allocator
     * is dropped as it is (its segments are the parent's device memory, never
     * to be freed from here; its locks may be held by threads that did not
     * come along), and the next allocation creates a new one with new stats. */
    atomic_store_explicit(&npa_serving, NULL, memory_order_relaxed);
    atomic_store_explicit(&any_allocator, NULL, memory_order_relaxed);
    if (state == ST_ACTIVE)
        state = ST_UNINIT;
    npa_streams_forget_after_fork();
    npa_exec_forget_after_fork();
    npa_region_forget_after_fork();
    npa_saver_forget_after_fork();
    npa_device_forget_after_fork();
    npa_forget_threads_after_fork(); /* no thread of the child folds its caches into the dropped allocator */
    fork_parent();
}

static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;

static void register_handlers(void)
{
    atexit(at_exit);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
}

void npa_hook_register_handlers(void)
{
    pthread_once(&handlers_once, register_handlers);
}
