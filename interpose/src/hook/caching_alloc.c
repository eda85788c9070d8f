/* torch.cuda's caching_allocator_alloc and caching_allocator_delete
 * (npualloc.h): an allocation on a device and stream the caller names,
 * and its free, which names neither. The core keeps each live block's
 * device and stream, so the free is the block's own stream's, as torch's
 * raw_delete: no record of ours. */
#include "hook.h"
#include "npualloc.h"

NPA_EXPORT int npualloc_caching_allocator_alloc(void **ptr, size_t size, int device, void *stream)
{
    if (ptr == NULL || !npa_device_in_range(device))
        return ACL_ERROR_INVALID_PARAM;
    *ptr = NULL;
    if (size == 0)
        return ACL_SUCCESS; /* torch's raw_alloc: no block, a null pointer */
    /* The stream entry serves the thread's current device: torch's device
     * guard makes it the one named. The caller holds an address, which a
     * program writes from the host as often as on the stream (aclrtMemcpy
     * runs at once, ahead of the stream's queued work): the free waits for
     * the stream's work, as MindTorch's pass-through asks. */
    npa_device_guard guard;
    aclError err = npa_device_guard_enter(device, &guard);
    if (err != ACL_SUCCESS)
        return err;
    err = npualloc_malloc_stream(ptr, size, stream, NPUALLOC_STREAM_HOST_WRITES);
    npa_device_guard_leave(&guard);
    return err;
}

NPA_EXPORT int npualloc_caching_allocator_delete(void *ptr)
{
    if (ptr == NULL)
        return ACL_SUCCESS; /* torch's free(nullptr) */
    /* The allocator an allocation would take now: none when the cache is
     * off (NPUALLOC_DISABLE, after aclFinalize, one that could not be made),
     * and then the alloc was the runtime's, and so is the free. Not only
     * the one serving: before the first allocation (a forked child's too,
     * holding its parent's addresses) nothing is ours, and the runtime
     * would free what it was handed. */
    npa_allocator *a = npa_hook_allocator();
    if (a == NULL) {
        __typeof__(&aclrtFree) real = NPA_REAL(aclrtFree);
        return real ? real(ptr) : npa_no_runtime_error(NPA_FN_aclrtFree);
    }
    /* No hint device: a pointer that is none of ours is the caller's error
     * here, not a free forwarded to the runtime (num_foreign_frees). */
    bool stack = npa_pystack_take_for_free();
    npa_free_result freed = npa_free(a, ptr, -1, NULL);
    if (stack)
        npa_pystack_drop();
    if (freed == NPA_FREE_OK)
        return ACL_SUCCESS;
    aclError err;
    if (npa_saver_free(ptr, &err)) /* allocated inside a memory_saver region */
        return err;
    return ACL_ERROR_RT_MEMORY_FREE;
}
