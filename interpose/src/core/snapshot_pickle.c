/* torch.cuda.memory._snapshot()'s dict as pickle protocol 2 bytes, written by
 * hand: the snapshot is only dicts, lists, ints, strings, a float, booleans
 * and one tuple, and emitting those opcodes is simpler than any binary format
 * a reader would need to be taught. The output uses no globals, so it is safe
 * to load with an unpickler that refuses every class (npualloc's does), and
 * torch's memory_viz and the web page read it unchanged.
 *
 * Each device is read under one hold of its lock into two growing buffers
 * (its segments, its trace), which are joined into the final dict afterwards. */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef struct pickle_buffer {
    unsigned char *data;
    size_t len, cap;
    bool failed;             /* a realloc failed: every later write is dropped */
} pickle_buffer;

static void put(pickle_buffer *b, const void *bytes, size_t n) {
    if (b->failed || n == 0) return; /* n == 0 may come with bytes == NULL */
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 4096;
        while (n > cap - b->len) cap *= 2;
        unsigned char *data = realloc(b->data, cap);
        if (!data) {
            b->failed = true;
            return;
        }
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, bytes, n);
    b->len += n;
}

static void op(pickle_buffer *b, unsigned char opcode) { put(b, &opcode, 1); }

/* Pickle opcodes (Lib/pickletools.py). */
enum {
    OP_PROTO = 0x80, OP_STOP = '.', OP_MARK = '(', OP_EMPTY_DICT = '}', OP_SETITEMS = 'u',
    OP_EMPTY_LIST = ']', OP_APPENDS = 'e', OP_BININT = 'J', OP_LONG1 = 0x8a, OP_BINUNICODE = 'X',
    OP_BINFLOAT = 'G', OP_NEWTRUE = 0x88, OP_NEWFALSE = 0x89, OP_TUPLE2 = 0x86,
};

static void put_le(pickle_buffer *b, uint64_t v, size_t n) {
    unsigned char bytes[8];
    for (size_t i = 0; i < n; i++) bytes[i] = (unsigned char)(v >> (8 * i));
    put(b, bytes, n);
}

static void int_value(pickle_buffer *b, int64_t v) {
    if (v >= INT32_MIN && v <= INT32_MAX) {
        op(b, OP_BININT);
        put_le(b, (uint64_t)v, 4);
    } else { /* eight bytes of two's complement */
        op(b, OP_LONG1);
        op(b, 8);
        put_le(b, (uint64_t)v, 8);
    }
}

/* Addresses and sizes: unsigned, so one zero byte keeps the top bit a sign. */
static void uint_value(pickle_buffer *b, uint64_t v) {
    if (v <= INT32_MAX) {
        int_value(b, (int64_t)v);
        return;
    }
    op(b, OP_LONG1);
    op(b, 9);
    put_le(b, v, 8);
    op(b, 0);
}

/* The bytes at s (n left) that one character takes, *whole set, or else
 * those one U+FFFD stands for: a lead byte and the continuation bytes that
 * could still have completed it, Python's decoder's "maximal subpart" (a
 * three-byte character cut after two bytes is one U+FFFD, not two). RFC
 * 3629: no overlong forms, no surrogates, nothing past U+10FFFF. */
static size_t utf8_span(const unsigned char *s, size_t n, bool *whole) {
    unsigned char lead = s[0], low = 0x80, high = 0xbf;
    size_t length, i = 1;
    *whole = lead < 0x80;
    if (*whole) return 1;
    if (lead >= 0xc2 && lead <= 0xdf) length = 2;
    else if (lead >= 0xe0 && lead <= 0xef) length = 3;
    else if (lead >= 0xf0 && lead <= 0xf4) length = 4;
    else return 1;
    if (lead == 0xe0) low = 0xa0;
    else if (lead == 0xed) high = 0x9f;
    else if (lead == 0xf0) low = 0x90;
    else if (lead == 0xf4) high = 0x8f;
    if (n > 1 && s[1] >= low && s[1] <= high) {
        i = 2;
        while (i < length && i < n && (s[i] & 0xc0) == 0x80) i++;
    }
    *whole = i == length;
    return i;
}

