/* Which device each context the program created is on. A context's destroy
 * may tear its device down (its last reference), so the repeatable
 * executors made on that device are settled first (npa_exec_settle); the
 * runtime does not say which device a context is on without making it
 * current, but aclrtCreateContext names it. Settling every device instead
 * made executors on the others forget theirs, so one launched again after
 * a helper context elsewhere was destroyed was fenced nowhere.
 *
 * A context aclrtGetCurrentContext hands out that we did not see created
 * is a device's default one, which the runtime does not destroy (CANN
 * destroys only a context aclrtCreateContext made): its destroy settles
 * nothing. One we never saw at all (made past us) stays unknown: its
 * destroy settles every device. Contexts are few (the defaults one per
 * device): a list searched end to end. */
#include <pthread.h>
#include <stdlib.h>

#include "hook.h"

/* device: NPA_CONTEXT_DEFAULT for a default context. force_resets: its
 * device's force resets begun before its creation. One begun since dropped
 * the context's reference with the device's others, and its destroy then
 * drops none (device.c's count). */
typedef struct known_context {
    aclrtContext context;
    int device;
    unsigned force_resets;
} known_context;

static known_context *known;
static size_t nknown, cap_known;
/* A leaf in the lock order (hook.h): nothing is taken or called under it. */
static pthread_mutex_t context_lock = PTHREAD_MUTEX_INITIALIZER;

/* context_lock held: its index, or nknown. */
static size_t find(aclrtContext context)
{
    size_t i = 0;
    while (i < nknown && known[i].context != context)
        i++;
    return i;
}

/* context_lock held: k recorded (replace: over an entry of its context). */
static void remember(known_context k, bool replace)
{
    size_t i = find(k.context);
    if (i < nknown && !replace)
        return;
    if (i == nknown && nknown == cap_known) {
        size_t ncap = cap_known ? cap_known * 2 : 8;
        known_context *nk = realloc(known, ncap * sizeof(*nk));
        if (nk != NULL) {
            known = nk;
            cap_known = ncap;
        }
    }
    if (i < cap_known) { /* no room: left unknown, its destroy settles every device */
        known[i] = k;
        if (i == nknown)
            nknown++;
    }
}

void npa_context_created(aclrtContext context, int device, unsigned force_resets)
{
    npa_mutex_lock(&context_lock);
    remember((known_context){context, device, force_resets}, true); /* a destroyed one's address given again */
    npa_mutex_unlock(&context_lock);
}

/* A context created through us stays what it is when made current. */
void npa_context_handed_out(aclrtContext context)
{
    npa_mutex_lock(&context_lock);
    remember((known_context){context, NPA_CONTEXT_DEFAULT, 0}, false);
    npa_mutex_unlock(&context_lock);
}

int npa_context_device(aclrtContext context, unsigned *force_resets)
{
    npa_mutex_lock(&context_lock);
    size_t i = find(context);
    int device = i < nknown ? known[i].device : -1;
    *force_resets = i < nknown ? known[i].force_resets : 0;
    npa_mutex_unlock(&context_lock);
    return device;
}

void npa_context_destroyed(aclrtContext context)
{
    npa_mutex_lock(&context_lock);
    size_t i = find(context);
    if (i < nknown)
        known[i] = known[--nknown];
    npa_mutex_unlock(&context_lock);
}

/* aclFinalize ends every context: an address the next session hands out
 * (its default contexts' too) names none of them. */
void npa_contexts_forget(void)
{
    npa_mutex_lock(&context_lock);
    nknown = 0;
    npa_mutex_unlock(&context_lock);
}

void npa_contexts_lock_for_fork(void)
{
    npa_mutex_lock(&context_lock);
}

void npa_contexts_unlock_after_fork(void)
{
    npa_mutex_unlock(&context_lock);
}
