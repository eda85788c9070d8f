/* Stats publication and the reset calls. Every mutation happens under the
 * device mutex inside an npa_stats_begin/end section (internal.h), so a reader
 * of the shared-memory copy sees seq odd, or a whole update. */
#include <string.h>

#include "device_figures.h"
#include "internal.h"

static npualloc_stat *stat_run(npualloc_device_stats *s) { return &s->allocation[0]; }

void npa_stats_init(npa_allocator *a, npa_device *d, size_t free_bytes) {
    npualloc_device_stats *s = d->stats;
    npa_stats_begin(d);
    __atomic_store_n(&s->in_use, 1, __ATOMIC_RELAXED);
    npa_stat_store(&s->max_split_size, npa_config_max_split_stat(&a->config));
    npa_stat_store(&s->device_free_bytes, (int64_t)free_bytes);
    npa_stat_store(&s->device_total_bytes, (int64_t)d->total_bytes);
    npa_stat_store(&s->reserved_limit_bytes, (int64_t)d->limit_bytes);
    npa_stats_end(d);
}

npa_error npa_stats_sample_device_memory(npa_allocator *a, npa_device *d, size_t *free_bytes, size_t *total_bytes) {
    size_t free_now = 0, total_now = 0;
    npa_error err = a->backend.mem_get_info(a->backend.ctx, d->id, &free_now, &total_now);
    if (err != NPA_OK) free_now = total_now = 0; /* the stats keep the last figure the runtime gave */
    else {
        npa_stats_begin(d);
        npa_stat_store(&d->stats->device_free_bytes, (int64_t)free_now);
        npa_stat_store(&d->stats->device_total_bytes, (int64_t)total_now);
        npa_stats_end(d);
        /* A device made while the runtime could not tell its size (a
         * thread without a context, a transient error) would otherwise run
         * a week without its cap, GC or expandable ranges. */
        if (d->total_bytes == 0 && total_now != 0) npa_device_size_known(a, d, total_now);
    }
    if (free_bytes) *free_bytes = free_now;
    if (total_bytes) *total_bytes = total_now;
    return err;
}

static void sample_on(npa_allocator *a, npa_device *d, void *arg) {
    (void)arg;
    npa_stats_sample_device_memory(a, d, NULL, NULL);
}

void npa_sample_device_memory(npa_allocator *a, int device) { npa_for_devices(a, device, sample_on, NULL); }

void npa_detach_stats_storage(npa_allocator *a) {
    if (!a) return;
    pthread_mutex_lock(&a->init_lock); /* device_create reads stats_storage under it */
    a->backend.stats_storage = NULL;
    a->backend.thread_stats_storage = NULL;
    for (int id = 0; id < NPUALLOC_MAX_DEVICES; id++) {
        npa_device *d = a->devices[id];
        if (!d) continue;
        npa_lock_acquire(&d->lock); /* every access to d->stats is made under it, with no section open */
        /* The threads' caches fold everything back first, their slots then
         * all zero: no fast path writes the storage left behind. */
        npa_tcaches_freeze(d);
        npa_stats_begin(d);
        npa_tcaches_fold_all(d);
        npa_stats_end(d);
        if (d->stats != &d->local_stats) {
            memcpy(&d->local_stats, d->stats, sizeof d->local_stats);
            d->stats = &d->local_stats;
        }
        /* The slots too, or npa_get_stats would read them in a region gone
         * (and the figures would lose their part). */
        if (d->threads != d->local_threads) {
            memcpy(d->local_threads, d->threads, sizeof d->local_threads);
            d->threads = d->local_threads;
        }
        npa_tcaches_point_slots(d);
        npa_tcaches_thaw(d);
        npa_lock_release(&d->lock);
    }
    pthread_mutex_unlock(&a->init_lock);
}

