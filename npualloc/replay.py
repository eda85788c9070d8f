"""`python -m npualloc replay TRACE`: will this workload fit, and how well does
npualloc serve it?

TRACE is a PyTorch memory snapshot (the pickle torch.cuda.memory._dump_snapshot
writes, optionally gzip-compressed; tools/traces/ ships recordings of real
models). Its alloc/free events are turned into a compact event file and driven,
one aclrtMalloc/aclrtFree each, by the C replayer (npualloc-replay) on the
simulated runtime with libnpualloc.so preloaded. The simulator's HBM size is
then searched down to the smallest in which the trace still runs without an OOM.

Event mapping: the replay follows the program's frees ("free_requested", or
the old "free"; "free_completed" only where no request came first). A free of
an address that is not live and an allocation at an address that is still live
cannot be replayed faithfully; both are skipped and counted. An allocation
of 0 bytes, which torch's allocator serves with no memory (and never
records), is counted and not replayed, nor is its free. "snapshot" entries
mark iteration ends (tools/traces/record.py writes one per iteration).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import subprocess
import sys
import tempfile
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import simulator
from ._ffi import ACL_ERROR_RT_MEMORY_ALLOCATION
from .conf_env import with_conf
from .snapshot import load as load_any_snapshot
from .errors import NpuallocError
from .summary import human_bytes

PACKAGE_DIR = Path(__file__).resolve().parent

# tools/replay/replay_format.h
EVENT_FILE_MAGIC = b"NPAREPLY"
EVENT_FILE_VERSION = 1
EVENT_FILE_HEADER = struct.Struct("<8sIIQ")
EVENT = struct.Struct("<QII")
OP_ALLOC, OP_FREE, OP_ITERATION_END = 0, 1, 2

# The exit status of a replay that hit an OOM at --hbm when no smallest-HBM
# search was asked for (with the search, the report answers what fits).
EXIT_DID_NOT_FIT = 10
MIB = 1 << 20
DEFAULT_HBM = "64G"
# The smallest-HBM search stops once its bracket is this narrow: 1% of the
# answer, but never coarser than 64 MiB and never finer than the simulator's 1 MiB.
SEARCH_MAX_STEP = 64 * MIB
SEARCH_MIN_STEP = MIB
# The most HBM a replay models, --hbm and the search alike: a trace that needs
# more is not a memory question, and the simulator reserves an arena of twice
# its HBM and 1 GiB, which x86-64's 128 TiB of user address space refuses
# from 48 TiB on (its runtime then fails to start).
MAX_HBM = 1 << 44

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.I)


class ReplayError(NpuallocError):
    """A one-line reason the replay cannot be done."""


def parse_size(text: str) -> int:
    """Bytes of "64G", "16GiB", "512M", "1.5T", "4096" (units are binary)."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a size: {text!r} (e.g. 64G, 16GiB, 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))


# ---------------------------------------------------------------- trace -> event file

def load_snapshot(path: str | Path) -> dict:
    """A memory snapshot with the history replay needs, through the package's
    one snapshot loader (which refuses any class: a crafted pickle runs no code)."""
    try:
        data = load_any_snapshot(path)
    except NpuallocError as e:
        raise ReplayError(str(e)) from None
    if not isinstance(data.get("device_traces"), list):
        raise ReplayError(f"{path}: no device_traces (record it with "
                          "torch.cuda.memory._record_memory_history() before _dump_snapshot)")
    return data


@dataclass
class EventFile:
    """What was written, and what of the trace could not be replayed."""
    path: Path
    device: int
    events: int
    allocs: int
    frees: int
    iterations: int
    slot_count: int
    skipped_frees: int
    skipped_allocs: int
    zero_size_allocs: int
    # Of each event, the index of its entry in the device's trace: the
    # replayer numbers the events it wrote, which leave out the entries not
    # replayed (free_completed after a request, segment_alloc, ...).
    trace_entries: array


