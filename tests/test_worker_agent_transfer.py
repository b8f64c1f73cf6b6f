"""Downloads, uploads and the blob cache over real HTTP, against a tiny loopback server.

`StubServer` serves blobs with or without HTTP Range support and injects one fault per
request from a list (cut the body short, corrupt a byte, answer 500), which is how a
flaky network and a broken store look from the agent's side.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from worker_agent.client import UploadTarget
from worker_agent.errors import DiskFull, ServerError
from worker_agent.retry import Backoff
from worker_agent.transfer import BlobCache, ChecksumMismatch, Transfers, disk_errors

FAST = Backoff(attempts=4, initial_s=0.01, max_s=0.02)
BLOB = bytes(range(256)) * 64  # 16 KiB


class StubServer(ThreadingHTTPServer):
    """Blobs by path; `faults` is consumed one per request; `requests` records each one."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.blobs: dict[str, bytes] = {}
        self.json_routes: dict[str, tuple[int, Any]] = {}
        self.faults: list[str] = []
        self.honour_range = True
        self.requests: list[tuple[str, str, str | None]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: StubServer

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _fault(self) -> str | None:
        return self.server.faults.pop(0) if self.server.faults else None

    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(("GET", path, self.headers.get("Range")))
        fault = self._fault()
        if path in self.server.json_routes:
            self._json(*self.server.json_routes[path])
            return
        if fault == "500":
            self._json(500, {"error": {"code": "internal_error", "message": "boom"}})
            return
        blob = self.server.blobs.get(path)
        if blob is None:
            self._json(404, {"error": {"code": "blob_not_found", "message": f"no {path}"}})
            return
        start, end, status = 0, len(blob), 200
        wanted = self.headers.get("Range")
        if wanted and self.server.honour_range:
            first, _, last = wanted.removeprefix("bytes=").partition("-")
            start, end, status = int(first), (int(last) + 1 if last else len(blob)), 206
        body = blob[start:end]
        if fault == "corrupt":
            body = bytes([body[0] ^ 0xFF]) + body[1:]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(blob)}")
        self.end_headers()
        if fault == "cut":  # half the body, then the connection drops
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            return
        self.wfile.write(body)

    def do_PUT(self) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(("PUT", path, None))
        data = self.rfile.read(int(self.headers["Content-Length"]))
        if self._fault() == "403":
            self._json(403, {"error": {"code": "url_expired", "message": "ask again"}})
            return
        self.server.blobs[path] = data
        self._json(200, {"size": len(data)})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        self.server.requests.append(("POST", path, None))
        data = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if path == "/form":  # a presigned form: keep the multipart body as it came
            if self._fault() == "403":
                self._json(403, {"error": {"code": "url_expired", "message": "ask again"}})
                return
            self.server.blobs[path] = data
            self.send_response(204)
            self.end_headers()
            return
        self._json(
            *self.server.json_routes.get(path, (404, {"error": {"code": "x", "message": "x"}}))
        )


@pytest.fixture
def stub() -> Iterator[StubServer]:
    server = StubServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def transfers(tmp_path: Path) -> Iterator[Transfers]:
    moving = Transfers(tmp_path, policy=FAST)
    yield moving
    moving.close()


