"""One module's outer step in one round (docs/design.md §4.4): verify, aggregate, Nesterov, publish.

`step_module(run_id, module_id, t)` runs in two passes over the module's contributions,
each streamed from the object store to a temporary file, one at a time:

1. **verify** each upload before anything uses it (docs/design.md §7; S3 test servers enforce
   neither size nor signature): size and sha256 against what the worker declared,
   hashed as it downloads; then `codecs.verify` against the module's spec (header,
   names, shapes, dtypes, finite values) for its norm. Norms above
   ``outer.reject_norm_factor`` x the median of the verified ones are outliers. Then the
   checks that hold with one or two Δs a round (rounds.verify, ``outer.verify``): replay
   (an upload's bytes seen before in the run), its norm against the module's history (the
   accepted medians of its last ``outer.history_rounds`` steps), its cosine with the
   module's outer momentum, and proof of useful work (`Scorer`: applied alone to its
   path's base weights it must lower the loss on its unit's own training windows and not
   raise the held-out loss beyond a tolerance).
2. **aggregate** the accepted ones into one fp32 sum (`codecs.accumulate`, token weights,
   the robust rule), the √(contributing paths) rescale, then Nesterov at round t's outer
   lr chunk by chunk, streaming version `base` and its momentum (module files,
   runs.prepare) in and t + 1 out. The arithmetic is dipaco.outer's (`DeltaAccumulator`
   fed the uploads still encoded, `clip_threshold`, `trimmed_mean`, `rescale_factor`,
   `outer_lr`, `outer_step`), so the server steps exactly as the simulator does.

Memory, whatever the number of contributions: pass 1 holds one upload (<= 1x the fp32
module); pass 2 the fp32 sum plus one upload plus chunks; the trimmed mean, which needs
every Δ per value, decodes them to disk and works in chunks. Uploads wait between the
passes in the data dir's tmp/ (not a RAM-backed /tmp). Measured: docs/benchmarks.md.

Crash safety: the step first writes its blobs (weights, momentum, with
comm.download_codec the encoded update and its residual) under their deterministic keys
(runs.keys), outside any transaction (a whole-module copy must not hold the row lock, or
SQLite's one write lock). Then one transaction, under a lock on the module row, publishes
the ModuleVersion, settles every contribution and writes the OuterStep row. Nothing is
visible until that commit: a crash before it leaves at most unreferenced blobs, which the
retry overwrites with the same step's bytes; an OuterStep row makes any later delivery a
no-op, and the lock makes a concurrent duplicate wait and then find it. Tests arm a `Fault` at that point through ``$DIPACO_FAULTS_DIR``.
"""

from __future__ import annotations

import enum
import hashlib
import io
import logging
import math
import os
import shutil
import signal
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from torch import Tensor

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.config import CommConfig, OuterConfig
from dipaco.data.windows import unit_tokens
from dipaco.modules_file import ModuleReader, ModuleWriter, Spec, read_module
from dipaco.outer import (
    DeltaAccumulator,
    norm_outliers,
    outer_lr,
    outer_step,
    rescale_factor,
    trimmed_mean,
)
from dipaco_server.rounds import verify
from dipaco_server.rounds.close import previous_published
from dipaco_server.rounds.lease import lease_tokens
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round, WorkUnit
from dipaco_server.rounds.publish import EncodedUpdate, encode_update, publish_module_version
from dipaco_server.rounds.replication import CHECK_OFFSET
from dipaco_server.runs import keys
from dipaco_server.runs.errors import RoundClosed
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.phases import local_round, round_config
from dipaco_server.runs.prepare import data_index_key, work_root
from dipaco_server.storage import BlobNotFound, BlobStore, get_blob_store
from dipaco_server.workers import trust
from dipaco_server.workers.models import Worker

logger = logging.getLogger(__name__)

DOWNLOAD_CHUNK = 1 << 20
STEP_CHUNK = 1 << 18  # values per Nesterov chunk: 1 MiB per temporary
TRIM_CHUNK = 1 << 18  # values x contributions per trimmed-mean chunk (sort keeps ~7 copies)
FAULTS_DIR_ENV = "DIPACO_FAULTS_DIR"


class Fault(enum.Enum):
    """Faults a test arms by creating ``$DIPACO_FAULTS_DIR/<value>``; each fires once."""

    KILL_AFTER_BLOB_WRITE = "kill-after-blob-write"  # SIGKILL: a worker dying mid-step
    RAISE_AFTER_BLOB_WRITE = "raise-after-blob-write"  # an error between blobs and commit


class InjectedFault(RuntimeError):
    pass


def inject(fault: Fault) -> None:
    folder = os.environ.get(FAULTS_DIR_ENV)
    if not folder:
        return
    try:
        (Path(folder) / fault.value).unlink()  # atomic: exactly one process consumes it
    except FileNotFoundError:
        return
    logger.warning("injected fault %s in process %d", fault.value, os.getpid())
    if fault is Fault.KILL_AFTER_BLOB_WRITE:
        os.kill(os.getpid(), signal.SIGKILL)
    raise InjectedFault(f"injected fault {fault.value}")


# --- the computation (no database) -------------------------------------------------------


