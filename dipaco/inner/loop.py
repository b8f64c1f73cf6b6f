"""The inner loop: H AdamW steps on one path, returning the pseudo-gradient Δ = θ_old − θ_new.

Linear warm-up then cosine decay, global-norm clipping, gradient accumulation to a fixed
batch of micro_batch_size x grad_accum_steps sequences, fp32 master weights and AdamW
moments; on CUDA the forward and backward run under bf16 autocast (fp16 with a gradient
scaler on a card without bf16: dipaco.inner.fit.precision_for). On CUDA the model, its
head and the loss are also compiled together (`torch.compile`, with a fallback to eager
that says why: dipaco.inner.engine), it uses fused AdamW, feeds the token windows through
pinned buffers with non-blocking copies, and reads the loss and gradient norm back only
every `report_every` steps, so the host runs ahead of the device and no step waits for it.
On the CPU (no compile, the plain AdamW) every step is read back and a resumed loop
continues bit for bit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from dipaco.config import InnerConfig
from dipaco.inner.checkpoint import (
    CheckpointWriter,
    Progress,
    checkpoint_identity,
    load_checkpoint,
    weights_digest,
)
from dipaco.inner.engine import (
    Engine,
    adam_by_name,
    configure_optimizer,
    cpu_params,
    load_adam_by_name,
)
from dipaco.inner.state import (
    InnerResult,
    StepMetrics,
    TokenSource,
    lr_at,
)

log = logging.getLogger(__name__)

# Steps between read-backs of the loss and gradient norm on CUDA: each read waits for the
# device to drain its queue, so one every 10 steps costs about a tenth of one step's
# launch gap, while progress and the non-finite check stay within 10 steps of the truth.
REPORT_EVERY_CUDA = 10


def delta_of(model: nn.Module, theta_old: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """θ_old − θ_new for every state-dict name; a tied tensor appears under both names."""
    return delta_from(model, cpu_params(model), theta_old)


def delta_from(
    model: nn.Module, weights: Mapping[str, Tensor], theta_old: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """θ_old − `weights` (fp32 on the CPU, by parameter name) for every state-dict name."""
    by_param = {n: theta_old[n] - weights[n] for n, _ in model.named_parameters()}
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    return {key: by_param[names[t.data_ptr()]] for key, t in model.state_dict().items()}


def _rebase(model: nn.Module, theta_old: dict[str, Tensor], shift: Mapping[str, Tensor]) -> None:
    """Move the live weights and θ_old by `shift` (names without a shift stay). θ_old's
    tensors are replaced, never changed in place: a checkpoint being written reads them."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in shift:
                param.add_(shift[name].to(param.device, param.dtype))
                theta_old[name] = theta_old[name] + shift[name].to(torch.float32)


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
    stop_at: int | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    checkpoint_interval_s: float | None = None,
    resume: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    adam: Mapping[str, Tensor] | None = None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None = None,
    compile: bool | None = None,
    report_every: int | None = None,
) -> InnerResult:
    """Train `model` (a Hugging Face causal LM whose weights are θ_old) for cfg.steps steps,
    or the first `stop_at` of them.

    `adam` (``<parameter name>/<key>`` tensors, as InnerResult.adam returns them) starts
    the optimiser warm instead of fresh; a checkpoint being resumed takes precedence.

    The schedule runs over global steps first_step .. first_step + cfg.steps - 1 of a
    `total_steps`-long schedule (default: this loop alone); DiLoCo's run-long schedule is
    first_step = t·H, total_steps = T·H. `stop_at` (1 .. cfg.steps; None: cfg.steps) is
    the loop's bound, counted from the unit's start (a resumed checkpoint's steps
    included): a work unit sized to fewer steps than H trains the first `stop_at` steps
    of its H-step slot, each at the learning rate it has there, and returns completed.

    With checkpoint_path, a checkpoint is taken every `checkpoint_every` steps and every
    `checkpoint_interval_s` seconds (either, both or neither), when should_stop() turns
    true, and at the end; the loop stands still only for the snapshot to host memory and
    a background thread writes the file (dipaco.inner.checkpoint). When this returns, and
    when it raises, the last checkpoint taken is whole on disk. A run that finds one resumes
    from it (resume=True) or raises CheckpointMismatch if it belongs to other work.

    `should_stop()` is asked before every step (host-side, no device sync). `on_step` is
    called after every step; its loss and grad_norm are those of the last step read back
    from the device (`report_every`: None reads every step on the CPU, where it is free,
    and every REPORT_EVERY_CUDA steps on CUDA). A non-finite loss raises
    FloatingPointError at the read-back that sees it. `compile`: torch.compile the decoder
    body (None: on CUDA only).

    `rebase(step)`, after each step, may return a shift (state-dict name -> tensor): a newer
    base version landed (θ_new_base − θ_old, outer.overlap's eager correction). It is added
    to the live weights and to θ_old, so training goes on from the newer version and the
    Δ is relative to it. A checkpoint written after it holds the moved θ_old (it is not
    asked again on resume, the step being past) and is checked against the weights the
    unit started from by their sha256.
    """
    device = torch.device(device)
    use_compile = device.type == "cuda" if compile is None else compile
    engine = Engine.build(model, cfg, device, use_compile)
    return train_steps(
        engine, source, cfg, seq_len=seq_len, theta_old=cpu_params(model),
        start_position=start_position, first_step=first_step, total_steps=total_steps,
        stop_at=stop_at, checkpoint_path=checkpoint_path, checkpoint_every=checkpoint_every,
        checkpoint_interval_s=checkpoint_interval_s, resume=resume, on_step=on_step,
        should_stop=should_stop, adam=adam, rebase=rebase, report_every=report_every,
    )  # fmt: skip


