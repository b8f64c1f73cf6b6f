"""The agent's client and heartbeats against the live worker API (real HTTP, real database)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import httpx
import pytest
from django.utils import timezone

from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.models import Lease, Round
from dipaco_server.rounds.protocol.leases import expire_leases
from dipaco_server.storage import BlobStore
from dipaco_server.workers.models import Worker
from dipaco_server.workers.services import create_enrollment_token, revoke_worker
from tests.test_worker_agent_e2e import running_run
from tests.test_worker_agent_e2e import store as store
from worker_agent.client import Client
from worker_agent.errors import AuthFailed, ExitCode
from worker_agent.heartbeat import HeartbeatThread
from worker_agent.retry import Backoff

pytestmark = pytest.mark.django_db(transaction=True)
FAST = Backoff(attempts=2, initial_s=0.01, max_s=0.02)


def enrolled(server: str) -> Client:
    _, enrollment = create_enrollment_token(max_uses=1)
    registration = Client(server, policy=FAST).register(enrollment, "box", {"kind": "cpu"})
    return Client(server, registration.token, policy=FAST)


def test_a_revoked_worker_is_told_to_enroll_again(live_server: Any, db: None) -> None:
    client = enrolled(live_server.url)
    assert client.lease() is None, "nothing is queued: 204 means no work, not an error"
    revoke_worker(Worker.objects.get())
    with pytest.raises(AuthFailed, match="--enroll") as refused:
        client.lease()
    assert refused.value.exit_code == ExitCode.AUTH
    client.close()


def test_a_used_up_enrollment_token_is_refused_with_the_reason(live_server: Any) -> None:
    _, enrollment = create_enrollment_token(max_uses=1)
    client = Client(live_server.url, policy=FAST)
    client.register(enrollment, "first", {})
    with pytest.raises(AuthFailed, match="used 1 of 1 times"):
        client.register(enrollment, "second", {})
    client.close()


def test_heartbeats_extend_a_lease_and_notice_when_it_expires(
    store: BlobStore,
    live_server: Any,
) -> None:
    running_run(store, steps=3)
    client = enrolled(live_server.url)
    grant = client.lease()
    assert grant is not None
    beats = HeartbeatThread(client, interval_s=60)
    beats.track(grant.lease_id, grant.secret)
    before = Lease.objects.get(pk=grant.lease_id).deadline
    beats.beat()
    lease = Lease.objects.get(pk=grant.lease_id)
    assert lease.heartbeat_at is not None and lease.deadline >= before
    assert not beats.lease_lost.is_set()

    expire_leases(now=timezone.now() + timedelta(days=1))  # as if heartbeats had stopped
    beats.beat()
    assert beats.lease_lost.is_set() and "lease_expired" in beats.lost_reason
    assert not beats.release_requested
    client.close()


def test_a_closing_round_makes_the_heartbeat_ask_for_a_release(
    store: BlobStore,
    live_server: Any,
) -> None:
    running_run(store, steps=3)
    client = enrolled(live_server.url)
    grant = client.lease()
    assert grant is not None
    beats = HeartbeatThread(client, interval_s=0.05)
    beats.start()
    beats.track(grant.lease_id, grant.secret)
    mark_round_closing(Round.objects.get())
    assert beats.lease_lost.wait(timeout=30), "the heartbeat thread never noticed"
    beats.stop()
    assert beats.release_requested, beats.lost_reason
    client.close()


def test_an_idle_agent_waits_as_long_as_the_servers_retry_after_says(
    live_server: Any, db: None, settings: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing queued: the 204 carries Retry-After (workers seen / DIPACO_IDLE_POLL_RATE, up to
    1.5 times that: jittered), and the agent waits that long when it is longer than its own
    backoff, even when it is longer than twice the agent's longest wait (the cap before issue
    23's 10,000-volunteer run: it squeezed a crowd the server spread over 200 s into 60 s)."""
    import io
    import json
    import threading

    from dipaco_server.rounds.protocol import pacing
    from worker_agent.agent import Agent, AgentOptions
    from worker_agent.device import detect_device
    from worker_agent.progress import JsonReporter

    settings.DIPACO_IDLE_POLL_RATE = 0.25  # one worker seen: ask again in 4 s
    monkeypatch.setattr(pacing, "_active_workers", (float("-inf"), 0))
    client = enrolled(live_server.url)
    assert client.lease() is None
    assert client.idle_retry_after_s in (4.0, 5.0, 6.0)

    out, stop = io.StringIO(), threading.Event()
    options = AgentOptions(data_dir=tmp_path, idle_wait_s=(0.5, 1.0))  # its own: at most 1 s
    agent = Agent(client, HeartbeatThread(client, 30.0), detect_device("cpu"), options,
                  JsonReporter(out), stop)  # fmt: skip
    waiting = threading.Thread(target=agent._next_lease)
    waiting.start()
    for _ in range(100):  # bounded: the first idle event comes after one request
        if '"idle"' in out.getvalue():
            break
        stop.wait(0.05)
    stop.set()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "a stop ends the idle wait at once"
    idle = [json.loads(line) for line in out.getvalue().splitlines() if '"idle"' in line]
    assert idle and "asking again in " in idle[0]["message"], idle
    waited = float(idle[0]["message"].rsplit("asking again in ", 1)[1].split()[0])
    assert waited in (4.0, 5.0, 6.0), idle  # the server's jittered Retry-After, not 0.5 s
    client.close()


