/* Sim-only introspection API of the simulated CANN runtime (libaclsim.so).
 * Tests use it to see what reached the "driver": call counts, device memory
 * outstanding, invalid device accesses, executor misuse. Nothing here exists
 * in the real CANN; code that must also run on real hardware looks these
 * symbols up with dlsym and treats their absence as "not simulated". */
#ifndef ACLSIM_H
#define ACLSIM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Calls of one API by name ("aclrtMalloc", "aclnnSimCopy", ...) since start or
 * the last aclsim_reset_counters(); UINT64_MAX for a name the sim does not know. */
uint64_t aclsim_call_count(const char *api);
/* Zeroes the call counts and the violation counters below (not live state). */
void aclsim_reset_counters(void);

/* Accounted bytes (round_up(size, 32) + 32 for aclrtMalloc) of live
 * aclrtMalloc-family allocations on a device; UINT64_MAX for a bad device. */
uint64_t aclsim_bytes_outstanding(int32_t device);
/* Live aclrtMalloc-family allocations on a device. */
uint64_t aclsim_live_allocations(int32_t device);
/* Bytes of live aclrtMallocPhysical handles on a device. */
uint64_t aclsim_physical_bytes_outstanding(int32_t device);
/* 1 when ptr is the start of a live allocation; fills what was asked and what
 * the capacity accounting charged. 0 otherwise. */
int aclsim_allocation_info(const void *ptr, uint64_t *requested, uint64_t *accounted);

/* Touches of device memory that is freed, unmapped or unknown, found when the
 * touching operation executed. */
uint64_t aclsim_invalid_accesses(void);
/* aclnn workspaces whose contents changed while their op was running (the
 * workspace was freed and reused by someone else before the op finished). */
uint64_t aclsim_workspace_clobbers(void);

uint64_t aclsim_executors_live(void);
uint64_t aclsim_executors_destroyed(void);
/* Repeatable executors destroyed while queued work still used them. */
uint64_t aclsim_executor_violations(void);

/* Duration of simulated aclnn ops created from now on (taken into the
 * executor at phase 1). Default: NPUSIM_OP_US. */
void aclsim_set_op_duration_us(uint64_t us);
uint64_t aclsim_op_duration_us(void);
/* Microseconds of driver latency (NPUSIM_MALLOC_US, NPUSIM_FREE_US) the
 * calling thread has spent inside the runtime's calls that have returned. */
uint64_t aclsim_thread_latency_us(void);
/* Microseconds the ops that finished have lasted on the stream workers,
 * each its executor's duration. */
uint64_t aclsim_op_time_us(void);

/* Makes the next n raw device allocations fail with 207001. */
void aclsim_fail_next_mallocs(uint32_t n);
/* After `skip` calls of api ("aclrtUnmapMem" or "aclrtFreePhysical") that
 * succeed, the next n fail with 207002 and change nothing. -1 for another name. */
int aclsim_fail_release(const char *api, uint32_t skip, uint32_t n);
/* Makes the next n calls of api fail with error, after their parameter
 * checks and without effect: "aclrtSetDevice" (the device cannot be entered),
 * "aclrtSynchronizeDevice", "aclrtSynchronizeStream", "aclrtRecordEvent",
 * "aclDestroyAclOpExecutor" (the executor stays live; a destroyed one still
 * aborts). n = 0 clears it. -1 for another name, or error 0 with n > 0. */
int aclsim_fail_next_calls(const char *api, uint32_t n, int32_t error);
/* Calls failed on purpose so far (all injection kinds). */
uint64_t aclsim_injected_failures(void);

#ifdef __cplusplus
}
#endif

#endif
