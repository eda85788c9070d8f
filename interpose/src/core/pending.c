/* Stream-safe reuse. Frees collect in an open batch; the next poll (every
 * malloc starts with one) records ONE fence covering the whole batch, so a
 * burst of frees costs one fence, and hands back every batch whose fence has
 * completed, without blocking. Pending blocks stay "active" in the stats. */
#include <stdlib.h>

#include "internal.h"

static void complete_blocks(npa_allocator *a, npa_device *d, npa_block *blocks) {
    npa_stats_begin(d);
    for (npa_block *b = blocks, *next; b; b = next) {
        next = b->link;
        b->link = NULL;
        d->stats->num_pending_frees--;
        npa_free_block(a, d, b);
    }
    npa_stats_end(d);
}

static void release_fence(npa_allocator *a, void *fence) {
    if (a->backend.fence_release) a->backend.fence_release(a->backend.ctx, fence);
}

/* Puts the open batch behind a fence; with no fence needed (eager, or the
 * backend synchronized instead) its blocks are handled at once. When the
 * backend could neither fence nor synchronize (the device cannot be entered)
 * or there is no memory for the batch record, the blocks stay pending in the
 * open batch: a stream may still use them, and the next poll tries again. */
static void close_open_batch(npa_allocator *a, npa_device *d) {
    void *fence = NULL;
    if (a->backend.fence_record(a->backend.ctx, d->id, &fence) != NPA_OK) return;
    if (!fence) {
        npa_block *blocks = d->open_batch;
        d->open_batch = NULL;
        complete_blocks(a, d, blocks);
        return;
    }
    npa_fence_batch *batch = d->spare_batches;
    if (batch) d->spare_batches = batch->next;
    else batch = malloc(sizeof *batch);
    if (!batch) {
        release_fence(a, fence);
        return;
    }
    batch->fence = fence;
    batch->blocks = d->open_batch;
    batch->next = NULL;
    d->open_batch = NULL;
    *d->batches_tail = batch;
    d->batches_tail = &batch->next;
}

/* Unlinks every batch that is done (or every batch, when all is set). */
static void drain_batches(npa_allocator *a, npa_device *d, bool all) {
    npa_fence_batch **link = &d->batches;
    while (*link) {
        npa_fence_batch *batch = *link;
        if (!all && !a->backend.fence_done(a->backend.ctx, batch->fence)) {
            link = &batch->next;
            continue;
        }
        *link = batch->next;
        release_fence(a, batch->fence);
        complete_blocks(a, d, batch->blocks);
        batch->next = d->spare_batches;
        d->spare_batches = batch;
    }
    d->batches_tail = link;
}

void npa_pending_poll(npa_allocator *a, npa_device *d) {
    if (d->open_batch) close_open_batch(a, d);
    if (d->batches) drain_batches(a, d, false);
}

void npa_pending_drain_all(npa_allocator *a, npa_device *d) {
    drain_batches(a, d, true);
    npa_block *blocks = d->open_batch;
    d->open_batch = NULL;
    complete_blocks(a, d, blocks);
}

bool npa_synchronize_and_drain(npa_allocator *a, npa_device *d) {
    /* A synchronize that failed proves nothing about queued work: the
     * pending blocks stay pending until a fence or a later synchronize says. */
    if (a->backend.synchronize(a->backend.ctx, d->id) != NPA_OK) return false;
    npa_stats_begin(d);
    d->stats->num_sync_all_streams++;
    npa_stats_end(d);
    npa_pending_drain_all(a, d);
    return true;
}
