/* The layout of npualloc's shared-memory stats region: the one definition that
 * the allocator (writer) and the Python package (reader, through cffi ABI mode)
 * both use. Everything between the cffi markers must stay parseable by
 * cffi's cdef: fixed-width fields, plain structs, integer #defines only.
 *
 * Rules for readers: check the file size >= sizeof(npualloc_region), then
 * magic, then version, then header.size == sizeof(npualloc_region) before
 * trusting any other field. Stats are published with one seqlock per device
 * (npualloc_device_stats.seq: odd while a writer is inside); copy, re-read seq,
 * retry when it changed or was odd. Since version 9 a device's figures are
 * its npualloc_device_stats plus its npualloc_thread_stats slots (below):
 * read the device's seq, copy the device, copy each slot under its own
 * seqlock, then check the device's seq unchanged (retry otherwise); add each
 * slot's current and allocated into the [ALL] entry and the slot's pool's
 * entry, and its num_cache_hits; largest_free_block is the largest of the
 * device's and the slots' largest_held. Then npualloc_stats_from_region on
 * the sum (each stat's freed is implied in the region). The header's config
 * text, which a config change rewrites, has its own (header.config_seq), and
 * so has the pause state with its byte counts (header.pause.seq).
 *
 * Bump NPUALLOC_SHM_VERSION on any change of layout or meaning of a field
 * below, or of where a command leaves its answer (a snapshot's file name):
 * a requester then refuses the other side's region instead of misreading
 * it. A new command code needs no bump: a process that predates it
 * answers NPUALLOC_CMD_EUNKNOWN. */
#ifndef NPUALLOC_SHM_H
#define NPUALLOC_SHM_H

#include <stddef.h>
#include <stdint.h>

/* cffi:begin */
#define NPUALLOC_SHM_MAGIC 0x434f4c4c41555041
#define NPUALLOC_SHM_VERSION 9
#define NPUALLOC_MAX_DEVICES 16
#define NPUALLOC_THREAD_SLOTS 32 /* per device: a thread beyond them has no cache */
#define NPUALLOC_CONFIG_LEN 1024 /* the longest config text, every key at its longest, is 836 */
#define NPUALLOC_CMDLINE_LEN 256

/* Pool index of every per-pool stat, as torch's "all", "small_pool", "large_pool". */
#define NPUALLOC_POOL_ALL 0
#define NPUALLOC_POOL_SMALL 1
#define NPUALLOC_POOL_LARGE 2
#define NPUALLOC_POOL_COUNT 3

/* Commands another process can post (npualloc_command.code). */
#define NPUALLOC_CMD_NONE 0
#define NPUALLOC_CMD_EMPTY_CACHE 1
#define NPUALLOC_CMD_RESET_PEAK 2
#define NPUALLOC_CMD_RESET_ACCUMULATED 3
#define NPUALLOC_CMD_SET_GC_THRESHOLD 4
/* Writes torch's pickle beside the region at <region's name>.snapshot.<the
 * region file's inode>.<request_seq> (version 8: .snapshot.<request_seq>
 * before, where a process with the same pid in another pid namespace
 * sharing the directory answered over the file another's requester was to
 * read). */
#define NPUALLOC_CMD_SNAPSHOT 5
#define NPUALLOC_CMD_RECORD_HISTORY 6   /* arg: record_history entries per device, 0: off */
#define NPUALLOC_MAX_RECORD_HISTORY 16777216 /* the most entries per device record_history takes */
#define NPUALLOC_CMD_PAUSE 7            /* release all device memory, block allocator calls until RESUME */
#define NPUALLOC_CMD_RESUME 8
#define NPUALLOC_CMD_SET_MEMORY_FRACTION 9 /* arg: the fraction, device: its index (not -1: per device) */

