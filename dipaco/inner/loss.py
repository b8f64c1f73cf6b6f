"""The causal-LM loss without the fp32 logits of a whole micro-batch.

`model(input_ids).logits` followed by `F.cross_entropy(logits.float(), ...)` holds a
(B·T, V) bf16 and a (B·T, V) fp32 copy of the logits, plus log-softmax's fp32 output for
the backward: at micro-batch 8 x 1024 and V = 32,000 about 3 GiB, and several passes over
it through memory. Here the decoder body runs to its hidden states (B, T, C), and the LM
head and the cross-entropy run over chunks of tokens, so at most one chunk's logits live
at a time:
- on CUDA when the loop is not compiled (a compiled loop puts the head and the loss in
  its graph instead: dipaco.inner.engine.WholeLoss, which the memory fit counts with its
  whole bf16 logits), `LinearCrossEntropy` computes each chunk's loss *and* its gradients
  in the forward (the gradients are kept, (N, C) and (V, C), instead of the logits), so the head
  costs its usual three matmuls; Liger-Kernel's Triton kernel, which does the same fused,
  is used instead when it is installed (`pip install liger-kernel`);
- on the CPU, `linear_cross_entropy` keeps autograd's own arithmetic (bit for bit the
  plain loss in one chunk, the CPU's reference) and chunks only past 1 GiB of logits,
  recomputing the chunks' logits in the backward (torch.utils.checkpoint) then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dipaco.config import CUDA_LOGITS_PER_CHUNK

log = logging.getLogger(__name__)

# Logit elements per chunk: 2^25 is 128 MiB in fp32 (1,024 tokens at V = 32,768), small
# beside a 150M model's activations at micro-batch 8 x 1024, and a head matmul of 1,024 rows
# runs near the GPU's peak. Defined with the memory estimate that counts it (dipaco.config).
LOGITS_PER_CHUNK = CUDA_LOGITS_PER_CHUNK
# On the CPU memory is plentiful and recomputing a chunk's logits is not free: chunks only
# past 2^28 logits (1 GiB in fp32), so the CPU's usual batches run in one, as a plain loop.
LOGITS_PER_CHUNK_CPU = 2**28

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


class LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T` whose gradients are made in the forward,
    chunk by chunk, with the matmuls in `dtype` (bf16 under autocast, as F.linear would)
    and the softmax in fp32. hidden (N, C), weight (V, C) fp32 master, targets (N,)."""

    @staticmethod
    def forward(
        ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor, chunk: int, dtype: torch.dtype
    ) -> Tensor:
        n = hidden.shape[0]
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # (V, C)
            grad_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)  # (N, C)
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, n, chunk):
                h = hidden[start : start + chunk].to(dtype)  # (n, C)
                t = targets[start : start + chunk]  # (n,)
                logits = (h @ w.T).float()  # (n, V)
                lse = torch.logsumexp(logits, dim=-1)  # (n,)
                total += (lse - logits.gather(1, t[:, None]).squeeze(1)).sum()
                probs = logits.sub_(lse[:, None]).exp_()  # softmax, in place (n, V)
                probs[torch.arange(t.shape[0], device=t.device), t] -= 1.0
                g = probs.div_(n).to(dtype)  # d(mean loss)/d(logits) (n, V)
                grad_hidden[start : start + chunk] = g @ w  # (n, C)
                _add_weight_grad(grad_weight, g, h)  # (V, C) += (V, n) @ (n, C), in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.hidden_dtype = hidden.dtype
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            (grad_hidden * grad_output).to(ctx.hidden_dtype),
            grad_weight * grad_output,
            None,
            None,
            None,
        )


def _add_weight_grad(grad_weight: Tensor, g: Tensor, h: Tensor) -> None:
    """grad_weight (V, C) fp32 += g.T @ h with the products summed in fp32, not rounded to
    the matmul's dtype chunk by chunk (32 chunks at V = 32,000 would each lose bf16's
    8 bits before the sum). On CUDA one matmul with an fp32 output (the tensor cores
    accumulate in fp32 anyway); elsewhere the operands go up to fp32, which on the CPU
    is also what a bf16 matmul computes inside."""
    if g.is_cuda and g.dtype != torch.float32:
        grad_weight.add_(torch.mm(g.T, h, out_dtype=torch.float32))
    else:
        grad_weight.addmm_(g.T.float(), h.float())


def _liger_loss() -> Callable[[Tensor, Tensor, Tensor], Tensor] | None:
    try:  # an optional dependency (a GPU's), imported only where a CUDA loss is built
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
    except ImportError:
        return None
    return cast(Callable[[Tensor, Tensor, Tensor], Tensor], LigerFusedLinearCrossEntropyLoss())


class CausalLMLoss:
    """Mean next-token cross-entropy of a Hugging Face causal LM (`model.model` the decoder
    body, `model.lm_head` the head) on (B, T) inputs and targets. `body` may be a compiled
    `model.model`. `fused` (None: on CUDA) takes LinearCrossEntropy, or Liger's kernel when
    it is installed, over the CPU's reference arithmetic."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        chunk: int | None = None,
        *,
        fused: bool | None = None,
    ) -> None:
        self.model = cast(Any, model)
        self.chunk = chunk
        self.fused = device.type == "cuda" if fused is None else fused
        self.liger = _liger_loss() if self.fused and device.type == "cuda" else None
        if self.liger is not None:
            log.info("loss: Liger-Kernel's fused linear cross-entropy")

    def __call__(self, body: Body, inputs: Tensor, targets: Tensor) -> Tensor:
        hidden = body(input_ids=inputs).last_hidden_state  # (B, T, C)
        flat = hidden.reshape(-1, hidden.shape[-1])  # (B·T, C)
        weight = self.model.lm_head.weight  # (V, C), fp32 master
        device = flat.device.type
        if not self.fused:
            size = self.chunk or chunk_tokens(weight.shape[0], LOGITS_PER_CHUNK_CPU)
            return linear_cross_entropy(flat, weight, targets.reshape(-1), chunk=size)
        # The head's matmul runs in the autocast dtype, as F.linear would under autocast.
        autocast = torch.is_autocast_enabled(device)
        dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
        if self.liger is not None:
            # Liger's kernel takes one dtype for both; its gradient flows back through the
            # casts to the fp32 master.
            return self.liger(weight.to(dtype), flat.to(dtype), targets.reshape(-1))
        size = self.chunk or chunk_tokens(weight.shape[0])
        loss = LinearCrossEntropy.apply(flat, weight, targets.reshape(-1), size, dtype)
        return cast(Tensor, loss)
