/* The fake device behind the core's unit tests (see fake_backend.h). */
#include "fake_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef struct fake_fence {
    unsigned long long epoch;
    int polls;
    size_t stream_count;      /* a per-stream fence: these streams' events */
    uintptr_t streams[FAKE_STREAMS];
    unsigned long long stream_epochs[FAKE_STREAMS];
} fake_fence;

/* Fake addresses start high, 2 MiB aligned, with a gap between segments so a
 * merge across segments would show. */
#define FAKE_BASE 0x100000000000ULL
#define FAKE_ALIGN ((size_t)2 << 20)

void fake_init(fake_backend *f, size_t capacity, bool host_memory) {
    memset(f, 0, sizeof *f);
    pthread_mutex_init(&f->lock, NULL);
    f->capacity = capacity;
    f->host_memory = host_memory;
    f->next_addr = FAKE_BASE;
    atomic_init(&f->needs_fence, 1);
    for (int device = 0; device < NPUALLOC_MAX_DEVICES; device++) f->stats[device] = &f->default_stats[device];
}

void fake_destroy(fake_backend *f) {
    if (f->host_memory) {
        for (size_t i = 0; i < f->segment_count; i++) free(f->segments[i].ptr);
        for (size_t i = 0; i < sizeof f->reservations / sizeof *f->reservations; i++)
            if (f->reservations[i].ptr) munmap(f->reservations[i].ptr, f->reservations[i].size);
    }
    free(f->segments);
    free(f->pages);
    pthread_mutex_destroy(&f->lock);
}

/* Room for one more entry in a list of segments or pages. */
static bool reserve_entry(fake_segment **items, size_t count, size_t *capacity) {
    if (count < *capacity) return true;
    size_t cap = *capacity ? *capacity * 2 : 64;
    fake_segment *grown = realloc(*items, cap * sizeof *grown);
    if (!grown) return false;
    *items = grown;
    *capacity = cap;
    return true;
}

/* Lock held. Whether a raw malloc or a page map may take size bytes: an
 * injected failure, or a full device (207001), says no. */
static npa_error capacity_allows(fake_backend *f, int device, size_t size) {
    if (f->fail_next_mallocs > 0) {
        f->fail_next_mallocs--;
        return f->fail_malloc_error ? f->fail_malloc_error : NPA_ERR_OOM;
    }
    return size <= f->capacity - f->used[device] ? NPA_OK : NPA_ERR_OOM;
}

/* Under f->lock. */
static void note_stats_section(fake_backend *f, int device) {
    npualloc_device_stats *s = device >= 0 && device < NPUALLOC_MAX_DEVICES ? f->stats[device] : NULL;
    if (s && (__atomic_load_n(&s->seq, __ATOMIC_RELAXED) & 1)) f->calls_in_stats_section++;
}

static npa_error fake_malloc(void *ctx, int device, size_t size, void **ptr) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    f->raw_malloc_calls++;
    note_stats_section(f, device);
    npa_error err = capacity_allows(f, device, size);
    if (err == NPA_OK && !reserve_entry(&f->segments, f->segment_count, &f->segment_capacity)) err = NPA_ERR_OOM;
    void *p = NULL;
    if (err == NPA_OK) {
        if (f->host_memory) {
            if (posix_memalign(&p, 4096, size) != 0) err = NPA_ERR_OOM;
        } else {
            p = (void *)(uintptr_t)f->next_addr;
            f->next_addr += (size + FAKE_ALIGN - 1) / FAKE_ALIGN * FAKE_ALIGN + FAKE_ALIGN;
        }
    }
    if (err == NPA_OK) {
        f->segments[f->segment_count++] = (fake_segment){p, size, device};
        f->used[device] += size;
        *ptr = p;
    } else {
        f->raw_malloc_failures++;
    }
    pthread_mutex_unlock(&f->lock);
    return err;
}