/* Command results (npualloc_command.ack_status). */
#define NPUALLOC_CMD_OK 0
#define NPUALLOC_CMD_EUNKNOWN 1
#define NPUALLOC_CMD_EINVAL 2
#define NPUALLOC_CMD_EFAILED 3
#define NPUALLOC_CMD_ENOTPAUSABLE 4     /* plain segments or no VMM: run it with expandable_segments:True */
#define NPUALLOC_CMD_ENOTPAUSED 5       /* RESUME of a process that is not paused */
#define NPUALLOC_CMD_EPAUSED 6          /* any other command while paused */
#define NPUALLOC_CMD_WITHDRAWN 7        /* written by the requester that withdrew it, never applied */
/* npualloc_pause_state.state */
#define NPUALLOC_RUNNING 0
#define NPUALLOC_PAUSING 1
#define NPUALLOC_PAUSED 2
#define NPUALLOC_RESUMING 3

/* One torch Stat: current, peak, allocated (sum of increases), freed (sum of
 * decreases). In the region (version 4) the writer keeps freed implied: a
 * decrease moves current alone, a store fewer on each of the dozen or so
 * decreases of every free (1.4 ns of a 46 ns malloc+free pair), and the last
 * field holds current_at_reset, current when the accumulated counts were
 * last reset (0 before), so freed = allocated - current + current_at_reset.
 * A copy handed out (npualloc_get_stats, npualloc_reader_stats) holds freed
 * there instead: npualloc_stats_from_region. */
typedef struct npualloc_stat {
    int64_t current;
    int64_t peak;
    int64_t allocated;
    union {
        int64_t current_at_reset; /* as the writer keeps it: the region */
        int64_t freed;            /* in a copy handed out */
    };
} npualloc_stat;

/* torch's memory_stats() schema for one device, plus npualloc's own counters. */
typedef struct npualloc_device_stats {
    uint64_t seq;            /* seqlock: odd while being written */
    int32_t in_use;          /* 1 once this device has allocated through npualloc */
    int32_t pad0;
    npualloc_stat allocation[3];
    npualloc_stat segment[3];
    npualloc_stat active[3];
    npualloc_stat inactive_split[3];
    npualloc_stat allocated_bytes[3];
    npualloc_stat reserved_bytes[3];
    npualloc_stat active_bytes[3];
    npualloc_stat inactive_split_bytes[3];
    npualloc_stat requested_bytes[3];
    npualloc_stat oversize_allocations;
    npualloc_stat oversize_segments;
    int64_t num_alloc_retries;
    int64_t num_ooms;
    int64_t num_sync_all_streams;
    int64_t num_device_alloc;
    int64_t num_device_free;
    int64_t max_split_size;          /* -1 when unset */
    /* npualloc's own */
    int64_t num_cache_hits;          /* mallocs served without a raw device malloc */
    int64_t num_cache_misses;        /* mallocs that needed a new segment */
    int64_t largest_free_block;      /* fragmentation = 1 - largest_free_block / free cached bytes */
    int64_t num_foreign_frees;       /* frees of pointers npualloc never made, passed to the runtime */
    int64_t num_invalid_frees;       /* double frees / interior pointers refused */
    int64_t num_pending_frees;       /* blocks waiting for stream work before reuse */
    int64_t num_executor_destroys_forwarded;
    int64_t num_executor_destroys_skipped;  /* destroys that would have been double frees */
    int64_t device_free_bytes;       /* last aclrtGetMemInfo(HBM) seen */
    int64_t device_total_bytes;
    int64_t reserved_limit_bytes;    /* per_process_memory_fraction cap, 0 when none */
} npualloc_device_stats;

/* The command slot: a requester fills code/device/arg and then increments
 * request_seq; the process applies it at its next allocator call and stores
 * ack_status, then sets ack_seq = request_seq. Each request is closed once,
 * by whichever side moves closed_seq to it first (a compare-and-swap from
 * the one before): the process, to apply it, or its requester, to withdraw
 * it when the process did not come in time; a requester that withdraws
 * acknowledges it itself (NPUALLOC_CMD_WITHDRAWN). So a command given up on
 * is never applied later (version 6). */
