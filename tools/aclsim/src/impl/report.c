/* Violation counters and the sim's stderr reports. A misbehaving program can
 * make the same mistake millions of times, so only the first REPORT_LIMIT
 * reports are printed; the counters keep counting. Never writes to stdout. */
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "internal.h"

#define REPORT_LIMIT 16

static _Atomic uint64_t reports_printed;
static _Atomic uint64_t invalid_accesses, workspace_clobbers, executor_violations;

void sim_report(const char *fmt, ...)
{
    uint64_t n = atomic_fetch_add(&reports_printed, 1);
    if (n > REPORT_LIMIT)
        return;
    if (n == REPORT_LIMIT) {
        fputs("aclsim: further reports suppressed (see aclsim_* counters)\n", stderr);
        return;
    }
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "aclsim: %s\n", line);
}

void sim_fatal(const char *fmt, ...)
{
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "aclsim: %s\n", line);
    fflush(stderr);
    abort();
}

void sim_note_invalid_access(void) { atomic_fetch_add(&invalid_accesses, 1); }
void sim_note_workspace_clobber(void) { atomic_fetch_add(&workspace_clobbers, 1); }
void sim_note_executor_violation(void) { atomic_fetch_add(&executor_violations, 1); }

void sim_reset_violations(void)
{
    atomic_store(&invalid_accesses, 0);
    atomic_store(&workspace_clobbers, 0);
    atomic_store(&executor_violations, 0);
}

SIM_EXPORT uint64_t aclsim_invalid_accesses(void) { return atomic_load(&invalid_accesses); }
SIM_EXPORT uint64_t aclsim_workspace_clobbers(void) { return atomic_load(&workspace_clobbers); }
SIM_EXPORT uint64_t aclsim_executor_violations(void) { return atomic_load(&executor_violations); }
