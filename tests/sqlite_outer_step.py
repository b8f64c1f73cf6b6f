"""An outer step on the embedded SQLite database while workers heartbeat and complete.

Run as a process of its own (``python -m tests.sqlite_outer_step HIDDEN LAYERS [MODULE]``) with
DIPACO_DATA_DIR set and no DATABASE_URL: the embedded default, SQLite in WAL mode. It
builds a running run of a model of that size, two workers' contributions to round 0, and
a second run whose worker holds a lease. Then it steps MODULE ("shared") of round 0 as the
Celery task would; while the step writes the new module blob (the longest write), other
threads send heartbeats through the HTTP API and complete the second run's unit, each on
its own database connection. It prints JSON: the step's parameter count and seconds, and
for every heartbeat and completion its latency and error, if any.

The SQLite busy timeout is lowered to LOCK_TIMEOUT_S, so a write lock held across the
blob write shows as "database is locked" within seconds instead of after 20.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

LOCK_TIMEOUT_S = 3
HEARTBEATS = 5


def main(hidden: int, layers: int, stepped_module: str = "shared") -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    import django
    from django.conf import settings

    settings.DATABASES["default"]["OPTIONS"]["timeout"] = LOCK_TIMEOUT_S
    django.setup()
    import torch
    from django.core.management import call_command
    from django.db import connection
    from django.test import Client

    torch.set_num_threads(1)
    call_command("migrate", verbosity=0)
    assert connection.vendor == "sqlite", connection.vendor

    from dipaco.config import LayoutConfig
    from dipaco.modular import module_spec
    from dipaco_server.rounds.outer import step as outer_step
    from dipaco_server.rounds.outer.step import step_module
    from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
    from dipaco_server.rounds.protocol.grant import grant_lease
    from dipaco_server.storage import get_blob_store
    from dipaco_server.workers.services import create_enrollment_token, register_worker
    from tests import test_outer_tasks as helpers

    model = {
        **helpers.MODEL,
        "hidden_size": hidden,
        "num_layers": layers,
        "num_heads": max(2, hidden // 64),
        "num_kv_heads": max(1, hidden // 128),
        "intermediate_size": hidden * 3,
        "vocab_size": 8192 if hidden >= 256 else helpers.MODEL["vocab_size"],
    }
    helpers.MODEL.clear()
    helpers.MODEL.update(model)
    layout = LayoutConfig.grid(layers, levels=1, modules=1)  # one path: "0.0" and "shared"
    stepped = helpers.running_run(layout, replicas=2)
    helpers.contribute(stepped, helpers.good, seed=1, name="a")
    helpers.contribute(stepped, helpers.good, seed=2, name="b")
    helpers.closing_round(stepped)
    params = sum(
        torch.Size(shape).numel()
        for shape, _ in module_spec(stepped.run_config, stepped_module).values()
    )

    # A second run, whose worker holds a lease it completes during the step.
    other = helpers.running_run(layout, replicas=1)
    _, enrollment = create_enrollment_token(max_uses=None)
    busy, token = register_worker(enrollment, "busy", {"gpu": "none"})
    granted = grant_lease(busy)
    assert granted is not None and granted.unit.round.run_id == other.pk
    store = get_blob_store()
    reports = []
    for module_id in granted.unit.path.modules:
        data = helpers.good(other, module_id, 3)
        store.put_bytes(upload_key(granted.lease, module_id), data)
        import hashlib

        digest = hashlib.sha256(data).hexdigest()
        reports.append(ContributionReport(module_id, len(data), digest, helpers.TOKENS))

    events: list[dict[str, Any]] = []

    def timed(kind: str, call: Any) -> None:
        started = time.monotonic()
        error = ""
        try:
            status = call()
            if status is not None and status >= 400:
                error = f"HTTP {status}"
        except Exception as exc:  # recorded, and the caller fails on it
            error = f"{type(exc).__name__}: {exc}"
        finally:
            from django.db import connection as thread_connection

            thread_connection.close()
        events.append({"kind": kind, "seconds": time.monotonic() - started, "error": error})

    def heartbeat() -> int:
        response = Client().post(
            "/api/v1/worker/heartbeat",
            {"lease_id": granted.lease.pk},
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {token}",
            HTTP_X_LEASE_SECRET=granted.secret,
            HTTP_HOST="127.0.0.1",
        )
        return int(response.status_code)

    def finish() -> None:
        complete(busy, granted.lease.pk, granted.secret, reports)

    writing = threading.Event()
    real_put_file = type(store).put_file

    def put_file_while_workers_call(self: Any, key: str, path: Any) -> None:
        if key.endswith(".safetensors") and not writing.is_set():
            writing.set()
            # Heartbeats side by side, then the completion (which ends the lease they extend).
            beats = [
                threading.Thread(target=timed, args=("heartbeat", heartbeat))
                for _ in range(HEARTBEATS)
            ]
            for thread in beats:
                thread.start()
            for thread in beats:
                thread.join()
            last = threading.Thread(target=timed, args=("complete", finish))
            last.start()
            last.join()
        real_put_file(self, key, path)

    type(store).put_file = put_file_while_workers_call  # type: ignore[method-assign]
    outer_step.get_blob_store = lambda: store  # the same object the hook is installed on
    started = time.monotonic()
    report = step_module(stepped.pk, stepped_module, 0, store=store)
    seconds = time.monotonic() - started
    print(
        json.dumps(
            {
                "params": params,
                "step_seconds": seconds,
                "outcome": report["outcome"],
                "hooked": writing.is_set(),
                "events": events,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:4]))
