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
 * so its count stays above zero). */
aclError npa_device_enter(int device, npa_devswitch *s)
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
    aclError err = set != NULL ? set(device) : npa_no_runtime_error(NPA_FN_aclrtSetDevice);
    if (err == ACL_SUCCESS)
        s->switched = 1;
    else
        npa_cancel_on(); /* no leave follows a failed enter */
    return err;
}

void npa_device_leave(npa_devswitch *s)
{
    if (s->switched) {
        __typeof__(&aclrtResetDevice) reset = NPA_REAL(aclrtResetDevice);
        __typeof__(&aclrtSetDevice) set = NPA_REAL(aclrtSetDevice);
        if (!s->keep)
            reset(s->device);
        if (s->prev >= 0 && set(s->prev) == ACL_SUCCESS)
            reset(s->prev);
    }
    npa_cancel_on();
}

/* Devices a guard set and kept its reference on (bit per device). */
static atomic_uint devices_kept;

aclError npa_device_guard_enter(int device, npa_device_guard *g)
{
    aclError err = npa_device_enter(device, &g->sw);
    if (err != ACL_SUCCESS)
        return err;
    g->prev_record = npa_tls_device; /* what npa_device_enter found: the previous device, or -1 */
    npa_device_set_current(device);
    return ACL_SUCCESS;
}

void npa_device_guard_leave(npa_device_guard *g)
{
    npa_tls_device = g->prev_record;
    unsigned bit = 1u << g->sw.device;
    /* One guard keeps the device's reference, the first: fetch_or tells
     * which, so two racing first guards do not both keep one. */
    if (g->sw.switched && !(atomic_fetch_or_explicit(&devices_kept, bit, memory_order_relaxed) & bit))
        g->sw.keep = 1;
    npa_device_leave(&g->sw);
}

void npa_device_kept_released(int device)
{
    if (device >= 0 && device < NPUALLOC_MAX_DEVICES)
        atomic_fetch_and_explicit(&devices_kept, ~(1u << device), memory_order_relaxed);
}
