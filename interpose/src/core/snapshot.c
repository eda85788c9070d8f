/* Segment and block views for memory snapshots (torch's _snapshot()). Views
 * are built into one scratch array reused across segments of the call. */
#include <stdlib.h>

#include "internal.h"

static npa_block_state view_state(const npa_block *b) {
    switch (b->phase) {
    case NPA_PHASE_ALLOCATED: return NPA_BLOCK_ACTIVE_ALLOCATED;
    case NPA_PHASE_PENDING: return NPA_BLOCK_ACTIVE_PENDING_FREE;
    default: return NPA_BLOCK_INACTIVE;
    }
}

/* One view of the blocks from head up to the end of its segment or the
 * next unmapped stretch: a plain segment is one such run, an expandable one
 * a run per mapped stretch (torch reports each as a segment). */
static bool visit_run(npa_device *d, const npa_block *head, npa_segment_visitor visitor, void *arg,
                      npa_block_view **scratch, size_t *capacity) {
    size_t count = 0;
    for (const npa_block *b = head; b && b->phase != NPA_PHASE_UNMAPPED; b = b->next) count++;
    if (count > *capacity) {
        npa_block_view *grown = realloc(*scratch, count * sizeof *grown);
        if (!grown) return false;
        *scratch = grown;
        *capacity = count;
    }
    npa_segment_view view = {.device = d->id, .address = head->addr, .is_small = head->is_small,
                             .is_expandable = head->in_expandable,
                             .stream = npa_pool_stream(head->pool), .block_count = count,
                             .blocks = *scratch};
    size_t k = 0;
    for (const npa_block *b = head; k < count; b = b->next, k++) {
        npa_block_state state = view_state(b);
        size_t requested = b->requested;
        /* A recent block is a thread cache's: allocated if its fast malloc
         * lent it (the tcaches are frozen), else free in its stock. */
        const npa_lent *lent = b->phase == NPA_PHASE_RECENT ? npa_tcaches_find_lent(d, b->addr) : NULL;
        if (lent) {
            state = NPA_BLOCK_ACTIVE_ALLOCATED;
            requested = lent->requested;
        }
        (*scratch)[k] = (npa_block_view){.address = b->addr, .size = b->size,
                                         .requested_size = requested, .state = state};
        view.total_size += b->size;
        if (state == NPA_BLOCK_ACTIVE_ALLOCATED) view.allocated_size += b->size;
        if (state != NPA_BLOCK_INACTIVE) {
            view.active_size += b->size;
            view.requested_size += requested;
        }
    }
    visitor(&view, arg);
    return true;
}

/* Frozen: what the threads' caches lend and hold stays as seen. */
bool npa_visit_device_segments(npa_device *d, npa_segment_visitor visitor, void *arg, npa_block_view **scratch,
                               size_t *capacity) {
    bool complete = true;
    npa_tcaches_freeze(d);
    for (size_t i = 0; i < d->segments.count && complete; i++) {
        for (const npa_block *b = d->segments.items[i].first; b && complete; b = b->next) {
            bool starts_run = b->phase != NPA_PHASE_UNMAPPED && (!b->prev || b->prev->phase == NPA_PHASE_UNMAPPED);
            if (starts_run) complete = visit_run(d, b, visitor, arg, scratch, capacity);
        }
    }
    npa_tcaches_thaw(d);
    return complete;
}

void npa_visit_segments(npa_allocator *a, int device, npa_segment_visitor visitor, void *arg) {
    if (!a || !visitor) return;
    npa_block_view *scratch = NULL;
    size_t capacity = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        if (device >= 0 && i != device) continue;
        npa_device *d = npa_device_get(a, i, false);
        if (!d) continue;
        npa_lock_acquire(&d->lock);
        bool complete = npa_visit_device_segments(d, visitor, arg, &scratch, &capacity);
        npa_lock_release(&d->lock);
        if (!complete) break;
    }
    free(scratch);
}
