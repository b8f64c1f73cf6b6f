"""The one retry helper, and the client errors a volunteer sees when the server misbehaves."""

from __future__ import annotations

import math
import random
import socket
import threading

import httpx
import pytest

from dipaco import __version__
from dipaco.retry import LONGEST_IDLE_WAIT_S, idle_pause_s
from tests.test_worker_agent_transfer import StubServer, stub  # noqa: F401 (fixture)
from worker_agent.client import Client, compatible
from worker_agent.errors import IncompatibleServer, ServerError, ServerUnreachable
from worker_agent.retry import Backoff, delays, retry

FAST = Backoff(attempts=3, initial_s=0.01, max_s=0.02)


class Flaky:
    """Raises the given errors in turn, then returns "ok"; counts calls."""

    def __init__(self, *errors: Exception) -> None:
        self.errors, self.calls = list(errors), 0

    def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


def test_each_wait_is_jittered_between_half_and_all_of_a_capped_exponential_base() -> None:
    policy = Backoff(attempts=12, initial_s=1.0, multiplier=2.0, max_s=8.0)
    waits = list(delays(policy, random.Random(0)))
    assert len(waits) == policy.attempts - 1
    for k, wait in enumerate(waits):
        base = min(8.0, 2.0**k)
        assert base / 2 <= wait <= base
    assert max(waits) <= policy.max_s
    assert len({round(w, 6) for w in waits[4:]}) > 1, "capped waits are still jittered"
    assert sum(waits) <= policy.longest_total_s


def test_a_transient_failure_is_retried_until_it_succeeds() -> None:
    call, slept = Flaky(ServerError(503, "busy", "later"), httpx.ConnectError("refused")), []
    assert retry(call, FAST, what="x", sleep=slept.append) == "ok"
    assert call.calls == 3 and len(slept) == 2 and all(s <= FAST.max_s for s in slept)


def test_a_client_error_is_raised_at_once_without_a_retry() -> None:
    for error in (
        ServerError(404, "lease_not_found", "no"),
        ServerError(409, "lease_expired", "x"),
    ):
        call, slept = Flaky(error), []
        with pytest.raises(ServerError):
            retry(call, FAST, what="x", sleep=slept.append)
        assert call.calls == 1 and slept == []


def test_the_last_error_is_raised_after_the_last_attempt() -> None:
    call = Flaky(*[ServerError(502, "bad_gateway", f"try {i}") for i in range(5)])
    with pytest.raises(ServerError, match="try 2"):
        retry(call, FAST, what="x", sleep=lambda s: None)
    assert call.calls == FAST.attempts


def test_a_stop_request_ends_the_waiting_at_once() -> None:
    stop = threading.Event()
    stop.set()
    call = Flaky(ServerError(503, "busy", "later"))
    with pytest.raises(ServerError):
        retry(call, Backoff(attempts=5, initial_s=60, max_s=60), what="x", stop=stop)
    assert call.calls == 1


def test_retry_after_is_honoured_up_to_the_longest_wait() -> None:
    slept: list[float] = []
    call = Flaky(ServerError(429, "too_many_requests", "slow down", {"retry_after": "99"}))
    retry(call, Backoff(attempts=2, initial_s=0.01, max_s=0.5), what="x", sleep=slept.append)
    assert slept == [0.5]


def test_an_unreachable_server_is_reported_with_its_url_after_the_retries() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = Client(f"http://127.0.0.1:{port}", "dpw_x", policy=FAST)
    with pytest.raises(ServerUnreachable) as failed:
        client.lease()
    message = failed.value.message
    assert f"http://127.0.0.1:{port}" in message and "/api/v1/health" in message
    assert f"after {FAST.attempts} tries" in message
    client.close()


def test_a_server_of_another_version_is_refused_with_the_fix(stub: StubServer) -> None:  # noqa: F811
    client = Client(stub.url, policy=FAST)
    stub.json_routes["/api/v1/health"] = (200, {"status": "ok", "version": __version__})
    assert client.check_version() == __version__
    stub.json_routes["/api/v1/health"] = (503, {"status": "degraded", "version": __version__})
    assert client.check_version() == __version__, "a degraded server still says its version"
    stub.json_routes["/api/v1/health"] = (200, {"status": "ok", "version": "7.1.0"})
    with pytest.raises(IncompatibleServer, match=r"dipaco==7\.1\.0"):
        client.check_version()
    client.close()


