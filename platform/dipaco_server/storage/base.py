"""The blob store interface (the factory that builds the configured one is factory.py).

Two backends implement `BlobStore` and pass the same contract suite
(tests/test_blobstore_contract.py): `S3BlobStore` (any S3-compatible
endpoint) and `LocalBlobStore` (a directory served by this app's /blobs/
views with HMAC-signed URLs). Callers only ever see this interface.

Semantics both backends share:

- Keys pass `validate_key` on every call; a bad key raises InvalidBlobKey
  before any I/O.
- Writes are atomic: a reader sees the old blob or the new one, never a
  part. Writing an existing key replaces it. Blobs are immutable by
  convention (docs/design.md §4: versions and leases are in the key, and the
  database row naming the current version is what moves), not by refusal:
  an idempotent task that retries may rewrite its own output, and a worker
  may retry an upload whose response it lost.
- Reading a missing key raises BlobNotFound; deleting one is a no-op.
- Presigned URLs expire after `expires_s` (1 s to 7 days, S3's limit) and
  name exactly one key and one method. `max_bytes` is enforced by the local
  views for PUT and POST, and by S3 for POST (content-length-range); S3
  cannot limit a presigned PUT's size. Either way the server re-checks size
  and checksum of every upload before using it (docs/design.md §7).
"""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .keys import BlobStoreError, validate_key

MAX_EXPIRES_S = 7 * 24 * 3600  # SigV4 presigned URLs cannot outlive 7 days.
CHUNK_SIZE = 1024 * 1024


@dataclass(frozen=True)
class PresignedPost:
    """An HTML-form upload: POST `fields` plus a `file` field (last) to `url`.

    >>> httpx.post(post.url, data=post.fields, files={"file": open(p, "rb")})
    """

    url: str
    fields: dict[str, str]


class BlobStore(abc.ABC):
    """Flat key → bytes storage with presigned URLs for workers."""

    # Whether a presigned PUT's max_bytes is enforced by the store itself. Workers are
    # handed a PUT only where it is (an unbounded PUT could fill the store); everywhere else they POST a form whose
    # signed policy carries content-length-range.
    bounds_put: bool = False

    # --- writing -----------------------------------------------------------
    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None:
        """Store `data` under `key`, replacing any blob there."""

    @abc.abstractmethod
    def put_file(self, key: str, path: str | Path) -> None:
        """Store the file at `path` under `key`; large files go up in parts on S3."""

    # --- reading -----------------------------------------------------------
    @abc.abstractmethod
    def open(self, key: str) -> BinaryIO:
        """A readable binary stream of the blob; close it (or use `with`)."""

    def get_bytes(self, key: str) -> bytes:
        with self.open(key) as stream:
            return stream.read()

    @abc.abstractmethod
    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the blob, cut at its end (a start past it gives b"");
        raises BlobNotFound, and ValueError for a negative start or an end before it. The
        server reads windows of a shard this way, never the whole shard (dipaco.data.ranged)."""

    def iter_chunks(self, key: str, chunk_size: int = CHUNK_SIZE) -> Iterator[bytes]:
        """The blob in chunks. Raises BlobNotFound here, not on the first `next()`."""
        stream = self.open(key)

        def chunks() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(chunk_size):
                    yield chunk

        return chunks()

    def download_to(self, key: str, path: str | Path) -> None:
        """Copy the blob to `path` through a temporary file, so `path` is never partial."""
        with self.open(key) as stream:
            write_atomically(stream, Path(path))

    # --- metadata ----------------------------------------------------------
    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def size(self, key: str) -> int:
        """Size in bytes; raises BlobNotFound."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob; a missing key is not an error."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Every key that starts with `prefix` (a string prefix, as in S3), sorted."""

    # --- presigned URLs ----------------------------------------------------
    @abc.abstractmethod
    def presigned_get(self, key: str, expires_s: int) -> str: ...

    @abc.abstractmethod
    def presigned_put(self, key: str, expires_s: int, max_bytes: int) -> str:
        """A URL for one raw-body PUT (S3 cannot enforce `max_bytes` here: `bounds_put`)."""

    @abc.abstractmethod
    def presigned_post(self, key: str, expires_s: int, max_bytes: int) -> PresignedPost: ...


def write_atomically(stream: BinaryIO, path: Path) -> None:
    """`stream` to `path` through a temporary file beside it, so `path` is never partial."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(stream, out, CHUNK_SIZE)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def check_range(start: int, end: int) -> None:
    """Shared argument checks for ranged reads, so both backends refuse the same things."""
    if not isinstance(start, int) or not isinstance(end, int) or start < 0 or end < start:
        raise ValueError(f"a byte range needs 0 <= start <= end, got [{start!r}, {end!r})")


def check_presign_args(key: str, expires_s: int, max_bytes: int | None = None) -> None:
    """Shared argument checks for presigned URLs, so both backends refuse the same things."""
    validate_key(key)
    if not isinstance(expires_s, int) or not 1 <= expires_s <= MAX_EXPIRES_S:
        raise ValueError(f"expires_s must be an int from 1 to {MAX_EXPIRES_S}, got {expires_s!r}")
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
        raise ValueError(f"max_bytes must be a non-negative int, got {max_bytes!r}")


__all__ = ["BlobStore", "BlobStoreError", "PresignedPost", "check_presign_args", "check_range"]
