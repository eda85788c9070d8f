"""Every error of the CLI: one line on stderr starting "npualloc: ", its own
exit code, no traceback."""
from __future__ import annotations

import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from region_helpers import (Workload, assert_one_line_error, cli_env, region_bytes, region_file, run_cli,
                            write_region)

from npualloc import cli, errors
from npualloc import region as region_module
from npualloc.errors import (CommandInterruptedError, CommandRejectedError, CorruptRegionError, NpuallocError,
                             OtherUserError)
from npualloc.region import Region, RegionHeader, reader_library
from npualloc._ffi import REGION_SIZE, constants, ffi



def test_usage_errors(tmp_path: Path) -> None:
    assert_one_line_error(run_cli([], tmp_path), 2, "required")
    assert_one_line_error(run_cli(["stats"], tmp_path), 2, "pid")
    # -5 once read as a process that does not exist (exit 3); int() reads "٣٤" (Arabic-Indic) as 34, "1_000" as 1000
    for pid in ("notapid", "0", "-5", "٣٤", "1_000", "+7", " 7", "1" * 5000):  # 5000 digits: int()'s own limit
        assert_one_line_error(run_cli(["stats", pid], tmp_path), 2, "pid: needs a positive process id")
    assert_one_line_error(run_cli(["frobnicate"], tmp_path), 2, "invalid choice")
    assert_one_line_error(run_cli(["stats", "1", "--watch", "0"], tmp_path), 2, "--watch")
    # NaN and infinity parse as floats, and a wait against either never ends (run_cli's timeout fails a hang).
    for value in ("nan", "inf", "-1", "soon"):
        assert_one_line_error(run_cli(["stats", "1", "--watch", value], tmp_path), 2, "--watch: needs a positive")
        assert_one_line_error(run_cli(["empty-cache", "1", "--timeout", value], tmp_path), 2,
                              "--timeout: needs a positive")
    for port in ("99999", "-1", "http", "٩٠٠٠"):  # 99999 ended in an OverflowError traceback
        assert_one_line_error(run_cli(["exporter", "--port", port], tmp_path), 2, "--port: needs a TCP port")
    assert_one_line_error(run_cli(["run"], tmp_path), 2, "no command")
    for index in ("-1", "٣", "x"):  # "٣" was device 3
        assert_one_line_error(run_cli(["stats", "1", "--device", index], tmp_path), 2,
                              "--device: needs a whole number, 0 or more")
        assert_one_line_error(run_cli(["record-history", "1", index], tmp_path), 2,
                              "entries: needs a whole number, 0 or more")
    # checked before the command is posted: the process could only say it rejected the argument
    assert_one_line_error(run_cli(["record-history", "1", "16777217"], tmp_path), 2, "at most 16777216 per device")


def test_help_names_every_exit_code(tmp_path: Path) -> None:
    """--help lists what each exit code means; 10 and 130 came later than the
    list and were missing from it."""
    proc = run_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    codes = {cls.exit_code for cls in vars(errors).values() if isinstance(cls, type) and hasattr(cls, "exit_code")}
    codes |= {cli.EXIT_USAGE}
    assert sorted(code for code in codes if f" {code} " not in text) == [], text


def test_no_such_process(tmp_path: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    for action in ("stats", "empty-cache", "reset-peak"):
        assert_one_line_error(run_cli([action, str(dead.pid)], tmp_path), 3, f"no such process: {dead.pid}")


def test_process_not_under_npualloc(tmp_path: Path, sleeper: int) -> None:
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 4, "not running under npualloc")
    write_region(tmp_path, sleeper, region_bytes(sleeper, start_time=1))  # left by an earlier holder of the pid
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 4, "stale")


def test_process_without_a_region_yet_or_with_stats_off(tmp_path: Path) -> None:
    with Workload(tmp_path) as w:
        assert_one_line_error(run_cli(["stats", str(w.pid)], tmp_path), 4, "nothing allocated yet")
    with Workload(tmp_path, NPUALLOC_STATS="0") as w:
        w.call("malloc(4096)")
        assert_one_line_error(run_cli(["stats", str(w.pid)], tmp_path), 4, "NPUALLOC_STATS=0")


