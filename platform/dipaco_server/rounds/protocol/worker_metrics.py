"""What a completion may report about its own training: a closed, bounded schema
(a worker reports only what is its own).

A worker is untrusted, and so are its numbers (docs/design.md §7). A completion carries
the worker's own training metrics only, each finite and within what a real unit can
show; every other name is refused (422), and a name that is one of the server's
evaluation series is refused with a message that says so. Before this, any name
matching ``^[a-z][a-z0-9_]{0,63}$`` was stored as a metric point of the path: a worker
whose every Δ was rejected wrote ``val_loss = 0.0001``, the public dashboard showed a
perplexity of 1.00, and the evaluation skipped that path because a point existed.

The names are the ones worker_agent.agent sends; the series are runs.evaluate's and the
dashboard's (a test keeps the lists in step).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninja import Schema
from pydantic import ConfigDict, Field, ValidationError, model_validator

from dipaco.config import MAX_INNER_STEPS
from dipaco_server.workers.speed import MAX_TOKENS_PER_SECOND

__all__ = ["SERVER_SERIES", "WorkerMetricsIn", "worker_metrics"]

# Written by the server's evaluation alone (runs.evaluate, web.dipaco_web.queries).
SERVER_SERIES = frozenset({"val_loss", "val_loss_se", "val_perplexity", "routed_val_loss"})
MAX_SECONDS = 7 * 86_400.0  # a unit is sized to at most a day (units.target_seconds)


class WorkerMetricsIn(Schema):
    """The worker's own training metrics of one unit; all optional, each bounded."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    # Cross-entropy in nats: ln(vocab) <= 14 at the start; a diverged unit reports NaN,
    # which is refused, long before 10^4.
    loss: float | None = Field(
        None, ge=0, le=1e4, description="Mean training loss of the unit's last steps (nats)."
    )
    tokens_per_second: float | None = Field(
        None,
        ge=0,
        le=MAX_TOKENS_PER_SECOND,
        description="Training throughput; the scheduler uses the smaller of this and the "
        "server's own measure (tokens / the lease's wall time).",
    )
    train_seconds: float | None = Field(
        None, ge=0, le=MAX_SECONDS, description="Wall time spent training the unit."
    )
    steps: float | None = Field(
        None, ge=0, le=MAX_INNER_STEPS, description="Inner steps trained (inner.steps at most)."
    )
    rebased: float | None = Field(
        None, ge=0, le=1, description="outer.overlap eager: 1 if the Δ is relative to the "
        "rebased versions, 0 if to its base versions.",
    )  # fmt: skip
    rebase_wait_s: float | None = Field(
        None, ge=0, le=MAX_SECONDS, description="Seconds waited for the versions to rebase onto."
    )

    @model_validator(mode="before")
    @classmethod
    def _not_the_servers_series(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            taken = sorted(str(name) for name in data if name in SERVER_SERIES)
            if taken:
                raise ValueError(
                    f"{', '.join(taken)}: an evaluation series the server writes itself; a "
                    "completion reports the worker's own training metrics only "
                    f"({', '.join(cls.model_fields)})"
                )
        return data


def worker_metrics(metrics: Any) -> dict[str, float]:
    """`metrics` as the closed schema's plain floats (names not sent left out); ValueError
    with every refused name and why (the API's schema refuses the same before the view)."""
    if isinstance(metrics, WorkerMetricsIn):
        parsed = metrics
    else:
        try:
            parsed = WorkerMetricsIn.model_validate(metrics)
        except ValidationError as exc:
            listed = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'metrics'}: {e['msg']}"
                for e in exc.errors()
            )
            raise ValueError(listed) from None
    return {k: float(v) for k, v in parsed.model_dump(exclude_none=True).items()}
