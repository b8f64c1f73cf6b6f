"""Inference API: a path's manifest, its directory as a streamed zip, its files, and routing.

    GET  /runs/{id}/paths/{p}/manifest[?round=t]   files + module blobs, sha256, URLs
    GET  /runs/{id}/paths/{p}/download[?round=t]   the Hugging Face directory as a zip
    GET  /runs/{id}/paths/{p}/files/{name}[?round=t]  one file (blob-backed: a redirect)
    POST /runs/{id}/route {"text": ...}            the path for a text, with every score
    POST /runs/{id}/generate {"text": ..., ...}     a continuation, re-routed every k tokens

`round=t` serves the weights after round index t closed (0-based, as every machine field
of the API; the dashboard, the model card and the folder name count rounds from 1, so
they call it round t + 1); without it, the last closed round. Readable by
anyone while the setting DIPACO_PUBLIC_READ is true (the default), else by staff tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseRedirect,
    StreamingHttpResponse,
)
from django.urls import reverse
from ninja import Field, Query, Router, Schema

from dipaco_server.accounts.auth import StaffToken
from dipaco_server.bounds import MAX_INT, PathIndex, RunId
from dipaco_server.errors import ApiError
from dipaco_server.inference import generation, routing, services
from dipaco_server.inference.routing import MAX_TEXT_CHARS
from dipaco_server.inference.selection import select
from dipaco_server.inference.zipstream import ZipEntry, stream_zip
from dipaco_server.patterns import NOT_ONLY_WHITESPACE
from dipaco_server.storage import get_blob_store


class PublicReadOrStaff(StaffToken):
    """Anyone while settings.DIPACO_PUBLIC_READ is true; otherwise a staff token."""

    def __call__(self, request: HttpRequest) -> Any:
        if settings.DIPACO_PUBLIC_READ:
            return "public"
        return super().__call__(request)


router = Router(tags=["inference"], auth=PublicReadOrStaff())


class RoundQuery(Schema):
    round: int | None = Field(
        None,
        ge=0,
        le=MAX_INT,
        description="The weights after the round of this 0-based index closed (the "
        "dashboard's round 1 is 0); the last one if left out.",
    )


class RunRef(Schema):
    id: int
    name: str
    state: str


class PathRef(Schema):
    index: int
    choices: list[int] = Field(description="Module index per level.")
    modules: list[str] = Field(description="Module ids the path is assembled from.")


class FileOut(Schema):
    name: str
    size: int
    sha256: str
    url: str


class ModuleBlobOut(Schema):
    module_id: str
    version: int
    size: int
    sha256: str
    url: str = Field(description="Presigned GET of the module's fp32 safetensors.")


class ManifestOut(Schema):
    run: RunRef
    path: PathRef
    round: int = Field(
        description="0-based index of the round the weights are after (the dashboard and "
        "the folder name count from 1: round + 1)."
    )
    folder: str = Field(
        description="Directory name the zip unpacks to: <run>-path-<p>-round-<round + 1>."
    )
    expires_in: int = Field(description="Seconds the URLs stay valid.")
    files: list[FileOut] = Field(description="The Hugging Face directory, sorted by name.")
    modules: list[ModuleBlobOut] = Field(description="What model.safetensors is assembled from.")


class RouteIn(Schema):
    text: str = Field(
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        pattern=NOT_ONLY_WHITESPACE,
        description="A document or its start (not only whitespace, as Python's str.strip "
        "counts it); the router reads its first tokens.",
    )


class RouteOut(Schema):
    path: int
    modules: list[int] = Field(description="Module index per level of the chosen path.")
    scores: list[float] = Field(description="Score per path; the path is the highest.")


class GenerateIn(Schema):
    text: str = Field(
        min_length=1,
        max_length=MAX_TEXT_CHARS,
        pattern=NOT_ONLY_WHITESPACE,
        description="The prompt (not only whitespace); the router reads its first tokens.",
    )
    max_new_tokens: int = Field(
        32, ge=1, le=generation.MAX_NEW_TOKENS, description="New tokens at most."
    )
    reroute_every: int = Field(
        0,
        ge=0,
        le=generation.MAX_NEW_TOKENS,
        description="Re-route every this many new tokens, the router reading the last "
        "router.prefix_tokens tokens of the text so far (the DiPaCo paper: 64); 0 routes "
        "the prompt once.",
    )
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0 is greedy.")
    seed: int = Field(0, ge=0, le=MAX_INT, description="Sampling seed: same seed, same text.")
    path: int | None = Field(
        None, ge=0, le=MAX_INT, description="This path writes everything (no routing)."
    )
    round: int | None = Field(
        None, ge=0, le=MAX_INT, description="The weights after this 0-based round closed."
    )


class SegmentOut(Schema):
    path: int
    start: int = Field(description="First new token this path wrote (0-based).")
    end: int = Field(description="One past the last new token it wrote.")
    text: str


class SwitchOut(Schema):
    at: int = Field(description="New-token index where the path changed.")
    from_path: int
    to_path: int


class GenerateOut(Schema):
    path: int = Field(description="The path the prompt was routed to (or the one asked).")
    routed: bool
    prompt: str
    continuation: str
    tokens: int
    round: int
    reroute_every: int = Field(description="0 when the answer was not re-routed.")
    paths: list[int] = Field(description="Every path that wrote, in order of first use.")
    segments: list[SegmentOut]
    switches: list[SwitchOut]
    seed: int
    temperature: float


def _file_url(run_id: int, path_index: int, round: int) -> Callable[[str], str]:
    def url(name: str) -> str:
        relative = reverse(
            "api-v1:inference-file",
            kwargs={"run_id": run_id, "path_index": path_index, "name": name},
        )
        return f"{settings.DIPACO_PUBLIC_URL.rstrip('/')}{relative}?round={round}"

    return url


@router.get("/runs/{run_id}/paths/{path_index}/manifest", response=ManifestOut)
def path_manifest(
    request: HttpRequest, run_id: RunId, path_index: PathIndex, query: Query[RoundQuery]
) -> dict[str, Any]:
    """What `dipaco download` fetches: each file and module blob with size, sha256, URL."""
    selection = select(run_id, path_index, query.round)
    return services.manifest(selection, _file_url(run_id, path_index, selection.round))


@router.get("/runs/{run_id}/paths/{path_index}/download", response={200: None})
def path_download(
    request: HttpRequest, run_id: RunId, path_index: PathIndex, query: Query[RoundQuery]
) -> StreamingHttpResponse:
    """The path as a zip of a Hugging Face model directory, streamed as it is read."""
    selection = select(run_id, path_index, query.round)
    files = services.path_files(selection)  # everything that can fail, before the first byte
    store = get_blob_store()
    entries = [
        ZipEntry(
            f"{selection.folder}/{f.name}",
            f.size,
            (lambda data=f.data: iter([data]))
            if f.data is not None
            else (lambda key=f.blob_key: store.iter_chunks(key)),
        )
        for f in files
    ]
    response = StreamingHttpResponse(stream_zip(entries), content_type="application/zip")
    response["Content-Disposition"] = f'attachment; filename="{selection.folder}.zip"'
    return response


@router.get(
    "/runs/{run_id}/paths/{path_index}/files/{name}",
    response={200: None},
    url_name="inference-file",
)
def path_file(
    request: HttpRequest, run_id: RunId, path_index: PathIndex, name: str, query: Query[RoundQuery]
) -> HttpResponse:
    """One file of the directory; a blob-backed one redirects to a presigned URL."""
    selection = select(run_id, path_index, query.round)
    files = {f.name: f for f in services.path_files(selection)}
    file = files.get(name)
    if file is None:
        raise ApiError(
            404, "file_not_found", f"no file {name!r} in a path directory; files: {sorted(files)}"
        )
    if file.blob_key:
        url = get_blob_store().presigned_get(file.blob_key, services.URL_EXPIRES_S)
        return HttpResponseRedirect(url)
    kind = "text/markdown" if name.endswith(".md") else "application/json"
    return HttpResponse(file.data, content_type=f"{kind}; charset=utf-8")


@router.post("/runs/{run_id}/route", response=RouteOut)
def route(request: HttpRequest, run_id: RunId, body: RouteIn) -> dict[str, Any]:
    """The path the run's router picks for a text (the router that sharded the training data)."""
    return routing.route_text(run_id, body.text)


@router.post("/runs/{run_id}/generate", response=GenerateOut)
def generate(request: HttpRequest, run_id: RunId, body: GenerateIn) -> dict[str, Any]:
    """Continue a text on the run's paths: the router picks the prompt's path and, with
    reroute_every k, picks again from the text so far every k new tokens."""
    return generation.generate_text(
        run_id, body.text, body.max_new_tokens, reroute_every=body.reroute_every,
        temperature=body.temperature, seed=body.seed, path=body.path, round=body.round,
    )  # fmt: skip
