"""empty_cache as torch_npu's emptyCache (issue 11 item 5): a process with a
stream frees everything while its work is still queued, synchronizes, and
empties the cache; nothing it freed may be left active, pending or reserved,
whether the call comes from inside the process or from `npualloc
empty-cache <pid>`. And the device's free memory that another process reads
follows the segments (item 8)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import preload_env
from region_helpers import Workload, cli_env, region_file, wait_for_pending_command
from sim_programs import DEVICE_BUFFERS

import pytest

import npualloc

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _regions_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test reads regions where its processes put them."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))

# Frees every block while fills queued on a stream still use them, then
# synchronizes device and stream (the sequence). argv[1]: "api" empties
# the cache in process; "cli" waits for a line on stdin, then makes one
# allocator call (it applies the command another process posted).
SCENARIO = DEVICE_BUFFERS + """\
import json, sys
import npualloc
stream, ret = acl.rt.create_stream(); ok(ret)
aclsim.set_op_duration_us(2_000)
sizes = [512, 4096, 300_000, 1 << 20, 3 << 20, 12 << 20, 30 << 20] * 3   # both pools, > 13 blocks
blocks = [dev(size) for size in sizes]
workspaces = [dev(ops.WORKSPACE_BYTES) for _ in blocks]
for p, size, ws in zip(blocks, sizes, workspaces):
    n, ex, st = ops.fill_get_workspace_size(p, size, 7); ok(st)
    ok(ops.fill(ws, n, ex, stream))
for p in blocks + workspaces:
    ok(acl.rt.free(p))                       # the fills have not run yet
ok(acl.rt.synchronize_device())
ok(acl.rt.synchronize_stream(stream))
if sys.argv[1] == "api":
    npualloc.empty_cache()
    kept = 0
else:
    print(json.dumps("freed"), flush=True)
    sys.stdin.readline()
    kept, ret = acl.rt.malloc(4096, 0); ok(ret)   # applies the posted command first
stats = npualloc.memory_stats()
print(json.dumps({"stats": stats, "raw_blocks": aclsim.live_allocations(0),
                  "invalid_accesses": aclsim.invalid_accesses()}), flush=True)
sys.stdin.readline()
"""


def _start(mode: str, shm_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SCENARIO, mode], env=preload_env(NPUALLOC_SHM_DIR=str(shm_dir)),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> dict:
    assert proc.stdout and proc.stdin
    line = proc.stdout.readline()
    proc.stdin.write("\n")
    proc.stdin.flush()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and line, err
    assert err == "", err
    return json.loads(line)


def test_empty_cache_in_process_releases_every_freed_block(tmp_path: Path) -> None:
    out = _finish(_start("api", tmp_path))
    s = out["stats"]
    assert s["active.all.current"] == 0 and s["active_bytes.all.current"] == 0
    assert s["npualloc.pending_frees"] == 0
    assert s["reserved_bytes.all.current"] == 0 and s["segment.all.current"] == 0
    assert out["raw_blocks"] == 0  # the simulator holds no block of ours any more
    assert out["invalid_accesses"] == 0  # and none went back while a fill still used it
    assert s["num_sync_all_streams"] >= 1


def test_cli_empty_cache_releases_every_freed_block(tmp_path: Path) -> None:
    proc = _start("cli", tmp_path)
    assert proc.stdout and proc.stdin
    ready = proc.stdout.readline()
    assert json.loads(ready) == "freed", proc.stderr.read() if proc.stderr else ""
    cli = subprocess.Popen([sys.executable, "-m", "npualloc", "empty-cache", str(proc.pid)], env=cli_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pending_command(region_file(tmp_path, proc.pid), lambda: cli.poll() is None)
    proc.stdin.write("\n")
    proc.stdin.flush()
    out, err = cli.communicate(timeout=60)
    assert cli.returncode == 0 and out == f"process {proc.pid}: cache emptied\n", err
    report = _finish(proc)
    s = report["stats"]
    # Only the block of the call that applied the command is left: one
    # 4 KiB allocation in one fresh 2 MiB small segment.
    assert s["active.all.current"] == 1 and s["active_bytes.all.current"] == s["allocated_bytes.all.current"]
    assert s["npualloc.pending_frees"] == 0
    assert s["reserved_bytes.all.current"] == 2 * MiB and s["segment.all.current"] == 1
    assert report["raw_blocks"] == 1
    assert report["invalid_accesses"] == 0


def test_stats_from_another_process_follow_device_free_memory(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call(f"malloc({MiB})")

        def seen() -> tuple[int, int]:
            """(free memory another process reads in the region, the runtime's figure in the process)."""
            return npualloc.memory_stats(pid=w.pid)["npualloc.device_free_bytes"], w.call("npualloc.mem_get_info(0)")[0]

        first, live = seen()
        assert first == live
        w.call(f"malloc({200 * MiB})")  # a new segment
        grown, live = seen()
        assert grown == live and grown <= first - 200 * MiB
        w.call(f"malloc({2 * MiB})")  # a hit in the first 20 MiB segment: nothing changed hands
        assert seen() == (grown, grown)
        w.call("free()")
        w.call("free()")  # the 200 MiB block: cached, still reserved
        assert seen() == (grown, grown)
        w.call("npualloc.empty_cache()")
        emptied, live = seen()
        assert emptied == live and emptied >= grown + 200 * MiB
