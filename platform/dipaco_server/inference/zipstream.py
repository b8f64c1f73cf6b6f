"""A zip archive produced as a stream of byte chunks, never whole in memory.

`zipfile` writes to any object with `write`; on one that cannot `tell`/`seek` it
puts each entry's CRC and sizes in a data descriptor after the data instead of
going back to patch the header. So the archive goes out while the files are
read, chunk by chunk, and memory stays at one chunk. Entries are stored, not
deflated (model weights do not compress), and carry a fixed timestamp, so the
same files always give the same archive bytes.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # the earliest date zip can store; no clock in the bytes
FILE_MODE = 0o644 << 16  # unix permissions rw-r--r-- in external_attr


@dataclass(frozen=True)
class ZipEntry:
    name: str  # path inside the archive
    size: int  # known in advance: zipfile picks zip64 from it (files over 4 GiB)
    chunks: Callable[[], Iterator[bytes]]  # called when the entry's turn comes


class _Sink(io.RawIOBase):
    """A write-only, unseekable file: what zipfile writes waits here until drained."""

    def __init__(self) -> None:
        super().__init__()
        self._parts: list[bytes] = []

    def writable(self) -> bool:
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._parts.append(bytes(data))
        return len(data)

    def drain(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


def stream_zip(entries: Iterable[ZipEntry]) -> Iterator[bytes]:
    """The archive of `entries`, in order, as chunks; refuses an entry whose size was wrong."""
    sink = _Sink()
    with zipfile.ZipFile(sink, mode="w", compression=zipfile.ZIP_STORED) as archive:
        for entry in entries:
            info = zipfile.ZipInfo(entry.name, date_time=FIXED_TIME)
            info.external_attr = FILE_MODE
            info.compress_type = zipfile.ZIP_STORED
            info.file_size = entry.size
            written = 0
            with archive.open(info, mode="w") as out:
                for chunk in entry.chunks():
                    out.write(chunk)
                    written += len(chunk)
                    if data := sink.drain():
                        yield data
            if written != entry.size:
                raise ValueError(f"{entry.name}: expected {entry.size} bytes, read {written}")
            yield sink.drain()
    yield sink.drain()  # the central directory, written on close
