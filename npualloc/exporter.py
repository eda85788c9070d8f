"""`npualloc exporter [--port N] [--host ADDR]`: Prometheus metrics of the
processes running under npualloc on this node that `npualloc ls` lists (the
user's own; everyone's for root), read from their regions at each scrape with
the same validation (read_live_regions): a region that is torn, foreign or of
another version is skipped and counted, never trusted and never able to block
the others; another user's process is left out, uncounted, as ls leaves it.

Needs prometheus_client: `pip install npualloc[exporter]`. A Grafana
dashboard for these metrics is in tools/grafana/npualloc.json.
"""
from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Iterator
from typing import Any

from . import memory
from .errors import NpuallocError
from .region import Region, RegionHeader, read_live_regions

PREFIX = "npualloc_"
LABELS = ("pid", "command", "device")
COMMAND_WIDTH = 80

# (metric name, help, memory_stats() key): gauges of each process and device.
GAUGES = (
    ("allocated_bytes", "Bytes in allocated blocks", "allocated_bytes.all.current"),
    ("allocated_bytes_peak", "Peak of allocated_bytes since the last reset", "allocated_bytes.all.peak"),
    ("reserved_bytes", "Device bytes held by the allocator (segments)", "reserved_bytes.all.current"),
    ("reserved_bytes_peak", "Peak of reserved_bytes since the last reset", "reserved_bytes.all.peak"),
    ("active_bytes", "Bytes in active blocks (allocated or waiting for their streams)", "active_bytes.all.current"),
    ("active_bytes_peak", "Peak of active_bytes since the last reset", "active_bytes.all.peak"),
    ("cache_hit_rate", "Share of allocations served from the cache", "npualloc.cache_hit_rate"),
    ("fragmentation", "1 - largest free block / free cached bytes", "npualloc.fragmentation"),
    ("saver_allocated_bytes", "Device bytes of memory_saver allocations (outside the cache), paused or not",
     "npualloc.saver_allocated_bytes"),
    ("saver_paused_bytes", "Of those, released by a pause", "npualloc.saver_paused_bytes"),
)
# (metric name without _total, help, memory_stats() key): counters.
COUNTERS = (
    ("ooms", "Allocations that failed with out of memory", "num_ooms"),
    ("alloc_retries", "Allocations that freed the cache and retried", "num_alloc_retries"),
    ("device_mallocs", "Raw device mallocs made by the allocator", "num_device_alloc"),
    ("device_frees", "Raw device frees made by the allocator", "num_device_free"),
    ("executor_destroys_forwarded", "aclnn executor destroys passed to the runtime",
     "npualloc.executor_destroys_forwarded"),
    ("executor_destroys_skipped", "aclnn executor destroys skipped (double or never-repeatable)",
     "npualloc.executor_destroys_skipped"),
)


def _command_line(header: RegionHeader) -> str:
    from .cli import _command_line as command_line  # the CLI's display form; cli imports this module lazily
    return command_line(header, COMMAND_WIDTH)


class NpuallocCollector:
    """A prometheus_client collector reading every region at each scrape."""

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        gauges = {name: GaugeMetricFamily(PREFIX + name, text, labels=LABELS) for name, text, _ in GAUGES}
        counters = {name: CounterMetricFamily(PREFIX + name, text, labels=LABELS) for name, text, _ in COUNTERS}
        paused = GaugeMetricFamily(PREFIX + "paused_bytes", "Device bytes a pause released (npualloc pause)",
                                   labels=("pid", "command"))
        processes = GaugeMetricFamily(PREFIX + "processes", "Processes running under npualloc on this node")
        skipped = GaugeMetricFamily(PREFIX + "regions_skipped",
                                    "Regions skipped at this scrape: corrupt, foreign, another version or gone")

        def read(pid: int, region: Region) -> tuple[RegionHeader, dict[int, memory.Stats]]:
            return region.header(), {d: memory.region_stats(region, d) for d in region.devices_in_use()}

        count = bad = 0

        def skip(pid: int, error: NpuallocError) -> None:  # corrupt, foreign, another version, torn, gone meanwhile
            nonlocal bad
            bad += 1

        for process, (header, devices) in read_live_regions(read, skip):
            count += 1
            pid, command = str(process), _command_line(header)
            paused.add_metric([pid, command], header.paused_bytes)
            for device, stats in devices.items():
                labels = [pid, command, str(device)]
                for name, _, key in GAUGES:
                    gauges[name].add_metric(labels, stats[key])
                for name, _, key in COUNTERS:
                    counters[name].add_metric(labels, stats[key])
        processes.add_metric([], count)
        skipped.add_metric([], bad)
        yield from gauges.values()
        yield from counters.values()
        yield from (paused, processes, skipped)


def serve(host: str, port: int) -> tuple[Any, threading.Thread]:
    """Starts the HTTP server (a daemon thread); returns (server, thread)."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise NpuallocError("the exporter needs prometheus_client: pip install npualloc[exporter]") from None
    registry = CollectorRegistry()
    registry.register(NpuallocCollector())  # type: ignore[arg-type]
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise NpuallocError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    except UnicodeError as e:  # a name the resolver's IDNA encoding refuses (a label past 63 characters)
        raise NpuallocError(f"cannot listen on {host}:{port}: not a host name ({e})") from None


def cmd_exporter(args: argparse.Namespace) -> int:
    server, thread = serve(args.host, args.port)
    sys.stdout.write(f"serving npualloc metrics on http://{args.host}:{server.server_port}/metrics\n")
    sys.stdout.flush()
    thread.join()  # until Ctrl-C or a signal
    return 0


def _port(text: str) -> int:
    port = memory.parse_decimal(text)
    if port is None or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"needs a TCP port, 0 to 65535, not {text!r}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=_port, default=9464, help="TCP port (default 9464; 0: any free port)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
