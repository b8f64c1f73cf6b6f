"""``dipaco-worker --metrics-port N`` (worker_agent.metrics): the agent's progress served for
Prometheus over real HTTP on loopback, read at scrape time from what the panel shows; and
a port that is taken refused at start-up with the option named."""

from __future__ import annotations

import io
import socket
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from worker_agent.cli import main
from worker_agent.errors import ExitCode, UsageError
from worker_agent.metrics import serve_metrics
from worker_agent.progress import JsonReporter, Reporter
from worker_agent.transfer import TransferMeter


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    answer = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert answer.status_code == 200, answer.text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def test_the_agents_progress_is_served_as_it_changes() -> None:
    reporter = Reporter()
    reporter.meter = TransferMeter()
    port = free_port()
    server = serve_metrics(reporter, port)
    try:
        idle = scrape(port)
        assert idle["dipaco_worker_transfer_bytes_total"] == 0
        assert "dipaco_worker_step" not in idle, "no step before training"
        reporter.meter.add(4096)
        before = time.time()
        reporter.status(step=3, steps=20, loss=4.25, tokens_per_second=1234.5)
        reporter.status(units_done=2)
        served = scrape(port)
    finally:
        server.shutdown()
    assert served["dipaco_worker_step"] == 3 and served["dipaco_worker_unit_steps"] == 20
    assert served["dipaco_worker_loss"] == 4.25
    assert served["dipaco_worker_tokens_per_second"] == 1234.5
    assert served["dipaco_worker_transfer_bytes_total"] == 4096
    assert served["dipaco_worker_units_done_total"] == 2
    assert before <= served["dipaco_worker_last_step_timestamp_seconds"] <= time.time()


def test_a_taken_port_is_refused_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            serve_metrics(JsonReporter(io.StringIO()), port)
        except UsageError as exc:
            assert f"--metrics-port {port}" in exc.message
        else:
            raise AssertionError("a taken port was accepted")
        # Through the command line: exit code 2 before anything else starts.
        assert main(["--metrics-port", str(port), "--json-logs", "--server",
                     "http://127.0.0.1:9"]) == ExitCode.USAGE  # fmt: skip


def test_without_the_option_nothing_listens() -> None:
    from worker_agent.cli import build_parser

    args = build_parser().parse_args([])
    assert args.metrics_port is None and args.metrics_address == "127.0.0.1"
