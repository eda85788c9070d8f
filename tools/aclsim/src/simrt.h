/* Entry points of the simulated runtime's implementation library (libaclsim.so)
 * for its thin front libraries: the aclrt forwarders (libascendcl.so and
 * libacl_rt.so), libnnopbase.so and libopapi.so.
 *
 * They are deliberately NOT named aclrt*: a preloaded interposer defines
 * aclrtMalloc etc., and a forwarder that called an aclrt* symbol by name
 * would be bound to the interposer and recurse. simrt_Xxx implements aclXxx /
 * aclrtXxx with the same signature and counts the call under the public name. */
#ifndef ACLSIM_SIMRT_H
#define ACLSIM_SIMRT_H

#include <stddef.h>
#include <stdint.h>

#include "acl/acl.h"
#include "aclnn/acl_meta.h"

#define SIMRT_EXPORT __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C" {
#endif

SIMRT_EXPORT aclError simrt_Init(const char *configPath);
SIMRT_EXPORT aclError simrt_Finalize(void);

SIMRT_EXPORT aclError simrt_SetDevice(int32_t deviceId);
SIMRT_EXPORT aclError simrt_GetDevice(int32_t *deviceId);
SIMRT_EXPORT aclError simrt_ResetDevice(int32_t deviceId);
SIMRT_EXPORT aclError simrt_ResetDeviceForce(int32_t deviceId);
SIMRT_EXPORT aclError simrt_GetDeviceCount(uint32_t *count);
SIMRT_EXPORT aclError simrt_SynchronizeDevice(void);

SIMRT_EXPORT aclError simrt_Malloc(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
SIMRT_EXPORT aclError simrt_MallocAlign32(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
SIMRT_EXPORT aclError simrt_MallocCached(void **devPtr, size_t size, aclrtMemMallocPolicy policy);
SIMRT_EXPORT aclError simrt_Free(void *devPtr);
SIMRT_EXPORT aclError simrt_FreeWithDevSync(void *devPtr);
SIMRT_EXPORT aclError simrt_Memset(void *devPtr, size_t maxCount, int32_t value, size_t count);
SIMRT_EXPORT aclError simrt_MemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count,
                                        aclrtStream stream);
SIMRT_EXPORT aclError simrt_Memcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind);
SIMRT_EXPORT aclError simrt_MemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                        aclrtMemcpyKind kind, aclrtStream stream);
SIMRT_EXPORT aclError simrt_GetMemInfo(aclrtMemAttr attr, size_t *free, size_t *total);

SIMRT_EXPORT aclError simrt_CreateStream(aclrtStream *stream);
SIMRT_EXPORT aclError simrt_DestroyStream(aclrtStream stream);
SIMRT_EXPORT aclError simrt_DestroyStreamForce(aclrtStream stream);
SIMRT_EXPORT aclError simrt_SynchronizeStream(aclrtStream stream);
SIMRT_EXPORT aclError simrt_CreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag);

SIMRT_EXPORT aclError simrt_CreateContext(aclrtContext *context, int32_t deviceId);
SIMRT_EXPORT aclError simrt_DestroyContext(aclrtContext context);
SIMRT_EXPORT aclError simrt_SetCurrentContext(aclrtContext context);
SIMRT_EXPORT aclError simrt_GetCurrentContext(aclrtContext *context);
SIMRT_EXPORT aclError simrt_MallocHost(void **hostPtr, size_t size);
SIMRT_EXPORT aclError simrt_FreeHost(void *hostPtr);
SIMRT_EXPORT const char *simrt_GetSocName(void);
SIMRT_EXPORT aclError simrt_opSetModelDir(const char *modelDir);

