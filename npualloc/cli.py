"""`npualloc` / `python -m npualloc`: live allocator stats of other processes.

Exit codes: 0 success, 1 other error, 2 usage, 3 no such process, 4 process
not running under npualloc, 5 another user's process, 6 region of an
incompatible version, 7 truncated or corrupt region, 8 command not
acknowledged in time, 9 command rejected by the process, 10 process stopped
(SIGSTOP, a debugger) in the middle of updating its stats (`replay --no-search`:
the trace did not fit), 130 interrupted (Ctrl-C) while a command waited; `run`
passes the command's own exit code through (127: command not found, 126: not
executable).
Every error is one line on stderr starting "npualloc: ".
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import signal
import stat
import sys
import time
from datetime import datetime
from typing import Any, NoReturn

import psutil

from . import exporter, memory, plot, replay, simulator, snapshot
from ._ffi import constants
from .conf_env import with_conf
from .errors import (CommandInterruptedError, CommandRejectedError, NoSuchProcessError, NotUnderNpuallocError,
                     NpuallocError)
from .files import write_user_file
from .region import Region, RegionHeader, read_live_regions, region_base
from .summary import human_bytes

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"npualloc: {message} (see `npualloc --help`)\n")
        sys.exit(EXIT_USAGE)

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # "--opt=--" gives the option the value "--", as Python 3.13's argparse
        # reads it. Before 3.13 argparse took that "--" for the end of options,
        # dropped it and gave the option [], which no type function sees: run
        # --conf=-- exec'd a list (TypeError), replay --hbm=-- raised one, and
        # replay --build=-- was ignored. Now the option's own check judges "--".
        if action.option_strings and action.nargs is None and arg_strings == ["--"]:
            value = self._get_value(action, "--")
            self._check_value(action, value)
            return value
        return super()._get_values(action, arg_strings)


def _displayable(text: str) -> str:
    """text with every character a terminal would act on (escape sequences,
    bell, other controls) shown as "?": a command line or config string is
    another user's to choose, and root reads it in `ls` and `stats`."""
    return "".join(c if c.isprintable() else "?" for c in text)


def _command_line(header: RegionHeader, width: int = 100) -> str:
    """One display line of the process's command line, newlines of `python -c`
    scripts collapsed. Of a process of ours, psutil's view (current and whole);
    of another user's (root's ls, stats, exporter), the region's copy (256
    bytes, more than a line shows): reading /proc/<pid>/cmdline waits for that
    process's address-space lock, which its owner can keep held (a page fault
    on a FUSE file system of theirs whose server never answers)."""
    words = header.cmdline.split()
    if header.uid == os.geteuid():  # the header's uid is the process's: Region checked it
        try:
            words = psutil.Process(header.pid).cmdline() or words
        except psutil.Error:
            pass
    text = _displayable(" ".join(" ".join(words).split()))
    return text if len(text) <= width else text[:width - 1] + "…"


def _device_table(device: int, s: dict[str, Any]) -> list[str]:
    def pair(label: str, key: str, fmt: Any = human_bytes) -> str:
        return f"  {label:<22}{fmt(s[key + '.current']):>14}{fmt(s[key + '.peak']):>14}"

    hits, misses = s["npualloc.cache_hits"], s["npualloc.cache_misses"]
    return [
        f"NPU {device:<22}{'current':>14}{'peak':>14}",
        pair("allocated", "allocated_bytes.all"),
        pair("reserved", "reserved_bytes.all"),
        pair("active", "active_bytes.all"),
        pair("requested", "requested_bytes.all"),
        pair("non-releasable", "inactive_split_bytes.all"),
        pair("allocations", "allocation.all", str),
        pair("segments", "segment.all", str),
        pair("oversize allocations", "oversize_allocations", str),
        f"  {'cache hit rate':<22}{s['npualloc.cache_hit_rate']:>13.1%}   ({hits} hits, {misses} misses)",
        f"  {'fragmentation':<22}{s['npualloc.fragmentation']:>13.1%}   "
        f"(largest free block {human_bytes(s['npualloc.largest_free_block'])})",
        f"  {'device calls':<22}{s['num_device_alloc']:>14} mallocs, {s['num_device_free']} frees",
        f"  {'OOMs / retries':<22}{s['num_ooms']:>14} / {s['num_alloc_retries']}"
        f"   (sync all streams {s['num_sync_all_streams']})",
        f"  {'pending frees':<22}{s['npualloc.pending_frees']:>14}",
        f"  {'frees refused':<22}{s['npualloc.invalid_frees']:>14} invalid, "
        f"{s['npualloc.foreign_frees']} foreign (passed on)",
        f"  {'executor destroys':<22}{s['npualloc.executor_destroys_forwarded']:>14} forwarded, "
        f"{s['npualloc.executor_destroys_skipped']} skipped",
        f"  {'device memory':<22}{human_bytes(s['npualloc.device_free_bytes']):>14} free of "
        f"{human_bytes(s['npualloc.device_total_bytes'])}" + (
            f", reserved capped at {human_bytes(s['npualloc.reserved_limit_bytes'])}"
            if s['npualloc.reserved_limit_bytes'] else ""),
    ] + ([f"  {'memory_saver':<22}{human_bytes(s['npualloc.saver_allocated_bytes']):>14} in "
          f"{s['npualloc.saver_allocations']} allocations, {human_bytes(s['npualloc.saver_paused_bytes'])} paused, "
          f"{human_bytes(s['npualloc.saver_backup_bytes'])} host backup"] if s['npualloc.saver_allocations'] else [])


