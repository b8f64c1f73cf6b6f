"""Each Δ checked when its completion arrives, off the round's critical path (docs/design.md
§4.4, §7).

The outer step at a round's close used to fetch, decode and check every Δ of its module
before it could aggregate: at 16x16 and 150M the shared module's step read 256 Δs of
105 MB, 13 minutes of one core after the last completion (docs/benchmarks.md). The
checks that need no other Δ of the round are done here instead, by the ``check_unit``
task that each completion sends (rounds.lifecycle.receivers), while the round still trains:

- **format**: the upload fetched, its size and sha256 against what its worker declared,
  its content against the module's spec (header, names, shapes, dtypes, finite values) and
  its norm (`uploads.check_upload`, the step's own check);
- **direction**: its cosine with the module's outer momentum at the version the step will
  read it from (`rules.cosine`), recorded with that version.

The outcome is stored on the contribution (`Contribution.arrival_check`: the sha256 it is
of, and the norm and cosine, or the refusal), and the verified bytes are kept on the data
dir's disk (`checked_file`) for the step to aggregate. The unit's score is recorded on its
lease by the score_unit task beside this one (rounds.verification.unit_score).

What needs the whole round stays in the step (rounds.verification.checks): the norm
against the round's median, the history and useful-work rules, replica comparison, the
first round's settlement and peer check, robust aggregation. The step reuses a record only
for the bytes it names (its sha256), and a cosine only when it was taken against the
momentum the step reads; the same functions on the same bytes give the same floats, so the
verdicts and the step are those of an inline check, bit for bit. Where a record or the kept
file is missing (the task failed, was late, or ran on another machine), the step checks
inline or fetches the bytes again (checked against the same sha256).

Idempotent: the record is written once (a conditional update on a null record, while the
contribution is pending); a duplicate or retried task finds it and does nothing, and a file
written for a contribution that meanwhile settled is removed. Kept files are written under
a temporary name and renamed, so a reader never sees a partial one; the step removes those
of the contributions it settled.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.modules_file import Spec, read_module
from dipaco_server.rounds import stages
from dipaco_server.rounds.models import Contribution, Lease, Round
from dipaco_server.rounds.verification import rules
from dipaco_server.rounds.verification.uploads import Upload, check_upload
from dipaco_server.runs.models import Module, ModuleVersion
from dipaco_server.runs.phases import round_config
from dipaco_server.runs.prepare import work_root
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)

REFUSED = "code"  # a record with this key is a refusal: {"sha256", "code", "message"}


def checked_dir(run_id: int) -> Path:
    """Where a run's Δs checked at arrival wait for their step (the data dir's disk)."""
    return work_root() / "checked" / f"run-{run_id}"


def checked_file(run_id: int, contribution_id: int, sha256: str) -> Path:
    """The verified bytes of one contribution, kept for its step: named by its sha256, so a
    file is only ever the bytes its record is of."""
    return checked_dir(run_id) / f"{contribution_id}-{sha256}.safetensors"


def momentum_version(round_: Round, module: Module, base_versions: dict[str, int]) -> int | None:
    """The version whose outer momentum the module's step of `round_` will read (as
    rounds.outer.step chooses its base): the units' base version, or with outer.overlap
    the newest version published so far (round t - 1's step may publish a newer one before
    round t's step; the step then finds the recorded version differs and computes anew)."""
    _, config = round_config(round_.run.run_config, round_.t)
    if config.outer.overlap == "none":
        return base_versions.get(module.module_id)
    newest = ModuleVersion.objects.filter(module=module, version__lte=round_.t).order_by("-version")
    return newest.values_list("version", flat=True).first()


def check_arrived(lease_id: int, store: BlobStore | None = None) -> str:
    """Check every pending Δ of a completed lease that has no record yet; what happened."""
    lease = (
        Lease.objects.select_related("unit__round__run", "unit__path").filter(pk=lease_id).first()
    )
    if lease is None or lease.state != Lease.State.COMPLETED:
        return "not completed"
    round_ = lease.unit.round
    if round_.state == Round.State.CLOSED:
        return "round closed"
    rows = list(
        Contribution.objects.filter(
            lease=lease, status=Contribution.Status.PENDING, arrival_check__isnull=True
        )
        .select_related("module")
        .order_by("pk")
    )
    if not rows:
        return "checked already"
    from dipaco.modular import module_spec  # transformers: seconds to import

    _, config = round_config(round_.run.run_config, round_.t)
    store = store or get_blob_store()
    work = Path(tempfile.mkdtemp(prefix=f"arrival-{lease_id}-", dir=work_root()))
    stages.reset()
    checked = 0
    try:
        for c in rows:
            spec = module_spec(config, c.module.module_id)
            if _check_one(store, round_, lease, c, spec, config, work):
                checked += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stages.flush(round_.pk)
    return f"checked {checked}"


def _check_one(
    store: BlobStore, round_: Round, lease: Lease, c: Contribution, spec: Spec, config: Any,
    work: Path,
) -> bool:  # fmt: skip
    """One Δ checked and its record written (False: left to the step, or done already)."""
    upload = Upload(c.pk, lease.worker_id, c.blob_key, c.size, c.sha256, c.tokens)
    kept: Path | None = None
    try:
        with stages.timed("fetch_decode"):
            path, norm = check_upload(store, upload, spec, work)
    except CodecError as exc:
        if exc.code == "missing":  # nothing to judge yet: the step looks again
            return False
        record: dict[str, Any] = {"sha256": c.sha256, REFUSED: exc.code, "message": str(exc)}
    else:
        record = {"sha256": c.sha256, "norm": norm}
        if config.outer.verify and norm > 0:
            version = momentum_version(round_, c.module, lease.unit.base_versions)
            momentum = _momentum(store, round_.run_id, c.module, version, spec)
            if momentum is not None:
                with stages.timed("fetch_decode"):
                    delta = codecs.decode(path, spec, verify_checksum=False)
                cosine = rules.cosine(delta, momentum)
                del delta, momentum
                if cosine is None or math.isfinite(cosine):
                    record.update(cosine=cosine, momentum_version=version)
        kept = checked_file(round_.run_id, c.pk, c.sha256)
        kept.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, kept)  # same disk (work_root): atomic
    written = Contribution.objects.filter(
        pk=c.pk, status=Contribution.Status.PENDING, arrival_check__isnull=True
    ).update(arrival_check=record)
    # Not written: a duplicate task recorded it first (its file is these same bytes: leave
    # it), or the contribution settled meanwhile (its step is done with it: remove ours).
    settled = not Contribution.objects.filter(pk=c.pk, status=Contribution.Status.PENDING).exists()
    if not written and kept is not None and settled:
        kept.unlink(missing_ok=True)
    return bool(written)


