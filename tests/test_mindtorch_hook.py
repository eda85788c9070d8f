"""The MindTorch startup hook's edges, without MindTorch: what it costs a
program that never imports it, and what it does with an allocator module that
is not the one expected."""
from __future__ import annotations

import subprocess

from conftest import installed_python, preload_env, sim_env


def run_installed(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.run([installed_python(), "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_hook_imports_nothing_without_npualloc_and_only_a_finder_under_it():
    probe = ("import sys; print(any(type(f).__name__ == '_MindTorchAllocatorFinder' for f in sys.meta_path), "
             "'npualloc' in sys.modules, 'cffi' in sys.modules)")
    assert run_installed(probe, sim_env()).stdout.split() == ["False", "False", "False"]
    assert run_installed(probe, preload_env()).stdout.split() == ["True", "False", "False"]
    assert run_installed(probe, preload_env(NPUALLOC_DISABLE="1")).stdout.split() == ["False", "False", "False"]


def test_hook_reads_the_switches_as_the_library_does():
    """The hook stands aside exactly when the preloaded library does, so that
    MindTorch's own allocator never runs on top of a serving npualloc (or the
    pass-through on a library that serves nothing)."""
    probe = ("import ctypes, os, sys; lib = ctypes.CDLL(os.environ['LD_PRELOAD']); "
             "print(any(type(f).__name__ == '_MindTorchAllocatorFinder' for f in sys.meta_path), "
             "bool(lib.npualloc_is_active()))")
    for switch in ("NPUALLOC_DISABLE", "PYTORCH_NO_CUDA_MEMORY_CACHING"):
        for value in ("1", "true", "Yes", "ON", "0", "false", "no", "off", "2", ""):
            env = preload_env(**{switch: value})
            hooked, active = run_installed(probe, env).stdout.split()
            assert hooked == active, (switch, value, hooked, active)
            assert active == str(value not in ("1", "true", "Yes", "ON")), (switch, value)


def test_unexpected_allocator_module_is_left_alone_with_one_warning():
    code = """
import acl, types
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ptr, _ = acl.rt.malloc(512, 0)   # npualloc serves this process
from npualloc import mindtorch
odd = types.ModuleType("mindtorch_v2._backends.npu.allocator")
odd.get_allocator = lambda device_id=0: None
before = odd.get_allocator
print(mindtorch.install(odd), mindtorch.install(odd), odd.get_allocator is before)
"""
    proc = run_installed(code, preload_env())
    assert proc.stdout.split() == ["False", "False", "True"]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("npualloc:")]
    assert len(warnings) == 1 and "not the one expected" in warnings[0], proc.stderr
