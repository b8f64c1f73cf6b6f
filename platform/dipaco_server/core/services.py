"""Checks behind /api/v1/health: can this process reach its database and broker?"""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

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
