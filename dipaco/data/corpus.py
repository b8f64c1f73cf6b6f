"""Corpora: raw text in, a deterministic stream of `Document`s out.

Three sources, one decoding path:

- a directory of text files (walked in sorted order; ``.jsonl`` files inside it
  are read as JSON Lines),
- a JSON Lines file with a text field,
- ``stdlib``: the Python standard library sources of the running interpreter —
  real text on every machine, with natural domains (asyncio, email, tkinter, ...).

Every source is reduced to an iterable of ``(name, bytes)`` blobs and decoded by
`iter_blob_documents`; an object-store corpus plugs in there (list the keys in
sorted order, yield ``(key, body)``). Bad inputs — binary (a NUL byte),
undecodable as UTF-8, empty, too large, malformed JSON — are skipped and counted
in `CorpusStats`, never fatal.

Long documents are chunked to at most ``max_chars`` characters, cut at a blank
line (else a newline) in the second half of the window. Routing reads only the
first 32 tokens of a document (docs/design.md §1), so one 700 kB file routed as a single
document would put all of it into one path's shard; chunks route independently
and keep the shards balanced. 8192 characters is about 2-3k tokens of code.

The train/validation split hashes ``Document.source`` (the file or record a
chunk came from), not the chunk id, so every chunk of a file lands on the same
side and validation text is never a neighbouring chunk of a training file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dipaco.data.sources import (
    BadRecord,
    Listing,
    MissingColumn,
    S3Options,
    SourceFile,
    Span,
    UnreadableFile,
    iter_records,
    list_source,
    read_text_file,
)

DEFAULT_MAX_CHARS = 8192
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
MAX_BAD_FILES = 100

TEXT_SUFFIXES = frozenset(
    [
        ".txt",
        ".md",
        ".rst",
        ".py",
        ".pyi",
        ".c",
        ".h",
        ".cc",
        ".cpp",
        ".hpp",
        ".rs",
        ".go",
        ".java",
        ".js",
        ".ts",
        ".json",
        ".toml",
        ".cfg",
        ".ini",
        ".html",
        ".htm",
        ".css",
        ".xml",
        ".yaml",
        ".yml",
        ".sh",
        ".tex",
        ".csv",
    ]
)
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
STDLIB_SUFFIXES = frozenset({".py", ".txt", ".rst"})
# Directories of the standard library that are not its sources: third-party
# packages, bytecode, compiled extensions, and test suites full of fixtures in
# deliberately odd encodings.
STDLIB_EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "test", "tests", "idle_test"}
)


@dataclass(frozen=True)
class Document:
    """One routing unit: ``id`` is unique and stable, ``source`` names the file
    or record it came from (chunks of one file share it)."""

    id: str
    text: str
    source: str


@dataclass
class CorpusStats:
    """What a corpus read saw. ``skipped`` counts bad inputs by reason."""

    files: int = 0  # blobs looked at (files, or JSONL records)
    documents: int = 0  # documents yielded, after chunking
    chars: int = 0
    ignored: int = 0  # files without a text suffix in a directory walk
    skipped: Counter[str] = field(default_factory=Counter)
    skipped_examples: list[str] = field(default_factory=list)
    # Files that could not be read ("name: why"), skipped whole; at most MAX_BAD_FILES kept.
    bad_files: list[str] = field(default_factory=list)
    # Columns found in files without the text column, for the error when none has it.
    columns_found: set[str] = field(default_factory=set)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def skip(self, name: str, reason: str) -> None:
        self.skipped[reason] += 1
        if len(self.skipped_examples) < 20:
            self.skipped_examples.append(f"{name}: {reason}")

    def bad_file(self, name: str, reason: str, exc: Exception | None = None) -> None:
        """A file skipped whole: counted under "unreadable_file", named in bad_files."""
        self.skipped["unreadable_file"] += 1
        if len(self.bad_files) < MAX_BAD_FILES:
            self.bad_files.append(f"{name}: {reason}")
        if isinstance(exc, MissingColumn):
            self.columns_found.update(exc.columns)

    def check_columns(self, corpus: str, text_field: str) -> None:
        """Raise when no document was read and files lacked the text column: name it and
        the columns found."""
        if self.documents == 0 and self.columns_found:
            raise ValueError(
                f"no file of {corpus!r} has the column {text_field!r}; columns found: "
                f"{', '.join(sorted(self.columns_found))}; set the dataset's text_field"
            )

    def to_json(self) -> dict[str, object]:
        return {
            "files": self.files,
            "documents": self.documents,
            "chars": self.chars,
            "ignored": self.ignored,
            "skipped": dict(self.skipped),
            "skipped_examples": list(self.skipped_examples),
            "bad_files": list(self.bad_files),
        }

    def merge(self, other: CorpusStats) -> None:
        self.files += other.files
        self.documents += other.documents
        self.chars += other.chars
        self.ignored += other.ignored
        self.skipped.update(other.skipped)
        self.skipped_examples.extend(other.skipped_examples[: 20 - len(self.skipped_examples)])
        self.bad_files.extend(other.bad_files[: MAX_BAD_FILES - len(self.bad_files)])
        self.columns_found |= other.columns_found


@dataclass
class CorpusSplit:
    train: list[Document]
    val: list[Document]
    stats: CorpusStats


def is_validation(key: str, val_fraction: float) -> bool:
    """Deterministic split: the first 8 bytes of sha256(key) as a fraction of 2**64."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut ``text`` into pieces of at most ``max_chars``, preferring blank lines."""
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    chunks: list[str] = []
    start = 0
    while len(text) - start > max_chars:
        end = start + max_chars
        half = start + max_chars // 2
        cut = text.rfind("\n\n", half, end)
        cut = cut + 2 if cut >= 0 else text.rfind("\n", half, end) + 1
        if cut <= start:  # one enormous line: cut it hard
            cut = end
        chunks.append(text[start:cut])
        start = cut
    chunks.append(text[start:])
    return [c for c in chunks if c.strip()]


