"""The inner loop: it learns, it resumes bit for bit, and its first losses do not drift.

The stored-loss file tests/data/inner_losses.json is regenerated (after a deliberate change
to the model, the schedule or the data below) with:
    DIPACO_REGEN_LOSSES=1 .venv/bin/pytest tests/test_inner.py -k stored
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from dipaco.config import InnerConfig, LayoutConfig, RunConfig
from dipaco.inner import (
    CheckpointMismatch,
    InMemoryTokenSource,
    InnerResult,
    InnerState,
    StepMetrics,
    lr_at,
    run_inner_loop,
    train_path,
)
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, init_modules, modules_of_path

LOSSES_FILE = Path(__file__).parent / "data" / "inner_losses.json"
CFG = RunConfig.tiny(
    model={
        "hidden_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 256,
        "seq_len": 32,
    },
    layout=LayoutConfig.grid(2, levels=2, modules=2, path_specific=("embeddings",)),
    inner={"steps": 20, "warmup_steps": 2, "micro_batch_size": 4, "grad_accum_steps": 2},
)


def learnable_tokens(n: int = 8192, seed: int = 0) -> torch.Tensor:
    """Documents of 64 tokens following x -> (5x + 3) mod 61 from a random start: learnable."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(61, (n // 64 + 1,), generator=g).tolist()
    tokens, x = [], 0
    for i in range(n):
        x = starts[i // 64] if i % 64 == 0 else (5 * x + 3) % 61
        tokens.append(x + 10)
    return torch.tensor(tokens, dtype=torch.int64)


SOURCE = InMemoryTokenSource(learnable_tokens())


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; two threads on a busy machine spin and stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(cfg: InnerConfig = CFG.inner, seed: int = 0, **kwargs: Any) -> InnerResult:
    model = build_model(CFG.model, seed)
    return run_inner_loop(model, SOURCE, cfg, seq_len=CFG.model.seq_len, **kwargs)


def test_a_20_step_cpu_inner_loop_lowers_the_loss() -> None:
    result = run()
    assert result.completed and len(result.losses) == 20
    assert sum(result.losses[-3:]) / 3 < sum(result.losses[:3]) / 3 - 1.0
    assert result.tokens == 20 * 2 * 4 * 32
    assert result.position == 20 * 2 * 4
    assert result.tokens_per_second > 0


def test_delta_is_old_weights_minus_new_weights() -> None:
    model = build_model(CFG.model, 0)
    old = {n: t.clone() for n, t in model.state_dict().items()}
    result = run_inner_loop(model, SOURCE, CFG.inner, seq_len=CFG.model.seq_len)
    new = model.state_dict()
    assert set(result.delta) == set(old)
    for name, delta in result.delta.items():
        assert delta.dtype == torch.float32
        assert torch.equal(delta, old[name] - new[name])
    assert any(bool(d.abs().max() > 0) for d in result.delta.values())


def test_gradient_accumulation_matches_one_larger_micro_batch() -> None:
    steps = {"steps": 3}
    accumulated = run(CFG.inner.model_copy(update=steps))
    whole = run(
        CFG.inner.model_copy(update={**steps, "micro_batch_size": 8, "grad_accum_steps": 1})
    )
    assert accumulated.losses == pytest.approx(whole.losses, rel=1e-5)


class Crash(Exception):
    pass


def crash_after(step: int) -> Callable[[StepMetrics], None]:
    def on_step(metrics: StepMetrics) -> None:
        if metrics.step == step:
            raise Crash

    return on_step


@pytest.mark.parametrize("interruption", ["stop", "crash"])
def test_a_resumed_loop_ends_bit_identical_to_an_uninterrupted_one(
    tmp_path: Path, interruption: str
) -> None:
    cfg = CFG.inner.model_copy(update={"steps": 9})
    uninterrupted = run(cfg)
    ckpt = tmp_path / "unit.safetensors"
    if interruption == "stop":
        calls = iter(range(100))
        first = run(cfg, checkpoint_path=ckpt, should_stop=lambda: next(calls) == 4)
        assert not first.completed and first.losses == uninterrupted.losses[:4]
    else:
        with pytest.raises(Crash):
            run(cfg, checkpoint_path=ckpt, checkpoint_every=2, on_step=crash_after(5))
    steps_after_resume: list[int] = []
    resumed = run(cfg, checkpoint_path=ckpt, on_step=lambda m: steps_after_resume.append(m.step))
    assert steps_after_resume[0] == 5  # both resume after step 4
    assert resumed.losses == uninterrupted.losses
    assert resumed.position == uninterrupted.position
    for name, delta in uninterrupted.delta.items():
        assert torch.equal(resumed.delta[name], delta), name


def test_a_unit_sized_to_fewer_steps_trains_the_first_steps_of_its_slot_and_resumes_longer(
    tmp_path: Path,
) -> None:
    """A unit sized to k < H steps (`stop_at`, the loop's bound: the lease's `steps`)
    trains the first k steps of its H-step slot, each at the learning rate it has there,
    bit for bit what a loop stopped after k steps trains, but completed. Its checkpoint
    resumes under a longer bound (an expired unit given back with more steps) as one
    uninterrupted loop: the bound is not part of the checkpoint's identity."""
    cfg = CFG.inner.model_copy(update={"steps": 9})
    uninterrupted = run(cfg)
    calls = iter(range(100))
    stopped = run(cfg, should_stop=lambda: next(calls) == 4)
    ckpt = tmp_path / "unit.safetensors"
    sized = run(cfg, stop_at=4, checkpoint_path=ckpt)
    assert sized.completed and not stopped.completed
    assert sized.losses == stopped.losses == uninterrupted.losses[:4]
    assert sized.lrs == uninterrupted.lrs[:4] and sized.tokens == stopped.tokens
    for name, delta in stopped.delta.items():
        assert torch.equal(sized.delta[name], delta), name
    steps_after_resume: list[int] = []
    longer = run(cfg, stop_at=7, checkpoint_path=ckpt,
                 on_step=lambda m: steps_after_resume.append(m.step))  # fmt: skip
    assert steps_after_resume == [5, 6, 7] and longer.completed
    assert longer.losses == uninterrupted.losses[:7]
    whole = run(cfg, checkpoint_path=ckpt)  # None: H
    assert whole.losses == uninterrupted.losses and whole.position == uninterrupted.position
    for name, delta in uninterrupted.delta.items():
        assert torch.equal(whole.delta[name], delta), name


@pytest.mark.parametrize("stop_at", [0, 10])
def test_it_refuses_a_bound_outside_the_units_slot(stop_at: int) -> None:
    with pytest.raises(ValueError, match=f"stop_at = {stop_at}: must be 1 .. inner.steps = 9"):
        run(CFG.inner.model_copy(update={"steps": 9}), stop_at=stop_at)


def test_a_finished_checkpoint_returns_the_same_delta_without_training(tmp_path: Path) -> None:
    ckpt = tmp_path / "unit.safetensors"
    cfg = CFG.inner.model_copy(update={"steps": 3})
    first = run(cfg, checkpoint_path=ckpt)
    steps: list[int] = []
    again = run(cfg, checkpoint_path=ckpt, on_step=lambda m: steps.append(m.step))
    assert steps == [] and again.losses == first.losses
    assert all(torch.equal(again.delta[n], first.delta[n]) for n in first.delta)


def test_the_checkpoint_is_safetensors_with_a_json_header(tmp_path: Path) -> None:
    ckpt = tmp_path / "unit.safetensors"
    run(CFG.inner.model_copy(update={"steps": 2}), checkpoint_path=ckpt)
    with safe_open(str(ckpt), framework="pt") as handle:
        meta = json.loads(handle.metadata()["dipaco"])
        keys = set(handle.keys())
    assert meta["format"] == "dipaco-inner-checkpoint/1" and meta["progress"]["step"] == 2
    assert "rng/cpu" in keys and any(k.startswith("adam/") for k in keys)
    assert [p.name for p in tmp_path.iterdir()] == ["unit.safetensors"]  # no temp file left


def test_it_refuses_a_checkpoint_of_other_work(tmp_path: Path) -> None:
    ckpt = tmp_path / "unit.safetensors"
    cfg = CFG.inner.model_copy(update={"steps": 2})
    run(cfg, checkpoint_path=ckpt)
    with pytest.raises(CheckpointMismatch, match="other weights"):
        run(cfg, seed=1, checkpoint_path=ckpt)
    with pytest.raises(CheckpointMismatch, match="other settings"):
        run(cfg.model_copy(update={"lr": 1e-3}), checkpoint_path=ckpt)
    assert run(cfg, seed=1, checkpoint_path=ckpt, resume=False).completed


def test_the_schedule_warms_up_linearly_then_decays_to_the_floor() -> None:
    cfg = InnerConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, steps=10)
    lrs = [lr_at(cfg, s, 10) for s in range(10)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(lrs[3:]))
    assert lrs[-1] == pytest.approx(0.1)
    assert lr_at(cfg, 105, 200) < lr_at(cfg, 5, 200)  # a later round continues the schedule


