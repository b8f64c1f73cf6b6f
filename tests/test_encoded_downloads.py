"""Encoded downloads (issue 20): a worker that holds version t fetches only the encoded update.

With ``comm.download_codec`` int8 every outer step publishes its update encoded, and the
new version is exactly the version before plus the decoded update (rounds.outer.publish).

- On the cluster (docker-compose.yml's migrate, web = gunicorn, worker = Celery and beat on
  a fresh PostgreSQL database, Redis, the moto S3 server) one `dipaco-worker` trains a 2x1
  run for 6 rounds. From round 1 on it downloads only int8 updates, never an fp32 module
  (its own log, and what the server recorded per lease), and after 5 outer steps the
  module file it rebuilt is the server's published version 5, byte for byte.
- `ModuleFetcher` against a real HTTP server: a chain of updates rebuilds the server's
  weights bit for bit; a corrupt update, one the manifest's sha256 refuses, a held file
  that is gone, or a chain from another version falls back to the whole module.
- `plan_downloads`: which chain the manifest offers, and when the fp32 file is cheaper.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import http.server
import json
import os
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import torch

from dipaco.config import RunConfig
from dipaco.modular import init_modules, module_spec
from dipaco.modules_file import read_module, write_module
from dipaco.retry import Backoff
from dipaco.updates import apply_update, publish_update
from tests.conftest import S3Server, compose_command, compose_env, start_process, stop_process

# --- the fetcher against a real HTTP server ---------------------------------------------------

MODULE = "0.0"


def small_config() -> RunConfig:
    return RunConfig.tiny(
        model={"hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 64,
               "vocab_size": 256, "seq_len": 32},
        comm={"codec": "int8", "download_codec": "int8"},
    )  # fmt: skip


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        return


@pytest.fixture
def blob_server(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A plain HTTP server of a directory: what presigned GETs look like to the agent."""
    root = tmp_path / "served"
    root.mkdir()
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


class Published:
    """Versions 0..n of one module as the server publishes them, served over HTTP."""

    def __init__(self, root: Path, url: str, config: RunConfig, rounds: int) -> None:
        self.root, self.url, self.config = root, url, config
        spec = module_spec(config, MODULE)
        weights = {n: init_modules(config)[MODULE][n] for n in spec}
        generator = torch.Generator().manual_seed(0)
        residual = None
        self.weights = [weights]
        self.files: list[tuple[str, int]] = [self._put("v0", weights)]
        self.updates: list[tuple[str, int]] = [("", 0)]
        for _ in range(rounds):  # an outer step moves every value a little
            stepped = {n: t - 0.01 * torch.randn(t.shape, generator=generator)
                       for n, t in weights.items()}  # fmt: skip
            weights, data, residual = publish_update(weights, stepped, "int8", residual)
            v = len(self.weights)
            self.weights.append(weights)
            self.files.append(self._put(f"v{v}", weights))
            (root / f"u{v}").write_bytes(data)
            self.updates.append((hashlib.sha256(data).hexdigest(), len(data)))

    def _put(self, name: str, weights: dict[str, torch.Tensor]) -> tuple[str, int]:
        return write_module(self.root / name, weights)

    def ref(self, version: int, held: int | None = None) -> Any:
        from worker_agent.client import BlobRef, UpdateRef

        updates: tuple[Any, ...] = ()
        if held is not None:
            updates = tuple(
                UpdateRef(v - 1, v, f"{self.url}/u{v}", *self.updates[v],
                          self.files[v - 1][0], self.files[v][0])
                for v in range(held + 1, version + 1)
            )  # fmt: skip
        sha256, size = self.files[version]
        return BlobRef(MODULE, version, f"v{version}", sha256, size, f"{self.url}/v{version}",
                       updates)  # fmt: skip


def fetcher(tmp_path: Path) -> Any:
    from worker_agent.downloads import HeldModules, ModuleFetcher
    from worker_agent.transfer import BlobCache, Transfers

    transfers = Transfers(tmp_path / "agent", policy=Backoff(attempts=2, initial_s=0.0))
    cache = BlobCache(tmp_path / "agent" / "cache" / "blobs", transfers)
    return ModuleFetcher(cache, HeldModules(tmp_path / "agent" / "cache" / "held"))


def manifest(*refs: Any) -> Any:
    from worker_agent.client import Manifest, UnitData

    return Manifest(list(refs), UnitData("dipaco-rows-1", "<u2", 8, 0, 0, []))


