"""Verification's one entry point (rounds.verification.judge): the outer step reads fetch,
judge, aggregate, Nesterov step, publish, and reaches into no verification module but it."""

from __future__ import annotations

import ast
from pathlib import Path

STEP = Path(__file__).resolve().parents[1] / "platform/dipaco_server/rounds/outer/step.py"


def test_the_outer_step_imports_verification_through_judge_alone() -> None:
    tree = ast.parse(STEP.read_text())
    reached = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("dipaco_server.rounds.verification"):
                reached.add(node.module.rsplit(".", 1)[-1])
            assert not node.module.startswith("dipaco_server.rounds.protocol"), node.module
    # judge, plus the names of its outcomes: a verdict's type, the first round's reasons,
    # the carried Δs a step gathers and the kept files it forgets after its commit.
    assert reached <= {"judge", "uploads", "first_round", "settlement", "arrival"}, reached
    assert "judge" in reached
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)
             and isinstance(n.func, ast.Name)}  # fmt: skip
    assert {"judge", "step_judged", "settle"} <= calls
    assert "check_contributions" not in calls
