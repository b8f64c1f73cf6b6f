"""The agent's policies for one unit's training, as the library's loop takes them.

The library trains (`dipaco.inner.ResidentTrainer.train`: the resident model, the unit's
checkpoint, the out-of-memory fallback); what the agent decides around it lives here:
- `unit_split`: the micro-batch a unit trains with: the one an out-of-memory fallback
  left in the lease's record (a resumed unit keeps it), else the run's batch fitted to
  this machine's memory budget, both ways (dipaco.inner.fit_micro_batch);
- `unit_stop_at`: the unit's length, the loop's bound;
- `UnitStops`: why a unit stops short of its steps (a signal, the lease lost, a
  calibration unit's time, the round's deadline near), the first reason kept;
- `UnitProgress`: what each step and a fallback tell the volunteer and the lease's
  record (the step a restart resumes from);
- `unit_source`: the unit's windows in the path's order, streamed from its row chunks
  (as `dipaco simulate` reads them), slowed by --step-delay if asked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch import Tensor

from dipaco.config import InnerConfig, RunConfig
from dipaco.data.rows import FORMAT, Segment, UnitRows, rows_of
from dipaco.inner import DoesNotFit, StepMetrics, fit_micro_batch
from worker_agent.client import ChunkRef, LeaseGrant, UnitData, seconds_until
from worker_agent.errors import OutOfMemory
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.progress import Reporter
from worker_agent.state import LeaseRecord, LeaseStateFile

__all__ = [
    "SlowSource",
    "UnitProgress",
    "UnitStops",
    "unit_source",
    "unit_split",
    "unit_stop_at",
]


def unit_split(
    config: RunConfig,
    record: LeaseRecord,
    budget_bytes: int | None,
    device: str,
    *,
    compiled: bool,
) -> InnerConfig:
    """The micro-batch split the unit trains with (the same batch in every case);
    `compiled`: the loss is compiled whole, which keeps a micro-batch's logits on CUDA."""
    inner = config.inner
    if record.micro_batch_size is not None and record.micro_batch_size != inner.micro_batch_size:
        # An out-of-memory fallback shrank it before a restart: it does not grow back.
        return inner.model_copy(update={
            "micro_batch_size": record.micro_batch_size,
            "grad_accum_steps": inner.batch_size // record.micro_batch_size,
        })  # fmt: skip
    try:
        return fit_micro_batch(config, budget_bytes, device, whole_logits=compiled)
    except DoesNotFit as error:
        raise OutOfMemory(str(error)) from error


def unit_stop_at(grant: LeaseGrant, record: LeaseRecord) -> int:
    """The unit's length, the loop's bound (counted from the unit's start, a resumed
    checkpoint's steps included): the lease's steps. A unit stopped short of them and then
    killed while handing in resumes at its end, so it trains no more steps."""
    if record.phase == "uploading" and 0 < record.step < grant.steps:
        return record.step
    return grant.steps


class UnitStops:
    """Why the unit must stop short of its steps; `reason` keeps the first one."""

    def __init__(
        self, grant: LeaseGrant, stop: threading.Event, heartbeats: HeartbeatThread
    ) -> None:
        self.grant, self.stop, self.heartbeats = grant, stop, heartbeats
        self.started = time.monotonic()
        self.done = 0  # the unit's steps done, from its start, once a step ran here
        self.reason = ""

    def round_end(self) -> float | None:
        """Seconds until the unit must stop to upload before the round's deadline (a
        heartbeat interval ahead); a heartbeat may bring it forward (rounds.lifecycle.close)."""
        grant = self.grant
        left = seconds_until(self.heartbeats.round_deadline or grant.round_deadline)
        return None if left is None else left - grant.heartbeat_interval_s

    def must_stop(self) -> str | None:
        """Why the unit must stop now, whatever its steps (None: it may go on): what the
        rebase's wait gives up on."""
        if self.stop.is_set():
            return "stopped by a signal"
        if self.heartbeats.lease_lost.is_set():
            return self.heartbeats.lost_reason or "lease lost"
        left = self.round_end()
        if left is not None and left <= 0 and self.done:
            return "the round's deadline is near"
        return None

    def should_stop(self) -> bool:
        """The loop's question before each step; a calibration unit also stops at its time."""
        why = self.must_stop()
        limit = self.grant.seconds_limit
        late = limit is not None and time.monotonic() - self.started >= limit
        if why is None and late and self.done:
            why = f"calibration: {limit:.0f} s are up"
        if why is not None and not self.reason:
            self.reason = why
        return why is not None


