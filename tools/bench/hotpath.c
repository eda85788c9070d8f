/* The hot path as a program sees it: ns per aclrtMalloc + aclrtFree pair
 * through the exported symbols, bound by the dynamic linker (run it with
 * LD_PRELOAD=libnpualloc.so to measure npualloc; without, every call would be
 * a raw runtime call); npualloc's stream-aware entry (npualloc_malloc_stream
 * + npualloc_free_stream on a stream of the thread's own, as MindTorch's
 * pass-through calls them; --host-writes passes NPUALLOC_STREAM_HOST_WRITES);
 * the allocator core alone (npa_malloc + npa_free linked in, over a no-op
 * backend: what the hook layer adds is the difference); or glibc
 * malloc/free. All walk the same size sequence in the same pattern, so
 * their figures compare.
 *
 *     npualloc-bench-hotpath [--allocator acl|stream|core|glibc] [--host-writes] [--shared-counter]
 *                            [--threads N] [--batches B] [--pairs P] [--group G] [--fence-after M]
 *                            [--max-size BYTES] SIZES_FILE
 *
 * --fence-after M (core only) gives the core's backend fences, as under
 * reuse_policy:safe, that complete once M more mallocs were made after
 * their record: the fence path's own work, counted by callgrind without
 * the simulator's stream thread, whose timing decides how long a real
 * fence takes (and so how often it is queried).
 *
 * --max-size BYTES leaves out the sizes above BYTES: glibc serves sizes up
 * to 1 MiB from its per-thread arenas without a system call, and the larger
 * ones with mmap and munmap, whose cost with several threads is the
 * kernel's (its lock on the address space, a TLB shootdown per munmap).
 *
 * --shared-counter (glibc only) has every malloc and free also move one byte
 * count that all threads share, and raise its peak when passed, with one
 * atomic add and a compare: the least that an allocator adds to each call
 * when it keeps its stats exact across threads by putting every change in
 * one order (as a lock does; a peak of what the threads hold together is
 * the stat that asks for an order). With glibc's per-thread arenas
 * underneath, what threads lose against one thread is that order's price.
 *
 * Each thread walks the size list from its own offset, so threads ask for
 * different sizes at the same moment. A step allocates G blocks and then
 * frees them (G = 1: malloc, free, malloc, free ...); a batch is P pairs, timed
 * with clock_gettime, and its cost per pair is one sample. Every thread first
 * runs its whole sequence once untimed, so the timed batches are cache hits
 * (the JSON says how many raw device mallocs and cache misses happened while
 * timing, and every runtime call of the kinds a steady loop should not make,
 * so a reader can check). All threads use device 0.
 *
 * Prints one JSON object on stdout (with how many CPUs the process may run
 * on: the bench pins its one-thread runs); exits 1 on any ACL error. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "acl/acl.h"
#include "aclsim.h"
#include "core.h"
#include "npualloc.h"

#define MAX_THREADS 64
#define MAX_GROUP 256

typedef enum allocator_kind { ALLOCATOR_ACL, ALLOCATOR_STREAM, ALLOCATOR_CORE, ALLOCATOR_GLIBC } allocator_kind;

typedef struct options {
    allocator_kind allocator;
    int host_writes;    /* ALLOCATOR_STREAM: NPUALLOC_STREAM_HOST_WRITES */
    int shared_counter; /* ALLOCATOR_GLIBC: every call moves shared_bytes */
    int threads;
    int batches;
    int pairs;          /* per batch, a multiple of group */
    int group;
    int fence_after;    /* ALLOCATOR_CORE: fences complete this many mallocs after their record; -1: none */
    size_t max_size;    /* sizes above it are left out; 0: none are */
    const char *sizes_path;
} options;

typedef struct sizes {
    size_t *values;
    size_t count;
} sizes;

