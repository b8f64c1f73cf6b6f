"""Settings from the environment, through helpers that refuse malformed values.

Every variable the control plane reads is parsed here, so a typo fails at
start-up with a message that names the variable and says what to change,
instead of surfacing later as a confusing connection error. Each helper takes
the environment as an argument (default ``os.environ``) so tests can feed it
values without touching the process.

With nothing set, the result is the embedded default of docs/design.md §3: SQLite,
the Celery broker and result store, and the blob store all live under
``DIPACO_DATA_DIR``.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

Environ = Mapping[str, str]

# Every variable this module reads; docker-compose.yml is checked against it.
KNOWN_VARIABLES = frozenset(
    {
        "DATABASE_URL",
        "REDIS_URL",
        "S3_ENDPOINT_URL",
        "S3_BUCKET",
        "S3_ACCESS_KEY_ID",
        "S3_SECRET_ACCESS_KEY",
        "S3_REGION",
        "DIPACO_DATA_DIR",
        "DIPACO_PUBLIC_URL",
        "SECRET_KEY",
        "DEBUG",
        "ALLOWED_HOSTS",
        "DIPACO_PUBLIC_DASHBOARD",
        "DIPACO_PUBLIC_READ",
        "DIPACO_RATE_LIMIT_WORKER",
        "DIPACO_RATE_LIMIT_ADDRESS",
        "DIPACO_DATA_ROOTS",
        "DIPACO_SOURCE_BUCKETS",
        "DIPACO_RATE_LIMIT_PUBLIC",
        "DIPACO_DB_POOL",
        "DIPACO_GRANT_RATE",
        "DIPACO_HEARTBEAT_RATE",
        "DIPACO_SHED_AFTER_S",
        "DIPACO_WORKER_INSTALL",
        "DIPACO_METRICS_TOKEN",
        "DIPACO_METRICS_ALLOW",
    }
)

DATABASE_EXAMPLE = "postgres://user:pass@host:5432/db or sqlite:////absolute/path/db.sqlite3"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_REGION_RE = re.compile(r"^[a-z0-9-]+$")
_HOST_RE = re.compile(r"^(\.?[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\]|\*)$")
MIN_SECRET_KEY_LENGTH = 32
DEFAULT_WORKER_INSTALL = "pip install dipaco"


def refuse(name: str, shown: str, problem: str, fix: str) -> ImproperlyConfigured:
    """The one error every helper raises: variable, value, what is wrong, what to do."""
    return ImproperlyConfigured(f"{name}={shown!r}: {problem}; {fix}")


def _get(environ: Environ, name: str) -> str | None:
    """The value of ``name``, or None when unset or blank (compose's ``${X:-}``)."""
    value = environ.get(name)
    if value is None or not value.strip():
        return None
    return value.strip()


def _redact(url: str) -> str:
    """``url`` with its password replaced, so error messages never print a secret."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "***"  # unparseable: show nothing rather than a possible secret
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urlunsplit(parts._replace(netloc=netloc))


def _split(name: str, value: str, fix: str) -> SplitResult:
    try:
        return urlsplit(value)
    except ValueError as exc:  # e.g. an unbalanced IPv6 bracket
        raise refuse(name, _redact(value), f"not a valid URL ({exc})", fix) from None


def env_bool(name: str, default: bool, environ: Environ = os.environ) -> bool:
    value = _get(environ, name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise refuse(name, value, "not a boolean", "use one of 1/0, true/false, yes/no, on/off")


def env_url(
    name: str, schemes: tuple[str, ...], example: str, environ: Environ = os.environ
) -> str | None:
    """A URL with one of ``schemes`` and a host, or None when unset."""
    value = _get(environ, name)
    if value is None:
        return None
    fix = f"expected e.g. {example}"
    if "://" not in value:
        raise refuse(name, _redact(value), "not a URL (no '://')", fix)
    parts = _split(name, value, fix)
    if parts.scheme not in schemes:
        raise refuse(name, _redact(value), f"scheme must be one of {', '.join(schemes)}", fix)
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError:
        raise refuse(name, _redact(value), "the port is not a number", fix) from None
    if not parts.hostname:
        raise refuse(name, _redact(value), "no host", fix)
    return value


def data_dir(environ: Environ = os.environ) -> Path:
    """``DIPACO_DATA_DIR`` (default ``$XDG_DATA_HOME/dipaco`` or ~/.local/share/dipaco), created."""
    path = data_dir_path(environ)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise refuse(
            "DIPACO_DATA_DIR",
            str(path),
            f"cannot create it ({exc.strerror})",
            "point it at a writable directory",
        ) from None
    return path


def data_dir_path(environ: Environ = os.environ) -> Path:
    """Where the data dir is, without creating it (``dipaco admin`` looks before it leaps)."""
    value = _get(environ, "DIPACO_DATA_DIR")
    if value is None:
        xdg = _get(environ, "XDG_DATA_HOME")
        base = Path(xdg) if xdg else Path.home() / ".local" / "share"
        path = base / "dipaco"
    else:
        path = Path(value).expanduser()
        if not path.is_absolute():
            raise refuse(
                "DIPACO_DATA_DIR", value, "not an absolute path", "use e.g. /var/lib/dipaco"
            )
    return path


def database(environ: Environ, data: Path) -> dict[str, Any]:
    """Django's DATABASES["default"] from ``DATABASE_URL``; SQLite in ``data`` when unset."""
    value = _get(environ, "DATABASE_URL")
    if value is None:
        value = f"sqlite:///{data / 'db.sqlite3'}"
    elif "://" not in value:
        raise refuse(
            "DATABASE_URL",
            _redact(value),
            "not a URL (no '://')",
            f"expected e.g. {DATABASE_EXAMPLE}",
        )
    fix = f"expected e.g. {DATABASE_EXAMPLE}"
    parts = _split("DATABASE_URL", value, fix)
    if parts.scheme in {"postgres", "postgresql", "pgsql"}:
        try:
            parts.port  # noqa: B018 - parsing the port is the check
        except ValueError:
            raise refuse("DATABASE_URL", _redact(value), "the port is not a number", fix) from None
        if not parts.path.strip("/"):
            raise refuse("DATABASE_URL", _redact(value), "no database name", fix)
    elif parts.scheme == "sqlite":
        # sqlite:///x.db would be relative to whatever directory the process starts in.
        if not parts.path.startswith("//"):
            raise refuse("DATABASE_URL", value, "the SQLite path is not absolute", fix)
    else:
        raise refuse("DATABASE_URL", _redact(value), f"unsupported scheme {parts.scheme!r}", fix)
    try:
        config = dj_database_url.parse(value, conn_max_age=60, conn_health_checks=True)
    except Exception as exc:  # dj-database-url raises several types for bad input
        raise refuse("DATABASE_URL", _redact(value), f"cannot be parsed ({exc})", fix) from None
    if config["ENGINE"] == "django.db.backends.sqlite3":
        # A web server and a Celery worker write to the same file: WAL lets readers
        # proceed during a write, IMMEDIATE avoids deadlocking upgrades, and the
        # timeout waits for a lock instead of failing with "database is locked".
        config["CONN_MAX_AGE"] = 0
        config["OPTIONS"] = {
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
        }
    pool = db_pool(environ)
    if pool is not None and config["ENGINE"] == "django.db.backends.postgresql":
        # Django's pooled psycopg connections (psycopg_pool): each process keeps at most
        # `pool` connections, shared by its threads, instead of one per thread. Django asks
        # for CONN_MAX_AGE 0 with a pool: a request returns its connection to the pool.
        config["CONN_MAX_AGE"] = 0
        config["CONN_HEALTH_CHECKS"] = False
        options = dict(config.get("OPTIONS") or {})
        options["pool"] = {"min_size": 1, "max_size": pool, "timeout": 10}
        config["OPTIONS"] = options
    return dict(config)


def grant_rate(environ: Environ = os.environ) -> float | None:
    """``DIPACO_GRANT_RATE``: lease grants per second when a round opens (rounds.protocol.leases), or
    None when unset (the scheduling policy's default, 50)."""
    return _rate("DIPACO_GRANT_RATE", environ, "give grants per second, e.g. 50")


def heartbeat_rate(environ: Environ = os.environ) -> float | None:
    """``DIPACO_HEARTBEAT_RATE``: heartbeats per second the server aims for, all workers
    together (rounds.protocol.pacing.heartbeat_interval_s), or None when unset (the policy's 50)."""
    return _rate("DIPACO_HEARTBEAT_RATE", environ, "give heartbeats per second, e.g. 50")


DEFAULT_SHED_AFTER_S = 5.0


def shed_after_s(environ: Environ = os.environ) -> float | None:
    """``DIPACO_SHED_AFTER_S``: a request for new work that waited longer than this for a
    web thread is answered 503 overloaded (dipaco_server.shedding); default 5, ``off``: never."""
    value = _get(environ, "DIPACO_SHED_AFTER_S")
    if value is None:
        return DEFAULT_SHED_AFTER_S
    if value.lower() in _FALSE - {"0"}:  # 0 would read as "shed everything"
        return None
    fix = "give seconds, e.g. 5 (well under the agent's 30 s time-out), or off"
    return _rate("DIPACO_SHED_AFTER_S", environ, fix)


def _rate(name: str, environ: Environ, fix: str) -> float | None:
    value = _get(environ, name)
    if value is None:
        return None
    try:
        rate = float(value)
    except ValueError:
        raise refuse(name, value, "not a number", fix) from None
    if not 0 < rate < math.inf:
        raise refuse(name, value, "must be a positive number", fix)
    return rate


def worker_install(environ: Environ = os.environ) -> str:
    """``DIPACO_WORKER_INSTALL``: the install command the enrolment page shows volunteers
    before their ``dipaco-worker`` line, e.g. a pinned version or a wheel on your own index."""
    value = _get(environ, "DIPACO_WORKER_INSTALL")
    if value is None:
        return DEFAULT_WORKER_INSTALL
    fix = f"give one shell command, e.g. {DEFAULT_WORKER_INSTALL!r} or 'pip install dipaco==0.1.0'"
    if len(value) > 500 or any(ch in value for ch in "\r\n\x00"):
        raise refuse("DIPACO_WORKER_INSTALL", value[:80], "is not one short line", fix)
    return value


def db_pool(environ: Environ = os.environ) -> int | None:
    """``DIPACO_DB_POOL``: PostgreSQL connections per process in a pool (1 to 100); unset or
    ``off``: one persistent connection per thread. See docs/deploy.md."""
    value = _get(environ, "DIPACO_DB_POOL")
    if value is None or value.strip().lower() == "off":
        return None
    fix = "give the connections per process, e.g. 4, or off"
    try:
        size = int(value)
    except ValueError:
        raise refuse("DIPACO_DB_POOL", value, "not a whole number", fix) from None
    if not 1 <= size <= 100:
        raise refuse("DIPACO_DB_POOL", value, "must be between 1 and 100", fix)
    try:
        import psycopg_pool  # noqa: F401 - the pool Django's PostgreSQL backend uses
    except ImportError:
        raise refuse(
            "DIPACO_DB_POOL", value, "psycopg_pool is not installed", "pip install 'psycopg[pool]'"
        ) from None
    return size


def redis_url(environ: Environ = os.environ) -> str | None:
    value = env_url("REDIS_URL", ("redis", "rediss"), "redis://127.0.0.1:6379/0", environ)
    if value is not None:
        db = urlsplit(value).path.strip("/")
        if db and not db.isdigit():
            raise refuse(
                "REDIS_URL",
                _redact(value),
                f"database {db!r} is not a number",
                "expected e.g. redis://127.0.0.1:6379/0",
            )
    return value


def celery_transport(data: Path, redis: str | None) -> dict[str, Any]:
    """Celery broker and result backend: Redis when given, else directories in ``data``.

    The embedded broker is kombu's filesystem transport, which a real worker
    process consumes like any broker; results go to Celery's ``file://`` backend.
    """
    if redis is not None:
        # A task taken by a worker that then died whole (kill -9, a lost machine) is handed
        # out again after the visibility timeout: kombu's default is an hour. 30 min is well
        # over an outer step of a large module; a round closing longer than that is also
        # resent by the beat sweep (DIPACO_ROUND_CLOSE_RETRY_S).
        options = {"visibility_timeout": 1800}
        return {
            "broker_url": redis,
            "broker_transport": None,  # the URL's: redis
            "result_backend": redis,
            "broker_transport_options": options,
        }
    queue, control, results = (
        data / "broker" / "queue",
        data / "broker" / "control",
        data / "results",
    )
    for folder in (queue, control, results):
        folder.mkdir(parents=True, exist_ok=True)
    return {
        "broker_url": "filesystem://localhost//",
        # kombu's filesystem transport, made to stop within a poll (dipaco_server.broker).
        "broker_transport": "dipaco_server.broker:FilesystemTransport",
        "result_backend": f"file://{results}",
        "broker_transport_options": {
            # One folder for both directions: producers and workers share it.
            "data_folder_in": str(queue),
            "data_folder_out": str(queue),
            "control_folder": str(control),
            # The default 1 s poll would add a second to every round trip.
            "polling_interval": 0.2,
        },
    }


def blob_store(environ: Environ, data: Path) -> dict[str, Any]:
    """Where blobs live: S3 when ``S3_BUCKET`` is set, else ``data``/blobs."""
    bucket = _get(environ, "S3_BUCKET")
    others = [
        n
        for n in ("S3_ENDPOINT_URL", "S3_ACCESS_KEY_ID", "S3_SECRET_ACCESS_KEY")
        if _get(environ, n) is not None
    ]
    if bucket is None:
        if others:
            shown = _get(environ, others[0]) if others[0] == "S3_ENDPOINT_URL" else "***"
            raise refuse(
                others[0],
                shown or "",
                "set without S3_BUCKET",
                "set S3_BUCKET to use S3, or unset the S3_* variables for the local store",
            )
        return {"backend": "local", "root": data / "blobs"}
    if not _BUCKET_RE.match(bucket):
        raise refuse(
            "S3_BUCKET",
            bucket,
            "not a valid bucket name",
            "use 3-63 lowercase letters, digits, dots and hyphens, e.g. dipaco",
        )
    key_id, secret = _get(environ, "S3_ACCESS_KEY_ID"), _get(environ, "S3_SECRET_ACCESS_KEY")
    if (key_id is None) != (secret is None):
        missing = "S3_SECRET_ACCESS_KEY" if secret is None else "S3_ACCESS_KEY_ID"
        raise refuse(
            missing,
            "",
            "unset while its pair is set",
            "set both S3_ACCESS_KEY_ID and S3_SECRET_ACCESS_KEY, or neither for boto3's chain",
        )
    region = _get(environ, "S3_REGION") or "us-east-1"
    if not _REGION_RE.match(region):
        raise refuse("S3_REGION", region, "not a region name", "use e.g. us-east-1")
    endpoint = env_url("S3_ENDPOINT_URL", ("http", "https"), "http://127.0.0.1:9000", environ)
    return {
        "backend": "s3",
        "endpoint_url": endpoint.rstrip("/") if endpoint else None,
        "bucket": bucket,
        "access_key_id": key_id,
        "secret_access_key": secret,
        "region": region,
    }


def secret_key(environ: Environ, data: Path) -> str:
    """``SECRET_KEY``, or a random key generated once and kept (mode 0600) in ``data``."""
    value = _get(environ, "SECRET_KEY")
    if value is not None:
        if len(value) < MIN_SECRET_KEY_LENGTH:
            raise refuse(
                "SECRET_KEY",
                "***",
                f"shorter than {MIN_SECRET_KEY_LENGTH} characters",
                "generate one with: python -c 'import secrets; print(secrets.token_urlsafe(50))'",
            )
        return value
    path = data / "secret_key"
    if not path.exists():
        # Write a private temp file, then link it into place: two processes that
        # start together (web and worker) both end up reading the same key.
        tmp = data / f".secret_key.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(50))
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    key = path.read_text().strip()
    if len(key) < MIN_SECRET_KEY_LENGTH:
        raise refuse(
            "SECRET_KEY",
            "***",
            f"unset and {path} is too short or empty",
            f"delete {path} to generate a new key, or set SECRET_KEY",
        )
    return key


def data_roots(environ: Environ, data: Path) -> list[Path]:
    """``DIPACO_DATA_ROOTS``: the directories datasets and runs may read corpora from.

    Absolute paths separated by ``:`` (os.pathsep); by default ``DIPACO_DATA_DIR/corpus``
    (where ``dipaco demo`` samples its corpus), never the data dir itself, which holds the
    secret key file and the database.
    """
    value = _get(environ, "DIPACO_DATA_ROOTS")
    if value is None:
        return [(data / "corpus").resolve()]
    roots = []
    for part in value.split(os.pathsep):
        if not part.strip():
            continue
        path = Path(part.strip()).expanduser()
        if not path.is_absolute():
            raise refuse(
                "DIPACO_DATA_ROOTS",
                value,
                f"{part!r} is not an absolute path",
                f"list absolute directories separated by {os.pathsep!r}, e.g. /srv/corpora",
            )
        roots.append(path.resolve())
    return roots


def source_buckets(environ: Environ = os.environ) -> list[str]:
    """``DIPACO_SOURCE_BUCKETS``: the S3 buckets datasets may read ``s3://`` corpora from,
    separated by commas; none by default. The server's S3 credentials (the ``S3_*``
    variables, else the AWS chain) may reach more buckets than corpora should come from."""
    value = _get(environ, "DIPACO_SOURCE_BUCKETS")
    buckets = [b.strip() for b in (value or "").split(",") if b.strip()]
    for bucket in buckets:
        if not _BUCKET_RE.match(bucket):
            raise refuse(
                "DIPACO_SOURCE_BUCKETS",
                value or "",
                f"{bucket!r} is not a bucket name",
                "list bucket names separated by commas, e.g. corpora,fineweb-edu",
            )
    return buckets


def public_url(environ: Environ = os.environ) -> str:
    """``DIPACO_PUBLIC_URL``: the address workers and browsers use to reach this server."""
    example = "https://dipaco.example.org"
    value = env_url("DIPACO_PUBLIC_URL", ("http", "https"), example, environ)
    if value is None:
        return "http://127.0.0.1:8000"
    parts = urlsplit(value)
    if parts.query or parts.fragment:
        raise refuse(
            "DIPACO_PUBLIC_URL", value, "has a query or fragment", f"expected e.g. {example}"
        )
    return value.rstrip("/")


def allowed_hosts(environ: Environ, public: str) -> list[str]:
    """``ALLOWED_HOSTS`` (comma-separated); by default loopback and the public URL's host."""
    value = _get(environ, "ALLOWED_HOSTS")
    if value is None:
        host = urlsplit(public).hostname or "127.0.0.1"
        return sorted({"127.0.0.1", "localhost", "[::1]", host})
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    for host in hosts:
        if not _HOST_RE.match(host):
            raise refuse(
                "ALLOWED_HOSTS",
                value,
                f"{host!r} is not a host name",
                "list bare host names, comma-separated, e.g. dipaco.example.org,localhost",
            )
    return hosts


_RATE_RE = re.compile(r"^(\d+)\s*/\s*(\d*)\s*(s|sec|second|m|min|minute|h|hour)s?$", re.IGNORECASE)
_RATE_UNITS = {"s": 1, "sec": 1, "second": 1, "m": 60, "min": 60, "minute": 60}
_RATE_UNITS.update(h=3600, hour=3600)


def rate_limit(name: str, default: str, environ: Environ = os.environ) -> tuple[int, int] | None:
    """A rate like ``600/min`` as (requests, seconds); None for ``0`` or ``off`` (no limit).

    The period is ``s``, ``min`` or ``h``, optionally with a count (``100/10s``).
    """
    value = _get(environ, name) or default
    if value.lower() in _FALSE:
        return None
    match = _RATE_RE.match(value)
    fix = "use e.g. 600/min, 20/s, 100/10s or 5000/h, or off to disable the limit"
    if match is None:
        raise refuse(name, value, "not a rate", fix)
    count, periods, unit = int(match[1]), int(match[2] or 1), match[3].lower()
    if count == 0:
        return None
    seconds = periods * _RATE_UNITS[unit]
    if seconds == 0 or seconds > 24 * 3600:
        raise refuse(name, value, "the period must be between 1 s and 24 h", fix)
    return count, seconds


def rate_limit_cache(redis: str | None) -> dict[str, Any]:
    """The cache the rate limiter counts in: Redis when given (shared by every web process),
    else this process's memory (the embedded server: one machine, counted per process).

    Short socket timeouts: the limiter fails open when Redis is away
    (dipaco_server.ratelimit), and must not hold a worker's request while it finds out.
    """
    if redis is None:
        return {
            "BACKEND": "django.core.cache.backends.locmem.LocMemCache",
            "LOCATION": "dipaco-rate-limits",
            "OPTIONS": {"MAX_ENTRIES": 100_000},
        }
    return {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": redis,
        "KEY_PREFIX": "dipaco:ratelimit",
        "OPTIONS": {"socket_connect_timeout": 0.5, "socket_timeout": 0.5},
    }


MIN_METRICS_TOKEN_LENGTH = 16


def metrics_token(environ: Environ = os.environ) -> str | None:
    """``DIPACO_METRICS_TOKEN``: the bearer token a Prometheus scrape of /metrics sends
    (rounds.reports.scrape), or None: only staff tokens and DIPACO_METRICS_ALLOW's addresses."""
    value = _get(environ, "DIPACO_METRICS_TOKEN")
    fix = "use a random string, e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'"
    if value is not None and len(value) < MIN_METRICS_TOKEN_LENGTH:
        raise refuse(
            "DIPACO_METRICS_TOKEN",
            "***",
            f"shorter than {MIN_METRICS_TOKEN_LENGTH} characters",
            fix,
        )
    if value is not None and (any(ch.isspace() for ch in value) or not value.isprintable()):
        raise refuse("DIPACO_METRICS_TOKEN", "***", "holds spaces or control characters", fix)
    return value


def metrics_allow(
    environ: Environ = os.environ,
) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``DIPACO_METRICS_ALLOW``: addresses or networks (comma-separated, e.g.
    ``127.0.0.1, 10.0.0.0/8``) whose scrapes of /metrics need no token; none by default."""
    value, networks = _get(environ, "DIPACO_METRICS_ALLOW"), []
    for item in (part.strip() for part in (value or "").split(",")):
        if not item:
            continue
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            fix = "give comma-separated addresses or networks, e.g. 127.0.0.1, 10.0.0.0/8"
            raise refuse(
                "DIPACO_METRICS_ALLOW", value or "", f"{item!r} is not an address or a network", fix
            ) from None
    return networks
