"""Control-plane load: N simulated volunteers against gunicorn + PostgreSQL + Redis (issue 9).

    .venv/bin/python bench/control_plane.py --volunteers 500 --duration 120
    .venv/bin/python bench/control_plane.py --volunteers 2000 --unit-seconds 300 --ramp 120 \
        --warmup 150 --duration 300 --json cp.json

Each volunteer is a coroutine with its own worker token running what `dipaco-worker`
does, without the training: heartbeat every 30 s (with its lease while it holds one),
lease a unit (when none is queued, wait as the agent does: 1 s, then 1.5x longer up to
30 s, or the server's Retry-After when longer), "train" for --unit-seconds (± 20%), ask
for upload URLs, PUT a small
payload per module to each presigned URL (the server checks each blob's size at
completion; content is the outer step's business, and no Celery worker runs here), then
complete. Every request opens its own connection (aiohttp), as volunteers 30 s apart would. The server is `dipaco server`'s
gunicorn command on a fresh PostgreSQL database, with Redis as the broker (completions
that fill a round send a task there), and the local blob store behind the same gunicorn.

Reported over the measured window (after --warmup): requests/s, p50/p99/max latency per
request kind and overall, errors; then, from the database, units lost (a completion the
client got 200 for that is not recorded) or duplicated (a unit completed under two
leases). Latencies are measured twice: in the client (when the client process is short
of CPU, or the server's accept queue is long, that waiting shows up there) and in the
server, from gunicorn's access log (%(M)s: from the parsed request to the response).
Figures and the command: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

HEARTBEAT_S = 30.0  # worker_agent.run: HeartbeatThread(interval_s=30.0)
IDLE_WAIT_S = (1.0, 30.0)  # worker_agent.agent: first and longest wait after a 204 (x1.5)
PAYLOAD_BYTES = 256
REQUEST_TIMEOUT_S = 30.0
CLOSE_AT = 0.95  # share of a round's units done before the bench closes it
# gunicorn's access log, with the time each request took in the server (%(M)s, ms): the
# server-side latency, without the client's own queueing when it is short of CPU.
ACCESS_FORMAT = 'bench-access %(t)s "%(m)s %(U)s" %(s)s %(M)s'
ACCESS_RE = re.compile(r'^bench-access \[([^\]]+)\] "(\S+) (\S+)" (\d+) (\d+)$')


# --- services and the server ------------------------------------------------------------


def with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


def create_database(admin_url: str, name: str) -> str:
    import psycopg

    with psycopg.connect(with_path(admin_url, "/postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_path(admin_url, f"/{name}")


def drop_database(admin_url: str, name: str) -> None:
    import psycopg

    with psycopg.connect(with_path(admin_url, "/postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def server_environ(database: str, redis: str, data_dir: Path, url: str) -> dict[str, str]:
    from dipaco_server.env import KNOWN_VARIABLES

    environ = {k: v for k, v in os.environ.items() if k not in KNOWN_VARIABLES}
    environ.update(
        DATABASE_URL=database, REDIS_URL=redis, DIPACO_DATA_DIR=str(data_dir),
        DIPACO_PUBLIC_URL=url, DJANGO_SETTINGS_MODULE="dipaco_server.settings",
        # Every simulated volunteer calls from 127.0.0.1: no per-address limit here.
        DIPACO_RATE_LIMIT_ADDRESS="off",
    )  # fmt: skip
    return environ


def seed(volunteers: int, units: int, paths: int) -> tuple[int, list[str]]:
    """A running run with about `units` queued units per round, and a token per volunteer."""
    from dipaco.config import LayoutConfig, RunConfig
    from dipaco_server.rounds.services import start_run
    from dipaco_server.runs import keys
    from dipaco_server.runs.services import create_run, publish_module_version, transition
    from dipaco_server.workers.services import create_enrollment_token, register_worker

    levels = 1 if paths == 1 else 2
    modules = round(paths ** (1 / levels))
    if modules**levels != paths:
        raise SystemExit(f"--paths {paths}: give 1 or a square (4, 9, 16, ...)")
    config = RunConfig.tiny(
        name="bench", rounds=100_000, replicas_per_path=math.ceil(units / paths),
        model={"hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
               "intermediate_size": 192, "vocab_size": 1024, "seq_len": 64},
        layout=LayoutConfig.grid(2, levels, modules),
    )  # fmt: skip
    run = create_run("bench", config.model_dump(mode="json"))
    for module in run.modules.all():
        # The bench never fetches weights (no manifest call): the rows are what leases need.
        key = keys.module_key(run.pk, module.module_id, 0)
        publish_module_version(module, 0, blob_key=key, sha256="0" * 64, size=1)
    run.paths.update(train_tokens=10_000_000)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=None, label="bench")
    tokens = [
        register_worker(enrollment, f"bench-{i}", {"gpu": "none"})[1] for i in range(volunteers)
    ]
    return run.pk, tokens


class RoundTurner(threading.Thread):
    """Closes a round and opens the next, as close_round and finish_round would, minus the
    outer step and the evaluation (no Celery worker runs here): once no unit is queued and
    CLOSE_AT of them are done (the quorum rule, with the deadline taken as passed), so a
    unit whose lease answer was lost to a timeout does not hold the round for 5 minutes."""

    def __init__(self, run_id: int) -> None:
        super().__init__(name="round-turner", daemon=True)
        self.run_id, self.stop, self.closed = run_id, threading.Event(), 0

    def run(self) -> None:
        from django.db import connections
        from django.db.models import Count, Q

        from dipaco_server.rounds.models import Round, WorkUnit
        from dipaco_server.rounds.services import mark_round_closed, mark_round_closing, open_round

        while not self.stop.wait(1.0):
            round_ = Round.objects.filter(run_id=self.run_id, state=Round.State.OPEN).first()
            if round_ is None:
                continue
            units = round_.units.aggregate(
                total=Count("pk"),
                queued=Count("pk", filter=Q(state=WorkUnit.State.QUEUED)),
                done=Count("pk", filter=Q(state=WorkUnit.State.DONE)),
            )
            if units["queued"] or units["done"] < CLOSE_AT * units["total"]:
                continue
            if mark_round_closing(round_):
                mark_round_closed(round_)
                open_round(round_.run, round_.t + 1)
                self.closed += 1
        connections.close_all()


# --- volunteers ---------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.samples: list[tuple[float, str, float]] = []  # (time, kind, latency s)
        self.errors: Counter[str] = Counter()
        self.completed: Counter[int] = Counter()  # unit id -> 200 completions
        self.granted: set[int] = set()  # lease ids the clients learned of
        self.idle = 0  # lease answers 204: nothing queued (the round is closing)


@dataclass
class Reply:
    status_code: int
    body: bytes
    headers: Mapping[str, str]

    def json(self) -> Any:
        return json.loads(self.body)


class Session:
    """The volunteers' HTTP client: aiohttp, a new connection per request.

    A real volunteer talks to the server every 30 s from its own machine, far apart for
    gunicorn's 2 s keep-alive, so every request opens a connection; so do these. aiohttp
    rather than httpx: httpx's connection pool spends CPU per request that grows with the
    number of connections in flight, and at 5,000 volunteers the client alone filled a
    core, measuring its own queue instead of the server.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True),
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
        )

    async def request(self, method: str, url: str, *, json: Any = None,
                      content: bytes | None = None, headers: Mapping[str, str] | None = None,
                      ) -> Reply:  # fmt: skip
        absolute = url if "://" in url else self.base_url + url
        async with self.http.request(method, absolute, json=json, data=content,
                                     headers=headers) as response:  # fmt: skip
            return Reply(response.status, await response.read(), response.headers)

    async def close(self) -> None:
        await self.http.close()


