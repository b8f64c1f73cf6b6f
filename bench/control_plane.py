"""Control-plane load: N simulated volunteers against the real control plane.

    .venv/bin/python bench/control_plane.py --volunteers 500 --unit-seconds 60 --duration 300
    .venv/bin/python bench/control_plane.py --volunteers 10000 --unit-seconds 120 --ramp 120 \
        --warmup 150 --duration 600 --json docs/figures/control_plane.json

Each volunteer is a coroutine with its own worker token running what `dipaco-worker`
does, without the training: heartbeat every 30 s at first, then as often as the server's
last answer said (`heartbeat_interval_s`, as worker_agent.heartbeat does; with its lease while it holds one; a
"release" instruction ends the unit), lease a unit (when none is granted, wait as the
agent does: 1 s, then 1.5x longer up to 30 s, or the server's Retry-After when longer),
"train" for --unit-seconds (± 20%), ask for upload URLs, send a real encoded Δ of each
module to its presigned S3 form POST, then complete. The Δs are real: the run has token
shards in S3 as preparation leaves them, and the bench trains each path once per set of
module versions a lease names (`Deltas`, in a thread beside the client), so the outer step
verifies and scores every upload as it would a volunteer's; the units of one path and
round share that Δ, each upload's bytes made unique in its header (or the outer step would
reject all but one as replays). Every request opens its own connection (aiohttp), as volunteers 30 s
apart would.

The server is the real thing, scaled out on one machine: --web-servers gunicorn masters
(`dipaco server`'s command, sharing one port through SO_REUSEPORT) of --web-workers
processes each, --celery-workers Celery workers and Celery beat, all on one fresh
PostgreSQL database (with DIPACO_DB_POOL, Django's pooled psycopg connections), one Redis,
and a moto S3 server holding the run's real module blobs. Rounds are turned by the
platform: completions send close_round, the Celery outer step verifies and aggregates
every upload and publishes the next versions, finish_round opens the next round.

Reported over the measured window (after --warmup): requests/s, p50/p99/max latency per
request kind and overall, counting timed-out and failed requests (at the time they took)
in the percentiles and in `error_rate`; p99 over the round boundaries in the window
(from a round's closing to DIPACO_GRANT_RATE's spread after the next opening). Units:
lost (a volunteer trained it but could not hand it in: a refused or failed upload or
completion after the agent's retries (8 tries over about 2 minutes, every try counted in
the figures), a "release" instruction, unless the database shows it completed anyway; or a
completion the client got 200 for that is not recorded) and duplicated (a unit completed
under two leases, or twice to a client). Latencies are also read from gunicorn's access
log (in the server: from the parsed request to the response), and the CPU the web, Celery
and S3 processes used per request. With --scrape-every S, a Prometheus-like client
scrapes /metrics every S seconds through the window (its latency), and after the load one
scrape's web + PostgreSQL CPU is measured on the final state, as a share of the server's
CPU at a 15 s scrape interval. Figures and the commands: docs/benchmarks.md.

Over 1,000 lines: the volunteers speak the worker protocol by hand (thousands in one
process, so not the agent), and the server they load is started, measured and torn down
here, so one file is the whole experiment; bench/soak.py imports its pieces.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
import httpx

from dipaco.retry import (
    HAND_IN_PAUSE_S,
    Backoff,
    delays,
    hand_in_patience_s,
    idle_pause_s,
    transient_status,
)

HEARTBEAT_S = 30.0  # worker_agent.run: HeartbeatThread(interval_s=30.0), until the server says
IDLE_WAIT_S = (1.0, 30.0)  # worker_agent.agent: first and longest wait after a 204 (x1.5)
REQUEST_TIMEOUT_S = 30.0
# worker_agent.client: every call is tried again after a failure a later try may not see
# (transport, time-out, 5xx, 408, 429), up to Backoff()'s 8 tries over about 2 minutes,
# waiting the server's Retry-After when longer; then the agent gives up the unit.
RETRY = Backoff()
ANY_ERROR = tuple(range(400, 600))
BOUNDARY_TAIL_S = 30.0  # a boundary's window: closing .. opening + units / grant rate + this
LAG_TICK_S = 0.5  # how often loop_lag measures the client's event loop
BACKEND_SAMPLE_S = 20.0  # how often the window samples the database backends' CPU
GRANT_RATE = 50.0  # rounds.policy's DIPACO_GRANT_RATE default, unless --grant-rate
CHECK_OFFSET = (
    1_000_000  # rounds.verification.replication: check copies' replica indices start here
)
# gunicorn's access log, with the time each request took in the server (%(M)s, ms): the
# server-side latency, without the client's own queueing when it is short of CPU.
ACCESS_FORMAT = 'bench-access %(t)s "%(m)s %(U)s" %(s)s %(M)s'
ACCESS_RE = re.compile(r'^bench-access \[([^\]]+)\] "(\S+) (\S+)" (\d+) (\d+)$')
SCRAPE_TOKEN = "bench-metrics-scrape-token-0123456789"  # DIPACO_METRICS_TOKEN of the server
SCRAPE_COST_SCRAPES = 20  # back-to-back scrapes whose CPU gives one scrape's
MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
         "intermediate_size": 64, "vocab_size": 256, "seq_len": 32}  # fmt: skip


# --- services and the server ------------------------------------------------------------


def with_path(url: str, path: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=path))


def create_database(admin_url: str, name: str) -> str:
    # the server's database driver, for the bench's own database only
    import psycopg

    with psycopg.connect(with_path(admin_url, "/postgres"), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return with_path(admin_url, f"/{name}")


def drop_database(admin_url: str, name: str) -> None:
    # the server's database driver, for the bench's own database only
    import psycopg

    with psycopg.connect(with_path(admin_url, "/postgres"), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def start_s3(port: int, log: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A moto S3 server in its own process, with a bucket: the S3_* variables for it."""
    # boto3 (~0.2 s to import): only for the S3 server
    import boto3

    command = [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)]
    server = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT)
    environ = {"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "S3_BUCKET": "bench",
               "S3_ACCESS_KEY_ID": "bench", "S3_SECRET_ACCESS_KEY": "bench",
               "S3_REGION": "us-east-1"}  # fmt: skip
    client = boto3.client("s3", endpoint_url=environ["S3_ENDPOINT_URL"], region_name="us-east-1",
                          aws_access_key_id="bench", aws_secret_access_key="bench")  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket="bench")
            return server, environ
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def server_environ(database: str, redis: str, data_dir: Path, url: str,
                   s3: Mapping[str, str], args: argparse.Namespace) -> dict[str, str]:  # fmt: skip
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco_server.env import KNOWN_VARIABLES

    environ = {k: v for k, v in os.environ.items() if k not in KNOWN_VARIABLES}
    environ.update(
        DATABASE_URL=database, REDIS_URL=redis, DIPACO_DATA_DIR=str(data_dir),
        DIPACO_PUBLIC_URL=url, DJANGO_SETTINGS_MODULE="dipaco_server.settings",
        # Every simulated volunteer calls from 127.0.0.1: no per-address limit here.
        DIPACO_RATE_LIMIT_ADDRESS="off", DIPACO_DB_POOL=str(args.db_pool),
        OMP_NUM_THREADS="1", **s3,
    )  # fmt: skip
    if args.grant_rate:
        environ["DIPACO_GRANT_RATE"] = str(args.grant_rate)
    if args.shed_after:
        environ["DIPACO_SHED_AFTER_S"] = args.shed_after
    if args.scrape_every:
        environ["DIPACO_METRICS_TOKEN"] = SCRAPE_TOKEN
    return environ


