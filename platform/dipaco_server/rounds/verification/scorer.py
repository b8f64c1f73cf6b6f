"""Proof of useful work (rounds.verification.rules.score_delta) for one module's outer step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from django.conf import settings
from torch import Tensor

from dipaco import codecs
from dipaco.data.ranged import store_shard
from dipaco.data.rows import StoreRows
from dipaco.data.scored import heldout_seed, heldout_windows, unit_seed, unit_windows_scored
from dipaco.data.shards import ShardIndex
from dipaco.data.windows import unit_windows
from dipaco.evaluate import window_count
from dipaco.flops import score_windows
from dipaco.model import build_model
from dipaco.modular import module_spec, modules_of_path
from dipaco.modules_file import read_module
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Contribution, Lease, Round, WorkUnit
from dipaco_server.rounds.verification import rules
from dipaco_server.rounds.verification.uploads import Upload, fetch
from dipaco_server.runs import keys
from dipaco_server.runs.device import autocast, server_device
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.prepare import data_index_key
from dipaco_server.runs.rows import row_index
from dipaco_server.storage import BlobNotFound, BlobStore

logger = logging.getLogger(__name__)

_PathKey = tuple[int, tuple[tuple[str, int], ...]]  # (path, the versions its Δ is relative to)


def score_secret() -> bytes:
    """The secret the scored windows are drawn with (dipaco.data.scored): the setting
    DIPACO_SCORE_SECRET where one is set, else Django's SECRET_KEY. Neither is ever sent to
    a worker, so it cannot tell before its upload which windows will score its Δ."""
    secret = getattr(settings, "DIPACO_SCORE_SECRET", "") or settings.SECRET_KEY
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def delta_bases(rows: Sequence[Contribution]) -> dict[int, tuple[tuple[str, int], ...]]:
    """Lease -> the versions its unit's Δ is relative to, every module of its path: the
    unit's base versions, with each contribution's recorded `base_version` over them."""
    bases = {c.lease_id: dict(c.unit.base_versions) for c in rows}
    recorded = Contribution.objects.filter(
        lease_id__in=list(bases), base_version__isnull=False
    ).values_list("lease_id", "module__module_id", "base_version")
    for lease_id, module_id, version in recorded:
        bases[lease_id][module_id] = version
    return {lease: tuple(sorted(versions.items())) for lease, versions in bases.items()}


def covered_windows(config: Any, lease_id: int) -> int | None:
    """The unit's windows its lease covered from the start: its steps (sized to the
    worker's speed, rounds.granted.lease_steps; 0: all H) x the batch. The server's own
    record, not the worker's claim. None: the whole unit."""
    steps = Lease.objects.filter(pk=lease_id).values_list("steps", flat=True).first()
    if not steps or steps >= config.inner.steps:
        return None
    return int(steps * config.inner.batch_size)


def granted_base(
    lease_id: int, delta_base: tuple[tuple[str, int], ...], covered: int | None
) -> rules.BaseLosses | None:
    """The base losses computed while the lease's unit trained (`Lease.base_losses`,
    unit_score.score_granted) when they are of the same versions and windows as its Δ's
    score needs; None otherwise (then the score computes them)."""
    if not lease_id:
        return None
    row = Lease.objects.filter(pk=lease_id).values_list("base_losses", flat=True).first()
    if not isinstance(row, dict) or row.get("base") != [list(p) for p in delta_base]:
        return None
    if row.get("covered") != covered:
        return None
    try:
        train = tuple(float(x) for x in row["train"])
        return rules.BaseLosses(train, float(row["heldout"]))
    except (KeyError, TypeError, ValueError):
        return None


