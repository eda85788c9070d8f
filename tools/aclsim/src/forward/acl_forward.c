/* The exported ACL runtime API: each function forwards to its simrt_
 * implementation in libaclsim.so. This one file is compiled into both
 * libascendcl.so and libacl_rt.so, which in CANN 8 export the same aclrt*
 * names. It must never call an acl* symbol by name: an LD_PRELOADed
 * interposer defines those, and the call would land back in the interposer. */
#include "../simrt.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT aclError aclInit(const char *configPath) { return simrt_Init(configPath); }
EXPORT aclError aclFinalize(void) { return simrt_Finalize(); }

EXPORT aclError aclrtSetDevice(int32_t deviceId) { return simrt_SetDevice(deviceId); }
EXPORT aclError aclrtGetDevice(int32_t *deviceId) { return simrt_GetDevice(deviceId); }
EXPORT aclError aclrtResetDevice(int32_t deviceId) { return simrt_ResetDevice(deviceId); }
EXPORT aclError aclrtResetDeviceForce(int32_t deviceId) { return simrt_ResetDeviceForce(deviceId); }
EXPORT aclError aclrtGetDeviceCount(uint32_t *count) { return simrt_GetDeviceCount(count); }
EXPORT aclError aclrtSynchronizeDevice(void) { return simrt_SynchronizeDevice(); }

EXPORT aclError aclrtMalloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return simrt_Malloc(devPtr, size, policy);
}
EXPORT aclError aclrtMallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return simrt_MallocAlign32(devPtr, size, policy);
}
EXPORT aclError aclrtMallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy)
{
    return simrt_MallocCached(devPtr, size, policy);
}
EXPORT aclError aclrtFree(void *devPtr) { return simrt_Free(devPtr); }
EXPORT aclError aclrtFreeWithDevSync(void *devPtr) { return simrt_FreeWithDevSync(devPtr); }
EXPORT aclError aclrtMemset(void *devPtr, size_t maxCount, int32_t value, size_t count)
{
    return simrt_Memset(devPtr, maxCount, value, count);
}
EXPORT aclError aclrtMemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count, aclrtStream stream)
{
    return simrt_MemsetAsync(devPtr, maxCount, value, count, stream);
}
EXPORT aclError aclrtMemcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)
{
    return simrt_Memcpy(dst, destMax, src, count, kind);
}
EXPORT aclError aclrtMemcpyAsync(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind,
                                 aclrtStream stream)
{
    return simrt_MemcpyAsync(dst, destMax, src, count, kind, stream);
}
EXPORT aclError aclrtGetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total)
{
    return simrt_GetMemInfo(attr, free, total);
}

EXPORT aclError aclrtCreateStream(aclrtStream *stream) { return simrt_CreateStream(stream); }
EXPORT aclError aclrtDestroyStream(aclrtStream stream) { return simrt_DestroyStream(stream); }
EXPORT aclError aclrtDestroyStreamForce(aclrtStream stream) { return simrt_DestroyStreamForce(stream); }
EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) { return simrt_SynchronizeStream(stream); }
EXPORT aclError aclrtCreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag)
{
    return simrt_CreateStreamWithConfig(stream, priority, flag);
}

EXPORT aclError aclrtCreateContext(aclrtContext *context, int32_t deviceId)
{
    return simrt_CreateContext(context, deviceId);
}
EXPORT aclError aclrtDestroyContext(aclrtContext context) { return simrt_DestroyContext(context); }
EXPORT aclError aclrtSetCurrentContext(aclrtContext context) { return simrt_SetCurrentContext(context); }
EXPORT aclError aclrtGetCurrentContext(aclrtContext *context) { return simrt_GetCurrentContext(context); }
EXPORT aclError aclrtMallocHost(void **hostPtr, size_t size) { return simrt_MallocHost(hostPtr, size); }
EXPORT aclError aclrtFreeHost(void *hostPtr) { return simrt_FreeHost(hostPtr); }
EXPORT const char *aclrtGetSocName(void) { return simrt_GetSocName(); }
EXPORT aclError aclopSetModelDir(const char *modelDir) { return simrt_opSetModelDir(modelDir); }

EXPORT aclError aclrtCreateEvent(aclrtEvent *event) { return simrt_CreateEvent(event); }
EXPORT aclError aclrtCreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    return simrt_CreateEventWithFlag(event, flag);
}
EXPORT aclError aclrtCreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    return simrt_CreateEventExWithFlag(event, flag);
}
EXPORT aclError aclrtEventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    return simrt_EventElapsedTime(ms, startEvent, endEvent);
}
EXPORT aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) { return simrt_RecordEvent(event, stream); }
EXPORT aclError aclrtQueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    return simrt_QueryEventStatus(event, status);
}
EXPORT aclError aclrtQueryEvent(aclrtEvent event, aclrtEventStatus *status) { return simrt_QueryEvent(event, status); }
EXPORT aclError aclrtSynchronizeEvent(aclrtEvent event) { return simrt_SynchronizeEvent(event); }
EXPORT aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    return simrt_StreamWaitEvent(stream, event);
}
EXPORT aclError aclrtDestroyEvent(aclrtEvent event) { return simrt_DestroyEvent(event); }

EXPORT aclError aclrtReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr, uint64_t flags)
{
    return simrt_ReserveMemAddress(virPtr, size, alignment, expectPtr, flags);
}
EXPORT aclError aclrtReleaseMemAddress(void *virPtr) { return simrt_ReleaseMemAddress(virPtr); }
EXPORT aclError aclrtMallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                    uint64_t flags)
{
    return simrt_MallocPhysical(handle, size, prop, flags);
}
EXPORT aclError aclrtFreePhysical(aclrtDrvMemHandle handle) { return simrt_FreePhysical(handle); }
EXPORT aclError aclrtMapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle, uint64_t flags)
{
    return simrt_MapMem(virPtr, size, offset, handle, flags);
}
EXPORT aclError aclrtUnmapMem(void *virPtr) { return simrt_UnmapMem(virPtr); }
EXPORT aclError aclrtMemGetAllocationGranularity(aclrtPhysicalMemProp *prop, aclrtMemGranularityOptions option,
                                                 size_t *granularity)
{
    return simrt_MemGetAllocationGranularity(prop, option, granularity);
}
