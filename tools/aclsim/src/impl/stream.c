/* Streams: each has a worker thread that runs its queued tasks in order, so
 * async work really overlaps with the host and really finishes later, which
 * is what makes freeing memory that queued work still uses observable. */
#include <stdlib.h>

#include "internal.h"

/* Lock held. Runs the task at the head of the queue; the lock is dropped
 * around work that takes time so other threads keep going. */
static void run_task(struct sim_task *t)
{
    switch (t->kind) {
    case TASK_COPY:
        pthread_mutex_unlock(&sim_lock);
        sim_do_copy(&t->u.copy);
        pthread_mutex_lock(&sim_lock);
        break;
    case TASK_FILL:
        pthread_mutex_unlock(&sim_lock);
        sim_do_fill(&t->u.fill);
        pthread_mutex_lock(&sim_lock);
        break;
    case TASK_OP:
        pthread_mutex_unlock(&sim_lock);
        sim_executor_run(t->u.op.exec, t->u.op.ws, t->u.op.ws_size);
        pthread_mutex_lock(&sim_lock);
        sim_executor_task_done(t->u.op.exec);
        break;
    case TASK_EVENT_RECORD:
        sim_event_task_done(t->u.event.ev, t->u.event.seq);
        break;
    case TASK_EVENT_WAIT:
        sim_event_task_wait(t->u.event.ev, t->u.event.seq);
        break;
    }
}

/* Lock held. A task dropped unrun by aclrtDestroyStreamForce: its copy, fill
 * or op never happens and its event record never completes; what it holds is
 * let go. */
static void discard_task(struct sim_task *t)
{
    switch (t->kind) {
    case TASK_COPY:
    case TASK_FILL:
        break;
    case TASK_OP:
        sim_executor_task_done(t->u.op.exec);
        break;
    case TASK_EVENT_RECORD:
    case TASK_EVENT_WAIT:
        sim_event_task_discard(t->u.event.ev);
        break;
    }
}

/* Lock held. Drops the tasks from t on, unrun; returns how many. */
static uint64_t drop_tasks(struct sim_task *t)
{
    uint64_t n = 0;
    while (t != NULL) {
        struct sim_task *next = t->next;
        discard_task(t);
        free(t);
        n++;
        t = next;
    }
    return n;
}

static void *worker_main(void *arg)
{
    struct sim_stream *s = arg;
    pthread_mutex_lock(&sim_lock);
    for (;;) {
        while (s->head == NULL && !s->stopping)
            pthread_cond_wait(&s->work, &sim_lock);
        struct sim_task *t = s->head;
        if (t == NULL)
            break;
        run_task(t);
        s->head = t->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->completed++;
        free(t);
        pthread_cond_broadcast(&sim_progress);
    }
    pthread_mutex_unlock(&sim_lock);
    return NULL;
}

struct sim_stream *sim_stream_create(int32_t device, const struct sim_context *context)
{
    struct sim_stream *s = calloc(1, sizeof *s);
    if (s == NULL)
        return NULL;
    struct sim_device *d = sim_device(device);
    s->device = device;
    s->generation = d->generation;
    s->context = context;
    pthread_cond_init(&s->work, NULL);
    if (pthread_create(&s->worker, NULL, worker_main, s) != 0) {
        pthread_cond_destroy(&s->work);
        free(s);
        return NULL;
    }
    s->next_on_device = d->streams;
    d->streams = s;
    return s;
}

void sim_stream_submit(struct sim_stream *s, struct sim_task *t)
{
    t->next = NULL;
    if (s->tail != NULL)
        s->tail->next = t;
    else
        s->head = t;
    s->tail = t;
    s->submitted++;
    pthread_cond_signal(&s->work);
}

void sim_stream_wait_idle(struct sim_stream *s)
{
    uint64_t target = s->submitted;
    while (s->completed < target)
        pthread_cond_wait(&sim_progress, &sim_lock);
}

void sim_device_wait_idle(struct sim_device *d)
{
again:
    for (int dying = 0; dying < 2; dying++)
        for (struct sim_stream *s = dying ? d->dying : d->streams; s != NULL; s = s->next_on_device) {
            if (s->completed < s->submitted) {
                pthread_cond_wait(&sim_progress, &sim_lock);
                goto again; /* the lists may have changed while waiting */
            }
        }
}

static void unlink_stream(struct sim_stream **list, struct sim_stream *s)
{
    for (struct sim_stream **link = list; *link != NULL; link = &(*link)->next_on_device) {
        if (*link == s) {
            *link = s->next_on_device;
            return;
        }
    }
}

