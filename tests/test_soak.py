"""The soak (bench/soak.py, issue 11), short: volunteers through real rounds with random kills.

The command runs as the operator runs it, in its own process: gunicorn, a Celery worker
and beat (the project's commands), a moto S3 server and a fresh PostgreSQL database, on
the session's Redis through a queue of its own. A fifth of the units are abandoned by
their volunteer (their leases must expire and the units go to someone else) and the
Celery worker is killed with SIGKILL and restarted during the run; the outer steps are
real (valid Δ uploads of a tiny model). The long run and its figures: docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import ROOT

SOAK_TIMEOUT_S = 300


@pytest.mark.timeout(SOAK_TIMEOUT_S + 30)
def test_a_short_soak_with_killed_volunteers_and_a_killed_celery_worker_loses_and_duplicates_nothing(
    postgres_url: str, redis_url: str, tmp_path: Path
) -> None:
    server = urlunsplit(urlsplit(postgres_url)._replace(path="/postgres"))
    report = tmp_path / "soak.json"
    command = [
        sys.executable, str(ROOT / "bench" / "soak.py"), "--quiet",
        "--volunteers", "24", "--units-per-volunteer", "0.5", "--duration", "32",
        "--min-rounds", "2", "--max-duration", "150",
        "--unit-seconds", "3", "--ramp", "3", "--lease-timeout", "9", "--sweep-every", "2",
        "--kill-fraction", "0.2", "--celery-kill-every", "20", "--celery-kill-max", "1",
        "--visibility-timeout", "10",
        "--round-deadline", "12", "--web-workers", "1", "--task-concurrency", "1",
        "--postgres", server, "--redis", redis_url, "--json", str(report),
    ]  # fmt: skip
    environ = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        command, env=environ, capture_output=True, text=True, timeout=SOAK_TIMEOUT_S
    )
    assert report.exists(), f"no report (exit {done.returncode}):\n{done.stdout}\n{done.stderr}"
    result = json.loads(report.read_text())
    units = result["units"]

    assert units["lost"] == 0, done.stdout
    assert units["duplicated"] == 0, done.stdout
    assert units["versions_skipped"] == 0 and units["versions_applied_twice"] == 0, done.stdout
    assert units["rounds_closed"] >= 2, done.stdout
    # Every closed round stepped every module of the grid (4 paths: 5 modules) exactly once.
    assert units["outer_steps"] >= 5 * units["rounds_closed"], done.stdout
    assert units["completed_by_clients"] > 0 and units["leases_expired"] > 0, done.stdout
    assert result["kills"]["celery worker kill -9"] == 1, done.stdout
    assert sum(n for kind, n in result["kills"].items() if kind.startswith("volunteer")) > 0
    assert result["latency"]["complete"]["requests"] > 0
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
