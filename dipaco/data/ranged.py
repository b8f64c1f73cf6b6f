"""A token shard read by byte ranges from wherever it is stored, never copied whole.

The server cuts a unit's windows, scores a Δ and evaluates a path on a few windows of a
shard that can be gigabytes (a 150M path's train shard); downloading it whole for each
of these cost more than everything else they do. `RangedShard` has TokenShard's reading
interface (`read_window`, `read_windows`, `len`, `dtype`, `path`) over a
``read_range(start, end) -> bytes`` callable (a blob store's ranged GET). A batch of
windows is sorted, windows closer than `MAX_GAP` bytes are read in one range (at most
`MAX_SPAN` bytes long), and the ranges are fetched by `THREADS` threads at once, so the
bytes read are those of the windows (plus gaps under 4 KiB) and the latency is one
request's per `THREADS` ranges.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

ReadRange = Callable[[int, int], bytes]

MAX_GAP = 4 * 1024  # bytes between two windows that are still read in one range
MAX_SPAN = 4 * 1024 * 1024  # the longest range read at once
THREADS = 8  # ranges in flight together (boto3 clients and local files are thread-safe)


def plan_ranges(
    starts: Sequence[int], length: int, gap: int = MAX_GAP, span: int = MAX_SPAN
) -> list[tuple[int, int, list[int]]]:
    """[(start, end, indices into `starts`)]: byte ranges covering each [s, s + length),
    windows less than `gap` bytes apart merged, no range over `span` bytes (unless one
    window is)."""
    order = sorted(range(len(starts)), key=lambda i: starts[i])
    ranges: list[tuple[int, int, list[int]]] = []
    for i in order:
        s, e = starts[i], starts[i] + length
        if ranges:
            first, last, members = ranges[-1]
            if s - last <= gap and max(e, last) - first <= span:
                ranges[-1] = (first, max(e, last), [*members, i])
                continue
        ranges.append((s, e, [i]))
    return ranges


class RangedShard:
    """A shard of `size` bytes of `dtype` tokens, read through `read_range`; `name` (its
    blob key) stands for the file's path in messages."""

    def __init__(self, read_range: ReadRange, size: int, dtype: Any, name: str) -> None:
        self.read_range, self.path = read_range, name
        self.dtype = np.dtype(dtype)
        if size % self.dtype.itemsize:
            raise ValueError(
                f"{name} has {size} bytes, not a whole number of {self.dtype.name} tokens; "
                "the blob is truncated or the dtype is wrong"
            )
        self.num_tokens = size // self.dtype.itemsize
        self.bytes_read = 0
        self.ranges_read = 0

    def __len__(self) -> int:
        return self.num_tokens

    def read_window(self, offset: int, length: int) -> np.ndarray:
        """``length`` tokens from ``offset`` as int64, wrapping past the end to the start
        (as TokenShard.read_window)."""
        n = self.num_tokens
        if not 0 <= offset < n:
            raise IndexError(f"offset {offset} is outside {self.path} ({n} tokens)")
        if offset + length <= n:
            return self.read_windows([offset], length)[0]
        if length > n:
            raise ValueError(f"a window of {length} tokens is longer than {self.path} ({n})")
        head = self.read_windows([offset], n - offset)[0]
        return np.concatenate([head, self.read_windows([0], length - head.size)[0]])

    def read_windows(self, offsets: Sequence[int], length: int) -> np.ndarray:
        """(k, length) int64: the windows at token `offsets`, none past the end."""
        n, item = self.num_tokens, self.dtype.itemsize
        for offset in offsets:
            if not 0 <= offset <= n - length:
                raise IndexError(
                    f"window [{offset}, {offset + length}) is outside {self.path} ({n} tokens)"
                )
        out = np.empty((len(offsets), length), dtype=np.int64)
        ranges = plan_ranges([o * item for o in offsets], length * item)

        def fetch(r: tuple[int, int, list[int]]) -> tuple[int, bytes, list[int]]:
            start, end, members = r
            data = self.read_range(start, end)
            if len(data) != end - start:
                raise ValueError(f"{self.path}: read {len(data)} bytes of [{start}, {end})")
            return start, data, members

        with ThreadPoolExecutor(max_workers=min(THREADS, max(1, len(ranges)))) as pool:
            for start, data, members in pool.map(fetch, ranges):
                tokens = np.frombuffer(data, dtype=self.dtype)
                for i in members:
                    at = (offsets[i] * item - start) // item
                    out[i] = tokens[at : at + length]
                self.bytes_read += len(data)
                self.ranges_read += 1
        return out


def store_shard(store: Any, key: str, dtype: Any) -> RangedShard:
    """The shard under `key` of a blob store with `size` and `get_range` (the server's)."""
    return RangedShard(
        lambda start, end: store.get_range(key, start, end), store.size(key), dtype, key
    )
