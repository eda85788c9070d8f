/* The allocator config string: torch's keys plus npualloc's own, as
 * comma-separated key:value (or key=value) with bracketed list values. A bad
 * key or value warns once and keeps the value in force (MindTorch v2's
 * behaviour, not torch's exception). The parser reads only up to the string's
 * NUL, copies nothing unbounded and converts numbers with overflow checks, so
 * any byte string is safe input. */
#include <ctype.h>
#include <limits.h>
#include <locale.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "internal.h"

/* A piece of the input: not NUL-terminated. */
typedef struct span {
    const char *p;
    size_t n;
} span;

#define WHY_LEN 96
#define MAX_DIVISIONS ((uint64_t)1 << 31)
static const char EXPANDABLE_EXCLUDED[] =
    "expandable_segments:True cannot be combined with max_split_size_mb or garbage_collection_threshold "
    "(torch_npu's rule)";

static span trim(span s) {
    while (s.n && isspace((unsigned char)s.p[0])) s.p++, s.n--;
    while (s.n && isspace((unsigned char)s.p[s.n - 1])) s.n--;
    return s;
}

static bool span_is(span s, const char *word) { return strlen(word) == s.n && memcmp(s.p, word, s.n) == 0; }

static bool span_is_nocase(span s, const char *word) {
    return strlen(word) == s.n && strncasecmp(s.p, word, s.n) == 0;
}

/* Printable, bounded copy of user text for a warning. */
static void describe(span s, char *out, size_t len) {
    size_t limit = len - 4; /* room for "..." and NUL */
    size_t k = 0;
    for (size_t i = 0; i < s.n && k < limit; i++) out[k++] = isprint((unsigned char)s.p[i]) ? s.p[i] : '?';
    if (s.n > limit) memcpy(out + k, "...", 3), k += 3;
    out[k] = '\0';
}

static bool parse_uint(span s, uint64_t *out) {
    if (s.n == 0) return false;
    uint64_t v = 0;
    for (size_t i = 0; i < s.n; i++) {
        if (s.p[i] < '0' || s.p[i] > '9') return false;
        unsigned digit = (unsigned)(s.p[i] - '0');
        if (v > (UINT64_MAX - digit) / 10) return false;
        v = v * 10 + digit;
    }
    *out = v;
    return true;
}

/* Numbers in a config string and in its canonical text are C's (0.8),
 * whatever LC_NUMERIC the host program chose: strtod and printf follow it,
 * and a program in a comma-decimal locale had 0.8 refused as no number
 * (strtod stopped at the point) and its config written as 0,8, which ends
 * the entry at the comma. The C locale is made once and put on the calling
 * thread for the conversion only (uselocale); where it cannot be made, the
 * thread's own locale is used as before. */
static locale_t c_numeric;
static pthread_once_t c_numeric_once = PTHREAD_ONCE_INIT;

static void make_c_numeric(void) { c_numeric = newlocale(LC_NUMERIC_MASK, "C", (locale_t)0); }

/* The thread's locale to give back to leave_c_numeric, (locale_t)0 when unchanged. */
static locale_t enter_c_numeric(void) {
    pthread_once(&c_numeric_once, make_c_numeric);
    return c_numeric ? uselocale(c_numeric) : (locale_t)0;
}

static void leave_c_numeric(locale_t previous) {
    if (previous) uselocale(previous);
}

static bool parse_double(span s, double *out) {
    char buf[64];
    if (s.n == 0 || s.n >= sizeof buf) return false;
    memcpy(buf, s.p, s.n);
    buf[s.n] = '\0';
    char *end = NULL;
    locale_t previous = enter_c_numeric();
    double v = strtod(buf, &end);
    leave_c_numeric(previous);
    if (end != buf + s.n) return false;
    *out = v;
    return true;
}

static bool is_power_of_two(uint64_t v) { return v && (v & (v - 1)) == 0; }

static unsigned log2_floor(uint64_t v) { return 63u - (unsigned)__builtin_clzll(v); }

/* torch's rule for both MB sizes: at least kLargeBuffer (20 MB). */
static bool parse_mb_from_20(span v, size_t *bytes, char *why) {
    uint64_t mb;
    if (!parse_uint(v, &mb)) return snprintf(why, WHY_LEN, "expected a whole number of MB"), false;
    if (mb < NPA_LARGE_BUFFER / NPA_MiB) return snprintf(why, WHY_LEN, "must be at least 20"), false;
    if (mb > SIZE_MAX / NPA_MiB) return snprintf(why, WHY_LEN, "too large"), false;
    *bytes = (size_t)mb * NPA_MiB;
    return true;
}

