"""The partition of a path's state dict into modules, and its inverse."""

from __future__ import annotations

import pytest
import torch

from dipaco.config import LayoutConfig, RunConfig
from dipaco.model import build_model
from dipaco.modular import (
    assemble_path_state,
    init_modules,
    init_modules_from_base,
    module_ids,
    module_spec,
    modules_of_path,
    paths_through,
    split_path_state,
)

# Small enough that building a model per case costs milliseconds.
MICRO = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


def micro(num_layers: int, levels: int, modules: int, specific: tuple = (), **model) -> RunConfig:
    layout = LayoutConfig.grid(num_layers, levels, modules, specific)
    return RunConfig.tiny(
        model={**MICRO, "num_layers": num_layers, "vocab_size": 64, **model}, layout=layout
    )


LAYOUTS = {
    "1x1": micro(2, 1, 1),
    "2x2 with path-specific embeddings": micro(4, 2, 2, ("embeddings",)),
    "3x4 with every non-block part path-specific": micro(
        6, 3, 4, ("embeddings", "final_norm", "lm_head")
    ),
    "2x2 tied, path-specific embedding and head": micro(
        4, 2, 2, ("embeddings", "lm_head"), tie_embeddings=True
    ),
}


@pytest.mark.parametrize("cfg", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_every_tensor_belongs_to_exactly_one_module_of_the_path(cfg: RunConfig) -> None:
    state = build_model(cfg.model, 1).state_dict()
    for p in range(cfg.num_paths):
        modules = split_path_state(cfg, p, state)
        assert list(modules) == modules_of_path(cfg, p)
        names = [name for tensors in modules.values() for name in tensors]
        owned = set(state) - ({"lm_head.weight"} if cfg.model.tie_embeddings else set())
        assert sorted(names) == sorted(owned)  # no tensor twice, none left out


@pytest.mark.parametrize("cfg", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_assembling_a_split_state_gives_it_back(cfg: RunConfig) -> None:
    state = build_model(cfg.model, 2).state_dict()
    for p in range(cfg.num_paths):
        again = assemble_path_state(cfg, p, split_path_state(cfg, p, state))
        assert list(again) == list(state)
        assert all(torch.equal(again[name], state[name]) for name in state)
        model = build_model(cfg.model, 3)
        model.load_state_dict(again)  # strict: the result is a loadable state dict


def test_module_ids_follow_the_layout() -> None:
    cfg = LAYOUTS["3x4 with every non-block part path-specific"]
    ids = module_ids(cfg)
    assert ids[:4] == ["0.0", "0.1", "0.2", "0.3"] and len(ids) == 12 + 64
    assert "shared" not in ids and ids[-1] == "path.63"
    assert module_ids(LAYOUTS["1x1"]) == ["0.0", "shared"]


def test_paths_through_a_module_are_the_paths_that_pick_it() -> None:
    cfg = LAYOUTS["2x2 with path-specific embeddings"]
    assert paths_through(cfg, "0.1") == [2, 3]
    assert paths_through(cfg, "1.0") == [0, 2]
    assert paths_through(cfg, "shared") == [0, 1, 2, 3]
    assert paths_through(cfg, "path.2") == [2]
    for module_id in module_ids(cfg):
        assert all(module_id in modules_of_path(cfg, p) for p in paths_through(cfg, module_id))


@pytest.mark.parametrize("bad", ["2.0", "0.2", "path.4", "00.1", "../0.1", "shared "])
def test_it_refuses_unknown_module_ids(bad: str) -> None:
    with pytest.raises(ValueError, match="unknown module id"):
        module_spec(LAYOUTS["2x2 with path-specific embeddings"], bad)


def test_module_specs_match_the_tensors_and_the_config_counts() -> None:
    cfg = LAYOUTS["2x2 with path-specific embeddings"]
    modules = init_modules(cfg)
    counts = cfg.module_param_counts()
    assert list(modules) == module_ids(cfg) == list(counts)
    for module_id, tensors in modules.items():
        spec = module_spec(cfg, module_id)
        assert {n: (tuple(t.shape), t.dtype) for n, t in tensors.items()} == spec
        assert sum(t.numel() for t in tensors.values()) == counts[module_id]


def test_modules_of_one_level_start_equal_but_own_their_memory() -> None:
    cfg = LAYOUTS["2x2 with path-specific embeddings"]
    modules = init_modules(cfg, seed=5)
    for name, tensor in modules["0.0"].items():
        assert torch.equal(tensor, modules["0.1"][name])
        assert tensor.data_ptr() != modules["0.1"][name].data_ptr()
    assert not torch.equal(
        modules["0.0"]["model.layers.0.mlp.up_proj.weight"],
        init_modules(cfg, seed=6)["0.0"]["model.layers.0.mlp.up_proj.weight"],
    )


def test_modules_from_a_base_model_reproduce_it_on_every_path() -> None:
    cfg = LAYOUTS["2x2 with path-specific embeddings"]
    base = build_model(cfg.model, 9).state_dict()
    modules = init_modules_from_base(cfg, base)
    for p in range(cfg.num_paths):
        path = assemble_path_state(cfg, p, modules)
        assert all(torch.equal(path[name], base[name]) for name in base)


def test_it_refuses_a_state_dict_with_missing_or_extra_tensors() -> None:
    cfg = LAYOUTS["1x1"]
    state = dict(build_model(cfg.model, 0).state_dict())
    del state["model.norm.weight"]
    state["model.layers.9.mlp.up_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\]"):
        split_path_state(cfg, 0, state)


def test_it_refuses_to_assemble_a_module_with_a_wrong_shape() -> None:
    cfg = LAYOUTS["2x2 with path-specific embeddings"]
    modules = init_modules(cfg)
    modules["1.1"]["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"module '1.1' tensor .* shape \(3, 3\)"):
        assemble_path_state(cfg, 1, modules)
    with pytest.raises(ValueError, match=r"needs module 'path\.0'"):
        assemble_path_state(cfg, 0, {k: v for k, v in modules.items() if k != "path.0"})
