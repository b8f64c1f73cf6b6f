"""``dipaco server``: the control plane on this machine, in one command.

Applies migrations, then runs three child processes — gunicorn (web + API),
a Celery worker and Celery beat — and stops them together on Ctrl-C/SIGTERM.
The child commands are the ones docker-compose.yml runs (a test checks that
they agree), so the embedded mode and the cluster mode run the same code.
Django is imported only when the command runs: a worker-only install still
has the rest of the ``dipaco`` CLI.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from types import FrameType

from dipaco.cli.command import Command
from dipaco_server.http_limits import REQUEST_LINE_LIMIT

DESCRIPTION = """\
Run the dipaco control plane on this machine: the web app and API (gunicorn),
a Celery worker for the outer-optimiser tasks and Celery beat for periodic
ones. Database migrations are applied first; Ctrl-C or SIGTERM stops all three.

With nothing configured it runs the embedded default: SQLite, a filesystem
Celery broker and a local blob store, all under DIPACO_DATA_DIR
(default ~/.local/share/dipaco). Environment variables switch each part to a
service:
  DATABASE_URL       postgres://user:pass@host:5432/db
  REDIS_URL          redis://host:6379/0  (Celery broker and results)
  S3_BUCKET          with S3_ENDPOINT_URL, S3_ACCESS_KEY_ID,
                     S3_SECRET_ACCESS_KEY, S3_REGION: blobs in S3/MinIO
  DIPACO_PUBLIC_URL  the URL workers and browsers use to reach this server
                     (default: http://HOST:PORT of this command)
  SECRET_KEY, DEBUG, ALLOWED_HOSTS  as in Django (a key is generated and
                     kept in the data dir when SECRET_KEY is unset)"""

EPILOG = """\
examples:
  dipaco server
      the control plane at http://127.0.0.1:8000 (API docs: /api/v1/docs)
  DIPACO_PUBLIC_URL=http://192.168.1.5:8000 dipaco server --host 0.0.0.0
      reachable from volunteers on the local network"""

SHUTDOWN_GRACE_S = 20.0  # then SIGKILL: acks_late hands an interrupted task to the next worker
READY_TIMEOUT_S = 60.0
POLL_S = 0.2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--port", type=int, default=8000, help="port to bind (default: %(default)s)"
    )
    parser.add_argument(
        "--web-workers",
        type=int,
        default=2,
        metavar="N",
        help="gunicorn worker processes (default: %(default)s)",
    )
    parser.add_argument(
        "--task-concurrency",
        type=int,
        default=2,
        metavar="N",
        help="Celery tasks run at once; each outer step holds a module in memory "
        "(default: %(default)s)",
    )


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


WEB_WORKER_CLASS = "dipaco_server.web_worker.QueueTimingWorker"  # gthread, timed (shedding.py)
WEB_CONNECTIONS = 10_000  # per gunicorn worker process (web_worker.connection_room)
WEB_THREADS = 4  # per gunicorn worker process; each thread holds its own database connection


def child_commands(
    host: str, port: int, web_workers: int, task_concurrency: int, web_threads: int = WEB_THREADS
) -> dict[str, list[str]]:
    """The processes ``dipaco server`` supervises; docker-compose.yml runs the same ones."""
    python = sys.executable
    return {
        "web": [
            python, "-m", "gunicorn", "dipaco_server.wsgi:application",
            "--bind", _bind_address(host, port),
            "--workers", str(web_workers),
            # Threads, not gunicorn's default sync worker: a sync worker serves one
            # connection at a time and, since gunicorn 25, lingers up to 2 s after each
            # response for the peer to close, so a few slow volunteers stall it. gthread
            # also keeps connections alive between a worker's calls. See bench/control_plane.py.
            # Ours times each request's wait for a thread, for load shedding.
            "--worker-class", WEB_WORKER_CLASS, "--threads", str(web_threads),
            # Connections a process takes in (within ulimit -n): past gunicorn's 1,000, they
            # would wait in the kernel's accept queue, untimed and so never shed.
            "--worker-connections", str(WEB_CONNECTIONS),
            "--limit-request-line", str(REQUEST_LINE_LIMIT),
            "--access-logfile", "-",
            # Load the app (Django, torch, transformers: ~4 s of CPU, wsgi.py) once in the
            # master and fork the workers from it, sharing those pages, instead of once per
            # worker.
            "--preload",
            # gunicorn >= 25.1 otherwise opens ~/.gunicorn/gunicorn.ctl, which two
            # servers on one machine (or a test beside a dev server) would share.
            "--no-control-socket",
        ],
        "worker": [
            python, "-m", "celery", "-A", "dipaco_server", "worker",
            "--loglevel=INFO", f"--concurrency={task_concurrency}",
            # Mingle and gossip broadcast between workers; nothing here needs them.
            "--without-gossip", "--without-mingle",
        ],
        "beat": [
            python, "-m", "celery", "-A", "dipaco_server", "beat", "--loglevel=INFO",
            # Answers `celery inspect ping`, so beat can be health-checked like the worker.
            "--enable-remote-control",
        ],
    }  # fmt: skip


def die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if ``dipaco server`` itself is killed."""
    if sys.platform == "linux":
        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)


