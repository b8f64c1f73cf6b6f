"""What only the S3 backend promises, checked against the moto S3 server:
multipart uploads for large files, a size condition in presigned POSTs (the
test server does not enforce it, so the signed policy is read instead),
presigning for a public endpoint, and a clear error for a missing bucket.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from dipaco_server.storage import BlobStoreError
from dipaco_server.storage.s3 import S3BlobStore

MiB = 1024 * 1024


def make_store(server, bucket: str, **options) -> S3BlobStore:
    return S3BlobStore(
        bucket=bucket,
        endpoint_url=server.endpoint_url,
        access_key_id=server.access_key_id,
        secret_access_key=server.secret_access_key,
        region=server.region,
        **options,
    )


def test_a_file_over_the_threshold_is_uploaded_in_parts(
    s3_server, s3_bucket: str, tmp_path: Path
) -> None:
    store = make_store(
        s3_server, s3_bucket, multipart_threshold=5 * MiB, multipart_chunk_size=5 * MiB
    )
    source = tmp_path / "v1.safetensors"
    source.write_bytes(os.urandom(11 * MiB))

    store.put_file("runs/1/modules/0.0/v1.safetensors", source)

    head = store.client.head_object(Bucket=s3_bucket, Key="runs/1/modules/0.0/v1.safetensors")
    assert head["ETag"].strip('"').endswith("-3")  # a multipart ETag names its part count
    assert head["ContentLength"] == 11 * MiB


def test_a_presigned_post_signs_a_content_length_range(s3_server, s3_bucket: str) -> None:
    store = make_store(s3_server, s3_bucket)

    post = store.presigned_post("runs/1/rounds/0/u1/l1/0.0.safetensors", 60, max_bytes=4096)

    policy = json.loads(base64.b64decode(post.fields["policy"]))
    assert ["content-length-range", 0, 4096] in policy["conditions"]
    assert post.fields["key"] == "runs/1/rounds/0/u1/l1/0.0.safetensors"


def test_presigned_urls_name_the_public_endpoint_when_one_is_set(s3_server, s3_bucket: str) -> None:
    store = make_store(s3_server, s3_bucket, public_endpoint_url="https://blobs.example.org")

    get_url = urlsplit(store.presigned_get("runs/1/tokenizer.json", 60))
    post_url = urlsplit(store.presigned_post("runs/1/x.bin", 60, 10).url)

    assert (get_url.scheme, get_url.netloc) == ("https", "blobs.example.org")
    assert get_url.path == f"/{s3_bucket}/runs/1/tokenizer.json"  # path-style addressing
    assert "X-Amz-Signature=" in get_url.query
    assert post_url.netloc == "blobs.example.org"


def test_a_missing_bucket_is_reported_as_a_configuration_error(s3_server) -> None:
    store = make_store(s3_server, "no-such-bucket-here")
    with pytest.raises(BlobStoreError, match="no-such-bucket-here"):
        store.put_bytes("runs/1/x.bin", b"x")
    with pytest.raises(BlobStoreError, match="no-such-bucket-here"):
        store.list("runs/")
