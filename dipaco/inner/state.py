"""What the inner loop takes and returns: token sources, step metrics, results, warm state."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from dipaco.config import InnerConfig, RunConfig
from dipaco.tensorfile import FileTensors, write_safetensors

STATE_FORMAT = "dipaco-inner-state/1"


class TokenSource(Protocol):
    """Training windows addressed by position, so a checkpoint can name where data resumes."""

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        """Windows position .. position+batch_size-1 as (batch_size, seq_len + 1) int64."""
        ...


class InMemoryTokenSource:
    """Non-overlapping windows of one token tensor, wrapping around at the end."""

    def __init__(self, tokens: Tensor) -> None:
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"tokens must be 1-D int64, got {tuple(tokens.shape)} {tokens.dtype}")
        self.tokens = tokens

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        windows = (self.tokens.numel() - 1) // seq_len
        if windows < 1:
            raise ValueError(f"{self.tokens.numel()} tokens hold no window of {seq_len + 1}")
        starts = ((position + torch.arange(batch_size)) % windows) * seq_len  # (B,)
        offsets = torch.arange(seq_len + 1)  # (T+1,)
        return self.tokens[starts[:, None] + offsets[None, :]]  # (B, T+1)


@dataclass
class StepMetrics:
    """What `on_step` sees after every step. `loss` and `grad_norm` are those of step
    `reported_step`: on the CPU every step, on CUDA the last one read back from the device
    (every `report_every` steps, so that no step waits for the GPU); `step`, `lr`,
    `tokens` and `seconds` are always the current step's."""

    step: int  # steps done in this loop, 1-based
    loss: float  # mean cross-entropy over the micro-batches of step `reported_step`
    lr: float
    grad_norm: float  # before clipping, of step `reported_step`
    tokens: int  # tokens trained on so far in this loop
    seconds: float  # training time so far, across resumes
    reported_step: int = 0  # the step `loss` and `grad_norm` belong to (0: none read yet)
    # The last step whose checkpoint is whole on disk (0: none). Checkpoints are written in
    # the background, so the one taken after step k - 1 may still be in flight at step k.
    checkpointed_step: int = 0


@dataclass
class InnerResult:
    delta: dict[str, Tensor]  # θ_old − θ_new per state-dict name, fp32 on the CPU; when
    # stopped early, of the steps done ({} if none)
    losses: list[float]
    lrs: list[float]
    grad_norms: list[float]
    tokens: int
    seconds: float
    position: int  # data position after the last micro-batch
    completed: bool  # False when should_stop ended it before its bound (checkpoint saved)
    module_deltas: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # by train_path
    # AdamW state by parameter name; on the CPU read lazily from the unit's last checkpoint
    # (dipaco.inner.checkpoint), one tensor per access
    adam: Mapping[str, Tensor] = field(default_factory=dict)
    state: InnerState | None = None  # by train_path: the state to hand the path's next unit
    checkpoints: int = 0  # checkpoints written by this call
    # Seconds the loop stood still for them: the snapshots to host memory (and any wait for
    # the write before), and the last write, which the loop returns after.
    checkpoint_block_s: float = 0.0
    checkpoint_write_s: float = 0.0  # seconds the background writer spent writing them
    # Waits until the last checkpoint is on disk (the loop may return before: its Δ came
    # from the snapshot); call it before removing the checkpoint's folder.
    checkpoint_written: Callable[[], None] = field(default=lambda: None, repr=False)
    # Seconds of the unit outside its steps, by part (PathTrainer.train_path): what a
    # unit's fixed cost is made of.
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class CheckpointMismatch(ValueError):
    """A checkpoint exists but belongs to other work; it is never silently reused."""


def state_fingerprint(config: RunConfig) -> str:
    """What must match for saved AdamW moments to fit: the model's shapes and AdamW's betas,
    and the layout, since the residual is kept per module: a run's dense phase 1 and its
    DiPaCo phase 2 both have a path 0 (RunConfig.dense_phase), with other modules."""
    return json.dumps(
        {
            "model": config.model.model_dump(mode="json"),
            "betas": list(config.inner.betas),
            "layout": config.layout.model_dump(mode="json"),
        },
        sort_keys=True,
    )


