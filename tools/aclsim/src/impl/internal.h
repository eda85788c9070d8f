/* State and helpers shared by the files of libaclsim.so. Nothing here is
 * exported (the library builds with -fvisibility=hidden). */
#ifndef ACLSIM_INTERNAL_H
#define ACLSIM_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "../simrt.h"
#include "aclsim.h"
#include "api_names.h"

#define SIM_EXPORT __attribute__((visibility("default")))

/* ---- configuration (config.c), read once from NPUSIM_* ---- */
struct sim_config {
    uint64_t hbm_bytes;     /* per-device capacity */
    int32_t device_count;
    uint64_t malloc_us;     /* latency of a raw allocation, on the caller */
    uint64_t free_us;       /* latency of a raw free, on the caller */
    uint64_t fail_nth;      /* the Nth raw allocation fails; 0 = never */
    double fail_prob;       /* each raw allocation fails with this probability */
    uint64_t fail_seed;
    uint64_t op_us;         /* default duration of a simulated aclnn op */
    size_t poison_bytes;    /* how much of a freed block gets poisoned */
    const char *shared_dir; /* NPUSIM_SHARED_DIR: capacity shared with other processes; NULL: private */
};
const struct sim_config *sim_config(void);

/* ---- the one lock: all runtime state is guarded by it; sim_progress is
 * broadcast whenever a stream finishes a task (syncs and event waits sleep on it). */
extern pthread_mutex_t sim_lock;
extern pthread_cond_t sim_progress;

/* ---- call counters (counters.c) ---- */
#define SIM_API_ENUM(name) SIM_API_##name,
enum sim_api { SIM_API_LIST(SIM_API_ENUM) SIM_API_COUNT };
void sim_count(enum sim_api api);
/* The API of a public name; -1 for a name the sim does not know. */
int sim_api_index(const char *name);

