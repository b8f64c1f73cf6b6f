"""Where a corpus's files live and how each is read: local or S3, text, JSON Lines
(plain, ``.gz``, ``.zst``), Parquet, and a Hugging Face ``datasets`` directory saved to
disk (Arrow IPC streams listed in ``state.json``).

`pyarrow` reads the columnar formats and S3: its ``S3FileSystem`` lists and opens files on
any S3-compatible store (and decompresses ``.gz``/``.zst`` as it reads), its Parquet reader
yields record batches, and its IPC reader reads a saved ``datasets`` directory without the
``datasets`` package. Local text and JSON Lines need no pyarrow (it is a server-side
extra): `LocalFiles` opens them with gzip and zstandard. Nothing reads a whole file into memory except a plain text file, which is one
document (at most ``max_bytes``).

A record's name (`Document.source`, which the train/validation split and the samples hash)
is its file's path relative to the source's root without its compression and format
suffixes, then ``:<row>`` (0-based; a JSON Lines row is a non-blank line). So
``part-0.parquet``, ``part-0.jsonl.zst`` and a ``datasets`` directory's ``part-0.arrow``
holding the same records in the same order name, split and sample them the same way.
A plain text file keeps its whole relative path as its name (it is one record).

A file larger than a piece (`piece_spans`) is read in several pieces, so one huge file
still prepares in parallel: a Parquet file by ranges of its row groups, an uncompressed
JSON Lines file by byte ranges cut at line starts (each piece seeks to its first line).
A piece's records keep their file's row numbers, so they are named, split and sampled as
if the file were read whole. A compressed stream (``.gz``, ``.zst``) cannot be entered
midway, and a saved ``datasets`` file is a stream too: those stay one piece per file
(such corpora come as many files).

A source is ``stdlib``, a local path (a file, a directory, or a glob such as
``/srv/fineweb/*.parquet``) or ``s3://bucket/prefix`` (also with a glob). Credentials for
S3 come from the caller (`S3Options`; the server passes its settings), never from the
source string.
"""

from __future__ import annotations

import fnmatch
import gzip
import json
import os
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import zstandard

COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
RECORD_FORMATS = {".parquet": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl", ".arrow": "arrow"}
GLOB_CHARS = frozenset("*?[")
BATCH_ROWS = 1024  # rows per Parquet/Arrow record batch read: bounded memory, few calls


@dataclass(frozen=True)
class S3Options:
    """How to reach an S3-compatible store; None fields fall back to the AWS chain."""

    endpoint_url: str | None = None
    access_key: str | None = None
    secret_key: str | None = None
    region: str | None = None


@dataclass(frozen=True)
class SourceFile:
    """One file of a corpus. ``name`` prefixes its records' names (module docstring)."""

    path: str  # in the file system, e.g. "/srv/c/a.jsonl.zst" or "bucket/c/a.parquet"
    rel: str  # relative to the root, e.g. "a.jsonl.zst"
    name: str  # rel without compression and record-format suffixes, e.g. "a"
    kind: str  # "text", "jsonl", "parquet" or "arrow"
    compression: str | None
    size: int


@dataclass(frozen=True)
class Span:
    """One piece of a corpus: records ``start`` to ``stop`` (exclusive; None: to the end) of
    file ``file`` (its index in the listing), read from byte ``offset`` to ``end`` (an
    uncompressed JSON Lines file) or from the row groups ``groups`` (Parquet); a whole
    file when neither is set."""

    file: int
    start: int = 0
    stop: int | None = None
    offset: int | None = None
    end: int | None = None
    groups: tuple[int, ...] | None = None

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Span:
        groups = raw.get("groups")
        return cls(**{**raw, "groups": None if groups is None else tuple(groups)})


@dataclass
class Listing:
    """A source's files, in the order every pass reads them, and how to open them."""

    fs: Any  # pyarrow.fs.FileSystem
    root: str
    files: list[SourceFile]
    ignored: int = 0  # files of no known kind in a directory walk


class UnreadableFile(Exception):
    """A file that cannot be read as its kind: skipped whole and reported by name."""


def is_s3(source: str) -> bool:
    return source.startswith("s3://")


def s3_bucket(source: str) -> str:
    """The bucket of ``s3://bucket/prefix``."""
    return source[len("s3://") :].split("/", 1)[0]


def classify(rel: str, text_suffixes: frozenset[str]) -> tuple[str, str, str | None] | None:
    """(kind, record name, compression) of a file by its name, or None to ignore it."""
    stem, suffix = posixpath.splitext(rel)
    compression = COMPRESSIONS.get(suffix.lower())
    if compression is not None:
        rel_plain = stem
        stem, suffix = posixpath.splitext(stem)
    else:
        rel_plain = rel
    kind = RECORD_FORMATS.get(suffix.lower())
    if kind is not None:
        return kind, stem, compression
    if suffix.lower() in text_suffixes:
        return "text", rel_plain, compression
    return None


class LocalFiles:
    """The two calls the readers make of a pyarrow file system, for local files without
    pyarrow (a server-side extra): `dipaco simulate` on text or JSON Lines needs none."""

    def open_input_stream(self, path: str, compression: str | None = None) -> IO[bytes]:
        if compression == "gzip":
            return gzip.open(path, "rb")  # type: ignore[return-value]
        if compression == "zstd":
            return ZstdReader(open(path, "rb"))  # type: ignore[return-value]
        return open(path, "rb")

    def open_input_file(self, path: str) -> IO[bytes]:
        return open(path, "rb")


class ZstdReader:
    """A .zst file's frames, decompressed as read; a file that ends inside a frame raises
    (zstandard's stream_reader would return the partial text as if it were whole)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._frame = zstandard.ZstdDecompressor().decompressobj()
        self._started = False

    def read(self, size: int = -1) -> bytes:
        while True:
            block = self._raw.read(1 << 20)
            if not block:
                if self._started and not self._frame.eof:
                    raise EOFError("the file ends inside a zstd frame (truncated)")
                return b""
            out = bytearray()
            while block:
                if self._frame.eof:  # the next frame of a multi-frame file
                    self._frame = zstandard.ZstdDecompressor().decompressobj()
                self._started = True
                out += self._frame.decompress(block)
                block = self._frame.unused_data if self._frame.eof else b""
            if out:
                return bytes(out)

    def __enter__(self) -> ZstdReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._raw.close()


def filesystem(source: str, s3: S3Options | None) -> tuple[Any, str]:
    """(file system, path in it) of a source: LocalFiles, or pyarrow's S3FileSystem."""
    if not is_s3(source):
        return LocalFiles(), str(Path(source).expanduser())
    # pyarrow (a server-side extra, a second to import): only an S3 source needs it here.
    from pyarrow import fs  # see the comment above

    options = s3 or S3Options()
    kwargs: dict[str, Any] = {}
    if options.endpoint_url:
        scheme, _, host = options.endpoint_url.partition("://")
        kwargs.update(endpoint_override=host or scheme, scheme=scheme if host else "https")
    if options.access_key and options.secret_key:
        kwargs.update(access_key=options.access_key, secret_key=options.secret_key)
    return fs.S3FileSystem(region=options.region or "us-east-1", **kwargs), source[5:]


def _split_glob(path: str) -> tuple[str, str | None]:
    """(root directory, pattern relative to it) of a path that may hold a glob."""
    parts = path.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS & set(part):
            return "/".join(parts[:i]), "/".join(parts[i:])
    return path.rstrip("/"), None


def _walk(fs: Any, root: str, excluded_dirs: frozenset[str]) -> list[tuple[str, int]]:
    """(path relative to root, size) of every file under root, sorted by relative path."""
    if isinstance(fs, LocalFiles):  # os.walk: prunes excluded dirs, skips symlinks
        found: list[tuple[str, str]] = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in excluded_dirs]
            for f in filenames:
                full = os.path.join(dirpath, f)
                if not os.path.islink(full):
                    found.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
        return sorted((rel, os.path.getsize(full)) for rel, full in found)
    from pyarrow import fs as pafs  # as in filesystem

    infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    prefix = root.rstrip("/") + "/"
    return sorted(
        (info.path[len(prefix) :], int(info.size or 0))
        for info in infos
        if info.type == pafs.FileType.File and info.path.startswith(prefix)
    )


def _saved_dataset_files(fs: Any, root: str) -> list[str] | None:
    """The Arrow files of a `datasets` directory (``save_to_disk``), in their order:
    ``state.json``'s ``_data_files``, or each split's for a ``dataset_dict.json``."""
    for name, splits in (("state.json", False), ("dataset_dict.json", True)):
        try:
            with fs.open_input_stream(f"{root}/{name}", compression=None) as f:
                meta = json.loads(f.read())
        except (FileNotFoundError, OSError, ValueError):
            continue
        if not splits:
            return [entry["filename"] for entry in meta.get("_data_files", [])]
        files: list[str] = []
        for split in meta.get("splits", []):
            inner = _saved_dataset_files(fs, f"{root}/{split}") or []
            files.extend(f"{split}/{f}" for f in inner)
        return files
    return None


