/* History recording (record_history:N): the last N allocator events of each
 * device in a ring, torch's device_traces. Off by default; the allocation
 * paths then pay one predictable branch each (npa_history_note). Every
 * function here runs under the device lock, except npa_set_record_history,
 * which takes the locks itself. */
#include <stdlib.h>
#include <time.h>

#include "internal.h"

static int64_t realtime_us(void) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    return (int64_t)now.tv_sec * 1000000 + now.tv_nsec / 1000;
}

void npa_history_record(npa_device *d, const npa_pool *pool, npa_trace_action action, uintptr_t addr, size_t size) {
    npa_history *h = &d->history;
    /* torch records a snapshot with no context: it is no call of the program's. */
    const npa_backend *b = d->backend;
    uint32_t stack = b->capture_stack && action != NPA_TRACE_SNAPSHOT ? b->capture_stack(b->ctx) : 0;
    /* torch's record_trace keeps the context in the entry only from ALLOC
     * up; under STATE the stack serves the snapshot's blocks and segments. */
    bool in_trace = __atomic_load_n(&d->config->record_context, __ATOMIC_RELAXED) != NPA_CONTEXT_STATE;
    h->entries[h->next] = (npa_trace_entry){.addr = addr, .size = size, .time_us = realtime_us(),
                                            .stream = npa_pool_stream(pool), .action = (uint8_t)action,
                                            .stack_in_trace = in_trace, .stack = stack};
    h->next = h->next + 1 == h->capacity ? 0 : h->next + 1;
    if (h->count < h->capacity) h->count++;
}

bool npa_history_reset(npa_history *h, size_t capacity) {
    free(h->entries);
    *h = (npa_history){0};
    if (capacity == 0) return true;
    if (capacity > SIZE_MAX / sizeof(npa_trace_entry)) return false;
    h->entries = malloc(capacity * sizeof(npa_trace_entry));
    if (!h->entries) return false;
    h->capacity = capacity;
    return true;
}

void npa_history_visit(const npa_device *d, npa_trace_visitor visitor, void *arg) {
    const npa_history *h = &d->history;
    size_t index = (h->next + h->capacity - h->count) % (h->capacity ? h->capacity : 1);
    for (size_t i = 0; i < h->count; i++) {
        const npa_trace_entry *e = &h->entries[index];
        npa_trace_view view = {.device = d->id, .action = e->action, .addr = e->addr, .size = e->size,
                               .time_us = e->time_us, .stream = e->stream, .stack = e->stack,
                               .stack_in_trace = e->stack_in_trace};
        visitor(&view, arg);
        index = index + 1 == h->capacity ? 0 : index + 1;
    }
}

/* Under the init lock, so a device created meanwhile starts with the new size. */
int npa_set_record_history(npa_allocator *a, size_t max_entries) {
    if (!a) return -1;
    pthread_mutex_lock(&a->init_lock);
    __atomic_store_n(&a->config.record_history, max_entries, __ATOMIC_RELAXED);
    bool ok = true;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES && ok; i++) {
        npa_device *d = a->devices[i];
        if (!d) continue;
        npa_lock_acquire(&d->lock);
        ok = npa_history_reset(&d->history, max_entries);
        npa_tcaches_settle(d); /* every event through the device lock while recording */
        npa_lock_release(&d->lock);
    }
    if (!ok) { /* all off rather than some devices recording */
        __atomic_store_n(&a->config.record_history, 0, __ATOMIC_RELAXED);
        for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
            npa_device *d = a->devices[i];
            if (!d) continue;
            npa_lock_acquire(&d->lock);
            npa_history_reset(&d->history, 0);
            npa_tcaches_settle(d);
            npa_lock_release(&d->lock);
        }
    }
    pthread_mutex_unlock(&a->init_lock);
    return ok ? 0 : -1;
}

void npa_set_record_stacks(npa_allocator *a, bool on) {
    if (a) __atomic_store_n(&a->config.record_stacks, on, __ATOMIC_RELAXED);
}

void npa_set_record_context(npa_allocator *a, npa_record_context context) {
    if (a) __atomic_store_n(&a->config.record_context, context, __ATOMIC_RELAXED);
}

typedef struct trace_visit {
    npa_trace_visitor visitor;
    void *arg;
} trace_visit;

static void visit_on(npa_allocator *a, npa_device *d, void *arg) {
    (void)a;
    const trace_visit *v = arg;
    npa_history_visit(d, v->visitor, v->arg);
}

void npa_visit_trace(npa_allocator *a, int device, npa_trace_visitor visitor, void *arg) {
    if (!visitor) return;
    npa_for_devices(a, device, visit_on, &(trace_visit){.visitor = visitor, .arg = arg});
}
