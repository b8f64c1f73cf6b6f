"""What the demo trains: the run config its flags describe, and the corpus it reads.

The corpus is a sample of the running interpreter's standard library written once as a
JSON Lines file in the data dir (one record per source file, so the platform's
train/validation split, which hashes each record, never puts two chunks of one file on
both sides). A second demo with the same model size finds the file and its dataset and
reuses both.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.corpus import STDLIB_EXCLUDED_DIRS, STDLIB_SUFFIXES, stdlib_root

# Path sizes. "tiny" is RunConfig.tiny()'s 2.84M-parameter model: ~0.1-0.2 s per inner
# step of 4 x 128 tokens on one CPU core. "micro" (0.24M) is for tests and smoke runs;
# "small" (8.6M, dipaco simulate's) wants more cores or a GPU.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "micro": {
        "hidden_size": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
        "intermediate_size": 192, "vocab_size": 1024, "seq_len": 64,
    },
    "tiny": {},
    "small": {
        "hidden_size": 256, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
        "intermediate_size": 704, "vocab_size": 8192, "seq_len": 256,
    },
}  # fmt: skip
# Characters of stdlib text per model size: enough that no path repeats its shard in the
# default rounds (~0.3 tokens per character with an 8k BPE), small enough to prepare in
# seconds. The interpreter's stdlib may hold less; the sample is then all of it.
CORPUS_CHARS = {"micro": 1_000_000, "tiny": 3_000_000, "small": 4_000_000}
# Files above this are skipped: many small files give the validation split (by file)
# enough documents for every path.
MAX_FILE_BYTES = 32 * 1024
# encodings/ is ~100 generated, nearly identical charmap tables (14% of a sample): with
# some in training and others in validation, validation measures how well a model
# memorised them rather than how well it models code.
SKIPPED_DIRS = frozenset({"encodings"})
VAL_FRACTION = 0.1  # of the sample's files; DataConfig's 0.01 is for whole corpora

DEFAULT_PATHS = (2, 2)
DEFAULT_WORKERS = 2
DEFAULT_ROUNDS = 5
DEFAULT_INNER_STEPS = 30
DEFAULT_MODEL_SIZE = "tiny"
# Phase 1 (the paper's recipe, docs/design.md §1): a dense DiLoCo model trained on the volunteers
# first, whose features route the documents and whose layers start every module. Five
# rounds of one unit per worker cost about a third of five DiPaCo rounds (four units each):
# 31 s against 87 s of the default demo's 3 min 11 s on 2 cores (docs/benchmarks.md, "The demo").
DEFAULT_PHASE1_ROUNDS = 5


def parse_paths(text: str) -> tuple[int, int]:
    """'LxK': L levels of K modules each, K**L paths (as in `dipaco simulate --paths`)."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2)) < 1:
        raise ValueError(f"--paths {text!r}: write LEVELSxMODULES, e.g. 2x2 (4 paths) or 1x4")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class DemoPlan:
    paths: tuple[int, int] = DEFAULT_PATHS  # (levels, modules per level)
    workers: int = DEFAULT_WORKERS
    rounds: int = DEFAULT_ROUNDS
    inner_steps: int = DEFAULT_INNER_STEPS
    model_size: str = DEFAULT_MODEL_SIZE
    seed: int = 0
    # 0: no phase 1 (random init, tf-idf router). The command line's default is
    # DEFAULT_PHASE1_ROUNDS; plans built in code (the cluster and fault tests) ask for one.
    phase1_rounds: int = 0

    def config(self, name: str, corpus: Path) -> RunConfig:
        """The run config; refuses what cannot work with the message naming the flag."""
        if self.model_size not in MODEL_SIZES:
            raise ValueError(f"--model-size {self.model_size!r}: choose {sorted(MODEL_SIZES)}")
        for flag, value in (("--workers", self.workers), ("--rounds", self.rounds),
                            ("--inner-steps", self.inner_steps)):  # fmt: skip
            if value < 1:
                raise ValueError(f"{flag} {value}: give at least 1")
        if self.phase1_rounds < 0:
            raise ValueError(
                f"--phase1-rounds {self.phase1_rounds}: give 0 (no dense phase) or more"
            )
        model = {**RunConfig.tiny().model.model_dump(mode="json"), **MODEL_SIZES[self.model_size]}
        levels, modules = self.paths
        if levels > model["num_layers"]:
            raise ValueError(
                f"--paths {levels}x{modules}: the {self.model_size} model has "
                f"{model['num_layers']} layers, so at most {model['num_layers']} levels"
            )
        num_paths = modules**levels
        warmup = max(1, self.inner_steps // 4)  # of the run-long schedule (dipaco.inner)
        # Phase 1: one replica per worker (plain DiLoCo on the volunteers), the run's H; its
        # config makes router.featurizer "base-lm" (the phase-1 model's features route).
        phase1 = (
            {"rounds": self.phase1_rounds, "replicas": self.workers} if self.phase1_rounds else None
        )
        return RunConfig.tiny(
            name=name,
            seed=self.seed,
            rounds=self.rounds,
            # Enough replicas that every worker has a unit each round (plain DiLoCo: 1x1).
            replicas_per_path=max(1, math.ceil(self.workers / num_paths)),
            model=model,
            layout=LayoutConfig.grid(model["num_layers"], levels, modules).model_dump(),
            inner={"steps": self.inner_steps, "warmup_steps": warmup},
            data={"corpus": str(corpus), "val_fraction": VAL_FRACTION},
            phase1=phase1,
        )


def stdlib_sample(directory: Path, chars: int) -> Path:
    """A JSON Lines sample of about `chars` characters of stdlib files, written once.

    Files are taken in the order of a hash of their relative path (so the sample covers
    every package, not just the alphabetically first), whole, one record each.
    """
    root = stdlib_root()
    inputs = f"{root}:{chars}:{MAX_FILE_BYTES}:{sorted(SKIPPED_DIRS)}"
    tag = hashlib.sha256(inputs.encode()).hexdigest()[:10]
    target = directory / f"stdlib-{chars}-{tag}.jsonl"
    if target.is_file():
        return target
    skipped = STDLIB_EXCLUDED_DIRS | SKIPPED_DIRS
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skipped]  # pruned: site-packages is large
        for name in names:
            path = Path(folder, name)
            if (
                path.suffix in STDLIB_SUFFIXES
                and not path.is_symlink()
                and path.stat().st_size <= MAX_FILE_BYTES
            ):
                files.append(path)
    files.sort(key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest())
    directory.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    total = 0
    with tmp.open("w", encoding="utf-8") as out:
        for path in files:
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue  # the platform would skip it too
            if not text.strip():
                continue
            record = {"text": text, "file": path.relative_to(root).as_posix()}
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            total += len(text)
            if total >= chars:
                break
    os.replace(tmp, target)
    return target
