/* The memory saver: torch_memory_saver's pause and resume on Ascend
 * (npualloc.memory_saver). An allocation made inside a region() gets a
 * device address range of its own (aclrtReserveMemAddress) backed by one
 * physical allocation mapped there, never the cache: pausing it unmaps and
 * frees the physical memory (so any process can use it) and keeps the
 * addresses, resuming maps new physical memory at the same addresses. With
 * a CPU backup the contents are copied to host memory first and back after;
 * without one they are undefined after resume, as torch_memory_saver's.
 * Only what the program holds is backed up: there is no cached free space.
 *
 * Nothing is lost: host memory for the backups is allocated, and every
 * copy made, on every device before anything is unmapped; a pause that
 * fails half way maps back what it unmapped (restoring the backed-up
 * contents); a resume that finds no room keeps the backups of what it
 * could not map, says why, and can be retried.
 *
 * `npualloc pause <pid>` (pause.c) pauses these too, each with a backup
 * whatever its region asked (the program carries on with the same
 * contents), and keeps saver_lock until its resume. The bytes per device
 * are published in the region (npualloc_saver_stats). A forked child
 * forgets the parent's allocations, as the rest of the hook does. */
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"
#include "npualloc.h"
#include "region/region.h"

/* The device's page of physical memory (aclrtMemGetAllocationGranularity
 * answers 2 MiB on Ascend): a pausable allocation spans whole pages. */
#define SAVER_PAGE ((size_t)2 << 20)
#define SAVER_TAG_LEN 64

typedef struct saver_block {
    uintptr_t addr;
    size_t size;      /* whole pages */
    int device;
    char tag[SAVER_TAG_LEN];
    bool backup;
    bool by_command;  /* released by `npualloc pause`, for its resume only */
    bool unmapped;    /* released by the pause in progress (undone if it fails) */
    bool freeing;     /* its free is under way without saver_lock (npa_saver_free) */
    void *physical;   /* NULL while paused */
    void *host;       /* the backup while paused (backup only) */
    struct saver_block *next;
} saver_block;

NPA_TLS int npa_saver_region = -1;
/* The tag of this thread's region. Each block keeps its own copy, so tags
 * are only names: a program may use a new one every step, for as long as
 * it runs. */
static NPA_TLS char region_tag[SAVER_TAG_LEN];

/* 6b in the lock order (hook.h). Held across a pause's and a resume's
 * runtime calls, which must see the blocks whole; never across a free's
 * synchronize (npa_saver_free), which every free the cache does not own
 * would wait for. */
static pthread_mutex_t saver_lock = PTHREAD_MUTEX_INITIALIZER;
static saver_block *blocks; /* saver_lock */
/* Signalled, with saver_lock, when a free under way ends: the block gone or,
 * the free failed, whole again for a pause, a resume or another free. */
static pthread_cond_t free_ended = PTHREAD_COND_INITIALIZER;

/* Which blocks a pause, resume or count is about: those of one tag, of
 * every tag (tag NULL), or those `npualloc pause` released (by_command). */
typedef struct {
    const char *tag;
    bool by_command;
} saver_selection;

