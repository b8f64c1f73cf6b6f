"""A path's training windows (dipaco.data.windows): which tokens each work unit reads.

The simulator, the server and the worker agent all go through these functions, so these
tests pin the order they share.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.config import RunConfig
from dipaco.data.shards import TokenShard
from dipaco.data.windows import ShardSource, path_seed, unit_start, unit_windows

SEQ_LEN = 8


def shard_of(tmp_path: Path, tokens: int) -> TokenShard:
    path = tmp_path / "train.bin"
    np.arange(tokens, dtype="<u2").tofile(path)  # token i is i: a window shows where it is
    return TokenShard(path, "<u2")


def config(replicas: int = 3) -> RunConfig:
    return RunConfig.tiny(
        replicas_per_path=replicas, inner={"steps": 2, "micro_batch_size": 2, "grad_accum_steps": 1}
    )


def test_a_window_is_seq_len_plus_one_consecutive_tokens_at_its_index(tmp_path: Path) -> None:
    source = ShardSource(shard_of(tmp_path, 10 * SEQ_LEN + 1), SEQ_LEN, seed=0)
    rows = source.batch(0, 10, SEQ_LEN)  # (10, T + 1)
    for row, w in zip(rows, source.order, strict=True):
        assert torch.equal(row, torch.arange(int(w) * SEQ_LEN, int(w) * SEQ_LEN + SEQ_LEN + 1))


def test_the_order_is_a_seeded_permutation_of_every_window_of_the_shard(tmp_path: Path) -> None:
    shard = shard_of(tmp_path, 50 * SEQ_LEN + 3)  # 3 tokens too few for a 51st window
    first, again = ShardSource(shard, SEQ_LEN, seed=5), ShardSource(shard, SEQ_LEN, seed=5)
    assert sorted(first.order.tolist()) == list(range(50))
    assert torch.equal(first.order, again.order)
    assert not torch.equal(first.order, ShardSource(shard, SEQ_LEN, seed=6).order)
    assert first.order.tolist() != list(range(50)), "shuffled, not the shard's own order"


def test_the_units_of_a_round_read_different_windows_and_the_next_round_moves_on() -> None:
    run = config(replicas=3)
    per_unit = unit_windows(run)
    assert per_unit == 2 * 2  # H x batch
    read: set[int] = set()
    for t in range(4):
        for r in range(3):
            start = unit_start(run, t, r)
            positions = set(range(start, start + per_unit))
            assert not positions & read, f"unit ({t}, {r}) repeats another unit's windows"
            read |= positions
    assert read == set(range(4 * 3 * per_unit))  # no gap either


def test_a_shard_shorter_than_the_units_wraps_into_a_new_pass_in_a_new_order(
    tmp_path: Path,
) -> None:
    source = ShardSource(shard_of(tmp_path, 20 * SEQ_LEN + 1), SEQ_LEN, seed=1)
    first, second = source.windows_at(0, 20), source.windows_at(20, 20)
    assert sorted(first) == sorted(second) == list(range(20))
    assert first != second, "a new pass reads the windows in a new order"
    assert torch.equal(source.batch(20, 2, SEQ_LEN)[:, 0], torch.tensor(second[:2]) * SEQ_LEN)


def test_each_path_has_its_own_order_seeded_from_the_run() -> None:
    run = config()
    assert [path_seed(run, p) for p in range(3)] == [run.seed, run.seed + 1, run.seed + 2]


def test_a_unit_outside_the_run_and_a_shard_without_a_window_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="replicas_per_path"):
        unit_start(config(replicas=2), 0, 2)
    with pytest.raises(ValueError, match="rounds count from 0"):
        unit_start(config(), -1, 0)
    with pytest.raises(ValueError, match="not one window"):
        ShardSource(shard_of(tmp_path, SEQ_LEN), SEQ_LEN, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        ShardSource(shard_of(tmp_path, 3 * SEQ_LEN + 1), SEQ_LEN, seed=0).batch(0, 1, 4)