typedef struct worker {
    pthread_t thread;
    int index;
    double *per_pair_ns;     /* one sample per batch */
    double wall_s;           /* the timed batches, start to end */
    double cpu_s;            /* CPU time of those batches: below wall_s when the thread waited for a core */
    long sleeps;             /* voluntary context switches in them: waits for a lock (or anything else that blocks) */
    int failed;
} worker;

static options opts = {ALLOCATOR_ACL, 0, 0, 1, 1000, 1000, 1, -1, 0, NULL};
static sizes seq;
static npa_allocator *core;   /* ALLOCATOR_CORE */
/* ALLOCATOR_STREAM: the preloaded library's entry (looked up, not linked),
 * and each thread's stream. */
static int (*malloc_stream)(void **, size_t, void *, int);
static int (*free_stream)(void *, void *);
static __thread aclrtStream thread_stream;

/* The core's backend: device memory is a bump of fake addresses (never
 * touched), frees and synchronizes do nothing, no fences (eager reuse). */
static uintptr_t next_fake_addr = (uintptr_t)1 << 44;
static pthread_mutex_t fake_lock = PTHREAD_MUTEX_INITIALIZER;

static npa_error fake_malloc(void *ctx, int device, size_t size, void **ptr) {
    (void)ctx, (void)device;
    pthread_mutex_lock(&fake_lock);
    *ptr = (void *)next_fake_addr;
    next_fake_addr += (size + ((size_t)2 << 20)) & ~(((size_t)2 << 20) - 1);
    pthread_mutex_unlock(&fake_lock);
    return NPA_OK;
}
static npa_error fake_free(void *ctx, int device, void *ptr) { return (void)ctx, (void)device, (void)ptr, NPA_OK; }
static npa_error fake_sync(void *ctx, int device) { return (void)ctx, (void)device, NPA_OK; }
static npa_error fake_info(void *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
    (void)ctx, (void)device;
    *free_bytes = *total_bytes = (size_t)1 << 46;
    return NPA_OK;
}
/* --fence-after: the core's fences. The clock is mallocs made (one
 * thread's, or racy counts of several: only the timing of completion). */
static uint64_t core_mallocs, fence_records, fence_queries;
static npa_error fake_fence_record(void *ctx, int device, void **fence) {
    (void)ctx, (void)device;
    uint64_t *at = malloc(sizeof *at);
    if (!at) return NPA_ERR_OOM;
    *at = core_mallocs;
    fence_records++;
    *fence = at;
    return NPA_OK;
}
static int fake_fence_done(void *ctx, void *fence) {
    (void)ctx;
    fence_queries++;
    return core_mallocs - *(uint64_t *)fence >= (uint64_t)opts.fence_after;
}
static void fake_fence_release(void *ctx, void *fence) { (void)ctx, free(fence); }

static pthread_barrier_t warmed_up, counted, timing_done;

