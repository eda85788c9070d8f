/* npualloc's configuration: torch's allocator keys plus npualloc's own, parsed
 * from MINDTORCH_NPU_ALLOC_CONF / PYTORCH_NPU_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF.
 * Bad keys or values warn and keep what was in force; nothing here can crash. */
#ifndef NPUALLOC_CONFIG_H
#define NPUALLOC_CONFIG_H

#include <stdbool.h>
#include <stddef.h>

/* torch: 16 power-of-two intervals starting at 1 MiB. */
#define NPA_ROUNDUP_INTERVALS 16

typedef enum npa_reuse_policy {
    NPA_REUSE_AUTO = 0,  /* eager while one stream is in use, safe once more are */
    NPA_REUSE_EAGER = 1,
    NPA_REUSE_SAFE = 2,
} npa_reuse_policy;

/* torch's context= of _record_memory_history (its RecordContext; NEVER is
 * record_stacks:none): whose frames events carry once stacks are recorded. */
typedef enum npa_record_context {
    NPA_CONTEXT_ALLOC = 0,   /* a malloc's: its events carry them, a free's fall back on its alloc's */
    NPA_CONTEXT_STATE = 1,   /* a malloc's, for the live blocks and segments only: no trace entry shows them */
    NPA_CONTEXT_ALL = 2,     /* and a free's (or empty_cache's) for the events of that call */
} npa_record_context;

typedef struct npa_config {
    size_t max_split_size;          /* SIZE_MAX: unlimited */
    size_t max_non_split_rounding;  /* default 20 MiB */
    double garbage_collection_threshold; /* 0: off; else in (0, 1) */
    double per_process_memory_fraction;  /* (0, 1], default 1.0 */
    unsigned roundup_power2_divisions[NPA_ROUNDUP_INTERVALS]; /* 0 or 1: none */
    npa_reuse_policy reuse_policy;
    size_t record_history;          /* ring-buffer entries, 0: off */
    bool record_stacks;             /* events carry the Python frames of the malloc under way */
    npa_record_context record_context;
    char oom_snapshot[256];         /* path written on OOM, "" : none */
    bool expandable_segments;       /* never with max_split_size or a GC threshold (torch_npu's rule) */
    unsigned recent_blocks;         /* freed small blocks a device keeps whole for reuse, 0: none (torch) */
} npa_config;

/* What a refused entry leaves in force, for the warning to say: the parser
 * knows whether its string set the key earlier, the caller what the config
 * held before (the defaults at start, the values in force at run time). */
typedef enum npa_config_kept {
    NPA_KEPT_SAID = 0,   /* the message says it, or the entry names no setting */
    NPA_KEPT_BEFORE,     /* what the config held before the string */
    NPA_KEPT_EARLIER,    /* what an earlier entry of the string set */
} npa_config_kept;

/* Called once per problem with a one-line message naming the key and why. */
typedef void (*npa_config_warn_fn)(void *arg, const char *message, npa_config_kept kept);

void npa_config_defaults(npa_config *config);
/* Applies every valid key of text over *config; returns the number of problems. */
int npa_config_parse(npa_config *config, const char *text, npa_config_warn_fn warn, void *arg);
/* The key of one entry of such text ("key:value" or "key=value") as the
 * parser reads it: up to the entry's first ':' or '=', blanks (isspace)
 * trimmed. Its length (0: a blank entry), and *key where it starts. */
size_t npa_config_entry_key(const char *entry, size_t n, const char **key);
/* torch_npu's rule: expandable segments are refused beside max_split_size_mb
 * or a garbage_collection_threshold. Whether config has either key set. */
bool npa_config_excludes_expandable(const npa_config *config);
/* Run-time changes of the two sides of that rule (npualloc_set_config): each
 * is refused, with a warning and config unchanged (false), when it would put
 * expandable segments beside a GC threshold or max_split_size_mb. Stores are
 * atomic (an allocator's config is read by threads that allocate); the
 * caller serializes the check and the store against each other. */
bool npa_config_set_expandable(npa_config *config, bool on, npa_config_warn_fn warn, void *arg);
bool npa_config_set_gc_threshold(npa_config *config, double threshold, npa_config_warn_fn warn, void *arg);
/* memory_stats()'s max_split_size: the configured bytes, -1 when unlimited (torch's "unset"). */
static inline long long npa_config_max_split_stat(const npa_config *config) {
    return config->max_split_size == (size_t)-1 ? -1 : (long long)config->max_split_size;
}
/* The config in force as canonical "key:value,..." text; returns the length written. */
size_t npa_config_format(const npa_config *config, char *buf, size_t len);

#endif
