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
 * copy made, before anything is unmapped; a pause that fails half way maps
 * back what it unmapped; a resume that finds no room keeps the backups of
 * what it could not map, says why, and can be retried. */
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"
#include "npualloc.h"

/* The device's page of physical memory (aclrtMemGetAllocationGranularity
 * answers 2 MiB on Ascend): a pausable allocation spans whole pages. */
#define SAVER_PAGE ((size_t)2 << 20)
#define SAVER_MAX_TAGS 64
#define SAVER_TAG_LEN 64

typedef struct saver_block {
    uintptr_t addr;
    size_t size;      /* whole pages */
    int device;
    int tag;
    bool backup;
    void *physical;   /* NULL while paused */
    void *host;       /* the backup while paused (backup only) */
    struct saver_block *next;
} saver_block;

NPA_TLS int npa_saver_region = -1;

static pthread_mutex_t saver_lock = PTHREAD_MUTEX_INITIALIZER;
static char tags[SAVER_MAX_TAGS][SAVER_TAG_LEN]; /* saver_lock; slots never reused */
static int tag_count;
static saver_block *blocks;                      /* saver_lock */

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

/* saver_lock held. The tag's index, -1 when it cannot be named (too long, too many). */
static int tag_index(const char *tag, bool create)
{
    for (int i = 0; i < tag_count; i++)
        if (strcmp(tags[i], tag) == 0)
            return i;
    if (!create || strlen(tag) >= SAVER_TAG_LEN || tag_count == SAVER_MAX_TAGS)
        return -1;
    strcpy(tags[tag_count], tag);
    return tag_count++;
}

/* Physical memory for b, mapped at its addresses (the device is entered). */
static aclError map_physical(saver_block *b)
{
    aclrtPhysicalMemProp prop = {
        .handleType = ACL_MEM_HANDLE_TYPE_NONE,
        .allocationType = ACL_MEM_ALLOCATION_TYPE_PINNED,
        .memAttr = ACL_HBM_MEM_HUGE,
        .location = {.id = (uint32_t)b->device, .type = ACL_MEM_LOCATION_TYPE_DEVICE},
    };
    aclrtDrvMemHandle physical = NULL;
    aclError err = NPA_REAL(aclrtMallocPhysical)(&physical, b->size, &prop, 0);
    if (err != ACL_SUCCESS)
        return err;
    err = NPA_REAL(aclrtMapMem)((void *)b->addr, b->size, 0, physical, 0);
    if (err != ACL_SUCCESS) {
        NPA_REAL(aclrtFreePhysical)(physical);
        return err;
    }
    b->physical = physical;
    return ACL_SUCCESS;
}

static aclError unmap_physical(saver_block *b)
{
    aclError err = NPA_REAL(aclrtUnmapMem)((void *)b->addr);
    if (err == ACL_SUCCESS)
        err = NPA_REAL(aclrtFreePhysical)(b->physical);
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
    int region = npa_saver_region;
    *b = (saver_block){.size = (size + SAVER_PAGE - 1) / SAVER_PAGE * SAVER_PAGE, .device = device,
                       .tag = region >> 1, .backup = region & 1};
    void *base = NULL;
    aclError err = NPA_REAL(aclrtReserveMemAddress)(&base, b->size, 0, NULL, 0);
    if (err == ACL_SUCCESS) {
        b->addr = (uintptr_t)base;
        err = map_physical(b);
        if (err != ACL_SUCCESS)
            NPA_REAL(aclrtReleaseMemAddress)(base);
    }
    if (err != ACL_SUCCESS) {
        free(b);
        return err;
    }
    pthread_mutex_lock(&saver_lock);
    b->next = blocks;
    blocks = b;
    pthread_mutex_unlock(&saver_lock);
    *ptr = base;
    return ACL_SUCCESS;
}

int npa_saver_free(void *ptr, aclError *err)
{
    pthread_mutex_lock(&saver_lock);
    saver_block **link = &blocks;
    while (*link != NULL && (*link)->addr != (uintptr_t)ptr)
        link = &(*link)->next;
    saver_block *b = *link;
    if (b == NULL) {
        pthread_mutex_unlock(&saver_lock);
        return 0;
    }
    /* aclrtFree does not wait for queued work, but the physical memory goes
     * back to the device here: wait, as a real free of it must not race. */
    npa_devswitch sw;
    *err = npa_device_enter(b->device, &sw);
    if (*err == ACL_SUCCESS) {
        if (b->physical != NULL) {
            *err = NPA_REAL(aclrtSynchronizeDevice)();
            if (*err == ACL_SUCCESS)
                *err = unmap_physical(b);
        }
        if (*err == ACL_SUCCESS)
            *err = NPA_REAL(aclrtReleaseMemAddress)(ptr);
        npa_device_leave(&sw);
    }
    if (*err == ACL_SUCCESS) { /* a paused block is simply freed: its backup goes too */
        *link = b->next;
        free(b->host);
        free(b);
    }
    pthread_mutex_unlock(&saver_lock);
    return 1;
}

NPA_EXPORT int npualloc_saver_region(const char *tag, int enable_cpu_backup)
{
    if (tag == NULL) {
        npa_saver_region = -1;
        return 0;
    }
    pthread_mutex_lock(&saver_lock);
    int index = tag_index(tag, true);
    pthread_mutex_unlock(&saver_lock);
    if (index < 0)
        return -1;
    npa_saver_region = index * 2 + (enable_cpu_backup != 0);
    return 0;
}

