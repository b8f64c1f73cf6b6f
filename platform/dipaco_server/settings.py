"""Django settings for the dipaco control plane.

Everything comes from the environment through ``dipaco_server.env``, which
refuses malformed values with a message naming the variable. Nothing set means
the embedded default (docs/design.md §3): SQLite, a filesystem Celery broker and a
local blob directory, all under ``DIPACO_DATA_DIR``. Setting ``DATABASE_URL``,
``REDIS_URL`` and ``S3_BUCKET`` (+ endpoint and keys) gives the cluster mode;
the code paths are the same.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from dipaco_server import env

# --- where things live --------------------------------------------------------
DIPACO_DATA_DIR = env.data_dir(os.environ)
DIPACO_PUBLIC_URL = env.public_url(os.environ)
DIPACO_BLOB_STORE = env.blob_store(os.environ, DIPACO_DATA_DIR)
REDIS_URL = env.redis_url(os.environ)
# Directories datasets and runs may read corpora from (dipaco_server.runs.sources).
DIPACO_DATA_ROOTS = env.data_roots(os.environ, DIPACO_DATA_DIR)
# Buckets datasets may read s3:// corpora from (dipaco_server.runs.sources); none by default.
DIPACO_SOURCE_BUCKETS = env.source_buckets(os.environ)

# --- Django core --------------------------------------------------------------
SECRET_KEY = env.secret_key(os.environ, DIPACO_DATA_DIR)
DEBUG = env.env_bool("DEBUG", False, os.environ)
ALLOWED_HOSTS = env.allowed_hosts(os.environ, DIPACO_PUBLIC_URL)
_public = urlsplit(DIPACO_PUBLIC_URL)
CSRF_TRUSTED_ORIGINS = [f"{_public.scheme}://{_public.netloc}"]
CSRF_FAILURE_VIEW = "dipaco_server.error_pages.csrf_failure"  # a page of the site, JSON under /api/

# --- HTTPS (what `manage.py check --deploy` asks for) --------------------------------
# With an https DIPACO_PUBLIC_URL the server sits behind a TLS proxy (gunicorn speaks
# plain HTTP), which must set X-Forwarded-Proto: cookies only over HTTPS, HSTS for a
# year, and plain-HTTP requests redirected, except the health check that compose and
# load balancers send to the container's own port.
_https = _public.scheme == "https"
SESSION_COOKIE_SECURE = _https
CSRF_COOKIE_SECURE = _https
SESSION_COOKIE_HTTPONLY = True
SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https") if _https else None
SECURE_SSL_REDIRECT = _https and not DEBUG
SECURE_REDIRECT_EXEMPT = [r"^api/v1/health$", r"^healthz$", r"^readyz$", r"^metrics$"]
SECURE_HSTS_SECONDS = 365 * 24 * 3600 if _https and not DEBUG else 0
SECURE_HSTS_INCLUDE_SUBDOMAINS = _https
SECURE_HSTS_PRELOAD = _https
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"

DATABASES = {"default": env.database(os.environ, DIPACO_DATA_DIR)}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    # Ninja ships swagger-ui as static files; listing it serves the API docs
    # from this server instead of a CDN.
    "ninja",
    "dipaco_server.core",
    "dipaco_server.runs",
    "dipaco_server.workers",
    "dipaco_server.rounds",
    "dipaco_server.accounts",
    "dipaco_server.inference",
    "dipaco_server.audit",
    "dipaco_web",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    # Counts and times every answer, the shed ones too (monitoring.http).
    "dipaco_server.monitoring.http.RequestMetricsMiddleware",
    # Probes and the scrape, whatever Host they name (core.probes): before CommonMiddleware.
    "dipaco_server.core.probes.HostFreeRoutes",
    # First of ours: shedding a request under overload must cost as little as possible.
    "dipaco_server.shedding.LoadSheddingMiddleware",
    # Before sessions and auth: a refused worker request costs one cache round trip.
    "dipaco_server.ratelimit.RateLimitMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "dipaco_server.urls"
WSGI_APPLICATION = "dipaco_server.wsgi.application"
ASGI_APPLICATION = "dipaco_server.asgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

# Static files are served by the app itself (urls.py), straight from the
# installed packages: no collectstatic step, no CDN.
STATIC_URL = "static/"

# --- password sign-in (dipaco_server.accounts.throttle) ----------------------------
# Wrong passwords lock a user name (5) or an address (20) out for 15 minutes, counted in
# the rate-limit cache; the right password is refused too until the window ends.
AUTHENTICATION_BACKENDS = ["dipaco_server.accounts.throttle.ThrottledModelBackend"]
SIGNIN_FAILURES_PER_USER = 5
SIGNIN_FAILURES_PER_ADDRESS = 20
SIGNIN_LOCKOUT_S = 15 * 60

# --- dashboard (dipaco_web) -----------------------------------------------------
# Runs and workers pages for anyone (default), or only for signed-in users when
# false; the run buttons are for staff either way.
DIPACO_PUBLIC_DASHBOARD = env.env_bool("DIPACO_PUBLIC_DASHBOARD", True, os.environ)
# Whether path downloads, manifests and routing answer without a staff token.
DIPACO_PUBLIC_READ = env.env_bool("DIPACO_PUBLIC_READ", True, os.environ)

# --- rate limits on the worker API (dipaco_server.ratelimit) -------------------
# Per worker token and per client address, as (requests, seconds); None: no limit. A
# worker makes about 2 heartbeats and a few calls per unit a minute, so 600/min per
# token only stops a runaway client; the address limit is for one host's many workers.
DIPACO_RATE_LIMIT_WORKER = env.rate_limit("DIPACO_RATE_LIMIT_WORKER", "600/min", os.environ)
DIPACO_RATE_LIMIT_ADDRESS = env.rate_limit("DIPACO_RATE_LIMIT_ADDRESS", "6000/min", os.environ)
# Routing a text and a path's downloads (manifest, zip, files), per client address: they
# answer anyone (DIPACO_PUBLIC_READ) and cost CPU or a model's worth of bandwidth each.
DIPACO_RATE_LIMIT_PUBLIC = env.rate_limit("DIPACO_RATE_LIMIT_PUBLIC", "120/min", os.environ)
# Lease grants per second when a round opens (rounds.policy, rounds.protocol.leases; docs/deploy.md).
if (_grant_rate := env.grant_rate(os.environ)) is not None:
    DIPACO_GRANT_RATE = _grant_rate
# Heartbeats per second, all workers together (rounds.policy, rounds.protocol.leases; docs/deploy.md).
if (_heartbeat_rate := env.heartbeat_rate(os.environ)) is not None:
    DIPACO_HEARTBEAT_RATE = _heartbeat_rate
# A request for new work that waited longer than this for a web thread is told to come
# back later (dipaco_server.shedding; docs/deploy.md); None: never.
DIPACO_SHED_AFTER_S = env.shed_after_s(os.environ)
# Where evaluation and proof of useful work run their forward passes (runs.device): auto
# (CUDA where torch sees it), cpu, cuda or cuda:N.
DIPACO_SERVER_DEVICE = os.environ.get("DIPACO_SERVER_DEVICE", "auto")
# Who may scrape /metrics (dipaco_server.rounds.reports.scrape): a bearer token, and addresses
# or networks that need none; staff tokens always may.
DIPACO_METRICS_TOKEN = env.metrics_token(os.environ)
DIPACO_METRICS_ALLOW = env.metrics_allow(os.environ)
# What the enrolment page tells volunteers to install before `dipaco-worker` (dipaco_web).
DIPACO_WORKER_INSTALL = env.worker_install(os.environ)
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "ratelimit": env.rate_limit_cache(REDIS_URL),
}

# --- Celery (read by dipaco_server.celery through the CELERY_ namespace) -----
_celery = env.celery_transport(DIPACO_DATA_DIR, REDIS_URL)
CELERY_BROKER_URL = _celery["broker_url"]
CELERY_BROKER_TRANSPORT = _celery["broker_transport"]
CELERY_RESULT_BACKEND = _celery["result_backend"]
CELERY_BROKER_TRANSPORT_OPTIONS = _celery["broker_transport_options"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
# A task is acknowledged only after it finishes, and a worker takes one task at
# a time: a worker that dies mid outer step hands the task to another worker
# (outer-step tasks are idempotent, docs/design.md §4).
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_ACCEPT_CONTENT = ["json"]
CELERY_RESULT_EXPIRES = 24 * 3600
# The embedded file:// result backend has no native chord join: Celery's chord_unlock polls
# the outer steps' results, every second by default, which every round waited on after its
# last step; a quarter second costs a few file reads. (Redis joins chords natively.)
CELERY_RESULT_CHORD_RETRY_INTERVAL = 0.25
CELERY_TIMEZONE = TIME_ZONE
CELERY_BEAT_SCHEDULE_FILENAME = str(DIPACO_DATA_DIR / "celerybeat-schedule")
# Periodic tasks: expired leases go back to the queue (docs/design.md §4).
CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "sweep-leases": {"task": "dipaco_server.rounds.tasks.sweep_leases", "schedule": 30.0},
    # Rounds whose quorum is in and whose deadline has passed (or whose close was lost).
    "close-ready-rounds": {
        "task": "dipaco_server.rounds.tasks.close_ready_rounds",
        "schedule": 30.0,
    },
    # Uploads and module versions past retention (rounds.lifecycle.retention): the store stays bounded.
    "sweep-blobs": {"task": "dipaco_server.rounds.tasks.sweep_blobs", "schedule": 600.0},
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": "WARNING"},
    "loggers": {"dipaco_server": {"level": "INFO"}, "dipaco_web": {"level": "INFO"}},
}
