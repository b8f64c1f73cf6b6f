"""What the platform hands out and accepts: the size of a work unit, and the memory and
storage a run may need."""

from __future__ import annotations

from pydantic import Field

from dipaco.config.rules import MAX_BYTES, MAX_INNER_STEPS, GiB, Section


class UnitsConfig(Section):
    """How big a work unit is on the platform: sized to each worker's measured speed.

    A unit is at most H = inner.steps steps; a worker whose H steps would take longer
    than `target_seconds` gets fewer (its lease says how many), and the outer step weights
    its Δ by the tokens it trained on (outer.token_weighting). The lr schedule stays the
    run's: a shorter unit is the first steps of the full one, so resuming and salvage
    (a partial Δ after SIGTERM, lease expiry or the round closing) mean the same thing.
    """

    # A unit longer than a day would outlive most volunteers' sessions and every lease.
    target_seconds: float = Field(
        default=900.0,
        gt=0,
        le=86_400.0,
        description="Wall time a unit should take at the worker's speed.",
    )
    calibration_seconds: float = Field(
        default=60.0,
        gt=0,
        le=3600.0,  # measuring a speed takes a minute; an hour is ample
        description="A new worker's first unit stops after this long (it uploads the steps "
        "done): its completion measures the speed that sizes its next units.",
    )
    min_partial_steps: int = Field(
        default=1,
        ge=1,
        le=MAX_INNER_STEPS,
        description="A salvaged partial Δ of fewer steps is dropped, not uploaded.",
    )


class LimitsConfig(Section):
    """Refuse configs that cannot fit, before anything is allocated."""

    max_path_memory_bytes: int = Field(
        default=80 * GiB,
        gt=0,
        le=MAX_BYTES,
        description="Largest training memory estimate accepted for one path.",
    )
    max_module_storage_bytes: int = Field(
        default=1024 * GiB,
        gt=0,
        le=MAX_BYTES,
        description="Largest fp32 weights + momentum over all modules.",
    )
