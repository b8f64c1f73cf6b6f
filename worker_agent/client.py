"""The control plane's worker API over HTTP: the one module that knows its URLs and JSON.

Everything the rest of the agent sees is a dataclass defined here, read from the JSON by
pydantic (`_read`), so a change of a request or response shape is a change of this file
alone. Every call goes through
`worker_agent.retry`: transient failures are retried with backoff and jitter, the
server's 4xx refusals are raised at once as `ServerError` with their stable code,
and a server that never answers becomes `ServerUnreachable` naming the URL.

Routes (under ``/api/v1``): ``GET health``; ``POST worker/register``,
``worker/heartbeat``, ``worker/lease``; ``GET worker/lease/<id>/manifest``, ``.../rebase``;
``POST worker/lease/<id>/upload-urls``, ``.../complete``, ``.../release``. The lease's
secret travels in the ``X-Lease-Secret`` header, the worker token as a bearer token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import field
from datetime import datetime
from typing import Annotated, Any, TypeVar

import httpx
from pydantic import AliasChoices, AliasPath, BeforeValidator, Field, TypeAdapter, model_validator
from pydantic.dataclasses import dataclass

from dipaco import __version__
from worker_agent.errors import (
    TOKEN_REFUSED,
    AuthFailed,
    IncompatibleServer,
    ServerError,
    ServerUnreachable,
    WorkerDistrusted,
)
from worker_agent.retry import Backoff, RetryAttempt, retry

__all__ = [
    "BlobRef",
    "Client",
    "Contribution",
    "DataWindow",
    "Heartbeat",
    "LeaseGrant",
    "Manifest",
    "RebaseAnswer",
    "RebasePlan",
    "Registration",
    "UpdateRef",
    "UploadTarget",
    "compatible",
    "parse_error",
]

API = "/api/v1"
SECRET_HEADER = "X-Lease-Secret"
OVERLOADED = "overloaded"  # 503: new work shed under load; come back after Retry-After
USER_AGENT = f"dipaco-worker/{__version__}"


def _or_empty(value: Any) -> Any:
    """The server leaves a field null or out where it has nothing; "" here."""
    return "" if value is None else value


def _or_none(value: Any) -> Any:
    """An empty object or list means none (the rebase plan of a unit that has none)."""
    return value or None


def _or(default: Any) -> Callable[[Any], Any]:
    return lambda value: default if value is None else value


Text = Annotated[str, BeforeValidator(_or_empty)]


@dataclass(frozen=True)
class Registration:
    worker_id: int
    name: str
    token: str
    heartbeat_interval_s: float


@dataclass(frozen=True)
class DataWindow:
    """The unit's windows of its path's train shard (dipaco.data.windows)."""

    start_position: int  # where it starts in the path's seeded window order
    windows: int  # sequences of seq_len + 1 tokens it reads: H x batch
    seed: int  # of the path's window order
    dtype: str  # numpy dtype string of the token file, e.g. "<u2"


@dataclass(frozen=True)
class RebasePlan:
    """outer.overlap eager: after step `at_step`, rebase onto what round `round` publishes."""

    at_step: int
    round: int


@dataclass(frozen=True)
class LeaseGrant:
    """One work unit: train `steps` inner steps of path `path` from the modules' base versions.

    `steps` is the unit's length, the inner loop's bound; `config`'s inner.steps (H) is
    the unit's slot of the lr schedule, which `steps` never changes."""

    lease_id: int
    secret: str  # the answer's lease_secret
    deadline: str  # ISO 8601, as the server sent it
    heartbeat_interval_s: float
    run_id: int
    run_name: str
    round: int
    unit_id: int
    path: int
    modules: list[str]
    base_versions: dict[str, int]
    steps: int  # the unit's length, from its start: H, or fewer sized to this worker's speed
    config: dict[str, Any]  # the whole RunConfig as JSON
    data: DataWindow
    raw: dict[str, Any] = field(repr=False)  # the answer as received, kept for resuming
    size_reason: Text = ""  # why `steps`, from the server
    seconds_limit: float | None = None  # a calibration unit: stop after this long
    round_deadline: str | None = None  # ISO 8601: upload what is trained by then
    hard_deadline: str | None = None  # ISO 8601: heartbeats never extend the lease past it
    cold: bool = False  # train from fresh AdamW moments: another worker trains a copy too
    # outer.overlap eager (worker_agent.rebase)
    rebase: Annotated[RebasePlan | None, BeforeValidator(_or_none)] = None

    @model_validator(mode="before")
    @classmethod
    def _keep_raw(cls, data: Any) -> Any:
        """A lease answer keeps itself whole, for resuming (worker_agent.state)."""
        if isinstance(data, Mapping) and "raw" not in data:
            return {**data, "secret": data.get("lease_secret"), "raw": dict(data)}
        return data


