"""One module's outer step in one round (docs/design.md §4.4): verify, aggregate, Nesterov, publish.

`step_module(run_id, module_id, t)` runs in two passes over the module's contributions,
each streamed from the object store to a temporary file, one at a time:

1. **judge** each upload before anything uses it (docs/design.md §7; S3 test servers enforce
   neither size nor signature): every acceptance check lives in rounds.verification, whose
   `check_contributions` returns a verdict per upload; each Δ is decoded there at most once
   and the aggregation reuses it. What one Δ alone decides (fetch, size, sha256, format,
   finite, norm, the cosine with the momentum) was mostly done when its completion
   arrived (the check_unit task, rounds.verification.arrival): the step reuses that record
   for the bytes it names and the verified copy that task kept on this disk, and checks
   inline only a Δ without one (the task failed, was late or never sent), with the same
   result bit for bit. What needs the whole round is done here: the median-norm outliers,
   the history and useful-work rules (scores recorded by score_unit), replicas, the first
   round.
2. **aggregate** the accepted ones into one fp32 sum (`codecs.accumulate`, token weights,
   the robust rule; a large module's sum split by tensor over threads,
   rounds.outer.aggregate.tensor_groups), the √(contributing paths) rescale, then Nesterov at round t's outer
   lr chunk by chunk, streaming version `base` and its momentum (module files,
   runs.prepare) in and t + 1 out. The arithmetic is dipaco.outer's (`DeltaAccumulator`
   fed the uploads still encoded, `clip_threshold`, `trimmed_mean`, `rescale_factor`,
   `outer_lr`, `outer_step`), so the server steps exactly as the simulator does.

Memory: pass 1 holds each verified Δ that a check decoded (fp32, kept for pass 2 instead
of decoding it again); pass 2 the fp32 sum plus chunks; the trimmed mean, which needs
every Δ per value, writes them to disk and works in chunks. Uploads wait between the
passes in the data dir's tmp/ (not a RAM-backed /tmp). Measured: docs/benchmarks.md.

Crash safety: the step first writes its blobs (weights, momentum, with
comm.download_codec the encoded update and its residual) under their deterministic keys
(runs.keys), outside any transaction (a whole-module copy must not hold the row lock, or
SQLite's one write lock). Then one transaction, under a lock on the module row, publishes
the ModuleVersion, settles every contribution and writes the OuterStep row. Nothing is
visible until that commit: a crash before it leaves at most unreferenced blobs, which the
retry overwrites with the same step's bytes; an OuterStep row makes any later delivery a
no-op, and the lock makes a concurrent duplicate wait and then find it. Tests arm a `Fault` at that point through ``$DIPACO_FAULTS_DIR``.

The checks live in rounds.verification, the streamed arithmetic in rounds.outer.aggregate.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import shutil
import signal
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from dipaco.config import CommConfig, OuterConfig
from dipaco.data.windows import unit_tokens
from dipaco.modules_file import Spec
from dipaco.outer import (
    outer_lr,
    round_momentum,
)
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Contribution, OuterStep, Round, WorkUnit
from dipaco_server.rounds.outer.aggregate import BaseVersion, aggregate_uploads, apply_step
from dipaco_server.rounds.outer.publish import EncodedUpdate, encode_update
from dipaco_server.rounds.verification.arrival import forget
from dipaco_server.rounds.verification.first_round import UNSETTLED, WAITING
from dipaco_server.rounds.verification.judge import Judgement, judge, settle
from dipaco_server.rounds.verification.settlement import carried
from dipaco_server.rounds.verification.uploads import Verdict
from dipaco_server.runs import keys
from dipaco_server.runs.errors import RoundClosed
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.phases import PATHS, local_round, round_config
from dipaco_server.runs.prepare import work_root
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)

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
    whole_unit: int = 0  # a whole unit's tokens: credit's measure of work
    replicas: list[tuple[int, str]] = field(default_factory=list)  # (worker, counter it moves)
    waited: bool = False  # an undecided first round: every Δ kept for the next step

    def kept_reason(self, verdict: Verdict) -> str:
        """Why a waiting step kept `verdict`'s Δ (first_round.KEPT)."""
        if verdict.reason.startswith(UNSETTLED):
            return f"{verdict.reason}; kept for the next round's step"
        return (
            f"{WAITING}: the module's first step waits for the next round's "
            "evidence on a tie among other units; kept for that step"
        )

    @property
    def accepted_median_norm(self) -> float | None:
        """The median norm of the accepted Δs: the module's history for later rounds."""
        norms = [v.norm for v in self.verdicts if v.accepted and v.norm is not None]
        return statistics.median(norms) if norms else None


