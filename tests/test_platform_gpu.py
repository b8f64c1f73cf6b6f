"""bench/platform_gpu.sh's figures, from canned worker events and API answers, and its run.

The script itself needs a GPU (or minutes of CPU for its dry run), so it is not run here;
what it computes from what it collected is: utilisation and MFU from the worker's JSON
events, each round's stages, validation loss and bytes, the process tree whose memory it
samples, and the run it creates (2 paths of the 150M preset, a batch of 64 x 1,024)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from dipaco.config import RunConfig
from dipaco.flops import flops_per_token

ROOT = Path(__file__).resolve().parents[1]
H100 = "NVIDIA H100 80GB HBM3"
H100_PEAK = 989e12


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


@pytest.fixture(scope="module")
def figures() -> ModuleType:
    return load("platform_gpu_figures")


def stamp(seconds: float) -> str:
    return f"2026-11-27T12:{int(seconds) // 60:02d}:{seconds % 60:06.3f}Z"


def worker_events() -> list[dict[str, object]]:
    """Two units at 1,000 tokens a step: the first compiles for 10 s in its first step,
    then 10 steps at 1,000 tokens/s; the second trains 10 steps."""
    return [
        {"event": "lease", "time": stamp(90.0)},
        {"event": "step", "time": stamp(100.0), "step": 1, "tokens_per_second": 100.0},
        {"event": "step", "time": stamp(110.0), "step": 11, "tokens_per_second": 550.0},
        {"event": "lease", "time": stamp(111.0)},
        {
            "event": "completed",
            "time": stamp(112.0),
            "train_seconds": 20.0,
            "tokens_per_second": 550.0,
            "steps": 11.0,
        },
        {"event": "step", "time": stamp(116.0), "step": 1, "tokens_per_second": 1000.0},
        {"event": "step", "time": stamp(125.0), "step": 10, "tokens_per_second": 1000.0},
        {
            "event": "completed",
            "time": stamp(127.0),
            "train_seconds": 10.0,
            "tokens_per_second": 1000.0,
            "steps": 10.0,
        },
    ]


def test_utilisation_and_mfu_leave_the_compile_out(figures: ModuleType) -> None:
    config = RunConfig.paper_150m()
    got = figures.worker_figures(worker_events(), 1000, flops_per_token(config.model), H100_PEAK)
    # window: the first step event (100 s) to the last (125 s); training in it: 30 s of
    # units less the first step's 10 s (1,000 tokens at 100 tokens/s)
    assert got["window_seconds"] == pytest.approx(25.0)
    assert got["first_step_seconds"] == pytest.approx(10.0)
    assert got["utilisation"] == pytest.approx(20.0 / 25.0)
    assert got["tokens_per_second"] == pytest.approx(20_000 / 25.0)
    # each unit's own speed, the first without its compile: 1,000 tokens/s both
    assert got["unit_tokens_per_second"] == pytest.approx(1000.0)
    per_token = flops_per_token(config.model)
    assert got["mfu"] == pytest.approx(800.0 * per_token / H100_PEAK)
    assert got["unit_mfu"] == pytest.approx(1000.0 * per_token / H100_PEAK)
    assert got["mfu_vs_unit"] == pytest.approx(0.8)
    assert got["unit_steps"] == [11, 10]


def test_a_worker_that_never_trained_has_no_figures(figures: ModuleType) -> None:
    got = figures.worker_figures([{"event": "lease", "time": stamp(1.0)}], 1000, 1.0, None)
    assert got == {"units": 0, "utilisation": None, "mfu": None, "unit_mfu": None}


def test_no_peak_for_the_device_means_no_mfu(figures: ModuleType) -> None:
    got = figures.worker_figures(worker_events(), 1000, 1e9, None)
    assert got["mfu"] is None and got["unit_mfu"] is None
    assert got["utilisation"] == pytest.approx(0.8)


def rounds_answer() -> list[dict[str, object]]:
    """GET /runs/{id}/rounds: newest first; round 1 still open."""
    stage = {"started_at": stamp(0), "ended_at": stamp(1)}
    return [
        {"t": 1, "state": "open", "opened_at": stamp(70.0), "closed_at": None, "stages": []},
        {"t": 0, "state": "closed", "opened_at": stamp(5.0), "closed_at": stamp(70.5),
         "stages": [{**stage, "stage": "training", "wall_seconds": 60.0, "seconds": 118.0,
                     "tasks": 2},
                    {**stage, "stage": "outer_step", "wall_seconds": 3.0, "seconds": 5.0,
                     "tasks": 3}]},
    ]  # fmt: skip


def test_rounds_oldest_first_with_stages_losses_and_bytes(figures: ModuleType) -> None:
    losses = [
        {"name": "val_loss", "value": 6.0, "round": 0, "path": 1},
        {"name": "val_loss", "value": 5.0, "round": 0, "path": 0},
        {"name": "val_loss", "value": 4.0, "round": None, "path": None},  # not a path's point
    ]
    traffic = [{"round": 0, "upload": 700, "download": 900}]
    got = figures.round_figures(rounds_answer(), losses, traffic)
    assert [r["round"] for r in got] == [0, 1]
    first, second = got
    assert first["wall_seconds"] == pytest.approx(65.5)
    assert first["stages"]["outer_step"] == {"wall_seconds": 3.0, "seconds": 5.0, "tasks": 3}
    assert first["val_loss"] == pytest.approx(5.5)
    assert first["val_loss_by_path"] == [5.0, 6.0]
    assert (first["upload_bytes"], first["download_bytes"]) == (700, 900)
    assert second["wall_seconds"] is None and second["val_loss"] is None
    assert (second["upload_bytes"], second["download_bytes"]) == (0, 0)


def test_summary_has_the_keys_the_figure_promises(figures: ModuleType) -> None:
    config = RunConfig.paper_150m()
    traffic = [
        {"round": 0, "upload": 700, "download": 900},
        {"round": 1, "upload": 1, "download": 2},
    ]
    got = figures.summarise(worker_events(), rounds_answer(), [], traffic, config, H100)
    for key in ("device", "params", "utilisation", "mfu", "rounds"):
        assert key in got
    assert got["device"] == H100 and got["params"] == config.num_params()
    assert (got["upload_bytes"], got["download_bytes"]) == (701, 902)
    assert got["step_tokens"] == config.inner.batch_size * config.model.seq_len


def test_the_process_tree_holds_a_child(figures: ModuleType) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = figures.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        assert figures.rss_bytes(os.getpid()) > 0
        assert figures.rss_bytes(2**22 + 7) == 0  # no such process
    finally:
        child.kill()
        child.wait()


def test_the_run_is_two_150m_paths_at_a_batch_of_64_by_1024() -> None:
    bench = load("platform_gpu")
    config = bench.run_config("150m", rounds=3, paths=2, steps=240, batch=64,
                              overlap="delayed", corpus="/tmp/corpus.jsonl")  # fmt: skip
    assert config.num_paths == 2 and len(config.layout.levels) == 2
    assert config.num_params() == RunConfig.paper_150m().num_params()
    assert config.inner.batch_size * config.model.seq_len == 64 * 1024
    assert (config.rounds, config.inner.steps, config.outer.overlap) == (3, 240, "delayed")
    # neither the calibration nor the sizing cuts a unit of H steps short
    assert config.units.calibration_seconds >= 3600 and config.units.target_seconds >= 3600
    # 256k tokens/s x 60 s x 1.02 over 65,536 tokens a step
    assert bench.sized_steps(256_000.0, config, 60.0) == 240
    tiny = bench.run_config("tiny", rounds=3, paths=3, steps=5, batch=4, overlap="none",
                            corpus="/tmp/c.jsonl")  # fmt: skip
    assert tiny.num_paths == 3 and tiny.model.seq_len == RunConfig.tiny().model.seq_len


def test_worker_events_are_its_json_objects(figures: ModuleType, tmp_path: Path) -> None:
    assert figures.read_events(tmp_path / "never-started.jsonl") == []
    log = tmp_path / "worker.jsonl"
    log.write_text(
        '{"event": "lease"}\nTraceback (most recent call last):\n[1, 2]\n{"event": "idle"}\n'
    )
    assert [e["event"] for e in figures.read_events(log)] == ["lease", "idle"]
