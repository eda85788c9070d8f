"""Every way a program reaches the runtime ends in npualloc: PLT calls, ctypes
attribute lookups and dlopen+dlsym on a library handle (RTLD_LOCAL or
RTLD_GLOBAL, before or after the first call), and the real runtime is found
even where RTLD_NEXT cannot see it. With no runtime at all a call fails with
the runtime's error and one stderr line."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import NPUALLOC_LIB, SIM_LIB, compile_c, preload_env, run_python, sim_env

# What a ctypes user (MindTorch v2) does, without pyACL unless asked: the
# runtime library is opened by path, so it is in no global scope.
CTYPES_LOOKUP = """
import ctypes, json, os, sys
libname, mode, late = sys.argv[1], {"local": ctypes.RTLD_LOCAL, "global": ctypes.RTLD_GLOBAL}[sys.argv[2]], sys.argv[3] == "late"
sim = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", "libaclsim.so"))
sim.aclsim_call_count.restype = ctypes.c_uint64
sim.aclsim_call_count.argtypes = [ctypes.c_char_p]
# device mallocs of any kind: the program's own, or npualloc's segments (aclrtMallocAlign32)
raw = lambda: sim.aclsim_call_count(b"aclrtMalloc") + sim.aclsim_call_count(b"aclrtMallocAlign32")
if late:  # the first allocation happens through pyACL before the handle lookup
    import acl
    assert acl.init() == 0 and acl.rt.set_device(0) == 0
    p, ret = acl.rt.malloc(1 << 20, 0); assert ret == 0 and acl.rt.free(p) == 0
lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", libname), mode=mode)
npa = ctypes.CDLL(os.environ["LD_PRELOAD"])
addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
ours = addr(lib.aclrtMalloc) == addr(npa.aclrtMalloc) and addr(lib.aclrtFree) == addr(npa.aclrtFree)
untouched = addr(lib.aclrtMemcpy) != 0 and addr(lib.aclrtGetDeviceCount) != 0
if not late:
    assert lib.aclInit(None) == 0 and lib.aclrtSetDevice(0) == 0
lib.aclrtMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_int]
lib.aclrtFree.argtypes = [ctypes.c_void_p]
before = raw()
for _ in range(10):
    p = ctypes.c_void_p()
    assert lib.aclrtMalloc(ctypes.byref(p), 1 << 20, 0) == 0
    assert lib.aclrtFree(p) == 0
print(json.dumps({"ours": ours, "untouched": untouched, "raw": raw() - before}))
"""


@pytest.mark.parametrize("libname", ["libacl_rt.so", "libascendcl.so"])
@pytest.mark.parametrize("mode", ["local", "global"])
@pytest.mark.parametrize("when", ["early", "late"])
def test_ctypes_handle_lookups_reach_the_cache(libname, mode, when):
    proc = run_python(CTYPES_LOOKUP, preload_env(), args=[libname, mode, when])
    out = json.loads(proc.stdout)
    assert out["ours"] and out["untouched"]
    # ten 1 MiB malloc/free pairs: one raw malloc (a fresh segment) or none
    # (the pyACL warm-up's segment serves them)
    assert out["raw"] == (1 if when == "early" else 0)
    assert proc.stderr == ""


def test_ctypes_handle_lookups_without_npualloc_reach_the_runtime():
    """The same script without the preload: every malloc is raw, and the
    functions are the library's own."""
    env = sim_env(LD_PRELOAD=str(NPUALLOC_LIB), NPUALLOC_DISABLE="1")
    proc = run_python(CTYPES_LOOKUP, env, args=["libacl_rt.so", "local", "early"])
    assert json.loads(proc.stdout)["raw"] == 10


# Every name npualloc exports in place of the runtime's (hook.h's npa_fn up
# to NPA_FN_INTERPOSED_COUNT), by the library that defines it.
INTERPOSED = {"libascendcl.so": ["aclInit", "aclFinalize", "aclrtSetDevice", "aclrtResetDevice",
                                 "aclrtResetDeviceForce", "aclrtCreateContext", "aclrtSetCurrentContext", "aclrtDestroyContext",
                                 "aclrtGetCurrentContext",
                                 "aclrtMalloc", "aclrtMallocAlign32", "aclrtMallocCached", "aclrtFree",
                                 "aclrtFreeWithDevSync", "aclrtCreateStream", "aclrtDestroyStream",
                                 "aclrtDestroyStreamForce", "aclrtCreateStreamWithConfig"],
              "libnnopbase.so": ["aclnnFinalize", "aclSetAclOpExecutorRepeatable", "aclDestroyAclOpExecutor"]}
