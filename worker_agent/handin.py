"""Handing a trained unit's Δ in: the patience rule, and the thread it runs on.

A unit's edges overlap (docs/design.md §8): once a unit has trained, its Δ is encoded,
uploaded and completed (in that order, as the server expects) on a `HandInThread` while
the agent asks for its next lease, fetches that unit's weights and data and trains it.
The lease request names the lease being handed in (``POST /worker/lease?handing_in=<id>``),
which the server then leaves out of the worker's lease limit: one lease training, one
handing in, never more (the agent waits for a hand-in before it starts the next).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dipaco.config import RunConfig
from dipaco.inner import InnerResult, InnerState
from dipaco.retry import HAND_IN_PAUSE_S
from worker_agent.client import Client, Contribution, LeaseGrant, UploadTarget
from worker_agent.errors import ServerUnreachable
from worker_agent.payload import EncodedDelta, encode_deltas
from worker_agent.progress import Reporter
from worker_agent.rebase import Rebaser, rebased_versions
from worker_agent.retry import is_transient
from worker_agent.transfer import Transfers, disk_errors

__all__ = ["HandInThread", "TrainedUnit", "hand_in", "send_unit"]


def hand_in(
    send: Callable[[], None],
    *,
    until: float,
    stop: threading.Event,
    on_wait: Callable[[BaseException, float], None] | None = None,
    pause_s: float = HAND_IN_PAUSE_S,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """`send()` a trained unit's Δ (upload URLs, uploads, completion) until it goes through.

    Work in hand is worth more than a request: a server or store that cannot be reached, or
    answers 5xx/429, through the client's own tries (about 2 minutes: an overload, a restart,
    the volunteer's network) is tried again every `pause_s` until `until` (monotonic), the
    last moment its round may still take it. An answer that cannot change (a 4xx: the round
    closed, the lease was taken over) is raised at once, as is the last failure once
    `until` has passed or `stop` is set (the state file keeps the unit for a restart).
    """
    while True:
        try:
            send()
            return
        except Exception as error:
            if not (isinstance(error, ServerUnreachable) or is_transient(error)):
                raise
            pause = min(pause_s, until - clock())
            if pause <= 0 or stop.is_set():
                raise
            if on_wait is not None:
                on_wait(error, pause)
            if stop.wait(pause):
                raise


class HandInThread:
    """One trained unit's hand-in, run by `work` on its own thread.

    `work` handles what it can (a lease gone, a stop) itself; anything it raises is kept and
    raised again by `wait`, on the agent's thread, which then ends as it would have had the
    hand-in run there.
    """

    def __init__(
        self,
        lease_id: int,
        run_id: int,
        path: int,
        work_dir: Path,
        work: Callable[[], None],
        *,
        before_next_lease: bool = False,
    ) -> None:
        self.lease_id, self.run_id, self.path, self.work_dir = lease_id, run_id, path, work_dir
        # In before the next lease is asked for: a calibration unit's completion reports the
        # speed the server sizes that lease by.
        self.before_next_lease = before_next_lease
        self._work = work
        self._error: BaseException | None = None
        # Set once the fp32 Δ is encoded and let go (or the hand-in ended): the next unit
        # trains after it, so the two never hold their memory at once (`send_unit`).
        self.encoded = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"dipaco-hand-in-{lease_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._work()
        except Exception as error:  # kept for `wait`, on the agent's thread
            self._error = error
        finally:
            self.encoded.set()

    def wait_encoded(self) -> None:
        """Until the Δ is encoded and its fp32 copy let go (the upload may go on)."""
        self.encoded.wait()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Until the hand-in is over; raises what it could not handle (once)."""
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error


@dataclass
class TrainedUnit:
    """A unit that has trained, as its hand-in needs it."""

    grant: LeaseGrant
    config: RunConfig
    result: InnerResult
    work: Path  # the unit's work directory: its encoded Δs go under deltas/
    salvaged: str  # why a partial Δ stopped early ("" for a unit that trained its steps)
    rebaser: Rebaser | None  # outer.overlap eager's hook, if the unit had one
    micro_batch: int = 0  # the micro-batch it trained with (reported)


