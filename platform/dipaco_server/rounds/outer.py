"""One module's outer step in one round (DESIGN §4.4): verify, aggregate, Nesterov, publish.

`step_module(run_id, module_id, t)` runs in two passes over the module's contributions,
each streamed from the object store to a temporary file, one at a time:

1. **verify** each upload before anything uses it (DESIGN §7; S3 test servers enforce
   neither size nor signature): size and sha256 against what the worker declared,
   hashed as it downloads; then `codecs.verify` against the module's spec (header,
   names, shapes, dtypes, finite values) for its norm. Norms above
   ``outer.reject_norm_factor`` x the median of the verified ones are outliers.
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

Crash safety: nothing in the database changes until one transaction, under a lock on the
module row, uploads both blobs under their deterministic keys (runs.keys), publishes the
ModuleVersion, settles every contribution and writes the OuterStep row. A crash before
the commit leaves at most an unreferenced blob, which the retry overwrites; an OuterStep
row makes any later delivery a no-op, and the lock makes a concurrent duplicate wait and
then find it. Tests arm a `Fault` at that point through ``$DIPACO_FAULTS_DIR``.
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
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from django.db import transaction
from django.db.models import F
from django.utils import timezone
from torch import Tensor

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.config import OuterConfig
from dipaco.outer import (
    DeltaAccumulator,
    clip_threshold,
    norm_outliers,
    outer_lr,
    outer_step,
    rescale_factor,
    trimmed_mean,
)
from dipaco_server.rounds.models import Contribution, OuterStep, Round, WorkUnit
from dipaco_server.runs import keys
from dipaco_server.runs.errors import RoundClosed
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.phases import local_round, round_config
from dipaco_server.runs.prepare import ModuleReader, ModuleWriter, Spec, work_root
from dipaco_server.runs.services import publish_module_version
from dipaco_server.storage import BlobNotFound, BlobStore, get_blob_store
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


@dataclass
class Verdict:
    upload: Upload
    file: Path | None = None  # the verified local copy while it is needed
    norm: float | None = None
    reason: str = ""  # "<code>: <message>" when rejected

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


@dataclass
class StepResult:
    verdicts: list[Verdict]
    weights: Path | None = None  # None: nothing accepted, the module keeps its version
    weights_sha256: str = ""
    weights_size: int = 0
    momentum: Path | None = None
    median_norm: float | None = None
    update_norm: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


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
    store: BlobStore, uploads: Sequence[Upload], spec: Spec, reject_norm_factor: float, work: Path
) -> list[Verdict]:
    """Pass 1: every upload fetched, checked and measured; outliers by norm rejected."""
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
    return verdicts


def contributing_paths(accepted: Sequence[Verdict]) -> int:
    """The distinct paths among the accepted contributions: what DiPaCo's √ rescale counts
    (dipaco.outer.rescale_factor), not the layout's paths through the module; a path that
    is stopped, or whose uploads were all refused, adds no Δ to the mean."""
    return len({v.upload.path for v in accepted})


def aggregate(
    accepted: Sequence[Verdict], spec: Spec, cfg: OuterConfig, work: Path
) -> dict[str, Tensor]:
    """Pass 2: the module's outer gradient in fp32, as dipaco.outer.aggregate computes it
    with ``paths_through=contributing_paths(accepted)``: the library's DeltaAccumulator
    (weights, clipping) fed the verified uploads still encoded, and its trimmed_mean."""
    if cfg.robust == "trimmed-mean":
        grad = _trimmed_mean(accepted, spec, cfg, work)
    else:
        limit = None
        if cfg.robust == "clipped-mean":
            limit = clip_threshold([float(v.norm or 0.0) for v in accepted], cfg.clip_factor)
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
) -> StepResult:
    """Verify, aggregate and step in `work`; the outputs stay there for the caller.

    `round_index` is the 0-based round of the run's config whose step this is: it sets
    the outer learning rate (dipaco.outer.outer_lr, cfg.warmup_rounds).
    """
    clock = time.perf_counter()
    result = StepResult(verify_uploads(store, uploads, spec, cfg.reject_norm_factor, work))
    result.timings["verify"] = time.perf_counter() - clock
    norms = [v.norm for v in result.verdicts if v.norm is not None]
    result.median_norm = statistics.median(norms) if norms else None
    accepted = [v for v in result.verdicts if v.accepted]
    if accepted:
        if base is None:
            raise ValueError("contributions without a base version: the round has no units")
        grad = aggregate(accepted, spec, cfg, work)
        result.timings["aggregate"] = time.perf_counter() - clock
        for verdict in accepted:  # done with them: free the disk before the step
            if verdict.file is not None:
                verdict.file.unlink(missing_ok=True)
            verdict.file = None
        result.update_norm = math.sqrt(
            sum(float(torch.linalg.vector_norm(t)) ** 2 for t in grad.values())
        )
        lr = outer_lr(cfg, round_index)
        weights, digest, size, momentum = apply_step(store, base, grad, spec, cfg, work, lr)
        result.weights, result.weights_sha256, result.weights_size = weights, digest, size
        result.momentum = momentum
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
    store = store or get_blob_store()
    pending = Contribution.objects.filter(
        module=module, unit__round=round_, status=Contribution.Status.PENDING
    )
    # Path by path, then replica, as dipaco simulate adds them: a float sum depends on its
    # order, and completion order (pk) depends on which worker finished first.
    ordered = pending.select_related("lease", "unit__path").order_by(
        "unit__path__index", "unit__replica", "pk"
    )
    uploads = [
        Upload(c.pk, c.lease.worker_id, c.blob_key, c.size, c.sha256, c.tokens, c.unit.path.index)
        for c in ordered
    ]
    base = _base_version(round_, module)
    spec = module_spec(config, module_id)
    work = Path(tempfile.mkdtemp(prefix=f"outer-{run_id}-{module_id}-{t}-", dir=work_root()))
    try:
        result = compute_step(
            store,
            uploads,
            base,
            spec,
            config.outer,
            work,
            round_index=local_round(round_.run.run_config, t),
        )
        report = _commit(store, module, round_, base, result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info(
        "run %s round %d module %s: %s in %.2f s", run_id, t, module_id, report, result.seconds
    )
    return report


def _base_version(round_: Round, module: Module) -> BaseVersion | None:
    """The version every unit of the round that trains `module` started from."""
    units = WorkUnit.objects.filter(round=round_).values_list("base_versions", flat=True)
    bases = {versions[module.module_id] for versions in units if module.module_id in versions}
    if not bases:
        return None
    if len(bases) > 1:
        raise ValueError(f"units of round {round_.t} disagree on {module} versions: {bases}")
    version = ModuleVersion.objects.get(module=module, version=bases.pop())
    return BaseVersion(version.version, version.blob_key, version.sha256, version.momentum_key)


def _count(verdicts: Sequence[Verdict], counter: str) -> None:
    """Add each worker's contributions to its `counter` (DESIGN §4: drops count against it)."""
    for worker_id, n in Counter(v.upload.worker_id for v in verdicts).items():
        Worker.objects.filter(pk=worker_id).update(**{counter: F(counter) + n})


