"""The server's streaming preparation: S3 sources behind an allow-list, pieces that resume,
shards reused by a later run, and memory that does not grow with the corpus."""

from __future__ import annotations

import json
import os
import tracemalloc
import uuid
from pathlib import Path
from typing import Any

import pytest
from django.test import Client, override_settings

from dipaco.data import stream
from dipaco.data.corpus import corpus_listing
from dipaco.data.stream import prepare_listing
from dipaco_server.runs import keys
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.runs.prepare import prepare_run
from dipaco_server.runs.services import create_run
from dipaco_server.storage import get_blob_store
from tests.test_admin_api import admin, staff
from tests.test_sources import config as sources_config
from tests.test_sources import records, write_parquet
from tests.test_worker_api import assert_error

__all__ = ["staff"]  # a fixture this module uses


@pytest.mark.django_db
def test_a_bucket_outside_the_allow_list_is_refused_naming_the_setting(
    client: Client, staff: str
) -> None:
    body: dict[str, Any] = {"name": "web", "source": "s3://other-bucket/fineweb/"}
    with override_settings(DIPACO_SOURCE_BUCKETS=["corpora"]):
        refused = admin(client, "POST", "/datasets", staff, body)
        error = assert_error(refused, 422, "source_bucket_not_allowed")
        assert "DIPACO_SOURCE_BUCKETS" in error["message"]
        assert error["details"]["setting"] == "DIPACO_SOURCE_BUCKETS"
        allowed = {**body, "source": "s3://corpora/fineweb/", "text_field": "content"}
        created = admin(client, "POST", "/datasets", staff, allowed)
    assert created.status_code == 201, created.content
    assert created.json()["text_field"] == "content"
    with override_settings(DIPACO_SOURCE_BUCKETS=[]):
        assert_error(
            admin(client, "POST", "/datasets", staff, {**body, "name": "x"}),
            422,
            "source_bucket_not_allowed",
        )


def corpus_dir(files: int = 4, rows: int = 60) -> Path:
    """A Parquet corpus under the default data root (DIPACO_DATA_DIR/corpus)."""
    root = Path(os.environ["DIPACO_DATA_DIR"]) / "corpus" / f"pq-{uuid.uuid4().hex[:8]}"
    write_parquet(root, records(files=files, rows=rows))
    return root


def run_on(dataset: Dataset, name: str) -> Run:
    config = sources_config().model_dump(mode="json")
    del config["name"]
    return create_run(f"{name}-{uuid.uuid4().hex[:6]}", config, dataset=dataset)


def shard_hashes(run: Run) -> list[str]:
    index = json.loads(get_blob_store().get_bytes(keys.data_index_key(run.pk)))
    return [e[s]["sha256"] for e in index["paths"] for s in ("train", "val")]


@pytest.mark.django_db
def test_a_preparation_killed_midway_resumes_with_the_pieces_left_and_the_same_shards(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = corpus_dir()
    dataset = Dataset.objects.create(name=f"d-{uuid.uuid4().hex[:6]}", source=str(root))
    run = run_on(dataset, "killed")
    written: list[int] = []
    real = stream.write_piece

    def write_then_die(listing: Any, piece: int, *args: Any, **kwargs: Any) -> Any:
        if len(written) == 2:  # the third piece dies midway: nothing of it is kept
            raise KeyboardInterrupt("killed")
        written.append(piece)
        return real(listing, piece, *args, **kwargs)

    monkeypatch.setattr(stream, "write_piece", write_then_die)
    with pytest.raises(KeyboardInterrupt):
        prepare_run(run)
    run.refresh_from_db()
    assert run.state == Run.State.PREPARING and run.progress["pieces"] == {"done": 2, "total": 4}
    monkeypatch.setattr(
        stream, "write_piece", lambda *a, **k: written.append(a[1]) or real(*a, **k)
    )
    prepare_run(run)
    run.refresh_from_db()
    assert run.state == Run.State.READY
    assert written == [0, 1, 2, 3]  # the resumed preparation ran only the two pieces left
    listing = corpus_listing(str(root))
    expected, _ = prepare_listing(sources_config(), listing, tmp_path)
    assert shard_hashes(run) == [e[s].sha256 for e in expected.paths for s in ("train", "val")]

    # A later run with the same dataset, tokenizer and router reuses every piece.
    written.clear()
    again = run_on(dataset, "again")
    prepare_run(again)
    again.refresh_from_db()
    assert again.state == Run.State.READY and written == []
    assert shard_hashes(again) == shard_hashes(run)
    store = get_blob_store()
    assert store.get_bytes(keys.router_key(again.pk)) == store.get_bytes(keys.router_key(run.pk))


@pytest.mark.django_db
def test_a_large_file_prepares_in_pieces_of_its_row_groups_to_the_same_shards(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = corpus_dir(files=2, rows=60)  # row groups of 16 rows: 4 per file
    dataset = Dataset.objects.create(name=f"d-{uuid.uuid4().hex[:6]}", source=str(root))
    run = run_on(dataset, "ranges")
    monkeypatch.setattr(stream, "PIECE_BYTES", 1000)  # each row group is a piece
    spans: list[Any] = []
    real = stream.write_piece
    monkeypatch.setattr(
        stream, "write_piece", lambda *a, **k: spans.append(k["span"]) or real(*a, **k)
    )
    prepare_run(run)
    run.refresh_from_db()
    assert run.state == Run.State.READY
    assert [(s.file, s.groups) for s in spans] == [(f, (g,)) for f in (0, 1) for g in range(4)]
    expected, scan = prepare_listing(sources_config(), corpus_listing(str(root)), tmp_path)
    assert len(scan.spans) == 2, "whole files by default"
    assert shard_hashes(run) == [e[s].sha256 for e in expected.paths for s in ("train", "val")]


def heap_peak_kib(corpus: Path, out: Path) -> int:
    """The peak of the Python heap (tracemalloc; numpy's arrays included) while preparing."""
    listing = corpus_listing(str(corpus))
    tracemalloc.start()
    try:
        prepare_listing(sources_config(), listing, out, tokenizer_chars=100_000, router_docs=500)
        return tracemalloc.get_traced_memory()[1] // 1024
    finally:
        tracemalloc.stop()


def test_a_corpus_larger_than_the_memory_bound_prepares_within_it(tmp_path: Path) -> None:
    """The heap's peak while preparing 8x the text grows by under a quarter of the extra
    text: the corpus is never held (a list of its documents would grow by all of it and
    more). The bench measures the processes' RSS (bench/prepare.py)."""
    sizes = {"small": 1, "large": 8}
    chars = {}
    for name, files in sizes.items():
        data = records(files=files, rows=1000, seed=1, words=300)
        write_parquet(tmp_path / name, data)
        chars[name] = sum(len(t) for rows in data for t in rows)
    extra_kib = (chars["large"] - chars["small"]) / 1024
    assert extra_kib > 5_000  # 5 MB more text
    peaks = {name: heap_peak_kib(tmp_path / name, tmp_path / f"out-{name}") for name in sizes}
    assert peaks["large"] - peaks["small"] < extra_kib / 4, (peaks, extra_kib)
