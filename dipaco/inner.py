"""The inner loop: H AdamW steps on one path, returning the pseudo-gradient Δ = θ_old − θ_new.

Linear warm-up then cosine decay, global-norm clipping, gradient accumulation to a fixed
batch of micro_batch_size x grad_accum_steps sequences, bf16 autocast on CUDA only.
Checkpoints (weights, θ_old, AdamW state, step, data position, RNG) are one safetensors
file with a JSON header, written atomically; resuming one on the CPU continues bit for bit.

DiLoCo keeps each replica's inner AdamW state from one outer round to the next and never
sends it. `train_path` takes that state (an `InnerState`, or None for a fresh optimiser)
and returns the new one in `InnerResult.state`; the worker agent keeps one per (run, path)
on disk and the simulator one per (path, replica) in memory, through the same calls.
`InnerState` follows torchtitan's `Stateful` pattern (`state_dict` / `load_state_dict`)
and is keyed by parameter name, so it survives a change of micro-batch or device.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from dipaco.config import InnerConfig, RunConfig
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, split_path_state

__all__ = [
    "CheckpointMismatch",
    "InMemoryTokenSource",
    "InnerResult",
    "InnerState",
    "StepMetrics",
    "TokenSource",
    "checkpoint_identity",
    "lr_at",
    "run_inner_loop",
    "state_fingerprint",
    "train_path",
]

CHECKPOINT_FORMAT = "dipaco-inner-checkpoint/1"
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
    step: int  # steps done in this loop, 1-based
    loss: float  # mean cross-entropy over the step's micro-batches
    lr: float
    grad_norm: float  # before clipping
    tokens: int  # tokens trained on so far in this loop
    seconds: float  # training time so far, across resumes


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
    completed: bool  # False when should_stop ended the loop early (the checkpoint is saved)
    module_deltas: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # by train_path
    adam: dict[str, Tensor] = field(default_factory=dict)  # AdamW state by parameter name
    state: InnerState | None = None  # by train_path: the state to hand the path's next unit

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

    adam: dict[str, Tensor] = field(default_factory=dict)
    residual: dict[str, Tensor] = field(default_factory=dict)
    fingerprint: str = ""

    def state_dict(self) -> dict[str, Tensor]:
        tensors = {f"adam/{k}": v for k, v in self.adam.items()}
        tensors.update({f"residual/{k}": v for k, v in self.residual.items()})
        return tensors

    def load_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        self.adam = {k[5:]: v for k, v in tensors.items() if k.startswith("adam/")}
        self.residual = {k[9:]: v for k, v in tensors.items() if k.startswith("residual/")}

    def module_residual(self, module_id: str) -> dict[str, Tensor]:
        """The error-feedback residual of one module's Δ, by tensor name (empty: none yet)."""
        prefix = f"{module_id}/"
        return {k[len(prefix) :]: v for k, v in self.residual.items() if k.startswith(prefix)}

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
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        meta = {"format": STATE_FORMAT, "fingerprint": self.fingerprint}
        save_file(tensors, str(tmp), metadata={"dipaco": json.dumps(meta)})
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
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
        except (OSError, ValueError, SafetensorError):
            return None  # a torn or foreign file: start with fresh moments, never crash
        state = cls(fingerprint=str(meta.get("fingerprint", "")))
        state.load_state_dict(tensors)
        return state


def lr_at(cfg: InnerConfig, step: int, total_steps: int) -> float:
    """Learning rate of 0-based `step` of a `total_steps` schedule: linear warm-up, cosine."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps - 1)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def _make_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    # Decay matrices only, not norms (the nanoGPT/Llama convention).
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def _adam_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The optimiser's per-parameter state as ``<parameter name>/<key>`` CPU tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for param, state in optimizer.state.items():
        for key, value in state.items():
            tensor = value if isinstance(value, Tensor) else torch.tensor(value)
            out[f"{names[id(param)]}/{key}"] = tensor.detach().to("cpu", copy=True)
    return out


def _load_adam_by_name(
    model: nn.Module, optimizer: torch.optim.Optimizer, adam: Mapping[str, Tensor]
) -> None:
    """Put saved moments back on the parameters they belong to (on the model's device)."""
    for name, param in model.named_parameters():
        keys = {k.rsplit("/", 1)[1]: v for k, v in adam.items() if k.rsplit("/", 1)[0] == name}
        if not keys:
            continue
        state = {}
        for key, value in keys.items():
            if key != "step" and tuple(value.shape) != tuple(param.shape):
                raise CheckpointMismatch(
                    f"AdamW state {name}/{key} has shape {tuple(value.shape)}, the parameter "
                    f"{tuple(param.shape)}: the state belongs to another model"
                )
            # step stays on the CPU (torch's default for non-capturable AdamW)
            state[key] = value.clone() if key == "step" else value.to(param.device, copy=True)
        optimizer.state[param] = state


def _cpu_params(model: nn.Module) -> dict[str, Tensor]:
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in model.named_parameters()}


