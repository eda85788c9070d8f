/* The sim's libopapi.so: two simulated aclnn operators over raw device
 * pointers (see include/aclsim_ops.h). Phase 1 validates and captures the
 * arguments in an executor; phase 2 queues it on a stream; the stream worker
 * calls finish() once the op's duration has elapsed. */
#include <stddef.h>

#include "../simrt.h"
#include "aclsim_ops.h"

#define EXPORT __attribute__((visibility("default")))

struct fill_params {
    void *dst;
    uint64_t bytes;
    int32_t value;
};

struct copy_params {
    void *dst;
    const void *src;
    uint64_t bytes;
};

static void fill_finish(const void *params)
{
    const struct fill_params *p = params;
    simrt_DeviceFill(p->dst, p->value, (size_t)p->bytes, "aclnnSimFill dst");
}

static void copy_finish(const void *params)
{
    const struct copy_params *p = params;
    simrt_DeviceCopy(p->dst, p->src, (size_t)p->bytes, "aclnnSimCopy src/dst");
}

static const simrt_op_kind fill_kind = {"aclnnSimFill", fill_finish};
static const simrt_op_kind copy_kind = {"aclnnSimCopy", copy_finish};

EXPORT aclnnStatus aclnnSimFillGetWorkspaceSize(void *dst, uint64_t bytes, int32_t value, uint64_t *workspaceSize,
                                                aclOpExecutor **executor)
{
    simrt_CountCall("aclnnSimFillGetWorkspaceSize");
    if (dst == NULL || workspaceSize == NULL || executor == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    struct fill_params p = {.dst = dst, .bytes = bytes, .value = value};
    *workspaceSize = ACLSIM_OP_WORKSPACE_BYTES;
    return simrt_CreateExecutor(&fill_kind, &p, sizeof p, ACLSIM_OP_WORKSPACE_BYTES, executor);
}

EXPORT aclnnStatus aclnnSimFill(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)
{
    simrt_CountCall("aclnnSimFill");
    return simrt_LaunchExecutor("aclnnSimFill", workspace, workspaceSize, executor, stream);
}

EXPORT aclnnStatus aclnnSimCopyGetWorkspaceSize(void *dst, const void *src, uint64_t bytes, uint64_t *workspaceSize,
                                                aclOpExecutor **executor)
{
    simrt_CountCall("aclnnSimCopyGetWorkspaceSize");
    if (dst == NULL || src == NULL || workspaceSize == NULL || executor == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    struct copy_params p = {.dst = dst, .src = src, .bytes = bytes};
    *workspaceSize = ACLSIM_OP_WORKSPACE_BYTES;
    return simrt_CreateExecutor(&copy_kind, &p, sizeof p, ACLSIM_OP_WORKSPACE_BYTES, executor);
}

EXPORT aclnnStatus aclnnSimCopy(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream)
{
    simrt_CountCall("aclnnSimCopy");
    return simrt_LaunchExecutor("aclnnSimCopy", workspace, workspaceSize, executor, stream);
}