def _encode(unit: TrainedUnit, data_dir: Path) -> tuple[list[EncodedDelta], InnerState]:
    """The unit's Δ encoded under its work folder. The encoded files are what goes up: the
    fp32 Δ (4 bytes a parameter) is let go as each module is encoded, not after the
    upload, while the next unit trains."""
    result = unit.result
    deltas, result.delta, result.module_deltas = result.module_deltas, {}, {}
    with disk_errors(data_dir):
        return encode_deltas(deltas, unit.config, unit.work / "deltas", result.state,
                             release=True)  # fmt: skip


def send_unit(
    unit: TrainedUnit,
    *,
    until: float,
    client: Client,
    transfers: Transfers,
    reporter: Reporter,
    stop: threading.Event,
    pause_s: float,
    data_dir: Path,
    on_encoded: Callable[[], None] | None = None,
) -> tuple[dict[str, float], InnerState]:
    """Encode the unit's Δ, upload it and complete its lease (`hand_in`'s patience); returns
    the completion's metrics and the path's next inner state (to keep once accepted).
    `on_encoded()` is called once the fp32 Δ is encoded and let go."""
    grant, result, work, rebaser = unit.grant, unit.result, unit.work, unit.rebaser
    encoded, state = _encode(unit, data_dir)
    if on_encoded is not None:
        on_encoded()
    steps = len(result.losses)
    tail = result.losses[-max(1, steps // 10) :]
    metrics = {
        "loss": sum(tail) / len(tail),
        "tokens_per_second": result.tokens_per_second,
        "train_seconds": result.seconds,
        "steps": float(steps),
    }
    relative_to = None
    if grant.rebase is not None:
        # The marker says whether this unit's Δ is relative to the rebased versions
        # (also after a resume past the rebase); else to its base, as delayed.
        relative_to = rebased_versions(work, grant.rebase, steps)
        metrics["rebased"] = 0.0 if relative_to is None else 1.0
        waited = rebaser.waited_s if rebaser is not None else 0.0
        metrics["rebase_wait_s"] = waited
        if relative_to is None and steps >= grant.rebase.at_step:
            why = rebaser.fallback if rebaser is not None and rebaser.fallback else "resumed"
            reporter.event(
                "rebase_fallback", f"lease {grant.lease_id}: no rebase at step "
                f"{grant.rebase.at_step} ({why}); its Δ is relative to its base versions "
                f"{grant.base_versions} (as outer.overlap delayed)",
                at_step=grant.rebase.at_step, reason=why, waited_s=waited,
            )  # fmt: skip
    contributions = [Contribution(d.module_id, d.sha256, d.size) for d in encoded]
    targets: dict[str, UploadTarget] = {}
    uploaded: set[str] = set()

    def send() -> None:
        """Upload URLs, the uploads not yet done, the completion (a replay of which
        answers as the first); fresh URLs after a failure short of the completion."""
        if not targets or len(uploaded) < len(encoded):
            targets.update(client.upload_urls(grant.lease_id, grant.secret))
        for delta in encoded:
            if delta.module_id not in uploaded:
                transfers.upload(targets[delta.module_id], delta.path)
                uploaded.add(delta.module_id)
        client.complete(
            grant.lease_id, grant.secret, contributions, result.tokens, metrics,
            base_versions=relative_to,
        )  # fmt: skip

    hand_in(
        send, until=until, stop=stop, pause_s=pause_s,
        on_wait=lambda error, pause: reporter.event(
            "hand_in_wait", f"lease {grant.lease_id}: handing in its Δ failed ({error}); "
            f"trying again in {pause:.3g} s, as long as its round may take it",
            lease_id=grant.lease_id, wait_s=pause,
        ),
    )  # fmt: skip
    if unit.salvaged:
        reporter.event(
            "salvaged", f"lease {grant.lease_id}: the partial Δ of {steps} of {grant.steps} "
            f"steps ({result.tokens:,} tokens) was uploaded and completed ({unit.salvaged})",
            steps=steps, tokens=result.tokens, reason=unit.salvaged,
        )  # fmt: skip
    return metrics, state
