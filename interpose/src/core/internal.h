/* The allocator core's internal types, shared by the files of interpose/src/core
 * (one concern each) and by the C unit tests. Nothing here is exported.
 *
 * Locking: every structure reached through an npa_device is guarded by that
 * device's lock (lock.h); the allocator-wide fields are immutable after
 * npa_create except the config's run-time keys (atomic: the GC threshold and
 * expandable_segments, set under init_lock; record_history; record_stacks)
 * and the device table (published once per device with release/acquire).
 * Order: the allocator's init_lock before a device's lock (record_history
 * and npa_detach_stats_storage take each under it; the GC threshold and expandable_segments setters take
 * no lock under it); one device lock at a time, never two, except npa_pause
 * (pausable.c), which holds init_lock and then every device lock, ascending,
 * until npa_resume; the backend is called with the device lock held and must
 * never call back into the core. The hook's full order is in hook/hook.h. */
#ifndef NPUALLOC_CORE_INTERNAL_H
#define NPUALLOC_CORE_INTERNAL_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core.h"
#include "lock.h"

/* torch's sizing constants (CUDACachingAllocator.cpp). */
#define NPA_MIN_BLOCK_SIZE ((size_t)512)
#define NPA_SMALL_SIZE ((size_t)1 << 20)
#define NPA_SMALL_BUFFER ((size_t)2 << 20)
#define NPA_MIN_LARGE_ALLOC ((size_t)10 << 20)
#define NPA_LARGE_BUFFER ((size_t)20 << 20)
#define NPA_ROUND_LARGE ((size_t)2 << 20)
#define NPA_MiB ((size_t)1 << 20)
/* Requests above this cannot be padded and rounded without overflow; no
 * device has that much memory, so they fail as OOM straight away. */
#define NPA_MAX_REQUEST ((size_t)1 << 60)

/* Where a block is in its life. A pending block was freed by the program but
 * may still be used by queued stream work: it is neither reusable nor
 * mergeable until its fence completes (torch's event-deferred free). An
 * unmapped block is address space of an expandable segment with no memory
 * behind it: in no pool, merged only with unmapped neighbours. A recent
 * block is held by a thread's cache (tcache.c): free and reusable, whole in
 * its stock (recent.c) instead of its pool, not merged until it leaves; or
 * lent out of the stock by a fast malloc, allocated but in no live map (the
 * fast paths never write a block's phase, which the device lock's holder
 * reads in its neighbours' merges). */
typedef enum npa_block_phase {
    NPA_PHASE_FREE = 0,
    NPA_PHASE_ALLOCATED = 1,
    NPA_PHASE_PENDING = 2,
    NPA_PHASE_UNMAPPED = 3,
    NPA_PHASE_RECENT = 4,
} npa_block_phase;

typedef struct npa_block npa_block;
typedef struct npa_pool npa_pool;
typedef struct npa_stream_set npa_stream_set;
struct npa_block {
    npa_block *left, *right; /* treap children while FREE (in a pool) */
    npa_block *prev, *next;  /* address neighbours inside the segment */
    npa_block *link;         /* hash chain while ALLOCATED, batch list while PENDING, slab list while unused */
    uintptr_t addr;
    size_t size;
    size_t requested;        /* caller's size while active, 0 while free */
    uint64_t age_base;       /* pool search count when it entered the pool (GC age) */
    npa_pool *pool;          /* the pool it belongs to: its size class and its stream */
    npa_stream_set *uses;    /* streams other than its own it was recorded on (npa_record_stream), or NULL */
    uint32_t priority;       /* treap heap key, derived from addr */
    uint8_t phase;           /* npa_block_phase */
    bool is_small;           /* small pool (2 MiB segments) */
    bool in_expandable;      /* part of an expandable segment */
    bool uses_unknown;       /* recorded on a stream that could not be noted (no host memory) or that
                              * was destroyed since (npa_stream_retire): its free waits for a synchronize */
    uint64_t unknown_by;     /* when uses_unknown: the destroy (token) that was its only cause, which
                              * settles it once the runtime returns; NPA_UNKNOWN_STAYS for any other */
    bool fence_own;          /* NPA_STREAM_HOST_WRITES: its free waits for an event on its own stream too
                              * (npa_block_fences_own: not once that stream's destroy began) */
};

#define NPA_UNKNOWN_STAYS UINT64_MAX

static inline bool npa_block_is_split(const npa_block *b) { return b->prev != NULL || b->next != NULL; }

/* An ordered set of free blocks keyed (size, addr): an intrusive treap whose
 * priorities hash the address, so no node is allocated and no RNG is shared. */
typedef struct npa_expandable npa_expandable;

/* The plain large pool's free blocks counted by size in 64 KiB buckets,
 * below 64 MiB, for the fast malloc (tcache.c take_large), which cannot walk
 * the pool without the device lock. Written only under the device lock
 * (npa_pool_insert and _remove, npa_summary_settle), read with atomics.
 * seq is odd from the first count a stats section changes to that
 * section's close: a reader that saw it even, and the same after its
 * counts, read the pool as some section left it, never half way through
 * a merge or split (a section closes under the hold of the lock that
 * opened it; a change outside any section leaves it odd until the next
 * close: the fast path declines meanwhile, which is only slower). On its
 * own lines (npa_device): every slow large malloc and free writes it.
 * Kept only while the device lends (the fast paths run: npa_tcaches_settle
 * starts and stops it), so that a lone thread's pool changes and section
 * closes skip it (the pool's summary pointer NULL, one test): stopped, seq
 * stays odd (parked) and the counts go stale; started, the counts are
 * rebuilt from the pool, seq odd, until the section's close. */
#define NPA_SUMMARY_SHIFT 16
#define NPA_SUMMARY_BUCKETS 1024
typedef struct npa_pool_summary {
    uint32_t seq;
    uint32_t counts[NPA_SUMMARY_BUCKETS];
} npa_pool_summary;

struct npa_pool {
    npa_block *root;
    npa_block *largest;      /* the maximum, kept for largest_free_block */
    bool *largest_moved;     /* its device's largest_moved, set when largest changes */
    npa_pool_summary *summary; /* the device's large_summary for its plain large pool while it lends, else NULL */
    uint64_t search_count;   /* best-fit searches so far: the GC clock */
    bool is_small;
    bool vmm_refused;        /* the device refused a reservation: plain segments from then on */
    /* Whose blocks these are (torch's block->stream). A plain pool serves
     * callers that name no stream (aclrtMalloc): its frees wait for the reuse
     * policy's fences. A stream's pool serves npa_malloc_stream on that
     * stream: a block freed there is reusable at once, since whatever the
     * stream runs next runs after the work that used it; only the streams
     * in its uses are fenced. Segments (and so blocks) never change pool. */
    bool on_stream;
    /* 0 while the stream lives; the token of the destroy that set the pool
     * aside (npa_stream_retire) while that destroy runs; NPA_STREAM_GONE
     * once it returned. A set-aside pool serves no allocation. Its blocks
     * freed once the stream is gone go back to the device as their
     * segments empty, after a fence (free_into_gone_pool). */
    uint64_t retired_by;
    uintptr_t stream;        /* the stream's handle when on_stream (the default stream may be 0) */
};

/* npa_pool.retired_by of a pool whose stream's destroy returned (tokens
 * count up from 1 and never reach it). */
#define NPA_STREAM_GONE UINT64_MAX

/* The stream a snapshot names for a pool's blocks and segments (torch's
 * block->stream): its stream, 0 for a plain pool or none. */
static inline uintptr_t npa_pool_stream(const npa_pool *pool) {
    return pool && pool->on_stream ? pool->stream : 0;
}

/* Whether b's free waits for an event on its own stream (host writes). Not
 * once the stream's destroy began: the destroy waits for that work itself,
 * and an event recorded on a destroyed stream's handle names nothing. */