SHARD_TOKENS = {"train": 65_536, "val": 4_096}  # per path: 2,048 and 128 windows of 32


def corpus(n: int, seed: int, vocab: int) -> Any:
    """A learnable token stream: a few repeating phrases with 5 % noise. Trained Δs lower
    its loss on any window, so the outer step's proof of useful work accepts them."""
    # numpy: only for the Δs made here
    import numpy as np

    rng = np.random.default_rng(seed)
    phrases = [np.random.default_rng(k).integers(1, vocab, size=12) for k in range(6)]
    out = np.concatenate([phrases[i] for i in rng.integers(0, 6, size=n // 12 + 1)])[:n]
    noise = rng.random(n) < 0.05
    out[noise] = rng.integers(1, vocab, size=int(noise.sum()))
    return out


class Deltas:
    """Each unit's Δ bytes per module: trained, as a volunteer would, on the unit's path
    shard from the module versions its lease names, once per (path, versions) and shared by
    the units that have both (each upload made unique by `unique`). A Δ replayed from an
    older version stops lowering the loss after a round or two, and the outer step's proof
    of useful work then refuses it, as it should. Trained in a thread beside the client:
    about a second per path per round for this model."""

    def __init__(self, run_id: int, shards: Path) -> None:
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from dipaco.data.shards import TokenShard, token_dtype
        from dipaco.data.windows import ShardSource
        from dipaco_server.runs.models import Run

        self.run_id = run_id
        self.config = Run.objects.get(pk=run_id).run_config
        dtype = token_dtype(self.config.model.vocab_size)
        self.sources = {
            p: ShardSource.for_path(TokenShard(shards / str(p) / "train.bin", dtype), self.config, p)
            for p in range(self.config.layout.num_paths)
        }  # fmt: skip
        self.ready: dict[tuple[int, tuple[tuple[str, int], ...]], asyncio.Future[Any]] = {}

    async def get(self, path: int, versions: Mapping[str, int], t: int) -> Mapping[str, bytes]:
        key = (path, tuple(sorted(versions.items())))
        if key not in self.ready:
            loop = asyncio.get_running_loop()
            self.ready[key] = loop.run_in_executor(None, self.train, path, dict(versions), t)
        result: Mapping[str, bytes] = await self.ready[key]
        return result

    def train(self, path: int, versions: dict[str, int], t: int) -> dict[str, bytes]:
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from django.db import connection

        from dipaco import codecs
        from dipaco.inner import train_path
        from dipaco.modular import module_spec
        from dipaco.modules_file import read_module
        from dipaco_server.runs.models import ModuleVersion
        from dipaco_server.storage import get_blob_store

        store, base = get_blob_store(), {}
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for module_id, version in versions.items():
                    row = ModuleVersion.objects.get(
                        module__run_id=self.run_id, module__module_id=module_id, version=version
                    )
                    file = Path(tmp) / f"{module_id}.safetensors"
                    store.download_to(row.blob_key, file)
                    spec = module_spec(self.config, module_id)
                    base[module_id] = read_module(file, spec, row.sha256)
        finally:
            connection.close()  # this executor thread's own connection
        trained = train_path(self.config, path, base, self.sources[path], round_index=t,
                             start_position=0)  # fmt: skip
        return {
            m: codecs.encode(d, self.config.comm.codec) for m, d in trained.module_deltas.items()
        }


def seed(
    volunteers: int, units: int, paths: int, work: Path, overlap: str = "none"
) -> tuple[int, list[str], Deltas]:
    """A running run with about `units` queued units per round, its modules' real version-0
    blobs and its paths' real token shards (written under `work`) in S3, a token per
    volunteer, and the Δs its units upload (`Deltas`)."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco.config import LayoutConfig, RunConfig
    from dipaco.data.shards import ShardIndex, ShardInfo, token_dtype
    from dipaco.modular import init_modules
    from dipaco.modules_file import write_module
    from dipaco_server.rounds.lifecycle.open import start_run
    from dipaco_server.runs import keys
    from dipaco_server.runs.prepare import upload_shards
    from dipaco_server.runs.services import create_run, transition
    from dipaco_server.runs.versions import publish_module_version
    from dipaco_server.storage import get_blob_store
    from dipaco_server.workers.services import create_enrollment_token, register_worker

    levels = 1 if paths == 1 else 2
    modules = round(paths ** (1 / levels))
    if modules**levels != paths:
        raise SystemExit(f"--paths {paths}: give 1 or a square (4, 9, 16, ...)")
    config = RunConfig.tiny(
        name="bench", rounds=100_000, replicas_per_path=math.ceil(units / paths),
        model=MODEL, layout=LayoutConfig.grid(2, levels, modules), outer={"overlap": overlap},
    )  # fmt: skip
    run = create_run("bench", config.model_dump(mode="json"))
    config = run.run_config
    store, weights = get_blob_store(), init_modules(config)
    phase = run.modules.first().phase
    dtype = token_dtype(config.model.vocab_size)
    blobs, shards = work / "blobs", work / "shards"
    blobs.mkdir()
    for module in run.modules.all():
        file = blobs / f"{module.module_id}.safetensors"
        sha256, size = write_module(file, weights[module.module_id])
        key = keys.module_key(run.pk, module.module_id, 0, phase)
        store.put_file(key, file)
        publish_module_version(module, 0, blob_key=key, sha256=sha256, size=size)
    entries = []
    for p in range(paths):
        (shards / str(p)).mkdir(parents=True)
        entry = {}
        for split, n in SHARD_TOKENS.items():
            file = shards / str(p) / f"{split}.bin"
            corpus(n, 2 * p + (split == "val"), config.model.vocab_size).astype(dtype).tofile(file)
            sha = hashlib.sha256(file.read_bytes()).hexdigest()
            entry[split] = ShardInfo(f"{p}/{split}.bin", n, 1, sha)
        entries.append(entry)
    index = ShardIndex(dtype.name, config.model.vocab_size, 0, paths, "bench", entries)
    index.save(shards)
    upload_shards(run, store, index, shards, phase)
    for state in ("preparing", "ready"):
        transition(run, state)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=None, label="bench")
    tokens = [
        register_worker(enrollment, f"bench-{i}", {"gpu": "none"})[1] for i in range(volunteers)
    ]
    return run.pk, tokens, Deltas(run.pk, shards)


def process_cpu_s(roots: list[int]) -> float:
    """CPU seconds (user + system) of the processes `roots` and all their descendants."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, list(roots)
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0.0)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return total


def database_backends(admin_url: str, name: str) -> dict[int, float]:
    """PostgreSQL backend pid -> CPU seconds so far, for the connections to database `name`."""
    # the server's database driver, for the bench's own database only
    import psycopg

    with psycopg.connect(with_path(admin_url, "/postgres"), autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s", (name,))]  # fmt: skip
    return {pid: process_cpu_s([pid]) for pid in pids}


def redis_pids() -> list[int]:
    """The redis-server processes on this machine (the bench's broker and cache)."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == "redis-server":
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


async def loop_lag(lags: list[float], every_s: float = LAG_TICK_S) -> None:
    """How late this client's event loop wakes from a sleep, every `every_s` (appended to
    `lags`): the share of a client-side latency that is the client waiting for its own CPU."""
    while True:
        asked = time.monotonic()
        await asyncio.sleep(every_s)
        lags.append(max(0.0, time.monotonic() - asked - every_s))


def capacity(cpu: Mapping[str, float], latency: Mapping[str, Any], seconds: float,
             volunteers: int) -> dict[str, float]:  # fmt: skip
    """CPU per request of the web and database processes (the part that grows with the
    volunteers), and what one core of them would serve at this load's mix of requests."""
    web_requests = sum(row["requests"] for kind, row in latency.items()
                       if kind not in ("all", "upload"))  # fmt: skip
    per_request_ms = 1e3 * (cpu["web"] + cpu["postgres"]) / max(1, web_requests)
    per_volunteer = web_requests / seconds / volunteers  # web requests a volunteer makes per s
    per_core = 1e3 / per_request_ms if per_request_ms else math.nan
    return {
        **{f"{k}_s": round(v, 1) for k, v in cpu.items()},
        "web_requests": web_requests,
        "web_ms_per_request": round(1e3 * cpu["web"] / max(1, web_requests), 2),
        "postgres_ms_per_request": round(1e3 * cpu["postgres"] / max(1, web_requests), 2),
        "celery_and_s3_ms_per_request": round(
            1e3 * (cpu["celery"] + cpu["s3"]) / max(1, web_requests), 2),
        # Every part's CPU over the window, in cores of this machine: near os.cpu_count(), the
        # machine, not the server, is the limit (the client, S3 and Celery share its cores).
        "cores_busy": round(sum(cpu.values()) / seconds, 2),
        "cores": os.cpu_count() or 0,
        "requests_per_core_s": round(per_core, 1),
        "projected_volunteers_per_core": round(per_core / per_volunteer) if per_volunteer else 0,
    }  # fmt: skip


# --- volunteers ---------------------------------------------------------------------------


@dataclass
class Stats:
    samples: list[tuple[float, str, float, bool]] = field(default_factory=list)  # time, kind, s, ok
    errors: Counter[str] = field(default_factory=Counter)
    completed: Counter[int] = field(default_factory=Counter)  # unit id -> 200 completions
    granted: set[int] = field(default_factory=set)  # lease ids the clients learned of
    unfinished: dict[int, str] = field(default_factory=dict)  # lease id -> why not handed in
    idle = 0  # lease answers 204
    partial = 0  # units stopped before their steps for the round's deadline, Δ handed in
    hand_in_waits = 0  # hand-ins tried again after the client's tries were spent


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
                      content: Any = None, headers: Mapping[str, str] | None = None,
                      ) -> Reply:  # fmt: skip
        absolute = url if "://" in url else self.base_url + url
        async with self.http.request(method, absolute, json=json, data=content,
                                     headers=headers) as response:  # fmt: skip
            return Reply(response.status, await response.read(), response.headers)

    async def close(self) -> None:
        await self.http.close()


async def call(client: Any, stats: Stats, kind: str, method: str, url: str,
               transport_errors: tuple[type[BaseException], ...] = (aiohttp.ClientError,),
               answers: tuple[int, ...] = (), **kwargs: Any) -> Any:  # fmt: skip
    """One request; None when it failed. A failure counts in the percentiles at the time it
    took (a time-out: REQUEST_TIMEOUT_S) and in the error rate; one whose status is in
    `answers` is still returned (the caller acts on it) but counts as failed all the same.
    `client` is this bench's Session or any client with the same ``request``
    (bench/soak.py passes httpx's, with its `transport_errors`)."""
    started = time.monotonic()
    try:
        response = await client.request(method, url, **kwargs)
    except (*transport_errors, TimeoutError) as exc:
        stats.samples.append((started, kind, time.monotonic() - started, False))
        stats.errors[f"{kind} {type(exc).__name__}"] += 1
        return None
    ok = response.status_code < 400
    stats.samples.append((started, kind, time.monotonic() - started, ok))
    if not ok:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = ""
        stats.errors[f"{kind} {response.status_code} {code}".strip()] += 1
        return response if response.status_code in answers else None
    return response


def transient(reply: Any) -> bool:
    """worker_agent.retry.is_transient for one answer (None: a transport error or time-out)."""
    return reply is None or transient_status(reply.status_code)


async def persist(send: Any, rng: random.Random) -> Any:
    """`send()` (a `call` with ``answers=ANY_ERROR``) as the agent's client retries: its
    reply once it succeeds, else the last failure's (None: a transport error or time-out)
    once a failure is final or the tries are spent. Every try counts in the figures."""
    waits = delays(RETRY, rng)
    while True:
        reply = await send()
        if succeeded(reply):
            return reply
        wait = next(waits, None)
        if not transient(reply) or wait is None:
            return reply
        hint = float(reply.headers.get("Retry-After", 0)) if reply is not None else 0.0
        await asyncio.sleep(min(RETRY.max_s, max(wait, hint)))


def succeeded(reply: Any) -> bool:
    return reply is not None and reply.status_code < 400


def trained_tokens(lease: Mapping[str, Any], steps: int | None = None) -> int:
    """The tokens a worker reports for training the lease's steps, or `steps` of them
    (rounds.protocol.complete accepts between the run's least partial steps and the lease's)."""
    inner, model = lease["config"]["inner"], lease["config"]["model"]
    batch = inner.get("batch_size") or inner["micro_batch_size"] * inner["grad_accum_steps"]
    return int(lease["steps"] if steps is None else steps) * batch * model["seq_len"]


def monotonic_at(iso: str | None) -> float | None:
    """A server timestamp (ISO 8601) on this process's monotonic clock (one machine)."""
    if not iso:
        return None
    when = datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    return time.monotonic() + (when - time.time())


def unique(data: bytes, nonce: str) -> bytes:
    """`data`, an encoded Δ, with `nonce` in its header's metadata: other bytes, the same Δ.

    The outer step rejects bytes uploaded before in the run as a replay (rounds.verification.rules), so
    every upload must differ; encoding a fresh Δ per upload would cost the client the CPU
    the server is measured with. The codec container's header is JSON padded to 8 bytes."""
    length = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"]["bench_nonce"] = nonce
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + length :]


