"""Two workers' agreeing copies of a unit that both bought nothing are held, not refused.

An honest unit's windows can buy nothing from its base in a round: in the live attack
bench two workers' identical copies of one seed-2 unit moved its training loss from 6.6748
to 6.6901, and both were refused as `no_training_gain` and their workers' trust cut. Such a
pair is held (rules.AGREED_NO_GAIN): left out of the step, neither credited nor counted
against either worker. Two copies of a flipped useful Δ are still refused, and cost trust
(tests/test_verification.py::test_two_colluders_uploading_one_flipped_delta_confirm_nothing_and_are_refused).

Real services as in tests/test_verification.py (PostgreSQL, the blob store, the lease and
completion services, the outer step with its scorer reading real shards).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.config import OuterConfig
from dipaco_server.rounds.models import Contribution, OuterStep
from dipaco_server.rounds.verification import rules
from tests.test_untrusted import reasons, scaled, step_round, submit
from tests.test_verification import refreshed, scored_replicated_run

pytestmark = pytest.mark.django_db


def test_two_agreeing_copies_that_both_buy_nothing_are_held_and_cost_no_trust(
    tmp_path: Path, settings: Any
) -> None:
    """A fiftieth of the honest Δ lowers the unit's loss by far less than 1% and raises
    it not at all: what a unit whose data bought nothing uploads, on both copies."""
    run, sources = scored_replicated_run(tmp_path, settings)
    first, _ = submit(run, "first", sources, scaled(0.02))  # the original
    second, _ = submit(run, "second", sources, scaled(0.02))  # its check copy
    step_round(run, 0)

    assert reasons(run, first) == reasons(run, second) == {rules.AGREED_NO_GAIN}
    for c in Contribution.objects.filter(unit__round__run=run):
        assert c.status == Contribution.Status.REJECTED  # left out of the step
        assert "neither credited nor counted against either worker" in c.reason
    for worker in refreshed(first, second):
        assert worker.trust == 1.0
        assert (worker.units_completed, worker.tokens_processed) == (0, 0)
        assert (worker.replicas_agreed, worker.replicas_disagreed) == (0, 0)
    for module_id in ("0.0", "shared"):
        step = OuterStep.objects.get(round__run=run, round__t=0, module__module_id=module_id)
        assert (step.outcome, step.accepted, step.rejected) == ("kept", 0, 2)


def test_a_lone_copy_that_buys_nothing_is_still_refused(tmp_path: Path, settings: Any) -> None:
    """Without a second worker's agreeing copy nothing corroborates it: refused."""
    run, sources = scored_replicated_run(tmp_path, settings)
    lone, _ = submit(run, "lone", sources, scaled(0.02))
    honest, _ = submit(run, "honest", sources)  # its check copy, which gains
    step_round(run, 0)

    assert reasons(run, lone) == {rules.NO_GAIN}
    assert reasons(run, honest) == {""}
    (lone,) = refreshed(lone)
    assert lone.trust < 1.0


def test_the_rule_holds_only_agreeing_copies_refused_for_no_gain_alone() -> None:
    torch.manual_seed(0)
    delta = {"w": torch.randn(64, 32)}
    near = {k: v + 0.3 * torch.randn_like(v) for k, v in delta.items()}
    cfg = OuterConfig()
    no_gain = f"{rules.NO_GAIN}: it did not lower the loss"
    flat, worse = rules.Score(6.67, 6.69, 6.7, 6.7), rules.Score(6.67, 6.80, 6.7, 6.8)

    def held(reasons: tuple[str, str], scores: Any, other: Any = near, **kw: Any) -> bool:
        return rules.held_no_gain(reasons, scores, delta, other, cfg, **kw) != ""

    assert held((no_gain, no_gain), (flat, flat))
    # Raised by more than score_min_gain (1%) on either copy: a flip's mark, refused.
    assert not held((no_gain, no_gain), (flat, worse))
    assert not held((no_gain, no_gain), (flat, None))
    # Refused for anything else on either side, or one accepted: not held.
    direction = f"{rules.DIRECTION}: cosine -0.9"
    assert not held((no_gain, direction), (flat, flat))
    assert not held((no_gain, ""), (flat, flat))
    # Copies that disagree say nothing about the unit's data; identical bytes do.
    flipped = {k: -v for k, v in delta.items()}
    assert not held((no_gain, no_gain), (flat, flat), flipped)
    assert held((no_gain, no_gain), (flat, flat), delta, identical=True)
