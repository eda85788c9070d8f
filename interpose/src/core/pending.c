/* Stream-safe reuse. Plain frees collect in an open batch; a poll (every
 * malloc starts with one) records ONE fence covering the whole batch once it
 * holds NPA_FENCE_BATCH_BLOCKS frees or a share of the reserved bytes, or at
 * once when a malloc would otherwise miss (npa_pending_flush), and hands
 * back every batch whose fence has completed, without blocking (after a
 * query that found a plain fence running, polls wait a back-off before they
 * ask again; a miss always asks). A fence costs a runtime call per live stream
 * (an event record: a task queued to the stream); shared by many frees it
 * costs a malloc+free pair little, and recording it later than the frees
 * only covers more work, never less.
 * Pending blocks stay "active" in the stats.
 * Two kinds of batch: plain blocks (the reuse policy's fence over every
 * stream) and stream blocks recorded on other streams (one event on each
 * of the streams their uses name). */
#include <stdlib.h>

#include "internal.h"

/* How many frees share a fence. Measured with make bench's hot path (safe,
 * frees in groups of 16, 2-core VM under load): 64 left the event records
 * dominant (3x eager); 256 held so much back that a warm cache missed (1% of
 * pairs in tests/test_demo_bench.py, one run in seven); 128 did neither. */
#define NPA_FENCE_BATCH_BLOCKS 128
/* And how many bytes: an open batch holds back at most a sixteenth of what
 * the device reserves (and at least 2 MiB, one large segment's worth).
 * Memory held back by an unfenced batch is memory the next miss must grow
 * by: a fixed 128 MiB let make demo's 72 MiB program reserve 260 MiB (19
 * raw mallocs) where 8 MiB gave 132 MiB (9), with the same step time; small
 * blocks still fill the 128-block batch first. */
#define NPA_FENCE_BATCH_MIN_BYTES ((size_t)2 << 20)
#define NPA_FENCE_BATCH_RESERVED_SHARE 16

/* How many mallocs a poll may skip the query after the oldest plain fence
 * was found not done: the skip doubles from 1 up to this at each such query
 * and ends when a fence completes. A fence on an idle stream completes within a
 * few mallocs and one on a busy stream takes thousands: querying at every
 * malloc cost make bench's fence path 0.85 queries per malloc (each a
 * runtime call that takes the runtime's lock its stream threads take). A
 * done batch waits at most this many mallocs more, and never at a miss
 * (npa_pending_flush asks at once), so no malloc grows the pool for it.
 * Stream events (USES batches) are asked at every poll, as torch's
 * process_events asks them: the stats count their blocks active until
 * then, and torch's stop counting them at the first malloc after. */
#define NPA_POLL_BACKOFF_MAX 64

/* num_pending_frees moves, and pending_any with it: the fast mallocs' one
 * look at the device (tcache.c), on a line nothing else writes. Release:
 * a fast malloc that reads it false, then (after an acquire fence) the
 * plain large pool's summary, sees the summary as this thread left it, the
 * blocks just completed in it (complete_blocks). */
static void count_pending(npa_device *d, int64_t delta) {
    npa_stat_add(&d->stats->num_pending_frees, delta);
    bool any = d->stats->num_pending_frees != 0;
    if (any != __atomic_load_n(&d->pending_any, __ATOMIC_RELAXED)) __atomic_store_n(&d->pending_any, any, __ATOMIC_RELEASE);
}

static bool batch_full(const npa_device *d) {
    if (d->open_blocks >= NPA_FENCE_BATCH_BLOCKS) return true;
    size_t share = (size_t)d->stats->reserved_bytes[NPUALLOC_POOL_ALL].current / NPA_FENCE_BATCH_RESERVED_SHARE;
    return d->open_bytes >= (share > NPA_FENCE_BATCH_MIN_BYTES ? share : NPA_FENCE_BATCH_MIN_BYTES);
}

/* Every block of the list becomes reusable: merged into its pool, or, with
 * whole set, the newest a recent cache's worth of them (the list is newest
 * first) held whole there, so the next mallocs of their sizes skip best
 * fit, split and merge as after an eager free. The rest go straight to the
 * pool: offered to the cache, each would only push out a block put there
 * just before. The drains that empty the cache (a synchronize) merge all.
 * A gone stream's block is never held: no malloc takes it, and merged it
 * lets its segment go back. The blocks merged go back oldest first, in the
 * order they were freed, as torch's process_events takes each stream's
 * events: which merges meet which neighbours free decides inactive_split's
 * peak and totals. */
