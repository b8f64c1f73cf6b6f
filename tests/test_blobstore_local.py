"""The local backend's own guarantees: the S3 test server checks neither
signatures nor sizes, so these run on the local store and its /blobs/ views
only. HTTP goes through the live server where the wire matters (sizes) and
through Django's test client where it does not.
"""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import pytest
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from dipaco_server.storage import InvalidBlobKey, get_blob_store, validate_key
from dipaco_server.storage.factory import build_blob_store
from dipaco_server.storage.local import LocalBlobStore
from dipaco_server.storage.uploads import BlobTooLarge, copy_limited
from dipaco_server.storage.views import blob as blob_view

KEY = "runs/1/rounds/0/u1/l1/0.0.safetensors"


@pytest.fixture
def store(settings, tmp_path: Path) -> LocalBlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_PUBLIC_URL = "http://testserver"
    built = get_blob_store()
    assert isinstance(built, LocalBlobStore)
    return built


@pytest.fixture
def live_store(settings, live_server, store: LocalBlobStore) -> LocalBlobStore:
    settings.DIPACO_PUBLIC_URL = live_server.url
    built = get_blob_store()
    assert isinstance(built, LocalBlobStore)
    return built


def local_path(url: str) -> str:
    """The path and query of a store URL, for Django's test client."""
    parts = urlsplit(url)
    return f"{parts.path}?{parts.query}"


def with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query))
    query.update(changes)
    return f"{parts.path}?{urlencode(query)}"


def assert_error(response, status: int, code: str) -> None:
    assert response.status_code == status, response.content
    body = json.loads(response.content)
    assert body["error"]["code"] == code
    assert body["error"]["message"]


def test_it_refuses_a_forged_signature_with_403(client, store: LocalBlobStore) -> None:
    store.put_bytes(KEY, b"secret weights")
    url = store.presigned_get(KEY, 60)
    signature = dict(parse_qsl(urlsplit(url).query))["signature"]
    other = build_blob_store(
        {"backend": "local", "root": store.root}, public_url="http://testserver", secret="other"
    )

    forgeries = [
        with_query(url, signature=("0" if signature[0] != "0" else "1") + signature[1:]),
        with_query(url, expires=str(int(time.time()) + 3600)),
        local_path(url).replace(KEY, "runs/1/rounds/0/u1/l1/1.0.safetensors"),
        local_path(other.presigned_get(KEY, 60)),
    ]
    for forged in forgeries:
        assert_error(client.get(forged), 403, "signature_invalid")
    assert_error(client.get(urlsplit(url).path), 403, "signature_missing")


def test_it_refuses_to_raise_an_upload_urls_size_limit(client, store: LocalBlobStore) -> None:
    url = store.presigned_put(KEY, 60, max_bytes=10)
    response = client.put(
        with_query(url, max_bytes="1000000"), b"x" * 100, "application/octet-stream"
    )
    assert_error(response, 403, "signature_invalid")
    assert not store.exists(KEY)


def test_it_refuses_an_expired_url_with_403(client, store: LocalBlobStore) -> None:
    store.put_bytes(KEY, b"weights")
    past = int(time.time()) - 1
    assert_error(
        client.get(local_path(store.signed_url("GET", KEY, past, None))), 403, "url_expired"
    )
    put_url = local_path(store.signed_url("PUT", KEY, past, 100))
    assert_error(client.put(put_url, b"new", "application/octet-stream"), 403, "url_expired")
    assert store.get_bytes(KEY) == b"weights"


def test_a_url_works_only_with_the_method_it_was_signed_for(client, store: LocalBlobStore) -> None:
    store.put_bytes(KEY, b"weights")
    get_url = local_path(store.presigned_get(KEY, 60))
    put_url = local_path(store.presigned_put(KEY, 60, 100))

    assert_error(client.put(get_url, b"new", "application/octet-stream"), 403, "signature_invalid")
    assert_error(client.get(put_url), 403, "signature_invalid")
    post = client.post(put_url, {"file": io.BytesIO(b"new")})
    assert_error(post, 403, "signature_invalid")
    assert_error(client.delete(get_url), 405, "method_not_allowed")
    assert store.get_bytes(KEY) == b"weights"


def test_it_refuses_an_oversized_put_with_413_and_stores_nothing(
    live_store: LocalBlobStore,
) -> None:
    url = live_store.presigned_put(KEY, 60, max_bytes=1000)

    assert_error(httpx.put(url, content=b"x" * 1001), 413, "blob_too_large")
    assert not live_store.exists(KEY)
    assert httpx.put(url, content=b"x" * 1000).status_code == 200
    assert live_store.size(KEY) == 1000


