"""`python -m npualloc plot SNAPSHOT -o FILE.png`: a memory snapshot as a picture.

Top: allocated and reserved bytes over time, from the recorded trace (one pair
of lines per device; red marks are OOMs). Bottom: the segment map at snapshot
time, one bar per segment with its blocks coloured by state.

The trace tells only changes; the level they start from is taken from the
segments (the state at the end of the trace) where the snapshot has them, so
a ring that dropped its oldest events still plots true levels. "Allocated" is
counted in requested bytes, as torch's trace records them.
"""
from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import NpuallocError
from .files import write_user_file
from .snapshot import Snapshot, load

MIB = 1 << 20
MAX_SEGMENT_ROWS = 48
STATE_COLORS = {"active_allocated": "#1f77b4", "active_pending_free": "#ff7f0e", "inactive": "#d9d9d9"}
STATE_LABELS = {"active_allocated": "allocated", "active_pending_free": "pending free", "inactive": "free (cached)"}


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise NpuallocError("plot needs matplotlib: pip install 'npualloc[plot]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


@dataclass
class Timeline:
    """Levels after each event of one device's trace."""
    times: list[float]       # seconds from the first event, or the event index when untimed
    timed: bool
    allocated: list[int]
    reserved: list[int]
    ooms: list[float]


def timeline(snapshot: Snapshot, device: int) -> Timeline:
    trace = snapshot.get("device_traces", [])[device]
    ends_allocation = "free_requested" if any(e["action"] == "free_requested" for e in trace) else None
    allocated_deltas, reserved_deltas = [], []
    for e in trace:
        action, size = e["action"], int(e.get("size", 0))
        if action == "alloc":
            allocated_deltas.append(size)
        elif action == ends_allocation or (ends_allocation is None and action in ("free", "free_completed")):
            allocated_deltas.append(-size)
        else:
            allocated_deltas.append(0)
        reserved_deltas.append(size if action in ("segment_alloc", "segment_map") else
                               -size if action in ("segment_free", "segment_unmap") else 0)

    segments = [s for s in snapshot.get("segments", []) if s.get("device", 0) == device]
    allocated = reserved = 0
    if segments:  # start where the end state says the trace started
        final_allocated = sum(b.get("requested_size", b["size"]) for s in segments for b in s["blocks"]
                              if b["state"] == "active_allocated")
        final_reserved = sum(s["total_size"] for s in segments)
        allocated = max(0, final_allocated - sum(allocated_deltas))
        reserved = max(0, final_reserved - sum(reserved_deltas))

    stamps = [e.get("time_us") for e in trace]
    timed = all(isinstance(t, int) for t in stamps) and len(set(stamps)) > 1
    start = stamps[0] if timed and stamps else 0
    result = Timeline([], timed, [], [], [])
    for index, (e, da, dr) in enumerate(zip(trace, allocated_deltas, reserved_deltas)):
        t = (e["time_us"] - start) / 1e6 if timed else float(index)
        allocated += da
        reserved += dr
        result.times.append(t)
        result.allocated.append(allocated)
        result.reserved.append(reserved)
        if e["action"] == "oom":
            result.ooms.append(t)
    return result


def _plot_timelines(ax: Any, snapshot: Snapshot) -> None:
    traced = [d for d, trace in enumerate(snapshot.get("device_traces", [])) if trace]
    if not traced:
        ax.text(0.5, 0.5, "no history recorded\n(turn it on with record_history:N or "
                "npualloc.record_memory_history())", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    lines = {device: timeline(snapshot, device) for device in traced}
    timed = all(line.timed for line in lines.values())
    # A replay runs a whole training step in a millisecond: pick a unit that reads well.
    span = max(line.times[-1] for line in lines.values()) if timed else 0.0
    unit, scale = next(((name, factor) for name, factor in (("s", 1.0), ("ms", 1e3), ("µs", 1e6))
                        if span * factor >= 1.0), ("µs", 1e6))
    oom_labelled = False
    for device, line in lines.items():
        times = [t * scale for t in line.times] if timed else line.times
        suffix = f" (NPU {device})" if len(traced) > 1 else ""
        ax.step(times, [r / MIB for r in line.reserved], where="post", label=f"reserved{suffix}")
        ax.step(times, [a / MIB for a in line.allocated], where="post", label=f"allocated{suffix}")
        for t in line.ooms:
            ax.axvline(t * scale if timed else t, color="red", linestyle="--", linewidth=1,
                       label=None if oom_labelled else "OOM")
            oom_labelled = True
    ax.set_xlabel(f"{unit} since the first recorded event" if timed else "event")
    ax.set_ylabel("MiB")
    ax.set_title("Memory over time (recorded trace)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)


def _plot_segments(ax: Any, snapshot: Snapshot) -> None:
    segments = snapshot.get("segments", [])
    if not segments:
        ax.text(0.5, 0.5, "no segments in this snapshot", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return
    shown = sorted(segments, key=lambda s: -s["total_size"])[:MAX_SEGMENT_ROWS]
    shown.sort(key=lambda s: (s.get("device", 0), s["address"]))
    bars: dict[str, tuple[list[int], list[float], list[float]]] = {state: ([], [], []) for state in STATE_COLORS}
    for row, seg in enumerate(shown):
        offset = 0
        for block in seg["blocks"]:
            rows, starts, widths = bars[block["state"] if block["state"] in STATE_COLORS else "inactive"]
            rows.append(row)
            starts.append(offset / MIB)
            widths.append(block["size"] / MIB)
            offset += block["size"]
    for state, (rows, starts, widths) in bars.items():
        if rows:
            ax.barh(rows, widths, left=starts, height=0.8, color=STATE_COLORS[state], edgecolor="white",
                    linewidth=0.3, label=STATE_LABELS[state])
    ax.set_yticks(range(len(shown)))
    several_devices = len({s.get("device", 0) for s in shown}) > 1
    ax.set_yticklabels([(f"NPU{s.get('device', 0)} " if several_devices else "")
                        + f"{s['address']:#x} ({s.get('segment_type', '?')})" for s in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("MiB from the segment start")
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated")
    title = (f"Segments at snapshot time: {len(segments)} segments, {reserved / MIB:.1f} MiB reserved, "
             f"{allocated / MIB:.1f} MiB in allocated blocks")
    if len(shown) < len(segments):
        title += f" (the {len(shown)} largest shown)"
    ax.set_title(title)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8)


def plot_snapshot(snapshot: Snapshot, output: str | Path) -> None:
    plt = _pyplot()
    rows = min(len(snapshot.get("segments", [])), MAX_SEGMENT_ROWS)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6 + 0.18 * rows),
                                      gridspec_kw={"height_ratios": [3, 2 + 0.12 * rows]})
    _plot_timelines(top, snapshot)
    _plot_segments(bottom, snapshot)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, dpi=100, format="png")
    finally:
        plt.close(fig)
    write_user_file(output, png.getvalue())


def cmd_plot(args: Any) -> int:
    plot_snapshot(load(args.snapshot), args.output)
    sys.stdout.write(f"{args.snapshot}: plot written to {args.output}\n")
    return 0
