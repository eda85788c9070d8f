/* Threads through the exported entry points, for the sanitizer builds: run
 * with an instrumented libnpualloc.so preloaded on the simulated runtime.
 *
 * Each thread allocates log-uniform sizes from 1 B to 64 MiB through
 * aclrtMalloc/aclrtMallocAlign32, stamps every block with its own byte via the
 * runtime (aclrtMemset), checks the stamp (aclrtMemcpy to host) before freeing,
 * and frees out of order. Beside them, one thread creates and destroys
 * streams (so reuse_policy:auto switches to fenced reuse mid-run) and one reads
 * stats and empties the cache through npualloc's in-process API. Nothing here
 * knows the simulator: it would run the same on a real NPU. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "acl/acl.h"
#include "npualloc.h"

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

int main(int argc, char **argv)
{
    if (argc > 1)
        ops_per_worker = atoi(argv[1]);
    if (aclInit(NULL) != ACL_SUCCESS || aclrtSetDevice(0) != ACL_SUCCESS) {
        fprintf(stderr, "exports_stress: no runtime\n");
        return 2;
    }
    pthread_t threads[WORKERS + 2];
    for (uintptr_t i = 0; i < WORKERS; i++)
        pthread_create(&threads[i], NULL, worker, (void *)i);
    pthread_create(&threads[WORKERS], NULL, stream_churn, NULL);
    pthread_create(&threads[WORKERS + 1], NULL, observer, NULL);
    for (int i = 0; i < WORKERS + 2; i++)
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