def _momentum(
    store: BlobStore, run_id: int, module: Module, version: int | None, spec: Spec
) -> dict[str, Any] | None:
    """The module's outer momentum at `version` (None before its first step), downloaded
    once per version to the run's checked dir and read from there by later tasks."""
    if version is None:
        return None
    found = ModuleVersion.objects.filter(module=module, version=version)
    row = found.values_list("momentum_key", flat=True).first()
    if not row:
        return None
    local = checked_dir(run_id) / f"momentum-{module.pk}-v{version}.safetensors"
    if not local.exists():
        local.parent.mkdir(parents=True, exist_ok=True)
        partial = local.with_name(f"{local.name}.{os.getpid()}.part")
        store.download_to(row, partial)
        os.replace(partial, local)
    return read_module(local, spec)


def arrival_records(rows: list[Contribution]) -> dict[int, dict[str, Any]]:
    """Contribution -> its arrival record, for the rows that have one."""
    return {c.pk: c.arrival_check for c in rows if isinstance(c.arrival_check, dict)}


def forget(run_id: int, rows: list[Contribution]) -> None:
    """Remove the kept files of contributions their step settled."""
    for c in rows:
        checked_file(run_id, c.pk, c.sha256).unlink(missing_ok=True)


def sweep_kept(run_id: int) -> int:
    """Remove what a run's checked dir holds that no step will read: kept Δs of
    contributions no longer pending (a task that finished after its step, a run that
    ended), and cached momenta older than each module's version before its current one.
    Called by the retention sweep (rounds.lifecycle.retention); the number removed."""
    folder = checked_dir(run_id)
    if not folder.is_dir():
        return 0
    pending = set(
        Contribution.objects.filter(
            unit__round__run_id=run_id, status=Contribution.Status.PENDING
        ).values_list("pk", flat=True)
    )
    current = dict(Module.objects.filter(run_id=run_id).values_list("pk", "current_version"))
    removed = 0
    for path in folder.iterdir():
        stem, _, kind = path.name.partition(".")
        if kind != "safetensors":
            continue  # a download still being written (.part): its task renames it
        try:
            if stem.startswith("momentum-"):
                module, _, version = stem.removeprefix("momentum-").partition("-v")
                stale = int(version) < (current.get(int(module)) or 0) - 1
            else:
                stale = int(stem.partition("-")[0]) not in pending
        except ValueError:
            continue
        if stale:
            path.unlink(missing_ok=True)
            removed += 1
    return removed