@dataclass
class _Progress:
    step: int = 0
    position: int = 0
    tokens: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    # sha256 of the weights the unit started from, once a rebase moved θ_old off them
    # (outer.overlap eager): what a resumed checkpoint is checked against then.
    start_digest: str = ""


def _weights_digest(weights: Mapping[str, Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


def _save_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    theta_old: Mapping[str, Tensor],
    progress: _Progress,
    identity: dict[str, Any],
) -> None:
    tensors = {f"weights/{n}": t for n, t in _cpu_params(model).items()}
    tensors.update({f"theta_old/{n}": t for n, t in theta_old.items()})
    for index, state in optimizer.state_dict()["state"].items():
        for key, value in state.items():
            tensors[f"adam/{index}/{key}"] = value.detach().to("cpu", copy=True).contiguous()
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    meta = {"format": CHECKPOINT_FORMAT, "identity": identity, "progress": vars(progress)}
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"dipaco": json.dumps(meta)})
    with open(tmp, "rb") as handle:  # the bytes reach the disk before the name does
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    theta_old: dict[str, Tensor],
    identity: dict[str, Any],
) -> _Progress:
    """Model, optimiser and RNG from the checkpoint; `theta_old` too when a rebase had
    moved it (checked then by the digest of the weights the unit started from)."""
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {}).get("dipaco", "{}"))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointMismatch(f"{path} is not an inner-loop checkpoint; delete it")
        if meta["identity"] != identity:
            raise CheckpointMismatch(
                f"{path} was written with other settings ({meta['identity']} vs {identity}); "
                "delete it or pass resume=False"
            )
        start_digest = str(meta["progress"].get("start_digest") or "")
        if start_digest:  # rebased: θ_old moved, the weights it started from are its digest
            if _weights_digest(theta_old) != start_digest:
                raise CheckpointMismatch(
                    f"{path} started from other weights (their sha256 differs); "
                    "delete it or pass resume=False"
                )
            for name in theta_old:
                theta_old[name] = handle.get_tensor(f"theta_old/{name}")
        for name, old in theta_old.items():
            if not start_digest and not torch.equal(handle.get_tensor(f"theta_old/{name}"), old):
                raise CheckpointMismatch(
                    f"{path} started from other weights ({name} differs); "
                    "delete it or pass resume=False"
                )
        weights = {n: handle.get_tensor(f"weights/{n}") for n, _ in model.named_parameters()}
        state: dict[int, dict[str, Tensor]] = {}
        for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if key.startswith("adam/"):
                _, index, name = key.split("/")
                state.setdefault(int(index), {})[name] = handle.get_tensor(key)
        rng = {key: handle.get_tensor(key) for key in handle.keys() if key.startswith("rng/")}  # noqa: SIM118
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = state
    optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(rng["rng/cpu"])
    if torch.cuda.is_available():
        cuda = [rng.get(f"rng/cuda/{i}") for i in range(torch.cuda.device_count())]
        if all(t is not None for t in cuda):  # absent when written on a machine without CUDA
            torch.cuda.set_rng_state_all([t for t in cuda if t is not None])
    return _Progress(**meta["progress"])


def checkpoint_identity(
    cfg: InnerConfig, *, seq_len: int, start_position: int, first_step: int, total: int
) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed: the work, not its split.

    The micro-batch split (micro_batch_size x grad_accum_steps) is left out, the batch it
    makes kept: checkpoints fall on step boundaries, where the data position is
    step x batch_size sequences and the AdamW state is per parameter whatever the split,
    so a unit resumes under another split of the same batch (the worker agent's
    out-of-memory fallback halves the micro-batch and resumes its last checkpoint).
    """
    inner = cfg.model_dump(mode="json", exclude={"micro_batch_size", "grad_accum_steps"})
    return {
        "inner": {**inner, "batch_size": cfg.batch_size},
        "seq_len": seq_len,
        "start_position": start_position,
        "first_step": first_step,
        "total_steps": total,
    }


def _delta(model: nn.Module, theta_old: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ_old − θ_new for every state-dict name; a tied tensor appears under both names."""
    new = _cpu_params(model)
    by_param = {n: theta_old[n] - new[n] for n in new}
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    return {key: by_param[names[t.data_ptr()]] for key, t in model.state_dict().items()}