/* ---- violation counters and stderr reports (report.c) ---- */
void sim_report(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
_Noreturn void sim_fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
void sim_note_invalid_access(void);
void sim_note_workspace_clobber(void);
void sim_note_executor_violation(void);
void sim_reset_violations(void);

/* ---- latency model (latency.c) ---- */
/* A driver call's latency, busy-waited on the calling thread. */
void sim_spend_us(uint64_t us);
/* An op's duration, slept on its stream worker. */
void sim_sleep_us(uint64_t us);

/* ---- fault injection (fault.c): decides whether this raw allocation fails ---- */
int sim_inject_alloc_failure(void);
/* The error a test asked this call of api to fail with (aclsim_fail_release,
 * aclsim_fail_next_calls), or ACL_SUCCESS: the call goes on. The first takes
 * sim_lock, the second is called with it held. */
aclError sim_inject_call_failure(enum sim_api api);
aclError sim_inject_call_failure_locked(enum sim_api api);

/* ---- lifecycle (lifecycle.c) ---- */
aclError sim_require_init(void);       /* ACL_ERROR_UNINITIALIZE unless between aclInit and aclFinalize */
aclError sim_require_init_locked(void); /* the same, lock held */

/* ---- address arena of one device (arena.c): device pointers are host
 * addresses inside a reserved range, so they can be touched by the sim, and
 * freed ranges stay mapped so a late touch is detectable instead of a crash. */
struct sim_segment {
    uint64_t off, len;       /* byte range inside the arena */
    uint64_t requested;      /* what the caller asked for (live only) */
    uint64_t accounted;      /* what the capacity accounting charged (live only) */
    int live;
};
struct sim_arena {
    char *base;
    uint64_t size;
    uint64_t mapped_rw;      /* prefix length already made read-write */
    struct sim_segment *segs; /* sorted by off, covering [0, size) without gaps */
    size_t nsegs, cap;
};
int sim_arena_reserve(struct sim_arena *a, uint64_t size);
void *sim_arena_alloc(struct sim_arena *a, uint64_t len, uint64_t align, uint64_t requested, uint64_t accounted);
/* Index of the segment holding p, or -1 when p lies outside the arena. */
long sim_arena_find(const struct sim_arena *a, const void *p);
/* Frees the live segment at idx (poisons its head, gives its pages back). */
void sim_arena_release(struct sim_arena *a, long idx);

/* ---- capacity (capacity.c), lock held: a device's HBM, shared with the
 * other processes of NPUSIM_SHARED_DIR. charge: 1 when bytes fit (and are
 * added to the device's used_bytes), 0 when the device is full. used: the
 * bytes in use by every live process, this one included. */
int sim_capacity_charge(int32_t id, uint64_t bytes);
void sim_capacity_release(int32_t id, uint64_t bytes);
uint64_t sim_capacity_used(int32_t id);

/* ---- devices (device.c) ---- */
struct sim_stream;
struct sim_context;
struct sim_device {
    int32_t refcount;               /* aclrtSetDevice minus aclrtResetDevice */
    uint64_t generation;            /* bumped when refcount drops to 0: threads' stale contexts die */
    struct sim_stream *default_stream;
    struct sim_stream *streams;     /* every stream of the device, default one included */
    struct sim_stream *dying;       /* streams being destroyed, their work not yet done: no longer
                                     * any caller's, still the device's for a synchronize */
    struct sim_arena arena;
    uint64_t used_bytes;            /* capacity charged: allocations + physical handles */
    uint64_t alloc_bytes;           /* accounted bytes of live aclrtMalloc-family blocks */
    uint64_t live_allocs;
    uint64_t physical_bytes;
};
struct sim_device *sim_device(int32_t id);      /* NULL when out of range */
/* The calling thread's device (takes the lock: call without it): 107002 when
 * the thread has none, its device was reset, or another thread destroyed
 * its context (which this call detaches: the next runs in the device's
 * default one), 100001 before aclInit. */
aclError sim_current_device(int32_t *id);
aclError sim_current_device_locked(int32_t *id); /* the same, lock held */
/* The prologue of a call that needs an argument and a device: count it,
 * refuse a NULL argument (100000), then find the calling thread's device. */
static inline aclError sim_enter(enum sim_api api, const void *required, int32_t *id)
{
    sim_count(api);
    if (required == NULL)
        return ACL_ERROR_INVALID_PARAM;
    return sim_current_device(id);
}
void sim_reset_all_devices(void);               /* aclFinalize: lock held */
void sim_forget_current_device(void);
/* The context aclrtCreateContext or aclrtSetCurrentContext made current on
 * the calling thread; NULL: its device's default one. Live only when asked
 * under the hold of the lock in which sim_current_device_locked succeeded. */
const struct sim_context *sim_current_context(void);

/* ---- device memory validity (memcheck.c), lock held ---- */
int sim_is_device_address(const void *p);
/* 1 when [p, p+n) may be touched; counts and reports an invalid access when it
 * is not inside one live allocation or mapped VMM range, and returns 0 only
 * when touching it would fault (so the caller skips the effect). */
int sim_check_range(const void *p, size_t n, const char *what);
/* The same for a side of a copy its kind calls host memory: 0 (counted and
 * reported) when any of it is device memory, which the copy skips. */
int sim_check_host_range(const void *p, size_t n, const char *what);

/* ---- virtual memory (vmm.c), lock held ---- */
/* 1: p..p+n inside a reservation and fully mapped; 0: inside a reservation
 * but not fully mapped; -1: not inside any reservation. */
int sim_vmm_classify(const void *p, size_t n);

/* ---- memory effects (memops.c) ---- */
struct sim_copy { void *dst; const void *src; size_t n; int dst_dev, src_dev; const char *api; };
struct sim_fill { void *dst; int value; size_t n; const char *api; };
/* Both run checked and under the lock; return 0 when an invalid range was skipped. */
int sim_do_copy(const struct sim_copy *c);
int sim_do_fill(const struct sim_fill *f);

/* ---- streams (stream.c) ---- */
struct sim_event;
struct sim_executor;
enum sim_task_kind { TASK_COPY, TASK_FILL, TASK_OP, TASK_EVENT_RECORD, TASK_EVENT_WAIT };
struct sim_task {
    struct sim_task *next;
    enum sim_task_kind kind;
    union {
        struct sim_copy copy;
        struct sim_fill fill;
        struct { struct sim_executor *exec; void *ws; uint64_t ws_size; } op;
        struct { struct sim_event *ev; uint64_t seq; } event;
    } u;
};
struct sim_stream {
    int32_t device;
    uint64_t generation;     /* its device's when made: a reset ends every stream of an earlier one */
    const struct sim_context *context; /* made in it, which ends it when destroyed; NULL: the default one */
    struct sim_task *head, *tail;
    uint64_t submitted, completed;
    int stopping;
    int syncing;             /* threads in aclrtSynchronizeStream on it: it is freed once they left */
    pthread_t worker;
    pthread_cond_t work;
    struct sim_stream *next_on_device;
};
/* Lock held. The stream a handle names for the calling thread (NULL: its
 * device's default stream), or 107000 for one destroyed or unknown. It is
 * the caller's only while it holds the lock: once released, a destroy or a
 * device reset in another thread may free it (unless it counts as syncing). */
aclError sim_stream_resolve(aclrtStream handle, struct sim_stream **out);
struct sim_stream *sim_stream_create(int32_t device, const struct sim_context *context); /* lock held */
void sim_stream_submit(struct sim_stream *s, struct sim_task *t); /* lock held; takes t */
void sim_stream_wait_idle(struct sim_stream *s);          /* lock held */
/* Drains, stops and frees a stream. Lock held; released while joining. */
void sim_stream_destroy(struct sim_stream *s);
void sim_device_wait_idle(struct sim_device *d);          /* lock held */
/* Lock held, released meanwhile: destroys the device's streams of its
 * earlier generations (a reset's, after bumping the generation). */
void sim_device_destroy_old_streams(struct sim_device *d);
/* The same for the streams made in context c (its aclrtDestroyContext's). */
void sim_context_destroy_streams(struct sim_device *d, const struct sim_context *c);
/* In a forked child, lock held: the parent's streams are gone (fork.c). */
void sim_streams_forget_after_fork(void);
/* Counts api, then waits for every stream of the calling thread's device. */
aclError sim_synchronize_current_device(enum sim_api api);

/* ---- events (event.c), lock held ---- */
void sim_event_task_done(struct sim_event *ev, uint64_t seq);
void sim_event_task_wait(struct sim_event *ev, uint64_t seq);
void sim_event_task_discard(struct sim_event *ev); /* a record or wait dropped unrun */
void sim_events_forget_after_fork(void);           /* the parent's events are not the child's (fork.c) */

/* ---- executors (executor.c) ---- */
void sim_executor_run(struct sim_executor *e, void *ws, uint64_t ws_size); /* on a worker, lock not held */
void sim_executor_task_done(struct sim_executor *e);                     /* lock held */

#endif