def busiest_device(snapshot: dict) -> int:
    traces = snapshot["device_traces"]
    counts = [sum(1 for e in t if e.get("action") == "alloc") for t in traces]
    if not counts or max(counts) == 0:
        raise ReplayError("the trace has no alloc events")
    return counts.index(max(counts))


def write_event_file(snapshot: dict, out: Path, device: int | None = None) -> EventFile:
    """Turns one device's trace into the replayer's event file. Addresses
    become slots, reused as blocks are freed, so the replayer's table is as
    small as the trace's most live blocks."""
    device = busiest_device(snapshot) if device is None else device
    if not 0 <= device < len(snapshot["device_traces"]):
        raise ReplayError(f"the trace has no device {device}")
    live: dict[int, tuple[int, int]] = {}   # addr -> (slot, size)
    # 0-byte allocs not yet freed, by address (a recorder may give them all
    # one, 0). torch's allocator serves a 0-byte request with a null pointer,
    # no block and no trace entry, and aclrtMalloc refuses size 0 (the
    # replayer stopped at it, "aclError 100000"): such an alloc costs no
    # memory, so it and its free are not replayed, only counted.
    empty: Counter[int] = Counter()
    free_requested: set[int] = set()
    spare_slots: list[int] = []
    slot_count = 0
    records = bytearray()
    trace_entries = array("Q")
    allocs = frees = iterations = skipped_frees = skipped_allocs = zero_size_allocs = 0

    def record(size: int, slot: int, op: int) -> None:
        """One event, from the trace entry the loop below is at (index)."""
        records.extend(EVENT.pack(size, slot, op))
        trace_entries.append(index)

    def free(addr: int) -> bool:
        """Frees what is live at addr; False when nothing is."""
        nonlocal frees
        if empty[addr]:
            empty[addr] -= 1
            return True
        if addr not in live:
            return False
        slot, size = live.pop(addr)
        spare_slots.append(slot)
        record(size, slot, OP_FREE)
        frees += 1
        return True

    for index, entry in enumerate(snapshot["device_traces"][device]):
        action, addr = entry.get("action"), entry.get("addr")
        if action == "alloc":
            size = int(entry["size"])
            if size == 0:
                empty[addr] += 1
                zero_size_allocs += 1
                continue
            if addr in live:
                skipped_allocs += 1
                continue
            if spare_slots:
                slot = spare_slots.pop()
            else:
                slot, slot_count = slot_count, slot_count + 1
            live[addr] = (slot, size)
            record(size, slot, OP_ALLOC)
            allocs += 1
        elif action in ("free_requested", "free"):
            if free(addr):
                free_requested.add(addr)
            else:
                skipped_frees += 1
        elif action == "free_completed":
            if addr in free_requested:
                free_requested.discard(addr)
            elif not free(addr):
                skipped_frees += 1
        elif action == "snapshot":
            record(0, 0, OP_ITERATION_END)
            iterations += 1
    events = len(records) // EVENT.size
    with open(out, "wb") as f:
        f.write(EVENT_FILE_HEADER.pack(EVENT_FILE_MAGIC, EVENT_FILE_VERSION, slot_count, events))
        f.write(records)
    return EventFile(out, device, events, allocs, frees, iterations, slot_count, skipped_frees, skipped_allocs,
                     zero_size_allocs, trace_entries)


# ---------------------------------------------------------------- running the replayer

@dataclass
class Toolchain:
    """The three things a replay needs: the replayer, the allocator, the runtime."""
    replayer: Path
    library: Path
    runtime_lib64: Path