def _snapshot(pid: int, device: int | None) -> dict[str, Any]:
    with Region(pid) as region:
        header = region.header()
        in_use = region.devices_in_use()
        asked = [memory.region_device(region, device)] if device is not None else in_use
        # A device the process never allocated on has no figures, not zeros (region_device refused one
        # out of range or past the devices its runtime sees).
        unused = [d for d in asked if d not in in_use]
        return {
            "pid": pid,
            "command": _command_line(header),
            "config": header.config,
            "created_unix_ns": header.created_unix_ns,
            "region": str(region.path),
            "state": header.state,
            "paused_bytes": header.paused_bytes,
            "backup_bytes": header.backup_bytes,
            "devices": {str(d): memory.region_stats(region, d) for d in asked if d not in unused},
            "unused_devices": unused,
        }


def _render(snapshot: dict[str, Any]) -> str:
    started = datetime.fromtimestamp(snapshot["created_unix_ns"] / 1e9).strftime("%Y-%m-%d %H:%M:%S")
    lines = [f"npualloc · pid {snapshot['pid']} · {snapshot['command']}",
             f"config: {_displayable(snapshot['config']) or '(defaults)'} · region since {started}", ""]
    if snapshot["state"] != "running":
        lines[-1:-1] = [f"state: {snapshot['state']} · {human_bytes(snapshot['paused_bytes'])} of device memory "
                        f"released · {human_bytes(snapshot['backup_bytes'])} host backup"]
    if not snapshot["devices"] and not snapshot["unused_devices"]:
        lines.append("no device has allocated through npualloc yet")
    for device in snapshot["unused_devices"]:
        lines += [f"NPU {device}: unused by this process (nothing allocated on it through npualloc)", ""]
    for device, stats in snapshot["devices"].items():
        lines += _device_table(int(device), stats) + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def cmd_stats(args: argparse.Namespace) -> int:
    watched: int | None = None  # created_unix_ns of the region watched
    while True:
        try:
            snapshot = _snapshot(args.pid, args.device)
        except (NoSuchProcessError, NotUnderNpuallocError):
            if watched is None:
                raise
            # Its region is removed only at exit: a process watched until now ended.
            sys.stderr.write(f"npualloc: process {args.pid} ended\n")
            return 0
        if watched is not None and snapshot["created_unix_ns"] != watched:
            # Another region under the pid: the process ended and the pid was
            # given to a new one under npualloc (or it exec'd another program).
            sys.stderr.write(f"npualloc: process {args.pid} ended (the pid now names another region)\n")
            return 0
        watched = snapshot["created_unix_ns"]
        text = json.dumps(snapshot, indent=2) + "\n" if args.json else _render(snapshot)
        if args.watch and sys.stdout.isatty():
            text = "\033[H\033[2J" + text
        sys.stdout.write(text)
        sys.stdout.flush()
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _paused_mark(state: str) -> str:
    return "" if state == "running" else f"[{state}] "


