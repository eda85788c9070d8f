/* Virtual memory management (the API expandable segments are built on):
 * address reservations are PROT_NONE mappings, physical handles are memfd
 * files charged against the device's capacity, and mapping a handle is an
 * mmap of the file at the reserved address, so mapped memory is real,
 * usable memory and an unmapped range faults like unmapped device memory. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#define GRANULARITY (2ull << 20)

struct sim_physical {
    int fd;
    size_t size;
    int32_t device;
    int maps;                     /* mappings still using it */
    struct sim_physical *next;
};

struct sim_mapping {
    char *va;
    size_t size;
    struct sim_physical *phys;
    struct sim_mapping *next;
};

struct sim_reservation {
    char *base;                   /* aligned start handed to the caller */
    size_t size;
    char *raw;                    /* the mmap as made, for munmap */
    size_t raw_size;
    struct sim_mapping *maps;
    struct sim_reservation *next;
};

static struct sim_reservation *reservations;
static struct sim_physical *physicals;

/* Lock held. The reservation holding p, or NULL. */
static struct sim_reservation *reservation_of(const void *p)
{
    for (struct sim_reservation *r = reservations; r != NULL; r = r->next)
        if ((const char *)p >= r->base && (const char *)p < r->base + r->size)
            return r;
    return NULL;
}

static struct sim_mapping *mapping_at(struct sim_reservation *r, const char *p)
{
    for (struct sim_mapping *m = r->maps; m != NULL; m = m->next)
        if (p >= m->va && p < m->va + m->size)
            return m;
    return NULL;
}

int sim_vmm_classify(const void *p, size_t n)
{
    struct sim_reservation *r = reservation_of(p);
    if (r == NULL)
        return -1;
    const char *cursor = p, *end = (const char *)p + n;
    if (end > r->base + r->size)
        return 0;
    while (cursor < end) {
        struct sim_mapping *m = mapping_at(r, cursor);
        if (m == NULL)
            return 0;
        cursor = m->va + m->size;
    }
    return 1;
}

static int is_live_physical(const struct sim_physical *h)
{
    for (const struct sim_physical *p = physicals; p != NULL; p = p->next)
        if (p == h)
            return 1;
    return 0;
}

static int granular(size_t x) { return x % GRANULARITY == 0; }