static bool set_max_split_size(npa_config *c, span v, char *why) {
    return parse_mb_from_20(v, &c->max_split_size, why);
}

static bool set_max_non_split_rounding(npa_config *c, span v, char *why) {
    return parse_mb_from_20(v, &c->max_non_split_rounding, why);
}

static bool set_gc_threshold(npa_config *c, span v, char *why) {
    double t;
    if (!parse_double(v, &t) || !(t > 0.0 && t < 1.0))
        return snprintf(why, WHY_LEN, "must be a number strictly between 0 and 1"), false;
    c->garbage_collection_threshold = t;
    return true;
}

static bool set_fraction(npa_config *c, span v, char *why) {
    double f;
    if (!parse_double(v, &f) || !(f > 0.0 && f <= 1.0))
        return snprintf(why, WHY_LEN, "must be a number in (0, 1]"), false;
    c->per_process_memory_fraction = f;
    return true;
}

/* One `mb:divisions` entry of the list form; applies it to table. */
static bool apply_division_entry(span item, unsigned table[NPA_ROUNDUP_INTERVALS], bool *seen_first,
                                 size_t *last_index, char *why) {
    const char *colon = memchr(item.p, ':', item.n);
    if (!colon) return snprintf(why, WHY_LEN, "list entries are mb:divisions"), false;
    span key = trim((span){item.p, (size_t)(colon - item.p)});
    span val = trim((span){colon + 1, item.n - (size_t)(colon - item.p) - 1});
    uint64_t divisions;
    if (!parse_uint(val, &divisions) || (divisions && !is_power_of_two(divisions)) || divisions > MAX_DIVISIONS)
        return snprintf(why, WHY_LEN, "divisions must be 0 or a power of 2"), false;
    if (span_is(key, ">")) {
        /* As torch (c10's AllocatorConfig, torch_npu's): ">" fills every
         * interval after the last one named; with none named yet, every one
         * after the first (which then keeps what it had). */
        for (size_t i = *last_index + 1; i < NPA_ROUNDUP_INTERVALS; i++)
            table[i] = (unsigned)divisions;
        return true;
    }
    uint64_t mb;
    if (!parse_uint(key, &mb) || !is_power_of_two(mb))
        return snprintf(why, WHY_LEN, "interval keys must be MB powers of 2 or >"), false;
    size_t index = log2_floor(mb);
    if (index > NPA_ROUNDUP_INTERVALS - 1) index = NPA_ROUNDUP_INTERVALS - 1;
    if (!*seen_first) {
        /* The first entry also covers every interval below it. */
        for (size_t i = 0; i < index; i++) table[i] = (unsigned)divisions;
        *seen_first = true;
    }
    table[index] = (unsigned)divisions;
    *last_index = index;
    return true;
}

static bool set_roundup_divisions(npa_config *c, span v, char *why) {
    unsigned table[NPA_ROUNDUP_INTERVALS];
    memcpy(table, c->roundup_power2_divisions, sizeof table);
    if (v.n && v.p[0] == '[') {
        if (v.n < 2 || v.p[v.n - 1] != ']') return snprintf(why, WHY_LEN, "unterminated list"), false;
        span inner = trim((span){v.p + 1, v.n - 2});
        bool seen_first = false;
        size_t last_index = 0;
        while (inner.n) {
            const char *comma = memchr(inner.p, ',', inner.n);
            size_t len = comma ? (size_t)(comma - inner.p) : inner.n;
            span item = trim((span){inner.p, len});
            if (!item.n) return snprintf(why, WHY_LEN, "empty list entry"), false;
            if (!apply_division_entry(item, table, &seen_first, &last_index, why)) return false;
            if (!comma) break;
            inner = (span){comma + 1, inner.n - len - 1};
            if (!trim(inner).n) return snprintf(why, WHY_LEN, "empty list entry"), false;
        }
    } else {
        uint64_t divisions;
        if (!parse_uint(v, &divisions) || !is_power_of_two(divisions) || divisions > MAX_DIVISIONS)
            return snprintf(why, WHY_LEN, "must be a power of 2 or a [mb:divisions,...,>:divisions] list"),
                   false;
        for (size_t i = 0; i < NPA_ROUNDUP_INTERVALS; i++) table[i] = (unsigned)divisions;
    }
    memcpy(c->roundup_power2_divisions, table, sizeof table);
    return true;
}