async def upload(client: Session, stats: Stats, target: Mapping[str, Any],
                 data: bytes, rng: random.Random) -> Reply | None:  # fmt: skip
    """One module's Δ to the store, retried as the agent does: the presigned PUT where the
    store bounds its size, else the presigned form POST (S3: its content-length-range
    condition bounds it)."""

    async def send() -> Reply | None:
        if target.get("put_url"):
            return await call(client, stats, "upload", "PUT", target["put_url"],
                              content=data, answers=ANY_ERROR)  # fmt: skip
        form = aiohttp.FormData()
        for name, value in target["post"]["fields"].items():
            form.add_field(name, value)
        form.add_field("file", data, filename="delta.safetensors",
                       content_type="application/octet-stream")  # fmt: skip
        return await call(client, stats, "upload", "POST", target["post"]["url"],
                          content=form, answers=ANY_ERROR)  # fmt: skip

    return await persist(send, rng)


@dataclass
class HandIn:
    """One trained unit handed in as the agent does: upload URLs, the uploads not done yet,
    the completion; fresh URLs after a failure short of the completion."""

    client: Session
    stats: Stats
    lease: Mapping[str, Any]
    headers: Mapping[str, str]
    deltas: Mapping[str, bytes]
    steps: int
    rng: random.Random
    targets: list[dict[str, Any]] = field(default_factory=list)
    uploaded: set[str] = field(default_factory=set)

    async def send(self) -> tuple[Any, str]:
        """One try (each request with the client's retries): (the last reply, what it was)."""
        client, stats, rng = self.client, self.stats, self.rng
        prefix = f"/api/v1/worker/lease/{self.lease['lease_id']}"
        if not self.targets or len(self.uploaded) < len(self.targets):
            urls = await persist(functools.partial(
                call, client, stats, "upload-urls", "POST", f"{prefix}/upload-urls",
                headers=self.headers, answers=ANY_ERROR), rng)  # fmt: skip
            if not succeeded(urls):
                return urls, "upload-urls failed"
            self.targets[:] = urls.json()["uploads"]
        todo = [u for u in self.targets if u["module_id"] not in self.uploaded]
        sent = await asyncio.gather(
            *(upload(client, stats, u, self.deltas[u["module_id"]], rng) for u in todo)
        )
        self.uploaded.update(
            u["module_id"] for u, r in zip(todo, sent, strict=True) if succeeded(r)
        )
        failed = [r for r in sent if not succeeded(r)]
        if failed:
            return failed[0], "upload failed"
        body = {
            "contributions": [
                {"module_id": u["module_id"],
                 "sha256": hashlib.sha256(self.deltas[u["module_id"]]).hexdigest(),
                 "size": len(self.deltas[u["module_id"]])}
                for u in self.targets
            ],
            "tokens": trained_tokens(self.lease, self.steps), "metrics": {"loss": 1.0},
        }  # fmt: skip
        done = await persist(functools.partial(
            call, client, stats, "complete", "POST", f"{prefix}/complete", json=body,
            headers=self.headers, answers=ANY_ERROR), rng)  # fmt: skip
        return done, "complete failed"


