"""`outer.overlap` in `dipaco simulate`, and the inner loop's rebase (the eager correction).

Delayed: round t + 1 trains from the versions before round t's step and its Δs land on
round t's; with `eager_at`, a unit adds the newer version to its live weights mid-unit and
rebases its Δ on it (dipaco.inner.run_inner_loop's `rebase`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.config import RunConfig
from dipaco.inner import run_inner_loop
from dipaco.model import build_model
from dipaco.simulate.prepare import prepare_data
from dipaco.simulate.train import train_dipaco
from tests.test_inner import CFG, SOURCE
from tests.test_simulate import BUDGET, tiny_config

SHIFT_AT = 3


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the suite shares two cores with other work
    yield
    torch.set_num_threads(threads)


def shifted(scale: float) -> dict[str, torch.Tensor]:
    model = build_model(CFG.model, 0)
    g = torch.Generator().manual_seed(1)
    return {n: torch.randn(p.shape, generator=g) * scale for n, p in model.named_parameters()}


def with_overlap(config: RunConfig, overlap: str) -> RunConfig:
    outer = config.outer.model_copy(update={"overlap": overlap})
    return config.model_copy(update={"outer": outer})


def test_a_rebase_moves_the_live_weights_and_the_deltas_base() -> None:
    shift = shifted(1e-2)
    model = build_model(CFG.model, 0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []

    def rebase(step: int) -> dict[str, torch.Tensor] | None:
        calls.append(step)
        return shift if step == SHIFT_AT else None

    result = run_inner_loop(model, SOURCE, CFG.inner, seq_len=CFG.model.seq_len, rebase=rebase)

    assert calls == list(range(1, CFG.inner.steps + 1))
    after = dict(model.named_parameters())
    for name in before:  # Δ relative to the new base: (θ_old + shift) − θ_final
        assert torch.equal(result.delta[name], (before[name] + shift[name]) - after[name]), name
    plain = run_inner_loop(build_model(CFG.model, 0), SOURCE, CFG.inner, seq_len=CFG.model.seq_len)
    assert result.losses[:SHIFT_AT] == plain.losses[:SHIFT_AT]
    assert result.losses[SHIFT_AT:] != plain.losses[SHIFT_AT:], "training went on elsewhere"


def test_a_zero_rebase_changes_nothing() -> None:
    zero = {n: torch.zeros_like(t) for n, t in shifted(1.0).items()}
    rebased = run_inner_loop(
        build_model(CFG.model, 0), SOURCE, CFG.inner, seq_len=CFG.model.seq_len,
        rebase=lambda step: zero if step == SHIFT_AT else None,
    )  # fmt: skip
    plain = run_inner_loop(build_model(CFG.model, 0), SOURCE, CFG.inner, seq_len=CFG.model.seq_len)
    assert rebased.losses == plain.losses
    for name, delta in plain.delta.items():
        assert torch.equal(rebased.delta[name], delta), name


def test_delayed_rounds_train_from_the_version_before_and_eager_corrects_them(
    tmp_path: Path,
) -> None:
    config = tiny_config(rounds=2, comm={"codec": "fp32"})
    data = prepare_data(config, BUDGET, tmp_path)
    windows = data.val_windows(config.model.seq_len, 32)

    def curve(overlap: str, eager_at: float | None = None) -> list[float]:
        run = train_dipaco(with_overlap(config, overlap), data, windows, eager_at=eager_at)
        return [r.routed_loss for r in run.rounds]

    none, delayed = curve("none"), curve("delayed")
    eager_first = curve("delayed", eager_at=1 / config.inner.steps)
    eager_late = curve("delayed", eager_at=1.0)

    # Round 0 trains from version 0 in every mode; from round 1 on, delayed units train
    # from the version before the last step, so the runs part.
    assert none[:2] == delayed[:2] == eager_first[:2] == eager_late[:2]
    assert none[2] != delayed[2] and eager_first[2] != delayed[2]
    # Rebasing after the last step changes where no gradient was taken: the Δs are the
    # delayed run's own, relative to the newer version, so the weights are (nearly) the same.
    assert eager_late == pytest.approx(delayed, abs=1e-4)
    with pytest.raises(ValueError, match="eager_at"):
        train_dipaco(with_overlap(config, "delayed"), data, windows, eager_at=0.0)
