"""What a lease was granted: the unit's length under it (`lease_steps`) and the most tokens
a Δ under it may weigh (`lease_tokens`). The completion (rounds.protocol) caps a claim with
them and the outer step's checks (rounds.verification) weigh each Δ by them, so they live
below both; rounds.protocol.sizing decides the steps when it grants the lease."""

from __future__ import annotations

from dipaco.config import RunConfig
from dipaco.data.windows import step_tokens
from dipaco_server.rounds.models import Lease

__all__ = ["lease_steps", "lease_tokens"]


def lease_steps(lease: Lease, config: RunConfig) -> int:
    """The unit's length under `lease`, the one the lease answer names (`steps`: the
    agent's inner-loop bound, counted from the unit's start); H for leases granted before
    units were sized. It never changes the lr schedule, whose slot stays H steps."""
    return min(lease.steps, config.inner.steps) if lease.steps else config.inner.steps


def lease_tokens(lease: Lease, config: RunConfig) -> int:
    """The most tokens a Δ under `lease` may be weighted by: its steps x step tokens."""
    return lease_steps(lease, config) * step_tokens(config)