def path_shift(
    config: RunConfig,
    p: int,
    old: Mapping[str, Mapping[str, Tensor]],
    new: Mapping[str, Mapping[str, Tensor]],
) -> dict[str, Tensor]:
    """Path p's state-dict shift from modules `old` to modules `new` (θ_new − θ_old per
    name): what `run_inner_loop(rebase=)` adds for outer.overlap's eager correction. One
    home for the simulator (`train_dipaco(eager_at=)`) and the worker agent
    (worker_agent.rebase), so both rebase by the same float arithmetic."""
    before = assemble_path_state(config, p, old)
    after = assemble_path_state(config, p, new)
    return {name: after[name] - before[name] for name in after}


def _rebase(model: nn.Module, theta_old: dict[str, Tensor], shift: Mapping[str, Tensor]) -> None:
    """Move the live weights and θ_old by `shift` (names without a shift stay)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in shift:
                param.add_(shift[name].to(param.device, param.dtype))
                theta_old[name] += shift[name].to(torch.float32)


def run_inner_loop(
    model: nn.Module,
    source: TokenSource,
    cfg: InnerConfig,
    *,
    seq_len: int,
    device: torch.device | str = "cpu",
    start_position: int = 0,
    first_step: int = 0,
    total_steps: int | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    adam: Mapping[str, Tensor] | None = None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None = None,
) -> InnerResult:
    """Train `model` (a causal LM whose weights are θ_old) for cfg.steps AdamW steps.

    `adam` (``<parameter name>/<key>`` tensors, as InnerResult.adam returns them) starts
    the optimiser warm instead of fresh; a checkpoint being resumed takes precedence.

    The schedule runs over global steps first_step .. first_step + cfg.steps - 1 of a
    `total_steps`-long schedule (default: this loop alone); DiLoCo's run-long schedule is
    first_step = t·H, total_steps = T·H. With checkpoint_path, a checkpoint is written
    every `checkpoint_every` steps, when should_stop() turns true, and at the end; a run
    that finds one resumes from it (resume=True) or raises CheckpointMismatch if it
    belongs to other work.

    `rebase(step)`, after each step, may return a shift (state-dict name -> tensor): a newer
    base version landed (θ_new_base − θ_old, outer.overlap's eager correction). It is added
    to the live weights and to θ_old, so training goes on from the newer version and the
    Δ is relative to it. A checkpoint written after it holds the moved θ_old (it is not
    asked again on resume, the step being past) and is checked against the weights the
    unit started from by their sha256.
    """
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every = {checkpoint_every}: must be >= 1 or None")
    device = torch.device(device)
    model.to(device).train()
    theta_old = _cpu_params(model)
    optimizer = _make_optimizer(model, cfg)
    total = cfg.steps if total_steps is None else total_steps
    identity = checkpoint_identity(
        cfg, seq_len=seq_len, start_position=start_position, first_step=first_step, total=total
    )
    path = Path(checkpoint_path) if checkpoint_path is not None else None
    progress = _Progress(position=start_position)
    if path is not None and resume and path.exists():
        progress = _load_checkpoint(path, model, optimizer, theta_old, identity)
    elif adam:
        _load_adam_by_name(model, optimizer, adam)

    def save() -> None:
        if path is not None:
            _save_checkpoint(path, model, optimizer, theta_old, progress, identity)

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = int(cast(Any, model).get_input_embeddings().weight.shape[0])
    batch, accum = cfg.micro_batch_size, cfg.grad_accum_steps
    while progress.step < cfg.steps:
        if should_stop is not None and should_stop():
            save()
            # The partial Δ of the steps done so far: the worker agent salvages it.
            partial = _delta(model, theta_old) if progress.step else {}
            adam = _adam_by_name(model, optimizer)
            return _result(progress, partial, completed=False, adam=adam)
        started = time.perf_counter()
        lr = lr_at(cfg, first_step + progress.step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            window = source.batch(progress.position, batch, seq_len)
            _check_window(window, batch, seq_len, vocab)
            window = window.to(device)
            progress.position += batch
            inputs, targets = window[:, :-1], window[:, 1:]  # (B, T), (B, T)
            with autocast:
                logits = model(input_ids=inputs).logits  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1))
            (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        progress.step += 1
        progress.tokens += accum * batch * seq_len
        progress.losses.append(loss_sum.item() / accum)
        if not math.isfinite(progress.losses[-1]):
            raise FloatingPointError(
                f"loss is {progress.losses[-1]} at step {progress.step}; lower inner.lr "
                "or check the token source"
            )
        progress.lrs.append(lr)
        progress.grad_norms.append(float(grad_norm))
        progress.seconds += time.perf_counter() - started
        # After the timing: an eager unit may wait here for the newer version (the agent's
        # worker_agent.rebase), which is not training time, nor its speed.
        shift = rebase(progress.step) if rebase is not None else None
        if shift:
            if not progress.start_digest:
                progress.start_digest = _weights_digest(theta_old)
            _rebase(model, theta_old, shift)
        if on_step is not None:
            metrics = StepMetrics(
                progress.step, progress.losses[-1], lr, progress.grad_norms[-1],
                progress.tokens, progress.seconds,
            )  # fmt: skip
            on_step(metrics)
        periodic = checkpoint_every is not None and progress.step % checkpoint_every == 0
        if periodic and progress.step < cfg.steps:  # the last step is saved below
            save()
    save()  # a crash between here and the upload loses nothing: a rerun returns at once
    adam_state = _adam_by_name(model, optimizer)
    return _result(progress, _delta(model, theta_old), completed=True, adam=adam_state)


def _check_window(window: Tensor, batch: int, seq_len: int, vocab: int) -> None:
    if tuple(window.shape) != (batch, seq_len + 1) or window.dtype != torch.int64:
        raise ValueError(
            f"token source gave {tuple(window.shape)} {window.dtype}; "
            f"expected ({batch}, {seq_len + 1}) int64"
        )
    if int(window.min()) < 0 or int(window.max()) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); check model.vocab_size")


def _result(
    progress: _Progress,
    delta: dict[str, Tensor],
    *,
    completed: bool,
    adam: dict[str, Tensor] | None = None,
) -> InnerResult:
    return InnerResult(
        delta=delta,
        losses=list(progress.losses),
        lrs=list(progress.lrs),
        grad_norms=list(progress.grad_norms),
        tokens=progress.tokens,
        seconds=progress.seconds,
        position=progress.position,
        completed=completed,
        adam=adam or {},
    )


def train_path(
    config: RunConfig,
    p: int,
    modules: Mapping[str, Mapping[str, Tensor]],
    source: TokenSource,
    *,
    round_index: int = 0,
    device: torch.device | str = "cpu",
    start_position: int = 0,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    resume: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    state: InnerState | None = None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None = None,
) -> InnerResult:
    """One work unit: assemble path p from `modules`, train H steps, Δ split per module.

    `state` is the path's inner state from its previous unit on this worker (None: fresh
    AdamW); moments made for another model or other betas are ignored, not misapplied.
    The result's `state` carries the new moments (and `state`'s error-feedback residual,
    which dipaco.codecs.encode_with_feedback updates) to the path's next unit.
    """
    fingerprint = state_fingerprint(config)
    warm = state.adam if state is not None and state.fingerprint == fingerprint else None
    model = build_model(config.model, config.seed)
    model.load_state_dict(assemble_path_state(config, p, modules))
    h = config.inner.steps
    result = run_inner_loop(
        model,
        source,
        config.inner,
        seq_len=config.model.seq_len,
        device=device,
        start_position=start_position,
        first_step=round_index * h,
        total_steps=config.rounds * h,
        checkpoint_path=checkpoint_path,
        checkpoint_every=checkpoint_every,
        resume=resume,
        on_step=on_step,
        should_stop=should_stop,
        adam=warm,
        rebase=rebase,
    )
    residual = state.residual if state is not None and warm is not None else {}
    result.state = InnerState(adam=result.adam, residual=dict(residual), fingerprint=fingerprint)
    if result.delta:  # also a stopped unit's partial Δ, which the agent may salvage
        result.module_deltas = split_path_state(config, p, result.delta)
    return result
