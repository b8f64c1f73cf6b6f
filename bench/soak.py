"""Soak: simulated volunteers through real rounds, with random kills (the platform survives
its workers dying at any moment).

    .venv/bin/python bench/soak.py --volunteers 500 --duration 600 --json soak.json
    .venv/bin/python bench/soak.py --volunteers 24 --units-per-volunteer 0.5 --duration 32 \\
        --unit-seconds 3 --lease-timeout 9 --round-deadline 12 --sweep-every 2 \\
        --kill-fraction 0.2 --celery-kill-every 20 --celery-kill-max 1 \\
        --visibility-timeout 10   # the short version tests/test_soak.py runs

Figures and what the machine was doing meanwhile: docs/reliability.md.

Over 600 lines: the volunteers, the kills and the checks that nothing was lost or done
twice are one experiment, read and run as one file (the protocol pieces are
bench/control_plane.py's).

What bench/control_plane.py does (its pieces are imported from there), plus everything a
round needs to really close: the web server (`dipaco server`'s gunicorn command), a real
Celery worker and Celery beat (its commands too) on Redis, a moto S3 server in its own
process, and a fresh PostgreSQL database. The run is a tiny model with real version-0
modules; every volunteer uploads a real, valid Δ per module (`dipaco.codecs.encode` of
small random tensors of the module's shapes, encoded once per module and reused), so the
outer steps verify, aggregate and publish real versions round after round.

Random kills, so that the soak exercises recovery and not just the happy path:
  * volunteers: a unit is abandoned with probability --kill-fraction at a random moment
    (before or after its uploads, never completed, no more heartbeats): its lease must
    expire (--lease-timeout, swept by beat every --sweep-every s) and the unit go to
    someone else. A fresh volunteer registers through the API in its place.
  * the Celery worker: `kill -9` of its whole process group about every
    --celery-kill-every s (0: never), restarted at once. Its unacknowledged tasks come
    back after the broker's visibility timeout, which this soak sets to
    --visibility-timeout (the project's default is 30 min). kombu looks for them only
    every unacked_restore_interval x unacked_restore_throttle s (10 x 10 by default, so
    a task killed mid-run came back 100 s later, whatever the visibility timeout); the
    soak makes that a fifth of the visibility timeout, so they come back in about 1.2x it,
    and lets a scan's mutex, if the kill catches a worker holding it, lapse after 30 s
    (not 300 s).

Settings the soak changes (a settings module that imports the project's and overrides
these): DIPACO_LEASE_TIMEOUT_S, DIPACO_ROUND_DEADLINE_S, the beat intervals, Celery's
default queue (unique per soak, so that it shares a Redis database safely) and the
visibility timeout. Nothing is flushed: the soak's keys live on its own queue.

Reported (and written with --json): duration, volunteers, rounds closed, units completed,
lost (a completion the client got 200 for that is not done in the database, or a done
unit of a closed round whose contribution was not accepted by its outer step), duplicated
(a unit completed under two leases or twice to a client, a contribution recorded twice,
an outer step counted twice), module versions skipped or applied twice, p50/p99 latency
per request kind, errors by kind and kills. Exits 1 when anything was lost or duplicated.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import control_plane
import httpx
from control_plane import (
    REQUEST_TIMEOUT_S,
    Stats,
    create_database,
    drop_database,
    server_environ,
    summarize,
    trained_tokens,
    unique,
)

ROOT = Path(__file__).resolve().parent.parent
IDLE_WAIT_S = (1.0, 30.0)  # worker_agent.agent: first and longest wait with no work, x1.5
READY_TIMEOUT_S = 90.0
DRAIN_TIMEOUT_S = 120.0
MODEL = {
    "hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
    "intermediate_size": 64, "vocab_size": 320, "seq_len": 16,
}  # fmt: skip

SETTINGS = """\
# Written by bench/soak.py: the project's settings with the soak's timings.
from dipaco_server.settings import *  # noqa: F403

