/* Handle lookups. ctypes attribute access (MindTorch's aclnn bindings),
 * torch_npu's FunctionLoader and C programs that dlopen the runtime all call
 * dlsym(handle, "aclrtMalloc"), which binds to the library's own definition and
 * never sees LD_PRELOAD. Exporting dlsym puts us in front of those lookups: for
 * the names we interpose we hand out our function (and keep the real one the
 * handle found, the only way to reach a library opened RTLD_LOCAL); every
 * other lookup is the real dlsym's, untouched. */
#define _GNU_SOURCE
#include <dlfcn.h>

#include "hook.h"

/* This file is built without sanitizer instrumentation and always optimised
 * (interpose/build.mk): the sanitizer runtimes look up the functions they wrap
 * with dlsym during their own start-up, before their shadow memory exists, so
 * that path must run no instrumented code, call nothing they intercept, and
 * keep its tail call at every optimisation level. */

static _Atomic(npa_dlsym_fn) real_dlsym;

npa_dlsym_fn npa_get_real_dlsym(void)
{
    npa_dlsym_fn f = atomic_load_explicit(&real_dlsym, memory_order_acquire);
    if (f != NULL)
        return f;
    /* We export dlsym ourselves, so the real one is reached by version: the
     * newest glibc first (2.34 moved it into libc), then the base versions of
     * aarch64 and x86_64. */
    static const char *const versions[] = {"GLIBC_2.34", "GLIBC_2.17", "GLIBC_2.2.5"};
    for (size_t i = 0; f == NULL && i < sizeof(versions) / sizeof(versions[0]); i++)
        f = (npa_dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", versions[i]);
    atomic_store_explicit(&real_dlsym, f, memory_order_release);
    return f;
}

void *npa_real_dlsym(void *handle, const char *name)
{
    npa_dlsym_fn f = npa_get_real_dlsym();
    return f ? f(handle, name) : NULL;
}

/* Only names starting "acl" can be ours; anything else never leaves this file. */
static inline int may_be_interposed(const char *name)
{
    return name != NULL && name[0] == 'a' && name[1] == 'c' && name[2] == 'l';
}

NPA_EXPORT void *dlsym(void *handle, const char *name)
{
    int index = may_be_interposed(name) ? npa_interposed_index(name) : -1;
    if (NPA_LIKELY(index < 0)) {
        npa_dlsym_fn real = npa_get_real_dlsym();
        /* A tail call, so the real dlsym sees our caller's return address:
         * dlsym(RTLD_NEXT, ...) means "after the caller", not "after us". */
        return real ? real(handle, name) : NULL;
    }
    void *found = npa_real_dlsym(handle, name);
    if (found == NULL)
        return NULL; /* the handle has no such symbol: say so, as dlsym would */
    npa_real_offer(index, found);
    return npa_self_fn(index);
}
