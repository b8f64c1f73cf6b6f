"""Local volunteers: `dipaco-worker --json-logs` processes and what they report.

Each worker has its own data dir (identity, blob cache, AdamW state) under the demo's
data dir and keeps it between demos: a worker enrolled with this server (same URL) runs
without ``--enroll``, any other enrolls again. A thread per process reads its JSON lines,
keeps the latest step and unit figures for the progress panel, and appends every line to
the worker's log file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from dipaco_server.cli.server import die_with_parent

STOP_TIMEOUT_S = 30.0  # a worker finishes its step, releases its lease, exits 0


def worker_command() -> list[str]:
    """`dipaco-worker` as installed beside this interpreter, else through the module."""
    script = Path(sys.executable).with_name("dipaco-worker")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from worker_agent.cli import main; sys.exit(main())"]


def enrolled_with(data_dir: Path) -> str | None:
    """The server URL a worker data dir is enrolled with, or None."""
    try:
        return str(json.loads((data_dir / "worker.json").read_text("utf-8"))["server"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class WorkerStatus:
    """The latest of what one worker printed."""

    name: str
    state: str = "starting"
    round: int | None = None
    path: int | None = None
    step: int = 0
    steps: int = 0
    loss: float | None = None  # of the last step
    unit_loss: float | None = None  # of the last completed unit (mean of its last steps)
    tokens_per_second: float = 0.0
    units_done: int = 0
    error: str | None = None
    lines: list[str] = field(default_factory=list)  # the last few, for error reports


class WorkerProcess:
    def __init__(self, name: str, data_dir: Path, log_path: Path) -> None:
        self.name, self.data_dir, self.log_path = name, data_dir, log_path
        self.status = WorkerStatus(name)
        self.process: subprocess.Popen[str] | None = None
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None

    def start(self, server: str, enrollment: str, environ: dict[str, str]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        command = [*worker_command(), "--server", server, "--data-dir", str(self.data_dir),
                   "--name", self.name, "--json-logs", "--threads", "1",
                   "--probe-seconds", "0.2", "--checkpoint-every", "1000"]  # fmt: skip
        if enrolled_with(self.data_dir) != server.rstrip("/"):
            (self.data_dir / "worker.json").unlink(missing_ok=True)
            (self.data_dir / "lease.json").unlink(missing_ok=True)
            command += ["--enroll", enrollment]
        self.process = subprocess.Popen(
            command, env={**environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, name=f"{self.name}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                self._take(line)

    def _take(self, line: str) -> None:
        try:
            event: dict[str, Any] = json.loads(line)
        except ValueError:
            event = {"event": "output", "message": line.rstrip()}
        if not isinstance(event, dict):
            return
        with self._lock:
            s = self.status
            s.lines = [*s.lines[-19:], line.rstrip()]
            kind = event.get("event")
            if kind == "step":
                s.state, s.step, s.steps = "training", event.get("step", 0), event.get("steps", 0)
                s.loss = event.get("loss", s.loss)
                s.tokens_per_second = event.get("tokens_per_second", s.tokens_per_second)
            elif kind == "lease":
                s.state, s.step = "fetching", 0
                s.round, s.path = event.get("round"), event.get("path")
            elif kind == "completed":
                s.unit_loss = event.get("loss", s.unit_loss)
                # the hand-in may end while the next unit trains: that one's state stays
                if (event.get("round"), event.get("path")) == (s.round, s.path):
                    s.state = "uploaded"
                s.units_done = event.get("units_done", s.units_done + 1)
            elif kind == "idle":
                s.state = "waiting for work"
            elif kind == "error":
                s.state, s.error = "failed", str(event.get("message"))

    def snapshot(self) -> WorkerStatus:
        with self._lock:
            s = self.status
            return WorkerStatus(**{**s.__dict__, "lines": list(s.lines)})

    def exit_code(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal_stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        if self.process is None:
            return None
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return code


class WorkerPool:
    def __init__(self, root: Path, logs: Path, count: int) -> None:
        self.workers = [
            WorkerProcess(f"demo-worker-{i}", root / f"worker-{i}", logs / f"worker-{i}.log")
            for i in range(count)
        ]

    def start(self, server: str, enrollment: str, environ: dict[str, str]) -> None:
        for worker in self.workers:
            worker.start(server, enrollment, environ)

    def snapshots(self) -> list[WorkerStatus]:
        return [w.snapshot() for w in self.workers]

    def failed(self) -> list[tuple[WorkerProcess, int]]:
        """Workers that exited, with their exit codes (they run until told to stop)."""
        return [(w, code) for w in self.workers if (code := w.exit_code()) is not None]

    def stop(self) -> None:
        for worker in self.workers:
            worker.signal_stop()
        for worker in self.workers:
            worker.wait()

    def report(self, out: IO[str]) -> None:
        for worker in self.workers:
            tail = "\n    ".join(worker.snapshot().lines[-8:])
            print(f"  {worker.name} (log {worker.log_path}):\n    {tail}", file=out)
