"""A blob store in a local directory, served by this app's /blobs/ views.

The embedded default (docs/design.md §3): no object-store service, yet workers get
URLs that behave like presigned S3 URLs (see signing.py and views.py).

Every key maps to ``<root>/<key>``. `validate_key` already refuses anything
that could climb out, and `path_for` also checks that the resolved path
(symlinks followed) is still under the root. Writes go to ``<root>/.tmp``
and are renamed into place, so readers never see a partial blob. One
limitation S3 does not have: a key cannot also be a directory of other keys
(``a`` and ``a/b`` cannot both exist); docs/design.md §5's layout never needs that.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlencode

from django.urls import reverse

from . import signing
from .base import CHUNK_SIZE, BlobStore, PresignedPost, check_presign_args, check_range
from .keys import BlobNotFound, BlobStoreError, InvalidBlobKey, validate_key, validate_prefix

TMP_DIR = ".tmp"  # keys cannot start with '.', so no key can name it


class LocalBlobStore(BlobStore):
    bounds_put = True  # the blob view counts the body against the URL's signed max_bytes

    def __init__(self, root: Path, *, public_url: str, secret: str) -> None:
        if not secret:
            raise ValueError("LocalBlobStore needs a secret (settings.SECRET_KEY) to sign URLs")
        root.mkdir(parents=True, exist_ok=True)
        self.root = root.resolve()
        self.public_url = public_url.rstrip("/")
        self._secret = secret

    def __repr__(self) -> str:
        return f"LocalBlobStore({str(self.root)!r})"

    def path_for(self, key: str) -> Path:
        """The file that holds `key`, refused if it would resolve outside the root."""
        path = (self.root / validate_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise InvalidBlobKey(f"blob key {key!r} resolves outside the store root {self.root}")
        return path

    # --- writing -----------------------------------------------------------
    @contextmanager
    def writer(self, key: str) -> Iterator[BinaryIO]:
        """Yield a file to write the blob into; it appears under `key` only on success."""
        dest = self.path_for(key)
        tmp_dir = self.root / TMP_DIR
        tmp_dir.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=tmp_dir, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out:
                yield out
                out.flush()
                os.fsync(out.fileno())  # the rename must not outlive the data in a crash
            try:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp, dest)
            except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
                raise BlobStoreError(
                    f"blob key {key!r} collides with an existing key: in a local store a key "
                    "cannot also be a folder of other keys"
                ) from exc
        finally:
            Path(tmp).unlink(missing_ok=True)

    def put_bytes(self, key: str, data: bytes) -> None:
        with self.writer(key) as out:
            out.write(data)

    def put_file(self, key: str, path: str | Path) -> None:
        with open(path, "rb") as src, self.writer(key) as out:
            shutil.copyfileobj(src, out, CHUNK_SIZE)

    # --- reading -----------------------------------------------------------
    def open(self, key: str) -> BinaryIO:
        path = self.path_for(key)
        try:
            return open(path, "rb")
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise BlobNotFound(f"no blob under key {key!r}") from None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        check_range(start, end)
        with self.open(key) as stream:
            stream.seek(start)
            return stream.read(end - start)

    def exists(self, key: str) -> bool:
        return self.path_for(key).is_file()

    def size(self, key: str) -> int:
        path = self.path_for(key)
        if not path.is_file():
            raise BlobNotFound(f"no blob under key {key!r}")
        return path.stat().st_size

    def delete(self, key: str) -> None:
        path = self.path_for(key)
        if path.is_file():
            path.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        folder = prefix.rpartition("/")[0]
        base = (self.root / folder).resolve()
        if not base.is_relative_to(self.root) or not base.is_dir():
            return []
        keys = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]  # skip .tmp
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in filenames:
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix) and not name.startswith("."):
                    keys.append(key)
        return sorted(keys)

    # --- presigned URLs ----------------------------------------------------
    def signed_url(self, method: str, key: str, expires_at: int, max_bytes: int | None) -> str:
        """A URL for `method` on `key` valid until `expires_at` (Unix seconds)."""
        validate_key(key)
        query = signing.query_for(self._secret, method, key, expires_at, max_bytes)
        path = reverse("dipaco_blobs:blob", kwargs={"key": key})
        return f"{self.public_url}{path}?{urlencode(query)}"

    def authorise(self, method: str, key: str, query: Mapping[str, str]) -> int | None:
        """Check a request's signed query (signing.verify); return its max_bytes."""
        return signing.verify(self._secret, method, key, query)

    def presigned_get(self, key: str, expires_s: int) -> str:
        check_presign_args(key, expires_s)
        return self.signed_url("GET", key, int(time.time()) + expires_s, None)

    def presigned_put(self, key: str, expires_s: int, max_bytes: int) -> str:
        check_presign_args(key, expires_s, max_bytes)
        return self.signed_url("PUT", key, int(time.time()) + expires_s, max_bytes)

    def presigned_post(self, key: str, expires_s: int, max_bytes: int) -> PresignedPost:
        # The signature rides in the URL, not in the form as on S3, so the view
        # can refuse a bad request before it reads a byte of the body.
        check_presign_args(key, expires_s, max_bytes)
        url = self.signed_url("POST", key, int(time.time()) + expires_s, max_bytes)
        return PresignedPost(url=url, fields={})
