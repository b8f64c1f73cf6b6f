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
from pathlib import Path

from dipaco.retry import HAND_IN_PAUSE_S
from worker_agent.errors import ServerUnreachable
from worker_agent.retry import is_transient

__all__ = ["HandInThread", "hand_in"]


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

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        """Until the hand-in is over; raises what it could not handle (once)."""
        self._thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error