@dataclass(frozen=True)
class Upload:
    """One contribution as the outer step sees it: where it is and what its worker declared."""

    contribution_id: int
    worker_id: int
    key: str
    size: int
    sha256: str
    tokens: int
    path: int = 0  # the index of the path its unit trained: the √ rescale counts these
    unit_id: int = 0
    lease_id: int = 0
    position: int = 0  # the unit's data_position: where its training windows start
    replayed: bool = False  # its sha256 was uploaded before in this run (rounds.verify)
    check_of: int | None = None  # a check copy's: the original's contribution (replication)
    partial: bool = False  # salvaged before its lease's steps were done (issue 20)
    # The fraction of a whole unit's H steps it trained: a lease sized down (to the round's
    # deadline, a calibration) or a salvaged Δ is honest work that moves the loss less.
    work: float = 1.0
    # (module id, version) of every module of its path: the versions its unit's Δ is
    # relative to (the unit's base, or with outer.overlap eager those it rebased onto,
    # rounds.rebase); proof of useful work scores it there. (): the unit's base versions.
    delta_base: tuple[tuple[str, int], ...] = ()


@dataclass
class Verdict:
    upload: Upload
    file: Path | None = None  # the verified local copy while it is needed
    norm: float | None = None
    reason: str = ""  # "<code>: <message>" when rejected
    cosine: float | None = None  # with the module's outer momentum
    score: verify.Score | None = None  # proof of useful work

    @property
    def accepted(self) -> bool:
        return not self.reason

    def reject(self, code: str, message: str) -> None:
        self.reason = f"{code}: {message}"
        if self.file is not None:
            self.file.unlink(missing_ok=True)
            self.file = None


@dataclass(frozen=True)
class BaseVersion:
    """The version the round's contributions were trained from."""

    version: int
    key: str
    sha256: str
    momentum_key: str
    residual_key: str = ""  # its published update's error feedback (rounds.publish)


@dataclass
class StepResult:
    verdicts: list[Verdict]
    weights: Path | None = None  # None: nothing accepted, the module keeps its version
    weights_sha256: str = ""
    weights_size: int = 0
    momentum: Path | None = None
    update: EncodedUpdate | None = None  # comm.download_codec int8/fp16: t -> t + 1 encoded
    median_norm: float | None = None
    update_norm: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    replicas: list[tuple[int, int, bool]] = field(default_factory=list)  # (worker, worker, agreed)

    @property
    def accepted_median_norm(self) -> float | None:
        """The median norm of the accepted Δs: the module's history for later rounds."""
        norms = [v.norm for v in self.verdicts if v.accepted and v.norm is not None]
        return statistics.median(norms) if norms else None


# (upload, its decoded Δ) -> its score, or None when it cannot be scored
ScoreFn = Callable[[Upload, Mapping[str, Tensor]], "verify.Score | None"]


def fetch(store: BlobStore, upload: Upload, directory: Path) -> tuple[Path, bytearray]:
    """Download one upload to a file and to memory (for pass 1, which then drops it),
    refusing it unless its size and sha256 are the ones declared.

    The declared size is bounded by the completion check (an fp32 module plus a header),
    and a larger upload is refused as soon as it passes that size.
    """
    path = directory / f"contribution-{upload.contribution_id}.safetensors"
    digest, size, data = hashlib.sha256(), 0, bytearray(upload.size)
    try:
        stream: BinaryIO = store.open(upload.key)
    except BlobNotFound:
        raise CodecError("missing", "nothing was uploaded under its key") from None
    complete = False
    try:
        with stream, open(path, "wb") as out:
            while chunk := stream.read(DOWNLOAD_CHUNK):
                if size + len(chunk) > upload.size:
                    raise CodecError("size_mismatch", f"larger than the {upload.size} B declared")
                data[size : size + len(chunk)] = chunk
                size += len(chunk)
                digest.update(chunk)
                out.write(chunk)
        if size != upload.size:
            raise CodecError("size_mismatch", f"{size} B uploaded, {upload.size} B declared")
        if digest.hexdigest() != upload.sha256:
            raise CodecError("checksum_mismatch", "its sha256 differs from the one declared")
        complete = True
    finally:
        if not complete:
            path.unlink(missing_ok=True)
    return path, data


def check_upload(store: BlobStore, upload: Upload, spec: Spec, work: Path) -> tuple[Path, float]:
    """Fetch one upload and check it completely: (its file, its norm), or CodecError."""
    path, data = fetch(store, upload, work)
    try:
        # The whole blob's sha256 was checked while it downloaded; the per-tensor digests
        # inside come from the same worker and would add nothing.
        stats = codecs.verify(data, spec, verify_checksum=False)
    except CodecError:
        path.unlink()
        raise
    if not math.isfinite(stats.norm):
        path.unlink()
        raise CodecError("norm_overflow", "its norm overflows fp32")
    return path, stats.norm


