"""Held-out loss of each path after an outer round, and per-path early stopping (docs/design.md §1).

`evaluate_run(run, t)` assembles every active path from its modules as they stand after
round t (the newest version <= t + 1 of each), and scores it on fixed windows of its own
validation shard: the run's validation sample (dipaco.evaluate.sample_plan over every
path's validation tokens, seeded with the run's seed), the same windows every round and the
ones the demo and `dipaco simulate` score, so the curve moves only when the weights do and
agrees with every summary of the same weights. It records
``val_loss`` (mean next-token cross-entropy over every scored token), ``val_loss_se`` (the
standard error of that mean: the windows' losses' standard deviation over sqrt(windows),
the band around the run page's curves) and ``val_perplexity`` as MetricPoints of round t.

Rotation: when ``eval.flops`` cannot buy ``eval.min_path_windows`` windows for every path
(a 16x16 grid at the 150M preset), round t scores only its group of the paths
(dipaco.evaluate.eval_plan: `run_plan`), each on its own fixed windows, every path every K
rounds; a small grid has one group and scores every path every round, as before.

Early stopping: a path whose loss has not improved on its best for ``patience`` of its
evaluations is marked finished, and the scheduler leases it no more units. Unrotated, a
path is evaluated every round, and that is ``patience`` rounds (t - best_round, as it
always was). Rotated, a path's curve has a point every K rounds; its patience counts those
points (its evaluations after its best one, this one included), not rounds, so a path is
judged on as many fresh looks at its loss whatever K is, and stops at most
K x patience rounds after its best. Each path's points and decision are written in one
transaction; a path that already has its round-t point is skipped, so evaluating a round
twice changes nothing.
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.db import transaction
from torch import Tensor

from dipaco.config import EvalConfig, RunConfig
from dipaco.data.ranged import store_shard
from dipaco.data.shards import ShardIndex
from dipaco.evaluate import (
    EvalPlan,
    eval_plan,
    perplexity,
    sample_plan,
    sample_shard,
    sample_size,
    standard_error,
    window_losses,
)
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, module_spec
from dipaco.modules_file import read_module
from dipaco_server.runs import keys
from dipaco_server.runs.device import autocast, server_device
from dipaco_server.runs.models import MetricPoint, Module, ModuleVersion, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.phases import PATHS, first_round, round_config
from dipaco_server.runs.prepare import data_index_key, work_root
from dipaco_server.runs.services import record_metric
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)

LOSS = "val_loss"
START_LOSS = "start_val_loss"  # phase 2's paths before its first round (evaluate_start)
PERPLEXITY = "val_perplexity"
STDERR = "val_loss_se"  # the standard error of a val_loss point (the run page's band)


def eval_settings(config: RunConfig) -> EvalConfig:
    """The run's evaluation settings (``config.eval``)."""
    return config.eval


@dataclass(frozen=True)
class PathEval:
    path: int
    loss: float
    tokens: int
    finished: bool  # early-stopped by this evaluation
    stderr: float | None = None  # of the mean window loss; None under two windows

    @property
    def perplexity(self) -> float | None:
        return perplexity(self.loss)


def evaluate_run(
    run: Run, t: int, *, store: BlobStore | None = None, patience: int | None = None
) -> list[PathEval]:
    """Score every active path after round t; `patience` overrides the config's."""
    # Round t scores the paths of its phase, with that phase's config (runs.phases).
    phase, config = round_config(run.run_config, t)
    settings = eval_settings(config)
    patience = settings.patience if patience is None else patience
    scored, plan = _score(run, t, phase, config, LOSS, store)
    return [
        _record(run, path, t, loss, tokens, se, patience, settings.min_delta, plan.rotated)
        for path, loss, tokens, se in scored
    ]


def evaluate_start(run: Run, *, store: BlobStore | None = None) -> list[PathEval]:
    """Phase 2's starting point after a phase 1: every path at its version 0 (the phase-1
    model's layers) on the run's validation sample, recorded as ``start_val_loss`` at the
    round before phase 2's first (phase 1's last), so the dashboard's curves start where
    phase 2 does; not an early-stopping point. A run without phase 1 has round 0's.
    Rotated, only that round's group is scored (the budget is a round's)."""
    first = first_round(run.run_config, PATHS)
    if first == 0:
        return []
    config = run.run_config
    results = []
    scored, _ = _score(run, first - 1, PATHS, config, START_LOSS, store)
    for path, loss, tokens, se in scored:
        record_metric(run, START_LOSS, loss, path=path, round=first - 1)
        results.append(PathEval(path.index, loss, tokens, False, se))
    return results


def evaluate_start_or_log(run: Run, store: BlobStore | None = None) -> None:
    """`evaluate_start`, whose failure only costs the curves a point: training goes on."""
    try:
        evaluate_start(run, store=store)
    except Exception:
        logger.exception("run %s: evaluating phase 2's starting point failed", run.pk)


def run_sample(config: RunConfig, val_tokens: list[int]) -> list[list[int]]:
    """Per path (in index order), the windows of the run's validation sample."""
    return sample_plan(val_tokens, config.model.seq_len, sample_size(config), config.seed)


def run_plan(config: RunConfig, val_tokens: list[int]) -> EvalPlan:
    """The run's evaluation plan: which paths (in index order) each round scores, on which
    windows (dipaco.evaluate.eval_plan); `run_sample`'s windows when every path fits."""
    minimum = eval_settings(config).min_path_windows
    return eval_plan(val_tokens, config.model.seq_len, sample_size(config), minimum, config.seed)


Scored = tuple[RunPath, float, int, float | None]  # path, loss, tokens scored, standard error