static inline bool npa_block_fences_own(const npa_block *b) { return b->fence_own && !b->pool->retired_by; }

/* The small and large pool of one stream (or the plain pair), chained per
 * device. Blocks point at their pools, so a stream's pair is freed only
 * once no segment is left to it (an empty_cache, the stream's destroy). */
typedef struct npa_pool_pair npa_pool_pair;
struct npa_pool_pair {
    npa_pool small, large;
    npa_pool_pair *next;
};

/* The streams a block was recorded on besides its own (torch's stream_uses). */
struct npa_stream_set {
    size_t count, capacity;
    uintptr_t streams[];
};

void npa_pool_insert(npa_pool *pool, npa_block *b);
void npa_pool_remove(npa_pool *pool, npa_block *b);
/* The smallest block of at least size bytes (lowest address among equals). */
npa_block *npa_pool_lower_bound(const npa_pool *pool, size_t size);
/* The block after b in (size, addr) order, or NULL. */
npa_block *npa_pool_next(const npa_pool *pool, const npa_block *b);
/* The pool's summary s counts from now on, rebuilt from the pool's blocks
 * (seq odd: the section's close settles it), or no longer (seq odd until
 * a start). Under the device lock. */
void npa_pool_summary_start(npa_pool *pool, npa_pool_summary *s);
void npa_pool_summary_stop(npa_pool *pool, npa_pool_summary *s);

/* Live (allocated) blocks by start address: chained hash over block->link. */
typedef struct npa_block_map {
    npa_block **buckets;
    size_t mask;             /* bucket count - 1 (a power of two) */
    size_t count;
} npa_block_map;

bool npa_block_map_init(npa_block_map *map, size_t buckets);
void npa_block_map_destroy(npa_block_map *map);
/* Blocks start on 512-byte boundaries: drop those bits, then mix. */
static inline size_t npa_block_map_bucket(const npa_block_map *map, uintptr_t addr) {
    uint64_t h = ((uint64_t)addr >> 9) * 0x9e3779b97f4a7c15ULL;
    return (size_t)(h >> 32) & map->mask;
}
/* Doubles the table (left as it is when that memory cannot be had). */
void npa_block_map_grow(npa_block_map *map);
/* Inline: every slow malloc's, and it has two callers (alloc_found_block
 * and tcache.c's unlend), where LTO inlined main's one and left these a
 * call (17 instructions a pair by callgrind). */
static inline void npa_block_map_insert(npa_block_map *map, npa_block *b) {
    if (map->count > map->mask) npa_block_map_grow(map);
    size_t k = npa_block_map_bucket(map, b->addr);
    b->link = map->buckets[k];
    map->buckets[k] = b;
    map->count++;
}
/* Removes and returns the block starting at addr, or NULL. */
npa_block *npa_block_map_take(npa_block_map *map, uintptr_t addr);
/* The block starting at addr, left in the map, or NULL. */
npa_block *npa_block_map_find(const npa_block_map *map, uintptr_t addr);

/* Block structs come from per-device chunks so the hit path never calls malloc. */
typedef struct npa_slab {
    npa_block *free_list;
    void *chunks;            /* singly linked, freed at destroy */
} npa_slab;

npa_block *npa_slab_get(npa_slab *slab); /* NULL only when host memory is exhausted */
void npa_slab_put(npa_slab *slab, npa_block *b);
void npa_slab_destroy(npa_slab *slab);

/* Every device allocation of a device, sorted by address: tells an interior
 * pointer or a double free (inside a segment) from a foreign pointer. The
 * block at a segment's base is always the same struct (merges keep the lower
 * block), so `first` stays valid for the segment's life. */
typedef struct npa_segment {
    uintptr_t base;
    size_t size;             /* an expandable segment: its whole reserved range */
    npa_block *first;
    npa_expandable *expandable; /* NULL for a plain segment */
} npa_segment;

/* An expandable segment (expandable_segments:True): a reserved range of
 * address space of one pool (a pool reserves another when none has room),
 * with pages of physical memory mapped into it as the pool grows and
 * unmapped when they are free and memory is short. Its blocks tile the
 * range; unmapped stretches are NPA_PHASE_UNMAPPED blocks. */
struct npa_expandable {
    uintptr_t base;
    size_t page_size;        /* 2 MiB small pool, 20 MiB large pool (torch's segment sizes) */
    size_t page_count;       /* the range is page_size * page_count bytes */
    void **pages;            /* the backend's handle per page, NULL while unmapped */
};

typedef struct npa_segment_table {
    npa_segment *items;
    size_t count, capacity;
} npa_segment_table;

/* Frees received since the last fence, and batches waiting on their fence. */
typedef struct npa_fence_batch npa_fence_batch;
struct npa_fence_batch {
    void *fence;
    npa_block *blocks;       /* chained through block->link */
    npa_fence_batch *next;
    /* A USES batch: the streams its fence has an event on (kept with the
     * batch, reused when it is recycled), so a poll can tell which later
     * batches an unfinished one holds back (pending.c, drain_batches).
     * stream_count NPA_STREAMS_UNKNOWN: not noted (no host memory), read
     * as "every stream". */
    uintptr_t *streams;
    size_t stream_count, stream_capacity;
};
#define NPA_STREAMS_UNKNOWN SIZE_MAX

/* The two kinds of batch, each queued oldest first (pending.c). */
enum { NPA_BATCH_PLAIN, NPA_BATCH_USES, NPA_BATCH_KINDS };

/* One recorded allocator event (torch's TraceEntry). */
typedef struct npa_trace_entry {
    uintptr_t addr;          /* for an OOM: the device's free bytes, as torch */
    size_t size;
    int64_t time_us;         /* CLOCK_REALTIME, as torch's time_us */
    uintptr_t stream;        /* the stream of the pool the event's block is in, 0: a plain pool */
    uint8_t action;          /* npa_trace_action */
    bool stack_in_trace;     /* recorded under a record_context other than state: the trace entry shows the stack */
    uint32_t stack;          /* backend's capture_stack id, 0: none; with the two above in 8 bytes */
} npa_trace_entry;

/* The last `capacity` events of a device, oldest at (next - count). */
typedef struct npa_history {
    size_t capacity;         /* 0: recording off (the one field the hot path reads) */
    size_t next;             /* slot of the next event */
    size_t count;            /* events held, at most capacity */
    npa_trace_entry *entries;
} npa_history;

/* A block a tcache holds, with what its fast paths need to know of it, so
 * that they never touch the block's struct: its cache lines are shared with
 * its neighbours', which the device lock's holder rewrites (merges, the
 * pools' treaps). */
typedef struct npa_lent {
    uintptr_t addr;
    npa_block *block;
    size_t size;
    size_t requested;        /* the caller's, while lent (the block's own field says 0) */
    bool split;              /* npa_block_is_split when it entered the stock: a neighbour's merge rewrites
                              * prev and next under the device lock alone, but never whether a held block is split */
    bool is_small;           /* its pool's: which stock and which of the slot's pools (a small block may pass
                              * NPA_SMALL_SIZE by less than NPA_MIN_BLOCK_SIZE, so its size does not say) */
} npa_lent;

/* The recent cache (recent.c): small blocks freed with no fence needed,
 * kept whole for the next malloc of the same rounded size from the same
 * pool, so that pair skips the pool's search, split and merge. Each thread
 * has one per device, the stock of its tcache (below). At most capacity
 * blocks and NPA_RECENT_BYTES bytes, in no order (a slot's stamp says how
 * old it is). Guarded by its tcache's lock. */
#define NPA_RECENT_MAX 16
#define NPA_RECENT_BYTES NPA_SMALL_BUFFER
/* Every NPA_RECENT_JUDGED evictions: more than one in NPA_RECENT_EVICTED_SHARE
 * of the blocks put since the last verdict evicted unused, and the next
 * NPA_RECENT_BYPASS frees go straight to their pools (recent.c, evict). */
