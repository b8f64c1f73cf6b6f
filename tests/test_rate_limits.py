"""Rate limits on the worker API: per worker token and per client address, counted in Redis.

Requests go through Django's test client, so the middleware, the worker auth and the
views all run; the counters live in the real Redis of the ``redis_url`` fixture (db 15)
under a key prefix unique to each test, or in process memory for the embedded default.
A test that wants a 429 sends requests until one comes, at most 2 x limit + 1: every
such burst spans at most two windows (it takes far less than a window), so one window
is sure to go over its limit, wherever the window boundary falls.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.core.exceptions import ImproperlyConfigured
from django.test import Client
from django.test.utils import override_settings

from dipaco_server import env
from dipaco_server.workers.services import create_enrollment_token, register_worker

HEARTBEAT = "/api/v1/worker/heartbeat"
REGISTER = "/api/v1/worker/register"


def new_token(name: str) -> str:
    _, enrollment = create_enrollment_token(max_uses=None)
    _, token = register_worker(enrollment, name, {"gpu": "none"})
    return token


def beat(client: Client, token: str) -> Any:
    return client.post(
        HEARTBEAT, {}, content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {token}"
    )


def until_limited(send: Any, limit: int) -> Any:
    """Send until a 429 comes (at most 2 x limit + 1 requests); the 429, or the last answer."""
    response = None
    for _ in range(2 * limit + 1):
        response = send()
        if response.status_code == 429:
            return response
        assert response.status_code < 400 or response.status_code in (401, 422), response.content
    return response


def assert_limited(response: Any, limit: str, variable: str, period_s: int) -> int:
    """The 429 in the one error shape, naming the limit; its Retry-After in seconds."""
    assert response.status_code == 429, response.content
    error = response.json()["error"]
    assert error["code"] == "rate_limited"
    assert variable in error["message"] and "Retry-After" in error["message"]
    assert error["details"]["limit"] == limit
    assert error["details"]["variable"] == variable
    retry_after = int(response["Retry-After"])
    assert 1 <= retry_after <= period_s
    assert error["details"]["retry_after_s"] == retry_after
    return retry_after


@pytest.fixture
def prefix() -> str:
    return f"test-ratelimit-{uuid.uuid4().hex}"


@pytest.fixture
def redis_counters(redis_url: str, prefix: str) -> Iterator[redis.Redis]:
    """The rate limiter counting in Redis db 15 under this test's prefix; its keys deleted after."""
    cache = {**env.rate_limit_cache(redis_url), "KEY_PREFIX": prefix}
    client = redis.Redis.from_url(redis_url)
    with override_settings(CACHES={"default": {"BACKEND": _LOCMEM}, "ratelimit": cache}):
        yield client
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    client.close()


_LOCMEM = "django.core.cache.backends.locmem.LocMemCache"


@pytest.mark.django_db
def test_a_worker_token_over_its_limit_gets_429_with_retry_after_counted_in_redis(
    redis_counters: redis.Redis, prefix: str, settings: Any
) -> None:
    settings.DIPACO_RATE_LIMIT_WORKER = (3, 60)
    settings.DIPACO_RATE_LIMIT_ADDRESS = None
    token = new_token("limited-box")
    client = Client()
    refused = until_limited(lambda: beat(client, token), 3)
    assert_limited(refused, "worker", "DIPACO_RATE_LIMIT_WORKER", 60)
    counters = list(redis_counters.scan_iter(f"{prefix}*"))
    assert counters, "the counter should live in Redis under the test's prefix"
    assert all(token not in key.decode() for key in counters), "the token must not be a key"


@pytest.mark.django_db
def test_worker_tokens_and_addresses_are_limited_independently(
    redis_counters: redis.Redis, settings: Any
) -> None:
    settings.DIPACO_RATE_LIMIT_WORKER = (3, 60)
    settings.DIPACO_RATE_LIMIT_ADDRESS = None
    first, second = new_token("first-box"), new_token("second-box")
    here = Client(REMOTE_ADDR="10.0.0.1")
    assert_limited(until_limited(lambda: beat(here, first), 3), "worker", *_WORKER)
    assert beat(here, second).status_code == 200, "another token from the same address passes"
    # The token's limit follows the token to another address.
    assert beat(Client(REMOTE_ADDR="10.0.0.2"), first).status_code == 429

    settings.DIPACO_RATE_LIMIT_WORKER = None
    settings.DIPACO_RATE_LIMIT_ADDRESS = (4, 60)
    crowded = Client(REMOTE_ADDR="10.0.0.3")
    refused = until_limited(lambda: beat(crowded, new_token("fresh-box")), 4)
    assert_limited(refused, "address", "DIPACO_RATE_LIMIT_ADDRESS", 60)
    # The enrollment endpoint counts against the address too, before reading the body.
    assert crowded.post(REGISTER, {}, content_type="application/json").status_code == 429
    assert beat(Client(REMOTE_ADDR="10.0.0.4"), first).status_code == 200


_WORKER = ("DIPACO_RATE_LIMIT_WORKER", 60)


