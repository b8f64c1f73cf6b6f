"""Per-path token shards: the on-disk (and object-store) data format.

Layout under a shard directory (docs/design.md §5: ``runs/<run>/data/``)::

    index.json          format version, dtype, vocab size, separator id,
                        and per path and split: tokens, documents, sha256
    <path>/train.bin    token ids, little-endian uint16 (vocab <= 65536) or uint32
    <path>/val.bin

Each document is written as ``[separator] + ids``: the separator opens every
document (as BOS) and, since windows wrap around, also follows the last one.
Files are plain arrays, so a window of tokens is a byte range: a reader maps the
file (`np.memmap`) and never loads it whole, and a work unit can fetch just
``window_byte_range(...)`` of a remote file. Writers write to a temporary file
and rename it into place, and the index is written last.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from rich.progress import Progress

from dipaco.data.corpus import Document
from dipaco.tokenizer import RunTokenizer

if TYPE_CHECKING:  # routing imports data; data needs routing only for types
    from dipaco.routing.router import Router

SHARD_FORMAT_VERSION = 1
INDEX_NAME = "index.json"
SPLITS = ("train", "val")


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """uint16 when every id fits (vocab_size <= 65536), else uint32; little-endian."""
    if not 0 < vocab_size <= 2**32:
        raise ValueError(f"vocab_size must be in (0, 2**32], got {vocab_size}")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class ShardInfo:
    file: str  # relative to the shard directory, e.g. "3/train.bin"
    tokens: int
    docs: int
    sha256: str


class ShardWriter:
    """Appends documents to one token file; `close` renames it into place.

    Tokens are buffered and appended in chunks, so thousands of writers can be
    open at once without holding thousands of file handles.
    """

    def __init__(
        self, path: Path, dtype: np.dtype[Any], separator_id: int, *, flush_tokens: int = 1 << 20
    ) -> None:
        self.path = path
        self.dtype = dtype
        self.separator_id = separator_id
        self.flush_tokens = flush_tokens
        self._max_id = int(np.iinfo(dtype).max)
        self._tmp = path.with_name(f".{path.name}.tmp")
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self._hash = hashlib.sha256()
        self.tokens = 0
        self.docs = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp.write_bytes(b"")

    def add_document(self, ids: Sequence[int] | np.ndarray[Any, Any]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if len(arr) and (int(arr.min()) < 0 or int(arr.max()) > self._max_id):
            raise ValueError(
                f"token id out of range for {self.dtype.name} in {self.path}; "
                "the tokenizer's vocab_size must match the shard dtype"
            )
        doc = np.empty(len(arr) + 1, dtype=self.dtype)  # (1 + L,)
        doc[0] = self.separator_id
        doc[1:] = arr
        self._buffer.append(doc)
        self._buffered += len(doc)
        self.tokens += len(doc)
        self.docs += 1
        if self._buffered >= self.flush_tokens:
            self._flush()

    def _flush(self) -> None:
        if not self._buffer:
            return
        data = np.concatenate(self._buffer).tobytes()
        self._hash.update(data)
        with open(self._tmp, "ab") as f:
            f.write(data)
        self._buffer, self._buffered = [], 0

    def close(self, root: Path) -> ShardInfo:
        """Flush, fsync and rename into place; ``root`` makes the recorded path relative."""
        self._flush()
        with open(self._tmp, "ab") as f:
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._tmp, self.path)
        return ShardInfo(
            file=self.path.relative_to(root).as_posix(),
            tokens=self.tokens,
            docs=self.docs,
            sha256=self._hash.hexdigest(),
        )

    def abort(self) -> None:
        self._tmp.unlink(missing_ok=True)


class TokenShard:
    """Reads windows of one token file by token offset, through a memory map."""

    def __init__(self, path: str | os.PathLike[str], dtype: np.dtype[Any] | str) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise ValueError(
                f"{self.path} has {size} bytes, not a whole number of {self.dtype.name} "
                "tokens; the file is truncated or the dtype is wrong"
            )
        self.num_tokens = size // self.dtype.itemsize
        self._map: np.memmap[Any, np.dtype[Any]] | None = None

    def __len__(self) -> int:
        return self.num_tokens

    def _tokens(self) -> np.memmap[Any, np.dtype[Any]]:
        if self.num_tokens == 0:
            raise ValueError(
                f"{self.path} holds no tokens (no document was routed to it); "
                "add data, use fewer paths, or raise data.val_fraction for validation"
            )
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._map

    def read_window(self, offset: int, length: int) -> np.ndarray:
        """``length`` tokens from ``offset`` as int64, wrapping past the end of the
        file back to its start. ``offset`` must lie in [0, len(shard))."""
        tokens = self._tokens()
        n = self.num_tokens
        if not 0 <= offset < n:
            raise IndexError(
                f"offset {offset} is outside {self.path} ({n} tokens); "
                "offsets are in [0, num_tokens) and windows wrap, so reduce it modulo num_tokens"
            )
        if length < 0:
            raise ValueError(f"window length must be >= 0, got {length}")
        if offset + length <= n:
            return np.asarray(tokens[offset : offset + length], dtype=np.int64)
        idx = (offset + np.arange(length, dtype=np.int64)) % n  # (length,) wraps
        return np.asarray(tokens[idx], dtype=np.int64)

    def read_windows(self, offsets: Sequence[int], length: int) -> np.ndarray:
        """(k, length) int64: `read_window` at each offset (dipaco.data.ranged's interface)."""
        if not offsets:
            return np.zeros((0, length), dtype=np.int64)
        return np.stack([self.read_window(int(o), length) for o in offsets])

    def batch(self, position: int, batch_size: int, seq_len: int) -> torch.Tensor:
        """(B, T+1) int64 training batch starting at token offset ``position``.

        Row r holds tokens [position + r*T, position + (r+1)*T] (T+1 tokens: inputs
        and next-token targets), so consecutive batches use position += B*T and
        every token is a target once. Positions wrap modulo the shard length.
        """
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
        n = len(self)
        start = position % n if n else 0
        flat = self.read_window(start, batch_size * seq_len + 1)  # (B*T + 1,)
        rows = np.lib.stride_tricks.sliding_window_view(flat, seq_len + 1)[::seq_len]
        return torch.from_numpy(np.ascontiguousarray(rows[:batch_size]))  # (B, T+1)


def window_byte_range(offset: int, length: int, dtype: np.dtype[Any] | str) -> tuple[int, int]:
    """[start, end) bytes of a non-wrapping window, for an HTTP Range request."""
    itemsize = np.dtype(dtype).itemsize
    return offset * itemsize, (offset + length) * itemsize


@dataclass
class ShardIndex:
    dtype: str
    vocab_size: int
    separator_id: int
    num_paths: int
    tokenizer_fingerprint: str
    paths: list[dict[str, ShardInfo]] = field(default_factory=list)
    version: int = SHARD_FORMAT_VERSION

    def info(self, path: int, split: str) -> ShardInfo:
        if split not in SPLITS or not 0 <= path < self.num_paths:
            raise KeyError(f"no shard for path {path} split {split!r}")
        return self.paths[path][split]

    def open(self, root: str | os.PathLike[str], path: int, split: str = "train") -> TokenShard:
        info = self.info(path, split)
        shard = TokenShard(Path(root) / info.file, self.dtype)
        if len(shard) != info.tokens:
            raise ValueError(f"{shard.path} has {len(shard)} tokens, index says {info.tokens}")
        return shard

    def save(self, root: str | os.PathLike[str]) -> Path:
        target = Path(root) / INDEX_NAME
        tmp = target.with_name(f".{INDEX_NAME}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")
        os.replace(tmp, target)
        return target

    @classmethod
    def load(cls, root: str | os.PathLike[str]) -> ShardIndex:
        raw = json.loads((Path(root) / INDEX_NAME).read_text("utf-8"))
        if raw.get("version") != SHARD_FORMAT_VERSION:
            raise ValueError(f"shard format {raw.get('version')} is not {SHARD_FORMAT_VERSION}")
        raw["paths"] = [{s: ShardInfo(**e[s]) for s in SPLITS} for e in raw["paths"]]
        return cls(**raw)

    def verify(self, root: str | os.PathLike[str]) -> None:
        """Re-hash every file against the index; raises on the first mismatch."""
        for entry in self.paths:
            for info in entry.values():
                digest = hashlib.sha256()
                with open(Path(root) / info.file, "rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                if digest.hexdigest() != info.sha256:
                    raise ValueError(f"{info.file} does not match its sha256 in {INDEX_NAME}")


def build_shards(
    train: Iterable[Document],
    val: Iterable[Document],
    tokenizer: RunTokenizer,
    router: Router | None,
    out_dir: str | os.PathLike[str],
    *,
    num_paths: int | None = None,
    batch_docs: int = 256,
    progress: bool = True,
    unrouted_dir: str | os.PathLike[str] | None = None,
) -> ShardIndex:
    """Tokenise, route and write every document into its path's shard.

    ``router=None`` puts everything on path 0 (plain DiLoCo: one path, replicas
    read different windows); then ``num_paths`` must be 1 or left out. Returns
    the index, also saved as ``out_dir/index.json``: tokens and documents per
    path and split. ``unrouted_dir``: also write every document, in the same order, into
    one path there (what ``router=None`` would write; the simulator's baselines read it),
    from the same tokenisation.
    """
    root = Path(out_dir)
    root.mkdir(parents=True, exist_ok=True)
    paths = router.num_paths if router is not None else 1
    if num_paths is not None and num_paths != paths:
        raise ValueError(f"num_paths={num_paths} but the router has {paths} paths")
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        (p, split): ShardWriter(root / str(p) / f"{split}.bin", dtype, tokenizer.separator_id)
        for p in range(paths)
        for split in SPLITS
    }
    unrouted = Path(unrouted_dir) if unrouted_dir is not None else None
    if unrouted is not None:
        unrouted.mkdir(parents=True, exist_ok=True)
        writers.update(
            {
                (-1, split): ShardWriter(
                    unrouted / "0" / f"{split}.bin", dtype, tokenizer.separator_id
                )
                for split in SPLITS
            }
        )
    finished = False
    try:
        splits = (("train", train), ("val", val))
        _write_documents(writers, splits, tokenizer, router, batch_docs, progress)
        infos = {
            key: w.close(root if key[0] >= 0 or unrouted is None else unrouted)
            for key, w in writers.items()
        }
        finished = True
    finally:
        if not finished:  # leave no temporary files behind, whatever stopped us
            for w in writers.values():
                w.abort()
    if unrouted is not None:
        _shard_index(tokenizer, dtype, [{split: infos[-1, split] for split in SPLITS}]).save(
            unrouted
        )
    index = _shard_index(
        tokenizer, dtype, [{split: infos[p, split] for split in SPLITS} for p in range(paths)]
    )
    index.save(root)
    return index


def _write_documents(
    writers: dict[tuple[int, str], ShardWriter],
    splits: Iterable[tuple[str, Iterable[Document]]],
    tokenizer: RunTokenizer,
    router: Router | None,
    batch_docs: int,
    progress: bool,
) -> None:
    """Tokenise and route each split's documents into `writers` (path, split); writers
    keyed (-1, split) also get every document, unrouted."""
    with Progress(disable=not progress, transient=True) as bar:
        for split, docs in splits:
            total = len(docs) if isinstance(docs, Sequence) else None
            task = bar.add_task(f"Sharding {split}", total=total)
            for batch in _chunked(docs, batch_docs):
                texts = [d.text for d in batch]
                ids = tokenizer.encode_batch(texts)
                routes = router.route_batch(texts) if router is not None else [0] * len(texts)
                for path, doc_ids in zip(routes, ids, strict=True):
                    arr = np.asarray(doc_ids, dtype=np.int64)  # (L,)
                    writers[path, split].add_document(arr)
                    if (-1, split) in writers:
                        writers[-1, split].add_document(arr)
                bar.advance(task, len(batch))


def _shard_index(
    tokenizer: RunTokenizer, dtype: np.dtype[Any], paths: list[dict[str, ShardInfo]]
) -> ShardIndex:
    return ShardIndex(
        dtype=dtype.str,
        vocab_size=tokenizer.vocab_size,
        separator_id=tokenizer.separator_id,
        num_paths=len(paths),
        tokenizer_fingerprint=tokenizer.fingerprint,
        paths=paths,
    )


def _chunked(docs: Iterable[Document], size: int) -> Iterable[list[Document]]:
    batch: list[Document] = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch
