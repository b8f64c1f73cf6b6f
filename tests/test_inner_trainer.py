"""The fast loop's parts on the CPU: the chunked loss, the resident trainer, the compile
fallback and the read-back of losses every few steps; each gives what the plain loop does."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dipaco.config import RunConfig
from dipaco.inner import (
    InnerResult,
    InnerState,
    PathTrainer,
    StepMetrics,
    run_inner_loop,
    train_path,
)
from dipaco.inner import engine as inner_engine
from dipaco.inner.loss import CausalLMLoss, LinearCrossEntropy, linear_cross_entropy
from dipaco.model import build_model
from dipaco.modular import init_modules
from tests.test_inner import CFG, SOURCE

SHORT = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 3})})


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def assert_same_unit(a: InnerResult, b: InnerResult) -> None:
    assert a.losses == b.losses and a.grad_norms == b.grad_norms and a.lrs == b.lrs
    assert a.delta.keys() == b.delta.keys()
    for name, tensor in a.delta.items():
        assert torch.equal(tensor, b.delta[name]), name
    assert a.adam.keys() == b.adam.keys()
    for key, tensor in a.adam.items():
        assert torch.equal(tensor, b.adam[key]), key


def test_the_chunked_loss_equals_cross_entropy_of_the_whole_fp32_logits() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(50, 16, generator=g, requires_grad=True)  # (N, C)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)  # (V, C)
    targets = torch.randint(40, (50,), generator=g)  # (N,)
    reference = F.cross_entropy(F.linear(hidden, weight).float(), targets)
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    one_chunk = linear_cross_entropy(hidden, weight, targets)
    assert torch.equal(one_chunk, reference)
    chunked = linear_cross_entropy(hidden, weight, targets, chunk=7)  # 8 chunks, the last of 1
    grads = torch.autograd.grad(chunked, (hidden, weight))
    torch.testing.assert_close(chunked, reference, rtol=1e-6, atol=0)
    for grad, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_loss_gives_the_loss_and_gradients_of_the_plain_one(dtype: torch.dtype) -> None:
    """LinearCrossEntropy (CUDA's loss) run on the CPU, in fp32 and in bf16 under autocast
    as on a GPU, against autograd's cross-entropy of the same logits."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(50, 16, generator=g, requires_grad=True)  # (N, C)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)  # (V, C)
    targets = torch.randint(40, (50,), generator=g)  # (N,)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        reference = F.cross_entropy(F.linear(hidden, weight).float(), targets)
        fused = LinearCrossEntropy.apply(hidden, weight, targets, 7, dtype)
    ref_grads = torch.autograd.grad(reference * 0.5, (hidden, weight))
    grads = torch.autograd.grad(fused * 0.5, (hidden, weight))
    tolerance = (
        {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-3}
    )
    torch.testing.assert_close(fused, reference, **tolerance)
    for grad, ref in zip(grads, ref_grads, strict=True):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, ref, **tolerance)


def test_the_fused_loss_trains_a_model_as_the_plain_one_does() -> None:
    model = build_model(CFG.model, 0)
    window = SOURCE.batch(0, 4, CFG.model.seq_len)  # (B, T+1)
    inputs, targets = window[:, :-1], window[:, 1:]
    results = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss = CausalLMLoss(model, torch.device("cpu"), chunk=24, fused=fused)(
            model.model, inputs, targets
        )
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (plain, plain_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, plain, rtol=1e-5, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_loops_loss_is_the_models_own_cross_entropy() -> None:
    model = build_model(CFG.model, 0)
    window = SOURCE.batch(0, 4, CFG.model.seq_len)  # (B, T+1)
    inputs, targets = window[:, :-1], window[:, 1:]
    logits = model(input_ids=inputs).logits  # (B, T, V)
    expected = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss = CausalLMLoss(model, torch.device("cpu"), chunk=24)(model.model, inputs, targets)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)


