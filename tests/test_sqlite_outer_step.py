"""On the embedded SQLite database an outer step never holds the write lock while it copies
a module: heartbeats and completions sent meanwhile are answered, none "database is locked".

tests/sqlite_outer_step.py runs in a process of its own on a fresh SQLite data dir (the
session's database is PostgreSQL when it answers) and, while the step writes the new
module blob, sends five heartbeats through the HTTP API and completes another run's unit.
Its SQLite busy timeout is 3 s, so a lock held across the blob write fails them quickly.
Latencies are printed, not asserted. The 50M-parameter figure (module 0.0 of hidden 1024
and 4 layers is 50.3M parameters): `python -m tests.sqlite_outer_step 1024 4 0.0`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def test_heartbeats_and_completions_during_an_outer_step_on_sqlite_are_answered(
    tmp_path: Path,
) -> None:
    environ = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    environ.update(DIPACO_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "tests.sqlite_outer_step", "32", "2"],
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["hooked"], "the calls must run while the module blob is written"
    assert report["outcome"] == "stepped"
    kinds = sorted(event["kind"] for event in report["events"])
    assert kinds == ["complete"] + ["heartbeat"] * 5
    failed = [event for event in report["events"] if event["error"]]
    assert not failed, failed
    assert "database is locked" not in result.stderr
    print({e["kind"]: round(e["seconds"], 3) for e in report["events"]})