static void say(char *why, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void say(char *why, size_t len, const char *fmt, ...)
{
    if (why == NULL || len == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
}

static bool vmm_available(void)
{
    static const npa_fn needed[] = {NPA_FN_aclrtReserveMemAddress, NPA_FN_aclrtReleaseMemAddress,
                                    NPA_FN_aclrtMallocPhysical,    NPA_FN_aclrtFreePhysical,
                                    NPA_FN_aclrtMapMem,            NPA_FN_aclrtUnmapMem,
                                    NPA_FN_aclrtMemcpy};
    for (size_t i = 0; i < sizeof needed / sizeof needed[0]; i++)
        if (npa_real_optional(needed[i]) == NULL)
            return false;
    return true;
}

static bool used[NPUALLOC_MAX_DEVICES];         /* saver_lock: made a pausable allocation */

static void saver_stats_of(int device, npualloc_saver_stats *out)
{
    memset(out, 0, sizeof *out);
    out->in_use = used[device];
    for (saver_block *b = blocks; b; b = b->next) {
        if (b->device != device)
            continue;
        out->allocations++;
        out->allocated_bytes += (int64_t)b->size;
        out->paused_bytes += b->physical == NULL ? (int64_t)b->size : 0;
        out->backup_bytes += b->host != NULL ? (int64_t)b->size : 0;
    }
}

/* With saver_lock released (device locks come before it, hook.h): the
 * allocator's figure of the device's free memory, after saver memory
 * changed hands (device < 0: every device). */
static void resample_device_memory(int device)
{
    npa_allocator *a = npa_hook_allocator_any();
    if (a != NULL)
        npa_sample_device_memory(a, device);
}

/* saver_lock held (one writer at a time). The device's figures, into the
 * region under its seqlock. */
static void publish(int device)
{
    npualloc_saver_stats *s = npa_region_saver_stats(device);
    if (s == NULL)
        return;
    npualloc_saver_stats now;
    saver_stats_of(device, &now);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    __atomic_store_n(&s->in_use, now.in_use, __ATOMIC_RELAXED);
    __atomic_store_n(&s->allocations, now.allocations, __ATOMIC_RELAXED);
    __atomic_store_n(&s->allocated_bytes, now.allocated_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&s->paused_bytes, now.paused_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&s->backup_bytes, now.backup_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, s->seq + 1, __ATOMIC_RELEASE);
}

static void publish_all(void)
{
    bool done[NPUALLOC_MAX_DEVICES] = {false};
    for (saver_block *b = blocks; b; b = b->next)
        if (!done[b->device]) {
            done[b->device] = true;
            publish(b->device);
        }
}

static aclError map_physical(saver_block *b)
{
    return npa_vmm_map(b->device, (void *)b->addr, b->size, &b->physical);
}

static aclError unmap_physical(saver_block *b)
{
    aclError err = npa_vmm_unmap((void *)b->addr, b->size, b->physical);
    if (err == ACL_SUCCESS)
        b->physical = NULL;
    return err;
}

int npa_saver_malloc(int device, size_t size, void **ptr)
{
    if (!vmm_available()) {
        npa_warn_once("memory_saver: the runtime has no virtual memory API (aclrtReserveMemAddress, "
                      "aclrtMallocPhysical, aclrtMapMem, ...): allocations in a region are ordinary ones "
                      "and are not paused");
        return -1;
    }
    saver_block *b = calloc(1, sizeof *b);
    if (b == NULL)
        return ACL_ERROR_BAD_ALLOC;
    *b = (saver_block){.size = (size + SAVER_PAGE - 1) / SAVER_PAGE * SAVER_PAGE, .device = device,
                       .backup = npa_saver_region == 1};
    memcpy(b->tag, region_tag, sizeof b->tag);
    /* Under the lock: a pause of the whole process (pause.c) holds it, and
     * no allocation may be made while it is paused. */
    npa_mutex_lock(&saver_lock);
    void *base = NULL;
    aclError err = NPA_REAL(aclrtReserveMemAddress)(&base, b->size, 0, NULL, 0);
    if (err == ACL_SUCCESS) {
        b->addr = (uintptr_t)base;
        err = map_physical(b);
        if (err != ACL_SUCCESS)
            NPA_REAL(aclrtReleaseMemAddress)(base);
    }
    if (err == ACL_SUCCESS) {
        b->next = blocks;
        blocks = b;
        used[device] = true;
        publish(device);
        *ptr = base;
    } else {
        free(b);
    }
    npa_mutex_unlock(&saver_lock);
    if (err == ACL_SUCCESS)
        resample_device_memory(device);
    return err;
}

/* saver_lock held: the block at ptr, once no other free of it is under way
 * (a second free of a pointer waits for the first, and finds it gone or,
 * the first failed, frees it), or NULL. */
static saver_block *find_for_free(void *ptr)
{
    for (;;) {
        saver_block *b = blocks;
        while (b != NULL && b->addr != (uintptr_t)ptr)
            b = b->next;
        if (b == NULL || !b->freeing)
            return b;
        pthread_cond_wait(&free_ended, &saver_lock);
    }
}

/* The device synchronizes with the block marked as being freed, not under
 * saver_lock: every free of a pointer the cache does not own takes the lock
 * to ask here, and waited for all that device's queued work (any device's
 * free, and pausable mallocs, alike). Marked, it stays listed and counted;
 * a pause, a resume or another free of it waits for the end; a free that
 * fails leaves it as it was. */
int npa_saver_free(void *ptr, aclError *err)
{
    npa_mutex_lock(&saver_lock);
    saver_block *b = find_for_free(ptr);
    if (b != NULL)
        b->freeing = true;
    npa_mutex_unlock(&saver_lock);
    if (b == NULL)
        return 0;
    /* aclrtFree does not wait for queued work, but the physical memory goes
     * back to the device here: wait, as a real free of it must not race.
     * The block is read, not written, without the lock: the figures read it. */
    bool unmapped = false;
    npa_devswitch sw;
    *err = npa_device_enter(b->device, &sw);
    if (*err == ACL_SUCCESS) {
        if (b->physical != NULL) {
            *err = NPA_REAL(aclrtSynchronizeDevice)();
            if (*err == ACL_SUCCESS)
                *err = npa_vmm_unmap((void *)b->addr, b->size, b->physical);
            unmapped = *err == ACL_SUCCESS;
        }
        if (*err == ACL_SUCCESS)
            *err = NPA_REAL(aclrtReleaseMemAddress)(ptr);
        npa_device_leave(&sw);
    }
    int device = b->device;
    npa_mutex_lock(&saver_lock);
    if (unmapped) /* its range kept (the release refused): paused, contents gone */
        b->physical = NULL;
    if (*err == ACL_SUCCESS) { /* a paused block is simply freed: its backup goes too */
        saver_block **link = &blocks;
        while (*link != b)
            link = &(*link)->next;
        *link = b->next;
        free(b->host);
        free(b);
    } else {
        b->freeing = false;
    }
    publish(device);
    pthread_cond_broadcast(&free_ended);
    npa_mutex_unlock(&saver_lock);
    if (*err == ACL_SUCCESS || unmapped)
        resample_device_memory(device);
    return 1;
}

/* A thread that ends inside a region (a C program's worker that never
 * passes NULL) would stay counted in npa_entry_work for good, and every
 * later allocation of every thread would leave the hit path. The key's
 * value is set while the thread is inside one, so its destructor, run as
 * the thread exits, takes it out (what another key's destructor allocates
 * after that is ordinary). Should the key or its value be refused (out of
 * memory), the thread stays counted as before: only speed is lost. */
static pthread_key_t region_key;
static pthread_once_t region_key_once = PTHREAD_ONCE_INIT;
static bool region_key_made;

static void leave_region(void)
{
    atomic_fetch_sub_explicit(&npa_entry_work, NPA_WORK_SAVER_REGION, memory_order_relaxed);
    npa_saver_region = -1;
}

static void region_thread_ended(void *inside)
{
    (void)inside; /* non-NULL: the key's value is set only inside a region */
    leave_region();
}

/* In a forked child: the parent's other threads inside regions are not the
 * child's, and counted they would keep its allocations off the hit path for
 * its whole life; the forking thread alone is counted, as its region stays.
 * Registered at the process's first region rather than with the hook's
 * fork handlers, which wait for its first allocation (registered with
 * them, the at-exit release runs before the runtime's own teardown, which
 * aclInit registers): a child forked between the two counted the parent's
 * threads. Should the registration be refused (out of memory), such a
 * child loses only speed. */
static void count_only_this_thread(void)
{
    unsigned others = atomic_load_explicit(&npa_entry_work, memory_order_relaxed) & ~(NPA_WORK_SAVER_REGION - 1);
    if (npa_saver_region >= 0)
        others -= NPA_WORK_SAVER_REGION;
    atomic_fetch_sub_explicit(&npa_entry_work, others, memory_order_relaxed);
}

static void make_region_key(void)
{
    region_key_made = pthread_key_create(&region_key, region_thread_ended) == 0;
    pthread_atfork(NULL, NULL, count_only_this_thread);
}

NPA_EXPORT int npualloc_saver_region(const char *tag, int enable_cpu_backup)
{
    if (tag == NULL) {
        if (npa_saver_region >= 0) {
            if (region_key_made)
                pthread_setspecific(region_key, NULL);
            leave_region();
        }
        return 0;
    }
    size_t len = strlen(tag);
    if (len >= SAVER_TAG_LEN)
        return -1;
    memcpy(region_tag, tag, len + 1);
    /* Counted before this thread's region is set, so its next malloc sees the word set. */
    if (npa_saver_region < 0) {
        pthread_once(&region_key_once, make_region_key);
        if (region_key_made)
            pthread_setspecific(region_key, &npa_saver_region);
        atomic_fetch_add_explicit(&npa_entry_work, NPA_WORK_SAVER_REGION, memory_order_relaxed);
    }
    npa_saver_region = enable_cpu_backup != 0;
    return 0;
}

/* saver_lock held. Does b belong to the selection? A block the command
 * paused is its own until the command resumes it. */
static bool selected(const saver_block *b, saver_selection which)
{
    if (which.by_command)
        return b->by_command;
    return !b->by_command && (which.tag == NULL || strcmp(b->tag, which.tag) == 0);
}

/* saver_lock held: returns once no block of the selection is being freed.
 * Skipped, a block whose free then failed came back as it was: unpaused
 * after a pause that said the selection was paused. A pause or resume
 * waits for the free's synchronize instead, as it waited for saver_lock
 * when the free held it throughout. */
static void wait_for_frees(saver_selection which)
{
    for (;;) {
        bool freeing = false;
        for (saver_block *b = blocks; b && !freeing; b = b->next)
            freeing = b->freeing && selected(b, which);
        if (!freeing)
            return;
        pthread_cond_wait(&free_ended, &saver_lock);
    }
}

/* saver_lock held. Maps b back and restores its backup. */
static aclError restore(saver_block *b)
{
    npa_devswitch sw;
    aclError err = npa_device_enter(b->device, &sw);
    if (err != ACL_SUCCESS)
        return err;
    if ((err = map_physical(b)) == ACL_SUCCESS && b->host != NULL) {
        err = NPA_REAL(aclrtMemcpy)((void *)b->addr, b->size, b->host, b->size, ACL_MEMCPY_HOST_TO_DEVICE);
        if (err != ACL_SUCCESS) /* keep the backup: unmapped again, resume can be retried */
            unmap_physical(b);
    }
    npa_device_leave(&sw);
    if (err == ACL_SUCCESS) {
        free(b->host);
        b->host = NULL;
    }
    return err;
}

/* saver_lock held. The selected blocks that are mapped: synchronize their
 * devices, back up, then unmap; all or none. For the command every block
 * is backed up and marked by_command. */
static aclError pause_blocks(saver_selection which, bool for_command, char *why, size_t len)
{
    wait_for_frees(which);
    aclError err = ACL_SUCCESS;
    for (int device = 0; device < NPUALLOC_MAX_DEVICES && err == ACL_SUCCESS; device++) {
        bool any = false;
        for (saver_block *b = blocks; b && !any; b = b->next)
            any = selected(b, which) && b->device == device && b->physical != NULL;
        if (!any)
            continue;
        npa_devswitch sw;
        if ((err = npa_device_enter(device, &sw)) != ACL_SUCCESS) {
            say(why, len, "device %d cannot be entered (error %d): nothing was paused", device, err);
            break;
        }
        if ((err = NPA_REAL(aclrtSynchronizeDevice)()) != ACL_SUCCESS)
            say(why, len, "device %d cannot be synchronized (error %d): nothing was paused", device, err);
        for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
            if (!selected(b, which) || b->device != device || b->physical == NULL || !(b->backup || for_command))
                continue;
            if ((b->host = malloc(b->size)) == NULL) {
                err = ACL_ERROR_BAD_ALLOC;
                say(why, len, "no host memory for a %zu-byte backup: nothing was paused", b->size);
            } else if ((err = NPA_REAL(aclrtMemcpy)(b->host, b->size, (void *)b->addr, b->size,
                                                     ACL_MEMCPY_DEVICE_TO_HOST)) != ACL_SUCCESS) {
                say(why, len, "copying %#lx to the host failed (error %d): nothing was paused",
                    (unsigned long)b->addr, err);
            }
        }
        npa_device_leave(&sw);
    }
    for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
        if (!selected(b, which) || b->physical == NULL)
            continue;
        npa_devswitch sw;
        if ((err = npa_device_enter(b->device, &sw)) == ACL_SUCCESS) {
            err = unmap_physical(b);
            npa_device_leave(&sw);
        }
        if (err != ACL_SUCCESS) {
            say(why, len, "releasing %#lx on device %d failed (error %d): nothing was paused",
                (unsigned long)b->addr, b->device, err);
            break;
        }
        b->unmapped = true;
    }
    /* Undo on a failure: what was unmapped is mapped back (the backed-up
     * contents restored; without a backup they are undefined, as after any
     * pause), and every backup taken is dropped. */
    for (saver_block *b = blocks; b; b = b->next) {
        if (!selected(b, which))
            continue;
        if (err != ACL_SUCCESS && b->unmapped && restore(b) != ACL_SUCCESS)
            npa_warn_once("memory_saver: a failed pause could not map %#lx back: it stays paused (resume it)",
                          (unsigned long)b->addr);
        if (err != ACL_SUCCESS && b->physical != NULL) {
            free(b->host);
            b->host = NULL;
        }
        if (err == ACL_SUCCESS && b->unmapped)
            b->by_command = for_command;
        b->unmapped = false;
    }
    publish_all();
    return err;
}

