"""outer.overlap "eager" on the worker: the unit's rebase onto the previous round's versions.

A lease of an eager round may say `rebase` (platform rounds.protocol.rebase): after step
`at_step` the unit adds (v_t − v_{t-1}) to its live weights and its Δ becomes relative to
v_t, the versions round t − 1's outer step publishes while this unit trains
(`dipaco.inner.run_inner_loop(rebase=)`, the shift from `dipaco.inner.path_shift`, as
`dipaco simulate` computes it). `Rebaser` is that hook:

- at `at_step` exactly, and nowhere else, so two workers that train the same unit (a check
  copy) rebase at the same step and compute the same thing;
- it asks the server for the versions (GET .../rebase); while round t − 1 still steps it
  waits there, asking again with bounded backoff (heartbeats go on in their thread), and
  gives up when the agent must stop (a signal, the lease lost, the round's deadline) or
  when waiting longer would leave too little of the lease's hard deadline to train the
  remaining steps;
- the versions come as the manifest's modules do (worker_agent.downloads: encoded updates
  from the base versions the agent holds, checked to the server's sha256, or whole files);
- a marker in the unit's work directory (``rebase.json``) says the unit rebased and onto
  what, written before the shift is applied, so a unit resumed from a checkpoint past
  `at_step` still reports its Δ relative to the versions it rebased onto.

A unit that gave up reports its Δ relative to its base versions: plain delayed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from dipaco.config import RunConfig
from dipaco.inner import path_shift
from worker_agent.client import BlobRef, RebaseAnswer, RebasePlan, seconds_until
from worker_agent.errors import LEASE_GONE, Interrupted, ServerError, ServerUnreachable
from worker_agent.payload import ModuleFileInvalid
from worker_agent.transfer import ChecksumMismatch

__all__ = ["MARKER_NAME", "Rebaser", "rebased_versions"]

log = logging.getLogger(__name__)
MARKER_NAME = "rebase.json"
POLL_FIRST_S, POLL_LONGEST_S = 0.5, 5.0  # the wait's backoff between asks


def rebased_versions(work_dir: Path, plan: RebasePlan, steps_done: int) -> dict[str, int] | None:
    """The versions the unit's Δ is relative to after a rebase (its marker), or None: the
    unit did not rebase (or has not reached `at_step`), its Δ is relative to its base."""
    if steps_done < plan.at_step:
        return None
    try:
        raw = json.loads((work_dir / MARKER_NAME).read_text())
        if int(raw["at_step"]) != plan.at_step:
            return None
        return {str(m): int(v) for m, v in raw["versions"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class Rebaser:
    """`rebase(step)` for `dipaco.inner.run_inner_loop` (see the module's docstring).

    `ask` is the server's GET .../rebase; `load` fetches the modules it names (checked,
    as module tensors); `give_up` says why the agent must not wait any longer (None: it
    may); `sleep(s)` waits (True when interrupted); `hard_deadline` is the lease's (ISO).
    """

    plan: RebasePlan
    config: RunConfig
    path: int
    base: Mapping[str, Mapping[str, Tensor]]  # the modules the unit started from
    work_dir: Path
    ask: Callable[[], RebaseAnswer]
    load: Callable[[list[BlobRef]], dict[str, dict[str, Tensor]]]
    give_up: Callable[[], str | None]
    sleep: Callable[[float], bool]
    hard_deadline: str | None = None
    steps: int = 0  # the lease's steps (to leave time for those after the rebase)
    margin_s: float = 30.0  # the upload's share of the lease's time
    on_wait: Callable[[], None] | None = None  # called once when it starts waiting
    versions: dict[str, int] | None = None  # set once rebased
    refs: list[BlobRef] = field(default_factory=list)  # the modules it rebased onto
    fallback: str = ""  # why it did not rebase, when it gave up
    waited_s: float = 0.0
    _first: tuple[int, float] | None = None  # (step, time) of the first call: step time
    _reached: float = 0.0  # when it reached at_step

    def __call__(self, step: int) -> dict[str, Tensor] | None:
        if self._first is None:
            self._first = (step, time.monotonic())
        if step != self.plan.at_step:
            return None
        marker = self.work_dir / MARKER_NAME
        marker.unlink(missing_ok=True)  # this pass through at_step decides anew
        started = self._reached = time.monotonic()
        try:
            answer = self._wait()
        finally:
            self.waited_s += time.monotonic() - started
        if answer is None:
            log.warning("no rebase at step %d: %s; the Δ stays relative to the unit's base "
                        "versions (outer.overlap delayed)", step, self.fallback)  # fmt: skip
            return None
        try:
            new = self.load(answer.modules)
        except (ServerError, ServerUnreachable, ChecksumMismatch, ModuleFileInvalid,
                Interrupted) as exc:  # fmt: skip
            if isinstance(exc, ServerError) and exc.code in LEASE_GONE:
                raise
            # A signal mid-download, or versions that do not check out: train on, as delayed
            # (the next should_stop salvages the Δ when it was a signal).
            self.fallback = f"the versions to rebase onto could not be fetched ({exc})"
            log.warning("no rebase at step %d: %s", step, self.fallback)
            return None
        self.refs = list(answer.modules)
        shift = path_shift(self.config, self.path, self.base, new)
        tmp = marker.with_name(marker.name + ".tmp")
        tmp.write_text(json.dumps({"at_step": self.plan.at_step, "versions": answer.versions}))
        os.replace(tmp, marker)  # before the shift is applied: a checkpoint after it has it
        self.versions = dict(answer.versions)
        return shift

    def _wait(self) -> RebaseAnswer | None:
        pause = POLL_FIRST_S
        while True:
            reason = self.give_up() or self._out_of_time()
            if reason:
                self.fallback = reason
                return None
            try:
                answer = self.ask()
            except ServerError as exc:
                if exc.code in LEASE_GONE:
                    raise  # the agent drops the unit (worker_agent.agent)
                self.fallback = f"the server refused the rebase ({exc.code}: {exc.message})"
                return None
            except ServerUnreachable as exc:  # the client retried already: wait, then again
                log.warning("asking for the rebase failed (%s); asking again", exc)
                answer = RebaseAnswer("waiting", {}, POLL_LONGEST_S, [])
            if answer.state == "ready":
                return answer
            if answer.state != "waiting":
                self.fallback = f"the server has no rebase for this unit ({answer.state})"
                return None
            if pause == POLL_FIRST_S and self.on_wait is not None:
                self.on_wait()
            wait = min(POLL_LONGEST_S, max(pause, answer.retry_after_s))
            if self.sleep(wait):
                self.fallback = self.give_up() or "stopped while waiting"
                return None
            pause = min(POLL_LONGEST_S, pause * 1.5)

    def _out_of_time(self) -> str | None:
        """A reason when waiting on would leave too little of the lease to train the rest."""
        left = seconds_until(self.hard_deadline)
        if left is None or self._first is None:
            return None
        first_step, first_at = self._first
        timed = self.plan.at_step - first_step  # steps trained between the two calls
        per_step = (self._reached - first_at) / timed if timed > 0 else 0.0
        need = max(0, self.steps - self.plan.at_step) * per_step + self.margin_s
        if left < need:
            return (
                f"the lease's hard deadline is {left:.0f} s away and the "
                f"remaining steps need about {need:.0f} s"
            )
        return None
