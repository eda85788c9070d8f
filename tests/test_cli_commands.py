"""The CLI's commands against real preloaded processes: stats, ls, run and the
commands that change a running process."""
from __future__ import annotations

import ctypes
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from region_helpers import (Workload, assert_one_line_error, assert_shows_command, cli_env, cli_with_trigger,
                            region_bytes, region_file, run_cli, stuck_region_bytes, write_region)

import pytest

import npualloc
from npualloc.summary import human_bytes

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _regions_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test reads regions where its workloads and CLIs put them."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))


def test_stats_table_and_json_match_the_process(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call(f"malloc({3 * MiB})")
        w.call("malloc(1000)")
        inside = w.call("npualloc.memory_stats()")
        table = run_cli(["stats", str(w.pid)], tmp_path)
        assert table.returncode == 0 and table.stderr == "", table.stderr
        header = table.stdout.splitlines()[0].split(" · ")
        assert header[:2] == ["npualloc", f"pid {w.pid}"], header
        assert_shows_command(header[2], w)
        for label in ("allocated", "reserved", "active", "segments", "cache hit rate", "fragmentation",
                      "device calls", "OOMs / retries", "pending frees", "executor destroys"):
            assert label in table.stdout, label
        assert f"{human_bytes(inside['reserved_bytes.all.current'])} " in table.stdout

        as_json = run_cli(["stats", str(w.pid), "--json", "--device", "0"], tmp_path)
        snapshot = json.loads(as_json.stdout)
        assert snapshot["pid"] == w.pid and list(snapshot["devices"]) == ["0"]
        assert snapshot["devices"]["0"] == inside


def test_stats_of_a_device_the_process_never_used_says_so(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")  # device 0 only
        table = run_cli(["stats", str(w.pid), "--device", "1"], tmp_path)
        assert table.returncode == 0 and table.stderr == "", table.stderr
        assert "NPU 1: unused by this process (nothing allocated on it through npualloc)" in table.stdout
        assert "  reserved" not in table.stdout and "0 B free of 0 B" not in table.stdout
        as_json = json.loads(run_cli(["stats", str(w.pid), "--device", "1", "--json"], tmp_path).stdout)
        assert as_json["devices"] == {} and as_json["unused_devices"] == [1]
        both = json.loads(run_cli(["stats", str(w.pid), "--json"], tmp_path).stdout)
        assert list(both["devices"]) == ["0"] and both["unused_devices"] == []



def test_a_device_past_the_runtime_devices_is_a_bad_device(tmp_path: Path) -> None:
    """As in the process: it read as an unused device (stats) or took a command
    for a device that does not exist."""
    with Workload(tmp_path, NPUSIM_DEVICE_COUNT="2") as w:
        w.call("malloc(4096)")
        pid = str(w.pid)
        for args in (["stats", pid, "--device", "7"], ["stats", pid, "--device", "2", "--json"],
                     ["empty-cache", pid, "--device", "7"], ["reset-peak", pid, "--device", "2"],
                     ["set-memory-fraction", pid, "0.5", "--device", "7"]):
            assert_one_line_error(run_cli(args, tmp_path), 2, "the runtime sees 2 device(s)")
        assert run_cli(["stats", pid, "--device", "1"], tmp_path).returncode == 0  # exists, unused


def _watching(tmp_path: Path, pid: int) -> subprocess.Popen:
    """`stats <pid> --watch 0.05`, once it has shown a frame: the process is being watched."""
    watcher = subprocess.Popen([sys.executable, "-m", "npualloc", "stats", str(pid), "--watch", "0.05"],
                               env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watcher.stdout is not None
    for line in watcher.stdout:
        if line.startswith(f"npualloc · pid {pid} "):
            break
    return watcher


def test_stats_watch_of_a_process_that_exits_says_it_ended(tmp_path: Path) -> None:
    w = Workload(tmp_path)
    try:
        w.call("malloc(4096)")
        watcher = _watching(tmp_path, w.pid)
        assert w.close() == 0
        _, err = watcher.communicate(timeout=60)
    finally:
        w.close()
    assert watcher.returncode == 0 and err == f"npualloc: process {w.pid} ended\n", err


def test_stats_watch_ends_when_the_pid_names_another_region(tmp_path: Path) -> None:
    """Each frame opens the region by pid: once the process ended and its pid
    went to a new process under npualloc, the watch went on showing that one
    as if it were the same. A region created at another time is another process."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        path = write_region(tmp_path, sleeper.pid, region_bytes(sleeper.pid, created_unix_ns=1))
        watcher = _watching(tmp_path, sleeper.pid)
        replacement = path.with_name("replacement")  # the new region appears whole, as the allocator makes one
        replacement.write_bytes(region_bytes(sleeper.pid, created_unix_ns=2))
        replacement.chmod(0o600)
        replacement.rename(path)
        _, err = watcher.communicate(timeout=60)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert watcher.returncode == 0, err
    assert err == f"npualloc: process {sleeper.pid} ended (the pid now names another region)\n", err


def test_stats_watch_refreshes_until_interrupted(tmp_path: Path) -> None:
    """Frames are counted as they arrive (never a wait of some seconds), and a
    change made in the process shows in a later frame."""
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        # Ctrl-C as a terminal sends it: a suite started as a background job
        # (`.ci/run &`) passes SIGINT down ignored, and Python keeps it so.
        watcher = subprocess.Popen([sys.executable, "-m", "npualloc", "stats", str(w.pid), "--watch", "0.05"],
                                   env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert watcher.stdout is not None

        def frames_until(text: str, count: int) -> int:
            """Reads frames until `count` of them have contained `text`; the frames read."""
            frames, seen, frame = 0, 0, ""
            for line in watcher.stdout:
                if line.startswith(f"npualloc · pid {w.pid} ") and frame:
                    frames += 1
                    seen += text in frame
                    frame = ""
                    if seen >= count:
                        return frames
                frame += line
            raise AssertionError(f"the watch ended after {frames} frames: {watcher.stderr.read()}")

        small = human_bytes(npualloc.memory_reserved(pid=w.pid))
        frames_until(f"{small} ", 3)
        w.call(f"malloc({3 * MiB})")  # a 20 MiB segment more: a later frame must show it
        frames_until(f"{human_bytes(npualloc.memory_reserved(pid=w.pid))} ", 1)
        watcher.send_signal(signal.SIGINT)
        _, err = watcher.communicate(timeout=30)
        assert watcher.returncode == 0 and "Traceback" not in err, err


def test_ls_lists_live_processes_and_cleans_stale_regions(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = write_region(tmp_path, dead.pid, region_bytes(os.getpid(), pid=dead.pid))
    with Workload(tmp_path) as first, Workload(tmp_path) as second:
        first.call(f"malloc({3 * MiB})")
        second.call("malloc(4096)")
        rows = json.loads(run_cli(["ls", "--json"], tmp_path).stdout)
        by_pid = {row["pid"]: row for row in rows}
        assert set(by_pid) == {first.pid, second.pid}
        assert by_pid[first.pid]["device"] == 0
        assert by_pid[first.pid]["allocated"] == npualloc.memory_allocated(pid=first.pid) >= 3 * MiB
        assert by_pid[second.pid]["reserved"] == npualloc.memory_reserved(pid=second.pid) > 0
        assert_shows_command(by_pid[second.pid]["command"], second)
        assert not stale.exists()

        table = run_cli(["ls"], tmp_path)
        assert table.returncode == 0
        header, *lines = table.stdout.splitlines()
        assert header.split() == ["PID", "DEV", "ALLOCATED", "RESERVED", "COMMAND"]
        assert sorted(int(line.split()[0]) for line in lines) == sorted([first.pid, second.pid])
    assert run_cli(["ls"], tmp_path).stdout == "no process is running under npualloc\n"


def test_list_gpu_processes_lists_the_devices_processes_in_torchs_format(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda.list_gpu_processes(device)'s printout, from the regions
    `ls` reads: the processes holding memory of that device, none on another."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    assert npualloc.list_gpu_processes(0) == "NPU:0\nno processes are running"
    with Workload(tmp_path) as first, Workload(tmp_path) as second:
        first.call(f"malloc({3 * MiB})")
        second.call("malloc(4096)")
        lines = npualloc.list_gpu_processes("npu:0").splitlines()
        assert lines[0] == "NPU:0"
        assert sorted(lines[1:]) == sorted(
            f"process {w.pid:>10d} uses {npualloc.memory_reserved(0, pid=w.pid) / MiB:>12.3f} MB NPU memory"
            for w in (first, second))
        assert npualloc.list_gpu_processes(1) == "NPU:1\nno processes are running"


def test_ls_lists_healthy_processes_beside_a_region_stuck_mid_update(tmp_path: Path, sleeper: int) -> None:
    stuck_path = write_region(tmp_path, sleeper, stuck_region_bytes(sleeper))
    with Workload(tmp_path) as healthy:
        healthy.call("malloc(4096)")
        proc = run_cli(["ls", "--json"], tmp_path)
        assert proc.returncode == 0
        assert [row["pid"] for row in json.loads(proc.stdout)] == [healthy.pid]
        assert proc.stderr == f"npualloc: skipping process {sleeper}: {stuck_path}: device 0 stats stayed " \
                              "mid-update (a writer died or stopped inside its seqlock?)\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: a process and files of another user")
def test_ls_shows_another_users_command_line_from_the_region(tmp_path: Path, sleeper: int) -> None:
    """Reading /proc/<pid>/cmdline waits for that process's address-space
    lock, which its owner can keep held: root's ls takes another user's
    command line from the region (here "crafted"), its own from /proc."""
    theirs = subprocess.Popen(["sleep", "60"], user=65534)
    try:
        write_region(tmp_path, sleeper, region_bytes(sleeper))
        path = tmp_path / "npualloc-65534" / f"npualloc.{theirs.pid}"
        path.parent.mkdir(mode=0o700)
        path.write_bytes(region_bytes(theirs.pid, uid=65534))
        path.chmod(0o600)
        for owned in (path.parent, path):
            os.chown(owned, 65534, 65534)
        proc = run_cli(["ls", "--json"], tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert {row["pid"]: row["command"] for row in json.loads(proc.stdout)} == {
            sleeper: "sleep 60", theirs.pid: "crafted"}
    finally:
        theirs.kill()
        theirs.wait()


def test_ls_cleans_leftover_snapshot_and_temporary_files_of_dead_processes(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    mine = region_file(tmp_path, dead.pid).parent
    mine.mkdir(mode=0o700)
    leftovers = [mine / f"npualloc.{dead.pid}.snapshot.2148584.3",  # .<its region's inode>.<command>
                 mine / f"npualloc.{dead.pid}.snapshot.2148584.4.tmp.{dead.pid}.0badf00d",
                 mine / f"npualloc.{dead.pid}.snapshot.3",  # as named before region layout version 8
                 mine / f".npualloc.{dead.pid}.tmp.0badf00d",
                 mine / f".npualloc.{dead.pid}.tmp",  # as named before random suffixes
                 mine / f".npualloc.{dead.pid}.reap.5eed1e55",  # a gone region moved aside by a reaper killed then
                 mine / f".npualloc.{dead.pid}.reap",  # as named before random suffixes
                 mine / f"npualloc.{dead.pid}.snapshot.4.tmp.{dead.pid}.0badf00d",
                 mine / f"npualloc.{dead.pid}.snapshot.5.tmp.{dead.pid}"]  # as named before random suffixes
    kept = [mine / f"npualloc.{os.getpid()}.snapshot.2148584.1",  # a live process's: a requester may be reading it
            mine / f"npualloc.{os.getpid()}.snapshot.1",
            mine / "unrelated.file", tmp_path / f"npualloc.{dead.pid}.snapshot.3"]  # not in a region directory
    for path in leftovers + kept:
        path.write_bytes(b"x")
    planted = mine / f"npualloc.{dead.pid}.snapshot.6"  # a directory at a leftover's name: never moved aside
    planted.mkdir()
    assert run_cli(["ls"], tmp_path).returncode == 0
    assert [p for p in leftovers if p.exists()] == []
    assert all(p.exists() for p in kept)
    assert planted.is_dir() and [name for name in os.listdir(mine) if name.startswith(".")] == []


def test_ls_cleans_the_region_of_a_forked_child_that_skipped_atexit(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call("malloc(4096)")
        child = w.call(f"fork_child_allocates({MiB})")[0]
        assert region_file(tmp_path, child).exists()
        rows = json.loads(run_cli(["ls", "--json"], tmp_path).stdout)
        assert [row["pid"] for row in rows] == [w.pid]
        assert not region_file(tmp_path, child).exists()



def test_empty_cache_reset_peak_and_gc_threshold(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        w.call(f"malloc({3 * MiB})")
        w.call("malloc(4096)")
        w.call(f"acl.rt.free({w.call('live')[0]})")
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] == 20 * MiB

        done = cli_with_trigger(w, tmp_path, ["empty-cache", str(w.pid), "--device", "0"], "free()")
        assert done.returncode == 0 and "cache emptied" in done.stdout, done.stderr
        assert npualloc.memory_stats(pid=w.pid)["reserved_bytes.large_pool.current"] == 0

        assert npualloc.max_memory_allocated(pid=w.pid) >= 3 * MiB
        done = cli_with_trigger(w, tmp_path, ["reset-peak", str(w.pid)], "malloc(4096)")
        assert done.returncode == 0, done.stderr
        assert npualloc.max_memory_allocated(pid=w.pid) == npualloc.memory_allocated(pid=w.pid) < MiB

        done = cli_with_trigger(w, tmp_path, ["set-gc-threshold", str(w.pid), "0.25"], "malloc(4096)")
        assert done.returncode == 0, done.stderr
        assert "garbage_collection_threshold:0.25" in w.call("npualloc.get_config()")

        # Waiting out a NaN or infinite deadline never ended; 0 first, so that without the check this fails, not hangs.
        for timeout in (0.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="positive number of seconds"):
                npualloc.empty_cache(pid=w.pid, timeout=timeout)


def test_reset_peak_without_a_device_resets_every_device_in_use(tmp_path: Path) -> None:
    """As its --device help says (default: every device in use), like empty-cache:
    it reset only the first device the process allocated on."""
    with Workload(tmp_path) as w:
        for device in (0, 1):
            w.call(f"acl.rt.set_device({device})")
            w.call(f"malloc({3 * MiB})")
            w.call("free()")
        assert [npualloc.max_memory_allocated(d, pid=w.pid) for d in (0, 1)] == [3 * MiB + 512] * 2
        done = cli_with_trigger(w, tmp_path, ["reset-peak", str(w.pid)], "malloc(4096)")
        assert done.returncode == 0 and "peak stats reset" in done.stdout, done.stderr
        assert [npualloc.max_memory_allocated(d, pid=w.pid) for d in (0, 1)] == [0, 4608]


def test_set_memory_fraction(tmp_path: Path) -> None:
    with Workload(tmp_path, NPUSIM_HBM_MB="100") as w:
        w.call(f"malloc({40 * MiB - 64})")
        done = cli_with_trigger(w, tmp_path, ["set-memory-fraction", str(w.pid), "0.5"], "malloc(4096)")
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout == f"process {w.pid}: per_process_memory_fraction of device 0 set to 0.5\n"
        assert npualloc.memory_stats(pid=w.pid)["npualloc.reserved_limit_bytes"] == 50 * MiB
        assert w.call(f"acl.rt.malloc({20 * MiB - 64}, 0)[1]") == 207001
        # The config line cannot show it (the cap is per device, as torch's): the device's table does.
        table = run_cli(["stats", str(w.pid)], tmp_path).stdout
        assert "free of 100.00 MiB, reserved capped at 50.00 MiB\n" in table, table

        # A cap below 2 MiB of the device the region shows is refused before anything is posted.
        refused = run_cli(["set-memory-fraction", str(w.pid), "0.01", "--device", "0"], tmp_path)
        assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
        assert refused.stderr.startswith("npualloc: fraction 0.01 caps device 0 at 1048576 bytes, below the "
                                         "smallest segment"), refused.stderr
        done = cli_with_trigger(w, tmp_path, ["set-memory-fraction", str(w.pid), "1", "--device", "0"],
                                "malloc(4096)")
        assert done.stdout == f"process {w.pid}: per_process_memory_fraction of device 0 set to 1\n", done.stderr
        assert npualloc.memory_stats(pid=w.pid)["npualloc.reserved_limit_bytes"] == 0
        w.call(f"malloc({20 * MiB - 64})")
        assert "capped" not in run_cli(["stats", str(w.pid)], tmp_path).stdout


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "npualloc", "run", *args], env=env, capture_output=True, text=True,
                          timeout=60)


PRINT_CHILD_ENV = ("import os, subprocess, sys; print(subprocess.run([sys.executable, '-c', "
                   "\"import os; print(os.environ['LD_PRELOAD']); "
                   "print(any(l.rstrip().endswith('/libnpualloc.so') for l in open('/proc/self/maps'))); "
                   "print(os.environ.get('MINDTORCH_NPU_ALLOC_CONF')); print(os.environ.get('PYTORCH_NPU_ALLOC_CONF'))\"], "
                   "capture_output=True, text=True).stdout, end='')")


def test_run_preloads_into_children_and_keeps_ld_preload(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    env["LD_PRELOAD"] = "libm.so.6"
    done = _run(["--conf", "garbage_collection_threshold:0.6", "--", sys.executable, "-c", PRINT_CHILD_ENV], env)
    assert done.returncode == 0, done.stderr
    preload, mapped, mindtorch_conf, torch_npu_conf = done.stdout.splitlines()
    assert preload == f"{npualloc.library_path()}:libm.so.6"
    assert mapped == "True"
    assert (mindtorch_conf, torch_npu_conf) == ("garbage_collection_threshold:0.6", "None")

    env["PYTORCH_NPU_ALLOC_CONF"] = "max_split_size_mb:64"  # the variable the user already uses, --conf after
    done = _run(["--conf", "max_split_size_mb:128", "--", sys.executable, "-c", PRINT_CHILD_ENV], env)
    assert done.stdout.splitlines()[2:] == ["None", "max_split_size_mb:64,max_split_size_mb:128"]


def test_run_conf_adds_its_keys_to_the_users_config(tmp_path: Path) -> None:
    """--conf went into the config variable in place of what the user had
    set there, silently dropping their keys. It is added after them: the
    user's keys stay, and for a key in both --conf's wins, as the later of
    a repeated key does in torch's parser (and the library's). A bad entry's
    warning names both places it may come from."""
    env = cli_env(tmp_path)
    code = "import acl, npualloc; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0); print(npualloc.get_config())"
    for variable in ("MINDTORCH_NPU_ALLOC_CONF", "PYTORCH_NPU_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        users = {variable: "max_split_size_mb:64,garbage_collection_threshold:0.5,frobnicate:1"}
        done = _run(["--conf", "roundup_power2_divisions:4,max_split_size_mb:128", "--", sys.executable, "-c", code],
                    env | users)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "max_split_size_mb:128,garbage_collection_threshold:0.5,roundup_power2_divisions:4\n"
        assert done.stderr == (f"npualloc: {variable} and npualloc run --conf: unknown key 'frobnicate'; "
                               "ignored\n"), done.stderr


def test_run_conf_reads_an_empty_variable_as_unset(tmp_path: Path) -> None:
    """The library skips a config variable set empty (MindTorch's reading):
    --conf goes into the variable it will read, and an empty --conf is no
    config at all, not an empty variable the library would look past."""
    env = cli_env(tmp_path)
    env.update(MINDTORCH_NPU_ALLOC_CONF="", PYTORCH_NPU_ALLOC_CONF="max_split_size_mb:64")
    code = ("import acl, npualloc; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0); "
            "print(npualloc.memory_stats(0)['max_split_size'])")
    for conf, max_split in ((None, 64 << 20), ("max_split_size_mb:128", 128 << 20), ("", -1)):
        done = _run([*(["--conf", conf] if conf is not None else []), "--", sys.executable, "-c", code], env)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert done.stdout == f"{max_split}\n", conf


def test_run_conf_reads_a_blank_variable_as_holding_nothing(tmp_path: Path) -> None:
    """A variable of blanks and commas has no entry: the library reads it
    (and looks no further, as MindTorch does) and finds nothing. --conf
    went after it ('  ,<conf>'), the warnings naming the variable as a
    place a bad entry may come from, and after a value ending in ','
    with an empty entry between (',,'). Now --conf goes there alone, and
    after the user's last entry with one comma."""
    env = cli_env(tmp_path) | {"PYTORCH_NPU_ALLOC_CONF": "max_split_size_mb:64"}  # hidden by the one before
    code = ("import acl, npualloc, os; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0); "
            "print(os.environ['MINDTORCH_NPU_ALLOC_CONF']); print(npualloc.memory_stats(0)['max_split_size'])")
    for users, conf, read, max_split, warned in (
            (" \t", "max_split_size_mb:banana", "max_split_size_mb:banana", -1, "npualloc run --conf"),
            (" ,", "garbage_collection_threshold:0.5", "garbage_collection_threshold:0.5", -1, None),
            ("max_split_size_mb:128, ,", "max_split_size_mb:banana", "max_split_size_mb:128,max_split_size_mb:banana",
             128 << 20, "MINDTORCH_NPU_ALLOC_CONF and npualloc run --conf")):
        done = _run(["--conf", conf, "--", sys.executable, "-c", code], env | {"MINDTORCH_NPU_ALLOC_CONF": users})
        assert done.returncode == 0, done.stderr
        assert done.stdout == f"{read}\n{max_split}\n", users
        warning = f"npualloc: {warned}: max_split_size_mb"
        assert [line[:len(warning)] for line in done.stderr.splitlines()] == ([] if warned is None else [warning]), \
            done.stderr
    done = _run(["--", sys.executable, "-c", code], env | {"MINDTORCH_NPU_ALLOC_CONF": " "})
    assert done.stdout == " \n-1\n" and done.stderr == "", done.stderr  # the library stops at the blank one


def test_run_replaces_another_npualloc_in_ld_preload(tmp_path: Path) -> None:
    """A libnpualloc.so already in LD_PRELOAD under another path (the
    checkout's build/lib, another install) is not kept beside the package's:
    both loaded, ours took the other's aclrtMalloc for the runtime's, so every
    segment was cached twice and empty_cache gave nothing back to the device."""
    other = tmp_path / "other" / "libnpualloc.so"
    other.parent.mkdir()
    shutil.copy(npualloc.library_path(), other)
    env = cli_env(tmp_path)
    env["LD_PRELOAD"] = f"{other} libm.so.6"
    maps = "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if l.rstrip().endswith('/libnpualloc.so')}))"
    done = _run(["--", sys.executable, "-c", f"import os; print(os.environ['LD_PRELOAD']); {maps}"], env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{npualloc.library_path()}:libm.so.6", str([npualloc.library_path()])]


def test_run_conf_warnings_name_the_option(tmp_path: Path) -> None:
    done = _run(["--conf", "max_split_size_mb:banana", "--", sys.executable, "-c",
                 "import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)"], cli_env(tmp_path))
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npualloc: npualloc run --conf: max_split_size_mb"), done.stderr


def test_run_passes_the_exit_code_through(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    assert _run(["--", sys.executable, "-c", "raise SystemExit(7)"], env).returncode == 7
    assert _run([sys.executable, "-c", "pass"], env).returncode == 0  # "--" is optional
    # exec: the command replaces the CLI, so a shell sees its signal as 128+N.
    shell = subprocess.run(["sh", "-c", f'"{sys.executable}" -m npualloc run -- sh -c \'kill -9 $$\'; echo $?'],
                           env=env, capture_output=True, text=True, timeout=60)
    assert shell.stdout.strip() == str(128 + signal.SIGKILL)


def test_run_gives_the_command_the_signal_dispositions_it_was_started_with(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ for itself, and an ignored signal
    stays ignored across exec: `npualloc run -- yes | head -1` had yes write
    on into EPIPE ("Broken pipe" on stderr, exit 1) instead of ending on
    SIGPIPE as it does started by the shell."""
    env = cli_env(tmp_path)
    direct = subprocess.run(["grep", "^SigIgn:", "/proc/self/status"], env=env, capture_output=True, text=True)
    assert _run(["--", "grep", "^SigIgn:", "/proc/self/status"], env).stdout == direct.stdout
    proc = subprocess.Popen([sys.executable, "-m", "npualloc", "run", "--", "yes"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"y\n"
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=60)
    assert (proc.returncode, stderr) == (-signal.SIGPIPE, b"")


def test_run_gives_the_command_the_environment_it_was_given(tmp_path: Path) -> None:
    """Python coerces a C or POSIX locale to C.UTF-8 at start-up (PEP 538) by
    setting LC_CTYPE in its own environment: the command inherited an
    LC_CTYPE=C.UTF-8 nobody gave it, or had the LC_CTYPE=C it was given
    changed. It gets what it was given, plus LD_PRELOAD (env(1) prints it
    unchanged, being no Python)."""
    given = {k: v for k, v in cli_env(tmp_path).items() if k != "LANG" and not k.startswith("LC_")}
    for locale in ({}, {"LC_CTYPE": "C"}):
        env = given | locale
        done = _run(["--", "env", "-0"], env)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        got = dict(entry.split("=", 1) for entry in done.stdout.split("\0") if entry)
        assert got == env | {"LD_PRELOAD": npualloc.library_path()}, locale


def _set_user_id_of_nobody(path: Path) -> None:
    """path becomes nobody's, set-user-ID: a program whose exec changes the ids of root, who runs the tests."""
    os.chown(path, pwd.getpwnam("nobody").pw_uid, -1)
    path.chmod(0o4755)


def test_run_warns_that_a_set_user_id_program_runs_without_npualloc(tmp_path: Path) -> None:
    """The dynamic linker ignores LD_PRELOAD in a program whose exec changes
    the process's ids and drops it from its environment (sudo, su): run
    started it without npualloc and said nothing. Here a copy of env(1),
    set-user-ID to nobody; a plain copy runs under npualloc without a word."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a set-user-ID program of another user")
    tool = tmp_path / "bin" / "env"
    tool.parent.mkdir()
    tool.parent.chmod(0o755)
    shutil.copy("/usr/bin/env", tool)
    env = cli_env(tmp_path)
    plain = _run(["--", str(tool)], env)
    assert plain.returncode == 0 and plain.stderr == "" and "LD_PRELOAD=" in plain.stdout
    _set_user_id_of_nobody(tool)
    setuid = _run(["--", str(tool)], env)
    if "LD_PRELOAD=" in setuid.stdout:
        pytest.skip(f"set-user-ID bits are not honoured under {tmp_path} (a nosuid mount)")
    assert setuid.returncode == 0
    assert setuid.stderr == (f"npualloc: {tool} is set-user-ID or set-group-ID, and the dynamic linker "
                             "ignores LD_PRELOAD in it: it runs without npualloc\n")


def test_run_does_not_warn_for_a_set_user_id_script(tmp_path: Path) -> None:
    """Linux ignores the set-ID bits of a script ("#!" or none): it runs with
    the caller's ids, under npualloc, and run said it ran without."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a set-user-ID script of another user")
    env = cli_env(tmp_path)
    for name, text in (("with-interpreter", "#!/bin/sh\nenv\n"), ("without", "env\n")):
        script = tmp_path / name
        script.write_text(text)
        _set_user_id_of_nobody(script)
        done = _run(["--", str(script)], env)
        assert (done.returncode, done.stderr) == (0, ""), name
        assert f"LD_PRELOAD={npualloc.library_path()}" in done.stdout.splitlines(), name


def _no_new_privs() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")


@pytest.mark.parametrize("ignored_by", ["no_new_privs", "a nosuid mount"])
def test_run_does_not_warn_where_the_kernel_ignores_set_id_bits(tmp_path: Path, ignored_by: str) -> None:
    """On a nosuid mount and in a process with no_new_privs (a container's,
    systemd's NoNewPrivileges) a set-user-ID program runs with the caller's
    ids, under npualloc, and run said it ran without."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make a set-user-ID program of another user")
    directory = tmp_path / "bin"
    directory.mkdir()
    directory.chmod(0o755)
    mounted = ignored_by == "a nosuid mount"
    if mounted and subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,size=4m", "tmpfs", str(directory)],
                                  capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        tool = directory / "env"
        shutil.copy("/usr/bin/env", tool)
        _set_user_id_of_nobody(tool)
        done = subprocess.run([sys.executable, "-m", "npualloc", "run", "--", str(tool)], env=cli_env(tmp_path),
                              capture_output=True, text=True, timeout=60,
                              preexec_fn=None if mounted else _no_new_privs)
        assert (done.returncode, done.stderr) == (0, "")
        assert f"LD_PRELOAD={npualloc.library_path()}" in done.stdout.splitlines()
    finally:
        if mounted:
            subprocess.run(["umount", str(directory)], check=True)


def test_run_runs_a_script_without_an_interpreter_line_with_sh(tmp_path: Path) -> None:
    """The kernel refuses a script without "#!" (ENOEXEC); the shell, env(1)
    and execvp(3) run it with /bin/sh, as run does now: it said "cannot run
    ...: Exec format error", exit 126, to a script `./script` runs."""
    script = tmp_path / "bin" / "train-npu"
    script.parent.mkdir()
    script.write_text('echo "$1|$#|$LD_PRELOAD"\nexit 3\n')
    script.chmod(0o755)
    env = cli_env(tmp_path)
    env["PATH"] = f"{script.parent}{os.pathsep}{env['PATH']}"
    done = _run(["--", "train-npu", "a b", "c"], env)
    assert (done.returncode, done.stdout, done.stderr) == (3, f"a b|2|{npualloc.library_path()}\n", "")


def test_run_runs_the_first_script_without_an_interpreter_line_on_path(tmp_path: Path) -> None:
    """The shell, env(1) and execvp(3) run the first file of the name on PATH,
    with sh if the kernel refuses it: Python's execvpe passed over it to a
    later directory's program of the same name, and run ran that one."""
    first, later = tmp_path / "first", tmp_path / "later"
    for directory, text in ((first, "echo first\n"), (later, "#!/bin/sh\necho later\n")):
        directory.mkdir()
        (directory / "train-npu").write_text(text)
        (directory / "train-npu").chmod(0o755)
    env = cli_env(tmp_path)
    env["PATH"] = f"{first}{os.pathsep}{later}{os.pathsep}{env['PATH']}"
    direct = subprocess.run(["env", "train-npu"], env=env, capture_output=True, text=True)
    assert direct.stdout == "first\n"
    done = _run(["--", "train-npu"], env)
    assert (done.returncode, done.stdout, done.stderr) == (0, "first\n", "")


def test_run_process_is_visible_to_stats(tmp_path: Path) -> None:
    env = cli_env(tmp_path)
    script = ("import acl, sys; acl.init(); acl.rt.set_device(0); acl.rt.malloc(1 << 20, 0); "
              "print('ready', flush=True); sys.stdin.readline()")
    proc = subprocess.Popen([sys.executable, "-m", "npualloc", "run", "--", sys.executable, "-c", script], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        assert npualloc.memory_allocated(pid=proc.pid) >= MiB  # same pid: run execs
        assert json.loads(run_cli(["ls", "--json"], tmp_path).stdout)[0]["pid"] == proc.pid
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0


def test_list_gpu_processes_warns_of_a_process_whose_region_cannot_be_read(tmp_path: Path, sleeper: int) -> None:
    """A process stuck mid-update (or of another npualloc version) may hold
    memory of the device: left out of torch's printout, but named in a
    warning, as ls names it on stderr, rather than a bare "no processes are
    running"."""
    write_region(tmp_path, sleeper, stuck_region_bytes(sleeper))
    with Workload(tmp_path) as healthy:
        healthy.call("malloc(4096)")
        with pytest.warns(RuntimeWarning, match=f"skips process {sleeper}: .*mid-update"):
            lines = npualloc.list_gpu_processes(0).splitlines()
        assert [int(line.split()[1]) for line in lines[1:]] == [healthy.pid]