@dataclass
class InnerState:
    """One path's inner-optimiser state between work units (a torchtitan-style Stateful).

    ``adam`` maps ``<parameter name>/<key>`` (key: step, exp_avg, exp_avg_sq) to CPU
    tensors; ``residual`` maps ``<module id>/<tensor name>`` to the pseudo-gradient's
    quantisation error kept for error feedback (dipaco.codecs.encode_with_feedback).
    ``fingerprint`` names the model and betas the moments were made with; `load` returns
    None for a file made with others, so a changed run never reuses moments that do not fit.
    """

    adam: Mapping[str, Tensor] = field(default_factory=dict)  # lazy: FileTensors
    residual: Mapping[str, Tensor] = field(default_factory=dict)  # lazy once loaded
    fingerprint: str = ""

    def state_dict(self) -> Mapping[str, Tensor]:
        """`adam/<name>/<key>` and `residual/<module>/<name>` tensors: a view that reads
        lazily held moments only as each is accessed."""
        return _StateTensors(self.adam, self.residual)

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        self.adam = {k[5:]: v for k, v in tensors.items() if k.startswith("adam/")}
        self.residual = {k[9:]: v for k, v in tensors.items() if k.startswith("residual/")}

    def module_residual(self, module_id: str) -> dict[str, Tensor]:
        """The error-feedback residual of one module's Δ, by tensor name (empty: none yet)."""
        prefix, residual = f"{module_id}/", self.residual
        return {k[len(prefix) :]: residual[k] for k in residual if k.startswith(prefix)}

    def set_module_residual(self, module_id: str, tensors: Mapping[str, Tensor]) -> None:
        """Replace one module's residual (encode_with_feedback's second result)."""
        prefix = f"{module_id}/"
        self.residual = {k: v for k, v in self.residual.items() if not k.startswith(prefix)}
        self.residual.update({prefix + name: t for name, t in tensors.items()})

    def save(self, path: str | Path) -> None:
        """Atomically, as safetensors with the fingerprint in the header."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        meta = {"format": STATE_FORMAT, "fingerprint": self.fingerprint}
        with open(tmp, "wb") as handle:  # streamed, one tensor at a time (_StateTensors)
            write_safetensors(handle, self.state_dict(), {"dipaco": json.dumps(meta)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None) -> InnerState | None:
        """The saved state, or None when absent, unreadable or made for another model."""
        path = Path(path)
        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as handle:
                meta = json.loads((handle.metadata() or {}).get("dipaco", "{}"))
                if meta.get("format") != STATE_FORMAT:
                    return None
                if fingerprint is not None and meta.get("fingerprint") != fingerprint:
                    return None
                keys = list(handle.keys())
            # The moments stay on disk until the optimizer takes them, one at a time, and
            # the residual until its module's next Δ is encoded (4 bytes a parameter each
            # that a unit would otherwise hold while it trains).
            adam = FileTensors(path, {k[5:]: k for k in keys if k.startswith("adam/")})
            residual = FileTensors(path, {k[9:]: k for k in keys if k.startswith("residual/")})
        except (OSError, ValueError, SafetensorError):
            return None  # a torn or foreign file: start with fresh moments, never crash
        return cls(adam=adam, residual=residual, fingerprint=str(meta.get("fingerprint", "")))


def lr_at(cfg: InnerConfig, step: int, total_steps: int) -> float:
    """Learning rate of 0-based `step` of a `total_steps` schedule: linear warm-up, cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


class _StateTensors(Mapping[str, Tensor]):
    """InnerState's tensors under their file names, each read (a lazy moment) or moved to
    the CPU only when accessed; `spec` without reading (dipaco.tensorfile)."""

    def __init__(self, adam: Mapping[str, Tensor], residual: Mapping[str, Tensor]) -> None:
        self.parts = {"adam/": adam, "residual/": residual}

    def _part(self, key: str) -> tuple[Mapping[str, Tensor], str]:
        for prefix, part in self.parts.items():
            if key.startswith(prefix) and key[len(prefix) :] in part:
                return part, key[len(prefix) :]
        raise KeyError(key)

    def spec(self, key: str) -> tuple[torch.dtype, tuple[int, ...]]:
        part, name = self._part(key)
        spec = getattr(part, "spec", None)
        if spec is not None:
            return spec(name)
        tensor = part[name]
        return tensor.dtype, tuple(tensor.shape)

    def __getitem__(self, key: str) -> Tensor:
        part, name = self._part(key)
        return part[name].detach().to("cpu")

    def __iter__(self) -> Iterator[str]:
        for prefix, part in self.parts.items():
            for name in part:
                yield prefix + name

    def __len__(self) -> int:
        return sum(len(part) for part in self.parts.values())
