"""The demo's live panel: the stage (phase 1, between the phases, phase 2), rounds and
units, the validation curve with phase 2's start marked, each worker's step and loss, the
dense baselines' progress; events are printed above it as log lines.

On a terminal the panel redraws four times a second; elsewhere (a pipe, a CI log) only
the log lines are printed, so the output stays readable.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from dipaco_demo.workers import WorkerStatus


@dataclass
class PanelState:
    title: str = "dipaco demo"
    stage: str = "starting"
    rounds: int = 0  # of both phases
    phase1_rounds: int = 0  # rounds 0 .. phase1_rounds - 1 train the dense model
    round: int | None = None
    units_total: int = 0  # over the whole run
    units_done: int = 0
    # round -> validation loss: the dense model's in phase 1, routed over paths in phase 2
    routed: dict[int, float] = field(default_factory=dict)
    workers: list[WorkerStatus] = field(default_factory=list)
    dense_name: str = ""  # the baseline training now: "equal wall-clock", "equal tokens"
    dense_step: int = 0
    dense_steps: int = 0
    dense_loss: float | None = None


class DemoDisplay:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.state = PanelState()
        self._lock = threading.Lock()
        self.live: Live | None = None
        if console.is_terminal:
            self.live = Live(
                console=console, get_renderable=self._render, refresh_per_second=4,
                transient=True,
            )  # fmt: skip

    def __enter__(self) -> DemoDisplay:
        if self.live is not None:
            self.live.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def update(self, **fields: Any) -> None:
        with self._lock:
            for name, value in fields.items():
                setattr(self.state, name, value)

    def log(self, message: str) -> None:
        self.console.log(message, highlight=False)

    def _render(self) -> RenderableType:
        with self._lock:
            s = PanelState(**self.state.__dict__)
        total = max(1, s.units_total)
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan", justify="right")
        grid.add_column()
        grid.add_row("stage", s.stage)
        if s.round is not None:
            bar = ProgressBar(total=total, completed=s.units_done, width=30)
            phase = ""
            if s.phase1_rounds:
                phase = "  phase 1 (dense)" if s.round < s.phase1_rounds else "  phase 2 (DiPaCo)"
            text = f"round {s.round + 1}/{s.rounds}{phase}  units {s.units_done}/{total}"
            grid.add_row("training", Group(Text(text), bar))
        if s.routed:
            grid.add_row("val loss", curve(s.routed, s.phase1_rounds))
        for w in s.workers:
            # The agent's events carry the 0-based index; people read rounds from 1.
            where = (
                f"round {w.round + 1} path {w.path}"
                if w.path is not None and w.round is not None
                else ""
            )
            step = f"step {w.step}/{w.steps}" if w.steps else ""
            loss = f"loss {w.loss:.3f}" if w.loss is not None else ""
            speed = f"{w.tokens_per_second:,.0f} tok/s" if w.tokens_per_second else ""
            figures = "  ".join(x for x in (where, step, loss, speed, f"units {w.units_done}") if x)
            grid.add_row(w.name, f"{w.state}  {figures}")
        if s.dense_steps:
            loss = f"  loss {s.dense_loss:.3f}" if s.dense_loss is not None else ""
            grid.add_row("dense", f"{s.dense_name}: step {s.dense_step}/{s.dense_steps}{loss}")
        return Group(Text(s.title, style="bold"), grid)


def curve(losses: dict[int, float], phase1_rounds: int, last: int = 6) -> str:
    """The last rounds' validation losses (rounds counted from 1), "|" where phase 2 starts."""
    shown = sorted(losses.items())[-last:]
    parts = []
    for t, loss in shown:
        if phase1_rounds and t == phase1_rounds:
            parts.append("| phase 2, routed:")
        parts.append(f"r{t + 1}: {loss:.3f}")
    if not phase1_rounds:
        return "routed, after each round: " + "  ".join(parts)
    head = "phase 1, dense:" if shown[0][0] < phase1_rounds else "phase 2, routed:"
    if parts[0] == "| phase 2, routed:":
        parts.pop(0)
    return f"{head} " + "  ".join(parts)
