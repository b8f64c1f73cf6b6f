"""``dipaco-worker --metrics-port N``: this agent's progress for a Prometheus on its machine.

Off by default. The numbers are the ones the panel shows (progress.Reporter's fields and
the transfer meter), read at each scrape by a custom collector, so training does no extra
work for them. The server bound to 127.0.0.1 unless ``--metrics-address`` says otherwise:
they describe this machine, and only its owner needs them.

Names are stable (a volunteer's alerts and dashboards use them):

- ``dipaco_worker_tokens_per_second``: training speed of the current unit;
- ``dipaco_worker_step``, ``dipaco_worker_unit_steps``: inner step, and the unit's steps;
- ``dipaco_worker_loss``: the last inner step's training loss;
- ``dipaco_worker_transfer_bytes_total``: bytes downloaded and uploaded;
- ``dipaco_worker_units_done_total``: units handed in since the agent started;
- ``dipaco_worker_last_step_timestamp_seconds``: when the last inner step ended (Unix
  time): ``time() - dipaco_worker_last_step_timestamp_seconds`` is how long training has
  been still.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from worker_agent.errors import UsageError
from worker_agent.progress import Reporter

__all__ = ["GAUGES", "serve_metrics"]

# reporter field -> (metric name, help)
GAUGES = {
    "tokens_per_second": ("dipaco_worker_tokens_per_second", "Training tokens per second."),
    "step": ("dipaco_worker_step", "The current unit's inner step."),
    "steps": ("dipaco_worker_unit_steps", "The current unit's inner steps in all."),
    "loss": ("dipaco_worker_loss", "The last inner step's training loss."),
    "last_step_at": (
        "dipaco_worker_last_step_timestamp_seconds",
        "When the last inner step ended, in Unix seconds.",
    ),
}


class ReporterCollector:
    """Yields the reporter's numbers at each scrape (a prometheus_client Collector)."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter

    def collect(self) -> Iterator[Any]:
        # prometheus_client is optional on a worker: imported only once serving
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        with self.reporter._lock:
            fields = dict(self.reporter.fields)
            moved = self.reporter.meter.total_bytes if self.reporter.meter is not None else 0
        for field, (name, text) in GAUGES.items():
            value = _number(fields.get(field))
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        yield CounterMetricFamily(
            "dipaco_worker_transfer_bytes", "Bytes downloaded and uploaded.", value=moved
        )
        units = _number(fields.get("units_done")) or 0.0
        yield CounterMetricFamily(
            "dipaco_worker_units_done", "Units handed in since the agent started.", value=units
        )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def serve_metrics(reporter: Reporter, port: int, address: str = "127.0.0.1") -> Any:
    """Serve /metrics on `address`:`port` from a background thread; returns the server
    (``shutdown()`` stops it). Raises UsageError naming the option when it cannot."""
    try:
        # optional on a worker-only install: refused below, naming the package
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise UsageError(
            "--metrics-port needs the prometheus-client package: pip install prometheus-client"
        ) from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReporterCollector(reporter))
    try:
        server, _ = start_http_server(port, addr=address, registry=registry)
    except OSError as exc:
        raise UsageError(
            f"--metrics-port {port}: cannot listen on {address}:{port} ({exc.strerror or exc}); "
            "choose a free port"
        ) from None
    return server
