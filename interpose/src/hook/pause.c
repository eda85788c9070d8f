/* `npualloc pause <pid>` / `npualloc resume <pid>` for an unmodified
 * program. The pause command is applied by whichever thread next enters the
 * allocator: it releases the process's device memory (npa_pause, which
 * keeps every allocator lock, so other threads entering the allocator wait
 * on them), acknowledges, and then waits here, answering the requests that
 * follow, until a resume brings the memory back. A resume that cannot (the
 * memory is taken) is answered as failed and the process stays paused, its
 * backup kept, for the next resume. The state and byte counts are in the
 * region header, for stats and ls. */
#include <stdio.h>
#include <time.h>

#include "hook.h"
#include "region/region.h"

static void set_state(npualloc_region *r, uint32_t state, size_t paused, size_t backup)
{
    __atomic_store_n(&r->header.paused_bytes, (uint64_t)paused, __ATOMIC_RELAXED);
    __atomic_store_n(&r->header.backup_bytes, (uint64_t)backup, __ATOMIC_RELAXED);
    __atomic_store_n(&r->header.pause_state, state, __ATOMIC_RELEASE);
}

static void acknowledge(npualloc_region *r, uint64_t seq, int32_t status)
{
    __atomic_store_n(&r->command.ack_status, status, __ATOMIC_RELAXED);
    __atomic_store_n(&r->command.ack_seq, seq, __ATOMIC_RELEASE);
}

/* The next request after seq (the requester serialises with flock, so one at a time). */
static uint64_t next_request(npualloc_region *r, uint64_t seq)
{
    const struct timespec nap = {.tv_sec = 0, .tv_nsec = 2 * 1000 * 1000};
    uint64_t requested;
    while ((requested = __atomic_load_n(&r->command.request_seq, __ATOMIC_ACQUIRE)) == seq)
        nanosleep(&nap, NULL);
    return requested;
}

int32_t npa_pause_command(npa_allocator *a, npualloc_region *r, uint64_t *seq)
{
    char why[256];
    npa_paused *paused = NULL;
    set_state(r, NPUALLOC_PAUSING, 0, 0);
    npa_error err = npa_pause(a, &paused, why, sizeof why);
    if (err != NPA_OK) {
        set_state(r, NPUALLOC_RUNNING, 0, 0);
        npa_warn_once("pause refused, the process runs on: %s", why);
        return err == NPA_ERR_INVALID_PARAM ? NPUALLOC_CMD_ENOTPAUSABLE : NPUALLOC_CMD_EFAILED;
    }
    size_t unmapped, backup;
    npa_paused_bytes(paused, &unmapped, &backup);
    set_state(r, NPUALLOC_PAUSED, unmapped, backup);
    acknowledge(r, *seq, NPUALLOC_CMD_OK);
    for (;;) {
        *seq = next_request(r, *seq);
        if (__atomic_load_n(&r->command.code, __ATOMIC_RELAXED) != NPUALLOC_CMD_RESUME) {
            acknowledge(r, *seq, NPUALLOC_CMD_EPAUSED); /* the allocator is held: nothing else can run */
            continue;
        }
        set_state(r, NPUALLOC_RESUMING, unmapped, backup);
        if (npa_resume(a, paused, why, sizeof why) == NPA_OK) {
            set_state(r, NPUALLOC_RUNNING, 0, 0);
            return NPUALLOC_CMD_OK; /* the caller acknowledges the resume */
        }
        npa_warn_once("resume failed, still paused: %s", why);
        set_state(r, NPUALLOC_PAUSED, unmapped, backup);
        acknowledge(r, *seq, NPUALLOC_CMD_EFAILED);
    }
}