static const char *const reuse_policy_names[] = {
    [NPA_REUSE_AUTO] = "auto", [NPA_REUSE_EAGER] = "eager", [NPA_REUSE_SAFE] = "safe"};

static bool set_reuse_policy(npa_config *c, span v, char *why) {
    for (size_t i = 0; i < sizeof reuse_policy_names / sizeof *reuse_policy_names; i++) {
        if (span_is_nocase(v, reuse_policy_names[i])) {
            c->reuse_policy = (npa_reuse_policy)i;
            return true;
        }
    }
    return snprintf(why, WHY_LEN, "must be eager, safe or auto"), false;
}

static bool set_record_history(npa_config *c, span v, char *why) {
    uint64_t n;
    if (!parse_uint(v, &n) || n > NPUALLOC_MAX_RECORD_HISTORY)
        return snprintf(why, WHY_LEN, "must be a number of entries up to %llu",
                        (unsigned long long)NPUALLOC_MAX_RECORD_HISTORY),
               false;
    c->record_history = (size_t)n;
    return true;
}

static bool set_oom_snapshot(npa_config *c, span v, char *why) {
    if (v.n >= sizeof c->oom_snapshot)
        return snprintf(why, WHY_LEN, "path longer than %zu bytes", sizeof c->oom_snapshot - 1), false;
    if (memchr(v.p, '\0', v.n)) return snprintf(why, WHY_LEN, "path contains NUL"), false;
    memcpy(c->oom_snapshot, v.p, v.n);
    c->oom_snapshot[v.n] = '\0';
    return true;
}

/* torch takes True or False; true and 1 (false and 0) are tolerated. */
static bool set_expandable_segments(npa_config *c, span v, char *why) {
    if (span_is_nocase(v, "true") || span_is(v, "1")) c->expandable_segments = true;
    else if (span_is_nocase(v, "false") || span_is(v, "0")) c->expandable_segments = false;
    else return snprintf(why, WHY_LEN, "must be True or False"), false;
    return true;
}

/* npualloc's recent cache (core/recent.c): how many freed small blocks each
 * device keeps whole for the next malloc of their size; 0 merges every free
 * at once, as torch does, for programs that compare inactive_split or
 * snapshot shapes with torch's exactly. */
static bool set_recent_blocks(npa_config *c, span v, char *why) {
    uint64_t n;
    if (!parse_uint(v, &n) || n > NPA_RECENT_MAX)
        return snprintf(why, WHY_LEN, "must be a number of blocks from 0 to %d", NPA_RECENT_MAX), false;
    c->recent_blocks = (unsigned)n;
    return true;
}

/* torch's stacks= of _record_memory_history: "python" (or "all": npualloc
 * has no C++ frames to add) records the Python frames of each allocation. */
static bool set_record_stacks(npa_config *c, span v, char *why) {
    if (span_is(v, "python") || span_is(v, "all")) c->record_stacks = true;
    else if (span_is(v, "none")) c->record_stacks = false;
    else return snprintf(why, WHY_LEN, "must be python, all or none"), false;
    return true;
}

/* torch's context= of _record_memory_history, for the stacks above: "all"
 * also takes the frames of each free (and empty_cache), which its events
 * carry; "alloc" (the default) takes a malloc's only, and the frees fall
 * back on their alloc's; "state" takes a malloc's for the snapshot's live
 * blocks and segments, and no trace entry carries frames. */
static bool set_record_context(npa_config *c, span v, char *why) {
    if (span_is(v, "all")) c->record_context = NPA_CONTEXT_ALL;
    else if (span_is(v, "alloc")) c->record_context = NPA_CONTEXT_ALLOC;
    else if (span_is(v, "state")) c->record_context = NPA_CONTEXT_STATE;
    else return snprintf(why, WHY_LEN, "must be state, alloc or all"), false;
    return true;
}

/* Each setter returns false with the reason in why (WHY_LEN bytes). */
typedef struct known_key {
    const char *name;
    bool (*apply)(npa_config *c, span value, char *why);
} known_key;

static const known_key known_keys[] = {
    {"max_split_size_mb", set_max_split_size},
    {"max_non_split_rounding_mb", set_max_non_split_rounding},
    {"garbage_collection_threshold", set_gc_threshold},
    {"roundup_power2_divisions", set_roundup_divisions},
    {"per_process_memory_fraction", set_fraction},
    {"reuse_policy", set_reuse_policy},
    {"record_history", set_record_history},
    {"record_stacks", set_record_stacks},
    {"record_context", set_record_context},
    {"oom_snapshot", set_oom_snapshot},
    {"expandable_segments", set_expandable_segments},
    {"recent_blocks", set_recent_blocks},
};