@dataclass
class Volunteer:
    """One simulated volunteer: asks for work, trains it in simulated time (heartbeating)
    and hands it in, as worker_agent does."""

    client: Session
    token: str
    stats: Stats
    args: argparse.Namespace
    payloads: Deltas
    stop: asyncio.Event
    next_beat: float = field(default_factory=time.monotonic)
    interval: float = HEARTBEAT_S
    round_end: float | None = None  # the lease's round deadline as last heard (monotonic)

    def __post_init__(self) -> None:
        self.auth = {"Authorization": f"Bearer {self.token}"}
        self.rng = random.Random(self.token)

    async def beat(self, lease: dict[str, Any] | None) -> bool:
        """Heartbeat when one is due; False when the server says to release the lease."""
        if time.monotonic() < self.next_beat:
            return True
        self.next_beat = time.monotonic() + self.interval
        secret = {"X-Lease-Secret": lease["lease_secret"]} if lease else {}
        body = {"lease_id": lease["lease_id"] if lease else None}
        reply = await call(self.client, self.stats, "heartbeat", "POST",
                           "/api/v1/worker/heartbeat", json=body,
                           headers={**self.auth, **secret})  # fmt: skip
        if reply is None:
            return True
        answer = reply.json()
        self.interval = float(answer.get("heartbeat_interval_s") or self.interval)
        self.next_beat = time.monotonic() + self.interval  # the server's pace from now on
        if lease is not None and answer.get("round_deadline"):
            self.round_end = monotonic_at(answer["round_deadline"])  # an adaptive close moves it
        return "release" not in answer.get("instructions", [])

    async def run(self) -> None:
        await asyncio.sleep(self.rng.uniform(0, self.args.ramp))
        idle_wait = IDLE_WAIT_S[0]
        while not self.stop.is_set():
            await self.beat(None)
            # 503 is the server shedding load (dipaco_server.shedding): an error in the
            # figures, but, as for the agent, an idle answer whose Retry-After is honoured.
            response = await call(self.client, self.stats, "lease", "POST",
                                  "/api/v1/worker/lease", headers=self.auth,
                                  answers=(503,))  # fmt: skip
            if response is None or response.status_code in (204, 503):
                # As the agent does: back off 1 s, x1.5, up to 30 s, or the server's
                # Retry-After (on a 204; the longer of the two on a 503).
                hint = float(response.headers.get("Retry-After", 0)) if response is not None else 0
                idle = response is not None and response.status_code == 204
                self.stats.idle += idle
                pause = idle_pause_s(idle_wait, hint, shed=not idle)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), pause)
                idle_wait = min(IDLE_WAIT_S[1], idle_wait * 1.5)
                continue
            idle_wait = IDLE_WAIT_S[0]
            await self.work(response.json())

    async def work(self, lease: dict[str, Any]) -> None:
        """Train the lease's unit and hand it in, or record why it was not."""
        lease_id = lease["lease_id"]
        # A check copy (sampled replication of untrusted work) never holds up its round:
        # when the round closes first, its completion is refused. Lost work too, named apart.
        kind = "check copy: " if lease["replica"] >= CHECK_OFFSET else ""
        self.stats.granted.add(lease_id)
        steps, released = await self.train(lease)
        if self.stop.is_set():
            return
        if released:
            self.stats.unfinished[lease_id] = kind + "release instruction"
            return
        self.stats.partial += steps < int(lease["steps"])
        await self.hand_in(lease, steps, kind)

    async def train(self, lease: dict[str, Any]) -> tuple[int, bool]:
        """(steps trained, whether the server said to release the lease).

        As the agent trains: the lease's steps (sized to the worker's speed and to what
        fits before the round's deadline) at unit_seconds per full unit of H steps, and a
        heartbeat interval before the round's deadline as last heard it stops after the
        step in progress and hands in the partial Δ (worker_agent.agent)."""
        steps, started = int(lease["steps"]), time.monotonic()
        unit_s = self.args.unit_seconds * self.rng.uniform(0.8, 1.2)
        step_s = unit_s / int(lease["config"]["inner"]["steps"])
        done_at = started + steps * step_s
        self.round_end = monotonic_at(lease.get("round_deadline"))
        while (left := done_at - time.monotonic()) > 0 and not self.stop.is_set():
            round_end = self.round_end
            if round_end is not None and round_end - self.interval <= time.monotonic():
                # the step in progress ends, then the partial Δ goes up
                trained = max(1, math.ceil((time.monotonic() - started) / step_s))
                steps = min(steps, trained)
                done_at = started + step_s * steps
                await asyncio.sleep(max(0.0, done_at - time.monotonic()))
                break
            wake = min(left, max(0.0, self.next_beat - time.monotonic()) + 0.01)
            if round_end is not None:
                wake = min(wake, max(0.0, round_end - self.interval - time.monotonic()) + 0.01)
            await asyncio.sleep(wake)
            if not await self.beat(lease):
                return steps, True
        return steps, False

    async def hand_in(self, lease: dict[str, Any], steps: int, kind: str) -> None:
        """worker_agent.agent.hand_in: tried again every HAND_IN_PAUSE_S while the round
        may take the Δ (its deadline as last heard plus two heartbeat intervals)."""
        lease_id = lease["lease_id"]
        headers = {**self.auth, "X-Lease-Secret": lease["lease_secret"]}
        trained = await self.payloads.get(lease["path"], lease["base_versions"], lease["round"])
        deltas = {m: unique(d, f"{self.token[-16:]}-{lease_id}") for m, d in trained.items()}
        unit = HandIn(self.client, self.stats, lease, headers, deltas, steps, self.rng)
        left = None if self.round_end is None else self.round_end - time.monotonic()
        until = time.monotonic() + hand_in_patience_s(left, self.interval, RETRY.longest_total_s)
        while True:
            reply, why = await unit.send()
            if succeeded(reply):
                self.stats.completed[lease["unit_id"]] += 1
                return
            pause = min(HAND_IN_PAUSE_S, until - time.monotonic())
            if not transient(reply) or pause <= 0 or self.stop.is_set():
                self.stats.unfinished[lease_id] = kind + why
                return
            self.stats.hand_in_waits += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), pause)
            await self.beat(lease)


