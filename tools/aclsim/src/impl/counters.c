/* Per-API call counters: what reached the simulated runtime, by public name. */
#include <stdatomic.h>
#include <string.h>

#include "internal.h"

#define SIM_API_NAME(name) #name,
static const char *const api_names[SIM_API_COUNT] = {SIM_API_LIST(SIM_API_NAME)};
static _Atomic uint64_t api_calls[SIM_API_COUNT];

void sim_count(enum sim_api api)
{
    atomic_fetch_add_explicit(&api_calls[api], 1, memory_order_relaxed);
}

int sim_api_index(const char *name)
{
    for (int i = 0; name != NULL && i < SIM_API_COUNT; i++)
        if (strcmp(api_names[i], name) == 0)
            return i;
    return -1;
}

SIM_EXPORT void simrt_CountCall(const char *api)
{
    int i = sim_api_index(api);
    if (i >= 0)
        sim_count((enum sim_api)i);
}

SIM_EXPORT uint64_t aclsim_call_count(const char *api)
{
    int i = sim_api_index(api);
    return i < 0 ? UINT64_MAX : atomic_load(&api_calls[i]);
}

SIM_EXPORT void aclsim_reset_counters(void)
{
    for (int i = 0; i < SIM_API_COUNT; i++)
        atomic_store(&api_calls[i], 0);
    sim_reset_violations();
}
