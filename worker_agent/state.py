"""The lease being worked on, on disk, so that a restart after ``kill -9`` can resume it.

``lease.json`` (0600: it holds the lease's secret) is written atomically when a lease is
granted, at each checkpoint (with the step reached) and when training ends; it is removed
once the unit is completed or released. On start, a saved lease that the server still
calls active is resumed (its checkpoint continues training); any other is dropped along
with its work directory.

The file names one lease: the one training, or the one being handed in until the next is
granted. A hand-in that ends on its own thread clears it only while it still names that
lease (`clear(lease_id)`), never the next unit's.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from worker_agent.config import write_private_json

__all__ = ["LeaseRecord", "LeaseStateFile"]

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

    def save(self, record: LeaseRecord) -> None:
        with self._lock:
            record.updated_at = time.time()
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
        """Remove the file; given `lease_id`, only while it names that lease."""
        with self._lock:
            if lease_id is not None:
                saved = self.load()
                if saved is not None and saved.lease_id != lease_id:
                    return
            self.path.unlink(missing_ok=True)
