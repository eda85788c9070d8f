/* Pausing a whole process's device memory (`npualloc pause <pid>`): every
 * device is synchronized, every live block copied to host memory, and every
 * mapped page of every expandable segment unmapped and its physical memory
 * freed, with the addresses kept; resume maps new pages where pages were
 * and copies the blocks back. Between the two the allocator's table lock
 * and every device lock stay held, so any thread that enters the allocator
 * waits there until the resume.
 *
 * Only VMM-backed memory can be released at the same addresses: a process
 * with a plain segment cannot be paused (expandable_segments:True, from
 * the start, puts every block in expandable segments; switched on at run
 * time, the plain segments made before stay until their blocks are freed
 * and the cache emptied, which the pause does first). Nothing is lost: the
 * host backup is allocated and filled before anything is unmapped, a pause
 * that fails half way maps back what it unmapped (or, when it cannot, stays
 * paused with its backup, for a resume to finish), and a resume that cannot
 * map its pages unmaps what it mapped, keeps the backup and can be retried. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct npa_paused {
    char *backup;            /* every allocated block's bytes, in walk order */
    size_t backup_bytes;
    size_t unmapped_bytes;
    char *was_mapped;        /* per page of every expandable segment, in walk order */
    size_t page_total;
};

typedef enum { WALK_COUNT, WALK_BACKUP, WALK_RESTORE } walk_op;

/* Visits every allocated block of every expandable segment in one fixed
 * order (the locks keep it fixed between pause and resume): counts, copies
 * out or copies back. */
static npa_error walk_blocks(npa_allocator *a, npa_paused *p, walk_op op, char *why, size_t len) {
    size_t offset = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = a->devices[i];
        for (size_t k = 0; d && k < d->segments.count; k++) {
            if (!d->segments.items[k].expandable) continue;
            for (npa_block *b = d->segments.items[k].first; b; b = b->next) {
                if (b->phase != NPA_PHASE_ALLOCATED) continue; /* free or pending: nothing to keep */
                npa_error err = NPA_OK;
                if (op == WALK_BACKUP)
                    err = a->backend.copy_to_host(a->backend.ctx, d->id, p->backup + offset, (void *)b->addr, b->size);
                else if (op == WALK_RESTORE)
                    err = a->backend.copy_to_device(a->backend.ctx, d->id, (void *)b->addr, p->backup + offset,
                                                    b->size);
                if (err != NPA_OK) {
                    snprintf(why, len, "copying block %#lx of device %d %s failed (error %d)", (unsigned long)b->addr,
                             d->id, op == WALK_BACKUP ? "to the host" : "back", err);
                    return err;
                }
                offset += b->size;
            }
        }
    }
    p->backup_bytes = offset;
    return NPA_OK;
}

/* Every page of every expandable segment, in one fixed order (index counts them). */
typedef struct page_ref {
    npa_device *d;
    npa_expandable *es;
    size_t page, index;
} page_ref;
typedef npa_error (*page_fn)(npa_allocator *a, npa_paused *p, const page_ref *at, char *why, size_t len);

static npa_error each_page(npa_allocator *a, npa_paused *p, page_fn fn, char *why, size_t len) {
    page_ref at = {0};
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        if (!(at.d = a->devices[i])) continue;
        for (size_t k = 0; k < at.d->segments.count; k++) {
            if (!(at.es = at.d->segments.items[k].expandable)) continue;
            for (at.page = 0; at.page < at.es->page_count; at.page++, at.index++) {
                npa_error err = fn(a, p, &at, why, len);
                if (err != NPA_OK) return err;
            }
        }
    }
    return NPA_OK;
}

static void *page_addr(const page_ref *at) { return (void *)(at->es->base + at->page * at->es->page_size); }

static npa_error note_mapped(npa_allocator *a, npa_paused *p, const page_ref *at, char *why, size_t len) {
    (void)a, (void)why, (void)len;
    p->was_mapped[at->index] = at->es->pages[at->page] != NULL;
    p->unmapped_bytes += at->es->pages[at->page] ? at->es->page_size : 0;
    return NPA_OK;
}

/* Maps back a page that was mapped at the pause and is not now. */
static npa_error map_page(npa_allocator *a, npa_paused *p, const page_ref *at, char *why, size_t len) {
    void **handle = &at->es->pages[at->page];
    if (!p->was_mapped[at->index] || *handle) return NPA_OK;
    npa_error err = a->backend.page_map(a->backend.ctx, at->d->id, page_addr(at), at->es->page_size, handle);
    if (err != NPA_OK) {
        *handle = NULL;
        snprintf(why, len, "device %d has no room for its %zu-byte page at %p (error %d: another process may hold "
                 "the memory); the backup is kept, resume again once memory is free",
                 at->d->id, at->es->page_size, page_addr(at), err);
    }
    return err;
}

/* Unmaps a mapped page: every one at the pause, and at a failed resume the
 * ones it mapped (at the pause all were unmapped, so those are the mapped ones). */
static npa_error unmap_page(npa_allocator *a, npa_paused *p, const page_ref *at, char *why, size_t len) {
    (void)p;
    void **handle = &at->es->pages[at->page];
    if (!*handle) return NPA_OK;
    npa_error err = a->backend.page_unmap(a->backend.ctx, at->d->id, page_addr(at), at->es->page_size, *handle);
    if (err != NPA_OK) {
        snprintf(why, len, "unmapping %p on device %d failed (error %d)", page_addr(at), at->d->id, err);
        return err;
    }
    *handle = NULL;
    return NPA_OK;
}

