"""A unit's training windows as a blob of its own, so a lease's data URL reads only them.

A lease used to get a presigned URL of its path's whole train shard: any worker holding
one lease could read every token of the path. Now the manifest's data URL points at a
blob cut for the unit: the windows at its positions (WorkUnit.data_position,
data_windows) of its path's seeded order, one row of seq_len + 1 tokens each
(dipaco.data.windows.ShardSource.unit_rows), which the worker reads with
dipaco.data.windows.UnitSource, batch for batch the same tokens as before.

The blob is cut on the first manifest request of a unit whose windows have none yet: its
windows are read from the path's shard by ranged GETs (dipaco.data.ranged: sorted, near
ones merged, several in flight), never by downloading the whole shard, which at a 150M
path is gigabytes for a unit's ~1/100th of it. Its key names the shard's digest, the
start and the count, so a check copy of the same windows and every later request reuse
it; its digest is kept in memory once computed.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

from dipaco_server.rounds import stages
from dipaco_server.runs import keys
from dipaco_server.storage import BlobStore
from dipaco_server.storage.keys import validate_key

_digests: dict[str, tuple[str, int]] = {}  # key -> (sha256, size) of cut blobs
# One lock per unit blob: two requests for one unit cut it once, while other units are cut
# beside it (at a 150M path a cut is a unit's ~256,000 windows: one lock for all serialised
# a round's first grants).
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


def _lock(key: str) -> threading.Lock:
    with _guard:
        return _locks.setdefault(key, threading.Lock())


@dataclass(frozen=True)
class UnitData:
    key: str
    sha256: str
    size: int  # bytes
    tokens: int
    windows: int
    first_position: int


def unit_data_key(
    run_id: int, phase: int, path: int, shard_sha256: str, first: int, count: int
) -> str:
    """<phase prefix>/data/<path>/units/<shard digest>-<first>-<count>.bin."""
    prefix = keys.phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/data/{path}/units/{shard_sha256[:16]}-{first}-{count}.bin")


def unit_data(
    store: BlobStore,
    *,
    run_id: int,
    phase: int,
    path: int,
    shard_sha256: str,
    dtype: str,
    seq_len: int,
    seed: int,
    first: int,
    count: int,
) -> UnitData:
    """The unit's window blob (cut and uploaded the first time): key, digest and size."""
    key = unit_data_key(run_id, phase, path, shard_sha256, first, count)
    with _lock(key):
        known = _digests.get(key)
        if known is None:
            if store.exists(key):
                data = store.get_bytes(key)
            else:
                shard = keys.data_key(run_id, path, "train", phase)
                with stages.timed("data_cutting"):  # the caller flushes it to its round
                    data = cut_unit(store, shard, dtype, seq_len, seed, first, count)
                    store.put_bytes(key, data)
            known = _digests[key] = (hashlib.sha256(data).hexdigest(), len(data))
    sha256, size = known
    return UnitData(key, sha256, size, count * (seq_len + 1), count, first)


def cut_unit(
    store: BlobStore, shard: str, dtype: str, seq_len: int, seed: int, first: int, count: int
) -> bytes:
    """The rows of windows first .. first + count - 1 of the shard under key `shard` in its
    seeded order (ShardSource.unit_rows), read by ranges."""
    # numpy and torch (under ShardSource) load here, not when the API's modules import.
    from dipaco.data.ranged import store_shard
    from dipaco.data.windows import ShardSource

    source = ShardSource(store_shard(store, shard, dtype), seq_len, seed)
    return bytes(source.unit_rows(first, count).tobytes())