def verify_uploads(
    store: BlobStore,
    uploads: Sequence[Upload],
    spec: Spec,
    reject_norm_factor: float,
    work: Path,
    *,
    cfg: OuterConfig | None = None,
    history: Sequence[float] = (),
    momentum: Mapping[str, Tensor] | None = None,
    scorer: ScoreFn | None = None,
) -> list[Verdict]:
    """Pass 1: every upload fetched, checked and measured; outliers by norm rejected; then,
    with `cfg` and ``cfg.verify``, the history, direction and useful-work checks."""
    verdicts = []
    for upload in uploads:
        verdict = Verdict(upload)
        try:
            verdict.file, verdict.norm = check_upload(store, upload, spec, work)
        except CodecError as exc:  # the codec's refusals and ours share one shape
            verdict.reject(exc.code, str(exc))
        verdicts.append(verdict)
    verified = [v for v in verdicts if v.accepted]
    if verified:
        norms = [float(v.norm or 0.0) for v in verified]
        median = statistics.median(norms)
        for verdict, outlier in zip(
            verified, norm_outliers(norms, reject_norm_factor), strict=True
        ):
            if outlier:
                verdict.reject(
                    "norm_outlier",
                    f"norm {verdict.norm:.4g} exceeds {reject_norm_factor:g} x the round's "
                    f"median {median:.4g} (outer.reject_norm_factor)",
                )
    if cfg is not None and cfg.verify:
        screen_verdicts(verdicts, spec, cfg, history, momentum, scorer)
    return verdicts


def screen_verdicts(
    verdicts: Sequence[Verdict],
    spec: Spec,
    cfg: OuterConfig,
    history: Sequence[float],
    momentum: Mapping[str, Tensor] | None,
    scorer: ScoreFn | None,
) -> None:
    """rounds.verify's checks on the verified uploads, one decoded Δ in memory at a time."""
    candidates = []
    for v in verdicts:
        if not v.accepted or v.file is None:
            continue
        needs_delta = momentum is not None or (scorer is not None and cfg.score)
        if needs_delta and not v.upload.replayed and (v.norm or 0.0) > 0:
            delta = codecs.decode(v.file, spec, verify_checksum=False)
            if momentum is not None:
                v.cosine = verify.cosine(delta, momentum)
            if scorer is not None and cfg.score:
                try:
                    v.score = scorer(v.upload, delta)
                except CodecError as exc:  # another module's Δ of its unit is unusable
                    v.reject("unit_invalid", f"its unit's Δ cannot be scored: {exc}")
                    continue
            del delta
        candidates.append(
            verify.Candidate(
                v.upload.contribution_id,
                float(v.norm or 0.0),
                cosine=v.cosine,
                score=v.score,
                replayed=v.upload.replayed,
                work=v.upload.work,
            )
        )
    refused = verify.screen(candidates, history, cfg)
    for v in verdicts:
        reason = refused.get(v.upload.contribution_id)
        if reason:
            code, _, message = reason.partition(": ")
            v.reject(code, message)


def compare_replicas(
    verdicts: Sequence[Verdict], spec: Spec, cfg: OuterConfig
) -> list[tuple[int, int, bool]]:
    """Each check copy's Δ against its original's (rounds.replication, rounds.verify
    .replicas_agree): on a disagreement both are rejected. (worker, worker, agreed) per
    pair that could be compared: both uploads verified and not refused otherwise, and
    trained on the same number of tokens."""
    by_id = {v.upload.contribution_id: v for v in verdicts}
    pairs = []
    for check in verdicts:
        original = by_id.get(check.upload.check_of) if check.upload.check_of else None
        if original is None or not (check.accepted and original.accepted):
            continue
        if check.upload.tokens != original.upload.tokens:
            # One of them was salvaged partway (or sized to another speed): Δs of different
            # lengths of training are not comparable, and neither says the other is wrong.
            continue
        if check.upload.delta_base != original.upload.delta_base:
            # outer.overlap eager: one rebased onto round t - 1's versions, the other could
            # not in time (rounds.rebase). Relative to other versions, they are not comparable.
            continue
        assert check.file is not None and original.file is not None
        agree, why = verify.replicas_agree(
            codecs.decode(original.file, spec, verify_checksum=False),
            codecs.decode(check.file, spec, verify_checksum=False),
            cfg,
        )
        pairs.append((original.upload.worker_id, check.upload.worker_id, agree))
        if not agree:
            message = f"two workers trained unit {original.upload.unit_id}: {why}"
            original.reject(verify.REPLICA, message)
            check.reject(verify.REPLICA, message)
    return pairs


def contributing_paths(accepted: Sequence[Verdict]) -> int:
    """The distinct paths among the accepted contributions: what DiPaCo's √ rescale counts
    (dipaco.outer.rescale_factor), not the layout's paths through the module; a path that
    is stopped, or whose uploads were all refused, adds no Δ to the mean."""
    return len({v.upload.path for v in accepted})


def aggregate_uploads(
    accepted: Sequence[Verdict],
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    history: Sequence[float] = (),
) -> dict[str, Tensor]:
    """Pass 2: the module's outer gradient in fp32, as dipaco.outer.aggregate computes it
    with ``paths_through=contributing_paths(accepted)``: the library's DeltaAccumulator
    (weights, clipping) fed the verified uploads still encoded, and its trimmed_mean."""
    if cfg.robust == "trimmed-mean":
        grad = _trimmed_mean(accepted, spec, cfg, work)
    else:
        limit = None
        if cfg.robust == "clipped-mean":
            # x the module's reference norm (its history), the round's median at first
            limit = verify.clip_limit([float(v.norm or 0.0) for v in accepted], history, cfg)
        accumulator = DeltaAccumulator(spec, token_weighting=cfg.token_weighting, clip_norm=limit)
        for verdict in accepted:
            assert verdict.file is not None
            # Its sha256 was checked as it downloaded (pass 1).
            accumulator.add_encoded(
                verdict.file, verdict.upload.tokens, norm=verdict.norm, verify_checksum=False
            )
        grad = accumulator.mean(in_place=True)  # no second copy of the module
    factor = rescale_factor(cfg, contributing_paths(accepted))
    if factor != 1.0:
        for tensor in grad.values():
            tensor.mul_(factor)
    return grad