/* pickle reads a BINUNICODE string as UTF-8 and refuses the whole file over
 * one that is not, so what is not well-formed goes as U+FFFD, as Python's
 * decoder would replace it: a path in another encoding (Linux paths are
 * bytes, the config's oom_snapshot), a name cut inside a character (pystack
 * keeps 256 bytes). The length is written once the text is. */
static void str_value(pickle_buffer *b, const char *s) {
    static const char replacement[] = "\xef\xbf\xbd";
    const unsigned char *text = (const unsigned char *)s;
    size_t n = strlen(s), kept = 0;
    op(b, OP_BINUNICODE);
    size_t length_at = b->len;
    put_le(b, 0, 4);
    for (size_t i = 0; i < n;) {
        bool whole;
        size_t span = utf8_span(text + i, n - i, &whole);
        if (!whole) {
            put(b, text + kept, i - kept);
            put(b, replacement, sizeof replacement - 1);
            kept = i + span;
        }
        i += span;
    }
    put(b, text + kept, n - kept);
    if (b->failed) return;
    size_t written = b->len - length_at - 4;
    for (size_t i = 0; i < 4; i++) b->data[length_at + i] = (unsigned char)(written >> (8 * i));
}

static void float_value(pickle_buffer *b, double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    op(b, OP_BINFLOAT);
    for (int i = 7; i >= 0; i--) op(b, (unsigned char)(bits >> (8 * i))); /* big-endian */
}

static void bool_value(pickle_buffer *b, bool v) { op(b, v ? OP_NEWTRUE : OP_NEWFALSE); }

/* A dict or list is its empty form, MARK, the items, then SETITEMS/APPENDS. */
static void open_dict(pickle_buffer *b) {
    op(b, OP_EMPTY_DICT);
    op(b, OP_MARK);
}
static void close_dict(pickle_buffer *b) { op(b, OP_SETITEMS); }
static void open_list(pickle_buffer *b) {
    op(b, OP_EMPTY_LIST);
    op(b, OP_MARK);
}
static void close_list(pickle_buffer *b) { op(b, OP_APPENDS); }
static void empty_list(pickle_buffer *b) { op(b, OP_EMPTY_LIST); }

static const char *const block_states[] = {
    [NPA_BLOCK_ACTIVE_ALLOCATED] = "active_allocated",
    [NPA_BLOCK_ACTIVE_PENDING_FREE] = "active_pending_free",
    [NPA_BLOCK_INACTIVE] = "inactive",
};

static const char *const trace_actions[] = {
    [NPA_TRACE_ALLOC] = "alloc",
    [NPA_TRACE_FREE_REQUESTED] = "free_requested",
    [NPA_TRACE_FREE_COMPLETED] = "free_completed",
    [NPA_TRACE_SEGMENT_ALLOC] = "segment_alloc",
    [NPA_TRACE_SEGMENT_FREE] = "segment_free",
    [NPA_TRACE_OOM] = "oom",
    [NPA_TRACE_SEGMENT_MAP] = "segment_map",
    [NPA_TRACE_SEGMENT_UNMAP] = "segment_unmap",
    [NPA_TRACE_SNAPSHOT] = "snapshot",
};

/* torch's frame dict: {"filename", "line", "name"}. */
static void frame_dict(const char *filename, int line, const char *name, void *arg) {
    pickle_buffer *b = arg;
    open_dict(b);
    str_value(b, "filename"), str_value(b, filename);
    str_value(b, "line"), int_value(b, line);
    str_value(b, "name"), str_value(b, name);
    close_dict(b);
}

