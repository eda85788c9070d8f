/* Finding the real runtime. LD_PRELOAD puts us first in the global scope, so
 * the runtime's own definitions are found in this order:
 *   1. dlsym(RTLD_NEXT): the global scope after us (programs linked against
 *      the runtime, libraries opened RTLD_GLOBAL);
 *   2. a copy the program already loaded, by file name (a library Python
 *      opened RTLD_LOCAL is loaded but invisible to RTLD_NEXT); libacl_rt.so
 *      before libascendcl.so, since CANN 8 keeps the implementation there;
 *   3. NPUALLOC_ACL_LIB, a path the user names;
 *   4. $ASCEND_HOME_PATH/lib64/<library>.
 * A function the program looked up through a handle is also offered to us by
 * dlsym.c. Whatever we find is compared with our own functions, so a
 * misconfigured path can never make a call loop back into us. Nothing here
 * knows anything about the simulator: the same code runs on a real CANN. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

_Atomic(void *) npa_real_fns[NPA_FN_COUNT];

enum { LIB_ACL, LIB_NNOP };

static const struct {
    const char *name;
    int lib;
} fn_info[NPA_FN_COUNT] = {
#define ACL(n) [NPA_FN_##n] = {#n, LIB_ACL}
#define NNOP(n) [NPA_FN_##n] = {#n, LIB_NNOP}
    ACL(aclInit), ACL(aclFinalize), ACL(aclrtSetDevice), ACL(aclrtResetDevice), ACL(aclrtResetDeviceForce),
    ACL(aclrtCreateContext),
    ACL(aclrtSetCurrentContext), ACL(aclrtDestroyContext), ACL(aclrtGetCurrentContext), ACL(aclrtMalloc),
    ACL(aclrtMallocAlign32), ACL(aclrtMallocCached), ACL(aclrtFree), ACL(aclrtFreeWithDevSync),
    ACL(aclrtCreateStream), ACL(aclrtDestroyStream), ACL(aclrtDestroyStreamForce), ACL(aclrtCreateStreamWithConfig),
    NNOP(aclnnFinalize), NNOP(aclSetAclOpExecutorRepeatable),
    NNOP(aclDestroyAclOpExecutor), ACL(aclrtGetDevice), ACL(aclrtSynchronizeDevice), ACL(aclrtGetMemInfo),
    ACL(aclrtCreateEvent), ACL(aclrtRecordEvent), ACL(aclrtQueryEventStatus), ACL(aclrtDestroyEvent),
    ACL(aclrtReserveMemAddress), ACL(aclrtReleaseMemAddress), ACL(aclrtMallocPhysical), ACL(aclrtFreePhysical),
    ACL(aclrtMapMem), ACL(aclrtUnmapMem), ACL(aclrtMemcpy), ACL(aclrtGetDeviceCount),
#undef ACL
#undef NNOP
};

/* Our own definitions, by hidden aliases: &aclrtMalloc itself would go
 * through the GOT and could name whatever the global scope resolves. */
#define SELF(n) extern __typeof__(n) npa_self_##n NPA_HIDDEN;
SELF(aclInit) SELF(aclFinalize) SELF(aclrtSetDevice) SELF(aclrtResetDevice) SELF(aclrtResetDeviceForce)
SELF(aclrtCreateContext)
SELF(aclrtSetCurrentContext) SELF(aclrtDestroyContext) SELF(aclrtGetCurrentContext) SELF(aclrtMalloc)
SELF(aclrtMallocAlign32) SELF(aclrtMallocCached) SELF(aclrtFree) SELF(aclrtFreeWithDevSync)
SELF(aclrtCreateStream) SELF(aclrtDestroyStream) SELF(aclrtDestroyStreamForce) SELF(aclrtCreateStreamWithConfig)
SELF(aclnnFinalize)
SELF(aclSetAclOpExecutorRepeatable) SELF(aclDestroyAclOpExecutor)
#undef SELF

static void *const self_fns[NPA_FN_INTERPOSED_COUNT] = {
#define SELF(n) [NPA_FN_##n] = (void *)npa_self_##n
    SELF(aclInit), SELF(aclFinalize), SELF(aclrtSetDevice), SELF(aclrtResetDevice), SELF(aclrtResetDeviceForce),
    SELF(aclrtCreateContext),
    SELF(aclrtSetCurrentContext), SELF(aclrtDestroyContext), SELF(aclrtGetCurrentContext), SELF(aclrtMalloc),
    SELF(aclrtMallocAlign32), SELF(aclrtMallocCached), SELF(aclrtFree), SELF(aclrtFreeWithDevSync),
    SELF(aclrtCreateStream), SELF(aclrtDestroyStream), SELF(aclrtDestroyStreamForce), SELF(aclrtCreateStreamWithConfig),
    SELF(aclnnFinalize),
    SELF(aclSetAclOpExecutorRepeatable), SELF(aclDestroyAclOpExecutor),
#undef SELF
};

static int is_self(void *p)
{
    for (int i = 0; i < NPA_FN_INTERPOSED_COUNT; i++)
        if (p == self_fns[i])
            return 1;
    return 0;
}

int npa_interposed_index(const char *name)
{
    if (name == NULL)
        return -1;
    for (int i = 0; i < NPA_FN_INTERPOSED_COUNT; i++)
        if (strcmp(name, fn_info[i].name) == 0)
            return i;
    return -1;
}

void *npa_self_fn(int index)
{
    return self_fns[index];
}

/* Handles of the libraries we take functions from, kept open for good: a
 * handle holds a reference, so the functions we cached cannot be unloaded
 * under us. */
/* After the stream locks in the lock order (hook.h); nothing of ours is taken under it. */
static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
#define MAX_HANDLES 8
static struct {
    char path[PATH_MAX];
    void *handle;
} handles[MAX_HANDLES];
static int handle_count;

