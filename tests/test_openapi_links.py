"""The OpenAPI links a run's answers declare to its dataset: a client that follows links
(schemathesis' stateful phase) never asks for ``/datasets/None`` when a run has no dataset.

Without declared links, schemathesis infers one from the field name ``dataset_id``, and
from a list of runs it substitutes any run's value, a null among them. The declared links
name one value each (which a null leaves unfollowed) and replace the inferred ones."""

from __future__ import annotations

import copy
from typing import Any

import schemathesis

from dipaco_server.api import DATASET_OPERATION, api

DATASET_ROUTE = ("/api/v1/datasets/{dataset_id}", "get")


def served_schema() -> dict[str, Any]:
    return copy.deepcopy(api.get_openapi_schema(path_prefix="/api/v1/"))


def links_to_datasets(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    found = []
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            for answer in operation.get("responses", {}).values():
                for link in answer.get("links", {}).values():
                    target = link.get("operationId") or link.get("operationRef", "")
                    if target == DATASET_OPERATION or "datasets~1{dataset_id}" in target:
                        found.append((f"{method.upper()} {path}", target, link))
    return found


def test_every_answer_naming_a_runs_dataset_links_to_it_by_one_value() -> None:
    links = links_to_datasets(served_schema())
    sources = {source for source, _, _ in links}
    assert {"POST /api/v1/runs", "GET /api/v1/runs", "GET /api/v1/runs/{run_id}",
            "POST /api/v1/runs/{run_id}/start"} <= sources, sources  # fmt: skip
    for source, _, link in links:
        pointer = link["parameters"]["dataset_id"]
        assert "*" not in pointer, (source, pointer)
    listed = [link for source, _, link in links if source == "GET /api/v1/runs"]
    assert listed[0]["parameters"] == {"dataset_id": "$response.body#/items/0/dataset_id"}


def test_schemathesis_infers_no_link_that_could_pick_a_null_dataset_id() -> None:
    schema = schemathesis.openapi.from_dict(served_schema())
    schema.as_state_machine()  # infers links, adding them to the schema's own
    inferred = links_to_datasets(schema.raw_schema)
    assert inferred, "the stateful phase follows runs to their datasets"
    # A dataset's own id is never null; a run's dataset_id may be.
    wildcards = [(s, link) for s, _, link in inferred
                 if any("*" in str(v) and str(v).endswith("/dataset_id")
                        for v in link.get("parameters", {}).values())]  # fmt: skip
    assert not wildcards, f"links that may substitute any run's (null) dataset_id: {wildcards}"