def step_judged(
    store: BlobStore,
    judgement: Judgement,
    base: BaseVersion | None,
    spec: Spec,
    cfg: OuterConfig,
    work: Path,
    *,
    round_index: int,
    trained_start: bool = False,
    comm: CommConfig | None = None,
) -> StepResult:
    """Aggregate what `judgement` accepted, take the Nesterov step and encode what is
    published; the outputs stay in `work` (judge_uploads is the first half: a test or bench
    that hands uploads calls both, as the Celery task does through `judge`)."""
    clock = time.perf_counter()
    result = StepResult(judgement.verdicts, replicas=judgement.replicas)
    result.timings["verify"] = judgement.seconds
    if judgement.waited:
        result.waited = True
        result.seconds = judgement.seconds
        return result
    result.median_norm = judgement.median_norm
    accepted, history = judgement.accepted, judgement.history
    if accepted:
        if base is None:
            raise ValueError("contributions without a base version: the round has no units")
        grad = aggregate_uploads(accepted, spec, cfg, work, history)
        result.timings["aggregate"] = time.perf_counter() - clock
        for verdict in accepted:  # done with them: free the disk before the step
            verdict.release()
        result.update_norm = math.sqrt(
            sum(float(torch.linalg.vector_norm(t)) ** 2 for t in grad.values())
        )
        lr = outer_lr(cfg, round_index)
        mu = round_momentum(cfg, round_index, trained_start=trained_start)
        weights, digest, size, new_momentum = apply_step(store, base, grad, spec, cfg, work, lr, mu)
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
    result.seconds = judgement.seconds + time.perf_counter() - clock
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
    if not round_.previous_published():
        # outer.overlap delayed: round t's Δs go onto round t - 1's versions (staleness 1).
        raise RoundClosed(
            f"round {t - 1} of run {run_id} has not published its versions; round {t}'s "
            "outer step runs after it (close_round waits for that)"
        )
    store = store or get_blob_store()
    # The round's Δs, and those a waiting first step kept from earlier rounds (settlement.carried).
    pending = Contribution.objects.filter(module=module).filter(
        Q(unit__round=round_, status=Contribution.Status.PENDING) | carried(run_id, t)
    )
    # Path by path, then replica, as dipaco simulate adds them: a float sum depends on its
    # order, and completion order (pk) depends on which worker finished first.
    ordered = pending.select_related("lease", "unit__path").order_by(
        "unit__round__t", "unit__path__index", "unit__replica", "pk"
    )
    rows = list(ordered)
    whole_unit = unit_tokens(config)
    # The version the units trained from (their Δs' reference, scored on it by Scorer), and
    # the one the step applies onto: the same, or with outer.overlap delayed the newer one
    # that round t - 1 published while round t trained. With "eager" the units that rebased
    # are relative to that newer one already (rounds.protocol.rebase): applied onto it, no staleness.
    base = _base_version(round_, module)
    if base is not None and config.outer.overlap != "none":
        base = _latest_version(module, t)
    spec = module_spec(config, module_id)
    work = Path(tempfile.mkdtemp(prefix=f"outer-{run_id}-{module_id}-{t}-", dir=work_root()))
    try:
        round_index = local_round(round_.run.run_config, t)
        # Phase 2 from a base model (phase 1's, or an uploaded checkpoint, both kept there)
        # starts trained: its first step takes no momentum (dipaco.outer.round_momentum).
        trained_start = (
            round_index == 0 and phase == PATHS and store.exists(keys.base_model_key(run_id))
        )
        stages.reset()
        with stages.timed("outer_step"):
            judgement = judge(
                round_, module, rows, config=config, store=store, spec=spec, work=work,
                base_momentum_key=base.momentum_key if base is not None else None,
                base_version=base.version if base is not None else None,
                can_wait=round_index + 1 < config.rounds,
            )  # fmt: skip
            result = step_judged(store, judgement, base, spec, config.outer, work,
                                 round_index=round_index, trained_start=trained_start,
                                 comm=config.comm)  # fmt: skip
        result.whole_unit = whole_unit
        with stages.timed("publishing"):
            report = _commit(store, module, round_, base, result)
        stages.flush(round_.pk)
        if not result.waited:  # settled: the copies kept at arrival are done with
            forget(run_id, rows)
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
    return _as_base(ModuleVersion.objects.get(module=module, version=bases.pop()))