def find_toolchain(build: str | None, runtime: str | None) -> Toolchain:
    """--build DIR takes all three from a build tree; otherwise the package's
    own files (npualloc/lib/) and the simulator named by --runtime,
    $ASCEND_HOME_PATH, a checkout's build/aclsim, or the one shipped in the
    package (npualloc/sim/)."""
    if build:
        root = Path(build)
        replayer, library = root / "tools" / "npualloc-replay", root / "lib" / "libnpualloc.so"
        runtime_dirs = [runtime or root / "aclsim"]
    else:
        replayer, library = PACKAGE_DIR / "lib" / "npualloc-replay", PACKAGE_DIR / "lib" / "libnpualloc.so"
        # A checkout's build tree before the package's copy, which is only as
        # fresh as the last `make package`.
        runtime_dirs = [runtime] if runtime else [os.environ.get("ASCEND_HOME_PATH"), simulator.CHECKOUT_HOME,
                                                  simulator.PACKAGED_HOME]
    for path in (replayer, library):
        if not path.is_file():
            raise ReplayError(f"{path} is missing: build it with `make all`")
    for directory in filter(None, runtime_dirs):
        # Not a real CANN install: its HBM size no environment variable can change.
        if simulator.is_simulator(Path(directory)):
            return Toolchain(replayer, library, Path(directory) / "lib64")
    tried = ", ".join(str(d) for d in filter(None, runtime_dirs)) or "nothing (ASCEND_HOME_PATH unset)"
    raise ReplayError(f"no simulated runtime found (tried {tried}): build it with `make sim`, "
                      "or name it with --runtime DIR or ASCEND_HOME_PATH")