def test_it_refuses_token_ids_outside_the_vocabulary() -> None:
    bad = InMemoryTokenSource(torch.full((1000,), CFG.model.vocab_size, dtype=torch.int64))
    model = build_model(CFG.model, 0)
    with pytest.raises(ValueError, match=r"model\.vocab_size"):
        run_inner_loop(model, bad, CFG.inner, seq_len=CFG.model.seq_len)


def test_a_work_unit_trains_its_path_and_splits_the_delta_by_module() -> None:
    modules = init_modules(CFG)
    cfg = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 2})})
    result = train_path(cfg, 3, modules, SOURCE, round_index=1)
    assert list(result.module_deltas) == modules_of_path(CFG, 3)
    assert modules_of_path(CFG, 3) == ["0.1", "1.1", "shared", "path.3"]
    model = build_model(CFG.model, 7)
    model.load_state_dict(assemble_path_state(CFG, 3, modules))
    direct = run_inner_loop(
        model, SOURCE, cfg.inner, seq_len=32, first_step=2, total_steps=2 * cfg.rounds
    )
    for module_id, delta in result.module_deltas.items():
        for name, tensor in delta.items():
            assert torch.equal(tensor, direct.delta[name]), (module_id, name)


def test_the_first_losses_of_a_fixed_seed_match_the_stored_ones() -> None:
    losses = run(CFG.inner.model_copy(update={"steps": 5})).losses
    if os.environ.get("DIPACO_REGEN_LOSSES"):
        LOSSES_FILE.parent.mkdir(parents=True, exist_ok=True)
        record = {"config": CFG.model_dump(mode="json"), "losses": losses}
        LOSSES_FILE.write_text(json.dumps(record, indent=1) + "\n")
    stored = json.loads(LOSSES_FILE.read_text())
    assert stored["config"] == CFG.model_dump(mode="json"), "config changed: regenerate"
    assert losses == pytest.approx(stored["losses"], rel=1e-5, abs=0)