/* saver_lock held. Every selected block that is paused, mapped back with
 * its contents; one that finds no room stays paused with its backup. */
static aclError resume_blocks(saver_selection which, char *why, size_t len)
{
    wait_for_frees(which);
    aclError err = ACL_SUCCESS;
    for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
        if (!selected(b, which) || b->physical != NULL)
            continue;
        if ((err = restore(b)) != ACL_SUCCESS)
            say(why, len,
                "device %d has no room for %zu bytes at %#lx (error %d: another process may hold it); "
                "what is still paused keeps its backup: resume again once memory is free",
                b->device, b->size, (unsigned long)b->addr, err);
        else
            b->by_command = false;
    }
    publish_all();
    return err;
}

NPA_EXPORT int npualloc_saver_pause(const char *tag, char *why, size_t why_len)
{
    npa_mutex_lock(&saver_lock);
    aclError err = pause_blocks((saver_selection){.tag = tag}, false, why, why_len);
    npa_mutex_unlock(&saver_lock);
    resample_device_memory(-1);
    return err;
}

NPA_EXPORT int npualloc_saver_resume(const char *tag, char *why, size_t why_len)
{
    npa_mutex_lock(&saver_lock);
    aclError err = resume_blocks((saver_selection){.tag = tag}, why, why_len);
    npa_mutex_unlock(&saver_lock);
    resample_device_memory(-1);
    return err;
}

