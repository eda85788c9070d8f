/* aclInit / aclFinalize. As in the real runtime both are once per process:
 * the init flag is never cleared, so aclInit after aclFinalize is also a
 * repeated init (100002), and a second aclFinalize is 100037. */
#include "internal.h"

pthread_mutex_t sim_lock = PTHREAD_MUTEX_INITIALIZER;
pthread_cond_t sim_progress = PTHREAD_COND_INITIALIZER;

static int initialized, finalized;

aclError sim_require_init_locked(void)
{
    return initialized && !finalized ? ACL_SUCCESS : ACL_ERROR_UNINITIALIZE;
}

aclError sim_require_init(void)
{
    pthread_mutex_lock(&sim_lock);
    aclError ret = sim_require_init_locked();
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

SIM_EXPORT aclError simrt_Init(const char *configPath)
{
    (void)configPath; /* the sim has no JSON config (dump/profiling options) to read */
    sim_count(SIM_API_aclInit);
    sim_config();
    pthread_mutex_lock(&sim_lock);
    aclError ret = initialized ? ACL_ERROR_REPEAT_INITIALIZE : ACL_SUCCESS;
    initialized = 1;
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

SIM_EXPORT aclError simrt_Finalize(void)
{
    sim_count(SIM_API_aclFinalize);
    pthread_mutex_lock(&sim_lock);
    if (!initialized || finalized) {
        /* Nothing to finalize before aclInit: refused, and aclInit stays
         * possible (latching "finalized" here left a process whose aclInit
         * succeeded and whose every later call said 100001). */
        pthread_mutex_unlock(&sim_lock);
        return initialized ? ACL_ERROR_REPEAT_FINALIZE : ACL_ERROR_UNINITIALIZE;
    }
    finalized = 1;
    /* Finalize resets every device: queued work drains, streams go away.
     * Device memory stays where it is (the process still owns it). */
    sim_reset_all_devices();
    pthread_mutex_unlock(&sim_lock);
    sim_forget_current_device();
    return ACL_SUCCESS;
}