static void complete_blocks(npa_allocator *a, npa_device *d, npa_block *blocks, bool whole) {
    npa_tcache *t = npa_tcache_mine(a, d->id); /* the polling thread's stock holds them */
    unsigned capacity = t ? t->stock.capacity : 0;
    unsigned offered = whole ? 0 : capacity;
    npa_block *merged = NULL; /* those not held, oldest first */
    int64_t completed = 0;
    npa_stats_begin(d);
    for (npa_block *b = blocks, *next; b; b = next) {
        next = b->link;
        b->link = NULL;
        free(b->uses);
        b->uses = NULL;
        b->uses_unknown = false;
        b->unknown_by = 0;
        b->fence_own = false;
        completed++;
        if (offered < capacity && b->pool->retired_by != NPA_STREAM_GONE && npa_tcache_keep(d, t, b, d->lending)) {
            offered++;
        } else {
            b->link = merged;
            merged = b;
        }
    }
    for (npa_block *b = merged, *next; b; b = next) {
        next = b->link;
        b->link = NULL;
        npa_free_block(a, d, b);
    }
    /* Not pending only now that they are in their pools: a fast malloc
     * that finds nothing pending weighs its held block against the plain
     * large pool's summary alone (tcache.c take_large), so a block between
     * the two counts must be there, or the summary's seq odd (a merge may
     * freeze the tcaches, and a fast malloc runs on meanwhile). */
    count_pending(d, -completed);
    npa_stats_end(d);
}

static void release_fence(npa_allocator *a, void *fence) {
    if (a->backend.fence_release) a->backend.fence_release(a->backend.ctx, fence);
}

/* Notes the streams a USES batch's fence waits on in the batch (its own
 * array, kept across recycling); unknown when host memory ran out. */
static void note_batch_streams(npa_fence_batch *batch, const uintptr_t *streams, size_t count) {
    if (count > batch->stream_capacity) {
        uintptr_t *grown = realloc(batch->streams, count * sizeof *grown);
        if (!grown) {
            batch->stream_count = NPA_STREAMS_UNKNOWN;
            return;
        }
        batch->streams = grown;
        batch->stream_capacity = count;
    }
    for (size_t i = 0; i < count; i++) batch->streams[i] = streams[i];
    batch->stream_count = count;
}

/* Puts the open list *open behind the fence just recorded (err, fence; for
 * a USES batch also the streams it waits on); with no fence needed (eager,
 * or the backend synchronized instead) its blocks are handled at once.
 * When the backend could neither fence nor synchronize (the device cannot
 * be entered) or there is no memory for the batch record, the blocks stay
 * pending in the open list: a stream may still use them, and the next poll
 * tries again. */
static void close_batch(npa_allocator *a, npa_device *d, npa_block **open, npa_error err, void *fence,
                        const uintptr_t *streams, size_t stream_count) {
    int kind = open == &d->open_uses ? NPA_BATCH_USES : NPA_BATCH_PLAIN;
    if (err != NPA_OK) return;
    if (!fence) {
        npa_block *blocks = *open;
        *open = NULL;
        complete_blocks(a, d, blocks, true);
        return;
    }
    npa_fence_batch *batch = d->spare_batches;
    if (batch) d->spare_batches = batch->next;
    else if ((batch = malloc(sizeof *batch))) *batch = (npa_fence_batch){.streams = NULL};
    if (!batch) {
        release_fence(a, fence);
        return;
    }
    batch->stream_count = 0;
    if (kind == NPA_BATCH_USES) note_batch_streams(batch, streams, stream_count);
    batch->fence = fence;
    batch->blocks = *open;
    batch->next = NULL;
    *open = NULL;
    *d->batches_tail[kind] = batch;
    d->batches_tail[kind] = &batch->next;
}

static void close_open_batch(npa_allocator *a, npa_device *d) {
    void *fence = NULL;
    npa_error err = d->open_gone && a->backend.fence_record_always
                        ? a->backend.fence_record_always(a->backend.ctx, d->id, &fence)
                        : a->backend.fence_record(a->backend.ctx, d->id, &fence);
    close_batch(a, d, &d->open_batch, err, fence, NULL, 0);
}

static void open_add(npa_device *d, npa_block **open, npa_block *b) {
    b->phase = NPA_PHASE_PENDING;
    b->link = *open;
    *open = b;
    count_pending(d, 1);
}

void npa_pending_add(npa_device *d, npa_block *b) {
    open_add(d, &d->open_batch, b);
    d->open_blocks++;
    d->open_bytes += b->size;
}

