"""The inner loop: H AdamW steps on one path, returning the pseudo-gradient Δ = θ_old − θ_new.

Linear warm-up then cosine decay, global-norm clipping, gradient accumulation to a fixed
batch of micro_batch_size x grad_accum_steps sequences, bf16 autocast on CUDA only over
fp32 master weights and AdamW moments. On CUDA it is also compiled (`torch.compile`, with
a fallback to eager that says why), uses fused AdamW, feeds the token windows through
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
    new = cpu_params(model)
    by_param = {n: theta_old[n] - new[n] for n in new}
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
) -> InnerResult:
    """run_inner_loop on an engine whose model holds θ_old (`theta_old`: its fp32 copy on
    the CPU, by parameter name, never changed in place by the caller while this runs)."""
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
    model, optimizer, device, writer = engine.model, engine.optimizer, engine.device, engine.writer
    cuda = device.type == "cuda"
    every = report_every or (REPORT_EVERY_CUDA if cuda else 1)
    configure_optimizer(optimizer, cfg)
    total = cfg.steps if total_steps is None else total_steps
    identity = checkpoint_identity(
        cfg, seq_len=seq_len, start_position=start_position, first_step=first_step, total=total
    )
    path = Path(checkpoint_path) if checkpoint_path is not None else None
    writer.begin(path)
    progress = Progress(position=start_position)
    if path is not None and resume and path.exists():
        load_adam_by_name(model, optimizer, {})  # the checkpoint's state replaces all of it
        progress = load_checkpoint(path, model, optimizer, theta_old, identity)
    else:
        load_adam_by_name(model, optimizer, adam or {})

    pending: list[tuple[int, Tensor, Tensor]] = []  # (step, loss sum, grad norm) not read yet

    def read_back() -> None:
        """Move the pending steps' loss and gradient norm to the host (one sync)."""
        if not pending:
            return
        values = torch.stack([torch.stack((s, g.float())) for _, s, g in pending]).tolist()
        for (step, _, _), (loss_sum, grad_norm) in zip(pending, values, strict=True):
            loss = loss_sum / cfg.grad_accum_steps
            if not math.isfinite(loss):
                raise FloatingPointError(
                    f"loss is {loss} at step {step}; lower inner.lr or check the token source"
                )
            progress.losses.append(loss)
            progress.grad_norms.append(grad_norm)
        pending.clear()

    def save() -> None:
        if path is not None:
            writer.save(model, optimizer, theta_old, progress, identity)

    finished = False
    try:
        result = _steps(
            engine, source, cfg, seq_len, theta_old, progress, pending, read_back, save,
            first_step=first_step, total=total, stop=stop, every=every,
            checkpointing=path is not None, checkpoint_every=checkpoint_every,
            checkpoint_interval_s=checkpoint_interval_s,
            on_step=on_step, should_stop=should_stop, rebase=rebase,
        )  # fmt: skip
        finished = True
    finally:
        if not finished:  # the last checkpoint taken is whole on disk, even after a crash
            _wait_quietly(writer)
    writer.wait()
    result.checkpoints, result.checkpoint_block_s = writer.count, writer.block_s
    result.checkpoint_write_s = writer.write_s
    return result


def _steps(
    engine: Engine,
    source: TokenSource,
    cfg: InnerConfig,
    seq_len: int,
    theta_old: dict[str, Tensor],
    progress: Progress,
    pending: list[tuple[int, Tensor, Tensor]],
    read_back: Callable[[], None],
    save: Callable[[], None],
    *,
    first_step: int,
    total: int,
    stop: int,
    every: int,
    checkpointing: bool,
    checkpoint_every: int | None,
    checkpoint_interval_s: float | None,
    on_step: Callable[[StepMetrics], None] | None,
    should_stop: Callable[[], bool] | None,
    rebase: Callable[[int], Mapping[str, Tensor] | None] | None,
) -> InnerResult:
    model, optimizer, device, forward = (
        engine.model,
        engine.optimizer,
        engine.device,
        engine.forward,
    )
    writer = engine.writer
    cuda = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)
    params = [p for p in model.parameters() if p.requires_grad]
    vocab = int(cast(Any, model).get_input_embeddings().weight.shape[0])
    batch, accum = cfg.micro_batch_size, cfg.grad_accum_steps
    last_checkpoint = time.monotonic()

    def micro_step(inputs: Tensor, targets: Tensor) -> Tensor:
        with autocast:
            loss = engine.loss(forward.body, inputs, targets)  # fp32 ()
        (loss / accum).backward()
        return loss.detach()

    while progress.step < stop:
        if should_stop is not None and should_stop():
            read_back()
            save()
            # The partial Δ of the steps done so far (the worker agent salvages it), made
            # while the checkpoint is written.
            partial = delta_of(model, theta_old) if progress.step else {}
            adam_state = adam_by_name(model, optimizer)
            writer.finish()
            return _result(progress, partial, completed=False, adam=adam_state)
        started = time.perf_counter()
        lr = lr_at(cfg, first_step + progress.step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=device)
        for _ in range(accum):
            window = source.batch(progress.position, batch, seq_len)
            _check_window(window, batch, seq_len, vocab)
            window = engine.feed(window)
            progress.position += batch
            inputs, targets = window[:, :-1], window[:, 1:]  # (B, T), (B, T)
            if forward.compiled is not None and not forward.proven:
                try:
                    loss = micro_step(inputs, targets)
                    forward.proven = True
                except torch.OutOfMemoryError:
                    raise  # the agent's fallback halves the micro-batch
                except Exception as error:  # the first compiled call: compile errors land here
                    optimizer.zero_grad(set_to_none=True)  # the first micro-batch: no others
                    forward.fallback(error)
                    loss = micro_step(inputs, targets)
            else:
                loss = micro_step(inputs, targets)
            loss_sum += loss
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        optimizer.step()
        progress.step += 1
        progress.tokens += accum * batch * seq_len
        progress.lrs.append(lr)
        pending.append((progress.step, loss_sum, grad_norm))
        periodic = checkpoint_every is not None and progress.step % checkpoint_every == 0
        timed = (
            checkpoint_interval_s is not None
            and time.monotonic() - last_checkpoint >= checkpoint_interval_s
        )
        due = checkpointing and (periodic or timed) and progress.step < stop
        last = progress.step == stop
        if due or last or len(pending) >= every or not progress.losses:
            read_back()  # inside the step's time: the device's work is training time
            if (due or last) and cuda:
                torch.cuda.synchronize(device)
        progress.seconds += time.perf_counter() - started
        # After the timing: an eager unit may wait here for the newer version (the agent's
        # worker_agent.rebase), which is not training time, nor its speed.
        shift = rebase(progress.step) if rebase is not None else None
        if shift:
            if not progress.start_digest:
                progress.start_digest = weights_digest(theta_old)
            _rebase(model, theta_old, shift)
        if on_step is not None:
            on_step(
                StepMetrics(
                    step=progress.step,
                    loss=progress.losses[-1],
                    lr=lr,
                    grad_norm=progress.grad_norms[-1],
                    tokens=progress.tokens,
                    seconds=progress.seconds,
                    reported_step=len(progress.losses),
                    checkpointed_step=writer.done_step,
                )
            )
        if due:
            save()
            last_checkpoint = time.monotonic()
    read_back()
    save()  # a crash between here and the upload loses nothing: a rerun returns at once
    delta, adam_state = delta_of(model, theta_old), adam_by_name(model, optimizer)
    writer.finish()  # while the write ran, Δ and the moments came to the host
    return _result(progress, delta, completed=True, adam=adam_state)


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
