"""Seed a live server's database for the conformance run; prints what the fuzzer needs as JSON.

Run with the server's environment (``python -m tests.conformance_seed``): a staff user
and token, an enrollment token, a registered worker, a run prepared for real (tiny model,
the first standard-library files, blobs in the server's store), started, and a lease of
its first unit granted to the worker. Output: tokens, ids and the lease secret.
"""

from __future__ import annotations

import json
import os
import sys

FILES = 20
MODEL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "seq_len": 16,
}


def main() -> int:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dipaco_server.settings")
    import django

    django.setup()
    import torch

    torch.set_num_threads(1)
    from dipaco.config import LayoutConfig, RunConfig
    from dipaco_server.accounts.services import create_api_token, create_user
    from dipaco_server.rounds.lifecycle.open import start_run
    from dipaco_server.rounds.protocol.grant import grant_lease
    from dipaco_server.runs.models import Dataset
    from dipaco_server.runs.prepare import prepare_run
    from dipaco_server.runs.services import create_run
    from dipaco_server.workers.services import create_enrollment_token, register_worker

    user, _ = create_user("conformance", staff=True)
    _, staff = create_api_token(user, name="conformance")
    enrollment_row, enrollment = create_enrollment_token(max_uses=None)
    worker, worker_token = register_worker(enrollment, "conformance-box", {"gpu": "none"})
    dataset = Dataset.objects.create(name="conformance", source="stdlib")
    config = RunConfig.tiny(
        model=MODEL, data={"val_fraction": 0.2}, layout=LayoutConfig.grid(2, levels=1, modules=2)
    ).model_dump(mode="json")
    del config["name"]
    run = create_run("conformance", config, dataset=dataset)
    prepare_run(run, max_files=FILES)
    start_run(run)
    grant = grant_lease(worker)
    if grant is None:
        print("the seeded run has no queued unit", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "staff": staff,
                "worker": worker_token,
                "secret": grant.secret,
                "ids": {
                    "run_id": run.pk,
                    "dataset_id": dataset.pk,
                    "worker_id": worker.pk,
                    "token_id": enrollment_row.pk,
                    "lease_id": grant.lease.pk,
                    "path_index": 0,
                },
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
