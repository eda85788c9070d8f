/* The config parser: every key's valid and invalid values, the syntax
 * variants, ignored torch keys, expandable_segments and its clashes, one warning per problem naming the key,
 * canonical formatting that parses back, and fuzz runs over random, mutated
 * and adversarial strings (meant for ASan: any out-of-bounds read fails it). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core.h"
#include "test_util.h"

typedef struct warnings {
    int count;
    char last[256];
    npa_config_kept last_kept;
} warnings;

static void collect(void *arg, const char *message, npa_config_kept kept) {
    warnings *w = arg;
    w->count++;
    snprintf(w->last, sizeof w->last, "%s", message);
    w->last_kept = kept;
}

/* Parses text over the defaults; returns the problem count. */
static int parse(const char *text, npa_config *c, warnings *w) {
    npa_config_defaults(c);
    memset(w, 0, sizeof *w);
    return npa_config_parse(c, text, collect, w);
}

static void test_valid_keys(void) {
    npa_config c;
    warnings w;
    CHECK_EQ(parse("max_split_size_mb:64,max_non_split_rounding_mb:32,garbage_collection_threshold:0.6,"
                   "per_process_memory_fraction:0.75,reuse_policy:safe,record_history:1000,"
                   "oom_snapshot:/tmp/oom.pickle,roundup_power2_divisions:4,recent_blocks:3",
                   &c, &w),
             0);
    CHECK_EQ(w.count, 0);
    CHECK_EQ(c.max_split_size, 64 * MiB);
    CHECK_EQ(c.max_non_split_rounding, 32 * MiB);
    CHECK(c.garbage_collection_threshold == 0.6);
    CHECK(c.per_process_memory_fraction == 0.75);
    CHECK_EQ(c.reuse_policy, NPA_REUSE_SAFE);
    CHECK_EQ(c.record_history, 1000);
    CHECK(strcmp(c.oom_snapshot, "/tmp/oom.pickle") == 0);
    for (int i = 0; i < NPA_ROUNDUP_INTERVALS; i++) CHECK_EQ(c.roundup_power2_divisions[i], 4);
    CHECK_EQ(c.recent_blocks, 3);
    CHECK_EQ(parse("recent_blocks:0", &c, &w), 0);
    CHECK_EQ(c.recent_blocks, 0);
    CHECK_EQ(parse("per_process_memory_fraction:1", &c, &w), 0);
    CHECK(c.per_process_memory_fraction == 1.0);
    CHECK_EQ(parse("max_split_size_mb:20", &c, &w), 0); /* the minimum itself */
    CHECK_EQ(c.max_split_size, 20 * MiB);
}

static void test_syntax_variants(void) {
    npa_config c;
    warnings w;
    CHECK_EQ(parse("  max_split_size_mb = 100 ,\tgarbage_collection_threshold=0.5 ,, reuse_policy: EAGER ,", &c, &w),
             0);
    CHECK_EQ(w.count, 0);
    CHECK_EQ(c.max_split_size, 100 * MiB);
    CHECK(c.garbage_collection_threshold == 0.5);
    CHECK_EQ(c.reuse_policy, NPA_REUSE_EAGER);
    CHECK_EQ(parse("", &c, &w), 0);
    CHECK_EQ(parse(" , ,", &c, &w), 0);
    CHECK_EQ(w.count, 0);
    /* Commas inside brackets belong to the list. */
    CHECK_EQ(parse("roundup_power2_divisions:[ 1:2 , >:4 ],max_split_size_mb:30", &c, &w), 0);
    CHECK_EQ(c.roundup_power2_divisions[0], 2); /* torch: '>' starts after the last interval named */
    CHECK_EQ(c.roundup_power2_divisions[1], 4);
    CHECK_EQ(c.roundup_power2_divisions[NPA_ROUNDUP_INTERVALS - 1], 4);
    CHECK_EQ(c.max_split_size, 30 * MiB);
    CHECK_EQ(parse("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", &c, &w), 0);
    CHECK_EQ(c.roundup_power2_divisions[0], 1);  /* the first entry fills the intervals below it */
    CHECK_EQ(c.roundup_power2_divisions[8], 1);  /* 256 MB */
    CHECK_EQ(c.roundup_power2_divisions[9], 2);  /* 512 MB */
    CHECK_EQ(c.roundup_power2_divisions[10], 4); /* 1024 MB keeps its own, '>' fills from 2048 MB */
    CHECK_EQ(c.roundup_power2_divisions[11], 8);
    CHECK_EQ(parse("roundup_power2_divisions:[>:4]", &c, &w), 0);
    CHECK_EQ(c.roundup_power2_divisions[0], 0);  /* alone: every interval after the first */
    CHECK_EQ(c.roundup_power2_divisions[1], 4);
}

