/* The device current on each thread. aclrtMalloc carries no device, and
 * asking the runtime on every call would cost more than the cache saves, so
 * we record what aclrtSetDevice made current (it goes through us) and ask
 * aclrtGetDevice only for a thread that never set a device through us. */
#include "hook.h"

NPA_TLS int npa_tls_device = -1;

/* Sequentially consistent, as is live_streams (streams.c): a first stream's
 * creator adds itself to live_streams, then reads this to know which
 * devices to synchronize, while a thread that set a device here launches
 * on it, then frees and reads live_streams (the core, through
 * npa_fence_needed_word) to know whether the block may be reused at once.
 * A store-buffering pair: with weaker orders C11 lets both read the old
 * value, the creator skipping that device's default-stream work and the
 * free not waiting for it. */
static atomic_uint devices_seen;

static void note_seen(int device)
{
    if (device >= 0 && device < 32)
        atomic_fetch_or_explicit(&devices_seen, 1u << device, memory_order_seq_cst);
}

unsigned npa_devices_seen(void)
{
    return atomic_load_explicit(&devices_seen, memory_order_seq_cst);
}

int npa_runtime_device_count(void)
{
    __typeof__(&aclrtGetDeviceCount) real = npa_real_optional(NPA_FN_aclrtGetDeviceCount);
    uint32_t count = 0;
    if (real == NULL || real(&count) != ACL_SUCCESS || count > INT32_MAX)
        return -1;
    return (int)count;
}

int npa_thread_device_slow(void)
{
    __typeof__(&aclrtGetDevice) get = NPA_REAL(aclrtGetDevice);
    int32_t device = -1;
    /* A failure (no device on this thread) is not remembered: the thread may
     * set one later through a path we do not see. */
    if (get == NULL || get(&device) != ACL_SUCCESS || device < 0)
        return -1;
    npa_tls_device = device;
    note_seen(device);
    return device;
}

void npa_device_set_current(int device)
{
    npa_tls_device = device;
    note_seen(device);
}

void npa_device_forget_current(void)
{
    npa_tls_device = -1;
}

/* The runtime's synchronize, mem-info and event calls act on the thread's
 * current device. When the core asks about another one we switch for the one
 * call. SetDevice is reference-counted (process-wide) against ResetDevice, so
 * every SetDevice we make is matched by a ResetDevice: the borrowed device's
 * count ends where it was, and the way back to the previous device is a
 * SetDevice+ResetDevice pair on it, which leaves it current (it was current,
 * so its count stays above zero).
 *
 * aclrtResetDeviceForce drops every reference, ours included, whatever the
 * count, and another thread may call it at any time. So each runtime call
 * of ours that takes or drops a reference runs under ref_lock together with
 * its record, and a force reset says under it when it begins and when it
 * has returned. A switch whose reference a force reset may have dropped
 * (one began after the switch's SetDevice, or was under way at it, when
 * the SetDevice may have come before the release or after it) leaves the
 * reference alone: resetting it would drop one taken since, a kept one
 * perhaps, or the guard's own under its new block; at worst the device
 * keeps one reference more. Nor does a guard keep its reference then: the
 * next guard keeps one. The lock is never held across the runtime's force
 * reset: that drains the device's streams, whose host callbacks (run on
 * another thread, aclrtLaunchCallback) may call us and switch devices.
 * A plain reset drops one reference, which the counts absorb in any order.
 * Lock order (hook.h): innermost; under it only the runtime. */
static pthread_mutex_t ref_lock = PTHREAD_MUTEX_INITIALIZER;
/* Devices a guard set and kept its reference on (bit per device). */
static unsigned devices_kept; /* ref_lock */
/* The references the runtime holds on each device by the calls we saw take
 * and drop them (the program's SetDevice, ResetDevice and contexts, our
 * switches): a teardown whose device holds more than one cannot release
 * it (npa_devices_at_last_reference). A reference taken where we cannot
 * see it (inside the runtime) makes this count low, and a teardown then
 * counts as perhaps the last, as it did before anything was counted; one
 * dropped where we cannot see it (a context outlived by a force reset, a
 * reset more than the device's references) makes it high, and a destroy
 * then fences a device that was released, which costs a device init.
 * Atomic, not under ref_lock: the program's SetDevice counts its reference
 * and must not wait for our switches, which hold ref_lock across runtime
 * calls. Relaxed: a count read as a hint, publishing nothing. */
static atomic_uint refs[NPUALLOC_MAX_DEVICES];
/* Force resets per device: begun, and of those, not yet returned. */
static unsigned force_resets_begun[NPUALLOC_MAX_DEVICES];   /* ref_lock */
static unsigned force_resets_running[NPUALLOC_MAX_DEVICES]; /* ref_lock */

/* A reset more than the device's references is tolerated by the runtime:
 * the count stays at 0. */
void npa_device_ref_count(int device, int delta)
{
    if (!npa_device_in_range(device))
        return;
    if (delta > 0) {
        atomic_fetch_add_explicit(&refs[device], 1, memory_order_relaxed);
        return;
    }
    unsigned n = atomic_load_explicit(&refs[device], memory_order_relaxed);
    while (n > 0 && !atomic_compare_exchange_weak_explicit(&refs[device], &n, n - 1, memory_order_relaxed,
                                                           memory_order_relaxed))
        ;
}

static void count_released(int device)
{
    atomic_store_explicit(&refs[device], 0, memory_order_relaxed);
}

