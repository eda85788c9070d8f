/* Python stacks for history (record_stacks:python): the backend's
 * capture_stack and visit_stack. An alloc event recorded with stacks on
 * carries the frames of the allocating thread's Python code, read through
 * the CPython API of the interpreter running in this process, which is found
 * at run time (dlsym): nothing is linked against libpython, and a process
 * that is not Python, or a thread Python does not know, records no stack
 * (id 0). The stack is taken at the malloc entry with no npualloc lock held
 * (npa_pystack_take) and handed to the core's capture_stack through a
 * thread-local, for every event of that call, until the entry drops it
 * (npa_pystack_drop). pyACL, ctypes and most extensions release the GIL around
 * the runtime call, so a Python thread without it takes it for the capture
 * (PyGILState_Ensure), as torch's allocator does for its stacks.
 *
 * Interned so memory stays bounded: each code object is held (a reference,
 * so its address is never reused) with copies of its file and function
 * names, up to MAX_CODES; a stack is a sequence of (code, line) of at most
 * MAX_DEPTH innermost frames, stored once, up to MAX_STACKS stacks and
 * MAX_FRAMES frames in all. When the stack table is full, later new stacks
 * are recorded as none; when the code table is, stacks end at the first
 * frame of new code (one warning per table).
 *
 * Lock: stack_lock (hook.h, 7b), taken after the GIL when capturing, under a
 * device lock when a snapshot reads stacks, and by fork_prepare; under it
 * only the Python API and malloc are called (warnings wait for its
 * release). Never waited for the GIL while holding it: a thread holding the
 * GIL may be waiting for it. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hook.h"

#define MAX_CODES 4096
#define MAX_STACKS 16384
#define MAX_FRAMES (1u << 18)
#define MAX_DEPTH 48
#define MAX_NAME 256

/* The CPython API used, all in the stable ABI since 3.9 (PyObject is opaque here). */
typedef struct python_api {
    int (*is_initialized)(void);                    /* Py_IsInitialized */
    int (*gil_check)(void);                         /* PyGILState_Check */
    int (*gil_ensure)(void);                        /* PyGILState_Ensure */
    void (*gil_release)(int state);                 /* PyGILState_Release */
    int (*is_finalizing)(void);                     /* Py_IsFinalizing (3.13) / _Py_IsFinalizing */
    void *(*this_thread_state)(void);               /* PyGILState_GetThisThreadState */
    void *(*current_thread_state)(void);            /* PyThreadState_GetUnchecked (3.13) / _PyThreadState_UncheckedGet */
    void *(*get_frame)(void);                       /* PyEval_GetFrame: borrowed */
    void *(*frame_code)(void *frame);               /* PyFrame_GetCode: new reference */
    int (*frame_line)(void *frame);                 /* PyFrame_GetLineNumber */
    void *(*frame_back)(void *frame);               /* PyFrame_GetBack: new reference */
    void *(*get_attr)(void *object, const char *);  /* PyObject_GetAttrString: new reference */
    const char *(*utf8)(void *unicode);             /* PyUnicode_AsUTF8: borrowed */
    void (*err_fetch)(void **type, void **value, void **traceback);
    void (*err_restore)(void *type, void *value, void *traceback);
    void (*incref)(void *object);                   /* Py_IncRef */
    void (*decref)(void *object);                   /* Py_DecRef */
} python_api;

typedef struct code_entry {
    void *code;       /* held: a reference taken when interned */
    char *filename;
    char *name;
} code_entry;

typedef struct frame_entry {
    uint32_t code;    /* index into codes */
    int32_t line;
} frame_entry;

typedef struct stack_entry {
    uint32_t first;   /* index into frames */
    uint32_t depth;
    uint64_t hash;
} stack_entry;

static NPA_TLS uint32_t taken;    /* this thread's stack for its call under way, 0 outside one */
static pthread_once_t api_once = PTHREAD_ONCE_INIT;
static bool api_found;           /* written once under api_once */
static python_api py;
static pthread_mutex_t stack_lock = PTHREAD_MUTEX_INITIALIZER;
/* Under stack_lock: */
static int tables_state;         /* 0 not allocated yet, 1 ready, -1 no host memory */
static code_entry *codes;        /* MAX_CODES */
static uint32_t code_count;
static uint32_t *code_index;     /* 2 * MAX_CODES slots: codes index + 1, 0 empty */
static frame_entry *frames;      /* MAX_FRAMES */
static uint32_t frame_count;
static stack_entry *stacks;      /* MAX_STACKS; id = index + 1 */
static uint32_t stack_count;
static uint32_t *stack_index;    /* 2 * MAX_STACKS slots: stack id, 0 empty */

