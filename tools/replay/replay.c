/* npualloc-replay: drives a recorded allocation trace through aclrtMalloc /
 * aclrtFree, one call per event, and prints one JSON object of what it
 * measured on stdout (nothing else ever goes to stdout).
 *
 *     npualloc-replay [--device N] EVENT_FILE
 *
 * The runtime is loaded the way Python programs on Ascend load it: dlopen of
 * libascendcl.so (found on LD_LIBRARY_PATH: the simulator's lib64 or real
 * CANN's), then the ACL functions are resolved through the dynamic linker's
 * global scope. With libnpualloc.so in LD_PRELOAD that scope finds npualloc's
 * aclrtMalloc/aclrtFree first; without it, the runtime's own. Nothing is
 * linked at build time, so the tool builds anywhere. npualloc's stats and
 * the simulator's call counters are looked up the same way and reported as
 * null where absent.
 *
 * Exit status: 0 when the trace ran to its end or stopped at an OOM (both are
 * results), 1 on any other ACL error (the JSON says which), 2 on bad usage or
 * an unreadable event file. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "acl/acl.h"
#include "npualloc.h"
#include "replay_format.h"

#define ACL_OOM 207001
#define RUNTIME_LIBRARY "libascendcl.so"

typedef aclError (*acl_init_fn)(const char *config_path);
typedef aclError (*acl_finalize_fn)(void);
typedef aclError (*set_device_fn)(int32_t device);
typedef aclError (*malloc_fn)(void **ptr, size_t size, aclrtMemMallocPolicy policy);
typedef aclError (*free_fn)(void *ptr);
typedef int (*get_stats_fn)(int device, npualloc_device_stats *out);
typedef int (*is_active_fn)(void);
typedef uint64_t (*call_count_fn)(const char *api);

/* The runtime entry points this tool calls, as the dynamic linker binds them. */
typedef struct acl_api {
    acl_init_fn init;
    acl_finalize_fn finalize;
    set_device_fn set_device;
    set_device_fn reset_device;
    malloc_fn malloc;
    free_fn free;
} acl_api;

typedef struct trace {
    replay_header header;
    replay_event *events;
    uint64_t marks;            /* REPLAY_ITERATION_END events in the file */
} trace;

typedef struct raw_counts {
    uint64_t mallocs;
    uint64_t frees;
} raw_counts;

/* Where raw device calls are counted: the simulator's own counters when it
 * has them; else npualloc's (num_device_alloc/free) while it is active; else
 * this tool's calls, every one of which is raw when nothing stands between it
 * and the runtime. */
typedef enum raw_source { RAW_FROM_ACLSIM, RAW_FROM_NPUALLOC, RAW_FROM_REPLAY } raw_source;
static const char *const raw_source_names[] = {"aclsim", "npualloc", "replay"};

typedef struct raw_probe {
    raw_source source;
    call_count_fn call_count;
    get_stats_fn get_stats;
    int device;
} raw_probe;

/* The simulator counts each API under its public name; npualloc may reach the
 * device through any of the malloc variants, or map physical memory. */
static const char *const raw_malloc_apis[] = {"aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached",
                                              "aclrtMallocPhysical"};
static const char *const raw_free_apis[] = {"aclrtFree", "aclrtFreeWithDevSync", "aclrtFreePhysical"};

static uint64_t sum_call_counts(call_count_fn call_count, const char *const *apis, size_t n)
{
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t count = call_count(apis[i]);
        if (count != UINT64_MAX)
            total += count;
    }
    return total;
}

/* replay_calls: this tool's own successful mallocs and frees so far. */
static raw_counts read_raw(const raw_probe *probe, raw_counts replay_calls)
{
    raw_counts counts = replay_calls;
    if (probe->source == RAW_FROM_ACLSIM) {
        counts.mallocs = sum_call_counts(probe->call_count, raw_malloc_apis,
                                         sizeof raw_malloc_apis / sizeof *raw_malloc_apis);
        counts.frees = sum_call_counts(probe->call_count, raw_free_apis, sizeof raw_free_apis / sizeof *raw_free_apis);
    } else if (probe->source == RAW_FROM_NPUALLOC) {
        npualloc_device_stats stats;
        probe->get_stats(probe->device, &stats);
        counts.mallocs = (uint64_t)stats.num_device_alloc;
        counts.frees = (uint64_t)stats.num_device_free;
    }
    return counts;
}

