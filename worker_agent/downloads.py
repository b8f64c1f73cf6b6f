"""A unit's modules: kept from the last unit, rebuilt from encoded updates, or fetched whole.

The agent keeps the fp32 file of the version of each module it holds (in the blob cache,
by sha256) and an index of those versions per run (`HeldModules`,
``<cache>/held/run-<id>.json``). It tells the server what it holds when it asks for a
unit's manifest; the server then sends, with ``comm.download_codec`` int8 or fp16, the
encoded outer updates from the held version to the unit's (platform rounds.protocol.downloads).
`ModuleFetcher` applies them (dipaco.updates.apply_update: θ_t + decode(u) in fp32, as
the server computed the version it published), writes the result as a module file
(dipaco.modules_file, whose bytes are a function of the values and the module's spec),
and accepts it only if that file's sha256 is the server's: the worker then holds the
server's weights bit for bit. Anything that does not check out (a missing or foreign held
file, an update that fails its sha256 or dipaco.codecs' checks, a result that differs)
is logged and the module is fetched whole instead, as a new worker would.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from torch import Tensor

from dipaco import codecs
from dipaco.config import RunConfig
from dipaco.modular import module_spec
from dipaco.modules_file import CorruptModule, Spec, module_bytes, read_module, write_module
from dipaco.updates import apply_update
from worker_agent.client import BlobRef, Manifest, UpdateRef
from worker_agent.errors import ServerError
from worker_agent.payload import load_module
from worker_agent.transfer import BlobCache, ChecksumMismatch

__all__ = ["FetchStats", "HeldModules", "ModuleFetcher", "UpdateRefused"]

log = logging.getLogger(__name__)
_MODULE_ID = re.compile(r"^[a-z0-9.]{1,32}$")  # what the manifest's `held` parameter takes


class UpdateRefused(Exception):
    """Encoded updates that cannot rebuild the module: it is fetched whole instead."""


class HeldModules:
    """module id -> (version, sha256 of its fp32 file) the agent holds, per run."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _file(self, run_id: int) -> Path:
        return self.root / f"run-{int(run_id)}.json"

    def load(self, run_id: int) -> dict[str, tuple[int, str]]:
        try:
            raw = json.loads(self._file(run_id).read_text())
            return {str(m): (int(v[0]), str(v[1])) for m, v in raw.items()}
        except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
            return {}  # missing or torn: the server sends whole modules

    def save(self, run_id: int, held: Mapping[str, tuple[int, str]]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        target = self._file(run_id)
        tmp = target.with_name(target.name + ".tmp")
        tmp.write_text(json.dumps({m: list(v) for m, v in held.items()}, sort_keys=True))
        os.replace(tmp, target)


@dataclass
class FetchStats:
    """What one manifest's modules cost: bytes of encoded updates, of whole fp32 files."""

    update_bytes: int = 0
    module_bytes: int = 0
    from_updates: int = 0  # modules rebuilt from encoded updates
    whole: int = 0  # modules fetched (or found in the cache) whole
    held: int = 0  # modules the agent held at the unit's version already
    fallbacks: int = 0  # updates refused, module fetched whole


class ModuleFetcher:
    def __init__(self, cache: BlobCache, held: HeldModules) -> None:
        self.cache, self.held = cache, held

    def held_versions(self, run_id: int, modules: Sequence[str]) -> dict[str, int]:
        """What to tell the server about the unit's `modules`: the versions held whose
        files are still in the cache."""
        held = self.held.load(run_id)
        return {
            m: held[m][0]
            for m in modules
            if m in held and _MODULE_ID.match(m) and self._cached(held[m][1])
        }

    def _cached(self, sha256: str) -> bool:
        try:
            return self.cache.path_for(sha256).exists()
        except ValueError:  # not a sha256: a foreign index
            return False

    def fetch(
        self, run_id: int, manifest: Manifest, config: RunConfig
    ) -> tuple[dict[str, dict[str, Tensor]], FetchStats]:
        """Every module of the manifest, checked against the run's module spec."""
        held = self.held.load(run_id)
        stats = FetchStats()
        modules = {}
        for ref in manifest.modules:
            blob = self._blob(ref, held.get(ref.module_id), config, stats)
            modules[ref.module_id] = load_module(blob, config, ref.module_id)
            held[ref.module_id] = (ref.version, ref.sha256)
        self.held.save(run_id, held)
        return modules, stats

    def _blob(
        self, ref: BlobRef, have: tuple[int, str] | None, config: RunConfig, stats: FetchStats
    ) -> Path:
        what = f"module {ref.module_id} v{ref.version}"
        if have == (ref.version, ref.sha256) and self._cached(ref.sha256):
            stats.held += 1
            return self.cache.fetch(ref.url, ref.sha256, ref.size, what=what)  # re-hashed
        if ref.updates and have is not None:
            before = self.cache.transfers.meter.total_bytes
            try:
                path = self.rebuild(ref, have, config)
            except UpdateRefused as exc:
                log.warning("%s: falling back to the whole fp32 file: %s", what, exc)
                stats.fallbacks += 1
            else:
                stats.from_updates += 1
                stats.update_bytes += self.cache.transfers.meter.total_bytes - before
                return path
        before = self.cache.transfers.meter.total_bytes
        path = self.cache.fetch(ref.url, ref.sha256, ref.size, what=what)
        stats.whole += 1
        stats.module_bytes += self.cache.transfers.meter.total_bytes - before
        return path

    def rebuild(self, ref: BlobRef, have: tuple[int, str], config: RunConfig) -> Path:
        """Version `ref.version` from the held file and the encoded updates; UpdateRefused
        unless every link checks out and the result is the server's file, byte for byte."""
        spec = module_spec(config, ref.module_id)
        version, sha256 = have
        start = ref.updates[0]
        if start.from_version != version:
            raise UpdateRefused(
                f"the updates start from v{start.from_version}, the agent holds v{version}"
            )
        if start.from_sha256 != sha256:  # e.g. a dense phase's module of the same id
            raise UpdateRefused(f"the v{version} the agent holds is not the server's")
        try:
            weights = read_module(self.cache.path_for(sha256), spec, sha256)
        except (OSError, CorruptModule) as exc:
            raise UpdateRefused(f"the held v{version} is gone or corrupt ({exc})") from exc
        limit = module_bytes(spec)  # an encoded update is never larger than the fp32 file
        out = self.cache.root / "rebuild.tmp"  # one unit, one module at a time
        try:
            for update in ref.updates:
                if (update.from_version, update.from_sha256) != (version, sha256):
                    raise UpdateRefused(
                        f"the update to v{update.version} does not follow v{version}"
                    )
                weights = self._apply(ref, update, weights, spec, limit, out)
                version, sha256 = update.version, update.to_sha256
            if (version, sha256) != (ref.version, ref.sha256):
                raise UpdateRefused(f"the updates end at v{version}, the unit needs v{ref.version}")
            target = self.cache.path_for(ref.sha256)
            os.replace(out, target)
            return target
        finally:
            out.unlink(missing_ok=True)

    def _apply(
        self,
        ref: BlobRef,
        update: UpdateRef,
        weights: dict[str, Tensor],
        spec: Spec,
        limit: int,
        out: Path,
    ) -> dict[str, Tensor]:
        step = f"update v{update.from_version} -> v{update.version} of module {ref.module_id}"
        if update.size > limit:
            raise UpdateRefused(f"{step} declares {update.size} B, more than the fp32 module")
        try:
            data = self.cache.fetch(update.url, update.sha256, update.size, what=step)
            new = apply_update(weights, data, spec)
        except (
            codecs.CodecError,
            ChecksumMismatch,
            ServerError,
            httpx.HTTPError,
            ValueError,
        ) as exc:
            raise UpdateRefused(f"{step} is unusable: {exc}") from exc
        digest, _ = write_module(out, {name: new[name] for name in spec})
        if digest != update.to_sha256:
            raise UpdateRefused(f"{step} does not rebuild the server's v{update.version}")
        return new
