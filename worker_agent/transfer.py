"""Moving bytes through presigned URLs: resumable downloads, uploads, and the blob cache.

Downloads go to ``<dest>.part`` and resume with an HTTP ``Range`` request from where
the part ends, within one run (a retry) and across restarts (the part stays on disk).
A server that ignores ``Range`` (answers 200 with the whole object) is handled by
starting over and skipping to the wanted byte. `BlobCache` keeps module weights and
train shards by sha256: a hit is re-hashed before use, a corrupt file is deleted and fetched again,
and a download that does not match its sha256 is never renamed into the cache.
Every transfer goes through `worker_agent.retry`; a full disk stops the agent with a
message naming the data directory.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, cast

import httpx

from worker_agent.client import UploadTarget, parse_error
from worker_agent.errors import DiskFull, Interrupted, ServerError
from worker_agent.retry import Backoff, RetryAttempt, is_transient, retry

__all__ = ["BlobCache", "ChecksumMismatch", "TransferMeter", "Transfers", "sha256_of"]

log = logging.getLogger(__name__)
CHUNK = 1 << 20


class ChecksumMismatch(Exception):
    """Downloaded bytes do not hash to the manifest's sha256 (transient: fetch again)."""


@dataclass
class TransferMeter:
    """Bytes moved and the recent speed, for the progress display."""

    total_bytes: int = 0
    _window_start: float = 0.0
    _window_bytes: int = 0
    bytes_per_second: float = 0.0

    def add(self, n: int) -> None:
        now = time.monotonic()
        if self._window_start == 0.0:
            self._window_start = now
        self.total_bytes += n
        self._window_bytes += n
        elapsed = now - self._window_start
        if elapsed >= 0.5:
            self.bytes_per_second = self._window_bytes / elapsed
            self._window_start, self._window_bytes = now, 0


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def disk_errors(data_dir: Path) -> Iterator[None]:
    """ENOSPC (and EDQUOT) as DiskFull naming the directory; other errors pass."""
    try:
        yield
    except Exception as exc:
        # safetensors reports a full disk as its own error type, with the OS's message.
        full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or "No space left on device" in str(exc):
            raise DiskFull(
                f"the disk holding {data_dir} is full ({exc}); free some space "
                "or point --data-dir at a larger disk"
            ) from exc
        raise


def _transient(error: BaseException) -> bool:
    return isinstance(error, ChecksumMismatch) or is_transient(error)


class _MeteredFile:
    """A file for httpx to stream up: counts bytes, stops when asked. Has fileno() for length."""

    def __init__(self, handle: BinaryIO, meter: TransferMeter, stop: threading.Event | None):
        self.handle, self.meter, self.stop = handle, meter, stop

    def fileno(self) -> int:
        return self.handle.fileno()

    def __iter__(self) -> Iterator[bytes]:  # httpx streams an iterable; it calls read()
        return iter(lambda: self.read(CHUNK), b"")

    def read(self, size: int = -1) -> bytes:
        if self.stop is not None and self.stop.is_set():
            raise Interrupted("stopped during an upload")
        data = self.handle.read(size)
        self.meter.add(len(data))
        return data


