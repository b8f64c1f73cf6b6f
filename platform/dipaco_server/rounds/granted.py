"""What a lease was granted: the unit's length under it (`lease_steps`), the most tokens
a Δ under it may weigh (`lease_tokens`) and the learning rate its steps train at
(`lease_lr_share`). The completion (rounds.protocol) caps a claim with
them and the outer step's checks (rounds.verification) weigh each Δ by them, so they live
below both; rounds.protocol.sizing decides the steps when it grants the lease."""

from __future__ import annotations

from dipaco.config import RunConfig
from dipaco.data.windows import step_tokens
from dipaco_server.rounds.models import Lease

__all__ = ["lease_lr_share", "lease_steps", "lease_tokens", "lr_share"]


def lease_steps(lease: Lease, config: RunConfig) -> int:
    """The unit's length under `lease`, the one the lease answer names (`steps`: the
    agent's inner-loop bound, counted from the unit's start); H for leases granted before
    units were sized. It never changes the lr schedule, whose slot stays H steps."""
    return min(lease.steps, config.inner.steps) if lease.steps else config.inner.steps


def lease_tokens(lease: Lease, config: RunConfig) -> int:
    """The most tokens a Δ under `lease` may be weighted by: its steps x step tokens."""
    return lease_steps(lease, config) * step_tokens(config)


def lr_share(config: RunConfig, round_index: int, steps: int) -> float:
    """The mean learning rate of the first `steps` steps of round `round_index`'s H-step slot
    of the phase's schedule (linear warm-up, cosine decay over the phase's rounds x H steps:
    dipaco.inner.state.lr_at, as the worker trains them), as a fraction of the peak lr.

    What a unit's training can move its loss by scales with it: in the demo's 2-round phase
    (H = 10, 2 warm-up steps, min_lr_ratio 0.1) the first round trains at 0.85 of the peak
    and the last at 0.29, whose honest units lowered most of their windows' loss by 0.8-1.5%
    where the first round's did by 2.1-4.4%."""
    from dipaco.inner.state import lr_at  # dipaco.inner loads the model's code: seconds

    inner, h = config.inner, config.inner.steps
    steps = max(1, min(steps, h))
    total = max(1, config.rounds) * h
    first = max(0, round_index) * h
    rates = [lr_at(inner, first + i, total) for i in range(steps)]
    return min(1.0, sum(rates) / (steps * inner.lr))


def lease_lr_share(lease: Lease, config: RunConfig, round_index: int) -> float:
    """`lr_share` of the steps `lease` granted in round `round_index` of its phase."""
    return lr_share(config, round_index, lease_steps(lease, config))