async def volunteer(client: Session, token: str, stats: Stats, args: argparse.Namespace,
                    payloads: Deltas, stop: asyncio.Event) -> None:  # fmt: skip
    await Volunteer(client, token, stats, args, payloads, stop).run()


async def load(url: str, tokens: list[str], args: argparse.Namespace,
               payloads: Deltas) -> tuple[Stats, float, float]:  # fmt: skip
    stats, stop = Stats(), asyncio.Event()
    client = Session(url)
    try:
        tasks = [asyncio.create_task(volunteer(client, t, stats, args, payloads, stop))
                 for t in tokens]  # fmt: skip
        started = time.monotonic()
        window = (started + args.warmup, started + args.warmup + args.duration)
        await asyncio.sleep(args.warmup + args.duration)
        stop.set()
        await asyncio.wait(tasks, timeout=REQUEST_TIMEOUT_S + 5)
        for task in tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                error = task.exception()
                stats.errors[f"volunteer crashed: {type(error).__name__}: {error}"] += 1
            task.cancel()
    finally:
        await client.close()
    return stats, *window


# --- Prometheus' scrape of /metrics ------------------------------------------------------


async def scrape_loop(url: str, every_s: float, took: list[tuple[float, int]]) -> None:
    """GET /metrics every `every_s`, as Prometheus does: (seconds, status) of each."""
    headers = {"Authorization": f"Bearer {SCRAPE_TOKEN}"}
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            asked = time.monotonic()
            try:
                async with session.get(f"{url}/metrics", headers=headers) as reply:
                    await reply.read()
                    status = reply.status
            except (aiohttp.ClientError, TimeoutError):
                status = 0
            took.append((time.monotonic() - asked, status))
            await asyncio.sleep(max(0.0, every_s - (time.monotonic() - asked)))


