"""The control plane as the demo uses it: `dipaco server` as a child, tokens, the admin API.

The server is the real ``dipaco server`` command in its own session, its output (and its
children's) in a log file, on the embedded default in the demo's data dir: service URLs
in the environment (DATABASE_URL, REDIS_URL, S3_*) are left out, so a demo never writes
to a real deployment. The demo process opens the same SQLite database through Django only
to mint its staff and enrollment tokens, as ``dipaco admin`` does, and to read what the
admin API does not serve (the run's token shards and the sizes of what was sent).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from dipaco_server.cli.server import die_with_parent

# The server's own variables that point at services; the demo runs without them.
SERVICE_VARIABLES = (
    "DATABASE_URL", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET", "S3_ACCESS_KEY_ID",
    "S3_SECRET_ACCESS_KEY", "S3_REGION", "DIPACO_PUBLIC_URL", "ALLOWED_HOSTS",
)  # fmt: skip
READY_TIMEOUT_S = 180.0  # migrations on a first start, and four Python processes importing
STOP_TIMEOUT_S = 45.0  # dipaco server gives its children 20 s, then kills them
API_TIMEOUT_S = 60.0
STAFF_USER = "demo"


class DemoError(Exception):
    """A failure to report as one line (the message says what to do)."""


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def embedded_environ(data_dir: Path, url: str) -> dict[str, str]:
    """This process's environment for the embedded default in `data_dir`, served at `url`."""
    environ = {k: v for k, v in os.environ.items() if k not in SERVICE_VARIABLES}
    environ.update(
        DIPACO_DATA_DIR=str(data_dir),
        DIPACO_PUBLIC_URL=url,
        DJANGO_SETTINGS_MODULE="dipaco_server.settings",
    )
    return environ


def log_tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class ServerProcess:
    """`dipaco server` on 127.0.0.1:`port`, output appended to `log_path`."""

    def __init__(
        self, environ: dict[str, str], port: int, log_path: Path, *, task_concurrency: int = 2
    ) -> None:
        self.environ, self.port, self.log_path = environ, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.task_concurrency = task_concurrency
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        args = ["server", "--host", "127.0.0.1", "--port", str(self.port),
                "--web-workers", "2", "--task-concurrency", str(self.task_concurrency)]  # fmt: skip
        code = f"import sys; from dipaco.cli import main; sys.exit(main({args!r}))"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            # Its own session: Ctrl+C reaches the demo alone, which stops the workers
            # before the server they talk to.
            self.process = subprocess.Popen(
                [sys.executable, "-c", code], env=self.environ, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent,
            )  # fmt: skip

    def wait_until_healthy(self, stopped: Callable[[], bool] = lambda: False) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and not stopped():
            if self.process is None or self.process.poll() is not None:
                raise DemoError(
                    f"dipaco server exited while starting; its log ({self.log_path}) ends:\n"
                    + log_tail(self.log_path)
                )
            try:
                if httpx.get(f"{self.url}/api/v1/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.3)
        if not stopped():
            raise DemoError(f"dipaco server did not become healthy; see {self.log_path}")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(timeout=10)


# --- tokens, through Django (as `dipaco admin`) ------------------------------------------


def setup_django(environ: dict[str, str]) -> None:
    """Point this process's Django at the demo's database (before anything imports it)."""
    for name in SERVICE_VARIABLES:
        os.environ.pop(name, None)
    os.environ.update(environ)
    from dipaco_server.cli.admin import setup_django as setup  # after os.environ is set

    setup()
    # The server logs what it does; here its INFO lines would break the panel.
    logging.getLogger("dipaco_server").setLevel(logging.WARNING)


def mint_tokens(label: str, enrollments: int) -> tuple[str, str]:
    """(a staff API token of the user "demo", an enrollment token for `enrollments` workers)."""
    # Django: set up by setup_django when the server's database is first needed
    from django.db import connections

    # The server's models: importable once setup_django (above) has set Django up.
    from dipaco_server.accounts.services import UserExists, create_api_token, create_user, find_user
    from dipaco_server.workers.services import create_enrollment_token

    try:
        user, _ = create_user(STAFF_USER, staff=True)
    except UserExists:
        user = find_user(STAFF_USER)
        if not user.is_staff:
            user.is_staff = True
            user.save(update_fields=["is_staff"])
    _, api_token = create_api_token(user, name=label[:100])
    _, enroll = create_enrollment_token(
        created_by=user, label=label[:100], max_uses=max(1, enrollments),
        expires_in=timedelta(hours=2),
    )  # fmt: skip
    connections.close_all()
    return api_token, enroll


# --- the admin API -------------------------------------------------------------------------


class AdminClient:
    """The admin API with a staff token; a refusal raises DemoError with the API's message."""

    def __init__(self, server: str, token: str) -> None:
        self.server = server.rstrip("/")
        self.http = httpx.Client(
            base_url=f"{self.server}/api/v1",
            headers={"Authorization": f"Bearer {token}"},
            timeout=API_TIMEOUT_S,
        )

    def close(self) -> None:
        self.http.close()

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise DemoError(f"{method} {path}: the server does not answer ({exc})") from None
        if response.status_code >= 400:
            try:
                error = response.json()["error"]
                message = f"{error['code']}: {error['message']}"
            except (ValueError, KeyError, TypeError):
                message = response.text[:300]
            raise DemoError(f"{method} {path} -> {response.status_code} {message}")
        return response.json() if response.content else None

    def items(self, path: str, **params: Any) -> list[Any]:
        """Every item of a paginated list."""
        found: list[Any] = []
        while True:
            page = self.call("GET", path, params={**params, "limit": 500, "offset": len(found)})
            found.extend(page["items"])
            if not page["items"] or len(found) >= page["count"]:
                return found

    def dataset(self, name: str, source: str) -> dict[str, Any]:
        """The dataset `name` (created the first time; later demos reuse it)."""
        for dataset in self.items("/datasets"):
            if dataset["name"] == name:
                return dict(dataset)
        return dict(self.call("POST", "/datasets", json={"name": name, "source": source}))

    def create_run(self, name: str, config: dict[str, Any], dataset_id: int) -> dict[str, Any]:
        body = {"name": name, "config": config, "dataset_id": dataset_id}
        return dict(self.call("POST", "/runs", json=body))

    def run(self, run_id: int) -> dict[str, Any]:
        return dict(self.call("GET", f"/runs/{run_id}"))

    def move(self, run_id: int, action: str) -> dict[str, Any]:
        """start, pause, resume or cancel."""
        return dict(self.call("POST", f"/runs/{run_id}/{action}"))

    def metrics(self, run_id: int, name: str) -> list[dict[str, Any]]:
        return self.items(f"/runs/{run_id}/metrics", name=name)
