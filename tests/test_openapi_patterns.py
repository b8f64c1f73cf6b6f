"""The OpenAPI document declares what the server enforces, character for character.

schemathesis (tests/test_conformance.py) reads the schema with Python's `re`, pydantic
enforces it with its Rust regex, and the services check text with `str.strip` and
`unicodedata`: here each text rule is compared across all three for every code point
that could tell them apart, so a schema-valid request is never refused and a refused one
is never schema-valid. The request-line limit of gunicorn and the longest query the
schema admits are compared too.
"""

from __future__ import annotations

import re
import sys
import unicodedata
from functools import cache
from typing import Annotated, Any
from urllib.parse import quote, urlsplit

import pytest
from pydantic import Field as Range
from pydantic import TypeAdapter, ValidationError

from dipaco_server import patterns
from dipaco_server.bounds import MAX_ID
from dipaco_server.cli.server import child_commands
from dipaco_server.errors import ServiceError
from dipaco_server.http_limits import REQUEST_LINE_LIMIT
from dipaco_server.rounds.protocol.downloads import HELD_PATTERN
from dipaco_server.runs.sources import check_source
from dipaco_server.workers.services import _clean_text

CODES = [c for c in range(sys.maxunicode + 1) if not 0xD800 <= c <= 0xDFFF]  # JSON's strings
# Where the sets begin and end: the code points a misspelt range would get wrong.
EDGES = sorted(
    {n for c in patterns.WHITESPACE_CODES + patterns.CONTROL_CODES for n in (c - 1, c, c + 1)}
    & set(CODES)
)


@cache
def openapi() -> dict[str, Any]:
    from dipaco_server.api import api

    return dict(api.get_openapi_schema())


def component(name: str) -> dict[str, Any]:
    return dict(openapi()["components"]["schemas"][name])


def query_parameter(path: str, name: str) -> dict[str, Any]:
    """An optional string parameter's schema (its string branch)."""
    operation = openapi()["paths"][path]["get"]
    schema = next(p["schema"] for p in operation["parameters"] if p["name"] == name)
    if "anyOf" in schema:
        schema = next(s for s in schema["anyOf"] if s.get("type") == "string")
    return dict(schema)


def declared(schema: dict[str, Any], value: str) -> bool:
    """Whether a JSON Schema string schema admits `value`, as schemathesis reads it."""
    return (
        schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", sys.maxsize)
        and re.search(schema.get("pattern", ""), value) is not None
    )


def enforced(pattern: str, value: str) -> bool:
    """Whether pydantic's Rust regex, a second dialect, reads `pattern` alike for `value`."""
    adapter = TypeAdapter(Annotated[str, Range(pattern=pattern)])
    try:
        adapter.validate_python(value)
    except ValidationError:
        return False
    return True


def service_accepts_name(value: str, required: bool) -> bool:
    try:
        _clean_text(value, "name", 1000, required=required)
    except ServiceError:
        return False
    return True


@pytest.mark.parametrize("field", ["name", "owner"])
def test_a_worker_name_is_schema_valid_exactly_when_registration_accepts_it(field: str) -> None:
    schema = component("RegisterIn")["properties"][field]
    required = field == "name"
    inside = re.compile(schema["pattern"])
    refused = {chr(c) for c in patterns.CONTROL_CODES}  # the service's categories, checked below
    for code in CODES:  # within a name: everything but control and format characters
        assert (inside.search(f"a{chr(code)}b") is not None) == (chr(code) not in refused)
    for code in EDGES:
        for value in (f"a{chr(code)}b", f"{chr(code)}a", f"a{chr(code)}", chr(code)):
            assert declared(schema, value) == service_accepts_name(value, required), (
                hex(code),
                value,
            )
            assert enforced(schema["pattern"], value) == declared(schema, value), hex(code)
    assert declared(schema, "") is not required and declared(schema, "  ") is not required


def test_route_text_of_whitespace_alone_is_schema_invalid_as_the_router_refuses_it() -> None:
    schema = component("RouteIn")["properties"]["text"]
    pattern = re.compile(schema["pattern"])
    for code in CODES:
        assert (pattern.search(chr(code) * 2) is not None) == bool(chr(code).strip()), hex(code)
    for code in EDGES:
        assert enforced(schema["pattern"], chr(code)) == bool(chr(code).strip()), hex(code)
    assert not declared(schema, "\x85") and not declared(schema, " \u3000\n")


