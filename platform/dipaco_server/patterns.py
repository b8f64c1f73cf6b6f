"""Text rules the API declares in its schema and enforces with the same regular expression.

A rule the server checks in Python (``str.strip``, ``unicodedata.category``) and a schema
pattern that only resembles it disagree at the edges: ``\\s`` is one set of characters in
Python's ``re``, another in the Rust regex pydantic enforces patterns with, and a third in
JSON Schema's ECMA-262 dialect (U+0085, NEXT LINE, is whitespace to Python and Rust, not
to ECMA-262). So the character sets here are spelled out, code point by code point, from
Python's own definitions, and a client (or schemathesis) that satisfies the schema
satisfies the server.

Where a service already enforces the rule with its own error (worker names:
``worker_invalid``; dataset sources: ``source_invalid``), the pattern is only declared
(`declared`), so the client keeps that error and its message instead of pydantic's "should
match pattern '<a thousand characters>'"; tests/test_openapi_patterns.py holds each
declared pattern to its service, code point by code point. The short ones (route text,
NO_NUL) pydantic enforces, as ``invalid_request``.

Only escapes all three dialects read alike are used: ``\\xHH`` and ``\\uHHHH``, and
``\\UHHHHHHHH`` (Python and Rust) for the few format characters beyond the BMP.
"""

from __future__ import annotations

import sys
import unicodedata

# Names end up in the dashboard and in logs: control and format characters, and line and
# paragraph separators, are refused (workers.services._clean_text applies the same set).
CONTROL_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def _escape(code: int) -> str:
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _char_class(codes: list[int]) -> str:
    """The inside of a [...] class matching exactly `codes`, as ranges where they run on."""
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        parts.append(_escape(codes[i]) if i == j else f"{_escape(codes[i])}-{_escape(codes[j])}")
        i = j + 1
    return "".join(parts)


_ALL = range(sys.maxunicode + 1)
WHITESPACE_CODES = [c for c in _ALL if chr(c).isspace()]  # what str.strip() removes
CONTROL_CODES = [c for c in _ALL if unicodedata.category(chr(c)) in CONTROL_CATEGORIES]

WHITESPACE = _char_class(WHITESPACE_CODES)
CONTROL = _char_class(CONTROL_CODES)
_EITHER = _char_class(sorted(set(WHITESPACE_CODES) | set(CONTROL_CODES)))

# Some character that str.strip() keeps: text that is not only whitespace (U+0085 included).
NOT_ONLY_WHITESPACE = f"[^{WHITESPACE}]"

# A name as workers.services._clean_text accepts it: once stripped, not empty and free of
# control characters (whitespace at either end, control or not, is stripped first).
_STRIPPED_NAME = f"[^{_EITHER}](?:[^{CONTROL}]*[^{_EITHER}])?"
NAME = f"^[{WHITESPACE}]*{_STRIPPED_NAME}[{WHITESPACE}]*$"
OPTIONAL_NAME = f"^[{WHITESPACE}]*(?:{_STRIPPED_NAME})?[{WHITESPACE}]*$"

# No NUL: PostgreSQL text cannot hold it, so a filter with one could never match anything.
NO_NUL = "^[^\\x00]*$"


def declared(pattern: str) -> dict[str, str]:
    """A Field's json_schema_extra that shows `pattern` without pydantic enforcing it: for
    rules a service enforces with its own, clearer, error."""
    return {"pattern": pattern}