#define NPA_RECENT_JUDGED 32
#define NPA_RECENT_EVICTED_SHARE 8
#define NPA_RECENT_BYPASS 4096
/* A tcache's second stock holds plain large-pool blocks (tcache.c says
 * when): at most NPA_LARGE_STOCK_MAX blocks and NPA_LARGE_STOCK_BYTES
 * bytes a thread, chosen by make bench (README). */
#define NPA_LARGE_STOCK_MAX 8
#define NPA_LARGE_STOCK_BYTES ((size_t)32 << 20)
typedef struct npa_recent {
    unsigned capacity;       /* config recent_blocks, at most NPA_RECENT_MAX (the large stock: NPA_LARGE_STOCK_MAX) */
    unsigned count;
    size_t bytes;
    size_t largest;          /* the biggest block held, for largest_free_block */
    uint64_t clock;          /* puts so far: the next stamp */
    /* Whether holding pays (recent.c): the clock at the last verdict, the
     * blocks evicted unused since, and how many frees are still to go
     * straight to their pools after a verdict that it did not. */
    uint64_t judged_clock;
    unsigned evicted;
    unsigned bypass;
    bool unjudged;           /* the large stock: never bypassed (tcache.c, large_admits) */
    /* Scanned on every small malloc: kept apart from the rest, with one
     * slot past the last block for the scan's sentinel (npa_stock_take). */
    size_t sizes[NPA_RECENT_MAX + 1];
    npa_block *blocks[NPA_RECENT_MAX];
    uint64_t stamps[NPA_RECENT_MAX];
    /* What the fast paths know of each block without reading its struct
     * (npa_lent): kept only while the device lends (full moves, below), and
     * written for every held block when it begins to (npa_stock_index). */
    uintptr_t addrs[NPA_RECENT_MAX];
    const npa_pool *pools[NPA_RECENT_MAX];
    bool splits[NPA_RECENT_MAX];
} npa_recent;

#define NPA_LENT_MAX 48      /* then the fast malloc declines: scans stay short */

/* The stats a tcache's fast paths raise, in groups that share one ceiling:
 * the fast malloc's allocation and active (blocks), allocated_bytes and
 * active_bytes, requested_bytes (the first NPA_CEIL_MALLOC groups); the
 * fast free's inactive_split and inactive_split_bytes (a lent split block
 * it takes back is inactive again). */
enum { NPA_CEIL_BLOCKS, NPA_CEIL_BYTES, NPA_CEIL_REQUESTED, NPA_CEIL_SPLIT, NPA_CEIL_SPLIT_BYTES, NPA_CEILINGS };
#define NPA_CEIL_MALLOC 3
/* The entries a ceiling is kept for: the two pools (by index), then [ALL]. */
enum { NPA_CEIL_ALL = NPUALLOC_THREAD_POOL_COUNT, NPA_CEIL_ENTRIES };

/* A thread's cache on one device (tcache.c): its stock of free blocks (the
 * recent cache) and the blocks its fast paths lent out of it, served and
 * taken back without the device lock. What the fast paths change in the
 * stats goes to the thread's slot (npualloc_thread_stats), which readers
 * add to the device's figures; ceilings keep the sum under the device's
 * peaks (tcache.c says how). Lock: the owner takes it on its fast paths;
 * any other thread only while it holds the device lock. */
typedef struct npa_device npa_device;
typedef struct npa_tcache npa_tcache;
/* How far apart lines that different threads write must start: 128 bytes,
 * aarch64's coherence granule on several hosts and the pair of lines x86's
 * spatial prefetcher fetches together; 64 leaves two threads' hot lines in
 * one pair. A tcache, a device's thread slots and its pending_any line are
 * aligned to it. */
#define NPA_APART 128
struct npa_tcache {
    npa_lock lock;
    bool enabled;            /* fast paths allowed (the device's lending): written under the device lock and
                              * this lock, atomic (the fast paths look before taking the lock) */
    unsigned index;          /* in the device's tcaches and its thread slots */
    npa_device *device;
    const void *owner;       /* its thread's npa_my_caches: tells the owner apart (npa_tcaches_flush) */
    bool owner_gone;         /* its thread ended while the device was paused: the resume retires it
                              * (under the device's exit_lock) */
    const npa_config *config; /* the device's d->config, read here by the fast paths: the device's own
                               * field shares a cache line the device lock's holder writes */
    npualloc_thread_stats *slot;
    int64_t largest_published; /* the stocks' largest as the slot shows it */
    int64_t ceiling[NPA_CEIL_ENTRIES][NPA_CEILINGS]; /* the slot's current may rise to these, by pool
                                                      * and both together ([ALL]) */
    npa_recent stock;
    npa_recent large;        /* plain large-pool blocks, only while the fast paths run (tcache.c) */
    unsigned lent_count;
    npa_lent lent[NPA_LENT_MAX + 1]; /* lent_count of them, then the scan's sentinel (tcache.c) */
};

/* Lock order: hook/hook.h lists every lock of the library. For the core:
 * the tcache registry lock (tcache.c) and init_lock before any device lock,
 * one device lock at a time; under a device lock its tcaches' locks, in
 * index order (a freeze only tries the caller's own). A tcache's owner
 * takes its own lock on its fast paths with no device lock and never takes
 * one while holding it. A device's exit_lock is a leaf, taken under the
 * device lock or the registry lock. */
struct npa_device {
    npa_lock lock;           /* lock.h */
    int id;
    unsigned stats_depth;    /* nesting of open seqlock write sections */
    bool largest_moved;      /* a pool's largest block changed: largest_free_block is stale; or a freeze
                              * ends with the outermost section (freeze_at_close): the closing's slow way */
    bool gone_freed;         /* a block went back to a gone stream's pool: its segment may be free (release_gone_freed) */
    npa_history history;     /* beside the lock: in cache whenever the device is */
    npa_pool_pair plain;     /* callers that name no stream */
    npa_pool_pair *streams;  /* one pair per stream used through npa_malloc_stream, most recent first */
    /* The threads' caches (tcache.c) by slot index, NULL where none; R, the
     * sum of their ceilings (lending, below: whether their fast paths run). */
    npa_tcache *tcaches[NPUALLOC_THREAD_SLOTS];
    unsigned tcache_count;
    /* A pause holds the device lock until its resume (pausable.c): paused
     * changes under the lock and exit_lock too, so that a thread's exit,
     * which cannot have the lock meanwhile, reads it under exit_lock alone
     * and leaves its tcache for the resume (owner_gone, tcache.c's
     * leave_device) instead of waiting for it. exit_lock is a leaf. */
    bool paused;
    npa_lock exit_lock;
    /* Freezes (npa_tcaches_freeze) open, their locks taken at the first
     * (all but maybe the caller's own, frozen_without); an increase of
     * inactive_split that froze, to end with the outermost section (refit,
     * thaw); a freeze that must refit when it ends. */
    unsigned freeze_depth;
    npa_tcache *frozen_without; /* the caller's own, its lock held below it (npa_tcaches_freeze) */
    bool freeze_at_close;
    bool refit_due;
    uint64_t allocator_id;   /* npa_allocator.id: the calling thread's own tcache (tcache.c's own_tcache) */
    int64_t reserve[NPA_CEIL_ENTRIES][NPA_CEILINGS];
    npa_block_map live;
    npa_segment_table segments;
    npa_slab slab;
    npa_block *open_batch;   /* pending frees not yet covered by a fence */
    npa_block *open_uses;    /* frees of blocks with stream uses, not yet covered by their streams' fence */
    size_t open_blocks, open_bytes; /* in both open lists: when to close them (pending.c) */
    size_t open_gone;        /* blocks of gone streams' pools in open_batch: its fence is then fence_record_always */
    uintptr_t *fence_streams; /* scratch: the distinct streams of open_uses */
    size_t fence_streams_capacity;
    /* Fenced batches per kind, oldest first: PLAIN waits on the reuse
     * policy's fence, USES on the streams its blocks were used on. */
    npa_fence_batch *batches[NPA_BATCH_KINDS];
    npa_fence_batch **batches_tail[NPA_BATCH_KINDS];
    npa_fence_batch *spare_batches;
    unsigned poll_backoff;   /* polls to skip before the next query of a plain fence (pending.c) */
    unsigned polls_skipped;  /* polls since the last query of one */
    size_t total_bytes;      /* device capacity, from init or the first sample that told it (0: unknown) */
    size_t limit_bytes;      /* per_process_memory_fraction cap, 0: none (npa_set_memory_fraction changes it) */
    size_t allowed_bytes;    /* the cap, else total_bytes: what GC measures against and a new range is sized by */
    npualloc_device_stats *stats; /* backend storage or local_stats */
    npualloc_device_stats local_stats;
    npualloc_thread_stats *threads; /* its threads' NPUALLOC_THREAD_SLOTS slots: backend storage or local_threads */
    /* A slot's lines its thread's alone, by pairs (NPA_APART). */
    _Alignas(NPA_APART) npualloc_thread_stats local_threads[NPUALLOC_THREAD_SLOTS];
    const npa_backend *backend; /* the allocator's: its capture_stack names each recorded event's stack */
    const npa_config *config;   /* the allocator's: its record_context says whether the trace shows that stack */
    _Alignas(64) npa_pool_summary large_summary; /* plain.large's; lines of its own */
    /* num_pending_frees != 0, for the threads' fast mallocs (pending.c):
     * last, on a line pair of its own (the struct's size a multiple of
     * NPA_APART: nothing allocated after it shares the pair), written only
     * when it changes. */
    _Alignas(NPA_APART) bool pending_any;
    /* Whether the threads' fast paths run (npa_tcaches_settle: not paused, no
     * history, two threads or more); written under the lock, atomic. Every
     * malloc and free asks it first, a lone thread's one test for them
     * (malloc_on, block_op_any_device): on this line, which the fast malloc
     * reads anyway and the slow paths write only as pending_any changes. */
    bool lending;
};

