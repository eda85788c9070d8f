/* The aclrtMalloc family, aclrtFree and aclrtGetMemInfo.
 * Capacity accounting follows the real runtime's rounding: aclrtMalloc and
 * aclrtMallocCached charge round_up(size, 32) + 32, aclrtMallocAlign32 charges
 * round_up(size, 32). Every block starts 64-byte aligned. The policy picks the
 * pages: HUGE_FIRST gives blocks over 1 MiB 2 MiB huge pages (so they start
 * 2 MiB aligned) and smaller ones normal pages, NORMAL_ONLY never huge pages,
 * and HUGE1G_ONLY 1 GiB pages: 1 GiB aligned, charged in whole GiB (its
 * granularity). HUGE_ONLY is placed as HUGE_FIRST: the reference says
 * nothing of its small blocks, and a 2 MiB slot each, charged 96 bytes, ran
 * the simulated device out of addresses while it reported memory free. */
#include "internal.h"

#define HUGE_THRESHOLD (1ull << 20)
#define HUGE_ALIGN (2ull << 20)
#define BLOCK_ALIGN 64
#define GIANT_PAGE (1ull << 30)

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Where a block of this policy starts: the page size it gets (the P2P
 * variants get the same pages; the memory-type flag bits sit above 0xff). */
static uint64_t policy_align(aclrtMemMallocPolicy policy, size_t size)
{
    switch ((unsigned)policy & 0xffu) {
    case ACL_MEM_MALLOC_NORMAL_ONLY:
    case ACL_MEM_MALLOC_NORMAL_ONLY_P2P: return BLOCK_ALIGN;
    case ACL_MEM_MALLOC_HUGE1G_ONLY:
    case ACL_MEM_MALLOC_HUGE1G_ONLY_P2P: return GIANT_PAGE;
    default: return size > HUGE_THRESHOLD ? HUGE_ALIGN : BLOCK_ALIGN;
    }
}

static aclError device_malloc(enum sim_api api, void **devPtr, size_t size, aclrtMemMallocPolicy policy, int pad32)
{
    sim_count(api);
    if (devPtr == NULL || size == 0)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    const struct sim_config *cfg = sim_config();
    sim_spend_us(cfg->malloc_us);
    if (size > cfg->hbm_bytes)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    uint64_t accounted = align_up(size, 32) + (pad32 ? 32 : 0);
    uint64_t align = policy_align(policy, size);
    if (align == GIANT_PAGE)
        accounted = align_up(accounted, GIANT_PAGE);

    struct sim_device *d = sim_device(id);
    pthread_mutex_lock(&sim_lock);
    void *p = NULL;
    if (!sim_inject_alloc_failure() && sim_capacity_charge(id, accounted)) {
        p = sim_arena_alloc(&d->arena, align_up(accounted, BLOCK_ALIGN), align, size, accounted);
        if (p == NULL)
            sim_capacity_release(id, accounted);
    }
    if (p != NULL) {
        d->alloc_bytes += accounted;
        d->live_allocs++;
    }
    pthread_mutex_unlock(&sim_lock);
    if (p == NULL)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *devPtr = p;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_Malloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(SIM_API_aclrtMalloc, devPtr, size, policy, 1);
}

SIM_EXPORT aclError simrt_MallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(SIM_API_aclrtMallocAlign32, devPtr, size, policy, 0);
}

SIM_EXPORT aclError simrt_MallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return device_malloc(SIM_API_aclrtMallocCached, devPtr, size, policy, 1);
}

/* Lock held. Finds the device and segment of a block start, or returns 0. */
static int find_block(const void *p, struct sim_device **dev, long *idx)
{
    for (int32_t id = 0; id < sim_config()->device_count; id++) {
        struct sim_device *d = sim_device(id);
        long i = sim_arena_find(&d->arena, p);
        if (i < 0)
            continue;
        const struct sim_segment *seg = &d->arena.segs[i];
        if (!seg->live || d->arena.base + seg->off != (const char *)p)
            return 0;
        *dev = d;
        *idx = i;
        return 1;
    }
    return 0;
}

/* aclrtFree frees at once and never waits for the device (CANN 7+): work still
 * queued on a stream that uses the block will touch freed memory. */
static aclError device_free(void *devPtr)
{
    if (devPtr == NULL)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    sim_spend_us(sim_config()->free_us);
    pthread_mutex_lock(&sim_lock);
    struct sim_device *d;
    long idx;
    if (!find_block(devPtr, &d, &idx)) {
        pthread_mutex_unlock(&sim_lock);
        sim_report("aclrtFree(%p): not the start of a live allocation (unknown, interior or already freed)", devPtr);
        return ACL_ERROR_RT_MEMORY_FREE;
    }
    uint64_t accounted = d->arena.segs[idx].accounted;
    sim_arena_release(&d->arena, idx);
    sim_capacity_release((int32_t)(d - sim_device(0)), accounted);
    d->alloc_bytes -= accounted;
    d->live_allocs--;
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_Free(void *devPtr)
{
    sim_count(SIM_API_aclrtFree);
    return device_free(devPtr);
}

SIM_EXPORT aclError simrt_FreeWithDevSync(void *devPtr)
{
    aclError ret = sim_synchronize_current_device(SIM_API_aclrtFreeWithDevSync);
    return ret != ACL_SUCCESS ? ret : device_free(devPtr);
}

/* The sim has one memory pool per device. HBM and DDR attributes (plain, huge
 * and normal) all report it, so callers that ask for ACL_DDR_MEM (MindTorch v2
 * passes 0) see the same numbers as ACL_HBM_MEM (torch_npu); the P2P and 1G
 * huge-page pools are not simulated and report 0/0, as unsupported attributes
 * do on real hardware. */
SIM_EXPORT aclError simrt_GetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total)
{
    sim_count(SIM_API_aclrtGetMemInfo);
    if (free == NULL || total == NULL || (int)attr < 0 || attr > ACL_HBM_MEM_P2P_HUGE1G)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    if (attr > ACL_HBM_MEM_NORMAL) {
        *free = *total = 0;
        return ACL_SUCCESS;
    }
    pthread_mutex_lock(&sim_lock);
    *total = sim_config()->hbm_bytes;
    *free = sim_config()->hbm_bytes - sim_capacity_used(id);
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}
