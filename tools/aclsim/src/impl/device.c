/* Devices and the per-thread current device. As in ACL, the current device
 * (really: the current context) belongs to the calling thread: a new thread
 * has none until it calls aclrtSetDevice, and memory/stream calls without one
 * fail with ACL_ERROR_RT_CONTEXT_NULL. aclrtSetDevice is reference-counted
 * against aclrtResetDevice; the first reference creates the default stream,
 * the last reset drains and destroys the device's streams. */
#include <stdbool.h>
#include <stdlib.h>

#include "internal.h"

static struct sim_device *devices;
static struct sim_context *default_contexts; /* one per device, aclrtGetCurrentContext's */
static pthread_once_t devices_once = PTHREAD_ONCE_INIT;

/* A context is a device reference with an identity: created with one
 * attach, destroyed with one detach (and with the streams made in it), and
 * current for a thread through aclrtSetCurrentContext. Destroyed contexts
 * are kept (marked dead, never freed) so a stale handle is reported instead
 * of read after free. A device's default context is no reference of its
 * own (aclrtSetDevice's are): CANN destroys only a context
 * aclrtCreateContext made. */
#define CONTEXT_LIVE 0x43545854u
#define CONTEXT_DEFAULT 0x44465458u
#define CONTEXT_DEAD 0xdeadc7c7u
struct sim_context {
    uint32_t magic;
    int32_t device;
    uint64_t generation;
};

/* The thread's context: a device and the generation of that device it was
 * set in, so a context outlived by a full reset is recognised as gone. */
static __thread int32_t current_device = -1;
static __thread uint64_t current_generation;
/* The context aclrtCreateContext or aclrtSetCurrentContext made current on
 * the thread; NULL: its device's default context (aclrtSetDevice's). */
static __thread struct sim_context *current_context;

static void allocate_devices(void)
{
    devices = calloc((size_t)sim_config()->device_count, sizeof *devices);
    default_contexts = calloc((size_t)sim_config()->device_count, sizeof *default_contexts);
    if (devices == NULL || default_contexts == NULL)
        sim_fatal("out of host memory for %d devices", sim_config()->device_count);
}

struct sim_device *sim_device(int32_t id)
{
    pthread_once(&devices_once, allocate_devices);
    if (id < 0 || id >= sim_config()->device_count)
        return NULL;
    return &devices[id];
}

aclError sim_current_device_locked(int32_t *id)
{
    aclError ret = sim_require_init_locked();
    if (ret != ACL_SUCCESS)
        return ret;
    if (current_context != NULL && current_context->magic != CONTEXT_LIVE) {
        /* Destroyed by another thread: CANN detaches a destroyed context
         * from the threads it was current on and refuses their call; the
         * next runs in the device's default context, as on the thread that
         * destroyed it. A stream made in it would be no context's to end. */
        current_context = NULL;
        return ACL_ERROR_RT_CONTEXT_NULL;
    }
    if (current_device < 0)
        return ACL_ERROR_RT_CONTEXT_NULL;
    struct sim_device *d = sim_device(current_device);
    if (d->refcount == 0 || d->generation != current_generation)
        return ACL_ERROR_RT_CONTEXT_NULL;
    *id = current_device;
    return ACL_SUCCESS;
}

