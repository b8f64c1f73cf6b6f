"""Where corpora may come from: ``"stdlib"`` or a path under a configured data root.

A dataset's source (and a run's ``data.corpus`` when it has no dataset) is read by the
server itself, so a staff token that could name any path could make the server read,
count and serve back any file it can open: the secret key file in the data dir, the
SQLite database, /etc. Every source therefore goes through `check_source`, which
resolves symbolic links and ``..`` and refuses anything outside ``DIPACO_DATA_ROOTS``
(settings; default ``DIPACO_DATA_DIR/corpus``) with a 422 that names the setting.

One function, called by the admin API, run creation, preparation (the roots may have
changed since) and the dashboard's dataset form.
"""

from __future__ import annotations

import os
from pathlib import Path

from django.conf import settings

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


def check_source(source: str) -> str:
    """`source` stripped when it is "stdlib" or an absolute path inside a data root.

    Raises SourceInvalid for a relative or over-long path and SourceOutsideDataRoots,
    naming DIPACO_DATA_ROOTS and the roots, for a path (after resolving links) outside
    every root. The path need not exist yet: preparation reports a missing corpus.
    """
    source = source.strip()
    if source in BUILTIN_SOURCES:
        return source
    if not source.startswith("/") or len(source) > MAX_SOURCE_LENGTH or "\x00" in source:
        raise SourceInvalid(
            f'source {source[:200]!r}: use "stdlib" or an absolute path on the server '
            f"(at most {MAX_SOURCE_LENGTH} characters) under DIPACO_DATA_ROOTS",
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
