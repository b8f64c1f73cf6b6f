"""A path's training windows stored in the order units read them: rows in chunks.

The window order (dipaco.data.windows) says which windows a unit trains on: position k of
a path's order. Preparation writes that order out, so that a unit's windows are a few
contiguous reads and nobody has to gather them from across the shard:

- a *row* is one window of T + 1 tokens (window w: tokens w·T .. w·T + T of the path's
  train tokens);
- pass 0 of the order is a seeded permutation of all W windows (``first_pass``, today's
  order since the order was defined), and file row r holds the window at position r;
- the rows are cut into *chunks* of ``rows_per_chunk`` rows (at most ``CHUNK_BYTES``,
  64 MiB, as MosaicML streaming's shards), each its own blob with its sha256 in the path's
  ``RowIndex``;
- pass p ≥ 1 (a run that reads more than W windows) visits the chunks in a new seeded
  order and each chunk's rows in a new seeded order (``RowOrder.locate``): every pass is a
  new order, and a unit still reads whole chunks, one after the other.

Why this shuffle. Pass 0 is a full permutation (no block shuffle): it is written once, at
preparation, from the local token file, so it costs nothing at training time, and any
contiguous run of rows is a uniform sample of the path's documents. Later passes only
permute chunks and the rows within each chunk, so that a unit never needs more than the
chunks its positions fall in: its batches are then drawn from chunks that are each
themselves a uniform sample of the whole path, in a new order.

A chunk is half a unit's windows at the run's config, within 256 KiB .. 64 MiB
(``rows_per_chunk``): a lease is given URLs of the chunks its rows fall in (whole chunks,
each checked by its sha256), so it reaches its own rows plus at most the partial chunks at
its two ends.

`UnitRows` is the worker's token source over a unit's chunks: it fetches a chunk when the
trainer first needs it, fetches the next while the trainer reads the current one, and
keeps at most two. `StoreRows` reads given positions' rows by ranges of the chunk blobs
(the server's scoring). `ShardSource` (dipaco.data.windows) reads the same order from the
token file, for the simulator.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dipaco.config import RunConfig

if TYPE_CHECKING:
    from torch import Tensor

    from dipaco.data.shards import TokenShard

__all__ = [
    "CHUNK_BYTES",
    "FORMAT",
    "ChunkInfo",
    "RowIndex",
    "RowOrder",
    "Segment",
    "StoreRows",
    "UnitRows",
    "first_pass",
    "rows_of",
    "rows_per_chunk",
    "write_rows",
]

FORMAT = "dipaco-rows-1"  # RowIndex.format: a reader refuses any other
CHUNK_BYTES = 64 * 1024 * 1024  # the largest chunk blob
MIN_CHUNK_BYTES = 256 * 1024  # the smallest (but for a path's last): requests stay few


def rows_per_chunk(config: RunConfig, itemsize: int) -> int:
    """Rows of one chunk at `config`: half a unit's windows, so a lease reaches little
    beyond its own rows, within MIN_CHUNK_BYTES .. CHUNK_BYTES, so a path of short units
    is not thousands of tiny objects, nor a long unit's chunk gigabytes."""
    row_bytes = (config.model.seq_len + 1) * itemsize
    unit = config.inner.steps * config.inner.batch_size  # dipaco.data.windows.unit_windows
    floor = max(1, MIN_CHUNK_BYTES // row_bytes)
    return max(floor, min(CHUNK_BYTES // row_bytes, unit // 2))


def _seed(*parts: int) -> int:
    """A generator seed from integers (a pass, a chunk), the same on every machine."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _permutation(n: int, seed: int) -> np.ndarray:
    """(n,) a seeded permutation that numpy alone computes, the same under every version:
    the order of splitmix64 hashes of 0 .. n - 1 (later passes; the worker computes them)."""
    key = int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:8], "little")
    with np.errstate(over="ignore"):
        z = (np.arange(n, dtype=np.uint64) ^ np.uint64(key)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return np.argsort(z, kind="stable")


def first_pass(windows: int, seed: int) -> np.ndarray:
    """Pass 0 of a path's order: file row r holds window first_pass(W, seed)[r] (torch's
    seeded permutation, the order dipaco.data.windows has always used; preparation writes
    it, so only the server and the simulator compute it)."""
    import torch  # not at the top: the web process imports this module and never needs it

    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(windows, generator=generator).numpy()  # (W,) int64


@dataclass(frozen=True)
class Segment:
    """Consecutive positions of an order that lie in one chunk: `count` rows from
    `start` of the chunk's order in this pass (its own rows in order when `perm_seed` is
    None, else in the permutation seeded with it)."""

    chunk: int
    start: int
    count: int
    perm_seed: int | None = None

    def rows(self, chunk_rows: int) -> np.ndarray:
        """(count,) the chunk's rows this segment reads, in order."""
        if self.perm_seed is None:
            return np.arange(self.start, self.start + self.count)
        return _permutation(chunk_rows, self.perm_seed)[self.start : self.start + self.count]


class RowOrder:
    """Positions of a path's order as (chunk, row) of its row chunks (the module doc)."""

    def __init__(self, windows: int, rows_per_chunk: int, seed: int) -> None:
        if windows < 1 or rows_per_chunk < 1:
            raise ValueError(f"an order needs windows and rows per chunk, got {windows}, "
                             f"{rows_per_chunk}")  # fmt: skip
        self.windows, self.per_chunk, self.seed = windows, rows_per_chunk, seed
        self.chunks = -(-windows // rows_per_chunk)

    def chunk_rows(self, chunk: int) -> int:
        """Rows of chunk `chunk` (the last may be short)."""
        return min(self.per_chunk, self.windows - chunk * self.per_chunk)

    @lru_cache(maxsize=4)  # noqa: B019 (an order lives as long as its source)
    def _pass(self, p: int) -> tuple[np.ndarray, list[int]]:
        """Pass p's chunk order and where each of its slots starts, in positions."""
        chunks = _permutation(self.chunks, _seed(self.seed, p))
        starts = np.cumsum([0] + [self.chunk_rows(int(c)) for c in chunks]).tolist()
        return chunks, starts

    def segments(self, first: int, count: int) -> list[Segment]:
        """The segments positions first .. first + count - 1 read, in order."""
        if first < 0 or count < 0:
            raise ValueError(f"no positions {first} + {count}: both count from 0")
        out: list[Segment] = []
        k, end = first, first + count
        while k < end:
            p, r = divmod(k, self.windows)
            if p == 0:
                chunk, at = divmod(r, self.per_chunk)
                seed = None
            else:
                chunks, starts = self._pass(p)
                slot = bisect_right(starts, r) - 1
                chunk, at = int(chunks[slot]), r - starts[slot]
                seed = _seed(self.seed, p, chunk)
            n = min(end - k, self.chunk_rows(chunk) - at)
            out.append(Segment(chunk, at, n, seed))
            k += n
        return out

    def file_rows(self, first: int, count: int) -> np.ndarray:
        """(count,) the file rows (chunk · rows_per_chunk + row) positions read."""
        parts = [
            s.chunk * self.per_chunk + s.rows(self.chunk_rows(s.chunk))
            for s in self.segments(first, count)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class ChunkInfo:
    rows: int
    bytes: int
    sha256: str


@dataclass
class RowIndex:
    """A path's row chunks: what preparation wrote, and the order they hold."""

    dtype: str
    seq_len: int
    seed: int  # of the order (dipaco.data.windows.path_seed)
    windows: int
    rows_per_chunk: int
    chunks: list[ChunkInfo] = field(default_factory=list)
    format: str = FORMAT

    @property
    def order(self) -> RowOrder:
        return RowOrder(self.windows, self.rows_per_chunk, self.seed)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str = "the row index") -> RowIndex:
        """Parse and check an index; a malformed or foreign one is refused by name."""
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, not {FORMAT!r}")
            chunks = [ChunkInfo(**c) for c in data.pop("chunks")]
            index = cls(**data, chunks=chunks)
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{where} cannot be read ({error}): prepare the data again") from None
        if sum(c.rows for c in index.chunks) != index.windows or len(index.chunks) != -(
            -index.windows // max(1, index.rows_per_chunk)
        ):
            raise ValueError(f"{where} does not add up (chunks against windows): prepare again")
        return index

    def matches(self, seq_len: int, seed: int, per_chunk: int) -> str:
        """Why this index cannot serve a run at these settings ("" when it can)."""
        if (self.seq_len, self.seed, self.rows_per_chunk) != (seq_len, seed, per_chunk):
            return (
                f"the rows were written for seq_len {self.seq_len}, seed {self.seed}, "
                f"{self.rows_per_chunk} rows a chunk; the run asks {seq_len}, {seed}, "
                f"{per_chunk}"
            )
        return ""


def write_rows(
    shard: TokenShard,
    seq_len: int,
    seed: int,
    per_chunk: int,
    out: Path,
    *,
    on_chunk: Callable[[int, int], None] | None = None,
) -> RowIndex:
    """Write `shard`'s windows as row chunks ``out/<chunk>.bin`` in pass 0's order, one
    chunk in memory at a time, and return their index (not saved)."""
    T, dtype = seq_len, shard.dtype
    windows = (len(shard) - 1) // T
    if windows < 1:
        raise ValueError(f"{shard.path} holds {len(shard)} tokens, not one window of {T + 1}")
    tokens = np.memmap(shard.path, dtype=dtype, mode="r")
    view = np.lib.stride_tricks.as_strided(
        tokens, shape=(windows, T + 1), strides=(T * dtype.itemsize, dtype.itemsize)
    )  # (W, T+1): row w is window w, read through the map (no copy)
    order = first_pass(windows, seed)
    out.mkdir(parents=True, exist_ok=True)
    index = RowIndex(dtype.str, T, seed, windows, per_chunk)
    chunks = -(-windows // per_chunk)
    for c in range(chunks):
        picks = np.sort(order[c * per_chunk : (c + 1) * per_chunk])  # read the map in order,
        where = np.argsort(np.argsort(order[c * per_chunk : (c + 1) * per_chunk]))
        rows = np.ascontiguousarray(view[picks][where])  # then put rows in the order's place
        data = rows.tobytes()
        tmp = out / f".{c}.bin.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, out / f"{c}.bin")
        index.chunks.append(ChunkInfo(len(rows), len(data), hashlib.sha256(data).hexdigest()))
        if on_chunk is not None:
            on_chunk(c + 1, chunks)
    return index


def rows_of(path: Path, dtype: str, rows: int, seq_len: int, chunk: int) -> np.ndarray:
    """A chunk file as its (rows, T+1) array, checked against the shape its index gives."""
    array = np.fromfile(path, dtype=dtype)
    if array.size != rows * (seq_len + 1):
        raise ValueError(f"chunk {chunk} holds {array.size} tokens, not {rows} rows of "
                         f"{seq_len + 1}: truncated or of another preparation")  # fmt: skip
    return array.reshape(rows, seq_len + 1)


class StoreRows:
    """Rows of given positions read by byte ranges of the chunk blobs (`read_range(chunk,
    start, end) -> bytes`): a unit's scored windows, without its other rows."""

    def __init__(self, index: RowIndex, read_range: Callable[[int, int, int], bytes]) -> None:
        self.index, self.read_range, self.order = index, read_range, index.order
        self.row_bytes = (index.seq_len + 1) * np.dtype(index.dtype).itemsize
        self.ranges_read = 0

    def read(self, first: int, count: int) -> np.ndarray:
        """(count, T+1) int64: the rows at positions first .. first + count - 1, one ranged
        read per run of neighbouring rows of a chunk."""
        return self.read_at(np.arange(first, first + count, dtype=np.int64))

    def read_at(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """(len(positions), T+1) int64: the rows at the given positions, in their order
        (the scored draw of a unit: dipaco.data.scored), one ranged read per run of
        neighbouring rows of a chunk; no other row is read."""
        at = np.asarray(positions, dtype=np.int64).reshape(-1)
        out = np.empty((at.size, self.index.seq_len + 1), dtype=np.int64)
        if at.size == 0:
            return out
        if int(at.min()) < 0:
            raise ValueError(f"no position {int(at.min())}: positions count from 0")
        lo = int(at.min())
        chunks, rows = [], []  # of every position lo .. max: arithmetic, no reads
        for s in self.order.segments(lo, int(at.max()) + 1 - lo):
            chunks.append(np.full(s.count, s.chunk, dtype=np.int64))
            rows.append(s.rows(self.order.chunk_rows(s.chunk)))
        chunk_of, row_of = np.concatenate(chunks)[at - lo], np.concatenate(rows)[at - lo]
        for chunk in np.unique(chunk_of).tolist():
            mine = chunk_of == chunk
            wanted = np.unique(row_of[mine])  # sorted
            got = []
            for a, b in _runs(wanted):
                data = self.read_range(chunk, a * self.row_bytes, b * self.row_bytes)
                if len(data) != (b - a) * self.row_bytes:
                    raise ValueError(f"chunk {chunk}: read {len(data)} bytes of rows {a}..{b}")
                self.ranges_read += 1
                got.append(np.frombuffer(data, dtype=self.index.dtype).reshape(b - a, -1))
            block = np.concatenate(got)  # (len(wanted), T+1), rows in sorted order
            out[mine] = block[np.searchsorted(wanted, row_of[mine])]
        return out


def _runs(rows: np.ndarray) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges covering sorted `rows`, neighbours merged."""
    ordered = np.unique(rows)
    if ordered.size == 0:
        return
    lo = prev = int(ordered[0])
    for r in ordered[1:].tolist():
        if r != prev + 1:
            yield lo, prev + 1
            lo = r
        prev = r
    yield lo, prev + 1


class UnitRows:
    """A unit's rows streamed from its chunks, as dipaco.inner's TokenSource.

    `segments` are the unit's, from position `first`; `fetch(i)` returns segment i's chunk
    as a (rows, T+1) array (downloaded and checked by its sha256). A chunk is fetched when
    a batch first needs it, the next one in the background while the trainer reads it, and
    at most two are held; a unit resumed at a later position never fetches the chunks
    before it.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        chunk_rows: Sequence[int],
        fetch: Callable[[int], np.ndarray],
        first: int,
        seq_len: int,
    ) -> None:
        self.segments, self.chunk_rows, self.fetch = list(segments), list(chunk_rows), fetch
        self.first, self.seq_len = first, seq_len
        self.starts = np.cumsum([0] + [s.count for s in self.segments]).tolist()
        self.count = self.starts[-1]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unit-rows")
        self._loading: dict[int, Future[np.ndarray]] = {}
        self._lock = threading.Lock()
        self.fetched: list[int] = []  # segments fetched, in order (tests, the bench)

    def _load(self, i: int) -> np.ndarray:
        chunk = self.fetch(i)
        seg = self.segments[i]
        rows = seg.rows(self.chunk_rows[i])
        self.fetched.append(i)
        return np.ascontiguousarray(chunk[rows])  # this segment's rows only; the chunk goes

    def _segment(self, i: int) -> Future[np.ndarray]:
        with self._lock:
            if i not in self._loading:
                self._loading[i] = self._pool.submit(self._load, i)
            return self._loading[i]

    def batch(self, position: int, batch_size: int, seq_len: int) -> Tensor:
        if seq_len != self.seq_len:
            raise ValueError(f"rows cut for seq_len {self.seq_len}, asked for {seq_len}")
        lo = position - self.first
        if lo < 0 or lo + batch_size > self.count:
            raise IndexError(
                f"positions {position} .. {position + batch_size - 1} are outside this "
                f"unit's rows {self.first} .. {self.first + self.count - 1}"
            )
        import torch  # torch and numpy: dipaco.data.windows' note

        first_seg = bisect_right(self.starts, lo) - 1
        last_seg = bisect_right(self.starts, lo + batch_size - 1) - 1
        with self._lock:  # segments the trainer has moved past are dropped
            for i in [i for i in self._loading if i < first_seg]:
                del self._loading[i]
        parts = []
        for i in range(first_seg, last_seg + 1):
            rows = self._segment(i).result()
            a = max(lo, self.starts[i]) - self.starts[i]
            b = min(lo + batch_size, self.starts[i + 1]) - self.starts[i]
            parts.append(rows[a:b])
        if last_seg + 1 < len(self.segments) and len(self._loading) < 2:
            self._segment(last_seg + 1)  # the next chunk comes while this one trains
        return torch.from_numpy(np.concatenate(parts).astype(np.int64))  # (B, T+1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