def _ls_rows(pid: int, region: Region) -> list[dict[str, Any]]:
    """ls's rows of one process: one per device in use (device None: nothing allocated yet)."""
    rows: list[dict[str, Any]] = []
    header = region.header()
    command = _command_line(header)
    devices: list[int | None] = list(region.devices_in_use()) or [None]
    for device in devices:
        stats = region.read_device_stats(device) if device is not None else None
        rows.append({
            "pid": pid,
            "device": device,
            "allocated": stats.allocated_bytes[0].current if stats is not None else 0,
            "reserved": stats.reserved_bytes[0].current if stats is not None else 0,
            "command": command,
            "state": header.state,
        })
    return rows


def _say_skipped(pid: int, error: NpuallocError) -> None:
    sys.stderr.write(f"npualloc: skipping process {pid}: {error}\n")


def cmd_ls(args: argparse.Namespace) -> int:
    rows = [row for _, rows_of_pid in read_live_regions(_ls_rows, _say_skipped) for row in rows_of_pid]
    if args.json:
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    elif not rows:
        sys.stdout.write("no process is running under npualloc\n")
    else:
        sys.stdout.write(f"{'PID':>8}  {'DEV':>3}  {'ALLOCATED':>12}  {'RESERVED':>12}  COMMAND\n")
        for row in rows:
            shown = "-" if row["device"] is None else str(row["device"])
            sys.stdout.write(f"{row['pid']:>8}  {shown:>3}  {human_bytes(row['allocated']):>12}  "
                             f"{human_bytes(row['reserved']):>12}  {_paused_mark(row['state'])}{row['command']}\n")
    return 0


def _is_binary(path: str) -> bool:
    """bash's test of a file the kernel refused (ENOEXEC): a NUL in its first
    line makes it a program for another machine, not a script for sh."""
    try:
        with open(path, "rb") as f:
            return b"\0" in f.read(80).split(b"\n", 1)[0]
    except OSError:
        return False


def _exec(command: list[str], env: dict[str, str]) -> None:
    """Python's execvpe less its one difference from execvp(3): a file the
    kernel refuses for want of a "#!" line is a shell script to the shell and
    to execvp, which run it with sh, not a reason to try PATH's next directory."""
    program = command[0]
    paths = [program] if os.sep in program else [os.path.join(d, program) for d in os.get_exec_path(env)]
    first_error: OSError | None = None
    for path in paths:
        try:
            os.execve(path, command, env)
        except OSError as e:
            if e.errno == errno.ENOEXEC and not _is_binary(path):
                os.execve("/bin/sh", ["/bin/sh", path, *command[1:]], env)
            last_error = e
            if first_error is None and not isinstance(e, (FileNotFoundError, NotADirectoryError)):
                first_error = e
    raise first_error or last_error


def _set_ids_ignored(path: str, info: os.stat_result) -> bool:
    """Linux ignores a file's set-ID bits on a script ("#!" or none), on a
    nosuid mount and in a process with no_new_privs (a container's, systemd's
    NoNewPrivileges): it runs with the caller's ids. Only a set-ID file is
    looked at; one that cannot be read (mode 4711) is taken for a program."""
    if not info.st_mode & (stat.S_ISUID | stat.S_ISGID) or not stat.S_ISREG(info.st_mode):
        return False
    try:
        if os.statvfs(path).f_flag & os.ST_NOSUID:
            return True
        with open("/proc/self/status") as status:
            if "NoNewPrivs:\t1\n" in status.read():
                return True
        with open(path, "rb") as f:
            return f.read(4) != b"\x7fELF"
    except OSError:
        return False


def _warn_if_preload_ignored(program: str, path: str | None) -> None:
    """The dynamic linker ignores LD_PRELOAD (and drops it from the
    environment) in a program whose exec changes the process's ids, one
    set-user-ID or set-group-ID to someone else (sudo, su): it would run
    without npualloc, silently. path: where PATH finds program, if anywhere."""
    if path is None:
        return  # exec says why
    try:
        info = os.stat(path)
    except OSError:
        return  # exec says why
    set_ids = info.st_mode & (stat.S_ISUID | stat.S_ISGID) if not _set_ids_ignored(path, info) else 0
    uid = info.st_uid if set_ids & stat.S_ISUID else os.geteuid()
    gid = info.st_gid if set_ids & stat.S_ISGID else os.getegid()
    if uid != os.getuid() or gid != os.getgid():
        sys.stderr.write(f"npualloc: {program} is set-user-ID or set-group-ID, and the dynamic linker "
                         "ignores LD_PRELOAD in it: it runs without npualloc\n")


