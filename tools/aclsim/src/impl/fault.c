/* Fault injection for raw device allocations (aclrtMalloc family and
 * aclrtMallocPhysical): the Nth one (NPUSIM_FAIL_NTH_MALLOC), each with a
 * probability from a seeded generator (NPUSIM_FAIL_PROB, NPUSIM_FAIL_SEED, so a
 * failing run can be replayed), and the next n on request of a test. Called
 * with the lock held, so the sequence is deterministic for a given call order.
 *
 * And, on request of a test, failures of the calls an allocator's stream-safe
 * reuse depends on: a device that cannot be entered (aclrtSetDevice), work
 * that cannot be waited for (aclrtSynchronizeDevice, aclrtSynchronizeStream)
 * or fenced (aclrtRecordEvent), with the error code the test names (e.g.
 * 207004 ACL_ERROR_RT_NO_DEVICE for a device that is gone, 500000
 * ACL_ERROR_INTERNAL_ERROR). Such a call fails after its parameter checks
 * and does nothing. */
#include <stdatomic.h>

#include "internal.h"

static uint64_t attempts;
static uint64_t rng_state;
static int rng_seeded;
static uint32_t forced_failures;
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

static const enum sim_api failable_calls[] = {SIM_API_aclrtSetDevice, SIM_API_aclrtSynchronizeDevice,
                                              SIM_API_aclrtSynchronizeStream, SIM_API_aclrtRecordEvent};
#define FAILABLE_CALLS (sizeof failable_calls / sizeof *failable_calls)
static struct {
    uint32_t left;
    aclError error;
} call_faults[FAILABLE_CALLS];

aclError sim_inject_call_failure(enum sim_api api)
{
    aclError error = ACL_SUCCESS;
    pthread_mutex_lock(&sim_lock);
    for (size_t i = 0; i < FAILABLE_CALLS; i++) {
        if (failable_calls[i] == api && call_faults[i].left > 0) {
            call_faults[i].left--;
            error = call_faults[i].error;
        }
    }
    pthread_mutex_unlock(&sim_lock);
    if (error != ACL_SUCCESS)
        atomic_fetch_add(&injected, 1);
    return error;
}

SIM_EXPORT int aclsim_fail_next_calls(const char *api, uint32_t n, int32_t error)
{
    int index = sim_api_index(api);
    if (error == ACL_SUCCESS && n > 0)
        return -1;
    for (size_t i = 0; index >= 0 && i < FAILABLE_CALLS; i++) {
        if ((int)failable_calls[i] == index) {
            pthread_mutex_lock(&sim_lock);
            call_faults[i].left = n;
            call_faults[i].error = error;
            pthread_mutex_unlock(&sim_lock);
            return 0;
        }
    }
    return -1;
}

SIM_EXPORT uint64_t aclsim_injected_failures(void) { return atomic_load(&injected); }
