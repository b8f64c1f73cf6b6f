"""The embedded broker: kombu's filesystem transport, stopping as soon as its worker stops.

Celery consumes a polling transport (no event loop to wake) with ``synloop``, which drains
for 2 s at a time and, once a shutdown signal has set ``celery.worker.state.should_stop``,
drains once more before it stops: a SIGTERM (Ctrl-C on ``dipaco server``, a demo ending,
``docker compose stop``) waited 4 s in those drains before the warm shutdown began. This
transport ends a drain at its next poll once the worker is stopping, so the shutdown starts
within one polling interval; a task that is running still finishes (warm shutdown).

Producers (the web, beat) never drain. Every process writes through ``Channel``, whose
messages appear whole: kombu's writes a message in place, and a worker that lists the folder
between the file's creation and its write moved an empty file and died decoding it (Celery's
consumer does not survive a ``JSONDecodeError``). Here a message is written under a name no
queue matches and renamed into place, which is atomic on one filesystem.
Chosen by ``env.celery_transport`` (``broker_transport``) for the embedded default only.
"""

from __future__ import annotations

import os
import time
import uuid
from queue import Empty
from typing import Any

from celery.worker import state
from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


def worker_stopping() -> bool:
    """Whether this process is a Celery worker a shutdown signal has reached."""
    return state.should_stop is not None or state.should_terminate is not None


class Channel(filesystem.Channel):  # type: ignore[misc]
    """kombu's filesystem channel whose messages appear in the queue's folder whole."""

    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # kombu's name (its time order and queue suffix), so every reader finds it as before.
        name = f"{round(time.monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # A leading dot: partition(".") gives no queue's "<queue>.msg", so no reader takes it.
        partial = os.path.join(self.data_folder_out, f".writing-{name}")
        try:
            self._write(partial, dumps(payload).encode())
            os.replace(partial, final)
        except OSError as exc:
            if os.path.exists(partial):
                os.remove(partial)
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _write(self, path: str, data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)


class FilesystemTransport(filesystem.Transport):  # type: ignore[misc]
    """kombu's filesystem transport whose ``drain_events`` ends early in a stopping worker
    and whose messages are written whole (``Channel``)."""

    Channel = Channel

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