def test_an_overloaded_server_is_asked_again_at_its_pace_not_given_up_on(
    live_server: Any, db: None, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lease request shed under load (503 overloaded, dipaco_server.shedding) is an idle
    answer with a Retry-After, not a failure: with a policy of two tries, three shed lease
    requests in a row would otherwise end in ServerUnreachable and the agent would exit."""
    from dipaco_server import shedding

    client = enrolled(live_server.url)
    settings.DIPACO_SHED_AFTER_S = 5.0
    # The live server is not gunicorn: the wait QueueTimingWorker would have measured.
    monkeypatch.setattr(shedding, "queued_s", lambda: 10.0)
    for _ in range(3):
        assert client.lease() is None
        assert client.overloaded
        assert client.idle_retry_after_s is not None and 10 <= client.idle_retry_after_s <= 20
    monkeypatch.setattr(shedding, "queued_s", lambda: None)
    assert client.lease() is None and not client.overloaded  # a plain 204: nothing queued
    client.close()


class FlakyNetwork(httpx.HTTPTransport):
    """The volunteer's line dropping requests: the first `drops[route]` requests whose path
    ends with `route` fail to connect; `passed` counts those that went through."""

    def __init__(self, drops: dict[str, int]) -> None:
        super().__init__()
        self.drops, self.passed = dict(drops), dict.fromkeys(drops, 0)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for route, left in self.drops.items():
            if request.url.path.endswith(route):
                if left > 0:
                    self.drops[route] = left - 1
                    raise httpx.ConnectError("the line is down", request=request)
                self.passed[route] += 1
        return super().handle_request(request)


def test_a_trained_delta_is_handed_in_through_outages_longer_than_the_clients_tries(
    store: BlobStore, live_server: Any, tmp_path: Any
) -> None:
    """The network fails the upload-URL request through all the client's tries and one
    more, then the completion through all of them: before, the first give-up ended the agent
    (ServerUnreachable) with a trained unit in hand. Now the agent tries the hand-in again
    while its round may take it; the completion's retry does not upload again."""
    import io
    import json
    import threading

    from dipaco_server.rounds.models import WorkUnit
    from worker_agent.agent import Agent, AgentOptions
    from worker_agent.device import detect_device
    from worker_agent.progress import JsonReporter

    running_run(store, steps=2)
    token = enrolled(live_server.url).token
    network = FlakyNetwork({"/upload-urls": FAST.attempts + 1, "/complete": FAST.attempts})
    client = Client(live_server.url, token, policy=FAST, transport=network)
    out, stop = io.StringIO(), threading.Event()
    options = AgentOptions(data_dir=tmp_path, max_units=1, hand_in_pause_s=0.05, policy=FAST)
    agent = Agent(client, HeartbeatThread(client, 30.0), detect_device("cpu"), options,
                  JsonReporter(out), stop)  # fmt: skip
    try:
        agent.run()
    finally:
        agent.close()
        client.close()
    events = [json.loads(line) for line in out.getvalue().splitlines()]
    waits = [e for e in events if e["event"] == "hand_in_wait"]
    assert len(waits) == 2, out.getvalue()  # one give-up of upload URLs, one of completion
    assert all("trying again in" in e["message"] for e in waits), waits
    assert [e["event"] for e in events].count("completed") == 1, out.getvalue()
    assert network.passed == {"/upload-urls": 1, "/complete": 1}, network.passed
    lease = Lease.objects.select_related("unit").get()
    assert lease.state == Lease.State.COMPLETED and lease.unit.state == WorkUnit.State.DONE
