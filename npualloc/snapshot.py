"""Memory snapshots and allocation history in torch.cuda.memory's formats.

`memory_snapshot()` is torch.cuda.memory._snapshot(): {"segments", "device_traces",
"allocator_settings"} with torch's fields, so torch's `_memory_viz` and the
memory_viz web page read it (and `dump_snapshot`'s file) unchanged. The library
builds it as pickle bytes (core/snapshot_pickle.c), which hold no globals;
they are loaded here with an unpickler that refuses every class, so a file
from elsewhere cannot run code through this module.

With pid=... the snapshot comes from another process: a command through its
region makes it write <region>.snapshot.<seq> at its next allocator call,
which is read and removed here.

Frames are recorded only with record_stacks:python (or stacks="python" here,
in this process): the library then takes the allocating thread's Python
frames (hook/pystack.c); otherwise every "frames" is [].
"""
from __future__ import annotations

import io
import os
import pickle
import resource
import signal
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

from ._ffi import constants, ffi
from .errors import CorruptRegionError, NpuallocError
from .files import FileRefusedError, read_regular_file, write_user_file
from .memory import _in_process, _library, set_config
from .region import COMMAND_TIMEOUT_S, Region

Snapshot = dict[str, Any]

# The most a snapshot may inflate to: a gzip bomb (megabytes that inflate to
# tens of gigabytes) is refused before it takes the memory. Ours hold at most
# DEFAULT_MAX_ENTRIES trace entries per device and the segments' blocks.
MAX_SNAPSHOT_BYTES = 1 << 30

# torch's _record_memory_history defaults to an unbounded trace; a ring in C
# needs a size: 32 bytes per entry, so this is 3.2 MB per device.
DEFAULT_MAX_ENTRIES = 100_000

# How many segments, blocks and trace entries a loaded snapshot may hold.
# A pickle may name one object from any number of places (its memo), so a
# crafted file of a few hundred KB unpickles into billions of trace entries
# for plot and replay to walk (an audit's: 1e10 from 400 KB, gigabytes within
# a minute). A snapshot naming one list of them twice is refused, and the
# entries of its lists may number one per SNAPSHOT_BYTES_PER_ENTRY bytes of
# the pickle (a dict of a few fields, some 40 bytes in tools/traces; one dict
# named again costs 2), or MIN_SNAPSHOT_ENTRIES for a small file. Frames are
# only counted (len), never walked, up to MAX_SNAPSHOT_FRAMES.
SNAPSHOT_BYTES_PER_ENTRY = 16
MIN_SNAPSHOT_ENTRIES = 4_000_000
MAX_SNAPSHOT_FRAMES = 100_000_000


