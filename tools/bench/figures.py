"""How the bench takes and states a measured figure. Taken in rounds, each
round's runs pinned to one CPU and the rounds taking the CPUs in turn (on a
VM whose CPUs ran the same code at 69 and 120 ns, an unpinned run landed on
either, and two runs compared two CPUs as often as two builds). Stated as
the median of the rounds with their min-max, so a reader sees how far a
figure moves on the machine that made it."""
from __future__ import annotations

import os
import statistics
from typing import Callable


def round_cpus(rounds: int) -> list[int]:
    """The CPU each round runs on: those this process may use, in turn."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[i % len(cpus)] for i in range(rounds)]


def pinned(cpu: int | None) -> Callable[[], None] | None:
    """A subprocess preexec_fn that pins the child (and the threads it
    starts) to cpu; None leaves it unpinned."""
    return None if cpu is None else lambda: os.sched_setaffinity(0, {cpu})


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt_value(value: float, fmt: str) -> str:
    """value formatted, without the minus sign of a negative that rounds to
    zero ("-0%" for a loss of -0.2%; Python 3.10 has no "z" option)."""
    text = f"{value:{fmt}}"
    return text[1:] if text.startswith("-") and not any(c in "123456789" for c in text) else text


def fmt_spread(s: dict[str, float], fmt: str = ".2f", suffix: str = "") -> str:
    return f"{fmt_value(s['median'], fmt)}{suffix} [{fmt_value(s['min'], fmt)}-{fmt_value(s['max'], fmt)}]"