/* The stacks that events without one of their own fall back on, by
 * address, as torch's fall back on a block's or a segment's context: the
 * latest recorded alloc at an address (a block's), and the latest
 * segment_alloc or segment_map there (a segment's; an expandable one's
 * listed stretch takes the latest map at its start). History order breaks
 * ties. */
typedef enum stack_kind { STACK_OF_BLOCK, STACK_OF_SEGMENT } stack_kind;

typedef struct addr_stack {
    stack_kind kind;
    uintptr_t addr;
    size_t order;
    uint32_t stack;
} addr_stack;

typedef struct trace_writer {
    pickle_buffer *b;
    const npa_backend *backend;
    size_t active;           /* the active bytes of the segments written */
    addr_stack *stacks;      /* sorted by (kind, addr, order); NULL when none were recorded */
    size_t stack_count, stack_capacity, seen;
    bool stacks_incomplete;  /* host memory ran out while collecting: stack_count is then 0 */
} trace_writer;

static void frames_list(trace_writer *w, uint32_t stack) {
    open_list(w->b);
    if (stack != 0 && w->backend->visit_stack) w->backend->visit_stack(w->backend->ctx, stack, frame_dict, w->b);
    close_list(w->b);
}

static void collect_stack(const npa_trace_view *e, void *arg) {
    trace_writer *w = arg;
    size_t order = w->seen++;
    stack_kind kind;
    if (e->action == NPA_TRACE_ALLOC) kind = STACK_OF_BLOCK;
    else if (e->action == NPA_TRACE_SEGMENT_ALLOC || e->action == NPA_TRACE_SEGMENT_MAP) kind = STACK_OF_SEGMENT;
    else return; /* stackless ones too: a later one at the address wins */
    if (w->stack_count == w->stack_capacity) {
        size_t capacity = w->stack_capacity ? 2 * w->stack_capacity : 256;
        addr_stack *grown = realloc(w->stacks, capacity * sizeof *grown);
        if (!grown) { /* an older event at the address would stand in for it: no frames at all */
            w->stacks_incomplete = true;
            return;
        }
        w->stacks = grown, w->stack_capacity = capacity;
    }
    w->stacks[w->stack_count++] = (addr_stack){.kind = kind, .addr = e->addr, .order = order, .stack = e->stack};
}

static bool precedes(const addr_stack *a, stack_kind kind, uintptr_t addr, size_t order) {
    if (a->kind != kind) return a->kind < kind;
    if (a->addr != addr) return a->addr < addr;
    return a->order < order;
}

static int by_kind_addr_order(const void *l, const void *r) {
    const addr_stack *a = l, *b = r;
    if (precedes(a, b->kind, b->addr, b->order)) return -1;
    return precedes(b, a->kind, a->addr, a->order);
}

/* The stack of the latest event of kind at addr recorded before the event
 * numbered before (history order); SIZE_MAX: the latest of all. */
static uint32_t stack_at(const trace_writer *w, stack_kind kind, uintptr_t addr, size_t before) {
    size_t lo = 0, hi = w->stack_count; /* the first entry not before (kind, addr, before) */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (precedes(&w->stacks[mid], kind, addr, before)) lo = mid + 1;
        else hi = mid;
    }
    const addr_stack *last = lo > 0 ? &w->stacks[lo - 1] : NULL;
    return last && last->kind == kind && last->addr == addr ? last->stack : 0;
}

/* torch's segment dict: the stream is that of the pools holding it (0 for
 * aclrtMalloc's, which carries none); no private pools ((0, 0)). Its frames
 * are those of the malloc that made it (torch's
 * context_when_segment_allocated), a live block's those of its alloc event,
 * when history recorded them with a stack, else []. */
