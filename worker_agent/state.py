"""The lease being worked on, on disk, so that a restart after ``kill -9`` can resume it.

``lease.json`` (0600: it holds the lease's secret) is written atomically when a lease is
granted, at each checkpoint (with the step reached) and when training ends; it is removed
once the unit is completed or released. On start, a saved lease that the server still
calls active is resumed (its checkpoint continues training); any other is dropped along
with its work directory.

The file names one lease. While a trained unit is handed in (on its own thread, while the
next unit trains: worker_agent.handin) it names that one (`hold`), so that a restart
after ``kill -9`` hands its Δ in; the next unit's record waits in memory and is written
when the hand-in ends (`clear` of the held lease). A crash meanwhile loses the next
unit's progress only: its lease expires and the server gives its unit back.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dipaco.config import RunConfig
from dipaco.inner import InnerState, state_fingerprint
from dipaco.tensorfile import FileTensors
from worker_agent.config import write_private_json

__all__ = ["InnerStates", "LeaseRecord", "LeaseStateFile"]

log = logging.getLogger(__name__)
STATE_NAME = "lease.json"


@dataclass
class LeaseRecord:
    server: str
    lease: dict[str, Any]  # the lease answer as received (client.lease_from_json reads it)
    step: int = 0
    phase: str = "training"  # training | uploading
    micro_batch_size: int | None = None  # after an out-of-memory fallback
    updated_at: float = 0.0

    @property
    def lease_id(self) -> int:
        return int(self.lease["lease_id"])


class LeaseStateFile:
    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / STATE_NAME
        self._lock = threading.Lock()
        self._held: int | None = None  # the lease in hand-in the file keeps naming
        self._pending: LeaseRecord | None = None  # another lease's record, written after

    def hold(self, lease_id: int) -> None:
        """Keep the file naming `lease_id` (saved already) until it is cleared."""
        with self._lock:
            self._held = lease_id

    def save(self, record: LeaseRecord) -> None:
        with self._lock:
            record.updated_at = time.time()
            if self._held is not None and record.lease_id != self._held:
                self._pending = record
                return
            write_private_json(self.path, asdict(record))

    def load(self) -> LeaseRecord | None:
        if not self.path.exists():
            return None
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            return LeaseRecord(**raw)
        except (ValueError, TypeError) as exc:
            log.warning("ignoring the damaged %s (%s); starting clean", self.path, exc)
            return None

    def clear(self, lease_id: int | None = None) -> None:
        """Remove the file; given `lease_id`, only while it names that lease. Clearing the
        held lease writes the record that waited for it, if any."""
        with self._lock:
            if self._pending is not None and self._pending.lease_id == lease_id:
                self._pending = None
            if lease_id is not None:
                saved = self.load()
                if saved is not None and saved.lease_id != lease_id:
                    return
            self.path.unlink(missing_ok=True)
            if self._held is not None and lease_id in (None, self._held):
                self._held, pending, self._pending = None, self._pending, None
                if pending is not None:
                    write_private_json(self.path, asdict(pending))


class InnerStates:
    """The warm `InnerState` of each (run, path) under ``<root>/run-<id>/path-<p>.safetensors``.

    Written with `InnerState.save` (atomic) once the server accepted the unit that made it
    (worker_agent.agent), and read with `InnerState.load`, which returns None for a missing,
    torn or foreign file, or one made for another model or other betas
    (`dipaco.inner.state_fingerprint`): the unit then starts with fresh moments.

    The last state saved is also kept in memory, and `load` returns that very object: its
    moments are the tensors the resident trainer returned, so the path's next unit keeps
    the moments still in the optimizer instead of reading 2 GB back in at 150M
    (`dipaco.inner.PathTrainer.train_path`). A refused completion saves nothing, so the
    next unit gets the last accepted state, whose tensors are not the resident ones.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._last: tuple[int, int, InnerState] | None = None

    def path_for(self, run_id: int, path: int) -> Path:
        return self.root / f"run-{int(run_id)}" / f"path-{int(path)}.safetensors"

    def load(self, run_id: int, path: int, config: RunConfig) -> InnerState | None:
        fingerprint = state_fingerprint(config)
        last = self._last
        if last is not None and last[:2] == (run_id, path) and last[2].fingerprint == fingerprint:
            return last[2]
        return InnerState.load(self.path_for(run_id, path), fingerprint)

    def save(self, run_id: int, path: int, state: InnerState) -> None:
        if state.adam:  # a unit that never stepped has nothing worth keeping
            target = self.path_for(run_id, path)
            state.save(target)
            if isinstance(state.adam, FileTensors):  # read from the unit's checkpoint, which
                # goes: read from the saved copy instead (the same mapping, so the trainer
                # still knows it for the moments it holds)
                state.adam.reopen(target, {key: f"adam/{key}" for key in state.adam})
            # The residual is read from the saved copy too, a module at a time when the
            # path's next Δ is encoded: not held while the next units train.
            state.residual = FileTensors(target, {k: f"residual/{k}" for k in state.residual})
            self._last = (run_id, path, state)