class _PlainDataUnpickler(pickle.Unpickler):
    """Snapshots are dicts, lists, tuples, ints, floats, strings and booleans only."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a memory snapshot holds no objects, but this one names {module}.{name}")


def loads(data: bytes) -> Snapshot:
    """A snapshot from pickle bytes (gzip-compressed or not), refusing anything
    that is not plain data."""
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data)
    try:
        snapshot = _PlainDataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, TypeError) as e:
        raise NpuallocError(f"not a memory snapshot pickle ({e})") from None
    if not isinstance(snapshot, dict):
        raise NpuallocError("not a memory snapshot (expected torch's _snapshot() dict)")
    _check_shape(snapshot, max(MIN_SNAPSHOT_ENTRIES, len(data) // SNAPSHOT_BYTES_PER_ENTRY))
    return snapshot


def _refuse_past(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise NpuallocError(f"not a memory snapshot: it holds more than {limit:,} {what}")


def _expect(value: object, kinds: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kinds):
        raise NpuallocError(f"not a memory snapshot: {where} is {type(value).__name__}")
    return value


def _check_record(record: object, fields: dict[str, type | tuple[type, ...]], required: tuple[str, ...],
                  where: str) -> int:
    """record is a dict whose fields, where present (required ones always),
    have their kinds; returns how many frames it holds (a list when present)."""
    _expect(record, dict, where)
    for name, kinds in fields.items():
        if name in record or name in required:
            _expect(record.get(name), kinds, f"{where}[{name!r}]")
    return len(_expect(record.get("frames", []), list, f"{where}['frames']"))


_SEGMENT_FIELDS = {"device": int, "address": int, "total_size": int, "blocks": list}
_BLOCK_FIELDS = {"size": int, "requested_size": int, "state": str}
_TRACE_FIELDS = {"action": str, "addr": int, "size": int, "time_us": (int, float)}


def _check_shape(snapshot: Snapshot, max_entries: int) -> None:
    """The fields plot, replay and memory_viz read have torch's kinds, and the
    whole fits max_entries and MAX_SNAPSHOT_FRAMES: bad input is an
    NpuallocError, never a traceback or a walk without end. The entries are
    counted from the lists' lengths before any is walked, and a list named
    twice is refused, so a file naming one list many times over is refused
    at once."""
    segments = _expect(snapshot.get("segments", []), list, "segments")
    traces = _expect(snapshot.get("device_traces", []), list, "device_traces")
    lists = [(f"device_traces[{d}]", _expect(trace, list, f"device_traces[{d}]")) for d, trace in enumerate(traces)]
    for i, segment in enumerate(segments):
        _expect(segment, dict, f"segments[{i}]")
        lists.append((f"segments[{i}]['blocks']", _expect(segment.get("blocks"), list, f"segments[{i}]['blocks']")))
    seen: set[int] = {id(segments)}
    for where, items in lists:
        if id(items) in seen:
            raise NpuallocError(f"not a memory snapshot: {where} is a list named twice")
        seen.add(id(items))
    _refuse_past(len(segments) + sum(len(items) for _, items in lists), max_entries,
                 "segments, blocks and trace entries for its size")
    frames = 0
    for i, segment in enumerate(segments):
        where = f"segments[{i}]"
        frames += _check_record(segment, _SEGMENT_FIELDS, ("address", "total_size", "blocks"), where)
        for j, block in enumerate(segment["blocks"]):
            frames += _check_record(block, _BLOCK_FIELDS, ("size", "state"), f"{where}['blocks'][{j}]")
    for device, trace in enumerate(traces):
        for k, entry in enumerate(trace):
            frames += _check_record(entry, _TRACE_FIELDS, ("action",), f"device_traces[{device}][{k}]")
    _refuse_past(frames, MAX_SNAPSHOT_FRAMES, "stack frames")


def _gunzip(data: bytes) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip's framing
    try:
        inflated = inflater.decompress(data, MAX_SNAPSHOT_BYTES)
    except zlib.error as e:
        raise NpuallocError(f"not a gzip file ({e})") from None
    if inflater.unconsumed_tail:
        raise NpuallocError(f"it inflates to more than {MAX_SNAPSHOT_BYTES >> 20} MiB: not a memory snapshot")
    return inflated


def load(path: str | Path) -> Snapshot:
    """A snapshot file: ours, torch's _dump_snapshot, or either gzip-compressed."""
    file = read_regular_file(path, MAX_SNAPSHOT_BYTES)
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
_LOAD_IN_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from npualloc.snapshot import loads
try:
    loads(sys.stdin.buffer.read())
except MemoryError:
    sys.exit(3)
except Exception as e:
    sys.stderr.write(str(e))
    sys.exit(4)