static int load_trace(const char *path, trace *out)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "npualloc-replay: %s: %s\n", path, strerror(errno));
        return -1;
    }
    int rc = -1;
    if (fread(&out->header, sizeof out->header, 1, f) != 1 ||
        memcmp(out->header.magic, REPLAY_MAGIC, sizeof out->header.magic) != 0) {
        fprintf(stderr, "npualloc-replay: %s: not a replay event file\n", path);
        goto done;
    }
    if (out->header.version != REPLAY_VERSION) {
        fprintf(stderr, "npualloc-replay: %s: event file version %u, this tool reads %u\n", path,
                out->header.version, REPLAY_VERSION);
        goto done;
    }
    uint64_t count = out->header.event_count;
    out->events = malloc(count ? count * sizeof *out->events : 1);
    if (!out->events || fread(out->events, sizeof *out->events, count, f) != count || fgetc(f) != EOF) {
        fprintf(stderr, "npualloc-replay: %s: truncated or oversized (header says %llu events)\n", path,
                (unsigned long long)count);
        goto done;
    }
    /* Checked here, once, so the timed loop can trust every event: slots in
     * range, allocated only when empty, freed only when live. */
    bool *live = calloc(out->header.slot_count ? out->header.slot_count : 1, sizeof *live);
    if (!live) {
        fprintf(stderr, "npualloc-replay: out of host memory\n");
        goto done;
    }
    out->marks = 0;
    for (uint64_t i = 0; i < count; i++) {
        const replay_event *e = &out->events[i];
        bool ok;
        if (e->op == REPLAY_ITERATION_END)
            ok = true, out->marks++;
        else if (e->op == REPLAY_ALLOC || e->op == REPLAY_FREE)
            ok = e->slot < out->header.slot_count && live[e->slot] == (e->op == REPLAY_FREE);
        else
            ok = false;
        if (!ok) {
            fprintf(stderr, "npualloc-replay: %s: event %llu is corrupt\n", path, (unsigned long long)i);
            goto done_live;
        }
        if (e->op != REPLAY_ITERATION_END)
            live[e->slot] = e->op == REPLAY_ALLOC;
    }
    rc = 0;
done_live:
    free(live);
done:
    fclose(f);
    return rc;
}

static int load_runtime(acl_api *api, void **handle)
{
    *handle = dlopen(RUNTIME_LIBRARY, RTLD_NOW | RTLD_GLOBAL);
    if (!*handle) {
        fprintf(stderr, "npualloc-replay: cannot load the runtime: %s\n", dlerror());
        return -1;
    }
    api->init = (acl_init_fn)dlsym(RTLD_DEFAULT, "aclInit");
    api->finalize = (acl_finalize_fn)dlsym(RTLD_DEFAULT, "aclFinalize");
    api->set_device = (set_device_fn)dlsym(RTLD_DEFAULT, "aclrtSetDevice");
    api->reset_device = (set_device_fn)dlsym(RTLD_DEFAULT, "aclrtResetDevice");
    api->malloc = (malloc_fn)dlsym(RTLD_DEFAULT, "aclrtMalloc");
    api->free = (free_fn)dlsym(RTLD_DEFAULT, "aclrtFree");
    if (!api->init || !api->finalize || !api->set_device || !api->reset_device || !api->malloc || !api->free) {
        fprintf(stderr, "npualloc-replay: %s lacks an ACL function this tool calls\n", RUNTIME_LIBRARY);
        return -1;
    }
    return 0;
}

static double seconds_between(const struct timespec *a, const struct timespec *b)
{
    return (double)(b->tv_sec - a->tv_sec) + (double)(b->tv_nsec - a->tv_nsec) * 1e-9;
}

static void print_u64_or_null(const char *key, bool known, uint64_t value)
{
    if (known)
        printf(", \"%s\": %llu", key, (unsigned long long)value);
    else
        printf(", \"%s\": null", key);
}

/* What one pass over the trace did. */
typedef struct replay_result {
    uint64_t executed;         /* events looked at, marks included */
    raw_counts calls;          /* successful aclrtMalloc/aclrtFree calls */
    uint64_t live_requested, peak_requested;
    uint64_t iterations;
    raw_counts *raw_at_mark;   /* raw calls counted at each iteration mark */
    aclError failure;          /* ACL_SUCCESS, or the error that stopped the pass */
    uint64_t failed_event, failed_size;
    double wall_seconds;
} replay_result;

