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

bool npa_visit_device_segments(npa_device *d, npa_segment_visitor visitor, void *arg, npa_block_view **scratch,
                               size_t *capacity) {
    for (size_t i = 0; i < d->segments.count; i++) {
        const npa_segment *seg = &d->segments.items[i];
        size_t count = 0;
        for (const npa_block *b = seg->first; b; b = b->next) count++;
        if (count > *capacity) {
            npa_block_view *grown = realloc(*scratch, count * sizeof *grown);
            if (!grown) return false;
            *scratch = grown;
            *capacity = count;
        }
        npa_segment_view view = {.device = d->id, .address = seg->base, .total_size = seg->size,
                                 .is_small = seg->first->is_small, .block_count = count, .blocks = *scratch};
        size_t k = 0;
        for (const npa_block *b = seg->first; b; b = b->next, k++) {
            npa_block_state state = view_state(b);
            (*scratch)[k] = (npa_block_view){.address = b->addr, .size = b->size,
                                             .requested_size = b->requested, .state = state};
            if (state == NPA_BLOCK_ACTIVE_ALLOCATED) view.allocated_size += b->size;
            if (state != NPA_BLOCK_INACTIVE) {
                view.active_size += b->size;
                view.requested_size += b->requested;
            }
        }
        visitor(&view, arg);
    }
    return true;
}

void npa_visit_segments(npa_allocator *a, int device, npa_segment_visitor visitor, void *arg) {
    if (!a || !visitor) return;
    npa_block_view *scratch = NULL;
    size_t capacity = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        if (device >= 0 && i != device) continue;
        npa_device *d = npa_device_get(a, i, false);
        if (!d) continue;
        pthread_mutex_lock(&d->lock);
        bool complete = npa_visit_device_segments(d, visitor, arg, &scratch, &capacity);
        pthread_mutex_unlock(&d->lock);
        if (!complete) break;
    }
    free(scratch);
}