/* torch / torch_npu keys npualloc accepts without implementing; a value that
 * asks for the default (one of `defaults`, "|"-separated) is silent. */
typedef struct ignored_key {
    const char *name;
    const char *defaults;
} ignored_key;

static const ignored_key ignored_keys[] = {
    {"release_lock_on_cudamalloc", "false|0"},
    {"backend", "native"},
    {"base_addr_aligned_kb", "16"},
    {"page_size", ""},
    {"segment_size_mb", ""},
};

static bool is_default_value(const char *defaults, span value) {
    for (const char *p = defaults; *p;) {
        const char *bar = strchr(p, '|');
        size_t len = bar ? (size_t)(bar - p) : strlen(p);
        if (len == value.n && strncasecmp(p, value.p, len) == 0) return true;
        p += len + (bar ? 1 : 0);
    }
    return false;
}

static void vwarnf(npa_config_warn_fn warn, void *arg, npa_config_kept kept, const char *format, va_list ap)
    __attribute__((format(printf, 4, 0)));
static void vwarnf(npa_config_warn_fn warn, void *arg, npa_config_kept kept, const char *format, va_list ap) {
    char message[256];
    vsnprintf(message, sizeof message, format, ap);
    warn(arg, message, kept);
}

/* A warning whose text says what stays (NPA_KEPT_SAID). */
static void warnf(npa_config_warn_fn warn, void *arg, const char *format, ...)
    __attribute__((format(printf, 3, 4)));
static void warnf(npa_config_warn_fn warn, void *arg, const char *format, ...) {
    if (!warn) return;
    va_list ap;
    va_start(ap, format);
    vwarnf(warn, arg, NPA_KEPT_SAID, format, ap);
    va_end(ap);
}

/* The warnings about a config string's entries: the first
 * ENTRY_WARNINGS_SHOWN, then a count. A string of hundreds of bad entries
 * says so in a few lines, and what the string as a whole means (expandable
 * segments turned off by a clash) is still said after them. */
#define ENTRY_WARNINGS_SHOWN 8
typedef struct {
    npa_config_warn_fn warn;
    void *arg;
    unsigned shown, hidden;
} entry_warnings;

static void entry_warnf(entry_warnings *w, npa_config_kept kept, const char *format, ...)
    __attribute__((format(printf, 3, 4)));
static void entry_warnf(entry_warnings *w, npa_config_kept kept, const char *format, ...) {
    if (!w->warn) return;
    if (w->shown == ENTRY_WARNINGS_SHOWN) {
        w->hidden++;
        return;
    }
    w->shown++;
    va_list ap;
    va_start(ap, format);
    vwarnf(w->warn, w->arg, kept, format, ap);
    va_end(ap);
}

/* Where an entry's key ends: its first ':' or '=', else its end. */
static size_t key_end(span entry) {
    size_t sep = 0;
    while (sep < entry.n && entry.p[sep] != ':' && entry.p[sep] != '=') sep++;
    return sep;
}

size_t npa_config_entry_key(const char *entry, size_t n, const char **key) {
    span k = trim((span){entry, key_end((span){entry, n})});
    *key = k.p;
    return k.n;
}

/* Returns 1 when the entry is a problem (warned), else 0. set: the
 * known_keys an earlier entry of the string set (bit i for known_keys[i]),
 * whose value a refused one keeps. */
_Static_assert(sizeof known_keys / sizeof *known_keys <= sizeof(unsigned) * CHAR_BIT,
               "apply_entry's set holds a bit per known key");
