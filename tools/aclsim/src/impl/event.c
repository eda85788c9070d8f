/* Events. An event remembers how many records were issued and how many have
 * executed; it is complete when they match, so a never-recorded event is
 * complete, as on real hardware. Query polarity differs per API:
 * aclrtQueryEventStatus says COMPLETE=1, the older aclrtQueryEvent COMPLETE=0.
 *
 * Event objects are recycled through a free list of our own instead of being
 * handed back to malloc, so a destroyed handle can always be read safely and
 * reported as invalid (until the slot is reused, as a real runtime reuses ids). */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

#define EVENT_LIVE 0x45564e54u
#define EVENT_DEAD 0xdeadeeeeu

struct sim_event {
    uint32_t magic;
    uint64_t generation;   /* process_generation when created */
    uint64_t record_seq;   /* records issued */
    uint64_t done_seq;     /* highest record that has executed */
    int refs;              /* queued record/wait tasks still pointing here */
    struct timespec done_at; /* when the latest record executed (aclrtEventElapsedTime) */
    struct sim_event *next_free;
};

static struct sim_event *free_events;
/* Bumped in a forked child: the parent's events are not the child's. Their
 * records were to be completed by streams the child does not have (fork.c),
 * so a wait for one would never end; to the child they are unknown events. */
static uint64_t process_generation;

void sim_events_forget_after_fork(void)
{
    process_generation++;
}

static void recycle(struct sim_event *ev)
{
    ev->next_free = free_events;
    free_events = ev;
}

static void unref(struct sim_event *ev)
{
    if (--ev->refs == 0 && ev->magic == EVENT_DEAD)
        recycle(ev);
}

/* Lock held: record seq of ev has executed (a later one may have already). */
static void mark_done(struct sim_event *ev, uint64_t seq)
{
    if (seq > ev->done_seq) {
        ev->done_seq = seq;
        clock_gettime(CLOCK_MONOTONIC, &ev->done_at);
    }
}

void sim_event_task_done(struct sim_event *ev, uint64_t seq)
{
    mark_done(ev, seq);
    unref(ev);
}

void sim_event_task_discard(struct sim_event *ev)
{
    unref(ev);
}

void sim_event_task_wait(struct sim_event *ev, uint64_t seq)
{
    while (ev->done_seq < seq)
        pthread_cond_wait(&sim_progress, &sim_lock);
    unref(ev);
}

/* Lock held. */
static int is_live(const struct sim_event *ev)
{
    return ev != NULL && ev->magic == EVENT_LIVE && ev->generation == process_generation;
}