def scrape_cpu_s(url: str, groups: Mapping[str, list[int]], admin_url: str, name: str) -> float:
    """Web + PostgreSQL CPU seconds of one scrape: SCRAPE_COST_SCRAPES back to back on the
    run's final state, the volunteers stopped (beat's sweeps are the only other work)."""
    web, database = process_cpu_s(groups["web"]), database_backends(admin_url, name)
    headers = {"Authorization": f"Bearer {SCRAPE_TOKEN}"}
    with httpx.Client(timeout=60) as client:
        for _ in range(SCRAPE_COST_SCRAPES):
            client.get(f"{url}/metrics", headers=headers).raise_for_status()
    after = database_backends(admin_url, name)
    spent = process_cpu_s(groups["web"]) - web
    spent += sum(cpu - database.get(pid, 0.0) for pid, cpu in after.items())
    return spent / SCRAPE_COST_SCRAPES


def scrape_figures(took: list[tuple[float, int]], cpu_s: float, cpu: Mapping[str, float],
                   seconds: float, every_s: float) -> dict[str, Any]:  # fmt: skip
    """The scrapes' latency in the window, and a scrape's CPU as a share of the server's
    (web, PostgreSQL and Celery over the window) at 15 s and at `every_s`."""
    server_per_s = (cpu["web"] + cpu["postgres"] + cpu["celery"]) / seconds
    latencies = [t for t, _ in took]
    return {
        "every_s": every_s,
        "scrapes": len(took),
        "failed": sum(1 for _, status in took if status != 200),
        "p50_ms": round(1e3 * percentile(latencies, 0.5), 1),
        "p99_ms": round(1e3 * percentile(latencies, 0.99), 1),
        "max_ms": round(1e3 * max(latencies, default=math.nan), 1),
        "cpu_ms_per_scrape": round(1e3 * cpu_s, 1),
        "server_cpu_cores": round(server_per_s, 3),
        "share_at_15s": round(cpu_s / 15 / server_per_s, 4) if server_per_s else math.nan,
        f"share_at_{every_s:g}s": round(cpu_s / every_s / server_per_s, 4)
        if server_per_s
        else math.nan,
    }


# --- report -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else math.nan


def summarize(samples: list[tuple[float, str, float, bool]], seconds: float) -> dict[str, Any]:
    kinds: dict[str, list[float]] = defaultdict(list)
    failed: Counter[str] = Counter()
    for _, kind, latency, ok in samples:
        for name in (kind, "all"):
            kinds[name].append(latency)
            failed[name] += not ok
    return {
        kind: {"requests": len(v), "per_s": len(v) / seconds, "p50_ms": 1e3 * percentile(v, 0.5),
               "p99_ms": 1e3 * percentile(v, 0.99), "max_ms": 1e3 * max(v),
               "failed": failed[kind]}
        for kind, v in sorted(kinds.items())
    }  # fmt: skip


def request_kind(method: str, path: str) -> str | None:
    tail = path.rstrip("/").rsplit("/", 1)[-1]
    if path.startswith("/api/v1/worker/") and tail in ("heartbeat", "lease", "upload-urls",
                                                       "complete"):  # fmt: skip
        return tail
    return None


def server_side(logs: list[Path], start: float, end: float) -> dict[str, Any]:
    """Per-kind latency as gunicorn measured it, over the same window (wall-clock times)."""
    kinds: dict[str, list[float]] = defaultdict(list)
    for log in logs:
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


