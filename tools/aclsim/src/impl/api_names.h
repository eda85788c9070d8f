/* Every public API the sim counts, in one list (X-macro), so the counter table,
 * the enum and the name lookup can never disagree. */
#define SIM_API_LIST(X)                                                                                        \
    X(aclInit) X(aclFinalize)                                                                                  \
    X(aclrtSetDevice) X(aclrtGetDevice) X(aclrtResetDevice) X(aclrtResetDeviceForce) X(aclrtGetDeviceCount) X(aclrtSynchronizeDevice)   \
    X(aclrtMalloc) X(aclrtMallocAlign32) X(aclrtMallocCached) X(aclrtFree) X(aclrtFreeWithDevSync)             \
    X(aclrtMemset) X(aclrtMemsetAsync) X(aclrtMemcpy) X(aclrtMemcpyAsync) X(aclrtGetMemInfo)                   \
    X(aclrtCreateStream) X(aclrtDestroyStream) X(aclrtSynchronizeStream) X(aclrtCreateStreamWithConfig) X(aclrtDestroyStreamForce)\
    X(aclrtCreateEvent) X(aclrtCreateEventWithFlag) X(aclrtRecordEvent) X(aclrtQueryEventStatus)               \
    X(aclrtQueryEvent) X(aclrtSynchronizeEvent) X(aclrtStreamWaitEvent) X(aclrtDestroyEvent)     \
    X(aclrtCreateEventExWithFlag) X(aclrtEventElapsedTime) X(aclrtCreateContext) X(aclrtDestroyContext)       \
    X(aclrtSetCurrentContext) X(aclrtGetCurrentContext) X(aclrtMallocHost) X(aclrtFreeHost) X(aclrtGetSocName) X(aclopSetModelDir)                   \
    X(aclrtReserveMemAddress) X(aclrtReleaseMemAddress) X(aclrtMallocPhysical) X(aclrtFreePhysical)            \
    X(aclrtMapMem) X(aclrtUnmapMem) X(aclrtMemGetAllocationGranularity)                                        \
    X(aclnnInit) X(aclnnFinalize) X(aclSetAclOpExecutorRepeatable) X(aclDestroyAclOpExecutor)                 \
    X(aclnnSimFillGetWorkspaceSize) X(aclnnSimFill) X(aclnnSimCopyGetWorkspaceSize) X(aclnnSimCopy)