class Supervisor:
    """Starts child processes, notices when one exits, stops them all."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_signal: int | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = signum

    def start(self, name: str, command: list[str]) -> None:
        # Own session: a Ctrl-C reaches only this process, which then stops the
        # children in order instead of all of them racing on the same signal.
        child = subprocess.Popen(command, start_new_session=True, preexec_fn=die_with_parent)
        self.children[name] = child
        print(f"started {name} (pid {child.pid}): {' '.join(command[1:])}", flush=True)

    def exited(self) -> tuple[str, int] | None:
        for name, child in self.children.items():
            code = child.poll()
            if code is not None:
                return name, code
        return None

    def stop_all(self) -> None:
        for child in self.children.values():
            if child.poll() is None:
                child.terminate()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for name, child in self.children.items():
            try:
                child.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop in {SHUTDOWN_GRACE_S:.0f} s; killing it", flush=True)
                # The whole group: gunicorn and Celery leave their own children behind.
                os.killpg(child.pid, signal.SIGKILL)
                child.wait(timeout=10)


def _wait_until_healthy(url: str, supervisor: Supervisor) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline and supervisor.stop_signal is None:
        if supervisor.exited() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{url}/api/v1/health", timeout=2) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while a dependency comes up
        time.sleep(POLL_S)
    return False


def _prepare() -> str | None:
    """Check settings and migrate; returns an error message, or None when ready."""
    try:
        # Django only when the server starts (the module docstring)
        import django
        from django.core.exceptions import ImproperlyConfigured
    except ModuleNotFoundError:
        return "Django is not installed; install the server extra: pip install 'dipaco[server]'"
    try:
        django.setup()
    except ImproperlyConfigured as exc:
        return str(exc)
    # after django.setup() above
    from django.conf import settings
    from django.core.management import call_command
    from django.db import DatabaseError, connections

    try:
        call_command("migrate", interactive=False, verbosity=0)
    except DatabaseError as exc:
        return f"cannot migrate the database ({exc}); check DATABASE_URL and that the server runs"
    finally:
        connections.close_all()  # the children open their own
    database = settings.DATABASES["default"]
    print(f"data dir:   {settings.DIPACO_DATA_DIR}", flush=True)
    print(f"database:   {database['ENGINE'].rsplit('.', 1)[-1]} {database['NAME']}", flush=True)
    print(f"broker:     {settings.CELERY_BROKER_URL.split('://')[0]}", flush=True)
    print(f"blob store: {settings.DIPACO_BLOB_STORE['backend']}", flush=True)
    return None


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    browse_host = "127.0.0.1" if args.host in {"0.0.0.0", "::", ""} else args.host
    url = f"http://{_bind_address(browse_host, args.port)}"
    # Blob URLs handed to workers point here unless the operator says otherwise.
    os.environ.setdefault("DIPACO_PUBLIC_URL", url)
    error = _prepare()
    if error is not None:
        print(f"dipaco server: {error}", file=sys.stderr)
        return 2

    supervisor = Supervisor()
    previous = {s: signal.signal(s, supervisor.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        commands = child_commands(args.host, args.port, args.web_workers, args.task_concurrency)
        for name, command in commands.items():
            supervisor.start(name, command)
        if _wait_until_healthy(url, supervisor):
            print(f"dipaco control plane: {url}  (API docs: {url}/api/v1/docs)", flush=True)
        elif supervisor.stop_signal is None and supervisor.exited() is None:
            print(
                f"dipaco server: {url}/api/v1/health is not healthy yet; see the logs", flush=True
            )
        while supervisor.stop_signal is None:
            exited = supervisor.exited()
            if exited is not None:
                print(f"dipaco server: {exited[0]} exited with code {exited[1]}; stopping")
                code = 1
                break
            time.sleep(POLL_S)
    finally:
        supervisor.stop_all()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    print("dipaco server: stopped", flush=True)
    return code


COMMAND = Command(
    "server",
    "run the control plane (web, API, Celery worker and beat)",
    DESCRIPTION,
    add_arguments,
    run,
    epilog=EPILOG,
)
register = COMMAND.register