class UnitProgress:
    """The loop's `on_step` and `on_fallback` for a lease: the volunteer's status line, and
    the lease's record (the newest checkpoint's step, a fallback's micro-batch)."""

    def __init__(
        self,
        grant: LeaseGrant,
        record: LeaseRecord,
        state: LeaseStateFile,
        reporter: Reporter,
        stops: UnitStops,
    ) -> None:
        self.grant, self.record, self.state = grant, record, state
        self.reporter, self.stops = reporter, stops

    def on_step(self, m: StepMetrics) -> None:
        self.stops.done = m.step
        speed = m.tokens / m.seconds if m.seconds > 0 else 0.0
        self.reporter.status(step=m.step, steps=self.grant.steps, loss=m.loss,
                             tokens_per_second=speed, lease_id=self.grant.lease_id)  # fmt: skip
        # The step of the newest checkpoint written to disk (the library writes them in the
        # background, by time): what a restart resumes from.
        if m.checkpointed_step > self.record.step:
            self.record.step = m.checkpointed_step
            self.state.save(self.record)

    def on_fallback(self, old: InnerConfig, new: InnerConfig) -> None:
        self.record.micro_batch_size = new.micro_batch_size
        self.state.save(self.record)
        self.reporter.event(
            "fallback", f"out of memory: micro-batch {old.micro_batch_size} -> "
            f"{new.micro_batch_size}, accumulation {new.grad_accum_steps} (same batch)",
        )  # fmt: skip


class SlowSource:
    """A token source that sleeps before each micro-batch (--step-delay): inside the timed
    part of a step, so the speed the agent reports, and the server sizes units by, is the
    slower one."""

    def __init__(self, source: UnitRows, delay_s: float) -> None:
        self.source, self.delay_s = source, delay_s

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        time.sleep(self.delay_s)
        return self.source.batch(position, batch_size, seq_len)

    def close(self) -> None:
        self.source.close()


def unit_source(
    config: RunConfig,
    data: UnitData,
    fetch: Callable[[ChunkRef], Path],
    *,
    step_delay_s: float,
    accum: int,
) -> UnitRows | SlowSource:
    """The unit's windows in the path's order, streamed from its row chunks as the trainer
    reaches them (dipaco.data.rows.UnitRows: the next chunk fetched while one trains, two
    held at most, none before a resumed unit's position); `fetch` gives a chunk's verified
    local copy. The same batches as dipaco simulate's ShardSource at those positions."""
    seq_len = config.model.seq_len
    if data.format != FORMAT or data.seq_len != seq_len:
        raise ValueError(
            f"the server sent training data as {data.format!r} rows of seq_len {data.seq_len}; "
            f"this agent reads {FORMAT!r} at the run's seq_len {seq_len}: upgrade the agent "
            "(pip install -U dipaco)"
        )
    chunks = data.chunks

    def load(i: int) -> np.ndarray:
        ref = chunks[i]
        return rows_of(fetch(ref), data.dtype, ref.rows, seq_len, ref.chunk)

    segments = [Segment(c.chunk, c.start, c.count, c.perm_seed) for c in chunks]
    source = UnitRows(segments, [c.rows for c in chunks], load, data.first_position, seq_len)
    if step_delay_s:
        return SlowSource(source, step_delay_s / accum)
    return source