def test_it_refuses_an_oversized_post_with_413_and_stores_nothing(
    live_store: LocalBlobStore,
) -> None:
    # 5000 bytes is well within the form overhead allowance, so only the count
    # taken while the file streams can catch it, not the Content-Length check.
    post = live_store.presigned_post(KEY, 60, max_bytes=1000)

    response = httpx.post(post.url, data=post.fields, files={"file": ("d", b"x" * 5000)})

    assert_error(response, 413, "blob_too_large")
    assert not live_store.exists(KEY)
    assert list((live_store.root / ".tmp").iterdir()) == []
    exact = httpx.post(post.url, data=post.fields, files={"file": ("d", b"x" * 1000)})
    assert exact.status_code == 204
    assert live_store.size(KEY) == 1000


def test_the_size_limit_counts_bytes_read_not_the_declared_length() -> None:
    with pytest.raises(BlobTooLarge):
        copy_limited(io.BytesIO(b"x" * 200_000), io.BytesIO(), max_bytes=100_000, expected=10)
    out = io.BytesIO()
    assert copy_limited(io.BytesIO(b"x" * 10), out, max_bytes=10, expected=10) == 10


def test_a_put_without_content_length_is_refused_with_411(rf, store: LocalBlobStore) -> None:
    path = local_path(store.presigned_put(KEY, 60, 100))
    request = rf.generic("PUT", path, b"abc", "application/octet-stream")
    del request.META["CONTENT_LENGTH"]

    assert_error(blob_view(request, key=KEY), 411, "length_required")
    assert not store.exists(KEY)


def test_a_form_cut_short_stores_nothing(client, store: LocalBlobStore) -> None:
    path = local_path(store.presigned_post(KEY, 60, 100).url)
    body = (
        b'--XyZ\r\nContent-Disposition: form-data; name="file"; filename="d"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\nhalf a file"
    )
    response = client.generic("POST", path, body, "multipart/form-data; boundary=XyZ")

    assert_error(response, 400, "missing_file")
    assert not store.exists(KEY)


def test_malformed_uploads_get_a_4xx_json_error(client, store: LocalBlobStore) -> None:
    path = local_path(store.presigned_post(KEY, 60, 100).url)
    two_files = {"file": io.BytesIO(b"a"), "other": io.BytesIO(b"b")}
    assert_error(client.post(path, two_files), 400, "bad_form")
    assert_error(client.post(path, {"note": "no file"}), 400, "missing_file")
    assert_error(client.post(path, b"raw", "application/octet-stream"), 400, "bad_form")
    assert_error(client.get(with_query(path, expires="soon")), 403, "signature_invalid")
    missing = local_path(store.presigned_get("runs/1/nothing.bin", 60))
    assert_error(client.get(missing), 404, "blob_not_found")
    assert not store.exists(KEY)


def test_a_url_path_that_climbs_out_is_refused(client, store: LocalBlobStore, tmp_path) -> None:
    (tmp_path / "secret.txt").write_text("outside the root")
    for path in ("/blobs/%2e%2e/secret.txt", "/blobs/runs/%2E%2E/%2E%2E/secret.txt", "/blobs/"):
        assert_error(client.get(path + "?expires=1&signature=00"), 400, "invalid_key")


def test_a_symlink_inside_the_root_cannot_lead_out_of_it(store: LocalBlobStore, tmp_path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"not a blob")
    (store.root / "runs").mkdir()
    (store.root / "runs" / "link").symlink_to(outside)

    with pytest.raises(InvalidBlobKey, match="outside the store root"):
        store.get_bytes("runs/link/secret.bin")
    with pytest.raises(InvalidBlobKey, match="outside the store root"):
        store.put_bytes("runs/link/new.bin", b"x")
    assert store.list("runs/link/") == []
    assert sorted(p.name for p in outside.iterdir()) == ["secret.bin"]


def test_writes_leave_no_temporary_files_and_list_hides_the_temp_folder(
    store: LocalBlobStore,
) -> None:
    store.put_bytes("runs/1/a.bin", b"a")
    with pytest.raises(RuntimeError), store.writer("runs/1/b.bin") as out:
        out.write(b"half")
        raise RuntimeError("writer died")
    assert not store.exists("runs/1/b.bin")
    assert list((store.root / ".tmp").iterdir()) == []
    assert store.list() == ["runs/1/a.bin"]


@hypothesis_settings(database=None)
@given(st.text(alphabet="ab./\\-_%~ \x00", max_size=24))
def test_any_key_that_passes_validation_stays_under_the_root(key: str) -> None:
    root = Path("/srv/blobs")
    try:
        validate_key(key)
    except InvalidBlobKey:
        return
    assert os.path.normpath(root / key).startswith(f"{root}/")
    assert ".." not in key.split("/")


def test_the_factory_refuses_an_unknown_backend(settings) -> None:
    settings.DIPACO_BLOB_STORE = {"backend": "ftp"}
    with pytest.raises(ImproperlyConfigured, match="'local'"):
        get_blob_store()
