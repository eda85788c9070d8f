"""Loading a memory snapshot from pickle bytes without trusting them: plain
data only (every class refused, so a file from elsewhere runs no code), a
bounded inflate for gzip, and a check of the shape and size plot, replay and
memory_viz rely on. Standard library only: snapshot.py's trial load runs this
file alone in a child process (python -I, nothing imported from the
environment, the package or the current directory)."""
from __future__ import annotations

import io
import pickle
import zlib
from typing import Any


class NotASnapshot(Exception):
    """What was loaded is not a memory snapshot; the message is one line for a user."""


# The most a snapshot may inflate to: a gzip bomb (megabytes that inflate to
# tens of gigabytes) is refused before it takes the memory. Ours hold the
# segments' blocks and the recorded history, 100,000 entries a device by
# default (snapshot.DEFAULT_MAX_ENTRIES).
MAX_SNAPSHOT_BYTES = 1 << 30

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


def loads(data: bytes) -> dict[str, Any]:
    """A snapshot from pickle bytes (gzip-compressed or not), refusing anything
    that is not plain data."""
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data)
    try:
        snapshot = _PlainDataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError, TypeError, AttributeError,
            OverflowError) as e:
        raise NotASnapshot(f"not a memory snapshot pickle ({e})") from None
    if not isinstance(snapshot, dict):
        raise NotASnapshot("not a memory snapshot (expected torch's _snapshot() dict)")
    _check_shape(snapshot, max(MIN_SNAPSHOT_ENTRIES, len(data) // SNAPSHOT_BYTES_PER_ENTRY))
    return snapshot


def _refuse_past(count: int, limit: int, what: str) -> None:
    if count > limit:
        raise NotASnapshot(f"not a memory snapshot: it holds more than {limit:,} {what}")


def _expect(value: object, kinds: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(value, kinds):
        raise NotASnapshot(f"not a memory snapshot: {where} is {type(value).__name__}")
    return value


# Every int field checked here (sizes, addresses, times, a device index) is
# unsigned 64-bit in torch's snapshots, as in ours (core/snapshot_pickle.c);
# past that range replay's struct.pack and plot's float division raised.
_MAX_FIELD = (1 << 64) - 1


def _check_record(record: object, fields: dict[str, type | tuple[type, ...]], required: tuple[str, ...],
                  where: str) -> int:
    """record is a dict whose fields, where present (required ones always),
    have their kinds, ints within _MAX_FIELD; returns how many frames it
    holds (a list when present)."""
    _expect(record, dict, where)
    for name, kinds in fields.items():
        if name in record or name in required:
            value = _expect(record.get(name), kinds, f"{where}[{name!r}]")
            if isinstance(value, int) and not 0 <= value <= _MAX_FIELD:
                raise NotASnapshot(f"not a memory snapshot: {where}[{name!r}] is "
                                   f"{'negative' if value < 0 else 'past 2**64 - 1'}")
    return len(_expect(record.get("frames", []), list, f"{where}['frames']"))


_SEGMENT_FIELDS = {"device": int, "address": int, "total_size": int, "blocks": list}
_BLOCK_FIELDS = {"size": int, "requested_size": int, "state": str}
_TRACE_FIELDS = {"action": str, "addr": int, "device_free": int, "size": int, "time_us": (int, float)}
# torch writes an OOM entry's address field as device_free, not addr.
_TRACE_REQUIRED = ("action", "addr", "size")
_OOM_REQUIRED = ("action", "device_free", "size")


def _check_shape(snapshot: dict[str, Any], max_entries: int) -> None:
    """The fields plot, replay and memory_viz read have torch's kinds, and the
    whole fits max_entries and MAX_SNAPSHOT_FRAMES: bad input is an
    NotASnapshot, never a traceback or a walk without end. The entries are
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
            raise NotASnapshot(f"not a memory snapshot: {where} is a list named twice")
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
            oom = isinstance(entry, dict) and entry.get("action") == "oom"
            frames += _check_record(entry, _TRACE_FIELDS, _OOM_REQUIRED if oom else _TRACE_REQUIRED,
                                    f"device_traces[{device}][{k}]")
    _refuse_past(frames, MAX_SNAPSHOT_FRAMES, "stack frames")


def _gunzip(data: bytes) -> bytes:
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # gzip's framing
    try:
        inflated = inflater.decompress(data, MAX_SNAPSHOT_BYTES)
    except zlib.error as e:
        raise NotASnapshot(f"not a gzip file ({e})") from None
    if inflater.unconsumed_tail:
        raise NotASnapshot(f"it inflates to more than {MAX_SNAPSHOT_BYTES >> 20} MiB: not a memory snapshot")
    return inflated
