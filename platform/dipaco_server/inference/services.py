"""The files of a path's Hugging Face directory, for the weights a `Selection` names
(dipaco_server.inference.selection picks them).

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
from dipaco_server.inference.selection import Selection
from dipaco_server.runs import keys
from dipaco_server.runs.models import Run
from dipaco_server.storage import BlobStore, get_blob_store, validate_key

if TYPE_CHECKING:
    from torch import Tensor

logger = logging.getLogger(__name__)
Tensors = dict[str, "Tensor"]


class RunNotPrepared(ServiceError):
    """The run has no tokenizer or router in the blob store yet."""

    code, status = "run_not_prepared", 409


@dataclass(frozen=True)
class PathFile:
    """One file of the directory: small ones carry `data`; blob-backed ones a `blob_key`."""

    name: str
    size: int
    sha256: str
    data: bytes | None = None
    blob_key: str | None = None


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