def test_a_worker_holding_v0_rebuilds_v3_from_the_updates_alone_bit_for_bit(
    tmp_path: Path, blob_server: tuple[Path, str]
) -> None:
    config = small_config()
    published = Published(*blob_server, config, rounds=3)
    agent = fetcher(tmp_path)
    modules, stats = agent.fetch(7, manifest(published.ref(0)), config)  # a new worker
    assert (stats.whole, stats.module_bytes) == (1, published.files[0][1])
    assert agent.held_versions(7, [MODULE, "1.0"]) == {MODULE: 0}

    modules, stats = agent.fetch(7, manifest(published.ref(3, held=0)), config)
    update_bytes = sum(size for _, size in published.updates[1:])
    assert (stats.from_updates, stats.whole, stats.fallbacks) == (1, 0, 0)
    assert stats.update_bytes == update_bytes  # int8: each a third of the fp32 file or less
    assert all(0 < size < published.files[0][1] / 2 for _, size in published.updates[1:])
    for name, tensor in published.weights[3].items():
        assert torch.equal(modules[MODULE][name], tensor), name
    cached = agent.cache.path_for(published.files[3][0])
    assert cached.read_bytes() == (published.root / "v3").read_bytes()
    assert agent.held_versions(7, [MODULE]) == {MODULE: 3}

    # Held at the unit's version already: nothing moves.
    before = agent.cache.transfers.meter.total_bytes
    _, stats = agent.fetch(7, manifest(published.ref(3, held=3)), config)
    assert stats.held == 1 and agent.cache.transfers.meter.total_bytes == before


