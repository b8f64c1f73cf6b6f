"""Model FLOPs utilisation (MFU): the training FLOPs a loop does against the device's peak.

``flops_per_token`` is the PaLM paper's count (Chowdhery et al. 2022, appendix B), which
nanoGPT's ``estimate_mfu`` and torchtitan use too: 6 FLOPs per matmul parameter per token
(forward 2, backward 4) plus the attention scores and their weighted sum, 12·L·T·d per
token over fwd + bwd (counted in full, as the convention does, though a causal mask could
skip half). The input embedding is a lookup, not a matmul, so its parameters are left out;
an untied output layer is a matmul and counts. For the papers' 150M path (12 blocks of
896, vocabulary 32,000, sequences of 1,024) that is 1.006 GFLOP per token.

``PEAK_BF16_FLOPS`` holds the dense (no 2:4 sparsity) bf16 tensor-core peak of the
devices a volunteer is likely to lend, from the vendors' data sheets; ``peak_flops``
matches ``torch.cuda.get_device_name``. An unknown device has no MFU (None), not a guess.

The server's per-round forward passes are budgeted with the same count (`budget_windows`,
below).
"""

from __future__ import annotations

import math

from dipaco.config import ModelConfig, RunConfig, count_path_params

__all__ = [
    "PEAK_BF16_FLOPS",
    "SCORE_PASSES",
    "budget_windows",
    "flops_per_token",
    "mfu",
    "peak_flops",
    "score_windows",
    "window_flops",
]

# (substring of torch.cuda.get_device_name, dense bf16 FLOP/s); the first match wins, so a
# variant comes before its family's plain name.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("H200", 989e12),  # also GH200: the same tensor cores as the H100 SXM
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L4", 121e12),
)


def flops_per_token(model: ModelConfig) -> float:
    """Training FLOPs per token of one path (forward and backward), as described above."""
    params = count_path_params(model)
    embedding = model.vocab_size * model.hidden_size
    matmul_params = params if model.tie_embeddings else params - embedding
    attention = 12 * model.num_layers * model.seq_len * model.hidden_size
    return 6.0 * matmul_params + attention


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a device by its name, or None when the table has none."""
    for key, peak in PEAK_BF16_FLOPS:
        if key in device_name:
            return peak
    return None


def mfu(tokens_per_s: float, model: ModelConfig, device_name: str) -> float | None:
    """The fraction of the device's bf16 peak that ``tokens_per_s`` of training uses."""
    peak = peak_flops(device_name)
    return None if peak is None else tokens_per_s * flops_per_token(model) / peak


# The server's forward passes per round, budgeted in FLOPs and sized to the run's model.
#
# The server scores every unit's Δ (proof of useful work: `outer.score_flops` a unit) and
# evaluates every path after each round (`eval.flops` a round). Both are forward passes
# over windows of `model.seq_len` tokens, and a window's cost grows with the model: one of
# the 150M path (1,024 tokens) costs about 700 times one of the tiny preset's (128 tokens).
# A count of windows that is cheap at one size is hours of CPU at the other, so the
# budgets are in forward FLOPs (a third of `flops_per_token`) and the windows follow:
# min(most, max(1, floor(budget / window_flops))), where `most` is the count in windows
# (the evaluation sample's SAMPLE_WINDOWS, `outer.score_windows`). The defaults leave
# every model up to the capacity preset's at that count, so the tiny preset scores and
# evaluates exactly the windows it did (the checks against hostile workers rely on them);
# at the 150M preset they buy 6 scoring windows of 1,024 tokens (fewer refused honest units
# in the attack bench at that count, docs/reliability.md) and 291 evaluation windows (docs/design.md §7: what that does to the standard errors).

SCORE_PASSES = 4  # the path's base losses and the Δ's, on training and held-out windows


def window_flops(model: ModelConfig) -> float:
    """Forward FLOPs of one window of `model.seq_len` tokens through a path."""
    return flops_per_token(model) / 3 * model.seq_len


def budget_windows(flops: float, model: ModelConfig, most: int) -> int:
    """Windows a budget of `flops` buys at `model`'s size: at least 1, at most `most`."""
    return max(1, min(most, math.floor(flops / window_flops(model))))


def score_windows(config: RunConfig) -> int:
    """Training and held-out windows a unit's Δ is scored on (SCORE_PASSES passes)."""
    per_pass = config.outer.score_flops / SCORE_PASSES
    return budget_windows(per_pass, config.model, config.outer.score_windows)
