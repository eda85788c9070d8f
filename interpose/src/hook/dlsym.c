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

NPA_EXPORT void *dlsym(void *handle, const char *name)
{
    int index = npa_interposed_index(name);
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
