"""A path's training windows, in a seeded shuffled order: the one definition of which tokens
a work unit trains on, for the simulator, the server (what it tells a unit) and the worker
agent (how it reads them), so a platform run and ``dipaco simulate`` see the same data.

A path's train shard of N tokens holds W = (N - 1) // T non-overlapping windows of T + 1
tokens (window w: tokens w·T .. w·T + T; its last token is the next window's first, as
the next-token target). `ShardSource` reads them in the order of a permutation seeded
with `path_seed` (config.seed + path): position k < W reads window perm[k], and the
inner loop advances the position by one per sequence. Unit (t, r), replica r of outer
round t, starts at position `unit_start` = (t·R + r)·H·B and reads H·B windows
(`unit_windows`), so every replica of a round reads different windows, consecutive rounds
move on through the shard, and a shard shorter than a round wraps into a new pass, in a
new order (dipaco.data.rows: the platform stores this order as row chunks, so a unit's
windows are a few contiguous reads).

Why shuffled, not a contiguous slice: documents are written to a shard one after the
other, so a contiguous run of H·B windows is a handful of documents (at simulation scale,
a few files), and replicas of a path would drift apart on them; a permutation gives every
unit i.i.d. batches of its path's documents.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dipaco.config import RunConfig

if TYPE_CHECKING:
    from torch import Tensor

    from dipaco.data.ranged import RangedShard
    from dipaco.data.shards import TokenShard

# torch and numpy are imported where they are used: the server's processes import this
# module (path_seed, unit_start) at their start, and torch takes seconds to import.

__all__ = [
    "RowSource",
    "ShardSource",
    "path_seed",
    "step_tokens",
    "unit_start",
    "unit_tokens",
    "unit_windows",
]


def step_tokens(config: RunConfig) -> int:
    """Tokens of one inner step: batch sequences x sequence length."""
    return config.inner.batch_size * config.model.seq_len


def unit_tokens(config: RunConfig) -> int:
    """Tokens one whole unit trains on: H steps x batch sequences x sequence length."""
    return config.inner.steps * step_tokens(config)


def path_seed(config: RunConfig, path: int) -> int:
    """The seed of path `path`'s window order."""
    return config.seed + path


def unit_windows(config: RunConfig) -> int:
    """Windows one unit trains on: H steps x the batch (micro-batch x accumulation)."""
    return config.inner.steps * config.inner.batch_size


def unit_start(config: RunConfig, round_index: int, replica: int) -> int:
    """The position in its path's window order where unit (round_index, replica) starts."""
    if round_index < 0 or not 0 <= replica < config.replicas_per_path:
        raise ValueError(
            f"no unit (round {round_index}, replica {replica}): rounds count from 0 and "
            f"replicas from 0 to replicas_per_path - 1 = {config.replicas_per_path - 1}"
        )
    return (round_index * config.replicas_per_path + replica) * unit_windows(config)


class RowSource:
    """A TokenSource over given (N, T+1) sequences in one seeded shuffle: the demo's dense
    baselines read every unit's sequences of the run this way."""

    def __init__(self, rows: Tensor, seed: int) -> None:
        # torch and numpy: the note under the imports
        import torch

        self.rows = rows  # (N, T+1)
        generator = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(rows.shape[0], generator=generator)  # (N,)

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        if seq_len + 1 != self.rows.shape[1]:
            raise ValueError(f"sequences cut for seq_len {self.rows.shape[1] - 1}, asked {seq_len}")
        # torch and numpy: the note under the imports
        import torch

        picks = self.order[(position + torch.arange(batch_size)) % self.order.numel()]  # (B,)
        return self.rows[picks]  # (B, T+1)


class ShardSource:
    """dipaco.inner's TokenSource over a TokenShard, reading windows in the path's order.

    The inner loop counts its position in windows (it advances by batch_size per
    micro-batch, like InMemoryTokenSource), while TokenShard reads by token offset; this
    adapter converts. Position k < W reads window order[k] of the shard's W windows (pass
    0, a seeded permutation); later passes follow dipaco.data.rows.RowOrder, chunk by chunk,
    which is exactly what the platform's row chunks hold (`rows_per_chunk`: theirs; by
    default one chunk, so every pass is a new permutation of the whole shard).
    """

    def __init__(
        self,
        shard: TokenShard | RangedShard,
        seq_len: int,
        seed: int,
        rows_per_chunk: int | None = None,
    ) -> None:
        # rows: numpy, imported where used (the note under the imports)
        from dipaco.data.rows import RowOrder, first_pass

        self.shard = shard
        self.seq_len = seq_len
        windows = (len(shard) - 1) // seq_len
        if windows < 1:
            raise ValueError(
                f"{shard.path} holds {len(shard)} tokens, not one window of {seq_len + 1}; "
                "give the path more data (or use fewer paths)"
            )
        # torch and numpy: the note under the imports
        import torch

        self.order = torch.from_numpy(first_pass(windows, seed))  # (W,) pass 0
        self.rows = RowOrder(windows, rows_per_chunk or windows, seed)

    @classmethod
    def for_path(cls, shard: TokenShard | RangedShard, config: RunConfig, path: int) -> ShardSource:
        """Path `path`'s training windows under `config` (its seq_len, `path_seed` and the
        row chunks preparation writes for it)."""
        from dipaco.data.rows import rows_per_chunk  # numpy: the note under the imports

        per_chunk = rows_per_chunk(config, shard.dtype.itemsize)
        return cls(shard, config.model.seq_len, path_seed(config, path), per_chunk)

    def windows_at(self, position: int, count: int) -> list[int]:
        """The windows positions position .. position + count - 1 read."""
        return [int(w) for w in self.order.numpy()[self.rows.file_rows(position, count)]]

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        if seq_len != self.seq_len:
            raise ValueError(f"source cut for seq_len {self.seq_len}, asked for {seq_len}")
        # torch and numpy: the note under the imports
        import numpy as np
        import torch

        picks = self.windows_at(position, batch_size)
        rows = self.shard.read_windows([w * seq_len for w in picks], seq_len + 1)
        return torch.from_numpy(np.ascontiguousarray(rows))  # (B, T+1)