@pytest.mark.django_db
def test_a_limited_token_passes_again_once_its_window_is_over(
    redis_counters: redis.Redis, settings: Any
) -> None:
    settings.DIPACO_RATE_LIMIT_WORKER = (2, 2)
    settings.DIPACO_RATE_LIMIT_ADDRESS = None
    token = new_token("patient-box")
    client = Client()
    retry_after = assert_limited(
        until_limited(lambda: beat(client, token), 2), "worker", "DIPACO_RATE_LIMIT_WORKER", 2
    )
    time.sleep(retry_after)  # as the agent does (worker_agent.retry honours Retry-After)
    assert beat(client, token).status_code == 200


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.django_db
def test_the_worker_api_fails_open_with_a_warning_when_redis_is_unreachable(
    settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    unreachable = env.rate_limit_cache(f"redis://127.0.0.1:{closed_port()}/15")
    settings.CACHES = {"default": {"BACKEND": _LOCMEM}, "ratelimit": unreachable}
    settings.DIPACO_RATE_LIMIT_WORKER = (1, 60)
    settings.DIPACO_RATE_LIMIT_ADDRESS = (1, 60)
    token = new_token("open-box")
    client = Client()
    with caplog.at_level(logging.WARNING, logger="dipaco_server.ratelimit"):
        answers = [beat(client, token).status_code for _ in range(3)]
    assert answers == [200, 200, 200]
    warnings = [r for r in caplog.records if r.name == "dipaco_server.ratelimit"]
    assert len(warnings) == 1, "one warning, then the limiter pauses instead of retrying"
    assert "REDIS_URL" in warnings[0].getMessage()


@pytest.mark.django_db
def test_the_embedded_default_counts_in_process_memory(settings: Any, prefix: str) -> None:
    embedded = {**env.rate_limit_cache(None), "LOCATION": prefix}
    assert embedded["BACKEND"] == _LOCMEM
    settings.CACHES = {"default": {"BACKEND": _LOCMEM}, "ratelimit": embedded}
    settings.DIPACO_RATE_LIMIT_WORKER = None
    settings.DIPACO_RATE_LIMIT_ADDRESS = (3, 60)
    client = Client(REMOTE_ADDR="10.0.1.1")
    refused = until_limited(lambda: client.post(REGISTER, {}, content_type="application/json"), 3)
    assert_limited(refused, "address", "DIPACO_RATE_LIMIT_ADDRESS", 60)


@pytest.mark.django_db
def test_routes_outside_the_worker_api_are_not_limited(settings: Any, prefix: str) -> None:
    settings.CACHES = {"default": {"BACKEND": _LOCMEM}, "ratelimit": {"BACKEND": _LOCMEM}}
    settings.DIPACO_RATE_LIMIT_ADDRESS = (1, 60)
    client = Client(REMOTE_ADDR="10.0.1.2")
    assert [client.get("/api/v1/health").status_code for _ in range(3)] == [200, 200, 200]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, (600, 60)),
        ("", (600, 60)),
        ("120/min", (120, 60)),
        ("20/s", (20, 1)),
        ("100/10s", (100, 10)),
        ("5000/h", (5000, 3600)),
        ("5 / 2 minutes", (5, 120)),
        ("off", None),
        ("0", None),
        ("0/min", None),
    ],
)
def test_rate_variables_parse_to_requests_per_seconds_or_off(
    value: str | None, expected: tuple[int, int] | None
) -> None:
    environ = {} if value is None else {"DIPACO_RATE_LIMIT_WORKER": value}
    assert env.rate_limit("DIPACO_RATE_LIMIT_WORKER", "600/min", environ) == expected


@pytest.mark.parametrize("value", ["fast", "10/week", "10/0s", "-5/min", "10/2d", "1e3/min"])
def test_a_malformed_rate_is_refused_naming_the_variable_and_the_fix(value: str) -> None:
    with pytest.raises(ImproperlyConfigured) as refused:
        env.rate_limit(
            "DIPACO_RATE_LIMIT_ADDRESS", "6000/min", {"DIPACO_RATE_LIMIT_ADDRESS": value}
        )
    message = str(refused.value)
    assert message.startswith(f"DIPACO_RATE_LIMIT_ADDRESS={value!r}")
    assert "600/min" in message and "off" in message


@pytest.mark.django_db
@pytest.mark.parametrize(
    "method, path",
    [
        ("post", "/api/v1/runs/{run}/route"),
        ("post", "/api/v1/runs/{run}/generate"),
        ("get", "/api/v1/runs/{run}/paths/0/download"),
        ("get", "/api/v1/runs/{run}/paths/0/files/model.safetensors"),
        ("get", "/api/v1/runs/{run}/paths/0/manifest"),
    ],
)
def test_routing_and_path_downloads_are_limited_per_address_with_retry_after(
    redis_counters: redis.Redis, settings: Any, method: str, path: str
) -> None:
    settings.DIPACO_RATE_LIMIT_PUBLIC = (3, 60)
    settings.DIPACO_PUBLIC_READ = True
    url = path.format(run=999_999)  # counted before the view looks the run up

    def send(client: Client) -> Any:
        if method == "post":
            return client.post(url, {"text": "def f(): pass"}, content_type="application/json")
        return client.get(url)

    crowded = Client(REMOTE_ADDR="10.0.1.1")
    refused = None
    for _ in range(2 * 3 + 1):
        refused = send(crowded)
        if refused.status_code == 429:
            break
        assert refused.status_code == 404, refused.content  # no such run: answered, not limited
    assert refused is not None
    retry_after = assert_limited(refused, "public", "DIPACO_RATE_LIMIT_PUBLIC", 60)
    assert retry_after >= 1
    assert send(Client(REMOTE_ADDR="10.0.1.2")).status_code == 404, "another address passes"
    # Other public routes are not counted.
    assert crowded.get("/api/v1/health").status_code == 200
