/* Validity of device memory an operation touches, judged when the operation
 * executes (for async work: on the stream worker, when it actually runs, as a
 * real device would fault or corrupt at that moment, not at enqueue time). */
#include "internal.h"

/* Lock held. The arena holding p, or NULL. */
static struct sim_arena *arena_of(const void *p, long *idx)
{
    for (int32_t id = 0; id < sim_config()->device_count; id++) {
        struct sim_arena *a = &sim_device(id)->arena;
        long i = sim_arena_find(a, p);
        if (i >= 0) {
            *idx = i;
            return a;
        }
    }
    return NULL;
}

int sim_is_device_address(const void *p)
{
    long idx;
    return arena_of(p, &idx) != NULL || sim_vmm_classify(p, 1) >= 0;
}

static void invalid(const char *what, const void *p, size_t n, const char *why)
{
    sim_note_invalid_access();
    sim_report("invalid device access by %s: [%p, +%zu) %s", what, p, n, why);
}

int sim_check_range(const void *p, size_t n, const char *what)
{
    if (n == 0)
        return 1;
    long idx;
    struct sim_arena *a = arena_of(p, &idx);
    if (a != NULL) {
        const struct sim_segment *seg = &a->segs[idx];
        uint64_t off = (uint64_t)((const char *)p - a->base);
        if (seg->live && off + n <= seg->off + seg->len)
            return 1;
        invalid(what, p, n, seg->live ? "overruns its allocation" : "is freed device memory");
        /* Freed blocks stay mapped, so the effect still happens (and corrupts,
         * as it would on hardware) unless it runs off the mapped part. */
        return off + n <= a->mapped_rw;
    }
    int vmm = sim_vmm_classify(p, n);
    if (vmm == 1)
        return 1;
    invalid(what, p, n, vmm == 0 ? "is not fully mapped (VMM)" : "is not device memory");
    return 0;
}

int sim_check_host_range(const void *p, size_t n, const char *what)
{
    if (n == 0)
        return 1;
    const char *last = (const char *)p + n - 1;
    if (!sim_is_device_address(p) && !sim_is_device_address(last))
        return 1;
    /* Device memory is not host memory: the copy engine would take the
     * device address for a host one (and no check of device memory, freed
     * or not, would apply). The kind names the wrong side. */
    invalid(what, p, n, "is device memory where the copy kind says host memory");
    return 0;
}