@dataclass(frozen=True)
class UpdateRef:
    """An encoded outer update: version from_version + its decoded values = version
    `version`, whose fp32 module file hashes to to_sha256 (worker_agent.downloads)."""

    from_version: int
    version: int
    url: str
    sha256: str
    size: int
    from_sha256: str
    to_sha256: str


@dataclass(frozen=True)
class BlobRef:
    module_id: str
    version: int
    key: str
    sha256: str
    size: int
    url: str
    # from the version the manifest request held
    updates: Annotated[tuple[UpdateRef, ...], BeforeValidator(_or(()))] = ()


@dataclass(frozen=True)
class ChunkRef:
    """One row chunk of the unit's path and the segment of it the unit reads
    (dipaco.data.rows.Segment); kept by sha256."""

    chunk: int
    key: str
    url: str
    sha256: str
    size: int  # bytes
    rows: int
    start: int
    count: int
    perm_seed: int | None = None


@dataclass(frozen=True)
class UnitData:
    """The unit's training windows: rows of seq_len + 1 tokens from position
    `first_position`, the chunks' segments in order (dipaco.data.rows.UnitRows)."""

    format: str
    dtype: str
    seq_len: int
    first_position: int
    windows: int
    chunks: list[ChunkRef]
    tokens: int = 0


@dataclass(frozen=True)
class Manifest:
    modules: list[BlobRef]
    data: UnitData


@dataclass(frozen=True)
class RebaseAnswer:
    """GET .../rebase: "ready" (modules at `versions`), "waiting" or "none"."""

    state: str
    versions: Annotated[dict[str, int], BeforeValidator(_or({}))] = field(default_factory=dict)
    retry_after_s: Annotated[float, BeforeValidator(_or(0.0))] = 0.0
    modules: Annotated[list[BlobRef], BeforeValidator(_or([]))] = field(default_factory=list)


@dataclass(frozen=True)
class UploadTarget:
    """Where one module's Δ goes: a raw PUT to `put_url`, or a form POST (`post_url`)."""

    module_id: str
    key: str
    max_bytes: int
    put_url: Text  # none where the store cannot bound a PUT
    post_url: str = Field(validation_alias=AliasChoices("post_url", AliasPath("post", "url")))
    post_fields: dict[str, str] = Field(
        validation_alias=AliasChoices("post_fields", AliasPath("post", "fields"))
    )


@dataclass(frozen=True)
class Contribution:
    module_id: str
    sha256: str
    size: int


def _lease_field(name: str) -> Any:
    """A field of the heartbeat answer's `lease` object (absent without a lease)."""
    return Field(default=None, validation_alias=AliasChoices(name, AliasPath("lease", name[6:])))


@dataclass(frozen=True)
class Heartbeat:
    server_time: str
    heartbeat_interval_s: float
    lease_state: str | None = _lease_field("lease_state")  # "active", ... or None
    lease_deadline: str | None = _lease_field("lease_deadline")
    # "release": the unit's work is no longer needed
    instructions: Annotated[list[str], BeforeValidator(_or([]))] = field(default_factory=list)
    # the round's deadline now (it may move up)
    round_deadline: str | None = Field(
        default=None,
        validation_alias=AliasChoices("round_deadline", AliasPath("lease", "round_deadline")),
    )


def compatible(server_version: str, agent_version: str = __version__) -> bool:
    """Same major version, and the same minor while the major is 0 (semver's rule)."""
    server, agent = server_version.split("."), agent_version.split(".")
    if len(server) < 2 or server[0] != agent[0]:
        return False
    return server[0] != "0" or server[1] == agent[1]


def parse_error(response: httpx.Response) -> ServerError:
    """The answer's ``{"error": {"code", "message"}}``, or a stand-in for a non-JSON answer."""
    status = response.status_code
    try:
        body = response.json()
        error = body["error"]
        server_error = ServerError(
            status, str(error["code"]), str(error["message"]), dict(error.get("details") or {})
        )
    except (ValueError, KeyError, TypeError):
        text = response.text[:200].strip() if not response.is_stream_consumed else ""
        server_error = ServerError(status, f"http_{status}", text or response.reason_phrase)
    if "Retry-After" in response.headers:
        server_error.details.setdefault("retry_after", response.headers["Retry-After"])
    return server_error


