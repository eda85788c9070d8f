/* The address arena of one device. Device memory is host memory at addresses
 * the sim hands out from one reserved range per device, so:
 *  - "is this a device pointer" is a range test,
 *  - the sim can read and write device memory (memcpy, ops) directly,
 *  - a freed block stays mapped: a late touch is detected, not a segfault,
 *    and the poison written on free is visible in whatever reads it.
 * Blocks are placed first-fit in a sorted segment table, so freed addresses
 * are reused as a real driver reuses them. The table costs O(blocks) per
 * operation, fine for the block counts an allocator test makes. */
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#define POISON_BYTE 0xDB
/* The base is aligned to the largest page (1 GiB, HUGE1G_ONLY), so aligning
 * an offset aligns the address. */
#define BASE_ALIGN (1ull << 30)
/* The reserved range is made read-write lazily, in steps this large. */
#define RW_STEP (64ull << 20)

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

int sim_arena_reserve(struct sim_arena *a, uint64_t size)
{
    /* PROT_NONE + NORESERVE costs no commit charge, whatever the overcommit policy. */
    char *raw = mmap(NULL, size + BASE_ALIGN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return -1;
    a->segs = malloc(16 * sizeof *a->segs);
    if (a->segs == NULL) {
        munmap(raw, size + BASE_ALIGN);
        return -1;
    }
    a->base = (char *)align_up((uint64_t)(uintptr_t)raw, BASE_ALIGN);
    a->size = size;
    a->mapped_rw = 0;
    a->cap = 16;
    a->nsegs = 1;
    a->segs[0] = (struct sim_segment){.off = 0, .len = size};
    return 0;
}

static int make_room(struct sim_arena *a, size_t extra)
{
    if (a->nsegs + extra <= a->cap)
        return 0;
    size_t cap = a->cap * 2;
    struct sim_segment *segs = realloc(a->segs, cap * sizeof *segs);
    if (segs == NULL)
        return -1;
    a->segs = segs;
    a->cap = cap;
    return 0;
}

static void insert_segment(struct sim_arena *a, size_t at, struct sim_segment seg)
{
    memmove(&a->segs[at + 1], &a->segs[at], (a->nsegs - at) * sizeof seg);
    a->segs[at] = seg;
    a->nsegs++;
}

static void remove_segment(struct sim_arena *a, size_t at)
{
    memmove(&a->segs[at], &a->segs[at + 1], (a->nsegs - at - 1) * sizeof *a->segs);
    a->nsegs--;
}

static int ensure_read_write(struct sim_arena *a, uint64_t end)
{
    if (end <= a->mapped_rw)
        return 0;
    uint64_t target = align_up(end, RW_STEP);
    if (target > a->size)
        target = a->size;
    if (mprotect(a->base + a->mapped_rw, target - a->mapped_rw, PROT_READ | PROT_WRITE) != 0)
        return -1;
    a->mapped_rw = target;
    return 0;
}

void *sim_arena_alloc(struct sim_arena *a, uint64_t len, uint64_t align, uint64_t requested, uint64_t accounted)
{
    if (make_room(a, 2) != 0)
        return NULL;
    for (size_t i = 0; i < a->nsegs; i++) {
        struct sim_segment seg = a->segs[i];
        if (seg.live)
            continue;
        uint64_t start = align_up(seg.off, align);
        if (start + len > seg.off + seg.len)
            continue;
        if (ensure_read_write(a, start + len) != 0)
            return NULL;
        struct sim_segment block = {.off = start, .len = len, .requested = requested, .accounted = accounted, .live = 1};
        uint64_t tail = seg.off + seg.len - (start + len);
        a->segs[i] = block;
        if (tail > 0)
            insert_segment(a, i + 1, (struct sim_segment){.off = start + len, .len = tail});
        if (start > seg.off)
            insert_segment(a, i, (struct sim_segment){.off = seg.off, .len = start - seg.off});
        return a->base + start;
    }
    return NULL;
}

long sim_arena_find(const struct sim_arena *a, const void *p)
{
    const char *c = p;
    if (a->base == NULL || c < a->base || c >= a->base + a->size)
        return -1;
    uint64_t off = (uint64_t)(c - a->base);
    size_t lo = 0, hi = a->nsegs;
    while (hi - lo > 1) {
        size_t mid = (lo + hi) / 2;
        if (a->segs[mid].off <= off)
            lo = mid;
        else
            hi = mid;
    }
    return (long)lo;
}

void sim_arena_release(struct sim_arena *a, long idx)
{
    struct sim_segment *seg = &a->segs[idx];
    char *start = a->base + seg->off;
    /* Poison a bounded head so stale reads show up as 0xDB; give the pages
     * past it back to the kernel (they read as zeros from now on). */
    size_t poison = seg->len < sim_config()->poison_bytes ? seg->len : sim_config()->poison_bytes;
    memset(start, POISON_BYTE, poison);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t drop_from = align_up((uint64_t)(uintptr_t)(start + poison), page);
    uint64_t drop_to = ((uint64_t)(uintptr_t)(start + seg->len)) / page * page;
    if (drop_to > drop_from)
        madvise((void *)(uintptr_t)drop_from, drop_to - drop_from, MADV_DONTNEED);

    seg->live = 0;
    seg->requested = seg->accounted = 0;
    if ((size_t)idx + 1 < a->nsegs && !a->segs[idx + 1].live) {
        seg->len += a->segs[idx + 1].len;
        remove_segment(a, (size_t)idx + 1);
    }
    if (idx > 0 && !a->segs[idx - 1].live) {
        a->segs[idx - 1].len += seg->len;
        remove_segment(a, (size_t)idx);
    }
}
