"""Tasks with no domain meaning, used to check that workers consume the broker."""

from __future__ import annotations

import os
import socket

from celery import shared_task


@shared_task
def ping(nonce: str) -> dict[str, object]:
    """Echo ``nonce`` with the answering process: a round trip proves a live worker."""
    return {"nonce": nonce, "pid": os.getpid(), "hostname": socket.gethostname()}
