"""Each Δ checked when its completion arrives (rounds.verification.arrival): the completion
sends check_unit, whose record the round's outer step reuses instead of fetching and
decoding the Δ again, with the same verdicts and the same step bit for bit; a step whose
records are missing, stale or whose kept bytes are gone checks inline; a duplicate task
is a no-op.

Real services: PostgreSQL, the blob store, the completion service over the worker API,
the in-process broker, the outer step, honest Δs trained on the unit's own windows.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from dipaco.modular import module_spec
from dipaco_server.rounds.lifecycle import receivers
from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.lifecycle.retention import sweep_blobs
from dipaco_server.rounds.lifecycle.tasks import check_unit
from dipaco_server.rounds.models import Contribution, Lease, OuterStep, Round
from dipaco_server.rounds.outer import step
from dipaco_server.rounds.verification import checks, judge, uploads
from dipaco_server.rounds.verification.arrival import (
    arrival_records,
    check_arrived,
    checked_file,
    sweep_kept,
)
from dipaco_server.rounds.verification.context import norm_history, outer_momentum
from dipaco_server.runs.models import Module
from dipaco_server.runs.phases import local_round, round_config
from dipaco_server.runs.prepare import work_root
from dipaco_server.storage import BlobStore, get_blob_store
from tests import test_worker_api as api
from tests.test_untrusted import one_torch_thread as one_torch_thread  # the fixture
from tests.test_untrusted import reasons, scaled, step_round, submit, two_worker_run
from tests.test_untrusted import work as work  # the fixture
from tests.test_worker_api import store  # noqa: F401 (a fixture used below)

pytestmark = pytest.mark.django_db
CHECK = "dipaco_server.rounds.tasks.check_unit"


def test_a_completion_sends_check_unit_and_its_record_is_stored(
    client: Any,
    store: BlobStore,  # noqa: F811 (the fixture imported above)
    django_capture_on_commit_callbacks: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = api.running_run(store)
    sent: list[tuple[str, list[Any]]] = []  # what the completion's commit sends the broker
    send = receivers.celery_app.send_task

    def recorded(name: str, args: Any = None, **kwargs: Any) -> Any:
        sent.append((name, list(args or [])))
        if name == CHECK:  # not sent: run below, in this process, as the task's body
            return None
        return send(name, args=args, **kwargs)

    monkeypatch.setattr(receivers.celery_app, "send_task", recorded)
    _, token = api.new_worker("w0")
    holder = api.Holder(client, store, run, token, api.take_lease(client, token))
    with django_capture_on_commit_callbacks(execute=True):
        done = holder.on("complete", holder.completion())
    assert done.status_code == 200, done.content
    lease = Lease.objects.get(pk=holder.lease["lease_id"])
    assert (CHECK, [lease.pk]) in sent, sent

    assert check_unit(lease.pk) == f"checked {lease.contributions.count()}"  # the task's body
    for c in lease.contributions.all():
        record = c.arrival_check
        assert record is not None and record["sha256"] == c.sha256, record
        assert "code" in record or checked_file(run.pk, c.pk, c.sha256).exists()
    # A duplicate delivery (acks_late redelivers after a worker died) does nothing.
    before = {c.pk: c.arrival_check for c in lease.contributions.all()}
    assert check_unit(lease.pk) == "checked already"
    assert {c.pk: c.arrival_check for c in lease.contributions.all()} == before
    # Kept files of Δs still pending stay; once they settled, the retention sweep removes
    # what a step did not (a run that ended, a task that finished after its step).
    # (These fake Δs were refused at arrival, so nothing was kept: a file stands in.)
    kept = [checked_file(run.pk, c.pk, c.sha256) for c in lease.contributions.all()]
    for f in kept:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"verified bytes")
    assert sweep_kept(run.pk) == 0 and all(f.exists() for f in kept)
    lease.contributions.update(status="rejected")
    sweep_blobs(store=store)
    assert not [f for f in kept if f.exists()]


def _inputs(run: Any, module_id: str, t: int) -> dict[str, Any]:
    """What step_module hands judge_uploads and step_judged for `module_id` in round t (no database writes)."""
    round_ = Round.objects.get(run=run, t=t)
    phase, config = round_config(run.run_config, t)
    module = Module.objects.get(run=run, phase=phase, module_id=module_id)
    rows = list(
        Contribution.objects.filter(module=module, unit__round=round_, status="pending")
        .select_related("lease", "unit__path")
        .order_by("unit__path__index", "unit__replica", "pk")
    )
    base = step._base_version(round_, module)
    assert base is not None
    return {
        "config": config, "module": module, "rows": rows, "base": base,
        "uploads": judge.uploads_of(run.pk, module, t, rows, config),
        "spec": module_spec(config, module_id),
        "round_index": local_round(run.run_config, t),
        "history": norm_history(module, t, config.outer.history_rounds),
    }  # fmt: skip


def _compute(run: Any, got: dict[str, Any], arrival: bool) -> Any:
    work = Path(tempfile.mkdtemp(dir=work_root()))
    try:
        store = get_blob_store()
        spec, base = got["spec"], got["base"]
        momentum = outer_momentum(store, base.momentum_key, spec, work)
        cfg = got["config"].outer
        judgement = judge.judge_uploads(
            store, got["uploads"], spec, cfg, work, history=got["history"], momentum=momentum,
            arrival=arrival_records(got["rows"]) if arrival else None,
            kept=lambda u: checked_file(run.pk, u.contribution_id, u.sha256),
            momentum_version=base.version if momentum is not None else None,
        )  # fmt: skip
        result = step.step_judged(
            store, judgement, base, spec, cfg, work, round_index=got["round_index"],
            comm=got["config"].comm,
        )  # fmt: skip
        assert momentum is not None, "round 1 steps against an outer momentum"
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


class Counts:
    """Calls of the step's inline format check and of decoding a verdict's Δ."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checked = self.decoded = 0
        check, decoded = checks.check_upload, uploads.Verdict.decoded

        def counted_check(*args: Any, **kwargs: Any) -> Any:
            self.checked += 1
            return check(*args, **kwargs)

        def counted_decode(verdict: Any, spec: Any) -> Any:
            self.decoded += 1
            return decoded(verdict, spec)

        monkeypatch.setattr(checks, "check_upload", counted_check)
        monkeypatch.setattr(uploads.Verdict, "decoded", counted_decode)

    def take(self) -> tuple[int, int]:
        out = (self.checked, self.decoded)
        self.checked = self.decoded = 0
        return out