static void segment_dict(const npa_segment_view *seg, void *arg) {
    trace_writer *w = arg;
    pickle_buffer *b = w->b;
    w->active += seg->active_size;
    open_dict(b);
    str_value(b, "device"), int_value(b, seg->device);
    str_value(b, "address"), uint_value(b, seg->address);
    str_value(b, "total_size"), uint_value(b, seg->total_size);
    str_value(b, "allocated_size"), uint_value(b, seg->allocated_size);
    str_value(b, "active_size"), uint_value(b, seg->active_size);
    str_value(b, "requested_size"), uint_value(b, seg->requested_size);
    str_value(b, "stream"), uint_value(b, seg->stream);
    str_value(b, "segment_type"), str_value(b, seg->is_small ? "small" : "large");
    str_value(b, "segment_pool_id"), int_value(b, 0), int_value(b, 0), op(b, OP_TUPLE2);
    str_value(b, "is_expandable"), bool_value(b, seg->is_expandable);
    str_value(b, "frames");
    frames_list(w, stack_at(w, STACK_OF_SEGMENT, seg->address, SIZE_MAX));
    str_value(b, "blocks");
    open_list(b);
    for (size_t i = 0; i < seg->block_count; i++) {
        const npa_block_view *block = &seg->blocks[i];
        open_dict(b);
        str_value(b, "address"), uint_value(b, block->address);
        str_value(b, "size"), uint_value(b, block->size);
        str_value(b, "requested_size"), uint_value(b, block->requested_size);
        str_value(b, "state"), str_value(b, block_states[block->state]);
        str_value(b, "frames");
        frames_list(w, block->state == NPA_BLOCK_INACTIVE ? 0 : stack_at(w, STACK_OF_BLOCK, block->address, SIZE_MAX));
        close_dict(b);
    }
    close_list(b);
    close_dict(b);
}

/* torch's trace entry. An event recorded without a stack of its own falls
 * back as torch's does: a free on the frames of the alloc it frees (its
 * block's context_when_allocated), a segment's release or unmap on those of
 * the malloc that made or mapped it (context_when_segment_allocated). One
 * recorded under record_context:state shows none. */
static void trace_dict(const npa_trace_view *e, void *arg) {
    trace_writer *w = arg;
    pickle_buffer *b = w->b;
    size_t order = w->seen++;
    uint32_t stack = e->stack;
    if (!e->stack_in_trace) stack = 0;
    else if (stack == 0 && (e->action == NPA_TRACE_FREE_REQUESTED || e->action == NPA_TRACE_FREE_COMPLETED))
        stack = stack_at(w, STACK_OF_BLOCK, e->addr, order);
    else if (stack == 0 && (e->action == NPA_TRACE_SEGMENT_FREE || e->action == NPA_TRACE_SEGMENT_UNMAP))
        stack = stack_at(w, STACK_OF_SEGMENT, e->addr, order);
    open_dict(b);
    str_value(b, "action"), str_value(b, trace_actions[e->action]);
    str_value(b, "addr"), uint_value(b, e->addr);
    if (e->action == NPA_TRACE_OOM) str_value(b, "device_free"), uint_value(b, e->addr);
    str_value(b, "size"), uint_value(b, e->size);
    str_value(b, "stream"), uint_value(b, e->stream);
    str_value(b, "time_us"), int_value(b, e->time_us);
    str_value(b, "frames");
    frames_list(w, stack);
    close_dict(b);
}