SIM_EXPORT aclError simrt_ReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                            uint64_t flags)
{
    sim_count(SIM_API_aclrtReserveMemAddress);
    (void)flags;
    if (virPtr == NULL || size == 0 || !granular(size) || expectPtr != NULL || (alignment & (alignment - 1)) != 0)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
    struct sim_reservation *r = calloc(1, sizeof *r);
    if (r == NULL)
        return ACL_ERROR_BAD_ALLOC;
    r->raw_size = size + align;
    r->raw = mmap(NULL, r->raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r->raw == MAP_FAILED) {
        free(r);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    r->base = (char *)(((uintptr_t)r->raw + align - 1) / align * align);
    r->size = size;
    pthread_mutex_lock(&sim_lock);
    r->next = reservations;
    reservations = r;
    pthread_mutex_unlock(&sim_lock);
    *virPtr = r->base;
    return ACL_SUCCESS;
}

/* Releasing a reservation that still has mappings is refused (207002). */
SIM_EXPORT aclError simrt_ReleaseMemAddress(void *virPtr)
{
    int32_t id;
    aclError ret = sim_enter(SIM_API_aclrtReleaseMemAddress, virPtr, &id);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    struct sim_reservation **link = &reservations;
    while (*link != NULL && (*link)->base != virPtr)
        link = &(*link)->next;
    struct sim_reservation *r = *link;
    if (r == NULL || r->maps != NULL) {
        pthread_mutex_unlock(&sim_lock);
        return r == NULL ? ACL_ERROR_INVALID_PARAM : ACL_ERROR_RT_MEMORY_FREE;
    }
    *link = r->next;
    pthread_mutex_unlock(&sim_lock);
    munmap(r->raw, r->raw_size);
    free(r);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_MallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                         uint64_t flags)
{
    sim_count(SIM_API_aclrtMallocPhysical);
    (void)flags;
    if (handle == NULL || prop == NULL || size == 0 || !granular(size))
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    struct sim_device *d = sim_device((int32_t)prop->location.id);
    if (prop->location.type != ACL_MEM_LOCATION_TYPE_DEVICE || d == NULL)
        return ACL_ERROR_INVALID_PARAM;
    const struct sim_config *cfg = sim_config();
    sim_spend_us(cfg->malloc_us);
    struct sim_physical *h = calloc(1, sizeof *h);
    if (h == NULL)
        return ACL_ERROR_BAD_ALLOC;
    pthread_mutex_lock(&sim_lock);
    int32_t device = (int32_t)prop->location.id;
    int fail = sim_inject_alloc_failure() || !sim_capacity_charge(device, size);
    if (!fail)
        d->physical_bytes += size;
    pthread_mutex_unlock(&sim_lock);
    if (fail) {
        free(h);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    h->fd = memfd_create("aclsim-physical", MFD_CLOEXEC);
    if (h->fd < 0 || ftruncate(h->fd, (off_t)size) != 0) {
        if (h->fd >= 0)
            close(h->fd);
        free(h);
        pthread_mutex_lock(&sim_lock);
        sim_capacity_release(device, size);
        d->physical_bytes -= size;
        pthread_mutex_unlock(&sim_lock);
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    }
    h->size = size;
    h->device = (int32_t)prop->location.id;
    pthread_mutex_lock(&sim_lock);
    h->next = physicals;
    physicals = h;
    pthread_mutex_unlock(&sim_lock);
    *handle = h;
    return ACL_SUCCESS;
}

/* Freeing a handle that is still mapped is refused (207002): unmap first. */
SIM_EXPORT aclError simrt_FreePhysical(aclrtDrvMemHandle handle)
{
    int32_t id;
    aclError ret = sim_enter(SIM_API_aclrtFreePhysical, handle, &id);
    if (ret != ACL_SUCCESS)
        return ret;
    sim_spend_us(sim_config()->free_us);
    pthread_mutex_lock(&sim_lock);
    struct sim_physical *h = handle;
    if (!is_live_physical(h) || h->maps > 0 || sim_inject_call_failure_locked(SIM_API_aclrtFreePhysical) != ACL_SUCCESS) {
        pthread_mutex_unlock(&sim_lock);
        return is_live_physical(h) ? ACL_ERROR_RT_MEMORY_FREE : ACL_ERROR_INVALID_PARAM;
    }
    struct sim_physical **link = &physicals;
    while (*link != h)
        link = &(*link)->next;
    *link = h->next;
    struct sim_device *d = sim_device(h->device);
    sim_capacity_release(h->device, h->size);
    d->physical_bytes -= h->size;
    pthread_mutex_unlock(&sim_lock);
    close(h->fd);
    free(h);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_MapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags)
{
    sim_count(SIM_API_aclrtMapMem);
    (void)flags;
    if (virPtr == NULL || handle == NULL || size == 0 || !granular(size) || !granular(offset))
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    struct sim_mapping *m = calloc(1, sizeof *m);
    if (m == NULL)
        return ACL_ERROR_BAD_ALLOC;
    pthread_mutex_lock(&sim_lock);
    struct sim_physical *h = handle;
    struct sim_reservation *r = reservation_of(virPtr);
    char *va = virPtr;
    /* The target must lie in one reservation at a multiple of the granularity
     * (the device maps whole 2 MiB pages: a mapping cannot start inside one),
     * be unmapped, and the handle must hold offset + size. */
    int ok = r != NULL && granular((size_t)(va - r->base)) && is_live_physical(h) && offset + size <= h->size &&
             va + size <= r->base + r->size;
    for (struct sim_mapping *o = ok ? r->maps : NULL; o != NULL; o = o->next)
        if (va < o->va + o->size && o->va < va + size)
            ok = 0;
    if (ok && mmap(va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, h->fd, (off_t)offset) == MAP_FAILED)
        ok = 0;
    if (ok) {
        *m = (struct sim_mapping){.va = va, .size = size, .phys = h, .next = r->maps};
        r->maps = m;
        h->maps++;
    }
    pthread_mutex_unlock(&sim_lock);
    if (!ok) {
        free(m);
        return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_UnmapMem(void *virPtr)
{
    int32_t id;
    aclError ret = sim_enter(SIM_API_aclrtUnmapMem, virPtr, &id);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    struct sim_reservation *r = reservation_of(virPtr);
    struct sim_mapping **link = r != NULL ? &r->maps : NULL;
    while (link != NULL && *link != NULL && (*link)->va != (char *)virPtr)
        link = &(*link)->next;
    struct sim_mapping *m = link != NULL ? *link : NULL;
    if (m != NULL && sim_inject_call_failure_locked(SIM_API_aclrtUnmapMem) != ACL_SUCCESS) {
        pthread_mutex_unlock(&sim_lock);
        return ACL_ERROR_RT_MEMORY_FREE; /* injected: still mapped */
    }
    if (m != NULL) {
        /* Put the reservation's PROT_NONE back, so later touches fault-check as unmapped. */
        mmap(m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        *link = m->next;
        m->phys->maps--;
    }
    pthread_mutex_unlock(&sim_lock);
    if (m == NULL)
        return ACL_ERROR_INVALID_PARAM;
    free(m);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_MemGetAllocationGranularity(aclrtPhysicalMemProp *prop, aclrtMemGranularityOptions option,
                                                      size_t *granularity)
{
    sim_count(SIM_API_aclrtMemGetAllocationGranularity);
    (void)option; /* minimum and recommended are both the 2 MiB device page */
    if (prop == NULL || granularity == NULL)
        return ACL_ERROR_INVALID_PARAM;
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    *granularity = GRANULARITY;
    return ACL_SUCCESS;
}

SIM_EXPORT uint64_t aclsim_physical_bytes_outstanding(int32_t device)
{
    struct sim_device *d = sim_device(device);
    if (d == NULL)
        return UINT64_MAX;
    pthread_mutex_lock(&sim_lock);
    uint64_t bytes = d->physical_bytes;
    pthread_mutex_unlock(&sim_lock);
    return bytes;
}
