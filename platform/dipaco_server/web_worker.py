"""gunicorn's gthread worker, timing how long each request waits for a thread.

A gthread worker accepts connections as fast as they arrive and queues them for its
threads. Past its capacity (10,000 volunteers on two cores: bench/control_plane.py) that
queue grows without bound: a request may wait longer than its client does (the agent
gives up after 30 s) and still be served, a lease granted to nobody, while every retry
adds to the queue. This worker stamps each request when it is queued and the handling
thread reads the wait back through :func:`queued_s`; dipaco_server.shedding answers
"come back later" to new work that waited too long (DIPACO_SHED_AFTER_S).

Nothing here imports Django: gunicorn's master imports the worker class before it forks.
``dipaco server`` and docker-compose.yml both start gunicorn with
``--worker-class dipaco_server.web_worker.QueueTimingWorker``; under any other server
(runserver, the tests' clients) :func:`queued_s` is None and nothing is shed.
"""

from __future__ import annotations

import resource
import threading
import time
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

_local = threading.local()
# File descriptors kept for everything but client connections (database pool, Redis,
# logs, the listening sockets, imports).
FD_RESERVE = 256


def raise_open_files_limit() -> int:
    """Raise this process's open-files limit (ulimit -n) to its hard limit; the new soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass  # keep the soft limit we have
    return soft


def connection_room(wanted: int, threads: int, open_files: int) -> int:
    """How many connections one process may hold: `wanted` (gunicorn's
    ``--worker-connections``) within `open_files` less FD_RESERVE, and at least one more
    than its threads.

    A connection gthread has not accepted waits in the kernel's accept queue, where no one
    measures its wait, so it cannot be shed: ``dipaco server`` asks for 10,000 so that,
    under overload, requests queue where they are timed. Past the open-files limit an
    accept would fail and end the worker, hence the bound."""
    if open_files == resource.RLIM_INFINITY:
        return wanted
    return max(threads + 1, min(wanted, open_files - FD_RESERVE))


def queued_s() -> float | None:
    """Seconds the request this thread is handling waited for it; None outside our worker."""
    return getattr(_local, "queued_s", None)


class QueueTimingWorker(ThreadWorker):  # type: ignore[misc]  # gunicorn is untyped
    """gthread, plus the time each request spent queued for a thread."""

    def init_process(self) -> None:
        open_files = raise_open_files_limit()
        room = connection_room(self.worker_connections, self.cfg.threads, open_files)
        if room < self.worker_connections:
            self.log.warning(
                "holding at most %d connections, not %d: the open-files limit (ulimit -n) "
                "is too low; raise it for more",
                room,
                self.worker_connections,
            )
            self.worker_connections = room
            self.max_keepalived = room - self.cfg.threads
        super().init_process()

    def enqueue_req(self, conn: Any) -> None:
        # Every way in (a new connection, a kept-alive one with a new request, one
        # deferred for its first bytes) goes through here to the thread pool.
        conn.dipaco_queued_at = time.monotonic()
        super().enqueue_req(conn)

    def handle(self, conn: Any) -> Any:
        queued_at = getattr(conn, "dipaco_queued_at", None)
        _local.queued_s = None if queued_at is None else time.monotonic() - queued_at
        try:
            return super().handle(conn)
        finally:
            _local.queued_s = None