void npa_pending_add_gone(npa_device *d, npa_block *b) {
    npa_pending_add(d, b);
    d->open_gone++;
}

/* Blocks of streams are fenced at the next poll, as torch records their
 * events at the free: their fence names only the streams they were used on. */
void npa_pending_add_uses(npa_allocator *a, npa_device *d, npa_block *b) {
    (void)a;
    open_add(d, &d->open_uses, b);
}

/* Adds stream to d->fence_streams unless there; false when host memory ran out. */
static bool add_fence_stream(npa_device *d, size_t *count, uintptr_t stream) {
    size_t k = 0;
    while (k < *count && d->fence_streams[k] != stream) k++;
    if (k < *count) return true;
    if (*count == d->fence_streams_capacity) {
        size_t capacity = *count ? *count * 2 : 8;
        uintptr_t *grown = realloc(d->fence_streams, capacity * sizeof *grown);
        if (!grown) return false;
        d->fence_streams = grown;
        d->fence_streams_capacity = capacity;
    }
    d->fence_streams[(*count)++] = stream;
    return true;
}

/* The distinct streams the open uses name (and the own stream of blocks
 * written from the host), into d->fence_streams; false when one block's
 * uses are unknown or host memory ran out (a synchronize then stands in for
 * the fence). */
static bool collect_use_streams(npa_device *d, size_t *count) {
    *count = 0;
    for (npa_block *b = d->open_uses; b; b = b->link) {
        if (b->uses_unknown) return false;
        if (npa_block_fences_own(b) && !add_fence_stream(d, count, b->pool->stream)) return false;
        for (size_t i = 0; b->uses && i < b->uses->count; i++)
            if (!add_fence_stream(d, count, b->uses->streams[i])) return false;
    }
    return true;
}

/* One event on each stream the open uses name, for all of them at once. */
static void close_uses_batch(npa_allocator *a, npa_device *d) {
    void *fence = NULL;
    size_t count = 0;
    npa_error err;
    if (a->backend.fence_record_streams && collect_use_streams(d, &count))
        err = a->backend.fence_record_streams(a->backend.ctx, d->id, d->fence_streams, count, &fence);
    else if ((err = a->backend.synchronize(a->backend.ctx, d->id)) == NPA_OK) {
        /* Its own section, after the backend returned: a section open across
         * a backend call (a synchronize may take seconds) would keep seq odd
         * that long, and every reader of the region would find the stats
         * mid-update and give up. */
        npa_stats_begin(d);
        npa_stat_add(&d->stats->num_sync_all_streams, 1);
        npa_stats_end(d);
    }
    close_batch(a, d, &d->open_uses, err, fence, d->fence_streams, count);
}

/* Whether every stream of inner is among those of outer (unknown: all). */
static bool streams_within(const npa_fence_batch *inner, const npa_fence_batch *outer) {
    if (outer->stream_count == NPA_STREAMS_UNKNOWN) return true;
    if (inner->stream_count == NPA_STREAMS_UNKNOWN) return false;
    for (size_t i = 0; i < inner->stream_count; i++) {
        size_t k = 0;
        while (k < outer->stream_count && outer->streams[k] != inner->streams[i]) k++;
        if (k == outer->stream_count) return false;
    }
    return true;
}

/* At most this many unfinished USES batches a poll looks past (queries
 * per poll beyond the completed ones); the rest wait for the next poll. */
#define NPA_USES_BLOCKERS 8
/* And at most this many unfinished ones it walks past in all (asked or
 * not), so a poll never walks the whole queue a busy stream holds. */
#define NPA_USES_WALK 64

static void finish_batch(npa_allocator *a, npa_device *d, npa_fence_batch *batch, bool all) {
    release_fence(a, batch->fence);
    complete_blocks(a, d, batch->blocks, !all);
    batch->next = d->spare_batches;
    d->spare_batches = batch;
}

/* Unlinks every PLAIN batch that is done (or every one, when all is set),
 * oldest first; the first not done stops the queue: a later plain fence
 * covers the same streams (every live one) and was recorded after, so it
 * is not done either (and if it were, its blocks only wait one more poll).
 * One query. Sets the polls' back-off: none after a fence completed,
 * doubled after a query that found none. */