void npa_pystack_enable(const npa_config *config)
{
    bool on = __atomic_load_n(&config->record_stacks, __ATOMIC_RELAXED);
    npa_entry_work_mark(NPA_WORK_PYSTACK, on);
    npa_entry_work_mark(NPA_WORK_FREE_PYSTACK,
                        on && __atomic_load_n(&config->record_context, __ATOMIC_RELAXED) == NPA_CONTEXT_ALL);
}

static void look_up_api(void)
{
#define FIND(field, name) (py.field = (__typeof__(py.field))npa_real_dlsym(RTLD_DEFAULT, name))
    FIND(is_initialized, "Py_IsInitialized");
    FIND(gil_check, "PyGILState_Check");
    FIND(gil_ensure, "PyGILState_Ensure");
    FIND(gil_release, "PyGILState_Release");
    if (!FIND(is_finalizing, "Py_IsFinalizing"))
        FIND(is_finalizing, "_Py_IsFinalizing");
    FIND(this_thread_state, "PyGILState_GetThisThreadState");
    if (!FIND(current_thread_state, "PyThreadState_GetUnchecked"))
        FIND(current_thread_state, "_PyThreadState_UncheckedGet");
    FIND(get_frame, "PyEval_GetFrame");
    FIND(frame_code, "PyFrame_GetCode");
    FIND(frame_line, "PyFrame_GetLineNumber");
    FIND(frame_back, "PyFrame_GetBack");
    FIND(get_attr, "PyObject_GetAttrString");
    FIND(utf8, "PyUnicode_AsUTF8");
    FIND(err_fetch, "PyErr_Fetch");
    FIND(err_restore, "PyErr_Restore");
    FIND(incref, "Py_IncRef");
    FIND(decref, "Py_DecRef");
#undef FIND
    api_found = py.is_initialized && py.gil_check && py.gil_ensure && py.gil_release && py.is_finalizing &&
                py.this_thread_state && py.get_frame && py.frame_code && py.frame_line && py.frame_back &&
                py.get_attr && py.utf8 && py.err_fetch && py.err_restore && py.incref && py.decref;
}

static bool allocate_tables(void)
{
    codes = calloc(MAX_CODES, sizeof *codes);
    code_index = calloc(2 * MAX_CODES, sizeof *code_index);
    frames = calloc(MAX_FRAMES, sizeof *frames);
    stacks = calloc(MAX_STACKS, sizeof *stacks);
    stack_index = calloc(2 * MAX_STACKS, sizeof *stack_index);
    if (codes && code_index && frames && stacks && stack_index)
        return true;
    free(codes), free(code_index), free(frames), free(stacks), free(stack_index);
    codes = NULL;
    return false;
}

/* This thread holds the GIL. PyGILState_Check alone answers 1 with
 * sub-interpreters, so the thread's own state must be the current one. */
static bool holds_gil(void *mine)
{
    return py.gil_check() && (!py.current_thread_state || py.current_thread_state() == mine);
}

static char *copy_name(void *code, const char *attribute)
{
    void *value = py.get_attr(code, attribute);
    const char *text = value ? py.utf8(value) : NULL;
    char *copy = text ? strndup(text, MAX_NAME) : strdup("??");
    if (value)
        py.decref(value);
    return copy;
}

/* The codes index of code, interning it; UINT32_MAX when the table is full. */
static uint32_t intern_code(void *code)
{
    uint32_t slot = (uint32_t)(((uintptr_t)code >> 4) * 2654435761u) % (2 * MAX_CODES);
    for (;; slot = (slot + 1) % (2 * MAX_CODES)) {
        uint32_t index = code_index[slot];
        if (index == 0)
            break;
        if (codes[index - 1].code == code)
            return index - 1;
    }
    if (code_count == MAX_CODES)
        return UINT32_MAX;
    void *type, *value, *traceback; /* an exception being handled stays as it was */
    py.err_fetch(&type, &value, &traceback);
    code_entry entry = {code, copy_name(code, "co_filename"), copy_name(code, "co_name")};
    py.err_restore(type, value, traceback);
    if (!entry.filename || !entry.name) {
        free(entry.filename), free(entry.name);
        return UINT32_MAX;
    }
    py.incref(code);
    codes[code_count] = entry;
    code_index[slot] = ++code_count;
    return code_count - 1;
}

static uint64_t hash_frames(const frame_entry *f, uint32_t depth)
{
    uint64_t h = 1469598103934665603ull;
    for (uint32_t i = 0; i < depth; i++) {
        h = (h ^ f[i].code) * 1099511628211ull;
        h = (h ^ (uint32_t)f[i].line) * 1099511628211ull;
    }
    return h;
}

/* What a capture could not record: warned about once stack_lock is
 * released (a write to a stderr pipe nobody reads blocks, and fork_prepare
 * and snapshots under a device lock take stack_lock). */
enum { TABLE_CODES_FULL = 1, TABLE_STACKS_FULL = 2 };

