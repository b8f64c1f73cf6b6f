"""What a run's life cycle asks of the app built on runs, which runs must not import.

runs sits below rounds in the server's layers (tests/test_layers.py): a run decides when a
round is due (it starts; phase 2 is ready) and when its leases must end (it ended), but
rounds owns rounds and leases. So runs sends a signal, and the receivers rounds connects
(rounds.lifecycle.receivers, when the app is ready) do the work synchronously, in the sender's
transaction: an error a receiver raises reaches the sender as if it had made the call.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.dispatch import Signal

from dipaco_server.runs.models import Run

round_due = Signal()  # run=, t=: open round t of run (rounds.lifecycle.open.open_round)
run_ended = Signal()  # run=, now=: run moved to a final state; its active leases end


def open_round(run: Run, t: int) -> Any:
    """Open round `t` of `run` through rounds (rounds.lifecycle.open.open_round, whose errors it
    raises); the round opened, or the one already open."""
    answers = round_due.send(sender=Run, run=run, t=t)
    if not answers:
        raise ImproperlyConfigured(
            "nothing opens rounds: add dipaco_server.rounds to INSTALLED_APPS"
        )
    return answers[0][1]
