"""MFU's two inputs: FLOPs per token of a path, and the device's peak by its name."""

from __future__ import annotations

import pytest

from dipaco.config import ModelConfig, RunConfig
from dipaco.flops import flops_per_token, mfu, peak_flops
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
