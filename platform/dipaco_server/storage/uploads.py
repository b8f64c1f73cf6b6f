"""Size-limited streaming of untrusted upload bodies into a blob writer.

Content-Length only decides early refusals; the limit that counts is the
number of bytes actually read, checked chunk by chunk, so a body never lands
on disk beyond ``max_bytes`` plus one chunk, whatever its headers claim.
"""

from __future__ import annotations

from typing import Any, BinaryIO, Protocol

from django.core.files.uploadhandler import FileUploadHandler
from django.http import HttpRequest

CHUNK_SIZE = 64 * 1024


class BlobTooLarge(Exception):
    """The body exceeds the URL's max_bytes (HTTP 413)."""


class BodyRefused(Exception):
    """An upload the view refuses for another client fault, with its status and code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class Readable(Protocol):
    def read(self, size: int = -1, /) -> bytes: ...


def copy_limited(src: Readable, out: BinaryIO, max_bytes: int, expected: int | None) -> int:
    """Copy `src` to `out`, refusing more than `max_bytes`; return the bytes copied.

    With `expected` set (the declared Content-Length), a body that ends early
    is refused too: a client that hung up must not leave a truncated blob.
    """
    total = 0
    while chunk := src.read(CHUNK_SIZE):
        total += len(chunk)
        if total > max_bytes:
            raise BlobTooLarge(f"the body exceeds this URL's limit of {max_bytes} bytes")
        out.write(chunk)
    if expected is not None and total != expected:
        raise BodyRefused(
            400, "incomplete_body", f"the body ended after {total} of {expected} bytes"
        )
    return total


class _FormFileHandler(FileUploadHandler):
    """Streams the form's one ``file`` field into `out`, counting as it goes."""

    def __init__(self, request: HttpRequest, out: BinaryIO, max_bytes: int) -> None:
        super().__init__(request)
        self.out = out
        self.max_bytes = max_bytes
        self.started = False
        self.received = False
        self.size = 0

    def new_file(self, field_name: str, *args: Any, **kwargs: Any) -> None:
        super().new_file(field_name, *args, **kwargs)
        if field_name != "file" or self.started:
            raise BodyRefused(
                400, "bad_form", "the form must carry exactly one file field, named 'file'"
            )
        self.started = True

    def receive_data_chunk(self, raw_data: bytes, start: int) -> None:
        self.size += len(raw_data)
        if self.size > self.max_bytes:
            raise BlobTooLarge(f"the file exceeds this URL's limit of {self.max_bytes} bytes")
        self.out.write(raw_data)
        return None  # consumed: no later handler sees this chunk

    def file_complete(self, file_size: int) -> None:
        # Called only when the parser reaches the part after the file, so a
        # form cut short never counts as received.
        self.received = True
        return None  # the bytes are already in `out`; nothing goes in request.FILES


def form_upload_handler(request: HttpRequest, out: BinaryIO, max_bytes: int) -> _FormFileHandler:
    return _FormFileHandler(request, out, max_bytes)
