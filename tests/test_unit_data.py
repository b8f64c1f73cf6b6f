"""A lease's data URL covers its unit's windows and nothing else of its path's train shard.

A run is prepared for real (the first standard-library files, blobs in the local store),
started, and a unit leased; its manifest is fetched through the worker API and its data
URL through the blob view, as a worker does.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import torch
from django.test import Client

from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource, UnitSource, path_seed
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.runs import keys
from dipaco_server.runs.prepare import prepare_run
from dipaco_server.storage import get_blob_store
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_prepare import FILES, new_run


def fetch(client: Client, url: str) -> Any:
    parts = urlsplit(url)
    return client.get(f"{parts.path}?{parts.query}", HTTP_HOST="127.0.0.1")


def test_a_leases_data_url_serves_its_units_windows_and_cannot_reach_the_rest(
    db: None, tmp_path: Path
) -> None:
    torch.set_num_threads(1)
    run = new_run()
    prepare_run(run, max_files=FILES)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=None)
    worker, token = register_worker(enrollment, f"box-{uuid.uuid4().hex[:6]}", {"gpu": "none"})
    grant = grant_lease(worker)
    assert grant is not None
    unit, config = grant.unit, run.run_config
    client = Client()
    answer = client.get(
        f"/api/v1/worker/lease/{grant.lease.pk}/manifest",
        HTTP_AUTHORIZATION=f"Bearer {token}",
        HTTP_X_LEASE_SECRET=grant.secret,
        HTTP_HOST="127.0.0.1",
    )
    assert answer.status_code == 200, answer.content
    data = answer.json()["data"]
    seq_len = config.model.seq_len
    shard_key = keys.data_key(run.pk, unit.path.index, "train")
    assert data["scope"] == "unit" and data["key"] != shard_key
    assert (data["windows"], data["first_position"]) == (unit.data_windows, unit.data_position)

    served = fetch(client, data["url"])
    assert served.status_code == 200
    body = b"".join(served.streaming_content) if served.streaming else served.content
    itemsize = np.dtype(data["dtype"]).itemsize
    assert len(body) == data["size"] == unit.data_windows * (seq_len + 1) * itemsize

    # The same tokens the path's whole shard gives at the unit's positions, and no others.
    whole = tmp_path / "train.bin"
    get_blob_store().download_to(shard_key, whole)
    path_source = ShardSource(
        TokenShard(whole, data["dtype"]), seq_len, path_seed(config, unit.path.index)
    )
    expected = path_source.unit_rows(unit.data_position, unit.data_windows)
    assert body == expected.tobytes()
    assert len(body) < whole.stat().st_size, "the unit's blob must be smaller than the shard"
    mine = tmp_path / "unit.bin"
    mine.write_bytes(body)
    unit_source = UnitSource(TokenShard(mine, data["dtype"]), seq_len, unit.data_position)
    batch = config.inner.micro_batch_size
    for position in range(unit.data_position, unit.data_position + unit.data_windows, batch):
        assert torch.equal(
            unit_source.batch(position, batch, seq_len), path_source.batch(position, batch, seq_len)
        )

    # The URL is signed for the unit's key: pointed at the path's shard it is refused.
    forged = data["url"].replace(data["key"], shard_key)
    assert forged != data["url"]
    assert fetch(client, forged).status_code in (400, 403)
