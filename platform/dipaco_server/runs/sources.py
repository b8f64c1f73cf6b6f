"""Where corpora may come from: ``"stdlib"``, a path under a configured data root, or an
``s3://bucket/prefix`` in an allowed bucket.

A dataset's source (and a run's ``data.corpus`` when it has no dataset) is read by the
server itself, so a staff token that could name any path could make the server read,
count and serve back any file it can open: the secret key file in the data dir, the
SQLite database, /etc. Every source therefore goes through `check_source`, which
resolves symbolic links and ``..`` and refuses anything outside ``DIPACO_DATA_ROOTS``
(settings; default ``DIPACO_DATA_DIR/corpus``) with a 422 that names the setting.

An ``s3://`` source is read with the server's own S3 credentials (`s3_options`: the
``S3_*`` settings, else the AWS chain), which may reach buckets no corpus should come from,
so its bucket must be in ``DIPACO_SOURCE_BUCKETS`` (none by default); no credential is
ever part of a source, a run's config or a page.

One function, called by the admin API, run creation, preparation (the roots may have
changed since) and the dashboard's dataset form.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

from dipaco.data.sources import S3Options, is_s3, s3_bucket
from dipaco_server.errors import ServiceError

BUILTIN_SOURCES = ("stdlib",)
MAX_SOURCE_LENGTH = 1000


class SourceOutsideDataRoots(ServiceError):
    """details: {"source", "data_roots", "setting"}."""

    code, status = "source_outside_data_roots", 422


class SourceInvalid(ServiceError):
    code, status = "source_invalid", 422


def data_roots() -> list[Path]:
    """The configured roots (settings.DIPACO_DATA_ROOTS), resolved, read per call."""
    return [Path(root).resolve() for root in settings.DIPACO_DATA_ROOTS]


class SourceBucketNotAllowed(ServiceError):
    """details: {"source", "bucket", "allowed", "setting"}."""

    code, status = "source_bucket_not_allowed", 422


def s3_options() -> S3Options:
    """The credentials s3:// corpora are read with: the blob store's S3 settings when it
    is on S3, else pyarrow's AWS chain (environment, instance profile)."""
    store = settings.DIPACO_BLOB_STORE
    if store.get("backend") != "s3":
        return S3Options()
    return S3Options(
        endpoint_url=store.get("endpoint_url"),
        access_key=store.get("access_key_id"),
        secret_key=store.get("secret_access_key"),
        region=store.get("region"),
    )


def _check_s3(source: str) -> str:
    bucket = s3_bucket(source)
    allowed = list(settings.DIPACO_SOURCE_BUCKETS)
    if bucket not in allowed:
        raise SourceBucketNotAllowed(
            f"source {source[:200]!r} is in bucket {bucket[:64]!r}, which is not in "
            f"DIPACO_SOURCE_BUCKETS ({', '.join(allowed) or 'none'}); have the operator add "
            "the bucket to DIPACO_SOURCE_BUCKETS (comma-separated) or copy the corpus there",
            source=source[:200],
            bucket=bucket[:64],
            allowed=allowed,
            setting="DIPACO_SOURCE_BUCKETS",
        )
    return source


def check_source(source: str) -> str:
    """`source` stripped when it is "stdlib" or an absolute path inside a data root.

    Raises SourceInvalid for a relative or over-long path and SourceOutsideDataRoots,
    naming DIPACO_DATA_ROOTS and the roots, for a path (after resolving links) outside
    every root. The path need not exist yet: preparation reports a missing corpus.
    """
    source = source.strip()
    if source in BUILTIN_SOURCES:
        return source
    if is_s3(source) and len(source) <= MAX_SOURCE_LENGTH and "\x00" not in source:
        return _check_s3(source)
    if not source.startswith("/") or len(source) > MAX_SOURCE_LENGTH or "\x00" in source:
        raise SourceInvalid(
            f'source {source[:200]!r}: use "stdlib", an absolute path on the server '
            f"(at most {MAX_SOURCE_LENGTH} characters) under DIPACO_DATA_ROOTS, or "
            "s3://bucket/prefix in a bucket of DIPACO_SOURCE_BUCKETS",
            source=source[:200],
        )
    roots = data_roots()
    try:
        resolved = Path(source).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, an unreadable parent
        resolved = None
    if resolved is None or not any(resolved.is_relative_to(root) for root in roots):
        shown = os.pathsep.join(str(root) for root in roots) or "(none)"
        raise SourceOutsideDataRoots(
            f"source {source[:200]!r} is outside the data roots ({shown}); put the corpus "
            "under one of them, or have the operator add its directory to DIPACO_DATA_ROOTS "
            f'(absolute paths separated by "{os.pathsep}"), or use "stdlib"',
            source=source[:200],
            data_roots=[str(root) for root in roots],
            setting="DIPACO_DATA_ROOTS",
        )
    return source
