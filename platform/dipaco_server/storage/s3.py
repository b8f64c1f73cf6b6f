"""A blob store on any S3-compatible endpoint (AWS, MinIO, R2) through boto3.

With a custom endpoint the client uses path-style addressing
(``http://host:9000/bucket/key``), which MinIO and most self-hosted servers
need; everything is signed with SigV4. boto3's default request checksums
(CRC32 headers, aws-chunked bodies, added in 1.36) are limited to the calls
that require them, because several S3-compatible servers refuse them.

Presigned URLs are signed for ``public_endpoint_url`` when it is set: in a
compose setup the server reaches MinIO at ``http://minio:9000`` but workers
reach it at a public address, and the host is part of the signature.

Permissions: the key needs s3:GetObject, PutObject, DeleteObject and
ListBucket; without ListBucket, S3 answers 403 instead of 404 for a missing
key and `exists` raises instead of returning False.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, BinaryIO, cast

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError

from .base import BlobStore, PresignedPost, check_presign_args, check_range, write_atomically
from .keys import BlobNotFound, BlobStoreError, validate_key, validate_prefix

MiB = 1024 * 1024


class S3BlobStore(BlobStore):
    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        region: str | None = None,
        public_endpoint_url: str | None = None,
        multipart_threshold: int = 64 * MiB,
        multipart_chunk_size: int = 16 * MiB,  # S3 parts: 5 MiB minimum, 10,000 at most
        max_concurrency: int = 4,
    ) -> None:
        self.bucket = bucket
        self.multipart_threshold = multipart_threshold
        self.client = _client(endpoint_url, access_key_id, secret_access_key, region)
        self._presigner = (
            _client(public_endpoint_url, access_key_id, secret_access_key, region)
            if public_endpoint_url
            else self.client
        )
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunk_size,
            max_concurrency=max_concurrency,
        )

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> S3BlobStore:
        """Build from a DIPACO_BLOB_STORE dict; the tuning keys are optional."""
        optional = {
            k: int(config[k])
            for k in ("multipart_threshold", "multipart_chunk_size", "max_concurrency")
            if config.get(k)
        }
        return cls(
            bucket=str(config["bucket"]),
            endpoint_url=config.get("endpoint_url") or None,
            access_key_id=config.get("access_key_id") or None,
            secret_access_key=config.get("secret_access_key") or None,
            region=config.get("region") or None,
            public_endpoint_url=config.get("public_endpoint_url") or None,
            **optional,
        )

    def __repr__(self) -> str:
        return f"S3BlobStore({self.client.meta.endpoint_url!r}, bucket={self.bucket!r})"

    # --- writing -----------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        validate_key(key)
        with self._errors(key):
            if len(data) >= self.multipart_threshold:
                self.client.upload_fileobj(
                    io.BytesIO(data), self.bucket, key, Config=self._transfer
                )
            else:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data)

    def put_file(self, key: str, path: str | Path) -> None:
        validate_key(key)
        with self._errors(key):
            self.client.upload_file(str(path), self.bucket, key, Config=self._transfer)

    # --- reading -----------------------------------------------------------
    def open(self, key: str) -> BinaryIO:
        return cast(BinaryIO, self._get(key)["Body"])  # botocore's StreamingBody is an io.IOBase

    def _get(self, key: str) -> dict[str, Any]:
        validate_key(key)
        with self._errors(key):
            return cast(dict[str, Any], self.client.get_object(Bucket=self.bucket, Key=key))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        validate_key(key)
        check_range(start, end)
        if end == start:
            return b""
        try:
            with self._errors(key):
                response = self.client.get_object(
                    Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}"
                )
        except ClientError as exc:  # a start past the end: nothing there, as a file read
            if exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""
            raise
        with response["Body"] as body:
            return cast(bytes, body.read())

    def download_to(self, key: str, path: str | Path) -> None:
        # One GET, streamed through a temporary file: what the outer step fetches (module
        # versions, shards, Δs) is mostly far below multipart_threshold, where s3transfer's
        # HEAD, thread pool and futures cost more CPU than the bytes. Larger objects go to
        # s3transfer, which fetches them in parallel ranges (also renaming a finished file).
        response = self._get(key)
        body = response["Body"]
        if int(response.get("ContentLength") or 0) >= self.multipart_threshold:
            body.close()
            with self._errors(key):
                self.client.download_file(self.bucket, key, str(path), Config=self._transfer)
            return
        with body:
            write_atomically(cast(BinaryIO, body), Path(path))

    # --- metadata ----------------------------------------------------------
    def exists(self, key: str) -> bool:
        try:
            self.size(key)
        except BlobNotFound:
            return False
        return True

    def size(self, key: str) -> int:
        validate_key(key)
        with self._errors(key):
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        return int(head["ContentLength"])

    def delete(self, key: str) -> None:
        validate_key(key)
        with self._errors(key):
            self.client.delete_object(Bucket=self.bucket, Key=key)

    def list(self, prefix: str = "") -> list[str]:
        validate_prefix(prefix)
        keys: list[str] = []
        with self._errors(prefix):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            )
            for page in pages:
                keys.extend(item["Key"] for item in page.get("Contents", []))
        return sorted(keys)

    # --- presigned URLs ----------------------------------------------------
    def presigned_get(self, key: str, expires_s: int) -> str:
        check_presign_args(key, expires_s)
        params = {"Bucket": self.bucket, "Key": key}
        return str(self._presigner.generate_presigned_url("get_object", params, expires_s))

    def presigned_put(self, key: str, expires_s: int, max_bytes: int) -> str:
        # S3 has no size condition for a presigned PUT; use presigned_post where
        # the endpoint must enforce it. The caller re-checks the size anyway.
        check_presign_args(key, expires_s, max_bytes)
        params = {"Bucket": self.bucket, "Key": key}
        return str(self._presigner.generate_presigned_url("put_object", params, expires_s))

    def presigned_post(self, key: str, expires_s: int, max_bytes: int) -> PresignedPost:
        check_presign_args(key, expires_s, max_bytes)
        post = self._presigner.generate_presigned_post(
            self.bucket,
            key,
            Conditions=[["content-length-range", 0, max_bytes]],
            ExpiresIn=expires_s,
        )
        return PresignedPost(url=post["url"], fields=dict(post["fields"]))

    # --- errors ------------------------------------------------------------
    def _errors(self, key: str) -> _TranslateErrors:
        return _TranslateErrors(self.bucket, key)


class _TranslateErrors:
    """Turns boto's 404s into BlobNotFound and a missing bucket into a config error."""

    def __init__(self, bucket: str, key: str) -> None:
        self.bucket = bucket
        self.key = key

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if not isinstance(exc, ClientError):
            return
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if error.get("Code") == "NoSuchBucket":
            raise BlobStoreError(
                f"S3 bucket {self.bucket!r} does not exist; create it or fix the bucket setting"
            ) from exc
        if error.get("Code") in ("404", "NoSuchKey", "NotFound") or status == 404:
            raise BlobNotFound(f"no blob under key {self.key!r}") from None


def _client(
    endpoint_url: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    region: str | None,
) -> Any:
    config = Config(
        signature_version="s3v4",
        s3={"addressing_style": "path" if endpoint_url else "auto"},
        retries={"max_attempts": 5, "mode": "standard"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A session per client: boto3's default session is not safe to share
    # between threads while clients are being created.
    session = boto3.session.Session()
    return session.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        region_name=region or "us-east-1",
        config=config,
    )
