"""A unit's training windows in a manifest: presigned GETs of the row chunks they lie in.

Preparation writes each path's train split as row chunks in the order units read them
(dipaco.data.rows, runs.stages.upload_rows): position k of the path's order is a row of
T + 1 tokens in one chunk, and a unit's positions [first, first + count) are a few
consecutive chunks. The manifest names them, each with its sha256 and the segment of it
the unit reads (`start`, `count`, and `perm_seed` where a later pass reads the chunk's rows
in a new order); the worker streams them (dipaco.data.rows.UnitRows). Nothing here reads a
token: the path's row index (a few kilobytes of JSON, kept in memory once read) and the
signing are all the work, so a manifest costs the same at 150M as at tiny. A lease's URLs
cover its own chunks only: its rows, plus at most the partial chunks at its two ends.

A run prepared before row chunks has no row index; its manifests are refused with a
message to prepare the data again, never served other windows.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.utils import timezone

from dipaco.config import RunConfig
from dipaco.data.rows import FORMAT, rows_per_chunk
from dipaco.data.windows import path_seed
from dipaco_server.rounds.models import Lease
from dipaco_server.runs import keys
from dipaco_server.runs.errors import DataNotReady
from dipaco_server.runs.rows import row_index
from dipaco_server.storage import BlobStore
from dipaco_server.storage.base import MAX_EXPIRES_S

__all__ = ["data_url_expires_s", "rows_manifest", "unit_rows"]

DATA_URL_MIN_EXPIRES_S = 900


def data_url_expires_s(hard_deadline: datetime | None, now: datetime | None = None) -> int:
    """A chunk URL lives until the lease cannot run any longer (its hard deadline), as the
    worker fetches the last chunk near the unit's end; at least 15 minutes, at most 7 days."""
    if hard_deadline is None:
        return DATA_URL_MIN_EXPIRES_S
    left = (hard_deadline - (now or timezone.now())).total_seconds()
    return int(min(MAX_EXPIRES_S, max(DATA_URL_MIN_EXPIRES_S, left + DATA_URL_MIN_EXPIRES_S)))


def unit_rows(store: BlobStore, lease: Lease, config: RunConfig, dtype: str) -> dict[str, Any]:
    """The manifest's "data" for `lease`: its unit's row segments with presigned GETs."""
    unit = lease.unit
    return rows_manifest(
        store, run_id=unit.round.run_id, path=unit.path.index, phase=unit.path.phase,
        config=config, dtype=dtype, first=unit.data_position, count=unit.data_windows,
        expires_s=data_url_expires_s(lease.hard_deadline),
    )  # fmt: skip


def rows_manifest(
    store: BlobStore,
    *,
    run_id: int,
    path: int,
    phase: int,
    config: RunConfig,
    dtype: str,
    first: int,
    count: int,
    expires_s: int,
) -> dict[str, Any]:
    """Positions first .. first + count - 1 of a path's order: the segments of the row
    chunks they lie in, each with its chunk's presigned GET and sha256. Reads the row
    index only."""
    index = row_index(store, run_id, path, phase)
    per_chunk = rows_per_chunk(config, int(dtype[-1]))
    problem = index.matches(config.model.seq_len, path_seed(config, path), per_chunk)
    if index.dtype != dtype:
        problem = f"the rows hold {index.dtype} tokens, the run's vocabulary needs {dtype}"
    if problem:
        raise DataNotReady(
            f"path {path}'s row chunks do not fit the run: {problem}; prepare the run's data again",
            path=path,
        )
    chunks = []
    for segment in index.order.segments(first, count):
        info = index.chunks[segment.chunk]
        key = keys.rows_chunk_key(run_id, path, segment.chunk, phase)
        chunks.append({
            "chunk": segment.chunk,
            "key": key,
            "url": store.presigned_get(key, expires_s),
            "sha256": info.sha256,
            "size": info.bytes,
            "rows": info.rows,
            "start": segment.start,
            "count": segment.count,
            "perm_seed": segment.perm_seed,
        })  # fmt: skip
    return {
        "format": FORMAT,
        "dtype": dtype,
        "seq_len": index.seq_len,
        "first_position": first,
        "windows": count,
        "tokens": count * (index.seq_len + 1),
        "expires_in_s": expires_s,
        "chunks": chunks,
    }
