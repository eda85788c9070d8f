/* Threads through the exported entry points, for the sanitizer builds: run
 * with an instrumented libnpualloc.so preloaded on the simulated runtime.
 *
 * Each thread allocates log-uniform sizes from 1 B to 64 MiB through
 * aclrtMalloc/aclrtMallocAlign32, stamps every block with its own byte via the
 * runtime (aclrtMemset), checks the stamp (aclrtMemcpy to host) before freeing,
 * and frees out of order. Beside them, one thread creates and destroys
 * streams (so reuse_policy:auto switches to fenced reuse mid-run) and one reads
 * stats and empties the cache through npualloc's in-process API. One more
 * rewrites the config while another copies the stats and the config out of
 * this process's own stats region with libnpualloc_reader, as another
 * process does (ThreadSanitizer then checks each seqlock writer's stores
 * against the reader's loads: a plain store there is a race). Nothing here
 * knows the simulator: it would run the same on a real NPU. */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "acl/acl.h"
#include "npualloc.h"
#include "npualloc_reader.h"

#define WORKERS 4
#define LIVE_PER_WORKER 8
#define MAX_SIZE ((size_t)64 << 20)
#define SAMPLE 4096 /* bytes checked at each end of a block */

static int ops_per_worker = 400;
static atomic_int failures;
static atomic_int workers_done;

static void fail(const char *what, long detail)
{
    fprintf(stderr, "exports_stress: %s (%ld)\n", what, detail);
    atomic_fetch_add(&failures, 1);
}

static uint64_t next_random(uint64_t *state)
{
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    return *state;
}

/* Log-uniform over [1, MAX_SIZE]: most blocks small, some very large. */
static size_t random_size(uint64_t *state)
{
    unsigned bits = (unsigned)(next_random(state) % 27); /* 2^26 = 64 MiB */
    size_t base = (size_t)1 << bits;
    size_t size = base + (size_t)(next_random(state) % base);
    return size > MAX_SIZE ? MAX_SIZE : size;
}

typedef struct live_block {
    void *ptr;
    size_t size;
    unsigned char stamp;
} live_block;

static int check_stamp(const live_block *b, unsigned char *host)
{
    size_t head = b->size < SAMPLE ? b->size : SAMPLE;
    if (aclrtMemcpy(host, SAMPLE, b->ptr, head, ACL_MEMCPY_DEVICE_TO_HOST) != ACL_SUCCESS)
        return -1;
    for (size_t i = 0; i < head; i++)
        if (host[i] != b->stamp)
            return -1;
    if (b->size > SAMPLE) {
        const char *tail = (const char *)b->ptr + b->size - SAMPLE;
        if (aclrtMemcpy(host, SAMPLE, tail, SAMPLE, ACL_MEMCPY_DEVICE_TO_HOST) != ACL_SUCCESS)
            return -1;
        for (size_t i = 0; i < SAMPLE; i++)
            if (host[i] != b->stamp)
                return -1;
    }
    return 0;
}

static void *worker(void *arg)
{
    uint64_t state = 0x9E3779B97F4A7C15ull * (uintptr_t)arg + 1;
    live_block live[LIVE_PER_WORKER] = {{0}};
    unsigned char host[SAMPLE];
    if (aclrtSetDevice(0) != ACL_SUCCESS) {
        fail("aclrtSetDevice", (long)(uintptr_t)arg);
        return NULL;
    }
    for (int op = 0; op < ops_per_worker; op++) {
        live_block *b = &live[next_random(&state) % LIVE_PER_WORKER];
        if (b->ptr) {
            if (check_stamp(b, host) != 0)
                fail("block changed while live", (long)b->size);
            if (aclrtFree(b->ptr) != ACL_SUCCESS)
                fail("aclrtFree", (long)b->size);
            b->ptr = NULL;
            continue;
        }
        b->size = random_size(&state);
        b->stamp = (unsigned char)(1 + next_random(&state) % 255);
        aclError err = (op & 1) ? aclrtMallocAlign32(&b->ptr, b->size, ACL_MEM_MALLOC_HUGE_FIRST)
                                : aclrtMalloc(&b->ptr, b->size, ACL_MEM_MALLOC_HUGE_FIRST);
        if (err != ACL_SUCCESS || b->ptr == NULL || ((uintptr_t)b->ptr & 63) != 0) {
            fail("aclrtMalloc", (long)err);
            b->ptr = NULL;
            continue;
        }
        if (aclrtMemset(b->ptr, b->size, b->stamp, b->size) != ACL_SUCCESS)
            fail("aclrtMemset", (long)b->size);
    }
    for (int i = 0; i < LIVE_PER_WORKER; i++) {
        if (!live[i].ptr)
            continue;
        if (check_stamp(&live[i], host) != 0)
            fail("block changed while live", (long)live[i].size);
        if (aclrtFree(live[i].ptr) != ACL_SUCCESS)
            fail("aclrtFree", (long)live[i].size);
    }
    atomic_fetch_add(&workers_done, 1);
    return NULL;
}

