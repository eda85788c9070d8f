/* NPUSIM_* environment knobs, read once on first use. Defaults are chosen so
 * an unconfigured process looks like one 64 GiB Ascend 910B-class device
 * among eight, with raw allocation costs of the order real drivers show. */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

/* aclrtMalloc/aclrtFree go through the driver (ioctl, page-table updates):
 * tens of microseconds each for small blocks, which is what makes a caching
 * allocator worth having. 40/20 us keep that visible without slowing tests
 * much (tests set both to 0 anyway). */
#define DEFAULT_MALLOC_US 40
#define DEFAULT_FREE_US 20
#define DEFAULT_OP_US 10
#define DEFAULT_HBM_MB 65536
#define DEFAULT_DEVICE_COUNT 8
#define DEFAULT_POISON_BYTES 4096
#define MAX_DEVICE_COUNT 64

static struct sim_config config;
static pthread_once_t config_once = PTHREAD_ONCE_INIT;

static uint64_t env_u64(const char *name, uint64_t fallback)
{
    const char *text = getenv(name);
    if (text == NULL || *text == '\0')
        return fallback;
    char *end;
    unsigned long long value = strtoull(text, &end, 0);
    return *end == '\0' ? (uint64_t)value : fallback;
}

static double env_double(const char *name, double fallback)
{
    const char *text = getenv(name);
    if (text == NULL || *text == '\0')
        return fallback;
    char *end;
    double value = strtod(text, &end);
    return *end == '\0' ? value : fallback;
}

static void read_config(void)
{
    config.hbm_bytes = env_u64("NPUSIM_HBM_MB", DEFAULT_HBM_MB) << 20;
    uint64_t count = env_u64("NPUSIM_DEVICE_COUNT", DEFAULT_DEVICE_COUNT);
    config.device_count = (int32_t)(count > MAX_DEVICE_COUNT ? MAX_DEVICE_COUNT : count);
    config.malloc_us = env_u64("NPUSIM_MALLOC_US", DEFAULT_MALLOC_US);
    config.free_us = env_u64("NPUSIM_FREE_US", DEFAULT_FREE_US);
    config.fail_nth = env_u64("NPUSIM_FAIL_NTH_MALLOC", 0);
    config.fail_prob = env_double("NPUSIM_FAIL_PROB", 0.0);
    config.fail_seed = env_u64("NPUSIM_FAIL_SEED", 1);
    config.op_us = env_u64("NPUSIM_OP_US", DEFAULT_OP_US);
    config.poison_bytes = (size_t)env_u64("NPUSIM_POISON_BYTES", DEFAULT_POISON_BYTES);
    const char *shared = getenv("NPUSIM_SHARED_DIR");
    config.shared_dir = shared != NULL && *shared != '\0' ? shared : NULL;
}

const struct sim_config *sim_config(void)
{
    pthread_once(&config_once, read_config);
    return &config;
}
