"""A simulated device's memory is shared by the processes of one
NPUSIM_SHARED_DIR, as a real NPU's is by the processes of a node: what one
process holds is missing for the other, aclrtGetMemInfo sees both, and a
process that dies gives its memory back however it died."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from conftest import run_python, sim_env

MiB = 1 << 20
HOLDER = """\
import sys, acl
assert acl.init() == 0 and acl.rt.set_device(0) == 0
ptr, ret = acl.rt.malloc(48 << 20, 0)
assert ret == 0, ret
print("holding", flush=True)
sys.stdin.readline()
"""
PROBE = """\
import acl
assert acl.init() == 0 and acl.rt.set_device(0) == 0
free, total, _ = acl.rt.get_mem_info(1)
ptr, ret = acl.rt.malloc(32 << 20, 0)
print(free, total, ret)
"""


def _holder(env: dict[str, str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "holding\n"
    return proc


def _probe(env: dict[str, str]) -> list[int]:
    return [int(x) for x in run_python(textwrap.dedent(PROBE), env).stdout.split()]


def test_processes_share_a_device_and_a_killed_one_frees_its_memory():
    env = sim_env(NPUSIM_HBM_MB="64")
    holder = _holder(env)
    try:
        assert _probe(env) == [16 * MiB - 32, 64 * MiB, 207001]  # the holder's 48 MiB (+32, aclrtMalloc's pad)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert _probe(env) == [64 * MiB, 64 * MiB, 0]  # its record is ignored once it is dead


def test_unrelated_capacities_never_mix(tmp_path):
    holder = _holder(sim_env(NPUSIM_HBM_MB="64"))
    try:
        # Another directory, or none: the device is this process's alone.
        assert _probe(sim_env(NPUSIM_HBM_MB="64", NPUSIM_SHARED_DIR=str(tmp_path))) == [64 * MiB, 64 * MiB, 0]
        private = sim_env(NPUSIM_HBM_MB="64")
        del private["NPUSIM_SHARED_DIR"]
        assert _probe(private) == [64 * MiB, 64 * MiB, 0]
    finally:
        holder.stdin.close()
        assert holder.wait() == 0


def test_a_foreign_file_is_refused(tmp_path):
    (tmp_path / "device0").write_bytes(b"x" * 8192)
    proc = run_python(PROBE, sim_env(NPUSIM_SHARED_DIR=str(tmp_path)), check=False)
    assert proc.returncode != 0 and "not a device accounting file" in proc.stderr