async def call(client: Session, stats: Stats, kind: str, method: str, url: str,
               **kwargs: Any) -> Reply | None:  # fmt: skip
    started = time.monotonic()
    try:
        response = await client.request(method, url, **kwargs)
    except (aiohttp.ClientError, TimeoutError) as exc:
        stats.errors[f"{kind} {type(exc).__name__}"] += 1
        return None
    stats.samples.append((started, kind, time.monotonic() - started))
    if response.status_code >= 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = ""
        stats.errors[f"{kind} {response.status_code} {code}".strip()] += 1
        return None
    return response


async def volunteer(client: Session, token: str, stats: Stats, args: argparse.Namespace,
                    stop: asyncio.Event) -> None:  # fmt: skip
    auth = {"Authorization": f"Bearer {token}"}
    rng = random.Random(token)
    payload = rng.randbytes(PAYLOAD_BYTES)
    digest = hashlib.sha256(payload).hexdigest()
    await asyncio.sleep(rng.uniform(0, args.ramp))
    next_beat = time.monotonic()

    async def beat(lease: dict[str, Any] | None) -> None:
        nonlocal next_beat
        if time.monotonic() < next_beat:
            return
        next_beat = time.monotonic() + HEARTBEAT_S
        headers = {**auth, **({"X-Lease-Secret": lease["lease_secret"]} if lease else {})}
        body = {"lease_id": lease["lease_id"] if lease else None}
        await call(client, stats, "heartbeat", "POST", "/api/v1/worker/heartbeat",
                   json=body, headers=headers)  # fmt: skip

    idle_wait = IDLE_WAIT_S[0]
    while not stop.is_set():
        await beat(None)
        response = await call(client, stats, "lease", "POST", "/api/v1/worker/lease", headers=auth)
        if response is None or response.status_code == 204:
            # As the agent does: back off 1 s, x1.5, up to 30 s, or the server's
            # Retry-After when that is longer (it grows with the idle crowd).
            hint = float(response.headers.get("Retry-After", 0)) if response is not None else 0
            stats.idle += response is not None
            await asyncio.sleep(max(idle_wait, hint))
            idle_wait = min(IDLE_WAIT_S[1], idle_wait * 1.5)
            continue
        idle_wait = IDLE_WAIT_S[0]
        lease = response.json()
        stats.granted.add(lease["lease_id"])
        headers = {**auth, "X-Lease-Secret": lease["lease_secret"]}
        done_at = time.monotonic() + args.unit_seconds * rng.uniform(0.8, 1.2)
        while (left := done_at - time.monotonic()) > 0 and not stop.is_set():
            await asyncio.sleep(min(left, max(0.0, next_beat - time.monotonic()) + 0.01))
            await beat(lease)
        if stop.is_set():
            return
        prefix = f"/api/v1/worker/lease/{lease['lease_id']}"
        urls = await call(client, stats, "upload-urls", "POST", f"{prefix}/upload-urls",
                          headers=headers)  # fmt: skip
        if urls is None:
            continue
        uploads = urls.json()["uploads"]
        puts = [call(client, stats, "put", "PUT", u["put_url"], content=payload) for u in uploads]
        if any(r is None for r in await asyncio.gather(*puts)):
            continue
        body = {
            "contributions": [
                {"module_id": u["module_id"], "sha256": digest, "size": PAYLOAD_BYTES}
                for u in uploads
            ],
            "tokens": 1, "metrics": {"loss": 1.0},
        }  # fmt: skip
        if await call(client, stats, "complete", "POST", f"{prefix}/complete", json=body,
                      headers=headers) is not None:  # fmt: skip
            stats.completed[lease["unit_id"]] += 1


