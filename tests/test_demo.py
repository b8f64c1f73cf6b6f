"""`dipaco demo`, run as a user runs it: a subprocess on a fresh data dir (on a terminal,
or in a pipe as in a script), read back through the JSON summary it writes, the
dashboard it serves and the SQLite database it leaves behind."""

from __future__ import annotations

import argparse
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
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dipaco.config import OuterConfig
from dipaco_demo.cli import add_arguments, serve_after_summary
from dipaco_demo.control import free_port, port_is_free
from dipaco_demo.plan import stdlib_sample
from tests.conftest import compose_env

# `dipaco demo` without needing the console script on PATH.
DEMO = [sys.executable, "-m", "dipaco_demo.cli"]
# Both phases: 2 dense rounds of 2 replicas, the preparation between, 2 DiPaCo rounds.
SHORT = ["--model-size", "micro", "--phase1-rounds", "2", "--rounds", "2", "--inner-steps", "10",
         "--workers", "2"]  # fmt: skip
DEMO_TIMEOUT_S = 300  # a loaded 2-core machine runs the short demo in 1-2 min
TERMINAL_CODES = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


class DemoProcess:
    """A `dipaco demo` subprocess whose output is collected as it comes: through a pipe,
    or with `terminal` on a pseudo-terminal 200 columns wide, as a person would run it."""

    def __init__(self, args: list[str], data_dir: Path, *, terminal: bool = False) -> None:
        # No service URLs: the demo must not need them (and must ignore them if set).
        environ = {**compose_env(), "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        command = [*DEMO, *args, "--data-dir", str(data_dir)]
        self.data_dir = data_dir
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
            code = self.process.poll()
            if code is not None:
                # What it printed last (its error) may still be in the pipe or terminal.
                self._reader.join(timeout=10)
                if text in self.output:
                    return
                raise AssertionError(
                    f"the demo exited early (code {code}):\n{self.output[-6000:]}\n{self.logs()}"
                )
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.output[-4000:]}"
            time.sleep(0.2)

    def logs(self, tail: int = 2000) -> str:
        """The end of every log the demo wrote (its server's and its workers'), for failures."""
        parts = []
        for log in sorted(self.data_dir.glob("**/*.log")):
            text = log.read_text(errors="replace")[-tail:]
            parts.append(f"--- {log.relative_to(self.data_dir)} (last {tail} characters)\n{text}")
        return "\n".join(parts)

    def stop(self) -> None:
        """End a demo that a failed check left running: Ctrl-C, as a person would (it stops
        its workers and server, which also die with it), then by force."""
        if self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=30)

    def finish(self, timeout: float = DEMO_TIMEOUT_S) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        self._reader.join(timeout=10)
        return code


@pytest.fixture
def start_demo() -> Iterator[Callable[..., DemoProcess]]:
    """Starts `DemoProcess`es and stops any still running when the test ends, pass or fail:
    a demo left behind keeps training and serving, and slows every test after it."""
    demos: list[DemoProcess] = []

    def start(args: list[str], data_dir: Path, *, terminal: bool = False) -> DemoProcess:
        demos.append(DemoProcess(args, data_dir, terminal=terminal))
        return demos[-1]

    yield start
    for demo in demos:
        demo.stop()


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