/* All or none: a failure unmaps what this call mapped. */
static npa_error map_back(npa_allocator *a, npa_paused *p, char *why, size_t len) {
    npa_error err = each_page(a, p, map_page, why, len);
    if (err != NPA_OK) {
        char ignored[8];
        each_page(a, p, unmap_page, ignored, sizeof ignored);
    }
    return err;
}

static void unlock_all(npa_allocator *a) {
    for (int i = NPUALLOC_MAX_DEVICES - 1; i >= 0; i--) {
        npa_device *d = a->devices[i];
        if (!d) continue;
        npa_tcaches_set_paused(d, false); /* the threads' fast paths run again */
        npa_lock_release(&d->lock);
    }
    pthread_mutex_unlock(&a->init_lock);
}

static npa_error refuse(npa_allocator *a, npa_paused *p, npa_error err) {
    unlock_all(a);
    if (p) {
        free(p->backup);
        free(p->was_mapped);
        free(p);
    }
    return err;
}

npa_error npa_pause(npa_allocator *a, npa_paused **out, char *why, size_t len) {
    snprintf(why, len, "ok");
    if (!a->backend.page_map || !a->backend.copy_to_host || !a->backend.copy_to_device) {
        snprintf(why, len, "the runtime lacks the virtual memory or copy calls a pause needs");
        return NPA_ERR_INVALID_PARAM;
    }
    /* Frees waiting for their fence, and free pages, need no backup: hand them back first. */
    npa_error err = npa_empty_cache(a, -1);
    if (err != NPA_OK) {
        snprintf(why, len, "a device could not be synchronized (error %d)", err);
        return err;
    }
    /* Table lock first, so no thread creates a device meanwhile; then every device, ascending. */
    pthread_mutex_lock(&a->init_lock);
    size_t pages = 0, plain = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = a->devices[i];
        if (!d) continue;
        npa_lock_acquire(&d->lock);
        /* The blocks the threads' caches lent are backed up as live ones, and
         * no thread's fast path runs until the resume. */
        npa_tcaches_set_paused(d, true);
        for (size_t s = 0; s < d->segments.count; s++) {
            if (d->segments.items[s].expandable) pages += d->segments.items[s].expandable->page_count;
            else plain++;
        }
    }
    if (plain) {
        snprintf(why, len, "it holds %zu plain segment%s with live blocks, which cannot be released at the same "
                 "addresses (give it expandable_segments:True before they are made)", plain, plain == 1 ? "" : "s");
        return refuse(a, NULL, NPA_ERR_INVALID_PARAM);
    }
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        if (a->devices[i] && (err = a->backend.synchronize(a->backend.ctx, i)) != NPA_OK) {
            snprintf(why, len, "device %d could not be synchronized (error %d)", i, err);
            return refuse(a, NULL, err);
        }
    }
    npa_paused *p = calloc(1, sizeof *p);
    if (p) p->was_mapped = calloc(pages ? pages : 1, 1);
    if (!p || !p->was_mapped || walk_blocks(a, p, WALK_COUNT, why, len) != NPA_OK ||
        !(p->backup = malloc(p->backup_bytes ? p->backup_bytes : 1))) {
        snprintf(why, len, "no host memory for the backup (%zu bytes): nothing was paused", p ? p->backup_bytes : 0);
        return refuse(a, p, NPA_ERR_OOM);
    }
    if ((err = walk_blocks(a, p, WALK_BACKUP, why, len)) != NPA_OK) return refuse(a, p, err);
    each_page(a, p, note_mapped, why, len);
    if ((err = each_page(a, p, unmap_page, why, len)) != NPA_OK) {
        char ignored[8];
        if (map_back(a, p, ignored, sizeof ignored) == NPA_OK &&
            walk_blocks(a, p, WALK_RESTORE, ignored, sizeof ignored) == NPA_OK)
            return refuse(a, p, err);
        /* What it unmapped could not be mapped back (another process took
         * the memory meanwhile) or refilled: freeing the backup now would
         * lose the blocks. It stays paused with its backup instead, as
         * after a resume that found no room; npa_resume finishes the job. */
        each_page(a, p, unmap_page, ignored, sizeof ignored);
        size_t at = strlen(why);
        snprintf(why + at, len - at, "; what was unmapped could not be mapped back: it stays paused with its "
                 "backup, resume it");
        *out = p;
        return err;
    }
    *out = p;
    return NPA_OK;
}

void npa_paused_sample_device_memory(npa_allocator *a, const npa_paused *p) {
    (void)p; /* the proof that this thread holds every device lock */
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++)
        if (a->devices[i]) npa_stats_sample_device_memory(a, a->devices[i], NULL, NULL);
}

npa_error npa_resume(npa_allocator *a, npa_paused *p, char *why, size_t len) {
    snprintf(why, len, "ok");
    npa_error err = map_back(a, p, why, len);
    if (err == NPA_OK && (err = walk_blocks(a, p, WALK_RESTORE, why, len)) != NPA_OK)
        snprintf(why + strlen(why), len - strlen(why), "; the backup is kept, resume again");
    if (err != NPA_OK) {
        char ignored[8];
        each_page(a, p, unmap_page, ignored, sizeof ignored);
        return err;
    }
    npa_paused_sample_device_memory(a, p);
    return refuse(a, p, NPA_OK); /* unlock and free: the process runs on */
}

void npa_paused_bytes(const npa_paused *p, size_t *unmapped, size_t *backup) {
    *unmapped = p->unmapped_bytes;
    *backup = p->backup_bytes;
}