struct npa_allocator {
    npa_backend backend;
    /* garbage_collection_threshold and expandable_segments: read and written
     * atomically; written under init_lock (npa_set_gc_threshold,
     * npa_set_expandable_segments), which takes no lock under it. */
    npa_config config;
    pthread_mutex_t init_lock;
    npa_device *devices[NPUALLOC_MAX_DEVICES];
    uint64_t retire_tokens; /* npa_stream_retire's, handed out atomically */
    bool has_divisions;     /* npa_config_has_divisions(&config), which no run-time key changes */
    uint64_t id;            /* unique in the process, never reused: what a thread's caches are keyed by */
    npa_allocator *next_live; /* the live allocators, under tcache.c's registry lock */
};

/* Whether a plain free made now waits for the reuse policy's fence. */
static inline bool npa_plain_fence_needed(const npa_allocator *a) {
    const atomic_int *needed = a->backend.fence_needed;
    return a->backend.fence_record && (!needed || atomic_load_explicit(needed, memory_order_seq_cst) > 0);
}

static inline bool npa_backend_has_vmm(const npa_backend *b) {
    return b->va_reserve && b->page_map && b->page_unmap && b->va_release;
}

/* expandable_segments as in force now: how a pool grows (oom.c). Written by
 * any thread at run time, read under the device lock; nothing is published
 * with it, so relaxed is enough. */
static inline bool npa_expandable_on(const npa_allocator *a) {
    return __atomic_load_n(&a->config.expandable_segments, __ATOMIC_RELAXED);
}

/* alloc.c */
npa_device *npa_device_create_slow(npa_allocator *a, int device);
/* The device's size, first known after its creation (the runtime could not
 * tell it then): the config's cap, GC and expandable ranges take it from now
 * on. Under the device lock, outside a stats section (a refused cap warns). */
void npa_device_size_known(npa_allocator *a, npa_device *d, size_t total_bytes);
/* Runs fn(a, d, arg) on one device (if it exists) or on every existing one
 * (device < 0), each under its lock, one at a time. */
void npa_for_devices(npa_allocator *a, int device, void (*fn)(npa_allocator *, npa_device *, void *), void *arg);

/* The device's state, created on first use when create is set; NULL for a
 * bad id (or no host memory). Inline: every malloc and free starts here. */
static inline npa_device *npa_device_get(npa_allocator *a, int device, bool create) {
    if (device < 0 || device >= NPUALLOC_MAX_DEVICES) return NULL;
    npa_device *d = __atomic_load_n(&a->devices[device], __ATOMIC_ACQUIRE);
    return d || !create ? d : npa_device_create_slow(a, device);
}
/* Completes a free: merges with free neighbours, returns it to its pool. */
void npa_free_block(npa_allocator *a, npa_device *d, npa_block *b);
/* The same for a block whose allocation ended earlier (a recent block,
 * already counted inactive): merges it into its pool. */
void npa_pool_return(npa_device *d, npa_block *b);
/* Joins upper into lower, its address neighbour: the lower struct survives,
 * so a segment's first block keeps its struct. Neither is in a pool. */
void npa_block_absorb(npa_device *d, npa_block *lower, npa_block *upper);
double npa_gc_threshold(const npa_allocator *a);

/* recent.c: a tcache's stock. Under its lock; with the device lock too
 * where a block enters or goes back to its pool. */
/* Whether a block the program frees now, reusable at once, waits in the
 * stock: a small block, unless the cache is bypassed for now (this free is
 * then one of the bypass's). */
static inline bool npa_recent_admits(npa_recent *r, const npa_block *b) {
    if (r->capacity == 0 || !b->is_small || b->in_expandable || b->size > NPA_RECENT_BYTES) return false;
    if (__builtin_expect(r->bypass == 0, 1)) return true;
    r->bypass--;
    return false;
}
/* Whether b fits without an eviction, in the small stock or the large. */
static inline bool npa_stock_has_room(const npa_recent *r, size_t size, bool is_small) {
    return r->count < r->capacity && r->bytes + size <= (is_small ? NPA_RECENT_BYTES : NPA_LARGE_STOCK_BYTES);
}
/* Returns the oldest held blocks to their pools until a block of size fits. */
void npa_stock_make_room(npa_device *d, npa_recent *r, size_t size, bool is_small);
/* Every move below takes full: whether it keeps the fast paths' arrays
 * (addrs, pools, splits), which only a device that lends needs; a lone
 * thread's hit path leaves them (10 instructions a pair by callgrind). */
/* The slot's largest_held set to the stock's largest, which changed: in a
 * slot section of its own (tcache.c). */
void npa_tcache_publish_largest(npa_tcache *t);
/* The tcache whose small stock r is (a move not full is a lone thread's, on its small stock). */
static inline npa_tcache *npa_stock_owner(npa_recent *r) {
    return (npa_tcache *)((char *)r - offsetof(npa_tcache, stock));
}
/* Unlinks slot i; the last slot moves into it. Inlined into every caller:
 * on the hit path (npa_stock_take) a call would cost more than its body.
 * Not full, the caller is a lone thread's slow path, and its slot learns
 * the stock's largest here when it changed (the others publish it
 * themselves, in their own sections). */