typedef struct npualloc_command {
    uint64_t request_seq;
    uint64_t ack_seq;
    uint64_t closed_seq;
    int32_t code;
    int32_t device;          /* -1: every device */
    double arg;
    int32_t ack_status;
    int32_t pad0;
} npualloc_command;

/* `npualloc pause`'s state of the process and what it released, one
 * figure (version 7): a state read apart from its counts (versions 2 to 6
 * kept the three bare in the header) could be paired with the next
 * update's, "paused" with the 0 bytes of the resume that followed. Written
 * by the thread applying the pause, under their own seqlock (same protocol). */
typedef struct npualloc_pause_state {
    uint64_t seq;
    uint32_t state;          /* NPUALLOC_RUNNING, _PAUSING, _PAUSED, _RESUMING */
    uint32_t pad0;
    uint64_t paused_bytes;   /* device memory released by `npualloc pause` (memory_saver's included) */
    uint64_t backup_bytes;   /* host memory holding the paused blocks */
} npualloc_pause_state;

typedef struct npualloc_region_header {
    uint64_t magic;
    uint32_t version;
    uint32_t config_seq;     /* seqlock of config, odd while it is rewritten (version 5) */
    uint64_t size;           /* sizeof(npualloc_region) of the writer */
    int32_t pid;
    uint32_t uid;
    uint64_t start_time;     /* /proc/<pid>/stat field 22: tells a reused pid apart */
    uint64_t created_unix_ns;
    char config[1024];       /* the config in force, canonical key:value form, whole (512 before version 7) */
    char cmdline[256];
    uint32_t device_count;   /* highest device index in use + 1 */
    uint32_t runtime_device_count; /* the devices the runtime sees (aclrtGetDeviceCount), 0: not known (version 7) */
    npualloc_pause_state pause;
} npualloc_region_header;

/* npualloc.memory_saver's allocations on one device (version 3). They never
 * enter the cache, so none of npualloc_device_stats counts them. Written by
 * one thread at a time, under their own seqlock (same protocol). */
typedef struct npualloc_saver_stats {
    uint64_t seq;
    int32_t in_use;          /* 1 once the device made a pausable allocation */
    int32_t allocations;     /* live pausable allocations */
    int64_t allocated_bytes; /* their device memory (whole 2 MiB pages), paused or not */
    int64_t paused_bytes;    /* of those, released now (memory_saver.pause or `npualloc pause`) */
    int64_t backup_bytes;    /* host memory holding paused contents */
} npualloc_saver_stats;

/* The stats npualloc_thread_stats carries, per pool, in this order: the
 * index of each in its current[pool] and allocated[pool]. */
#define NPUALLOC_THREAD_ALLOCATION 0
#define NPUALLOC_THREAD_ALLOCATED_BYTES 1
#define NPUALLOC_THREAD_ACTIVE 2
#define NPUALLOC_THREAD_ACTIVE_BYTES 3
#define NPUALLOC_THREAD_REQUESTED_BYTES 4
#define NPUALLOC_THREAD_INACTIVE_SPLIT 5
#define NPUALLOC_THREAD_INACTIVE_SPLIT_BYTES 6
#define NPUALLOC_THREAD_STAT_COUNT 7
/* Pool index of a slot's current and allocated: NPUALLOC_POOL_SMALL - 1, NPUALLOC_POOL_LARGE - 1. */
#define NPUALLOC_THREAD_POOL_COUNT 2

/* The stat changes one thread's cache made without the device lock
 * (version 9), to be added to its device's own figures (the reading rule
 * above): the device's figures alone miss what the threads' caches lent
 * and took back. Written by one thread at a time under its own seqlock
 * (same protocol). A slot no thread holds is all zeros. The device's peaks
 * already cover the sum: its writer keeps device.current plus what the
 * slots may reach within the device's peak. */