void sim_stream_destroy(struct sim_stream *s)
{
    /* No caller's from now on (a second destroy is refused, a device reset
     * passes it by), but the device's until its work is done: a device
     * synchronize meanwhile, from another thread, waits for that work too,
     * as it waits for all the device's queued tasks on real hardware. */
    struct sim_device *d = sim_device(s->device);
    unlink_stream(&d->streams, s);
    s->next_on_device = d->dying;
    d->dying = s;
    sim_stream_wait_idle(s);
    unlink_stream(&d->dying, s);
    s->stopping = 1;
    pthread_cond_signal(&s->work);
    pthread_mutex_unlock(&sim_lock);
    pthread_join(s->worker, NULL);
    pthread_mutex_lock(&sim_lock);
    while (s->syncing > 0) /* drained: they return now, but still read it */
        pthread_cond_wait(&sim_progress, &sim_lock);
    pthread_cond_destroy(&s->work);
    free(s);
}

/* Whether s is a reset's to destroy (context NULL: it is of an earlier
 * generation of its device d) or the destroy's of context. */
static int ended_by(const struct sim_stream *s, const struct sim_device *d, const struct sim_context *context)
{
    return context == NULL ? s->generation != d->generation : s->context == context;
}

/* One at a time, as destroying one releases the lock while its worker is
 * joined. Meanwhile an aclrtSetDevice may give the device a new default
 * stream: of the new generation, it is not the reset's to destroy (a reset
 * that destroyed every stream left the device with a freed default stream).
 * A stream another thread is destroying meanwhile is on the device's dying
 * list, not on its streams: each is destroyed once. */
static void destroy_streams(struct sim_device *d, const struct sim_context *context)
{
again:
    for (struct sim_stream *s = d->streams; s != NULL; s = s->next_on_device) {
        if (ended_by(s, d, context)) {
            sim_stream_destroy(s);
            goto again; /* the list may have changed while the lock was released */
        }
    }
}

void sim_device_destroy_old_streams(struct sim_device *d)
{
    destroy_streams(d, NULL);
}

/* CANN's context teardown takes down every stream made in the context,
 * each after its queued work, as aclrtDestroyStream does; its events and
 * the device's memory are not the context's and stay. */
void sim_context_destroy_streams(struct sim_device *d, const struct sim_context *c)
{
    destroy_streams(d, c);
}

/* Lock held. The tasks no worker has taken are dropped; the head, which
 * its worker may be running, is left to end. Dropped tasks count as
 * completed, so a synchronize of the stream waiting meanwhile returns. */
static void discard_queued(struct sim_stream *s)
{
    if (s->head == NULL)
        return;
    struct sim_task *t = s->head->next;
    s->head->next = NULL;
    s->tail = s->head;
    s->completed += drop_tasks(t);
    pthread_cond_broadcast(&sim_progress);
}

/* In a forked child, lock held. The parent's streams had workers the child
 * has not, so none of them runs again: every task is dropped unrun (the one
 * a worker was running too: nothing will finish it here) and the streams
 * go, so a handle of the parent's is an unknown stream in the child. A
 * device in use gets a new default stream at its next use. */
void sim_streams_forget_after_fork(void)
{
    for (int32_t id = 0; id < sim_config()->device_count; id++) {
        struct sim_device *d = sim_device(id);
        for (int dying = 0; dying < 2; dying++) {
            struct sim_stream **list = dying ? &d->dying : &d->streams;
            while (*list != NULL) {
                struct sim_stream *s = *list;
                *list = s->next_on_device;
                drop_tasks(s->head);
                free(s); /* no pthread_cond_destroy: it would wait for its waiter, the parent's worker */
            }
        }
        d->default_stream = NULL;
    }
}

/* Lock held. Whether handle is a live stream (handles are checked against
 * the live set so a destroyed stream is an error, not a wild pointer). One
 * of an earlier generation of its device is a reset's, which has yet to
 * destroy it: no caller's, as once destroyed (accepted, it took work from a
 * context the device started meanwhile, and a destroy the reset's own). */
static int is_live_stream(const struct sim_stream *handle)
{
    for (int32_t id = 0; id < sim_config()->device_count; id++)
        for (const struct sim_stream *s = sim_device(id)->streams; s != NULL; s = s->next_on_device)
            if (s == handle)
                return s->generation == sim_device(id)->generation;
    return 0;
}

