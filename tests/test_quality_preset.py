"""RunConfig.capacity(): the module-dominant preset of the GPU quality run (bench/quality_gpu.sh)."""

from __future__ import annotations

from types import ModuleType

import pytest

from dipaco.config import RunConfig
from tests.bench_modules import bench_module


def test_the_capacity_preset_puts_most_of_a_path_in_its_modules_and_several_paths_in_all() -> None:
    config = RunConfig.capacity()
    counts = config.module_param_counts()
    path = config.num_params()

    assert (path - counts["shared"]) / path > 0.7  # the blocks, not the embeddings
    assert sum(counts.values()) / path > 3  # DiPaCo's capacity over a path's
    assert config.num_paths == 16 and len(config.layout.levels) == 2
    tokens = config.rounds * config.inner.steps * config.inner.batch_size * config.model.seq_len
    assert tokens * config.num_paths / path > 20  # the dense path-size model: capacity-bound


def test_the_capacity_preset_takes_changes_as_tiny_does() -> None:
    config = RunConfig.capacity(rounds=2, inner={"micro_batch_size": 4}, model={"seq_len": 64})

    assert (config.rounds, config.inner.micro_batch_size, config.model.seq_len) == (2, 4, 64)
    assert config.inner.steps == RunConfig.capacity().inner.steps  # the rest stays
    assert config.model.hidden_size == RunConfig.capacity().model.hidden_size


def quality_module() -> ModuleType:
    return bench_module("quality")


def test_the_time_budget_scales_h_so_the_planned_tokens_fit() -> None:
    """bench/quality.py --time-budget, as bench/quality_gpu.sh runs it: the jobs' tokens
    (pairs that compare at equal tokens plan equal tokens) shrink to what the measured
    rate trains in the time left, and the JSON's sizing says so."""
    quality = quality_module()
    jobs = "b/dipaco-fp32,b/dense,b/dense-steps,a/diloco,a/data-parallel"
    args = quality.parse_args(
        ["--preset", "capacity", "--only", jobs, "--rounds", "4", "--inner-steps", "60",
         "--batch", "256", "--diloco-rounds", "8", "--diloco-inner-steps", "48",
         "--diloco-batch", "256", "--codec-seeds", "1", "--time-budget", "500"]
    )  # fmt: skip
    cfgs = quality.configs(args)
    planned = {n: quality.planned_tokens(n, cfgs[quality.JOB_CONFIG[n]]) for n in args.only}
    assert planned["b/dipaco-fp32"] == planned["b/dense"] == 16 * planned["b/dense-steps"]
    assert planned["b/dipaco-fp32"] == 4 * 60 * 16 * 256 * 256  # 252M, as the script says
    assert planned["a/diloco"] == planned["a/data-parallel"] == 8 * 48 * 4 * 256 * 256

    # A rate at which the plan does not fit: H shrinks, the pairs stay equal.
    rate = 1e6
    scaled, sizing = quality.fit_budget(args, cfgs, rate, elapsed=200.0)
    left = 500 - 200 - quality.JOB_RESERVE_S
    assert sizing["scale"] == pytest.approx(
        left * rate * quality.SHARED_RATE / sum(planned.values())
    )
    assert scaled["b-fp32"].inner.steps == int(60 * sizing["scale"])
    assert scaled["a"].inner.steps == int(48 * sizing["scale"])
    assert sizing["scaled_job_tokens"] <= left * rate * quality.SHARED_RATE
    # A fast enough rate, or none measured (a cached base): the sizes stay.
    assert quality.fit_budget(args, cfgs, 1e9, elapsed=200.0)[0] is cfgs
    assert quality.fit_budget(args, cfgs, None, elapsed=200.0)[1]["scale"] == 1.0
