/* Sim-only queries about device memory, for tests (see include/aclsim.h). */
#include "internal.h"

SIM_EXPORT uint64_t aclsim_bytes_outstanding(int32_t device)
{
    struct sim_device *d = sim_device(device);
    if (d == NULL)
        return UINT64_MAX;
    pthread_mutex_lock(&sim_lock);
    uint64_t bytes = d->alloc_bytes;
    pthread_mutex_unlock(&sim_lock);
    return bytes;
}

SIM_EXPORT uint64_t aclsim_live_allocations(int32_t device)
{
    struct sim_device *d = sim_device(device);
    if (d == NULL)
        return UINT64_MAX;
    pthread_mutex_lock(&sim_lock);
    uint64_t n = d->live_allocs;
    pthread_mutex_unlock(&sim_lock);
    return n;
}

SIM_EXPORT int aclsim_allocation_info(const void *ptr, uint64_t *requested, uint64_t *accounted)
{
    int found = 0;
    pthread_mutex_lock(&sim_lock);
    for (int32_t id = 0; id < sim_config()->device_count && !found; id++) {
        struct sim_arena *a = &sim_device(id)->arena;
        long i = sim_arena_find(a, ptr);
        if (i < 0 || !a->segs[i].live || a->base + a->segs[i].off != (const char *)ptr)
            continue;
        if (requested != NULL)
            *requested = a->segs[i].requested;
        if (accounted != NULL)
            *accounted = a->segs[i].accounted;
        found = 1;
    }
    pthread_mutex_unlock(&sim_lock);
    return found;
}
