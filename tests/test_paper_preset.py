"""The papers' 150M path as a preset of the library (RunConfig.paper_150m): what the new-run
form's "150M-parameter paths", `dipaco simulate --model-size 150m` and the benches use, and
one inner step of it on the CPU (one sequence of 32 tokens: the model is the full 174M)."""

from __future__ import annotations

import argparse

import torch

from dipaco.cli.simulate import register
from dipaco.config import ModelConfig, RunConfig
from dipaco.inner import InMemoryTokenSource, run_inner_loop
from dipaco.model import build_model
from dipaco.modular import modules_of_path
from dipaco_web.runform import preset


def test_the_preset_is_the_papers_path_on_a_2x2_grid_and_the_forms_150m() -> None:
    config = RunConfig.paper_150m()
    assert config.model == ModelConfig()
    assert (config.model.hidden_size, config.model.num_layers, config.model.seq_len) == (
        896,
        12,
        1024,
    )
    assert config.layout.num_paths == 4 and len(config.layout.levels) == 2
    assert modules_of_path(config, 3) == ["0.1", "1.1", "shared"]
    assert config.num_params() == 174_348_160
    form = preset("150m").config
    assert form == {k: v for k, v in config.model_dump(mode="json").items() if k != "name"}
    assert RunConfig.paper_150m(rounds=3, inner={"steps": 7}).inner.steps == 7


def test_simulate_model_size_150m_trains_the_presets_path() -> None:
    from dipaco.cli.simulate import build_config  # after register's parser is built

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--model-size", "150m", "--rounds", "2"])
    config = build_config(args)
    assert config.model == RunConfig.paper_150m().model
    assert config.layout == RunConfig.paper_150m().layout


def test_one_inner_step_of_the_150m_path_runs_on_the_cpu() -> None:
    config = RunConfig.paper_150m(
        inner={"steps": 1, "warmup_steps": 1, "micro_batch_size": 1, "grad_accum_steps": 1}
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(config.model, config.seed)
        tokens = torch.randint(config.model.vocab_size, (4096,), generator=torch.Generator())
        result = run_inner_loop(model, InMemoryTokenSource(tokens), config.inner, seq_len=32)
    finally:
        torch.set_num_threads(threads)
    assert result.completed and len(result.losses) == 1
    assert abs(result.losses[0] - torch.log(torch.tensor(32000.0)).item()) < 1.0
    assert result.tokens == 32
    assert sum(d.numel() for d in result.delta.values()) == config.num_params()
    assert any(bool(d.abs().max() > 0) for d in result.delta.values())