def boundaries(run_id: int, grant_rate: float) -> list[dict[str, Any]]:
    """Each round boundary: from a round's closing to the next round's opening plus the
    time its units take to go out at the grant rate (+ BOUNDARY_TAIL_S), wall-clock."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco_server.rounds.models import Round

    rounds = list(Round.objects.filter(run_id=run_id).order_by("t"))
    out = []
    for previous, current in itertools.pairwise(rounds):
        # When it began closing: closing_at moves when beat resends a slow round's steps.
        started = previous.closing_started_at
        if started is None:
            continue
        units = current.units.count()
        opened = current.opened_at.timestamp()
        # With outer.overlap the next round opens as the step starts: the step's own length
        # is closing to closed, and volunteers wait only closing to the next opening.
        step_s = (previous.closed_at - started).total_seconds() if previous.closed_at else None
        out.append({
            "t": current.t, "closing_at": started.timestamp(), "opened_at": opened,
            "outer_step_s": step_s,  # None: still stepping when the window ended
            "wait_s": opened - started.timestamp(),
            "until": opened + units / grant_rate + BOUNDARY_TAIL_S,
        })  # fmt: skip
    return out


def verify(run_id: int, stats: Stats) -> dict[str, int]:
    """Lost and duplicated units, from the database against what the clients were told."""
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from django.db.models import Count

    from dipaco_server.rounds.models import Contribution, Lease, OuterStep, WorkUnit

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
    # Trained but not handed in: lost, unless the server recorded it anyway (salvaged).
    salvaged = set(
        Lease.objects.filter(pk__in=list(stats.unfinished), state=Lease.State.COMPLETED)
        .values_list("pk", flat=True)
    )  # fmt: skip
    unfinished = Counter(why for pk, why in stats.unfinished.items() if pk not in salvaged)
    active = Lease.objects.filter(unit__round__run_id=run_id, state=Lease.State.ACTIVE)
    contributions = Counter(
        Contribution.objects.filter(unit__round__run_id=run_id).values_list("status", flat=True)
    )
    return {
        "completed_by_clients": len(stats.completed),
        "done_in_database": len(done),
        "lost": len(set(stats.completed) - done) + len(done - contributed)
        + sum(unfinished.values()),
        "lost_why": dict(unfinished),
        "salvaged": len(salvaged),
        "duplicated": twice + sum(1 for n in stats.completed.values() if n > 1),
        "orphaned_leases": active.exclude(pk__in=stats.granted).count(),
        "outer_steps": OuterStep.objects.filter(module__run_id=run_id).count(),
        # units the outer step's proof of useful work scored (rounds.outer.step.Scorer)
        "scored": Lease.objects.filter(unit__round__run_id=run_id, score__isnull=False).count(),
        "contributions": dict(contributions),
    }  # fmt: skip


def print_report(result: dict[str, Any]) -> None:
    print(f"\n{result['volunteers']} volunteers, {result['duration_s']:.0f} s measured, "
          f"unit {result['unit_seconds']:.0f} s, {result['web_servers']} gunicorn masters x "
          f"{result['web_workers']} workers, {result['celery_workers']} Celery workers, "
          f"load {result['load_average']}")  # fmt: skip
    print(f"{'':<12}{'client side':>54}{'in the server':>20}")
    print(f"{'kind':<12}{'requests':>9}{'req/s':>9}{'failed':>9}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'max ms':>9}{'p50 ms':>10}{'p99 ms':>10}")  # fmt: skip
    for kind, row in result["latency"].items():
        server = result.get("server_latency", {}).get(kind, {})
        print(f"{kind:<12}{row['requests']:>9}{row['per_s']:>9.1f}{row['failed']:>9}"
              f"{row['p50_ms']:>9.1f}{row['p99_ms']:>9.1f}{row['max_ms']:>9.0f}"
              f"{server.get('p50_ms', math.nan):>10.1f}{server.get('p99_ms', math.nan):>10.1f}")  # fmt: skip
    print(
        f"p99 over {result['boundaries_in_window']} boundaries: "
        f"{result['p99_boundary_ms']:.1f} ms; error rate {result['error_rate']:.5f}"
    )
    print(f"errors: {dict(result['errors']) or 'none'}")
    print(f"units: {result['units']}")
    print(f"rounds: {result['rounds']}")
    print(f"cpu: {result['cpu']}")
    print(f"client event-loop lag (ms): {result['client_loop_lag_ms']}")
    if "scrape" in result:
        print(f"scrape /metrics: {result['scrape']}")


async def measured(
    url: str,
    tokens: list[str],
    args: argparse.Namespace,
    payloads: Deltas,
    groups: dict[str, list[int]],
    database: str,
    lags: list[float],
    scrapes: list[tuple[float, int]],
) -> tuple[Stats, float, float, dict[str, float]]:
    """The volunteers' load, and each process group's CPU over the measured window; with
    --scrape-every, /metrics scraped through the window (`scrapes`)."""

    task = asyncio.create_task(load(url, tokens, args, payloads))
    await asyncio.sleep(args.warmup)
    scraping = None
    if args.scrape_every:
        scraping = asyncio.create_task(scrape_loop(url, args.scrape_every, scrapes))
    before = {k: process_cpu_s(v) for k, v in groups.items()}
    client_before = time.process_time()  # this process: the volunteers and Δ thread
    lagging = asyncio.create_task(loop_lag(lags))
    first = database_backends(args.postgres, database)
    # Every backend's CPU as last seen, sampled through the window: the pool closes
    # connections (psycopg_pool's max_lifetime, an hour) and a backend gone by the
    # end would otherwise take its CPU with it (a 57-min window counted 21 CPU-s of
    # about 400).
    seen = dict(first)
    end_at = time.monotonic() + args.duration
    while (left := end_at - time.monotonic()) > 0:
        await asyncio.sleep(min(BACKEND_SAMPLE_S, left))
        # In a thread: a connection to a loaded PostgreSQL can take seconds, and
        # the volunteers' event loop would stall with it (sessions 14-15 did that).
        sample = await asyncio.to_thread(database_backends, args.postgres, database)
        for pid, cpu in sample.items():
            seen[pid] = max(seen.get(pid, 0.0), cpu)  # 0 if it ended meanwhile
    spent = {k: process_cpu_s(v) - before[k] for k, v in groups.items()}
    spent["postgres"] = sum(cpu - first.get(pid, 0.0) for pid, cpu in seen.items())
    spent["client"] = time.process_time() - client_before
    lagging.cancel()
    if scraping is not None:
        scraping.cancel()
    stats, start, end = await task
    return stats, start, end, spent


def start_server(
    args: argparse.Namespace,
    port: int,
    environ: dict[str, str],
    work: Path,
    children: dict[str, subprocess.Popen[bytes]],
) -> list[Path]:
    """The web servers (on one port), Celery workers and beat, added to `children`;
    returns the web servers' access logs."""
    from dipaco_server.cli.server import child_commands  # platform/ is on sys.path by now

    threads = {"web_threads": args.web_threads} if args.web_threads else {}
    commands = child_commands("127.0.0.1", port, args.web_workers, 1, **threads)
    logs = []
    for i in range(args.web_servers):
        logs.append(work / f"web-{i}.log")
        command = [*commands["web"], "--reuse-port", "--access-logformat", ACCESS_FORMAT]
        children[f"web-{i}"] = subprocess.Popen(
            command, env=environ, stdout=logs[-1].open("ab"), stderr=subprocess.STDOUT
        )
    for i in range(args.celery_workers):
        command = [*commands["worker"], "-n", f"bench{i}@%h"]
        children[f"celery-{i}"] = subprocess.Popen(
            command, env=environ, stdout=(work / f"celery-{i}.log").open("ab"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    children["beat"] = subprocess.Popen(
        commands["beat"], env=environ, stdout=(work / "beat.log").open("ab"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    return logs


def wait_healthy(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.3)


def build_result(
    args: argparse.Namespace,
    run_id: int,
    stats: Stats,
    window_s: tuple[float, float],
    cpu: dict[str, float],
    lags: list[float],
    wall_offset: float,
    units: int,
    environ: dict[str, str],
    logs: list[Path],
) -> dict[str, Any]:
    """Every figure of the measured window (client monotonic times `window_s`)."""
    from dipaco_server.cli.server import WEB_THREADS  # platform/ is on sys.path by now

    start, end = window_s
    seconds = end - start
    window = [s for s in stats.samples if start <= s[0] < end]
    grant_rate = args.grant_rate or GRANT_RATE
    edges = boundaries(run_id, grant_rate)
    for edge in edges:
        for key in ("closing_at", "opened_at", "until"):
            edge[key] -= wall_offset  # to the client's monotonic clock
    inside = [e for e in edges if start <= e["opened_at"] < end]
    at_boundary = [s for s in window
                   if any(e["closing_at"] <= s[0] < e["until"] for e in inside)]  # fmt: skip
    latency = summarize(window, seconds)
    overall = latency.get("all", {"requests": 0, "failed": 0})
    requests = max(1, overall["requests"])
    counts = verify(run_id, stats)
    result = {
        "volunteers": args.volunteers,
        "p50_ms": overall.get("p50_ms", math.nan),
        "p99_ms": overall.get("p99_ms", math.nan),
        "p99_boundary_ms": 1e3 * percentile([s[2] for s in at_boundary], 0.99),
        "requests_per_s": overall["requests"] / seconds,
        "error_rate": overall["failed"] / requests,
        "lost_units": counts["lost"],
        "duplicated_units": counts["duplicated"],
        "boundaries_in_window": len(inside),
        "duration_s": seconds, "warmup_s": args.warmup, "unit_seconds": args.unit_seconds,
        "ramp_s": args.ramp, "web_servers": args.web_servers,
        "web_workers": args.web_workers, "web_threads": args.web_threads or WEB_THREADS,
        "celery_workers": args.celery_workers,
        "db_pool": args.db_pool, "grant_rate": grant_rate, "units_per_round": units,
        "overlap": args.overlap,
        "shed_after_s": environ.get("DIPACO_SHED_AFTER_S", "default (5)"),
        "load_average": [round(x, 1) for x in os.getloadavg()],
        "cpu": capacity(cpu, latency, seconds, args.volunteers),
        "client_loop_lag_ms": {
            "p50": round(1e3 * percentile(lags, 0.5), 1),
            "p99": round(1e3 * percentile(lags, 0.99), 1),
            "max": round(1e3 * max(lags, default=math.nan), 1),
        },
        "rounds": [{"t": e["t"],
                    "outer_step_s": e["outer_step_s"] and round(e["outer_step_s"], 1),
                    "wait_s": round(e["wait_s"], 1),
                    "opened_at_s": round(e["opened_at"] - start + args.warmup, 1)}
                   for e in edges],
        "latency": latency, "errors": dict(stats.errors),
        "server_latency": server_side(logs, start + wall_offset, end + wall_offset),
        "units": {**counts, "idle_polls": stats.idle, "partial": stats.partial,
                  "hand_in_waits": stats.hand_in_waits},
    }  # fmt: skip
    return result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--volunteers", type=int, default=500, help="simulated volunteers")
    parser.add_argument("--duration", type=float, default=300.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before measuring")
    parser.add_argument("--unit-seconds", type=float, default=60.0, help="simulated training")
    parser.add_argument("--ramp", type=float, default=30.0, help="volunteers start over this")
    parser.add_argument("--web-servers", type=int, default=2,
                        help="gunicorn masters on one port (SO_REUSEPORT)")  # fmt: skip
    parser.add_argument("--web-workers", type=int, default=1, help="processes per master")
    parser.add_argument(
        "--web-threads",
        type=int,
        default=None,
        help="gthread threads per web process (default: dipaco server's)",
    )
    parser.add_argument("--celery-workers", type=int, default=2, help="Celery worker processes")
    parser.add_argument("--db-pool", default="4",
                        help="DIPACO_DB_POOL: connections per process, or off")  # fmt: skip
    parser.add_argument("--grant-rate", type=float, default=None,
                        help=f"DIPACO_GRANT_RATE (default {GRANT_RATE:.0f}/s)")  # fmt: skip
    parser.add_argument("--shed-after", default=None, metavar="SECONDS",
                        help="DIPACO_SHED_AFTER_S: shed new work queued longer, or off "
                        "(default: the server's, 5 s)")  # fmt: skip
    parser.add_argument("--paths", type=int, default=4, help="paths of the run (1 or a square)")
    parser.add_argument("--units-per-volunteer", type=float, default=1.0,
                        help="work units per round, per volunteer (default: one each)")  # fmt: skip
    parser.add_argument("--postgres", default=os.environ.get(
        "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"))  # fmt: skip
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/12", help="flushed")
    parser.add_argument("--overlap", choices=("none", "delayed", "eager"), default="none",
                        help="the run's outer.overlap: with delayed, round t + 1 opens as "
                             "round t's outer step starts, so volunteers train through it")  # fmt: skip
    parser.add_argument("--scrape-every", type=float, metavar="SECONDS",
                        help="scrape /metrics this often through the window, then measure a "
                        "scrape's CPU (Prometheus' default interval: 15)")  # fmt: skip
    parser.add_argument("--json", type=Path, help="write the result here")
    return parser.parse_args()


def main() -> int:
    args = parse_args()

    # the server's Redis client: only to flush the bench's database
    import redis

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "platform"))
    # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
    from dipaco_demo.control import free_port

    name = f"dipaco_bench_{os.getpid()}"
    database = create_database(args.postgres, name)
    redis.Redis.from_url(args.redis).flushdb()
    work = Path(tempfile.mkdtemp(prefix="dipaco-bench-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    s3, s3_environ = start_s3(free_port(), work / "s3.log")
    environ = server_environ(database, args.redis, work, url, s3_environ, args)
    os.environ.update(environ)
    children: dict[str, subprocess.Popen[bytes]] = {"s3": s3}
    try:
        subprocess.run([sys.executable, "-m", "django", "migrate", "--noinput", "-v", "0"],
                       env=environ, check=True)  # fmt: skip
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from dipaco_server.cli.admin import setup_django

        setup_django()
        logging.getLogger("dipaco_server").setLevel(logging.WARNING)  # one line per worker
        units = round(args.volunteers * args.units_per_volunteer)
        print(f"seeding {units} units per round and {args.volunteers} workers ...", flush=True)
        run_id, tokens, payloads = seed(args.volunteers, units, args.paths, work, args.overlap)
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from django.db import connections

        connections.close_all()
        logs = start_server(args, port, environ, work, children)
        wait_healthy(url)
        print(f"{args.volunteers} volunteers for {args.warmup:.0f} + {args.duration:.0f} s ...",
              flush=True)  # fmt: skip
        wall_offset = time.time() - time.monotonic()
        groups = {
            "web": [p.pid for n, p in children.items() if n.startswith("web")],
            "celery": [p.pid for n, p in children.items() if n.startswith(("celery", "beat"))],
            "s3": [s3.pid],
            "redis": redis_pids(),
        }

        lags: list[float] = []
        scrapes: list[tuple[float, int]] = []
        stats, start, end, cpu = asyncio.run(
            measured(url, tokens, args, payloads, groups, name, lags, scrapes)
        )
        result = build_result(
            args, run_id, stats, (start, end), cpu, lags, wall_offset, units, environ, logs
        )
        if args.scrape_every:
            cost = scrape_cpu_s(url, groups, args.postgres, name)
            result["scrape"] = scrape_figures(scrapes, cost, cpu, end - start, args.scrape_every)
        print_report(result)
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    finally:
        for child in reversed(list(children.values())):
            child.terminate()
        for child in children.values():
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
        # the server's modules: platform/ is on sys.path (and Django set up) by the time this runs
        from django.db import connections

        connections.close_all()
        drop_database(args.postgres, name)
        redis.Redis.from_url(args.redis).flushdb()
        if not os.environ.get("DIPACO_BENCH_KEEP"):
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
