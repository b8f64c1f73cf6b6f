"""`dipaco demo`, run as a user runs it: a subprocess on a fresh data dir, read back
through the JSON summary it writes and the SQLite database it leaves behind."""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dipaco.demo.control import free_port, port_is_free
from dipaco.demo.plan import stdlib_sample
from tests.conftest import compose_env

# `dipaco demo` without needing the console script on PATH.
DEMO = [sys.executable, "-m", "dipaco.cli.demo"]
SHORT = ["--model-size", "micro", "--rounds", "2", "--inner-steps", "10", "--workers", "2"]
DEMO_TIMEOUT_S = 300  # a loaded 2-core machine runs the short demo in 1-2 min


class DemoProcess:
    """A `dipaco demo` subprocess whose output is collected line by line."""

    def __init__(self, args: list[str], data_dir: Path) -> None:
        # No service URLs: the demo must not need them (and must ignore them if set).
        environ = {**compose_env(), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [*DEMO, *args, "--data-dir", str(data_dir)], env=environ, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, text: str, timeout: float = DEMO_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.process.poll() is None, f"the demo exited early:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output[-4000:]}"
            time.sleep(0.2)

    def finish(self, timeout: float = DEMO_TIMEOUT_S) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self._reader.join(timeout=10)
        return code


def run_states(data_dir: Path) -> dict[str, str]:
    with sqlite3.connect(data_dir / "db.sqlite3") as db:
        return dict(db.execute("SELECT name, state FROM runs_run").fetchall())


def live_pids(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
        except (FileNotFoundError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def children_of(pid: int) -> list[int]:
    """Every descendant of `pid` now (they run in their own sessions, not its group)."""
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().split(") ", 1)[1].split()
            except (FileNotFoundError, IndexError):
                continue
            if int(fields[1]) == parent:
                child = int(stat.parent.name)
                found.append(child)
                frontier.append(child)
    return found


def test_a_short_demo_trains_and_its_summary_shows_routed_validation_loss_falling(
    tmp_path: Path,
) -> None:
    port, summary_path = free_port(), tmp_path / "summary.json"
    args = [*SHORT, "--port", str(port), "--json", str(summary_path), "--keep-serving"]
    demo = DemoProcess(args, tmp_path / "d")
    demo.wait_for("the server keeps running")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    dashboard = httpx.get(summary["dashboard"], timeout=30)
    children = children_of(demo.process.pid)
    demo.process.send_signal(signal.SIGINT)  # how --keep-serving is meant to end
    assert demo.finish(timeout=120) == 0, demo.output[-6000:]

    routed = summary["routed_val_loss"]
    assert [r["round"] for r in routed["rounds"]] == [0, 1]
    assert routed["final"] == routed["rounds"][-1]["loss"]
    assert routed["final"] < routed["before"], "validation loss fell over the run"
    for name in ("before", "routed", "dense", "ratio_vs_dense"):
        assert math.isfinite(summary["perplexity"][name]) and summary["perplexity"][name] > 0
    assert len(summary["paths"]) == 4
    for path in summary["paths"]:
        assert path["val_tokens"] > 0
        assert path["perplexity"] > 1 and path["perplexity_dense"] > 1

    # The dense baseline trained on exactly the tokens the workers trained on.
    assert summary["tokens"]["dipaco"] == summary["tokens"]["dense"] > 0
    sent = summary["bytes"]
    assert sent["units"] == 2 * 4
    assert sent["upload_bytes"] > 0 and sent["download_bytes"] > 0
    assert 0 < sent["ratio_vs_data_parallel"] < 1, "fewer bytes than an all-reduce per step"
    assert summary["dashboard"] == f"http://127.0.0.1:{port}/runs/{summary['run']['id']}/"
    assert dashboard.status_code == 200 and summary["run"]["name"] in dashboard.text
    assert summary["sample"]["continuation"].strip()
    assert Path(summary["sample"]["directory"], "model.safetensors").is_file()

    for shown in ("routed", "dense", "x less", summary["dashboard"]):
        assert shown in demo.output
    assert run_states(tmp_path / "d") == {summary["run"]["name"]: "finished"}
    assert live_pids(children) == [], "the server and its children stopped with the demo"
    assert port_is_free("127.0.0.1", port)


def test_ctrl_c_during_training_cancels_the_run_and_stops_every_process(tmp_path: Path) -> None:
    port = free_port()
    demo = DemoProcess([*SHORT, "--inner-steps", "400", "--port", str(port)], tmp_path / "d")
    demo.wait_for("dipaco-worker processes")
    children = children_of(demo.process.pid)
    assert len(children) >= 4, "a server with its web, task worker and beat, and 2 workers"
    demo.process.send_signal(signal.SIGINT)
    assert demo.finish(timeout=DEMO_TIMEOUT_S) == 130, demo.output[-4000:]

    assert "interrupted" in demo.output
    assert list(run_states(tmp_path / "d").values()) == ["cancelled"]
    assert live_pids(children) == [], "every process the demo started has exited"
    assert port_is_free("127.0.0.1", port)


def test_the_demo_refuses_a_layout_its_model_cannot_hold_before_starting_anything(
    tmp_path: Path,
) -> None:
    result = subprocess.run(
        [*DEMO, "--model-size", "micro", "--paths", "3x2", "--data-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.returncode == 2
    assert "--paths 3x2" in result.stdout and "at most 2 levels" in result.stdout
    assert not (tmp_path / "db.sqlite3").exists()


def test_demo_help_names_every_flag_and_how_to_stop() -> None:
    result = subprocess.run([*DEMO, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0
    for flag in ("--paths", "--workers", "--rounds", "--inner-steps", "--model-size",
                 "--keep-serving", "--port", "--data-dir", "--json"):  # fmt: skip
        assert flag in result.stdout
    assert "Ctrl+C" in result.stdout


def test_the_corpus_sample_is_written_once_and_reused(tmp_path: Path) -> None:
    first = stdlib_sample(tmp_path, 50_000)
    written = first.stat().st_mtime_ns
    records = [json.loads(line) for line in first.read_text().splitlines()]
    assert sum(len(r["text"]) for r in records) >= 50_000
    assert len({r["file"] for r in records}) == len(records), "one record per file"
    time.sleep(0.01)
    assert stdlib_sample(tmp_path, 50_000) == first
    assert first.stat().st_mtime_ns == written


@pytest.mark.parametrize("paths", ["2", "0x2", "2x", "axb"])
def test_paths_must_be_levels_x_modules(paths: str) -> None:
    from dipaco.demo.plan import parse_paths

    with pytest.raises(ValueError, match="LEVELSxMODULES"):
        parse_paths(paths)
