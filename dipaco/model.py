"""One path is an ordinary `transformers` LlamaForCausalLM; this builds it from a ModelConfig."""

from __future__ import annotations

from functools import lru_cache
from typing import cast

import torch
from torch import nn
from transformers import LlamaForCausalLM

from dipaco.config import ModelConfig

__all__ = ["build_model", "count_parameters", "state_shapes"]


def build_model(
    model_cfg: ModelConfig,
    seed: int,
    *,
    device: torch.device | str = "cpu",
) -> LlamaForCausalLM:
    """A freshly initialised fp32 model; the same seed gives the same weights, bit for bit.

    The global RNG is left as it was, so building a model never shifts a caller's
    random stream (data order, dropout elsewhere).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(model_cfg.to_hf_config())
    # Initialised on the CPU so a seed gives the same weights on every device.
    return cast(LlamaForCausalLM, nn.Module.to(model, device=torch.device(device)))


def count_parameters(model: nn.Module) -> int:
    """Distinct trainable values; a tied embedding and LM head count once."""
    return sum(p.numel() for p in model.parameters())


@lru_cache(maxsize=32)
def state_shapes(model_cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every state-dict tensor, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(model_cfg.to_hf_config())
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}
