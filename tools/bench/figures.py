"""How the bench states a measured figure: the median of repeated runs with
their min-max, so a reader sees how far a figure moves on the machine that
made it (the bench's sections all report this way)."""
from __future__ import annotations

import statistics


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_spread(s: dict[str, float], fmt: str = ".2f", suffix: str = "") -> str:
    return f"{s['median']:{fmt}}{suffix} [{s['min']:{fmt}}-{s['max']:{fmt}}]"
