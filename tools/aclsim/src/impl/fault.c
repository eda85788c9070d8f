/* Fault injection for raw device allocations (aclrtMalloc family and
 * aclrtMallocPhysical): the Nth one (NPUSIM_FAIL_NTH_MALLOC), each with a
 * probability from a seeded generator (NPUSIM_FAIL_PROB, NPUSIM_FAIL_SEED, so a
 * failing run can be replayed), and the next n on request of a test. Called
 * with the lock held, so the sequence is deterministic for a given call order.
 *
 * Releases of virtual memory (aclrtUnmapMem, aclrtFreePhysical) fail on
 * request of a test (aclsim_fail_release): after `skip` calls that succeed,
 * the next n fail with 207002 (ACL_ERROR_RT_MEMORY_FREE, the runtime's code
 * for a release the driver refused) and change nothing: the mapping stays
 * mapped, the handle stays live, as a failed driver call leaves them. */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

static uint64_t attempts;
static uint64_t rng_state;
static int rng_seeded;
static uint32_t forced_failures;
static struct {
    uint32_t skip, fail;
} release_failures[2]; /* sim_lock; [0] aclrtUnmapMem, [1] aclrtFreePhysical */
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

int sim_inject_release_failure(enum sim_api api)
{
    uint32_t i = api == SIM_API_aclrtUnmapMem ? 0 : 1;
    if (release_failures[i].skip > 0) {
        release_failures[i].skip--;
        return 0;
    }
    if (release_failures[i].fail == 0)
        return 0;
    release_failures[i].fail--;
    atomic_fetch_add(&injected, 1);
    return 1;
}

SIM_EXPORT int aclsim_fail_release(const char *api, uint32_t skip, uint32_t n)
{
    int i = api == NULL ? -1 : strcmp(api, "aclrtUnmapMem") == 0 ? 0 : strcmp(api, "aclrtFreePhysical") == 0 ? 1 : -1;
    if (i < 0)
        return -1;
    pthread_mutex_lock(&sim_lock);
    release_failures[i].skip = skip;
    release_failures[i].fail = n;
    pthread_mutex_unlock(&sim_lock);
    return 0;
}
