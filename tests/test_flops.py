"""MFU's two inputs: FLOPs per token of a path, and the device's peak by its name; and the
server's per-round forward passes, budgeted in FLOPs (windows follow for the model)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dipaco.config import ModelConfig, RunConfig
from dipaco.evaluate import SAMPLE_WINDOWS, sample_size
from dipaco.flops import (
    budget_windows,
    flops_per_token,
    mfu,
    peak_flops,
    score_windows,
    window_flops,
)
from dipaco.model import build_model


def test_flops_per_token_counts_six_per_matmul_parameter_plus_attention() -> None:
    model = RunConfig.tiny().model
    built = build_model(model, 0)
    embedding = built.get_input_embeddings().weight.numel()
    matmul_params = sum(p.numel() for p in built.parameters()) - embedding
    attention = 12 * model.num_layers * model.seq_len * model.hidden_size
    assert flops_per_token(model) == pytest.approx(6 * matmul_params + attention, rel=1e-3)


def test_the_papers_150m_path_costs_about_one_gigaflop_per_token() -> None:
    # The figure the GPU issue quotes for the 150m preset (174.3M parameters).
    assert flops_per_token(ModelConfig()) == pytest.approx(1.006e9, rel=1e-3)


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
    ],
)
def test_the_peak_is_looked_up_by_the_device_name(name: str, peak: float) -> None:
    assert peak_flops(name) == peak


def test_an_unknown_device_has_no_mfu_rather_than_a_guess() -> None:
    assert peak_flops("cpu") is None
    assert mfu(1e6, ModelConfig(), "Some Future GPU") is None


def test_mfu_is_the_share_of_the_peak_that_training_uses() -> None:
    tokens_per_s = 0.4 * 989e12 / flops_per_token(ModelConfig())
    assert mfu(tokens_per_s, ModelConfig(), "NVIDIA H100 80GB HBM3") == pytest.approx(0.4)


@pytest.mark.parametrize("preset", [RunConfig.tiny, RunConfig.capacity])
def test_the_default_budgets_keep_the_small_presets_window_counts(preset: object) -> None:
    # The checks against hostile workers were measured on these counts.
    config = preset()  # type: ignore[operator]
    assert score_windows(config) == config.outer.score_windows == 8
    assert sample_size(config) == SAMPLE_WINDOWS == 1024


def test_at_150m_the_budgets_buy_fewer_windows_of_more_tokens() -> None:
    config = RunConfig.paper_150m()
    assert window_flops(config.model) == pytest.approx(3.434e11, rel=1e-3)
    # 6 windows of 1,024 tokens: fewer refused honest units in the attack bench
    assert score_windows(config) == 6
    assert sample_size(config) == 291
    fewer = RunConfig.paper_150m(outer={"score_flops": 1.5e12})
    assert score_windows(fewer) == 1
    more = RunConfig.paper_150m(outer={"score_flops": 4 * 3 * 3.44e11}, eval={"flops": 1e15})
    assert (score_windows(more), sample_size(more)) == (3, 1024)


def test_a_budget_buys_at_least_one_window_and_at_most_the_count() -> None:
    model = ModelConfig()
    assert budget_windows(1e6, model, 8) == 1
    assert budget_windows(1e30, model, 8) == 8
    # eval.batches x batch_size above SAMPLE_WINDOWS still raises the count it caps.
    config = RunConfig.tiny(eval={"batches": 64, "batch_size": 32})
    assert sample_size(config) == 2048


@pytest.mark.parametrize(
    "sections",
    [{"outer": {"score_flops": 0}}, {"eval": {"flops": -1.0}}, {"eval": {"flops": 1e30}}],
)
def test_a_budget_out_of_bounds_is_refused_naming_it(sections: dict[str, object]) -> None:
    with pytest.raises(ValidationError) as err:
        RunConfig.tiny(**sections)
    assert "flops" in str(err.value)
