"""The server reads training and validation tokens by byte ranges, never a whole shard or
chunk: scoring a Δ (rounds.verification.scorer, on the unit's row chunks) and evaluating a
path (runs.evaluate) each run here on a blob store that refuses to read a large blob whole
(or in a range over a quarter of it), and read the same tokens as from a local copy.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import torch

from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.ranged import RangedShard, plan_ranges
from dipaco.data.shards import ShardIndex, ShardInfo, TokenShard
from dipaco.data.windows import ShardSource, unit_windows
from dipaco.evaluate import mean_loss, sample_shard
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, init_modules
from dipaco.modules_file import write_module
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.verification.scorer import Scorer
from dipaco_server.runs import keys
from dipaco_server.runs.evaluate import evaluate_run, run_sample
from dipaco_server.runs.models import Run
from dipaco_server.runs.prepare import data_index_key
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.stages import upload_rows
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store
from dipaco_server.storage.base import PresignedPost

MODEL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "seq_len": 16,
}
TOKENS = 1 << 20  # 2 MiB of uint16 per shard: "large" to the refusing store below
LARGE = 1 << 20


class RefusingStore(BlobStore):
    """A real store that refuses to read a blob over LARGE bytes whole, or in a range over a
    quarter of it, and counts the bytes it served by ranges."""

    def __init__(self, inner: BlobStore) -> None:
        self.inner = inner
        self.range_bytes = 0
        self.ranges = 0

    def _refuse_whole(self, key: str) -> None:
        if self.inner.size(key) > LARGE:
            raise AssertionError(f"read {key} whole ({self.inner.size(key)} bytes)")

    def open(self, key: str) -> BinaryIO:
        self._refuse_whole(key)
        return self.inner.open(key)

    def get_bytes(self, key: str) -> bytes:
        self._refuse_whole(key)
        return self.inner.get_bytes(key)

    def download_to(self, key: str, path: str | Path) -> None:
        self._refuse_whole(key)
        self.inner.download_to(key, path)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        size = self.inner.size(key)
        if size > LARGE and end - start > size // 4:
            raise AssertionError(f"read {end - start} of {size} bytes of {key} at once")
        self.range_bytes += end - start
        self.ranges += 1
        return self.inner.get_range(key, start, end)

    def put_bytes(self, key: str, data: bytes) -> None:
        self.inner.put_bytes(key, data)

    def put_file(self, key: str, path: str | Path) -> None:
        self.inner.put_file(key, path)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def size(self, key: str) -> int:
        return self.inner.size(key)

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.inner.list(prefix)

    def presigned_get(self, key: str, expires_s: int) -> str:
        return self.inner.presigned_get(key, expires_s)

    def presigned_put(self, key: str, expires_s: int, max_bytes: int) -> str:
        return self.inner.presigned_put(key, expires_s, max_bytes)

    def presigned_post(self, key: str, expires_s: int, max_bytes: int) -> PresignedPost:
        return self.inner.presigned_post(key, expires_s, max_bytes)


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def store(settings: Any, tmp_path: Path, db: None) -> BlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    return get_blob_store()


def large_run(tmp: Path, store: BlobStore) -> tuple[Run, dict[tuple[int, str], np.ndarray]]:
    """A running 2-path run with version-0 modules and 2 MiB train and val shards per path."""
    layout = LayoutConfig.grid(2, levels=1, modules=2)
    config = RunConfig.tiny(model=MODEL, layout=layout, rounds=4).model_dump(mode="json")
    del config["name"]
    run = create_run(f"ranges-{uuid.uuid4().hex[:8]}", config)
    for module_id, tensors in init_modules(run.run_config).items():
        file = tmp / f"{module_id}-v0"
        sha256, size = write_module(file, tensors)
        key = keys.module_key(run.pk, module_id, 0)
        store.put_file(key, file)
        module = run.modules.get(module_id=module_id)
        publish_module_version(module, 0, blob_key=key, sha256=sha256, size=size)
    rng = np.random.default_rng(0)
    shards, infos = {}, []
    for p in range(2):
        for split in ("train", "val"):
            ids = rng.integers(0, MODEL["vocab_size"], TOKENS).astype("<u2")
            store.put_bytes(keys.data_key(run.pk, p, split), ids.tobytes())
            shards[(p, split)] = ids
            if split == "train":
                ids.tofile(tmp / "train.bin")
                upload_rows(store, run.run_config, run.pk, p, 2, tmp / "train.bin", "<u2")
        info = ShardInfo(f"{p}/val.bin", TOKENS, 1, "0" * 64)
        infos.append({"train": info, "val": info})
    index = ShardIndex("<u2", MODEL["vocab_size"], 0, 2, "test", infos)
    store.put_file(data_index_key(run.pk), index.save(tmp))
    run.paths.update(train_tokens=TOKENS, val_tokens=TOKENS)
    for state in ("preparing", "ready", "running"):
        transition(run, state)
    return run, shards


def local_shard(tmp: Path, ids: np.ndarray) -> TokenShard:
    file = tmp / f"local-{uuid.uuid4().hex[:6]}.bin"
    ids.tofile(file)
    return TokenShard(file, "<u2")


def test_ranges_merge_near_windows_and_read_the_same_tokens(tmp_path: Path) -> None:
    assert plan_ranges([0, 40, 10_000], 20, gap=30) == [(0, 60, [0, 1]), (10_000, 10_020, [2])]
    assert plan_ranges([0, 40, 80], 20, gap=30, span=70) == [(0, 60, [0, 1]), (80, 100, [2])]
    ids = np.arange(5000, dtype="<u2")
    data = ids.tobytes()
    shard = RangedShard(lambda s, e: data[s:e], len(data), "<u2", "shard")
    local = local_shard(tmp_path, ids)
    offsets = [4000, 3, 17, 20, 2500]
    assert np.array_equal(shard.read_windows(offsets, 33), local.read_windows(offsets, 33))
    assert np.array_equal(shard.read_window(4990, 30), local.read_window(4990, 30)), "wraps"
    with pytest.raises(IndexError, match="outside"):
        shard.read_windows([4990], 30)


def test_scoring_and_evaluation_read_large_shards_by_ranges(
    store: BlobStore, tmp_path: Path
) -> None:
    run, shards = large_run(tmp_path, store)
    refusing = RefusingStore(store)
    config = run.run_config
    T = config.model.seq_len

    # Scoring: the unit's drawn train windows and this round's drawn held-out windows.
    round_ = open_round(run, 0)
    module = run.modules.get(module_id="0.0")
    scorer = Scorer(refusing, round_, module, config, tmp_path)
    _, heldout = scorer._path(0)  # as Scorer.__call__: the path (and the shards' dtype) first
    before = refusing.range_bytes
    train = scorer._train_windows(0, 200)
    picks = scorer.train_picks(0, 200)
    assert len(picks) == config.outer.score_windows
    assert picks.min() >= 200 and picks.max() < 200 + unit_windows(config)
    expected = ShardSource.for_path(local_shard(tmp_path, shards[(0, "train")]), config, 0)
    rows = torch.cat([expected.batch(int(k), 1, T) for k in picks])
    assert torch.equal(train, rows)
    row_bytes = (T + 1) * 2
    assert refusing.range_bytes - before <= config.outer.score_windows * row_bytes, "its rows"
    val = shards[(0, "val")].astype(np.int64)
    drawn = scorer.heldout_picks(0, (TOKENS - 1) // T)
    rows = [val[i * T : i * T + T + 1] for i in drawn]
    assert torch.equal(heldout, torch.from_numpy(np.stack(rows)))

    # Evaluating: the run's validation sample of each path.
    before = refusing.range_bytes
    results = evaluate_run(run, 0, store=refusing)
    plan = run_sample(config, [TOKENS, TOKENS])
    print("evaluation read", refusing.range_bytes - before, "bytes in", refusing.ranges, "ranges")
    assert refusing.range_bytes - before < 2 * TOKENS * 2 // 2, "under half of the shards"
    model = build_model(config.model, config.seed)
    modules = init_modules(config)
    for result, p in zip(results, range(2), strict=True):
        model.load_state_dict(assemble_path_state(config, p, modules))
        windows = sample_shard(local_shard(tmp_path, shards[(p, "val")]), T, plan[p])
        assert result.loss == pytest.approx(mean_loss(model, windows, config.eval.batch_size))