def _score(
    run: Run, t: int, phase: int, config: RunConfig, name: str, store: BlobStore | None
) -> tuple[list[Scored], EvalPlan]:
    """(path, loss, tokens scored, standard error) of every active path of `phase` that
    round t's plan scores and that has no `name` point of round t, assembled from its
    modules as they stand after round t; and the plan."""
    done = set(
        MetricPoint.objects.filter(run=run, round=t, name=name).values_list("path_id", flat=True)
    )
    every = list(run.paths.filter(phase=phase).order_by("index"))
    seq_len = config.model.seq_len
    if not any(p.val_tokens > seq_len for p in every):
        return [], EvalPlan([[] for _ in every], [list(range(len(every)))])  # no window
    # The plan is over every path of the phase, stopped ones too, so it never moves.
    run_eval = run_plan(config, [p.val_tokens for p in every])
    plan = {p.index: row for p, row in zip(every, run_eval.windows, strict=True)}
    due = {every[i].index for i in run_eval.paths_at(t)}
    paths = [
        p for p in every if p.state == RunPath.State.ACTIVE and p.pk not in done and p.index in due
    ]
    if not paths:
        return [], run_eval
    store = store or get_blob_store()
    work = Path(tempfile.mkdtemp(prefix=f"evaluate-{run.pk}-{t}-", dir=work_root()))
    scores = []
    try:
        store.download_to(data_index_key(run.pk, phase), work / "index.json")
        index = ShardIndex.load(work)
        modules = _ModuleCache(run, t, store, work, phase, config)
        device = server_device()  # a GPU where the Celery worker has one, in bf16
        model = build_model(config.model, config.seed).to(device)
        for path in paths:
            model.load_state_dict(assemble_path_state(config, path.index, modules.of(path)))
            # Only the sample's windows of the validation shard, read by ranges.
            val = store_shard(store, keys.data_key(run.pk, path.index, "val", phase), index.dtype)
            windows = sample_shard(val, seq_len, plan[path.index])
            with autocast(device):
                losses = window_losses(model, windows, eval_settings(config).batch_size)
            loss = float(losses.mean())
            if not math.isfinite(loss):
                logger.warning(
                    "run %s path %d: validation loss is %s after round %d",
                    run.pk,
                    path.index,
                    loss,
                    t,
                )
                continue
            scores.append((path, loss, windows[:, 1:].numel(), standard_error(losses)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return scores, run_eval


def _record(
    run: Run,
    path: RunPath,
    t: int,
    loss: float,
    tokens: int,
    stderr: float | None,
    patience: int | None,
    min_delta: float,
    rotated: bool = False,
) -> PathEval:
    """The path's points and its early-stopping decision, in one transaction: `patience`
    counts rounds since the best unrotated, the path's evaluations since it rotated."""
    with transaction.atomic():
        path = RunPath.objects.select_for_update().get(pk=path.pk)
        if MetricPoint.objects.filter(path=path, round=t, name=LOSS).exists():
            return PathEval(path.index, loss, tokens, False, stderr)  # a concurrent one won
        record_metric(run, LOSS, loss, path=path, round=t)
        if stderr is not None:
            record_metric(run, STDERR, stderr, path=path, round=t)
        ppl = perplexity(loss)
        if ppl is not None:  # a NaN loss has none
            record_metric(run, PERPLEXITY, ppl, path=path, round=t)
        improved = path.best_val_loss is None or loss < path.best_val_loss - min_delta
        if improved:
            path.best_val_loss, path.best_round = loss, t
        stale = _stale(path, t, rotated)
        finished = patience is not None and not improved and stale >= patience
        if finished:
            path.state = RunPath.State.FINISHED
        path.save(update_fields=["best_val_loss", "best_round", "state"])
    if finished:
        best = f"{path.best_val_loss:.4f} (round {path.best_round})"
        logger.info(
            "run %s path %d stops early: %d %s without beating %s",
            run.pk,
            path.index,
            stale,
            "evaluations" if rotated else "rounds",
            best,
        )
    return PathEval(path.index, loss, tokens, finished, stderr)


def _stale(path: RunPath, t: int, rotated: bool) -> int:
    """How long the path has gone without beating its best, as of round t's point: rounds
    unrotated (every round evaluates it), its evaluations after its best one rotated."""
    if path.best_round is None:
        return 0
    if not rotated:
        return t - path.best_round
    return MetricPoint.objects.filter(
        path=path, name=LOSS, round__gt=path.best_round, round__lte=t
    ).count()


class _ModuleCache:
    """Each module's weights after round t, downloaded and checked once per evaluation."""

    def __init__(
        self, run: Run, t: int, store: BlobStore, work: Path, phase: int, config: RunConfig
    ) -> None:
        self.run, self.t, self.store, self.work = run, t, store, work
        self.phase, self.config = phase, config
        self.tensors: dict[str, dict[str, Tensor]] = {}

    def of(self, path: RunPath) -> dict[str, dict[str, Tensor]]:
        for module_id in path.modules:
            if module_id in self.tensors:
                continue
            version = (
                ModuleVersion.objects.filter(
                    module=Module.objects.get(run=self.run, phase=self.phase, module_id=module_id),
                    version__lte=self.t + 1,
                )
                .order_by("-version")
                .first()
            )
            if version is None:
                raise ValueError(f"module {module_id} of run {self.run.pk} has no version yet")
            file = self.work / f"{module_id}.safetensors"
            self.store.download_to(version.blob_key, file)
            spec = module_spec(self.config, module_id)
            self.tensors[module_id] = read_module(file, spec, version.sha256)
            file.unlink()
        return {m: self.tensors[m] for m in path.modules}