def test_a_download_cut_short_resumes_with_a_range_request(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/b"], stub.faults = BLOB, ["cut"]
    dest = transfers.download(f"{stub.url}/b", tmp_path / "b")
    assert dest.read_bytes() == BLOB
    assert [r[2] for r in stub.requests] == [None, f"bytes={len(BLOB) // 2}-"]
    assert not (tmp_path / "b.part").exists()


def test_a_part_left_by_an_earlier_process_is_continued_not_fetched_again(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/b"] = BLOB
    (tmp_path / "b.part").write_bytes(BLOB[:1000])
    transfers.download(f"{stub.url}/b", tmp_path / "b")
    assert (tmp_path / "b").read_bytes() == BLOB
    assert stub.requests == [("GET", "/b", "bytes=1000-")]


def test_a_window_is_fetched_by_byte_range_even_from_a_server_that_ignores_range(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/shard"] = BLOB
    transfers.download(f"{stub.url}/shard", tmp_path / "w1", start=100, end=300)
    assert (tmp_path / "w1").read_bytes() == BLOB[100:300]
    assert stub.requests[-1][2] == "bytes=100-299"
    stub.honour_range = False  # like Django's FileResponse: 200 with the whole object
    (tmp_path / "w2.part").write_bytes(BLOB[100:150])
    transfers.download(f"{stub.url}/shard", tmp_path / "w2", start=100, end=300)
    assert (tmp_path / "w2").read_bytes() == BLOB[100:300]


def test_the_cache_uses_a_verified_copy_and_fetches_a_corrupt_one_again(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/m"] = BLOB
    digest = hashlib.sha256(BLOB).hexdigest()
    cache = BlobCache(tmp_path / "cache", transfers)
    path = cache.fetch(f"{stub.url}/m", digest, len(BLOB))
    assert path == tmp_path / "cache" / digest and path.read_bytes() == BLOB
    cache.fetch(f"{stub.url}/m", digest, len(BLOB))
    assert len(stub.requests) == 1, "an intact cached copy is not downloaded again"

    path.write_bytes(b"\xff" + BLOB[1:])  # bit rot, or a truncated write from a crash
    assert cache.fetch(f"{stub.url}/m", digest, len(BLOB)).read_bytes() == BLOB
    assert len(stub.requests) == 2


def test_bytes_that_do_not_match_their_sha256_are_retried_then_refused(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/m"] = BLOB
    digest = hashlib.sha256(BLOB).hexdigest()
    cache = BlobCache(tmp_path / "cache", transfers)
    stub.faults = ["corrupt"]
    assert cache.fetch(f"{stub.url}/m", digest).read_bytes() == BLOB  # second try is clean
    cache.path_for(digest).unlink()
    stub.faults = ["corrupt"] * FAST.attempts
    with pytest.raises(ChecksumMismatch):
        cache.fetch(f"{stub.url}/m", digest)
    assert not cache.path_for(digest).exists(), "bad bytes never enter the cache"


def test_a_server_error_is_retried_and_a_missing_blob_is_not(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    stub.blobs["/b"], stub.faults = BLOB, ["500", "500"]
    assert transfers.download(f"{stub.url}/b", tmp_path / "b").read_bytes() == BLOB
    assert len(stub.requests) == 3
    with pytest.raises(ServerError) as refused:
        transfers.download(f"{stub.url}/missing", tmp_path / "m")
    assert refused.value.code == "blob_not_found" and len(stub.requests) == 4


def test_an_upload_posts_the_presigned_form_and_an_expired_url_is_not_retried(
    stub: StubServer, transfers: Transfers, tmp_path: Path
) -> None:
    source = tmp_path / "delta.safetensors"
    source.write_bytes(BLOB)
    fields = {"key": "k", "policy": "p0l1cy"}
    target = UploadTarget("0.0", "k", len(BLOB), f"{stub.url}/up", f"{stub.url}/form", fields)
    transfers.upload(target, source)
    form = stub.blobs["/form"]  # the signed fields first, then the file (S3's order)
    assert BLOB in form and form.index(b"p0l1cy") < form.index(BLOB)
    assert transfers.meter.total_bytes == len(BLOB)
    stub.faults = ["403"]
    with pytest.raises(ServerError, match="url_expired"):
        transfers.upload(target, source)
    assert [r[0] for r in stub.requests] == ["POST", "POST"]
    # Only where the server offers no form (none does today) is the PUT used.
    put_only = UploadTarget("0.0", "k", len(BLOB), f"{stub.url}/up", "", {})
    transfers.upload(put_only, source)
    assert stub.blobs["/up"] == BLOB
    too_small = UploadTarget("0.0", "k", 10, f"{stub.url}/up", f"{stub.url}/form", {})
    with pytest.raises(ValueError, match="at most 10"):
        transfers.upload(too_small, source)


def test_a_full_disk_stops_with_a_message_naming_the_data_directory(tmp_path: Path) -> None:
    with pytest.raises(DiskFull, match=str(tmp_path)), disk_errors(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(PermissionError), disk_errors(tmp_path):
        raise PermissionError(errno.EACCES, "Permission denied")


def test_the_cache_drops_the_least_recently_used_blobs_beyond_its_size(
    transfers: Transfers, tmp_path: Path
) -> None:
    cache = BlobCache(tmp_path / "cache", transfers)
    blobs = {}
    for age, name in enumerate("abc"):
        digest = hashlib.sha256(name.encode()).hexdigest()
        path = cache.path_for(digest)
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + age, 1000 + age))  # a is the oldest
        blobs[name] = path
    freed = cache.prune(keep={blobs["a"].name}, max_bytes=150)
    assert freed == 200 and blobs["a"].exists(), "kept blobs stay whatever their age"
    assert not blobs["b"].exists() and not blobs["c"].exists()
