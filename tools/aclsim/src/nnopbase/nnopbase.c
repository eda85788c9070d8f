/* The sim's libnnopbase.so: aclnn initialisation and the executor lifecycle
 * calls, forwarded to the shared executor registry in libaclsim.so. */
#include "../simrt.h"

#define EXPORT __attribute__((visibility("default")))

EXPORT aclnnStatus aclnnInit(const char *configPath) { return simrt_nnInit(configPath); }
EXPORT aclnnStatus aclnnFinalize(void) { return simrt_nnFinalize(); }
EXPORT aclnnStatus aclSetAclOpExecutorRepeatable(aclOpExecutor *executor)
{
    return simrt_SetExecutorRepeatable(executor);
}
EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) { return simrt_DestroyExecutor(executor); }
