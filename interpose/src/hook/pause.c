/* `npualloc pause <pid>` / `npualloc resume <pid>` for an unmodified
 * program. The pause command is applied by whichever thread next enters the
 * allocator: it releases the process's device memory (npa_pause, which
 * keeps every allocator lock, so other threads entering the allocator wait
 * on them), acknowledges, and then waits here, answering the requests that
 * follow, until a resume brings the memory back. A resume that cannot (the
 * memory is taken) is answered as failed and the process stays paused, its
 * backup kept, for the next resume. memory_saver's allocations are paused
 * with the rest (saver.c), backed up whatever their region asked. The
 * state and byte counts are in the region header, for stats and ls, under
 * a seqlock of their own (npa_region_publish_pause). */
#include <stdbool.h>
#include <stdio.h>
#include <time.h>

#include "hook.h"
#include "region/region.h"

/* The next request after seq (the requester serialises with flock, so one at
 * a time). Polled 2 ms apart at first, then ever more slowly up to 50 ms: a
 * job paused for hours woke 500 times a second (a soak run), and a resume
 * answered within 50 ms is in time for any requester. */
static uint64_t next_request(npualloc_region *r, uint64_t seq)
{
    const long first_ns = 2 * 1000 * 1000, longest_ns = 50 * 1000 * 1000;
    struct timespec nap = {.tv_sec = 0, .tv_nsec = first_ns};
    uint64_t requested;
    while ((requested = __atomic_load_n(&r->command.request_seq, __ATOMIC_ACQUIRE)) == seq) {
        nanosleep(&nap, NULL);
        long next_ns = nap.tv_nsec + nap.tv_nsec / 8;
        nap.tv_nsec = next_ns < longest_ns ? next_ns : longest_ns;
    }
    return requested;
}

/* A pause that could not be undone: the process stays paused with its
 * backup (the locks held, memory_saver's too), as after a resume that found
 * no room, for `resume` to finish; the command fails. */
static int32_t stay_paused(npa_allocator *a, npa_paused *paused, bool *held)
{
    npa_saver_command_hold();
    *held = true;
    npa_paused_sample_device_memory(a, paused);
    return NPUALLOC_CMD_EFAILED;
}

/* The header's figures of a paused process (saver_lock held): what is
 * released now, the cache's and memory_saver's. Not what the pause
 * released: a resume that failed may have mapped memory_saver's back (it
 * goes first), and that figure counted it released for as long as the
 * process stayed paused. */
static void publish_paused(npualloc_region *r, uint32_t state, const npa_paused *paused)
{
    size_t released, backup, saver_released, saver_backup;
    npa_paused_bytes(paused, &released, &backup);
    npa_saver_command_paused_bytes(&saver_released, &saver_backup);
    npa_region_publish_pause(r, state, released + saver_released, backup + saver_backup);
}

/* The cache's memory first (npa_pause takes every allocator lock), then
 * memory_saver's (saver_lock, held too): all or none. *held: whether the
 * process is paused now (the locks held), whatever the status. */
static int32_t pause_all(npa_allocator *a, npa_paused **paused, bool *held, char *why, size_t len)
{
    *held = false;
    *paused = NULL;
    npa_error err = npa_pause(a, paused, why, len);
    if (err != NPA_OK && *paused == NULL) {
        npa_warn_once("pause refused, the process runs on: %s", why);
        return err == NPA_ERR_INVALID_PARAM ? NPUALLOC_CMD_ENOTPAUSABLE : NPUALLOC_CMD_EFAILED;
    }
    if (err != NPA_OK) { /* failed half way, and what it unmapped could not be mapped back */
        npa_warn_once("pause failed and the process stays paused, resume it: %s", why);
        return stay_paused(a, *paused, held);
    }
    if (npa_saver_command_pause(why, len) == ACL_SUCCESS) {
        *held = true;
        npa_paused_sample_device_memory(a, *paused);
        return NPUALLOC_CMD_OK;
    }
    npa_warn_once("pause refused, the process runs on: memory_saver: %s", why);
    char undo[256];
    if (npa_resume(a, *paused, undo, sizeof undo) == NPA_OK)
        return NPUALLOC_CMD_EFAILED;
    /* The cache's memory was taken meanwhile by another process. */
    npa_warn_once("and the cache's memory could not be mapped back (%s): the process stays paused, resume it", undo);
    return stay_paused(a, *paused, held);
}

int32_t npa_pause_command(npa_allocator *a, npualloc_region *r, uint64_t *seq)
{
    char why[256];
    npa_paused *paused = NULL;
    bool held;
    npa_region_publish_pause(r, NPUALLOC_PAUSING, 0, 0);
    int32_t status = pause_all(a, &paused, &held, why, sizeof why);
    if (!held) {
        npa_region_publish_pause(r, NPUALLOC_RUNNING, 0, 0);
        return status;
    }
    publish_paused(r, NPUALLOC_PAUSED, paused);
    npa_region_acknowledge(r, *seq, status);
    bool saver_back = false;
    for (;;) {
        *seq = next_request(r, *seq);
        npa_command_claim claim = npa_region_take_command(r, *seq);
        if (claim == NPA_COMMAND_WITHDRAWN)
            continue; /* its requester gave up on it and answered it */
        if (claim == NPA_COMMAND_DAMAGED) {
            npa_region_acknowledge(r, *seq, NPUALLOC_CMD_EINVAL);
            continue;
        }
        if (__atomic_load_n(&r->command.code, __ATOMIC_RELAXED) != NPUALLOC_CMD_RESUME) {
            npa_region_acknowledge(r, *seq, NPUALLOC_CMD_EPAUSED); /* the allocator is held: nothing else can run */
            continue;
        }
        publish_paused(r, NPUALLOC_RESUMING, paused);
        /* memory_saver's first: what it maps back stays mapped if the cache's
         * then finds no room, so a retry only does the rest. */
        saver_back = saver_back || npa_saver_command_resume(why, sizeof why) == ACL_SUCCESS;
        if (saver_back && npa_resume(a, paused, why, sizeof why) == NPA_OK) {
            npa_saver_command_done();
            npa_region_publish_pause(r, NPUALLOC_RUNNING, 0, 0);
            return NPUALLOC_CMD_OK; /* the caller acknowledges the resume */
        }
        npa_warn_once("resume failed, still paused: %s", why);
        npa_paused_sample_device_memory(a, paused); /* memory_saver's blocks may be back */
        publish_paused(r, NPUALLOC_PAUSED, paused);
        npa_region_acknowledge(r, *seq, NPUALLOC_CMD_EFAILED);
    }
}