async def load(url: str, tokens: list[str], args: argparse.Namespace) -> tuple[Stats, float, float]:
    stats, stop = Stats(), asyncio.Event()
    client = Session(url)
    try:
        tasks = [asyncio.create_task(volunteer(client, t, stats, args, stop)) for t in tokens]
        started = time.monotonic()
        window = (started + args.warmup, started + args.warmup + args.duration)
        await asyncio.sleep(args.warmup + args.duration)
        stop.set()
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
        for task in tasks:
            task.cancel()
    finally:
        await client.close()
    return stats, *window


# --- report -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def summarize(stats: Stats, start: float, end: float) -> dict[str, Any]:
    kinds: dict[str, list[float]] = defaultdict(list)
    for at, kind, latency in stats.samples:
        if start <= at < end:
            kinds[kind].append(latency)
            kinds["all"].append(latency)
    seconds = end - start
    return {
        kind: {"requests": len(v), "per_s": len(v) / seconds, "p50_ms": 1e3 * percentile(v, 0.5),
               "p99_ms": 1e3 * percentile(v, 0.99), "max_ms": 1e3 * max(v)}
        for kind, v in sorted(kinds.items())
    }  # fmt: skip


def request_kind(method: str, path: str) -> str | None:
    if method == "PUT" and path.startswith("/blobs/"):
        return "put"
    tail = path.rstrip("/").rsplit("/", 1)[-1]
    if path.startswith("/api/v1/worker/") and tail in ("heartbeat", "lease", "upload-urls",
                                                       "complete"):  # fmt: skip
        return tail
    return None


def server_side(log: Path, start: float, end: float) -> dict[str, Any]:
    """Per-kind latency as gunicorn measured it, over the same window (wall-clock times)."""
    kinds: dict[str, list[float]] = defaultdict(list)
    for line in log.read_text(errors="replace").splitlines():
        match = ACCESS_RE.match(line)
        if match is None:
            continue
        stamp, method, path, _status, millis = match.groups()
        at = datetime.strptime(stamp, "%d/%b/%Y:%H:%M:%S %z").timestamp()
        kind = request_kind(method, path)
        if kind is not None and start <= at < end:
            kinds[kind].append(int(millis) / 1e3)
            kinds["all"].append(int(millis) / 1e3)
    return {
        kind: {"requests": len(v), "p50_ms": 1e3 * percentile(v, 0.5),
               "p99_ms": 1e3 * percentile(v, 0.99)}
        for kind, v in sorted(kinds.items())
    }  # fmt: skip


