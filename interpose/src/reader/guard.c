/* A region's owner can shrink its file under a reader's mapping (ftruncate
 * after the reader checked the size), and the reader's next access would
 * fault (SIGBUS) and kill it: another user could so end root's `npualloc
 * stats`, `ls` or an exporter (found by an audit on 2026-11-25, reproduced).
 * The library catches that fault for the mappings it made: it maps private
 * zero pages over the region, so the access completes (reading zeros), and
 * marks the mapping lost, which every read then reports as the file having
 * been truncated. Any other SIGBUS goes to the handler that was there before
 * ours (the default: the process ends as it would have). */
#define _GNU_SOURCE
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/mman.h>

#include "guard.h"

/* A fixed table, so the handler walks it without a lock or an allocation;
 * past it, npualloc_reader_open refuses (an unguarded mapping would let the
 * file's owner end the reader). */
#define GUARDED_MAX NPUALLOC_READER_OPEN_MAX

static struct {
    _Atomic uintptr_t base; /* 0: a free slot */
    atomic_int lost;
} g_guarded[GUARDED_MAX];

static struct sigaction g_previous;
static pthread_once_t g_installed = PTHREAD_ONCE_INIT;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    uintptr_t address = (uintptr_t)info->si_addr;
    for (int i = 0; i < GUARDED_MAX; i++) {
        uintptr_t base = atomic_load_explicit(&g_guarded[i].base, memory_order_acquire);
        if (base != 0 && address - base < sizeof(npualloc_region)) {
            /* Lost before the zero pages appear: another thread reading the
             * mapping would otherwise find a seq of 0 there, take the zeros
             * for figures and still be told nothing was lost. mmap is a plain
             * system call, safe in a handler. */
            atomic_store_explicit(&g_guarded[i].lost, 1, memory_order_seq_cst);
            mmap((void *)base, sizeof(npualloc_region), PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
            return; /* the access runs again, on the zero pages */
        }
    }
    if (g_previous.sa_flags & SA_SIGINFO) {
        g_previous.sa_sigaction(sig, info, context);
    } else if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN) {
        g_previous.sa_handler(sig);
    } else {
        sigaction(SIGBUS, &g_previous, NULL); /* the default again, and the fault again under it */
        raise(sig);
    }
}

static void install(void)
{
    struct sigaction ours = {.sa_sigaction = on_sigbus, .sa_flags = SA_SIGINFO | SA_ONSTACK};
    sigemptyset(&ours.sa_mask);
    sigaction(SIGBUS, &ours, &g_previous);
}

int npa_reader_guard(const npualloc_region *region)
{
    pthread_once(&g_installed, install);
    for (int i = 0; i < GUARDED_MAX; i++) {
        uintptr_t free_slot = 0;
        if (atomic_compare_exchange_strong(&g_guarded[i].base, &free_slot, (uintptr_t)region)) {
            atomic_store_explicit(&g_guarded[i].lost, 0, memory_order_release); /* before any read of it */
            return 0;
        }
    }
    return -1;
}

void npa_reader_unguard(const npualloc_region *region)
{
    for (int i = 0; i < GUARDED_MAX; i++) {
        uintptr_t base = (uintptr_t)region;
        if (atomic_compare_exchange_strong(&g_guarded[i].base, &base, 0))
            return;
    }
}

int32_t npualloc_reader_lost(const npualloc_region *region)
{
    for (int i = 0; i < GUARDED_MAX; i++)
        if (atomic_load_explicit(&g_guarded[i].base, memory_order_acquire) == (uintptr_t)region)
            return atomic_load_explicit(&g_guarded[i].lost, memory_order_acquire);
    return 0;
}