def _corrupt_in_place(path: Path) -> None:
    """Flip a byte of the last tensor's payload: the file keeps its size and header."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("fault", "why"),
    [
        ("corrupt-content", "does not match its sha256"),  # dipaco.codecs' per-tensor check
        ("sha256-mismatch", "do not match sha256"),  # the manifest's, as it downloads
        ("held-gone", "is gone or corrupt"),
        ("other-base", "the updates start from v0, the agent holds v1"),
        ("broken-chain", "the update to v2 does not follow v1"),
        ("foreign-file", "the v0 the agent holds is not the server's"),  # another phase's
    ],
)
def test_an_unusable_update_is_refused_and_the_whole_module_is_fetched_instead(
    tmp_path: Path,
    blob_server: tuple[Path, str],
    fault: str,
    why: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = small_config()
    published = Published(*blob_server, config, rounds=2)
    agent = fetcher(tmp_path)
    agent.fetch(7, manifest(published.ref(0)), config)
    ref = published.ref(2, held=0)
    if fault == "corrupt-content":
        # The store's copy changed and the manifest names its new sha256 (a tampered
        # server-side blob): dipaco.codecs' per-tensor sha256 and the rebuilt file's refuse it.
        _corrupt_in_place(published.root / "u2")
        digest = hashlib.sha256((published.root / "u2").read_bytes()).hexdigest()
        updates = (ref.updates[0], dataclasses.replace(ref.updates[1], sha256=digest))
        ref = dataclasses.replace(ref, updates=updates)
    elif fault == "sha256-mismatch":
        _corrupt_in_place(published.root / "u1")  # the manifest's sha256 refuses the bytes
    elif fault == "held-gone":
        agent.cache.path_for(published.files[0][0]).unlink()
    elif fault == "broken-chain":  # the second link claims another base than the first's end
        wrong = dataclasses.replace(ref.updates[1], from_sha256=published.files[0][0])
        ref = dataclasses.replace(ref, updates=(ref.updates[0], wrong))
    elif fault == "foreign-file":
        agent.held.save(7, {MODULE: (0, published.files[1][0])})
        write_module(agent.cache.path_for(published.files[1][0]), published.weights[1])
    elif fault == "other-base":
        agent.held.save(7, {MODULE: (1, published.files[1][0])})
        write_module(agent.cache.path_for(published.files[1][0]), published.weights[1])
    modules, stats = agent.fetch(7, manifest(ref), config)
    assert (stats.fallbacks, stats.whole, stats.from_updates) == (1, 1, 0), fault
    assert stats.module_bytes == published.files[2][1]
    for name, tensor in published.weights[2].items():
        assert torch.equal(modules[MODULE][name], tensor), name
    assert "falling back to the whole fp32 file" in caplog.text and why in caplog.text
    assert agent.held_versions(7, [MODULE]) == {MODULE: 2}
    assert not list(agent.cache.root.glob("rebuild*")), "no half-built file is left behind"


def test_a_torn_held_index_means_whole_modules(tmp_path: Path) -> None:
    agent = fetcher(tmp_path)
    agent.held.root.mkdir(parents=True)
    (agent.held.root / "run-7.json").write_text('{"0.0": [3, "not hex"')
    assert agent.held_versions(7, [MODULE]) == {}
    (agent.held.root / "run-7.json").write_text('{"0.0": [3, "not hex"]}')
    assert agent.held_versions(7, [MODULE]) == {}


def test_apply_update_refuses_an_update_for_another_module() -> None:
    config = small_config()
    old = init_modules(config)[MODULE]
    other = init_modules(config)["1.0"]
    _, data, _ = publish_update(other, other, "int8", None)
    from dipaco.codecs import CodecError

    with pytest.raises(CodecError):
        apply_update(old, data, module_spec(config, MODULE))


# --- the outer step publishes θ_t + decode(u) -----------------------------------------------


@pytest.mark.django_db
def test_the_outer_step_publishes_its_base_plus_exactly_the_decoded_update_as_the_library(
    tmp_path: Path,
) -> None:
    """Two steps through judge_uploads and rounds.outer.step.step_judged with int8 published updates: each
    version is bit for bit what dipaco.updates.publish_update gives from the same step (its
    residual carried to the second), the update's bytes are the library's, and a worker's
    apply_update of them to the base rebuilds the version."""
    from dipaco import codecs
    from dipaco.outer import aggregate, outer_lr, outer_step
    from dipaco_server.rounds.outer.step import BaseVersion, step_judged
    from dipaco_server.rounds.verification.judge import judge_uploads
    from dipaco_server.rounds.verification.uploads import Upload
    from dipaco_server.runs import keys
    from dipaco_server.storage import get_blob_store
    from tests.test_outer_tasks import DILOCO, random_delta, running_run, stored_version

    run = running_run(DILOCO, replicas=1)
    config, store = run.run_config, get_blob_store()
    spec, cfg = module_spec(config, "0.0"), config.outer
    comm = config.comm.model_copy(update={"download_codec": "int8"})
    row = run.modules.get(module_id="0.0").versions.get(version=0)
    base = BaseVersion(0, row.blob_key, row.sha256, "")
    weights, residual = stored_version(run, "0.0", 0), None
    for t in range(2):
        data = codecs.encode(random_delta(run, "0.0", seed=t, scale=1e-2), "fp16")
        store.put_bytes(f"runs/{run.pk}/scratch/{t}.safetensors", data)
        upload = Upload(t, 0, f"runs/{run.pk}/scratch/{t}.safetensors", len(data),
                        hashlib.sha256(data).hexdigest(), 100)  # fmt: skip
        work = tmp_path / f"step-{t}"
        work.mkdir()
        judgement = judge_uploads(store, [upload], spec, cfg, work)
        result = step_judged(store, judgement, base, spec, cfg, work, round_index=t, comm=comm)
        assert result.weights is not None and result.update is not None

        grad = aggregate([(codecs.decode(data, spec), 100)], cfg, paths_through=1, spec=spec)
        stepped, _ = outer_step(weights, grad, None, cfg, lr=outer_lr(cfg, t))
        expected, update, residual = publish_update(
            weights, stepped, "int8", residual,
            block_size=comm.block_size, compression=comm.compression,
        )  # fmt: skip
        published = read_module(result.weights, spec, result.weights_sha256)
        for name in spec:
            assert torch.equal(published[name], expected[name]), (t, name)
        assert result.update.path.read_bytes() == update
        rebuilt = apply_update(weights, result.update.path, spec)
        assert all(torch.equal(rebuilt[name], published[name]) for name in spec)
        kept = read_module(result.update.residual, spec)
        assert all(torch.equal(kept[name], residual[name]) for name in spec)
        assert any(float(r.abs().max()) > 0 for r in residual.values()), "int8 rounds off"

        # Version t + 1, as _commit stores it, is the next step's base.
        key = keys.module_key(run.pk, "0.0", t + 1)
        residual_key = keys.residual_key(run.pk, "0.0", t + 1)
        store.put_file(key, result.weights)
        store.put_file(residual_key, result.update.residual)
        base = BaseVersion(t + 1, key, result.weights_sha256, "", residual_key)
        weights = expected


# --- which chain the manifest offers -----------------------------------------------------------


def test_the_manifest_offers_the_chain_only_when_it_is_whole_and_cheaper() -> None:
    from dipaco_server.rounds.protocol.downloads import parse_held, plan_downloads
    from dipaco_server.runs.models import ModuleVersion

    def row(v: int, update: int | None) -> ModuleVersion:
        return ModuleVersion(
            version=v, blob_key=f"v{v}", sha256=f"{v}" * 64, size=1000,
            update_key=f"u{v}" if update else "", update_sha256="a" * 64, update_size=update,
        )  # fmt: skip

    rows = {"0.0": [row(0, None), row(1, 400), row(2, 400), row(3, 400)], "1.0": [row(3, 400)]}
    wanted = {"0.0": 3, "1.0": 3}
    plan = plan_downloads(rows, wanted, parse_held("0.0:2,1.0:3"))
    assert [u["version"] for u in plan["0.0"].updates] == [3] and plan["0.0"].bytes == 400
    assert plan["0.0"].updates[0]["from_sha256"] == "2" * 64
    assert plan["1.0"].held and plan["1.0"].bytes == 0
    plan = plan_downloads(rows, wanted, parse_held("0.0:1"))
    assert [u["version"] for u in plan["0.0"].updates] == [2, 3] and plan["0.0"].bytes == 800
    assert plan["1.0"].bytes == 1000, "not held: the fp32 file"
    # Three updates of 400 B cost more than the 1000 B fp32 file: the file is sent.
    assert plan_downloads(rows, wanted, parse_held("0.0:0"))["0.0"].updates == []
    # A round that kept the module made no version 2: update 3 starts from version 1.
    gap = {"0.0": [row(1, 400), row(3, 400)]}
    plan = plan_downloads(gap, {"0.0": 3}, parse_held("0.0:1"), {"0.0": {3: 1}})
    assert [(u["from_version"], u["version"]) for u in plan["0.0"].updates] == [(1, 3)]
    # A link swept by retention, or a version the worker invents: the fp32 file.
    swept = plan_downloads(gap, {"0.0": 3}, parse_held("0.0:1"), {"0.0": {3: 2}})
    assert swept["0.0"].updates == [] and swept["0.0"].bytes == 1000
    assert plan_downloads(rows, wanted, parse_held("0.0:9"))["0.0"].bytes == 1000
    assert parse_held("0.0:1;DROP") == {} and parse_held(None) == {}


# --- the dashboard's "Communication" ---------------------------------------------------------


@pytest.mark.django_db
def test_communication_counts_what_each_manifest_sent_down_and_shows_down_and_up(
    client: Any,
) -> None:
    from dipaco_server.rounds.models import Contribution, Lease
    from dipaco_web.curves import communication
    from tests.test_dashboard import build_short_run

    short_run = build_short_run()
    run = short_run.run
    before = communication(run)
    assert before.total_moved == before.total_downloaded + before.total_uploaded > 0
    uploaded = sum(Contribution.objects.filter(unit__round__run=run).values_list("size", flat=True))
    assert before.total_uploaded == uploaded
    leases = list(Lease.objects.filter(unit__round__run=run, state="completed").order_by("pk"))
    # A worker that held the versions before: its manifest sent 1,000 B of updates; one
    # that held its unit's versions already: nothing. The others were recorded as before.
    Lease.objects.filter(pk=leases[-1].pk).update(download_bytes=1000)
    Lease.objects.filter(pk=leases[-2].pk).update(download_bytes=0)
    after = communication(run)
    assert after.total_uploaded == before.total_uploaded
    assert after.total_data_parallel == before.total_data_parallel
    per_lease = before.total_downloaded // len(leases)  # every unit: its path's fp32 files
    assert after.total_downloaded == before.total_downloaded - 2 * per_lease + 1000
    assert after.ratio == pytest.approx(after.total_data_parallel / after.total_moved)
    html = client.get(f"/runs/{run.pk}/").content.decode()
    section = html[html.index('id="run-communication"') :].split("</section>")[0]
    assert 'data-bytes="download"' in section and 'data-bytes="upload"' in section


# --- on the cluster ---------------------------------------------------------------------------

ROUNDS = 6  # the unit of round 5 starts from version 5: five published updates later
INNER_STEPS = 6
MODULES = ("0.0", "1.0", "shared")  # a 2x1 layout of the micro model
REDIS_DB = 10  # not 15, 14, 13, 12 or 11 (other tests' and benchmarks'; see their notes)
SETTINGS_MODULE = """\
from dipaco_server.settings import *  # noqa: F403

