/* Live streams and the event fences of stream-safe reuse. aclrtMalloc and
 * aclrtFree carry no stream, so a block freed while a kernel on another stream
 * still reads it must not be handed out until that work is done. A fence is
 * one event recorded on every live stream of the device (and its default
 * stream) at the time of the free; it completes when all of them have. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

/* One event of a fence and the stream it was recorded on. settled: that
 * stream was destroyed after the record and before the event completed;
 * whatever the record waited for has run or been dropped (aclrtDestroyStreamForce
 * drops it, and what becomes of the event then the runtime does not say), so
 * the event is not waited for. */
typedef struct fence_slot {
    aclrtEvent event;
    aclrtStream stream;
    atomic_bool settled;
} fence_slot;

typedef struct npa_fence {
    int device;
    int count;
    uint64_t seq;                    /* from fences_recorded, when recorded */
    struct npa_fence *prev, *next;   /* the device's outstanding fences */
    fence_slot slots[];
} npa_fence;

/* Per device: its live streams and a pool of idle events (creating an event
 * per free would cost a runtime call each time). The lock comes after the
 * core's device lock and before open_lock (hook.h); it is never held across
 * a synchronize. */
typedef struct dev_streams {
    pthread_mutex_t lock;
    aclrtStream *streams;
    size_t nstreams, cap_streams;
    aclrtEvent *pool;
    size_t npool, cap_pool;
    /* Streams whose aclrtDestroyStream runs: no longer among the live ones
     * (no event may name a stream being destroyed), but their queued work
     * may still use blocks freed meanwhile, so while one is dying a fence
     * over the device's streams synchronizes instead, which waits for it. */
    int dying;
    /* Streams no longer tracked since one of them refused an event as a
     * handle the runtime does not know (unknown_stream), or more were
     * listed than the device holds (track_locked): the runtime took
     * one down without a destroy we saw (the reset that dropped the device's
     * last reference, or its last context's destroy, which we cannot tell
     * from one that did not), or it is of a kind we cannot fence. Either
     * way only a synchronize covers its work, so while any are untracked
     * (unfenceable) every fence over the device synchronizes, and the
     * streams made meanwhile are not tracked either: kept, a program whose
     * threads each made a stream and reset the device at its end grew the
     * list by one dead stream a step, and each fence tried an event on
     * every one of them (a probe's 8 fences a step made 12,412 event
     * records a step between its steps 1,100 and 2,000). Until the device
     * is released for certain (aclrtResetDeviceForce); they stay counted in
     * live_streams meanwhile, since a destroy of one cannot tell its device
     * (the auto policy fences). */
    size_t untracked;
    npa_fence *outstanding; /* recorded and not yet released, for npa_streams_dead */
} dev_streams;

static dev_streams devs[NPUALLOC_MAX_DEVICES] = {
    [0 ... NPUALLOC_MAX_DEVICES - 1] = {.lock = PTHREAD_MUTEX_INITIALIZER},
};
static atomic_int live_streams; /* created and not yet destroyed (dying ones too), for the auto policy */
/* Fences recorded so far, every device's: a destroy settles only those
 * recorded before it began (a stream given the same handle since is new). */
static atomic_uint_fast64_t fences_recorded;

static int push(void ***v, size_t *n, size_t *cap, void *item)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 8;
        void **nv = realloc(*v, ncap * sizeof(void *));
        if (nv == NULL)
            return -1;
        *v = nv;
        *cap = ncap;
    }
    (*v)[(*n)++] = item;
    return 0;
}

/* Under reuse_policy:auto a free made while no stream exists is reusable at
 * once: the default stream runs in order. The first stream ends that, and
 * work queued on the default stream before it may still read such a block
 * when the new stream is handed it. One synchronize of every device in use
 * closes the gap, once per switch from no stream to some. */
