"""Memory snapshots and allocation history in torch.cuda.memory's formats.

`_snapshot()` is torch.cuda.memory._snapshot(): {"segments", "device_traces",
"allocator_settings"} with torch's fields (`memory_snapshot()` its segments, as
torch's), so torch's `_memory_viz` and the memory_viz web page read it (and
`dump_snapshot`'s file) unchanged. The library
builds it as pickle bytes (core/snapshot_pickle.c), which hold no globals;
they are loaded here with an unpickler that refuses every class, so a file
from elsewhere cannot run code through this module.

With pid=... the snapshot comes from another process: a command through its
region makes it write <region>.snapshot.<region inode>.<seq> at its next
allocator call, which is read and removed here.

Frames are recorded only with record_stacks:python (or stacks="python" here,
in this process): the library then takes the Python frames of each malloc's
caller, and with record_context:all (context="all" here) of each free's and
empty_cache's, for the events of that call (hook/pystack.c); otherwise
every "frames" is []. With record_context:state (context="state") only the
live blocks and the segments show them, no trace entry.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _snapshot_check
from ._ffi import constants, ffi
from .errors import CorruptRegionError, NoSuchProcessError, NpuallocError
from .files import FileRefusedError, FileTooLargeError, read_regular_file, write_user_file
from .memory import _in_process, _library, set_config
from .region import COMMAND_TIMEOUT_S, Region

Snapshot = dict[str, Any]

# torch's _record_memory_history defaults to an unbounded trace; a ring in C
# needs a size: 40 bytes per entry, so this is 4 MB per device.
DEFAULT_MAX_ENTRIES = 100_000


def loads(data: bytes) -> Snapshot:
    """A snapshot from pickle bytes (gzip-compressed or not), refusing anything
    that is not plain data (_snapshot_check)."""
    try:
        return _snapshot_check.loads(data)
    except _snapshot_check.NotASnapshot as e:
        raise NpuallocError(str(e)) from None
    except MemoryError:  # a pickle's few bytes may ask for any amount (a length of 2**62)
        raise NpuallocError("out of memory while unpickling it (not a memory snapshot?)") from None


def load(path: str | Path) -> Snapshot:
    """A snapshot file: ours, torch's _dump_snapshot, or either gzip-compressed."""
    file = read_regular_file(path, _snapshot_check.MAX_SNAPSHOT_BYTES)
    try:
        if file.uid not in (os.geteuid(), 0):
            _load_in_a_bounded_child(file.data)
        return loads(file.data)
    except NpuallocError as e:
        raise NpuallocError(f"{path}: {e}") from None


# A pickle can unpickle into far more memory than its bytes: an empty list per
# byte takes 64 times as much (an audit's 20 KB .gz: 1.8 GB; a 1 GiB one would
# take 64 GB), where a real snapshot takes 11 times (tools/traces); and dict
# keys that all hash alike take quadratic time (a review's 279 KB: 4.4 s). A
# file of another user's is therefore loaded once first in a child process
# with its data segment and CPU time capped, and a wall-clock wait for it
# (a child starved of the CPU on a loaded machine still ends), and loaded
# here only if that one succeeded.
FOREIGN_SNAPSHOT_MEMORY = 4 << 30
FOREIGN_SNAPSHOT_CPU_S = 120
FOREIGN_SNAPSHOT_WAIT_S = 600
# The child loads _snapshot_check.py by its path and nothing else of ours:
# the package's imports (cffi, psutil) may be reachable only through the
# environment, which -I leaves out.
_LOAD_IN_CHILD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("npualloc_snapshot_check", sys.argv[1])
check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check)
try:
    check.loads(sys.stdin.buffer.read())
except MemoryError:
    sys.exit(3)
except check.NotASnapshot as e:
    sys.stderr.write(str(e))
    sys.exit(4)
