"""Start-up: options → device and speed probe → enrollment or saved identity → the loop.

Kept apart from cli.py so ``dipaco-worker --help`` answers without importing torch.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from worker_agent.agent import Agent, AgentOptions
from worker_agent.client import Client
from worker_agent.config import (
    WorkerIdentity,
    default_data_dir,
    load_identity,
    save_identity,
)
from worker_agent.device import apply_memory_cap, detect_device, select_gpus, speed_probe
from worker_agent.errors import UsageError
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.progress import Reporter
from worker_agent.retry import RetryAttempt

__all__ = ["run_agent"]


def run_agent(args: argparse.Namespace, reporter: Reporter, stop: threading.Event) -> None:
    if args.max_units is not None and args.max_units < 1:
        raise UsageError(f"--max-units {args.max_units}: give at least 1")
    if args.step_delay < 0:
        raise UsageError(f"--step-delay {args.step_delay}: give 0 or more seconds")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every {args.checkpoint_every}: give at least 1 step")
    if not args.checkpoint_interval > 0 or args.checkpoint_interval == float("inf"):
        raise UsageError(
            f"--checkpoint-interval {args.checkpoint_interval}: give a number of seconds above 0"
        )
    if args.enroll is not None and not args.server:
        raise UsageError("--enroll needs --server URL: the server that issued the token")
    data_dir = (args.data_dir or default_data_dir()).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    saved = None if args.enroll is not None else _saved_identity(args, data_dir)  # fail fast
    select_gpus(args.gpus)
    if args.threads is not None:
        if args.threads < 1:
            raise UsageError(f"--threads {args.threads}: give at least 1")
        torch.set_num_threads(args.threads)
    device = detect_device(args.device)
    budget = apply_memory_cap(device, args.memory_cap)
    device.probe_tokens_per_second = speed_probe(device.device, seconds=args.probe_seconds)
    reporter.event(
        "device", f"training on {device.name}: probe {device.probe_tokens_per_second:,.0f} "
        "tokens/s", device=device.describe(),
    )  # fmt: skip
    identity = saved or _enroll(args, data_dir, device.describe(), reporter, stop)
    reporter.status(worker=identity.name, server=identity.server)
    reporter.event("page", f"this worker's page: {identity.server}/workers/{identity.worker_id}/")
    client = Client(identity.server, identity.token, stop=stop,
                    on_retry=_retry_reporter(reporter), worker_id=identity.worker_id)  # fmt: skip
    heartbeats = HeartbeatThread(
        Client(identity.server, identity.token, worker_id=identity.worker_id), interval_s=30.0
    )  # its own connection: never waits behind a transfer
    agent = Agent(
        client, heartbeats, device,
        AgentOptions(data_dir, max_units=args.max_units,
                     # --checkpoint-every replaces the time-based checkpoints
                     checkpoint_interval_s=(args.checkpoint_interval
                                            if args.checkpoint_every is None else None),
                     checkpoint_every=args.checkpoint_every, compile=args.compile,
                     memory_budget_bytes=budget, cache_max_bytes=args.cache_size,
                     step_delay_s=args.step_delay),
        reporter, stop,
    )  # fmt: skip
    try:
        client.check_version()
        heartbeats.start()
        agent.run()
    finally:
        heartbeats.stop()
        agent.close()
        client.close()
        heartbeats.client.close()


def _saved_identity(args: argparse.Namespace, data_dir: Path) -> WorkerIdentity:
    identity = load_identity(data_dir)
    if args.server and args.server.rstrip("/") != identity.server:
        raise UsageError(
            f"this machine is enrolled with {identity.server}, not {args.server}; "
            "to switch servers enroll again with --server URL --enroll TOKEN"
        )
    return identity


def _enroll(
    args: argparse.Namespace,
    data_dir: Path,
    device: dict[str, object],
    reporter: Reporter,
    stop: threading.Event,
) -> WorkerIdentity:
    server = args.server.rstrip("/")
    client = Client(server, stop=stop, on_retry=_retry_reporter(reporter))
    try:
        client.check_version()
        registration = client.register(args.enroll, args.name, device)
    finally:
        client.close()
    identity = WorkerIdentity(server, registration.worker_id, registration.token, registration.name)
    path = save_identity(data_dir, identity)
    reporter.event(
        "enrolled", f"enrolled as worker {identity.worker_id} ({identity.name}); token saved "
        f"in {path} (mode 0600); next time run dipaco-worker alone",
        worker_id=identity.worker_id,
    )  # fmt: skip
    return identity


def _retry_reporter(reporter: Reporter) -> Callable[[RetryAttempt], None]:
    def on_retry(attempt: RetryAttempt) -> None:
        reporter.event(
            "retry", f"{attempt.what} failed ({attempt.error}); try {attempt.attempt + 1} "
            f"in {attempt.wait_s:.1f} s", what=attempt.what, attempt=attempt.attempt,
        )  # fmt: skip

    return on_retry
