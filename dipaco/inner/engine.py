"""What the inner loop trains with: the optimizer, the (compiled) loss, the arithmetic,
the token feed and the checkpoint writer, grouped as an `Engine` that a resident trainer
keeps from one unit to the next."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dipaco.config import InnerConfig
from dipaco.inner.checkpoint import CheckpointWriter
from dipaco.inner.fit import Precision, precision_for
from dipaco.inner.loss import CausalLMLoss
from dipaco.inner.state import CheckpointMismatch

log = logging.getLogger(__name__)

_warned: set[str] = set()  # compile fallbacks already logged in this process


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


def make_optimizer(model: nn.Module, cfg: InnerConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters: fused on CUDA, torch's default on the
    CPU (its for-loop implementation, which the CPU's bit-identical resumes are made with)."""
    # Decay matrices only, not norms (the nanoGPT/Llama convention).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda" and all(p.is_cuda for p in params)
    extra: dict[str, Any] = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)


def configure_optimizer(optimizer: torch.optim.Optimizer, cfg: InnerConfig) -> None:
    """Set a (resident) optimizer's hyper-parameters to `cfg`'s (lr is set every step)."""
    decay, no_decay = optimizer.param_groups
    for group, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0)):
        group.update(betas=cfg.betas, eps=cfg.eps, weight_decay=weight_decay, lr=cfg.lr)


def adam_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The optimiser's per-parameter state as ``<parameter name>/<key>`` CPU tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            tensor = value if isinstance(value, Tensor) else torch.tensor(value)
            out[f"{names[id(param)]}/{key}"] = tensor.detach().to("cpu", copy=True)
    return out


def load_adam_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, adam: Mapping[str, Tensor]
) -> None:
    """Put saved moments on the parameters they belong to: copied into the state tensors
    a resident optimizer already has, else into new ones on the parameter's device. Each
    saved tensor is read from `adam` only as it is put in place, so a lazy mapping
    (dipaco.tensorfile.FileTensors) costs one tensor at a time."""
    on_device = {
        id(p): bool(g.get("fused") or g.get("capturable"))
        for g in optimizer.param_groups
        for p in g["params"]
    }
    by_param: dict[str, list[str]] = {}
    for key in adam:
        name, field = key.rsplit("/", 1)
        by_param.setdefault(name, []).append(field)
    for name, param in model.named_parameters():
        fields = by_param.get(name)
        if not fields:
            optimizer.state.pop(param, None)  # fresh, as a new optimizer would start it
            continue
        state = optimizer.state.get(param, {})
        for key in fields:
            value = adam[f"{name}/{key}"]
            if key != "step" and tuple(value.shape) != tuple(param.shape):
                raise CheckpointMismatch(
                    f"AdamW state {name}/{key} has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(param.shape)}: the state belongs to another model"
                )
            current = state.get(key)
            if isinstance(current, Tensor) and current.shape == value.shape:
                current.copy_(value, non_blocking=True)
            elif key == "step":  # on the CPU unless fused or capturable (torch's defaults)
                device = param.device if on_device.get(id(param)) else torch.device("cpu")
                state[key] = value.to(device, torch.float32, copy=True)
            else:
                state[key] = value.to(param.device, copy=True)
        optimizer.state[param] = state


def cpu_params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