def replay_env(tools: Toolchain, hbm_bytes: int, conf: str | None, preload: bool,
               sim_latency: bool) -> dict[str, str]:
    env = simulator.simulated_env(tools.runtime_lib64.parent, {
        k: v for k, v in os.environ.items() if not k.startswith("NPUSIM_") and k != "LD_PRELOAD"})
    env["NPUSIM_HBM_MB"] = str(hbm_bytes // MIB)
    if not sim_latency:
        env["NPUSIM_MALLOC_US"] = "0"
        env["NPUSIM_FREE_US"] = "0"
    if preload:
        env["LD_PRELOAD"] = str(tools.library)
    # The library parses --conf, as under `npualloc run --conf`: one parser, the same warnings.
    return with_conf(env, conf, "replay") if conf is not None else env


def run_replayer(tools: Toolchain, written: EventFile, env: dict[str, str]) -> tuple[dict[str, Any], list[str]]:
    """The replayer's result and the library's warnings (its `npualloc:` lines on stderr)."""
    proc = subprocess.run([str(tools.replayer), str(written.path)], env=env, capture_output=True, text=True)
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        reason = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise ReplayError(f"the replayer failed: {reason}") from None
    if result.get("acl_error") not in (None, ACL_ERROR_RT_MEMORY_ALLOCATION):
        raise ReplayError(f"the replayer stopped at entry {failed_trace_entry(written, result)} of device "
                          f"{written.device}'s trace ({human_bytes(result['failed_size'])}): aclError "
                          f"{result['acl_error']}")
    return result, [line for line in proc.stderr.splitlines() if line.startswith("npualloc:")]


def failed_trace_entry(written: EventFile, result: dict[str, Any]) -> int | None:
    """The trace entry (index in the device's trace) whose event stopped the replay."""
    return None if result["failed_event"] is None else written.trace_entries[result["failed_event"]]


def fits(result: dict[str, Any]) -> bool:
    return bool(result["completed"]) and not result["oom"]


def smallest_hbm(tools: Toolchain, written: EventFile, env: dict[str, str], peak_requested: int,
                 known_fit: int | None) -> tuple[int, int, int]:
    """Bisection over the simulator's HBM (in MiB): returns (smallest size
    that fitted, the resolution reached, number of replays). Below the peak
    requested nothing can fit; known_fit is a size that already fitted."""
    def try_size(size: int) -> bool:
        nonlocal runs
        runs += 1
        # Its warnings are the first replay's (same config); its OOMs are the search's own.
        return fits(run_replayer(tools, written, dict(env, NPUSIM_HBM_MB=str(size // MIB)))[0])

    runs = 0
    low = max(0, peak_requested // MIB - 1) * MIB     # does not fit
    high = known_fit
    if high is None:
        high = min(max(2 * low, 64 * MIB), MAX_HBM)
        while not try_size(high):
            if high >= MAX_HBM:
                raise ReplayError(f"does not fit even in {human_bytes(high)}")
            low, high = high, min(2 * high, MAX_HBM)
    while high - low > max(SEARCH_MIN_STEP, min(SEARCH_MAX_STEP, high // 100)):
        middle = (low + high) // 2 // MIB * MIB
        if try_size(middle):
            high = middle
        else:
            low = middle
    return high, high - low, runs


# ---------------------------------------------------------------- the command

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", help="memory snapshot: .pickle or .pickle.gz (torch's _dump_snapshot format)")
    parser.add_argument("--conf", help="allocator config for this replay, e.g. "
                        "expandable_segments:False,max_split_size_mb:128 (default: the environment's)")
    parser.add_argument("--hbm", default=DEFAULT_HBM, help=f"simulated HBM size (default {DEFAULT_HBM})")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the report")
    parser.add_argument("--device", type=int, help="which device's trace (default: the one with most allocs)")
    parser.add_argument("--no-search", action="store_true", help="skip the smallest-HBM search (then a replay "
                        f"that does not fit in --hbm exits {EXIT_DID_NOT_FIT})")
    parser.add_argument("--raw", action="store_true",
                        help="replay on the runtime alone, without npualloc (for comparison)")
    parser.add_argument("--sim-latency", action="store_true",
                        help="keep the simulator's malloc/free latency model (default: zero latency)")
    parser.add_argument("--build", metavar="DIR", help="take the replayer, libnpualloc.so and the simulator "
                        "from this build tree (a checkout's build/)")
    parser.add_argument("--runtime", metavar="DIR", help="the simulated runtime (its ASCEND_HOME_PATH, "
                        "holding lib64/)")


def replay(args: argparse.Namespace) -> dict[str, Any]:
    """Everything the command reports, as one dict (the --json output)."""
    try:
        hbm = parse_size(args.hbm)
    except ValueError as e:
        raise ReplayError(f"--hbm: {e}") from None
    if hbm < MIB:
        raise ReplayError(f"--hbm: {args.hbm} is under the simulator's 1 MiB granularity")
    if hbm > MAX_HBM:
        raise ReplayError(f"--hbm: {args.hbm} is past the {human_bytes(MAX_HBM)} the simulator models")
    for option, directory in (("--build", args.build), ("--runtime", args.runtime)):
        # Read as not given, an empty one (`--build "$BUILD"`, BUILD unset)
        # replayed with other tools than named, and said nothing.
        if directory == "":
            raise ReplayError(f"{option}: an empty path names no directory")
    tools = find_toolchain(args.build, args.runtime)
    snapshot = load_snapshot(args.trace)
    with tempfile.TemporaryDirectory(prefix="npualloc-replay-") as tmp:
        written = write_event_file(snapshot, Path(tmp) / "events.bin", args.device)
        env = replay_env(tools, hbm, args.conf, not args.raw, args.sim_latency)
        result, warnings = run_replayer(tools, written, env)
        if not args.raw and not result["npualloc_loaded"]:
            raise ReplayError(f"{tools.library} was preloaded but its stats API is not visible")
        report: dict[str, Any] = {
            "trace": str(args.trace), "device": written.device, "trace_events": written.events,
            "allocs": written.allocs, "frees": written.frees, "iterations": written.iterations,
            "skipped_frees": written.skipped_frees, "skipped_allocs": written.skipped_allocs,
            "zero_size_allocs": written.zero_size_allocs,
            "failed_trace_entry": failed_trace_entry(written, result),
            "conf": args.conf, "npualloc": not args.raw, "hbm_bytes": hbm // MIB * MIB,
            "replay": result, "fits": fits(result), "warnings": warnings,
        }
        peak_requested = result["peak_requested_bytes"]
        peak_reserved = result["peak_reserved_bytes"]
        report["reserved_over_requested"] = (peak_reserved / peak_requested
                                             if peak_reserved is not None and peak_requested else None)
        if not args.no_search:
            smallest, resolution, runs = smallest_hbm(tools, written, env, peak_requested,
                                                      report["hbm_bytes"] if report["fits"] else None)
            report.update(smallest_hbm_bytes=smallest, smallest_hbm_resolution_bytes=resolution,
                          search_replays=runs)
    return report


def render(report: dict[str, Any]) -> str:
    r = report["replay"]

    def size_or_na(value: int | None) -> str:
        return human_bytes(value) if value is not None else "n/a (npualloc not loaded)"

    lines = [
        f"trace              {report['trace']} (device {report['device']}: {report['allocs']} allocs, "
        f"{report['frees']} frees, {report['iterations']} iterations)",
    ]
    if report["skipped_frees"] or report["skipped_allocs"]:
        lines.append(f"skipped            {report['skipped_frees']} frees of addresses not live, "
                     f"{report['skipped_allocs']} allocs at addresses still live")
    if report["zero_size_allocs"]:
        lines.append(f"not replayed       {report['zero_size_allocs']} allocs of 0 bytes (torch's allocator gives "
                     "them no memory)")
    if not report["npualloc"]:
        allocator = "none (the runtime alone)"
    elif report["conf"] is not None:
        allocator = f"npualloc, conf {report['conf']!r}"
    else:
        allocator = "npualloc, conf from the environment"
    lines += [
        f"allocator          {allocator}",
        f"replayed           {r['events']} events in {r['wall_seconds']:.3f} s "
        f"({r['events_per_second'] / 1e6:.2f} M events/s)",
        f"peak requested     {human_bytes(r['peak_requested_bytes'])}",
        f"peak allocated     {size_or_na(r['peak_allocated_bytes'])}",
        f"peak reserved      {size_or_na(r['peak_reserved_bytes'])}"
        + (f"  (reserved/requested {report['reserved_over_requested']:.3f})"
           if report["reserved_over_requested"] is not None else ""),
        "fragmentation      " + (f"{r['fragmentation']:.3f} (end of trace: 1 - largest free block / cached free)"
                                  if r["fragmentation"] is not None else "n/a"),
    ]
    if r["raw_mallocs"] is not None:
        after = (f", {r['raw_mallocs_after_first_iteration']} mallocs after iteration 1"
                 if report["iterations"] >= 2 and r["raw_mallocs_after_first_iteration"] is not None else "")
        lines.append(f"raw device calls   {r['raw_mallocs']} mallocs, {r['raw_frees']} frees{after}")
    if r["num_ooms"] is not None:
        lines.append(f"OOMs / retries     {r['num_ooms']} / {r['num_alloc_retries']}")
    hbm = human_bytes(report["hbm_bytes"])
    lines.append(f"fits in {hbm:<10} " + ("yes" if report["fits"] else
                                           f"no: OOM at trace entry {report['failed_trace_entry']} "
                                           f"({human_bytes(r['failed_size'])})"))
    if "smallest_hbm_bytes" in report:
        lines.append(f"smallest HBM       {human_bytes(report['smallest_hbm_bytes'])} "
                     f"(to {human_bytes(report['smallest_hbm_resolution_bytes'])}, "
                     f"{report['search_replays']} replays)")
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    try:
        report = replay(args)
    except ReplayError as e:
        sys.stderr.write(f"npualloc: {e}\n")
        return 1
    sys.stderr.write("".join(f"{line}\n" for line in report["warnings"]))
    sys.stdout.write(json.dumps(report, indent=2) + "\n" if args.json else render(report))
    return EXIT_DID_NOT_FIT if not report["fits"] and args.no_search else 0


if __name__ == "__main__":  # `python -m npualloc.replay`: the CLI's command, with its errors and Ctrl-C
    from npualloc.cli import main
    sys.exit(main(["replay", *sys.argv[1:]]))
