"""How much of a unit a lease trains: steps sized to the worker's measured speed and the
round's deadline (`size_unit`); what a lease was granted is rounds.granted's."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime

from dipaco.config import RunConfig
from dipaco.data.windows import step_tokens
from dipaco_server.workers.speed import plausible_speed

logger = logging.getLogger(__name__)
__all__ = ["UnitSize", "size_unit"]


@dataclass(frozen=True)
class UnitSize:
    """How many steps a lease may train, and why (shown to the worker and the dashboard)."""

    steps: int  # counted from the unit's start: a resumed checkpoint's steps included
    trained_steps: int  # of those, the ones this lease is expected to train
    reason: str
    seconds: float | None = None  # a calibration unit stops after this long


def size_unit(
    config: RunConfig,
    speed: float | None,
    *,
    resumed_steps: int = 0,
    round_deadline: datetime | None = None,
    now: datetime | None = None,
    stop_margin_s: float = 0.0,
) -> UnitSize:
    """Steps for a unit on a worker of `speed` tokens/s, so that it takes about
    ``units.target_seconds`` (at most H, at least one step).

    A worker never measured gets the whole unit but stops after
    ``units.calibration_seconds`` and uploads the steps done: that completion reports the
    speed that sizes its next units, and a slow GPU loses no more than that time. A worker taking back a unit it held (`resumed_steps`:
    the steps its earlier lease allowed, which its checkpoint cannot exceed) may add a
    unit's worth to them. Before the round's deadline the unit is also cut to what the
    worker can train by then, `stop_margin_s` before it (agents stop a heartbeat interval
    early), so a slow worker's unit still ends in time and is not cut short again.
    """
    h, per_step = config.inner.steps, step_tokens(config)
    units = config.units
    limit = None
    # A stored speed is bounded (workers.speed) and so is every config field, but a row
    # written before they were must not turn into inf x seconds -> NaN -> int() here.
    speed = plausible_speed(speed)
    if speed is None:
        fresh, limit = h, units.calibration_seconds
        reason = (
            f"calibration: this worker's speed is unknown; it trains up to H = {h} steps "
            f"for at most {limit:g} s, which measures it"
        )
    else:
        fit = _steps_in(units.target_seconds, speed, per_step)
        fresh = max(1, min(h, fit))
        reason = (
            f"{speed:,.0f} tokens/s x {units.target_seconds:,.0f} s target = {fit:,} steps"
            + (f", capped at H = {h}" if fit > h else "")
            + (", raised to 1" if fit < 1 else "")
        )
        if round_deadline is not None and now is not None:
            left = max(0.0, (round_deadline - now).total_seconds() - stop_margin_s)
            by_deadline = _steps_in(left, speed, per_step)
            if by_deadline < fresh:
                fresh = max(1, by_deadline)
                reason += (
                    f"; {fresh} fit in the {left:,.0f} s left to train before the round's deadline"
                )
    steps = min(h, resumed_steps + fresh)
    if resumed_steps:
        reason += f"; resumes its checkpoint of up to {resumed_steps} steps"
    trained = max(1, steps - resumed_steps)
    return UnitSize(steps=steps, trained_steps=trained, reason=reason, seconds=limit)


def _steps_in(seconds: float, speed: float, per_step: int) -> int:
    """Whole steps of `per_step` tokens that `seconds` at `speed` tokens/s hold; a
    non-finite product (never from bounded inputs) counts as unbounded: 2^62."""
    steps = seconds * speed / per_step
    return int(steps) if math.isfinite(steps) and steps < 2**62 else 2**62
