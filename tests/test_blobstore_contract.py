"""One contract for every blob store: each test runs on the local backend (a tmp
root served by the real /blobs/ views on pytest-django's live server) and on
the S3 backend (the moto S3 server from conftest), and presigned URLs are
fetched with a real HTTP client. Checks only one backend can make (signatures,
size limits: the S3 test server enforces neither) are in test_blobstore_local.py
and test_blobstore_s3.py.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import pytest

from dipaco_server.storage import BlobNotFound, BlobStore, InvalidBlobKey, get_blob_store

MiB = 1024 * 1024
# S3's smallest part is 5 MiB, so a 12 MiB file goes up in three parts.
SMALL_PARTS = {"multipart_threshold": 5 * MiB, "multipart_chunk_size": 5 * MiB}

TRAVERSAL_KEYS = [
    "../outside.bin",
    "runs/../../outside.bin",
    "/etc/passwd",
    "runs//1/x.bin",
    "runs/./x.bin",
    "runs/1/",
    "runs\\..\\x.bin",
    "runs/%2e%2e/x.bin",
    ".tmp/x.bin",
    "",
    "a" * 1025,
]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, settings, tmp_path: Path) -> BlobStore:
    if request.param == "local":
        live_server = request.getfixturevalue("live_server")
        settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
        settings.DIPACO_PUBLIC_URL = live_server.url
    else:
        server = request.getfixturevalue("s3_server")
        settings.DIPACO_BLOB_STORE = {
            "backend": "s3",
            "endpoint_url": server.endpoint_url,
            "bucket": request.getfixturevalue("s3_bucket"),
            "access_key_id": server.access_key_id,
            "secret_access_key": server.secret_access_key,
            "region": server.region,
            **SMALL_PARTS,
        }
    return get_blob_store()


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_it_round_trips_bytes_and_reports_their_size(store: BlobStore) -> None:
    data = os.urandom(1000) + b"\x00\xff"
    store.put_bytes("runs/1/modules/0.0/v0.safetensors", data)

    assert store.exists("runs/1/modules/0.0/v0.safetensors")
    assert store.size("runs/1/modules/0.0/v0.safetensors") == len(data)
    assert store.get_bytes("runs/1/modules/0.0/v0.safetensors") == data
    with store.open("runs/1/modules/0.0/v0.safetensors") as stream:
        assert stream.read(10) + stream.read() == data
    assert b"".join(store.iter_chunks("runs/1/modules/0.0/v0.safetensors", 7)) == data


def test_it_stores_an_empty_blob(store: BlobStore) -> None:
    store.put_bytes("runs/1/empty.bin", b"")
    assert store.exists("runs/1/empty.bin")
    assert store.size("runs/1/empty.bin") == 0
    assert store.get_bytes("runs/1/empty.bin") == b""


def test_a_ranged_read_returns_those_bytes_cut_at_the_end(store: BlobStore) -> None:
    data = os.urandom(3000)
    store.put_bytes("runs/1/data/0/train.bin", data)
    key = "runs/1/data/0/train.bin"

    assert store.get_range(key, 0, 10) == data[:10]
    assert store.get_range(key, 1234, 2345) == data[1234:2345]
    assert store.get_range(key, 2990, 5000) == data[2990:], "cut at the blob's end"
    assert store.get_range(key, 100, 100) == b""
    assert store.get_range(key, 3000, 3010) == b"", "a start past the end reads nothing"
    for start, end in [(-1, 4), (10, 5)]:
        with pytest.raises(ValueError, match="start <= end"):
            store.get_range(key, start, end)


def test_writing_a_key_again_replaces_the_blob(store: BlobStore) -> None:
    store.put_bytes("runs/1/tokenizer.json", b"old")
    store.put_bytes("runs/1/tokenizer.json", b"newer")
    assert store.get_bytes("runs/1/tokenizer.json") == b"newer"
    assert store.size("runs/1/tokenizer.json") == 5


def test_every_read_of_a_missing_key_raises_blob_not_found(
    store: BlobStore, tmp_path: Path
) -> None:
    assert not store.exists("runs/1/missing.bin")
    with pytest.raises(BlobNotFound):
        store.get_bytes("runs/1/missing.bin")
    with pytest.raises(BlobNotFound):
        store.open("runs/1/missing.bin")
    with pytest.raises(BlobNotFound):
        store.get_range("runs/1/missing.bin", 0, 4)
    with pytest.raises(BlobNotFound):
        store.iter_chunks("runs/1/missing.bin")
    with pytest.raises(BlobNotFound):
        store.size("runs/1/missing.bin")
    with pytest.raises(BlobNotFound):
        store.download_to("runs/1/missing.bin", tmp_path / "out.bin")
    assert not (tmp_path / "out.bin").exists()


def test_delete_removes_the_blob_and_ignores_a_missing_one(store: BlobStore) -> None:
    store.put_bytes("runs/1/rounds/0/u1/l1/0.0.safetensors", b"delta")
    store.delete("runs/1/rounds/0/u1/l1/0.0.safetensors")
    assert not store.exists("runs/1/rounds/0/u1/l1/0.0.safetensors")
    assert store.list("runs/1/rounds/") == []
    store.delete("runs/1/rounds/0/u1/l1/0.0.safetensors")  # no error the second time


def test_list_returns_the_keys_under_a_string_prefix_sorted(store: BlobStore) -> None:
    keys = [
        "runs/1/modules/1.0/v0.safetensors",
        "runs/1/modules/0.0/v1.safetensors",
        "runs/1/modules/0.0/v0.safetensors",
        "runs/1/modules/0.0/momentum/v0.safetensors",
        "runs/1/module.txt",
        "runs/2/modules/0.0/v0.safetensors",
        "runs/10/tokenizer.json",
    ]
    for key in keys:
        store.put_bytes(key, key.encode())

    assert store.list("runs/1/modules/0.0/") == sorted(k for k in keys if "1/modules/0.0/" in k)
    assert store.list("runs/1/mod") == sorted(k for k in keys if k.startswith("runs/1/mod"))
    assert store.list("runs/1") == sorted(k for k in keys if k.startswith("runs/1"))
    assert store.list() == sorted(keys)
    assert store.list("runs/3/") == []


def test_download_to_writes_a_small_blob_whole_and_replaces_the_file(
    store: BlobStore, tmp_path: Path
) -> None:
    data = os.urandom(300_000)
    store.put_bytes("runs/1/modules/0.0/v2.safetensors", data)
    (tmp_path / "out").mkdir()
    target = tmp_path / "out" / "v2.safetensors"
    target.write_bytes(b"an older copy")

    store.download_to("runs/1/modules/0.0/v2.safetensors", target)

    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["v2.safetensors"]  # no temporary left


def test_a_large_file_goes_up_in_parts_and_comes_back_intact(
    store: BlobStore, tmp_path: Path
) -> None:
    data = os.urandom(12 * MiB + 123)
    source = tmp_path / "weights.safetensors"
    source.write_bytes(data)

    store.put_file("runs/1/modules/0.0/v1.safetensors", source)
    store.download_to("runs/1/modules/0.0/v1.safetensors", tmp_path / "copy.safetensors")

    assert store.size("runs/1/modules/0.0/v1.safetensors") == len(data)
    assert sha256((tmp_path / "copy.safetensors").read_bytes()) == sha256(data)
    streamed = hashlib.sha256()
    for chunk in store.iter_chunks("runs/1/modules/0.0/v1.safetensors"):
        streamed.update(chunk)
    assert streamed.hexdigest() == sha256(data)


def test_a_presigned_get_serves_the_blob_over_http(store: BlobStore) -> None:
    data = os.urandom(300_000)
    store.put_bytes("runs/1/data/0/train.bin", data)

    response = httpx.get(store.presigned_get("runs/1/data/0/train.bin", expires_s=60))

    assert response.status_code == 200
    assert response.content == data


def test_a_presigned_get_of_a_missing_key_answers_404(store: BlobStore) -> None:
    response = httpx.get(store.presigned_get("runs/1/data/0/nothing.bin", expires_s=60))
    assert response.status_code == 404


def test_a_presigned_put_stores_the_body(store: BlobStore) -> None:
    data = os.urandom(70_000)
    url = store.presigned_put("runs/1/rounds/0/u1/l1/0.0.safetensors", 60, max_bytes=100_000)

    response = httpx.put(url, content=data)

    assert response.is_success, response.text
    assert store.get_bytes("runs/1/rounds/0/u1/l1/0.0.safetensors") == data


def test_a_presigned_post_stores_the_form_file(store: BlobStore) -> None:
    data = os.urandom(70_000)
    post = store.presigned_post("runs/1/rounds/0/u2/l2/1.0.safetensors", 60, max_bytes=100_000)

    response = httpx.post(post.url, data=post.fields, files={"file": ("delta", data)})

    assert response.is_success, response.text
    assert store.get_bytes("runs/1/rounds/0/u2/l2/1.0.safetensors") == data


def test_presigned_urls_refuse_an_expiry_outside_one_second_to_seven_days(
    store: BlobStore,
) -> None:
    for expires_s in (0, -5, 7 * 24 * 3600 + 1):
        with pytest.raises(ValueError, match="expires_s"):
            store.presigned_get("runs/1/x.bin", expires_s)
    with pytest.raises(ValueError, match="max_bytes"):
        store.presigned_put("runs/1/x.bin", 60, max_bytes=-1)


@pytest.mark.parametrize("key", TRAVERSAL_KEYS)
def test_every_operation_refuses_a_key_that_could_escape(
    store: BlobStore, key: str, tmp_path: Path
) -> None:
    source = tmp_path / "x.bin"
    source.write_bytes(b"x")
    operations = [
        lambda: store.put_bytes(key, b"x"),
        lambda: store.put_file(key, source),
        lambda: store.get_bytes(key),
        lambda: store.get_range(key, 0, 1),
        lambda: store.open(key),
        lambda: store.download_to(key, tmp_path / "out.bin"),
        lambda: store.exists(key),
        lambda: store.size(key),
        lambda: store.delete(key),
        lambda: store.presigned_get(key, 60),
        lambda: store.presigned_put(key, 60, 10),
        lambda: store.presigned_post(key, 60, 10),
    ]
    for operation in operations:
        with pytest.raises(InvalidBlobKey):
            operation()
    with pytest.raises(InvalidBlobKey):
        store.list("/etc")
    with pytest.raises(InvalidBlobKey):
        store.list("runs/../")
