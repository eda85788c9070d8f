/* npualloc.h: the in-process C API, callable before the first allocation
 * (then there is nothing cached and the stats are zero). */
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"
#include "npualloc.h"
#include "region/region.h"

NPA_EXPORT int npualloc_is_active(void)
{
    if (npa_hook_disabled())
        return 0;
    if (atomic_load_explicit(&npa_serving, memory_order_acquire) != NULL)
        return 1;
    /* Not allocated yet (or finalized): active when the program's aclrtMalloc
     * would reach us, i.e. we are preloaded rather than merely dlopened by the
     * Python package. */
    return npa_real_dlsym(RTLD_DEFAULT, "aclrtMalloc") == npa_self_fn(NPA_FN_aclrtMalloc);
}

NPA_EXPORT int npualloc_get_stats(int device, npualloc_device_stats *out)
{
    if (!npa_device_in_range(device) || out == NULL)
        return -1;
    npa_allocator *a = npa_hook_allocator_any();
    if (a != NULL) {
        npa_get_stats(a, device, out);
    } else {
        /* No allocation yet: torch's figures are all 0 but the setting. */
        memset(out, 0, sizeof(*out));
        out->max_split_size = npa_config_max_split_stat(npa_hook_config());
    }
    return 0;
}

NPA_EXPORT void npualloc_empty_cache(int device)
{
    /* Only while serving: after aclFinalize the segments are the runtime's past. */
    npa_allocator *a = atomic_load_explicit(&npa_serving, memory_order_acquire);
    if (a == NULL)
        return;
    bool stack = npa_pystack_take_for_free(); /* torch's emptyCache: its releases carry the caller's frames */
    npa_empty_cache(a, device);
    if (stack)
        npa_pystack_drop();
}

NPA_EXPORT void npualloc_reset_peak_stats(int device)
{
    npa_allocator *a = npa_hook_allocator_any();
    if (a != NULL)
        npa_reset_peak_stats(a, device);
}

NPA_EXPORT void npualloc_reset_accumulated_stats(int device)
{
    npa_allocator *a = npa_hook_allocator_any();
    if (a != NULL)
        npa_reset_accumulated_stats(a, device);
}

NPA_EXPORT size_t npualloc_get_config(char *buf, size_t len)
{
    npa_allocator *a = npa_hook_allocator_any();
    return npa_config_format(a ? npa_get_config(a) : npa_hook_config(), buf, len);
}

/* Whatever the parser kept, the call changes nothing: the value in force stays. */
static void set_config_warn(void *arg, const char *message, npa_config_kept kept)
{
    (void)arg, (void)kept;
    npa_warn_forwarded("npualloc_set_config: %s (not applied)", message);
}

/* 0 when the allocator took the key, else -1 (warned). */
static int apply_to_allocator(npa_allocator *a, const npa_config *parsed, npa_runtime_key key)
{
    /* The core warns through the backend when torch_npu's rule refuses these. */
    if (key == NPA_KEY_GC_THRESHOLD)
        return npa_set_gc_threshold(a, parsed->garbage_collection_threshold);
    if (key == NPA_KEY_EXPANDABLE_SEGMENTS)
        return npa_set_expandable_segments(a, parsed->expandable_segments);
    if (key == NPA_KEY_RECORD_STACKS) {
        npa_set_record_stacks(a, parsed->record_stacks);
        return 0;
    }
    if (key == NPA_KEY_RECORD_CONTEXT) {
        npa_set_record_context(a, parsed->record_context);
        return 0;
    }
    if (npa_set_record_history(a, parsed->record_history) != 0) {
        npa_warn_once("npualloc_set_config: no host memory for %zu history entries per device; recording is off",
                      parsed->record_history);
        return -1;
    }
    return 0;
}

/* Applies key from parsed (the other fields are defaults): to the allocator,
 * or, before there is one, to the config it will be created with; and to the
 * config later allocators (a forked child's) start with. 0 when taken, else 1
 * (warned). */
static int apply_runtime_key(npa_allocator *a, const npa_config *parsed, npa_runtime_key key)
{
    if (a == NULL && npa_hook_preinit_config(parsed, key, set_config_warn, &a) != 0)
        return 1;
    if (a == NULL)
        return 0; /* the allocator will be created with it */
    if (apply_to_allocator(a, parsed, key) != 0)
        return 1;
    npa_hook_remember_config(parsed, key);
    return 0;
}

