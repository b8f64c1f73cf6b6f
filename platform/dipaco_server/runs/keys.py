"""Object-store keys of DESIGN §5, built from database ids only.

No worker input ever becomes part of a key (DESIGN §7): every function takes
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


def module_key(run_id: int, module_id: str, version: int) -> str:
    """runs/<run>/modules/<module>/v<t>.safetensors: fp32 weights after outer step t."""
    module = check_module_id(module_id)
    return validate_key(
        f"{run_prefix(run_id)}/modules/{module}/v{_id(version, 'version')}.safetensors"
    )


def momentum_key(run_id: int, module_id: str, version: int) -> str:
    """runs/<run>/modules/<module>/momentum/v<t>.safetensors: the outer Nesterov buffer."""
    module = check_module_id(module_id)
    version = _id(version, "version")
    return validate_key(f"{run_prefix(run_id)}/modules/{module}/momentum/v{version}.safetensors")


def contribution_key(run_id: int, t: int, unit_id: int, lease_id: int, module_id: str) -> str:
    """runs/<run>/rounds/<t>/<unit>/<lease>/<module>.safetensors: one encoded Δ."""
    module = check_module_id(module_id)
    parts = [_id(t, "round"), _id(unit_id, "unit id"), _id(lease_id, "lease id")]
    return validate_key(
        f"{run_prefix(run_id)}/rounds/{'/'.join(map(str, parts))}/{module}.safetensors"
    )


def data_key(run_id: int, path_index: int, split: Literal["train", "val"]) -> str:
    """runs/<run>/data/<path>/{train,val}.bin: the path's token ids."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    return validate_key(f"{run_prefix(run_id)}/data/{_id(path_index, 'path index')}/{split}.bin")


def tokenizer_key(run_id: int) -> str:
    return validate_key(f"{run_prefix(run_id)}/tokenizer.json")


def router_key(run_id: int) -> str:
    return validate_key(f"{run_prefix(run_id)}/router.safetensors")