static void *keep_open(const char *path, int flags)
{
    void *h = NULL;
    npa_mutex_lock(&open_lock);
    for (int i = 0; i < handle_count; i++)
        if (strcmp(handles[i].path, path) == 0) {
            h = handles[i].handle;
            goto out;
        }
    h = dlopen(path, flags);
    if (h != NULL && handle_count < MAX_HANDLES) {
        snprintf(handles[handle_count].path, PATH_MAX, "%s", path);
        handles[handle_count++].handle = h;
    }
out:
    npa_mutex_unlock(&open_lock);
    return h;
}

/* The library of a function we cached stays loaded for good: a program may
 * dlclose the handle it looked the function up through while we still call
 * it (for a cache miss, the exit's release of the cache, a deferred executor
 * destroy); an unloaded runtime would make those calls jump into nothing. */
static void keep_loaded(void *fn)
{
    Dl_info info;
    if (dladdr(fn, &info) && info.dli_fname != NULL && info.dli_fname[0] != '\0')
        keep_open(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

void npa_real_offer(int index, void *fn)
{
    void *expected = NULL;
    if (fn != NULL && !is_self(fn) &&
        atomic_compare_exchange_strong_explicit(&npa_real_fns[index], &expected, fn, memory_order_acq_rel,
                                                memory_order_acquire))
        keep_loaded(fn);
}

struct loaded_search {
    const char *base;
    char path[PATH_MAX];
};

static int match_loaded(struct dl_phdr_info *info, size_t size, void *arg)
{
    (void)size;
    struct loaded_search *s = arg;
    const char *name = info->dlpi_name;
    if (name == NULL || name[0] == '\0')
        return 0;
    const char *slash = strrchr(name, '/');
    const char *file = slash ? slash + 1 : name;
    size_t n = strlen(s->base);
    /* libascendcl.so and versioned names like libascendcl.so.8 */
    if (strncmp(file, s->base, n) == 0 && (file[n] == '\0' || file[n] == '.')) {
        snprintf(s->path, sizeof(s->path), "%s", name);
        return 1;
    }
    return 0;
}

static void *from_handle(void *h, const char *name)
{
    void *p = h ? npa_real_dlsym(h, name) : NULL;
    return p && !is_self(p) ? p : NULL;
}

static void *from_loaded(const char *base, const char *name)
{
    struct loaded_search s = {.base = base};
    if (!dl_iterate_phdr(match_loaded, &s))
        return NULL;
    return from_handle(keep_open(s.path, RTLD_LAZY | RTLD_NOLOAD), name);
}

static void *resolve(npa_fn fn)
{
    const char *name = fn_info[fn].name;
    int nnop = fn_info[fn].lib == LIB_NNOP;
    void *p = npa_real_dlsym(RTLD_NEXT, name);
    if (p != NULL && !is_self(p))
        return p;
    if (nnop) {
        if ((p = from_loaded("libnnopbase.so", name)))
            return p;
    } else if ((p = from_loaded("libacl_rt.so", name)) || (p = from_loaded("libascendcl.so", name))) {
        return p;
    }
    const char *env = getenv("NPUALLOC_ACL_LIB");
    if (env && *env && (p = from_handle(keep_open(env, RTLD_NOW | RTLD_LOCAL), name)))
        return p;
    const char *home = getenv("ASCEND_HOME_PATH");
    if (home && *home) {
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/lib64/%s", home, nnop ? "libnnopbase.so" : "libascendcl.so");
        if ((p = from_handle(keep_open(path, RTLD_NOW | RTLD_LOCAL), name)))
            return p;
    }
    return NULL;
}

/* Caches what resolve found (the first finder wins). */
static void *remember(npa_fn fn, void *p)
{
    void *expected = NULL;
    if (atomic_compare_exchange_strong_explicit(&npa_real_fns[fn], &expected, p, memory_order_acq_rel,
                                                memory_order_acquire))
        keep_loaded(p); /* RTLD_NEXT may have found it in a library the program opened RTLD_GLOBAL */
    else
        p = expected; /* another thread (or a handle lookup) got there first */
    return p;
}

void *npa_real_optional(npa_fn fn)
{
    void *p = atomic_load_explicit(&npa_real_fns[fn], memory_order_acquire);
    if (p == NULL && (p = resolve(fn)) != NULL)
        p = remember(fn, p);
    return p;
}

void *npa_real_slow(npa_fn fn)
{
    void *p = resolve(fn);
    if (p == NULL) {
        /* Not cached: the runtime may still be loaded later. */
        if (fn_info[fn].lib == LIB_NNOP)
            npa_warn_once("cannot find the aclnn runtime (libnnopbase.so: not in the global scope, not loaded, "
                          "not in NPUALLOC_ACL_LIB or $ASCEND_HOME_PATH/lib64); aclnn executor calls fail with %d",
                          npa_no_runtime_error(fn));
        else
            npa_warn_once("cannot find the CANN runtime (libacl_rt.so/libascendcl.so: not in the global scope, "
                          "not loaded, not in NPUALLOC_ACL_LIB or $ASCEND_HOME_PATH/lib64); ACL calls fail with %d",
                          npa_no_runtime_error(fn));
        return NULL;
    }
    return remember(fn, p);
}

int npa_no_runtime_error(npa_fn fn)
{
    return fn_info[fn].lib == LIB_NNOP ? ACLNN_ERR_INNER_NULLPTR : ACL_ERROR_UNINITIALIZE;
}

void npa_realacl_lock_for_fork(void)
{
    npa_mutex_lock(&open_lock);
}

void npa_realacl_unlock_after_fork(void)
{
    npa_mutex_unlock(&open_lock);
}
