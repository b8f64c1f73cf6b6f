"""What the staff buttons on a run page do: the admin API's own service,
dipaco_server.runs.actions (prepare, start, pause, resume, cancel), so a button and an API
call make the same move with the same checks and errors."""

from __future__ import annotations

from dipaco_server.runs.actions import ACTIONS, perform

__all__ = ["ACTIONS", "perform"]
