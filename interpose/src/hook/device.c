/* The device current on each thread. aclrtMalloc carries no device, and
 * asking the runtime on every call would cost more than the cache saves, so
 * we record what aclrtSetDevice made current (it goes through us) and ask
 * aclrtGetDevice only for a thread that never set a device through us. */
#include "hook.h"

NPA_TLS int npa_tls_device = -1;

/* Sequentially consistent, as is live_streams (streams.c): a first stream's
 * creator adds itself to live_streams, then reads this to know which
 * devices to synchronize, while a thread that set a device here launches
 * on it, then frees and reads live_streams (npa_fence_needed) to know
 * whether the block may be reused at once. A store-buffering pair: with
 * weaker orders C11 lets both read the old value, the creator skipping that
 * device's default-stream work and the free not waiting for it. */
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
 * its record, and so does a force reset with its update of the record (one
 * order for all: lock, runtime call, record): a force reset cannot fall
 * between a guard's aclrtSetDevice and its decision to keep that reference
 * (which kept a reference the reset had dropped, or reset the one it had
 * just taken after the reset, tearing the device down under its new
 * block), and a switch whose reference a force reset dropped does not
 * reset again (it would drop a reference taken since, a kept one perhaps).
 * A plain reset drops one reference, which the counts absorb in any order.
 * Lock order (hook.h): innermost; under it only the runtime. */
static pthread_mutex_t ref_lock = PTHREAD_MUTEX_INITIALIZER;
/* Devices a guard set and kept its reference on (bit per device). */
static unsigned devices_kept;                       /* ref_lock */
static unsigned force_resets[NPUALLOC_MAX_DEVICES]; /* ref_lock: successful ones per device */

static unsigned force_resets_of(int device)
{
    return device >= 0 && device < NPUALLOC_MAX_DEVICES ? force_resets[device] : 0;
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
        s->switched = 1;
        s->force_resets = force_resets_of(device);
        if (keep_first && !(devices_kept & (1u << device))) {
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
        if (!s->keep && force_resets_of(s->device) == s->force_resets)
            reset(s->device);
        if (s->prev >= 0 && set(s->prev) == ACL_SUCCESS)
            reset(s->prev);
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
    /* Only a force reset holds the lock across the runtime's call: a plain
     * one (a device's last reference can take long to tear down) need not. */
    if (force)
        npa_mutex_lock(&ref_lock);
    aclError err = real(device);
    if (!force)
        npa_mutex_lock(&ref_lock);
    if (err == ACL_SUCCESS && device >= 0 && device < NPUALLOC_MAX_DEVICES) {
        devices_kept &= ~(1u << device);
        if (force)
            force_resets[device]++;
    }
    npa_mutex_unlock(&ref_lock);
    return err;
}

void npa_device_lock_for_fork(void)
{
    npa_mutex_lock(&ref_lock);
}

void npa_device_unlock_after_fork(void)
{
    npa_mutex_unlock(&ref_lock);
}