def verify(run_id: int, stats: Stats) -> dict[str, int]:
    """Lost and duplicated units, from the database against what the clients were told."""
    from django.db.models import Count

    from dipaco_server.rounds.models import Contribution, Lease, WorkUnit

    done = set(
        WorkUnit.objects.filter(round__run_id=run_id, state=WorkUnit.State.DONE).values_list(
            "pk", flat=True
        )
    )
    twice = (
        Lease.objects.filter(unit__round__run_id=run_id, state=Lease.State.COMPLETED)
        .values("unit").annotate(n=Count("pk")).filter(n__gt=1).count()
    )  # fmt: skip
    contributed = set(
        Contribution.objects.filter(unit__round__run_id=run_id).values_list("unit", flat=True)
    )
    active = Lease.objects.filter(unit__round__run_id=run_id, state=Lease.State.ACTIVE)
    return {
        "completed_by_clients": len(stats.completed),
        "done_in_database": len(done),
        "lost": len(set(stats.completed) - done) + len(done - contributed),
        "duplicated": twice + sum(1 for n in stats.completed.values() if n > 1),
        "orphaned_leases": active.exclude(pk__in=stats.granted).count(),
    }


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{result['volunteers']} volunteers, {result['duration_s']:.0f} s measured, "
          f"unit {result['unit_seconds']:.0f} s, {result['web_workers']} gunicorn workers, "
          f"load {result['load_average']}")  # fmt: skip
    print(f"{'':<12}{'client side':>45}{'in the server':>20}")
    print(f"{'kind':<12}{'requests':>9}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'p50 ms':>10}{'p99 ms':>10}")  # fmt: skip
    for kind, row in result["latency"].items():
        server = result.get("server_latency", {}).get(kind, {})
        print(f"{kind:<12}{row['requests']:>9}{row['per_s']:>9.1f}{row['p50_ms']:>9.1f}"
              f"{row['p99_ms']:>9.1f}{row['max_ms']:>9.0f}"
              f"{server.get('p50_ms', math.nan):>10.1f}{server.get('p99_ms', math.nan):>10.1f}")  # fmt: skip
    print(f"errors: {dict(result['errors']) or 'none'}")
    print(f"units: {result['units']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volunteers", type=int, default=500, help="simulated volunteers")
    parser.add_argument("--duration", type=float, default=120.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before measuring")
    parser.add_argument("--unit-seconds", type=float, default=60.0, help="simulated training")
    parser.add_argument("--ramp", type=float, default=30.0, help="volunteers start over this")
    parser.add_argument("--web-workers", type=int, default=2, help="gunicorn workers")
    parser.add_argument("--paths", type=int, default=4, help="paths of the run (1 or a square)")
    parser.add_argument("--units-per-volunteer", type=float, default=1.0,
                        help="work units per round, per volunteer (default: one each)")  # fmt: skip
    parser.add_argument("--postgres", default=os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"))  # fmt: skip
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/12", help="flushed")
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()

    import redis

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))
    from dipaco.cli.server import child_commands
    from dipaco.demo.control import free_port

    name = f"dipaco_bench_{os.getpid()}"
    database = create_database(args.postgres, name)
    redis.Redis.from_url(args.redis).flushdb()
    work = Path(tempfile.mkdtemp(prefix="dipaco-bench-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    environ = server_environ(database, args.redis, work, url)
    os.environ.update(environ)
    server = None
    try:
        subprocess.run([sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
                       env=environ, check=True)  # fmt: skip
        from dipaco.cli.admin import setup_django

        setup_django()
        logging.getLogger("dipaco_server").setLevel(logging.WARNING)  # one line per worker
        units = round(args.volunteers * args.units_per_volunteer)
        print(f"seeding {units} units per round and {args.volunteers} workers ...", flush=True)
        run_id, tokens = seed(args.volunteers, units, args.paths)
        from django.db import connections

        connections.close_all()
        turner = RoundTurner(run_id)
        turner.start()
        command = child_commands("127.0.0.1", port, args.web_workers, 1)["web"]
        command += ["--access-logformat", ACCESS_FORMAT]
        log = (work / "web.log").open("ab")
        server = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        print(f"{args.volunteers} volunteers for {args.warmup:.0f} + {args.duration:.0f} s ...",
              flush=True)  # fmt: skip
        wall_offset = time.time() - time.monotonic()
        stats, start, end = asyncio.run(load(url, tokens, args))
        turner.stop.set()
        turner.join()
        result = {
            "volunteers": args.volunteers, "duration_s": end - start,
            "unit_seconds": args.unit_seconds, "web_workers": args.web_workers,
            "load_average": [round(x, 1) for x in os.getloadavg()],
            "latency": summarize(stats, start, end), "errors": dict(stats.errors),
            "server_latency": server_side(work / "web.log", start + wall_offset,
                                          end + wall_offset),
            "units": {**verify(run_id, stats), "units_per_round": units,
                      "rounds_closed": turner.closed, "idle_polls": stats.idle},
        }  # fmt: skip
        print_report(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        from django.db import connections

        connections.close_all()
        drop_database(args.postgres, name)
        redis.Redis.from_url(args.redis).flushdb()
        if not os.environ.get("DIPACO_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
