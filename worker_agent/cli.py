"""``dipaco-worker``: lend this machine's accelerator to a dipaco run.

    dipaco-worker --server https://dipaco.example.org --enroll dpe_...   # the first time
    dipaco-worker                                                         # afterwards

The first Ctrl+C (or SIGTERM) finishes the current step, releases the lease and exits
0; a second one exits at once (130).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from worker_agent.errors import EXIT_CODES_HELP, AgentError, ExitCode, Interrupted
from worker_agent.heap import fix_mmap_threshold
from worker_agent.progress import JsonReporter, Reporter, RichReporter

__all__ = ["build_parser", "main", "parse_size"]

log = logging.getLogger("worker_agent")
# dipaco.inner.DEFAULT_CHECKPOINT_INTERVAL_S, written here so that --help needs no torch
# (tests/test_worker_agent_local.py checks they agree).
CHECKPOINT_INTERVAL_S = 120.0
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in '24GiB', '24G', '800MB' or '24' (GiB when no unit is given)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; write e.g. 24GiB or 800MB")
    value, unit = float(match.group(1)), (match.group(2) or "G").upper()
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    base = 1000 if unit.endswith("B") and "I" not in unit and unit != "B" else 1024
    return int(value * base**power)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dipaco-worker",
        description="Lend this machine's GPU (or CPU) to a dipaco training run.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--server", metavar="URL", help="the dipaco server (saved at enrollment)")
    add("--enroll", metavar="TOKEN", help="enrollment token from the operator (first run only)")
    add("--name", default=socket.gethostname(), help="this machine's name on the dashboard")
    add("--data-dir", type=Path, help="config, cache and checkpoints "
        "(default $DIPACO_WORKER_DIR or ~/.local/share/dipaco-worker)")  # fmt: skip
    add("--device", default="auto", help="auto (cuda, then mps, then cpu), cuda, cuda:N, mps, cpu")
    add("--gpus", metavar="LIST", help="GPUs this agent may see, e.g. 0 or 1,3 (one agent per GPU)")
    add("--memory-cap", type=parse_size, metavar="SIZE",
        help="use at most this much accelerator memory, e.g. 20GiB")  # fmt: skip
    add("--threads", type=int, metavar="N", help="CPU threads for torch (default: all cores)")
    add("--json-logs", action="store_true", help="one JSON object per line instead of the panel")
    add("--once", action="store_true", help="do one work unit, then exit")
    add("--max-units", type=int, metavar="N", help="do N work units, then exit")
    add("--checkpoint-interval", type=float, default=CHECKPOINT_INTERVAL_S, metavar="SECONDS",
        help="save the unit's training state every SECONDS of training (default "
        f"{CHECKPOINT_INTERVAL_S:g}): if this machine stops (a crash, a power cut, kill -9), "
        "a restart resumes from the last one, so at most this much training is lost; saving "
        "runs in the background, training pauses only to copy the state to memory")  # fmt: skip
    add("--checkpoint-every", type=int, metavar="STEPS",
        help="save it every STEPS inner steps instead of by time")  # fmt: skip
    add("--no-compile", dest="compile", action="store_false", default=None,
        help="train without torch.compile (on by default on CUDA, off on the CPU); for a "
        "GPU whose compiler fails, or to start the first unit sooner")  # fmt: skip
    add("--probe-seconds", type=float, default=1.0, help="length of the start-up speed probe")
    add("--step-delay", type=float, default=0.0, metavar="SECONDS",
        help="sleep this long before each micro-batch: a slower device, for tests and "
        "benchmarks of unit sizing (default 0)")  # fmt: skip
    add("--cache-size", type=parse_size, default=20 * 1024**3, metavar="SIZE",
        help="keep at most this much module weights cached (default 20GiB)")  # fmt: skip
    add("--metrics-port", type=int, metavar="N",
        help="serve this agent's progress (tokens/s, step, loss, bytes moved, last step's "
        "time) for Prometheus at http://ADDRESS:N/metrics; off by default")  # fmt: skip
    add(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDRESS",
        help="where --metrics-port listens (default 127.0.0.1: this machine only)",
    )
    return parser


def _reporter(json_logs: bool) -> Reporter:
    reporter: Reporter = JsonReporter() if json_logs else RichReporter()
    root = logging.getLogger()
    root.handlers[:] = [reporter.log_handler()]
    root.setLevel(logging.WARNING)
    logging.getLogger("worker_agent").setLevel(logging.INFO)
    return reporter


@contextmanager
def _process_state() -> Iterator[None]:
    """Restore logging and signal handlers afterwards (main() may run inside another program)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        root.handlers[:], root.level = handlers, level
        for number, handler in signals.items():
            signal.signal(number, handler)


def _install_signals(stop: threading.Event, reporter: Reporter) -> None:
    def handle(signum: int, frame: FrameType | None) -> None:
        if stop.is_set():
            reporter.close()
            os._exit(ExitCode.INTERRUPTED)
        stop.set()
        reporter.event(
            "stopping",
            f"{signal.Signals(signum).name}: finishing the current step, then releasing the "
            "lease (press Ctrl+C again to quit at once)",
        )

    signal.signal(signal.SIGINT, handle)
    signal.signal(signal.SIGTERM, handle)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.once:
        args.max_units = 1
    with _process_state():
        return _main(args)


def _main(args: argparse.Namespace) -> int:
    reporter = _reporter(args.json_logs)
    fix_mmap_threshold()  # freed tensors' pages go back at once (worker_agent.heap)
    stop = threading.Event()
    _install_signals(stop, reporter)
    metrics = None
    try:
        if args.metrics_port is not None:
            # prometheus_client is optional on a worker-only install: only with the option
            from worker_agent.metrics import serve_metrics

            metrics = serve_metrics(reporter, args.metrics_port, args.metrics_address)
        from worker_agent.run import run_agent  # torch (seconds): not for --help

        run_agent(args, reporter, stop)
        return ExitCode.OK
    except Interrupted:
        return ExitCode.OK
    except AgentError as exc:
        reporter.event("error", exc.message, exit_code=int(exc.exit_code))
        return exc.exit_code
    except Exception as exc:
        log.exception("dipaco-worker failed unexpectedly")
        reporter.event("error", f"unexpected error: {type(exc).__name__}: {exc}", exit_code=1)
        return ExitCode.ERROR
    finally:
        if metrics is not None:
            metrics.shutdown()
        reporter.close()


if __name__ == "__main__":
    sys.exit(main())
