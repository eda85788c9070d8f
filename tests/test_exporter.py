"""`npualloc exporter`: a real HTTP scrape on loopback, parsed by
prometheus_client's own parser, while processes start, allocate, hit an OOM
and exit; a corrupt region beside them is skipped and counted, never fatal."""
from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from region_helpers import Workload, cli_env, region_bytes, write_region

from conftest import ROOT

parser = pytest.importorskip("prometheus_client.parser")
MiB = 1 << 20


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def of_pid(samples: dict, name: str, pid: int, device: int | None = 0) -> float:
    found = [v for (n, labels), v in samples.items() if n == name and ("pid", str(pid)) in labels
             and (device is None or ("device", str(device)) in labels)]
    assert len(found) == 1, (name, pid, found)
    return found[0]


def pids(samples: dict) -> set[int]:
    return {int(dict(labels)["pid"]) for (n, labels), _ in samples.items() if n == "npualloc_reserved_bytes"}


def test_scrapes_follow_processes_as_they_come_and_go(tmp_path: Path, sleeper: int) -> None:
    exporter = subprocess.Popen([sys.executable, "-m", "npualloc", "exporter", "--port", "0", "--host", "127.0.0.1"],
                                env=cli_env(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert exporter.stdout is not None
        line = exporter.stdout.readline()
        assert line.startswith("serving npualloc metrics on http://127.0.0.1:"), (line, exporter.stderr)
        url = line.split()[-1]

        empty = scrape(url)
        assert empty[("npualloc_processes", ())] == 0 and not pids(empty)

        with Workload(tmp_path) as first:
            first.call(f"malloc({3 * MiB})")
            with Workload(tmp_path, NPUSIM_HBM_MB="64") as second:
                second.call(f"malloc({MiB})")
                assert second.call(f"acl.rt.malloc({1 << 40}, 0)[1]") == 207001  # an OOM, counted
                # a corrupt region beside them: skipped and counted, the others still served
                write_region(tmp_path, sleeper, region_bytes(sleeper)[:100])
                both = scrape(url)
                assert pids(both) == {first.pid, second.pid}
                assert both[("npualloc_processes", ())] == 2 and both[("npualloc_regions_skipped", ())] == 1
                assert of_pid(both, "npualloc_allocated_bytes", first.pid) >= 3 * MiB
                assert of_pid(both, "npualloc_reserved_bytes", first.pid) >= of_pid(
                    both, "npualloc_allocated_bytes", first.pid)
                assert of_pid(both, "npualloc_allocated_bytes_peak", first.pid) >= 3 * MiB
                assert of_pid(both, "npualloc_ooms_total", second.pid) == 1
                assert of_pid(both, "npualloc_ooms_total", first.pid) == 0
                assert of_pid(both, "npualloc_device_mallocs_total", first.pid) >= 1
                assert of_pid(both, "npualloc_alloc_retries_total", second.pid) >= 1
                assert 0 <= of_pid(both, "npualloc_cache_hit_rate", first.pid) <= 1
                assert of_pid(both, "npualloc_paused_bytes", first.pid, device=None) == 0
                command = next(dict(labels)["command"] for (n, labels), _ in both.items()
                               if n == "npualloc_reserved_bytes" and ("pid", str(first.pid)) in labels)
                assert "python" in command
            # the second has exited: gone at the next scrape
            assert pids(scrape(url)) == {first.pid}
        assert not pids(scrape(url))
        assert exporter.poll() is None
    finally:
        exporter.terminate()
        _, stderr = exporter.communicate(timeout=30)
    assert stderr == "", stderr


def test_port_in_use_is_a_one_line_error(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "npualloc", "exporter", "--port", str(port)],
                              env=cli_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"npualloc: cannot listen on 127.0.0.1:{port}") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("host", ["a" * 300, "a..b"])
def test_a_host_name_the_resolver_refuses_is_a_one_line_error(tmp_path: Path, host: str) -> None:
    """A label past 63 characters or an empty one fails the resolver's IDNA
    encoding with UnicodeError, not OSError: it printed the codec's words
    alone, naming neither --host nor what could not listen."""
    proc = subprocess.run([sys.executable, "-m", "npualloc", "exporter", "--host", host, "--port", "0"],
                          env=cli_env(tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"npualloc: cannot listen on {host}:0: not a host name (") and \
        proc.stderr.count("\n") == 1


def test_dashboard_uses_only_exported_metrics() -> None:
    from npualloc.exporter import COUNTERS, GAUGES, PREFIX
    names = {PREFIX + n for n, _, _ in GAUGES} | {PREFIX + n + "_total" for n, _, _ in COUNTERS} | {
        PREFIX + n for n in ("paused_bytes", "processes", "regions_skipped")}
    dashboard = json.loads((ROOT / "tools" / "grafana" / "npualloc.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    assert exprs
    for expr in exprs:
        used = set(re.findall(r"npualloc_[a-z_]+", expr))
        assert used and used <= names, (expr, used - names)
