"""What the agent tells its user: a live terminal panel, or one JSON object per line.

Both reporters take the same calls: `event(name, message, **fields)` for things that
happen (lease, fetched, completed, retry, fallback, stopping...) and `status(**fields)`
for the numbers the panel shows (run, path, step/H, loss, tokens/s, units done).
Transfer bytes and speed are read from the TransferMeter at each refresh.

``--json-logs`` lines look like::

    {"time": "2025-01-01T12:00:00.000Z", "event": "step", "step": 3, "steps": 20, ...}

Log records of the agent's modules (retries, warnings) are routed through the same
reporter, so a headless machine's log is one JSON stream.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from datetime import UTC, datetime
from typing import IO, Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.logging import RichHandler
from rich.table import Table
from rich.text import Text

from worker_agent.transfer import TransferMeter

__all__ = ["JsonReporter", "Reporter", "RichReporter", "human_bytes"]

STEP_EVENT_EVERY_S = 1.0  # --json-logs: at most one "step" line a second (and the last step)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


class Reporter:
    """The interface both output modes implement; also a silent reporter for tests."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {"units_done": 0}
        self.meter: TransferMeter | None = None
        # Re-entrant: the signal handler reports from the main thread, maybe mid-report.
        self._lock = threading.RLock()

    def event(self, name: str, message: str, **fields: Any) -> None:
        with self._lock:
            self.fields.update(fields)

    def status(self, **fields: Any) -> None:
        with self._lock:
            self.fields.update(fields)
            if "step" in fields:  # for --metrics-port: how long training has been still
                self.fields["last_step_at"] = time.time()

    def log_handler(self) -> logging.Handler:
        return logging.NullHandler()

    def close(self) -> None:
        pass


class JsonReporter(Reporter):
    def __init__(self, stream: IO[str] | None = None) -> None:
        super().__init__()
        self.stream = stream or sys.stdout
        self._last_step_line = 0.0

    def _emit(self, record: dict[str, Any]) -> None:
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        line = json.dumps({"time": stamp, **record}, default=str)
        with self._lock:
            self.stream.write(line + "\n")
            self.stream.flush()

    def event(self, name: str, message: str, **fields: Any) -> None:
        super().event(name, message, **fields)
        self._emit({"event": name, "message": message, **fields})

    def status(self, **fields: Any) -> None:
        super().status(**fields)
        if "step" not in fields:
            return
        now = time.monotonic()
        last = fields.get("step") == fields.get("steps")
        if last or now - self._last_step_line >= STEP_EVENT_EVERY_S:
            self._last_step_line = now
            self._emit({"event": "step", **fields})

    def log_handler(self) -> logging.Handler:
        reporter = self

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                reporter._emit(
                    {"event": "log", "level": record.levelname.lower(), "logger": record.name,
                     "message": record.getMessage()}
                )  # fmt: skip

        return Handler()


class RichReporter(Reporter):
    """A live panel on a terminal; plain timestamped lines when output is not a terminal."""

    def __init__(self, console: Console | None = None) -> None:
        super().__init__()
        self.console = console or Console(stderr=False)
        self.live: Live | None = None
        self._last_line = 0.0
        if self.console.is_terminal:
            self.live = Live(
                console=self.console,
                get_renderable=self._render,
                refresh_per_second=4,
                transient=False,
            )
            self.live.start()

    def event(self, name: str, message: str, **fields: Any) -> None:
        super().event(name, message, **{**fields, "state": message})
        self._line(Text(message))

    def status(self, **fields: Any) -> None:
        super().status(**fields)
        if self.live is not None or "step" not in fields:
            return
        now = time.monotonic()  # no panel: a progress line every 10 s, and the last step
        if fields.get("step") == fields.get("steps") or now - self._last_line >= 10.0:
            self._last_line = now
            self._line(
                Text(
                    f"step {fields['step']}/{fields.get('steps')}  loss "
                    f"{fields.get('loss', 0):.4f}  "
                    f"{fields.get('tokens_per_second', 0):,.0f} tokens/s"
                )
            )

    def _line(self, message: Text) -> None:
        """A line with its time, as RichHandler writes the agent's log records. Not
        console.log, which ends every line with its caller's source location
        ("progress.py:130"): nothing a volunteer can use, and noise in a piped log."""
        stamp = Text(datetime.now().strftime("[%X]"), style="log.time")
        self.console.print(
            Text.assemble(stamp, " ", message), soft_wrap=not self.console.is_terminal
        )

    def log_handler(self) -> logging.Handler:
        return RichHandler(console=self.console, show_path=False, markup=False)

    def _render(self) -> RenderableType:
        with self._lock:
            f = dict(self.fields)
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", justify="right")
        table.add_column()
        if "run" in f:
            # people count rounds from 1, as the dashboard does; the JSON field stays 0-based
            number = f["round"] + 1 if isinstance(f.get("round"), int) else "?"
            table.add_row("run", f"{f['run']}  round {number}  path {f.get('path')}")
        if "step" in f:
            loss = f.get("loss")
            table.add_row("step", f"{f['step']}/{f.get('steps', '?')}")
            table.add_row("loss", "-" if loss is None else f"{loss:.4f}")
            table.add_row("tokens/s", f"{f.get('tokens_per_second', 0.0):,.0f}")
        if self.meter is not None:
            moved, speed = self.meter.total_bytes, self.meter.bytes_per_second
            table.add_row("transfer", f"{human_bytes(moved)} ({human_bytes(speed)}/s)")
        table.add_row("units done", str(f.get("units_done", 0)))
        table.add_row("state", str(f.get("state", "starting")))
        return Group(Text("dipaco-worker", style="bold"), table)

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