def _latest_version(module: Module, t: int) -> BaseVersion:
    """The module's newest version published before round t's step (at most version t):
    what round t's step applies onto. Without overlap it is the units' base version; with
    outer.overlap delayed it may be one newer (Round.previous_published)."""
    return _as_base(
        ModuleVersion.objects.filter(module=module, version__lte=t).order_by("-version")[0]
    )


def _as_base(version: ModuleVersion) -> BaseVersion:
    """What an outer step reads of a stored version."""
    return BaseVersion(
        version.version,
        version.blob_key,
        version.sha256,
        version.momentum_key,
        version.residual_key,
    )


def _commit(
    store: BlobStore, module: Module, round_: Round, base: BaseVersion | None, result: StepResult
) -> dict[str, Any]:
    """Blobs, version, contributions and the OuterStep row: all visible at once, or none."""
    run_id, module_id, t = module.run_id, module.module_id, round_.t
    now = timezone.now()
    settled = [] if result.waited else result.verdicts  # a waiting step settles none
    accepted = [v for v in settled if v.accepted]
    rejected = [v for v in settled if not v.accepted]
    done = OuterStep.objects.filter(round=round_, module=module).first()
    if done is not None:  # a duplicate delivery that finished first: nothing to write
        return _report(done, module_id, t, replayed=True)
    blobs = _write_blobs(store, module, t, result)
    version = blobs.version
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
                blob_key=blobs.weights_key,
                sha256=result.weights_sha256,
                size=result.weights_size,
                momentum_key=blobs.momentum_key,
                update_key=blobs.update_key,
                update_sha256=result.update.sha256 if result.update else "",
                update_size=result.update.size if result.update else None,
                residual_key=blobs.residual_key,
            )
        for verdict in result.verdicts:
            status = "accepted" if verdict.accepted else "rejected"
            pending = Contribution.objects.filter(
                pk=verdict.upload.contribution_id, status=Contribution.Status.PENDING
            )
            if result.waited:  # kept pending, with why, for the next round's step
                pending.update(reason=result.kept_reason(verdict))
            else:
                pending.update(status=status, reason=verdict.reason, verified_at=now)
        if not result.waited:
            settle(result.verdicts, result.replicas, result.whole_unit)
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
        why = "its Δs kept for the next round's" if result.waited else "no accepted contribution"
        logger.warning("%s: %s; it keeps version %s", where, why, kept)
    return _report(step, module_id, t, replayed=False)


@dataclass
class StepBlobs:
    """What `_write_blobs` wrote: the new version's keys (none when the step kept the base)."""

    version: int | None = None
    weights_key: str = ""
    momentum_key: str = ""
    update_key: str = ""
    residual_key: str = ""


def _write_blobs(store: BlobStore, module: Module, t: int, result: StepResult) -> StepBlobs:
    """Version t + 1's blobs (momentum, encoded update and its residual, weights last),
    written before the commit and unpublished until it.

    Outside the transaction: copying a whole module inside it held the row lock, and on
    SQLite the database's one write lock, for as long as the copy took, so heartbeats and
    completions waited or failed with "database is locked". Unpublished, they are
    invisible; a duplicate delivery that wins the race in `_commit` wrote the same
    version's key with the same step's bytes.
    """
    if result.weights is None:
        return StepBlobs()
    run_id, module_id, phase = module.run_id, module.module_id, module.phase
    version = t + 1
    blobs = StepBlobs(version, keys.module_key(run_id, module_id, version, phase))
    if result.momentum is not None:
        blobs.momentum_key = keys.momentum_key(run_id, module_id, version, phase)
        store.put_file(blobs.momentum_key, result.momentum)
    # From the base: OuterStep.base_version links it (rounds.protocol.downloads).
    if result.update is not None:
        blobs.update_key = keys.update_key(run_id, module_id, version, phase)
        blobs.residual_key = keys.residual_key(run_id, module_id, version, phase)
        store.put_file(blobs.residual_key, result.update.residual)
        store.put_file(blobs.update_key, result.update.path)
    store.put_file(blobs.weights_key, result.weights)
    inject(Fault.KILL_AFTER_BLOB_WRITE)
    inject(Fault.RAISE_AFTER_BLOB_WRITE)
    return blobs