def _stat(fs: Any, path: str) -> tuple[str | None, int]:
    """("file" or "dir" or None, size) of a path."""
    if not path:
        return None, 0
    if isinstance(fs, LocalFiles):
        if os.path.isfile(path):
            return "file", os.path.getsize(path)
        return ("dir" if os.path.isdir(path) else None), 0
    from pyarrow import fs as pafs  # as in filesystem

    info = fs.get_file_info(path)
    if info.type == pafs.FileType.File:
        return "file", int(info.size or 0)
    return ("dir" if info.type == pafs.FileType.Directory else None), 0


def list_source(
    source: str,
    *,
    s3: S3Options | None = None,
    text_suffixes: frozenset[str],
    excluded_dirs: frozenset[str] = frozenset(),
) -> Listing:
    """The files of ``source`` (a local or s3:// file, directory or glob), sorted by their
    path relative to the root. Raises FileNotFoundError when there is nothing there."""
    fs, path = filesystem(source, s3)
    root, pattern = _split_glob(path)
    kind, size = _stat(fs, root)
    if kind == "file" and pattern is None:
        root, entries = posixpath.dirname(root), [(posixpath.basename(root), size)]
    elif kind == "dir":
        saved = _saved_dataset_files(fs, root) if pattern is None else None
        if saved is not None:
            sizes = dict(_walk(fs, root, excluded_dirs))
            entries = [(rel, sizes.get(rel, 0)) for rel in saved]
        else:
            entries = _walk(fs, root, excluded_dirs)
            if pattern is not None:
                entries = [(rel, size) for rel, size in entries if fnmatch.fnmatch(rel, pattern)]
    else:
        raise FileNotFoundError(
            f"corpus {source!r} is neither 'stdlib' nor an existing file, directory, glob or "
            "s3:// prefix; point data.corpus (or the dataset's source) at one of those"
        )
    files: list[SourceFile] = []
    ignored = 0
    for rel, size in entries:
        found = classify(rel, text_suffixes)
        if found is None:
            ignored += 1
            continue
        full = f"{root}/{rel}" if root else rel
        files.append(SourceFile(full, rel, found[1], found[0], found[2], size))
    return Listing(fs=fs, root=root, files=files, ignored=ignored)


def read_text_file(listing: Listing, file: SourceFile) -> bytes:
    """A plain text file's bytes (decompressed)."""
    try:
        with listing.fs.open_input_stream(file.path, compression=file.compression) as f:
            return bytes(f.read())
    except (OSError, ValueError, EOFError, zstandard.ZstdError) as exc:  # as in iter_records
        raise UnreadableFile(f"{exc.__class__.__name__}: {str(exc)[:200]}") from exc


def iter_records(
    listing: Listing, file: SourceFile, text_field: str, span: Span | None = None
) -> Iterator[tuple[int, Any]]:
    """(row, value) of every record of a JSONL, Parquet or Arrow file (of ``span`` only,
    when given): the text field's value, or a BadRecord. Raises UnreadableFile when the
    file cannot be read, MissingColumn when it has no such column."""
    try:
        if file.kind == "jsonl":
            yield from _jsonl_records(listing, file, text_field, span)
        else:
            yield from _columnar_records(listing, file, text_field, span)
    except (OSError, ValueError, EOFError, zstandard.ZstdError) as exc:
        # pyarrow's ArrowInvalid is a ValueError; a truncated .gz an EOFError.
        raise UnreadableFile(f"{exc.__class__.__name__}: {str(exc)[:200]}") from exc


class MissingColumn(UnreadableFile):
    def __init__(self, column: str, columns: list[str]) -> None:
        super().__init__(f"no column {column!r} (columns: {', '.join(columns) or 'none'})")
        self.columns = columns