/* One "key:value" item; list values keep their brackets. */
static int apply_item(npa_allocator *a, const char *item, size_t len)
{
    char text[256];
    if (len >= sizeof(text)) {
        npa_warn_once("npualloc_set_config: item too long (not applied)");
        return 1;
    }
    memcpy(text, item, len);
    text[len] = '\0';
    /* The key as the parser reads it: a newline between entries is a
     * blank there, not part of the next key. */
    const char *key;
    size_t key_len = npa_config_entry_key(text, len, &key);
    if (key_len == 0)
        return 0; /* an empty item, as in "a:1,,b:2" */
    static const struct {
        const char *name;
        npa_runtime_key key;
    } runtime_keys[] = {{"garbage_collection_threshold", NPA_KEY_GC_THRESHOLD},
                        {"record_history", NPA_KEY_RECORD_HISTORY},
                        {"record_stacks", NPA_KEY_RECORD_STACKS},
                        {"record_context", NPA_KEY_RECORD_CONTEXT},
                        {"expandable_segments", NPA_KEY_EXPANDABLE_SEGMENTS}};
    int which = -1;
    for (size_t i = 0; i < sizeof(runtime_keys) / sizeof(runtime_keys[0]); i++)
        if (key_len == strlen(runtime_keys[i].name) && strncmp(key, runtime_keys[i].name, key_len) == 0)
            which = (int)runtime_keys[i].key;
    if (which < 0) {
        npa_warn_once("npualloc_set_config: %.*s cannot change at run time; set it in %s before the program "
                      "starts",
                      (int)key_len, key, npa_hook_config_source());
        return 1;
    }
    npa_config parsed;
    npa_config_defaults(&parsed);
    if (npa_config_parse(&parsed, text, set_config_warn, NULL) != 0)
        return 1;
    return apply_runtime_key(a, &parsed, (npa_runtime_key)which);
}

NPA_EXPORT int npualloc_set_config(const char *text)
{
    if (text == NULL)
        return 0;
    npa_allocator *a = npa_hook_allocator_any();
    int rejected = 0;
    const char *item = text;
    int depth = 0;
    for (const char *p = text;; p++) {
        if (*p == '[')
            depth++;
        else if (*p == ']' && depth > 0)
            depth--;
        if (*p == '\0' || (*p == ',' && depth == 0)) {
            rejected += apply_item(a, item, (size_t)(p - item));
            if (*p == '\0')
                break;
            item = p + 1;
        }
    }
    npa_region_publish_config(a);
    return rejected;
}

/* Not through npualloc_set_config: torch's parser, which that follows,
 * refuses garbage_collection_threshold:0, so a config string cannot turn the
 * threshold off again. */
NPA_EXPORT int npualloc_set_gc_threshold(double threshold)
{
    if (!(threshold >= 0.0 && threshold < 1.0)) { /* also rejects NaN */
        npa_warn_once("npualloc_set_gc_threshold: %g is not in [0, 1) (not applied)", threshold);
        return -1;
    }
    npa_config parsed;
    npa_config_defaults(&parsed);
    parsed.garbage_collection_threshold = threshold;
    npa_allocator *a = npa_hook_allocator_any();
    int rejected = apply_runtime_key(a, &parsed, NPA_KEY_GC_THRESHOLD);
    npa_region_publish_config(npa_hook_allocator_any());
    return rejected ? -1 : 0;
}

int npa_hook_set_memory_fraction(npa_allocator *a, int device, double fraction, const char **why)
{
    if (!(fraction >= 0.0 && fraction <= 1.0)) { /* also rejects NaN */
        *why = "the fraction is not in [0, 1]";
        return -1;
    }
    if (!npa_device_in_range(device)) {
        *why = "no such device index";
        return -1;
    }
    /* Asked before the allocator is made for it: a call the runtime cannot
     * size a cap for (before aclInit) is refused with that reason, and makes
     * no allocator or region for nothing. The core asks again under the
     * device lock, for a device whose size it does not know yet. */
    size_t free_bytes, total_bytes;
    if (npa_hook_mem_get_info(device, &free_bytes, &total_bytes) != ACL_SUCCESS) {
        *why = "the runtime cannot tell the device's memory";
        return -1;
    }
    if (a == NULL && (a = npa_hook_allocator()) == NULL) { /* made now, as torch's lazy init makes it */
        *why = "no allocator serves this process (npualloc disabled, or ACL finalized)";
        return -1;
    }
    if (npa_set_memory_fraction(a, device, fraction) != 0) {
        *why = "its cap is below the smallest segment (2 MiB), which would refuse every allocation";
        return -1;
    }
    return 0;
}

NPA_EXPORT int npualloc_set_memory_fraction(double fraction, int device)
{
    const char *why;
    if (npa_hook_set_memory_fraction(NULL, device, fraction, &why) == 0)
        return 0;
    npa_warn_once("npualloc_set_memory_fraction: %g on device %d: %s (not applied)", fraction, device, why);
    return -1;
}

NPA_EXPORT void *npualloc_snapshot(size_t *size)
{
    if (size == NULL)
        return NULL;
    *size = 0;
    return npa_snapshot_pickle(npa_hook_allocator_any(), npa_hook_config(), size);
}

NPA_EXPORT void npualloc_free_snapshot(void *snapshot)
{
    free(snapshot);
}

NPA_EXPORT int npualloc_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    return npa_hook_mem_get_info(device, free_bytes, total_bytes);
}

NPA_EXPORT int npualloc_device_count(void)
{
    return npa_runtime_device_count();
}

NPA_EXPORT int npualloc_current_device(void)
{
    /* A query, not an ACL call of the program's: where no runtime is found
     * the thread has no device, without the warning that ACL calls fail
     * (npa_thread_device's lookup gives one, for an allocation). */
    if (npa_tls_device < 0 && npa_real_optional(NPA_FN_aclrtGetDevice) == NULL)
        return -1;
    return npa_thread_device();
}
