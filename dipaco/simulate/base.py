"""An optional dense warm-up phase every method and baseline starts from.

DiPaCo starts its modules from a trained dense model (docs/design.md §1, init_modules_from_base),
and DiLoCo's experiments start from a pretrained checkpoint (arXiv 2311.08105): averaging
replicas that left one random initialisation 50 steps ago loses much of what they learnt,
which at simulation scale (a few rounds) dominates every comparison. The base model trains
`steps` AdamW steps on the stream of every document (its own warm-up and cosine), at its own
batch (`batch_size`; default the run's inner batch), and is cached in the work dir. Its key
holds the base's batch, not the method's: a bench that compares methods at different inner
batches (DiLoCo at 16, DiPaCo at 4) passes one `batch_size` and gets one base for all.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from dipaco.config import InnerConfig, LayoutConfig, RouterConfig, RunConfig
from dipaco.inner import StepMetrics, run_inner_loop
from dipaco.model import build_model
from dipaco.simulate.prepare import DataBudget, PreparedData, prepare_data

__all__ = ["BASE_SEED_OFFSET", "base_inner", "cache_path", "prepare_with_base", "train_base"]

BASE_SEED_OFFSET = 7919  # the base reads its own shuffle of the windows, not the methods'


def base_inner(config: RunConfig, steps: int, batch_size: int | None = None) -> InnerConfig:
    """The base model's optimiser: the run's inner settings, `steps` long, at `batch_size`
    sequences per step (one micro-batch of that size; default the run's batch)."""
    update: dict[str, int] = {"steps": steps}
    if batch_size is not None:
        if batch_size < 1:
            raise ValueError(f"base batch = {batch_size}: need at least 1 sequence per step")
        update.update(micro_batch_size=batch_size, grad_accum_steps=1)
    return config.inner.model_copy(update=update)


def cache_path(
    config: RunConfig, data: PreparedData, steps: int, batch_size: int | None = None
) -> Path:
    """Keyed by the token stream itself, so the 1-path and the P-path preparations of one
    corpus (the same documents in the same order) share one base model, and by what the
    base trains with (its own batch, not the method's)."""
    inner = base_inner(config, steps, batch_size)
    inputs = {
        "stream": data.everything.info(0, "train").sha256,
        "model": config.model.model_dump(mode="json"),
        "inner": inner.model_dump(
            mode="json", exclude={"steps", "micro_batch_size", "grad_accum_steps"}
        ),
        "batch": inner.batch_size,
        "seed": config.seed,
        "steps": steps,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return data.directory.parent / "bases" / f"base-{digest}.safetensors"


def train_base(
    config: RunConfig,
    data: PreparedData,
    steps: int,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    device: torch.device | str = "cpu",
    batch_size: int | None = None,
) -> dict[str, Tensor]:
    """The base model's state dict (fp32, CPU), trained once per (model, inner, seed,
    steps, batch)."""
    if steps < 1:
        raise ValueError(f"base steps = {steps}: need at least 1 (or no base phase at all)")
    path = cache_path(config, data, steps, batch_size)
    if path.is_file():
        return load_file(str(path))
    model = build_model(config.model, config.seed)
    source = data.train_source(None, config.model.seq_len, config.seed + BASE_SEED_OFFSET)
    inner = base_inner(config, steps, batch_size)
    run_inner_loop(
        model, source, inner, seq_len=config.model.seq_len, device=device, on_step=on_step
    )
    state = {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in model.state_dict().items()
    }
    if config.model.tie_embeddings:  # safetensors refuses shared tensors; assembly re-ties
        state["lm_head.weight"] = state["lm_head.weight"].clone()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    save_file(state, str(tmp))
    os.replace(tmp, path)
    return state


def prepare_with_base(
    config: RunConfig,
    budget: DataBudget,
    work_dir: Path | None,
    steps: int,
    *,
    log: Callable[[str], None] = lambda _: None,
    on_step: Callable[[StepMetrics], None] | None = None,
    device: torch.device | str = "cpu",
    batch_size: int | None = None,
) -> tuple[PreparedData, dict[str, Tensor] | None]:
    """The paper's order: a dense base model first (`steps`, 0: none), then the paths' data.

    With ``router.featurizer = "base-lm"`` the base trains on the one-path preparation of
    the corpus (every document), and its features then route the documents to the paths;
    with "tfidf" the paths' data comes first, as the router needs no model.
    """
    base: dict[str, Tensor] | None = None
    if config.router.featurizer == "base-lm" and config.num_paths > 1:
        if steps < 1:
            raise ValueError(
                "router.featurizer = 'base-lm' routes with the base model: give base steps "
                "(--base-steps) or use router.featurizer = 'tfidf'"
            )
        dense = config.model_copy(
            update={
                "layout": LayoutConfig.diloco(config.model.num_layers),
                "router": RouterConfig(),
            }
        )
        dense_data = prepare_data(dense, budget, work_dir, log=log)
        base = train_base(
            dense, dense_data, steps, on_step=on_step, device=device, batch_size=batch_size
        )
        return (
            prepare_data(config, budget, work_dir, log=log, base_state=base, device=device),
            base,
        )
    data = prepare_data(config, budget, work_dir, log=log)
    if steps:
        base = train_base(
            config, data, steps, on_step=on_step, device=device, batch_size=batch_size
        )
    return data, base
