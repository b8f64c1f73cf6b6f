"""The routes' OpenAPI schema stays what workers, the dashboard and scripts were built
against: every path, method, parameter, request and response schema as stored in
tests/data/openapi_schema.json. Only the prose may change (descriptions, summaries, the
server's version), so moving code between modules cannot silently move the wire protocol.

A deliberate change of the API rewrites the fixture, reviewed as part of the change:
``python -m tests.test_openapi_schema`` (with DJANGO_SETTINGS_MODULE=dipaco_server.settings).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from django.test import override_settings

FIXTURE = Path(__file__).resolve().parent / "data" / "openapi_schema.json"
PROSE = frozenset({"description", "summary"})


def without_prose(node: Any) -> Any:
    """`node` with every description and summary removed, at any depth."""
    if isinstance(node, dict):
        return {key: without_prose(value) for key, value in node.items() if key not in PROSE}
    if isinstance(node, list):
        return [without_prose(item) for item in node]
    return node


def live_schema() -> dict[str, Any]:
    """The schema the server serves with its default settings, less its prose and version."""
    from dipaco_server.api import api

    # Public reads on (the default) add an optional security entry to some routes.
    with override_settings(DIPACO_PUBLIC_READ=True):
        schema = json.loads(json.dumps(api.get_openapi_schema(path_prefix="/api/v1/")))
    schema.get("info", {}).pop("version", None)
    stripped: dict[str, Any] = without_prose(schema)
    return stripped


def test_the_api_schema_is_the_stored_one_apart_from_its_prose() -> None:
    stored = json.loads(FIXTURE.read_text("utf-8"))
    live = live_schema()
    assert sorted(live["paths"]) == sorted(stored["paths"]), "routes added or removed"
    for route, operations in stored["paths"].items():
        assert live["paths"][route] == operations, f"{route} changed"
    assert live["components"] == stored["components"], "a schema or security scheme changed"
    assert live == stored


def test_prose_is_all_the_comparison_ignores() -> None:
    schema = {"a": {"description": "x", "summary": "y", "title": "T"}, "b": [{"summary": 1}]}
    assert without_prose(schema) == {"a": {"title": "T"}, "b": [{}]}


if __name__ == "__main__":
    import django

    django.setup()
    FIXTURE.write_text(json.dumps(live_schema(), indent=1, sort_keys=True) + "\n", "utf-8")
    print(f"wrote {FIXTURE}")