def test_a_short_demo_on_a_terminal_trains_both_phases_compares_with_both_dense_models_and_keeps_serving(
    tmp_path: Path, start_demo: Callable[..., DemoProcess]
) -> None:
    port, summary_path = free_port(), tmp_path / "summary.json"
    args = [*SHORT, "--port", str(port), "--json", str(summary_path)]
    demo = start_demo(args, tmp_path / "d", terminal=True)
    demo.wait_for("press Ctrl-C to stop")
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    time.sleep(2)  # still serving after the summary, not on its way out
    assert demo.process.poll() is None, demo.output[-4000:]
    dashboard = httpx.get(summary["dashboard"], timeout=30)
    children = children_of(demo.process.pid)
    demo.process.send_signal(signal.SIGINT)  # how serving is meant to end
    assert demo.finish(timeout=120) == 0, demo.output[-6000:]

    # Phase 1 (rounds 0-1, dense, 2 replicas), the preparation, phase 2 (rounds 2-3).
    phases, routed = summary["phases"], summary["routed_val_loss"]
    phase1, phase2 = phases["phase1"], phases["phase2"]
    assert (phase1["rounds"], phase1["replicas"], phase1["units"]) == (2, 2, 4)
    assert [p["round"] for p in phase1["val_loss"]] == [0, 1]
    assert phase1["final_loss"] == phase1["val_loss"][-1]["loss"] < routed["initial"]
    assert phases["between"]["seconds"] > 0 and phases["between"]["featurizer"] == "base-lm"
    assert phase2["first_round"] == routed["phase2_first_round"] == 2
    assert phase2["starts_from"] == "the phase-1 model" and phase2["units"] == 2 * 4
    assert [r["round"] for r in routed["rounds"]] == [2, 3]
    assert [(c["round"], c["phase"]) for c in routed["curve"]] == [(0, 1), (1, 1), (2, 2), (3, 2)]
    assert routed["final"] == routed["rounds"][-1]["loss"]
    assert routed["final"] < routed["initial"], "validation loss fell over the run"
    assert routed["before"] < routed["initial"], "phase 2 starts from a trained model"
    # No step back at the phase boundary (dipaco.outer.round_momentum): the first phase-2
    # round scores no worse than the phase-1 model it started from, on the routed sample
    # ("before", the same weights) and against phase 1's own last figure. The second round
    # holds it within 1%: which worker trains which unit (warm or cold AdamW moments) moves a
    # round's loss by up to ~1% here (tests/test_platform_vs_simulate.py), and one seen run
    # went 5.947 -> 5.959.
    first, second = (r["loss"] for r in routed["rounds"])
    assert first <= routed["before"] and first <= phase1["final_loss"], (routed, phase1)
    assert second <= first * 1.01, routed["rounds"]
    for name in ("initial", "before", "routed"):
        assert math.isfinite(summary["perplexity"][name]) and summary["perplexity"][name] > 0
    assert len(summary["paths"]) == 4
    for path in summary["paths"]:
        assert path["val_tokens"] > 0 and path["perplexity"] > 1
        for key in ("equal_wall_clock", "equal_tokens"):
            assert path[f"perplexity_dense_{key}"] > 1

    # Two dense models from the phase-1 model: as many sequential steps as each path in
    # phase 2, and every token phase 2 saw.
    run, tokens = summary["run"], summary["tokens"]
    units = run["paths"] * run["replicas_per_path"]
    versus = summary["versus_dense"]
    assert summary["baselines"] == "trained"
    assert list(versus) == ["equal_wall_clock", "equal_tokens"]
    wall_clock, same_tokens = versus["equal_wall_clock"], versus["equal_tokens"]
    assert wall_clock["steps"] == run["rounds"] * run["inner_steps"] == 2 * 10
    assert same_tokens["steps"] == wall_clock["steps"] * units
    assert same_tokens["tokens"] == tokens["dipaco"] == wall_clock["tokens"] * units > 0
    assert tokens["phase1"] == phase1["tokens"] == tokens["dipaco"] // 2  # 4 units, not 8
    assert tokens["dense_equal_tokens"] == same_tokens["tokens"]
    for dense in (wall_clock, same_tokens):
        assert dense["perplexity"] > 1 and dense["seconds"] > 0
        assert dense["starts_from"] == "the phase-1 model"
        assert dense["ratio"] == pytest.approx(
            summary["perplexity"]["routed"] / dense["perplexity"]
        )
    lines = {line["label"]: line["text"] for line in summary["lines"]}
    assert list(lines) == ["rounds", "phase 1", "between the phases", "phase 2",
                           "vs dense, equal wall-clock", "vs dense, equal tokens", "bytes",
                           "sample", "dashboard", "time"]  # fmt: skip
    assert "| phase 2 (DiPaCo, routed)" in lines["rounds"]
    assert f"perplexity {phase1['final_perplexity']:.1f}" in lines["phase 1"]
    assert "from the phase-1 model as DiPaCo" in lines["vs dense, equal tokens"]
    assert summary["config"]["outer"] == OuterConfig().model_dump(mode="json"), "no demo-only outer"

    sent = summary["bytes"]
    assert (sent["units"], sent["phase1_units"]) == (2 * 2 + 2 * 4, 2 * 2)  # check copies apart
    # A new worker's units are all replicated: an idle worker may train a check copy. Its
    # tokens verify, they do not train (never averaged in), so they are counted apart.
    assert tokens["check_copies"] == sent["check_tokens"]
    assert (
        (sent["check_units"] > 0) == (sent["check_tokens"] > 0) == ("check cop" in lines["bytes"])
    )
    assert sent["upload_bytes"] > 0 and sent["download_bytes"] > 0
    assert 0 < sent["ratio_vs_data_parallel"] < 1, "fewer bytes than an all-reduce per step"
    assert summary["dashboard"] == f"http://127.0.0.1:{port}/runs/{run['id']}/"
    assert dashboard.status_code == 200 and run["name"] in dashboard.text
    # The training-loss chart shows what the workers reported, per phase, path and round
    # (numbered from 1 for people, as the terminal: phase 2 opens at round 3).
    training = chart_data(dashboard.text)["train_loss"]
    assert training["x"] == [1, 2, 3, 4] and training["phase_boundary"] == 3
    series = {s["label"]: s["values"] for s in training["series"]}
    assert sorted(series) == ["dense model (phase 1)", *(f"path {p}" for p in range(4))]
    assert all(v is not None and v > 0 for v in series.pop("dense model (phase 1)")[:2])
    assert all(v is not None and v > 0 for values in series.values() for v in values[2:])
    assert summary["sample"]["continuation"].strip()
    assert Path(summary["sample"]["directory"], "model.safetensors").is_file()

    for dense in (wall_clock, same_tokens):
        assert f"vs dense, equal {dense['equal']}: perplexity ratio {dense['ratio']:.3f}" in (
            demo.output
        )
    for shown in ("phase 1 is done", "phase 2 (DiPaCo) opened at round 3", "x less",
                  f"Dashboard: {summary['dashboard']}"):  # fmt: skip
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

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert serve_after_summary(parser.parse_args(flags).serve, interactive) is serves