DIPACO_LEASE_TIMEOUT_S = {lease_timeout!r}
DIPACO_ROUND_DEADLINE_S = {round_deadline!r}
CELERY_TASK_DEFAULT_QUEUE = {queue!r}
CELERY_BROKER_TRANSPORT_OPTIONS = {{
    "visibility_timeout": {visibility!r},
    "unacked_restore_interval": {restore_interval!r},
    "unacked_restore_throttle": 1,
    "unacked_mutex_expire": 30,
}}
CELERY_BEAT_SCHEDULE = {{
    "sweep-leases": {{"task": "dipaco_server.rounds.tasks.sweep_leases",
                     "schedule": {sweep!r}}},
    "close-ready-rounds": {{"task": "dipaco_server.rounds.tasks.close_ready_rounds",
                          "schedule": {sweep!r}}},
}}
"""


# --- services -----------------------------------------------------------------------------


def free_port() -> int:
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco_demo.control import free_port as port

    return port()


def wait_http(url: str, what: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited ({process.returncode}):\n{tail(log)}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} did not answer at {url} in {READY_TIMEOUT_S:.0f} s:\n{tail(log)}")


def tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def start(command: list[str], environ: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A child in its own process group (so a kill -9 takes its pool too), logging to `log`."""
    with log.open("ab") as out:
        return subprocess.Popen(
            command, env=environ, stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True, cwd=log.parent,
        )  # fmt: skip


def stop(process: subprocess.Popen[bytes] | None, grace: float = 20.0) -> None:
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        kill_group(process)


def kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


class CeleryWorker:
    """The compose/`dipaco server` worker command on the soak's queue, killable and restartable."""

    def __init__(self, command: list[str], environ: dict[str, str], log: Path) -> None:
        self.command, self.environ, self.log = command, environ, log
        self.lock = threading.Lock()
        self.process = start(command, environ, log)
        self.kills = 0

    def kill_and_restart(self) -> None:
        with self.lock:
            kill_group(self.process)
            self.kills += 1
            self.process = start(self.command, self.environ, self.log)

    def stop(self) -> None:
        with self.lock:
            stop(self.process)


# --- the run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Payload:
    data: bytes
    sha256: str


def seed(units: int, paths: int) -> tuple[int, str, dict[str, Payload]]:
    """A running run of a tiny model with real version-0 modules in the blob store, about
    `units` units per round, an enrollment token, and one valid Δ upload per module."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    import torch

    from dipaco import codecs
    from dipaco.config import LayoutConfig, RunConfig
    from dipaco.modular import init_modules, module_spec
    from dipaco.modules_file import write_module
    from dipaco_server.rounds.lifecycle.open import start_run
    from dipaco_server.runs import keys
    from dipaco_server.runs.services import create_run, transition
    from dipaco_server.runs.versions import publish_module_version
    from dipaco_server.storage import get_blob_store
    from dipaco_server.workers.services import create_enrollment_token

    levels = 1 if paths == 1 else 2
    modules = round(paths ** (1 / levels))
    if modules**levels != paths:
        raise SystemExit(f"--paths {paths}: give 1 or a square (4, 9, 16, ...)")
    config = RunConfig.tiny(
        name=f"soak-{uuid.uuid4().hex[:6]}", rounds=100_000, replicas_per_path=math.ceil(units / paths), model=MODEL,
        layout=LayoutConfig.grid(2, levels, modules),
    )  # fmt: skip
    run = create_run(config.name, config.model_dump(mode="json"))
    config = run.run_config
    store, weights = get_blob_store(), init_modules(config)
    scratch = Path(tempfile.mkdtemp(prefix="dipaco-soak-seed-"))
    payloads = {}
    generator = torch.Generator().manual_seed(0)
    for module in run.modules.all():
        file = scratch / f"{module.module_id}.safetensors"
        sha256, size = write_module(file, weights[module.module_id])
        key = keys.module_key(run.pk, module.module_id, 0)
        store.put_file(key, file)
        publish_module_version(module, 0, blob_key=key, sha256=sha256, size=size)
        delta = {
            name: torch.randn(shape, generator=generator) * 1e-3
            for name, (shape, _) in module_spec(config, module.module_id).items()
        }
        data = codecs.encode(delta, config.comm.codec, block_size=config.comm.block_size)
        payloads[module.module_id] = Payload(data, hashlib.sha256(data).hexdigest())
    shutil.rmtree(scratch, ignore_errors=True)
    run.paths.update(train_tokens=10_000_000)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=None, label="soak")
    return run.pk, enrollment, payloads


class Monitor(threading.Thread):
    """Rounds closed so far, from the database, for the progress line."""

    def __init__(self, run_id: int) -> None:
        super().__init__(name="soak-monitor", daemon=True)
        self.run_id, self.stop, self.closed, self.current = run_id, threading.Event(), 0, 0

    def run(self) -> None:
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from django.db import connections

        from dipaco_server.rounds.models import Round

        while not self.stop.wait(2.0):
            rounds = Round.objects.filter(run_id=self.run_id)
            self.closed = rounds.filter(state=Round.State.CLOSED).count()
            self.current = max(rounds.values_list("t", flat=True), default=0)
        connections.close_all()


# --- volunteers ---------------------------------------------------------------------------


@dataclass
class Soak:
    args: argparse.Namespace
    enrollment: str
    payloads: dict[str, Payload]
    stats: Stats = field(default_factory=Stats)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    kills: Counter[str] = field(default_factory=Counter)
    registered: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))


async def pause(soak: Soak, seconds: float) -> None:
    """Sleep, but wake as soon as the soak stops: it ends on time, not after every backoff."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(soak.stop.wait(), max(0.0, seconds))


