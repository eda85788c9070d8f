/* Fault injection for raw device allocations (aclrtMalloc family and
 * aclrtMallocPhysical): the Nth one (NPUSIM_FAIL_NTH_MALLOC), each with a
 * probability from a seeded generator (NPUSIM_FAIL_PROB, NPUSIM_FAIL_SEED, so a
 * failing run can be replayed), and the next n on request of a test. Called
 * with the lock held, so the sequence is deterministic for a given call order.
 *
 * Other calls fail on request of a test, one table for all of them: after
 * `skip` calls that succeed, the next n fail with an error and change
 * nothing, as a failed driver call leaves things.
 * - Releases of virtual memory (aclrtUnmapMem, aclrtFreePhysical;
 *   aclsim_fail_release): 207002 (ACL_ERROR_RT_MEMORY_FREE, the runtime's code
 *   for a release the driver refused): the mapping stays mapped, the handle live.
 * - The calls stream-safe reuse depends on (aclsim_fail_next_calls): a device
 *   that cannot be entered (aclrtSetDevice), work that cannot be waited for
 *   (aclrtSynchronizeDevice, aclrtSynchronizeStream) or fenced
 *   (aclrtRecordEvent), with the code the test names (e.g. 207004
 *   ACL_ERROR_RT_NO_DEVICE for a device that is gone, 500000
 *   ACL_ERROR_INTERNAL_ERROR).
 * - A repeatable executor's destroy the runtime refuses
 *   (aclDestroyAclOpExecutor, aclsim_fail_next_calls too): the reference
 *   names no code for it, so the test names one (an aclnnStatus); the
 *   executor stays live and may be destroyed again. */
#include <stdatomic.h>

#include "internal.h"

static uint64_t attempts;
static uint64_t rng_state;
static int rng_seeded;
static uint32_t forced_failures;
static const enum sim_api failable_calls[] = {SIM_API_aclrtUnmapMem, SIM_API_aclrtFreePhysical,
                                              SIM_API_aclrtSetDevice, SIM_API_aclrtSynchronizeDevice,
                                              SIM_API_aclrtSynchronizeStream, SIM_API_aclrtRecordEvent,
                                              SIM_API_aclDestroyAclOpExecutor};
#define FAILABLE_CALLS (sizeof failable_calls / sizeof *failable_calls)
#define RELEASES 2 /* the first entries: aclsim_fail_release's */
static struct {
    uint32_t skip, fail;
    aclError error;
} call_failures[FAILABLE_CALLS]; /* sim_lock */
static _Atomic uint64_t injected;

/* splitmix64: small, fast, and good enough to decide coin flips. */
static uint64_t next_random(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int sim_inject_alloc_failure(void)
{
    const struct sim_config *cfg = sim_config();
    int fail = 0;
    attempts++;
    if (forced_failures > 0) {
        forced_failures--;
        fail = 1;
    }
    if (cfg->fail_nth != 0 && attempts == cfg->fail_nth)
        fail = 1;
    if (cfg->fail_prob > 0.0) {
        if (!rng_seeded) {
            rng_state = cfg->fail_seed;
            rng_seeded = 1;
        }
        /* Draw on every attempt, failing or not, so the sequence only depends on the seed. */
        if ((double)(next_random() >> 11) * 0x1.0p-53 < cfg->fail_prob)
            fail = 1;
    }
    if (fail)
        atomic_fetch_add(&injected, 1);
    return fail;
}

SIM_EXPORT void aclsim_fail_next_mallocs(uint32_t n)
{
    pthread_mutex_lock(&sim_lock);
    forced_failures = n;
    pthread_mutex_unlock(&sim_lock);
}

SIM_EXPORT uint64_t aclsim_injected_failures(void) { return atomic_load(&injected); }

static int failable_index(const char *api, size_t first, size_t end)
{
    int index = api == NULL ? -1 : sim_api_index(api);
    for (size_t i = first; index >= 0 && i < end; i++)
        if ((int)failable_calls[i] == index)
            return (int)i;
    return -1;
}

aclError sim_inject_call_failure_locked(enum sim_api api)
{
    for (size_t i = 0; i < FAILABLE_CALLS; i++) {
        if (failable_calls[i] != api)
            continue;
        if (call_failures[i].skip > 0) {
            call_failures[i].skip--;
            return ACL_SUCCESS;
        }
        if (call_failures[i].fail == 0)
            return ACL_SUCCESS;
        call_failures[i].fail--;
        atomic_fetch_add(&injected, 1);
        return call_failures[i].error;
    }
    return ACL_SUCCESS;
}

aclError sim_inject_call_failure(enum sim_api api)
{
    pthread_mutex_lock(&sim_lock);
    aclError error = sim_inject_call_failure_locked(api);
    pthread_mutex_unlock(&sim_lock);
    return error;
}

static void set_call_failures(int i, uint32_t skip, uint32_t n, aclError error)
{
    pthread_mutex_lock(&sim_lock);
    call_failures[i].skip = skip;
    call_failures[i].fail = n;
    call_failures[i].error = error;
    pthread_mutex_unlock(&sim_lock);
}

SIM_EXPORT int aclsim_fail_release(const char *api, uint32_t skip, uint32_t n)
{
    int i = failable_index(api, 0, RELEASES);
    if (i < 0)
        return -1;
    set_call_failures(i, skip, n, ACL_ERROR_RT_MEMORY_FREE);
    return 0;
}

SIM_EXPORT int aclsim_fail_next_calls(const char *api, uint32_t n, int32_t error)
{
    int i = failable_index(api, RELEASES, FAILABLE_CALLS);
    if (i < 0 || (error == ACL_SUCCESS && n > 0))
        return -1;
    set_call_failures(i, 0, n, error);
    return 0;
}