DIPACO_ROUND_QUORUM = 1.0
CELERY_TASK_DEFAULT_QUEUE = {queue!r}
CELERY_RESULT_EXPIRES = 600
CELERY_BEAT_SCHEDULE = {{
    name: {{**entry, "schedule": 1.0}}
    for name, entry in CELERY_BEAT_SCHEDULE.items()  # noqa: F405
}}
"""


@pytest.fixture
def cluster(
    tmp_path: Path, postgres_url: str, redis_url: str, s3_server: S3Server, s3_bucket: str
) -> Iterator[dict[str, Any]]:
    import psycopg
    import redis

    from dipaco_demo.control import free_port
    from tests.conftest import with_database

    name = f"dipaco_downloads_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    admin_db = with_database(postgres_url, "postgres")
    with psycopg.connect(admin_db, autocommit=True, connect_timeout=5) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    database = with_database(postgres_url, name)
    queue = f"dipaco-downloads-{uuid.uuid4().hex[:8]}"
    settings_dir = tmp_path / "settings"
    settings_dir.mkdir()
    (settings_dir / "downloads_settings.py").write_text(SETTINGS_MODULE.format(queue=queue))
    redis_db = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    port = free_port()
    python_path = os.pathsep.join(filter(None, [str(settings_dir), os.environ.get("PYTHONPATH")]))
    environ = compose_env(
        DATABASE_URL=database, REDIS_URL=redis_db, **s3_server.environ(s3_bucket),
        DIPACO_DATA_DIR=str(tmp_path / "data"), DIPACO_PUBLIC_URL=f"http://127.0.0.1:{port}",
        DIPACO_HOST="127.0.0.1", DIPACO_PORT=str(port), WEB_CONCURRENCY="2",
        CELERY_CONCURRENCY="2", DJANGO_SETTINGS_MODULE="downloads_settings",
        PYTHONPATH=python_path,
    )  # fmt: skip
    processes: dict[str, Any] = {}
    try:
        migrate = compose_command("migrate", environ)
        assert start_process(migrate, environ, tmp_path / "migrate.log").wait(180) == 0
        for process in ("web", "worker", "beat"):
            processes[process] = start_process(
                compose_command(process, environ), environ, tmp_path / f"{process}.log"
            )
        yield {"environ": environ, "url": f"http://127.0.0.1:{port}", "database": database,
               "logs": tmp_path, "processes": processes}  # fmt: skip
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.terminate()
        for process in processes.values():
            stop_process(process)
        client = redis.Redis.from_url(redis_db)
        for key in client.scan_iter(f"*{queue}*"):
            client.delete(key)
        client.close()
        with psycopg.connect(admin_db, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def query(database: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    import psycopg

    with psycopg.connect(database, connect_timeout=5) as conn:
        return list(conn.execute(sql, params).fetchall())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_on_the_cluster_a_worker_downloads_only_int8_updates_and_holds_the_servers_weights(
    tmp_path: Path, cluster: dict[str, Any], s3_server: S3Server, s3_bucket: str
) -> None:
    from dipaco_demo.control import AdminClient
    from dipaco_demo.plan import DemoPlan, stdlib_sample
    from tests.test_worker_agent_cluster import Agent, admin, healthy, run_state, wait_until

    environ, url, database = cluster["environ"], cluster["url"], cluster["database"]
    cluster["agents"] = agents = [Agent("agent-0", tmp_path / "agent-0", tmp_path / "agent.log")]
    with ThreadPoolExecutor(1) as pool:
        enrolling = pool.submit(admin, environ, "enroll", "--uses", "1")
        admin(environ, "createuser", "ops", "--staff")
        client = AdminClient(url, admin(environ, "token", "create", "ops"))
        enrollment = enrolling.result()
    wait_until(lambda: healthy(url), "the web to answer", cluster, 90)
    agent = agents[0]
    agent.start(url, enrollment, environ)

    corpus = stdlib_sample(tmp_path / "data" / "corpus", 300_000)
    dataset = client.dataset("stdlib-sample", str(corpus))
    plan = DemoPlan(paths=(2, 1), model_size="micro", rounds=ROUNDS, inner_steps=INNER_STEPS)
    config = plan.config("downloads", corpus).model_dump(mode="json")
    config["comm"]["download_codec"] = "int8"
    config["outer"]["verify"] = False  # a few steps' Δs: every one stepped, every round
    run_id = client.create_run("downloads", config, dataset["id"])["id"]
    client.move(run_id, "start")
    wait_until(lambda: run_state(client, run_id, "ready"), "ready", cluster, 90)
    client.move(run_id, "start")
    wait_until(lambda: run_state(client, run_id, "finished"), "the run to finish", cluster, 420)
    client.close()

    # Every version after 0 came with its int8 update; each module stepped every round.
    # Retention kept the newest DIPACO_RETENTION_VERSIONS (4) and deleted the older ones'
    # blobs with them: weights, momentum, update and residual alike.
    kept = range(ROUNDS + 1 - 4, ROUNDS + 1)

    def swept() -> list[tuple[Any, ...]] | None:  # beat sweeps every second
        rows = query(database, "SELECT m.module_id, v.version, v.blob_key, v.sha256, v.size, "
                     "v.update_key, v.update_size, v.residual_key FROM runs_moduleversion v "
                     "JOIN runs_module m ON m.id = v.module_id WHERE m.phase = 2 "
                     "ORDER BY 1, 2")  # fmt: skip
        done = [(m, v) for m, v, *_ in rows] == [(m, v) for m in MODULES for v in kept]
        return rows if done else None

    versions = wait_until(swept, "retention to keep the newest 4 versions", cluster, 60)
    s3 = s3_server.client()
    for module_id, _v, _, _, size, update_key, update_size, residual_key in versions:
        # int8: a byte a value, a scale per 64, and the header, against 4 bytes a value
        assert update_key and residual_key and 0 < update_size < size / 2
        for folder, key in (("updates", update_key), ("residual", residual_key)):
            prefix = f"runs/{run_id}/modules/{module_id}/{folder}/"
            listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix=prefix).get("Contents", [])
            assert key.startswith(prefix)
            assert sorted(o["Key"] for o in listed) == sorted(
                f"{prefix}v{w}.safetensors" for w in kept
            ), "the swept versions' updates and residuals are gone, the kept ones' are there"

    # What the agent downloaded: fp32 modules once, then only updates (or nothing: its second
    # unit of a round starts from the version it just rebuilt).
    fetched = [e for e in agent.snapshot() if e.get("event") == "modules"]
    leases = [e for e in agent.snapshot() if e.get("event") == "lease"]
    assert len(fetched) == len(leases) == 2 * ROUNDS
    first, *later = fetched
    assert (first["download_whole"], first["download_from_updates"]) == (len(MODULES), 0)
    for event in later:
        assert event["download_whole"] == event["download_fallbacks"] == 0, event
        assert event["download_from_updates"] + event["download_held"] == len(MODULES)
    rebuilt = [e for e in later if e["download_from_updates"]]
    assert len(rebuilt) == ROUNDS - 1, "one rebuild a round, from round 1 on"

    # What the server recorded per lease (the dashboard's "down"): the same bytes.
    size = {(m, v): (s, u) for m, v, _, _, s, _, u, _ in versions}
    recorded = query(database, "SELECT r.t, l.download_bytes FROM rounds_lease l JOIN "
                     "rounds_workunit w ON w.id = l.unit_id JOIN rounds_round r ON "
                     "r.id = w.round_id WHERE l.state = 'completed' ORDER BY l.id")  # fmt: skip
    by_round: dict[int, list[int]] = {}
    for t, downloaded in recorded:
        by_round.setdefault(t, []).append(downloaded)
    assert sorted(by_round[0]) == [0, first["download_module_bytes"]]
    for t, event in zip(range(1, ROUNDS), rebuilt, strict=True):
        assert sorted(by_round[t]) == [0, event["download_update_bytes"]], t
        if t in kept:
            assert event["download_update_bytes"] == sum(size[(m, t)][1] for m in MODULES)
    assert first["download_module_bytes"] > 2 * max(max(by_round[t]) for t in range(1, ROUNDS))

    # After five outer steps the agent holds the server's version 5, byte for byte.
    held = json.loads((agent.data_dir / "cache" / "held" / f"run-{run_id}.json").read_text())
    for module_id, version, key, sha256, *_ in versions:
        if version != ROUNDS - 1:
            continue
        assert held[module_id] == [version, sha256]
        mine = (agent.data_dir / "cache" / "blobs" / sha256).read_bytes()
        servers = s3.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
        assert mine == servers, module_id
        spec = module_spec(RunConfig.model_validate(config), module_id)
        assert read_module(agent.data_dir / "cache" / "blobs" / sha256, spec, sha256)
