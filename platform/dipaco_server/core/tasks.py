"""Tasks with no domain meaning, and the retry policy every app's tasks share.

`ping` checks that workers consume the broker. `TRANSIENT` and `RETRY` say which failures
a task retries with backoff (the database or the object store was unreachable), and
`same_queue` sends a follow-up task to the queue its parent came from.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from celery import Task, shared_task
from django.db import InterfaceError, OperationalError

# Errors worth retrying with backoff: the database or the object store was unreachable.
TRANSIENT = (
    OperationalError,
    InterfaceError,
    ConnectionError,
    TimeoutError,
    BotoCoreError,
    ClientError,
)
RETRY = {
    "autoretry_for": TRANSIENT,
    "retry_backoff": 2,
    "retry_backoff_max": 120,
    "retry_jitter": True,
    "max_retries": 6,
}


def same_queue(task: Task) -> dict[str, Any]:
    """Options that send a follow-up task to the queue `task` was taken from."""
    queue = (task.request.delivery_info or {}).get("routing_key")
    return {"queue": queue} if queue else {}


@shared_task
def ping(nonce: str) -> dict[str, object]:
    """Echo ``nonce`` with the answering process: a round trip proves a live worker."""
    return {"nonce": nonce, "pid": os.getpid(), "hostname": socket.gethostname()}
