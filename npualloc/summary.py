"""memory_summary(): torch's 75-column text table, for an NPU.

Every line is 75 characters between two '|'; columns Cur Usage, Peak Usage,
Tot Alloc, Tot Freed, 10 characters each. Sizes scale down while the row's
first value stays >= 768 of the next unit, counts while >= 750 thousand, each
column scaled by the value of the row's "all" line, as torch does.

Also human_bytes, the one size format of the CLI's tables and the replay's
report.
"""
from __future__ import annotations

from typing import Any, Callable

WIDTH = 75
_SIZE_UNITS = ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB")
_COUNT_UNITS = (" ", "K", "M")
_COLUMNS = ("current", "peak", "allocated", "freed")

# (stat, row label, formatter kind), in torch's order.
_POOLED_ROWS = (
    ("allocated_bytes", "Allocated memory", "size"),
    ("active_bytes", "Active memory", "size"),
    ("requested_bytes", "Requested memory", "size"),
    ("reserved_bytes", "NPU reserved memory", "size"),
    ("inactive_split_bytes", "Non-releasable memory", "size"),
    ("allocation", "Allocations", "count"),
    ("active", "Active allocs", "count"),
    ("segment", "NPU reserved segments", "count"),
    ("inactive_split", "Non-releasable allocs", "count"),
)
_OVERSIZE_ROWS = (
    ("oversize_allocations", "Oversize allocations"),
    ("oversize_segments", "Oversize NPU segments"),
)


def _scaled(value: int, reference: float, units: tuple[str, ...], step: int, threshold: int) -> tuple[int, str]:
    unit = units[0]
    for next_unit in units[1:]:
        if reference < threshold:
            break
        unit = next_unit
        value //= step
        reference /= step
    return value, unit


def human_bytes(value: float) -> str:
    """value in the largest binary unit (up to TiB) that keeps it under 1024
    as printed: 1048575 bytes rounds to 1.00 MiB, not 1024.00 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        shown = f"{value:.0f}" if unit == "B" else f"{value:.2f}"
        if abs(float(shown)) < 1024:
            return f"{shown} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def format_size(value: int, reference: float) -> str:
    number, unit = _scaled(value, reference, _SIZE_UNITS, 1024, 768 * 1024)
    return f"{number:6d} {unit}"


def format_count(value: int, reference: float) -> str:
    number, unit = _scaled(value, reference, _COUNT_UNITS, 1000, 750 * 1000)
    return f"{number:7d} {unit} "


_FORMATTERS: dict[str, Callable[[int, float], str]] = {"size": format_size, "count": format_count}


def _row(label: str, values: list[str]) -> str:
    return f" {label:<21} | " + " | ".join(values) + " "


def format_summary(stats: dict[str, Any], device: int, abbreviated: bool = False) -> str:
    rule, double_rule = "-" * WIDTH, "=" * WIDTH
    lines = [
        double_rule,
        # torch's fixed columns (its "|" at column 37 whatever the counts), NPU names.
        f" {'':16} npualloc NPU memory summary, device ID {device:<17d} ",
        rule,
        f"  {'':9} NPU OOMs: {stats['num_ooms']:<13d} | {'':5} aclrtMalloc retries: {stats['num_alloc_retries']:<8d}  ",
        double_rule,
        "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  ",
    ]
    pools = [("all", None)] if abbreviated else [("all", None), ("large_pool", "from large pool"),
                                                  ("small_pool", "from small pool")]
    for stat, label, kind in _POOLED_ROWS:
        lines.append(rule)
        formatter = _FORMATTERS[kind]
        references = [stats[f"{stat}.all.{column}"] for column in _COLUMNS]
        for pool, pool_label in pools:
            values = [formatter(stats[f"{stat}.{pool}.{column}"], reference)
                      for column, reference in zip(_COLUMNS, references)]
            lines.append(_row(label if pool_label is None else f"      {pool_label}", values))
    for stat, label in _OVERSIZE_ROWS:
        lines.append(rule)
        values = [format_count(stats[f"{stat}.{column}"], stats[f"{stat}.{column}"]) for column in _COLUMNS]
        lines.append(_row(label, values))
    lines.append(double_rule)
    return "".join(f"|{line}|\n" for line in lines)