def test_ctrl_c_during_training_cancels_the_run_and_stops_every_process(
    tmp_path: Path, start_demo: Callable[..., DemoProcess]
) -> None:
    port = free_port()
    demo = start_demo([*SHORT, "--inner-steps", "400", "--port", str(port)], tmp_path / "d")
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
    for flag in ("--paths", "--workers", "--phase1-rounds", "--rounds", "--inner-steps",
                 "--model-size", "--serve", "--no-serve", "--keep-serving", "--port",
                 "--data-dir", "--json", "--no-baselines"):  # fmt: skip
        assert flag in result.stdout
    for phase in ("phase 1", "between the phases", "phase 2"):
        assert phase in result.stdout
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
    from dipaco_demo.plan import parse_paths

    with pytest.raises(ValueError, match="LEVELSxMODULES"):
        parse_paths(paths)


def test_the_demo_has_a_dense_phase_1_of_one_replica_per_worker_unless_told_not_to(
    tmp_path: Path,
) -> None:
    from dipaco_demo.plan import DEFAULT_PHASE1_ROUNDS, DemoPlan

    corpus = tmp_path / "corpus.jsonl"
    config = DemoPlan(workers=3, phase1_rounds=DEFAULT_PHASE1_ROUNDS).config("two-phase", corpus)
    assert config.phase1 is not None
    assert (config.phase1.rounds, config.phase1.replicas) == (DEFAULT_PHASE1_ROUNDS, 3)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).phase1_rounds == DEFAULT_PHASE1_ROUNDS > 0, "the CLI's default"
    assert config.router.featurizer == "base-lm", "the phase-1 model's features route"
    assert config.dense_phase.inner.steps == config.inner.steps
    assert config.outer == OuterConfig(), "the run's outer defaults, none of the demo's own"

    single = DemoPlan().config("one-phase", corpus)  # as the cluster and fault tests build it
    assert single.phase1 is None and single.router.featurizer == "tfidf"
    with pytest.raises(ValueError, match="--phase1-rounds -1"):
        DemoPlan(phase1_rounds=-1).config("bad", corpus)