/* Each bad entry: exactly one warning naming the key, the defaults kept. */
static void expect_rejected(const char *text, const char *key) {
    npa_config c, d;
    warnings w;
    npa_config_defaults(&d);
    CHECK_EQ(parse(text, &c, &w), 1);
    CHECK_EQ(w.count, 1);
    if (w.count != 1 || !strstr(w.last, key)) fprintf(stderr, "  for '%s': warning '%s'\n", text, w.last);
    CHECK(strstr(w.last, key) != NULL);
    CHECK(memcmp(&c, &d, sizeof c) == 0);
}

static void test_invalid_values_warn_once_and_keep_default(void) {
    expect_rejected("max_split_size_mb:10", "max_split_size_mb");
    expect_rejected("max_split_size_mb:-5", "max_split_size_mb");
    expect_rejected("max_split_size_mb:abc", "max_split_size_mb");
    expect_rejected("max_split_size_mb:99999999999999999999999", "max_split_size_mb");
    expect_rejected("max_non_split_rounding_mb:1.5", "max_non_split_rounding_mb");
    expect_rejected("max_non_split_rounding_mb:0", "max_non_split_rounding_mb"); /* torch: at least 20 */
    expect_rejected("max_non_split_rounding_mb:19", "max_non_split_rounding_mb");
    expect_rejected("garbage_collection_threshold:0", "garbage_collection_threshold");
    expect_rejected("garbage_collection_threshold:1", "garbage_collection_threshold");
    expect_rejected("garbage_collection_threshold:nan", "garbage_collection_threshold");
    expect_rejected("garbage_collection_threshold:0.5x", "garbage_collection_threshold");
    expect_rejected("per_process_memory_fraction:0", "per_process_memory_fraction");
    expect_rejected("per_process_memory_fraction:1.01", "per_process_memory_fraction");
    expect_rejected("per_process_memory_fraction:", "per_process_memory_fraction");
    expect_rejected("roundup_power2_divisions:3", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:0", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:[256:3]", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:[300:2]", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:[256:2", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:[256:2,]", "roundup_power2_divisions");
    expect_rejected("roundup_power2_divisions:[256]", "roundup_power2_divisions");
    expect_rejected("reuse_policy:sometimes", "reuse_policy");
    expect_rejected("record_history:many", "record_history");
    expect_rejected("record_context:never", "record_context"); /* torch's NEVER is record_stacks:none */
    expect_rejected("recent_blocks:17", "recent_blocks");
    expect_rejected("recent_blocks:-1", "recent_blocks");
    expect_rejected("unknown_key:1", "unknown_key");
    expect_rejected("max_split_size_mb", "max_split_size_mb"); /* no value at all */
    char long_path[400];
    memset(long_path, 'a', sizeof long_path);
    memcpy(long_path, "oom_snapshot:", 13);
    long_path[sizeof long_path - 1] = '\0';
    expect_rejected(long_path, "oom_snapshot");
}

static void test_problems_counted_and_good_keys_applied(void) {
    npa_config c;
    warnings w;
    CHECK_EQ(parse("bogus:1,max_split_size_mb:50,garbage_collection_threshold:2", &c, &w), 2);
    CHECK_EQ(w.count, 2);
    CHECK_EQ(c.max_split_size, 50 * MiB);
    CHECK(c.garbage_collection_threshold == 0.0);
}

/* A refused value leaves what the string set earlier for its key, else
 * what the config held; the warning says which, for the caller to word
 * ("(earlier value kept)", "(default kept)"). An entry naming no setting,
 * or a clash whose message says what stays, has nothing to add. */
static void test_a_refusal_says_what_it_keeps(void) {
    npa_config c;
    warnings w;
    CHECK_EQ(parse("record_history:5,record_history:many", &c, &w), 1);
    CHECK_EQ(c.record_history, 5);
    CHECK_EQ(w.last_kept, NPA_KEPT_EARLIER);
    CHECK_EQ(parse("record_history:many,record_history:more", &c, &w), 2);
    CHECK_EQ(c.record_history, 0);
    CHECK_EQ(w.last_kept, NPA_KEPT_BEFORE);
    CHECK_EQ(parse("record_history:5,reuse_policy:sometimes", &c, &w), 1); /* another key set earlier */
    CHECK_EQ(w.last_kept, NPA_KEPT_BEFORE);
    CHECK_EQ(parse("reuse_policy:sometimes,reuse_policy:safe,reuse_policy:never", &c, &w), 2);
    CHECK_EQ(c.reuse_policy, NPA_REUSE_SAFE);
    CHECK_EQ(w.last_kept, NPA_KEPT_EARLIER);
    const char *nothing_to_add[] = {"bogus:1", "max_split_size_mb", "expandable_segments:True,max_split_size_mb:64"};
    for (size_t i = 0; i < sizeof nothing_to_add / sizeof *nothing_to_add; i++) {
        CHECK_EQ(parse(nothing_to_add[i], &c, &w), 1);
        CHECK_EQ(w.last_kept, NPA_KEPT_SAID);
    }
    CHECK_EQ(parse("bogus:1", &c, &w), 1);
    CHECK(strcmp(w.last, "unknown key 'bogus'; ignored") == 0);
}

static void test_ignored_torch_keys(void) {
    npa_config c, d;
    warnings w;
    npa_config_defaults(&d);
    CHECK_EQ(parse("release_lock_on_cudamalloc:false,backend:native,base_addr_aligned_kb:16",
                   &c, &w),
             0);
    CHECK_EQ(w.count, 0); /* asking for the default is silent */
    const char *non_default[] = {"release_lock_on_cudamalloc:True",
                                 "backend:cudaMallocAsync", "base_addr_aligned_kb:0", "page_size:1g",
                                 "segment_size_mb:32"};
    for (size_t i = 0; i < sizeof non_default / sizeof *non_default; i++) {
        CHECK_EQ(parse(non_default[i], &c, &w), 0); /* accepted, not a problem */
        CHECK_EQ(w.count, 1);
        CHECK(strstr(w.last, "ignored") != NULL);
        CHECK(memcmp(&c, &d, sizeof c) == 0);
    }
}

static void test_expandable_segments(void) {
    npa_config c;
    warnings w;
    const char *on[] = {"expandable_segments:True", "expandable_segments:true", "expandable_segments=1",
                        "expandable_segments:False,expandable_segments:True"};
    for (size_t i = 0; i < sizeof on / sizeof *on; i++) {
        CHECK_EQ(parse(on[i], &c, &w), 0);
        CHECK_EQ(w.count, 0);
        CHECK(c.expandable_segments);
    }
    CHECK_EQ(parse("expandable_segments:False", &c, &w), 0);
    CHECK(!c.expandable_segments);
    CHECK_EQ(parse("expandable_segments:0", &c, &w), 0);
    CHECK(!c.expandable_segments);
    CHECK_EQ(parse("expandable_segments:yes", &c, &w), 1);
    CHECK(!c.expandable_segments);
    CHECK(strstr(w.last, "True or False") != NULL);
    /* torch_npu's rule: not beside max_split_size_mb or a GC threshold, in
     * either order; one warning, expandable stays off, the other key holds. */
    const char *clash[] = {"expandable_segments:True,max_split_size_mb:64",
                           "garbage_collection_threshold:0.5,expandable_segments:True"};
    for (size_t i = 0; i < sizeof clash / sizeof *clash; i++) {
        CHECK_EQ(parse(clash[i], &c, &w), 1);
        CHECK_EQ(w.count, 1);
        CHECK(strstr(w.last, "expandable_segments") != NULL);
        CHECK(!c.expandable_segments);
        CHECK(c.max_split_size == 64 * MiB || c.garbage_collection_threshold == 0.5);
    }
}

/* A string of many bad entries: the first 8 warned, then one count of the
 * rest, and the clash the string makes as a whole still said after them;
 * every entry still counts as a problem and the good ones apply. */
static void test_many_bad_entries_warn_a_few_then_a_count(void) {
    char bad[2048] = "", text[4096];
    for (int i = 0; i < 20; i++) snprintf(bad + strlen(bad), sizeof bad - strlen(bad), "bad_%d:1,", i);
    npa_config c;
    warnings w;
    snprintf(text, sizeof text, "%sexpandable_segments:True,max_split_size_mb:64", bad);
    CHECK_EQ(parse(text, &c, &w), 21);
    CHECK_EQ(w.count, 8 + 1 + 1);
    CHECK(strstr(w.last, "expandable segments stay off") != NULL);
    CHECK(!c.expandable_segments && c.max_split_size == 64 * MiB);
    snprintf(text, sizeof text, "%srecent_blocks:2", bad);
    CHECK_EQ(parse(text, &c, &w), 20);
    CHECK_EQ(w.count, 8 + 1);
    CHECK(strcmp(w.last, "12 more warnings about entries are not shown") == 0);
    CHECK_EQ(c.recent_blocks, 2);
    CHECK_EQ(parse("bad_1:1,bad_2:1,bad_3:1,bad_4:1,bad_5:1,bad_6:1,bad_7:1,bad_8:1", &c, &w), 8);
    CHECK_EQ(w.count, 8); /* exactly 8: no count line */
    CHECK(strstr(w.last, "bad_8") != NULL);
}

static void test_format_round_trip(void) {
    npa_config c, back;
    warnings w;
    char text[NPUALLOC_CONFIG_LEN];
    npa_config_defaults(&c);
    CHECK_EQ(npa_config_format(&c, text, sizeof text), 0);
    CHECK(text[0] == '\0');

    const char *inputs[] = {
        "max_split_size_mb:64,garbage_collection_threshold:0.6,per_process_memory_fraction:0.3333333333333333",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8],reuse_policy:safe,record_history:5",
        "roundup_power2_divisions:8,max_non_split_rounding_mb:40,oom_snapshot:/tmp/x.pickle",
        "roundup_power2_divisions:[1:0,2:4]",
        "expandable_segments:True,per_process_memory_fraction:0.5",
        "recent_blocks:0,reuse_policy:eager",
        "record_stacks:python,record_context:all,record_history:5",
        "record_stacks:python,record_context:state",
    };
    for (size_t i = 0; i < sizeof inputs / sizeof *inputs; i++) {
        CHECK_EQ(parse(inputs[i], &c, &w), 0);
        size_t n = npa_config_format(&c, text, sizeof text);
        CHECK_EQ(n, strlen(text));
        CHECK_EQ(parse(text, &back, &w), 0);
        CHECK(memcmp(&c, &back, sizeof c) == 0);
    }
    CHECK_EQ(parse("max_split_size_mb:64,reuse_policy:eager", &c, &w), 0);
    npa_config_format(&c, text, sizeof text);
    CHECK(strcmp(text, "max_split_size_mb:64,reuse_policy:eager") == 0);
    /* A short buffer truncates and stays terminated. */
    char tiny[8];
    CHECK_EQ(npa_config_format(&c, tiny, sizeof tiny), 7);
    CHECK(strcmp(tiny, "max_spl") == 0);
    CHECK_EQ(parse("record_context:all,record_context:alloc", &c, &w), 0); /* alloc: the default, not shown */
    CHECK_EQ(npa_config_format(&c, text, sizeof text), 0);
    CHECK_EQ(parse("record_context:state", &c, &w), 0);
    npa_config_format(&c, text, sizeof text);
    CHECK(strcmp(text, "record_context:state") == 0);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;
static uint64_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static void count_only(void *arg, const char *message, npa_config_kept kept) {
    (void)kept;
    int *n = arg;
    (*n)++;
    /* A warning is one line. */
    if (strchr(message, '\n')) (*n) += 1000000;
}

/* Random bytes, random picks from a grammar-ish alphabet, and mutations of
 * valid strings; every result must be a config within its documented ranges. */
static void test_fuzz(void) {
    static const char *seeds[] = {
        "max_split_size_mb:64,garbage_collection_threshold:0.6",
        "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]",
        "per_process_memory_fraction:0.5,reuse_policy:auto,record_history:10,oom_snapshot:/tmp/a",
        "expandable_segments:True,backend:native,page_size:1g",
    };
    static const char alphabet[] = "[]:=,> 0123456789.-abcdefgmx_\t";
    char buf[300];
    int bad_results = 0;
    int multi_line_warnings = 0;
    for (int iter = 0; iter < 30000; iter++) {
        size_t len = rng() % (sizeof buf - 1);
        int kind = iter % 3;
        if (kind == 0) {
            for (size_t i = 0; i < len; i++) buf[i] = (char)(1 + rng() % 255);
        } else if (kind == 1) {
            for (size_t i = 0; i < len; i++) buf[i] = alphabet[rng() % (sizeof alphabet - 1)];
        } else {
            const char *seed = seeds[rng() % (sizeof seeds / sizeof *seeds)];
            len = strlen(seed);
            memcpy(buf, seed, len);
            for (int m = 0; m < 1 + (int)(rng() % 4); m++) {
                size_t at = rng() % len;
                switch (rng() % 3) {
                case 0: buf[at] = alphabet[rng() % (sizeof alphabet - 1)]; break;
                case 1: len = at; break; /* truncate */
                default: buf[at] = (char)(1 + rng() % 255); break;
                }
                if (len == 0) break;
            }
        }
        buf[len] = '\0';
        npa_config c;
        npa_config_defaults(&c);
        int warned = 0;
        npa_config_parse(&c, buf, count_only, &warned);
        multi_line_warnings += warned >= 1000000;
        bad_results += !(c.max_split_size >= 20 * MiB);
        bad_results += !(c.garbage_collection_threshold >= 0.0 && c.garbage_collection_threshold < 1.0);
        bad_results += !(c.per_process_memory_fraction > 0.0 && c.per_process_memory_fraction <= 1.0);
        bad_results += c.oom_snapshot[sizeof c.oom_snapshot - 1] != '\0';
        bad_results += (unsigned)c.reuse_policy > NPA_REUSE_SAFE;
        for (int i = 0; i < NPA_ROUNDUP_INTERVALS; i++)
            bad_results += (c.roundup_power2_divisions[i] & (c.roundup_power2_divisions[i] - 1)) != 0;
        char text[NPUALLOC_CONFIG_LEN];
        size_t n = npa_config_format(&c, text, sizeof text);
        bad_results += n != strlen(text);
    }
    CHECK_EQ(bad_results, 0);
    CHECK_EQ(multi_line_warnings, 0);
}

/* Entries built from every key (known, ignored, unknown) and adversarial
 * values: signs, hex and exponent forms, nan and inf, numbers past 64 bits
 * or past the 63 characters a number is read from, subnormals and underflow,
 * brackets unbalanced, nested, empty or left open, blanks
 * inside, bytes past ASCII. Each input must: warn when it has a problem;
 * format to text that parses back, without a problem, to the same text; and,
 * as one entry over a config unlike the defaults in every key, leave that
 * config as it was when the entry is refused. */
static const char *const fuzz_keys[] = {
    "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold", "roundup_power2_divisions",
    "per_process_memory_fraction", "reuse_policy", "record_history", "record_stacks", "record_context",
    "oom_snapshot", "expandable_segments", "recent_blocks", "backend", "page_size", "bogus",
};
static const char *const fuzz_values[] = {
    "0", "1", "20", "64", "-1", "+5", "0x10", "1e3", "1.5", "nan", "-inf", "NaN", "infinity", "nan(1)", "0x1p-1",
    "0X1P-1", "4.9e-324", "1e-400", ".5", "5e-1", "1.", "0.99999999999999999", "18446744073709551615",
    "18446744073709551616", "99999999999999999999999999", "1_000", "True", "false", "python", "all", "state",
    "eager", "[", "]", "[]", "[[1:2]]", "[1:2,>:4]", "[1:2,,]", "[>:8]", "[1:2", "1:2]", "[ 1 : 2 , 2:4 ]",
    "[65536:2]", "[9223372036854775808:4]", "[1:2147483648]", "[1:4294967296]", "[4:16,3:2]", "[2:4,>:3]",
    "[8:32,]", "/tmp/[a,b]", "/tmp/a b", "0.50000000000000000000000000000000000000000000000000000000000000001",
    "\xff\xfe", "\xc2\x9b[31m", "", ":", "a:b:c", " 0.5\t", "\v0.5\n",
};
#define PICK(table) (table)[rng() % (sizeof(table) / sizeof *(table))]

/* One entry, key:value or key=value, blanks around the parts or not, the
 * value sometimes two values run together. */
static size_t fuzz_entry(char *out, size_t room) {
    const char *blank = rng() % 3 ? "" : " ";
    int n = snprintf(out, room, "%s%s%s%s%s%s%s", blank, PICK(fuzz_keys), blank, rng() % 4 ? ":" : "=", blank,
                     PICK(fuzz_values), rng() % 4 ? "" : PICK(fuzz_values));
    return n < 0 ? 0 : (size_t)n < room ? (size_t)n : room - 1;
}

static void test_fuzz_adversarial_entries(void) {
    static const char base_text[] =
        "max_split_size_mb:64,max_non_split_rounding_mb:40,garbage_collection_threshold:0.3,"
        "roundup_power2_divisions:[1:2,>:8],per_process_memory_fraction:0.5,reuse_policy:safe,record_history:7,"
        "record_stacks:python,record_context:all,oom_snapshot:/x,recent_blocks:3";
    npa_config base;
    warnings w;
    CHECK_EQ(parse(base_text, &base, &w), 0);
    char base_shown[NPUALLOC_CONFIG_LEN];
    npa_config_format(&base, base_shown, sizeof base_shown);
    int unwarned = 0, not_round_trip = 0, changed_by_refusal = 0;
    for (int iter = 0; iter < 3000; iter++) {
        char text[2048], shown[NPUALLOC_CONFIG_LEN], again[NPUALLOC_CONFIG_LEN];
        size_t len = 0;
        for (int e = 0, entries = 1 + (int)(rng() % 8); e < entries; e++) {
            len += fuzz_entry(text + len, sizeof text - len);
            if (rng() % 2) len += (size_t)snprintf(text + len, sizeof text - len, rng() % 4 ? "," : ",,");
        }
        npa_config c, back;
        int problems = parse(text, &c, &w);
        unwarned += problems > 0 && w.count == 0;
        npa_config_format(&c, shown, sizeof shown);
        int back_problems = parse(shown, &back, &w);
        npa_config_format(&back, again, sizeof again);
        not_round_trip += back_problems != 0 || strcmp(shown, again) != 0;

        fuzz_entry(text, sizeof text);
        c = base;
        memset(&w, 0, sizeof w);
        if (npa_config_parse(&c, text, collect, &w) > 0) {
            npa_config_format(&c, shown, sizeof shown);
            if (strcmp(shown, base_shown) != 0) {
                changed_by_refusal++;
                fprintf(stderr, "  refused yet changed: '%s'\n", text);
            }
        }
    }
    CHECK_EQ(unwarned, 0);
    CHECK_EQ(not_round_trip, 0);
    CHECK_EQ(changed_by_refusal, 0);
}

/* Every key at its longest (the list form of roundup_power2_divisions with
 * each interval at the largest divisions, the doubles needing 17 digits and
 * an exponent, a path as long as oom_snapshot holds) still fits the
 * region's config text (836 bytes of its 1024): readers of another process see it whole, as
 * get_config() in the process does. */
static void test_longest_text_fits_the_region(void) {
    char text[4096];
    int n = snprintf(text, sizeof text,
                     "max_split_size_mb:%zu,max_non_split_rounding_mb:%zu,"
                     "garbage_collection_threshold:1.0000000000000002e-300,"
                     "per_process_memory_fraction:1.0000000000000002e-300,reuse_policy:eager,record_history:%llu,"
                     "record_stacks:python,record_context:all,recent_blocks:10,roundup_power2_divisions:[",
                     SIZE_MAX / MiB, SIZE_MAX / MiB, (unsigned long long)NPUALLOC_MAX_RECORD_HISTORY);
    for (int i = 0; i < NPA_ROUNDUP_INTERVALS; i++)
        n += snprintf(text + n, sizeof text - (size_t)n, "%s%zu:%u", i ? "," : "", (size_t)1 << i, 1u << (31 - i % 2));
    n += snprintf(text + n, sizeof text - (size_t)n, "],oom_snapshot:/");
    npa_config c;
    memset(text + n, 'p', sizeof c.oom_snapshot - 2);
    text[n + sizeof c.oom_snapshot - 2] = '\0';
    warnings w;
    CHECK_EQ(parse(text, &c, &w), 0);
    c.expandable_segments = true; /* refused beside max_split_size, but a run-time key: the struct may hold both */
    char big[4096];
    size_t length = npa_config_format(&c, big, sizeof big);
    CHECK_EQ(length, strlen(big));
    CHECK(length >= 700); /* every key there */
    CHECK(length < NPUALLOC_CONFIG_LEN);
}

int main(void) {
    RUN(test_valid_keys);
    RUN(test_syntax_variants);
    RUN(test_invalid_values_warn_once_and_keep_default);
    RUN(test_problems_counted_and_good_keys_applied);
    RUN(test_a_refusal_says_what_it_keeps);
    RUN(test_ignored_torch_keys);
    RUN(test_expandable_segments);
    RUN(test_many_bad_entries_warn_a_few_then_a_count);
    RUN(test_format_round_trip);
    RUN(test_longest_text_fits_the_region);
    RUN(test_fuzz);
    RUN(test_fuzz_adversarial_entries);
    return check_report();
}