SIMRT_EXPORT aclError simrt_CreateEvent(aclrtEvent *event);
SIMRT_EXPORT aclError simrt_CreateEventWithFlag(aclrtEvent *event, uint32_t flag);
SIMRT_EXPORT aclError simrt_CreateEventExWithFlag(aclrtEvent *event, uint32_t flag);
SIMRT_EXPORT aclError simrt_EventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent);
SIMRT_EXPORT aclError simrt_RecordEvent(aclrtEvent event, aclrtStream stream);
SIMRT_EXPORT aclError simrt_QueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status);
SIMRT_EXPORT aclError simrt_QueryEvent(aclrtEvent event, aclrtEventStatus *status);
SIMRT_EXPORT aclError simrt_SynchronizeEvent(aclrtEvent event);
SIMRT_EXPORT aclError simrt_StreamWaitEvent(aclrtStream stream, aclrtEvent event);
SIMRT_EXPORT aclError simrt_DestroyEvent(aclrtEvent event);

SIMRT_EXPORT aclError simrt_ReserveMemAddress(void **virPtr, size_t size, size_t alignment, void *expectPtr,
                                              uint64_t flags);
SIMRT_EXPORT aclError simrt_ReleaseMemAddress(void *virPtr);
SIMRT_EXPORT aclError simrt_MallocPhysical(aclrtDrvMemHandle *handle, size_t size, const aclrtPhysicalMemProp *prop,
                                           uint64_t flags);
SIMRT_EXPORT aclError simrt_FreePhysical(aclrtDrvMemHandle handle);
SIMRT_EXPORT aclError simrt_MapMem(void *virPtr, size_t size, size_t offset, aclrtDrvMemHandle handle,
                                   uint64_t flags);
SIMRT_EXPORT aclError simrt_UnmapMem(void *virPtr);
SIMRT_EXPORT aclError simrt_MemGetAllocationGranularity(aclrtPhysicalMemProp *prop,
                                                        aclrtMemGranularityOptions option, size_t *granularity);

/* ---- nnopbase / opapi side ---- */

/* Counts one call of a public API by name (the ops in libopapi.so count
 * themselves through this, so all counters live in one place). */
SIMRT_EXPORT void simrt_CountCall(const char *api);

SIMRT_EXPORT aclnnStatus simrt_nnInit(const char *configPath);
SIMRT_EXPORT aclnnStatus simrt_nnFinalize(void);
SIMRT_EXPORT aclnnStatus simrt_SetExecutorRepeatable(aclOpExecutor *executor);
SIMRT_EXPORT aclnnStatus simrt_DestroyExecutor(aclOpExecutor *executor);

/* What a simulated operator does when its duration has elapsed. params is the
 * executor's private copy of what phase 1 was given. */
typedef struct simrt_op_kind {
    const char *name;
    void (*finish)(const void *params);
} simrt_op_kind;

/* Room for an aclnn op's copied descriptors (src/aclnn/engine.h). */
#define SIMRT_OP_PARAMS_MAX 4096

/* Phase 1: a new executor for `kind` holding a copy of params, the current op
 * duration and the workspace it will need. */
SIMRT_EXPORT aclnnStatus simrt_CreateExecutor(const simrt_op_kind *kind, const void *params, size_t paramsSize,
                                              uint64_t workspaceBytes, aclOpExecutor **executor);
/* Phase 2: queues the executor's op on a stream (NULL = default stream). */
SIMRT_EXPORT aclnnStatus simrt_LaunchExecutor(const char *api, void *workspace, uint64_t workspaceSize,
                                              aclOpExecutor *executor, aclrtStream stream);

/* Device-memory effects for ops, each range checked against live memory at
 * the moment it runs (invalid touches are counted, reported, and skipped if
 * the memory is not even mapped). `what` names the access in reports. */
SIMRT_EXPORT void simrt_DeviceFill(void *dst, int value, size_t bytes, const char *what);
SIMRT_EXPORT void simrt_DeviceCopy(void *dst, const void *src, size_t bytes, const char *what);

/* Checks every range (invalid touches counted and reported), then, if all are
 * at least mapped, runs compute(ctx) while still holding the runtime's lock
 * so no free can interleave. Returns whether compute ran. */
typedef struct simrt_range {
    const void *ptr;
    size_t bytes;
} simrt_range;
SIMRT_EXPORT int simrt_DeviceAccess(const simrt_range *ranges, size_t count, const char *what,
                                    void (*compute)(void *ctx), void *ctx);

#ifdef __cplusplus
}
#endif

#endif