uint64_t npa_devices_at_last_reference(int device)
{
    uint64_t last = ~0ull << NPUALLOC_MAX_DEVICES; /* not counted: perhaps */
    for (int d = 0; d < NPUALLOC_MAX_DEVICES; d++)
        if (atomic_load_explicit(&refs[d], memory_order_relaxed) <= 1)
            last |= 1ull << d;
    if (device < 0)
        return last;
    return device < 64 ? last & (1ull << device) : 0;
}

void npa_devices_released(void)
{
    for (int d = 0; d < NPUALLOC_MAX_DEVICES; d++)
        count_released(d);
}

/* The force resets of the device begun so far: a context created before
 * one lost its reference to it (aclrtDestroyContext, exports.c). */
unsigned npa_device_force_resets(int device)
{
    if (!npa_device_in_range(device))
        return 0;
    npa_mutex_lock(&ref_lock);
    unsigned n = force_resets_begun[device];
    npa_mutex_unlock(&ref_lock);
    return n;
}

static bool force_reset_running(int device)
{
    return npa_device_in_range(device) && force_resets_running[device] != 0;
}

/* ref_lock held: whether a force reset of the switch's device may have
 * dropped the reference its SetDevice took. */
static bool reference_maybe_dropped(const npa_devswitch *s)
{
    return s->force_reset_running ||
           (npa_device_in_range(s->device) && force_resets_begun[s->device] != s->force_resets);
}

/* keep_first: the guard's; the first into a device keeps its reference. */
static aclError enter(int device, npa_devswitch *s, bool keep_first)
{
    /* Until the leave: what follows calls the runtime, often under a device
     * lock (hook.h's npa_cancel_off). */
    npa_cancel_off();
    s->device = device;
    s->prev = npa_thread_device();
    s->switched = 0;
    s->keep = 0;
    if (s->prev == device)
        return ACL_SUCCESS;
    __typeof__(&aclrtSetDevice) set = NPA_REAL(aclrtSetDevice);
    if (set == NULL) {
        npa_cancel_on(); /* no leave follows a failed enter */
        return npa_no_runtime_error(NPA_FN_aclrtSetDevice);
    }
    npa_mutex_lock(&ref_lock);
    aclError err = set(device);
    if (err == ACL_SUCCESS) {
        npa_device_ref_count(device, 1);
        s->switched = 1;
        s->force_resets = npa_device_in_range(device) ? force_resets_begun[device] : 0;
        s->force_reset_running = force_reset_running(device);
        if (keep_first && !s->force_reset_running && !(devices_kept & (1u << device))) {
            devices_kept |= 1u << device;
            s->keep = 1;
        }
    }
    npa_mutex_unlock(&ref_lock);
    if (err != ACL_SUCCESS)
        npa_cancel_on();
    return err;
}

aclError npa_device_enter(int device, npa_devswitch *s)
{
    return enter(device, s, false);
}

void npa_device_leave(npa_devswitch *s)
{
    if (s->switched) {
        __typeof__(&aclrtResetDevice) reset = NPA_REAL(aclrtResetDevice);
        __typeof__(&aclrtSetDevice) set = NPA_REAL(aclrtSetDevice);
        npa_mutex_lock(&ref_lock);
        if (!s->keep && !reference_maybe_dropped(s) && reset(s->device) == ACL_SUCCESS)
            npa_device_ref_count(s->device, -1);
        /* The way back takes a reference on the previous device and drops
         * one: with a force reset of that device under way, the one dropped
         * might be another's, taken after the release. */
        if (s->prev >= 0 && set(s->prev) == ACL_SUCCESS) {
            npa_device_ref_count(s->prev, 1);
            if (!force_reset_running(s->prev) && reset(s->prev) == ACL_SUCCESS)
                npa_device_ref_count(s->prev, -1);
        }
        npa_mutex_unlock(&ref_lock);
    }
    npa_cancel_on();
}

aclError npa_device_guard_enter(int device, npa_device_guard *g)
{
    aclError err = enter(device, &g->sw, true);
    if (err != ACL_SUCCESS)
        return err;
    g->prev_record = npa_tls_device; /* what enter found: the previous device, or -1 */
    npa_device_set_current(device);
    return ACL_SUCCESS;
}

void npa_device_guard_leave(npa_device_guard *g)
{
    npa_tls_device = g->prev_record;
    npa_device_leave(&g->sw);
}

aclError npa_device_reset(aclError (*real)(int32_t), int32_t device, bool force)
{
    /* Counted as begun whether or not it succeeds: a switch overlapping a
     * failed one keeps a reference it could have dropped, never drops one
     * too many. */
    bool counted = force && npa_device_in_range(device);
    if (counted) {
        npa_mutex_lock(&ref_lock);
        force_resets_begun[device]++;
        force_resets_running[device]++;
        npa_mutex_unlock(&ref_lock);
    }
    aclError err = real(device);
    npa_mutex_lock(&ref_lock);
    if (counted)
        force_resets_running[device]--;
    if (err == ACL_SUCCESS && npa_device_in_range(device)) {
        devices_kept &= ~(1u << device);
        if (force)
            count_released(device);
        else
            npa_device_ref_count(device, -1);
    }
    npa_mutex_unlock(&ref_lock);
    return err;
}

void npa_device_lock_for_fork(void)
{
    npa_mutex_lock(&ref_lock);
}

/* ref_lock held: the threads resetting did not come along. */
void npa_device_forget_after_fork(void)
{
    for (int d = 0; d < NPUALLOC_MAX_DEVICES; d++)
        force_resets_running[d] = 0;
}

void npa_device_unlock_after_fork(void)
{
    npa_mutex_unlock(&ref_lock);
}