static NPA_ALWAYS_INLINE npa_block *npa_stock_remove_at(npa_recent *r, unsigned i, bool full) {
    npa_block *b = r->blocks[i];
    size_t size = r->sizes[i];
    unsigned last = --r->count;
    r->sizes[i] = r->sizes[last];
    r->blocks[i] = r->blocks[last];
    r->stamps[i] = r->stamps[last];
    if (full) {
        r->addrs[i] = r->addrs[last];
        r->pools[i] = r->pools[last];
        r->splits[i] = r->splits[last];
    }
    r->bytes -= size;
    if (size == r->largest) {
        r->largest = 0;
        for (unsigned k = 0; k < r->count; k++)
            if (r->sizes[k] > r->largest) r->largest = r->sizes[k];
        if (!full) npa_tcache_publish_largest(npa_stock_owner(r));
    }
    return b;
}
/* Holds the block of held (of pool), whose allocation ended already. */
static NPA_ALWAYS_INLINE void npa_stock_hold(npa_recent *r, const npa_lent *held, const npa_pool *pool, bool full) {
    size_t size = held->size;
    r->sizes[r->count] = size;
    r->blocks[r->count] = held->block;
    r->stamps[r->count] = r->clock++;
    if (full) {
        r->addrs[r->count] = held->addr;
        r->pools[r->count] = pool;
        r->splits[r->count] = held->split;
    }
    r->count++;
    r->bytes += size;
    if (size > r->largest) {
        r->largest = size;
        if (!full) npa_tcache_publish_largest(npa_stock_owner(r)); /* as npa_stock_remove_at */
    }
}
/* A held block of pool of exactly size bytes, out of the stock (still
 * counted inactive, as a block out of a pool), into *held; false when none.
 * The size searched for is written past the last block, so the scan stops
 * on it without testing the bound at each slot (half the instructions of
 * the hit path's longest loop); finding it there means no block matched.
 * Inline, as npa_stock_put below, for the slow path's hit and the fast
 * malloc alike (recent.c says why). */
/* Not full, only held->block is set. */
static NPA_ALWAYS_INLINE bool npa_stock_take(npa_recent *r, const npa_pool *pool, size_t size, npa_lent *held,
                                             bool full) {
    r->sizes[r->count] = size;
    for (unsigned i = 0;; i++) {
        if (r->sizes[i] != size) continue;
        if (i == r->count) return false;
        if (full ? r->pools[i] == pool : r->blocks[i]->pool == pool) {
            if (full) *held = (npa_lent){.addr = r->addrs[i], .size = size, .split = r->splits[i], .is_small = true};
            held->block = npa_stock_remove_at(r, i, full);
            return true;
        }
    }
}
/* The fast paths' arrays written for every held block: the device begins
 * to lend. Device lock held. */
static inline void npa_stock_index(npa_recent *r) {
    for (unsigned i = 0; i < r->count; i++) {
        const npa_block *b = r->blocks[i];
        r->addrs[i] = b->addr;
        r->pools[i] = b->pool;
        r->splits[i] = npa_block_is_split(b);
    }
}
/* Ends b's allocation into the stock (making room first), counted in the
 * device's stats as a free to the pool would count it. Device lock held,
 * inside a stats section: below, beside the stats helpers. */
static NPA_ALWAYS_INLINE void npa_stock_put(npa_device *d, npa_tcache *t, npa_block *b, bool full);
/* The large stock's put (recent.c): always full, the large stock holding
 * blocks only while the device lends. Out of line: inlined beside the
 * small one, it cost the small one's callers their inlining. */
void npa_stock_put_large(npa_device *d, npa_recent *r, npa_block *b);
/* The large stock's rule, torch's best fit for a block it hands out whole
 * (should_split: what is left not above NPA_SMALL_SIZE): the first held
 * block in the pool's order (size, then address) of at least size bytes
 * and at most NPA_SMALL_SIZE more that comes before (before_size,
 * before_addr) in that order (the pool's own best fit, which torch's one
 * search would weigh the held blocks against), out of the stock into
 * *held; false when none. Its blocks are all below max_split_size
 * (npa_tcache_keep), so none is split at or above it. */
bool npa_stock_take_fit(npa_recent *r, size_t size, size_t before_size, uintptr_t before_addr, npa_lent *held);
/* The fast malloc's two halves of it: the index of the smallest such block
 * of at most most bytes (the lowest address among equals), r->count when
 * none; then that block out into *held. */
unsigned npa_stock_find_fit(const npa_recent *r, size_t size, size_t most);
void npa_stock_take_at(npa_recent *r, unsigned at, npa_lent *held);
/* Every held block back to its pool (merged). Device lock held. */
void npa_stock_flush(npa_device *d, npa_recent *r);
/* Its oldest block (there is one) back to its pool. Device lock held. */
void npa_stock_return_oldest(npa_device *d, npa_recent *r);

/* tcache.c */
/* The calling thread's caches, for one allocator at a time (tests make
 * several): read on every call, at a fixed offset from the thread pointer. */
typedef struct npa_thread_caches {
    uint64_t allocator;      /* npa_allocator.id, 0: none */
    unsigned refused;        /* devices with no slot left for this thread: bit per device */
    npa_tcache *of_device[NPUALLOC_MAX_DEVICES];
} npa_thread_caches;
extern __thread __attribute__((tls_model("initial-exec"))) npa_thread_caches npa_my_caches;

/* The calling thread's tcache on device of the allocator whose id is
 * allocator_id, or NULL (no lookup of anything shared). */
static inline npa_tcache *npa_thread_tcache(uint64_t allocator_id, int device) {
    return npa_my_caches.allocator == allocator_id ? npa_my_caches.of_device[device] : NULL;
}
static inline npa_tcache *npa_tcache_mine(const npa_allocator *a, int device) { return npa_thread_tcache(a->id, device); }
/* The calling thread's tcache on device when its fast paths run (two
 * threads or more there, npa_tcaches_settle), else NULL: asked before the
 * size is rounded, which a lone thread's slow path does anyway. */
static inline npa_tcache *npa_tcache_serving(const npa_allocator *a, int device) {
    npa_tcache *t = npa_tcache_mine(a, device);
    return t && __atomic_load_n(&t->enabled, __ATOMIC_RELAXED) ? t : NULL;
}
/* npa_tcache_mine, made on the thread's first malloc on the device when
 * the config keeps a recent cache. No device lock held. */
npa_tcache *npa_tcache_get(npa_allocator *a, npa_device *d);
/* npa_create and npa_destroy: the registry of live allocators. */
void npa_tcache_register_allocator(npa_allocator *a);
void npa_tcache_unregister_allocator(npa_allocator *a);
/* The fast paths (no device lock): true when done, false to take the slow path. */
bool npa_tcache_malloc(npa_tcache *t, size_t rounded, size_t requested, void **ptr);
bool npa_tcache_free(const npa_allocator *a, npa_tcache *t, uintptr_t addr); /* addr not 0 */
/* With the device lock, t the calling thread's own: its slow malloc's figures
 * taken out of t's headroom (as far as it goes), and its slow free's given
 * back to it (no more than the free released, as far as the peaks leave). */
void npa_tcache_borrow(npa_device *d, npa_tcache *t, bool is_small, int64_t count, int64_t bytes,
                       int64_t requested);
void npa_tcache_regrant(npa_device *d, npa_tcache *t, bool is_small, int64_t count, int64_t bytes,
                        int64_t requested);
/* With the device lock: a block some thread's cache lent, at addr, handed
 * back to the device (counted there, in the live map), or NULL. */
npa_block *npa_tcaches_reclaim(npa_device *d, uintptr_t addr);
/* With the device lock: every stock back to the pools (lent blocks stay);
 * false when every stock was empty. */
enum { NPA_FLUSH_SMALL = 1, NPA_FLUSH_LARGE = 2 };
bool npa_tcaches_flush_some(npa_device *d, unsigned which); /* the small stocks, the large or both */
static inline bool npa_tcaches_flush(npa_device *d) { return npa_tcaches_flush_some(d, NPA_FLUSH_SMALL | NPA_FLUSH_LARGE); }
/* Frozen, while the fast paths run: one held block of which's stocks (a
 * single class) back to its pool, the oldest of the stock that holds the
 * most bytes; false when they are all empty. */
