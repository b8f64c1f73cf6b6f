"""A unit's data: row chunks in the order units read them (dipaco.data.rows), named by the
manifest without reading a token, streamed by the worker, and the same rows the simulator
reads.

A run is prepared for real (the first standard-library files, blobs in the local store),
started, and a unit leased; its manifest is fetched through the worker API and its chunks
through the blob view, as a worker does.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from django.test import Client

from dipaco.data import rows as rows_module
from dipaco.data.rows import FORMAT, RowIndex, Segment, StoreRows, UnitRows, write_rows
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.protocol import api
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.runs import keys
from dipaco_server.runs.prepare import prepare_run
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.workers.services import create_enrollment_token, register_worker
from tests.test_prepare import FILES, new_run

SEQ_LEN = 8


def fetch(client: Client, url: str) -> Any:
    parts = urlsplit(url)
    return client.get(f"{parts.path}?{parts.query}", HTTP_HOST="127.0.0.1")


def body_of(answer: Any) -> bytes:
    return b"".join(answer.streaming_content) if answer.streaming else answer.content


class CountingStore:
    """The run's store, recording every key whose bytes are read (a manifest's reads)."""

    def __init__(self, store: BlobStore) -> None:
        self.store = store
        self.read: list[str] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if name in ("get_bytes", "open", "get_range", "download_to"):

            def reading(key: str, *args: Any, **kwargs: Any) -> Any:
                self.read.append(key)
                return attr(key, *args, **kwargs)

            return reading
        return attr


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks down to 1 KiB (not 256 KiB): the test's path of 233 KB is then several."""
    monkeypatch.setattr(rows_module, "MIN_CHUNK_BYTES", 1024)


def leased(db: None) -> tuple[Any, Any, str, Any]:
    torch.set_num_threads(1)
    run = new_run()
    prepare_run(run, max_files=FILES)
    start_run(run)
    _, enrollment = create_enrollment_token(max_uses=None)
    worker, token = register_worker(enrollment, f"box-{uuid.uuid4().hex[:6]}", {"gpu": "none"})
    grant = grant_lease(worker)
    assert grant is not None
    return run, grant, token, Client()


def manifest(client: Client, grant: Any, token: str) -> Any:
    return client.get(
        f"/api/v1/worker/lease/{grant.lease.pk}/manifest",
        HTTP_AUTHORIZATION=f"Bearer {token}",
        HTTP_X_LEASE_SECRET=grant.secret,
        HTTP_HOST="127.0.0.1",
    )


