/* aclOpExecutor lifecycle (nnopbase semantics) and the execution of the
 * simulated ops on stream workers.
 *
 * Handles are addresses in a PROT_NONE reservation, one slot per executor
 * ever created and never reused, so "was this ever an executor, and is it
 * still alive" has an exact answer: a destroyed handle is never mistaken for
 * a newer executor that happens to sit at the same heap address. That is what
 * lets the sim turn the real double free (aclDestroyAclOpExecutor after phase
 * 2 already destroyed a plain executor) into a deterministic abort. */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "internal.h"

#define HANDLE_STRIDE 8ull
#define HANDLE_SPACE (1ull << 32)
#define BUCKETS 4096

struct sim_executor {
    uint64_t id;
    const simrt_op_kind *kind;
    unsigned char params[SIMRT_OP_PARAMS_MAX];
    uint64_t ws_required;
    uint64_t duration_us;
    int repeatable;
    int dead;
    int inflight;                 /* launches queued or running */
    struct sim_executor *hash_next;
};

enum handle_state { HANDLE_LIVE, HANDLE_DEAD, HANDLE_UNKNOWN };

static char *handle_base;
static uint64_t next_id = 1;
static struct sim_executor *buckets[BUCKETS];
static uint64_t live_count, destroyed_count;
static _Atomic int64_t duration_override = -1;

static aclOpExecutor *handle_of(uint64_t id) { return (aclOpExecutor *)(handle_base + id * HANDLE_STRIDE); }

/* Lock held. */
static enum handle_state lookup(const aclOpExecutor *handle, struct sim_executor **out)
{
    const char *h = (const char *)handle;
    if (handle_base == NULL || h < handle_base || h >= handle_base + HANDLE_SPACE)
        return HANDLE_UNKNOWN;
    uint64_t off = (uint64_t)(h - handle_base);
    uint64_t id = off / HANDLE_STRIDE;
    if (off % HANDLE_STRIDE != 0 || id == 0 || id >= next_id)
        return HANDLE_UNKNOWN;
    for (struct sim_executor *e = buckets[id % BUCKETS]; e != NULL; e = e->hash_next) {
        if (e->id == id) {
            *out = e;
            return HANDLE_LIVE;
        }
    }
    return HANDLE_DEAD;
}

/* Lock held. Aborts unless handle is a live executor, naming the misuse. */
static struct sim_executor *live_or_abort(const aclOpExecutor *handle, const char *api)
{
    struct sim_executor *e = NULL;
    switch (lookup(handle, &e)) {
    case HANDLE_LIVE: return e;
    case HANDLE_DEAD:
        if (strcmp(api, "aclDestroyAclOpExecutor") == 0)
            sim_fatal("double free of aclOpExecutor %p (already destroyed; phase 2 destroys a "
                      "non-repeatable executor itself)", (const void *)handle);
        sim_fatal("%s: use of destroyed aclOpExecutor %p", api, (const void *)handle);
    case HANDLE_UNKNOWN: break;
    }
    sim_fatal("%s: %p is not an aclOpExecutor", api, (const void *)handle);
}

/* Lock held. The handle dies now; the object lives on while launches use it. */
static void destroy(struct sim_executor *e)
{
    struct sim_executor **link = &buckets[e->id % BUCKETS];
    while (*link != e)
        link = &(*link)->hash_next;
    *link = e->hash_next;
    e->dead = 1;
    live_count--;
    destroyed_count++;
    if (e->inflight == 0)
        free(e);
}

void sim_executor_task_done(struct sim_executor *e)
{
    if (--e->inflight == 0 && e->dead)
        free(e);
}