bool npa_tcaches_return_one(npa_device *d, unsigned which);
/* With the device lock, t the calling thread's own (its lock not taken:
 * tcache.c): the slow path's moves of t's stock. A held block of pool of
 * exactly size bytes (of the plain large pool, npa_stock_take_fit's, which
 * must come before rival, the pool's best fit, or NULL: none), or NULL:
 * *lent when it went to the caller (for requested bytes) as a fast
 * malloc's would, raising t's ceilings within the peaks' slack if need be;
 * else counted inactive still, as a block out of a pool. npa_tcache_keep:
 * b, freed now, kept in the stock if it admits it (false: not kept). */
npa_block *npa_tcache_take(npa_device *d, npa_tcache *t, const npa_pool *pool, size_t size, size_t requested,
                           const npa_block *rival, bool *lent);
static NPA_ALWAYS_INLINE bool npa_tcache_keep(npa_device *d, npa_tcache *t, npa_block *b, bool lending); /* below */
/* While the device lends, a slow malloc's block b found in a pool, to be
 * cut to kept bytes, lent to t as its stock's would be (alloc.c): whether
 * t's stock would take it back from a free, and t's ceilings allow its
 * lend (raised within the peaks' slack if need be); then, cut, b lent for
 * requested bytes, room made in the stock for its return. Device lock. */
bool npa_tcache_lends_found(npa_device *d, npa_tcache *t, const npa_block *b, size_t kept, size_t requested);
void npa_tcache_lend_found(npa_device *d, npa_tcache *t, npa_block *b, size_t requested);
/* npa_tcache_keep's large part (tcache.c, out of line): b kept in t's large
 * stock if it may hold it (only while the device lends). */
bool npa_tcache_keep_large(npa_device *d, npa_tcache *t, npa_block *b);
/* With the device lock: every lent block back to the device too, the
 * stock flushed, the fast paths on or off as the device says (history,
 * pause): a pause and record_history. */
void npa_tcaches_settle(npa_device *d);
/* A pause's start and end (pausable.c), device lock held: paused as the
 * exits read it (exit_lock), then settled; the end first retires the
 * tcaches of threads that ended meanwhile (owner_gone). */
void npa_tcaches_set_paused(npa_device *d, bool paused);
/* Freeze: every tcache's lock, in index order (their fast paths stop);
 * the caller's own only tried (tcache.c). Nested freezes take them once;
 * the last thaw gives them back, after a refit when an increase of
 * inactive_split passed the ceilings meanwhile (npa_split_past_peak). */
void npa_tcaches_freeze(npa_device *d);
void npa_tcaches_thaw(npa_device *d);
/* The stats' closing: a freeze that an increase of inactive_split began
 * ends with the outermost section (refit, then thaw). */
void npa_tcaches_thaw_at_close(npa_device *d);
/* With the device lock, in a stats section, the fast paths running: a
 * slow path's increase of inactive_split or its bytes (already counted)
 * passed the device's own figure of a peak. It stays if device.current + R
 * is still within the peaks; else the calling thread's own headroom is
 * used first, else every tcache freezes until the outermost section ends,
 * the peaks raised to the exact sum meanwhile (tcache.c). */
__attribute__((noinline, cold)) void npa_split_past_peak(npa_device *d, bool is_small);
/* Whether a slow-path malloc of pool may add count blocks of bytes
 * (requested) to the device's stats with every ceiling kept under the
 * peaks; when not, it freezes, adds, then npa_tcaches_refit. */
bool npa_tcaches_fit(const npa_device *d, bool is_small, int64_t count, int64_t bytes, int64_t requested);
/* Frozen, in a stats section: the peaks of the slots' stats rise to the
 * device's figure plus the slots' (reset: set to it); in each entry whose
 * peaks no longer cover the ceilings (every entry, for a reset) they shrink
 * to their slots' figures and what the peaks leave is shared out again
 * (none while the fast paths are off). */
void npa_tcaches_refit(npa_device *d, bool reset);
/* Frozen, in a stats section: the slots' allocated counts and cache hits
 * go to the device's, for a reset of the accumulated counts. */
void npa_tcaches_fold_accumulated(npa_device *d);
/* Frozen, in a stats section: each slot's current added to the device's
 * current_at_reset, so that the sum's freed reads 0 after a reset. */
void npa_tcaches_add_slot_currents_at_reset(npa_device *d);
/* Frozen, in a stats section: every lent block, stock and count of every
 * tcache folded into the device's figures, so that every slot is zero. */
void npa_tcaches_fold_all(npa_device *d);
/* Frozen: each tcache's slot is its index's in d->threads again (moved). */
void npa_tcaches_point_slots(npa_device *d);
/* At destroy: every tcache folded back and freed. */
void npa_tcaches_destroy(npa_device *d);
/* The lent block at addr of any tcache of the device, or NULL: frozen. */
const npa_lent *npa_tcaches_find_lent(const npa_device *d, uintptr_t addr);

/* sizes.c */
/* Whether some interval of config has roundup_power2_divisions above 1. */
bool npa_config_has_divisions(const npa_config *config);
/* npa_round_size, told npa_config_has_divisions(config): without divisions
 * only the 512-byte rounding applies. The allocator knows it from its start
 * (a->has_divisions), and torch's default has none: looking up the size's
 * interval cost each malloc 11 instructions for nothing (callgrind, make
 * bench's hot path). */
size_t npa_round_size_as(const npa_config *config, bool has_divisions, size_t size);
size_t npa_segment_size(size_t rounded);

/* segment.c: raw device memory in and out; call with no stats section open,
 * the backend may take long. */
/* The new entry (valid until the table changes again), or NULL. */
npa_segment *npa_segments_add(npa_segment_table *t, uintptr_t base, size_t size, npa_block *first);
void npa_segments_remove(npa_segment_table *t, size_t index);
/* Index of the segment containing addr, or -1. */
ptrdiff_t npa_segments_find(const npa_segment_table *t, uintptr_t addr);
/* Why a growth got no memory. torch retries and reports only an out of
 * memory; any other error of the runtime's ends the malloc with that error
 * at once (a device lost, a runtime finalized meanwhile). */
typedef struct npa_refusal {
    bool cap_hit;    /* the per-process cap refused it, not the device */
    npa_error error; /* the runtime's error when it was not 207001; else NPA_OK */
} npa_refusal;

/* Notes a failed raw call's error in why, unless it says out of memory. */
static inline void npa_refusal_note(npa_refusal *why, npa_error err) {
    if (err != NPA_OK && err != NPA_ERR_OOM) why->error = err;
}

/* A new segment as one FREE block outside any pool, or NULL (why says why). */
npa_block *npa_segment_alloc(npa_allocator *a, npa_device *d, size_t size, npa_pool *pool, npa_refusal *why);
/* Gives a cached whole-segment block back to the device; false (nothing
 * done) when b is not a whole free segment. */
bool npa_segment_release(npa_allocator *a, npa_device *d, npa_block *b);
/* torch's release_blocks over both pools: every cached unsplit segment, and
 * every whole free page of the expandable segments (the caller has
 * synchronized the device when npa_expandable_unmappable said so). With a
 * retire token (never 0), only those of the pools it set aside, whose
 * stream's destroy waited for their work; with NPA_STREAM_GONE, those of
 * the pools of destroyed streams (what is free there waited for its fence). */
void npa_release_cached_segments(npa_allocator *a, npa_device *d, uint64_t only_retired_by);

/* expandable.c: torch's expandable segments over the backend's VMM calls. */
/* torch's try_allocate_expandable_block: a FREE block of at least size bytes
 * outside any pool, mapping pages at the lowest address where free and
 * unmapped space together fit it; NULL when the cap (*cap_hit), the device
 * or the address space refuses. A reservation the device refuses sets
 * pool->vmm_refused. */