static npa_error fake_free(void *ctx, int device, void *ptr) {
    fake_backend *f = ctx;
    npa_error err = NPA_ERR_FREE;
    pthread_mutex_lock(&f->lock);
    f->raw_free_calls++;
    note_stats_section(f, device);
    for (size_t i = 0; i < f->segment_count; i++) {
        if (f->segments[i].ptr != ptr || f->segments[i].device != device) continue;
        f->used[device] -= f->segments[i].size;
        if (f->host_memory) free(ptr);
        f->segments[i] = f->segments[--f->segment_count];
        err = NPA_OK;
        break;
    }
    if (err != NPA_OK) f->bad_frees++;
    pthread_mutex_unlock(&f->lock);
    return err;
}

static npa_error fake_synchronize(void *ctx, int device) {
    fake_backend *f = ctx;
    npa_error err = NPA_OK;
    pthread_mutex_lock(&f->lock);
    f->sync_calls++;
    note_stats_section(f, device);
    if (f->fail_next_syncs > 0) {
        f->fail_next_syncs--;
        err = 107002; /* ACL_ERROR_RT_CONTEXT_NULL: the device could not be entered */
    } else {
        f->completed_epoch = f->recorded_epoch;
    }
    pthread_mutex_unlock(&f->lock);
    return err;
}

static void fake_warn(void *ctx, const char *message) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    f->warnings++;
    snprintf(f->last_warning, sizeof f->last_warning, "%s", message);
    pthread_mutex_unlock(&f->lock);
}

static void fake_report_oom(void *ctx, int device, const char *message) {
    fake_backend *f = ctx;
    (void)device;
    pthread_mutex_lock(&f->lock);
    f->oom_reports++;
    snprintf(f->last_oom_report, sizeof f->last_oom_report, "%s", message);
    pthread_mutex_unlock(&f->lock);
}

static npa_error fake_mem_get_info(void *ctx, int device, size_t *free_bytes, size_t *total_bytes) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    bool fail = f->fail_next_mem_infos > 0;
    if (fail) f->fail_next_mem_infos--;
    *free_bytes = f->capacity - f->used[device];
    *total_bytes = f->capacity;
    pthread_mutex_unlock(&f->lock);
    return fail ? 107002 /* ACL_ERROR_RT_CONTEXT_NULL */ : NPA_OK;
}

void fake_set_eager(fake_backend *f, bool eager) {
    pthread_mutex_lock(&f->lock);
    f->eager = eager;
    atomic_store(&f->needs_fence, !eager);
    pthread_mutex_unlock(&f->lock);
}

/* A fence, or with the policy eager (and not always) none. */
static npa_error record_fence(fake_backend *f, int device, bool always, void **out) {
    fake_fence *fence = NULL;
    npa_error err = NPA_OK;
    pthread_mutex_lock(&f->lock);
    note_stats_section(f, device);
    if (f->fail_next_fences > 0) {
        f->fail_next_fences--;
        err = 107002;
    } else if (always || !f->eager) {
        fence = calloc(1, sizeof *fence);
        if (fence) {
            fence->epoch = ++f->recorded_epoch;
            f->fence_records++;
        }
    }
    pthread_mutex_unlock(&f->lock);
    *out = fence;
    return err;
}

static npa_error fake_fence_record(void *ctx, int device, void **out) { return record_fence(ctx, device, false, out); }

static npa_error fake_fence_record_always(void *ctx, int device, void **out) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    f->fence_records_always++;
    pthread_mutex_unlock(&f->lock);
    return record_fence(f, device, true, out);
}