def test_another_users_region(tmp_path: Path, sleeper: int) -> None:
    write_region(tmp_path, sleeper, region_bytes(sleeper, uid=os.geteuid() + 1))
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 5, "another user")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files and processes of another user")
def test_another_users_process_and_file(tmp_path: Path, sleeper: int) -> None:
    os.chown(write_region(tmp_path, sleeper, region_bytes(sleeper)), 65534, 65534)
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 5, "another user")
    theirs = subprocess.Popen(["sleep", "60"], user=65534, group=65534)
    try:
        assert_one_line_error(run_cli(["empty-cache", str(theirs.pid)], tmp_path), 5, "belongs to another user")
    finally:
        theirs.kill()
        theirs.wait()


def test_incompatible_version(tmp_path: Path, sleeper: int) -> None:
    write_region(tmp_path, sleeper, region_bytes(sleeper, version=constants.NPUALLOC_SHM_VERSION + 1))
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 6, "version")


def test_an_older_smaller_layout_is_an_incompatible_version_not_truncated(tmp_path: Path, sleeper: int) -> None:
    """Magic, then version, then size: a region of an earlier npualloc whose layout was smaller."""
    older = region_bytes(sleeper, version=constants.NPUALLOC_SHM_VERSION - 1)[:REGION_SIZE - 1024]
    write_region(tmp_path, sleeper, older)
    for args in (["stats", str(sleeper)], ["ls"]):
        proc = run_cli(args, tmp_path)
        assert f"layout version {constants.NPUALLOC_SHM_VERSION - 1}; this npualloc reads version" in proc.stderr
        assert "truncated" not in proc.stderr
    assert_one_line_error(run_cli(["stats", str(sleeper)], tmp_path), 6, "use the npualloc the process was started with")