npa_block *npa_expandable_alloc(npa_allocator *a, npa_device *d, npa_pool *pool, size_t size, npa_refusal *why);
/* What best fit ranks an expandable block by: its size plus the unmapped
 * space right after it (torch's expandable_size). */
size_t npa_expandable_reach(const npa_block *b);
/* Whether some free block of the device holds a whole mapped page. */
bool npa_expandable_unmappable(const npa_device *d);
/* torch's unmap_block over every free block of the segment at index, then
 * release_expandable_segment when nothing is mapped any more. */
void npa_expandable_release_free(npa_allocator *a, npa_device *d, size_t index);
/* At destroy: the bookkeeping of a segment that keeps live blocks. */
void npa_expandable_forget(npa_expandable *es);

/* pending.c */
/* Every malloc's poll: fences the open frees once there are enough of them
 * to share one fence (NPA_FENCE_BATCH_*), and hands back every batch
 * whose fence completed. */
void npa_pending_poll(npa_allocator *a, npa_device *d);
/* The same, fencing whatever is open: before a miss grows the pool, and
 * npa_process_pending. */
void npa_pending_flush(npa_allocator *a, npa_device *d);
/* A plain free waiting for the policy's fence. */
void npa_pending_add(npa_device *d, npa_block *b);
/* A free into a gone stream's pool, in the same batch, whose fence then
 * covers every live stream whatever the policy (fence_record_always). */
void npa_pending_add_gone(npa_device *d, npa_block *b);
/* A freed block with stream uses: reusable once events recorded on those
 * streams complete (one event per stream for every such block freed
 * before the next poll). */
void npa_pending_add_uses(npa_allocator *a, npa_device *d, npa_block *b);
/* Synchronizes the device and drains every pending free (num_sync_all_streams++);
 * the synchronize's error, with nothing drained, when it failed. */
npa_error npa_synchronize_and_drain(npa_allocator *a, npa_device *d);
/* Whether frees wait for a fence: open or fenced batches exist. */
static inline bool npa_pending_any(const npa_device *d) {
    return d->open_batch != NULL || d->open_uses != NULL || d->batches[NPA_BATCH_PLAIN] != NULL ||
           d->batches[NPA_BATCH_USES] != NULL;
}

/* gc.c */
void npa_gc(npa_allocator *a, npa_device *d);

/* oom.c: steps 3-6 of the malloc path; NULL when all of them failed, or at
 * once when the runtime failed for another reason than memory (why). */
npa_block *npa_grow(npa_allocator *a, npa_device *d, npa_pool *pool, size_t rounded, npa_refusal *why);
/* Step 7: counts the OOM (its trace event on pool's stream) and writes the
 * one-line report into msg. */
void npa_oom_report(npa_allocator *a, npa_device *d, const npa_pool *pool, size_t requested, size_t rounded,
                    bool cap_hit, char *msg, size_t msg_len);

/* stats.c: the seqlock around a batch of mutations. Sections nest; only the
 * outermost one flips seq, and it also publishes largest_free_block. The
 * fence orders the odd seq before the data stores for readers in other
 * processes; ThreadSanitizer cannot model fences (GCC 12+ warns), so the
 * warning is off.
 *
 * Inside a section every figure is stored with npa_stat_store, a relaxed
 * atomic store: C11 orders a store after the release fence, as the
 * reader's copy needs (npualloc_reader_stats), only when it is atomic. A
 * plain store the compiler may move above the fence or split, being free to
 * assume that nobody reads it meanwhile: a reader could then find seq even
 * and unchanged around a copy holding half of an update. It is the same one
 * store instruction on x86-64 and aarch64. Loads stay plain: the device
 * lock's holder is the only writer. */
static inline void npa_stat_store(int64_t *field, int64_t value) { __atomic_store_n(field, value, __ATOMIC_RELAXED); }
static inline void npa_stat_add(int64_t *field, int64_t delta) { npa_stat_store(field, *field + delta); }

#if defined(__SANITIZE_THREAD__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#pragma GCC diagnostic ignored "-Wtsan"
#endif
/* The outermost section's opening: seq odd. */
static inline void npa_stats_open(npa_device *d) {
    npualloc_device_stats *s = d->stats;
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void npa_stats_begin(npa_device *d) {
    if (d->stats_depth++ == 0) npa_stats_open(d);
}

/* npa_stats_begin where no section is open: the malloc's and the free's own
 * section (alloc_found_block, free_allocated), which malloc_on and
 * op_on_device open outside any other. A section closes in the function
 * that opened it, under one hold of the device lock, so the depth there is
 * 0: stored, not counted and tested. 14 instructions a malloc+free pair by
 * callgrind (make bench's hot path), with npa_stats_end_outermost. */
static inline void npa_stats_begin_outermost(npa_device *d) {
    d->stats_depth = 1;
    npa_stats_open(d);
}

static inline size_t npa_pair_largest(const npa_pool_pair *p) {
    size_t small = p->small.largest ? p->small.largest->size : 0;
    size_t large = p->large.largest ? p->large.largest->size : 0;
    return small > large ? small : large;
}

/* largest_free_block: the biggest block in any pool, recomputed only when
 * one of their largest blocks changed (the threads' stocks publish their
 * own in their slots). */
static inline void npa_publish_largest(npa_device *d) {
    d->largest_moved = false;
    size_t largest = npa_pair_largest(&d->plain);
    for (const npa_pool_pair *p = d->streams; p; p = p->next) {
        size_t l = npa_pair_largest(p);
        if (l > largest) largest = l;
    }
    npa_stat_store(&d->stats->largest_free_block, (int64_t)largest);
}

/* Ends the summary's change a section made (npa_pool_summary): release,
 * after its counts. Nothing while the device does not lend: seq stays odd. */
static inline void npa_summary_settle(npa_device *d) {
    npa_pool_summary *s = d->plain.large.summary;
    if (s && (s->seq & 1)) __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE); /* written under the lock alone */
}

/* The outermost section's closing: the summary settled, a freeze an
 * increase of inactive_split began ends (npa_split_past_peak sets
 * largest_moved too: one test for both), largest_free_block, then seq
 * even. */
static inline void npa_stats_close(npa_device *d) {
    npualloc_device_stats *s = d->stats;
    npa_summary_settle(d);
    if (d->largest_moved) {
        if (d->freeze_at_close) npa_tcaches_thaw_at_close(d);
        npa_publish_largest(d);
    }
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
}

static inline void npa_stats_end(npa_device *d) {
    if (--d->stats_depth == 0) npa_stats_close(d);
}

/* Closes npa_stats_begin_outermost's section. Its two callers end a
 * freeze begun in it themselves, in the branches they take anyway while
 * the threads' fast paths run (npa_split_past_peak freezes only then): a
 * call here, never made, cost a lone thread's pair a few register moves. */
static inline void npa_stats_end_outermost(npa_device *d) {
    npualloc_device_stats *s = d->stats;
    d->stats_depth = 0;
    npa_summary_settle(d);
    if (d->largest_moved) npa_publish_largest(d);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
}

/* allocated only grows (until a reset): allocated_bytes passes INT64_MAX
 * after 9.2 EB, 107 days at 1 TB/s of allocations, and a signed overflow
 * there is undefined. It wraps instead, as npualloc_stats_from_region
 * already reads it (freed stays right modulo 2^64). */
static inline void npa_stat_increase(npualloc_stat *st, int64_t x) {
    int64_t current = st->current + x;
    npa_stat_store(&st->current, current);
    if (current > st->peak) npa_stat_store(&st->peak, current);
    npa_stat_store(&st->allocated, (int64_t)((uint64_t)st->allocated + (uint64_t)x));
}

/* freed is implied by allocated and current (npualloc_shm.h). */
static inline void npa_stat_decrease(npualloc_stat *st, int64_t x) { npa_stat_add(&st->current, -x); }