static npa_error fake_fence_record_streams(void *ctx, int device, const uintptr_t *streams, size_t count,
                                           void **out) {
    fake_backend *f = ctx;
    *out = NULL;
    if (count > FAKE_STREAMS) return NPA_ERR_INVALID_PARAM;
    for (size_t i = 0; i < count; i++)
        if (streams[i] >= FAKE_STREAMS) return 107000; /* not a stream */
    fake_fence *fence = calloc(1, sizeof *fence);
    if (!fence) return NPA_ERR_OOM;
    pthread_mutex_lock(&f->lock);
    note_stats_section(f, device);
    if (f->fail_next_fences > 0) {
        f->fail_next_fences--;
        pthread_mutex_unlock(&f->lock);
        free(fence);
        return 107002;
    }
    fence->epoch = 0; /* done by its streams only */
    fence->stream_count = count;
    for (size_t i = 0; i < count; i++) {
        fence->streams[i] = streams[i];
        fence->stream_epochs[i] = ++f->stream_recorded[streams[i]];
    }
    f->stream_fence_records++;
    f->stream_events += (long)count;
    f->fence_records++; /* live fences count both kinds */
    pthread_mutex_unlock(&f->lock);
    *out = fence;
    return NPA_OK;
}

static int fake_fence_done(void *ctx, void *opaque) {
    fake_backend *f = ctx;
    fake_fence *fence = opaque;
    pthread_mutex_lock(&f->lock);
    f->fence_queries++;
    fence->polls++;
    int done = fence->epoch <= f->completed_epoch ||
               (f->auto_complete_polls > 0 && fence->polls >= f->auto_complete_polls);
    if (fence->stream_count > 0) {
        done = 1;
        for (size_t i = 0; i < fence->stream_count; i++)
            if (fence->stream_epochs[i] > f->stream_completed[fence->streams[i]]) done = 0;
    }
    pthread_mutex_unlock(&f->lock);
    return done;
}

static void fake_fence_release(void *ctx, void *fence) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    f->fence_releases++;
    pthread_mutex_unlock(&f->lock);
    free(fence);
}

static npa_error fake_va_reserve(void *ctx, int device, size_t size, void **base) {
    fake_backend *f = ctx;
    npa_error err = NPA_ERR_OOM;
    pthread_mutex_lock(&f->lock);
    f->va_reserves++;
    for (size_t i = 0; i < sizeof f->reservations / sizeof *f->reservations; i++) {
        fake_segment *r = &f->reservations[i];
        if (r->ptr) continue;
        void *p = (void *)(uintptr_t)f->next_addr;
        if (f->host_memory) p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        else f->next_addr += (size + FAKE_ALIGN - 1) / FAKE_ALIGN * FAKE_ALIGN + FAKE_ALIGN;
        if (p != MAP_FAILED) {
            *r = (fake_segment){p, size, device};
            *base = p;
            err = NPA_OK;
        }
        break;
    }
    pthread_mutex_unlock(&f->lock);
    return err;
}

static npa_error fake_va_release(void *ctx, int device, void *base) {
    fake_backend *f = ctx;
    npa_error err = NPA_ERR_FREE;
    pthread_mutex_lock(&f->lock);
    f->va_releases++;
    for (size_t i = 0; i < sizeof f->reservations / sizeof *f->reservations; i++) {
        fake_segment *r = &f->reservations[i];
        if (r->ptr != base || r->device != device) continue;
        if (f->host_memory) munmap(r->ptr, r->size);
        *r = (fake_segment){0};
        err = NPA_OK;
        break;
    }
    if (err != NPA_OK) f->bad_frees++;
    pthread_mutex_unlock(&f->lock);
    return err;
}