def test_a_warm_unit_continues_the_adamw_moments_of_the_previous_one() -> None:
    cfg = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 3})})
    modules = init_modules(CFG)
    first = train_path(cfg, 0, modules, SOURCE)
    assert first.state is not None and first.state.adam
    steps = {k: v for k, v in first.state.adam.items() if k.endswith("/step")}
    assert steps and all(float(v) == 3.0 for v in steps.values())
    warm = train_path(cfg, 0, modules, SOURCE, round_index=1, state=first.state)
    cold = train_path(cfg, 0, modules, SOURCE, round_index=1)
    assert warm.state is not None
    assert all(float(v) == 6.0 for k, v in warm.state.adam.items() if k.endswith("/step"))
    # Same weights, data and lr: only the moments differ, so the deltas must too.
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(warm.delta[name], cold.delta[name])


def test_inner_state_round_trips_bit_identically_through_a_file(tmp_path: Path) -> None:
    cfg = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 2})})
    modules = init_modules(CFG)
    first = train_path(cfg, 1, modules, SOURCE)
    assert first.state is not None
    first.state.residual["0.1/w"] = torch.randn(3, 5)
    first.state.save(tmp_path / "state.safetensors")
    loaded = InnerState.load(tmp_path / "state.safetensors", first.state.fingerprint)
    assert loaded is not None and loaded.fingerprint == first.state.fingerprint
    assert loaded.state_dict().keys() == first.state.state_dict().keys()
    for key, tensor in first.state.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    # The next unit from the file is bit-identical to the next unit from memory.
    from_memory = train_path(cfg, 1, modules, SOURCE, round_index=1, state=first.state)
    from_file = train_path(cfg, 1, modules, SOURCE, round_index=1, state=loaded)
    for name, tensor in from_memory.delta.items():
        assert torch.equal(from_file.delta[name], tensor), name
    assert InnerState.load(tmp_path / "state.safetensors", "another model") is None
    (tmp_path / "torn.safetensors").write_bytes(b"\x10\x00")
    assert InnerState.load(tmp_path / "torn.safetensors") is None


def test_moments_of_another_model_are_ignored_not_misapplied() -> None:
    cfg = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 2})})
    modules = init_modules(CFG)
    first = train_path(cfg, 0, modules, SOURCE)
    assert first.state is not None
    foreign = InnerState(adam=first.state.adam, fingerprint="another model")
    warm = train_path(cfg, 0, modules, SOURCE, state=foreign)
    cold = train_path(cfg, 0, modules, SOURCE)
    for name, tensor in cold.delta.items():
        assert torch.equal(warm.delta[name], tensor), name


def test_a_stopped_loop_returns_the_partial_delta_of_its_steps_and_resumes_it(
    tmp_path: Path,
) -> None:
    """Salvage (worker_agent): a unit stopped after k steps hands back θ_old − θ_k, and a
    unit stopped at 3, resumed and stopped at 6 hands back what one stopped at 6 does."""
    cfg = CFG.inner.model_copy(update={"steps": 9})

    def stop_at(k: int) -> Callable[[], bool]:
        calls = iter(range(100))
        return lambda: next(calls) == k

    nothing = run(cfg, should_stop=lambda: True)
    assert not nothing.completed and nothing.delta == {} and nothing.tokens == 0
    straight = run(cfg, should_stop=stop_at(6))
    assert not straight.completed and straight.tokens == 6 * cfg.batch_size * CFG.model.seq_len
    assert any(float(d.abs().sum()) > 0 for d in straight.delta.values())
    ckpt = tmp_path / "unit.safetensors"
    run(cfg, checkpoint_path=ckpt, should_stop=stop_at(3))
    resumed = run(cfg, checkpoint_path=ckpt, should_stop=stop_at(3))
    assert resumed.losses == straight.losses and resumed.tokens == straight.tokens
    for name, delta in straight.delta.items():
        assert torch.equal(resumed.delta[name], delta), name