class Transfers:
    """GET and POST (or PUT) through presigned URLs with one retry policy and one meter."""

    def __init__(
        self,
        data_dir: Path,
        *,
        policy: Backoff | None = None,
        stop: threading.Event | None = None,
        on_retry: Callable[[RetryAttempt], None] | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        self.data_dir = data_dir
        self.policy = policy or Backoff()
        self.stop = stop
        self.on_retry = on_retry
        self.meter = TransferMeter()
        self.http = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))

    def close(self) -> None:
        self.http.close()

    def _retry(self, call: Callable[[], None], what: str) -> None:
        retry(
            call,
            self.policy,
            what=what,
            transient=_transient,
            stop=self.stop,
            on_retry=self.on_retry,
        )

    def download(
        self,
        url: str,
        dest: Path,
        *,
        start: int = 0,
        end: int | None = None,
        sha256: str | None = None,
        what: str = "download",
    ) -> Path:
        """Bytes [start, end) of `url` into `dest` (atomically), resuming `dest.part`."""
        part = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)

        def attempt() -> None:
            with disk_errors(self.data_dir):
                self._fetch_part(url, part, start, end)
                if sha256 is not None and sha256_of(part) != sha256:
                    part.unlink()
                    raise ChecksumMismatch(f"{what}: the bytes do not match sha256 {sha256}")
                os.replace(part, dest)

        self._retry(attempt, what)
        return dest

    def _fetch_part(self, url: str, part: Path, start: int, end: int | None) -> None:
        have = part.stat().st_size if part.exists() else 0
        wanted = None if end is None else end - start
        if wanted is not None and have >= wanted:
            if have > wanted:
                part.unlink()  # not ours to trust: start over
                have = 0
            else:
                return
        headers = {}
        if have or start or end is not None:
            last = "" if end is None else str(end - 1)
            headers["Range"] = f"bytes={start + have}-{last}"
        with self.http.stream("GET", url, headers=headers) as response:
            if response.status_code == 416:  # the part is stale: start again
                part.unlink(missing_ok=True)
                raise ServerError(503, "range_not_satisfiable", "restarting the download")
            if response.status_code >= 400:
                response.read()
                raise parse_error(response)
            skip = 0
            if response.status_code == 200 and headers:
                # The server ignored Range and sends the object from byte 0.
                have, skip = 0, start
                part.unlink(missing_ok=True)
            remaining = None if wanted is None else wanted - have
            with open(part, "ab") as out:
                for chunk in response.iter_bytes():  # as received: a cut keeps what came
                    if self.stop is not None and self.stop.is_set():
                        raise Interrupted("stopped during a download")
                    if skip:
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                    if remaining is not None:
                        chunk = chunk[:remaining]
                        remaining -= len(chunk)
                    out.write(chunk)
                    self.meter.add(len(chunk))
                    if remaining == 0:
                        break
        got = part.stat().st_size
        if wanted is not None and got != wanted:
            raise ServerError(503, "incomplete_download", f"got {got} of {wanted} bytes")

    def upload(self, target: UploadTarget, path: Path) -> None:
        """POST `path` to the target's presigned form (a replay overwrites the same key).

        A form POST, not a PUT: the store enforces the signed content-length-range itself
        (S3 presigned POST policy; the local store's signed max_bytes), so an upload larger
        than the server allows is refused at the store, never written (a worker cannot fill the store). A raw
        PUT is used only where the server offers no form.
        """
        size = path.stat().st_size
        if size > target.max_bytes:
            raise ValueError(
                f"{path} is {size} bytes; the server takes at most {target.max_bytes} for "
                f"module {target.module_id}"
            )

        def attempt() -> None:
            with open(path, "rb") as handle:
                body = _MeteredFile(handle, self.meter, self.stop)
                if target.post_url:
                    response = self.http.post(
                        target.post_url,
                        data=dict(target.post_fields),
                        # httpx reads it in chunks: only .read is used (and fileno for size)
                        files={
                            "file": (path.name, cast(BinaryIO, body), "application/octet-stream")
                        },
                    )
                else:
                    response = self.http.put(
                        target.put_url,
                        content=body,
                        headers={"Content-Type": "application/octet-stream"},
                    )
            if response.status_code >= 400:
                raise parse_error(response)

        self._retry(attempt, f"upload of module {target.module_id}")


class BlobCache:
    """Module weights and train shards under ``<root>/<sha256>``, verified on every use."""

    def __init__(self, root: Path, transfers: Transfers) -> None:
        self.root = root
        self.transfers = transfers
        root.mkdir(parents=True, exist_ok=True)

    def path_for(self, sha256: str) -> Path:
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise ValueError(f"sha256 {sha256!r} is not 64 lowercase hex digits")
        return self.root / sha256

    def fetch(self, url: str, sha256: str, size: int | None = None, what: str = "blob") -> Path:
        """The verified local copy of the blob, downloading it (resumably) if needed."""
        path = self.path_for(sha256)
        if path.exists():
            if (size is None or path.stat().st_size == size) and sha256_of(path) == sha256:
                os.utime(path)  # mtime marks use, for prune (atime is often not kept)
                return path
            log.warning("cached %s is corrupt; downloading it again", path)
            path.unlink()
        return self.transfers.download(url, path, sha256=sha256, what=what)

    def prune(self, keep: set[str], max_bytes: int) -> int:
        """Delete least-recently-used blobs not in `keep` until the cache fits; bytes freed."""
        files = [p for p in self.root.iterdir() if p.is_file() and p.name not in keep]
        total = sum(p.stat().st_size for p in self.root.iterdir() if p.is_file())
        freed = 0
        for path in sorted(files, key=lambda p: p.stat().st_mtime):
            if total - freed <= max_bytes:
                break
            freed += path.stat().st_size
            path.unlink(missing_ok=True)
        return freed
