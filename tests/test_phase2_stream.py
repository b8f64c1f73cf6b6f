"""Phase 2's routing after a dense phase 1 streams (runs.between): the router fits on a
seeded sample of documents' prefixes, every chunk of documents is routed in its own task,
and the shards are the same whatever order (or number of workers) the chunks run in."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from dipaco.routing.router import Router
from dipaco_server.runs import between, keys, prepare
from dipaco_server.runs.models import Run
from dipaco_server.storage import get_blob_store
from tests.test_two_phases import FILES, new_run, router_spec

SAMPLE = 24  # documents the router fits on: far fewer than the corpus's


@pytest.fixture(autouse=True)
def local_store_small_sample(
    monkeypatch: pytest.MonkeyPatch, settings: Any, tmp_path: Path
) -> Iterator[None]:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    monkeypatch.setattr(between, "ROUTER_SAMPLE_DOCS", SAMPLE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def after_phase1() -> Run:
    """A phase-1 run prepared and its dense phase over (its version-0 modules stand in for
    the trained ones)."""
    run = new_run(phase1={"rounds": 1})
    prepare.prepare_run(run, max_files=FILES)
    Run.objects.filter(pk=run.pk).update(phase=Run.Phase.PREPARING)
    run.refresh_from_db()
    return run


def documents(run: Run, work: Path) -> list[tuple[str, str]]:
    """(split, text) of every document kept for phase 2, chunk by chunk (a piece each)."""
    store = get_blob_store()
    return [
        doc for i in range(run.phase_chunks) for doc in between.documents(store, run.pk, i, work)
    ]


def shards(run: Run) -> dict[str, bytes]:
    store = get_blob_store()
    out = {"index": store.get_bytes(keys.data_index_key(run.pk))}
    out["router"] = store.get_bytes(keys.router_key(run.pk))
    for p in range(run.run_config.num_paths):
        for split in ("train", "val"):
            out[f"{p}/{split}"] = store.get_bytes(keys.data_key(run.pk, p, split))
    return out


@pytest.mark.django_db
def test_the_router_fits_on_the_sample_and_every_document_is_routed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fitted: list[list[str]] = []
    fit = Router.fit.__func__  # type: ignore[attr-defined]

    def spy(cls: type[Router], texts: list[str], *args: Any, **kwargs: Any) -> Router:
        fitted.append(list(texts))
        return fit(cls, texts, *args, **kwargs)  # type: ignore[no-any-return]

    monkeypatch.setattr(Router, "fit", classmethod(spy))
    run = after_phase1()
    docs = documents(run, tmp_path)
    train = [text for split, text in docs if split == "train"]
    assert run.phase_chunks >= 4 and len(train) > 4 * SAMPLE

    chunks = between.begin(run)
    assert len(fitted) == 1 and len(fitted[0]) == SAMPLE, "the fit saw the sample only"
    limit = run.run_config.router.prefix_tokens * 64
    assert all(len(t) <= limit for t in fitted[0]) and set(fitted[0]) <= {t[:limit] for t in train}
    assert sum(router_spec(run, tmp_path).train_loads) == SAMPLE
    assert between.pending(run, get_blob_store()) == list(range(chunks))
    for chunk in range(chunks):
        between.route_chunk(run, chunk)
    between.finish(run)

    index = json.loads(get_blob_store().get_bytes(keys.data_index_key(run.pk)))
    routed = {s: sum(entry[s]["docs"] for entry in index["paths"]) for s in ("train", "val")}
    assert routed == {"train": len(train), "val": len(docs) - len(train)}
    assert sum(entry["train"]["docs"] > 0 for entry in index["paths"]) > 1
    assert len(fitted) == 1, "routing every document fitted nothing more"


@pytest.mark.django_db
def test_the_shards_are_the_same_whatever_order_the_chunks_are_routed_in() -> None:
    first = after_phase1()
    for chunk in range(between.begin(first)):
        between.route_chunk(first, chunk)
    between.finish(first)

    second = after_phase1()  # the same corpus and config: another worker's schedule
    chunks = between.begin(second)
    order = [*range(chunks - 1, -1, -1), 0]  # reversed, and a retried (resent) task
    for chunk in order[: chunks // 2]:
        between.route_chunk(second, chunk)
    with pytest.raises(RuntimeError, match="not routed yet"):
        between.finish(second)
    assert between.begin(second) == chunks  # prepare_phase2 sent again: resumes
    assert between.pending(second, get_blob_store()) == sorted(order[chunks // 2 : chunks])
    for chunk in order[chunks // 2 :]:
        between.route_chunk(second, chunk)
    between.finish(second)
    assert shards(first) == shards(second)
