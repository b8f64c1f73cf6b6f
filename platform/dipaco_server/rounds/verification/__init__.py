"""Every acceptance check of an outer step, in one place (docs/design.md §7, issue 34).

The outer step (rounds.outer_step) calls two things: `check_contributions` before it
aggregates (format, history, direction, proof of useful work, replication: the verdicts),
and `settle` inside its commit (counts, trust, credit). The rules themselves are pure
functions in rounds.verify, which bench/attacks.py runs too.
"""

from dipaco_server.rounds.verification.checks import aggregated, check_contributions
from dipaco_server.rounds.verification.context import (
    check_copies,
    norm_history,
    outer_momentum,
    replayed,
    replica_past,
)
from dipaco_server.rounds.verification.credit import settle
from dipaco_server.rounds.verification.scorer import Scorer
from dipaco_server.rounds.verification.uploads import ScoreFn, Upload, Verdict, check_upload

__all__ = [
    "ScoreFn",
    "Scorer",
    "Upload",
    "Verdict",
    "aggregated",
    "check_contributions",
    "check_copies",
    "check_upload",
    "norm_history",
    "outer_momentum",
    "replayed",
    "replica_past",
    "settle",
]
