/* Our own transcription of the public nnopbase executor API (libnnopbase.so). */
#ifndef NPUALLOC_ACLNN_ACL_META_H
#define NPUALLOC_ACLNN_ACL_META_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t aclnnStatus;
typedef struct aclOpExecutor aclOpExecutor;

#define ACLNN_SUCCESS 0
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002
#define ACLNN_ERR_RUNTIME_ERROR 361001
#define ACLNN_ERR_INNER_NULLPTR 561103

aclnnStatus aclnnInit(const char *configPath);
aclnnStatus aclnnFinalize(void);
aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor);
aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor);

#ifdef __cplusplus
}
#endif

#endif