EVERY_LOOKUP = """
import ctypes, json, os, sys
lib = ctypes.CDLL(os.path.join(os.environ["ASCEND_HOME_PATH"], "lib64", sys.argv[1]), mode=ctypes.RTLD_LOCAL)
npa = ctypes.CDLL(os.environ["LD_PRELOAD"])
addr = lambda f: ctypes.cast(f, ctypes.c_void_p).value
wrong = []
for name in sys.argv[2:]:
    try:
        if addr(getattr(lib, name)) != addr(getattr(npa, name)):
            wrong.append(name)
    except AttributeError:  # dlsym answered NULL
        wrong.append(name + " (missing)")
print(json.dumps(wrong))
"""


@pytest.mark.parametrize("libname", sorted(INTERPOSED))
def test_every_interposed_name_looked_up_through_a_handle_is_ours(libname):
    """aclrtDestroyContext was missing from the table of our own functions:
    a handle lookup of it answered NULL (ctypes raised AttributeError)."""
    proc = run_python(EVERY_LOOKUP, preload_env(), args=[libname, *INTERPOSED[libname]])
    assert json.loads(proc.stdout) == []


C_PROGRAM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int (*init_fn)(const char *);
typedef int (*dev_fn)(int32_t);
typedef int (*malloc_fn)(void **, size_t, int);
typedef int (*free_fn)(void *);
typedef uint64_t (*count_fn)(const char *);
typedef uint64_t (*live_fn)(int32_t);

static count_fn count;
static live_fn live;

/* Registered before the first allocation, so it runs after npualloc's own
 * exit handler: what the simulator holds once npualloc has cleaned up. */
static void report_at_exit(void)
{
    printf("exit_live=%llu\n", (unsigned long long)live(0));
}

static const char *object_of(void *fn)
{
    Dl_info info;
    return dladdr(fn, &info) && info.dli_fname ? info.dli_fname : "?";
}

int main(int argc, char **argv)
{
    int mode = strcmp(argv[2], "global") == 0 ? RTLD_GLOBAL : RTLD_LOCAL;
    void *h = dlopen(argv[1], RTLD_NOW | mode);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    init_fn init = (init_fn)dlsym(h, "aclInit");
    dev_fn set = (dev_fn)dlsym(h, "aclrtSetDevice");
    malloc_fn mal = (malloc_fn)dlsym(h, "aclrtMalloc");
    free_fn fr = (free_fn)dlsym(h, "aclrtFree");
    count = (count_fn)dlsym(h, "aclsim_call_count");
    live = (live_fn)dlsym(h, "aclsim_live_allocations");
    printf("malloc_from=%s\n", object_of((void *)mal));
    printf("memcpy_from=%s\n", object_of(dlsym(h, "aclrtMemcpy")));
    /* RTLD_NEXT from the executable must still mean "after the executable". */
    printf("rtld_next=%d\n", dlsym(RTLD_NEXT, "npualloc_is_active") != NULL);
    printf("missing=%d\n", dlsym(h, "aclrtNoSuchFunction") == NULL);
    atexit(report_at_exit);
    if (init(NULL) || set(0)) return 3;
    /* device mallocs of any kind: the program's own, or npualloc's segments */
    uint64_t before = count("aclrtMalloc") + count("aclrtMallocAlign32");
    for (int i = 0; i < 50; i++) {
        void *p = NULL;
        if (mal(&p, 3000 + i, 0) || fr(p)) return 4;
    }
    printf("raw=%llu\n", (unsigned long long)(count("aclrtMalloc") + count("aclrtMallocAlign32") - before));
    fflush(stdout);
    return 0; /* no aclFinalize: the exit handler returns the cache */
}
"""


@pytest.fixture(scope="module")
def c_program(tmp_path_factory):
    return compile_c(tmp_path_factory, "dlopen", C_PROGRAM)


def run_c(prog, env, *args):
    proc = subprocess.run([str(prog), *args], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return dict(line.split("=", 1) for line in proc.stdout.splitlines()), proc


@pytest.mark.parametrize("libname", ["libacl_rt.so", "libascendcl.so"])
@pytest.mark.parametrize("mode", ["local", "global"])
def test_c_program_dlopen_dlsym_reaches_the_cache(c_program, libname, mode):
    out, proc = run_c(c_program, preload_env(), str(SIM_LIB / libname), mode)
    assert out["malloc_from"].endswith("libnpualloc.so")
    assert out["memcpy_from"].endswith(libname)
    assert out["rtld_next"] == "1"
    assert out["missing"] == "1"
    assert out["raw"] == "1"  # 50 small malloc/free pairs, one 2 MiB segment
    assert out["exit_live"] == "0"  # exited without aclFinalize: the segment went back
    assert proc.stderr == ""


def test_c_program_without_npualloc_mallocs_every_time(c_program):
    out, _ = run_c(c_program, sim_env(), str(SIM_LIB / "libacl_rt.so"), "local")
    assert out["raw"] == "50"
    assert out["malloc_from"].endswith("libacl_rt.so")


NO_RUNTIME = """
import ctypes
lib = ctypes.CDLL(None)
p = ctypes.c_void_p()
print(lib.aclrtSetDevice(0), lib.aclrtMalloc(ctypes.byref(p), 4096, 0), lib.aclrtFree(ctypes.c_void_p(4096)),
      lib.aclSetAclOpExecutorRepeatable(ctypes.c_void_p(64)))