typedef struct npualloc_thread_stats {
    uint64_t seq;
    int64_t current[2][7];   /* [pool][NPUALLOC_THREAD_*]: moves of each stat's current */
    int64_t allocated[2][7]; /* the sum of those stats' increases (torch's Stat.allocated) */
    int64_t num_cache_hits;  /* mallocs the cache served */
    int64_t largest_held;    /* the biggest free block the cache holds (largest_free_block) */
    int64_t pad0;            /* a whole number of 128-byte line pairs: no false sharing between threads */
} npualloc_thread_stats;

typedef struct npualloc_region {
    npualloc_region_header header;
    npualloc_command command;
    npualloc_device_stats devices[16];
    npualloc_saver_stats saver[16];
    uint8_t pad0[120];       /* threads on a 128-byte boundary (the mapping is page aligned): aarch64's
                              * coherence granule, and x86's pair of lines its prefetcher fetches together */
    npualloc_thread_stats threads[16][32]; /* [device][slot] (version 9) */
} npualloc_region;
/* cffi:end */

/* The torch Stat fields, allocation[0] .. oversize_segments, are one run of
 * npualloc_stat, walked as an array. */
#define NPUALLOC_STAT_RUN_LENGTH (9 * NPUALLOC_POOL_COUNT + 2)
_Static_assert(offsetof(npualloc_device_stats, oversize_segments) - offsetof(npualloc_device_stats, allocation) ==
                   (NPUALLOC_STAT_RUN_LENGTH - 1) * sizeof(npualloc_stat),
               "the torch stats must be contiguous");

/* A copy of a device's region stats turned into the form handed out: each
 * stat's freed where the region keeps current_at_reset. Unsigned, since a
 * foreign or hostile region may hold anything: it wraps, never overflows. */
static inline void npualloc_stats_from_region(npualloc_device_stats *copy) {
    npualloc_stat *run = &copy->allocation[0];
    for (int i = 0; i < NPUALLOC_STAT_RUN_LENGTH; i++)
        run[i].freed = (int64_t)((uint64_t)run[i].allocated - (uint64_t)run[i].current +
                                 (uint64_t)run[i].current_at_reset);
}

/* cffi wants literal array lengths above; keep them tied to the names. */
_Static_assert(sizeof(((npualloc_region_header *)0)->config) == NPUALLOC_CONFIG_LEN, "config length");
_Static_assert(sizeof(((npualloc_region_header *)0)->cmdline) == NPUALLOC_CMDLINE_LEN, "cmdline length");
_Static_assert(sizeof(((npualloc_region *)0)->devices) / sizeof(npualloc_device_stats) == NPUALLOC_MAX_DEVICES,
               "device count");
_Static_assert(sizeof(((npualloc_region *)0)->saver) / sizeof(npualloc_saver_stats) == NPUALLOC_MAX_DEVICES,
               "saver device count");
_Static_assert(sizeof(((npualloc_thread_stats *)0)->current) ==
                   NPUALLOC_THREAD_POOL_COUNT * NPUALLOC_THREAD_STAT_COUNT * sizeof(int64_t) &&
                   sizeof(((npualloc_thread_stats *)0)->current[0]) == NPUALLOC_THREAD_STAT_COUNT * sizeof(int64_t) &&
                   sizeof(((npualloc_thread_stats *)0)->allocated) == sizeof(((npualloc_thread_stats *)0)->current),
               "thread stat counts");
_Static_assert(sizeof(((npualloc_region *)0)->threads) ==
                   NPUALLOC_MAX_DEVICES * NPUALLOC_THREAD_SLOTS * sizeof(npualloc_thread_stats) &&
                   sizeof(((npualloc_region *)0)->threads[0]) == NPUALLOC_THREAD_SLOTS * sizeof(npualloc_thread_stats),
               "thread slot counts");
_Static_assert(sizeof(npualloc_thread_stats) % 128 == 0 && offsetof(npualloc_region, threads) % 128 == 0,
               "each thread's slot on 128-byte line pairs of its own");

#endif