/* saver_lock held. Does b belong to the tag (-2: every tag; -1: an unknown one, none)? */
static bool tagged(const saver_block *b, int tag)
{
    return tag == -2 || b->tag == tag;
}

static int tag_of(const char *tag)
{
    return tag == NULL ? -2 : tag_index(tag, false);
}

/* saver_lock held. Maps b back and restores its backup (the device is entered). */
static aclError restore(saver_block *b)
{
    aclError err = map_physical(b);
    if (err != ACL_SUCCESS || b->host == NULL)
        return err;
    err = NPA_REAL(aclrtMemcpy)((void *)b->addr, b->size, b->host, b->size, ACL_MEMCPY_HOST_TO_DEVICE);
    if (err != ACL_SUCCESS) { /* keep the backup: unmapped again, resume can be retried */
        unmap_physical(b);
        return err;
    }
    free(b->host);
    b->host = NULL;
    return ACL_SUCCESS;
}

NPA_EXPORT int npualloc_saver_pause(const char *tag, char *why, size_t why_len)
{
    pthread_mutex_lock(&saver_lock);
    int t = tag_of(tag);
    aclError err = ACL_SUCCESS;
    saver_block *failed = NULL;
    /* Per device: synchronize, back up every block (host memory and copies),
     * and only then unmap; a failure undoes what this device's pass did. */
    for (int device = 0; device < NPUALLOC_MAX_DEVICES && err == ACL_SUCCESS; device++) {
        bool any = false;
        for (saver_block *b = blocks; b; b = b->next)
            any |= tagged(b, t) && b->device == device && b->physical != NULL;
        if (!any)
            continue;
        npa_devswitch sw;
        err = npa_device_enter(device, &sw);
        if (err != ACL_SUCCESS) {
            say(why, why_len, "device %d cannot be entered (error %d)", device, err);
            break;
        }
        err = NPA_REAL(aclrtSynchronizeDevice)();
        if (err != ACL_SUCCESS)
            say(why, why_len, "device %d cannot be synchronized (error %d)", device, err);
        for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
            if (!tagged(b, t) || b->device != device || b->physical == NULL || !b->backup)
                continue;
            if ((b->host = malloc(b->size)) == NULL) {
                err = ACL_ERROR_BAD_ALLOC;
                say(why, why_len, "no host memory for a %zu-byte backup: nothing was paused", b->size);
            } else if ((err = NPA_REAL(aclrtMemcpy)(b->host, b->size, (void *)b->addr, b->size,
                                                     ACL_MEMCPY_DEVICE_TO_HOST)) != ACL_SUCCESS) {
                say(why, why_len, "copying %#lx to the host failed (error %d): nothing was paused",
                    (unsigned long)b->addr, err);
            }
        }
        for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
            if (!tagged(b, t) || b->device != device || b->physical == NULL)
                continue;
            if ((err = unmap_physical(b)) != ACL_SUCCESS) {
                say(why, why_len, "unmapping %#lx failed (error %d): nothing was paused", (unsigned long)b->addr,
                    err);
                failed = b;
            }
        }
        if (err != ACL_SUCCESS) { /* map back what this pass unmapped; drop its backups */
            for (saver_block *b = blocks; b; b = b->next) {
                if (!tagged(b, t) || b->device != device || b == failed)
                    continue;
                if (b->physical == NULL && b->host != NULL)
                    restore(b);
                else if (b->physical != NULL) {
                    free(b->host);
                    b->host = NULL;
                }
            }
            if (failed) {
                free(failed->host);
                failed->host = NULL;
            }
        }
        npa_device_leave(&sw);
    }
    pthread_mutex_unlock(&saver_lock);
    return err;
}

NPA_EXPORT int npualloc_saver_resume(const char *tag, char *why, size_t why_len)
{
    pthread_mutex_lock(&saver_lock);
    int t = tag_of(tag);
    aclError err = ACL_SUCCESS;
    for (saver_block *b = blocks; b && err == ACL_SUCCESS; b = b->next) {
        if (!tagged(b, t) || b->physical != NULL)
            continue;
        npa_devswitch sw;
        err = npa_device_enter(b->device, &sw);
        if (err == ACL_SUCCESS) {
            err = restore(b);
            npa_device_leave(&sw);
        }
        if (err != ACL_SUCCESS)
            say(why, why_len,
                "device %d has no room for %zu bytes at %#lx (error %d: another process may hold it); "
                "what is still paused keeps its backup: resume again once memory is free",
                b->device, b->size, (unsigned long)b->addr, err);
    }
    pthread_mutex_unlock(&saver_lock);
    return err;
}

NPA_EXPORT int npualloc_saver_bytes(const char *tag, size_t *allocated, size_t *paused, size_t *backup)
{
    pthread_mutex_lock(&saver_lock);
    int t = tag_of(tag);
    *allocated = *paused = *backup = 0;
    for (saver_block *b = blocks; b; b = b->next) {
        if (!tagged(b, t))
            continue;
        *allocated += b->size;
        *paused += b->physical == NULL ? b->size : 0;
        *backup += b->host != NULL ? b->size : 0;
    }
    pthread_mutex_unlock(&saver_lock);
    return 0;
}