SIM_EXPORT aclnnStatus simrt_CreateExecutor(const simrt_op_kind *kind, const void *params, size_t paramsSize,
                                            uint64_t workspaceBytes, aclOpExecutor **executor)
{
    if (paramsSize > SIMRT_OP_PARAMS_MAX)
        sim_fatal("op %s: %zu bytes of parameters exceed the executor's room", kind->name, paramsSize);
    struct sim_executor *e = calloc(1, sizeof *e);
    if (e == NULL)
        return ACLNN_ERR_INNER_NULLPTR;
    e->kind = kind;
    memcpy(e->params, params, paramsSize);
    e->ws_required = workspaceBytes;
    int64_t override = atomic_load(&duration_override);
    e->duration_us = override >= 0 ? (uint64_t)override : sim_config()->op_us;

    pthread_mutex_lock(&sim_lock);
    if (handle_base == NULL) {
        void *space = mmap(NULL, HANDLE_SPACE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (space == MAP_FAILED)
            sim_fatal("cannot reserve address space for aclOpExecutor handles");
        handle_base = space;
    }
    if (next_id >= HANDLE_SPACE / HANDLE_STRIDE)
        sim_fatal("out of aclOpExecutor handles");
    e->id = next_id++;
    e->hash_next = buckets[e->id % BUCKETS];
    buckets[e->id % BUCKETS] = e;
    live_count++;
    *executor = handle_of(e->id);
    pthread_mutex_unlock(&sim_lock);
    return ACLNN_SUCCESS;
}

SIM_EXPORT aclnnStatus simrt_LaunchExecutor(const char *api, void *workspace, uint64_t workspaceSize,
                                            aclOpExecutor *executor, aclrtStream stream)
{
    if (executor == NULL)
        return ACLNN_ERR_INNER_NULLPTR;
    pthread_mutex_lock(&sim_lock);
    uint64_t ws_required = live_or_abort(executor, api)->ws_required;
    pthread_mutex_unlock(&sim_lock);
    if (ws_required > 0 && (workspace == NULL || workspaceSize < ws_required))
        return ACLNN_ERR_PARAM_INVALID;
    struct sim_task *t = calloc(1, sizeof *t);
    if (t == NULL)
        return ACLNN_ERR_INNER_NULLPTR;

    /* The stream is resolved under the hold of the lock that queues the op:
     * a destroy in between would free it. */
    pthread_mutex_lock(&sim_lock);
    struct sim_stream *s;
    if (sim_stream_resolve(stream, &s) != ACL_SUCCESS) {
        pthread_mutex_unlock(&sim_lock);
        free(t);
        return ACLNN_ERR_RUNTIME_ERROR;
    }
    struct sim_executor *e = live_or_abort(executor, api);
    t->kind = TASK_OP;
    t->u.op.exec = e;
    t->u.op.ws = workspace;
    t->u.op.ws_size = workspaceSize;
    e->inflight++;
    sim_stream_submit(s, t);
    /* A plain executor is single-use: a successful phase 2 destroys it. */
    if (!e->repeatable)
        destroy(e);
    pthread_mutex_unlock(&sim_lock);
    return ACLNN_SUCCESS;
}

SIM_EXPORT aclnnStatus simrt_SetExecutorRepeatable(aclOpExecutor *executor)
{
    sim_count(SIM_API_aclSetAclOpExecutorRepeatable);
    if (executor == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    pthread_mutex_lock(&sim_lock);
    live_or_abort(executor, "aclSetAclOpExecutorRepeatable")->repeatable = 1;
    pthread_mutex_unlock(&sim_lock);
    return ACLNN_SUCCESS;
}

SIM_EXPORT aclnnStatus simrt_DestroyExecutor(aclOpExecutor *executor)
{
    sim_count(SIM_API_aclDestroyAclOpExecutor);
    if (executor == NULL)
        return ACLNN_ERR_PARAM_NULLPTR;
    pthread_mutex_lock(&sim_lock);
    struct sim_executor *e = live_or_abort(executor, "aclDestroyAclOpExecutor");
    aclnnStatus refused = sim_inject_call_failure_locked(SIM_API_aclDestroyAclOpExecutor);
    if (refused != ACLNN_SUCCESS) {
        pthread_mutex_unlock(&sim_lock);
        return refused;
    }
    if (e->inflight > 0) {
        sim_note_executor_violation();
        sim_report("aclDestroyAclOpExecutor(%p) while %d launch(es) of it are still queued",
                   (void *)executor, e->inflight);
    }
    destroy(e);
    pthread_mutex_unlock(&sim_lock);
    return ACLNN_SUCCESS;
}

/* The stamp an executor writes into its workspace: distinct per executor,
 * so another op (or anyone) reusing the buffer meanwhile changes it. */
static uint8_t stamp_byte(uint64_t id, size_t i) { return (uint8_t)((id * 0x9e3779b97f4a7c15ull) >> (8 * (i % 8))); }

/* Writes (write=1) or verifies (write=0) the stamp; returns 0 on a mismatch. */
static int workspace_stamp(const struct sim_executor *e, unsigned char *ws, size_t n, int write, const char *what)
{
    int intact = 1;
    pthread_mutex_lock(&sim_lock);
    if (sim_check_range(ws, n, what)) {
        for (size_t i = 0; i < n; i++) {
            if (write)
                ws[i] = stamp_byte(e->id, i);
            else if (ws[i] != stamp_byte(e->id, i))
                intact = 0;
        }
    }
    pthread_mutex_unlock(&sim_lock);
    return intact;
}

/* An op holds its buffers for its whole duration: it writes its workspace
 * when it starts, reads it back when it ends, and only then produces its
 * effect (reading inputs late, so inputs freed and reused meanwhile corrupt
 * the output as they would on the device). */
void sim_executor_run(struct sim_executor *e, void *ws, uint64_t ws_size)
{
    char what[96];
    snprintf(what, sizeof what, "%s workspace", e->kind->name);
    size_t n = e->ws_required < ws_size ? (size_t)e->ws_required : (size_t)ws_size;
    if (n > 0)
        workspace_stamp(e, ws, n, 1, what);
    sim_sleep_us(e->duration_us);
    if (n > 0 && !workspace_stamp(e, ws, n, 0, what)) {
        sim_note_workspace_clobber();
        sim_report("%s: workspace [%p, +%zu) changed while the op ran (freed and reused before it finished?)",
                   e->kind->name, ws, n);
    }
    e->kind->finish(e->params);
}

SIM_EXPORT aclnnStatus simrt_nnInit(const char *configPath)
{
    (void)configPath;
    sim_count(SIM_API_aclnnInit);
    return ACLNN_SUCCESS;
}

SIM_EXPORT aclnnStatus simrt_nnFinalize(void)
{
    sim_count(SIM_API_aclnnFinalize);
    return ACLNN_SUCCESS;
}

SIM_EXPORT void simrt_DeviceFill(void *dst, int value, size_t bytes, const char *what)
{
    sim_do_fill(&(struct sim_fill){.dst = dst, .value = value, .n = bytes, .api = what});
}

SIM_EXPORT void simrt_DeviceCopy(void *dst, const void *src, size_t bytes, const char *what)
{
    sim_do_copy(&(struct sim_copy){.dst = dst, .src = src, .n = bytes, .dst_dev = 1, .src_dev = 1, .api = what});
}

SIM_EXPORT int simrt_DeviceAccess(const simrt_range *ranges, size_t count, const char *what,
                                  void (*compute)(void *ctx), void *ctx)
{
    pthread_mutex_lock(&sim_lock);
    int ok = 1;
    for (size_t i = 0; i < count; i++)
        if (!sim_check_range(ranges[i].ptr, ranges[i].bytes, what))
            ok = 0;
    if (ok)
        compute(ctx);
    pthread_mutex_unlock(&sim_lock);
    return ok;
}

SIM_EXPORT uint64_t aclsim_executors_live(void)
{
    pthread_mutex_lock(&sim_lock);
    uint64_t n = live_count;
    pthread_mutex_unlock(&sim_lock);
    return n;
}

SIM_EXPORT uint64_t aclsim_executors_destroyed(void)
{
    pthread_mutex_lock(&sim_lock);
    uint64_t n = destroyed_count;
    pthread_mutex_unlock(&sim_lock);
    return n;
}

SIM_EXPORT void aclsim_set_op_duration_us(uint64_t us) { atomic_store(&duration_override, (int64_t)us); }

SIM_EXPORT uint64_t aclsim_op_duration_us(void)
{
    int64_t override = atomic_load(&duration_override);
    return override >= 0 ? (uint64_t)override : sim_config()->op_us;
}
