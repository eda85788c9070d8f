/* aclrtMemcpy/aclrtMemset (run at once on the caller, no implicit sync, as
 * documented) and their Async forms (queued on a stream). The effect itself is
 * shared with the stream worker: checked, then performed under the lock so a
 * concurrent free cannot interleave with the check. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int sim_do_copy(const struct sim_copy *c)
{
    pthread_mutex_lock(&sim_lock);
    int ok = 1;
    if (!(c->src_dev ? sim_check_range(c->src, c->n, c->api) : sim_check_host_range(c->src, c->n, c->api)))
        ok = 0;
    if (!(c->dst_dev ? sim_check_range(c->dst, c->n, c->api) : sim_check_host_range(c->dst, c->n, c->api)))
        ok = 0;
    if (ok)
        memmove(c->dst, c->src, c->n);
    pthread_mutex_unlock(&sim_lock);
    return ok;
}

int sim_do_fill(const struct sim_fill *f)
{
    pthread_mutex_lock(&sim_lock);
    int ok = sim_check_range(f->dst, f->n, f->api);
    if (ok)
        memset(f->dst, f->value, f->n);
    pthread_mutex_unlock(&sim_lock);
    return ok;
}

/* Which side of a copy is device memory. ACL_MEMCPY_DEFAULT lets the runtime
 * decide from the addresses, as the real one does. */
static aclError plan_copy(struct sim_copy *c, aclrtMemcpyKind kind)
{
    switch (kind) {
    case ACL_MEMCPY_HOST_TO_HOST: c->src_dev = 0, c->dst_dev = 0; break;
    case ACL_MEMCPY_HOST_TO_DEVICE: c->src_dev = 0, c->dst_dev = 1; break;
    case ACL_MEMCPY_DEVICE_TO_HOST: c->src_dev = 1, c->dst_dev = 0; break;
    case ACL_MEMCPY_DEVICE_TO_DEVICE: c->src_dev = 1, c->dst_dev = 1; break;
    case ACL_MEMCPY_DEFAULT:
        pthread_mutex_lock(&sim_lock);
        c->src_dev = sim_is_device_address(c->src);
        c->dst_dev = sim_is_device_address(c->dst);
        pthread_mutex_unlock(&sim_lock);
        break;
    default: return ACL_ERROR_INVALID_PARAM;
    }
    return ACL_SUCCESS;
}

static aclError prepare_copy(struct sim_copy *c, void *dst, size_t destMax, const void *src, size_t count,
                             aclrtMemcpyKind kind, const char *api)
{
    if (dst == NULL || src == NULL || count > destMax)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    *c = (struct sim_copy){.dst = dst, .src = src, .n = count, .api = api};
    return plan_copy(c, kind);
}

SIM_EXPORT aclError simrt_Memcpy(void *dst, size_t destMax, const void *src, size_t count, aclrtMemcpyKind kind)
{
    sim_count(SIM_API_aclrtMemcpy);
    struct sim_copy c;
    aclError ret = prepare_copy(&c, dst, destMax, src, count, kind, "aclrtMemcpy");
    if (ret != ACL_SUCCESS)
        return ret;
    return sim_do_copy(&c) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}

/* Queues a prepared task on its stream, or frees it when preparing it (ret)
 * or resolving the stream failed. Resolved and submitted under one hold of
 * the lock: a destroy in between would free the stream. */
static aclError submit_task(struct sim_task *t, enum sim_task_kind kind, aclrtStream stream, aclError ret)
{
    pthread_mutex_lock(&sim_lock);
    struct sim_stream *s;
    if (ret == ACL_SUCCESS)
        ret = sim_stream_resolve(stream, &s);
    if (ret == ACL_SUCCESS) {
        t->kind = kind;
        sim_stream_submit(s, t);
    }
    pthread_mutex_unlock(&sim_lock);
    if (ret != ACL_SUCCESS)
        free(t);
    return ret;
}

SIM_EXPORT aclError simrt_MemcpyAsync(void *dst, size_t destMax, const void *src, size_t count,
                                      aclrtMemcpyKind kind, aclrtStream stream)
{
    sim_count(SIM_API_aclrtMemcpyAsync);
    struct sim_task *t = calloc(1, sizeof *t);
    if (t == NULL)
        return ACL_ERROR_BAD_ALLOC;
    aclError ret = prepare_copy(&t->u.copy, dst, destMax, src, count, kind, "aclrtMemcpyAsync");
    return submit_task(t, TASK_COPY, stream, ret);
}

static aclError prepare_fill(struct sim_fill *f, void *devPtr, size_t maxCount, int32_t value, size_t count,
                             const char *api)
{
    if (devPtr == NULL || count > maxCount)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    *f = (struct sim_fill){.dst = devPtr, .value = value, .n = count, .api = api};
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_Memset(void *devPtr, size_t maxCount, int32_t value, size_t count)
{
    sim_count(SIM_API_aclrtMemset);
    struct sim_fill f;
    aclError ret = prepare_fill(&f, devPtr, maxCount, value, count, "aclrtMemset");
    if (ret != ACL_SUCCESS)
        return ret;
    return sim_do_fill(&f) ? ACL_SUCCESS : ACL_ERROR_RT_PARAM_INVALID;
}

SIM_EXPORT aclError simrt_MemsetAsync(void *devPtr, size_t maxCount, int32_t value, size_t count,
                                      aclrtStream stream)
{
    sim_count(SIM_API_aclrtMemsetAsync);
    struct sim_task *t = calloc(1, sizeof *t);
    if (t == NULL)
        return ACL_ERROR_BAD_ALLOC;
    aclError ret = prepare_fill(&t->u.fill, devPtr, maxCount, value, count, "aclrtMemsetAsync");
    return submit_task(t, TASK_FILL, stream, ret);
}