@pytest.mark.parametrize("damage", ["truncated", "empty", "magic", "size field", "garbage", "zeros"])
def test_corrupt_or_truncated_region(tmp_path: Path, sleeper: int, damage: str) -> None:
    data = {
        "truncated": region_bytes(sleeper)[:REGION_SIZE // 2],
        "empty": b"",
        "magic": region_bytes(sleeper, magic=0x0123456789ABCDEF),
        "size field": region_bytes(sleeper, size=REGION_SIZE * 4),
        "garbage": os.urandom(REGION_SIZE),
        "zeros": bytes(REGION_SIZE),
    }[damage]
    write_region(tmp_path, sleeper, data)
    for args in (["stats", str(sleeper)], ["stats", str(sleeper), "--json"], ["reset-peak", str(sleeper)]):
        assert_one_line_error(run_cli(args, tmp_path), 7, f"npualloc.{sleeper}")


def test_command_not_acknowledged(tmp_path: Path, sleeper: int) -> None:
    """A region nobody serves (the sleeper never reaches an allocator)."""
    write_region(tmp_path, sleeper, region_bytes(sleeper))
    proc = run_cli(["empty-cache", str(sleeper), "--timeout", "0.3"], tmp_path)
    assert_one_line_error(proc, 8, "next allocator call: is the process idle?); withdrawn")
    # Withdrawn and answered by the requester: the next command is posted, not refused as busy.
    proc = run_cli(["reset-peak", str(sleeper), "--timeout", "0.3"], tmp_path)
    assert_one_line_error(proc, 8, "withdrawn, nothing was applied")


def test_ctrl_c_while_a_command_waits_withdraws_it(tmp_path: Path, sleeper: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C ended every command with exit 0 and nothing said (meant for
    stats --watch): a script took a pause for done, and the process paused
    later by itself. Then 130 and a line saying the command stayed posted.
    Now 130, the command withdrawn: nobody would apply it later."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    write_region(tmp_path, sleeper, region_bytes(sleeper))
    with Region(sleeper) as region:
        posted = region.command_seq()
        # A shell that runs the suite in the background (`.ci/run &`) passes SIGINT down ignored, and
        # Python keeps it so: the CLI then waited out its timeout and the sleeper's 60 s.
        proc = subprocess.Popen([sys.executable, "-m", "npualloc", "empty-cache", str(sleeper), "--timeout", "60"],
                                env=cli_env(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        while region.command_seq() == posted and proc.poll() is None:
            os.sched_yield()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), 130,
                          "withdrawn, nothing was applied")
    with Region(sleeper) as region:
        assert region.command_seq() == posted + 1
        status = ffi.new("int32_t *")
        assert reader_library().npualloc_reader_acked(region._region, posted + 1, status) == 1
        assert status[0] == constants.NPUALLOC_CMD_WITHDRAWN
    # In the Python API it is the user's Ctrl-C, not one of npualloc's errors to handle.
    assert issubclass(CommandInterruptedError, KeyboardInterrupt)
    assert not issubclass(CommandInterruptedError, NpuallocError)


def test_a_process_that_ends_before_acknowledging_is_said_to_have_ended(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The requester sees the process end (here it stays a zombie until we
    wait for it) and says so at once, not after its timeout as if the
    process were idle."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    target = subprocess.Popen(["sh", "-c", "read line"], stdin=subprocess.PIPE)
    try:
        path = write_region(tmp_path, target.pid, region_bytes(target.pid))
        cli = subprocess.Popen([sys.executable, "-m", "npualloc", "empty-cache", str(target.pid), "--timeout", "600"],
                               env=cli_env(tmp_path), cwd=ROOT, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
        with Region(target.pid) as region:
            while region.command_seq() == 0 and cli.poll() is None:   # posted: the CLI now waits for the answer
                os.sched_yield()
        assert path.exists()
        target.stdin.close()                                          # the process ends without answering
        out, err = cli.communicate(timeout=120)
        assert_one_line_error(subprocess.CompletedProcess(cli.args, cli.returncode, out, err), 3,
                              f"process {target.pid} ended before acknowledging the command")
    finally:
        target.kill()
        target.wait()


def test_bad_device_and_gc_value(tmp_path: Path, sleeper: int) -> None:
    write_region(tmp_path, sleeper, region_bytes(sleeper))
    assert_one_line_error(run_cli(["stats", str(sleeper), "--device", "99"], tmp_path), 2, "out of range")
    assert_one_line_error(run_cli(["set-gc-threshold", str(sleeper), "1.5"], tmp_path), 2, "[0, 1)")
    for fraction in ("1.5", "-0.5", "nan"):
        assert_one_line_error(run_cli(["set-memory-fraction", str(sleeper), fraction], tmp_path), 2, "Allowed range: 0~1")
    assert_one_line_error(run_cli(["set-memory-fraction", str(sleeper), "0.5", "--device", "99"], tmp_path), 2,
                          "out of range")


def test_memory_fraction_on_a_device_of_unknown_size_goes_to_the_process(tmp_path: Path, sleeper: int) -> None:
    """A device in use whose size its process could not tell (the runtime
    failed aclrtGetMemInfo there: device_total_bytes 0) has no cap to check
    here: the command goes to the process, which asks its runtime again.
    It was refused as a cap of 0 bytes, below the smallest segment."""
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper, device_count=1), REGION_SIZE)
    region.devices[0].in_use = 1
    write_region(tmp_path, sleeper, bytes(ffi.buffer(region)))
    proc = run_cli(["set-memory-fraction", str(sleeper), "0.5", "--device", "0", "--timeout", "0.3"], tmp_path)
    assert_one_line_error(proc, 8, "next allocator call: is the process idle?); withdrawn")


def test_run_command_not_found(tmp_path: Path) -> None:
    assert_one_line_error(run_cli(["run", "--", "no-such-command-npualloc"], tmp_path), 127, "command not found")
    # An empty name is no command to a shell either (exit 127), where Python's execve refused it: exit 2,
    # "execve: argv first element cannot be empty".
    assert_one_line_error(run_cli(["run", "--", "", "x"], tmp_path), 127, "npualloc: '': command not found")
    # The kernel's ENOENT for a script whose "#!" interpreter is missing was "command not found" too.
    script = tmp_path / "train.sh"
    script.write_text("#!/no/such/interpreter-npualloc\n")
    script.chmod(0o755)
    assert_one_line_error(run_cli(["run", "--", str(script)], tmp_path), 127,
                          f"cannot run {script}: the interpreter it names (#! line or ELF loader) is missing")


def test_an_options_value_of_two_dashes_is_that_value(tmp_path: Path) -> None:
    """"--opt=--" is the option with the value "--", as Python 3.13 reads it.
    Python 3.10 to 3.12 handed the option [] in its place: run --conf=-- ended
    in a TypeError traceback from exec, replay --hbm=-- in another, replay
    --build=-- ran with the package's tools as if it were not given, and
    exporter --port=-- said it could not listen on port []. Each is now the
    option's own answer to "--"."""
    allocate = "import acl; acl.init(); acl.rt.set_device(0); acl.rt.malloc(4096, 0)"
    ran = run_cli(["run", "--conf=--", "--", sys.executable, "-c", allocate], tmp_path)
    assert ran.returncode == 0 and ran.stdout == "", ran.stderr
    assert ran.stderr == "npualloc: npualloc run --conf: '--' is not a key:value entry; ignored\n"
    tiny = str(ROOT / "tools" / "traces" / "tiny.pickle.gz")
    assert_one_line_error(run_cli(["replay", tiny, "--hbm=--"], tmp_path), 1, "--hbm: not a size: '--'")
    assert_one_line_error(run_cli(["replay", tiny, "--build=--"], tmp_path), 1,
                          "--/tools/npualloc-replay is missing")
    assert_one_line_error(run_cli(["replay", tiny, "--device=--"], tmp_path), 2, "invalid int value: '--'")
    assert_one_line_error(run_cli(["exporter", "--port=--"], tmp_path), 2, "--port: needs a TCP port")
    assert_one_line_error(run_cli(["stats", "1", "--device=--"], tmp_path), 2, "--device: needs a whole number")
    assert_one_line_error(run_cli(["empty-cache", "1", "--timeout=--"], tmp_path), 2, "--timeout: needs a positive")


def test_run_a_program_of_a_format_the_kernel_cannot_run_is_one_line(tmp_path: Path) -> None:
    """The kernel's ENOEXEC for a program built for another machine (an
    x86-64 ELF on an aarch64 host) is no script without "#!": handed to sh,
    it came out as sh's syntax errors on its bytes, exit 2. bash tells the
    two apart by a NUL in the first line, and says "Exec format error"."""
    program = tmp_path / "train"
    program.write_bytes(b"\x7fELF\x02\x01\x01\0" + bytes(8) + b"\x02\0\xff\xff'\"`(" + bytes(64))
    program.chmod(0o755)
    assert_one_line_error(run_cli(["run", "--", str(program)], tmp_path), 126,
                          f"cannot run {program}: Exec format error")


@pytest.mark.parametrize("directory", ["my npualloc", "npualloc:2"])
def test_run_refuses_a_library_the_dynamic_linker_cannot_preload(tmp_path: Path, directory: str) -> None:
    """ld.so splits LD_PRELOAD at spaces and colons, so a package installed
    under such a path ran the command without npualloc, ld.so's two errors
    per process the only sign."""
    copy = tmp_path / directory
    shutil.copytree(ROOT / "npualloc", copy / "npualloc", ignore=shutil.ignore_patterns("__pycache__"))
    cli_of_the_copy = f"import sys; sys.path.insert(0, {str(copy)!r}); from npualloc import cli; sys.exit(cli.main())"
    proc = subprocess.run([sys.executable, "-c", cli_of_the_copy, "run", "--", "true"], env=cli_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert_one_line_error(proc, 1, f"cannot preload {copy}/npualloc/lib/libnpualloc.so: the dynamic linker splits")


def test_command_sequence_at_its_maximum(tmp_path: Path, sleeper: int) -> None:
    """A region whose request_seq is 2^64-1: the next number does not fit."""
    region = ffi.new("npualloc_region *")
    ffi.memmove(region, region_bytes(sleeper), REGION_SIZE)
    region.command.request_seq = (1 << 64) - 1
    write_region(tmp_path, sleeper, bytes(ffi.buffer(region)))
    for args in (["empty-cache", str(sleeper), "--timeout", "0.3"], ["snapshot", str(sleeper), "-o",
                                                                      str(tmp_path / "s.pickle")]):
        assert_one_line_error(run_cli(args, tmp_path), 7, "sequence number")
    assert not (tmp_path / "s.pickle").exists()


@pytest.mark.parametrize("owner", ["us", "nobody"])
def test_fifo_planted_at_the_region_name_hangs_nobody(tmp_path: Path, sleeper: int, owner: str) -> None:
    """A FIFO (mode 0666, nobody writing) at a live pid's region name: the
    readers open it non-blocking, see it is no regular file and refuse it
    (run_cli's timeout fails the test if anything blocks on it)."""
    if owner == "nobody" and os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another user")
    fifo = region_file(tmp_path, sleeper)
    fifo.parent.mkdir(mode=0o700)
    os.mkfifo(fifo, 0o666)
    os.chmod(fifo, 0o666)
    if owner == "nobody":
        os.chown(fifo, 65534, 65534)
    for args in (["stats", str(sleeper)], ["stats", str(sleeper), "--json"],
                 ["empty-cache", str(sleeper), "--timeout", "0.3"]):
        assert_one_line_error(run_cli(args, tmp_path, timeout=30), 7, "is not a regular file")
    listing = run_cli(["ls"], tmp_path, timeout=30)
    assert listing.returncode == 0
    assert listing.stdout == "no process is running under npualloc\n"
    assert listing.stderr.startswith(f"npualloc: skipping process {sleeper}: ") and "not a regular file" in listing.stderr
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # left as it was


def test_requester_holding_the_command_lock_delays_us_only_until_the_timeout(tmp_path: Path, sleeper: int) -> None:
    path = write_region(tmp_path, sleeper, region_bytes(sleeper))
    with open(path, "rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        assert_one_line_error(run_cli(["empty-cache", str(sleeper), "--timeout", "0.3"], tmp_path), 8, "command lock")


HOSTILE = "\x1b]0;pwned\x07\x1b[2J\x9b1m"  # set the window title, clear the screen, a C1 CSI


def test_stats_shows_no_terminal_controls_from_another_processes_config(tmp_path: Path) -> None:
    """The config string is the watched process's to choose, and root reads it
    in `stats`: every control character is shown as "?", never sent."""
    with Workload(tmp_path, PYTORCH_NPU_ALLOC_CONF=f"oom_snapshot:/tmp/oom{HOSTILE}.pickle") as w:
        assert w.call("acl.rt.malloc(4096, 0)[1]") == 0
        proc = run_cli(["stats", str(w.pid)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "config: oom_snapshot:/tmp/oom?]0;pwned??[2J?1m.pickle" in proc.stdout
    assert not any(c in proc.stdout for c in "\x1b\x07\x9b")


def test_a_command_line_is_shown_without_terminal_controls() -> None:
    """`ls` and `stats` show a process's command line (psutil's, else the
    region's copy: here the pid is gone, or the process another user's) with
    its controls as "?"."""
    gone = 2**22 + 1  # above pid_max's ceiling: no such process
    for uid in (os.geteuid(), os.geteuid() + 1):
        header = RegionHeader(pid=gone, uid=uid, start_time=0, created_unix_ns=0, cmdline=f"python -c {HOSTILE}",
                              config="", device_count=0, runtime_device_count=0, state="running", paused_bytes=0, backup_bytes=0)
        assert cli._command_line(header) == "python -c ?]0;pwned??[2J?1m"


def test_a_region_shrunk_under_the_reader_is_an_error_not_a_bus_error(tmp_path: Path, sleeper: int,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The region's owner truncates its file after the reader checked the size
    and mapped it: the reader's next access would end it with SIGBUS (root's
    stats, ls, an exporter). The reader library maps zero pages over the lost
    region instead, and every read then says the file was truncated."""
    path = write_region(tmp_path, sleeper, region_bytes(sleeper, device_count=1))
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    with Region(sleeper) as region:
        assert region.header().cmdline == "crafted"
        os.truncate(path, 0)
        with pytest.raises(CorruptRegionError, match="truncated while being read"):
            region.read_device_stats(0)
        with pytest.raises(CorruptRegionError, match="truncated while being read"):
            region.header()
    # The next reader finds the short file and says so before mapping it.
    proc = run_cli(["stats", str(sleeper)], tmp_path)
    assert proc.returncode != 0 and "truncated" in proc.stderr and "Bus error" not in proc.stderr


def test_a_command_to_a_region_shrunk_under_the_requester_fails_at_once(tmp_path: Path, sleeper: int,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Posted into the zero pages that replaced a truncated region, a command
    would wait its whole timeout for an answer no process can give: the
    requester says the file was truncated instead."""
    path = write_region(tmp_path, sleeper, region_bytes(sleeper, device_count=1))
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    with Region(sleeper, writable=True) as region:
        os.truncate(path, 0)
        with pytest.raises(CorruptRegionError, match="truncated while being read"):
            region.post_command(constants.NPUALLOC_CMD_EMPTY_CACHE, timeout=30)


def test_processes_proc_hides_are_another_users_not_a_traceback(tmp_path: Path, sleeper: int,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """With /proc mounted hidepid=1 a user may not read another user's
    /proc/<pid>/stat or status (PermissionError; another user can take a
    recycled pid of ours on purpose). `stats` of such a pid says whose it is;
    `ls` removes our leftover file named by it, as one of a dead pid, and
    lists on."""
    real_open = open

    def proc_hides_sleeper(path: object, *args: object, **kwargs: object) -> object:
        if str(path).startswith(f"/proc/{sleeper}/"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))
    leftover = region_file(tmp_path, sleeper).with_name(f"npualloc.{sleeper}.snapshot.3")
    leftover.parent.mkdir(mode=0o700)
    leftover.write_bytes(b"")
    monkeypatch.setattr(region_module, "open", proc_hides_sleeper, raising=False)
    assert cli.main(["stats", str(sleeper)]) == OtherUserError.exit_code
    assert capsys.readouterr().err == f"npualloc: process {sleeper} belongs to another user (/proc hides its details)\n"
    assert cli.main(["ls"]) == 0
    shown = capsys.readouterr()
    assert shown.out == "no process is running under npualloc\n" and shown.err == ""
    assert not leftover.exists()


def test_a_failed_pause_is_told_even_when_the_region_cannot_be_read_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed pause reads the region to say whether the process stays
    paused; a region that could not be read then (the process ended, a writer
    of the same uid broke it) replaced the refusal's own message with that
    read's error."""
    monkeypatch.setenv("NPUALLOC_SHM_DIR", str(tmp_path))

    def unreadable(self: Region) -> RegionHeader:
        raise CorruptRegionError("the region's magic was overwritten")

    def refuse(self: Region, *args: object, **kwargs: object) -> int:
        monkeypatch.setattr(Region, "header", unreadable)
        raise CommandRejectedError("the pause failed: no host memory for the backup", constants.NPUALLOC_CMD_EFAILED)

    with Workload(tmp_path) as w:
        w.call("malloc(512)")
        monkeypatch.setattr(Region, "post_command", refuse)
        assert cli.main(["pause", str(w.pid)]) == CommandRejectedError.exit_code
    err = capsys.readouterr().err
    assert "no host memory for the backup" in err and "magic" not in err, err
