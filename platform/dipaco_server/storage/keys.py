"""Blob keys: the one gate every key passes before it reaches a store.

Keys come from the server's own layout (docs/design.md §5) but also travel through
URLs that untrusted workers hold, so every backend calls `validate_key` on
every operation. A valid key is a relative POSIX path made of segments that
each start with a letter or digit and then use only ``A-Z a-z 0-9 . _ -``.
That is stricter than "no ``..``": it also refuses ``.``, hidden names (the
local store keeps its temporary files under ``<root>/.tmp``), empty segments,
leading or trailing slashes, backslashes and percent-escapes.
"""

from __future__ import annotations

import re

# S3 caps keys at 1024 bytes; common filesystems cap one name at 255 bytes.
MAX_KEY_LENGTH = 1024
MAX_SEGMENT_LENGTH = 255

_SEGMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PREFIX_CHARS = re.compile(r"[A-Za-z0-9._/-]*")


class BlobStoreError(Exception):
    """Base class for every error a blob store raises on purpose."""


class InvalidBlobKey(BlobStoreError, ValueError):
    """A key (or prefix) that could name something outside the store."""


class BlobNotFound(BlobStoreError, LookupError):
    """The key names no blob."""


def validate_key(key: object) -> str:
    """Return `key` unchanged if it is a safe blob key, else raise InvalidBlobKey.

    >>> validate_key("runs/7/modules/0.1/v3.safetensors")
    'runs/7/modules/0.1/v3.safetensors'
    """
    if not isinstance(key, str):
        raise InvalidBlobKey(f"blob key must be a str, got {type(key).__name__}")
    if not key:
        raise InvalidBlobKey("blob key is empty; pass a path such as 'runs/1/data/0/train.bin'")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidBlobKey(f"blob key is {len(key)} characters; the limit is {MAX_KEY_LENGTH}")
    if key.startswith("/"):
        raise InvalidBlobKey(f"blob key {key!r} starts with '/'; keys are relative to the store")
    for segment in key.split("/"):
        _check_segment(key, segment)
    return key


def validate_prefix(prefix: object) -> str:
    """Return `prefix` if it is a valid listing prefix: empty, or the start of a valid key.

    Like S3, a prefix is a plain string prefix (``runs/1/mod`` matches
    ``runs/1/modules/...``), so only its complete segments are checked as
    segments; the last one may be partial or empty (a trailing ``/``).
    """
    if not isinstance(prefix, str):
        raise InvalidBlobKey(f"blob prefix must be a str, got {type(prefix).__name__}")
    if len(prefix) > MAX_KEY_LENGTH or not _PREFIX_CHARS.fullmatch(prefix):
        raise InvalidBlobKey(
            f"blob prefix {prefix!r} is too long or uses characters outside A-Z a-z 0-9 . _ - /"
        )
    if prefix.startswith("/"):
        raise InvalidBlobKey(f"blob prefix {prefix!r} starts with '/'; prefixes are relative")
    *complete, last = prefix.split("/")
    for segment in complete:
        _check_segment(prefix, segment)
    if last and not last[0].isalnum():
        raise InvalidBlobKey(f"blob prefix {prefix!r}: a segment must start with a letter or digit")
    return prefix


def _check_segment(key: str, segment: str) -> None:
    if not segment:
        raise InvalidBlobKey(f"blob key {key!r} has an empty segment ('//' or a trailing '/')")
    if segment in (".", ".."):
        raise InvalidBlobKey(f"blob key {key!r} contains {segment!r}; path traversal is refused")
    if len(segment) > MAX_SEGMENT_LENGTH:
        raise InvalidBlobKey(
            f"blob key {key!r} has a segment of {len(segment)} characters; "
            f"the limit is {MAX_SEGMENT_LENGTH}"
        )
    if not _SEGMENT.fullmatch(segment):
        raise InvalidBlobKey(
            f"blob key {key!r}: segment {segment!r} must start with a letter or digit "
            "and use only A-Z a-z 0-9 . _ -"
        )