def _trimmed_mean(
    accepted: Sequence[Verdict], spec: Spec, cfg: OuterConfig, work: Path
) -> dict[str, Tensor]:
    """dipaco.outer.trimmed_mean, chunk by chunk over Δs decoded to raw fp32 files."""
    raw_files = []
    for verdict in accepted:  # one decoded Δ in memory at a time
        assert verdict.file is not None
        decoded = codecs.decode(verdict.file, spec, verify_checksum=False)
        raw = verdict.file.with_suffix(".f32")
        with open(raw, "wb") as out:
            for name in spec:
                out.write(decoded[name].contiguous().view(torch.uint8).numpy().data)
        del decoded
        raw_files.append(raw)
    tokens = [v.upload.tokens for v in accepted]
    chunk = max(1, TRIM_CHUNK // len(accepted))
    result = {name: torch.empty(shape, dtype=torch.float32) for name, (shape, _) in spec.items()}
    handles = [open(raw, "rb") for raw in raw_files]  # noqa: SIM115 (closed below)
    try:
        for name, flat in ((n, t.view(-1)) for n, t in result.items()):
            for start in range(0, flat.numel(), chunk):
                count = min(chunk, flat.numel() - start)
                pieces = [{name: _read_floats(h, count)} for h in handles]  # n x (count,)
                flat[start : start + count] = trimmed_mean(
                    pieces, tokens, cfg.trim_fraction, token_weighting=cfg.token_weighting
                )[name]
    finally:
        for handle in handles:
            handle.close()
    return result


def _read_floats(handle: io.BufferedReader, count: int) -> Tensor:
    values = torch.empty(count, dtype=torch.float32)
    if handle.readinto(values.view(torch.uint8).numpy().data) != 4 * count:
        raise OSError(f"{handle.name} ended early; the work directory was changed under us")
    return values


def apply_step(
    store: BlobStore,
    base: BaseVersion,
    grad: Mapping[str, Tensor],
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    lr: float,
) -> tuple[Path, str, int, Path | None]:
    """dipaco.outer.outer_step at outer learning rate `lr`, chunk by chunk, streaming version
    `base` and its momentum in: (weights file, its sha256, its size, momentum file)."""
    base_path, base_momentum = work / "base.safetensors", None
    store.download_to(base.key, base_path)
    if base.momentum_key and cfg.momentum:
        base_momentum = work / "base-momentum.safetensors"
        store.download_to(base.momentum_key, base_momentum)
    weights_path, momentum_path = work / "weights.safetensors", work / "momentum.safetensors"
    with (
        ModuleReader(base_path, spec, base.sha256) as params,
        ModuleReader(base_momentum, spec) if base_momentum else nullcontext() as buffer,
        ModuleWriter(weights_path, spec) as weights_out,
        ModuleWriter(momentum_path, spec) if cfg.momentum else nullcontext() as momentum_out,
    ):
        for name, (shape, _) in spec.items():
            flat = grad[name].view(-1)
            for start in range(0, math.prod(shape), STEP_CHUNK):
                g = flat[start : start + STEP_CHUNK]  # (c,)
                p = params.read(g.numel())  # (c,)
                m = {name: buffer.read(g.numel())} if buffer is not None else None  # (c,)
                new_p, new_m = outer_step({name: p}, {name: g}, m, cfg, lr=lr)
                weights_out.write(new_p[name])
                if momentum_out is not None:
                    momentum_out.write(new_m[name])
        params.finish()  # raises if version `base` is not the one the database names
        if buffer is not None:
            buffer.finish()
        digest, size = weights_out.close()
        if momentum_out is not None:
            momentum_out.close()
    return weights_path, digest, size, momentum_path if cfg.momentum else None


def compute_step(
    store: BlobStore,
    uploads: Sequence[Upload],
    base: BaseVersion | None,
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    *,
    round_index: int,
    history: Sequence[float] = (),
    momentum: Mapping[str, Tensor] | None = None,
    scorer: ScoreFn | None = None,
    comm: CommConfig | None = None,
) -> StepResult:
    """Verify, aggregate and step in `work`; the outputs stay there for the caller.

    `round_index` is the 0-based round of the run's config whose step this is: it sets
    the outer learning rate (dipaco.outer.outer_lr, cfg.warmup_rounds). `history`: the
    module's accepted median norms of earlier rounds; `momentum`: its outer momentum at
    the base version; `scorer`: proof of useful work (rounds.verify). With `comm` whose
    ``download_codec`` is not fp32, the step is published as an encoded update and the
    weights are the base plus exactly its decoded values (rounds.publish.encode_update).
    """
    clock = time.perf_counter()
    verdicts = verify_uploads(
        store,
        uploads,
        spec,
        cfg.reject_norm_factor,
        work,
        cfg=cfg,
        history=history,
        momentum=momentum,
        scorer=scorer,
    )
    result = StepResult(verdicts)
    result.replicas = compare_replicas(verdicts, spec, cfg)
    result.timings["verify"] = time.perf_counter() - clock
    norms = [v.norm for v in result.verdicts if v.norm is not None]
    result.median_norm = statistics.median(norms) if norms else None
    for v in result.verdicts:  # check copies are compared, never aggregated
        if v.upload.check_of is not None and v.file is not None:
            v.file.unlink(missing_ok=True)
            v.file = None
    accepted = [v for v in result.verdicts if v.accepted and v.upload.check_of is None]
    if accepted:
        if base is None:
            raise ValueError("contributions without a base version: the round has no units")
        grad = aggregate_uploads(accepted, spec, cfg, work, history)
        result.timings["aggregate"] = time.perf_counter() - clock
        for verdict in accepted:  # done with them: free the disk before the step
            if verdict.file is not None:
                verdict.file.unlink(missing_ok=True)
            verdict.file = None
        result.update_norm = math.sqrt(
            sum(float(torch.linalg.vector_norm(t)) ** 2 for t in grad.values())
        )
        lr = outer_lr(cfg, round_index)
        weights, digest, size, new_momentum = apply_step(store, base, grad, spec, cfg, work, lr)
        if comm is not None and comm.download_codec != "fp32":
            residual = None
            if base.residual_key:
                residual = work / "base-residual.safetensors"
                store.download_to(base.residual_key, residual)
            digest, size, result.update = encode_update(
                work / "base.safetensors", base.sha256, weights, residual, spec, comm, work
            )
        result.weights, result.weights_sha256, result.weights_size = weights, digest, size
        result.momentum = new_momentum
        result.tokens = sum(v.upload.tokens for v in accepted)
    result.seconds = time.perf_counter() - clock
    return result


# --- the database side ------------------------------------------------------------------


def _report(step: OuterStep, module_id: str, t: int, *, replayed: bool) -> dict[str, Any]:
    """The task's result: what the step did, and whether an earlier delivery did it."""
    done = {f: getattr(step, f) for f in ("outcome", "version", "accepted", "rejected")}
    return {"module_id": module_id, "t": t, **done, "replayed": replayed, "pid": os.getpid()}


def step_module(
    run_id: int, module_id: str, t: int, *, store: BlobStore | None = None
) -> dict[str, Any]:
    """Apply round t's outer step to one module once, however often it is called."""
    from dipaco.modular import module_spec  # transformers: seconds to import

    round_ = Round.objects.select_related("run").get(run_id=run_id, t=t)
    # Round t trains the modules of its phase, with that phase's config (runs.phases).
    phase, config = round_config(round_.run.run_config, t)
    module = Module.objects.select_related("run").get(
        run_id=run_id, phase=phase, module_id=module_id
    )
    if round_.state == Round.State.OPEN:
        raise RoundClosed(f"round {t} of run {run_id} is still open; close it before stepping")
    done = OuterStep.objects.filter(round=round_, module=module).first()
    if done is not None:
        return _report(done, module_id, t, replayed=True)
    if not previous_published(round_):
        # outer.overlap delayed: round t's Δs go onto round t - 1's versions (staleness 1).
        raise RoundClosed(
            f"round {t - 1} of run {run_id} has not published its versions; round {t}'s "
            "outer step runs after it (close_round waits for that)"
        )
    store = store or get_blob_store()
    pending = Contribution.objects.filter(
        module=module, unit__round=round_, status=Contribution.Status.PENDING
    )
    # Path by path, then replica, as dipaco simulate adds them: a float sum depends on its
    # order, and completion order (pk) depends on which worker finished first.
    ordered = pending.select_related("lease", "unit__path").order_by(
        "unit__path__index", "unit__replica", "pk"
    )
    # Each Δ weighs its tokens, capped at what its lease allowed (rounds.lease.size_unit),
    # never only at what the completion claimed: a partial or sized unit weighs less.
    rows = list(ordered)
    whole_unit = unit_tokens(config)
    delta_bases = _delta_bases(rows)
    replays = _replays(run_id, t, rows)
    checks = _check_copies(rows)  # identical bytes to their originals: agreement
    uploads = [
        Upload(
            c.pk,
            c.lease.worker_id,
            c.blob_key,
            c.size,
            c.sha256,
            min(c.tokens, lease_tokens(c.lease, config)),
            c.unit.path.index,
            unit_id=c.unit_id,
            lease_id=c.lease_id,
            position=c.unit.data_position,
            replayed=c.pk in replays,
            check_of=checks.get(c.pk),
            partial=c.tokens < lease_tokens(c.lease, config),
            work=min(1.0, min(c.tokens, lease_tokens(c.lease, config)) / whole_unit),
            delta_base=delta_bases[c.lease_id],
        )
        for c in rows
    ]
    # The version the units trained from (their Δs' reference, scored on it by Scorer), and
    # the one the step applies onto: the same, or with outer.overlap delayed the newer one
    # that round t - 1 published while round t trained. With "eager" the units that rebased
    # are relative to that newer one already (rounds.rebase): applied onto it, no staleness.
    base = _base_version(round_, module)
    if base is not None and config.outer.overlap != "none":
        base = _latest_version(module, t)
    spec = module_spec(config, module_id)
    work = Path(tempfile.mkdtemp(prefix=f"outer-{run_id}-{module_id}-{t}-", dir=work_root()))
    try:
        outer = config.outer
        momentum, scorer = None, None
        if outer.verify and uploads and base is not None:
            momentum = _momentum(store, base, spec, work)
            if outer.score:
                scorer = Scorer(store, round_, module, config, work)
        result = compute_step(
            store,
            uploads,
            base,
            spec,
            outer,
            work,
            round_index=local_round(round_.run.run_config, t),
            history=_history(module, t, outer.history_rounds),
            momentum=momentum,
            scorer=scorer,
            comm=config.comm,
        )
        report = _commit(store, module, round_, base, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info(
        "run %s round %d module %s: %s in %.2f s", run_id, t, module_id, report, result.seconds
    )
    return report


def _delta_bases(rows: Sequence[Contribution]) -> dict[int, tuple[tuple[str, int], ...]]:
    """Lease -> the versions its unit's Δ is relative to, every module of its path: the
    unit's base versions, with each contribution's recorded `base_version` over them."""
    bases = {c.lease_id: dict(c.unit.base_versions) for c in rows}
    recorded = Contribution.objects.filter(
        lease_id__in=list(bases), base_version__isnull=False
    ).values_list("lease_id", "module__module_id", "base_version")
    for lease_id, module_id, version in recorded:
        bases[lease_id][module_id] = version
    return {lease: tuple(sorted(versions.items())) for lease, versions in bases.items()}


def _check_copies(rows: Sequence[Contribution]) -> dict[int, int]:
    """Check copy's contribution -> its original's (same path and windows), among `rows`.
    A copy whose original brought no Δ is an ordinary contribution."""
    originals = {
        (c.unit.path_id, c.unit.data_position): c.pk for c in rows if c.unit.replica < CHECK_OFFSET
    }
    return {
        c.pk: originals[(c.unit.path_id, c.unit.data_position)]
        for c in rows
        if c.unit.replica >= CHECK_OFFSET and (c.unit.path_id, c.unit.data_position) in originals
    }


def _replays(run_id: int, t: int, rows: Sequence[Contribution]) -> set[int]:
    """The contributions whose bytes (sha256) a contribution of an earlier round carried.

    Within one round, identical bytes from two units say only that both computed the same
    thing (a deterministic machine, the same base and windows): which one copied cannot be
    told, and the first to complete is not always the honest one (bench/attacks.py
    measured an honest worker refused that way), so they are left to the other checks.
    """
    earlier = Contribution.objects.filter(
        unit__round__run_id=run_id, unit__round__t__lt=t, sha256__in={c.sha256 for c in rows}
    ).values_list("sha256", flat=True)
    seen = set(earlier)
    return {c.pk for c in rows if c.sha256 in seen}


def _history(module: Module, t: int, rounds: int) -> list[float]:
    """The module's accepted median Δ norms of its last `rounds` steps before round t."""
    steps = OuterStep.objects.filter(
        module=module, round__t__lt=t, median_norm__isnull=False, accepted__gt=0
    ).order_by("-round__t")
    return [float(n) for n in steps.values_list("median_norm", flat=True)[:rounds]]


def _momentum(
    store: BlobStore, base: BaseVersion, spec: Spec, work: Path
) -> dict[str, Tensor] | None:
    """The module's outer momentum at the base version (None before its first step)."""
    if not base.momentum_key:
        return None
    path = work / "momentum-check.safetensors"
    store.download_to(base.momentum_key, path)
    try:
        return read_module(path, spec)
    finally:
        path.unlink(missing_ok=True)


_PathKey = tuple[int, tuple[tuple[str, int], ...]]  # (path, the versions its Δ is relative to)


class Scorer:
    """Proof of useful work for one module's step (rounds.verify.score_delta): each Δ
    applied alone to its path's base weights, on ``outer.score_windows`` windows of its
    unit's own training data and as many held-out windows of the path's validation shard.

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
        from dipaco.model import build_model

        self.store, self.round, self.module = store, round_, module
        self.config, self.work = config, work
        self.model = build_model(config.model, config.seed)
        # Keyed by path and the versions its Δs are relative to (outer.overlap eager: the
        # unit's base versions, or those it rebased onto).
        self.paths: dict[_PathKey, tuple[dict[str, dict[str, Tensor]], Tensor]] = {}
        # Why a path could not be loaded (a shard or version missing): asked once per step,
        # not again for each of its Δs (each attempt downloaded the path's modules anew).
        self.unloadable: dict[_PathKey, Exception] = {}
        self.base: dict[tuple[_PathKey, int], tuple[float, float]] = {}
        self.train: dict[int, Any] = {}
        self.dtype: Any = None
        self.seconds = 0.0
        self.scored = 0
        self.reused = 0

    def __call__(self, upload: Upload, delta: Mapping[str, Tensor]) -> verify.Score | None:
        """The unit's whole Δ scored (rounds.verify.score_delta); CodecError when another
        module's upload of the unit is not what its worker declared."""
        recorded = self._recorded(upload)
        if recorded is not None:
            self.reused += 1
            return recorded
        clock = time.process_time()
        try:
            key = (upload.path, upload.delta_base)
            modules, heldout = self._path(upload.path, upload.delta_base)
            train = self._train_windows(upload.path, upload.position)
            deltas = {**self._siblings(upload), self.module.module_id: delta}
            score = verify.score_delta(
                self.config,
                upload.path,
                self.model,
                modules,
                deltas,
                train,
                heldout,
                before=self.base.get((key, upload.position)),
            )
        except (BlobNotFound, ValueError, KeyError, ModuleVersion.DoesNotExist) as exc:
            # Nothing to score it on: the other checks still hold.
            logger.warning("contribution %d not scored: %s", upload.contribution_id, exc)
            return None
        finally:
            self.seconds += time.process_time() - clock
        self.base[(key, upload.position)] = (score.train_before, score.heldout_before)
        self.scored += 1
        # A concurrent step of another module may have recorded it meanwhile: same inputs,
        # same score; the first write stays.
        Lease.objects.filter(pk=upload.lease_id, score__isnull=True).update(
            score={"base": [list(pair) for pair in upload.delta_base], **score.as_dict()}
        )
        return score

    def _recorded(self, upload: Upload) -> verify.Score | None:
        """The unit's score as another module's step recorded it, when it is relative to the
        same versions as this Δ; None otherwise."""
        if not upload.lease_id:
            return None
        row = Lease.objects.filter(pk=upload.lease_id).values_list("score", flat=True).first()
        if not isinstance(row, dict) or [list(p) for p in upload.delta_base] != row.get("base"):
            return None
        try:
            return verify.Score(
                float(row["train_before"]),
                float(row["train_after"]),
                float(row["heldout_before"]),
                float(row["heldout_after"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    def _siblings(self, upload: Upload) -> dict[str, dict[str, Tensor]]:
        """The unit's Δs of its path's other modules, fetched and checked like its own."""
        from dipaco.modular import module_spec

        others = Contribution.objects.filter(lease_id=upload.lease_id).exclude(
            module_id=self.module.pk
        )
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
        from dipaco.data.shards import ShardIndex
        from dipaco.evaluate import stream_windows
        from dipaco.modular import module_spec, modules_of_path

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
        val = self.work / f"score-val-{p}.bin"
        self.store.download_to(keys.data_key(run_id, p, "val", phase), val)
        tokens = torch.from_numpy(np.fromfile(val, dtype=self.dtype).astype(np.int64))
        val.unlink()
        windows = stream_windows(tokens, self.config.model.seq_len)
        heldout = windows[-self.config.outer.score_windows :].clone()
        if heldout.shape[0] == 0:
            raise ValueError(f"path {p} has no held-out window to score on")
        return modules, heldout

    def _train_windows(self, p: int, position: int) -> Tensor:
        from dipaco.data.shards import TokenShard
        from dipaco.data.windows import ShardSource

        if p not in self.train:
            file = self.work / f"score-train-{p}.bin"
            run_id, phase = self.module.run_id, self.module.phase
            self.store.download_to(keys.data_key(run_id, p, "train", phase), file)
            self.train[p] = ShardSource.for_path(TokenShard(file, self.dtype), self.config, p)
        count = self.config.outer.score_windows
        batch: Tensor = self.train[p].batch(position, count, self.config.model.seq_len)
        return batch


# Reasons a salvaged partial Δ, or one of a lease sized below H (the round's deadline, a
# calibration), may fail honestly: a step or two moves the weights too little to show a
# gain or a norm near the module's history. Refused and not credited, but its
# worker's trust does not fall for it (a preempted volunteer is not an attacker).
WEAK_REASONS = frozenset({verify.NO_GAIN, verify.NORM_LOW})


def _weak_partial(verdict: Verdict) -> bool:
    short = verdict.upload.partial or verdict.upload.work < 1.0
    return short and verdict.reason.split(":")[0] in WEAK_REASONS


def _base_version(round_: Round, module: Module) -> BaseVersion | None:
    """The version every unit of the round that trains `module` started from."""
    units = WorkUnit.objects.filter(round=round_).values_list("base_versions", flat=True)
    bases = {versions[module.module_id] for versions in units if module.module_id in versions}
    if not bases:
        return None
    if len(bases) > 1:
        raise ValueError(f"units of round {round_.t} disagree on {module} versions: {bases}")
    version = ModuleVersion.objects.get(module=module, version=bases.pop())
    return BaseVersion(
        version.version,
        version.blob_key,
        version.sha256,
        version.momentum_key,
        version.residual_key,
    )


def _latest_version(module: Module, t: int) -> BaseVersion:
    """The module's newest version published before round t's step (at most version t):
    what round t's step applies onto. Without overlap it is the units' base version; with
    outer.overlap delayed it may be one newer (rounds.close.previous_published)."""
    version = ModuleVersion.objects.filter(module=module, version__lte=t).order_by("-version")[0]
    return BaseVersion(
        version.version,
        version.blob_key,
        version.sha256,
        version.momentum_key,
        version.residual_key,
    )


def _count(verdicts: Sequence[Verdict], counter: str) -> None:
    """Add each worker's contributions to its `counter` (docs/design.md §4: drops count against it)."""
    for worker_id, n in Counter(v.upload.worker_id for v in verdicts).items():
        Worker.objects.filter(pk=worker_id).update(**{counter: F(counter) + n})


def _credit(unit_ids: set[int]) -> None:
    """Credit each unit whose contributions are now all settled and all accepted: one
    unit and its tokens to the worker that completed it (issue 19: credit only for
    accepted, verified work). Inside the step's transaction; the unit rows are locked in
    pk order, so of two modules' steps settling one unit's last contributions concurrently,
    the second waits, then sees the first's, and exactly one of them credits it.
    """
    if not unit_ids:
        return
    list(WorkUnit.objects.select_for_update().filter(pk__in=unit_ids).order_by("pk"))
    rows = Contribution.objects.filter(unit_id__in=unit_ids).values_list(
        "unit_id", "status", "tokens", "lease__worker_id"
    )
    by_unit: dict[int, list[tuple[str, int, int]]] = {}
    for unit_id, status, tokens, worker_id in rows:
        by_unit.setdefault(unit_id, []).append((status, tokens, worker_id))
    for contributions in by_unit.values():
        if any(status != Contribution.Status.ACCEPTED for status, _, _ in contributions):
            continue  # a Δ still pending (another module's step credits it) or rejected
        tokens, worker_id = min(t for _, t, _ in contributions), contributions[0][2]
        Worker.objects.filter(pk=worker_id).update(
            units_completed=F("units_completed") + 1,
            tokens_processed=F("tokens_processed") + tokens,
        )


def _commit(
    store: BlobStore, module: Module, round_: Round, base: BaseVersion | None, result: StepResult
) -> dict[str, Any]:
    """Blobs, version, contributions and the OuterStep row: all visible at once, or none."""
    run_id, module_id, t = module.run_id, module.module_id, round_.t
    now = timezone.now()
    accepted = [v for v in result.verdicts if v.accepted]
    rejected = [v for v in result.verdicts if not v.accepted]
    done = OuterStep.objects.filter(round=round_, module=module).first()
    if done is not None:  # a duplicate delivery that finished first: nothing to write
        return _report(done, module_id, t, replayed=True)
    version = None
    weights_key = momentum_key = update_key = residual_key = ""
    if result.weights is not None:
        # The blobs first, outside the transaction: copying a whole module inside it held
        # the row lock, and on SQLite the database's one write lock, for as long as the
        # copy took, so heartbeats and completions waited or failed with "database is
        # locked". Unpublished, they are invisible; a duplicate delivery that wins the
        # race below wrote the same version's key with the same step's bytes.
        version = t + 1
        weights_key = keys.module_key(run_id, module_id, version, module.phase)
        if result.momentum is not None:
            momentum_key = keys.momentum_key(run_id, module_id, version, module.phase)
            store.put_file(momentum_key, result.momentum)
        # From the base: OuterStep.base_version links it (rounds.downloads).
        if result.update is not None:
            update_key = keys.update_key(run_id, module_id, version, module.phase)
            residual_key = keys.residual_key(run_id, module_id, version, module.phase)
            store.put_file(residual_key, result.update.residual)
            store.put_file(update_key, result.update.path)
        store.put_file(weights_key, result.weights)
        inject(Fault.KILL_AFTER_BLOB_WRITE)
        inject(Fault.RAISE_AFTER_BLOB_WRITE)
    with transaction.atomic():
        # Serialises duplicate deliveries of this step: the second waits here, then finds
        # the first one's OuterStep row.
        Module.objects.select_for_update().filter(pk=module.pk).first()
        done = OuterStep.objects.filter(round=round_, module=module).first()
        if done is not None:
            return _report(done, module_id, t, replayed=True)
        if version is not None:
            publish_module_version(
                module,
                version,
                blob_key=weights_key,
                sha256=result.weights_sha256,
                size=result.weights_size,
                momentum_key=momentum_key,
                update_key=update_key,
                update_sha256=result.update.sha256 if result.update else "",
                update_size=result.update.size if result.update else None,
                residual_key=residual_key,
            )
        for verdict in result.verdicts:
            status = "accepted" if verdict.accepted else "rejected"
            Contribution.objects.filter(
                pk=verdict.upload.contribution_id, status=Contribution.Status.PENDING
            ).update(status=status, reason=verdict.reason, verified_at=now)
        _count(accepted, "contributions_accepted")
        _count(rejected, "contributions_rejected")
        trust.penalise(v.upload.worker_id for v in rejected if not _weak_partial(v))
        for a, b, agreed in result.replicas:
            counter = "replicas_agreed" if agreed else "replicas_disagreed"
            Worker.objects.filter(pk__in=[a, b]).update(**{counter: F(counter) + 1})
        trust.reward(v.upload.worker_id for v in accepted)
        _credit({v.upload.unit_id for v in result.verdicts})
        step = OuterStep.objects.create(
            round=round_,
            module=module,
            outcome=OuterStep.Outcome.STEPPED if version is not None else OuterStep.Outcome.KEPT,
            base_version=base.version if base is not None else None,
            version=version,
            accepted=len(accepted),
            rejected=len(rejected),
            tokens=result.tokens,
            median_norm=result.accepted_median_norm,
            update_norm=result.update_norm,
            seconds=result.seconds,
            created_at=now,
        )
    where = f"run {run_id} round {t} module {module_id}"
    for v in rejected:
        logger.warning(
            "%s: rejected contribution %d of worker %d: %s",
            where,
            v.upload.contribution_id,
            v.upload.worker_id,
            v.reason,
        )
    if version is None:
        kept = base.version if base is not None else module.current_version
        logger.warning("%s: no accepted contribution; it keeps version %s", where, kept)
    return _report(step, module_id, t, replayed=False)
