"""The inner loop on a GPU (skipped without CUDA; bench/gpu_check.sh runs them): compiled,
fused AdamW, the fused loss, pinned checkpoint buffers, losses read back every few steps.

CUDA kernels are not bit-reproducible (atomic adds in the backward), so results are
compared with the CPU's and with each other within tolerances, not bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dipaco.inner import REPORT_EVERY_CUDA, InnerResult, PathTrainer, StepMetrics, run_inner_loop
from dipaco.inner.loss import LinearCrossEntropy
from dipaco.model import build_model
from dipaco.modular import init_modules
from tests.test_inner import CFG, SOURCE

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
SHORT = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 3})})


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def assert_close_units(a: InnerResult, b: InnerResult, rel: float) -> None:
    assert a.losses == pytest.approx(b.losses, rel=rel)
    for name, delta in b.delta.items():
        assert relative_error(a.delta[name], delta) < 10 * rel, name


class Crash(Exception):
    pass


def crash_at(step: int) -> Callable[[StepMetrics], None]:
    def on_step(metrics: StepMetrics) -> None:
        if metrics.step == step:
            raise Crash

    return on_step


def test_the_fused_loss_on_cuda_matches_cross_entropy_under_autocast() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3000, 64, generator=g).cuda().requires_grad_()  # (N, C)
    weight = torch.randn(1000, 64, generator=g).cuda().requires_grad_()  # (V, C)
    targets = torch.randint(1000, (3000,), generator=g).cuda()  # (N,)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        reference = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        fused = LinearCrossEntropy.apply(hidden, weight, targets, 1024, torch.bfloat16)
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    grads = torch.autograd.grad(fused, (hidden, weight))
    assert float(fused) == pytest.approx(float(reference), rel=1e-3)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.float32 and relative_error(grad, ref) < 2e-2


def test_a_compiled_cuda_loop_learns_as_the_cpu_loop_does(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = CFG.inner.model_copy(update={"steps": 20})
    cpu = run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32)
    seen: list[StepMetrics] = []
    with caplog.at_level(logging.WARNING, logger="dipaco.inner.engine"):
        cuda = run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32,
                              device="cuda", on_step=seen.append)  # fmt: skip
    assert not [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert cuda.losses[0] == pytest.approx(cpu.losses[0], rel=1e-2)
    assert sum(cuda.losses[-3:]) / 3 < sum(cuda.losses[:3]) / 3 - 1.0
    assert all(d.device.type == "cpu" and d.dtype == torch.float32 for d in cuda.delta.values())
    # Read back at step 1, then every REPORT_EVERY_CUDA steps, and at the last.
    reported = [m.reported_step for m in seen]
    assert reported[:REPORT_EVERY_CUDA] == [1] * REPORT_EVERY_CUDA and reported[-1] == 20
    assert len(cuda.losses) == len(cuda.grad_norms) == 20


def test_a_resident_cuda_trainer_gives_what_fresh_builds_give(tmp_path: Path) -> None:
    modules = init_modules(SHORT)
    trainer = PathTrainer(SHORT, "cuda", compile=False)
    optimizer = trainer.engine.optimizer
    assert all(group["fused"] for group in optimizer.param_groups)
    first = trainer.train_path(SHORT, 0, modules, SOURCE, checkpoint_path=tmp_path / "a",
                               checkpoint_every=1)  # fmt: skip
    other = trainer.train_path(SHORT, 3, modules, SOURCE, round_index=1)
    warm = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1, state=first.state)
    assert all(b.is_pinned() for b in trainer.engine.writer._buffers.values())
    assert first.checkpoints == 3 and first.checkpoint_block_s > 0
    fresh = PathTrainer(SHORT, "cuda", compile=False)
    assert_close_units(other, fresh.train_path(SHORT, 3, modules, SOURCE, round_index=1), 1e-3)
    fresh_first = PathTrainer(SHORT, "cuda", compile=False).train_path(SHORT, 0, modules, SOURCE)
    fresh_warm = PathTrainer(SHORT, "cuda", compile=False).train_path(
        SHORT, 0, modules, SOURCE, round_index=1, state=fresh_first.state
    )
    assert_close_units(warm, fresh_warm, 1e-3)
    assert warm.state is not None
    assert all(float(v) == 6.0 for k, v in warm.state.adam.items() if k.endswith("/step"))


def test_a_cuda_loop_resumed_from_its_checkpoint_matches_an_uninterrupted_one(
    tmp_path: Path,
) -> None:
    cfg = CFG.inner.model_copy(update={"steps": 9})

    def run(**kwargs: Any) -> InnerResult:
        model = build_model(CFG.model, 0)
        return run_inner_loop(
            model, SOURCE, cfg, seq_len=32, device="cuda", compile=False, **kwargs
        )

    uninterrupted = run()
    ckpt = tmp_path / "unit.safetensors"
    with pytest.raises(Crash):
        run(checkpoint_path=ckpt, checkpoint_interval_s=1e-9, on_step=crash_at(5))
    steps: list[int] = []
    resumed = run(checkpoint_path=ckpt, on_step=lambda m: steps.append(m.step))
    assert steps[0] == 5
    assert_close_units(resumed, uninterrupted, 1e-3)


def test_the_loss_compiled_with_the_model_trains_as_the_eager_cuda_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """CUDA's default: body, head and cross-entropy in one compiled graph (WholeLoss), a
    bf16 residual stream under autocast; against the eager chunked loss."""
    modules = init_modules(SHORT)
    eager = PathTrainer(SHORT, "cuda", compile=False).train_path(SHORT, 0, modules, SOURCE)
    trainer = PathTrainer(SHORT, "cuda")
    assert trainer.engine.precision in ("bf16", "fp16") and trainer.engine.forward.compiled
    with caplog.at_level(logging.WARNING, logger="dipaco.inner.engine"):
        compiled = trainer.train_path(SHORT, 0, modules, SOURCE)
    assert not [r for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert trainer.engine.forward.proven
    assert_close_units(compiled, eager, 2e-2)


def test_fp16_with_a_scaler_trains_on_cuda_as_bf16_does() -> None:
    modules = init_modules(SHORT)
    bf16 = PathTrainer(SHORT, "cuda", compile=False, precision="bf16")
    fp16 = PathTrainer(SHORT, "cuda", compile=False, precision="fp16")
    assert bf16.engine.scaler is None and fp16.engine.scaler is not None
    a = bf16.train_path(SHORT, 0, modules, SOURCE)
    b = fp16.train_path(SHORT, 0, modules, SOURCE)
    assert_close_units(b, a, 2e-2)


def test_a_same_path_unit_on_cuda_keeps_its_moments_resident_and_its_delta_from_the_snapshot(
    tmp_path: Path,
) -> None:
    modules = init_modules(SHORT)
    trainer = PathTrainer(SHORT, "cuda", compile=False)
    first = trainer.train_path(SHORT, 0, modules, SOURCE, checkpoint_path=tmp_path / "a",
                               checkpoint_every=1, finish_write=False)  # fmt: skip
    first.checkpoint_written()
    assert all(d.device.type == "cpu" and d.dtype == torch.float32 for d in first.delta.values())
    warm = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1, state=first.state)
    fresh = PathTrainer(SHORT, "cuda", compile=False).train_path(
        SHORT, 0, modules, SOURCE, round_index=1, state=first.state
    )
    assert_close_units(warm, fresh, 1e-3)