@pytest.mark.parametrize(
    ("source", "valid"),
    [
        ("stdlib", True),
        (" stdlib\n", True),
        ("/srv/corpus", True),
        ("\x85/srv/corpus \u3000", True),
        ("", False),
        ("   ", False),
        ("stdlibs", False),
        ("corpus/relative", False),
        ("/srv/a\x00b", False),
        ("/" + "a" * 1000, False),
    ],
)
def test_a_dataset_source_is_schema_valid_exactly_when_the_server_reads_it(
    source: str, valid: bool, settings: Any
) -> None:
    settings.DIPACO_DATA_ROOTS = ["/"]  # where the source may lie is configuration, not schema
    schema = component("DatasetIn")["properties"]["source"]
    assert declared(schema, source) is valid
    assert enforced(schema["pattern"], source) is valid or len(source) > schema["maxLength"]
    try:
        check_source(source)
        read = True
    except ServiceError:
        read = False
    assert read is valid


def test_the_audit_log_filters_declare_that_nul_is_refused() -> None:
    for name in ("action", "target_type", "target_id", "actor"):
        schema = query_parameter("/api/v1/audit-log", name)
        assert declared(schema, "run.start") and not declared(schema, "run\x00start"), name


def test_a_run_config_is_declared_closed_with_its_fields_bounded() -> None:
    config = component("RunIn")["properties"]["config"]
    assert config["additionalProperties"] is False
    assert {"model", "layout", "inner", "outer", "phase1"} <= set(config["properties"])
    model = component("ModelConfig")
    assert model["additionalProperties"] is False
    assert "maximum" in model["properties"]["hidden_size"]


def longest_held() -> str:
    """A schema-valid `held` of the most characters, with the most ':' and ',' (each 3
    bytes once percent-encoded): 256 pairs sharing HELD_MAX_LENGTH."""
    schema = query_parameter("/api/v1/worker/lease/{lease_id}/manifest", "held")
    length, pairs = schema["maxLength"], 256
    room = length - (2 * pairs - 1)  # ids and versions together
    items = []
    for i in range(pairs):
        share = room // pairs + (i < room % pairs)
        version = min(9, share - 1)
        items.append(f"{'m' * (share - version)}:{'9' * version}")
    held = ",".join(items)
    assert len(held) == length and re.fullmatch(HELD_PATTERN, held)
    assert declared(schema, held) and not declared(schema, held + "9")
    return held


def longest_manifest_request(base: str) -> str:
    """The manifest URL whose request line is the longest the schema admits."""
    held = quote(longest_held(), safe="")
    return f"{base}/api/v1/worker/lease/{MAX_ID}/manifest?held={held}"


def request_line(url: str) -> str:
    parts = urlsplit(url)
    return f"GET {parts.path}?{parts.query} HTTP/1.1"


def test_the_longest_request_line_the_schema_admits_fits_gunicorns_limit() -> None:
    line = request_line(longest_manifest_request("http://127.0.0.1:8000"))
    assert len(line.encode()) <= REQUEST_LINE_LIMIT
    web = child_commands("127.0.0.1", 8000, web_workers=1, task_concurrency=1)["web"]
    assert web[web.index("--limit-request-line") + 1] == str(REQUEST_LINE_LIMIT)
    too_long = openapi()["paths"]["/api/v1/runs"]["get"]["responses"]["414"]["description"]
    assert f"over {REQUEST_LINE_LIMIT} bytes" in too_long


def test_every_pattern_reads_alike_in_python_and_in_pydantic() -> None:
    for code in EDGES:
        c = chr(code)
        assert enforced(patterns.NO_NUL, c) == (c != "\x00")
        assert (
            unicodedata.category(c) in patterns.CONTROL_CATEGORIES
            or c.isspace()
            or (enforced(patterns.NAME, c) and re.search(patterns.NAME, c))
        )


def every_pattern(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        return found + [p for value in node.values() for p in every_pattern(value)]
    if isinstance(node, list):
        return [p for value in node for p in every_pattern(value)]
    return []


def test_no_pattern_in_the_schema_uses_a_class_shorthand_the_dialects_read_differently() -> None:
    # \s is one set in ECMA-262 (JSON Schema, and schemathesis' generator), another in
    # Python's re and a third in pydantic's Rust regex: the old route-text pattern \S let
    # U+0085 alone through the schema and not through the server.
    found = every_pattern(openapi())
    assert len(found) >= 10
    shorthand = re.compile(r"(?<!\\)\\[sSwWdDbB]")
    assert [p for p in found if shorthand.search(p)] == []