class BadRecord:
    """A JSONL line that is not a JSON object with the text field: why, for the stats."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _jsonl_records(
    listing: Listing, file: SourceFile, text_field: str, span: Span | None
) -> Iterator[tuple[int, Any]]:
    ranged = span is not None and span.offset is not None
    if ranged:
        assert span is not None and span.offset is not None  # for mypy
        stream = listing.fs.open_input_file(file.path)
        stream.seek(span.offset)
        left = None if span.end is None else span.end - span.offset
    else:
        stream = listing.fs.open_input_stream(file.path, compression=file.compression)
        left = None
    with stream:
        row = span.start if ranged and span is not None else 0
        pending = b""
        while True:
            block = stream.read(1 << 20 if left is None else min(1 << 20, left))
            if left is not None:
                left -= len(block)
            lines = (pending + block).split(b"\n")
            pending = lines.pop() if block else b""
            for raw in lines:
                if not raw.strip():
                    continue
                yield row, _json_value(raw, text_field)
                row += 1
            if not block:
                return


def _json_value(raw: bytes, text_field: str) -> Any:
    if b"\x00" in raw:
        return BadRecord("binary")
    try:
        record = json.loads(raw)
    except UnicodeDecodeError:
        return BadRecord("undecodable")
    except ValueError:
        return BadRecord("bad_json")
    value = record.get(text_field) if isinstance(record, dict) else None
    return value if isinstance(value, str) else BadRecord(f"no_{text_field}_field")


def _columnar_records(
    listing: Listing, file: SourceFile, text_field: str, span: Span | None
) -> Iterator[tuple[int, Any]]:
    # pyarrow, as in filesystem.
    import pyarrow.ipc as ipc  # a server-side extra (module docstring)
    import pyarrow.parquet as pq  # as above

    if file.kind == "parquet":
        handle = listing.fs.open_input_file(file.path)
        reader = pq.ParquetFile(handle)
        names = reader.schema_arrow.names
        if text_field not in names:
            raise MissingColumn(text_field, names)
        groups = None if span is None or span.groups is None else list(span.groups)
        batches = reader.iter_batches(
            batch_size=BATCH_ROWS, columns=[text_field], row_groups=groups
        )
    else:
        handle = listing.fs.open_input_stream(file.path, compression=file.compression)
        stream = ipc.open_stream(handle)
        names = stream.schema.names
        if text_field not in names:
            raise MissingColumn(text_field, names)
        batches = stream
    row = 0 if span is None or span.groups is None else span.start
    with handle:
        for batch in batches:
            column = batch.column(batch.schema.get_field_index(text_field))
            for value in column.to_pylist():
                yield row, value if isinstance(value, str) else BadRecord("not_text")
                row += 1


def piece_spans(listing: Listing, index: int, piece_bytes: int) -> list[Span]:
    """The pieces of file ``index`` (module docstring): about ``piece_bytes`` each for a
    larger Parquet or uncompressed JSON Lines file, else the whole file. Reads a Parquet
    file's footer, or every byte of a JSON Lines file (no JSON parsing) to find its line
    starts and count its records."""
    file = listing.files[index]
    if file.size <= piece_bytes:
        return [Span(index)]
    try:
        if file.kind == "parquet":
            return _row_group_spans(listing, index, piece_bytes)
        if file.kind == "jsonl" and file.compression is None:
            return _line_spans(listing, index, piece_bytes)
    except (OSError, ValueError) as exc:  # as in iter_records
        raise UnreadableFile(f"{exc.__class__.__name__}: {str(exc)[:200]}") from exc
    return [Span(index)]


def _row_group_spans(listing: Listing, index: int, piece_bytes: int) -> list[Span]:
    import pyarrow.parquet as pq  # as in _columnar_records

    with listing.fs.open_input_file(listing.files[index].path) as handle:
        meta = pq.ParquetFile(handle).metadata
    spans, groups, start, row, size = [], [], 0, 0, 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        groups.append(g)
        row += group.num_rows
        size += group.total_byte_size
        if size >= piece_bytes or g == meta.num_row_groups - 1:
            spans.append(Span(index, start, row, groups=tuple(groups)))
            groups, start, size = [], row, 0
    return spans or [Span(index)]


def _line_spans(listing: Listing, index: int, piece_bytes: int) -> list[Span]:
    """Byte ranges of about ``piece_bytes``, each starting at a line start, with the row
    (non-blank line) each starts at, as _jsonl_records counts rows."""
    spans: list[Span] = []
    start_row, start_offset, row, offset = 0, 0, 0, 0
    with listing.fs.open_input_stream(listing.files[index].path, compression=None) as stream:
        pending = b""
        while True:
            block = stream.read(1 << 20)
            if not block and not pending:
                break
            lines = (pending + block).split(b"\n")
            pending = lines.pop() if block else b""
            for raw in lines:
                if offset - start_offset >= piece_bytes:  # a piece ends before this line
                    spans.append(Span(index, start_row, row, start_offset, offset))
                    start_row, start_offset = row, offset
                if raw.strip():
                    row += 1
                offset += len(raw) + 1
            if not block:
                break
    spans.append(Span(index, start_row, row, start_offset, None))
    return spans