static void settle_before_first_stream(void)
{
    if (npa_hook_config()->reuse_policy != NPA_REUSE_AUTO)
        return;
    unsigned seen = npa_devices_seen();
    for (int device = 0; seen != 0; device++, seen >>= 1) {
        aclError err = (seen & 1u) ? npa_hook_synchronize(device) : ACL_SUCCESS;
        if (err != ACL_SUCCESS)
            npa_warn_once("cannot synchronize device %d before its first stream (error %d): blocks freed "
                          "before it may be handed to the new stream while the default stream still uses them",
                          device, err);
    }
}

/* d->lock held. */
static bool unfenceable(const dev_streams *d)
{
    return d->untracked != 0;
}

/* The most streams a device holds, its default stream included
 * (aclrtCreateStream's constraints: 512 to 2,048 by model). */
#define DEVICE_STREAMS_MAX 2048

/* d->lock held. */
static void track_locked(dev_streams *d, int device, aclrtStream stream)
{
    if (!unfenceable(d) && d->nstreams + 1 >= DEVICE_STREAMS_MAX) {
        /* Listed with this one and the default stream, more than the device
         * holds: some were taken down unseen (a reset at the device's last
         * reference, a context's destroy) with no fence since to find them
         * refused. They are untracked as such a fence untracks them: kept,
         * a program that made a stream and reset the device each step grew
         * the list by one a step for as long as it ran, and the first fence
         * then tried an event on every one. */
        d->untracked += d->nstreams;
        d->nstreams = 0;
    }
    if (unfenceable(d)) {
        d->untracked++; /* its fences synchronize: nothing is recorded on any stream */
        return;
    }
    if (push(&d->streams, &d->nstreams, &d->cap_streams, stream) != 0)
        npa_warn_once("out of host memory tracking streams; frees on device %d may be reused early", device);
}

/* The switch from no stream to some, one creator at a time: a second
 * stream created while the first one's creator synchronizes would be handed
 * out before the default stream's work ended, blocks freed eagerly under it
 * and all. Taken with none of ours held; under it the runtime, a first
 * lookup of its functions (7 in hook.h) and a warning (seen_lock); a forked
 * child starts it afresh. So a stream's creation waits for the first one's
 * synchronize: a program whose default-stream work waits for a host
 * callback that creates a stream would wait for good (none is known). */
static pthread_mutex_t first_stream_lock = PTHREAD_MUTEX_INITIALIZER;

void npa_streams_add(int device, aclrtStream stream)
{
    npa_mutex_lock(&first_stream_lock);
    /* Sequentially consistent, before settle_before_first_stream reads the
     * devices seen: a store-buffering pair (device.c). */
    if (atomic_fetch_add_explicit(&live_streams, 1, memory_order_seq_cst) == 0)
        settle_before_first_stream();
    npa_mutex_unlock(&first_stream_lock);
    if (!npa_device_in_range(device))
        return; /* counted for the auto policy; fences there fall back to a sync */
    dev_streams *d = &devs[device];
    npa_mutex_lock(&d->lock);
    track_locked(d, device, stream);
    npa_mutex_unlock(&d->lock);
}

npa_stream_death npa_streams_dying(aclrtStream stream)
{
    npa_stream_death death = {0};
    for (int dev = 0; dev < NPUALLOC_MAX_DEVICES && !death.tracked; dev++) {
        dev_streams *d = &devs[dev];
        npa_mutex_lock(&d->lock);
        for (size_t i = 0; i < d->nstreams; i++)
            if (d->streams[i] == stream) {
                d->streams[i] = d->streams[--d->nstreams];
                d->dying++;
                death.tracked = dev + 1;
                break;
            }
        npa_mutex_unlock(&d->lock);
    }
    /* After the untracking: a fence recorded later names the stream only if
     * its caller named it (a use racing the destroy, or a new stream with
     * the same handle), and is not settled by this destroy. */
    death.fences_before = atomic_load_explicit(&fences_recorded, memory_order_acquire);
    return death;
}

/* d->lock held. The events recorded on stream (every stream: all) by
 * fences up to seq. */