def test_an_api_refusal_keeps_its_stable_code_and_is_asked_once(stub: StubServer) -> None:  # noqa: F811
    body = {"error": {"code": "lease_limit_reached", "message": "release it first"}}
    stub.json_routes["/api/v1/worker/lease"] = (409, body)
    client = Client(stub.url, "dpw_x", policy=FAST)
    with pytest.raises(ServerError) as refused:
        client.lease()
    assert (refused.value.status, refused.value.code) == (409, "lease_limit_reached")
    assert len(stub.requests) == 1
    client.close()


def test_versions_are_compatible_on_the_same_major_and_while_zero_the_same_minor() -> None:
    assert compatible("1.4.0", "1.2.9") and compatible("0.1.7", "0.1.0")
    assert not compatible("2.0.0", "1.9.0") and not compatible("0.2.0", "0.1.0")
    assert not compatible("garbage", "0.1.0")


def test_an_idle_worker_waits_the_servers_retry_after_up_to_a_guard_only() -> None:
    """The server paces an idle crowd (rounds.protocol.pacing.retry_after_s): on a 204 its
    Retry-After wins, shorter or longer than the worker's own backoff, up to a guard
    against a broken one; on a shed request (503) the longer of the two."""
    assert idle_pause_s(1.0, None) == 1.0
    assert idle_pause_s(1.5, 0.0) == 1.5
    assert idle_pause_s(1.5, math.nan) == 1.5
    assert idle_pause_s(30.0, 12.0) == 30.0  # shed: the worker's own backoff, when longer
    assert idle_pause_s(30.0, 12.0, shed=False) == 12.0  # the next round opens sooner
    assert idle_pause_s(30.0, 200.0) == 200.0  # 10,000 waiters over 200 s: not squeezed
    assert idle_pause_s(30.0, 200.0, shed=False) == 200.0
    assert idle_pause_s(30.0, 1e9, shed=False) == LONGEST_IDLE_WAIT_S
    assert idle_pause_s(30.0, None, shed=False) == 30.0  # no Retry-After: its own backoff


def test_a_hand_in_is_tried_again_until_it_goes_through_but_never_after_a_final_answer() -> None:
    """worker_agent.agent.hand_in: transient failures (the client's give-up, a transport
    error, a 5xx) are tried again while time is left; a 4xx is raised at once; so is the
    last failure once the time is up or a stop is asked."""
    from worker_agent.agent import hand_in

    never = threading.Event()
    unreachable = ServerUnreachable("cannot reach the dipaco server")
    flaky = Flaky(unreachable, httpx.ConnectError("down"), ServerError(503, "overloaded", "busy"))
    waits: list[float] = []
    hand_in(flaky, until=math.inf, stop=never, pause_s=0.01, on_wait=lambda e, s: waits.append(s))
    assert flaky.calls == 4 and waits == [0.01] * 3

    closed = Flaky(ServerError(409, "round_closed", "the round closed"))
    with pytest.raises(ServerError, match="round closed"):
        hand_in(closed, until=math.inf, stop=never, pause_s=0.01)
    assert closed.calls == 1, "a final answer is not asked again"

    clock = iter([0.0, 0.5, 1.5])  # the time left after each failure: 1.0, 0.5, none
    late = Flaky(unreachable, unreachable, unreachable, unreachable)
    with pytest.raises(ServerUnreachable):
        hand_in(late, until=1.0, stop=never, pause_s=0.01, clock=lambda: next(clock))
    assert late.calls == 3, "no try after the round can no longer take the Δ"

    stopped = threading.Event()
    stopped.set()
    once = Flaky(unreachable, unreachable)
    with pytest.raises(ServerUnreachable):
        hand_in(once, until=math.inf, stop=stopped, pause_s=0.01)
    assert once.calls == 1, "a stop ends the hand-in; the state file keeps the unit"


def test_a_hand_in_lasts_until_the_rounds_deadline_and_two_heartbeats_within_its_bounds() -> None:
    from dipaco.retry import HAND_IN_LONGEST_S, hand_in_patience_s

    assert hand_in_patience_s(600.0, 30.0, 120.0) == 660.0
    assert hand_in_patience_s(-300.0, 30.0, 120.0) == 120.0  # past it: the client's own tries
    assert hand_in_patience_s(None, 30.0, 120.0) == HAND_IN_LONGEST_S  # no deadline
    assert hand_in_patience_s(1e6, 30.0, 120.0) == HAND_IN_LONGEST_S