void npa_device_figures(npa_device *d, npualloc_device_stats *out) {
    /* Under the device lock its own figures hold still, and frozen so do
     * the slots (only their threads' fast paths write them without it): one
     * copy, exact, where their seqlocks would have this lock's holder retry
     * without bound while a thread hot in its fast path is inside at each
     * look. A slot whose owner's own fast path a signal handler interrupted
     * (frozen_without: the caller is its owner) is read as it stands.
     * Relaxed loads all the same: the figures are the storage's atomics. */
    npa_tcaches_freeze(d);
    npa_seqlock_copy_words(out, d->stats, sizeof *out);
    for (unsigned i = 0; i < NPUALLOC_THREAD_SLOTS; i++) {
        npualloc_thread_stats slot;
        npa_seqlock_copy_words(&slot, &d->threads[i], sizeof slot);
        npa_device_figures_add_slot(out, &slot);
    }
    npa_tcaches_thaw(d);
}

void npa_get_stats(npa_allocator *a, int device, npualloc_device_stats *out) {
    if (!out) return;
    npa_device *d = a ? npa_device_get(a, device, false) : NULL;
    if (!d) {
        memset(out, 0, sizeof *out);
        if (a) out->max_split_size = npa_config_max_split_stat(&a->config);
        return;
    }
    npa_lock_acquire(&d->lock);
    npa_device_figures(d, out);
    npa_lock_release(&d->lock);
    npualloc_stats_from_region(out);
}

void npa_reset_peak_stats(npa_allocator *a, int device) {
    npa_device *d = a ? npa_device_get(a, device, false) : NULL;
    if (!d) return;
    npa_lock_acquire(&d->lock);
    npa_stats_begin(d);
    npualloc_stat *run = stat_run(d->stats);
    for (size_t i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) npa_stat_store(&run[i].peak, run[i].current);
    npa_tcaches_freeze(d); /* the slots' stats: peak = the device's figure plus theirs */
    npa_tcaches_refit(d, true);
    npa_tcaches_thaw(d);
    npa_stats_end(d);
    npa_lock_release(&d->lock);
}

void npa_reset_accumulated_stats(npa_allocator *a, int device) {
    npa_device *d = a ? npa_device_get(a, device, false) : NULL;
    if (!d) return;
    npa_lock_acquire(&d->lock);
    npa_stats_begin(d);
    npualloc_device_stats *s = d->stats;
    npualloc_stat *run = stat_run(s);
    /* The slots' counts are zeroed with the device's (folded in, then
     * zeroed); their currents stay, and the device's current_at_reset
     * holds the whole figure, so the freed of the sum reads 0 too. */
    npa_tcaches_freeze(d);
    npa_tcaches_fold_accumulated(d);
    for (size_t i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++) { /* freed, implied, reads 0 from here */
        npa_stat_store(&run[i].allocated, 0);
        npa_stat_store(&run[i].current_at_reset, run[i].current);
    }
    npa_tcaches_add_slot_currents_at_reset(d);
    npa_tcaches_thaw(d);
    int64_t *const accumulated[] = {&s->num_alloc_retries, &s->num_ooms,         &s->num_sync_all_streams,
                                    &s->num_device_alloc,  &s->num_device_free,  &s->num_cache_hits,
                                    &s->num_cache_misses,  &s->num_foreign_frees, &s->num_invalid_frees};
    for (size_t i = 0; i < sizeof accumulated / sizeof *accumulated; i++) npa_stat_store(accumulated[i], 0);
    npa_stats_end(d);
    npa_lock_release(&d->lock);
}

void npa_count(npa_allocator *a, int device, npa_counter counter, int64_t delta, bool make) {
    npa_device *d = a ? npa_device_get(a, device, make) : NULL;
    if (!d) return;
    npa_lock_acquire(&d->lock);
    npa_stats_begin(d);
    switch (counter) {
    case NPA_COUNTER_EXECUTOR_DESTROYS_FORWARDED: npa_stat_add(&d->stats->num_executor_destroys_forwarded, delta); break;
    case NPA_COUNTER_EXECUTOR_DESTROYS_SKIPPED: npa_stat_add(&d->stats->num_executor_destroys_skipped, delta); break;
    }
    npa_stats_end(d);
    npa_lock_release(&d->lock);
}
