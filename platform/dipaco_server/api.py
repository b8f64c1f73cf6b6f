"""The HTTP API at /api/v1: one NinjaAPI, one router per app.

The OpenAPI schema is at /api/v1/openapi.json and its browsable docs at
/api/v1/docs (swagger-ui served from the ``ninja`` package's static files).

- admin API (staff bearer tokens, accounts.auth.StaffToken): /datasets, /runs,
  /runs/{id}/metrics, /enrollment-tokens, /workers, /audit-log (read-only)
- worker API (worker bearer tokens): /worker/register, /worker/heartbeat,
  /worker/lease, /worker/lease/{id}/manifest|upload-urls|complete|release
- /health (no auth)

Every error is ``{"error": {"code", "message"}}`` (dipaco_server.errors),
including unknown routes under /api/v1 and wrong methods.
"""

from typing import Any

from django.conf import settings
from django.urls import URLPattern, URLResolver, re_path
from ninja import NinjaAPI
from ninja.openapi.schema import OpenAPISchema
from ninja.operation import Operation

from dipaco import __version__
from dipaco_server import errors
from dipaco_server.audit.api import router as audit_router
from dipaco_server.core.api import router as core_router
from dipaco_server.inference.api import router as inference_router
from dipaco_server.rounds.protocol.api import router as protocol_router
from dipaco_server.rounds.reports import contributions, round_stages, run_status
from dipaco_server.runs.api import router as runs_router
from dipaco_server.shedding import document_shedding
from dipaco_server.workers.api import router as workers_router

PUBLIC_READ_SCHEME = "PublicReadOrStaff"  # the name ninja gives inference.api's auth


class DipacoAPI(NinjaAPI):
    """NinjaAPI whose every URL answers errors as JSON, ending with a JSON 404 catch-all."""

    def _get_urls(self) -> list[URLResolver | URLPattern]:
        urls = super()._get_urls()
        for pattern in urls:
            if isinstance(pattern, URLPattern):
                pattern.callback = errors.json_errors(pattern.callback)
        # Last, so it only sees paths that no route (including routers added later) matched.
        urls.append(re_path(r"^.*$", errors.not_found, name="not-found"))
        return urls

    def get_openapi_operation_id(self, operation: Operation) -> str:
        """``dipaco_server_<app>_api_<view>``: the app's, wherever in the app the view lives,
        so that moving a view between an app's modules keeps the ids clients were generated
        with (tests/test_openapi_schema.py)."""
        app = operation.view_func.__module__.split(".")[1]
        return f"dipaco_server_{app}_api_{operation.view_func.__name__}"

    def get_openapi_schema(
        self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None
    ) -> OpenAPISchema:
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        errors.document_errors(schema)
        document_shedding(schema)
        _document_public_reads(schema)
        _link_datasets(schema)
        return schema


DATASET_OPERATION = "dipaco_server_runs_api_get_dataset"


def _link_datasets(schema: OpenAPISchema) -> None:
    """Each answer that names a run's dataset links to it, from a single value.

    A run's ``dataset_id`` is null when the run reads its corpus itself. Without a link,
    schemathesis' stateful phase infers one from the field's name, and from a list of runs
    it picks any run's value, a null among them: ``GET /datasets/None``. An OpenAPI link
    replaces the inferred one; its expression names one value (the answer's, or the first
    listed run's), and a null one is not followed.
    """
    components = schema.get("components", {}).get("schemas", {})

    def resolved(node: Any) -> Any:
        while isinstance(node, dict) and "$ref" in node:
            node = components.get(node["$ref"].rsplit("/", 1)[-1], {})
        return node

    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            for status, answer in operation.get("responses", {}).items():
                if not str(status).startswith("2"):
                    continue
                body = resolved(answer.get("content", {}).get("application/json", {}).get("schema"))
                properties = body.get("properties", {}) if isinstance(body, dict) else {}
                listed = resolved(properties.get("items", {}).get("items"))
                if "dataset_id" in properties:
                    pointer = "$response.body#/dataset_id"
                elif isinstance(listed, dict) and "dataset_id" in listed.get("properties", {}):
                    pointer = "$response.body#/items/0/dataset_id"
                else:
                    continue
                answer.setdefault("links", {})["dataset"] = {
                    "operationId": DATASET_OPERATION,
                    "parameters": {"dataset_id": pointer},
                    "description": "The run's dataset; none when dataset_id is null.",
                }


def _document_public_reads(schema: OpenAPISchema) -> None:
    """Routes under PublicReadOrStaff need no token while DIPACO_PUBLIC_READ is on (the
    default): say so, as OpenAPI's optional security (an empty requirement first)."""
    if not settings.DIPACO_PUBLIC_READ:
        return
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            security = operation.get("security")
            if security and any(PUBLIC_READ_SCHEME in entry for entry in security):
                operation["security"] = [{}, *security]


api = DipacoAPI(
    title="dipaco control plane",
    version=__version__,
    description=(
        "Admin, worker and inference API of a dipaco server. Admin routes need a staff "
        "token (`dipaco admin token create USER`), worker routes a worker token from "
        "`POST /worker/register`; send either as `Authorization: Bearer <token>`. "
        'Every error is `{"error": {"code": ..., "message": ...}}`.'
    ),
    urls_namespace="api-v1",
    docs_url="/docs",
    parser=errors.SizeLimitedParser(),
)
errors.install(api)
api.add_router("/", core_router)
api.add_router("/", runs_router)
api.add_router("/", workers_router)
api.add_router("/", run_status.staff_router)
api.add_router("/", contributions.staff_router)
api.add_router("/", round_stages.staff_router)
api.add_router("/", inference_router)
api.add_router("/", audit_router)
api.add_router("/worker", protocol_router)
api.add_router("/worker", contributions.router)