async def call(client: httpx.AsyncClient, stats: Stats, kind: str, method: str, url: str,
               **kwargs: Any) -> httpx.Response | None:  # fmt: skip
    """One request; None when it failed: control_plane.call's bookkeeping, over httpx."""
    response: httpx.Response | None = await control_plane.call(
        client, stats, kind, method, url, transport_errors=(httpx.HTTPError,), **kwargs
    )
    return response


async def upload(client: httpx.AsyncClient, stats: Stats, target: dict[str, Any],
                 data: bytes) -> httpx.Response | None:  # fmt: skip
    """One module's Δ: the presigned PUT where there is one, else the presigned form POST
    (S3 offers no PUT: its put_url is empty)."""
    if target.get("put_url"):
        return await call(client, stats, "put", "PUT", target["put_url"], content=data)
    post = target["post"]
    files = {"file": ("delta.safetensors", data, "application/octet-stream")}
    return await call(client, stats, "put", "POST", post["url"], data=post["fields"],
                      files=files)  # fmt: skip


async def register(client: httpx.AsyncClient, soak: Soak) -> str | None:
    soak.registered += 1
    body = {"enrollment_token": soak.enrollment, "name": f"soak-{soak.registered}",
            "device": {"gpu": "none"}}  # fmt: skip
    for _ in range(10):
        response = await call(client, soak.stats, "register", "POST", "/api/v1/worker/register",
                              json=body)  # fmt: skip
        if response is not None:
            return str(response.json()["token"])
        await pause(soak, 2.0)
    return None


async def volunteer(client: httpx.AsyncClient, soak: Soak, ramp: float) -> None:
    """One volunteer until the soak stops or it is killed; then a fresh one takes its place."""
    await pause(soak, soak.rng.uniform(0, ramp))
    while not soak.stop.is_set():  # a killed volunteer is replaced at once, as by its owner
        token = await register(client, soak)
        if token is None or await lifetime(client, soak, token, random.Random(token)):
            return


