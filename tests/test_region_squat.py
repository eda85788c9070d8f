"""Another user attacks the region directory (issue 11 item 4): whatever they
plant in the shared base directory (/dev/shm) before a process starts, the
process keeps live stats that `ls` and `stats` read, warns once naming the
owner, and never writes through or into what was planted. Root reads every
user's regions, commands only its own.

The attacker is uid 65534, a forked child of the test that drops root; the
base is a sticky world-writable directory of the test's own, as /dev/shm is."""
from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import threading
import traceback
from pathlib import Path
from typing import Callable

import pytest
from conftest import SIM_LIB, preload_env
from region_helpers import MAIN_HOLDING_1_MIB, Workload, assert_one_line_error, region_bytes, run_cli

import npualloc
from npualloc.region import Region

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user (uid 65534)")

ATTACKER = 65534


def as_user(uid: int, action: Callable[[], None]) -> None:
    """Runs action in a forked child as uid; its failure fails the test."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            action()
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
            status = 1
        finally:
            os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        report = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child as uid {uid} failed:\n{report}"


def plant(base: Path, kind: str) -> None:
    """What the attacker leaves at root's region directory name, npualloc-0,
    plus decoys at names of the kind a process makes beside a taken name."""
    theirs = base / "theirs"
    taken = base / "npualloc-0"

    def attack() -> None:
        theirs.mkdir(mode=0o777)
        theirs.chmod(0o777)
        if kind == "directory":
            taken.mkdir(mode=0o777)
            taken.chmod(0o777)
        elif kind == "private directory":
            taken.mkdir(mode=0o700)
        elif kind == "symlink":
            taken.symlink_to(theirs)
        elif kind == "file":
            taken.write_bytes(b"")
        elif kind == "fifo":
            os.mkfifo(taken, 0o666)
        (base / "npualloc-0.Decoy1").mkdir(mode=0o700)      # theirs, private: not reused
        (base / "npualloc-0.Decoy2").symlink_to(theirs)     # a link: never followed
    as_user(ATTACKER, attack)


def snapshot_of_attackers_files(base: Path) -> dict[str, tuple[int, int]]:
    """Every name the attacker planted: (file type and mode, owner)."""
    found = {}
    for path in [base / "theirs", base / "npualloc-0", base / "npualloc-0.Decoy1", base / "npualloc-0.Decoy2"]:
        info = path.lstat()
        found[path.name] = (info.st_mode, info.st_uid)
    for path in [base / "theirs", base / "npualloc-0.Decoy1"]:
        found[path.name + "/"] = (len(os.listdir(path)), 0)
    return found


@pytest.mark.parametrize("kind", ["directory", "private directory", "symlink", "file", "fifo"])
def test_a_taken_region_directory_name_keeps_stats_live(base: Path, kind: str) -> None:
    plant(base, kind)
    before = snapshot_of_attackers_files(base)
    owner = pwd.getpwuid(ATTACKER).pw_name
    with Workload(base) as first, Workload(base) as second:
        first.call("malloc(3 << 20)")
        second.call("malloc(1 << 20)")
        first.call("fork_child_allocates(1 << 20)")  # the child's region goes through the same steps
        # Live and readable, through the API and the CLI.
        assert 3 << 20 <= npualloc.memory_allocated(pid=first.pid) < 4 << 20
        assert 1 << 20 <= npualloc.memory_allocated(pid=second.pid) < 2 << 20
        stats = run_cli(["stats", str(first.pid), "--json"], base)
        assert stats.returncode == 0, stats.stderr
        listed = run_cli(["ls", "--json"], base)
        assert listed.returncode == 0, listed.stderr
        assert {row["pid"] for row in json.loads(listed.stdout)} == {first.pid, second.pid}
        # Both regions are in one directory of root's own, beside the taken name.
        homes = {Region(p).path.parent for p in (first.pid, second.pid)}
        assert len(homes) == 1
        home = homes.pop()
        assert home.parent == base and home.name.startswith("npualloc-0.") and home.name not in before
        info = home.lstat()
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == 0
        assert sorted(os.listdir(home)) == sorted(f"npualloc.{p}" for p in (first.pid, second.pid))
    for w in (first, second):
        lines = w.stderr_text.splitlines()
        assert len(lines) == 1 and lines[0].startswith("npualloc: "), w.stderr_text  # once, the forked child too
        assert f"{base}/npualloc-0 " in lines[0] and f"uid {ATTACKER} ({owner})" in lines[0]
    # What the attacker planted is as it was: nothing replaced, followed or written into.
    assert snapshot_of_attackers_files(base) == before


def test_a_taken_name_with_the_base_full_of_decoys_still_gets_its_own_directory(base: Path) -> None:
    """Names the attacker could guess are passed over; the process draws its own."""
    plant(base, "directory")
    as_user(ATTACKER, lambda: [(base / f"npualloc-0.{i:06d}").mkdir(mode=0o700) for i in range(200)])
    with Workload(base) as w:
        w.call("malloc(4096)")
        home = Region(w.pid).path.parent
        assert home.lstat().st_uid == 0 and home.name[len("npualloc-0."):].isalnum()
        assert npualloc.memory_allocated(pid=w.pid) >= 4096


def test_root_reads_every_users_regions_and_commands_only_its_own(base: Path) -> None:
    theirs = subprocess.Popen(["sleep", "60"], user=ATTACKER, group=ATTACKER)
    try:
        data = region_bytes(theirs.pid, uid=ATTACKER)

        def publish() -> None:
            (base / f"npualloc-{ATTACKER}").mkdir(mode=0o700)
            path = base / f"npualloc-{ATTACKER}" / f"npualloc.{theirs.pid}"
            path.write_bytes(data)
            path.chmod(0o600)
        as_user(ATTACKER, publish)
        # A directory under their name that is not theirs is not theirs to speak for.
        forged = base / f"npualloc-{ATTACKER}.Forged"
        forged.mkdir(mode=0o700)
        (forged / "npualloc.1").write_bytes(region_bytes(1, uid=ATTACKER))
        listed = run_cli(["ls", "--json"], base)
        assert listed.returncode == 0, listed.stderr
        assert [row["pid"] for row in json.loads(listed.stdout)] == [theirs.pid]
        assert run_cli(["stats", str(theirs.pid)], base).returncode == 0
        assert_one_line_error(run_cli(["empty-cache", str(theirs.pid)], base), 5, "another user")
    finally:
        theirs.kill()
        theirs.wait()


VICTIM = r"""
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
""" + MAIN_HOLDING_1_MIB + r"""
    printf("ready\n");
    fflush(stdout);
    getchar(); /* held until the test is done */
    return 0;
}
"""


def start_victim(base: Path, umask: int = -1) -> subprocess.Popen[str]:
    """VICTIM as uid 65534 under npualloc, once it holds its 1 MiB."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    victim = base / "victim"
    subprocess.run([cc, "-O1", "-o", str(victim), "-x", "c", "-", "-ldl"], input=VICTIM, text=True, check=True)
    victim.chmod(0o755)
    env = preload_env(NPUALLOC_SHM_DIR=str(base))
    env.pop("NPUSIM_SHARED_DIR", None)  # the test's device accounting is root's alone
    proc = subprocess.Popen([str(victim), str(SIM_LIB / "libascendcl.so")], env=env, user=ATTACKER, group=ATTACKER,
                            extra_groups=[], umask=umask, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout and proc.stdout.readline() == "ready\n", proc.communicate(timeout=30)
    return proc


def test_a_user_squatted_by_another_user_keeps_stats_that_root_reads(base: Path) -> None:
    """Neither side root: uid 1 (daemon) takes the name of uid 65534's region
    directory; 65534's process keeps its stats and root sees them."""
    squatter = 1
    as_user(squatter, lambda: (base / f"npualloc-{ATTACKER}").mkdir(mode=0o755))
    proc = start_victim(base)
    try:
        assert npualloc.memory_allocated(pid=proc.pid) >= 1 << 20
        home = Region(proc.pid).path.parent
        info = home.lstat()
        assert home.name.startswith(f"npualloc-{ATTACKER}.") and info.st_uid == ATTACKER
        assert stat.S_IMODE(info.st_mode) == 0o700
        listed = run_cli(["ls", "--json"], base)
        assert [row["pid"] for row in json.loads(listed.stdout)] == [proc.pid], listed.stderr
        assert_one_line_error(run_cli(["empty-cache", str(proc.pid)], base), 5, "another user")
        assert os.listdir(base / f"npualloc-{ATTACKER}") == []
    finally:
        _, stderr = proc.communicate(input="\n", timeout=30)
    assert proc.returncode == 0, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("npualloc: "), stderr
    assert f"npualloc-{ATTACKER} " in lines[0] and f"uid {squatter} ({pwd.getpwuid(squatter).pw_name})" in lines[0]


@pytest.mark.parametrize("how", ["umask 0477", "left cut"])
def test_a_umask_that_cuts_the_owners_own_bits_still_gets_its_region_directory(base: Path, how: str) -> None:
    """mkdir's 0700 under umask 0477 is 0300, which even its owner cannot open
    to read: the process warned that its own directory was "open to group or
    others", found no fallback either, and kept no live stats; every later
    process of that user met the same directory ("left cut")."""
    home = base / f"npualloc-{ATTACKER}"
    def cut() -> None:
        home.mkdir()
        home.chmod(0o300)

    if how == "left cut":
        as_user(ATTACKER, cut)
    proc = start_victim(base, umask=0o477 if how == "umask 0477" else -1)
    try:
        assert npualloc.memory_allocated(pid=proc.pid) >= 1 << 20
        region = Region(proc.pid).path
        assert region.parent == home and stat.S_IMODE(home.lstat().st_mode) == 0o700
        assert stat.S_IMODE(region.lstat().st_mode) == 0o600 and region.lstat().st_uid == ATTACKER
        # Opened again at its name (a nameless file shows as "#<inode> (deleted)" in /proc and lsof).
        assert str(region) in [os.readlink(f"/proc/{proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{proc.pid}/fd")]
    finally:
        _, stderr = proc.communicate(input="\n", timeout=30)
    assert proc.returncode == 0 and stderr == "", stderr


def test_the_snapshot_hand_over_is_read_in_the_checked_directory_not_at_its_path(
        base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A base without the sticky bit (a shared scratch directory named by
    NPUALLOC_SHM_DIR): another user may rename root's region directory while
    the process writes the snapshot, and put their own at the name. The CLI
    read the hand-over file at its path, so it found theirs (or nothing) and
    failed, leaving the real file behind (an audit on 2026-11-26); it reads
    and removes it through the directory it checked."""
    base.chmod(0o777)
    moved = base / "moved-by-them"
    with Workload(base) as w:
        w.call("malloc(4096)")
        post = Region.post_command

        def post_then_attack(self: Region, *args, **kwargs) -> int:
            seq = post(self, *args, **kwargs)
            def attack() -> None:
                (base / "npualloc-0").rename(moved)
                (base / "npualloc-0").mkdir(mode=0o700)
            as_user(ATTACKER, attack)
            return seq

        monkeypatch.setattr(Region, "post_command", post_then_attack)
        applier = threading.Timer(0.3, lambda: w.call("malloc(512)"))
        applier.start()
        try:
            taken = npualloc._snapshot(pid=w.pid)
        finally:
            applier.join()
        assert taken["segments"]
        assert sorted(p.name for p in moved.iterdir()) == [f"npualloc.{w.pid}"]  # the hand-over file removed
        assert list((base / "npualloc-0").iterdir()) == []