def test_a_resident_trainer_reused_across_paths_and_rounds_gives_what_fresh_builds_give(
    tmp_path: Path,
) -> None:
    """Cold path 0, then cold path 3 of another round (the moments must be reset, not
    kept), then path 0 warm from its first unit (moments copied into the resident ones)."""
    modules = init_modules(SHORT)
    trainer = PathTrainer(SHORT)
    units: list[dict[str, Any]] = [
        {"p": 0, "round_index": 0},
        {"p": 3, "round_index": 1, "start_position": 40},
        {"p": 0, "round_index": 1},
    ]
    resident, fresh = [], []
    for i, unit in enumerate(units):
        p, kwargs = unit["p"], {k: v for k, v in unit.items() if k != "p"}
        state = resident[0].state if i == 2 else None
        fresh_state = fresh[0].state if i == 2 else None
        ckpt = tmp_path / f"unit-{i}.safetensors"
        resident.append(trainer.train_path(SHORT, p, modules, SOURCE, state=state,
                                           checkpoint_path=ckpt, checkpoint_every=1, **kwargs))  # fmt: skip
        fresh.append(train_path(SHORT, p, modules, SOURCE, state=fresh_state, **kwargs))
    for a, b in zip(resident, fresh, strict=True):
        assert_same_unit(a, b)
        assert a.module_deltas.keys() == b.module_deltas.keys()
    assert resident[2].checkpoints == 3  # after steps 1 and 2, and at the end
    warm_steps = [float(v) for k, v in resident[2].adam.items() if k.endswith("/step")]
    assert warm_steps and all(s == 6.0 for s in warm_steps)  # 3 + 3: it continued path 0's
    cold_steps = [float(v) for k, v in resident[1].adam.items() if k.endswith("/step")]
    assert all(s == 3.0 for s in cold_steps)  # path 3 did not inherit path 0's moments


def test_a_resident_trainer_refuses_a_run_of_another_model() -> None:
    trainer = PathTrainer(SHORT)
    wider = RunConfig.tiny(model={**SHORT.model.model_dump(), "hidden_size": 128},
                           layout=SHORT.layout, inner=SHORT.inner.model_dump())  # fmt: skip
    assert trainer.matches(SHORT.model_copy(update={"seed": 5}))  # the seed is overwritten
    assert not trainer.matches(wider)
    with pytest.raises(ValueError, match="build a new PathTrainer"):
        trainer.train_path(wider, 0, init_modules(wider), SOURCE)


@pytest.mark.parametrize("where", ["torch.compile", "the first compiled call"])
def test_a_failing_compile_falls_back_to_eager_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, where: str
) -> None:
    cfg = SHORT.inner

    def broken_compile(body: Any, **_: Any) -> Any:
        if where == "torch.compile":
            raise RuntimeError("no compiler for this device")

        def compiled(*_: Any, **__: Any) -> Any:
            raise RuntimeError("inductor failed on this kernel")

        return compiled

    eager = run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32, compile=False)
    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(inner_engine, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="dipaco.inner.engine"):
        runs = [
            run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32, compile=True)
            for _ in range(2)
        ]
    for result in runs:
        assert_same_unit(result, eager)
    warnings = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(warnings) == 1
    assert ("no compiler" if where == "torch.compile" else "inductor failed") in warnings[0]
    assert "compile=False" in warnings[0]


def test_reading_losses_back_every_few_steps_changes_nothing_but_when_on_step_sees_them() -> None:
    cfg = CFG.inner.model_copy(update={"steps": 7})
    seen: dict[int, list[StepMetrics]] = {1: [], 3: []}
    results = {}
    for every, metrics in seen.items():
        model = build_model(CFG.model, 0)
        results[every] = run_inner_loop(model, SOURCE, cfg, seq_len=32, report_every=every,
                                        on_step=metrics.append)  # fmt: skip
    assert_same_unit(results[3], results[1])
    assert [m.reported_step for m in seen[1]] == [1, 2, 3, 4, 5, 6, 7]
    # The first step is read at once, then every third, and the last: never a step ahead.
    assert [m.reported_step for m in seen[3]] == [1, 1, 1, 4, 4, 4, 7]
    losses = results[1].losses
    assert [m.loss for m in seen[3]] == [losses[m.reported_step - 1] for m in seen[3]]
    assert [m.step for m in seen[3]] == [m.step for m in seen[1]]


def test_warm_moments_of_another_model_leave_the_resident_optimizer_fresh() -> None:
    modules = init_modules(SHORT)
    trainer = PathTrainer(SHORT)
    first = trainer.train_path(SHORT, 0, modules, SOURCE)
    assert first.state is not None
    foreign = InnerState(adam=first.state.adam, fingerprint="another model")
    again = trainer.train_path(SHORT, 0, modules, SOURCE, state=foreign)
    assert_same_unit(again, first)


@pytest.mark.parametrize("every", [1, 3])
def test_a_non_finite_loss_stops_the_loop_at_the_read_back_that_sees_it(every: int) -> None:
    """An lr far past InnerConfig's bound and no clipping blow the loss up at step 4; read
    back every third step it is found at step 4 too (steps 2-4 are read together)."""
    cfg = CFG.inner.model_copy(update={"steps": 9, "lr": 1e6, "grad_clip": 1e30})
    steps: list[int] = []
    with pytest.raises(FloatingPointError, match=r"loss is nan at step 4; lower inner\.lr"):
        run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32, report_every=every,
                       on_step=lambda m: steps.append(m.step))  # fmt: skip
    assert steps == [1, 2, 3]