async def lifetime(client: httpx.AsyncClient, soak: Soak, token: str, rng: random.Random) -> bool:
    """Lease, heartbeat, upload, complete, until stopped (True) or killed (False)."""
    args, stats = soak.args, soak.stats
    auth = {"Authorization": f"Bearer {token}"}
    beat_every, next_beat = 30.0, 0.0

    async def beat(lease: dict[str, Any] | None) -> None:
        nonlocal next_beat
        if time.monotonic() < next_beat:
            return
        next_beat = time.monotonic() + beat_every
        headers = {**auth, **({"X-Lease-Secret": lease["lease_secret"]} if lease else {})}
        await call(client, stats, "heartbeat", "POST", "/api/v1/worker/heartbeat",
                   json={"lease_id": lease["lease_id"] if lease else None},
                   headers=headers)  # fmt: skip

    wait = IDLE_WAIT_S[0]
    while not soak.stop.is_set():
        await beat(None)
        response = await call(client, stats, "lease", "POST", "/api/v1/worker/lease", headers=auth)
        if response is None or response.status_code == 204:
            stats.idle += response is not None
            await pause(soak, wait * rng.uniform(0.8, 1.2))
            wait = min(IDLE_WAIT_S[1], wait * 1.5)
            continue
        wait = IDLE_WAIT_S[0]
        lease = response.json()
        stats.granted.add(lease["lease_id"])
        beat_every = float(lease["heartbeat_interval_s"])
        next_beat = time.monotonic() + beat_every
        headers = {**auth, "X-Lease-Secret": lease["lease_secret"]}
        seconds = args.unit_seconds * rng.uniform(0.8, 1.2)
        dies = rng.random() < args.kill_fraction
        # A dying volunteer stops mid-training, or after its uploads and before completing.
        before_upload = dies and rng.random() < 0.7
        train = seconds * rng.uniform(0.1, 0.9) if before_upload else seconds
        done_at = time.monotonic() + train
        while (left := done_at - time.monotonic()) > 0 and not soak.stop.is_set():
            await pause(soak, min(left, max(0.0, next_beat - time.monotonic()) + 0.01))
            await beat(lease)
        if soak.stop.is_set():
            return True
        if before_upload:
            soak.kills["volunteer mid-training"] += 1
            return False
        prefix = f"/api/v1/worker/lease/{lease['lease_id']}"
        urls = await call(client, stats, "upload-urls", "POST", f"{prefix}/upload-urls",
                          headers=headers)  # fmt: skip
        if urls is None:
            continue
        uploads = urls.json()["uploads"]
        # Bytes of their own per upload, or the outer step refuses all but one as replays.
        deltas = {u["module_id"]: unique(soak.payloads[u["module_id"]].data,
                                         f"{token[-16:]}-{lease['lease_id']}")
                  for u in uploads}  # fmt: skip
        puts = [upload(client, stats, u, deltas[u["module_id"]]) for u in uploads]
        if any(r is None for r in await asyncio.gather(*puts)):
            continue
        if dies:
            soak.kills["volunteer after upload"] += 1
            return False
        body = {
            "contributions": [
                {"module_id": u["module_id"],
                 "sha256": hashlib.sha256(deltas[u["module_id"]]).hexdigest(),
                 "size": len(deltas[u["module_id"]])}
                for u in uploads
            ],
            "tokens": trained_tokens(lease), "metrics": {"loss": 1.0},
        }  # fmt: skip
        if await call(client, stats, "complete", "POST", f"{prefix}/complete", json=body,
                      headers=headers) is not None:  # fmt: skip
            stats.completed[lease["unit_id"]] += 1
    return True


async def celery_killer(soak: Soak, worker: CeleryWorker) -> None:
    every, most = soak.args.celery_kill_every, soak.args.celery_kill_max
    if every <= 0:
        return
    while not most or soak.kills["celery worker kill -9"] < most:
        try:
            await asyncio.wait_for(soak.stop.wait(), every * soak.rng.uniform(0.5, 1.5))
            return
        except TimeoutError:
            await asyncio.to_thread(worker.kill_and_restart)
            soak.kills["celery worker kill -9"] += 1


async def load(url: str, soak: Soak, worker: CeleryWorker, monitor: Monitor) -> float:
    # rich: only for the report
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    args = soak.args
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        tasks = [
            asyncio.create_task(volunteer(client, soak, args.ramp)) for _ in range(args.volunteers)
        ]
        killer = asyncio.create_task(celery_killer(soak, worker))
        started = time.monotonic()
        columns = (
            TextColumn("soak"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.description}"),
        )
        with Progress(*columns, refresh_per_second=2, disable=args.quiet) as progress:
            bar = progress.add_task("", total=args.duration)
            while (elapsed := time.monotonic() - started) < args.duration or (
                monitor.closed < args.min_rounds and elapsed < args.max_duration
            ):
                errors = sum(soak.stats.errors.values())
                progress.update(bar, completed=elapsed, description=(
                    f"round {monitor.current} ({monitor.closed} closed)  "
                    f"units {len(soak.stats.completed)}  kills {sum(soak.kills.values())}  "
                    f"errors {errors}  requests {len(soak.stats.samples)}"
                ))  # fmt: skip
                await asyncio.sleep(1.0)
            progress.update(bar, completed=args.duration)
        soak.stop.set()
        await killer
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
        for task in tasks:
            task.cancel()
    return started


# --- verification -------------------------------------------------------------------------


