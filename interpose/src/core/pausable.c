/* Pausing a whole process's device memory (`npualloc pause <pid>`): every
 * device is synchronized, every live block copied to host memory, and every
 * mapped page of every expandable segment unmapped and its physical memory
 * freed, with the addresses kept; resume maps new pages where pages were
 * and copies the blocks back. Between the two the allocator's table lock
 * and every device lock stay held, so any thread that enters the allocator
 * waits there until the resume.
 *
 * Only VMM-backed memory can be released at the same addresses: a process
 * with a plain segment cannot be paused (expandable_segments:True puts
 * every block in expandable segments). Nothing is lost: the host backup is
 * allocated and filled before anything is unmapped, a pause that fails half
 * way maps back what it unmapped, and a resume that cannot map its pages
 * unmaps what it mapped, keeps the backup and can be retried. */
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

static npa_expandable *const *expandables(const npa_device *d, npa_expandable *out[2]) {
    out[0] = d->small.expandable;
    out[1] = d->large.expandable;
    return out;
}

static npa_block *first_block(const npa_device *d, const npa_expandable *es) {
    return d->segments.items[npa_segments_find(&d->segments, es->base)].first;
}

/* Visits every allocated block of every expandable segment in one fixed
 * order (the locks keep it fixed between pause and resume): counts, copies
 * out or copies back. */
static npa_error walk_blocks(npa_allocator *a, npa_paused *p, walk_op op, char *why, size_t len) {
    size_t offset = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = a->devices[i];
        npa_expandable *es[2];
        for (int k = 0; d && k < 2; k++) {
            if (!expandables(d, es)[k]) continue;
            for (npa_block *b = first_block(d, es[k]); b; b = b->next) {
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

/* Maps back every page that was mapped at the pause and is not now; on a
 * failure unmaps what this call mapped (all or none). */
static npa_error map_back(npa_allocator *a, npa_paused *p, char *why, size_t len) {
    size_t index = 0;
    npa_error err = NPA_OK;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES && err == NPA_OK; i++) {
        npa_device *d = a->devices[i];
        npa_expandable *es[2];
        for (int k = 0; d && k < 2 && err == NPA_OK; k++) {
            if (!expandables(d, es)[k]) continue;
            for (size_t page = 0; page < es[k]->page_count && err == NPA_OK; page++, index++) {
                if (!p->was_mapped[index] || es[k]->pages[page]) continue;
                void *addr = (void *)(es[k]->base + page * es[k]->page_size);
                err = a->backend.page_map(a->backend.ctx, d->id, addr, es[k]->page_size, &es[k]->pages[page]);
                if (err != NPA_OK) {
                    es[k]->pages[page] = NULL;
                    snprintf(why, len, "device %d has no room for its %zu-byte page at %p (error %d: another "
                             "process may hold the memory); the backup is kept, resume again once memory is free",
                             d->id, es[k]->page_size, addr, err);
                }
            }
        }
    }
    return err;
}

/* Unmaps every mapped page (the pause) or, undoing a failed map_back, only
 * those that were paused. */
static npa_error unmap_all(npa_allocator *a, char *why, size_t len) {
    size_t index = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = a->devices[i];
        npa_expandable *es[2];
        for (int k = 0; d && k < 2; k++) {
            if (!expandables(d, es)[k]) continue;
            for (size_t page = 0; page < es[k]->page_count; page++, index++) {
                if (!es[k]->pages[page]) continue;
                void *addr = (void *)(es[k]->base + page * es[k]->page_size);
                npa_error err = a->backend.page_unmap(a->backend.ctx, d->id, addr, es[k]->pages[page]);
                if (err != NPA_OK) {
                    snprintf(why, len, "unmapping %p on device %d failed (error %d)", addr, d->id, err);
                    return err;
                }
                es[k]->pages[page] = NULL;
            }
        }
    }
    return NPA_OK;
}

static void unlock_all(npa_allocator *a) {
    for (int i = NPUALLOC_MAX_DEVICES - 1; i >= 0; i--)
        if (a->devices[i]) pthread_mutex_unlock(&a->devices[i]->lock);
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
        snprintf(why, len, "the process does not use VMM-backed memory (start it with expandable_segments:True)");
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
        pthread_mutex_lock(&d->lock);
        for (size_t s = 0; s < d->segments.count; s++) {
            if (d->segments.items[s].expandable) pages += d->segments.items[s].expandable->page_count;
            else plain++;
        }
    }
    if (plain) {
        snprintf(why, len, "it holds %zu plain segment%s, which cannot be released at the same addresses (start it "
                 "with expandable_segments:True)", plain, plain == 1 ? "" : "s");
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
    size_t index = 0;
    for (int i = 0; i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = a->devices[i];
        npa_expandable *es[2];
        for (int k = 0; d && k < 2; k++) {
            if (!expandables(d, es)[k]) continue;
            for (size_t page = 0; page < es[k]->page_count; page++, index++) {
                p->was_mapped[index] = es[k]->pages[page] != NULL;
                p->unmapped_bytes += es[k]->pages[page] ? es[k]->page_size : 0;
            }
        }
    }
    if ((err = unmap_all(a, why, len)) != NPA_OK) {
        char ignored[8];
        if (map_back(a, p, ignored, sizeof ignored) == NPA_OK) walk_blocks(a, p, WALK_RESTORE, ignored, sizeof ignored);
        return refuse(a, p, err);
    }
    *out = p;
    return NPA_OK;
}

npa_error npa_resume(npa_allocator *a, npa_paused *p, char *why, size_t len) {
    snprintf(why, len, "ok");
    npa_error err = map_back(a, p, why, len);
    if (err == NPA_OK && (err = walk_blocks(a, p, WALK_RESTORE, why, len)) != NPA_OK)
        snprintf(why + strlen(why), len - strlen(why), "; the backup is kept, resume again");
    if (err != NPA_OK) {
        char ignored[8];
        unmap_all(a, ignored, sizeof ignored);
        return err;
    }
    return refuse(a, p, NPA_OK); /* unlock and free: the process runs on */
}

void npa_paused_bytes(const npa_paused *p, size_t *unmapped, size_t *backup) {
    *unmapped = p->unmapped_bytes;
    *backup = p->backup_bytes;
}