static void *stream_churn(void *arg)
{
    (void)arg;
    if (aclrtSetDevice(0) != ACL_SUCCESS)
        return NULL;
    while (atomic_load(&workers_done) < WORKERS) {
        aclrtStream stream = NULL;
        if (aclrtCreateStream(&stream) != ACL_SUCCESS) {
            fail("aclrtCreateStream", 0);
            return NULL;
        }
        aclrtSynchronizeStream(stream);
        if (aclrtDestroyStream(stream) != ACL_SUCCESS)
            fail("aclrtDestroyStream", 0);
    }
    return NULL;
}

/* npualloc's API is looked up at run time: this program is not linked to it. */
static void *observer(void *arg)
{
    (void)arg;
    __typeof__(&npualloc_get_stats) get_stats = (__typeof__(&npualloc_get_stats))dlsym(RTLD_DEFAULT, "npualloc_get_stats");
    __typeof__(&npualloc_empty_cache) empty_cache =
        (__typeof__(&npualloc_empty_cache))dlsym(RTLD_DEFAULT, "npualloc_empty_cache");
    if (!get_stats || !empty_cache) {
        fail("npualloc is not preloaded", 0);
        return NULL;
    }
    for (int round = 0; atomic_load(&workers_done) < WORKERS; round++) {
        npualloc_device_stats s;
        if (get_stats(0, &s) == 0) {
            const int64_t allocated = s.allocated_bytes[NPUALLOC_POOL_ALL].current;
            const int64_t reserved = s.reserved_bytes[NPUALLOC_POOL_ALL].current;
            if (allocated < 0 || allocated > reserved)
                fail("inconsistent stats: allocated vs reserved", (long)(allocated - reserved));
        }
        if (round % 64 == 0)
            empty_cache(0);
    }
    return NULL;
}

/* The two configs config_churn switches between, as npualloc_get_config
 * gives them: a copy of the region's text must be one of them, whole. */
static const char *const churned[2] = {"record_history:0", "record_history:16"};
static char churned_text[2][NPUALLOC_CONFIG_LEN];

static void *config_churn(void *arg)
{
    (void)arg;
    __typeof__(&npualloc_set_config) set_config =
        (__typeof__(&npualloc_set_config))dlsym(RTLD_DEFAULT, "npualloc_set_config");
    for (int round = 0; set_config && atomic_load(&workers_done) < WORKERS; round++)
        if (set_config(churned[round & 1]) != 0)
            fail("npualloc_set_config refused", round);
    return NULL;
}

/* Where this process's region is mapped (/proc/self/maps names its file,
 * npualloc.<pid>), or NULL before its first allocation made it. */
static const npualloc_region *own_region(void)
{
    char line[4352], name[64];
    snprintf(name, sizeof name, "/npualloc.%d\n", (int)getpid());
    FILE *maps = fopen("/proc/self/maps", "r");
    const npualloc_region *found = NULL;
    while (maps && !found && fgets(line, sizeof line, maps)) {
        size_t len = strlen(line), name_len = strlen(name);
        if (len > name_len && strcmp(line + len - name_len, name) == 0)
            found = (const npualloc_region *)(uintptr_t)strtoull(line, NULL, 16);
    }
    if (maps)
        fclose(maps);
    return found;
}

