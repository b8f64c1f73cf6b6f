"""`dipaco server` and the docker-compose.yml commands, run for real over HTTP."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from dipaco import __version__
from dipaco_server.cli.server import child_commands
from dipaco_server.env import KNOWN_VARIABLES, celery_transport
from dipaco_server.http_limits import REQUEST_LINE_LIMIT
from tests.conftest import (
    celery_client,
    compose_command,
    compose_env,
    compose_file,
    log_tail,
    start_process,
    stop_process,
)
from tests.test_openapi_patterns import longest_manifest_request, request_line

# `dipaco ...` exactly as the console script runs it, without needing it on PATH.
DIPACO = [sys.executable, "-c", "import sys; from dipaco.cli import main; sys.exit(main())"]
READY_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def fetch(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def wait_for_health(base: str, process: subprocess.Popen[bytes], log: Path) -> dict[str, object]:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited early:\n{log_tail(log)}"
        try:
            status, body = fetch(f"{base}/api/v1/health")
            if status == 200:
                return dict(json.loads(body))
        except OSError:
            pass  # not listening yet
        time.sleep(0.3)
    raise AssertionError(f"{base}/api/v1/health never answered 200:\n{log_tail(log)}")


def test_dipaco_server_serves_the_api_on_the_embedded_default_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    data, log, port = tmp_path / "data", tmp_path / "server.log", free_port()
    base = f"http://127.0.0.1:{port}"
    environ = compose_env(DIPACO_DATA_DIR=str(data))  # nothing else: the embedded default
    args = ["server", "--port", str(port), "--web-workers", "1", "--task-concurrency", "1"]
    server = start_process([*DIPACO, *args], environ, log)
    try:
        health = wait_for_health(base, server, log)
        assert health == {
            "status": "ok",
            "version": __version__,
            "database": {"ok": True, "detail": "sqlite"},
            "broker": {"ok": True, "detail": "filesystem"},
        }
        status, schema = fetch(f"{base}/api/v1/openapi.json")
        assert status == 200
        assert "/api/v1/health" in json.loads(schema)["paths"]

        status, docs = fetch(f"{base}/api/v1/docs")
        assert status == 200
        assets = re.findall(r'(?:src|href)="([^"]+)"', docs.decode())
        assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
        for asset in assets:  # served by this server, not a CDN
            assert asset.startswith("/static/"), asset
            assert fetch(f"{base}{asset}")[0] == 200, asset

        status, landing = fetch(f"{base}/")
        assert status == 200 and b"/api/v1/docs" in landing

        # Its worker consumes the filesystem broker in the data dir.
        nonce = uuid.uuid4().hex
        client = celery_client(celery_transport(data, None), "celery")
        answer = client.send_task("dipaco_server.core.tasks.ping", args=[nonce]).get(timeout=60)
        assert answer["nonce"] == nonce
        client.close()
    finally:
        code = stop_process(server, timeout=45)
    output = log_tail(log, 400)
    assert code == 0, output
    assert f"dipaco control plane: {base}" in output
    children = [int(pid) for pid in re.findall(r"^started \w+ \(pid (\d+)\)", output, re.M)]
    assert len(children) == 3, output
    for pid in children:
        assert not Path(f"/proc/{pid}").exists(), f"child {pid} outlived the server"


def test_dipaco_server_refuses_a_malformed_database_url_with_the_fix(tmp_path: Path) -> None:
    environ = compose_env(DIPACO_DATA_DIR=str(tmp_path), DATABASE_URL="postgres//x")
    result = subprocess.run(
        [*DIPACO, "server", "--port", str(free_port())],
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "DATABASE_URL='postgres//x'" in result.stderr
    assert "expected e.g. postgres://user:pass@host:5432/db" in result.stderr
    assert "Traceback" not in result.stderr


def test_dipaco_server_help_explains_the_settings() -> None:
    result = subprocess.run(
        [*DIPACO, "server", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0
    for variable in ("DATABASE_URL", "REDIS_URL", "S3_BUCKET", "DIPACO_DATA_DIR"):
        assert variable in result.stdout


def test_dipaco_server_runs_the_same_commands_as_docker_compose() -> None:
    environ = {
        "DIPACO_HOST": "0.0.0.0",
        "DIPACO_PORT": "8123",
        "WEB_CONCURRENCY": "3",
        "CELERY_CONCURRENCY": "4",
    }
    ours = child_commands("0.0.0.0", 8123, web_workers=3, task_concurrency=4)
    for service, command in ours.items():
        # ours: [python, "-m", "gunicorn", ...]; compose: ["gunicorn", ...]
        assert compose_command(service, environ) == command[2:], service


def test_docker_compose_passes_django_only_variables_the_settings_read() -> None:
    passed = set(compose_file()["x-django-env"]) - {"DJANGO_SETTINGS_MODULE"}
    assert passed == KNOWN_VARIABLES


def test_the_compose_migrate_web_and_beat_commands_run_natively(tmp_path: Path) -> None:
    port = free_port()
    environ = compose_env(
        DIPACO_DATA_DIR=str(tmp_path),
        DATABASE_URL=f"sqlite:///{tmp_path / 'db.sqlite3'}",
        DIPACO_HOST="127.0.0.1",
        DIPACO_PORT=str(port),
        WEB_CONCURRENCY="1",
    )
    migrate = subprocess.run(
        compose_command("migrate", environ), env=environ, capture_output=True, timeout=180
    )
    assert migrate.returncode == 0, migrate.stderr
    web_log, beat_log = tmp_path / "web.log", tmp_path / "beat.log"
    web = start_process(compose_command("web", environ), environ, web_log)
    beat = start_process(compose_command("beat", environ), environ, beat_log)
    client = celery_client(celery_transport(tmp_path, None), "celery")
    try:
        health = wait_for_health(f"http://127.0.0.1:{port}", web, web_log)
        assert health["status"] == "ok"
        # The longest request line the schema admits reaches the app (401 in the API's
        # JSON: no worker token), not gunicorn's 414 page; one byte past the limit does not.
        base = f"http://127.0.0.1:{port}"
        line = longest_manifest_request(base)
        status, body = fetch(line)
        assert status == 401 and json.loads(body)["error"]["code"], body[:200]
        overlong = line + "0" * (REQUEST_LINE_LIMIT - len(request_line(line)) + 1)
        assert fetch(overlong)[0] == 414
        deadline, beat_answered = time.monotonic() + READY_TIMEOUT_S, False
        while not beat_answered and time.monotonic() < deadline:
            assert beat.poll() is None, log_tail(beat_log)
            replies = client.control.ping(timeout=0.5)
            beat_answered = any(name.startswith("celerybeat@") for r in replies for name in r)
        assert beat_answered, log_tail(beat_log)
    finally:
        client.close()
        codes = stop_process(web), stop_process(beat)
    assert codes == (0, 0), log_tail(web_log) + log_tail(beat_log)
    assert any(p.name.startswith("celerybeat-schedule") for p in tmp_path.iterdir())
