"""What a unit's manifest sends a worker down: fp32 modules, or only the encoded updates.

With ``comm.download_codec`` int8 or fp16 every outer step publishes its update encoded
(rounds.outer.publish.encode_update: the new version is exactly the version before plus the
decoded update). A worker that says, in the manifest request's ``held`` parameter, that it
holds version h of a module the unit starts from at version b > h is sent the updates
h -> ... -> b, each from the version its outer step applied onto (OuterStep.base_version:
a round that kept the module made no version), each with the sha256 of the fp32 file it starts from and the one
it leads to, so the worker checks every step (worker_agent.payload.apply_updates). The
fp32 file's URL is always there too: new workers, and any worker whose updates do not
check out, fetch it instead. Updates are offered only while every link of the chain is
kept (rounds.lifecycle.retention) and while they are smaller than the fp32 file.

`Lease.download_bytes` records what the manifest sent the worker to: encoded updates,
fp32 files, nothing for a module it holds at the base version already. The dashboard's
"Communication" counts it (web/dipaco_web/curves.py), as `dipaco simulate` counts a unit
whose worker holds the version before.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dipaco_server.runs.models import ModuleVersion

# module:version pairs, comma-separated: "0.0:3,1.1:3" (module ids: dipaco.modular's forms)
HELD_PATTERN = r"^[a-z0-9.]{1,32}:[0-9]{1,9}(,[a-z0-9.]{1,32}:[0-9]{1,9}){0,255}$"
_HELD = re.compile(HELD_PATTERN)


def parse_held(text: str | None) -> dict[str, int]:
    """The ``held`` query parameter as module id -> version ({} when absent or malformed:
    it is a hint, and without it the worker gets whole fp32 modules)."""
    if not text or not _HELD.match(text):
        return {}
    held = {}
    for pair in text.split(","):
        module_id, _, version = pair.partition(":")
        held[module_id] = int(version)
    return held


@dataclass
class ModuleDownload:
    """One module of the manifest: its fp32 version, and the updates to it from `held`."""

    version: ModuleVersion
    updates: list[dict[str, Any]] = field(default_factory=list)
    held: bool = False  # the worker holds exactly this version: it downloads nothing

    @property
    def bytes(self) -> int:
        if self.held:
            return 0
        if self.updates:
            return sum(int(u["size"]) for u in self.updates)
        return int(self.version.size)


def plan_downloads(
    versions: Mapping[str, Sequence[ModuleVersion]],
    wanted: Mapping[str, int],
    held: Mapping[str, int],
    steps: Mapping[str, Mapping[int, int]] | None = None,
) -> dict[str, ModuleDownload]:
    """Per module of the unit: `versions` are the module's rows (any order), `wanted` the
    unit's base versions, `held` what the worker says it has, `steps` each stepped
    version's base (OuterStep: version -> the version its update starts from; by default
    the version before). The chain is walked back from the wanted version to the held one
    and offered when every link's update and the held version are still there and the
    updates together are smaller than the fp32 file."""
    plans = {}
    for module_id, target in wanted.items():
        rows = {row.version: row for row in versions.get(module_id, ())}
        bases = (steps or {}).get(module_id, {})
        plan = ModuleDownload(rows[target])
        have = held.get(module_id)
        if have == target:
            plan.held = True
        elif have is not None and have < target and have in rows:
            links: list[tuple[ModuleVersion, ModuleVersion]] = []
            v = target
            while v > have and v in rows and rows[v].update_key:
                base = bases.get(v, v - 1)  # a round that kept the module made no version
                if base not in rows or base >= v:
                    break
                links.append((rows[base], rows[v]))
                v = base
            cost = sum(int(row.update_size or 0) for _, row in links)
            if v == have and cost < int(plan.version.size):
                plan.updates = [_link(before, row) for before, row in reversed(links)]
        plans[module_id] = plan
    return plans


def _link(before: ModuleVersion, row: ModuleVersion) -> dict[str, Any]:
    return {
        "from_version": before.version,
        "version": row.version,
        "key": row.update_key,
        "sha256": row.update_sha256,
        "size": int(row.update_size or 0),
        "from_sha256": before.sha256,
        "to_sha256": row.sha256,
    }