# The values PEP 538's locale coercion gives LC_CTYPE.
_COERCED_LC_CTYPE = ("C.UTF-8", "C.utf8", "UTF-8")


def _environment_given() -> dict[str, str]:
    """os.environ less Python's own change to it: a C or POSIX locale is
    coerced at start-up (PEP 538) by setting LC_CTYPE in the interpreter's
    environment, for its children too, so a command run would get an
    LC_CTYPE nobody gave it (or C.UTF-8 for the C given). LC_CTYPE is taken
    back to its value in /proc/self/environ, the environment exec gave this
    process, when it now holds a coerced value it did not have there."""
    env = dict(os.environ)
    if env.get("LC_CTYPE") not in _COERCED_LC_CTYPE:
        return env
    try:
        with open("/proc/self/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except OSError:
        return env  # no /proc: what Python holds is all there is to go by
    started = next((os.fsdecode(e[len(b"LC_CTYPE="):]) for e in entries if e.startswith(b"LC_CTYPE=")), None)
    if started is None:
        del env["LC_CTYPE"]
    else:
        env["LC_CTYPE"] = started
    return env


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        _Parser(prog="npualloc").error("run: no command given (npualloc run [--sim] [--conf STR] -- CMD ...)")
    if not command[0]:
        # A shell's answer to '' (Python's execve refuses an empty argv[0] with a ValueError).
        sys.stderr.write("npualloc: '': command not found\n")
        return 127
    given = _environment_given()
    env = simulator.simulated_env(simulator.find_home(), given) if args.sim else given
    library = memory.library_path()
    if any(separator in library for separator in " :"):
        raise NpuallocError(f"cannot preload {library}: the dynamic linker splits LD_PRELOAD at spaces and colons; "
                            "install npualloc under a path without them")
    # ld.so's separators. Another libnpualloc.so (another install, a checkout's
    # build/lib) goes: both loaded are two allocators in one process.
    preloaded = env.get("LD_PRELOAD", "").replace(":", " ").split()
    name = os.path.basename(library)
    env["LD_PRELOAD"] = ":".join([library] + [p for p in preloaded if os.path.basename(p) != name])
    if args.conf is not None:
        env = with_conf(env, args.conf, "run", keep_users=True)
    # Python ignores these two for itself, and exec keeps an ignored signal
    # ignored: the command gets them at their defaults, as subprocess's children do.
    for ignored_by_python in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(ignored_by_python, signal.SIG_DFL)
    found = shutil.which(command[0], path=env.get("PATH", os.defpath))
    _warn_if_preload_ignored(command[0], found)
    try:
        _exec(command, env)  # same pid: `npualloc stats <pid>` names what the user started
    except FileNotFoundError:
        # Also the kernel's word for a file found whose interpreter is not.
        if found is not None:
            sys.stderr.write(f"npualloc: cannot run {command[0]}: the interpreter it names (#! line or ELF loader) "
                             "is missing\n")
        else:
            sys.stderr.write(f"npualloc: {command[0]}: command not found\n")
        return 127
    except OSError as e:
        sys.stderr.write(f"npualloc: cannot run {command[0]}: {e.strerror}\n")
        return 126


def cmd_empty_cache(args: argparse.Namespace) -> int:
    if args.device is None:
        memory.empty_cache(pid=args.pid, timeout=args.timeout)
    else:  # one device: post the command directly, memory.empty_cache is torch's all-devices call
        with Region(args.pid, writable=True) as region:
            region.post_command(constants.NPUALLOC_CMD_EMPTY_CACHE, memory.region_device(region, args.device),
                                timeout=args.timeout)
    sys.stdout.write(f"process {args.pid}: cache emptied\n")
    return 0


def _post_pause_command(region: Region, code: int, args: argparse.Namespace, failed: str, retry: str) -> None:
    """Posts a pause or a resume. A failure that leaves the process paused
    (what it released was taken by another process meanwhile) says so, and
    what to run; other refusals (a pause of a paused process) as they are."""
    try:
        region.post_command(code, timeout=args.timeout)
    except CommandRejectedError as e:
        try:
            paused = e.status == constants.NPUALLOC_CMD_EFAILED and region.header().state == "paused"
        except NpuallocError:  # the region unreadable now (the process ended): the refusal says what is known
            paused = False
        if not paused:
            raise
        raise CommandRejectedError(f"process {args.pid}: {failed} (another process may hold it; its stderr says "
                                   f"why); it stays paused with its backup: {retry} once memory is free", e.status) from e


def cmd_pause(args: argparse.Namespace) -> int:
    with Region(args.pid, writable=True) as region:
        _post_pause_command(region, constants.NPUALLOC_CMD_PAUSE, args,
                            "the pause failed half way and could not get back what it had released", "run resume")
        header = region.header()
    sys.stdout.write(f"process {args.pid}: paused, {human_bytes(header.paused_bytes)} of device memory released, "
                     f"{human_bytes(header.backup_bytes)} kept on the host\n")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    with Region(args.pid, writable=True) as region:
        _post_pause_command(region, constants.NPUALLOC_CMD_RESUME, args, "could not get its device memory back",
                            "run resume again")
    sys.stdout.write(f"process {args.pid}: resumed\n")
    return 0


def cmd_reset_peak(args: argparse.Namespace) -> int:
    # Without --device every device in use (-1), as its help says: memory.reset_peak_memory_stats's
    # default is one device, torch's current one.
    with Region(args.pid, writable=True) as region:
        device = -1 if args.device is None else memory.region_device(region, args.device)
        region.post_command(constants.NPUALLOC_CMD_RESET_PEAK, device, timeout=args.timeout)
    sys.stdout.write(f"process {args.pid}: peak stats reset\n")
    return 0


def cmd_set_gc_threshold(args: argparse.Namespace) -> int:
    try:
        memory.set_gc_threshold(args.value, pid=args.pid, timeout=args.timeout)
    except ValueError as e:
        _Parser(prog="npualloc").error(str(e))
    sys.stdout.write(f"process {args.pid}: garbage_collection_threshold set to {args.value:g}\n")
    return 0


def cmd_set_memory_fraction(args: argparse.Namespace) -> int:
    try:
        index = memory._set_memory_fraction(args.fraction, args.device, pid=args.pid, timeout=args.timeout)
    except ValueError as e:
        _Parser(prog="npualloc").error(str(e))
    sys.stdout.write(f"process {args.pid}: per_process_memory_fraction of device {index} set to {args.fraction:g}\n")
    return 0


def cmd_snapshot(args: argparse.Namespace) -> int:
    data = snapshot.snapshot_bytes(args.pid, timeout=args.timeout)
    taken = snapshot.loads(data)  # also proves the file loads before it is handed on
    write_user_file(args.output, data)
    events = sum(len(trace) for trace in taken["device_traces"])
    sys.stdout.write(f"process {args.pid}: snapshot written to {args.output} ({len(taken['segments'])} segments, "
                     f"{events} trace events)\n")
    return 0


def cmd_record_history(args: argparse.Namespace) -> int:
    snapshot.record_memory_history(None if args.entries == 0 else "all", max_entries=args.entries, pid=args.pid,
                                   timeout=args.timeout)
    state = f"recording the last {args.entries} events per device" if args.entries else "history recording off"
    sys.stdout.write(f"process {args.pid}: {state}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="npualloc", description="npualloc, a drop-in caching allocator for Ascend NPUs: run "
                     "programs under it unmodified, watch and command them from another shell (regions in "
                     f"{region_base()}/npualloc-<uid>), take and plot memory snapshots, replay workloads.",
                     epilog=__doc__.split("\n\n")[1] if __doc__ else None)
    sub = parser.add_subparsers(dest="action", required=True, parser_class=_Parser)

    def with_pid(name: str, help: str, device: bool = True, timeout: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        p.add_argument("pid", type=_pid)
        if device:
            p.add_argument("--device", type=_count, default=None, help="device index (default: every device in use)")
        if timeout:
            p.add_argument("--timeout", type=_seconds, default=5.0, help="seconds to wait for the acknowledgement")
        return p

    stats = with_pid("stats", "allocator stats of a process", timeout=False)
    stats.add_argument("--json", action="store_true", help="machine-readable output (memory_stats() keys)")
    stats.add_argument("--watch", type=_seconds, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    stats.set_defaults(run=cmd_stats)

    ls = sub.add_parser("ls", help="every process running under npualloc (cleans stale regions)")
    ls.add_argument("--json", action="store_true",
                    help="machine-readable output: one object per process and device (pid, device, allocated, "
                    "reserved, state, command)")
    ls.set_defaults(run=cmd_ls)

    run = sub.add_parser("run", help="run a command (and its children) with npualloc preloaded, same pid: "
                         "no change to the program")
    run.add_argument("--conf", help="allocator config, e.g. max_split_size_mb:128,garbage_collection_threshold:0.8")
    run.add_argument("--sim", action="store_true",
                     help="no NPU needed: run on the simulated CANN runtime shipped with npualloc, its pyACL-compatible "
                     "`acl` module importable (this command and its children only)")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    run.set_defaults(run=cmd_run)

    with_pid("empty-cache", "release the process's cached unused segments").set_defaults(run=cmd_empty_cache)
    with_pid("reset-peak", "reset the process's peak stats").set_defaults(run=cmd_reset_peak)
    pause_help = "release all the process's device memory at its next allocator call; it waits until resume"
    with_pid("pause", pause_help, device=False).set_defaults(run=cmd_pause)
    with_pid("resume", "map the paused process's memory back and let it run on", device=False).set_defaults(
        run=cmd_resume)
    gc = with_pid("set-gc-threshold", "set garbage_collection_threshold at run time (0: off)", device=False)
    gc.add_argument("value", type=float)
    gc.set_defaults(run=cmd_set_gc_threshold)

    fraction = with_pid("set-memory-fraction", "cap a device's reserved memory at a fraction of it from now on, as "
                        "torch's set_per_process_memory_fraction (1: no cap)", device=False)
    fraction.add_argument("fraction", type=float)
    fraction.add_argument("--device", type=_count, default=None,
                          help="device index (default: the first device the process allocated on)")
    fraction.set_defaults(run=cmd_set_memory_fraction)

    snap = with_pid("snapshot", "write the process's memory snapshot (torch's _dump_snapshot pickle)", device=False)
    snap.add_argument("-o", "--output", required=True, help="the .pickle file to write")
    snap.set_defaults(run=cmd_snapshot)
    history = with_pid("record-history", "record the last N allocator events per device (0: off)", device=False)
    history.add_argument("entries", type=_count, help="0 turns recording off")
    history.set_defaults(run=cmd_record_history)
    plotter = sub.add_parser("plot", help="memory over time and the segment map of a snapshot (ours, an OOM "
                             "snapshot or torch's), as a PNG")
    plotter.add_argument("snapshot", help="a snapshot pickle (ours or torch's, .gz too)")
    plotter.add_argument("-o", "--output", required=True, help="the .png file to write")
    plotter.set_defaults(run=plot.cmd_plot)

    replayer = sub.add_parser("replay", help="replay a recorded workload (a torch or npualloc snapshot) through "
                              "npualloc on the simulated runtime, no NPU needed: peak memory, fragmentation, raw "
                              "device calls, the smallest HBM it fits in, configs compared")
    replay.add_arguments(replayer)
    replayer.set_defaults(run=replay.run)

    metrics = sub.add_parser("exporter", help="serve Prometheus /metrics for every npualloc process on this node "
                             "(needs npualloc[exporter])")
    exporter.add_arguments(metrics)
    metrics.set_defaults(run=exporter.cmd_exporter)
    return parser


def _pid(text: str) -> int:
    """A process id: a positive int (0 or -5 is a usage error, not a missing process)."""
    value = memory.parse_decimal(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"needs a positive process id, not {text!r}")
    return value


def _count(text: str) -> int:
    """A device index or a number of entries: 0 or more, in ASCII digits."""
    value = memory.parse_decimal(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"needs a whole number, 0 or more, not {text!r}")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds: "nan" and "inf" parse as floats,
    and a wait against either never ends."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"needs a positive number of seconds, not {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except NpuallocError as e:
        sys.stderr.write(f"npualloc: {e}\n")
        return e.exit_code
    except ValueError as e:  # a bad --device
        sys.stderr.write(f"npualloc: {e}\n")
        return EXIT_USAGE
    except CommandInterruptedError as e:
        sys.stderr.write(f"npualloc: {e}\n")
        return e.exit_code
    except KeyboardInterrupt:
        if getattr(args, "watch", None) or args.run is exporter.cmd_exporter:
            return 0  # how --watch and the exporter are meant to end
        sys.stderr.write("npualloc: interrupted\n")
        return 130
    except BrokenPipeError:  # `npualloc ls | head`
        return 0
