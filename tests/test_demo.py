"""`dipaco demo`, run as a user runs it: a subprocess on a fresh data dir (on a terminal,
or in a pipe as in a script), read back through the JSON summary it writes, the
dashboard it serves and the SQLite database it leaves behind."""

from __future__ import annotations

import fcntl
import json
import math
import os
import pty
import re
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from dipaco.cli.demo import add_arguments, serve_after_summary
from dipaco.config import OuterConfig
from dipaco.demo.control import free_port, port_is_free
from dipaco.demo.plan import stdlib_sample
from tests.conftest import compose_env

# `dipaco demo` without needing the console script on PATH.
DEMO = [sys.executable, "-m", "dipaco.cli.demo"]
SHORT = ["--model-size", "micro", "--rounds", "2", "--inner-steps", "10", "--workers", "2"]
DEMO_TIMEOUT_S = 300  # a loaded 2-core machine runs the short demo in 1-2 min
TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


class DemoProcess:
    """A `dipaco demo` subprocess whose output is collected as it comes: through a pipe,
    or with `terminal` on a pseudo-terminal 200 columns wide, as a person would run it."""

    def __init__(self, args: list[str], data_dir: Path, *, terminal: bool = False) -> None:
        # No service URLs: the demo must not need them (and must ignore them if set).
        environ = {**compose_env(), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        command = [*DEMO, *args, "--data-dir", str(data_dir)]
        self.chunks: list[str] = []
        if terminal:
            self.terminal, screen = pty.openpty()
            fcntl.ioctl(screen, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
            self.process = subprocess.Popen(
                command, env={**environ, "TERM": "xterm"}, stdout=screen, stderr=screen,
                stdin=subprocess.DEVNULL, text=True,
            )  # fmt: skip
            os.close(screen)
            self._reader = threading.Thread(target=self._read_terminal, daemon=True)
        else:
            self.process = subprocess.Popen(
                command, env=environ, text=True, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip
            self._reader = threading.Thread(target=self._read_pipe, daemon=True)
        self._reader.start()

    def _read_pipe(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.chunks.append(line)

    def _read_terminal(self) -> None:
        while True:
            try:
                data = os.read(self.terminal, 65536)
            except OSError:  # EIO: the demo and its children closed the terminal
                data = b""
            if not data:
                os.close(self.terminal)
                return
            self.chunks.append(data.decode("utf-8", errors="replace"))

    @property
    def output(self) -> str:
        """What was printed, without a terminal's cursor and colour codes."""
        return TERMINAL_CODES.sub("", "".join(self.chunks))

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


def chart_data(html: str) -> dict[str, Any]:
    """The run page's charts, as it embeds them for dashboard.js."""
    match = re.search(r'<script id="run-charts" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the run page has no chart data"
    data: dict[str, Any] = json.loads(match.group(1))
    return data


def test_a_short_demo_on_a_terminal_trains_compares_with_both_dense_models_and_keeps_serving(
    tmp_path: Path,
) -> None:
    port, summary_path = free_port(), tmp_path / "summary.json"
    args = [*SHORT, "--port", str(port), "--json", str(summary_path)]
    demo = DemoProcess(args, tmp_path / "d", terminal=True)
    demo.wait_for("press Ctrl-C to stop")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    time.sleep(2)  # still serving after the summary, not on its way out
    assert demo.process.poll() is None, demo.output[-4000:]
    dashboard = httpx.get(summary["dashboard"], timeout=30)
    children = children_of(demo.process.pid)
    demo.process.send_signal(signal.SIGINT)  # how serving is meant to end
    assert demo.finish(timeout=120) == 0, demo.output[-6000:]

    routed = summary["routed_val_loss"]
    assert [r["round"] for r in routed["rounds"]] == [0, 1]
    assert routed["final"] == routed["rounds"][-1]["loss"]
    assert routed["final"] < routed["before"], "validation loss fell over the run"
    for name in ("before", "routed"):
        assert math.isfinite(summary["perplexity"][name]) and summary["perplexity"][name] > 0
    assert len(summary["paths"]) == 4
    for path in summary["paths"]:
        assert path["val_tokens"] > 0 and path["perplexity"] > 1
        for key in ("equal_wall_clock", "equal_tokens"):
            assert path[f"perplexity_dense_{key}"] > 1

    # Two dense models: as many sequential steps as each path, and every token it saw.
    run, tokens = summary["run"], summary["tokens"]
    units = run["paths"] * run["replicas_per_path"]
    versus = summary["versus_dense"]
    assert list(versus) == ["equal_wall_clock", "equal_tokens"]
    wall_clock, same_tokens = versus["equal_wall_clock"], versus["equal_tokens"]
    assert wall_clock["steps"] == run["rounds"] * run["inner_steps"] == 2 * 10
    assert same_tokens["steps"] == wall_clock["steps"] * units
    assert same_tokens["tokens"] == tokens["dipaco"] == wall_clock["tokens"] * units > 0
    assert tokens["dense_equal_tokens"] == same_tokens["tokens"]
    for dense in (wall_clock, same_tokens):
        assert dense["perplexity"] > 1 and dense["seconds"] > 0
        assert dense["ratio"] == pytest.approx(
            summary["perplexity"]["routed"] / dense["perplexity"]
        )
    labels = [line["label"] for line in summary["lines"]]
    assert labels == ["rounds", "vs dense, equal wall-clock", "vs dense, equal tokens",
                      "bytes", "sample", "dashboard", "time"]  # fmt: skip
    assert summary["config"]["outer"] == OuterConfig().model_dump(mode="json"), "no demo-only outer"

    sent = summary["bytes"]
    assert sent["units"] == 2 * 4
    assert sent["upload_bytes"] > 0 and sent["download_bytes"] > 0
    assert 0 < sent["ratio_vs_data_parallel"] < 1, "fewer bytes than an all-reduce per step"
    assert summary["dashboard"] == f"http://127.0.0.1:{port}/runs/{run['id']}/"
    assert dashboard.status_code == 200 and run["name"] in dashboard.text
    # The training-loss chart shows what the workers reported, per path and round.
    training = chart_data(dashboard.text)["train_loss"]
    assert training["x"] == [0, 1]
    assert sorted(s["label"] for s in training["series"]) == [f"path {p}" for p in range(4)]
    assert all(v is not None and v > 0 for s in training["series"] for v in s["values"])
    assert summary["sample"]["continuation"].strip()
    assert Path(summary["sample"]["directory"], "model.safetensors").is_file()

    for dense in (wall_clock, same_tokens):
        assert f"vs dense, equal {dense['equal']}: perplexity ratio {dense['ratio']:.3f}" in (
            demo.output
        )
    for shown in ("routed", "x less", f"Dashboard: {summary['dashboard']}"):
        assert shown in demo.output
    assert run_states(tmp_path / "d") == {run["name"]: "finished"}
    assert live_pids(children) == [], "the server and its children stopped with the demo"
    assert port_is_free("127.0.0.1", port)


@pytest.mark.parametrize(
    ("flags", "interactive", "serves"),
    [
        ([], True, True),
        ([], False, False),
        (["--no-serve"], True, False),
        (["--serve"], False, True),
        (["--keep-serving"], False, True),
    ],
)
def test_the_demo_serves_after_its_summary_on_a_terminal_unless_told(
    flags: list[str], interactive: bool, serves: bool
) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert serve_after_summary(parser.parse_args(flags).serve, interactive) is serves


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
                 "--serve", "--no-serve", "--keep-serving", "--port", "--data-dir", "--json"):  # fmt: skip
        assert flag in result.stdout
    assert "Ctrl+C" in result.stdout
    assert "equal wall-clock" in result.stdout and "equal tokens" in result.stdout
    assert "serve when stdout is a terminal" in result.stdout


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
