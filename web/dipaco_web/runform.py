"""The new-run form: presets, the config editor's fields, and the estimate shown before creation.

The editor is the whole run config as one input per leaf (``model.hidden_size``,
``inner.steps``, ``layout.levels`` as JSON, ...), so a problem the config schema reports
(runs.services.validate_config: ``field``, ``value``, ``rule``) is shown next to its
input. A whole config pasted as JSON takes the place of the fields. Nothing here writes:
creation goes through runs.services.create_run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dipaco.config import LayoutConfig, RunConfig, estimate_path_memory
from dipaco.data.windows import unit_tokens

GiB = 1024**3

# One path's size and the demo's schedule: `dipaco demo`'s default tiny model (2x2 paths,
# 5 rounds of H = 30); a small 8.6M model (`dipaco simulate --model-size small`); and the
# DiPaCo paper's 150M-parameter paths (ModelConfig's defaults), 2 levels of 2 modules.
_SMALL_MODEL = {
    "hidden_size": 256, "num_layers": 6, "num_heads": 8, "num_kv_heads": 4,
    "intermediate_size": 704, "vocab_size": 8192, "seq_len": 256,
}  # fmt: skip


def _demo() -> RunConfig:
    # `dipaco demo`'s defaults: the paper's two phases, 5 dense rounds of one unit per worker
    # (two workers), then 5 DiPaCo rounds.
    return RunConfig.tiny(
        rounds=5,
        inner={"steps": 30, "warmup_steps": 7},
        data={"val_fraction": 0.1},
        phase1={"rounds": 5, "replicas": 2},
    )


def _small() -> RunConfig:
    return RunConfig.tiny(
        rounds=20,
        model=_SMALL_MODEL,
        layout=LayoutConfig.grid(6, levels=2, modules=2).model_dump(),
        inner={"steps": 100, "warmup_steps": 25},
        data={"val_fraction": 0.05},
    )


def _paper() -> RunConfig:
    return RunConfig.paper_150m()


@dataclass(frozen=True)
class Preset:
    key: str
    label: str
    description: str
    config: dict[str, Any]  # RunConfig JSON without "name" (the form's name field sets it)


def presets() -> list[Preset]:
    """The presets, smallest first, each a complete validated config."""
    rows = [
        ("demo", "Demo size", "2.8M-parameter paths: 5 dense rounds, then 2x2 paths for 5 rounds of "
         "30 steps: minutes on a CPU",
         _demo()),
        ("small", "Small", "8.6M-parameter paths, 2x2, 20 rounds of 100 steps: a few GPUs",
         _small()),
        ("150m", "150M-parameter paths", "the DiPaCo paper's path size, 2x2, 100 rounds of 500 "
         "steps: volunteer GPUs", _paper()),
    ]  # fmt: skip
    out = []
    for key, label, description, config in rows:
        raw = config.model_dump(mode="json")
        raw.pop("name", None)
        out.append(Preset(key, label, description, raw))
    return out


def preset(key: str | None) -> Preset:
    """The preset named `key`; the first (demo size) for an unknown or missing one."""
    table = {p.key: p for p in presets()}
    return table.get(key or "", presets()[0])


# --- the editor's fields -------------------------------------------------------------------


@dataclass
class EditorField:
    name: str  # dotted path, e.g. "model.hidden_size"
    text: str  # what the input shows
    kind: str  # "text" | "json" | "bool"
    errors: list[str] = field(default_factory=list)


@dataclass
class EditorSection:
    name: str  # "" for the top-level scalars
    fields: list[EditorField]


def _text(value: Any) -> tuple[str, str]:
    if isinstance(value, bool):
        return ("true" if value else "false"), "bool"
    if isinstance(value, str):
        return value, "text"
    if isinstance(value, int | float):
        return json.dumps(value), "text"
    return json.dumps(value), "json"  # lists, null, objects kept whole (layout.levels)


# Sections that may be null as a whole: one JSON input, so they can be set or removed.
WHOLE_SECTIONS = frozenset({"phase1"})


def flatten(config: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted name, value) of every leaf: nested objects recurse (but WHOLE_SECTIONS),
    anything else is a leaf."""
    leaves: list[tuple[str, Any]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name not in WHOLE_SECTIONS:
            leaves.extend(flatten(value, f"{name}."))
        else:
            leaves.append((name, value))
    return leaves


def editor_sections(
    config: Mapping[str, Any], problems: Iterable[Mapping[str, Any]] = ()
) -> list[EditorSection]:
    """The editor's inputs for `config`, grouped by top-level section, each problem shown
    at its field (or the nearest field above it: ``layout.levels.0.blocks`` at
    ``layout.levels``; a problem of no field at the section's first input)."""
    leaves = [(n, v) for n, v in flatten(config) if n != "name"]
    fields = {name: EditorField(name, *_text(value)) for name, value in leaves}
    unplaced: list[str] = []
    for problem in problems:
        where = str(problem.get("field") or "")
        message = str(problem.get("rule") or "invalid")
        target = _nearest(where, fields)
        if target is None:
            unplaced.append(f"{where or 'config'}: {message}")
        else:
            fields[target].errors.append(message)
    sections: dict[str, list[EditorField]] = {}
    for name, _ in leaves:
        section = name.split(".", 1)[0] if "." in name else ""
        sections.setdefault(section, []).append(fields[name])
    out = [EditorSection(name, items) for name, items in sections.items()]
    if unplaced and out:
        out[0].fields[0].errors.extend(unplaced)
    return out


def _nearest(where: str, fields: Mapping[str, EditorField]) -> str | None:
    parts = where.split(".") if where else []
    while parts:
        name = ".".join(parts)
        if name in fields:
            return name
        parts.pop()
    # A section named whole (e.g. "phase1" when it is an object): its first field.
    prefix = f"{where}." if where else None
    if prefix:
        for name in fields:
            if name.startswith(prefix):
                return name
    return None


def parse_fields(
    values: Mapping[str, str], base: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The config the editor's inputs describe, on top of `base` (whose leaves name the
    inputs); (config, raw texts). A leaf that was a string stays the text typed; any other
    is read as JSON, and text that is not JSON is passed on as typed, for the schema to
    refuse next to its field."""
    config: dict[str, Any] = json.loads(json.dumps(dict(base)))
    raws: dict[str, str] = {}
    for name, old in flatten(base):
        if name == "name" or name not in values:
            continue
        raw = values[name]
        raws[name] = raw
        if isinstance(old, str):
            value: Any = raw
        else:
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw.strip()
        _set(config, name.split("."), value)
    return config, raws


def _set(target: dict[str, Any], parts: list[str], value: Any) -> None:
    for part in parts[:-1]:
        nested = target.get(part)
        if not isinstance(nested, dict):
            nested = {}
            target[part] = nested
        target = nested
    target[parts[-1]] = value


# --- the estimate --------------------------------------------------------------------------

# Sustained training throughputs the unit-time estimate assumes (6 FLOPs per parameter per
# token): a laptop CPU core in fp32, a consumer GPU, a data-centre GPU at a realistic
# utilisation. Rough by design; a worker's own measured speed replaces them once it trains.
REFERENCE_FLOPS = (
    ("a CPU core", 2e10),
    ("a consumer GPU", 2e13),
    ("a data-centre GPU", 1e14),
)


@dataclass(frozen=True)
class Estimate:
    params: int  # one path
    state_gib: float
    activation_gib: float
    total_gib: float
    limit_gib: float
    paths: int
    units_per_round: int
    total_units: int  # both phases
    unit_tokens: int
    unit_flops: float
    unit_seconds: list[tuple[str, float]]  # (device, seconds) per reference throughput
    target_seconds: float  # units.target_seconds: what the scheduler sizes units to

    @property
    def flops_text(self) -> str:
        return _scaled(self.unit_flops, ("", "k", "M", "G", "T", "P", "E")) + "FLOP"

    @property
    def unit_times(self) -> list[str]:
        return [f"{duration(s)} per unit on {device}" for device, s in self.unit_seconds]


def _scaled(value: float, units: tuple[str, ...]) -> str:
    for unit in units[:-1]:
        if value < 1000:
            return f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} {units[-1]}"


def duration(seconds: float) -> str:
    """A rough duration: < 1 s, 13 s, 4.2 min, 3.8 h, 16 days."""
    if seconds < 1:
        return "< 1 s"
    for limit, unit, size in ((60, "s", 1), (3600, "min", 60), (86400, "h", 3600)):
        if seconds < limit:
            return f"{seconds / size:.2g} {unit}" if size > 1 else f"{seconds:.0f} s"
    return f"{seconds / 86400:.3g} days"


def estimate(config: RunConfig) -> Estimate:
    """One path's training memory (dipaco.config.estimate_path_memory, the bound the schema
    enforces) and one work unit's size and time on the reference devices."""
    memory = estimate_path_memory(config.model, config.inner)
    tokens = unit_tokens(config)
    flops = 6.0 * memory.params * tokens
    units = config.num_paths * config.replicas_per_path
    total = units * config.rounds
    if config.phase1 is not None:
        total += config.phase1.rounds * config.phase1.replicas
    return Estimate(
        params=memory.params,
        state_gib=memory.state_bytes / GiB,
        activation_gib=memory.activation_bytes / GiB,
        total_gib=memory.total_bytes / GiB,
        limit_gib=config.limits.max_path_memory_bytes / GiB,
        paths=config.num_paths,
        units_per_round=units,
        total_units=total,
        unit_tokens=tokens,
        unit_flops=flops,
        unit_seconds=[(name, flops / speed) for name, speed in REFERENCE_FLOPS],
        target_seconds=float(getattr(getattr(config, "units", None), "target_seconds", 0.0)),
    )
