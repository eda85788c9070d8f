"""Run at every interpreter start by npualloc-mindtorch.pth; does nothing
unless this process runs under npualloc (libnpualloc.so in LD_PRELOAD, as
`npualloc run` sets it) and npualloc is not switched off. Then it watches for
MindTorch v2's allocator module and hands it to npualloc.mindtorch.install()
right after it executes, before anything can allocate through it.

Kept to the standard library's cheapest parts: it runs in every Python
process of an environment where npualloc is installed.
"""
import os
import sys

_TARGET = "mindtorch_v2._backends.npu.allocator"


def _under_npualloc() -> bool:
    preload = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
    if not any(os.path.basename(path) == "libnpualloc.so" for path in preload):
        return False
    # The library's own switches, read by its rule (interpose/src/hook/lifecycle.c,
    # env_true): set to one of these, it serves nothing; any other value leaves it on.
    return not any(_switched_on(os.environ.get(key)) for key in ("NPUALLOC_DISABLE", "PYTORCH_NO_CUDA_MEMORY_CACHING"))


def _switched_on(value) -> bool:
    return value is not None and (value == "1" or value.lower() in ("true", "yes", "on"))


class _MindTorchAllocatorFinder:
    """A meta path finder that answers only for MindTorch's allocator module:
    it finds it as the other finders would and patches it after execution."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        import importlib.machinery
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            from npualloc import mindtorch
            mindtorch.install(module)

        loader.exec_module = exec_module
        return spec


if _under_npualloc():
    sys.meta_path.insert(0, _MindTorchAllocatorFinder())