def _commit(
    store: BlobStore, module: Module, round_: Round, base: BaseVersion | None, result: StepResult
) -> dict[str, Any]:
    """Blobs, version, contributions and the OuterStep row: all visible at once, or none."""
    run_id, module_id, t = module.run_id, module.module_id, round_.t
    now = timezone.now()
    accepted = [v for v in result.verdicts if v.accepted]
    rejected = [v for v in result.verdicts if not v.accepted]
    with transaction.atomic():
        # Serialises duplicate deliveries of this step: the second waits here, then finds
        # the first one's OuterStep row.
        Module.objects.select_for_update().filter(pk=module.pk).first()
        done = OuterStep.objects.filter(round=round_, module=module).first()
        if done is not None:
            return _report(done, module_id, t, replayed=True)
        version = None
        if result.weights is not None:
            version = t + 1
            phase = module.phase
            weights_key = keys.module_key(run_id, module_id, version, phase)
            momentum_key = ""
            if result.momentum is not None:
                momentum_key = keys.momentum_key(run_id, module_id, version, phase)
                store.put_file(momentum_key, result.momentum)
            store.put_file(weights_key, result.weights)
            inject(Fault.KILL_AFTER_BLOB_WRITE)
            inject(Fault.RAISE_AFTER_BLOB_WRITE)
            publish_module_version(
                module,
                version,
                blob_key=weights_key,
                sha256=result.weights_sha256,
                size=result.weights_size,
                momentum_key=momentum_key,
            )
        for verdict in result.verdicts:
            status = "accepted" if verdict.accepted else "rejected"
            Contribution.objects.filter(
                pk=verdict.upload.contribution_id, status=Contribution.Status.PENDING
            ).update(status=status, reason=verdict.reason, verified_at=now)
        _count(accepted, "contributions_accepted")
        _count(rejected, "contributions_rejected")
        step = OuterStep.objects.create(
            round=round_,
            module=module,
            outcome=OuterStep.Outcome.STEPPED if version is not None else OuterStep.Outcome.KEPT,
            base_version=base.version if base is not None else None,
            version=version,
            accepted=len(accepted),
            rejected=len(rejected),
            tokens=result.tokens,
            median_norm=result.median_norm,
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
