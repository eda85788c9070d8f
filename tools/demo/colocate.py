"""The RL colocation pattern with npualloc.memory_saver, on the simulator: an
inference engine's weights (backed up) and KV cache (not) live in pausable
regions; the engine is paused while a training phase needs the device, then
resumed at the same addresses with its weights intact.

    python tools/demo/colocate.py          # runs itself under `npualloc run`, on a 2 GiB simulated device
"""
from __future__ import annotations

import os
import subprocess
import sys

MiB = 1 << 20


def main() -> None:
    import acl

    from npualloc import memory_saver

    def ok(ret: int) -> None:
        assert ret == 0, ret

    def free_mib() -> int:
        return acl.rt.get_mem_info(1)[0] // MiB

    def malloc(size: int) -> int:
        ptr, ret = acl.rt.malloc(size, 0)
        ok(ret)
        return ptr

    ok(acl.init())
    ok(acl.rt.set_device(0))
    with memory_saver.region("weights", enable_cpu_backup=True):
        weights = malloc(512 * MiB)
    with memory_saver.region("kv_cache"):
        kv_cache = malloc(1024 * MiB)
    data = os.urandom(MiB)
    ok(acl.rt.memcpy(weights, MiB, acl.util.bytes_to_ptr(data), MiB, 1))
    print(f"engine up:    {free_mib():5d} MiB free")

    memory_saver.pause()                       # every tag; the weights go to host memory first
    print(f"engine paused:{free_mib():5d} MiB free, {memory_saver.bytes_of()}")
    grads = malloc(1536 * MiB)                 # the training phase takes the memory (did not fit before)
    ok(acl.rt.free(grads))
    import npualloc
    npualloc.empty_cache()                     # give the trainer's cache back before resuming
    print(f"trained:      {free_mib():5d} MiB free")

    memory_saver.resume()
    assert acl.util.ptr_to_bytes(weights, MiB) == data
    print(f"engine back:  {free_mib():5d} MiB free, weights intact at {weights:#x}, kv cache at {kv_cache:#x}")


if __name__ == "__main__":
    if sys.argv[1:] == ["--under-npualloc"]:
        main()
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from launch import command, sim_environment
        env = sim_environment() | {"NPUSIM_HBM_MB": "2048"}
        args = [sys.executable, os.path.abspath(__file__), "--under-npualloc"]
        sys.exit(subprocess.call(command(args, npualloc=True), env=env))