aclError npa_saver_command_pause(char *why, size_t len)
{
    npa_mutex_lock(&saver_lock);
    aclError err = pause_blocks((saver_selection){.tag = NULL}, true, why, len);
    if (err != ACL_SUCCESS)
        npa_mutex_unlock(&saver_lock);
    return err; /* on success saver_lock stays held, until npa_saver_command_done */
}

aclError npa_saver_command_resume(char *why, size_t len)
{
    return resume_blocks((saver_selection){.by_command = true}, why, len);
}

void npa_saver_command_paused_bytes(size_t *released, size_t *backup)
{
    *released = *backup = 0;
    for (saver_block *b = blocks; b; b = b->next)
        if (selected(b, (saver_selection){.by_command = true}) && b->physical == NULL) {
            *released += b->size;
            *backup += b->host != NULL ? b->size : 0;
        }
}

void npa_saver_command_hold(void)
{
    npa_mutex_lock(&saver_lock);
}

void npa_saver_command_done(void)
{
    npa_mutex_unlock(&saver_lock);
}

NPA_EXPORT int npualloc_saver_bytes(const char *tag, size_t *allocated, size_t *paused, size_t *backup)
{
    size_t all = 0, unmapped = 0, backed_up = 0;
    npa_mutex_lock(&saver_lock);
    for (saver_block *b = blocks; b; b = b->next) {
        if (tag != NULL && strcmp(b->tag, tag) != 0)
            continue;
        all += b->size;
        unmapped += b->physical == NULL ? b->size : 0;
        backed_up += b->host != NULL ? b->size : 0;
    }
    npa_mutex_unlock(&saver_lock);
    if (allocated != NULL)
        *allocated = all;
    if (paused != NULL)
        *paused = unmapped;
    if (backup != NULL)
        *backup = backed_up;
    return 0;
}

NPA_EXPORT int npualloc_get_saver_stats(int device, npualloc_saver_stats *out)
{
    if (!npa_device_in_range(device) || out == NULL)
        return -1;
    npa_mutex_lock(&saver_lock);
    saver_stats_of(device, out);
    npa_mutex_unlock(&saver_lock);
    return 0;
}

void npa_saver_lock_for_fork(void)
{
    npa_mutex_lock(&saver_lock);
}

void npa_saver_unlock_after_fork(void)
{
    npa_mutex_unlock(&saver_lock);
}

void npa_saver_forget_after_fork(void)
{
    /* The parent's allocations are its device memory: the child never
     * pauses or frees them (a free of one is passed to the runtime, like
     * any pointer npualloc did not make here). Their records and backups
     * are the child's copies: dropped. The forking thread's region stays,
     * for the child's allocations (the threads counted in regions:
     * count_only_this_thread). */
    memset(used, 0, sizeof used);
    /* Waiters of the parent's threads, which the child has not, may be
     * counted in it: a broadcast would wait for them to wake. */
    pthread_cond_init(&free_ended, NULL);
    while (blocks) {
        saver_block *b = blocks;
        blocks = b->next;
        free(b->host);
        free(b);
    }
}
