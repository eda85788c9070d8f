/* The device lock's waits (lock.h): spin, then sleep on the futex. */
#define _GNU_SOURCE
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "lock.h"

#define SPINS 200

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield" ::: "memory");
#endif
}

void npa_lock_wait(npa_lock *l) {
    for (int i = 0; i < SPINS; i++) {
        cpu_relax();
        int expected = 0;
        if (__atomic_load_n(&l->state, __ATOMIC_RELAXED) == 0 &&
            __atomic_compare_exchange_n(&l->state, &expected, 1, false, __ATOMIC_ACQUIRE, __ATOMIC_RELAXED))
            return;
    }
    /* From here the word reads 2 while anyone may sleep on it: whoever takes
     * it this way keeps it 2, so its release wakes the next sleeper. */
    while (__atomic_exchange_n(&l->state, 2, __ATOMIC_ACQUIRE) != 0)
        syscall(SYS_futex, &l->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void npa_lock_wake(npa_lock *l) { syscall(SYS_futex, &l->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }
