/* A fake device for the core's unit tests: a capacity, optional real host
 * memory behind each segment (for pattern checks), failure injection, call
 * counters and controllable fences. Thread-safe (the core calls it under
 * per-device locks, so two devices may call at once). */
#ifndef NPUALLOC_TESTS_FAKE_BACKEND_H
#define NPUALLOC_TESTS_FAKE_BACKEND_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"

typedef struct fake_segment {
    void *ptr;
    size_t size;
    int device;
} fake_segment;

#define FAKE_STREAMS 8

typedef struct fake_backend {
    pthread_mutex_t lock;
    size_t capacity;           /* per device */
    size_t used[NPUALLOC_MAX_DEVICES];
    bool host_memory;          /* segments are real, writable host memory */
    unsigned long long next_addr; /* fake address space when !host_memory */
    int fail_next_mallocs;     /* the next N raw mallocs and page maps fail, */
    npa_error fail_malloc_error; /* with this error (0: 207001, out of memory) */
    int fail_next_syncs;       /* the next N synchronizes fail (nothing completes) */
    int fail_next_fences;      /* the next N fence records fail (no fence, no synchronize) */
    int fail_next_mem_infos;   /* the next N mem_get_info calls fail (the runtime cannot tell) */
    char last_warning[512];    /* the backend's warn: the latest message */
    long warnings;
    char last_oom_report[512];  /* the backend's report_oom: the latest report */
    long oom_reports;

    fake_segment *segments;
    size_t segment_count, segment_capacity;

    long raw_malloc_calls, raw_malloc_failures, raw_free_calls, sync_calls, bad_frees;

    /* Virtual memory (expandable segments), offered when vmm is set: a
     * reservation is PROT_NONE host address space (with host_memory) or a
     * fake range, a page is memory mapped at its address and charged to the
     * capacity. fail_next_mallocs and the capacity apply to page maps too. */
    bool vmm;
    int fail_after_unmaps;     /* after this many page unmaps succeed, */
    int fail_next_unmaps;      /* the next N fail with 207002 and leave the page mapped */
    long va_reserves, va_releases, page_maps, page_unmaps;
    fake_segment *pages;       /* live page_map calls; a handle is its address */
    size_t page_count, page_capacity;
    fake_segment reservations[2 * NPUALLOC_MAX_DEVICES];
    long copies;               /* copy_to_host / copy_to_device calls (offered with vmm and host_memory) */

    /* Fences: fence_record hands out epochs; a fence is done once
     * completed_epoch reaches it, or after auto_complete_polls queries. */
    bool fences;
    bool eager;                /* fence_record returns NULL (nothing queued); set with fake_set_eager */
    bool answers_fence_needed; /* offers fence_needed: the word needs_fence, read at free time */
    atomic_int needs_fence;    /* !eager */
    unsigned long long recorded_epoch, completed_epoch;
    int auto_complete_polls;   /* 0: only explicit completion */
    long fence_records, fence_releases;
    long fence_records_always; /* of them, asked for whatever the policy (fence_record_always) */
    long fence_queries;        /* fence_done calls, of both kinds */
    /* Per-stream fences (fence_record_streams), offered when stream_fences
     * is set: stream handles are 0 .. FAKE_STREAMS-1; each stream counts its
     * events recorded and completed, and a fence is done once every stream
     * it names has completed the event recorded for it. */
    bool stream_fences;
    unsigned long long stream_recorded[FAKE_STREAMS], stream_completed[FAKE_STREAMS];
    long stream_fence_records, stream_events;

    /* Where the core keeps each device's stats: default_stats unless a
     * test points elsewhere (or at NULL: the core's own copy). */
    npualloc_device_stats *stats[NPUALLOC_MAX_DEVICES];
    npualloc_device_stats default_stats[NPUALLOC_MAX_DEVICES];
    /* Where the core keeps each device's thread slots: NULL (the core's
     * own) unless a test points at slots it writes by hand. */
    npualloc_thread_stats *threads[NPUALLOC_MAX_DEVICES];
    /* Raw mallocs and frees, synchronizes and fence records made while the
     * device's stats (when stats[] gives them storage) were inside a
     * section, seq odd: the core must never hold one open across a backend
     * call, which may take seconds, while region readers give up. */
    long calls_in_stats_section;
} fake_backend;

void fake_init(fake_backend *f, size_t capacity, bool host_memory);
void fake_destroy(fake_backend *f);
npa_backend fake_iface(fake_backend *f);
/* The policy the fences follow: eager (no fence needed) or not. */
void fake_set_eager(fake_backend *f, bool eager);
/* Every fence recorded so far completes (the device went idle). */
void fake_complete_fences(fake_backend *f);
/* Every event recorded so far on one stream completes (its queue ran). */
void fake_complete_stream(fake_backend *f, uintptr_t stream);
long fake_live_fences(fake_backend *f);
size_t fake_used(fake_backend *f, int device);

#endif
