"""The agent's training of one unit: its data windows, warm inner state, out-of-memory fallback.

Tiny CPU models with fixed seeds; the library's inner loop does the training, these
tests check what the agent adds around it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dipaco import codecs
from dipaco.config import GiB, InnerConfig, RunConfig, estimate_path_memory
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource, unit_start
from dipaco.inner import (
    CHECKPOINT_NAME,
    DoesNotFit,
    InnerResult,
    InnerState,
    ResidentTrainer,
    StepMetrics,
    UnitHooks,
    UnitWork,
    fit_micro_batch,
    smaller_micro_batch,
    state_fingerprint,
    train_path,
)
from dipaco.inner.fit import path_memory
from dipaco.inner.trainer import Fault
from dipaco.modular import init_modules
from dipaco.tensorfile import FileTensors
from worker_agent.errors import OutOfMemory
from worker_agent.payload import encode_deltas
from worker_agent.state import InnerStates, LeaseRecord
from worker_agent.unit import unit_split

STEPS = 3
# Smaller than RunConfig.tiny's model, so a unit takes a fraction of a second on a busy CPU.
SMALL_MODEL = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 2, "intermediate_size": 64,
               "vocab_size": 256, "seq_len": 32}  # fmt: skip


def small(**inner: int) -> RunConfig:
    return RunConfig.tiny(model=SMALL_MODEL, inner=inner)


@pytest.fixture(scope="module")
def config() -> RunConfig:
    return small(steps=STEPS, micro_batch_size=4, grad_accum_steps=1)


def window_file(tmp_path: Path, config: RunConfig, seed: int = 0, windows: int = 0) -> Path:
    tokens = (windows or STEPS * config.inner.batch_size) * config.model.seq_len + 1
    rng = np.random.default_rng(seed)
    path = tmp_path / f"window-{seed}.bin"
    rng.integers(0, config.model.vocab_size, tokens, dtype=np.uint16).astype("<u2").tofile(path)
    return path


def unit(config: RunConfig, window: Path, round_index: int = 0, start: int = 0) -> UnitWork:
    source = ShardSource.for_path(TokenShard(window, "<u2"), config, 0)
    return UnitWork(config, 1, 0, round_index, init_modules(config), source, start)


def train_unit(
    work: UnitWork,
    *,
    device: torch.device,
    work_dir: Path,
    trainer: ResidentTrainer | None = None,
    fault: Fault | None = None,
    **options: Any,
) -> tuple[InnerResult, InnerConfig]:
    """One unit on `trainer` (None: a resident trainer built for it), as the agent trains it."""
    trainer = trainer or ResidentTrainer(device)
    return trainer.train(work, work_dir=work_dir, hooks=UnitHooks(fault=fault), **options)


def adam_steps(checkpoint: Path) -> float:
    with safe_open(str(checkpoint), framework="pt") as handle:
        return float(handle.get_tensor("adam/0/step"))


def test_a_unit_trains_on_the_windows_the_simulator_trains_unit_t_r_on(
    tmp_path: Path,
) -> None:
    config = small(steps=2, micro_batch_size=2, grad_accum_steps=1).model_copy(
        update={"replicas_per_path": 2}
    )
    shard = TokenShard(window_file(tmp_path, config, windows=20), "<u2")
    start = unit_start(config, 1, 1)  # round 1, replica 1: windows 12..15 of the order
    assert start == (1 * 2 + 1) * 2 * 2
    seen: list[torch.Tensor] = []

    class Recording(ShardSource):
        def batch(self, position: int, batch_size: int, seq_len: int) -> torch.Tensor:
            rows = super().batch(position, batch_size, seq_len)
            seen.append(rows)
            return rows

    source = Recording(shard, config.model.seq_len, seed=config.seed)
    work = UnitWork(config, 1, 0, 1, init_modules(config), source, start)
    agent, _ = train_unit(work, device=torch.device("cpu"), work_dir=tmp_path / "agent")
    read = torch.cat(seen)  # (H x B, T + 1)
    tokens = torch.from_numpy(shard.read_window(0, len(shard)))
    t = config.model.seq_len
    for row, w in zip(read, source.order[start : start + len(read)], strict=True):
        assert torch.equal(row, tokens[int(w) * t : int(w) * t + t + 1])
    simulator = train_path(config, 0, init_modules(config), ShardSource.for_path(shard, config, 0),
                           round_index=1, start_position=start)  # fmt: skip
    for name, delta in simulator.delta.items():
        assert torch.equal(agent.delta[name], delta), name


def test_a_unit_trains_and_returns_a_finite_delta_per_module(
    tmp_path: Path, config: RunConfig
) -> None:
    result, inner = train_unit(
        unit(config, window_file(tmp_path, config)), device=torch.device("cpu"),
        work_dir=tmp_path / "work",
    )  # fmt: skip
    assert result.completed and inner == config.inner
    assert sorted(result.module_deltas) == ["0.0", "1.0", "shared"]
    for tensors in result.module_deltas.values():
        assert all(torch.isfinite(t).all() for t in tensors.values())
    assert result.tokens == STEPS * config.inner.batch_size * config.model.seq_len


def test_the_same_path_coming_back_continues_its_adamw_state(
    tmp_path: Path, config: RunConfig
) -> None:
    states = InnerStates(tmp_path / "inner")
    cpu = torch.device("cpu")
    first, _ = train_unit(unit(config, window_file(tmp_path, config)), device=cpu,
                          work_dir=tmp_path / "a")  # fmt: skip
    assert first.completed and first.state is not None
    assert adam_steps(tmp_path / "a" / CHECKPOINT_NAME) == STEPS
    states.save(1, 0, first.state)
    assert states.path_for(1, 0).exists()

    second, _ = train_unit(unit(config, window_file(tmp_path, config, seed=1), round_index=1),
                           device=cpu, work_dir=tmp_path / "b",
                           state=states.load(1, 0, config))  # fmt: skip
    assert second.completed
    assert adam_steps(tmp_path / "b" / CHECKPOINT_NAME) == 2 * STEPS, "the moments carried over"

    cold, _ = train_unit(unit(config, window_file(tmp_path, config, seed=1), round_index=1),
                         device=cpu, work_dir=tmp_path / "c")  # fmt: skip
    assert adam_steps(tmp_path / "c" / CHECKPOINT_NAME) == STEPS
    differs = any(not torch.allclose(second.delta[name], cold.delta[name]) for name in cold.delta)
    assert differs, "warm and cold AdamW state must train differently"


def test_inner_state_kept_in_the_agents_cache_gives_the_delta_that_keeping_it_in_memory_gives(
    tmp_path: Path,
) -> None:
    # int8: the state carries an error-feedback residual as well as the AdamW moments.
    config = RunConfig.tiny(model=SMALL_MODEL, inner={"steps": STEPS, "micro_batch_size": 4,
                            "grad_accum_steps": 1}, comm={"codec": "int8"})  # fmt: skip
    cpu, states = torch.device("cpu"), InnerStates(tmp_path / "inner")
    first, _ = train_unit(unit(config, window_file(tmp_path, config)), device=cpu,
                          work_dir=tmp_path / "first")  # fmt: skip
    _, in_memory = encode_deltas(first.module_deltas, config, tmp_path / "d1", first.state)
    assert in_memory.adam and in_memory.residual, "moments and a residual to carry over"
    states.save(1, 0, in_memory)
    from_cache = states.load(1, 0, config)
    assert from_cache is not None
    # Both stay on disk until used: the moments until the optimizer takes them, the
    # residual until its module's next Δ is encoded (a module at a time).
    assert isinstance(from_cache.adam, FileTensors)
    assert isinstance(from_cache.residual, FileTensors)

    def second_unit(state: InnerState, name: str) -> tuple[dict[str, torch.Tensor], list[bytes]]:
        work = unit(config, window_file(tmp_path, config, seed=1), round_index=1)
        result, _ = train_unit(work, device=cpu, work_dir=tmp_path / name, state=state)
        directory = tmp_path / f"{name}-deltas"
        encoded, _ = encode_deltas(result.module_deltas, config, directory, result.state)
        return result.delta, [e.path.read_bytes() for e in encoded]

    cached_delta, cached_bytes = second_unit(from_cache, "cached")
    memory_delta, memory_bytes = second_unit(in_memory, "memory")
    assert cached_delta.keys() == memory_delta.keys()
    for name, delta in memory_delta.items():
        assert torch.equal(cached_delta[name], delta), name
    assert cached_bytes == memory_bytes, "the same residual went into the same encoding"
    cold_delta, _ = second_unit(InnerState(), "cold")
    assert any(not torch.equal(cold_delta[n], memory_delta[n]) for n in memory_delta)


def test_the_residual_feeds_back_the_last_encodings_rounding_error(tmp_path: Path) -> None:
    config = RunConfig.tiny(model=SMALL_MODEL, comm={"codec": "int8"})
    generator = torch.Generator().manual_seed(0)
    deltas = {"0.0": {"w": torch.randn(64, 64, generator=generator) * 1e-3}}
    encoded, state = encode_deltas(deltas, config, tmp_path / "d")
    sent = codecs.decode(encoded[0].path.read_bytes())["w"]
    assert torch.equal(state.residual["0.0/w"], deltas["0.0"]["w"] - sent)
    again, after = encode_deltas(deltas, config, tmp_path / "e", state)
    resent = codecs.decode(again[0].path.read_bytes())["w"]
    assert torch.equal(
        after.residual["0.0/w"], deltas["0.0"]["w"] + state.residual["0.0/w"] - resent
    )
    assert "0.0/w" in state.residual and state.residual["0.0/w"] is not after.residual["0.0/w"]


def test_encoding_that_releases_each_modules_delta_sends_the_same_bytes(tmp_path: Path) -> None:
    """The hand-in lets each module's fp32 Δ go once it is encoded (`release`): the same
    files and residual as encoding from a mapping it keeps, and the mapping ends empty."""
    config = RunConfig.tiny(model=SMALL_MODEL, comm={"codec": "int8"})
    generator = torch.Generator().manual_seed(1)
    deltas = {m: {"w": torch.randn(32, 32, generator=generator) * 1e-3} for m in ("0.0", "1.0")}
    kept, kept_state = encode_deltas(deltas, config, tmp_path / "kept")
    given = {m: dict(d) for m, d in deltas.items()}
    released, released_state = encode_deltas(given, config, tmp_path / "given", release=True)
    assert given == {}
    assert [(e.module_id, e.sha256) for e in released] == [(e.module_id, e.sha256) for e in kept]
    assert released_state.residual.keys() == kept_state.residual.keys()
    for key, residual in kept_state.residual.items():
        assert torch.equal(released_state.residual[key], residual), key


def test_moments_of_another_model_are_not_reused(tmp_path: Path, config: RunConfig) -> None:
    states = InnerStates(tmp_path / "inner")
    saved = InnerState({"x/step": torch.tensor(5.0)}, {}, state_fingerprint(config))
    states.save(1, 0, saved)
    wider = RunConfig.tiny(model={**SMALL_MODEL, "hidden_size": 64})
    assert states.load(1, 0, wider) is None
    assert states.load(1, 0, config) is not None


def test_out_of_memory_halves_the_micro_batch_and_keeps_the_effective_batch(
    tmp_path: Path, config: RunConfig
) -> None:
    cpu, window = torch.device("cpu"), window_file(tmp_path, config)
    reference, _ = train_unit(unit(config, window), device=cpu, work_dir=tmp_path / "ref")
    seen: list[tuple[int, int]] = []

    def oom_on_big_batches(metrics: StepMetrics, inner: object) -> None:
        micro = getattr(inner, "micro_batch_size")  # noqa: B009
        seen.append((metrics.step, micro))
        if metrics.step == 2 and micro > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    resident = ResidentTrainer(cpu)
    result, inner = train_unit(
        unit(config, window), device=cpu, work_dir=tmp_path / "oom", checkpoint_every=1,
        fault=oom_on_big_batches, trainer=resident,
    )  # fmt: skip
    assert resident.builds == 2, "the resident model is dropped and built again"
    assert (inner.micro_batch_size, inner.grad_accum_steps) == (2, 2)
    assert inner.batch_size == config.inner.batch_size
    assert seen == [(1, 4), (2, 4), (2, 2), (3, 2)], "resumed after the last checkpoint"
    assert result.completed and result.tokens == reference.tokens
    for name, delta in reference.delta.items():
        torch.testing.assert_close(result.delta[name], delta, rtol=1e-3, atol=1e-5)


def test_out_of_memory_at_one_sequence_per_micro_batch_gives_up_with_advice(
    tmp_path: Path,
) -> None:
    config = small(steps=1, micro_batch_size=1, grad_accum_steps=1)

    def always(metrics: StepMetrics, inner: object) -> None:
        raise RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)")

    with pytest.raises(DoesNotFit, match="bigger device"):
        train_unit(unit(config, window_file(tmp_path, config)), device=torch.device("cpu"),
                   work_dir=tmp_path / "w", fault=always)  # fmt: skip


def test_a_memory_budget_shrinks_the_micro_batch_before_training(config: RunConfig) -> None:
    big = small(micro_batch_size=8, grad_accum_steps=2)
    need = estimate_path_memory(big.model, big.inner).total_bytes
    fitted = fit_micro_batch(big, int(need * 0.7))
    assert fitted.micro_batch_size < 8 and fitted.batch_size == big.inner.batch_size
    assert fit_micro_batch(big, None) == big.inner
    with pytest.raises(DoesNotFit, match="--memory-cap"):
        fit_micro_batch(big, GiB // 1024)
    # On a GPU the estimate is bf16's (the loop's autocast): a budget the CPU's bound
    # exceeds can hold the whole micro-batch there.
    on_gpu = estimate_path_memory(big.model, big.inner, device="cuda").total_bytes
    assert on_gpu < need
    assert fit_micro_batch(big, on_gpu, "cuda") == big.inner
    assert fit_micro_batch(big, on_gpu).micro_batch_size < 8
    odd = smaller_micro_batch(big.inner.model_copy(update={"micro_batch_size": 6}))
    assert odd is not None and (odd.micro_batch_size, odd.grad_accum_steps) == (3, 4)


def path_unit(config: RunConfig, window: Path, path: int, round_index: int) -> UnitWork:
    source = ShardSource.for_path(TokenShard(window, "<u2"), config, path)
    return UnitWork(config, 1, path, round_index, init_modules(config), source, 0)


def test_a_unit_on_the_resident_trainer_after_another_gives_the_delta_of_a_fresh_model(
    tmp_path: Path, config: RunConfig
) -> None:
    """The agent keeps one model on the device across units: a unit trained on it after a
    unit of another path, by time-based checkpoints, matches one trained on a model built
    for it alone, bit for bit on the CPU (Δ, moments, checkpoint)."""
    cpu, window = torch.device("cpu"), window_file(tmp_path, config, windows=64)
    resident = ResidentTrainer(cpu)
    first, _ = train_unit(path_unit(config, window, 0, 0), device=cpu, work_dir=tmp_path / "a",
                          trainer=resident, checkpoint_interval_s=1e-6)  # fmt: skip
    assert first.completed and first.state is not None
    later, _ = train_unit(path_unit(config, window, 1, 1), device=cpu, work_dir=tmp_path / "b",
                          trainer=resident, state=first.state,
                          checkpoint_interval_s=1e-6)  # fmt: skip
    fresh, _ = train_unit(path_unit(config, window, 1, 1), device=cpu, work_dir=tmp_path / "c",
                          state=first.state, checkpoint_interval_s=1e-6)  # fmt: skip
    assert resident.builds == 1, "built once for both units"
    assert later.delta.keys() == fresh.delta.keys()
    for name, delta in fresh.delta.items():
        assert torch.equal(later.delta[name], delta), name
    assert later.adam.keys() == fresh.adam.keys()
    for name, moment in fresh.adam.items():
        assert torch.equal(later.adam[name], moment), name
    assert later.losses == fresh.losses
    assert adam_steps(tmp_path / "b" / CHECKPOINT_NAME) == adam_steps(
        tmp_path / "c" / CHECKPOINT_NAME
    )

    wider = RunConfig.tiny(
        model={**SMALL_MODEL, "hidden_size": 64}, inner=config.inner.model_dump()
    )
    other, _ = train_unit(path_unit(wider, window, 0, 0), device=cpu, work_dir=tmp_path / "d",
                          trainer=resident)  # fmt: skip
    assert other.completed and resident.builds == 2, "another architecture: built again"


def test_the_agent_grows_the_micro_batch_to_its_budget_but_not_back_after_a_fallback() -> None:
    config = small(micro_batch_size=2, grad_accum_steps=4)
    whole = config.inner.model_copy(update={"micro_batch_size": 8, "grad_accum_steps": 1})
    budget = path_memory(config, whole, "cpu")
    record = LeaseRecord(server="http://server", lease={})
    grown = unit_split(config, record, budget, "cpu", compiled=False)
    assert (grown.micro_batch_size, grown.grad_accum_steps) == (8, 1)
    assert unit_split(config, record, None, "cpu", compiled=False) == config.inner
    record.micro_batch_size = 1  # an out-of-memory fallback before a restart
    kept = unit_split(config, record, budget, "cpu", compiled=False)
    assert (kept.micro_batch_size, kept.grad_accum_steps) == (1, 8)
    with pytest.raises(OutOfMemory, match="--memory-cap"):
        unit_split(config, LeaseRecord(server="http://server", lease={}), 1024, "cpu",
                   compiled=False)  # fmt: skip


def test_a_unit_another_worker_also_trains_starts_from_fresh_moments(
    tmp_path: Path, config: RunConfig
) -> None:
    """The lease's `cold`: a replicated unit's two copies both start cold, so they differ by
    what differs between the machines, not by one worker's warm moments; every other unit
    of the path continues them."""
    from types import SimpleNamespace

    from worker_agent.agent import Agent

    states = InnerStates(tmp_path / "inner")
    first, _ = train_unit(unit(config, window_file(tmp_path, config)),
                          device=torch.device("cpu"), work_dir=tmp_path / "a")  # fmt: skip
    assert first.state is not None
    states.save(1, 0, first.state)
    agent = SimpleNamespace(inner_states=states)
    warm = Agent._inner_state(agent, SimpleNamespace(cold=False, run_id=1, path=0), config)  # type: ignore[arg-type]
    assert warm is not None and warm.adam
    cold = Agent._inner_state(agent, SimpleNamespace(cold=True, run_id=1, path=0), config)  # type: ignore[arg-type]
    assert cold is None