def train_steps(
    engine: Engine,
    source: TokenSource,
    cfg: InnerConfig,
    *,
    seq_len: int,
    theta_old: dict[str, Tensor],
    start_position: int = 0,
    first_step: int = 0,
    total_steps: int | None = None,
    stop_at: int | None = None,
    checkpoint_path: str | Path | None = None,
    checkpoint_every: int | None = None,
    checkpoint_interval_s: float | None = None,
    resume: bool = True,
    on_step: Callable[[StepMetrics], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    adam: Mapping[str, Tensor] | None = None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None = None,
    report_every: int | None = None,
    keep_moments: bool = False,
    finish_write: bool = True,
) -> InnerResult:
    """run_inner_loop on an engine whose model holds θ_old (`theta_old`: its fp32 copy on
    the CPU, by parameter name, never changed in place by the caller while this runs).

    `keep_moments`: the optimizer already holds the moments to start from (a resident
    trainer's, left by the path's previous unit), so `adam` is not loaded. `finish_write`
    False returns while the last checkpoint is still being written (the Δ, from its
    snapshot, is ready): the engine's writer joins it before its next write, and
    `InnerResult.checkpoint_written` waits for it."""
    _check_settings(cfg, stop_at, checkpoint_every, checkpoint_interval_s, report_every)
    every = report_every or (REPORT_EVERY_CUDA if engine.device.type == "cuda" else 1)
    configure_optimizer(engine.optimizer, cfg)
    total = cfg.steps if total_steps is None else total_steps
    identity = checkpoint_identity(
        cfg, seq_len=seq_len, start_position=start_position, first_step=first_step, total=total
    )
    path = Path(checkpoint_path) if checkpoint_path is not None else None
    engine.writer.begin(path)
    progress = Progress(position=start_position)
    model, optimizer = engine.model, engine.optimizer
    if path is not None and resume and path.exists():
        load_adam_by_name(model, optimizer, {})  # the checkpoint's state replaces all of it
        progress = load_checkpoint(path, model, optimizer, theta_old, identity)
    elif not keep_moments:
        load_adam_by_name(model, optimizer, adam or {})
    loop = _Loop(
        engine, source, cfg, seq_len=seq_len, theta_old=theta_old, progress=progress,
        identity=identity, schedule=_Schedule(path, checkpoint_every, checkpoint_interval_s),
        first_step=first_step, total=total, stop=cfg.steps if stop_at is None else stop_at,
        every=every, on_step=on_step, should_stop=should_stop, rebase=rebase,
    )  # fmt: skip
    try:
        result = loop.run()
    except BaseException:
        _wait_quietly(engine.writer)  # the last checkpoint taken is whole on disk
        raise
    if finish_write:
        engine.writer.finish()
    result.checkpoints, result.checkpoint_block_s = engine.writer.count, engine.writer.block_s
    result.checkpoint_write_s = engine.writer.write_s
    result.checkpoint_written = engine.writer.in_flight()
    return result


def _check_settings(
    cfg: InnerConfig,
    stop_at: int | None,
    checkpoint_every: int | None,
    checkpoint_interval_s: float | None,
    report_every: int | None,
) -> None:
    if checkpoint_every is not None and checkpoint_every < 1:
        raise ValueError(f"checkpoint_every = {checkpoint_every}: must be >= 1 or None")
    if checkpoint_interval_s is not None and not checkpoint_interval_s > 0:
        raise ValueError(f"checkpoint_interval_s = {checkpoint_interval_s}: must be > 0 or None")
    if report_every is not None and report_every < 1:
        raise ValueError(f"report_every = {report_every}: must be >= 1 or None")
    stop = cfg.steps if stop_at is None else stop_at
    if not 1 <= stop <= cfg.steps:
        raise ValueError(
            f"stop_at = {stop_at}: must be 1 .. inner.steps = {cfg.steps} (the unit's slot "
            "of the lr schedule), or None"
        )


@dataclass
class _Schedule:
    """When a checkpoint is due: every `every` steps and/or `interval_s` seconds."""

    path: Path | None
    every: int | None
    interval_s: float | None
    last: float = field(default_factory=time.monotonic)

    def due(self, step: int, stop: int) -> bool:
        if self.path is None or step >= stop:
            return False  # the last step's checkpoint is the loop's end's
        periodic = self.every is not None and step % self.every == 0
        timed = self.interval_s is not None and time.monotonic() - self.last >= self.interval_s
        return periodic or timed


class _Loop:
    """One call's steps, and the state they share (progress, the losses not read back)."""

    def __init__(
        self,
        engine: Engine,
        source: TokenSource,
        cfg: InnerConfig,
        *,
        seq_len: int,
        theta_old: dict[str, Tensor],
        progress: Progress,
        identity: dict[str, Any],
        schedule: _Schedule,
        first_step: int,
        total: int,
        stop: int,
        every: int,
        on_step: Callable[[StepMetrics], None] | None,
        should_stop: Callable[[], bool] | None,
        rebase: Callable[[int], Mapping[str, Tensor] | None] | None,
    ) -> None:
        self.engine, self.source, self.cfg, self.seq_len = engine, source, cfg, seq_len
        self.theta_old, self.progress, self.identity = theta_old, progress, identity
        self.schedule, self.first_step, self.total, self.stop = schedule, first_step, total, stop
        self.every, self.on_step, self.should_stop, self.rebase = (
            every,
            on_step,
            should_stop,
            rebase,
        )
        self.params = [p for p in engine.model.parameters() if p.requires_grad]
        self.vocab = int(cast(Any, engine.model).get_input_embeddings().weight.shape[0])
        self.pending: list[tuple[int, Tensor, Tensor]] = []  # (step, loss sum, grad norm)

    def run(self) -> InnerResult:
        progress = self.progress
        while progress.step < self.stop:
            if self.should_stop is not None and self.should_stop():
                return self.end(completed=False)
            started = time.perf_counter()
            lr = self.step()
            due = self.schedule.due(progress.step, self.stop)
            last = progress.step == self.stop
            if due or last or len(self.pending) >= self.every or not progress.losses:
                self.read_back()  # inside the step's time: the device's work is training time
                if (due or last) and self.engine.device.type == "cuda":
                    torch.cuda.synchronize(self.engine.device)
            progress.seconds += time.perf_counter() - started
            self.after_step(lr)
            if due:
                self.save()
                self.schedule.last = time.monotonic()
        return self.end(completed=True)

    def step(self) -> float:
        """One optimizer step over the batch's micro-batches; returns its learning rate."""
        engine, cfg, progress = self.engine, self.cfg, self.progress
        optimizer, scaler = engine.optimizer, engine.scaler
        lr = lr_at(cfg, self.first_step + progress.step, self.total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=engine.device)
        for _ in range(cfg.grad_accum_steps):
            loss_sum += self.micro_batch()
        if scaler is not None:
            scaler.unscale_(optimizer)  # the clip and the norm see the true gradients
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip)
        engine.writer.before_update()  # a snapshot's copies of these weights are done
        if scaler is not None:
            scaler.step(optimizer)  # skipped when a gradient overflowed, and the scale halves
            scaler.update()
        else:
            optimizer.step()
        progress.step += 1
        progress.tokens += cfg.batch_size * self.seq_len
        progress.lrs.append(lr)
        self.pending.append((progress.step, loss_sum, grad_norm))
        return lr

    def micro_batch(self) -> Tensor:
        """The next micro-batch's forward and backward; returns its loss (fp32, detached)."""
        engine, batch, progress = self.engine, self.cfg.micro_batch_size, self.progress
        window = self.source.batch(progress.position, batch, self.seq_len)
        _check_window(window, batch, self.seq_len, self.vocab)
        window = engine.feed(window)
        progress.position += batch
        inputs, targets = window[:, :-1], window[:, 1:]  # (B, T), (B, T)
        forward = engine.forward
        if forward.compiled is None or forward.proven:
            return self.forward_backward(inputs, targets)
        try:  # the first compiled call: compile errors land here
            loss = self.forward_backward(inputs, targets)
            forward.proven = True
            return loss
        except torch.OutOfMemoryError:
            raise  # the resident trainer's fallback halves the micro-batch
        except Exception as error:
            engine.optimizer.zero_grad(set_to_none=True)  # the first micro-batch: no others
            forward.fallback(error)
            return self.forward_backward(inputs, targets)

    def forward_backward(self, inputs: Tensor, targets: Tensor) -> Tensor:
        engine = self.engine
        with engine.autocast():
            loss = engine.forward.loss(inputs, targets)  # fp32 ()
        scaled = loss / self.cfg.grad_accum_steps
        if engine.scaler is not None:
            scaled = engine.scaler.scale(scaled)
        scaled.backward()
        return loss.detach()

    def read_back(self) -> None:
        """Move the pending steps' loss and gradient norm to the host (one sync)."""
        if not self.pending:
            return
        pending, progress = self.pending, self.progress
        values = torch.stack([torch.stack((s, g.float())) for _, s, g in pending]).tolist()
        for (step, _, _), (loss_sum, grad_norm) in zip(pending, values, strict=True):
            loss = loss_sum / self.cfg.grad_accum_steps
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {step}; lower inner.lr or check the token source"
                )
            progress.losses.append(loss)
            progress.grad_norms.append(grad_norm)
        pending.clear()

    def after_step(self, lr: float) -> None:
        """Outside the step's time: the rebase (an eager unit may wait there for the newer
        version, worker_agent.rebase: neither training time nor its speed), then on_step."""
        progress = self.progress
        shift = self.rebase(progress.step) if self.rebase is not None else None
        if shift:
            if not progress.start_digest:
                progress.start_digest = weights_digest(self.theta_old)
            _rebase(self.engine.model, self.theta_old, shift)
        if self.on_step is not None:
            self.on_step(
                StepMetrics(
                    step=progress.step, loss=progress.losses[-1], lr=lr,
                    grad_norm=progress.grad_norms[-1], tokens=progress.tokens,
                    seconds=progress.seconds, reported_step=len(progress.losses),
                    checkpointed_step=self.engine.writer.done_step,
                )
            )  # fmt: skip

    def save(self) -> bool:
        """A checkpoint now, if the loop keeps them; whether one was taken."""
        if self.schedule.path is None:
            return False
        engine = self.engine
        engine.writer.save(engine.model, engine.optimizer, self.theta_old, self.progress,
                           self.identity)  # fmt: skip
        return True

    def end(self, *, completed: bool) -> InnerResult:
        """The last checkpoint (a crash between here and the upload loses nothing: a rerun
        returns at once) and the Δ of the steps done (a stopped unit's is salvaged), made
        from the checkpoint's snapshot in host memory while the file is written."""
        self.read_back()
        engine, started = self.engine, time.perf_counter()
        # The gradients (4 bytes a parameter) are not needed again until the next unit's
        # first backward: let them go before Δ (as many bytes again) is made.
        engine.optimizer.zero_grad(set_to_none=True)
        snapshot = self.save()
        snapshot_s = time.perf_counter() - started
        if not self.progress.step:
            delta: dict[str, Tensor] = {}
        elif snapshot:
            delta = delta_from(engine.model, engine.writer.snapshot_weights(), self.theta_old)
        else:
            delta = delta_of(engine.model, self.theta_old)
        if snapshot:
            adam = engine.writer.snapshot_adam(engine.model, engine.optimizer)
        else:
            adam = adam_by_name(engine.model, engine.optimizer)
        result = _result(self.progress, delta, completed=completed, adam=adam)
        result.timings = {
            "final_snapshot_s": snapshot_s,
            "delta_and_moments_s": time.perf_counter() - started - snapshot_s,
        }
        return result


def _wait_quietly(writer: CheckpointWriter) -> None:
    """Let the write in flight finish while another error is on its way up."""
    try:
        writer.wait()
    except Exception as error:
        log.error("the last checkpoint could not be written: %s", error)


def _check_window(window: Tensor, batch: int, seq_len: int, vocab: int) -> None:
    if tuple(window.shape) != (batch, seq_len + 1) or window.dtype != torch.int64:
        raise ValueError(
            f"token source gave {tuple(window.shape)} {window.dtype}; "
            f"expected ({batch}, {seq_len + 1}) int64"
        )
    if int(window.min()) < 0 or int(window.max()) >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}); check model.vocab_size")


def _result(
    progress: Progress,
    delta: dict[str, Tensor],
    *,
    completed: bool,
    adam: Mapping[str, Tensor] | None = None,
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