aclError sim_current_device(int32_t *id)
{
    pthread_mutex_lock(&sim_lock);
    aclError ret = sim_current_device_locked(id);
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

void sim_forget_current_device(void)
{
    current_device = -1;
    current_context = NULL;
}

const struct sim_context *sim_current_context(void)
{
    return current_context;
}

/* The arena spans twice the capacity: accounting, not address space, decides
 * when memory runs out, so fragmentation of the sim's own layout never shows. */
static uint64_t arena_size(void)
{
    return 2 * sim_config()->hbm_bytes + (1ull << 30);
}

/* The prologue of a call naming a device: counted, after aclInit, in range. */
static aclError enter_device_call(enum sim_api api, int32_t id, struct sim_device **d)
{
    sim_count(api);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    *d = sim_device(id);
    return *d == NULL ? ACL_ERROR_RT_INVALID_DEVICEID : ACL_SUCCESS;
}

/* Lock held: one more reference on device id, which becomes the calling
 * thread's current one (aclrtSetDevice and aclrtCreateContext). */
static aclError attach_device(struct sim_device *d, int32_t deviceId)
{
    if (d->arena.base == NULL && sim_arena_reserve(&d->arena, arena_size()) != 0)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    if (d->refcount == 0 && (d->default_stream = sim_stream_create(deviceId, NULL)) == NULL)
        return ACL_ERROR_BAD_ALLOC;
    d->refcount++;
    current_device = deviceId;
    current_generation = d->generation;
    current_context = NULL;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_SetDevice(int32_t deviceId)
{
    struct sim_device *d;
    aclError ret = enter_device_call(SIM_API_aclrtSetDevice, deviceId, &d);
    if (ret == ACL_SUCCESS)
        ret = sim_inject_call_failure(SIM_API_aclrtSetDevice);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    ret = attach_device(d, deviceId);
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

SIM_EXPORT aclError simrt_GetDevice(int32_t *deviceId)
{
    sim_count(SIM_API_aclrtGetDevice);
    if (deviceId == NULL)
        return ACL_ERROR_INVALID_PARAM;
    return sim_current_device(deviceId);
}

/* Lock held, released while the streams are destroyed. */
static void reset_device(struct sim_device *d)
{
    d->refcount = 0;
    d->generation++;
    d->default_stream = NULL;
    sim_device_destroy_old_streams(d);
}

/* Lock held: drops one reference on device id. */
static void detach_device(struct sim_device *d, int32_t deviceId)
{
    /* Resetting a device with no reference left is tolerated, as in ACL. */
    if (d->refcount > 0 && --d->refcount == 0) {
        reset_device(d);
        if (current_device == deviceId)
            current_device = -1;
    }
}

/* aclrtResetDevice drops one reference; aclrtResetDeviceForce releases the
 * device whatever its count (streams drained and destroyed, as the last
 * plain reset does), and CANN documents an error for a device already
 * released, without its code. */
static aclError reset(enum sim_api api, int32_t deviceId, int force)
{
    struct sim_device *d;
    aclError ret = enter_device_call(api, deviceId, &d);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    if (force && d->refcount == 0)
        ret = ACL_ERROR_RT_PARAM_INVALID;
    else if (force)
        d->refcount = 1;
    if (ret == ACL_SUCCESS)
        detach_device(d, deviceId);
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

SIM_EXPORT aclError simrt_ResetDevice(int32_t deviceId)
{
    return reset(SIM_API_aclrtResetDevice, deviceId, 0);
}

SIM_EXPORT aclError simrt_ResetDeviceForce(int32_t deviceId)
{
    return reset(SIM_API_aclrtResetDeviceForce, deviceId, 1);
}

SIM_EXPORT aclError simrt_CreateContext(aclrtContext *context, int32_t deviceId)
{
    struct sim_device *d;
    aclError ret = enter_device_call(SIM_API_aclrtCreateContext, deviceId, &d);
    if (ret != ACL_SUCCESS)
        return ret;
    if (context == NULL)
        return ACL_ERROR_INVALID_PARAM;
    struct sim_context *c = malloc(sizeof *c);
    if (c == NULL)
        return ACL_ERROR_BAD_ALLOC;
    pthread_mutex_lock(&sim_lock);
    ret = attach_device(d, deviceId);
    *c = (struct sim_context){.magic = CONTEXT_LIVE, .device = deviceId, .generation = d->generation};
    if (ret == ACL_SUCCESS)
        current_context = c;
    pthread_mutex_unlock(&sim_lock);
    if (ret != ACL_SUCCESS) {
        free(c);
        return ret;
    }
    *context = c;
    return ACL_SUCCESS;
}

/* Counts api; after aclInit and for a live context (a default one too where
 * default_ok), returns with the lock held. */
static aclError lock_live_context(enum sim_api api, aclrtContext context, bool default_ok, struct sim_context **c)
{
    sim_count(api);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    if (context == NULL)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&sim_lock);
    *c = context;
    if ((*c)->magic != CONTEXT_LIVE && !(default_ok && (*c)->magic == CONTEXT_DEFAULT)) {
        pthread_mutex_unlock(&sim_lock);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_DestroyContext(aclrtContext context)
{
    struct sim_context *c;
    aclError ret = lock_live_context(SIM_API_aclrtDestroyContext, context, false, &c);
    if (ret != ACL_SUCCESS)
        return ret;
    c->magic = CONTEXT_DEAD;
    if (current_context == c)
        current_context = NULL;
    struct sim_device *d = sim_device(c->device);
    sim_context_destroy_streams(d, c);
    /* Asked once they are gone: a reset meanwhile took the reference. */
    if (d->generation == c->generation)
        detach_device(d, c->device);
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_SetCurrentContext(aclrtContext context)
{
    struct sim_context *c;
    aclError ret = lock_live_context(SIM_API_aclrtSetCurrentContext, context, true, &c);
    if (ret != ACL_SUCCESS)
        return ret;
    struct sim_device *d = sim_device(c->device);
    if (d->generation != c->generation) /* its device was reset under it */
        ret = ACL_ERROR_RT_CONTEXT_NULL;
    else {
        current_device = c->device;
        current_generation = c->generation;
        current_context = c->magic == CONTEXT_DEFAULT ? NULL : c;
    }
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

/* The thread's current context: one it created or set, else its device's
 * default context (the same handle for every thread, for the device's
 * present generation). */
SIM_EXPORT aclError simrt_GetCurrentContext(aclrtContext *context)
{
    sim_count(SIM_API_aclrtGetCurrentContext);
    if (context == NULL)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&sim_lock);
    int32_t id;
    aclError ret = sim_current_device_locked(&id);
    if (ret == ACL_SUCCESS && current_context != NULL) {
        *context = current_context;
    } else if (ret == ACL_SUCCESS) {
        struct sim_context *c = &default_contexts[id];
        *c = (struct sim_context){.magic = CONTEXT_DEFAULT, .device = id, .generation = sim_device(id)->generation};
        *context = c;
    }
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

void sim_reset_all_devices(void)
{
    for (int32_t id = 0; id < sim_config()->device_count; id++) {
        struct sim_device *d = sim_device(id);
        if (d->refcount > 0)
            reset_device(d);
    }
}

/* The device count is a property of the machine, not of ACL state, so the
 * sim answers it before aclInit too. */
SIM_EXPORT aclError simrt_GetDeviceCount(uint32_t *count)
{
    sim_count(SIM_API_aclrtGetDeviceCount);
    if (count == NULL)
        return ACL_ERROR_INVALID_PARAM;
    *count = (uint32_t)sim_config()->device_count;
    return ACL_SUCCESS;
}

aclError sim_synchronize_current_device(enum sim_api api)
{
    sim_count(api);
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret == ACL_SUCCESS)
        ret = sim_inject_call_failure(api);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    sim_device_wait_idle(sim_device(id));
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_SynchronizeDevice(void)
{
    return sim_synchronize_current_device(SIM_API_aclrtSynchronizeDevice);
}
