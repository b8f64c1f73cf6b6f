"""Fitting a step's batch to a device: the micro-batch split, both ways, and the arithmetic.

A step trains on `inner.batch_size` sequences (micro_batch_size x grad_accum_steps); how
they are split changes neither the Δ's meaning nor the checkpoint's identity
(dipaco.inner.checkpoint), only memory and speed. Before a unit trains,
`fit_micro_batch` grows the split to the largest micro-batch, within the batch, that the
memory estimate (dipaco.config.estimate_path_memory) fits in the budget: a GPU runs its
matmuls on more rows at once and launches fewer kernels (the run's default of 8 leaves
most of an H100 idle). When the estimate does not fit, it shrinks the split; when the
device runs out of memory anyway, `smaller_micro_batch` halves it and the unit resumes from
its last checkpoint (`dipaco.inner.ResidentTrainer`).

`precision_for` says which arithmetic a device trains in: bf16 autocast on a GPU that has
bf16 (Ampere and later), fp16 autocast with a gradient scaler on one that does not, fp32
on the CPU (unless a test forces fp16 there, which torch's CPU autocast also serves).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

import torch

from dipaco.config import (
    CUDA_LOGITS_PER_CHUNK,
    GiB,
    InnerConfig,
    RunConfig,
    estimate_path_memory,
)

__all__ = [
    "DoesNotFit",
    "Precision",
    "fit_micro_batch",
    "is_out_of_memory",
    "larger_micro_batches",
    "path_memory",
    "precision_for",
    "smaller_micro_batch",
]

log = logging.getLogger(__name__)

Precision = Literal["bf16", "fp16", "fp32"]


class DoesNotFit(MemoryError):
    """A unit that does not fit the device even with one sequence per micro-batch."""


def precision_for(device: torch.device, forced: Precision | None = None) -> Precision:
    """The arithmetic of the loop's forward and backward on `device` (master weights and
    AdamW moments stay fp32 in every case)."""
    if forced is not None:
        return forced
    if device.type != "cuda":
        return "fp32"
    # Before Ampere (compute capability 8) a GPU has no bf16 tensor cores: fp16 + a scaler.
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _split(inner: InnerConfig, micro: int) -> InnerConfig:
    accum = inner.batch_size // micro
    return inner.model_copy(update={"micro_batch_size": micro, "grad_accum_steps": accum})


def smaller_micro_batch(inner: InnerConfig) -> InnerConfig | None:
    """The largest micro-batch below half that divides the current one; None at 1."""
    micro = inner.micro_batch_size
    smaller = next((d for d in range(micro // 2, 0, -1) if micro % d == 0), None)
    return None if smaller is None else _split(inner, smaller)


def larger_micro_batches(inner: InnerConfig) -> list[InnerConfig]:
    """Every split of the same batch with a larger micro-batch, smallest first."""
    batch = inner.batch_size
    return [
        _split(inner, d) for d in range(inner.micro_batch_size + 1, batch + 1) if batch % d == 0
    ]


def path_memory(
    config: RunConfig, inner: InnerConfig, device: str, *, whole_logits: bool = False
) -> int:
    """Bytes one path trains in with the split `inner`: the library's estimate, and with
    `whole_logits` (the compiled loss on CUDA, which keeps a micro-batch's bf16 logits and
    their gradient, 4 bytes a logit, where the chunked loss keeps one chunk's) the rest."""
    need = estimate_path_memory(config.model, inner, device=device).total_bytes
    if whole_logits and device == "cuda":
        model = config.model
        tokens = inner.micro_batch_size * model.seq_len
        chunk = min(tokens, max(1, CUDA_LOGITS_PER_CHUNK // model.vocab_size))
        need += 4 * tokens * model.vocab_size - 12 * chunk * model.vocab_size
    return need


def fit_micro_batch(
    config: RunConfig,
    budget_bytes: int | None,
    device: str = "cpu",
    *,
    grow: bool = True,
    whole_logits: bool = False,
) -> InnerConfig:
    """The split of the run's batch whose memory (`path_memory` for `device`, its type:
    "cuda" trains in bf16) fits `budget_bytes`: the largest micro-batch that fits
    (`grow`), or the run's own shrunk until it fits. None: the run's split as it is.
    DoesNotFit when one sequence per micro-batch is too much."""
    inner = config.inner
    if budget_bytes is None:
        return inner
    need = partial(path_memory, config, device=device, whole_logits=whole_logits)
    if grow and need(inner) <= budget_bytes:
        for larger in larger_micro_batches(inner):
            if need(larger) > budget_bytes:
                break  # the estimate grows with the micro-batch: none larger fits
            inner = larger
    while need(inner) > budget_bytes:
        smaller = smaller_micro_batch(inner)
        if smaller is None:
            raise DoesNotFit(
                f"this run needs about {need(inner) / GiB:.1f} GiB even with one sequence per micro-batch; "
                f"the memory budget is {budget_bytes / GiB:.1f} GiB (raise --memory-cap or "
                "use a bigger device)"
            )
        inner = smaller
    if inner != config.inner:
        log.info("micro-batch %d -> %d to fit %.1f GiB (same effective batch)",
                 config.inner.micro_batch_size, inner.micro_batch_size,
                 budget_bytes / GiB)  # fmt: skip
    return inner
