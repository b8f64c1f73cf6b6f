"""Named runs, as the sections `RunConfig.<name>(**sections)` validates.

A preset is a function from keyword changes to plain sections: a model (a section
object) replaces a whole section, a dict changes only the fields it names
(`RunConfig.tiny(inner={"steps": 5})`). Add one here, and a classmethod on RunConfig
that validates it, so every caller writes `RunConfig.<name>()`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from dipaco.config.shape import LayoutConfig, ModelConfig
from dipaco.config.training import InnerConfig

__all__ = ["capacity", "modular", "overlay", "paper_150m", "tiny"]


def overlay(base: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """`base` with `sections` applied, every section object made plain: a dict changes the
    fields it names in a dict section, anything else replaces the section."""
    plain = {k: v.model_dump() if isinstance(v, BaseModel) else v for k, v in base.items()}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(plain.get(key), dict):
            plain[key] = {**plain[key], **value}
        else:
            plain[key] = value.model_dump() if isinstance(value, BaseModel) else value
    return plain


def tiny(**sections: Any) -> dict[str, Any]:
    """A ~2.8M-parameter, 2x2-path run that trains on a CPU in seconds; for tests and demos."""
    base: dict[str, Any] = {
        "name": "tiny",
        "rounds": 3,
        "model": ModelConfig(
            hidden_size=128,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=352,
            vocab_size=8192,
            seq_len=128,
        ),
        "layout": LayoutConfig.grid(4, levels=2, modules=2),
        "inner": InnerConfig(
            lr=3e-3, warmup_steps=5, micro_batch_size=4, grad_accum_steps=1, steps=20
        ),
    }
    return overlay(base, sections)


def capacity(**sections: Any) -> dict[str, Any]:
    """A module-dominant run for one GPU: DiPaCo's capacity claim at a scale it can show.

    Paths of 8.5M parameters (width 256, 8 blocks, vocabulary 4,096, sequences of 256)
    whose blocks are 75% of a path, on 2 levels x 4 modules (16 paths): 2 x 4 x 3.2M of
    modules plus the 2.1M shared embedding and head make 27.8M in all, 3.26x a path. At
    the batch of 256 sequences, 240 steps a path (4 rounds x 60) are 15.7M tokens a
    path and 252M for DiPaCo: 29.5 tokens per parameter for the dense path-size model
    trained on the same tokens, past the ~20 that is compute-optimal at its size
    (arXiv 2203.15556), so more data buys it less than more parameters would. Sizing
    from the one-H100 throughputs: bench/quality_gpu.sh. Fields it does not name are
    tiny's.
    """
    base: dict[str, Any] = {
        "name": "capacity",
        "rounds": 4,
        "model": {
            "hidden_size": 256,
            "num_layers": 8,
            "num_heads": 4,
            "num_kv_heads": 4,
            "intermediate_size": 704,
            "vocab_size": 4096,
            "seq_len": 256,
        },
        "layout": LayoutConfig.grid(8, levels=2, modules=4),
        "inner": {
            "lr": 2e-3,
            "warmup_steps": 24,
            "micro_batch_size": 256,
            "grad_accum_steps": 1,
            "steps": 60,
        },
    }
    return tiny(**overlay(base, sections))


def modular(**sections: Any) -> dict[str, Any]:
    """A module-dominant run for a CPU: tiny's path size, with the parameters in the modules.

    Paths of 2.67M parameters (tiny's 2.84M) whose 8 blocks of width 160 are 88% of the path:
    a vocabulary of 1,024 makes the shared embedding and head 0.33M where tiny's 8,192 make
    them 2.1M (74% of its path). On 2 levels x 5 modules (25 paths) the modules and the
    shared parts make 11.9M in all, 4.5x a path (tiny: 1.26x). Five modules a level, not
    four: with a shared embedding the total is under K x a path for K modules a level, so
    4x needs K >= 5. A path trains at ~1.2x tiny's tokens/s on one CPU thread (tiny's
    8,192-row head and its logits cost more than 4 more blocks): docs/benchmarks.md. Fields
    it does not name are tiny's.
    """
    base: dict[str, Any] = {
        "name": "modular",
        "model": {
            "hidden_size": 160,
            "num_layers": 8,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 448,
            "vocab_size": 1024,
        },
        "layout": LayoutConfig.grid(8, levels=2, modules=5),
    }
    return tiny(**overlay(base, sections))


def paper_150m(**sections: Any) -> dict[str, Any]:
    """The DiPaCo and DiLoCo papers' path (arXiv 2403.10616, 2311.08265): `ModelConfig()`,
    12 blocks of width 896, sequences of 1,024, a 32k vocabulary (174M parameters with the
    untied embedding and head, 146M without the head), on a 2-level 2x2 grid, 100 rounds of
    500 inner steps, with the platform's swept outer defaults (`OuterConfig()`): the size
    volunteers train. What it does not name is `RunConfig()`'s default.
    """
    base: dict[str, Any] = {
        "name": "paper-150m",
        "rounds": 100,
        "model": ModelConfig(),
        "layout": LayoutConfig.grid(ModelConfig().num_layers, levels=2, modules=2),
    }
    return overlay(base, sections)
