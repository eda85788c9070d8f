/* Time the simulated hardware takes. Driver calls cost the calling thread CPU
 * time, so they busy-wait on the monotonic clock (sleeping would undershoot
 * short latencies by the scheduler's wake-up slack). Ops run on stream
 * workers and may last long, so they sleep and leave the CPU to others. */
#include <stdatomic.h>
#include <time.h>

#include "internal.h"

/* What the latency model charged, for tests to assert on instead of timing
 * calls: a caller's driver latency is its own thread's, ops' time is the
 * workers'. Counted after the wait, so a call that returned has been charged. */
static _Thread_local uint64_t thread_latency_us;
static _Atomic uint64_t op_time_us;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void sim_spend_us(uint64_t us)
{
    if (us == 0)
        return;
    uint64_t deadline = now_ns() + us * 1000u;
    while (now_ns() < deadline) {
    }
    thread_latency_us += us;
}

void sim_sleep_us(uint64_t us)
{
    if (us == 0)
        return;
    struct timespec ts = {.tv_sec = (time_t)(us / 1000000u), .tv_nsec = (long)(us % 1000000u) * 1000};
    while (nanosleep(&ts, &ts) != 0) {
    }
    atomic_fetch_add_explicit(&op_time_us, us, memory_order_relaxed);
}

SIM_EXPORT uint64_t aclsim_thread_latency_us(void) { return thread_latency_us; }

SIM_EXPORT uint64_t aclsim_op_time_us(void) { return atomic_load_explicit(&op_time_us, memory_order_relaxed); }
