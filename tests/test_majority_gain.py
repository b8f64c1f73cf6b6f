"""The proof of useful work reads the gain a strict majority of the scored windows reach
(dipaco.data.scored.majority_gain, rules.score_delta), not their mean: a Δ that memorised
a few of its unit's windows shows their gain on the one or two of them a draw of 8 holds,
which carried the mean past the bar, and cannot carry a majority.
"""

from __future__ import annotations

import pytest
import torch

from dipaco.config import LayoutConfig, OuterConfig, RunConfig
from dipaco.data.scored import majority_gain
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, init_modules_from_base, split_path_state
from dipaco_server.rounds.verification import rules


def test_fewer_than_half_of_the_windows_cannot_carry_the_gain() -> None:
    before = [5.0] * 8
    memorised = [1.0, 1.0, 1.0, 1.0] + [5.0] * 4  # half of them: still no majority
    assert majority_gain(before, memorised) == 0.0
    assert statistics_mean_gain(before, memorised) == pytest.approx(0.4)  # what the mean read
    five = [1.0] * 5 + [5.0] * 3
    assert majority_gain(before, five) == pytest.approx(0.8)
    honest = [4.9, 4.8, 4.95, 4.85, 4.9, 4.7, 4.9, 4.8]
    assert majority_gain(before, honest) == pytest.approx(0.02)  # the 5th largest of 8
    assert majority_gain([5.0], [4.0]) == pytest.approx(0.2)  # one window: its own
    assert majority_gain([5.0, 5.0], [1.0, 5.0]) == 0.0  # two: both must gain
    assert majority_gain([], []) == 0.0
    with pytest.raises(ValueError, match="before"):
        majority_gain([1.0], [1.0, 2.0])


def statistics_mean_gain(before: list[float], after: list[float]) -> float:
    return (sum(before) - sum(after)) / sum(before)


def test_the_checks_and_the_credit_read_the_majority_gain() -> None:
    cfg = OuterConfig()
    # A mean drop of 40% that a majority of windows do not show: refused.
    carried = rules.Score(5.0, 3.0, 5.0, 5.0, train_gain=0.0)
    honest = rules.Score(5.0, 4.9, 5.0, 4.95, train_gain=0.02)
    refused = rules.screen([rules.Candidate(0, 1.0, score=carried)], [], cfg)
    assert refused[0].startswith(f"{rules.NO_GAIN}:") and "majority" in refused[0]
    assert rules.screen([rules.Candidate(0, 1.0, score=honest)], [], cfg) == {}
    # A score recorded before the majority gain was kept: the relative gain of the means.
    old = rules.Score.from_dict({k: v for k, v in honest.as_dict().items() if k != "train_gain"})
    assert old is not None and old.train_gain is None
    assert old.relative_gain == pytest.approx(0.1 / 5.0)
    assert rules.Score.from_dict(honest.as_dict()) == honest
    # Credit follows the same gain: the carried Δ earns nothing against an honest peer.
    assert rules.useful_fraction(carried, 1.0, [(honest, 1.0)]) == 0.0
    # Replicas: the copy whose majority gain is lower loses, whatever its mean.
    delta = {"w": torch.ones(4)}
    flipped = {"w": -torch.ones(4)}
    evidence = (rules.ReplicaEvidence(carried), rules.ReplicaEvidence(honest))
    outcome = rules.settle_replicas(delta, flipped, cfg, evidence)
    assert (outcome.kind, outcome.loser) == ("disagree", 0)


def _tiny() -> RunConfig:
    layers = RunConfig.tiny().model.num_layers
    return RunConfig.tiny(layout=LayoutConfig.grid(layers, 2, 2), seed=0)


def test_a_delta_that_memorised_two_of_eight_scored_windows_is_refused() -> None:
    """A real Δ of the tiny path: trained only on 2 of the 8 scored windows, it lowers their
    mean loss past the bar, and the majority of the windows shows no such gain; trained on
    all 8, it shows it."""
    torch.manual_seed(0)
    config, p = _tiny(), 0
    model = build_model(config.model, config.seed)
    modules = init_modules_from_base(config, model.state_dict())
    T = config.model.seq_len
    # Each window repeats its own 16 tokens: a few steps on one learn it, and little else.
    pattern = torch.randint(0, config.model.vocab_size, (8, 16))
    windows = pattern.repeat(1, T // 16 + 1)[:, : T + 1]
    heldout = torch.randint(0, config.model.vocab_size, (4, T + 1))

    def delta_trained_on(rows: torch.Tensor) -> dict[str, dict[str, torch.Tensor]]:
        trained = build_model(config.model, config.seed)
        trained.load_state_dict(assemble_path_state(config, p, modules))
        opt = torch.optim.Adam(trained.parameters(), lr=1e-3)
        for _ in range(10):
            logits = trained(input_ids=rows[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), rows[:, 1:])
            opt.zero_grad()
            loss.backward()
            opt.step()
        after = split_path_state(config, p, trained.state_dict())
        return {m: {n: modules[m][n] - after[m][n] for n in modules[m]} for m in after}

    base = rules.base_losses(config, p, model, modules, windows, heldout)
    assert len(base.train) == 8
    memorised = rules.score_delta(
        config, p, model, modules, delta_trained_on(windows[:2]), windows, heldout, base
    )
    assert memorised.relative_gain == memorised.train_gain
    mean_gain = memorised.gain / memorised.train_before
    assert mean_gain > config.outer.score_min_gain  # what the mean read: accepted
    assert memorised.train_gain is not None
    assert memorised.train_gain < config.outer.score_min_gain  # most windows gained nothing
    candidate = rules.Candidate(0, 1.0, score=memorised)
    assert rules.screen([candidate], [], config.outer)[0].startswith(f"{rules.NO_GAIN}:")
    whole = rules.score_delta(
        config, p, model, modules, delta_trained_on(windows), windows, heldout, base
    )
    assert whole.train_gain is not None and whole.train_gain > config.outer.score_min_gain
