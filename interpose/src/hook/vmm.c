/* Physical memory mapped at reserved addresses, the two steps of the ACL
 * virtual memory API that expandable segments (lifecycle.c's backend) and
 * the memory saver (saver.c) share. The caller has entered the device.
 * Either step fails whole: an error leaves nothing changed, so a caller
 * that undoes its work on an error knows what is mapped. */
#include "hook.h"

aclError npa_vmm_map(int device, void *addr, size_t size, void **handle)
{
    aclrtPhysicalMemProp prop = {
        .handleType = ACL_MEM_HANDLE_TYPE_NONE,
        .allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED,
        .memAttr = ACL_HBM_MEM_HUGE,
        .location = {.id = (uint32_t)device, .type = ACL_MEM_LOCATION_TYPE_DEVICE},
    };
    aclrtDrvMemHandle physical = NULL;
    aclError err = NPA_REAL(aclrtMallocPhysical)(&physical, size, &prop, 0);
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtMapMem)(addr, size, 0, physical, 0);
    if (err != ACL_SUCCESS) {
        NPA_REAL(aclrtFreePhysical)(physical);
        return err;
    }
    *handle = physical;
    return ACL_SUCCESS;
}

aclError npa_vmm_unmap(void *addr, size_t size, void *handle)
{
    aclError err = NPA_REAL(aclrtUnmapMem)(addr); /* a still-mapped handle cannot be freed */
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtFreePhysical)(handle);
    if (err == ACL_SUCCESS)
        return ACL_SUCCESS;
    /* The handle is still live and holds the contents: map it back where it
     * was, so the caller finds the memory as it was before the call. */
    aclError remap = NPA_REAL(aclrtMapMem)(addr, size, 0, handle, 0);
    if (remap != ACL_SUCCESS)
        npa_warn_once("aclrtFreePhysical failed (error %d) and mapping the memory back at %p failed too "
                      "(error %d): its contents are out of reach",
                      err, addr, remap);
    return err;
}