/* The timed loop: one ACL call per event, nothing else that costs. */
static void run_trace(const trace *t, void **slots, const acl_api *acl, const raw_probe *probe, replay_result *r)
{
    struct timespec started, finished;
    clock_gettime(CLOCK_MONOTONIC, &started);
    uint64_t i = 0;
    for (; i < t->header.event_count; i++) {
        const replay_event *e = &t->events[i];
        aclError err = ACL_SUCCESS;
        if (e->op == REPLAY_ALLOC) {
            err = acl->malloc(&slots[e->slot], e->size, ACL_MEM_MALLOC_HUGE_FIRST);
            if (err == ACL_SUCCESS) {
                r->calls.mallocs++;
                r->live_requested += e->size;
                if (r->live_requested > r->peak_requested)
                    r->peak_requested = r->live_requested;
            } else {
                slots[e->slot] = NULL;
            }
        } else if (e->op == REPLAY_FREE) {
            err = acl->free(slots[e->slot]);
            if (err == ACL_SUCCESS) {
                slots[e->slot] = NULL;
                r->calls.frees++;
                r->live_requested -= e->size;
            }
        } else {
            r->raw_at_mark[r->iterations++] = read_raw(probe, r->calls);
        }
        if (err != ACL_SUCCESS) {
            r->failure = err, r->failed_event = i, r->failed_size = e->size;
            break;
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &finished);
    r->executed = i;
    r->wall_seconds = seconds_between(&started, &finished);
}

static void print_json(const trace *t, const replay_result *r, const raw_probe *probe, raw_counts raw_start,
                       raw_counts raw_end, bool npualloc_loaded, bool npualloc_active,
                       const npualloc_device_stats *stats)
{
    uint64_t calls = r->calls.mallocs + r->calls.frees;
    printf("{\"trace_events\": %llu, \"completed\": %s", (unsigned long long)t->header.event_count,
           r->executed == t->header.event_count ? "true" : "false");
    printf(", \"events\": %llu, \"allocs\": %llu, \"frees\": %llu, \"iterations\": %llu", (unsigned long long)calls,
           (unsigned long long)r->calls.mallocs, (unsigned long long)r->calls.frees,
           (unsigned long long)r->iterations);
    printf(", \"wall_seconds\": %.9f, \"events_per_second\": %.1f", r->wall_seconds,
           r->wall_seconds > 0 ? calls / r->wall_seconds : 0.0);
    printf(", \"peak_requested_bytes\": %llu", (unsigned long long)r->peak_requested);
    printf(", \"oom\": %s", r->failure == ACL_OOM ? "true" : "false");
    bool failed = r->failure != ACL_SUCCESS;
    print_u64_or_null("failed_event", failed, r->failed_event);
    print_u64_or_null("failed_size", failed, r->failed_size);
    if (failed)
        printf(", \"acl_error\": %d", r->failure);
    else
        printf(", \"acl_error\": null");

    printf(", \"npualloc_loaded\": %s, \"npualloc_active\": %s", npualloc_loaded ? "true" : "false",
           npualloc_active ? "true" : "false");
    const npualloc_stat *reserved = &stats->reserved_bytes[NPUALLOC_POOL_ALL];
    const npualloc_stat *allocated = &stats->allocated_bytes[NPUALLOC_POOL_ALL];
    print_u64_or_null("peak_allocated_bytes", npualloc_active, (uint64_t)allocated->peak);
    print_u64_or_null("peak_reserved_bytes", npualloc_active, (uint64_t)reserved->peak);
    print_u64_or_null("allocated_bytes", npualloc_active, (uint64_t)allocated->current);
    print_u64_or_null("reserved_bytes", npualloc_active, (uint64_t)reserved->current);
    /* npualloc_shm.h's definition, on the cache as the trace left it. */
    int64_t cached_free = reserved->current - allocated->current;
    if (npualloc_active)
        printf(", \"fragmentation\": %.6f",
               cached_free > 0 ? 1.0 - (double)stats->largest_free_block / (double)cached_free : 0.0);
    else
        printf(", \"fragmentation\": null");
    print_u64_or_null("largest_free_block", npualloc_active, (uint64_t)stats->largest_free_block);
    print_u64_or_null("num_device_alloc", npualloc_active, (uint64_t)stats->num_device_alloc);
    print_u64_or_null("num_device_free", npualloc_active, (uint64_t)stats->num_device_free);
    print_u64_or_null("num_ooms", npualloc_active, (uint64_t)stats->num_ooms);
    print_u64_or_null("num_alloc_retries", npualloc_active, (uint64_t)stats->num_alloc_retries);

    printf(", \"raw_counts_from\": \"%s\"", raw_source_names[probe->source]);
    printf(", \"raw_mallocs\": %llu, \"raw_frees\": %llu", (unsigned long long)(raw_end.mallocs - raw_start.mallocs),
           (unsigned long long)(raw_end.frees - raw_start.frees));
    /* Iteration k's raw mallocs: from mark k-1 (or the start) to mark k; the
     * last entry is what followed the last mark, if anything did. */
    printf(", \"raw_mallocs_per_iteration\": [");
    uint64_t previous = raw_start.mallocs;
    for (uint64_t k = 0; k < r->iterations; k++) {
        printf("%s%llu", k ? ", " : "", (unsigned long long)(r->raw_at_mark[k].mallocs - previous));
        previous = r->raw_at_mark[k].mallocs;
    }
    printf("]");
    print_u64_or_null("raw_mallocs_after_first_iteration", r->iterations > 0,
                      r->iterations > 0 ? raw_end.mallocs - r->raw_at_mark[0].mallocs : 0);
    printf("}\n");
    fflush(stdout);
}

int main(int argc, char **argv)
{
    int device = 0;
    const char *path = NULL;
    bool usage_ok = true;
    for (int i = 1; i < argc && usage_ok; i++) {
        if (strcmp(argv[i], "--device") == 0 && i + 1 < argc)
            device = atoi(argv[++i]);
        else if (!path && argv[i][0] != '-')
            path = argv[i];
        else
            usage_ok = false;
    }
    if (!path || !usage_ok) {
        fprintf(stderr, "usage: npualloc-replay [--device N] EVENT_FILE\n");
        return 2;
    }
    trace t = {0};
    if (load_trace(path, &t) != 0)
        return 2;
    void **slots = calloc(t.header.slot_count ? t.header.slot_count : 1, sizeof *slots);
    replay_result r = {0};
    r.raw_at_mark = calloc(t.marks ? t.marks : 1, sizeof *r.raw_at_mark);
    if (!slots || !r.raw_at_mark) {
        fprintf(stderr, "npualloc-replay: out of host memory\n");
        return 2;
    }

    acl_api acl;
    void *runtime;
    if (load_runtime(&acl, &runtime) != 0)
        return 2;
    aclError err = acl.init(NULL);
    if (err == ACL_SUCCESS)
        err = acl.set_device(device);
    if (err != ACL_SUCCESS) {
        fprintf(stderr, "npualloc-replay: runtime start-up failed: aclError %d\n", err);
        return 1;
    }

    get_stats_fn get_stats = (get_stats_fn)dlsym(RTLD_DEFAULT, "npualloc_get_stats");
    is_active_fn is_active = (is_active_fn)dlsym(RTLD_DEFAULT, "npualloc_is_active");
    bool npualloc_active = get_stats && is_active && is_active();
    raw_probe probe = {RAW_FROM_REPLAY, NULL, get_stats, device};
    /* The simulator's counters live in a dependency of the runtime library. */
    probe.call_count = (call_count_fn)dlsym(runtime, "aclsim_call_count");
    if (probe.call_count)
        probe.source = RAW_FROM_ACLSIM;
    else if (npualloc_active)
        probe.source = RAW_FROM_NPUALLOC;
    raw_counts raw_start = read_raw(&probe, r.calls);

    run_trace(&t, slots, &acl, &probe, &r);

    raw_counts raw_end = read_raw(&probe, r.calls);
    npualloc_device_stats stats;
    memset(&stats, 0, sizeof stats);
    if (npualloc_active)
        get_stats(device, &stats);
    print_json(&t, &r, &probe, raw_start, raw_end, get_stats != NULL, npualloc_active, &stats);

    /* Hand back what the trace left live, outside the timed loop, so the
     * runtime tears down cleanly. */
    for (uint32_t s = 0; s < t.header.slot_count; s++)
        if (slots[s])
            acl.free(slots[s]);
    acl.reset_device(device);
    acl.finalize();
    free(slots);
    free(r.raw_at_mark);
    free(t.events);
    return r.failure == ACL_SUCCESS || r.failure == ACL_OOM ? 0 : 1;
}
