"""Inner AdamW state that survives between rounds of the same path (DESIGN §4.2).

DiLoCo keeps each replica's inner optimiser state across outer rounds and never sends
it. `dipaco.inner.run_inner_loop` builds a fresh AdamW per call and has no argument to
pass one in; what it does have is resume-from-checkpoint. So this module is the hook,
kept in the agent: before a unit starts, it writes a *seed checkpoint* in the library's
checkpoint format (format ``dipaco-inner-checkpoint/1``: ``weights/*``, ``theta_old/*``,
``adam/<i>/<name>``, ``rng/cpu`` and a JSON header with ``identity`` and ``progress``)
holding step 0 of the new unit, the new base weights, and the AdamW moments saved from
the path's previous unit. The library then "resumes" it: same code path as after a
crash, and its identity and θ_old checks still refuse a seed that does not fit.
If the library's format changes, tests/test_worker_agent_train.py fails first.

`retarget` rewrites a checkpoint's identity after the out-of-memory fallback changes
the micro-batch: the data position counts sequences, so it stays valid.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from dipaco.config import InnerConfig, RunConfig
from dipaco.inner import CHECKPOINT_FORMAT

__all__ = ["OptimizerStates", "inner_identity", "read_adam_state", "retarget", "write_seed"]

ADAM_PREFIX = "adam/"


def inner_identity(config: RunConfig, round_index: int) -> dict[str, Any]:
    """The identity `train_path` gives `run_inner_loop` for round t (see dipaco.inner)."""
    h = config.inner.steps
    return {
        "inner": config.inner.model_dump(mode="json"),
        "seq_len": config.model.seq_len,
        "start_position": 0,
        "first_step": round_index * h,
        "total_steps": config.rounds * h,
    }


def _write(path: Path, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    save_file(tensors, str(tmp), metadata={"dipaco": json.dumps(meta)})
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_seed(
    path: Path, weights: Mapping[str, Tensor], adam: Mapping[str, Tensor], identity: dict[str, Any]
) -> None:
    """A step-0 checkpoint of a unit whose model starts at `weights` (its named parameters)."""
    base = {n: t.detach().to("cpu", torch.float32).contiguous() for n, t in weights.items()}
    tensors = {f"weights/{n}": t for n, t in base.items()}
    tensors.update({f"theta_old/{n}": t.clone() for n, t in base.items()})  # no shared storage
    tensors.update(adam)
    tensors["rng/cpu"] = torch.get_rng_state()
    progress = {"step": 0, "position": 0, "tokens": 0, "seconds": 0.0, "losses": [], "lrs": [],
                "grad_norms": []}  # fmt: skip
    _write(path, tensors, {"format": CHECKPOINT_FORMAT, "identity": identity, "progress": progress})


def read_adam_state(checkpoint: Path) -> dict[str, Tensor]:
    """The AdamW tensors (``adam/<i>/<name>``) of a finished unit's checkpoint."""
    with safe_open(str(checkpoint), framework="pt") as handle:
        return {
            key: handle.get_tensor(key)
            for key in handle.keys()  # noqa: SIM118 (safe_open has no __iter__)
            if key.startswith(ADAM_PREFIX)
        }


def retarget(checkpoint: Path, identity: dict[str, Any]) -> None:
    """Rewrite the checkpoint's identity (same tensors and progress)."""
    with safe_open(str(checkpoint), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {})["dipaco"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    meta["identity"] = identity
    _write(checkpoint, tensors, meta)


class OptimizerStates:
    """AdamW moments per (run, path) under ``<root>/run-<id>/path-<p>.safetensors``."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path_for(self, run_id: int, path: int) -> Path:
        return self.root / f"run-{int(run_id)}" / f"path-{int(path)}.safetensors"

    def load(self, run_id: int, path: int, config: RunConfig) -> dict[str, Tensor] | None:
        """The saved moments if they were made with this model and optimiser, else None."""
        file = self.path_for(run_id, path)
        if not file.exists():
            return None
        with safe_open(str(file), framework="pt") as handle:
            if (handle.metadata() or {}).get("fingerprint") != _fingerprint(config):
                return None
            return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118

    def save(self, run_id: int, path: int, config: RunConfig, adam: Mapping[str, Tensor]) -> None:
        if not adam:
            return
        file = self.path_for(run_id, path)
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f"{file.name}.tmp-{os.getpid()}")
        save_file(dict(adam), str(tmp), metadata={"fingerprint": _fingerprint(config)})
        os.replace(tmp, file)


def _fingerprint(config: RunConfig) -> str:
    """What must match for moments to fit: the model (parameter order) and AdamW's betas."""
    inner: InnerConfig = config.inner
    return json.dumps(
        {"model": config.model.model_dump(mode="json"), "betas": list(inner.betas)},
        sort_keys=True,
    )