class Client:
    """One server, one worker token (the heartbeat thread has its own Client)."""

    def __init__(
        self,
        server: str,
        token: str | None = None,
        *,
        policy: Backoff | None = None,
        stop: threading.Event | None = None,
        on_retry: Callable[[RetryAttempt], None] | None = None,
        timeout_s: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        worker_id: int | None = None,
    ) -> None:
        self.server = server.rstrip("/")
        self.token = token
        self.worker_id = worker_id  # names the worker's page in WorkerDistrusted
        self.policy = policy or Backoff()
        self.stop = stop
        self.on_retry = on_retry
        self.idle_retry_after_s: float | None = None
        self.overloaded = False
        self.http = httpx.Client(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers={"User-Agent": USER_AGENT},
            transport=transport,
            follow_redirects=False,
        )

    def close(self) -> None:
        self.http.close()

    # --- the one request path ---------------------------------------------------------

    def _call(
        self,
        method: str,
        route: str,
        *,
        json: Mapping[str, Any] | None = None,
        secret: str | None = None,
        policy: Backoff | None = None,
        auth: bool = True,
        accept: tuple[int, ...] = (),
        answers: tuple[str, ...] = (),
    ) -> httpx.Response:
        url = f"{self.server}{API}/{route}"
        headers = {}
        if auth and self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if secret is not None:
            headers[SECRET_HEADER] = secret

        def attempt() -> httpx.Response:
            response = self.http.request(method, url, json=json, headers=headers)
            if response.status_code >= 400 and response.status_code not in accept:
                error = parse_error(response)
                if error.code not in answers:  # an error code the caller takes as an answer
                    raise error
            return response

        try:
            return retry(
                attempt,
                policy or self.policy,
                what=f"{method} {route}",
                stop=self.stop,
                on_retry=self.on_retry,
            )
        except ServerError as exc:
            if exc.code in TOKEN_REFUSED:
                raise AuthFailed(
                    f"the server refused this worker's token ({exc.code}: {exc.message}); "
                    f"enroll again: dipaco-worker --server {self.server} --enroll TOKEN"
                ) from exc
            if exc.code == "worker_distrusted":
                raise WorkerDistrusted(self.server, self.worker_id, exc.message) from exc
            if exc.transient:
                raise ServerUnreachable(
                    f"{self.server} kept failing ({exc.status} {exc.code}: {exc.message}); "
                    "the server is overloaded or broken: try later or tell its operator"
                ) from exc
            raise
        except httpx.TransportError as exc:
            raise ServerUnreachable(
                f"cannot reach the dipaco server at {self.server} ({type(exc).__name__}: "
                f"{exc}) after {(policy or self.policy).attempts} tries; check the URL "
                "(--server), your network or proxy, and that the server is running "
                f"({self.server}{API}/health should answer)"
            ) from exc

    # --- routes -----------------------------------------------------------------------

    def check_version(self) -> str:
        """The server's version; IncompatibleServer if this agent cannot talk to it."""
        try:
            # 503 is "degraded" (its broker is down): it still says its version.
            body = self._call("GET", "health", auth=False, accept=(503,)).json()
        except (ServerError, ValueError) as exc:
            raise IncompatibleServer(
                f"{self.server}{API}/health gave no dipaco answer ({exc}); "
                "is this a dipaco server? check --server"
            ) from exc
        version = str(body.get("version", "")) if isinstance(body, dict) else ""
        if not version or not compatible(version):
            raise IncompatibleServer(
                f"the server at {self.server} runs dipaco {version or '(unknown)'}, this agent "
                f"{__version__}; install a matching agent: pip install 'dipaco=={version}'"
                if version
                else f"{self.server}{API}/health did not say its version; check --server"
            )
        return version

    def register(self, enrollment_token: str, name: str, device: Mapping[str, Any]) -> Registration:
        body = {"enrollment_token": enrollment_token, "name": name, "device": dict(device)}
        try:
            data = self._call("POST", "worker/register", json=body, auth=False).json()
        except ServerError as exc:
            if exc.code in ("enrollment_refused", "worker_invalid"):
                raise AuthFailed(f"registration refused: {exc.message}") from exc
            raise
        return _read(Registration, data)

    def heartbeat(
        self, lease_id: int | None = None, secret: str | None = None, policy: Backoff | None = None
    ) -> Heartbeat:
        body = {"lease_id": lease_id}
        data = self._call("POST", "worker/heartbeat", json=body, secret=secret, policy=policy)
        return _read(Heartbeat, data.json())

    def lease(self, handing_in: int | None = None) -> LeaseGrant | None:
        """A work unit, or None when nothing is queued (HTTP 204) or the server is too busy
        to hand out work now (503 ``overloaded``: dipaco_server.shedding).

        `handing_in`: the lease whose trained Δ this worker is handing in meanwhile; it does
        not count against the worker's lease limit (one lease training, one handing in).

        After either, `idle_retry_after_s` holds the server's Retry-After (seconds before
        asking again; it grows with the number of idle workers), or None without one, and
        `overloaded` says which it was. An overloaded server is not a failure to give up
        on: an idle agent keeps asking at the pace the server sets, however long it lasts.
        """
        route = (
            "worker/lease" if handing_in is None else f"worker/lease?handing_in={int(handing_in)}"
        )
        response = self._call("POST", route, answers=(OVERLOADED,))
        self.idle_retry_after_s = None
        self.overloaded = response.status_code == 503
        if response.status_code in (204, 503):
            self.idle_retry_after_s = _seconds(response.headers.get("Retry-After"))
            return None
        return lease_from_json(response.json())

    def manifest(
        self, lease_id: int, secret: str, held: Mapping[str, int] | None = None
    ) -> Manifest:
        """The unit's blobs; `held` (module id -> version the agent holds) gets encoded
        updates from those versions where the run publishes them (worker_agent.downloads)."""
        route = f"worker/lease/{lease_id}/manifest"
        if held:
            route += "?held=" + ",".join(f"{m}:{int(v)}" for m, v in sorted(held.items()))
        return _read(Manifest, self._call("GET", route, secret=secret).json())

    def rebase(self, lease_id: int, secret: str) -> RebaseAnswer:
        """outer.overlap eager: the versions the unit rebases onto, once published; the
        modules come with encoded updates from the unit's base versions where published."""
        data = self._call("GET", f"worker/lease/{lease_id}/rebase", secret=secret).json()
        return _read(RebaseAnswer, data)

    def upload_urls(self, lease_id: int, secret: str) -> dict[str, UploadTarget]:
        data = self._call("POST", f"worker/lease/{lease_id}/upload-urls", secret=secret).json()
        targets = [_read(UploadTarget, upload) for upload in data["uploads"]]
        return {target.module_id: target for target in targets}

    def complete(
        self,
        lease_id: int,
        secret: str,
        contributions: list[Contribution],
        tokens: int,
        metrics: Mapping[str, float],
        base_versions: Mapping[str, int] | None = None,
    ) -> dict[str, Any]:
        """`base_versions`: the versions the Δs are relative to when not the unit's base
        (an eager unit that rebased, worker_agent.rebase)."""
        body: dict[str, Any] = {
            "contributions": [
                {"module_id": c.module_id, "sha256": c.sha256, "size": c.size}
                for c in contributions
            ],
            "tokens": tokens,
            "metrics": dict(metrics),
        }
        if base_versions is not None:
            body["base_versions"] = {str(m): int(v) for m, v in base_versions.items()}
        route = f"worker/lease/{lease_id}/complete"
        answer: dict[str, Any] = self._call("POST", route, json=body, secret=secret).json()
        return answer

    def release(self, lease_id: int, secret: str, policy: Backoff | None = None) -> None:
        self._call("POST", f"worker/lease/{lease_id}/release", secret=secret, policy=policy)


def _seconds(header: str | None) -> float | None:
    """A Retry-After in seconds (the delay form; an HTTP date or garbage gives None)."""
    try:
        value = float(header) if header is not None else None
    except ValueError:
        return None
    return value if value is not None and 0 <= value <= 3600 else None


T = TypeVar("T")
_READERS: dict[Any, TypeAdapter[Any]] = {}


def _read(shape: type[T], data: Any) -> T:
    """`data` (a JSON answer) as `shape`; pydantic's ValidationError (a ValueError) names
    the field an answer lacks or has of the wrong type."""
    reader = _READERS.get(shape)
    if reader is None:
        reader = _READERS[shape] = TypeAdapter(shape)
    result: T = reader.validate_python(data)
    return result


def lease_from_json(data: Mapping[str, Any]) -> LeaseGrant:
    """A lease answer (or the copy saved for resuming) as a LeaseGrant."""
    return _read(LeaseGrant, dict(data))


def seconds_until(when: str | None) -> float | None:
    """Seconds from now to a time the server sent (ISO 8601), or None when it sent none
    or an unreadable one (the lease's and the round's deadlines)."""
    if not when:
        return None
    try:
        moment = datetime.fromisoformat(when.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment.timestamp() - time.time()