/* The id of the stack of depth frames, storing it if new; 0 when full. */
static uint32_t intern_stack(const frame_entry *f, uint32_t depth, unsigned *full)
{
    uint64_t hash = hash_frames(f, depth);
    uint32_t slot = (uint32_t)(hash % (2 * MAX_STACKS));
    for (;; slot = (slot + 1) % (2 * MAX_STACKS)) {
        uint32_t id = stack_index[slot];
        if (id == 0)
            break;
        const stack_entry *s = &stacks[id - 1];
        if (s->hash == hash && s->depth == depth && memcmp(&frames[s->first], f, depth * sizeof *f) == 0)
            return id;
    }
    if (stack_count == MAX_STACKS || MAX_FRAMES - frame_count < depth) {
        *full |= TABLE_STACKS_FULL;
        return 0;
    }
    memcpy(&frames[frame_count], f, depth * sizeof *f);
    stacks[stack_count] = (stack_entry){.first = frame_count, .depth = depth, .hash = hash};
    frame_count += depth;
    stack_index[slot] = ++stack_count;
    return stack_count;
}

/* Walks the frames innermost first; each PyFrame_GetBack reference is
 * dropped once the next one is held. A frame whose code the full code table
 * cannot hold ends the stack there, as MAX_DEPTH does: the frames inside it
 * are kept, and a stack whose allocating frame is such code is none (one
 * without it would name its caller as the allocating line). A run that
 * keeps making code objects (exec, recompiled graphs) gets there once its
 * first MAX_CODES are in. */
static uint32_t capture_locked(unsigned *full)
{
    frame_entry walked[MAX_DEPTH];
    uint32_t depth = 0;
    void *frame = py.get_frame();
    if (frame)
        py.incref(frame);
    while (frame && depth < MAX_DEPTH && !(*full & TABLE_CODES_FULL)) {
        void *code = py.frame_code(frame);
        if (code) {
            uint32_t index = intern_code(code);
            if (index != UINT32_MAX)
                walked[depth++] = (frame_entry){index, py.frame_line(frame)};
            else
                *full |= TABLE_CODES_FULL;
            py.decref(code);
        }
        void *back = py.frame_back(frame);
        py.decref(frame);
        frame = back;
    }
    if (frame)
        py.decref(frame);
    return depth ? intern_stack(walked, depth, full) : 0;
}

/* The tables' sizes, not their counts: a stack refused for want of frames
 * leaves room for shorter ones, whose frame count would make each later
 * refusal's text a new warning. */
static void warn_tables_full(unsigned full)
{
    if (full & TABLE_CODES_FULL)
        npa_warn_once("record_stacks: the code table is full (%u code objects); frames of code first seen after "
                      "that are left out of stacks (a stack whose allocating frame is one is recorded without frames)",
                      (unsigned)MAX_CODES);
    if (full & TABLE_STACKS_FULL)
        npa_warn_once("record_stacks: the stack table is full (%u stacks or %u frames); later new stacks that do "
                      "not fit are recorded without frames", (unsigned)MAX_STACKS, MAX_FRAMES);
}

void npa_pystack_take(void)
{
    taken = 0;
    pthread_once(&api_once, look_up_api);
    /* Not Python, not yet or no longer running, or a thread it does not know. */
    if (!api_found || !py.is_initialized() || py.is_finalizing())
        return;
    void *mine = py.this_thread_state();
    if (mine == NULL)
        return;
    bool had_gil = holds_gil(mine);
    int gil_state = had_gil ? 0 : py.gil_ensure();
    unsigned full = 0;
    npa_mutex_lock(&stack_lock);
    if (tables_state == 0)
        tables_state = allocate_tables() ? 1 : -1;
    if (tables_state == 1)
        taken = capture_locked(&full);
    npa_mutex_unlock(&stack_lock);
    warn_tables_full(full);
    if (!had_gil)
        py.gil_release(gil_state);
}

uint32_t npa_pystack_capture(void *ctx)
{
    (void)ctx;
    return taken;
}

void npa_pystack_drop(void)
{
    taken = 0;
}

void npa_pystack_visit(void *ctx, uint32_t stack, npa_frame_visitor visit, void *arg)
{
    (void)ctx;
    npa_mutex_lock(&stack_lock);
    if (stack != 0 && stack <= stack_count) {
        const stack_entry *s = &stacks[stack - 1];
        for (uint32_t i = 0; i < s->depth; i++) {
            const frame_entry *f = &frames[s->first + i];
            visit(codes[f->code].filename, f->line, codes[f->code].name, arg);
        }
    }
    npa_mutex_unlock(&stack_lock);
}

void npa_pystack_lock_for_fork(void)
{
    npa_mutex_lock(&stack_lock);
}

void npa_pystack_unlock_after_fork(void)
{
    npa_mutex_unlock(&stack_lock);
}
