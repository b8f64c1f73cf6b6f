"""Checks behind /api/v1/health and /readyz: can this process reach its database, its
broker and its blob store?"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from django.conf import settings
from django.db import connection

from dipaco_server.celery import app


@dataclass(frozen=True)
class Check:
    ok: bool
    detail: str


def check_database() -> Check:
    vendor = connection.vendor
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    except Exception as exc:  # any driver error means "down"; the detail says which
        return Check(False, f"{vendor}: {type(exc).__name__}: {exc}")
    return Check(True, vendor)


def check_broker() -> Check:
    conn = app.connection_for_write()
    # The URL's scheme: the embedded broker's transport class is ours (dipaco_server.broker).
    transport = urlsplit(app.conf.broker_url).scheme
    try:
        if transport == "filesystem":
            # kombu's filesystem transport "connects" without touching the disk;
            # what can fail is the queue folder.
            folder = app.conf.broker_transport_options["data_folder_out"]
            if not os.access(folder, os.W_OK):
                return Check(False, f"filesystem: {folder} is not writable")
        else:
            conn.ensure_connection(max_retries=1, timeout=3)
    except Exception as exc:  # kombu wraps transport errors in several types
        return Check(False, f"{transport}: {type(exc).__name__}: {exc}")
    finally:
        conn.release()
    return Check(True, str(transport))


PROBE_TIMEOUT_S = 3.0


def check_blob_store() -> Check:
    """The configured store answers: S3's bucket (one HEAD, no retries, a 3 s time-out),
    or the local store's directory is writable."""
    config = settings.DIPACO_BLOB_STORE
    if config.get("backend") != "s3":
        root = Path(str(config.get("root", "")))
        if not root.is_dir() and not os.access(root.parent, os.W_OK):
            return Check(False, f"local: {root} does not exist and cannot be created")
        if root.is_dir() and not os.access(root, os.W_OK):
            return Check(False, f"local: {root} is not writable")
        return Check(True, "local")
    bucket = str(config["bucket"])
    try:
        _s3_probe(config).head_bucket(Bucket=bucket)
    except Exception as exc:  # botocore's connection and client errors alike mean "down"
        endpoint = config.get("endpoint_url") or "AWS"
        return Check(False, f"s3 {endpoint} bucket {bucket}: {type(exc).__name__}: {exc}")
    return Check(True, "s3")


_probes: dict[tuple[str, ...], Any] = {}


def _s3_probe(config: dict[str, Any]) -> Any:
    """A client for the readiness probe only: one attempt, short time-outs (the store's own
    client retries five times, which would hold a probe for seconds)."""
    # boto3 (~0.2 s to import) only where S3 is configured, as storage.factory does
    import boto3
    from botocore.config import Config

    key = tuple(str(config.get(k)) for k in ("endpoint_url", "access_key_id", "region"))
    client = _probes.get(key)
    if client is None:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=config.get("endpoint_url") or None,
            aws_access_key_id=config.get("access_key_id") or None,
            aws_secret_access_key=config.get("secret_access_key") or None,
            region_name=config.get("region") or "us-east-1",
            config=Config(
                retries={"max_attempts": 1, "mode": "standard"},
                connect_timeout=PROBE_TIMEOUT_S,
                read_timeout=PROBE_TIMEOUT_S,
                s3={"addressing_style": "path" if config.get("endpoint_url") else "auto"},
            ),
        )
        _probes[key] = client
    return client
