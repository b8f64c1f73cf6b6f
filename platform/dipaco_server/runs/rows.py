"""A path's row index (dipaco.data.rows): what a manifest signs chunk URLs from and the
scorer reads a unit's rows by. One small GET (a few kilobytes of JSON: a chunk's size and
digest each) per manifest; not cached, so a test database's reused run ids never meet
another run's index."""

from __future__ import annotations

from dipaco.data.rows import RowIndex
from dipaco_server.runs import keys
from dipaco_server.runs.errors import DataNotReady
from dipaco_server.storage import BlobNotFound, BlobStore

__all__ = ["row_index"]


def row_index(store: BlobStore, run_id: int, path: int, phase: int) -> RowIndex:
    """A path's row index (written after its chunks: found, they are all there)."""
    key = keys.rows_index_key(run_id, path, phase)
    try:
        index = RowIndex.from_json(store.get_bytes(key), where=f"row index {key}")
    except BlobNotFound:
        raise DataNotReady(
            f"path {path} of run {run_id} has no row chunks ({key}): its data was prepared "
            "before training data was stored in the order units read it, or not finished; "
            "prepare the run's data again (start a new run from the same dataset)",
            path=path,
        ) from None
    except ValueError as error:
        raise DataNotReady(str(error), path=path) from None
    return index