class WholeLoss(nn.Module):
    """The body, the head and the mean cross-entropy as one module, for torch.compile: the
    head and the loss inside the compiled graph, where Inductor fuses the logits' cast,
    log-softmax, gather and their gradient into a few kernels over the (N, V) logits and
    never writes an fp32 copy of them (the way modded-nanogpt compiles its loss)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        path = cast(Any, self.model)
        hidden = path.model(input_ids=inputs).last_hidden_state  # (B, T, C)
        logits = path.lm_head(hidden)  # (B, T, V), bf16 under autocast
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())  # fp32 ()


class Forward:
    """A micro-batch's loss (forward; its backward follows), compiled or eager.

    Compiled: `WholeLoss` under `torch.compile` (body, head and loss in one graph). Eager:
    the body, then `CausalLMLoss` (the CPU's reference arithmetic; on CUDA the chunked
    fused loss, or Liger's kernel). `torch.compile` compiles at the first call; if that
    call (forward and backward) raises, the loop goes on eagerly and the reason is logged
    once: a volunteer's GPU or driver that Inductor cannot serve still trains."""

    def __init__(self, model: nn.Module, loss: CausalLMLoss, compile: bool) -> None:
        body = cast(Any, model).model
        self.eager: Callable[[Tensor, Tensor], Tensor] = lambda inputs, targets: loss(
            body, inputs, targets
        )
        self.compiled: Callable[[Tensor, Tensor], Tensor] | None = None
        self.proven = False  # a compiled forward and backward have run
        if compile:
            try:
                # DIPACO_COMPILE_MODE (e.g. max-autotune-no-cudagraphs): a mode to measure
                # against the default (bench/profile_step.py); unset, torch's default.
                mode = os.environ.get("DIPACO_COMPILE_MODE") or None
                compiled = torch.compile(WholeLoss(model), mode=mode)
                self.compiled = cast(Callable[..., Tensor], compiled)
            except Exception as error:
                self.fallback(error)

    @property
    def loss(self) -> Callable[[Tensor, Tensor], Tensor]:
        return self.compiled if self.compiled is not None else self.eager

    def fallback(self, error: BaseException) -> None:
        self.compiled = None
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        _warn_once(
            f"torch.compile failed ({type(error).__name__}: {first}); training eagerly, "
            "which is slower (pass compile=False, or dipaco-worker --no-compile, to skip it)"
        )


class WindowFeed:
    """Token windows to the device. On CUDA through a ring of pinned host buffers with
    non-blocking copies: the host prepares the next window while the device computes, and
    a buffer is refilled only once its previous copy has left (its event)."""

    SLOTS = 3

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._slots: list[tuple[Tensor, torch.cuda.Event]] = []
        self._next = 0

    def __call__(self, window: Tensor) -> Tensor:
        if self.device.type != "cuda":
            return window.to(self.device)
        i = self._next % self.SLOTS
        self._next += 1
        if i < len(self._slots) and self._slots[i][0].shape == window.shape:
            buffer, event = self._slots[i]
            event.synchronize()
        else:
            buffer, event = torch.empty_like(window).pin_memory(), torch.cuda.Event()
            if i < len(self._slots):
                self._slots[i] = (buffer, event)
            else:
                self._slots.append((buffer, event))
        buffer.copy_(window)
        on_device = buffer.to(self.device, non_blocking=True)
        event.record()
        return on_device


@dataclass
class Engine:
    """What one loop trains with; a resident trainer keeps it across units. `precision`:
    the forward and backward's arithmetic (dipaco.inner.fit.precision_for); fp16 comes with
    a gradient scaler, since fp16 gradients underflow where bf16's do not."""

    model: nn.Module
    optimizer: torch.optim.AdamW
    forward: Forward
    feed: WindowFeed
    writer: CheckpointWriter
    device: torch.device
    precision: Precision = "fp32"
    scaler: torch.amp.GradScaler | None = None

    @classmethod
    def build(
        cls,
        model: nn.Module,
        cfg: InnerConfig,
        device: torch.device,
        compile: bool,
        precision: Precision | None = None,
    ) -> Engine:
        model.to(device).train()
        chosen = precision_for(device, precision)
        scaler = torch.amp.GradScaler(device.type) if chosen == "fp16" else None
        return cls(
            model=model,
            optimizer=make_optimizer(model, cfg, device),
            forward=Forward(model, CausalLMLoss(model, device), compile),
            feed=WindowFeed(device),
            writer=CheckpointWriter(device),
            device=device,
            precision=chosen,
            scaler=scaler,
        )

    def autocast(self) -> torch.autocast:
        """The forward's autocast context: off in fp32 (the CPU's bit-exact arithmetic)."""
        dtype = torch.float16 if self.precision == "fp16" else torch.bfloat16
        return torch.autocast(self.device.type, dtype=dtype, enabled=self.precision != "fp32")
