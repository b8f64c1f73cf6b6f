"""Which weights a download serves, and the files of a path's Hugging Face directory.

`select` picks, for each module of a path, its version after a given round closed
(round t's outer step writes version t + 1; version 0 is the untrained initial weights).
`path_files` lists the directory's files: the small ones (config, tokenizer, card) are
built in memory per request; model.safetensors is assembled from the module blobs once
per (run, path, module versions) and cached in the blob store under a key derived from
those versions, next to a sidecar with its sha256 and size (written last, so its presence
means the model blob is complete).
"""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path as FsPath
from typing import TYPE_CHECKING, Any

from django.db.models import Max

from dipaco.inference import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    MODEL_FILE,
    MODEL_FORMAT,
    generation_config_json,
    hf_config_json,
    sha256_file,
    tokenizer_files,
    write_model_file,
)
from dipaco_server.errors import ServiceError
from dipaco_server.inference import card
from dipaco_server.runs import keys
from dipaco_server.runs.errors import RunNotFound
from dipaco_server.runs.models import ModuleVersion, Path, Run
from dipaco_server.runs.phases import PATHS
from dipaco_server.storage import BlobStore, get_blob_store, validate_key

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)
Tensors = dict[str, "Tensor"]


class PathNotFound(ServiceError):
    code, status = "path_not_found", 404


class PathNotTrained(ServiceError):
    """No module version to serve yet, or only the initial weights and no round was asked."""

    code, status = "path_not_trained", 409


class RoundNotFound(ServiceError):
    code, status = "round_not_found", 404


class RunNotPrepared(ServiceError):
    """The run has no tokenizer or router in the blob store yet."""

    code, status = "run_not_prepared", 409


@dataclass(frozen=True)
class Selection:
    """The weights one download serves: a path and one version per module, at a round."""

    run: Run
    path: Path
    round: int
    versions: tuple[ModuleVersion, ...]  # in path.modules order

    @property
    def folder(self) -> str:
        """The directory name users see: ``<run>-path-<p>-round-<n>``, with the round
        counted from 1 as every page does (``round`` itself is the API's 0-based index)."""
        return f"{self.run.name}-path-{self.path.index}-round-{self.round + 1}"


@dataclass(frozen=True)
class PathFile:
    """One file of the directory: small ones carry `data`; blob-backed ones a `blob_key`."""

    name: str
    size: int
    sha256: str
    data: bytes | None = None
    blob_key: str | None = None


def get_run(run_id: int) -> Run:
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFound(f"no run with id {run_id}; the dashboard at / lists the runs")
    return run


def select(run_id: int, path_index: int, round: int | None = None) -> Selection:
    """The path's modules after round `round` closed (None: the last round with weights).

    Round t's outer step writes version t + 1, so "after round t" is each module's newest
    version at or before t + 1: the weights the evaluation scored as round t. Version 0,
    the initial weights, is never served: nothing has trained it.
    """
    run = get_run(run_id)
    paths = run.paths.filter(phase=PATHS)  # the DiPaCo paths; phase 1's model is not served
    path = paths.filter(index=path_index).first()
    if path is None:
        raise PathNotFound(
            f"run {run.name!r} has no path {path_index}; its paths are 0..{paths.count() - 1}",
            paths=paths.count(),
        )
    rows = ModuleVersion.objects.filter(
        module__run=run, module__phase=PATHS, module__module_id__in=path.modules
    )
    newest = rows.aggregate(v=Max("version"))["v"]
    if not newest:  # None: not prepared; 0: only the initial weights
        raise PathNotTrained(
            f"path {path_index} of run {run.name!r} has no trained weights yet (the run is "
            f"{run.state}); download it once its first round has closed"
        )
    last = newest - 1  # the last closed round
    if round is not None and round > last:
        raise RoundNotFound(
            f"path {path_index} of run {run.name!r} has weights up to round {last}; "
            f"ask for a round from 0 to {last}, or leave round out for the newest",
            last=last,
        )
    target = last if round is None else round
    chosen: dict[str, ModuleVersion] = {}
    for row in rows.filter(version__lte=target + 1).select_related("module").order_by("version"):
        chosen[row.module.module_id] = row  # ascending: the last one kept is the newest
    missing = [m for m in path.modules if m not in chosen]
    if missing:  # a module added to the path later than its others: not in this layout model
        raise RoundNotFound(f"modules {missing} have no version after round {target}")
    versions = tuple(chosen[m] for m in path.modules)
    return Selection(run=run, path=path, round=target, versions=versions)


# --- the run's tokenizer and router ----------------------------------------------------


def _run_blob(run: Run, key: str, dataset_key: str, what: str) -> str:
    """The run's own blob (docs/design.md §5), else its dataset's; refused when neither exists."""
    store = get_blob_store()
    for candidate in (key, dataset_key):
        if candidate and store.exists(candidate):
            return candidate
    raise RunNotPrepared(
        f"run {run.name!r} has no {what} in the blob store yet (expected at {key}); "
        "it is made when the run is prepared (POST /api/v1/runs/<id>/start)"
    )


def tokenizer_blob(run: Run) -> tuple[str, bytes]:
    """(key, bytes) of the run's tokenizer.json."""
    dataset_key = run.dataset.tokenizer_key if run.dataset else ""
    key = _run_blob(run, keys.tokenizer_key(run.pk), dataset_key, "tokenizer")
    return key, get_blob_store().get_bytes(key)