"""


def _within_hard_limit(value: int, kind: int) -> tuple[int, int]:
    """(value, value), or less where this process's hard limit (which the
    child inherits) is lower: only a privileged process may raise it."""
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    return value, value


def _load_in_a_bounded_child(data: bytes) -> None:
    # -I and cwd "/": nothing from the environment or the current directory
    # is imported (a pickle.py planted in /tmp, where such files lie, would
    # run as us); the package is imported from where this file is.
    child = subprocess.Popen([sys.executable, "-I", "-c", _LOAD_IN_CHILD, str(Path(__file__).resolve().parents[1])],
                             cwd="/", stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    why = "another user owns the file"
    try:
        # Before it gets the data: what it unpickles counts against the caps.
        resource.prlimit(child.pid, resource.RLIMIT_DATA,
                         _within_hard_limit(FOREIGN_SNAPSHOT_MEMORY, resource.RLIMIT_DATA))
        resource.prlimit(child.pid, resource.RLIMIT_CPU, _within_hard_limit(FOREIGN_SNAPSHOT_CPU_S, resource.RLIMIT_CPU))
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
    if child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise NpuallocError(f"it takes more than {FOREIGN_SNAPSHOT_CPU_S} s of CPU to unpickle (not a memory "
                            f"snapshot; loaded on trial because {why})")
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


def _read_snapshot_file(path: Path) -> bytes:
    """Reads and removes the file the process wrote for us; never through a
    link and only our own regular file, though the directory is the user's own (region_dir.c)."""
    try:
        data = read_regular_file(path, MAX_SNAPSHOT_BYTES, owner=os.geteuid()).data
    except FileRefusedError as e:
        raise CorruptRegionError(f"the process acknowledged the snapshot but {e}") from None
    path.unlink(missing_ok=True)
    return data


def snapshot_bytes(pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> bytes:
    """The snapshot as the pickle bytes the library wrote (what `_dump_snapshot`
    would write). Another process builds it at its next allocator call."""
    if _in_process(pid):
        return _in_process_bytes()
    assert pid is not None
    with Region(pid, writable=True) as region:
        seq = region.post_command(constants.NPUALLOC_CMD_SNAPSHOT, timeout=timeout)
    return _read_snapshot_file(region.path.with_name(f"{region.path.name}.snapshot.{seq}"))


def memory_snapshot(pid: int | None = None, timeout: float = COMMAND_TIMEOUT_S) -> Snapshot:
    """torch.cuda.memory._snapshot(): every segment and block, and the recorded
    history of each device (empty unless record_history is on)."""
    return loads(snapshot_bytes(pid, timeout))


def dump_snapshot(filename: str | Path = "dump_snapshot.pickle", pid: int | None = None,
                  timeout: float = COMMAND_TIMEOUT_S) -> None:
    """torch.cuda.memory._dump_snapshot(): the snapshot pickled to filename,
    which is never followed if a link nor replaced if not our regular file
    (files.write_user_file)."""
    write_user_file(filename, snapshot_bytes(pid, timeout))


def record_memory_history(enabled: str | None = "all", context: str | None = "all", stacks: str = "all",
                          max_entries: int = DEFAULT_MAX_ENTRIES, pid: int | None = None,
                          timeout: float = COMMAND_TIMEOUT_S) -> None:
    """torch.cuda.memory._record_memory_history(): enabled=None stops recording,
    anything else keeps the last max_entries events per device (the trace
    restarts either way). stacks="python" (or torch's default "all": there
    are no C++ frames to add) records the Python frames of each allocation in
    this process; for another process (pid=) only history is switched, its
    stacks follow its record_stacks config key. context is accepted for
    torch's signature."""
    del context
    if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 0:
        raise ValueError(f"max_entries must be a non-negative int, not {max_entries!r}")
    if stacks not in ("python", "all", None):
        raise ValueError(f"stacks must be 'python', 'all' or None, not {stacks!r}")
    entries = 0 if enabled is None else max_entries
    if _in_process(pid):
        with_stacks = enabled is not None and stacks is not None
        set_config(f"record_history:{entries},record_stacks:{'python' if with_stacks else 'none'}")
        return
    assert pid is not None
    with Region(pid, writable=True) as region:
        region.post_command(constants.NPUALLOC_CMD_RECORD_HISTORY, arg=float(entries), timeout=timeout)
