"""Object-store keys of docs/design.md §5, built from database ids only.

No worker input ever becomes part of a key (docs/design.md §7): every function takes
integers and module ids that the server itself created, re-checks them, and
passes the result through the blob stores' `validate_key`.
"""

from __future__ import annotations

import re
from typing import Literal

from dipaco_server.storage import validate_key

# dipaco.modular's module ids: "<level>.<k>", "shared", "path.<p>".
_MODULE_ID = re.compile(r"^(?:(?:0|[1-9]\d*)\.(?:0|[1-9]\d*)|shared|path\.(?:0|[1-9]\d*))$")


def _id(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")
    return value


def check_module_id(module_id: str) -> str:
    if not isinstance(module_id, str) or not _MODULE_ID.match(module_id):
        raise ValueError(
            f"module id {module_id!r} is not one of dipaco.modular's forms "
            "('<level>.<k>', 'shared', 'path.<p>')"
        )
    return module_id


def run_prefix(run_id: int) -> str:
    return f"runs/{_id(run_id, 'run id')}"


def phase_prefix(run_id: int, phase: int) -> str:
    """runs/<run> for phase 2 (docs/design.md §5 as it is), runs/<run>/phase1 for the dense phase:
    the phase-1 modules and shard have phase 2's ids and indices (runs.phases)."""
    if phase not in (1, 2):
        raise ValueError(f"phase must be 1 or 2, got {phase!r}")
    return run_prefix(run_id) + ("/phase1" if phase == 1 else "")


def module_key(run_id: int, module_id: str, version: int, phase: int = 2) -> str:
    """<phase prefix>/modules/<module>/v<t>.safetensors: fp32 weights after outer step t."""
    module = check_module_id(module_id)
    return validate_key(
        f"{phase_prefix(run_id, phase)}/modules/{module}/v{_id(version, 'version')}.safetensors"
    )


def momentum_key(run_id: int, module_id: str, version: int, phase: int = 2) -> str:
    """<phase prefix>/modules/<module>/momentum/v<t>.safetensors: the outer Nesterov buffer."""
    module = check_module_id(module_id)
    version = _id(version, "version")
    prefix = phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/modules/{module}/momentum/v{version}.safetensors")


def update_key(run_id: int, module_id: str, version: int, phase: int = 2) -> str:
    """<phase prefix>/modules/<module>/updates/v<t>.safetensors: the encoded outer update
    t - 1 -> t (comm.download_codec, dipaco.updates), what a worker holding t - 1 fetches."""
    module = check_module_id(module_id)
    version = _id(version, "version")
    prefix = phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/modules/{module}/updates/v{version}.safetensors")


def residual_key(run_id: int, module_id: str, version: int, phase: int = 2) -> str:
    """<phase prefix>/modules/<module>/residual/v<t>.safetensors: what the encoding of
    update t - 1 -> t rounded off (fp32), added to the next update (error feedback)."""
    module = check_module_id(module_id)
    version = _id(version, "version")
    prefix = phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/modules/{module}/residual/v{version}.safetensors")


def contribution_key(run_id: int, t: int, unit_id: int, lease_id: int, module_id: str) -> str:
    """runs/<run>/rounds/<t>/<unit>/<lease>/<module>.safetensors: one encoded Δ."""
    module = check_module_id(module_id)
    parts = [_id(t, "round"), _id(unit_id, "unit id"), _id(lease_id, "lease id")]
    return validate_key(
        f"{run_prefix(run_id)}/rounds/{'/'.join(map(str, parts))}/{module}.safetensors"
    )


def data_key(run_id: int, path_index: int, split: Literal["train", "val"], phase: int = 2) -> str:
    """<phase prefix>/data/<path>/{train,val}.bin: the path's token ids."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    prefix = phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/data/{_id(path_index, 'path index')}/{split}.bin")


def rows_index_key(run_id: int, path_index: int, phase: int = 2) -> str:
    """<phase prefix>/data/<path>/rows/index.json: the path's row chunks (dipaco.data.rows)."""
    prefix = phase_prefix(run_id, phase)
    return validate_key(f"{prefix}/data/{_id(path_index, 'path index')}/rows/index.json")


def rows_chunk_key(run_id: int, path_index: int, chunk: int, phase: int = 2) -> str:
    """<phase prefix>/data/<path>/rows/<chunk>.bin: rows of T + 1 tokens in the order units
    read them (dipaco.data.rows)."""
    prefix = phase_prefix(run_id, phase)
    path, c = _id(path_index, "path index"), _id(chunk, "chunk")
    return validate_key(f"{prefix}/data/{path}/rows/{c}.bin")


def data_index_key(run_id: int, phase: int = 2) -> str:
    """<phase prefix>/data/index.json: the shard index (dtype, tokens and sha256 per file)."""
    return validate_key(f"{phase_prefix(run_id, phase)}/data/index.json")


def base_model_key(run_id: int) -> str:
    """runs/<run>/base/model.safetensors: the dense path-size model phase 2 starts from
    (phase 1's last weights, or an uploaded checkpoint) and whose features route."""
    return validate_key(f"{run_prefix(run_id)}/base/model.safetensors")


def base_tokenizer_key(run_id: int) -> str:
    """runs/<run>/base/tokenizer.json: the tokenizer an uploaded checkpoint was trained with;
    preparation uses it instead of training one, so the checkpoint's token ids mean the same."""
    return validate_key(f"{run_prefix(run_id)}/base/tokenizer.json")


def documents_key(run_id: int, chunk: int) -> str:
    """runs/<run>/phase1/documents/<i>.jsonl: chunk i of the corpus split, kept for routing."""
    return validate_key(f"{phase_prefix(run_id, 1)}/documents/{_id(chunk, 'chunk')}.jsonl")


def documents_index_key(run_id: int) -> str:
    """runs/<run>/phase1/documents.json: where the documents of a run with a dense phase 1
    are kept for routing after it (runs.pieces.documents_key: its preparation's key and
    pieces); chunk i is piece i."""
    return validate_key(f"{phase_prefix(run_id, 1)}/documents.json")


def routed_key(run_id: int, chunk: int, part: str) -> str:
    """runs/<run>/phase1/routed/<i>/<part>: document chunk i tokenised and routed after
    phase 1 (runs.between): ``<path>/<split>.bin`` parts of every phase-2 shard, then
    ``manifest.json`` once they are all stored."""
    return validate_key(f"{routed_prefix(run_id)}{_id(chunk, 'chunk')}/{part}")


def routed_prefix(run_id: int) -> str:
    """runs/<run>/phase1/routed/: the listing prefix of every chunk's routed parts."""
    return f"{phase_prefix(run_id, 1)}/routed/"


def tokenizer_key(run_id: int) -> str:
    return validate_key(f"{run_prefix(run_id)}/tokenizer.json")


def router_key(run_id: int) -> str:
    return validate_key(f"{run_prefix(run_id)}/router.safetensors")
