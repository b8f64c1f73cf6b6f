"""schemathesis `--checks all` against a live server, on both backends, under three identities.

For each backend, the embedded default (SQLite, the filesystem broker, local blobs) and
the cluster (PostgreSQL, Redis, an S3 server), the server is started with
docker-compose.yml's own migrate and web (gunicorn) commands, its database seeded by
`tests.conformance_seed` (a real prepared run, started, with a lease granted to a
registered worker), and schemathesis' CLI runs every check against the schema the
server serves, as three identities, one after the other:

- anonymous: no Authorization header;
- worker: the registered worker's token (its lease id and X-Lease-Secret offered to
  the lease routes through dictionaries, so requests get past the 404s);
- staff: a staff API token (last: it may cancel the run and revoke the worker); on the
  embedded default also through schemathesis' stateful phase, which follows the schema's
  links from answers to requests.

Both backends get schemathesis' examples and fuzzing; the coverage phase (every edge of
every keyword, about 2,800 requests) runs on the cluster only: the request checks
are the same code on both, and PostgreSQL is the stricter store of the two (it enforces
column lengths, 32-bit integers and no NUL in text, where SQLite stores them).

Real ids are offered with a probability, so generated ones are tried too. The rate
limits are off on this server (tests/test_rate_limits.py covers them); everything else
is the production configuration. Under CI=true the seed is fixed and the examples per
operation bounded, so the whole module takes a few minutes on two cores. Each run's
output and JUnit report go to test-artifacts/conformance/.

The schema declares what the server enforces (dipaco_server.patterns: names without
control characters, route text that is not only whitespace, a dataset source the server
can read, no NUL in the audit-log filters; a closed, bounded run config; a `held` query
that fits gunicorn's request line; tests/test_openapi_patterns.py compares them code point
by code point). Statuses are added to what `positive_data_acceptance` expects only for the
operations whose schema cannot say everything the server checks (CONFIG_EXPECTATIONS
below); every other check runs with schemathesis' defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from tests.conftest import (
    CI,
    ROOT,
    S3Server,
    compose_command,
    compose_env,
    log_tail,
    start_process,
    stop_process,
)

ARTIFACTS = ROOT / "test-artifacts" / "conformance"
SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
SEED = 21
MAX_EXAMPLES = 4 if CI else 10
READY_TIMEOUT_S = 120.0
RUN_TIMEOUT_S = 300
REDIS_DB = 12  # not the redis_url fixture's db 15, which other sessions flush
IDENTITIES = ("anonymous", "worker", "staff")

# Operations whose request schema cannot express every rule the server applies; their
# refusals of schema-valid requests are the documented 4xx in the one error shape:
# - POST /datasets: whether a source lies under DIPACO_DATA_ROOTS (server configuration);
# - POST /runs: the run config's cross-field rules (dipaco.config, e.g. heads divide the
#   hidden size, a config name equal to the run's), answered config_invalid with each problem;
# - POST /runs/{run_id}/checkpoint: whether the uploaded file is a model checkpoint;
# - POST /worker/register: the device JSON within its size in bytes (the token's validity
#   is a 403);
# - POST /worker/lease/{lease_id}/complete: whether the uploads exist with that size.
CONFIG_EXPECTATIONS = {
    ("POST", "/api/v1/datasets"): ["422"],
    ("POST", "/api/v1/runs"): ["400", "422"],
    ("POST", "/api/v1/runs/{run_id}/checkpoint"): ["400", "413", "422"],
    ("POST", "/api/v1/worker/register"): ["422"],
    ("POST", "/api/v1/worker/lease/{lease_id}/complete"): ["422"],
}
# schemathesis' defaults without "5xx" (never acceptable here), plus 414 for negatives.
POSITIVE_DEFAULT = ["2xx", "3xx", "401", "403", "404", "409", "429"]
NEGATIVE_DEFAULT = [
    "400",
    "401",
    "403",
    "404",
    "405",
    "406",
    "409",
    "414",
    "415",
    "422",
    "428",
    "429",
]


# The coverage phase sends every edge of every keyword: over a thousand requests for the
# run config alone. Each identity runs it where its token is accepted, the worker on the
# worker and inference APIs (the latter answers anyone alike while DIPACO_PUBLIC_READ is
# on), staff on the admin API; elsewhere the token is refused before the body is read, so
# every edge would be the same 401/403. Fuzzing still sends each operation every token.
COVERAGE_SKIPPED = {"worker": "^admin: ", "staff": "^(worker|inference)$"}


def schemathesis_config(seed: dict[str, Any], identity: str) -> str:
    """schemathesis.toml: real ids (and the lease secret) offered to path parameters."""
    ids = seed["ids"]
    lines = []
    for name in ("run_id", "dataset_id", "worker_id", "token_id", "lease_id", "path_index"):
        lines += [f"[dictionaries.{name}]", f"values = [{int(ids[name])}]", ""]
    lines += ["[dictionaries.secret]", f"values = [{json.dumps(seed['secret'])}]", ""]
    lines += ["[parameters]"]
    for name in ("run_id", "dataset_id", "worker_id", "token_id", "lease_id", "path_index"):
        lines.append(f'"path.{name}" = {{ dictionary = "{name}", probability = 0.7 }}')
    if identity == "worker":
        lines.append('"header.X-Lease-Secret" = { dictionary = "secret", probability = 0.8 }')
    lines.append("")
    # A request line over gunicorn's limit (http_limits.REQUEST_LINE_LIMIT) is refused by
    # gunicorn itself (documented as 414 on every operation): a refusal of the invalid
    # request, like a 4xx of Django's. No schema-valid request line reaches the limit.
    lines += [
        "[checks.negative_data_rejection]",
        f"expected-statuses = {json.dumps(NEGATIVE_DEFAULT)}",
        "",
    ]
    if identity in COVERAGE_SKIPPED:
        lines += [
            "[[operations]]",
            f"include-tag-regex = {json.dumps(COVERAGE_SKIPPED[identity])}",
            "phases.coverage.enabled = false",
            "",
        ]
    for (method, path), extra in CONFIG_EXPECTATIONS.items():
        statuses = json.dumps(POSITIVE_DEFAULT + extra)
        lines += [
            "[[operations]]",
            f'include-name = "{method} {path}"',
            f"checks.positive_data_acceptance.expected-statuses = {statuses}",
            "",
        ]
    return "\n".join(lines)


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the web exited:\n{log_tail(log)}"
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=3).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the web never became healthy:\n{log_tail(log)}")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def serve(environ: dict[str, str], work: Path) -> Iterator[dict[str, Any]]:
    """Migrate, seed, start gunicorn (compose's commands); yields url and seed."""
    port = free_port()
    environ = {
        **environ,
        "DIPACO_DATA_DIR": str(work / "data"),
        "DIPACO_PUBLIC_URL": f"http://127.0.0.1:{port}",
        "DIPACO_HOST": "127.0.0.1",
        "DIPACO_PORT": str(port),
        "WEB_CONCURRENCY": "1",
        # Limits are tested in test_rate_limits.py; here they would answer the fuzzer 429.
        "DIPACO_RATE_LIMIT_WORKER": "off",
        "DIPACO_RATE_LIMIT_ADDRESS": "off",
        "DIPACO_RATE_LIMIT_PUBLIC": "off",
    }
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=300
    )
    assert migrate.returncode == 0, migrate.stderr.decode(errors="replace")
    seeded = subprocess.run(
        [sys.executable, "-m", "tests.conformance_seed"],
        env={**environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert seeded.returncode == 0, seeded.stderr[-4000:]
    seed = json.loads(seeded.stdout.strip().splitlines()[-1])
    log = work / "web.log"
    web = start_process(compose_command("web", environ), environ, log)
    try:
        wait_healthy(environ["DIPACO_PUBLIC_URL"], web, log)
        yield {"url": environ["DIPACO_PUBLIC_URL"], "seed": seed, "log": log}
    finally:
        stop_process(web)


def fuzz_command(
    seed: dict[str, Any], identity: str, url: str, work: Path, *, coverage: bool
) -> list[str]:
    config = work / f"schemathesis-{identity}.toml"
    config.write_text(schemathesis_config(seed, identity))
    # The coverage phase (every keyword's edge and every missing header) runs as the worker
    # and as staff, each on the operations its token opens (COVERAGE_SKIPPED); it already
    # sends each of their requests without the token. Anonymous requests change nothing, so
    # that run fuzzes only, alongside the worker's. It runs on one backend (`coverage`):
    # PostgreSQL, the stricter store (column lengths, 32-bit integers, no NUL in text).
    covered = coverage and identity != "anonymous"
    phases = "examples,coverage,fuzzing" if covered else "examples,fuzzing"
    if identity == "staff" and not coverage:
        # The stateful phase follows the schema's links from one answer to the next request
        # (a run's dataset_id to GET /datasets/{dataset_id}): as staff, who reach every
        # admin route, on the embedded default (the cluster runs the coverage phase).
        phases += ",stateful"
    command = [
        str(SCHEMATHESIS), "--no-color", "--config-file", str(config), "run",
        f"{url}/api/v1/openapi.json",
        "--checks", "all",
        "--phases", phases,
        "--max-examples", str(MAX_EXAMPLES),
        "--workers", "1",  # hypothesis parses lambdas with ast, which races across threads
        "--suppress-health-check", "all",
        "--report", "junit",
        "--report-junit-path", str(ARTIFACTS / f"{identity}.junit.xml"),
    ]  # fmt: skip
    if CI:
        command += ["--seed", str(SEED), "--generation-deterministic"]
    if identity != "anonymous":
        command += ["-H", f"Authorization: Bearer {seed[identity]}"]
    return command


def outcome(backend: str, identity: str, process: subprocess.Popen[str]) -> str | None:
    """None when the run found nothing, else its failures (without reproduction commands)."""
    try:
        output, _ = process.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
    name = f"{backend}-{identity}"
    (ARTIFACTS / f"{name}.txt").write_text(output)
    junit = ARTIFACTS / f"{identity}.junit.xml"
    if junit.exists():
        junit.rename(ARTIFACTS / f"{name}.junit.xml")
    if process.returncode == 0:
        return None
    failures = output.split("FAILURES", 1)[-1]
    failures = re.sub(r"Reproduce with:.*?st replay \w+", "", failures, flags=re.S)
    return f"{name}: exit {process.returncode}\n{failures[:6000]}"


def fuzz_every_identity(
    server: dict[str, Any], backend: str, work: Path, *, coverage: bool
) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def start(identity: str) -> subprocess.Popen[str]:
        command = fuzz_command(server["seed"], identity, server["url"], work, coverage=coverage)
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work
        )

    anonymous, worker = start("anonymous"), start("worker")
    found = [outcome(backend, "worker", worker), outcome(backend, "anonymous", anonymous)]
    found.append(outcome(backend, "staff", start("staff")))  # last: it may revoke the worker
    problems = [problem for problem in found if problem is not None]
    server_errors = [
        line for line in log_tail(server["log"], 100_000).splitlines() if "Traceback" in line
    ]
    assert not problems, "\n\n".join(problems) + f"\n(full output in {ARTIFACTS})"
    assert not server_errors, log_tail(server["log"], 200)


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_embedded_default(tmp_path: Path) -> None:
    environ = compose_env()  # nothing set: SQLite, filesystem broker, local blobs
    with serve(environ, tmp_path) as server:
        fuzz_every_identity(server, "embedded", tmp_path, coverage=False)


@pytest.mark.slow
def test_schemathesis_finds_nothing_on_the_cluster(
    tmp_path: Path, postgres_url: str, redis_url: str, s3_server: S3Server, s3_bucket: str
) -> None:
    import redis

    redis_db = urlunsplit(urlsplit(redis_url)._replace(path=f"/{REDIS_DB}"))
    redis.Redis.from_url(redis_db).flushdb()
    environ = compose_env(
        DATABASE_URL=postgres_url, REDIS_URL=redis_db, **s3_server.environ(s3_bucket)
    )
    try:
        with serve(environ, tmp_path) as server:
            fuzz_every_identity(server, "cluster", tmp_path, coverage=True)
    finally:
        redis.Redis.from_url(redis_db).flushdb()


def test_the_schemathesis_config_offers_the_seeded_ids_and_secret() -> None:
    seed = {
        "secret": "dpl_x",
        "ids": dict.fromkeys(
            ("run_id", "dataset_id", "worker_id", "token_id", "lease_id", "path_index"), 3
        ),
    }
    import tomllib

    config = tomllib.loads(schemathesis_config(seed, "worker"))
    assert config["dictionaries"]["lease_id"]["values"] == [3]
    assert config["dictionaries"]["secret"]["values"] == ["dpl_x"]
    assert "header.X-Lease-Secret" in config["parameters"]
    staff = tomllib.loads(schemathesis_config(seed, "staff"))
    assert "header.X-Lease-Secret" not in staff["parameters"]
    skipped = {o.get("include-tag-regex"): o for o in staff["operations"]}["^(worker|inference)$"]
    assert skipped["phases"]["coverage"]["enabled"] is False
    assert os.fspath(ARTIFACTS).endswith("test-artifacts/conformance")
