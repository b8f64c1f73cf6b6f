"""What the staff buttons on a run page do, through the same services as the admin API.

start: draft → preparing (data and modules get prepared), or ready → running with round
0 opened in the same transaction; pause: running → paused; resume: paused → running;
cancel: any live state → cancelled. A move the run's state does not allow raises
InvalidTransition, whose message says what is allowed.
"""

from __future__ import annotations

from collections.abc import Callable

from dipaco_server.rounds.services import start_run
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import transition


def _start(run: Run) -> Run:
    if run.state == Run.State.DRAFT:
        return transition(run, Run.State.PREPARING)
    if run.state == Run.State.READY:
        start_run(run)
        return run
    return transition(run, Run.State.RUNNING)  # refused with the allowed moves named


ACTIONS: dict[str, Callable[[Run], Run]] = {
    "start": _start,
    "pause": lambda run: transition(run, Run.State.PAUSED),
    "resume": lambda run: transition(run, Run.State.RUNNING),
    "cancel": lambda run: transition(run, Run.State.CANCELLED),
}


def perform(run: Run, action: str) -> Run:
    """Apply ``action`` (a key of ACTIONS) to ``run``; KeyError for an unknown one."""
    return ACTIONS[action](run)
