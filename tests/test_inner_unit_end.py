"""A unit's end on the resident trainer: the last checkpoint written while the Δ is handed
in, the Δ from its snapshot, and a path's moments kept resident for its next unit.

Tiny CPU models, bit for bit: what the agent does without waiting must give what waiting
gave."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dipaco.inner import InnerResult, InnerState, PathTrainer, StepMetrics
from dipaco.inner import checkpoint as inner_checkpoint
from dipaco.inner import loop as inner_loop
from dipaco.modular import init_modules
from tests.test_inner import CFG, SOURCE
from worker_agent.payload import encode_deltas
from worker_agent.state import InnerStates

SHORT = CFG.model_copy(update={"inner": CFG.inner.model_copy(update={"steps": 4})})


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved_step(path: Path) -> int:
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {})["dipaco"])
    return int(meta["progress"]["step"])


def assert_same_unit(a: InnerResult, b: InnerResult) -> None:
    assert a.losses == b.losses
    assert a.delta.keys() == b.delta.keys()
    for name, delta in b.delta.items():
        assert torch.equal(a.delta[name], delta), name
    assert a.adam.keys() == b.adam.keys()
    for name, moment in b.adam.items():
        assert torch.equal(a.adam[name], moment), name


def test_the_delta_from_the_last_snapshot_is_the_delta_read_off_the_model(
    tmp_path: Path,
) -> None:
    modules = init_modules(SHORT)
    waited = PathTrainer(SHORT).train_path(SHORT, 0, modules, SOURCE)  # no checkpoint
    trainer = PathTrainer(SHORT)
    result = trainer.train_path(SHORT, 0, modules, SOURCE, checkpoint_path=tmp_path / "c",
                                checkpoint_every=1, finish_write=False)  # fmt: skip
    result.checkpoint_written()
    assert saved_step(tmp_path / "c") == 4
    assert_same_unit(result, waited)
    assert set(result.timings) >= {"load_s", "final_snapshot_s", "delta_and_moments_s"}
    # The gradients went before Δ was made: the two are never held at once.
    assert all(p.grad is None for p in trainer.model.parameters())


def test_a_crash_during_the_final_background_write_leaves_a_checkpoint_that_resumes_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def dying_at_the_last(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        if json.loads(kwargs["metadata"]["dipaco"])["progress"]["step"] < 4:
            save_file(tensors, filename, **kwargs)
            return
        Path(filename).write_bytes(b"\x00" * 4096)  # half a file, then the disk goes away
        raise OSError("the disk went away mid-write")

    modules, ckpt = init_modules(SHORT), tmp_path / "unit" / "inner.safetensors"
    ckpt.parent.mkdir()
    uninterrupted = PathTrainer(SHORT).train_path(SHORT, 0, modules, SOURCE)
    monkeypatch.setattr(inner_checkpoint, "save_file", dying_at_the_last)
    trainer = PathTrainer(SHORT)
    result = trainer.train_path(SHORT, 0, modules, SOURCE, checkpoint_path=ckpt,
                                checkpoint_every=1, finish_write=False)  # fmt: skip
    result.checkpoint_written()  # the Δ was ready before the write failed
    assert_same_unit(result, uninterrupted)
    assert saved_step(ckpt) == 3, "the previous checkpoint is the file on disk, whole"
    assert [p.name for p in ckpt.parent.iterdir()] == ["inner.safetensors"]
    monkeypatch.undo()
    # The trainer's next unit is not failed by it: the error is logged.
    with caplog.at_level(logging.ERROR, logger="dipaco.inner.checkpoint"):
        trainer.train_path(SHORT, 1, modules, SOURCE)
    assert any("mid-write" in r.getMessage() for r in caplog.records)
    # A restart (another process: a fresh trainer) resumes step 4 from it, bit for bit.
    resumed_at: list[int] = []
    resumed = PathTrainer(SHORT).train_path(
        SHORT, 0, modules, SOURCE, checkpoint_path=ckpt,
        on_step=lambda m: resumed_at.append(m.step),
    )  # fmt: skip
    assert resumed_at == [4]
    assert_same_unit(resumed, uninterrupted)


def accepted(states: InnerStates, result: InnerResult, work: Path) -> None:
    """What the agent does once the server accepted a unit: encode, then keep the state."""
    _, state = encode_deltas(result.module_deltas, SHORT, work, result.state)
    states.save(1, 0, state)


def test_a_same_path_next_unit_gives_the_same_delta_with_resident_moments_as_with_a_reload(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    modules, states = init_modules(SHORT), InnerStates(tmp_path / "inner")
    trainer = PathTrainer(SHORT)
    first = trainer.train_path(SHORT, 0, modules, SOURCE)
    accepted(states, first, tmp_path / "d1")
    loads: list[int] = []
    real_load = inner_loop.load_adam_by_name
    monkeypatch.setattr(inner_loop, "load_adam_by_name",
                        lambda m, o, adam: (loads.append(len(adam)), real_load(m, o, adam)))  # fmt: skip
    resident = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1,
                                  state=states.load(1, 0, SHORT))  # fmt: skip
    assert loads == [], "the moments stayed in the optimizer"
    from_disk = InnerState.load(states.path_for(1, 0))
    assert from_disk is not None
    reloaded = PathTrainer(SHORT).train_path(SHORT, 0, modules, SOURCE, round_index=1,
                                             state=from_disk)  # fmt: skip
    assert loads and loads[-1] > 0, "a fresh trainer copies them in"
    assert_same_unit(resident, reloaded)


def test_a_refused_completion_leaves_the_next_unit_the_last_accepted_state(
    tmp_path: Path,
) -> None:
    modules, states = init_modules(SHORT), InnerStates(tmp_path / "inner")
    trainer = PathTrainer(SHORT)
    first = trainer.train_path(SHORT, 0, modules, SOURCE)
    accepted(states, first, tmp_path / "d1")
    last_accepted = states.load(1, 0, SHORT)
    assert last_accepted is not None
    # The second unit trains (its moments now in the optimizer) but the server refuses
    # its completion: nothing is kept.
    refused = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1, state=last_accepted)
    assert refused.completed
    again = states.load(1, 0, SHORT)
    assert again is last_accepted
    third = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1, state=again)
    reference = PathTrainer(SHORT).train_path(
        SHORT, 0, modules, SOURCE, round_index=1, state=InnerState.load(states.path_for(1, 0))
    )
    assert_same_unit(third, reference)
    assert_same_unit(refused, reference)  # the refused unit trained from the same state


def test_a_unit_that_crashed_leaves_no_resident_moments_for_the_next(tmp_path: Path) -> None:
    modules = init_modules(SHORT)
    trainer = PathTrainer(SHORT)
    first = trainer.train_path(SHORT, 0, modules, SOURCE)

    def crash(metrics: StepMetrics) -> None:
        raise RuntimeError("the machine went away")

    with pytest.raises(RuntimeError):
        trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1, state=first.state,
                           on_step=crash)  # fmt: skip
    after_crash = trainer.train_path(SHORT, 0, modules, SOURCE, round_index=1,
                                     state=first.state)  # fmt: skip
    fresh = PathTrainer(SHORT).train_path(SHORT, 0, modules, SOURCE, round_index=1,
                                          state=first.state)  # fmt: skip
    assert_same_unit(after_crash, fresh)
