"""The modular model: which tensors of a path belong to which module.

Module ids (safe as object-store key parts, docs/design.md §5):
- ``"<level>.<k>"``: module k of a level; holds that level's blocks.
- ``"shared"``: the non-block parts every path shares (embeddings, final norm, LM head
  unless listed in ``layout.path_specific``); absent when all of them are path-specific.
- ``"path.<p>"``: the path-specific non-block parts of path p; absent when none are.

Tensor names inside a module are the path's own state-dict names (``model.layers.3...``);
every module of a level covers the same blocks, so a name is never ambiguous. Every tensor
of a path belongs to exactly one of its modules, except a tied LM head, which is the
embedding tensor itself: split drops it and assemble puts it back.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache

import torch
from torch import Tensor

from dipaco.config import LayoutConfig, ModelConfig, PathPart, RunConfig
from dipaco.model import build_model, state_shapes

__all__ = [
    "SHARED",
    "assemble_path_state",
    "init_modules",
    "init_modules_from_base",
    "module_ids",
    "module_spec",
    "modules_of_path",
    "paths_through",
    "split_path_state",
]

SHARED = "shared"
PART_TENSORS: dict[str, PathPart] = {
    "model.embed_tokens.weight": "embeddings",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}
TIED_HEAD, TIED_TO = "lm_head.weight", "model.embed_tokens.weight"
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")
_LEVEL_ID = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)$")
_PATH_ID = re.compile(r"^path\.(0|[1-9]\d*)$")
Modules = dict[str, dict[str, Tensor]]


@lru_cache(maxsize=32)
def _owners(model: ModelConfig, layout: LayoutConfig) -> dict[str, str]:
    """Path tensor name -> owner: "level.<i>", "shared" or "path" (a tied head is left out)."""
    level_of_block = {}
    for i, level in enumerate(layout.levels):
        for block in range(*level.blocks):
            level_of_block[block] = i
    owners = {}
    for name in state_shapes(model):
        if model.tie_embeddings and name == TIED_HEAD:
            continue
        match = _BLOCK.match(name)
        if match:
            owners[name] = f"level.{level_of_block[int(match.group(1))]}"
        elif name in PART_TENSORS:
            owners[name] = "path" if PART_TENSORS[name] in layout.path_specific else SHARED
        else:
            raise ValueError(f"tensor {name!r} fits no module; dipaco.modular needs updating")
    return owners


def _has(config: RunConfig, owner: str) -> bool:
    return owner in _owners(config.model, config.layout).values()


def module_ids(config: RunConfig) -> list[str]:
    """Every module of the run: level modules in order, then "shared", then "path.<p>"."""
    ids = [f"{i}.{k}" for i, level in enumerate(config.layout.levels) for k in range(level.modules)]
    if _has(config, SHARED):
        ids.append(SHARED)
    if _has(config, "path"):
        ids.extend(f"path.{p}" for p in range(config.num_paths))
    return ids


def modules_of_path(config: RunConfig, p: int) -> list[str]:
    """The modules path p is assembled from, in module_ids order."""
    ids = [f"{i}.{k}" for i, k in enumerate(config.path_modules(p))]
    if _has(config, SHARED):
        ids.append(SHARED)
    if _has(config, "path"):
        ids.append(f"path.{p}")
    return ids


def _parse(config: RunConfig, module_id: str) -> tuple[str, int, int]:
    """("level", level, k), ("shared", 0, 0) or ("path", p, 0); refuses unknown ids."""
    level_match, path_match = _LEVEL_ID.match(module_id), _PATH_ID.match(module_id)
    if level_match:
        level, k = int(level_match.group(1)), int(level_match.group(2))
        if level < len(config.layout.levels) and k < config.layout.levels[level].modules:
            return "level", level, k
    elif path_match and _has(config, "path") and int(path_match.group(1)) < config.num_paths:
        return "path", int(path_match.group(1)), 0
    elif module_id == SHARED and _has(config, SHARED):
        return SHARED, 0, 0
    raise ValueError(f"unknown module id {module_id!r}; this run has {module_ids(config)}")


def paths_through(config: RunConfig, module_id: str) -> list[int]:
    """Paths that contain the module (for the outer step's √(paths) rescale)."""
    kind, a, b = _parse(config, module_id)
    if kind == "path":
        return [a]
    paths = range(config.num_paths)
    if kind == SHARED:
        return list(paths)
    return [p for p in paths if config.path_modules(p)[a] == b]


def module_spec(
    config: RunConfig, module_id: str
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of a module's tensors; uploads are checked against this."""
    kind, a, _ = _parse(config, module_id)
    owner = f"level.{a}" if kind == "level" else kind
    shapes = state_shapes(config.model)
    owners = _owners(config.model, config.layout)
    return {name: (shapes[name], torch.float32) for name, o in owners.items() if o == owner}


def _module_of(config: RunConfig, p: int) -> dict[str, str]:
    """Path tensor name -> module id for path p."""
    choices = config.path_modules(p)
    result = {}
    for name, owner in _owners(config.model, config.layout).items():
        if owner.startswith("level."):
            level = int(owner.removeprefix("level."))
            result[name] = f"{level}.{choices[level]}"
        else:
            result[name] = SHARED if owner == SHARED else f"path.{p}"
    return result


def split_path_state(config: RunConfig, p: int, state: Mapping[str, Tensor]) -> Modules:
    """A path's state dict (weights or Δ) -> {module id: {name: tensor}}; tensors not copied."""
    owner = _module_of(config, p)
    expected = set(owner) | ({TIED_HEAD} if config.model.tie_embeddings else set())
    missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or extra:
        raise ValueError(
            f"path {p} state does not match the model: missing {missing}, extra {extra}"
        )
    if config.model.tie_embeddings and not torch.equal(state[TIED_HEAD], state[TIED_TO]):
        raise ValueError("tied model: lm_head.weight differs from model.embed_tokens.weight")
    modules: Modules = {module_id: {} for module_id in modules_of_path(config, p)}
    for name, module_id in owner.items():
        modules[module_id][name] = state[name]
    return modules


def assemble_path_state(
    config: RunConfig, p: int, modules: Mapping[str, Mapping[str, Tensor]]
) -> dict[str, Tensor]:
    """Module tensors -> path p's state dict, ready for `load_state_dict`.

    `modules` may hold more modules than the path needs (e.g. all of them). Names and
    shapes are checked against module_spec; tensors are not copied.
    """
    state: dict[str, Tensor] = {}
    for module_id in modules_of_path(config, p):
        if module_id not in modules:
            raise ValueError(f"path {p} needs module {module_id!r}, which was not given")
        spec, given = module_spec(config, module_id), modules[module_id]
        if set(spec) != set(given):
            missing, extra = sorted(set(spec) - set(given)), sorted(set(given) - set(spec))
            raise ValueError(f"module {module_id!r}: missing {missing}, extra {extra}")
        for name, tensor in given.items():
            if tuple(tensor.shape) != spec[name][0]:
                raise ValueError(
                    f"module {module_id!r} tensor {name}: shape {tuple(tensor.shape)}, "
                    f"expected {spec[name][0]}"
                )
            state[name] = tensor
    if config.model.tie_embeddings:
        state[TIED_HEAD] = state[TIED_TO]
    return {name: state[name] for name in state_shapes(config.model)}  # the model's order


def init_modules_from_base(config: RunConfig, base_state: Mapping[str, Tensor]) -> Modules:
    """Every module of the run, copied (fp32, contiguous) from one dense model's state dict.

    All K modules of a level start equal: DiPaCo starts from a trained dense model and lets
    the paths' different data shards make the modules diverge.
    """
    split_path_state(config, 0, base_state)  # refuses a state dict of another shape
    return {
        module_id: {
            name: base_state[name].detach().to(torch.float32, copy=True).contiguous()
            for name in module_spec(config, module_id)
        }
        for module_id in module_ids(config)
    }


def init_modules(config: RunConfig, seed: int | None = None) -> Modules:
    """Every module of the run from one seeded model (`config.seed` unless given)."""
    base = build_model(config.model, config.seed if seed is None else seed)
    return init_modules_from_base(config, base.state_dict())