static double clock_s(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Keeps the compiler from pairing a malloc with its free and dropping both. */
static inline void keep(void *p) { __asm__ volatile("" : : "r"(p) : "memory"); }

/* --shared-counter: bytes the threads hold together and the most they ever
 * held, on one cache line (the peak test after the add then reads a line the
 * thread already owns). Relaxed: the add orders the changes by itself, and
 * nothing else is published through them. */
static struct {
    _Alignas(64) int64_t current;
    int64_t peak;
} shared_bytes;

static void count_shared(int64_t delta) {
    int64_t now = __atomic_add_fetch(&shared_bytes.current, delta, __ATOMIC_RELAXED);
    int64_t peak = __atomic_load_n(&shared_bytes.peak, __ATOMIC_RELAXED);
    while (now > peak &&
           !__atomic_compare_exchange_n(&shared_bytes.peak, &peak, now, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

static int alloc_block(void **p, size_t size) {
    switch (opts.allocator) {
    case ALLOCATOR_GLIBC:
        *p = malloc(size);
        keep(*p);
        if (opts.shared_counter && *p) count_shared((int64_t)size);
        return *p ? 0 : ENOMEM;
    case ALLOCATOR_CORE:
        core_mallocs++;
        return npa_malloc(core, 0, size, NPA_ENTRY_MALLOC, p);
    case ALLOCATOR_STREAM:
        return malloc_stream(p, size, thread_stream, opts.host_writes ? NPUALLOC_STREAM_HOST_WRITES : 0);
    case ALLOCATOR_ACL:
    default:
        return aclrtMalloc(p, size, ACL_MEM_MALLOC_HUGE_FIRST);
    }
}

static int free_block(void *p, size_t size) {
    switch (opts.allocator) {
    case ALLOCATOR_GLIBC:
        free(p);
        if (opts.shared_counter) count_shared(-(int64_t)size);
        return 0;
    case ALLOCATOR_CORE:
        return npa_free(core, p, 0, NULL) == NPA_FREE_OK ? 0 : EINVAL;
    case ALLOCATOR_STREAM:
        return free_stream(p, thread_stream);
    case ALLOCATOR_ACL:
    default:
        return aclrtFree(p);
    }
}

/* `steps` steps of the group pattern from position *next in the sequence. */
static int run_steps(int steps, size_t *next) {
    void *blocks[MAX_GROUP];
    size_t block_sizes[MAX_GROUP];
    for (int s = 0; s < steps; s++) {
        for (int g = 0; g < opts.group; g++) {
            block_sizes[g] = seq.values[*next];
            int err = alloc_block(&blocks[g], block_sizes[g]);
            if (err) return fprintf(stderr, "hotpath: malloc of %zu B failed: %d\n", block_sizes[g], err), err;
            *next = (*next + 1) % seq.count;
        }
        for (int g = 0; g < opts.group; g++) {
            int err = free_block(blocks[g], block_sizes[g]);
            if (err) return fprintf(stderr, "hotpath: free failed: %d\n", err), err;
        }
    }
    return 0;
}

static void *work(void *arg) {
    worker *w = arg;
    size_t next = seq.count * (size_t)w->index / (size_t)opts.threads;
    if (opts.allocator == ALLOCATOR_ACL || opts.allocator == ALLOCATOR_STREAM) {
        aclError err = aclrtSetDevice(0);
        if (err) fprintf(stderr, "hotpath: aclrtSetDevice: %d\n", err), w->failed = 1;
    }
    if (opts.allocator == ALLOCATOR_STREAM && !w->failed) {
        aclError err = aclrtCreateStream(&thread_stream);
        if (err) fprintf(stderr, "hotpath: aclrtCreateStream: %d\n", err), w->failed = 1;
    }
    /* One untimed pass over the whole sequence fills the cache. */
    if (!w->failed && run_steps((int)(seq.count / (size_t)opts.group), &next)) w->failed = 1;
    pthread_barrier_wait(&warmed_up);
    pthread_barrier_wait(&counted); /* main has read the counters the timed part is measured against */
    struct rusage usage;
    getrusage(RUSAGE_THREAD, &usage);
    long sleeps_start = usage.ru_nvcsw;
    double wall_start = clock_s(CLOCK_MONOTONIC), cpu_start = clock_s(CLOCK_THREAD_CPUTIME_ID);
    for (int b = 0; b < opts.batches && !w->failed; b++) {
        double start = clock_s(CLOCK_MONOTONIC);
        if (run_steps(opts.pairs / opts.group, &next)) w->failed = 1;
        w->per_pair_ns[b] = (clock_s(CLOCK_MONOTONIC) - start) * 1e9 / opts.pairs;
    }
    w->wall_s = clock_s(CLOCK_MONOTONIC) - wall_start;
    w->cpu_s = clock_s(CLOCK_THREAD_CPUTIME_ID) - cpu_start;
    getrusage(RUSAGE_THREAD, &usage);
    w->sleeps = usage.ru_nvcsw - sleeps_start;
    pthread_barrier_wait(&timing_done);
    return NULL;
}

static int compare_double(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double percentile(double *sorted, size_t n, double q) { return sorted[(size_t)(q * (double)(n - 1) + 0.5)]; }

static int load_sizes(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return fprintf(stderr, "hotpath: %s: %s\n", path, strerror(errno)), -1;
    char *line = NULL;
    size_t line_cap = 0, cap = 0;
    while (getline(&line, &line_cap, f) > 0) {
        if (line[0] == '#' || line[0] == '\n') continue;
        if (seq.count == cap) {
            cap = cap ? 2 * cap : 1024;
            size_t *grown = realloc(seq.values, cap * sizeof *seq.values);
            if (!grown) return free(line), fclose(f), fprintf(stderr, "hotpath: out of memory\n"), -1;
            seq.values = grown;
        }
        seq.values[seq.count] = strtoull(line, NULL, 10);
        if (seq.values[seq.count] == 0)
            return fprintf(stderr, "hotpath: %s: bad size %s", path, line), free(line), fclose(f), -1;
        if (!opts.max_size || seq.values[seq.count] <= opts.max_size) seq.count++;
    }
    free(line);
    fclose(f);
    if (seq.count < (size_t)opts.group)
        return fprintf(stderr, "hotpath: %s: too few sizes (up to --max-size)\n", path), -1;
    return 0;
}

static int usage(void) {
    fprintf(stderr, "usage: npualloc-bench-hotpath [--allocator acl|stream|core|glibc] [--host-writes] "
                    "[--shared-counter] [--threads N] [--batches B] [--pairs P] [--group G] [--fence-after M] "
                    "[--max-size BYTES] SIZES_FILE\n");
    return 2;
}

static int parse_options(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        const char *value = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--allocator") && value) {
            if (!strcmp(value, "acl")) opts.allocator = ALLOCATOR_ACL;
            else if (!strcmp(value, "stream")) opts.allocator = ALLOCATOR_STREAM;
            else if (!strcmp(value, "core")) opts.allocator = ALLOCATOR_CORE;
            else if (!strcmp(value, "glibc")) opts.allocator = ALLOCATOR_GLIBC;
            else return -1;
        } else if (!strcmp(argv[i], "--host-writes")) {
            opts.host_writes = 1;
            continue;
        } else if (!strcmp(argv[i], "--shared-counter")) {
            opts.shared_counter = 1;
            continue;
        } else if (!strcmp(argv[i], "--threads") && value) {
            opts.threads = atoi(value);
        } else if (!strcmp(argv[i], "--batches") && value) {
            opts.batches = atoi(value);
        } else if (!strcmp(argv[i], "--pairs") && value) {
            opts.pairs = atoi(value);
        } else if (!strcmp(argv[i], "--group") && value) {
            opts.group = atoi(value);
        } else if (!strcmp(argv[i], "--fence-after") && value) {
            opts.fence_after = atoi(value);
        } else if (!strcmp(argv[i], "--max-size") && value) {
            char *end;
            opts.max_size = strtoull(value, &end, 10);
            if (*end || !opts.max_size || value[0] == '-') return -1;
        } else if (argv[i][0] != '-' && !opts.sizes_path) {
            opts.sizes_path = argv[i];
            continue;
        } else {
            return -1;
        }
        i++;
    }
    if (opts.group >= 1 && (opts.pairs < opts.group || opts.pairs % opts.group)) {
        fprintf(stderr, "hotpath: --pairs (%d) must be a multiple of --group (%d)\n", opts.pairs, opts.group);
        return -1;
    }
    if (!opts.sizes_path || opts.threads < 1 || opts.threads > MAX_THREADS || opts.batches < 1 ||
        opts.group < 1 || opts.group > MAX_GROUP ||
        (opts.fence_after >= 0 && opts.allocator != ALLOCATOR_CORE) ||
        (opts.shared_counter && opts.allocator != ALLOCATOR_GLIBC))
        return -1;
    return 0;
}

/* Runtime calls as the simulator counts them (npualloc's own calls to the
 * runtime included, the program's calls into npualloc not): those a steady
 * loop of cache hits should not need. */
enum { CALL_MALLOC, CALL_FREE, CALL_RECORD, CALL_QUERY, CALL_SYNC, CALL_SEGMENT_MALLOC };
static const char *const COUNTED[] = {
    [CALL_MALLOC] = "aclrtMalloc", [CALL_FREE] = "aclrtFree", [CALL_RECORD] = "aclrtRecordEvent",
    [CALL_QUERY] = "aclrtQueryEventStatus", [CALL_SYNC] = "aclrtSynchronizeDevice",
    [CALL_SEGMENT_MALLOC] = "aclrtMallocAlign32", /* how npualloc asks for a segment */
};
#define N_COUNTED (sizeof COUNTED / sizeof COUNTED[0])

static void runtime_calls(uint64_t out[N_COUNTED]) {
    for (size_t i = 0; i < N_COUNTED; i++)
        out[i] = opts.allocator == ALLOCATOR_ACL || opts.allocator == ALLOCATOR_STREAM ? aclsim_call_count(COUNTED[i])
                                                                                          : 0;
    if (opts.allocator == ALLOCATOR_CORE) { /* the core's fences stand for events */
        out[CALL_RECORD] = fence_records;
        out[CALL_QUERY] = fence_queries;
    }
}

/* npualloc's cache counters: the linked core's, or the preloaded library's
 * (looked up, not linked). */
static int npualloc_stats(npualloc_device_stats *out) {
    if (opts.allocator == ALLOCATOR_CORE) return npa_get_stats(core, 0, out), 1;
    int (*get_stats)(int, npualloc_device_stats *) = (int (*)(int, npualloc_device_stats *))dlsym(
        RTLD_DEFAULT, "npualloc_get_stats");
    return get_stats && get_stats(0, out) == 0;
}

int main(int argc, char **argv) {
    if (parse_options(argc, argv)) return usage();
    if (load_sizes(opts.sizes_path)) return 2;
    if (opts.allocator == ALLOCATOR_STREAM) {
        malloc_stream = (int (*)(void **, size_t, void *, int))dlsym(RTLD_DEFAULT, "npualloc_malloc_stream");
        free_stream = (int (*)(void *, void *))dlsym(RTLD_DEFAULT, "npualloc_free_stream");
        if (!malloc_stream || !free_stream)
            return fprintf(stderr, "hotpath: --allocator stream needs libnpualloc.so preloaded\n"), 2;
    }
    if (opts.allocator == ALLOCATOR_ACL || opts.allocator == ALLOCATOR_STREAM) {
        aclError err = aclInit(NULL);
        if (err) return fprintf(stderr, "hotpath: aclInit: %d\n", err), 1;
    } else if (opts.allocator == ALLOCATOR_CORE) {
        npa_backend backend = {.raw_malloc = fake_malloc, .raw_free = fake_free, .synchronize = fake_sync,
                               .mem_get_info = fake_info};
        if (opts.fence_after >= 0) {
            backend.fence_record = fake_fence_record;
            backend.fence_done = fake_fence_done;
            backend.fence_release = fake_fence_release;
        }
        core = npa_create(&backend, NULL);
        if (!core) return fprintf(stderr, "hotpath: npa_create failed\n"), 1;
    }
    worker workers[MAX_THREADS] = {0};
    pthread_barrier_init(&warmed_up, NULL, (unsigned)opts.threads + 1);
    pthread_barrier_init(&counted, NULL, (unsigned)opts.threads + 1);
    pthread_barrier_init(&timing_done, NULL, (unsigned)opts.threads + 1);
    for (int t = 0; t < opts.threads; t++) {
        workers[t].index = t;
        workers[t].per_pair_ns = calloc((size_t)opts.batches, sizeof(double));
        if (!workers[t].per_pair_ns) return fprintf(stderr, "hotpath: out of memory\n"), 1;
        pthread_create(&workers[t].thread, NULL, work, &workers[t]);
    }
    pthread_barrier_wait(&warmed_up);
    npualloc_device_stats before = {0}, after = {0};
    int have_stats = npualloc_stats(&before);
    uint64_t calls_before[N_COUNTED], calls_after[N_COUNTED];
    runtime_calls(calls_before);
    pthread_barrier_wait(&counted);
    pthread_barrier_wait(&timing_done);
    runtime_calls(calls_after);
    have_stats = have_stats && npualloc_stats(&after);
    for (int t = 0; t < opts.threads; t++) pthread_join(workers[t].thread, NULL);

    size_t samples = (size_t)opts.threads * (size_t)opts.batches;
    double *all = malloc(samples * sizeof *all);
    if (!all) return fprintf(stderr, "hotpath: out of memory\n"), 1;
    int failed = 0;
    cpu_set_t allowed;
    int cpus_allowed = sched_getaffinity(0, sizeof allowed, &allowed) == 0 ? CPU_COUNT(&allowed) : -1;
    printf("{\"allocator\": \"%s\", \"threads\": %d, \"batches\": %d, \"pairs_per_batch\": %d, \"group\": %d, "
           "\"sizes\": %zu, \"max_size\": %zu, \"npualloc_loaded\": %s, \"cpus_allowed\": %d, \"per_thread\": [",
           opts.allocator == ALLOCATOR_ACL      ? "acl"
           : opts.allocator == ALLOCATOR_STREAM ? "stream"
           : opts.allocator == ALLOCATOR_CORE   ? "core"
                                                : "glibc",
           opts.threads, opts.batches, opts.pairs, opts.group,
           seq.count, opts.max_size, dlsym(RTLD_DEFAULT, "npualloc_is_active") ? "true" : "false", cpus_allowed);
    for (int t = 0; t < opts.threads; t++) {
        worker *w = &workers[t];
        failed |= w->failed;
        memcpy(all + (size_t)t * (size_t)opts.batches, w->per_pair_ns, (size_t)opts.batches * sizeof(double));
        qsort(w->per_pair_ns, (size_t)opts.batches, sizeof(double), compare_double);
        double pairs = (double)opts.batches * opts.pairs;
        printf("%s{\"median_ns\": %.2f, \"p90_ns\": %.2f, \"wall_s\": %.6f, \"cpu_s\": %.6f, "
               "\"pairs_per_s\": %.1f, \"sleeps\": %ld}", t ? ", " : "", percentile(w->per_pair_ns, (size_t)opts.batches, 0.5),
               percentile(w->per_pair_ns, (size_t)opts.batches, 0.9), w->wall_s, w->cpu_s, pairs / w->wall_s, w->sleeps);
    }
    qsort(all, samples, sizeof *all, compare_double);
    printf("], \"median_ns\": %.2f, \"p10_ns\": %.2f, \"p90_ns\": %.2f, \"raw_mallocs_while_timed\": %llu",
           percentile(all, samples, 0.5), percentile(all, samples, 0.1), percentile(all, samples, 0.9),
           (unsigned long long)(calls_after[CALL_MALLOC] + calls_after[CALL_SEGMENT_MALLOC] - calls_before[CALL_MALLOC]
                                - calls_before[CALL_SEGMENT_MALLOC]));
    printf(", \"runtime_calls_while_timed\": {");
    for (size_t i = 0; i < N_COUNTED; i++)
        printf("%s\"%s\": %llu", i ? ", " : "", COUNTED[i], (unsigned long long)(calls_after[i] - calls_before[i]));
    printf("}");
    if (have_stats)
        printf(", \"cache_hits_while_timed\": %lld, \"cache_misses_while_timed\": %lld",
               (long long)(after.num_cache_hits - before.num_cache_hits),
               (long long)(after.num_cache_misses - before.num_cache_misses));
    if (opts.shared_counter)
        printf(", \"shared_counter\": {\"current\": %lld, \"peak\": %lld}", (long long)shared_bytes.current,
               (long long)shared_bytes.peak);
    printf(", \"failed\": %s}\n", failed ? "true" : "false");
    return failed;
}
