"""The windows that score a unit's Δ are drawn by the server after the upload
(dipaco.data.scored, rounds.verification.scorer.Scorer): from all of the unit's windows,
with a seed from a secret no worker is sent, the same for the unit's replicas; the
held-out windows afresh each round. Real database and blob store (a run's row chunks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dipaco.data.rows import StoreRows
from dipaco.data.scored import draw_seed, first_windows, unit_windows_scored
from dipaco.data.windows import ShardSource, unit_windows
from dipaco.flops import score_windows
from dipaco.modular import modules_of_path
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.models import Round
from dipaco_server.rounds.verification.scorer import Scorer
from dipaco_server.rounds.verification.uploads import Upload
from dipaco_server.storage import BlobStore, get_blob_store
from tests.test_range_reads import TOKENS, large_run, local_shard, one_torch_thread, store
from tests.test_unit_data import SEQ_LEN, leased, manifest, small_chunks, written

__all__ = ["one_torch_thread", "small_chunks", "store"]  # fixtures used by name


def test_drawn_rows_are_read_by_ranges_of_those_rows_alone(tmp_path: Path) -> None:
    index, chunks = written(tmp_path, windows=53, per_chunk=7)
    reader = StoreRows(index, lambda c, a, b: chunks[c][a:b])
    positions = [50, 3, 60, 17, 52, 4]  # unsorted, across the first pass into the second
    got = reader.read_at(positions)
    for row, k in zip(got, positions, strict=True):
        assert np.array_equal(row, reader.read(k, 1)[0])
    reader.ranges_read = 0
    reader.read_at(positions)
    assert reader.ranges_read <= len(positions), "one range per run of neighbouring rows"
    assert reader.read_at([]).shape == (0, SEQ_LEN + 1)


def test_a_draw_is_uniform_over_the_unit_and_keeps_to_what_its_lease_covered() -> None:
    seen = np.zeros(40, dtype=int)
    for unit in range(400):
        picks = unit_windows_scored(1000, 40, 8, draw_seed(b"s", unit))
        assert len(set(picks.tolist())) == 8 and list(picks) == sorted(picks)
        seen[picks - 1000] += 1
    assert seen.min() > 0 and seen[8:].sum() > seen[:8].sum(), "not the first windows"
    whole = unit_windows_scored(0, 40, 8, 7)
    short = unit_windows_scored(0, 40, 8, 7, trained=12)
    assert short.max() < 12 and set(whole[whole < 12].tolist()) <= set(short.tolist())
    with pytest.raises(ValueError, match="secret"):
        draw_seed(b"", 1)


def test_a_units_scored_windows_depend_on_a_server_secret_and_are_its_replicas(
    store: BlobStore, tmp_path: Path, settings: Any
) -> None:
    run, shards = large_run(tmp_path, store)
    config = run.run_config
    T, k, W = config.model.seq_len, score_windows(config), unit_windows(config)
    round_ = open_round(run, 0)
    settings.DIPACO_SCORE_SECRET = "first secret"
    scorer = Scorer(store, round_, run.modules.get(module_id="0.0"), config, tmp_path)
    units = [scorer.train_picks(0, first) for first in (0, W, 2 * W, 3 * W)]
    for first, picks in zip((0, W, 2 * W, 3 * W), units, strict=True):
        assert len(picks) == k and first <= picks.min() and picks.max() < first + W
    offsets = {tuple((p - p.min()).tolist()) for p in units}
    assert len(offsets) == len(units), "each unit its own draw"
    assert any(not np.array_equal(p, first_windows(p.min(), k)) for p in units)

    # The same unit's replicas (same round, path, position), scored by another module's
    # step or by another scorer, get the same windows and the same rows.
    other = Scorer(store, round_, run.modules.get(module_id="0.1"), config, tmp_path)
    assert np.array_equal(other.train_picks(0, W), units[1])
    assert torch.equal(other._train_windows(0, W), scorer._train_windows(0, W))
    simulator = ShardSource.for_path(local_shard(tmp_path, shards[(0, "train")]), config, 0)
    rows = torch.cat([simulator.batch(int(q), 1, T) for q in units[1]])
    assert torch.equal(scorer._train_windows(0, W), rows), "the rows at the drawn positions"

    # Another secret, another draw: without the server's secret it cannot be computed.
    settings.DIPACO_SCORE_SECRET = "another secret"
    assert not np.array_equal(scorer.train_picks(0, W), units[1])
    settings.DIPACO_SCORE_SECRET = ""
    fallback = scorer.train_picks(0, W)  # Django's SECRET_KEY when no setting is given
    settings.SECRET_KEY = settings.SECRET_KEY + "-rotated"
    assert not np.array_equal(scorer.train_picks(0, W), fallback)


def test_heldout_windows_are_drawn_afresh_each_round(
    store: BlobStore, tmp_path: Path, settings: Any
) -> None:
    run, shards = large_run(tmp_path, store)
    config = run.run_config
    T = config.model.seq_len
    settings.DIPACO_SCORE_SECRET = "held-out secret"
    open_round(run, 0)
    module = run.modules.get(module_id="0.0")
    windows = (TOKENS - 1) // T
    base = tuple(sorted((m, 0) for m in modules_of_path(config, 0)))
    drawn = []
    for t in range(4):
        scorer = Scorer(store, Round(run=run, t=t), module, config, tmp_path)
        picks = scorer.heldout_picks(0, windows)
        assert len(picks) == score_windows(config) and picks.max() < windows
        _, heldout = scorer._path(0, base)
        val = shards[(0, "val")].astype(np.int64)
        expected = np.stack([val[i * T : i * T + T + 1] for i in picks])
        assert torch.equal(heldout, torch.from_numpy(expected))
        drawn.append(tuple(picks.tolist()))
    assert len(set(drawn)) == 4, "a new held-out sample each round"
    other_path = Scorer(store, Round(run=run, t=0), module, config, tmp_path)
    assert tuple(other_path.heldout_picks(1, windows).tolist()) != drawn[0]


def test_no_answer_a_worker_gets_carries_the_scoring_secret(db: None, settings: Any) -> None:
    settings.DIPACO_SCORE_SECRET = "scoring-secret-0a1b2c"
    run, grant, token, client = leased(db)
    answer = manifest(client, grant, token)
    assert answer.status_code == 200
    body = answer.content.decode()
    for secret in (settings.DIPACO_SCORE_SECRET, settings.SECRET_KEY):
        assert secret not in body
        assert secret not in json.dumps(grant.secret)
    # What the worker knows of its unit (its position and windows) leaves the draw open:
    # another secret draws other windows of the same unit.
    data = answer.json()["data"]
    first, count = data["first_position"], data["windows"]
    p = grant.unit.path.index
    scorer = Scorer(get_blob_store(), grant.unit.round, run.modules.first(), run.run_config,
                    Path("."))  # fmt: skip
    picks = scorer.train_picks(p, first)
    assert first <= picks.min() and picks.max() < first + count
    settings.DIPACO_SCORE_SECRET = token  # even the worker's own token is no key to it
    assert not np.array_equal(scorer.train_picks(p, first), picks)

    # A lease sized down to fewer steps is scored on the windows it covered: the server's
    # record of its steps, not the worker's claim.
    config = run.run_config
    grant.lease.steps = 2
    grant.lease.save(update_fields=["steps"])
    upload = Upload(0, grant.lease.worker_id, "", 0, "", 0, p, lease_id=grant.lease.pk,
                    position=first)  # fmt: skip
    covered = scorer._covered(upload)
    assert covered == 2 * config.inner.batch_size
    short = scorer.train_picks(p, first, covered)
    assert first <= short.min() and short.max() < first + covered