class Scorer:
    """Proof of useful work for one module's step (rounds.verification.rules.score_delta): each Δ
    applied alone to its path's base weights, on `score_windows(config)` windows of its
    unit's own training data (``outer.score_flops`` at the run's model size) and as many
    held-out windows of the path's validation shard.

    Which windows is drawn by the server after the upload (dipaco.data.scored), with a
    seed from a secret it never sends (`score_secret`): the training windows from all of
    the unit's windows, keyed by run, phase, round, path and the unit's first position (so
    a unit's replicas are scored on the same windows), the held-out windows afresh each
    round from the whole validation split.

    A path's base modules, shards and base losses are loaded once per step, on first use;
    each further Δ costs two forward passes. The score is the unit's, not the module's: the
    first step of the round to compute it records it on the lease (`Lease.score`, with the
    versions it is relative to), and the steps of the path's other modules take it from there.
    Each Δ's own checks (size, digest, content, norm, direction) still run in its own step,
    and the digests pin what every step reads, so the recorded score is of the same bytes.
    CPU seconds spent: `seconds`; scores reused: `reused`.
    """

    def __init__(
        self, store: BlobStore, round_: Round, module: Module, config: Any, work: Path
    ) -> None:
        self.store, self.round, self.module = store, round_, module
        self.config, self.work = config, work
        self.device = server_device()  # a GPU where the Celery worker has one, in bf16
        self.model = build_model(config.model, config.seed).to(self.device)
        # Keyed by path and the versions its Δs are relative to (outer.overlap eager: the
        # unit's base versions, or those it rebased onto).
        self.paths: dict[_PathKey, tuple[dict[str, dict[str, Tensor]], Tensor]] = {}
        # Why a path could not be loaded (a shard or version missing): asked once per step,
        # not again for each of its Δs (each attempt downloaded the path's modules anew).
        self.unloadable: dict[_PathKey, Exception] = {}
        # (path key, the unit's position, the windows its lease covered) -> its base losses
        self.base: dict[tuple[_PathKey, int, int | None], rules.BaseLosses] = {}
        self.train: dict[int, Any] = {}
        self.dtype: Any = None
        self.seconds = 0.0
        self.scored = 0
        self.reused = 0

    def __call__(self, upload: Upload, delta: Mapping[str, Tensor]) -> rules.Score | None:
        """The unit's whole Δ scored (rounds.verification.rules.score_delta); CodecError when another
        module's upload of the unit is not what its worker declared."""
        with stages.timed("scoring"), autocast(self.device):
            return self._score(
                upload, lambda: {**self._siblings(upload), self.module.module_id: delta}
            )

    def whole_unit(self, upload: Upload) -> rules.Score | None:
        """The score of the unit `upload` belongs to, every module of it fetched from the
        store (the first round's settlement scores units of other modules' paths too)."""
        with stages.timed("scoring"), autocast(self.device):
            return self._score(upload, lambda: self._siblings(upload, exclude=False))

    def _score(
        self, upload: Upload, unit_deltas: Callable[[], dict[str, dict[str, Tensor]]]
    ) -> rules.Score | None:
        recorded = self._recorded(upload)
        if recorded is not None:
            self.reused += 1
            return recorded
        clock = time.process_time()
        try:
            key = (upload.path, upload.delta_base)
            modules, heldout = self._path(upload.path, upload.delta_base)
            covered = self._covered(upload)
            train = self._train_windows(upload.path, upload.position, covered)
            deltas = unit_deltas()
            before = self.base.get((key, upload.position, covered)) or granted_base(
                upload.lease_id, upload.delta_base, covered
            )
            score = rules.score_delta(
                self.config, upload.path, self.model, modules, deltas, train, heldout, before
            )
        except (BlobNotFound, ValueError, KeyError, ModuleVersion.DoesNotExist) as exc:
            # Nothing to score it on: the other checks still hold.
            logger.warning("contribution %d not scored: %s", upload.contribution_id, exc)
            return None
        finally:
            self.seconds += time.process_time() - clock
        if score.base is not None:
            self.base[(key, upload.position, covered)] = score.base
        self.scored += 1
        # A concurrent step of another module may have recorded it meanwhile: same inputs,
        # same score; the first write stays.
        Lease.objects.filter(pk=upload.lease_id, score__isnull=True).update(
            score={"base": [list(pair) for pair in upload.delta_base], **score.as_dict()}
        )
        return score

    def base_losses(
        self, p: int, delta_base: tuple[tuple[str, int], ...], position: int, covered: int | None
    ) -> rules.BaseLosses:
        """Path p's base losses (at the versions `delta_base`) on the scored windows of
        its unit at `position` whose lease covered `covered` windows: what the unit's score
        reads before its Δ is applied, which the Δ does not change (unit_score.score_granted)."""
        with stages.timed("scoring"), autocast(self.device):
            clock = time.process_time()
            try:
                modules, heldout = self._path(p, delta_base)
                train = self._train_windows(p, position, covered)
                return rules.base_losses(self.config, p, self.model, modules, train, heldout)
            finally:
                self.seconds += time.process_time() - clock

    def _recorded(self, upload: Upload) -> rules.Score | None:
        """The unit's score as another module's step recorded it, when it is relative to the
        same versions as this Δ; None otherwise."""
        if not upload.lease_id:
            return None
        row = Lease.objects.filter(pk=upload.lease_id).values_list("score", flat=True).first()
        if not isinstance(row, dict) or [list(p) for p in upload.delta_base] != row.get("base"):
            return None
        return rules.Score.from_dict(row)

    def _siblings(self, upload: Upload, *, exclude: bool = True) -> dict[str, dict[str, Tensor]]:
        """The unit's Δs of its path's other modules (every module without `exclude`),
        fetched and checked like its own."""
        others = Contribution.objects.filter(lease_id=upload.lease_id)
        if exclude:
            others = others.exclude(module_id=self.module.pk)
        deltas = {}
        for c in others.select_related("module"):
            sibling = Upload(c.pk, upload.worker_id, c.blob_key, c.size, c.sha256, c.tokens)
            path, _ = fetch(self.store, sibling, self.work)
            try:
                spec = module_spec(self.config, c.module.module_id)
                deltas[c.module.module_id] = codecs.decode(path, spec, verify_checksum=False)
            finally:
                path.unlink(missing_ok=True)
        return deltas

    def _path(
        self, p: int, delta_base: tuple[tuple[str, int], ...] = ()
    ) -> tuple[dict[str, dict[str, Tensor]], Tensor]:
        """Path p's modules at the versions its Δ is relative to (`delta_base`; (): its
        units' base versions) and its held-out windows."""
        if (p, delta_base) in self.paths:
            return self.paths[(p, delta_base)]
        if (p, delta_base) in self.unloadable:  # without the traceback of each earlier raise
            raise self.unloadable[(p, delta_base)].with_traceback(None)
        try:
            self.paths[(p, delta_base)] = self._load_path(p, delta_base)
        except (BlobNotFound, ValueError, KeyError, ModuleVersion.DoesNotExist) as exc:
            self.unloadable[(p, delta_base)] = exc
            raise
        return self.paths[(p, delta_base)]

    def _load_path(
        self, p: int, delta_base: tuple[tuple[str, int], ...]
    ) -> tuple[dict[str, dict[str, Tensor]], Tensor]:
        run_id, phase = self.module.run_id, self.module.phase
        versions = dict(delta_base)
        if not versions:
            unit = WorkUnit.objects.filter(round=self.round, path__index=p).first()
            versions = unit.base_versions if unit is not None else {}
        modules = {}
        for module_id in modules_of_path(self.config, p):
            version = ModuleVersion.objects.get(
                module__run_id=run_id,
                module__phase=phase,
                module__module_id=module_id,
                version=versions[module_id],
            )
            file = self.work / f"score-{module_id}.safetensors"
            self.store.download_to(version.blob_key, file)
            spec = module_spec(self.config, module_id)
            modules[module_id] = read_module(file, spec, version.sha256)
            file.unlink()
        if self.dtype is None:
            self.store.download_to(data_index_key(run_id, phase), self.work / "index.json")
            self.dtype = ShardIndex.load(self.work).dtype
        # score_windows(config) windows of the validation shard drawn for this round
        # (dipaco.data.scored), read by ranges in file order.
        val = store_shard(self.store, keys.data_key(run_id, p, "val", phase), self.dtype)
        T = self.config.model.seq_len
        picks = self.heldout_picks(p, window_count(len(val), T))
        if not picks.size:
            raise ValueError(f"path {p} has no held-out window to score on")
        heldout = torch.from_numpy(val.read_windows([int(i) * T for i in picks], T + 1))
        return modules, heldout

    def train_picks(self, p: int, position: int, covered: int | None = None) -> np.ndarray:
        """The positions of the scored training windows of path p's unit that starts at
        `position` this round, sorted: drawn from all of the unit's windows (those its
        lease covered: `covered`, None for all; dipaco.data.scored.unit_windows_scored)."""
        seed = unit_seed(score_secret(), self.module.run_id, self.module.phase, self.round.t,
                         p, position)  # fmt: skip
        return unit_windows_scored(
            position, unit_windows(self.config), score_windows(self.config), seed, covered
        )

    def _covered(self, upload: Upload) -> int | None:
        return covered_windows(self.config, upload.lease_id)

    def heldout_picks(self, p: int, windows: int) -> np.ndarray:
        """This round's held-out windows of path p (indices of its validation split's
        `windows` windows), sorted."""
        seed = heldout_seed(score_secret(), self.module.run_id, self.module.phase, self.round.t, p)
        return heldout_windows(windows, score_windows(self.config), seed)

    def _train_windows(self, p: int, position: int, covered: int | None = None) -> Tensor:
        """The unit's scored rows (`train_picks`), read from its path's row chunks (the rows
        the worker trained on: dipaco.data.rows) by ranged reads of those rows alone."""
        if p not in self.train:
            run_id, phase = self.module.run_id, self.module.phase
            index = row_index(self.store, run_id, p, phase)

            def read_range(chunk: int, start: int, end: int) -> bytes:
                key = keys.rows_chunk_key(run_id, p, chunk, phase)
                return self.store.get_range(key, start, end)

            self.train[p] = StoreRows(index, read_range)
        rows = self.train[p].read_at(self.train_picks(p, position, covered))
        return torch.from_numpy(rows)