def base_model_bytes(run: Run) -> bytes:
    """The run's base model (runs.checkpoint), which a "base-lm" router reads features with."""
    key = keys.base_model_key(run.pk)
    store = get_blob_store()
    if not store.exists(key):
        raise RunNotPrepared(
            f"run {run.name!r} routes with its base model's features, and it has none yet "
            f"(expected at {key}); it is written after phase 1, or uploaded before the start"
        )
    return store.get_bytes(key)


def router_bytes(run: Run) -> bytes:
    dataset_key = run.dataset.router_key if run.dataset else ""
    return get_blob_store().get_bytes(
        _run_blob(run, keys.router_key(run.pk), dataset_key, "router")
    )


# --- the directory ---------------------------------------------------------------------


def _small(name: str, data: bytes) -> PathFile:
    return PathFile(name, len(data), hashlib.sha256(data).hexdigest(), data=data)


def path_files(selection: Selection) -> list[PathFile]:
    """Every file of the path's directory, sorted by name; builds model.safetensors if needed."""
    run = selection.run
    tokenizer_key, tokenizer_json = tokenizer_blob(run)
    tokenizers, separator_id = tokenizer_files(tokenizer_json)
    files = [_small(name, data) for name, data in tokenizers.items() if name != "tokenizer.json"]
    digest = hashlib.sha256(tokenizer_json).hexdigest()
    files.append(
        PathFile("tokenizer.json", len(tokenizer_json), digest, tokenizer_json, tokenizer_key)
    )
    files.append(_small(CONFIG_FILE, hf_config_json(run.run_config, separator_id)))
    files.append(_small(GENERATION_CONFIG_FILE, generation_config_json(separator_id)))
    files.extend(_small(name, data) for name, data in card.card_files(selection).items())
    files.append(ensure_model_blob(selection))
    return sorted(files, key=lambda f: f.name)


def model_blob_key(selection: Selection) -> str:
    """runs/<run>/inference/path-<p>/<digest>/model.safetensors, digest of what goes in."""
    inputs = {
        "format": MODEL_FORMAT,
        "path": selection.path.index,
        "modules": [[v.module.module_id, v.version, v.sha256] for v in selection.versions],
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:40]
    prefix = keys.run_prefix(selection.run.pk)
    return validate_key(f"{prefix}/inference/path-{selection.path.index}/{digest}/{MODEL_FILE}")


def ensure_model_blob(selection: Selection) -> PathFile:
    """model.safetensors of the selection: the cached blob, built first if missing.

    Two requests may build it at once; both write the same bytes (writes are atomic).
    """
    store = get_blob_store()
    key = model_blob_key(selection)
    sidecar = f"{key}.json"
    if store.exists(sidecar) and store.exists(key):
        facts = json.loads(store.get_bytes(sidecar))
        return PathFile(MODEL_FILE, int(facts["size"]), str(facts["sha256"]), blob_key=key)
    with tempfile.TemporaryDirectory(prefix="dipaco-path-") as tmp:
        modules = _fetch_modules(store, selection, FsPath(tmp))
        out = FsPath(tmp) / MODEL_FILE
        config = selection.run.run_config
        write_model_file(config, selection.path.index, modules, out)
        size, sha256 = out.stat().st_size, sha256_file(out)
        store.put_file(key, out)
    store.put_bytes(sidecar, json.dumps({"sha256": sha256, "size": size}).encode())
    logger.info("assembled %s (%d bytes)", key, size)
    return PathFile(MODEL_FILE, size, sha256, blob_key=key)


def _fetch_modules(store: BlobStore, selection: Selection, tmp: FsPath) -> dict[str, Tensors]:
    """Each module's tensors from its blob, refused if the blob is not what was recorded."""
    from dipaco.modules_file import load_module_file  # torch: not at every process's start

    config = selection.run.run_config
    modules: dict[str, Tensors] = {}
    for row in selection.versions:
        module_id = row.module.module_id
        local = tmp / f"{module_id}.safetensors"
        store.download_to(row.blob_key, local)
        if sha256_file(local) != row.sha256:
            raise RuntimeError(
                f"blob {row.blob_key} does not match the sha256 recorded for module "
                f"{module_id} v{row.version}; the blob store was changed behind the server"
            )
        modules[module_id] = load_module_file(local, config, module_id)
    return modules


# --- the manifest ----------------------------------------------------------------------

URL_EXPIRES_S = 3600  # long enough to fetch a large model over a slow link


def manifest(selection: Selection, file_url: Callable[[str], str]) -> dict[str, Any]:
    """Files of the directory and the module blobs it is assembled from, each with size,
    sha256 and a URL (presigned for blobs; `file_url(name)` for files built per request)."""
    store = get_blob_store()
    run, path = selection.run, selection.path

    def url(file: PathFile) -> str:
        if file.blob_key:
            return store.presigned_get(file.blob_key, URL_EXPIRES_S)
        return file_url(file.name)

    return {
        "run": {"id": run.pk, "name": run.name, "state": run.state},
        "path": {"index": path.index, "choices": path.choices, "modules": path.modules},
        "round": selection.round,
        "folder": selection.folder,
        "expires_in": URL_EXPIRES_S,
        "files": [
            {"name": f.name, "size": f.size, "sha256": f.sha256, "url": url(f)}
            for f in path_files(selection)
        ],
        "modules": [
            {
                "module_id": v.module.module_id,
                "version": v.version,
                "size": v.size,
                "sha256": v.sha256,
                "url": store.presigned_get(v.blob_key, URL_EXPIRES_S),
            }
            for v in selection.versions
        ],
    }
