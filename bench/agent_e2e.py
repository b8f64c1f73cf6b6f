"""`bench/agent_overhead.py --e2e`: utilisation end to end, a server, a run and one worker.

A real ``dipaco server`` (embedded mode: SQLite, filesystem broker, local blobs, a Celery
worker for the outer steps) on loopback, a tiny 2x2-path run prepared by the server's own
`prepare_run` (stdlib corpus), and one ``dipaco-worker`` process that does every unit of
the rounds asked for. Utilisation is the worker's training seconds (the sum of its units'
``train_seconds``) over the wall seconds from its first lease to its last completion.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from dipaco.config import RunConfig

SERVICE_VARIABLES = ("DATABASE_URL", "REDIS_URL", "S3_ENDPOINT_URL", "S3_BUCKET",
                     "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY", "S3_REGION",
                     "DIPACO_PUBLIC_URL", "ALLOWED_HOSTS")  # fmt: skip


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _start_server(root: Path) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    environ = {k: v for k, v in os.environ.items() if k not in SERVICE_VARIABLES}
    environ.update(DIPACO_DATA_DIR=str(root / "server"), DIPACO_PUBLIC_URL=url,
                   DJANGO_SETTINGS_MODULE="dipaco_server.settings")  # fmt: skip
    command = [str(Path(sys.executable).with_name("dipaco")), "server", "--port", str(port),
               "--web-workers", "1", "--task-concurrency", "1"]  # fmt: skip
    with (root / "server.log").open("ab") as log:
        server = subprocess.Popen(command, env=environ, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"dipaco server exited; see {root / 'server.log'}")
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                return server, url, environ
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"dipaco server did not become healthy; see {root / 'server.log'}")


def _prepared_run(
    environ: dict[str, str], rounds: int, steps: int, overlap: str, eager_at: float | None = None
) -> tuple[int, str, int]:
    """(run id, enrollment token, units) of a started tiny run, prepared by the server's code."""
    os.environ.update(environ)
    # Django's settings come from the server's environment, set just above: the server's
    # modules are imported only after it (and only by --e2e, which needs the server extra).
    from dipaco_server.cli.admin import setup_django

    setup_django()
    from dipaco_server.rounds.lifecycle.open import start_run
    from dipaco_server.runs.prepare import prepare_run
    from dipaco_server.runs.services import create_run
    from dipaco_server.workers.services import create_enrollment_token

    outer: dict[str, Any] = {"overlap": overlap}
    if eager_at is not None:
        outer["eager_at"] = eager_at
    config = RunConfig.tiny(rounds=rounds, inner={"steps": steps, "warmup_steps": 2}, outer=outer)
    spec = config.model_dump(mode="json")
    del spec["name"]
    run = prepare_run(create_run("utilisation", spec), max_files=200)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=1)
    return run.pk, enrollment, rounds * config.num_paths * config.replicas_per_path


def _stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


def end_to_end(
    rounds: int,
    steps: int,
    threads: int,
    keep: Path | None = None,
    overlap: str = "none",
    eager_at: float | None = None,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="agent-e2e-") as tmp:
        root = Path(tmp)
        server, url, environ = _start_server(root)
        worker: subprocess.CompletedProcess[str] | None = None
        try:
            run_id, enrollment, units = _prepared_run(environ, rounds, steps, overlap, eager_at)
            # The agent as shipped: checkpoints by time, written in the background.
            command = [str(Path(sys.executable).with_name("dipaco-worker")), "--server", url,
                       "--enroll", enrollment, "--data-dir", str(root / "worker"),
                       "--json-logs", "--threads", str(threads), "--max-units", str(units)]  # fmt: skip
            worker = subprocess.run(command, capture_output=True, text=True, timeout=3600)
            events = [json.loads(line) for line in worker.stdout.splitlines()
                      if line.startswith("{")]  # fmt: skip
            if worker.returncode != 0:
                raise SystemExit(f"dipaco-worker failed:\n{worker.stdout[-3000:]}{worker.stderr}")
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
            if keep is not None:  # the server's log and the worker's JSON events, for a look
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / "server.log", keep / "server.log")
                if worker is not None:
                    (keep / "worker.jsonl").write_text(worker.stdout)
    leases = [e for e in events if e["event"] == "lease"]
    fetched = [e for e in events if e["event"] == "fetched"]
    done = [e for e in events if e["event"] == "completed"]
    wall = _stamp(done[-1]) - _stamp(leases[0])
    train = sum(float(e["train_seconds"]) for e in done)
    fetch = sum(_stamp(f) - _stamp(lease) for lease, f in zip(leases, fetched, strict=True))
    # the next lease before the last completion is the hand-in overlapping: no wait
    waiting = sum(
        max(0.0, _stamp(lease) - _stamp(d)) for d, lease in zip(done, leases[1:], strict=False)
    )
    return {"run_id": run_id, "rounds": rounds, "units": len(done), "steps": steps,
            "wall_s": wall, "train_s": train, "utilisation": train / wall,
            "fetch_s": fetch, "between_units_s": waiting,
            "train_to_complete_s": wall - train - fetch - waiting,
            "idle_polls": sum(e["event"] == "idle" for e in events), "overlap": overlap,
            "eager_at": eager_at,
            # outer.overlap eager: units that rebased, fell back to delayed, seconds waited
            "rebased": sum(e["event"] == "rebase" for e in events),
            "rebase_fallbacks": sum(e["event"] == "rebase_fallback" for e in events),
            "rebase_wait_s": sum(float(e.get("rebase_wait_s") or 0.0) for e in done),
            "load": os.getloadavg() if hasattr(os, "getloadavg") else None}  # fmt: skip
