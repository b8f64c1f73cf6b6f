"""The causal-LM loss without the fp32 logits of a whole micro-batch.

`model(input_ids).logits` followed by `F.cross_entropy(logits.float(), ...)` holds a
(B·T, V) bf16 and a (B·T, V) fp32 copy of the logits, plus log-softmax's fp32 output for
the backward: at micro-batch 8 x 1024 and V = 32,000 about 3 GiB, and three passes over
it through memory. Here the decoder body runs to its hidden states (B, T, C), and the LM
head and the cross-entropy run over chunks of tokens: each chunk's logits are made,
upcast to fp32 and reduced, and, when there is more than one chunk, recomputed in the
backward (torch.utils.checkpoint) instead of kept, so at most one chunk's logits live at a
time. With Liger-Kernel installed (`pip install liger-kernel`), its fused linear +
cross-entropy Triton kernel does the same on CUDA without the recomputation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

# Logit elements per chunk: 2^24 is 64 MiB in fp32 (512 tokens at V = 32,768), small
# beside a 150M model's activations and large enough to keep the LM head's matmul efficient.
LOGITS_PER_CHUNK = 2**24

Body = Callable[..., Any]  # the decoder body: input_ids -> an output with .last_hidden_state


def chunk_tokens(vocab: int, budget: int = LOGITS_PER_CHUNK) -> int:
    """Tokens per chunk so that one chunk's logits hold about `budget` elements."""
    return max(1, budget // vocab)


def _chunk_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = F.linear(hidden, weight)  # (n, V), bf16 under CUDA autocast
    return F.cross_entropy(logits.float(), targets, reduction="sum")  # fp32 ()


def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, targets: Tensor, *, chunk: int | None = None
) -> Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, chunk by chunk.

    hidden (N, C), weight (V, C), targets (N,) int64; equal, within float rounding, to
    ``F.cross_entropy(F.linear(hidden, weight).float(), targets)``, and bit-identical to it
    in one chunk (the sum divided by N is what 'mean' computes)."""
    n = hidden.shape[0]
    size = chunk or chunk_tokens(weight.shape[0])
    if n <= size:
        return _chunk_loss_sum(hidden, weight, targets) / n
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, size):
        part = cast(
            Tensor,
            checkpoint(
                _chunk_loss_sum,
                hidden[start : start + size],  # (n, C)
                weight,
                targets[start : start + size],  # (n,)
                use_reentrant=False,
            ),
        )
        total = total + part
    return total / n


def _liger_loss() -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except ImportError:
        return None
    return cast(Callable[[Tensor, Tensor, Tensor], Tensor], LigerFusedLinearCrossEntropyLoss())


class CausalLMLoss:
    """Mean next-token cross-entropy of a Hugging Face causal LM (`model.model` the decoder
    body, `model.lm_head` the head) on (B, T) inputs and targets. `body` may be a compiled
    `model.model`; Liger's fused kernel is used on CUDA when it is installed."""

    def __init__(self, model: nn.Module, device: torch.device, chunk: int | None = None) -> None:
        self.model = cast(Any, model)
        self.chunk = chunk
        self.liger = _liger_loss() if device.type == "cuda" else None
        if self.liger is not None:
            log.info("loss: Liger-Kernel's fused linear cross-entropy")

    def __call__(self, body: Body, inputs: Tensor, targets: Tensor) -> Tensor:
        hidden = body(input_ids=inputs).last_hidden_state  # (B, T, C)
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B·T, C)
        weight = self.model.lm_head.weight  # (V, C), fp32 master
        if self.liger is not None:
            # Liger's kernel takes one dtype for both: the autocast one, as the head's matmul
            # would run; its gradient flows back through the casts to the fp32 master.
            dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled() else flat.dtype
            return self.liger(weight.to(dtype), flat.to(dtype), targets.reshape(-1))
        return linear_cross_entropy(flat, weight, targets.reshape(-1), chunk=self.chunk)