static void allocator_settings(pickle_buffer *b, const npa_config *config, double gc_threshold) {
    char text[NPUALLOC_CONFIG_LEN]; /* the whole config text, as the region holds it (test_config) */
    npa_config_format(config, text, sizeof text);
    open_dict(b);
    str_value(b, "PYTORCH_CUDA_ALLOC_CONF"), str_value(b, text);
    str_value(b, "max_split_size"), int_value(b, config->max_split_size == SIZE_MAX ? -1 : (int64_t)config->max_split_size);
    str_value(b, "garbage_collection_threshold"), float_value(b, gc_threshold);
    str_value(b, "expandable_segments"), bool_value(b, __atomic_load_n(&config->expandable_segments, __ATOMIC_RELAXED));
    str_value(b, "release_lock_on_cudamalloc"), bool_value(b, false);
    /* torch's form: the interval's lower bound in MB (powers of two from 1) -> divisions. */
    str_value(b, "roundup_power2_divisions");
    open_dict(b);
    for (int i = 0; i < NPA_ROUNDUP_INTERVALS; i++) {
        char key[16];
        unsigned long mb = 1ul << i;
        int n = 0;
        do key[n++] = (char)('0' + mb % 10); while ((mb /= 10) && n < 15);
        for (int l = 0, r = n - 1; l < r; l++, r--) {
            char c = key[l];
            key[l] = key[r];
            key[r] = c;
        }
        key[n] = '\0';
        str_value(b, key), int_value(b, config->roundup_power2_divisions[i]);
    }
    close_dict(b);
    close_dict(b);
}

void *npa_snapshot_pickle(npa_allocator *a, const npa_config *config, size_t *size) {
    pickle_buffer segments = {0}, traces = {0}, out = {0};
    npa_block_view *scratch = NULL;
    size_t scratch_capacity = 0;
    trace_writer stacks = {0}; /* the current device's stacks to fall back on (addr_stack) */
    /* torch lists every device; we list up to the highest one in use (at
     * least one), so the lists after it are cut off at traces_end. */
    size_t traces_end = 0;
    for (int i = 0; a && i < NPUALLOC_MAX_DEVICES; i++) {
        npa_device *d = npa_device_get(a, i, false);
        if (!d) {
            empty_list(&traces);
            continue;
        }
        open_list(&traces);
        npa_lock_acquire(&d->lock);
        stacks.stack_count = stacks.seen = 0;
        if (a->backend.visit_stack) {
            stacks.stacks_incomplete = false;
            npa_history_visit(d, collect_stack, &stacks);
            if (stacks.stacks_incomplete) stacks.stack_count = 0;
            if (stacks.stack_count) qsort(stacks.stacks, stacks.stack_count, sizeof *stacks.stacks, by_kind_addr_order);
        }
        trace_writer listed = {.b = &segments, .backend = &a->backend, .stacks = stacks.stacks,
                               .stack_count = stacks.stack_count};
        if (!npa_visit_device_segments(d, segment_dict, &listed, &scratch, &scratch_capacity)) segments.failed = true;
        npa_history_visit(d, trace_dict, &(trace_writer){.b = &traces, .backend = &a->backend,
                                                         .stacks = stacks.stacks, .stack_count = stacks.stack_count});
        /* torch's snapshot(): its event after the trace it hands out, so
         * later snapshots show where this one fell. */
        if (!segments.failed) npa_history_note(d, NULL, NPA_TRACE_SNAPSHOT, 0, listed.active);
        npa_lock_release(&d->lock);
        close_list(&traces);
        traces_end = traces.len;
    }
    free(scratch);
    free(stacks.stacks);
    if (traces_end == 0) {
        traces.len = 0;
        empty_list(&traces);
        traces_end = traces.len;
    }

    op(&out, OP_PROTO);
    op(&out, 2);
    open_dict(&out);
    str_value(&out, "segments");
    open_list(&out);
    put(&out, segments.data, segments.len);
    close_list(&out);
    str_value(&out, "device_traces");
    open_list(&out);
    put(&out, traces.data, traces_end);
    close_list(&out);
    str_value(&out, "allocator_settings");
    const npa_config *settings = a ? npa_get_config(a) : config;
    allocator_settings(&out, settings, a ? npa_gc_threshold(a) : settings->garbage_collection_threshold);
    close_dict(&out);
    op(&out, OP_STOP);

    bool failed = segments.failed || traces.failed || out.failed;
    free(segments.data);
    free(traces.data);
    if (failed) {
        free(out.data);
        return NULL;
    }
    *size = out.len;
    return out.data;
}