static int apply_entry(npa_config *config, span entry, entry_warnings *w, unsigned *set) {
    char shown_key[52], shown_value[52];
    size_t sep = key_end(entry);
    if (sep == entry.n) {
        describe(entry, shown_key, sizeof shown_key);
        entry_warnf(w, NPA_KEPT_SAID, "'%s' is not a key:value entry; ignored", shown_key);
        return 1;
    }
    span key = trim((span){entry.p, sep});
    span value = trim((span){entry.p + sep + 1, entry.n - sep - 1});
    describe(key, shown_key, sizeof shown_key);
    describe(value, shown_value, sizeof shown_value);

    for (size_t i = 0; i < sizeof known_keys / sizeof *known_keys; i++) {
        if (!span_is(key, known_keys[i].name)) continue;
        char why[WHY_LEN] = "";
        if (known_keys[i].apply(config, value, why)) {
            *set |= 1u << i;
            return 0;
        }
        entry_warnf(w, (*set & 1u << i) ? NPA_KEPT_EARLIER : NPA_KEPT_BEFORE, "%s: invalid value '%s' (%s)",
                    shown_key, shown_value, why);
        return 1;
    }
    for (size_t i = 0; i < sizeof ignored_keys / sizeof *ignored_keys; i++) {
        if (!span_is(key, ignored_keys[i].name)) continue;
        if (!is_default_value(ignored_keys[i].defaults, value))
            entry_warnf(w, NPA_KEPT_SAID, "%s:%s is not implemented by npualloc; ignored", shown_key, shown_value);
        return 0;
    }
    entry_warnf(w, NPA_KEPT_SAID, "unknown key '%s'; ignored", shown_key);
    return 1;
}

void npa_config_defaults(npa_config *config) {
    memset(config, 0, sizeof *config);
    config->max_split_size = SIZE_MAX;
    config->max_non_split_rounding = NPA_LARGE_BUFFER;
    config->garbage_collection_threshold = 0.0;
    config->per_process_memory_fraction = 1.0;
    config->reuse_policy = NPA_REUSE_AUTO;
    config->record_context = NPA_CONTEXT_ALLOC;
    config->recent_blocks = NPA_RECENT_MAX;
}

int npa_config_parse(npa_config *config, const char *text, npa_config_warn_fn warn, void *arg) {
    if (!config || !text) return 0;
    int problems = 0;
    entry_warnings entries = {.warn = warn, .arg = arg};
    unsigned set = 0;
    const char *p = text;
    while (*p) {
        /* An entry ends at a comma outside brackets. */
        const char *start = p;
        size_t depth = 0;
        for (; *p && !(*p == ',' && depth == 0); p++) {
            if (*p == '[') depth++;
            else if (*p == ']' && depth) depth--;
        }
        span entry = trim((span){start, (size_t)(p - start)});
        if (*p == ',') p++;
        if (entry.n) problems += apply_entry(config, entry, &entries, &set);
    }
    if (entries.hidden)
        warnf(warn, arg, "%u more warnings about entries are not shown", entries.hidden);
    if (config->expandable_segments && npa_config_excludes_expandable(config)) {
        warnf(warn, arg, "%s; expandable segments stay off", EXPANDABLE_EXCLUDED);
        config->expandable_segments = false;
        problems++;
    }
    return problems;
}

/* torch_npu refuses expandable segments beside either key: blocks of an
 * expandable segment are split freely and given back page by page, which
 * neither key's rules can describe. */
bool npa_config_excludes_expandable(const npa_config *config) {
    double threshold;
    __atomic_load(&config->garbage_collection_threshold, &threshold, __ATOMIC_RELAXED);
    return config->max_split_size != SIZE_MAX || threshold > 0.0;
}

bool npa_config_set_expandable(npa_config *config, bool on, npa_config_warn_fn warn, void *arg) {
    if (on && npa_config_excludes_expandable(config)) {
        warnf(warn, arg, "%s; expandable segments stay off", EXPANDABLE_EXCLUDED);
        return false;
    }
    __atomic_store_n(&config->expandable_segments, on, __ATOMIC_RELAXED);
    return true;
}

bool npa_config_set_gc_threshold(npa_config *config, double threshold, npa_config_warn_fn warn, void *arg) {
    if (threshold > 0.0 && __atomic_load_n(&config->expandable_segments, __ATOMIC_RELAXED)) {
        warnf(warn, arg, "%s; the threshold stays off (set expandable_segments:False first)", EXPANDABLE_EXCLUDED);
        return false;
    }
    __atomic_store(&config->garbage_collection_threshold, &threshold, __ATOMIC_RELAXED);
    return true;
}

/* Appends to buf as snprintf would, tracking the length actually written. */
typedef struct text_out {
    char *buf;
    size_t len, used;
} text_out;

static void out_printf(text_out *o, const char *format, ...) __attribute__((format(printf, 2, 3)));
static void out_printf(text_out *o, const char *format, ...) {
    if (o->used + 1 >= o->len) return;
    va_list ap;
    va_start(ap, format);
    int n = vsnprintf(o->buf + o->used, o->len - o->used, format, ap);
    va_end(ap);
    if (n < 0) return;
    size_t room = o->len - o->used - 1;
    o->used += (size_t)n < room ? (size_t)n : room;
}