def drain(run_id: int) -> None:
    """Wait for a round that is closing, or that the last completions made ready, to close:
    its outer steps are under way or queued, and counting now would call them lost."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco_server.rounds.lifecycle.close import round_ready_to_close
    from dipaco_server.rounds.models import Round

    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while time.monotonic() < deadline:
        rounds = Round.objects.filter(
            run_id=run_id, state__in=[Round.State.OPEN, Round.State.CLOSING]
        )
        if not any(r.state == Round.State.CLOSING or round_ready_to_close(r) for r in rounds):
            return
        time.sleep(1.0)


def verify(run_id: int, stats: Stats) -> dict[str, Any]:
    """Lost and duplicated units, contributions, outer steps and versions, from the database."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from django.db.models import Count

    from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round, WorkUnit
    from dipaco_server.runs.models import Module, ModuleVersion

    closed = set(
        Round.objects.filter(run_id=run_id, state=Round.State.CLOSED).values_list("pk", flat=True)
    )
    done = dict(
        WorkUnit.objects.filter(round__run_id=run_id, state=WorkUnit.State.DONE).values_list(
            "pk", "round_id"
        )
    )
    contributions = Contribution.objects.filter(unit__round__run_id=run_id)
    accepted = set(
        contributions.filter(status=Contribution.Status.ACCEPTED).values_list("unit", flat=True)
    )
    not_accepted = set(
        contributions.exclude(status=Contribution.Status.ACCEPTED).values_list("unit", flat=True)
    )
    # A done unit of a closed round must have every contribution accepted by its outer step.
    unstepped = {
        u for u, r in done.items() if r in closed and (u in not_accepted or u not in accepted)
    }
    twice_leased = (
        Lease.objects.filter(unit__round__run_id=run_id, state=Lease.State.COMPLETED)
        .values("unit").annotate(n=Count("pk")).filter(n__gt=1).count()
    )  # fmt: skip
    twice_recorded = (
        contributions.values("unit", "module").annotate(n=Count("pk")).filter(n__gt=1).count()
    )
    # Each outer step must count exactly the contributions accepted for its round and module.
    per_step = Counter(
        (r, m)
        for r, m in contributions.filter(status=Contribution.Status.ACCEPTED).values_list(
            "unit__round_id", "module_id"
        )
    )
    steps = list(OuterStep.objects.filter(round__run_id=run_id))
    miscounted = sum(1 for s in steps if s.accepted != per_step.get((s.round_id, s.module_id), 0))
    skipped = applied_twice = 0
    for module in Module.objects.filter(run_id=run_id):
        versions = sorted(
            ModuleVersion.objects.filter(module=module).values_list("version", flat=True)
        )
        stepped = [s for s in steps if s.module_id == module.pk and s.version is not None]
        skipped += (versions[-1] + 1 - len(set(versions))) if versions else 0
        skipped += sum(1 for s in steps if s.module_id == module.pk and s.version is None)
        applied_twice += len(versions) - len(set(versions))
        applied_twice += len(stepped) - len({s.version for s in stepped})
        skipped += len(closed) - len({s.round_id for s in stepped if s.round_id in closed})
    completed = set(stats.completed)
    open_done = sum(1 for r in done.values() if r not in closed)
    return {
        "rounds_closed": len(closed),
        "completed_by_clients": len(completed),
        "done_in_database": len(done),
        "done_in_open_rounds": open_done,
        "lost": len(completed - set(done)) + len(unstepped),
        "duplicated": twice_leased
        + twice_recorded
        + miscounted
        + sum(1 for n in stats.completed.values() if n > 1),
        "outer_steps": len(steps),
        "versions_skipped": skipped,
        "versions_applied_twice": applied_twice,
        "leases_expired": Lease.objects.filter(
            unit__round__run_id=run_id, state=Lease.State.EXPIRED
        ).count(),
        "units_given_up": WorkUnit.objects.filter(
            round__run_id=run_id, state=WorkUnit.State.EXPIRED
        ).count(),
    }


