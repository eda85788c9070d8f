/* Host-side runtime calls: page-locked host memory, the SoC name and the
 * single-operator model directory. */
#include <stdlib.h>
#include <sys/stat.h>

#include "internal.h"

/* Page-locked memory is ordinary host memory here, aligned as the driver's. */
SIM_EXPORT aclError simrt_MallocHost(void **hostPtr, size_t size)
{
    sim_count(SIM_API_aclrtMallocHost);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    if (hostPtr == NULL || size == 0)
        return ACL_ERROR_INVALID_PARAM;
    void *p = NULL;
    if (posix_memalign(&p, 4096, size) != 0)
        return ACL_ERROR_RT_MEMORY_ALLOCATION;
    *hostPtr = p;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_FreeHost(void *hostPtr)
{
    sim_count(SIM_API_aclrtFreeHost);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    if (hostPtr == NULL)
        return ACL_ERROR_INVALID_PARAM;
    free(hostPtr);
    return ACL_SUCCESS;
}

/* The simulated devices are Ascend 910B3s (what MindTorch's 910b op table
 * and the reference numbers assume). */
SIM_EXPORT const char *simrt_GetSocName(void)
{
    sim_count(SIM_API_aclrtGetSocName);
    return sim_require_init() == ACL_SUCCESS ? "Ascend910B3" : NULL;
}

static int model_dir_set;

/* Once per process, and only for an existing directory. */
SIM_EXPORT aclError simrt_opSetModelDir(const char *modelDir)
{
    sim_count(SIM_API_aclopSetModelDir);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    struct stat st;
    if (modelDir == NULL || stat(modelDir, &st) != 0 || !S_ISDIR(st.st_mode))
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&sim_lock);
    ret = model_dir_set ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS;
    model_dir_set = 1;
    pthread_mutex_unlock(&sim_lock);
    return ret;
}
