/* TEMPORARY: weak stand-ins for the two core entries the hook layer asked for
 * in core.h (npa_set_record_history, npa_count) until the core implements
 * them; a strong definition in interpose/src/core replaces these at link time.
 * Until then record_history cannot change at run time and the executor-destroy
 * counters stay 0. Delete this file once the core has both. */
#include "hook.h"

__attribute__((weak)) void npa_set_record_history(npa_allocator *a, size_t max_entries)
{
    (void)a;
    (void)max_entries;
}

__attribute__((weak)) void npa_count(npa_allocator *a, int device, npa_counter counter, int64_t delta)
{
    (void)a;
    (void)device;
    (void)counter;
    (void)delta;
}
