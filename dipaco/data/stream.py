"""Preparation that streams: a corpus of any size in bounded memory, in pieces that run in
parallel and resume, with the same shards whatever the number of processes.

Three passes, none holding the corpus:

1. `scan_corpus` reads every file once (no tokenising): counts, the files that read
   whole and their pieces (a file, or a range of a large file's rows: sources.piece_spans),
   the tokenizer's sample and the router's sample. A file that fails
   midway (a malformed Parquet, a truncated ``.zst``) is skipped whole and named in the
   statistics; its documents enter neither sample (each file's candidates are merged
   only once it has read to its end).
   - The tokenizer's sample is `dipaco.tokenizer.sample_texts`'s, drawn in one pass:
     the training documents with the smallest sha256 of their id until ``max_chars``
     (`TokenizerSample` keeps exactly those, so the tokenizer is today's).
   - The router's sample is the ``router_docs`` training documents with the smallest
     seeded hash of their id, each cut to the characters routing reads
     (`RouterSample`). With fewer training documents than that it is all of them.
     What this changes: the tf-idf weights, the k-means centroids and the balance biases
     are fitted on the sample instead of every document, so ``max_imbalance`` holds on
     the sample and, for the rest of the corpus, only as a sample estimate (with 20k
     documents the share of a path with load p has standard error sqrt(p(1-p)/20000), under
     0.4 percentage points); and since the fit sees documents in hash order, not file
     order, its k-means starts differ from the in-memory path's (dipaco.data.prepare).
2. `write_piece` tokenises, routes and writes one piece's documents into its own part of
   every path's shard (``<p>/<split>.bin`` under the piece's directory), with a manifest.
   A token budget keeps a seeded subset of records (`keep_fraction`, `is_kept`).
3. `join_parts` concatenates the parts in piece order into the shards and writes the
   index. Pieces are files in sorted order, a large file's ranges in row order, and a
   piece's output depends on its records alone, so the shards are byte for byte the same
   whichever process wrote which part, and whether a file was cut into ranges or not.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from dipaco.data.corpus import (
    DEFAULT_MAX_CHARS,
    CorpusStats,
    Document,
    is_validation,
    iter_file_documents,
)
from dipaco.data.shards import SPLITS, ShardIndex, ShardInfo, ShardWriter, token_dtype
from dipaco.data.sources import Listing, SourceFile, Span, UnreadableFile, piece_spans
from dipaco.routing.router import CHARS_PER_PREFIX_TOKEN, Router
from dipaco.tokenizer import DEFAULT_TRAIN_CHARS, RunTokenizer, train_tokenizer_on

if TYPE_CHECKING:
    from dipaco.config import RunConfig

ROUTER_SAMPLE_DOCS = 20_000  # documents the router fits on (module docstring: the error)
MAX_DOC_SAMPLE_CHARS = 20_000  # sample_texts' cut of one document
BATCH_DOCS = 256  # documents tokenised and routed together
PIECE_BYTES = 64 << 20  # a larger Parquet or plain JSON Lines file is cut into pieces


class TokenizerSample:
    """The training documents with the smallest sha256(id) until ``max_chars``: the
    sample `sample_texts` draws from a sorted list, kept in one pass.

    Invariant: the kept set minus its largest key holds fewer than ``max_chars``
    characters, so every document sample_texts would take is kept and little else."""

    def __init__(self, max_chars: int = DEFAULT_TRAIN_CHARS) -> None:
        self.max_chars = max_chars
        self._heap: list[tuple[int, str]] = []  # (-key, text): the largest key on top
        self._total = 0

    def add(self, doc_id: str, text: str) -> None:
        key = int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest(), "big")
        self.add_keyed(key, text[:MAX_DOC_SAMPLE_CHARS])

    def add_keyed(self, key: int, text: str) -> None:
        if self._heap and self._total >= self.max_chars and key > -self._heap[0][0]:
            return  # it would be the largest, and the rest already fill the budget
        heapq.heappush(self._heap, (-key, text))
        self._total += len(text)
        while self._heap and self._total - len(self._heap[0][1]) >= self.max_chars:
            self._total -= len(heapq.heappop(self._heap)[1])

    def merge(self, other: TokenizerSample) -> None:
        for neg, text in other._heap:
            self.add_keyed(-neg, text)

    def texts(self) -> list[str]:
        """What sample_texts returns for the same documents."""
        sample, total = [], 0
        for _, text in sorted(self._heap, reverse=True):  # ascending key
            if total >= self.max_chars:
                break
            cut = text[: self.max_chars - total]
            sample.append(cut)
            total += len(cut)
        return sample


class RouterSample:
    """The ``k`` training documents with the smallest seeded hash of their id, each cut to
    the ``prefix_chars`` routing reads (dipaco.routing.router.prefix_ids)."""

    def __init__(self, k: int, seed: int, prefix_chars: int) -> None:
        self.k, self.seed, self.prefix_chars = k, seed, prefix_chars
        self._heap: list[tuple[int, str]] = []

    def add(self, doc_id: str, text: str) -> None:
        digest = hashlib.blake2b(f"{self.seed}:{doc_id}".encode(), digest_size=8).digest()
        self.add_keyed(int.from_bytes(digest, "big"), text[: self.prefix_chars])

    def add_keyed(self, key: int, text: str) -> None:
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (-key, text))
        elif key < -self._heap[0][0]:
            heapq.heapreplace(self._heap, (-key, text))

    def merge(self, other: RouterSample) -> None:
        for neg, text in other._heap:
            self.add_keyed(-neg, text)

    def texts(self) -> list[str]:
        return [text for _, text in sorted(self._heap, reverse=True)]


@dataclass
class CorpusScan:
    """What the first pass found: the pieces (indexes into ``spans``, each a file that
    read whole or a range of one)."""

    pieces: list[int]
    tokenizer_texts: list[str]
    router_texts: list[str]
    stats: CorpusStats
    train_chars: int = 0
    val_chars: int = 0
    spans: list[Span] = field(default_factory=list)


@dataclass(frozen=True)
class ReadOptions:
    text_field: str = "text"
    val_fraction: float = 0.05
    max_chars: int = DEFAULT_MAX_CHARS


def scan_corpus(
    listing: Listing,
    read: ReadOptions,
    *,
    tokenizer_chars: int = DEFAULT_TRAIN_CHARS,
    router_docs: int = ROUTER_SAMPLE_DOCS,
    router_seed: int = 0,
    prefix_chars: int = 32 * 64,
    piece_bytes: int = PIECE_BYTES,
    on_file: Callable[[int, int], None] = lambda done, total: None,
) -> CorpusScan:
    """Pass 1 (module docstring). ``on_file(done, total)`` after each file."""
    stats = CorpusStats(ignored=listing.ignored)
    tokenizer, router = (
        TokenizerSample(tokenizer_chars),
        RouterSample(router_docs, router_seed, prefix_chars),
    )
    scan = CorpusScan([], [], [], stats)
    for i, file in enumerate(listing.files):
        local = CorpusStats()
        tok, rout = (
            TokenizerSample(tokenizer_chars),
            RouterSample(router_docs, router_seed, prefix_chars),
        )
        chars = [0, 0]
        try:
            for doc in _documents(listing, file, local, read):
                val = is_validation(doc.source, read.val_fraction)
                chars[val] += len(doc.text)
                if not val:
                    tok.add(doc.id, doc.text)
                    rout.add(doc.id, doc.text)
            spans = piece_spans(listing, i, piece_bytes)
        except UnreadableFile as exc:
            stats.bad_file(file.rel, str(exc), exc)
            stats.files += 1
        else:
            stats.merge(local)
            tokenizer.merge(tok)
            router.merge(rout)
            scan.pieces.extend(range(len(scan.spans), len(scan.spans) + len(spans)))
            scan.spans.extend(spans)
            scan.train_chars += chars[0]
            scan.val_chars += chars[1]
        on_file(i + 1, len(listing.files))
    scan.tokenizer_texts, scan.router_texts = tokenizer.texts(), router.texts()
    return scan


def _documents(
    listing: Listing,
    file: SourceFile,
    stats: CorpusStats,
    read: ReadOptions,
    span: Span | None = None,
) -> Iterator[Document]:
    return iter_file_documents(
        listing, file, stats, text_field=read.text_field, max_chars=read.max_chars, span=span
    )


def keep_fraction(
    token_budget: int | None, train_chars: int, tokenizer: RunTokenizer, sample: Sequence[str]
) -> float:
    """The share of records to keep so the training shards hold about ``token_budget``
    tokens, from the tokens per character of the tokenizer's own sample; 1.0 without one."""
    if token_budget is None or train_chars == 0:
        return 1.0
    chars = sum(len(t) for t in sample) or 1
    tokens = sum(len(ids) + 1 for ids in tokenizer.encode_batch(list(sample)))
    return min(1.0, token_budget / (train_chars * tokens / chars))