static npa_error fake_page_map(void *ctx, int device, void *addr, size_t size, void **handle) {
    fake_backend *f = ctx;
    pthread_mutex_lock(&f->lock);
    f->page_maps++;
    npa_error err = capacity_allows(f, device, size);
    if (err == NPA_OK && (!reserve_entry(&f->pages, f->page_count, &f->page_capacity) ||
                          (f->host_memory && mmap(addr, size, PROT_READ | PROT_WRITE,
                                                  MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED)))
        err = NPA_ERR_OOM;
    if (err == NPA_OK) {
        f->pages[f->page_count++] = (fake_segment){addr, size, device};
        f->used[device] += size;
        *handle = addr;
    }
    pthread_mutex_unlock(&f->lock);
    return err;
}

static npa_error fake_page_unmap(void *ctx, int device, void *addr, size_t size, void *handle) {
    fake_backend *f = ctx;
    npa_error err = NPA_ERR_FREE;
    pthread_mutex_lock(&f->lock);
    f->page_unmaps++;
    if (f->fail_after_unmaps == 0 && f->fail_next_unmaps > 0) { /* refused: stays mapped */
        f->fail_next_unmaps--;
        pthread_mutex_unlock(&f->lock);
        return NPA_ERR_FREE;
    }
    if (f->fail_after_unmaps > 0) f->fail_after_unmaps--;
    for (size_t i = 0; i < f->page_count && handle == addr; i++) {
        if (f->pages[i].ptr == addr && f->pages[i].size != size) break; /* not the size page_map was given */
        fake_segment *page = &f->pages[i];
        if (page->ptr != addr || page->device != device) continue;
        if (f->host_memory)
            mmap(addr, page->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        f->used[device] -= page->size;
        *page = f->pages[--f->page_count];
        err = NPA_OK;
        break;
    }
    if (err != NPA_OK) f->bad_frees++;
    pthread_mutex_unlock(&f->lock);
    return err;
}

/* Copies for npa_pause: plain memcpy, which faults on an unmapped page. */
static npa_error fake_copy(void *ctx, int device, void *dst, const void *src, size_t size) {
    fake_backend *f = ctx;
    (void)device;
    pthread_mutex_lock(&f->lock);
    f->copies++;
    pthread_mutex_unlock(&f->lock);
    memcpy(dst, src, size);
    return NPA_OK;
}

static npualloc_device_stats *fake_stats_storage(void *ctx, int device) {
    fake_backend *f = ctx;
    return f->stats[device];
}

static npualloc_thread_stats *fake_thread_stats_storage(void *ctx, int device) {
    fake_backend *f = ctx;
    return f->threads[device];
}

npa_backend fake_iface(fake_backend *f) {
    npa_backend b = {
        .ctx = f,
        .raw_malloc = fake_malloc,
        .raw_free = fake_free,
        .synchronize = fake_synchronize,
        .mem_get_info = fake_mem_get_info,
        .warn = fake_warn,
        .report_oom = fake_report_oom,
        .stats_storage = fake_stats_storage,
        .thread_stats_storage = fake_thread_stats_storage,
    };
    if (f->vmm) {
        b.va_reserve = fake_va_reserve;
        b.va_release = fake_va_release;
        b.page_map = fake_page_map;
        b.page_unmap = fake_page_unmap;
        if (f->host_memory) {
            b.copy_to_host = fake_copy;
            b.copy_to_device = fake_copy;
        }
    }
    if (f->fences) {
        b.fence_record = fake_fence_record;
        b.fence_record_always = fake_fence_record_always;
        if (f->answers_fence_needed) b.fence_needed = &f->needs_fence;
        b.fence_done = fake_fence_done;
        b.fence_release = fake_fence_release;
    }
    if (f->stream_fences) b.fence_record_streams = fake_fence_record_streams;
    return b;
}

void fake_complete_fences(fake_backend *f) {
    pthread_mutex_lock(&f->lock);
    f->completed_epoch = f->recorded_epoch;
    for (size_t i = 0; i < FAKE_STREAMS; i++) f->stream_completed[i] = f->stream_recorded[i];
    pthread_mutex_unlock(&f->lock);
}

void fake_complete_stream(fake_backend *f, uintptr_t stream) {
    pthread_mutex_lock(&f->lock);
    f->stream_completed[stream] = f->stream_recorded[stream];
    pthread_mutex_unlock(&f->lock);
}

long fake_live_fences(fake_backend *f) {
    pthread_mutex_lock(&f->lock);
    long live = f->fence_records - f->fence_releases;
    pthread_mutex_unlock(&f->lock);
    return live;
}

size_t fake_used(fake_backend *f, int device) {
    pthread_mutex_lock(&f->lock);
    size_t used = f->used[device];
    pthread_mutex_unlock(&f->lock);
    return used;
}