"""


@pytest.mark.parametrize("acl_lib", [None, "self"])
def test_no_runtime_fails_with_the_runtime_error_and_one_line(tmp_path, acl_lib):
    env = preload_env(ASCEND_HOME_PATH=str(tmp_path), NPUALLOC_SHM_DIR=str(tmp_path))
    env["LD_LIBRARY_PATH"] = ""
    if acl_lib == "self":  # a path that leads back to ourselves must not recurse
        env["NPUALLOC_ACL_LIB"] = str(NPUALLOC_LIB)
    proc = run_python(NO_RUNTIME, env)
    assert proc.stdout.split() == ["100001", "100001", "100001", "561103"]
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr  # one for the ACL runtime, one for aclnn
    assert all(line.startswith("npualloc: cannot find the") for line in lines)


@pytest.mark.parametrize("how", ["NPUALLOC_ACL_LIB", "ASCEND_HOME_PATH"])
def test_runtime_found_by_path_when_nothing_loaded_it(tmp_path, how):
    env = preload_env()
    env["LD_LIBRARY_PATH"] = ""
    if how == "NPUALLOC_ACL_LIB":
        env["NPUALLOC_ACL_LIB"] = str(SIM_LIB / "libascendcl.so")
        env["ASCEND_HOME_PATH"] = str(tmp_path)
    code = f"""
import ctypes
lib = ctypes.CDLL(None)  # only the global scope: the runtime is not loaded
p = ctypes.c_void_p()
rets = [lib.aclInit(None), lib.aclrtSetDevice(0)]
for _ in range(5):
    rets += [lib.aclrtMalloc(ctypes.byref(p), 4096, 0), lib.aclrtFree(p)]
sim = ctypes.CDLL({str(SIM_LIB / "libaclsim.so")!r})
sim.aclsim_call_count.restype = ctypes.c_uint64
print(set(rets), sim.aclsim_call_count(b"aclrtMalloc") + sim.aclsim_call_count(b"aclrtMallocAlign32"))
"""
    proc = run_python(code, env)
    assert proc.stdout.split() == ["{0}", "1"]
    assert proc.stderr == ""


CLOSE_THE_HANDLE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef int (*one_pointer_fn)(void *);

int main(int argc, char **argv)
{
    void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
    one_pointer_fn fn = (one_pointer_fn)dlsym(h, argv[2]);
    Dl_info info;
    printf("ours=%d\n", dladdr((void *)fn, &info) && info.dli_fname && strstr(info.dli_fname, "libnpualloc") != NULL);
    dlclose(h);
    printf("loaded=%d\n", dlopen(argv[1], RTLD_NOW | RTLD_NOLOAD) != NULL);
    fflush(stdout);
    printf("returned=%d\n", fn(NULL) != 0); /* ours, forwarding to the runtime's: an error for NULL */
    return 0;
}
"""


@pytest.mark.parametrize("libname, name", [("libnnopbase.so", "aclDestroyAclOpExecutor"),
                                           ("libacl_rt.so", "aclrtFree")])
def test_closing_the_handle_leaves_the_runtime_we_call_loaded(tmp_path_factory, libname, name):
    """A program may dlclose the handle it found a function through while we
    still forward to the runtime's (a later call, the exit's release of the
    cache, a deferred executor destroy): the library stays loaded. Without
    that, the handle was the library's last reference and the call crashed."""
    prog = compile_c(tmp_path_factory, "close_handle", CLOSE_THE_HANDLE)
    env = preload_env()
    env["LD_LIBRARY_PATH"] = ""  # only the handle loads the runtime
    out, proc = run_c(prog, env, str(SIM_LIB / libname), name)
    assert out == {"ours": "1", "loaded": "1", "returned": "1"}