"""


def _within_hard_limit(soft: int, hard: int, kind: int) -> tuple[int, int]:
    """(soft, hard), each no more than this process's hard limit (which the
    child inherits): only a privileged process may raise it."""
    ours = resource.getrlimit(kind)[1]
    if ours == resource.RLIM_INFINITY:
        return soft, hard
    return min(soft, ours), min(hard, ours)


def _load_in_a_bounded_child(data: bytes) -> None:
    # -I and cwd "/": nothing from the environment or the current directory
    # is imported (a pickle.py planted in /tmp, where such files lie, would
    # run as us).
    child = subprocess.Popen([sys.executable, "-I", "-c", _LOAD_IN_CHILD, _snapshot_check.__file__],
                             cwd="/", stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    why = "another user owns the file"
    try:
        # Before it gets the data: what it unpickles counts against the caps.
        resource.prlimit(child.pid, resource.RLIMIT_DATA,
                         _within_hard_limit(FOREIGN_SNAPSHOT_MEMORY, FOREIGN_SNAPSHOT_MEMORY, resource.RLIMIT_DATA))
        # A soft CPU limit below the hard one: its overrun is a SIGXCPU, told
        # apart from a SIGKILL (an out-of-memory killer, a cgroup's limit).
        resource.prlimit(child.pid, resource.RLIMIT_CPU,
                         _within_hard_limit(FOREIGN_SNAPSHOT_CPU_S, FOREIGN_SNAPSHOT_CPU_S + 5, resource.RLIMIT_CPU))
        _, error = child.communicate(data, timeout=FOREIGN_SNAPSHOT_WAIT_S)
    except subprocess.TimeoutExpired:
        raise NpuallocError(f"its trial load did not end within {FOREIGN_SNAPSHOT_WAIT_S} s ({why})") from None
    except OSError as e:
        raise NpuallocError(f"cannot load it on trial ({why}): {e.strerror}") from None
    finally:
        child.kill()
        child.wait()
    if child.returncode == 3:
        raise NpuallocError(f"it unpickles into more than {FOREIGN_SNAPSHOT_MEMORY >> 20} MiB (not a memory "
                            f"snapshot; loaded on trial because {why})")
    if child.returncode == -signal.SIGXCPU:
        raise NpuallocError(f"it takes more than {FOREIGN_SNAPSHOT_CPU_S} s of CPU to unpickle (not a memory "
                            f"snapshot; loaded on trial because {why})")
    if child.returncode == -signal.SIGKILL:
        raise NpuallocError(f"its trial load was killed (out of memory?) ({why})")
    if child.returncode != 0:
        raise NpuallocError(error.decode(errors="replace").strip() or
                            f"its trial load ended with status {child.returncode}")


def _in_process_bytes() -> bytes:
    lib = _library()
    size = ffi.new("size_t *")
    buffer = lib.npualloc_snapshot(size)
    if buffer == ffi.NULL:
        raise NpuallocError("no host memory for the snapshot")
    try:
        return bytes(ffi.buffer(buffer, size[0]))
    finally:
        lib.npualloc_free_snapshot(buffer)


def _read_snapshot_file(region: Region, seq: int) -> bytes:
    """Reads and removes the file the process wrote beside its region for
    our snapshot command seq (NPUALLOC_CMD_SNAPSHOT); never through a link
    and only our own regular file, though the directory is the user's own
    (region_dir.c), and in the directory the region was opened in, not at
    its path: where the base is not sticky another user can rename that
    directory and put their own at its name."""
    # The region file's inode is in the name, since a process with the same
    # pid in another pid namespace sharing the directory has the same region
    # name, and numbers its commands as this one does.
    name = f"{region.path.name}.snapshot.{region.inode}.{seq}"
    path = region.path.with_name(name)
    try:
        return read_regular_file(path, _snapshot_check.MAX_SNAPSHOT_BYTES, owner=os.geteuid(),
                                 dir_fd=region.directory_fd).data
    except FileTooLargeError as e:  # nothing is corrupt: a long history with stacks (record_history)
        raise NpuallocError(f"{e}: process {region.pid}'s snapshot is past what npualloc reads; record fewer "
                            "history entries (record_history) and take it again") from None
    except FileRefusedError as e:
        if region.process_ended():  # it removes the files nobody took at exit
            raise NoSuchProcessError(f"process {region.pid} ended before its snapshot was read") from None
        raise CorruptRegionError(f"the process acknowledged the snapshot but {e}") from None
    finally:  # read or refused, it is nobody's now: the name is removed, never followed (a link goes, not
        # its target), in the directory the region was opened in, which only its user can write (0700)
        try:
            os.unlink(name, dir_fd=region.directory_fd)
        except OSError:  # gone already (its process ended), or a directory planted there
            pass


def snapshot_bytes(pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> bytes:
    """The snapshot as the pickle bytes the library wrote (what `_dump_snapshot`
    would write). Another process builds it at its next allocator call."""
    if _in_process(pid):
        return _in_process_bytes()
    assert pid is not None
    with Region(pid, writable=True) as region:
        seq = region.post_command(constants.NPUALLOC_CMD_SNAPSHOT, timeout=timeout)
        return _read_snapshot_file(region, seq)


def torch_snapshot(device: object = None, augment_with_fx_traces: bool = False, *, pid: int | None = None,
                   timeout: float = COMMAND_TIMEOUT_S) -> Snapshot:
    """torch.cuda.memory._snapshot(device=None, augment_with_fx_traces=False):
    every segment and block of every device (torch does not read device
    either), and the recorded history of each (empty unless record_history is
    on); no FX code to augment. pid= (keyword only: torch's positional
    arguments stay torch's): another process's."""
    del device, augment_with_fx_traces
    return loads(snapshot_bytes(pid, timeout))


def memory_snapshot(mempool_id: object = None, include_traces: bool = True, *, pid: int | None = None,
                    timeout: float = COMMAND_TIMEOUT_S) -> list[dict[str, Any]]:
    """torch.cuda.memory_snapshot(mempool_id=None, include_traces=True): the
    segments of `_snapshot()`, which hold no trace either way (include_traces
    only spares torch copying them). npualloc has no memory pools, so a
    mempool_id other than torch's default pool, (0, 0), is refused rather than
    ignored."""
    del include_traces
    if mempool_id is not None and mempool_id != (0, 0):
        raise ValueError(f"npualloc has no memory pools: mempool_id must be None, not {mempool_id!r}")
    segments: list[dict[str, Any]] = torch_snapshot(pid=pid, timeout=timeout)["segments"]
    return segments


def dump_snapshot(filename: str | Path = "dump_snapshot.pickle", pid: int | None = None,
                  timeout: float = COMMAND_TIMEOUT_S) -> None:
    """torch.cuda.memory._dump_snapshot(): the snapshot pickled to filename,
    which is never followed if a link nor replaced if not our regular file
    (files.write_user_file)."""
    write_user_file(filename, snapshot_bytes(pid, timeout))


def _check_option(name: str, value: object, valid: tuple[str, ...]) -> None:
    """torch's check of record_memory_history's enabled, context and stacks
    (checkOptionIn, a TORCH_CHECK): a string it does not know is a
    RuntimeError; anything but a string is refused before, by its binding, as
    a TypeError. None is allowed (stacks=None is npualloc's: no stacks)."""
    if value is None or (isinstance(value, str) and value in valid):
        return
    message = f"{name} must be {', '.join(map(repr, valid))} or None, not {value!r}"
    raise RuntimeError(message) if isinstance(value, str) else TypeError(message)


def record_memory_history(enabled: str | bool | None = "all", context: str | None = "all", stacks: str | None = "all",
                          max_entries: int = DEFAULT_MAX_ENTRIES, pid: int | None = None,
                          timeout: float = COMMAND_TIMEOUT_S) -> None:
    """torch.cuda.memory._record_memory_history(): enabled=None stops recording,
    anything else keeps the last max_entries events per device (the trace
    restarts either way). stacks="python" (or torch's default "all": there
    are no C++ frames to add) records the Python frames of each allocation in
    this process, and with context="all" (torch's default) those of each free
    and empty_cache too, which their events carry (record_context:all);
    context="alloc" leaves a free's events the frames of its alloc,
    context="state" keeps frames for the live blocks and segments only, no
    trace entry carrying any (as torch), and context=None records none. For
    another process (pid=) only history is switched, its stacks follow its
    record_stacks and record_context config keys. enabled and context take
    torch's values, checked as torch checks them; enabled="state" records as
    "all" does (torch then keeps a trace of one entry beside the live blocks'
    stacks, but npualloc takes a live block's stack from its alloc event in
    the trace)."""
    if isinstance(enabled, bool):  # torch's legacy form: _record_memory_history(False) is off
        enabled = "all" if enabled else None
    _check_option("enabled", enabled, ("state", "all"))
    _check_option("context", context, ("state", "alloc", "all"))
    _check_option("stacks", stacks, ("python", "all"))
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        # torch's binding takes a size_t: anything else is its TypeError.
        raise TypeError(f"max_entries must be a non-negative int, not {max_entries!r}")
    if enabled is not None and max_entries > constants.NPUALLOC_MAX_RECORD_HISTORY:
        raise ValueError(f"max_entries must be at most {constants.NPUALLOC_MAX_RECORD_HISTORY} per device, "
                         f"not {max_entries}")
    entries = 0 if enabled is None else max_entries
    if _in_process(pid):
        with_stacks = enabled is not None and stacks is not None and context is not None
        set_config(f"record_history:{entries},record_stacks:{'python' if with_stacks else 'none'},"
                   f"record_context:{context or 'alloc'}")
        return
    assert pid is not None
    with Region(pid, writable=True) as region:
        region.post_command(constants.NPUALLOC_CMD_RECORD_HISTORY, arg=float(entries), timeout=timeout)


# torch.cuda.memory's private names, with torch's signatures: their positional
# arguments are torch's (a device, augment_with_fx_traces), never a pid, so
# code written for torch runs unchanged (npualloc's own functions above take
# pid= in those places).

def torch_dump_snapshot(filename: str | Path = "dump_snapshot.pickle", augment_with_fx_traces: bool = False) -> None:
    """torch.cuda.memory._dump_snapshot(filename, augment_with_fx_traces=False)."""
    del augment_with_fx_traces
    dump_snapshot(filename)


def torch_record_memory_history(enabled: str | bool | None = "all", *args: Any, **kwargs: Any) -> None:
    """torch.cuda.memory._record_memory_history: a bool is torch's legacy form
    (enabled, record_context, trace_alloc_max_entries, ...), anything else
    (enabled, context, stacks, max_entries, device, clear_history, ...)."""
    if isinstance(enabled, bool):
        _record_memory_history_legacy(enabled, *args, **kwargs)
    else:
        _record_memory_history_impl(enabled, *args, **kwargs)


def _record_memory_history_legacy(enabled: bool, record_context: bool = True, trace_alloc_max_entries: int = 1,
                                  trace_alloc_record_context: bool = False, device: object = None,
                                  record_context_cpp: bool = False, clear_history: bool = False,
                                  compile_context: bool = False, global_record_annotations: bool = False,
                                  skip_actions: list[str] | None = None) -> None:
    del device, record_context_cpp, clear_history, compile_context, global_record_annotations, skip_actions
    if not enabled:
        record_memory_history(None)
        return
    # torch keeps the stacks of live blocks beside a trace of trace_alloc_max_entries
    # (1 by default); npualloc takes a live block's stack from its alloc event in the
    # trace, so the trace keeps at least DEFAULT_MAX_ENTRIES. torch's context: "alloc"
    # with trace_alloc_record_context, else "state" with record_context, else none;
    # the legacy form never takes a free's stack.
    context = "alloc" if trace_alloc_record_context else "state" if record_context else None
    record_memory_history("all", context=context, max_entries=max(trace_alloc_max_entries, DEFAULT_MAX_ENTRIES))


def _record_memory_history_impl(enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
                                max_entries: int = DEFAULT_MAX_ENTRIES, device: object = None,
                                clear_history: bool = False, compile_context: bool = False,
                                global_record_annotations: bool = False, skip_actions: list[str] | None = None) -> None:
    del device, clear_history, compile_context, global_record_annotations, skip_actions
    record_memory_history(enabled, context, stacks, max_entries)
