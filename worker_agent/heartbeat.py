"""Heartbeats on their own thread, with their own HTTP connection.

Training and transfers never delay a heartbeat: this thread only sleeps and posts.
Without a lease it still says "alive" (the dashboard's last-seen); with one it extends
the lease. When the server answers that the lease is over (expired, round closed, run
stopped) or tells the agent to ``release`` it, `lease_lost` is set with the reason and
the trainer stops at the end of its current step.

A lease whose Δ is being handed in (uploads, then completion, on the agent's hand-in
thread) while the next unit trains is beaten too, each interval (`keep_alive`), until
`forget`: its liveness deadline must outlast a slow upload. Its answers change nothing
here; the hand-in's own requests learn whether the server still takes it.
"""

from __future__ import annotations

import logging
import threading

from worker_agent.client import Client
from worker_agent.errors import LEASE_GONE, AgentError, AuthFailed, ServerError
from worker_agent.retry import Backoff

__all__ = ["HeartbeatThread"]

log = logging.getLogger(__name__)


class HeartbeatThread(threading.Thread):
    def __init__(self, client: Client, interval_s: float) -> None:
        super().__init__(name="dipaco-heartbeat", daemon=True)
        self.client = client
        self.interval_s = interval_s
        self.lease_lost = threading.Event()
        self.lost_reason = ""
        self.release_requested = False
        self.round_deadline: str | None = None  # as the last beat heard it (ISO 8601)
        self.auth_error: AuthFailed | None = None
        self._halt = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._lease: tuple[int, str] | None = None
        self._handing_in: dict[int, str] = {}  # lease id -> secret, beaten until forgotten

    def track(self, lease_id: int, secret: str) -> None:
        """Extend this lease from now on (a beat goes out at once)."""
        with self._lock:
            self._lease = (lease_id, secret)
            self.lease_lost.clear()
            self.lost_reason, self.release_requested = "", False
            self.round_deadline = None
        self._wake.set()

    def untrack(self) -> None:
        with self._lock:
            self._lease = None

    def keep_alive(self, lease_id: int, secret: str) -> None:
        """Extend this lease (one being handed in) every interval until `forget`; it is no
        longer the tracked one, so the next unit's lease can be."""
        with self._lock:
            self._handing_in[lease_id] = secret
            if self._lease is not None and self._lease[0] == lease_id:
                self._lease = None

    def forget(self, lease_id: int) -> None:
        with self._lock:
            self._handing_in.pop(lease_id, None)

    def stop(self) -> None:
        self._halt.set()
        self._wake.set()

    def run(self) -> None:
        while not self._halt.is_set():
            self.beat()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def beat(self) -> None:
        with self._lock:
            lease = self._lease
            handing_in = list(self._handing_in.items())
        # Two quick tries: the next beat is the real retry, and must not be delayed.
        policy = Backoff(attempts=2, initial_s=1.0, max_s=max(1.0, self.interval_s / 4))
        for lease_id, secret in handing_in:
            try:
                self.client.heartbeat(lease_id, secret, policy=policy)
            except (ServerError, AgentError) as exc:  # the hand-in hears it from the server
                log.info("heartbeat of lease %s being handed in: %s", lease_id, exc)
        try:
            if lease is None:
                answer = self.client.heartbeat(policy=policy)
            else:
                answer = self.client.heartbeat(lease[0], lease[1], policy=policy)
        except ServerError as exc:
            if lease is not None and exc.code in LEASE_GONE:
                self._lost(lease, f"{exc.code}: {exc.message}", release=False)
            else:
                log.warning("heartbeat refused: %s", exc)
            return
        except AuthFailed as exc:
            self.auth_error = exc
            if lease is not None:
                self._lost(lease, exc.message, release=False)
            return
        except AgentError as exc:  # unreachable: the next beat tries again
            log.warning("heartbeat failed: %s", exc.message)
            return
        self.interval_s = answer.heartbeat_interval_s or self.interval_s
        if lease is not None and answer.round_deadline:
            with self._lock:
                if self._lease == lease:
                    self.round_deadline = answer.round_deadline
        if lease is not None and "release" in answer.instructions:
            self._lost(lease, "the server no longer needs this unit", release=True)

    def _lost(self, lease: tuple[int, str], reason: str, *, release: bool) -> None:
        with self._lock:
            if self._lease != lease:
                return  # a beat about a lease that is no longer ours to worry about
            self.lost_reason, self.release_requested = reason, release
        self.lease_lost.set()