def _documents_from_text(
    text: str, source: str, stats: CorpusStats, max_chars: int
) -> Iterator[Document]:
    if not text.strip():
        stats.skip(source, "empty")
        return
    chunks = chunk_text(text, max_chars)
    for i, chunk in enumerate(chunks):
        doc_id = source if len(chunks) == 1 else f"{source}#{i}"
        stats.documents += 1
        stats.chars += len(chunk)
        yield Document(id=doc_id, text=chunk, source=source)


def _decode(name: str, data: bytes, stats: CorpusStats, max_bytes: int) -> str | None:
    if len(data) > max_bytes:
        stats.skip(name, "too_large")
        return None
    if b"\x00" in data:
        stats.skip(name, "binary")
        return None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        stats.skip(name, "undecodable")
        return None


def iter_blob_documents(
    blobs: Iterable[tuple[str, bytes]],
    stats: CorpusStats,
    *,
    text_field: str = "text",
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[Document]:
    """Decode ``(name, bytes)`` blobs into documents; names ending in .jsonl are
    JSON Lines. The caller fixes the order (sort the names for determinism)."""
    for name, data in blobs:
        if Path(name).suffix.lower() in JSONL_SUFFIXES:
            yield from _jsonl_documents(name, data, stats, text_field, max_chars, max_bytes)
            continue
        stats.files += 1
        text = _decode(name, data, stats, max_bytes)
        if text is not None:
            yield from _documents_from_text(text, name, stats, max_chars)


def _jsonl_documents(
    name: str,
    data: bytes,
    stats: CorpusStats,
    text_field: str,
    max_chars: int,
    max_bytes: int,
) -> Iterator[Document]:
    # The size limit applies per record here: a JSONL corpus is one big file.
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        source = f"{name}:{lineno}"
        stats.files += 1
        line = _decode(source, raw, stats, max_bytes)
        if line is None:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            stats.skip(source, "bad_json")
            continue
        text = record.get(text_field) if isinstance(record, dict) else None
        if not isinstance(text, str):
            stats.skip(source, f"no_{text_field}_field")
            continue
        yield from _documents_from_text(text, source, stats, max_chars)


def _walk(root: Path, excluded_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Files under ``root`` in a deterministic order (sorted relative posix paths),
    without descending into ``excluded_dirs`` or following symlinks."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
        base = Path(dirpath)
        files.extend(base / f for f in filenames if not (base / f).is_symlink())
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_files(
    root: Path, files: Iterable[Path], stats: CorpusStats, max_bytes: int
) -> Iterator[tuple[str, bytes]]:
    for path in files:
        name = path.relative_to(root).as_posix()
        # Refuse before reading so a stray multi-gigabyte file costs nothing;
        # JSONL files are exempt (their limit is per record).
        if path.stat().st_size > max_bytes and path.suffix.lower() not in JSONL_SUFFIXES:
            stats.files += 1
            stats.skip(name, "too_large")
            continue
        try:
            data = path.read_bytes()
        except OSError as exc:
            stats.files += 1
            stats.skip(name, f"unreadable ({exc.__class__.__name__})")
            continue
        yield name, data


def iter_text_files(
    root: Path,
    files: Iterable[Path],
    stats: CorpusStats,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> Iterator[tuple[str, str]]:
    """``(name relative to root, text)`` of each file in `files`, in their order, under the
    rules that iter_corpus reads a directory by (size, binary, UTF-8); whole, not chunked."""
    for name, data in _read_files(root, files, stats, max_bytes):
        stats.files += 1
        text = _decode(name, data, stats, max_bytes)
        if text is not None:
            yield name, text


def walk_files(
    root: Path, suffixes: frozenset[str], excluded_dirs: frozenset[str] = frozenset()
) -> list[Path]:
    """The files under `root` with one of `suffixes`, in iter_corpus's deterministic order."""
    return [p for p in _walk(root, excluded_dirs) if p.suffix.lower() in suffixes]


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_listing(
    corpus: str, *, s3: S3Options | None = None, max_files: int | None = None
) -> Listing:
    """The files of ``corpus`` ("stdlib", a local file, directory or glob, or an s3://
    prefix; dipaco.data.sources) in the order every pass reads them."""
    if corpus == "stdlib":
        listing = list_source(
            str(stdlib_root()), text_suffixes=STDLIB_SUFFIXES, excluded_dirs=STDLIB_EXCLUDED_DIRS
        )
        listing.files = [f for f in listing.files if f.kind == "text" and f.compression is None]
    else:
        listing = list_source(corpus, s3=s3, text_suffixes=TEXT_SUFFIXES)
    if max_files is not None:
        listing.files = listing.files[:max_files]
    return listing


def iter_file_documents(
    listing: Listing,
    file: SourceFile,
    stats: CorpusStats,
    *,
    text_field: str = "text",
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    span: Span | None = None,
) -> Iterator[Document]:
    """The documents of one file of a listing (of one piece of it, ``span``). Raises
    UnreadableFile (dipaco.data.sources) when the file cannot be read: the caller skips
    it and reports it by name."""
    if file.kind == "text":
        stats.files += 1
        if file.size > max_bytes and file.compression is None:  # refuse before reading
            stats.skip(file.rel, "too_large")
            return
        text = _decode(file.rel, read_text_file(listing, file), stats, max_bytes)
        if text is not None:
            yield from _documents_from_text(text, file.rel, stats, max_chars)
        return
    for row, value in iter_records(listing, file, text_field, span):
        source = f"{file.name}:{row}"
        stats.files += 1
        if isinstance(value, BadRecord):
            stats.skip(source, value.reason)
        elif len(value) > max_bytes:
            stats.skip(source, "too_large")
        else:
            yield from _documents_from_text(value, source, stats, max_chars)


def iter_corpus(
    corpus: str,
    stats: CorpusStats,
    *,
    text_field: str = "text",
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_files: int | None = None,
    s3: S3Options | None = None,
) -> Iterator[Document]:
    """Stream the documents of ``corpus`` (corpus_listing). A file that cannot be read is
    reported in ``stats.bad_files`` by name and the rest goes on (the documents it gave
    before failing stay: the streaming preparation, dipaco.data.stream, drops them too).

    ``max_files`` keeps only the first N files in sorted order (tests, smoke runs).
    """
    listing = corpus_listing(corpus, s3=s3, max_files=max_files)
    stats.ignored += listing.ignored
    for file in listing.files:
        try:
            yield from iter_file_documents(
                listing, file, stats, text_field=text_field, max_chars=max_chars,
                max_bytes=max_bytes,
            )  # fmt: skip
        except UnreadableFile as exc:
            stats.bad_file(file.rel, str(exc), exc)
    stats.check_columns(corpus, text_field)


def split_documents(
    docs: Iterable[Document], val_fraction: float
) -> tuple[list[Document], list[Document]]:
    """Deterministic train/validation split by a hash of each document's source."""
    train: list[Document] = []
    val: list[Document] = []
    for doc in docs:
        (val if is_validation(doc.source, val_fraction) else train).append(doc)
    return train, val


def load_corpus(
    corpus: str,
    *,
    text_field: str = "text",
    val_fraction: float = 0.05,
    max_chars: int = DEFAULT_MAX_CHARS,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_files: int | None = None,
) -> CorpusSplit:
    """Read a whole corpus into memory, split into train and validation."""
    stats = CorpusStats()
    docs = iter_corpus(
        corpus,
        stats,
        text_field=text_field,
        max_chars=max_chars,
        max_bytes=max_bytes,
        max_files=max_files,
    )
    train, val = split_documents(docs, val_fraction)
    if not train:
        raise ValueError(
            f"corpus {corpus!r} yielded no training documents "
            f"({stats.files} files, skipped {dict(stats.skipped)}); point data.corpus at text"
        )
    return CorpusSplit(train=train, val=val, stats=stats)