/* Lock held. A device's default stream is made with its first reference;
 * a forked child's device, whose default stream stayed in the parent, gets
 * a new one here. */
static aclError default_stream(int32_t id, struct sim_stream **out)
{
    struct sim_device *d = sim_device(id);
    if (d->default_stream == NULL)
        d->default_stream = sim_stream_create(id, NULL);
    *out = d->default_stream;
    return *out != NULL ? ACL_SUCCESS : ACL_ERROR_BAD_ALLOC;
}

aclError sim_stream_resolve(aclrtStream handle, struct sim_stream **out)
{
    int32_t id;
    aclError ret = sim_current_device_locked(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    if (handle == NULL)
        return default_stream(id, out);
    if (!is_live_stream(handle))
        return ACL_ERROR_RT_PARAM_INVALID;
    *out = handle;
    return ACL_SUCCESS;
}

/* The thread's context is found live and given the stream under one hold
 * of the lock: a destroy of the context in another thread either comes
 * after, and ends the stream with the context's others, or before, and the
 * call is refused. */
static aclError create_stream(enum sim_api api, aclrtStream *stream)
{
    sim_count(api);
    if (stream == NULL)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&sim_lock);
    int32_t id;
    struct sim_stream *s = NULL;
    aclError ret = sim_current_device_locked(&id);
    if (ret == ACL_SUCCESS && (s = sim_stream_create(id, sim_current_context())) == NULL)
        ret = ACL_ERROR_BAD_ALLOC;
    pthread_mutex_unlock(&sim_lock);
    if (ret == ACL_SUCCESS)
        *stream = s;
    return ret;
}

SIM_EXPORT aclError simrt_CreateStream(aclrtStream *stream)
{
    return create_stream(SIM_API_aclrtCreateStream, stream);
}

/* Priority and flags order streams on real hardware; every simulated stream
 * has its own worker, so they change nothing the sim models. */
SIM_EXPORT aclError simrt_CreateStreamWithConfig(aclrtStream *stream, uint32_t priority, uint32_t flag)
{
    (void)priority, (void)flag;
    return create_stream(SIM_API_aclrtCreateStreamWithConfig, stream);
}

/* aclrtDestroyStream waits for the stream's queued work first;
 * aclrtDestroyStreamForce does not: CANN drops what has not run ("does not
 * wait for unfinished tasks"; its samples: "discarding all tasks"). What
 * becomes of an event record so dropped CANN does not say: here it never
 * completes, the outcome that hurts whoever waits on it. */
static aclError destroy_stream(enum sim_api api, aclrtStream stream, int force)
{
    sim_count(api);
    if (stream == NULL)
        return ACL_ERROR_INVALID_PARAM;
    /* Found and taken off the device's live streams under one hold of the
     * lock, so a second destroy racing this one is refused (107000) and no
     * work is queued on it from here on. */
    pthread_mutex_lock(&sim_lock);
    struct sim_stream *s;
    aclError ret = sim_stream_resolve(stream, &s);
    if (ret == ACL_SUCCESS && s == sim_device(s->device)->default_stream)
        ret = ACL_ERROR_INVALID_PARAM; /* the default stream lives as long as the device */
    if (ret == ACL_SUCCESS) {
        if (force)
            discard_queued(s);
        sim_stream_destroy(s);
    }
    pthread_mutex_unlock(&sim_lock);
    return ret;
}

SIM_EXPORT aclError simrt_DestroyStream(aclrtStream stream)
{
    return destroy_stream(SIM_API_aclrtDestroyStream, stream, 0);
}

SIM_EXPORT aclError simrt_DestroyStreamForce(aclrtStream stream)
{
    return destroy_stream(SIM_API_aclrtDestroyStreamForce, stream, 1);
}

SIM_EXPORT aclError simrt_SynchronizeStream(aclrtStream stream)
{
    sim_count(SIM_API_aclrtSynchronizeStream);
    pthread_mutex_lock(&sim_lock);
    struct sim_stream *s;
    aclError ret = sim_stream_resolve(stream, &s);
    if (ret == ACL_SUCCESS)
        ret = sim_inject_call_failure_locked(SIM_API_aclrtSynchronizeStream);
    if (ret == ACL_SUCCESS) {
        /* A destroy meanwhile drains the stream, which ends this wait too,
         * and frees it only once this thread has stopped reading it. */
        s->syncing++;
        sim_stream_wait_idle(s);
        s->syncing--;
        pthread_cond_broadcast(&sim_progress);
    }
    pthread_mutex_unlock(&sim_lock);
    return ret;
}