def test_the_step_reuses_arrival_checks_and_steps_exactly_as_inline(
    work: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, sources = two_worker_run(work)
    submit(run, "a0", sources)
    submit(run, "b0", sources)
    step_round(run, 0)  # version 1 and an outer momentum: round 1 checks direction
    submit(run, "a1", sources)
    submit(run, "b1", sources)
    leases = Lease.objects.filter(unit__round__run=run, unit__round__t=1)
    assert [check_arrived(lease.pk).startswith("checked ") for lease in leases] == [True] * 2
    counts = Counts(monkeypatch)
    for module_id in ("0.0", "shared"):
        got = _inputs(run, module_id, 1)
        assert all(c.arrival_check and "momentum_version" in c.arrival_check for c in got["rows"])
        reused = _compute(run, got, arrival=True)
        assert counts.take() == (0, 0), "nothing fetched by the check, nothing decoded"
        inline = _compute(run, got, arrival=False)
        checked, _ = counts.take()
        assert checked == len(got["rows"])
        assert reused.weights_sha256 == inline.weights_sha256  # the same step, bit for bit
        for a, b in zip(reused.verdicts, inline.verdicts, strict=True):
            assert (a.reason, a.norm, a.cosine) == (b.reason, b.norm, b.cosine)
        # The kept bytes gone (the task ran on another machine): fetched again, not checked.
        for c in got["rows"]:
            checked_file(run.pk, c.pk, c.sha256).rename(work / f"moved-{c.pk}")
        fetched = _compute(run, got, arrival=True)
        assert counts.take() == (0, 0)
        assert fetched.weights_sha256 == inline.weights_sha256
        for c in got["rows"]:
            (work / f"moved-{c.pk}").rename(checked_file(run.pk, c.pk, c.sha256))

    # The step itself: settles with the records, and removes the kept files after.
    assert mark_round_closing(Round.objects.get(run=run, t=1))
    for module_id in ("0.0", "shared"):
        step.step_module(run.pk, module_id, 1)
    assert counts.take()[0] == 0
    rows = Contribution.objects.filter(unit__round__run=run, unit__round__t=1)
    assert set(rows.values_list("status", flat=True)) == {"accepted"}
    assert not [c for c in rows if checked_file(run.pk, c.pk, c.sha256).exists()]
    # A task delivered after its step settled the Δs: nothing to do, nothing left behind.
    assert [check_arrived(lease.pk) for lease in leases] == ["checked already"] * 2


def test_a_step_without_its_records_checks_inline(
    work: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run, sources = two_worker_run(work)
    submit(run, "a0", sources)
    submit(run, "b0", sources)
    step_round(run, 0)
    submit(run, "a1", sources)
    submit(run, "b1", sources)
    leases = list(Lease.objects.filter(unit__round__run=run, unit__round__t=1).order_by("pk"))
    check_arrived(leases[0].pk)  # the other unit's task never ran (or failed)
    # A record of other bytes than the contribution names is not used either.
    stale = Contribution.objects.filter(lease=leases[0], module__module_id="shared")
    stale.update(arrival_check={"sha256": "0" * 64, "norm": 1.0})
    counts = Counts(monkeypatch)
    assert mark_round_closing(Round.objects.get(run=run, t=1))
    step.step_module(run.pk, "shared", 1)
    step.step_module(run.pk, "0.0", 1)
    checked, _ = counts.take()
    assert checked == 3  # shared: both; 0.0: the unit without a record
    rows = Contribution.objects.filter(unit__round__run=run, unit__round__t=1)
    assert set(rows.values_list("status", flat=True)) == {"accepted"}
    assert OuterStep.objects.filter(round__run=run, round__t=1, outcome="stepped").count() == 2


def test_a_refusal_at_arrival_is_the_steps_refusal(
    work: Path,
) -> None:
    run, sources = two_worker_run(work)
    honest, _ = submit(run, "honest", sources)
    broken = {"0.0": b"not a safetensors file", "shared": b"neither"}
    attacker, _ = submit(run, "attacker", sources, raw=broken)
    for lease in Lease.objects.filter(unit__round__run=run):
        check_arrived(lease.pk)
    refused = Contribution.objects.filter(lease__worker=attacker)
    for c in refused:
        assert c.arrival_check is not None and "code" in c.arrival_check, c.arrival_check
        assert not checked_file(run.pk, c.pk, c.sha256).exists()
    codes = {c.arrival_check["code"] for c in refused}
    step_round(run, 0)
    assert reasons(run, attacker) == codes
    assert reasons(run, honest) == {""}


def test_a_flip_is_refused_the_same_with_or_without_arrival_checks(
    work: Path,
) -> None:
    run, sources = two_worker_run(work)
    honest, _ = submit(run, "honest", sources)
    attacker, _ = submit(run, "attacker", sources, scaled(-1.0))
    for lease in Lease.objects.filter(unit__round__run=run):
        check_arrived(lease.pk)
    step_round(run, 0)
    assert reasons(run, honest) == {""}
    assert reasons(run, attacker) == {"no_training_gain"}


@pytest.mark.parametrize(("codec", "robust"), [("fp16", "mean"), ("int8", "clipped-mean")])
def test_a_sum_split_by_tensor_is_the_one_threads_sum_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, codec: str, robust: str
) -> None:
    """rounds.outer.aggregate's split (a large module's Δs summed by tensor group, a thread
    a group) against the single-threaded sum: the same outer gradient, bit for bit."""
    import torch

    from dipaco import codecs
    from dipaco.config import OuterConfig
    from dipaco_server.rounds.outer import aggregate
    from dipaco_server.rounds.verification.uploads import Upload, Verdict

    spec = {"embed": ((64, 32), torch.float32), "head": ((32, 64), torch.float32),
            "norm": ((32,), torch.float32), "block": ((16, 32), torch.float32)}  # fmt: skip
    cfg = OuterConfig(robust=robust)
    verdicts = []
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        delta = {n: torch.randn(shape, generator=g) * (i + 1) for n, (shape, _) in spec.items()}
        path = tmp_path / f"d{i}.safetensors"
        path.write_bytes(codecs.encode(delta, codec))
        norm = float(torch.sqrt(sum(t.double().square().sum() for t in delta.values())))
        upload = Upload(i + 1, i, "", 0, "", 100 * (i + 1), path=i % 2)
        verdicts.append(Verdict(upload, file=path, norm=norm))
    whole = aggregate.aggregate_uploads(verdicts, spec, cfg, tmp_path, history=(3.0,))
    monkeypatch.setattr(aggregate, "SPLIT_MIN_VALUES", 0)
    monkeypatch.setattr(aggregate, "SPLIT_MIN_DELTAS", 1)
    assert aggregate.split_parts(spec, len(verdicts)) == 2
    assert len(aggregate.tensor_groups(spec, 3)) == 3
    split = aggregate.aggregate_uploads(verdicts, spec, cfg, tmp_path, history=(3.0,))
    assert set(split) == set(whole)
    for name in spec:
        assert torch.equal(split[name], whole[name]), name