def print_report(result: dict[str, Any]) -> None:
    # rich: only for the report
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"\n{result['volunteers']} volunteers, {result['duration_s']:.0f} s, unit "
        f"{result['unit_seconds']:.0f} s, lease timeout {result['lease_timeout_s']:.0f} s, "
        f"load average {result['load_average']}"
    )
    table = Table("kind", "requests", "req/s", "p50 ms", "p99 ms", "max ms")
    for kind, row in result["latency"].items():
        table.add_row(kind, str(row["requests"]), f"{row['per_s']:.1f}", f"{row['p50_ms']:.1f}",
                      f"{row['p99_ms']:.1f}", f"{row['max_ms']:.0f}")  # fmt: skip
    console.print(table)
    console.print(f"units: {result['units']}")
    console.print(f"kills: {result['kills']}")
    console.print(f"errors: {result['errors'] or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volunteers", type=int, default=500, help="simulated volunteers")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument(
        "--min-rounds",
        type=int,
        default=0,
        help="keep the load on past --duration until this many rounds closed "
        "(a slow or busy machine still sees round boundaries)",
    )
    parser.add_argument(
        "--max-duration",
        type=float,
        default=0.0,
        help="... but never past this many seconds (default: 3x --duration)",
    )
    parser.add_argument("--unit-seconds", type=float, default=120.0, help="simulated training")
    parser.add_argument("--ramp", type=float, default=30.0, help="volunteers start over this")
    parser.add_argument("--units-per-volunteer", type=float, default=1.0,
                        help="work units per round, per volunteer")  # fmt: skip
    parser.add_argument("--paths", type=int, default=4, help="paths of the run (1 or a square)")
    parser.add_argument("--kill-fraction", type=float, default=0.05,
                        help="share of units whose volunteer dies before completing")  # fmt: skip
    parser.add_argument("--celery-kill-every", type=float, default=150.0,
                        help="kill -9 the Celery worker about this often, seconds (0: never)")  # fmt: skip
    parser.add_argument("--celery-kill-max", type=int, default=0,
                        help="kill the Celery worker at most this often (0: no limit)")  # fmt: skip
    parser.add_argument("--lease-timeout", type=float, default=180.0, help="DIPACO_LEASE_TIMEOUT_S")
    parser.add_argument("--round-deadline", type=float, default=200.0,
                        help="DIPACO_ROUND_DEADLINE_S: after it a quorum closes a round")  # fmt: skip
    parser.add_argument("--sweep-every", type=float, default=5.0,
                        help="beat interval of sweep-leases and close-ready-rounds")  # fmt: skip
    parser.add_argument("--visibility-timeout", type=float, default=60.0,
                        help="seconds before a killed worker's task is delivered again")  # fmt: skip
    parser.add_argument("--web-workers", type=int, default=4, help="gunicorn workers")
    parser.add_argument("--task-concurrency", type=int, default=2, help="Celery pool size")
    parser.add_argument("--postgres", default=os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"))  # fmt: skip
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/11",
                        help="broker and results; the soak uses its own queue, flushes nothing")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args()
    args.max_duration = args.max_duration or 3 * args.duration
    return soak(args)


def soak_environ(
    args: argparse.Namespace, database: str, work: Path, url: str, s3_port: int, bucket: str
) -> dict[str, str]:
    """The server's environment: control_plane's, with the soak's settings module and S3."""
    # Soak sets its own S3 variables below; no DB pool (as before), the default grant rate.
    defaults = argparse.Namespace(
        db_pool="off", grant_rate=None, shed_after=None, scrape_every=None
    )
    environ = server_environ(database, args.redis, work / "data", url, {}, defaults)
    environ.update(
        DJANGO_SETTINGS_MODULE="soak_settings", OMP_NUM_THREADS="1",
        # Every simulated volunteer comes from 127.0.0.1: one address, hundreds of
        # workers. The per-token limit stays at the project's default.
        DIPACO_RATE_LIMIT_ADDRESS="off",
        PYTHONPATH=os.pathsep.join([str(work), str(ROOT / "platform"),
                                    os.environ.get("PYTHONPATH", "")]),
        S3_ENDPOINT_URL=f"http://127.0.0.1:{s3_port}", S3_BUCKET=bucket,
        S3_ACCESS_KEY_ID="soak", S3_SECRET_ACCESS_KEY="soak", S3_REGION="us-east-1",
    )  # fmt: skip
    return environ


def start_s3(
    environ: dict[str, str], work: Path, s3_port: int, bucket: str
) -> subprocess.Popen[bytes]:
    """A moto S3 server in its own process, with the run's bucket."""
    import boto3  # ~0.2 s to import: only for the bucket

    moto = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)]
    process = start(moto, environ, work / "s3.log")
    wait_http(environ["S3_ENDPOINT_URL"], "the S3 server", process, work / "s3.log")
    boto3.client("s3", endpoint_url=environ["S3_ENDPOINT_URL"], aws_access_key_id="soak",
                 aws_secret_access_key="soak", region_name="us-east-1",
                 ).create_bucket(Bucket=bucket)  # fmt: skip
    return process