static void drain_plain(npa_allocator *a, npa_device *d, bool all) {
    bool completed = false;
    npa_fence_batch *batch;
    while ((batch = d->batches[NPA_BATCH_PLAIN]) && (all || a->backend.fence_done(a->backend.ctx, batch->fence))) {
        d->batches[NPA_BATCH_PLAIN] = batch->next;
        finish_batch(a, d, batch, all);
        completed = true;
    }
    if (!d->batches[NPA_BATCH_PLAIN]) d->batches_tail[NPA_BATCH_PLAIN] = &d->batches[NPA_BATCH_PLAIN];
    if (completed || !d->batches[NPA_BATCH_PLAIN]) d->poll_backoff = 0;
    else if (d->poll_backoff < NPA_POLL_BACKOFF_MAX) d->poll_backoff = d->poll_backoff ? 2 * d->poll_backoff : 1;
    d->polls_skipped = 0;
}

/* Unlinks every USES batch that is done (or every one, when all is set).
 * They name different streams each, so one waiting on a busy stream must
 * not hold back later ones whose streams are idle (torch keeps a queue of
 * events per stream "to avoid head-of-line delays", process_events): a
 * later batch is skipped unasked only when its streams include all those
 * of an earlier unfinished one (events on a stream complete in order, so
 * it is not done either), and asked otherwise. So it costs one query plus
 * one per distinct set of busy streams (at most NPA_USES_BLOCKERS), and
 * walks past at most NPA_USES_WALK unfinished batches. */
static void drain_uses(npa_allocator *a, npa_device *d, bool all) {
    npa_fence_batch *batch;
    const npa_fence_batch *blockers[NPA_USES_BLOCKERS];
    size_t blocker_count = 0;
    npa_fence_batch **link = &d->batches[NPA_BATCH_USES];
    size_t kept = 0;
    while ((batch = *link)) {
        if (!all && kept == NPA_USES_WALK) break;
        bool held = false;
        for (size_t i = 0; !all && !held && i < blocker_count; i++) held = streams_within(blockers[i], batch);
        if (!all && !held && blocker_count == NPA_USES_BLOCKERS) break; /* no query past the last blocker's */
        if (!held && (all || a->backend.fence_done(a->backend.ctx, batch->fence))) {
            *link = batch->next;
            finish_batch(a, d, batch, all);
            continue;
        }
        if (!held) blockers[blocker_count++] = batch;
        link = &batch->next;
        kept++;
    }
    if (!batch) d->batches_tail[NPA_BATCH_USES] = link; /* walked to the end: link ends the queue */
}

static void drain_batches(npa_allocator *a, npa_device *d, bool all) {
    drain_plain(a, d, all);
    drain_uses(a, d, all);
}

static void close_open(npa_allocator *a, npa_device *d, bool plain) {
    if (plain && d->open_batch) {
        close_open_batch(a, d);
        if (!d->open_batch) d->open_blocks = d->open_bytes = d->open_gone = 0;
    }
    if (d->open_uses) close_uses_batch(a, d);
}

void npa_pending_flush(npa_allocator *a, npa_device *d) {
    close_open(a, d, true);
    if (d->batches[NPA_BATCH_PLAIN] || d->batches[NPA_BATCH_USES]) drain_batches(a, d, false);
}

/* Plain fences are asked after the back-off; stream events at every poll,
 * as torch's malloc asks each stream's oldest event (process_events), so a
 * block whose streams have finished is inactive once the next malloc
 * returns, not up to NPA_POLL_BACKOFF_MAX mallocs later. */
void npa_pending_poll(npa_allocator *a, npa_device *d) {
    if (d->open_batch || d->open_uses) close_open(a, d, d->open_batch && batch_full(d));
    if (d->batches[NPA_BATCH_PLAIN]) {
        if (d->polls_skipped < d->poll_backoff) d->polls_skipped++;
        else drain_plain(a, d, false);
    }
    if (d->batches[NPA_BATCH_USES]) drain_uses(a, d, false);
}

/* After a synchronize: every pending free is safe. */
static void drain_all(npa_allocator *a, npa_device *d) {
    drain_batches(a, d, true);
    npa_block *blocks = d->open_batch;
    d->open_batch = NULL;
    complete_blocks(a, d, blocks, false);
    blocks = d->open_uses;
    d->open_uses = NULL;
    complete_blocks(a, d, blocks, false);
    d->open_blocks = d->open_bytes = d->open_gone = 0;
}

npa_error npa_synchronize_and_drain(npa_allocator *a, npa_device *d) {
    /* A synchronize that failed proves nothing about queued work: the
     * pending blocks stay pending until a fence or a later synchronize says. */
    npa_error err = a->backend.synchronize(a->backend.ctx, d->id);
    if (err != NPA_OK) return err;
    npa_stats_begin(d);
    npa_stat_add(&d->stats->num_sync_all_streams, 1);
    npa_stats_end(d);
    drain_all(a, d);
    return NPA_OK;
}