static void settle_on(dev_streams *d, bool all, aclrtStream stream, uint64_t seq)
{
    for (npa_fence *f = d->outstanding; f != NULL; f = f->next)
        for (int i = 0; f->seq <= seq && i < f->count; i++)
            if (all || f->slots[i].stream == stream)
                atomic_store_explicit(&f->slots[i].settled, true, memory_order_release);
}

void npa_streams_dead(npa_stream_death death, aclrtStream stream, int destroyed)
{
    if (destroyed) /* any device's fences may have named it (a use recorded there) */
        for (int dev = 0; dev < NPUALLOC_MAX_DEVICES; dev++) {
            dev_streams *d = &devs[dev];
            npa_mutex_lock(&d->lock);
            settle_on(d, false, stream, death.fences_before);
            npa_mutex_unlock(&d->lock);
        }
    if (death.tracked <= 0 || death.tracked > NPUALLOC_MAX_DEVICES)
        return;
    dev_streams *d = &devs[death.tracked - 1];
    npa_mutex_lock(&d->lock);
    d->dying--;
    if (!destroyed) /* refused: tracked again, on the device it was on, whoever calls */
        track_locked(d, death.tracked - 1, stream);
    npa_mutex_unlock(&d->lock);
    if (destroyed) /* counted live until now: the auto policy fenced while its work could still run */
        atomic_fetch_sub_explicit(&live_streams, 1, memory_order_relaxed);
}

void npa_streams_device_released(int device)
{
    if (!npa_device_in_range(device))
        return;
    dev_streams *d = &devs[device];
    npa_mutex_lock(&d->lock);
    size_t gone = d->nstreams + d->untracked;
    d->nstreams = 0;
    d->untracked = 0;
    /* Every event of the device's fences: its streams, the default one
     * included, are gone with their work (the reset waited for it). */
    settle_on(d, true, NULL, UINT64_MAX);
    npa_mutex_unlock(&d->lock);
    atomic_fetch_sub_explicit(&live_streams, (int)gone, memory_order_relaxed);
}

static aclrtEvent take_event(dev_streams *d)
{
    if (d->npool > 0)
        return d->pool[--d->npool];
    aclrtEvent ev = NULL;
    __typeof__(&aclrtCreateEvent) create = NPA_REAL(aclrtCreateEvent);
    if (create == NULL || create(&ev) != ACL_SUCCESS)
        return NULL;
    return ev;
}

static void give_event(dev_streams *d, aclrtEvent ev)
{
    if (push(&d->pool, &d->npool, &d->cap_pool, ev) != 0) {
        __typeof__(&aclrtDestroyEvent) destroy = NPA_REAL(aclrtDestroyEvent);
        if (destroy)
            destroy(ev);
    }
}

/* Whether a record's error says the runtime does not know the stream (nor
 * any work on it) rather than that it could not take the event this time:
 * only that makes a device unfenceable. Any other refusal (out of memory,
 * an internal error) costs the fence it happened in a synchronize and the
 * stream stays tracked: made unfenceable by one, a device's fences
 * synchronized for the rest of the run. */
static bool unknown_stream(aclError err)
{
    return err == ACL_ERROR_RT_PARAM_INVALID || err == ACL_ERROR_INVALID_RESOURCE_HANDLE;
}

/* One event on each of the count streams named, or (streams NULL) on every
 * live stream of the device and its default stream: see hook.h. */
