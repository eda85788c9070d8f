/* The simulated aclnn operators of the sim's libopapi.so. Real aclnn ops take
 * aclTensor*; these take raw device pointers, which is all an allocator test
 * needs: they touch device buffers and a workspace, on a stream, for a while.
 * Both follow the real two-phase protocol:
 *   phase 1  aclnnXxxGetWorkspaceSize(args..., &workspaceSize, &executor)
 *   phase 2  aclnnXxx(workspace, workspaceSize, executor, stream)
 * Each needs ACLSIM_OP_WORKSPACE_BYTES of workspace, which it really writes
 * when it starts and reads back when it ends. */
#ifndef ACLSIM_OPS_H
#define ACLSIM_OPS_H

#include <stdint.h>

#include "acl/acl.h"
#include "aclnn/acl_meta.h"

#ifdef __cplusplus
extern "C" {
#endif

#define ACLSIM_OP_WORKSPACE_BYTES 1024u

/* Sets `bytes` bytes at dst to (uint8_t)value when the op's duration ends. */
aclnnStatus aclnnSimFillGetWorkspaceSize(void *dst, uint64_t bytes, int32_t value, uint64_t *workspaceSize,
                                         aclOpExecutor **executor);
aclnnStatus aclnnSimFill(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

/* Copies `bytes` bytes from src to dst; src is read when the duration ends, so a
 * source freed and reused meanwhile shows up as corrupted output. */
aclnnStatus aclnnSimCopyGetWorkspaceSize(void *dst, const void *src, uint64_t bytes, uint64_t *workspaceSize,
                                         aclOpExecutor **executor);
aclnnStatus aclnnSimCopy(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

#ifdef __cplusplus
}
#endif

#endif