static void *region_reader(void *arg)
{
    void *reader = dlopen((const char *)arg, RTLD_NOW | RTLD_LOCAL);
    __typeof__(&npualloc_reader_stats) read_stats =
        reader ? (__typeof__(&npualloc_reader_stats))dlsym(reader, "npualloc_reader_stats") : NULL;
    __typeof__(&npualloc_reader_config) read_config =
        reader ? (__typeof__(&npualloc_reader_config))dlsym(reader, "npualloc_reader_config") : NULL;
    if (!read_stats || !read_config) {
        fail("no libnpualloc_reader at NPUALLOC_STRESS_READER", 0);
        return NULL;
    }
    const npualloc_region *region = NULL;
    long copies = 0;
    while (atomic_load(&workers_done) < WORKERS) {
        if (!region && !(region = own_region())) {
            sched_yield();
            continue;
        }
        npualloc_device_stats s;
        if (read_stats(region, 0, 1000, &s) == NPUALLOC_READ_OK) {
            copies++;
            const int64_t allocated = s.allocated_bytes[NPUALLOC_POOL_ALL].current;
            if (allocated < 0 || allocated > s.reserved_bytes[NPUALLOC_POOL_ALL].current)
                fail("region stats copied inconsistent", (long)allocated);
        }
        char text[NPUALLOC_CONFIG_LEN];
        if (read_config(region, 1000, text) == NPUALLOC_READ_OK && strcmp(text, churned_text[0]) != 0 &&
            strcmp(text, churned_text[1]) != 0)
            fail("region config copied torn", (long)strlen(text));
    }
    if (copies == 0)
        fail("no copy of the region's stats was made", 0);
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1)
        ops_per_worker = atoi(argv[1]);
    if (aclInit(NULL) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS) {
        fprintf(stderr, "exports_stress: no runtime\n");
        return 2;
    }
    const char *reader = getenv("NPUALLOC_STRESS_READER");
    __typeof__(&npualloc_set_config) set_config =
        (__typeof__(&npualloc_set_config))dlsym(RTLD_DEFAULT, "npualloc_set_config");
    __typeof__(&npualloc_get_config) get_config =
        (__typeof__(&npualloc_get_config))dlsym(RTLD_DEFAULT, "npualloc_get_config");
    if (!reader || !set_config || !get_config) {
        fprintf(stderr, "exports_stress: needs npualloc preloaded and NPUALLOC_STRESS_READER\n");
        return 2;
    }
    for (int i = 1; i >= 0; i--) { /* ends with history off, as the run starts */
        set_config(churned[i]);
        get_config(churned_text[i], sizeof churned_text[i]);
    }
    pthread_t threads[WORKERS + 4];
    for (uintptr_t i = 0; i < WORKERS; i++)
        pthread_create(&threads[i], NULL, worker, (void *)i);
    pthread_create(&threads[WORKERS], NULL, stream_churn, NULL);
    pthread_create(&threads[WORKERS + 1], NULL, observer, NULL);
    pthread_create(&threads[WORKERS + 2], NULL, config_churn, NULL);
    pthread_create(&threads[WORKERS + 3], NULL, region_reader, (void *)reader);
    for (int i = 0; i < WORKERS + 4; i++)
        pthread_join(threads[i], NULL);

    __typeof__(&npualloc_get_stats) get_stats = (__typeof__(&npualloc_get_stats))dlsym(RTLD_DEFAULT, "npualloc_get_stats");
    npualloc_device_stats s;
    if (!get_stats || get_stats(0, &s) != 0)
        fail("no stats at the end", 0);
    else if (s.allocated_bytes[NPUALLOC_POOL_ALL].current != 0 || s.num_device_alloc == 0)
        fail("allocations left, or none went through npualloc", (long)s.allocated_bytes[NPUALLOC_POOL_ALL].current);
    aclrtResetDevice(0);
    aclFinalize();
    int failed = atomic_load(&failures);
    fprintf(stderr, "exports_stress: %d workers x %d ops, %d failures\n", WORKERS, ops_per_worker, failed);
    return failed ? 1 : 0;
}