def test_a_manifest_reads_no_token_and_its_chunks_hold_the_units_rows_and_no_others(
    db: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run, grant, token, client = leased(db)
    unit, config = grant.unit, run.run_config
    p, T = unit.path.index, config.model.seq_len
    counting = CountingStore(get_blob_store())
    monkeypatch.setattr(api, "get_blob_store", lambda: counting)
    answer = manifest(client, grant, token)
    assert answer.status_code == 200, answer.content
    data = answer.json()["data"]
    token_reads = [k for k in counting.read if k.endswith(".bin")]
    assert token_reads == [], f"the manifest read token data: {token_reads}"
    assert keys.rows_index_key(run.pk, p) in counting.read  # its one read: the row index
    assert data["format"] == FORMAT
    assert (data["windows"], data["first_position"]) == (unit.data_windows, unit.data_position)

    index = RowIndex.from_json(get_blob_store().get_bytes(keys.rows_index_key(run.pk, p)))
    assert len(index.chunks) >= 3, "the test wants a path of several chunks"
    chunks = data["chunks"]
    named = [c["chunk"] for c in chunks]
    assert sum(c["count"] for c in chunks) == unit.data_windows
    # Only the chunks its rows lie in: every one but the two ends wholly its own.
    assert len(named) < len(index.chunks)
    for c in chunks[1:-1]:
        assert (c["start"], c["count"]) == (0, c["rows"])

    whole = tmp_path / "train.bin"
    get_blob_store().download_to(keys.data_key(run.pk, p, "train"), whole)
    simulator = ShardSource.for_path(TokenShard(whole, data["dtype"]), config, p)
    rows = []
    for c in chunks:
        served = fetch(client, c["url"])
        assert served.status_code == 200
        body = body_of(served)
        assert len(body) == c["size"]
        chunk = np.frombuffer(body, dtype=data["dtype"]).reshape(c["rows"], T + 1)
        segment = Segment(c["chunk"], c["start"], c["count"], c["perm_seed"])
        rows.append(chunk[segment.rows(c["rows"])])
    got = np.concatenate(rows).astype(np.int64)
    expected = simulator.batch(unit.data_position, unit.data_windows, T).numpy()
    assert np.array_equal(got, expected), "the chunks give the rows the simulator reads"

    # A URL is signed for its chunk: pointed at another chunk of the path it is refused.
    other = next(c for c in range(len(index.chunks)) if c not in named)
    forged = chunks[0]["url"].replace(chunks[0]["key"], keys.rows_chunk_key(run.pk, p, other))
    assert forged != chunks[0]["url"]
    assert fetch(client, forged).status_code in (400, 403)


def test_a_run_prepared_before_row_chunks_is_refused_with_a_message_to_prepare_again(
    db: None,
) -> None:
    run, grant, token, client = leased(db)
    get_blob_store().delete(keys.rows_index_key(run.pk, grant.unit.path.index))
    answer = manifest(client, grant, token)
    assert answer.status_code == 409, answer.content
    error = answer.json()["error"]
    assert error["code"] == "data_not_ready"
    assert "prepare the run's data again" in error["message"]


def token_file(tmp_path: Path, tokens: int) -> TokenShard:
    path = tmp_path / "train.bin"
    np.arange(tokens, dtype="<u2").tofile(path)  # token i is i: a row shows its window
    return TokenShard(path, "<u2")


def written(tmp_path: Path, windows: int, per_chunk: int, seed: int = 3) -> tuple[Any, Any]:
    shard = token_file(tmp_path, windows * SEQ_LEN + 1)
    index = write_rows(shard, SEQ_LEN, seed, per_chunk, tmp_path / "rows")
    chunks = {c: (tmp_path / "rows" / f"{c}.bin").read_bytes() for c in range(len(index.chunks))}
    return index, chunks


def test_every_pass_over_the_rows_holds_each_window_once_in_a_new_order(tmp_path: Path) -> None:
    index, chunks = written(tmp_path, windows=53, per_chunk=7)
    assert [c.rows for c in index.chunks] == [7] * 7 + [4]
    reader = StoreRows(index, lambda c, a, b: chunks[c][a:b])
    passes = []
    for p in range(3):
        rows = reader.read(p * 53, 53)
        windows = (rows[:, 0] // SEQ_LEN).tolist()  # row of window w starts at token w·T
        assert sorted(windows) == list(range(53)), f"pass {p} is not every window once"
        for row, w in zip(rows, windows, strict=True):
            assert np.array_equal(row, np.arange(w * SEQ_LEN, w * SEQ_LEN + SEQ_LEN + 1))
        passes.append(windows)
    assert passes[0] != passes[1] != passes[2] != passes[0], "each pass in a new order"
    # A contiguous read is one range per chunk in pass 0.
    reader.ranges_read = 0
    reader.read(10, 14)
    assert reader.ranges_read == 3


def test_a_resumed_unit_reads_only_the_chunks_left_and_the_same_rows(tmp_path: Path) -> None:
    index, chunks = written(tmp_path, windows=60, per_chunk=8)
    order = index.order
    first, count, B = 45, 40, 4  # crosses into the second pass

    def source(start: int) -> tuple[UnitRows, list[int]]:
        segments = order.segments(first, count)
        asked: list[int] = []

        def load(i: int) -> np.ndarray:
            asked.append(segments[i].chunk)
            data = np.frombuffer(chunks[segments[i].chunk], dtype="<u2")
            return data.reshape(-1, SEQ_LEN + 1)

        rows = [order.chunk_rows(s.chunk) for s in segments]
        return UnitRows(segments, rows, load, first, SEQ_LEN), asked

    whole, _ = source(first)
    never_stopped = [whole.batch(k, B, SEQ_LEN) for k in range(first, first + count, B)]
    resumed, asked = source(first)
    at = first + 24  # a checkpoint's position
    again = [resumed.batch(k, B, SEQ_LEN) for k in range(at, first + count, B)]
    for a, b in zip(never_stopped[6:], again, strict=True):
        assert torch.equal(a, b)
    skipped = {s.chunk for s in order.segments(first, at - first)} - {
        s.chunk for s in order.segments(at, first + count - at)
    }
    assert skipped and not skipped & set(asked), "a resumed unit fetched chunks it had read"
    simulator = ShardSource(token_file(tmp_path, 60 * SEQ_LEN + 1), SEQ_LEN, 3, 8)
    for k, batch in zip(range(first, first + count, B), never_stopped, strict=True):
        assert torch.equal(batch, simulator.batch(k, B, SEQ_LEN))
    with pytest.raises(IndexError, match="outside this unit's rows"):
        whole.batch(first + count - 1, 2, SEQ_LEN)
    whole.close()
    resumed.close()