def soak_result(
    args: argparse.Namespace,
    state: Soak,
    window_s: tuple[float, float],
    units: int,
    units_report: dict[str, Any],
) -> dict[str, Any]:
    started, ended = window_s
    window = [s for s in state.stats.samples if started <= s[0] < ended]
    return {
        "volunteers": args.volunteers, "duration_s": ended - started,
        "unit_seconds": args.unit_seconds, "lease_timeout_s": args.lease_timeout,
        "kill_fraction": args.kill_fraction, "celery_kill_every_s": args.celery_kill_every,
        "web_workers": args.web_workers, "task_concurrency": args.task_concurrency,
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "registered": state.registered, "units_per_round": units,
        "latency": summarize(window, ended - started),
        "errors": dict(state.stats.errors), "kills": dict(state.kills),
        "units": {**units_report, "idle_polls": state.stats.idle},
    }  # fmt: skip


def soak(args: argparse.Namespace) -> int:
    from moto.server import ThreadedMotoServer  # noqa: F401 - fail early without moto[server]

    sys.path.insert(0, str(ROOT / "platform"))
    from dipaco_server.cli.server import child_commands  # platform/ is on sys.path (above)

    tag = f"soak-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    name = tag.replace("-", "_")
    work = Path(tempfile.mkdtemp(prefix="dipaco-soak-"))
    (work / "soak_settings.py").write_text(SETTINGS.format(
        lease_timeout=args.lease_timeout, round_deadline=args.round_deadline, queue=tag,
        visibility=args.visibility_timeout, sweep=args.sweep_every,
        restore_interval=max(1, round(args.visibility_timeout / 5)),
    ))  # fmt: skip
    port, s3_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    bucket = name.replace("_", "-")
    processes: list[subprocess.Popen[bytes]] = []
    worker: CeleryWorker | None = None
    keep = os.environ.get("SOAK_KEEP_LOGS") is not None
    database = create_database(args.postgres, name)
    try:
        environ = soak_environ(args, database, work, url, s3_port, bucket)
        processes.append(start_s3(environ, work, s3_port, bucket))
        os.environ.update(environ)
        sys.path.insert(0, str(work))
        subprocess.run([sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
                       env=environ, check=True)  # fmt: skip
        from dipaco_server.cli.admin import setup_django  # platform/ is on sys.path

        setup_django()
        logging.getLogger("dipaco_server").setLevel(logging.WARNING)
        units = round(args.volunteers * args.units_per_volunteer)
        print(f"seeding a run of {units} units per round ...", flush=True)
        run_id, enrollment, payloads = seed(units, args.paths)
        from django.db import connections  # Django: set up above

        connections.close_all()
        commands = child_commands("127.0.0.1", port, args.web_workers, args.task_concurrency)
        processes.append(start(commands["web"], environ, work / "web.log"))
        worker_command = [*commands["worker"], f"--queues={tag}", f"--hostname={tag}@%h"]
        worker = CeleryWorker(worker_command, environ, work / "worker.log")
        beat = [*commands["beat"], f"--schedule={work / 'celerybeat-schedule'}"]
        processes.append(start(beat, environ, work / "beat.log"))
        wait_http(f"{url}/api/v1/health", "the web server", processes[1], work / "web.log")
        monitor = Monitor(run_id)
        monitor.start()
        print(f"{args.volunteers} volunteers for {args.duration:.0f} s (logs: {work}) ...",
              flush=True)  # fmt: skip
        state = Soak(args, enrollment, payloads)
        started = asyncio.run(load(url, state, worker, monitor))
        ended = time.monotonic()
        monitor.stop.set()
        monitor.join()
        drain(run_id)
        units_report = verify(run_id, state.stats)
        result = soak_result(args, state, (started, ended), units, units_report)
        print_report(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        failed = units_report["lost"] or units_report["duplicated"]
        failed = (
            failed or units_report["versions_skipped"] or units_report["versions_applied_twice"]
        )
        if failed:
            keep = True
            print(f"logs kept in {work}", file=sys.stderr)
        return 1 if failed else 0
    finally:
        if worker is not None:
            worker.stop()
        for process in reversed(processes):
            stop(process)
        from django.db import connections  # Django: set up above

        connections.close_all()
        drop_database(args.postgres, name)
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