def summary_without_baselines(phase1_rounds: int) -> Any:
    """A finished run's summary as the demo builds it, from made-up losses (no server)."""
    from dipaco_demo.plan import DemoPlan
    from dipaco_demo.records import Traffic
    from dipaco_demo.summary import DemoSummary

    config = DemoPlan(model_size="micro", phase1_rounds=phase1_rounds, rounds=2).config(
        "s", Path("corpus.jsonl")
    )
    first = phase1_rounds
    return DemoSummary(
        run_id=1, run_name="s", server="http://127.0.0.1:8000", config=config, seconds=60.0,
        workers=2, before={p: 5.0 for p in range(4)}, dense=[], weights={p: 10 for p in range(4)},
        rounds=[{"round": first + t, "routed": 4.0 - t, "paths": {p: 4.0 - t for p in range(4)}}
                for t in range(2)],
        traffic=Traffic(1000, 2000, 8, 20480), initial={p: 6.9 for p in range(4)},
        phase1_losses={t: 6.0 - t for t in range(first)}, baselines=False,
    )  # fmt: skip


def test_without_baselines_the_summary_says_they_were_skipped() -> None:
    summary = summary_without_baselines(phase1_rounds=2).to_json()
    assert summary["baselines"] == "skipped" and summary["versus_dense"] == {}
    lines = {line["label"]: line["text"] for line in summary["lines"]}
    assert lines["vs dense"] == "skipped (--no-baselines)"
    assert not any(label.startswith("vs dense,") for label in lines)
    assert "dense baselines" not in lines["time"]
    assert list(lines)[:5] == ["rounds", "phase 1", "between the phases", "phase 2", "vs dense"]
    # The curve: phase 1's two dense rounds, then phase 2 from the phase-1 model.
    assert "after each round 1: 403.4, 2: 148.4 | phase 2" in lines["rounds"]
    assert "starts at 148.4 (the phase-1 model" in lines["rounds"]
    assert "after each round 3: 54.6, 4: 20.1" in lines["rounds"]


def test_a_run_without_phase_1_has_one_phase_line_and_no_phase_1_in_its_json() -> None:
    summary = summary_without_baselines(phase1_rounds=0).to_json()
    assert summary["phases"]["phase1"] is None and summary["phases"]["between"] is None
    assert summary["phases"]["phase2"]["starts_from"] == "the seeded weights"
    lines = {line["label"]: line["text"] for line in summary["lines"]}
    assert list(lines)[:3] == ["rounds", "phases", "vs dense"]
    assert "--phase1-rounds 0" in lines["phases"] and "tfidf" in lines["phases"]
    assert "| phase 2" not in lines["rounds"]


def test_the_panel_marks_where_phase_2_starts_in_the_validation_curve() -> None:
    from dipaco_demo.display import curve

    losses = {0: 6.0, 1: 5.5, 2: 5.4, 3: 5.0}
    assert (
        curve(losses, 2)
        == "phase 1, dense: r1: 6.000  r2: 5.500  | phase 2, routed:  r3: 5.400  r4: 5.000"
    )
    assert (
        curve(losses, 0) == "routed, after each round: r1: 6.000  r2: 5.500  r3: 5.400  r4: 5.000"
    )
    assert curve({4: 5.0, 5: 4.0}, 2, last=2).startswith("phase 2, routed: r5: 5.000")
