"""The embedded broker: kombu's filesystem transport, stopping as soon as its worker stops.

Celery consumes a polling transport (no event loop to wake) with ``synloop``, which drains
for 2 s at a time and, once a shutdown signal has set ``celery.worker.state.should_stop``,
drains once more before it stops: a SIGTERM (Ctrl-C on ``dipaco server``, a demo ending,
``docker compose stop``) waited 4 s in those drains before the warm shutdown began. This
transport ends a drain at its next poll once the worker is stopping, so the shutdown starts
within one polling interval; a task that is running still finishes (warm shutdown).

Producers (the web, beat) never drain, so for them it is the filesystem transport as is.
Chosen by ``env.celery_transport`` (``broker_transport``) for the embedded default only.
"""

from __future__ import annotations

import time
from queue import Empty
from typing import Any

from celery.worker import state
from kombu.transport import filesystem


def worker_stopping() -> bool:
    """Whether this process is a Celery worker a shutdown signal has reached."""
    return state.should_stop is not None or state.should_terminate is not None


class FilesystemTransport(filesystem.Transport):  # type: ignore[misc]
    """kombu's filesystem transport whose ``drain_events`` ends early in a stopping worker."""

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        # kombu.transport.virtual.Transport.drain_events, with the stop check in its poll.
        started = time.monotonic()
        polling_interval = self.polling_interval
        if timeout and polling_interval and polling_interval > timeout:
            polling_interval = timeout
        while True:
            try:
                self.cycle.get(self._deliver, timeout=timeout)
            except Empty:
                if worker_stopping():
                    raise TimeoutError() from None
                if timeout is not None and time.monotonic() - started >= timeout:
                    raise TimeoutError() from None
                if polling_interval is not None:
                    time.sleep(polling_interval)
            else:
                return