static aclError create_event(aclrtEvent *event)
{
    if (event == NULL)
        return ACL_ERROR_INVALID_PARAM;
    int32_t id;
    aclError ret = sim_current_device(&id);
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    struct sim_event *ev = free_events;
    if (ev != NULL)
        free_events = ev->next_free;
    else
        ev = malloc(sizeof *ev);
    if (ev != NULL)
        *ev = (struct sim_event){.magic = EVENT_LIVE, .generation = process_generation};
    pthread_mutex_unlock(&sim_lock);
    if (ev == NULL)
        return ACL_ERROR_BAD_ALLOC;
    *event = ev;
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_CreateEvent(aclrtEvent *event)
{
    sim_count(SIM_API_aclrtCreateEvent);
    return create_event(event);
}

SIM_EXPORT aclError simrt_CreateEventWithFlag(aclrtEvent *event, uint32_t flag)
{
    sim_count(SIM_API_aclrtCreateEventWithFlag);
    (void)flag; /* timing/sync flags change nothing the sim models */
    return create_event(event);
}

SIM_EXPORT aclError simrt_CreateEventExWithFlag(aclrtEvent *event, uint32_t flag)
{
    sim_count(SIM_API_aclrtCreateEventExWithFlag);
    (void)flag;
    return create_event(event);
}

/* Queues a record or wait task on a stream for a live event. The stream is
 * resolved under the hold of the lock that queues the task: a destroy in
 * between would free it. */
static aclError queue_event_task(aclrtEvent event, aclrtStream stream, enum sim_task_kind kind)
{
    struct sim_task *t = calloc(1, sizeof *t);
    if (t == NULL)
        return ACL_ERROR_BAD_ALLOC;
    pthread_mutex_lock(&sim_lock);
    struct sim_stream *s;
    aclError ret = sim_stream_resolve(stream, &s);
    if (ret == ACL_SUCCESS && kind == TASK_EVENT_RECORD)
        ret = sim_inject_call_failure_locked(SIM_API_aclrtRecordEvent);
    struct sim_event *ev = event;
    if (ret == ACL_SUCCESS && !is_live(ev))
        ret = ACL_ERROR_RT_PARAM_INVALID;
    if (ret != ACL_SUCCESS) {
        pthread_mutex_unlock(&sim_lock);
        free(t);
        return ret;
    }
    if (kind == TASK_EVENT_RECORD)
        ev->record_seq++;
    if (kind == TASK_EVENT_RECORD && s->head == NULL) {
        /* Nothing queued or running on the stream: the record executes now,
         * as a device reaches it within microseconds. Queued, it waited for
         * the stream's worker thread to get a CPU, which on a busy 2-core
         * host took 0.2-1 ms that real hardware never adds. */
        mark_done(ev, ev->record_seq);
        pthread_cond_broadcast(&sim_progress); /* an aclrtSynchronizeEvent of an earlier record */
        pthread_mutex_unlock(&sim_lock);
        free(t);
        return ACL_SUCCESS;
    }
    t->kind = kind;
    t->u.event.ev = ev;
    t->u.event.seq = ev->record_seq; /* a wait waits for the latest record issued so far */
    ev->refs++;
    sim_stream_submit(s, t);
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_RecordEvent(aclrtEvent event, aclrtStream stream)
{
    sim_count(SIM_API_aclrtRecordEvent);
    return queue_event_task(event, stream, TASK_EVENT_RECORD);
}

SIM_EXPORT aclError simrt_StreamWaitEvent(aclrtStream stream, aclrtEvent event)
{
    sim_count(SIM_API_aclrtStreamWaitEvent);
    return queue_event_task(event, stream, TASK_EVENT_WAIT);
}

/* 1 complete, 0 not ready, -1 not a live event. */
static int event_complete(aclrtEvent event)
{
    pthread_mutex_lock(&sim_lock);
    struct sim_event *ev = event;
    int state = is_live(ev) ? ev->done_seq >= ev->record_seq : -1;
    pthread_mutex_unlock(&sim_lock);
    return state;
}

/* Both status queries: *complete is 1 or 0; they differ only in how they
 * spell it (the two enums have opposite polarity). */
static aclError query_event(enum sim_api api, aclrtEvent event, const void *status, int *complete)
{
    sim_count(api);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    if (status == NULL)
        return ACL_ERROR_INVALID_PARAM;
    *complete = event_complete(event);
    return *complete < 0 ? ACL_ERROR_RT_PARAM_INVALID : ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_QueryEventStatus(aclrtEvent event, aclrtEventRecordedStatus *status)
{
    int complete;
    aclError ret = query_event(SIM_API_aclrtQueryEventStatus, event, status, &complete);
    if (ret == ACL_SUCCESS)
        *status = complete ? ACL_EVENT_RECORDED_STATUS_COMPLETE : ACL_EVENT_RECORDED_STATUS_NOT_READY;
    return ret;
}

SIM_EXPORT aclError simrt_QueryEvent(aclrtEvent event, aclrtEventStatus *status)
{
    int complete;
    aclError ret = query_event(SIM_API_aclrtQueryEvent, event, status, &complete);
    if (ret == ACL_SUCCESS)
        *status = complete ? ACL_EVENT_STATUS_COMPLETE : ACL_EVENT_STATUS_NOT_READY;
    return ret;
}

/* Counts api and, after aclInit, takes the lock with a live event in *ev;
 * on an error the lock is not held. */
static aclError lock_live_event(enum sim_api api, aclrtEvent event, struct sim_event **ev)
{
    sim_count(api);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    pthread_mutex_lock(&sim_lock);
    *ev = event;
    if (!is_live(*ev)) {
        pthread_mutex_unlock(&sim_lock);
        return ACL_ERROR_RT_PARAM_INVALID;
    }
    return ACL_SUCCESS;
}

SIM_EXPORT aclError simrt_SynchronizeEvent(aclrtEvent event)
{
    struct sim_event *ev;
    aclError ret = lock_live_event(SIM_API_aclrtSynchronizeEvent, event, &ev);
    if (ret != ACL_SUCCESS)
        return ret;
    uint64_t target = ev->record_seq;
    ev->refs++; /* stays readable if destroyed by another thread meanwhile */
    while (ev->done_seq < target)
        pthread_cond_wait(&sim_progress, &sim_lock);
    unref(ev);
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

/* A destroyed event with records still queued is released once they ran. */
SIM_EXPORT aclError simrt_DestroyEvent(aclrtEvent event)
{
    struct sim_event *ev;
    aclError ret = lock_live_event(SIM_API_aclrtDestroyEvent, event, &ev);
    if (ret != ACL_SUCCESS)
        return ret;
    ev->magic = EVENT_DEAD;
    if (ev->refs == 0)
        recycle(ev);
    pthread_mutex_unlock(&sim_lock);
    return ACL_SUCCESS;
}

/* As on hardware: both events must be live, recorded and complete. */
SIM_EXPORT aclError simrt_EventElapsedTime(float *ms, aclrtEvent startEvent, aclrtEvent endEvent)
{
    sim_count(SIM_API_aclrtEventElapsedTime);
    aclError ret = sim_require_init();
    if (ret != ACL_SUCCESS)
        return ret;
    if (ms == NULL)
        return ACL_ERROR_INVALID_PARAM;
    pthread_mutex_lock(&sim_lock);
    struct sim_event *a = startEvent, *b = endEvent;
    if (!is_live(a) || !is_live(b) || a->record_seq == 0 || b->record_seq == 0)
        ret = ACL_ERROR_RT_PARAM_INVALID;
    else if (a->done_seq < a->record_seq || b->done_seq < b->record_seq)
        ret = ACL_ERROR_RT_EVENT_NOT_COMPLETE;
    else
        *ms = (float)((double)(b->done_at.tv_sec - a->done_at.tv_sec) * 1e3 +
                      (double)(b->done_at.tv_nsec - a->done_at.tv_nsec) / 1e6);
    pthread_mutex_unlock(&sim_lock);
    return ret;
}