def is_kept(source: str, fraction: float, seed: int) -> bool:
    """A seeded, per-record choice: the same records whatever the file layout."""
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(f"keep:{seed}:{source}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


@dataclass
class PieceResult:
    """One piece's part of every shard: ``parts["<path>/<split>"]`` is its ShardInfo as a
    dict (file relative to the piece's directory); ``error`` names why the file was skipped."""

    piece: int
    name: str
    parts: dict[str, dict[str, Any]] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    chars: int = 0
    error: str | None = None

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> PieceResult:
        return cls(**json.loads(text))


def write_piece(
    listing: Listing,
    piece: int,
    out: Path,
    tokenizer: RunTokenizer,
    router: Router | None,
    read: ReadOptions,
    *,
    keep: float = 1.0,
    keep_seed: int = 0,
    span: Span | None = None,
    documents_out: Path | None = None,
) -> PieceResult:
    """Pass 2 for one piece (``span``, the scan's; by default file ``piece`` whole): its
    documents tokenised, routed (path 0 without a router) and written under ``out``
    (``<path>/<split>.bin``), and with ``documents_out`` also as JSON Lines of
    ``{"split", "text"}`` there. A piece that fails midway leaves empty parts (and no
    documents) and its error in the result: skipped whole, as the scan skipped an
    unreadable file."""
    span = span if span is not None else Span(piece)
    file = listing.files[span.file]
    stats = CorpusStats()
    result = PieceResult(piece=piece, name=file.rel)
    sink = open(documents_out, "w", encoding="utf-8") if documents_out is not None else None  # noqa: SIM115 (closed below)

    def documents() -> Iterator[tuple[str, str]]:
        for doc in _documents(listing, file, stats, read, span):
            if is_kept(doc.source, keep, keep_seed):
                split = "val" if is_validation(doc.source, read.val_fraction) else "train"
                if sink is not None:
                    sink.write(json.dumps({"split": split, "text": doc.text}) + "\n")
                yield split, doc.text

    try:
        write_parts(documents(), out, tokenizer, router, result)
    except UnreadableFile as exc:
        result.error = str(exc)
        write_parts(iter(()), out, tokenizer, router, result)
        if sink is not None:
            sink.seek(0)
            sink.truncate()
    finally:
        if sink is not None:
            sink.close()
    result.stats = stats.to_json()
    return result


def write_parts(
    documents: Iterator[tuple[str, str]],
    out: Path,
    tokenizer: RunTokenizer,
    router: Router | None,
    result: PieceResult,
) -> None:
    """(split, text) pairs tokenised and routed ``BATCH_DOCS`` at a time (path 0 without a
    router) and appended, in order, to ``out/<path>/<split>.bin``; ``result`` gets the parts
    and the characters. The preparation's pieces and phase 2's routing (after a dense
    phase 1) both write this way. What ``documents`` raises aborts every part and goes on."""
    paths = router.num_paths if router is not None else 1
    dtype = token_dtype(tokenizer.vocab_size)
    writers = {
        (p, split): ShardWriter(out / str(p) / f"{split}.bin", dtype, tokenizer.separator_id)
        for p in range(paths)
        for split in SPLITS
    }
    chars = 0
    try:
        batch: list[tuple[str, str]] = []
        for pair in documents:
            batch.append(pair)
            if len(batch) == BATCH_DOCS:
                chars += _write_batch(batch, tokenizer, router, writers)
                batch = []
        chars += _write_batch(batch, tokenizer, router, writers)
    except BaseException:
        for w in writers.values():
            w.abort()
        raise
    result.chars = chars
    for (p, split), w in writers.items():
        result.parts[f"{p}/{split}"] = w.close(out).__dict__


def _write_batch(
    batch: list[tuple[str, str]],
    tokenizer: RunTokenizer,
    router: Router | None,
    writers: dict[tuple[int, str], ShardWriter],
) -> int:
    if not batch:
        return 0
    texts = [text for _, text in batch]
    ids = tokenizer.encode_batch_arrays(texts)
    routes = router.route_prefixes(texts, ids) if router is not None else [0] * len(texts)
    for (split, _), path, doc_ids in zip(batch, routes, ids, strict=True):
        writers[path, split].add_document(doc_ids)
    return sum(len(t) for t in texts)


def join_parts(
    results: Sequence[PieceResult],
    open_part: Callable[[PieceResult, str], IO[bytes]],
    out: Path,
    tokenizer: RunTokenizer,
    num_paths: int,
) -> ShardIndex:
    """Pass 3: every path's shard as its pieces' parts in piece order (``open_part(result,
    "<path>/<split>")`` opens one part), and the index; ``out/index.json`` is written last."""
    entries: list[dict[str, ShardInfo]] = []
    ordered = sorted(results, key=lambda r: r.piece)
    for p in range(num_paths):
        entry = {}
        for split in SPLITS:
            rel = f"{p}/{split}.bin"
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            digest, tokens, docs = hashlib.sha256(), 0, 0
            tmp = target.with_name(f".{target.name}.tmp")
            with open(tmp, "wb") as sink:
                for result in ordered:
                    part = result.parts[f"{p}/{split}"]
                    tokens, docs = tokens + part["tokens"], docs + part["docs"]
                    if part["tokens"] == 0:
                        continue
                    with open_part(result, f"{p}/{split}") as source:
                        while block := source.read(1 << 20):
                            digest.update(block)
                            sink.write(block)
                sink.flush()
                os.fsync(sink.fileno())
            os.replace(tmp, target)
            entry[split] = ShardInfo(rel, tokens, docs, digest.hexdigest())
        entries.append(entry)
    dtype = token_dtype(tokenizer.vocab_size)
    index = ShardIndex(
        dtype=dtype.str,
        vocab_size=tokenizer.vocab_size,
        separator_id=tokenizer.separator_id,
        num_paths=num_paths,
        tokenizer_fingerprint=tokenizer.fingerprint,
        paths=entries,
    )
    index.save(out)
    return index


def prepare_listing(
    config: RunConfig,
    listing: Listing,
    out: Path,
    *,
    num_paths: int | None = None,
    tokenizer_chars: int = DEFAULT_TRAIN_CHARS,
    router_docs: int = ROUTER_SAMPLE_DOCS,
    token_budget: int | None = None,
    piece_bytes: int = PIECE_BYTES,
) -> tuple[ShardIndex, CorpusScan]:
    """All three passes in this process (the server runs pass 2 as Celery tasks, the bench
    in a process pool): tokenizer/, router/, parts/<piece>/ and shards/ under ``out``."""
    from dipaco.data.prepare import fit_router_on  # prepare imports this module's callers

    read = ReadOptions(config.data.text_field, config.data.val_fraction)
    paths = config.layout.num_paths if num_paths is None else num_paths
    scan = scan_corpus(
        listing, read, tokenizer_chars=tokenizer_chars, router_docs=router_docs,
        router_seed=config.router.seed, prefix_chars=prefix_chars(config),
        piece_bytes=piece_bytes,
    )  # fmt: skip
    tokenizer = train_tokenizer_on(scan.tokenizer_texts, config.model.vocab_size)
    tokenizer.save(out / "tokenizer")
    router = None
    if paths > 1:
        fit_router_on(config, scan.router_texts, tokenizer).save(out / "router")
        router = Router.load(out / "router", tokenizer)  # as every piece task loads it
    keep = keep_fraction(token_budget, scan.train_chars, tokenizer, scan.tokenizer_texts)
    results = []
    for i in scan.pieces:
        part = out / "parts" / str(i)
        span = scan.spans[i]
        results.append(write_piece(listing, i, part, tokenizer, router, read, keep=keep, span=span))

    def open_part(result: PieceResult, part: str) -> IO[bytes]:
        return open(out / "parts" / str(result.piece) / f"{part}.bin", "rb")

    return join_parts(results, open_part, out / "shards", tokenizer, paths), scan


def prefix_chars(config: RunConfig) -> int:
    """The characters of a document routing reads (dipaco.routing.router.prefix_ids)."""
    return config.router.prefix_tokens * CHARS_PER_PREFIX_TOKEN