static aclError record_fence(int device, const uintptr_t *streams, size_t count, void **fence)
{
    *fence = NULL;
    if (!npa_device_in_range(device))
        return npa_hook_synchronize(device);
    __typeof__(&aclrtRecordEvent) record = NPA_REAL(aclrtRecordEvent);
    if (record == NULL)
        return npa_hook_synchronize(device);
    npa_devswitch sw;
    /* Events and the default stream belong to the current device. A device
     * we cannot enter can be neither fenced nor synchronized: say so, and
     * the caller keeps waiting (hook.h). */
    aclError err = npa_device_enter(device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    dev_streams *d = &devs[device];
    int complete = 1;
    npa_mutex_lock(&d->lock);
    size_t n = streams != NULL ? count : d->nstreams + 1;
    npa_fence *f = malloc(sizeof(npa_fence) + n * sizeof(fence_slot));
    if (f != NULL) {
        *f = (npa_fence){.device = device,
                         .seq = atomic_fetch_add_explicit(&fences_recorded, 1, memory_order_acq_rel) + 1,
                         .next = d->outstanding};
        if (d->outstanding != NULL)
            d->outstanding->prev = f;
        d->outstanding = f;
    }
    /* No host memory for the fence; or a stream being destroyed, which may
     * still use the blocks and which no event may name, or one that refused
     * an event: a synchronize below waits for it. */
    if (f == NULL || (streams == NULL && (d->dying > 0 || unfenceable(d)))) {
        complete = 0;
    } else {
        bool taken_down = false; /* a tracked stream the runtime does not know */
        for (size_t i = 0; i < n; i++) {
            aclrtStream stream = streams != NULL  ? (aclrtStream)streams[i]
                                 : i < d->nstreams ? d->streams[i]
                                                   : NULL; /* NULL: the default stream */
            aclrtEvent ev = take_event(d);
            aclError outcome = ev != NULL ? record(ev, stream) : ACL_ERROR_BAD_ALLOC;
            if (outcome == ACL_SUCCESS) {
                fence_slot *slot = &f->slots[f->count++];
                slot->event = ev;
                slot->stream = stream;
                atomic_init(&slot->settled, false);
            } else {
                if (ev != NULL)
                    give_event(d, ev);
                if (streams == NULL && i < d->nstreams && unknown_stream(outcome))
                    taken_down = true;
                complete = 0;
            }
        }
        if (taken_down) {
            d->untracked += d->nstreams;
            d->nstreams = 0;
        }
    }
    npa_mutex_unlock(&d->lock);
    if (!complete) {
        /* Cannot see when that stream's work ends: wait for all of it now,
         * which is what the fence would have waited for. The device lock is
         * not held across it: a synchronize may take long. */
        __typeof__(&aclrtSynchronizeDevice) sync = NPA_REAL(aclrtSynchronizeDevice);
        err = sync != NULL ? sync() : npa_no_runtime_error(NPA_FN_aclrtSynchronizeDevice);
    }
    npa_device_leave(&sw);
    if (f != NULL && (err != ACL_SUCCESS || f->count == 0)) {
        /* Failed: part of the work is not covered, so the fence proves
         * nothing. No event: the synchronize covered everything. */
        npa_fence_release(NULL, f);
        f = NULL;
    }
    *fence = f;
    return err;
}

npa_error npa_fence_record_always(void *ctx, int device, void **fence)
{
    (void)ctx;
    return record_fence(device, NULL, 0, fence);
}

npa_error npa_fence_record_streams(void *ctx, int device, const uintptr_t *streams, size_t count, void **fence)
{
    (void)ctx;
    return record_fence(device, streams, count, fence);
}

/* No free needs a fence: reuse_policy:eager's word. */
static const atomic_int never_needed;

const atomic_int *npa_fence_needed_word(const npa_config *config)
{
    switch (config->reuse_policy) {
    case NPA_REUSE_EAGER:
        return &never_needed;
    case NPA_REUSE_AUTO:
        /* Only the default stream exists: work on it runs in order, so a block
         * freed now is safe for whatever is queued after. Against a first
         * stream's creator (fetch_add, then synchronize) the core's load of
         * this word at a free is the other half of a store-buffering pair:
         * the program's launches before the free must be visible to that
         * synchronize, or the load must see the stream. The free takes the
         * device lock before it (on x86 a locked compare-and-swap, a full
         * barrier) and opens a stats section with a release fence (on
         * aarch64 a dmb ish, a full barrier), and the runtime's own launch
         * and synchronize share its locks. A device first set while the
         * creator ran is the other such pair (device.c): for it the load is
         * sequentially consistent (core.h's contract), which costs x86-64
         * nothing and aarch64 an ldar for an ldr. */
        return &live_streams;
    case NPA_REUSE_SAFE:
        break;
    }
    return NULL; /* every free */
}

/* Whether a fence is needed now, read as the core reads the word. */
static bool fence_needed(const npa_config *config)
{
    const atomic_int *word = npa_fence_needed_word(config);
    return word == NULL || atomic_load_explicit(word, memory_order_seq_cst) > 0;
}

npa_error npa_fence_record(void *ctx, int device, void **fence)
{
    *fence = NULL;
    return fence_needed(ctx) ? npa_fence_record_always(ctx, device, fence) : NPA_OK; /* ctx: backend_for's config */
}

int npa_fence_done(void *ctx, void *fence)
{
    (void)ctx;
    npa_fence *f = fence;
    __typeof__(&aclrtQueryEventStatus) query = NPA_REAL(aclrtQueryEventStatus);
    if (query == NULL)
        return 1;
    int done = 1;
    npa_cancel_off(); /* a runtime call under the device lock */
    for (int i = 0; done && i < f->count; i++) {
        if (atomic_load_explicit(&f->slots[i].settled, memory_order_acquire))
            continue;
        aclrtEventRecordedStatus status = ACL_EVENT_RECORDED_STATUS_NOT_READY;
        /* A query that fails names an event whose stream or context is gone,
         * and with it the work we were waiting for. */
        if (query(f->slots[i].event, &status) == ACL_SUCCESS && status != ACL_EVENT_RECORDED_STATUS_COMPLETE)
            done = 0;
    }
    npa_cancel_on();
    return done;
}

void npa_fence_release(void *ctx, void *fence)
{
    (void)ctx;
    npa_fence *f = fence;
    dev_streams *d = &devs[f->device];
    npa_mutex_lock(&d->lock);
    if (f->prev != NULL)
        f->prev->next = f->next;
    else
        d->outstanding = f->next;
    if (f->next != NULL)
        f->next->prev = f->prev;
    for (int i = 0; i < f->count; i++)
        give_event(d, f->slots[i].event);
    npa_mutex_unlock(&d->lock);
    free(f);
}

void npa_streams_destroy_events(int device, bool at_exit)
{
    __typeof__(&aclrtDestroyEvent) destroy = NPA_REAL(aclrtDestroyEvent);
    for (int dev = 0; dev < NPUALLOC_MAX_DEVICES; dev++) {
        if (device >= 0 && dev != device)
            continue;
        dev_streams *d = &devs[dev];
        if (!at_exit)
            npa_mutex_lock(&d->lock);
        else if (npa_mutex_lock_at_exit(&d->lock) != 0)
            continue;
        for (size_t i = 0; destroy && i < d->npool; i++)
            destroy(d->pool[i]);
        d->npool = 0;
        npa_mutex_unlock(&d->lock);
    }
}

void npa_streams_lock_for_fork(void)
{
    for (int dev = 0; dev < NPUALLOC_MAX_DEVICES; dev++)
        npa_mutex_lock(&devs[dev].lock);
}

void npa_streams_unlock_after_fork(void)
{
    for (int dev = NPUALLOC_MAX_DEVICES - 1; dev >= 0; dev--)
        npa_mutex_unlock(&devs[dev].lock);
}

void npa_streams_forget_after_fork(void)
{
    /* The parent's streams and events are not the child's: forget them
     * without destroying anything. */
    for (int dev = 0; dev < NPUALLOC_MAX_DEVICES; dev++) {
        devs[dev].nstreams = 0;
        devs[dev].npool = 0;
        devs[dev].dying = 0;
        devs[dev].untracked = 0;
        devs[dev].outstanding = NULL;
    }
    atomic_store_explicit(&live_streams, 0, memory_order_relaxed);
    pthread_mutex_init(&first_stream_lock, NULL); /* a parent's thread may have held it */
}