/* A per-pool stat moves in "all" and in the block's own pool. */
static inline void npa_pool_stat_increase(npualloc_stat st[NPUALLOC_POOL_COUNT], bool is_small, int64_t x) {
    npa_stat_increase(&st[NPUALLOC_POOL_ALL], x);
    npa_stat_increase(&st[is_small ? NPUALLOC_POOL_SMALL : NPUALLOC_POOL_LARGE], x);
}

static inline void npa_pool_stat_decrease(npualloc_stat st[NPUALLOC_POOL_COUNT], bool is_small, int64_t x) {
    npa_stat_decrease(&st[NPUALLOC_POOL_ALL], x);
    npa_stat_decrease(&st[is_small ? NPUALLOC_POOL_SMALL : NPUALLOC_POOL_LARGE], x);
}

/* inactive_split or its bytes (st) rise by x on the slow path, in [ALL]
 * and the block's pool. While the threads' fast paths run, a split block
 * one of them lent stays counted inactive in the device's figure (its slot
 * takes it out), which then is only an upper bound of the sum: no peak is
 * set from it, the ceilings keep it (tcache.c). Their sum R is never above
 * 0 there (a slot's figure never is), so a figure within its peak keeps
 * device.current + R within it: only one past it is the slow way
 * (npa_split_past_peak). With the fast paths off every slot is 0 there
 * (npa_tcaches_settle folds every lent block back), and the peak becomes
 * the figure, today's rule. So the common case is npa_stat_increase's, to
 * the instruction (make bench's hot path). */
static inline void npa_split_stat_raise(npa_device *d, npualloc_stat *st, bool is_small, int64_t x) {
    int64_t current = st->current + x;
    npa_stat_store(&st->current, current);
    if (__builtin_expect(current > st->peak, 0)) {
        if (__builtin_expect(d->lending, 0)) npa_split_past_peak(d, is_small);
        else npa_stat_store(&st->peak, current);
    }
    npa_stat_store(&st->allocated, (int64_t)((uint64_t)st->allocated + (uint64_t)x));
}

static inline void npa_split_stat_increase(npa_device *d, npualloc_stat st[NPUALLOC_POOL_COUNT], bool is_small,
                                           int64_t x) {
    npa_split_stat_raise(d, &st[NPUALLOC_POOL_ALL], is_small, x);
    npa_split_stat_raise(d, &st[is_small ? NPUALLOC_POOL_SMALL : NPUALLOC_POOL_LARGE], is_small, x);
}

void npa_stats_init(npa_allocator *a, npa_device *d, size_t free_bytes);
/* Asks the runtime for the device's free and total bytes and publishes them
 * (device_free_bytes, device_total_bytes); the outputs (may be NULL) get 0
 * when it cannot say, and the stats keep the last figure. Called where
 * device memory changed hands: a cache miss that grew the pool, empty_cache,
 * an OOM; never on the hit path. */
npa_error npa_stats_sample_device_memory(npa_allocator *a, npa_device *d, size_t *free_bytes, size_t *total_bytes);
/* With d's lock held: its figures with its threads' slots added
 * (device_figures.h), in the region's form (freed implied), the caches
 * frozen meanwhile (exact, no retry). What reports a stat reads, not
 * d->stats alone, which misses what the caches moved. */
void npa_device_figures(npa_device *d, npualloc_device_stats *out);

/* snapshot.c: one device's segments, with its lock held. The views' blocks
 * live in *scratch (grown as needed, the caller frees it); false when it
 * could not grow, and the visit stopped. */
bool npa_visit_device_segments(npa_device *d, npa_segment_visitor visitor, void *arg, npa_block_view **scratch,
                               size_t *capacity);

/* history.c: record_history's ring. Call with the device lock held. */
void npa_history_record(npa_device *d, const npa_pool *pool, npa_trace_action action, uintptr_t addr, size_t size);
/* With recording off this is the whole cost on the allocation paths: one
 * predictable branch on a field of the locked device. pool: the one the
 * event's block is in (its stream is the event's, as torch's), or NULL.
 * Each event but a snapshot's carries the stack of the call under way, as
 * torch's carry its context (the backend's capture_stack). */
static inline void npa_history_note(npa_device *d, const npa_pool *pool, npa_trace_action action, uintptr_t addr,
                                    size_t size) {
    if (__builtin_expect(d->history.capacity != 0, 0)) npa_history_record(d, pool, action, addr, size);
}
/* Empties the ring and gives it room for capacity events (0: off); false,
 * leaving recording off, when that memory cannot be had. */
bool npa_history_reset(npa_history *h, size_t capacity);
/* Every held event of the device, oldest first. */
void npa_history_visit(const npa_device *d, npa_trace_visitor visitor, void *arg);

/* What both stocks' puts do once room is made: b's free noted, b held in
 * r, counted in the device's stats as a free to the pool would count it.
 * is_small a constant at each caller. */
static NPA_ALWAYS_INLINE void npa_stock_hold_freed(npa_device *d, npa_recent *r, npa_block *b, bool is_small,
                                                   bool full) {
    size_t size = b->size, requested = b->requested;
    npa_history_note(d, b->pool, NPA_TRACE_FREE_COMPLETED, b->addr, requested);
    bool split = npa_block_is_split(b);
    /* The stock's own fields before the stats: GCC reloads every field
     * after a stat's atomic store (it may alias them). */
    b->phase = NPA_PHASE_RECENT;
    b->requested = 0;
    npa_stock_hold(r, &(npa_lent){.addr = b->addr, .block = b, .size = size, .split = split, .is_small = is_small},
                   b->pool, full);
    npualloc_device_stats *s = d->stats;
    if (split) { /* counted as the pool counts an unmerged free block */
        npa_split_stat_increase(d, s->inactive_split, is_small, 1);
        npa_split_stat_increase(d, s->inactive_split_bytes, is_small, (int64_t)size);
    }
    npa_pool_stat_decrease(s->active, is_small, 1);
    npa_pool_stat_decrease(s->active_bytes, is_small, (int64_t)size);
    npa_pool_stat_decrease(s->requested_bytes, is_small, (int64_t)requested);
}

/* recent.c's put and tcache.c's keep, inline for both their callers (the
 * eager free path and the fence's completion), as main's npa_recent_put:
 * LTO's growth limits otherwise left them out of line (the free's hit path
 * then paid calls, 60 instructions a lone thread's pair with the take by
 * callgrind). */
static NPA_ALWAYS_INLINE void npa_stock_put(npa_device *d, npa_tcache *t, npa_block *b, bool full) {
    npa_recent *r = &t->stock;
    if (!npa_stock_has_room(r, b->size, true)) {
        npa_stock_make_room(d, r, b->size, true); /* its evictions publish nothing */
        if (!full) npa_tcache_publish_largest(t);
    }
    npa_stock_hold_freed(d, r, b, true, full);
}

/* b, freed now (device lock held, t the calling thread's own), kept in
 * t's stock if it admits it; false: not kept. lending: d->lending. A lone
 * thread's stock tells its slot the largest where that changes (an
 * eviction, a bigger block: npa_stock_put), so its keep tests nothing
 * after (2.5 instructions a lone thread's pair by callgrind); while the device
 * lends, here. */
static NPA_ALWAYS_INLINE bool npa_tcache_keep(npa_device *d, npa_tcache *t, npa_block *b, bool lending) {
    /* A large block only while the device lends (its stock holds none else):
     * with lending a constant false, a lone thread's free tests nothing more,
     * the small stock's admission refusing large blocks. */
    if (lending && __builtin_expect(!b->is_small, 0)) return npa_tcache_keep_large(d, t, b);
    if (!npa_recent_admits(&t->stock, b)) return false;
    npa_stock_put(d, t, b, lending);
    if (lending && (int64_t)t->stock.largest != t->largest_published) npa_tcache_publish_largest(t);
    return true;
}

#endif