/* Shortest text that reads back as the same double. */
static void format_double(double v, char *buf, size_t len) {
    locale_t previous = enter_c_numeric();
    snprintf(buf, len, "%.15g", v);
    if (strtod(buf, NULL) != v) snprintf(buf, len, "%.17g", v);
    leave_c_numeric(previous);
}

size_t npa_config_format(const npa_config *c, char *buf, size_t len) {
    if (!c || !buf || len == 0) return 0;
    buf[0] = '\0';
    npa_config d;
    npa_config_defaults(&d);
    text_out o = {buf, len, 0};
    const char *sep = "";
    char number[40];
    /* The keys npualloc_set_config changes under running threads: read once
     * each, atomically. */
    double threshold;
    __atomic_load(&c->garbage_collection_threshold, &threshold, __ATOMIC_RELAXED);
    size_t record_history = __atomic_load_n(&c->record_history, __ATOMIC_RELAXED);
    bool record_stacks = __atomic_load_n(&c->record_stacks, __ATOMIC_RELAXED);
    npa_record_context record_context = __atomic_load_n(&c->record_context, __ATOMIC_RELAXED);
    bool expandable = __atomic_load_n(&c->expandable_segments, __ATOMIC_RELAXED);
    /* Only what differs from the defaults, so the text parses back into the
     * same config. */
    if (c->max_split_size != d.max_split_size) {
        out_printf(&o, "%smax_split_size_mb:%zu", sep, c->max_split_size / NPA_MiB);
        sep = ",";
    }
    if (c->max_non_split_rounding != d.max_non_split_rounding) {
        out_printf(&o, "%smax_non_split_rounding_mb:%zu", sep, c->max_non_split_rounding / NPA_MiB);
        sep = ",";
    }
    if (threshold != d.garbage_collection_threshold) {
        format_double(threshold, number, sizeof number);
        out_printf(&o, "%sgarbage_collection_threshold:%s", sep, number);
        sep = ",";
    }
    if (memcmp(c->roundup_power2_divisions, d.roundup_power2_divisions, sizeof d.roundup_power2_divisions) != 0) {
        const unsigned *t = c->roundup_power2_divisions;
        bool uniform = is_power_of_two(t[0]);
        for (size_t i = 1; i < NPA_ROUNDUP_INTERVALS; i++) uniform = uniform && t[i] == t[0];
        out_printf(&o, "%sroundup_power2_divisions:", sep);
        if (uniform) {
            out_printf(&o, "%u", t[0]);
        } else {
            for (size_t i = 0; i < NPA_ROUNDUP_INTERVALS; i++)
                out_printf(&o, "%s%zu:%u", i ? "," : "[", (size_t)1 << i, t[i]);
            out_printf(&o, "]");
        }
        sep = ",";
    }
    if (c->per_process_memory_fraction != d.per_process_memory_fraction) {
        format_double(c->per_process_memory_fraction, number, sizeof number);
        out_printf(&o, "%sper_process_memory_fraction:%s", sep, number);
        sep = ",";
    }
    if (c->reuse_policy != d.reuse_policy && (unsigned)c->reuse_policy <= NPA_REUSE_SAFE) {
        out_printf(&o, "%sreuse_policy:%s", sep, reuse_policy_names[c->reuse_policy]);
        sep = ",";
    }
    if (record_history != d.record_history) {
        out_printf(&o, "%srecord_history:%zu", sep, record_history);
        sep = ",";
    }
    if (record_stacks) {
        out_printf(&o, "%srecord_stacks:python", sep);
        sep = ",";
    }
    if (record_context != d.record_context) {
        out_printf(&o, "%srecord_context:%s", sep, record_context == NPA_CONTEXT_ALL ? "all" : "state");
        sep = ",";
    }
    if (expandable) {
        out_printf(&o, "%sexpandable_segments:True", sep);
        sep = ",";
    }
    if (c->recent_blocks != d.recent_blocks) {
        out_printf(&o, "%srecent_blocks:%u", sep, c->recent_blocks);
        sep = ",";
    }
    if (c->oom_snapshot[0]) out_printf(&o, "%soom_snapshot:%.*s", sep, (int)sizeof c->oom_snapshot, c->oom_snapshot);
    return o.used;
}
