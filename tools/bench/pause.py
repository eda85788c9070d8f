"""`make bench` section: pause and resume throughput (issue 12), device bytes
released per second against the bytes moved through the host backup.

Two paths, each in a pyACL program under npualloc on the simulator (a device
copy there is a host memcpy, so these figures bound the allocator's own work,
not a real NPU's PCIe copy rate):
- memory_saver: pause()/resume() of one tag with enable_cpu_backup;
- `npualloc pause <pid>`: the region command, posted by a second thread of
  the same program while its main thread allocates (expandable_segments:True).
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import launch
from figures import fmt_spread, spread

SIZE_MIB = 256
REPEATS = 5
PROGRAM = """\
import json, os, statistics, sys, threading, time
import acl
from npualloc import memory_saver
from npualloc._ffi import constants
from npualloc.region import Region
MiB = 1 << 20
SIZE, REPEATS = {size} * MiB, {repeats}
def ok(ret):
    assert ret == 0, ret
def malloc(size):
    p, ret = acl.rt.malloc(size, 0); ok(ret)
    return p
ok(acl.init()); ok(acl.rt.set_device(0))
data = os.urandom(MiB) * (SIZE // MiB)
def fill(p):
    ok(acl.rt.memcpy(p, SIZE, acl.util.bytes_to_ptr(data), SIZE, 1))
def check(p):
    assert acl.util.ptr_to_bytes(p, SIZE) == data
out = {{"bytes": SIZE, "saver": [], "command": []}}
with memory_saver.region("bench", enable_cpu_backup=True):
    p = malloc(SIZE)
fill(p)
for _ in range(REPEATS):
    t0 = time.perf_counter(); memory_saver.pause("bench")
    t1 = time.perf_counter(); memory_saver.resume("bench")
    out["saver"].append((t1 - t0, time.perf_counter() - t1))
check(p); ok(acl.rt.free(p))
p = malloc(SIZE)
fill(p)
stop = threading.Event()
def commander():
    with Region(os.getpid(), writable=True) as region:
        for _ in range(REPEATS):
            t0 = time.perf_counter(); region.post_command(constants.NPUALLOC_CMD_PAUSE, timeout=60)
            t1 = time.perf_counter(); region.post_command(constants.NPUALLOC_CMD_RESUME, timeout=60)
            out["command"].append((t1 - t0, time.perf_counter() - t1))
    stop.set()
thread = threading.Thread(target=commander)
thread.start()
while not stop.is_set():        # allocator calls, where the commands are taken
    ok(acl.rt.free(malloc(4096)))
thread.join()
check(p)
print(json.dumps(out))
"""


def measure(build: Any) -> dict[str, Any]:
    env = launch.sim_environment(build) | {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
                                           "NPUSIM_MALLOC_US": "0", "NPUSIM_FREE_US": "0"}
    code = PROGRAM.format(size=SIZE_MIB, repeats=REPEATS)
    proc = subprocess.run(launch.command([sys.executable, "-c", code], npualloc=True), env=env, cwd=launch.ROOT,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"pause bench exited {proc.returncode}: {proc.stderr.strip()}")
    return json.loads(proc.stdout.splitlines()[-1])


def markdown(result: dict[str, Any]) -> list[str]:
    gib = result["bytes"] / (1 << 30)
    lines = ["| path | pause GiB/s | resume GiB/s |", "|---|---:|---:|"]
    for key, label in (("saver", "memory_saver.pause/resume, CPU backup"),
                       ("command", "`npualloc pause/resume <pid>` (region command)")):
        pauses = spread([gib / t for t, _ in result[key]])
        resumes = spread([gib / t for _, t in result[key]])
        lines.append(f"| {label} | {fmt_spread(pauses)} | {fmt_spread(resumes)} |")
    lines.append(f"\n{SIZE_MIB} MiB of live blocks, median [min-max] of {REPEATS} pause/resume cycles; bytes moved "
                 "= the blocks copied to the host and back. The command path's pause includes the wait for the "
                 "program's next allocator call.")
    return lines
