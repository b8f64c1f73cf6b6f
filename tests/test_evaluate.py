"""Evaluation after a round: held-out loss per path on the run's validation sample, and early
stopping; the server, the demo and the simulator score the same weights alike.

Runs are built directly on the local blob store: version-0 modules from the run's seed and
random validation shards, so each test controls exactly what a path is scored on.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.shards import ShardIndex, ShardInfo
from dipaco.evaluate import (
    SAMPLE_WINDOWS,
    EvalPlan,
    eval_plan,
    routed_mean,
    sample_plan,
    sample_size,
    sample_streams,
    window_losses,
)
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, init_modules, split_path_state
from dipaco.modules_file import write_module
from dipaco.simulate.train import evaluate_paths
from dipaco_demo.baseline import fetch_run_data, path_losses
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.lifecycle.tasks import advance_run, finish_round
from dipaco_server.runs import evaluate as evaluate_module
from dipaco_server.runs import keys
from dipaco_server.runs.evaluate import evaluate_run, run_plan
from dipaco_server.runs.models import MetricPoint, Run
from dipaco_server.runs.prepare import data_index_key
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store

MODEL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "seq_len": 16,
}
TWO_PATHS = LayoutConfig.grid(2, levels=1, modules=2)  # paths 0, 1 over 0.0 / 0.1 + shared
VAL_TOKENS = 700  # 43 windows of 17 tokens per path: the 1024-window sample takes them all
# 2,499 windows per path: the sample takes 512 of each, at random.
LARGE_VAL_TOKENS = 40_000


@pytest.fixture
def store(settings: Any, tmp_path: Path, db: None) -> BlobStore:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    return get_blob_store()


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One thread: on a shared, loaded machine torch's thread pool stalls tiny ops 10-70x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def publish(
    run: Run, module_id: str, version: int, tensors: dict[str, torch.Tensor], tmp: Path
) -> None:
    file = tmp / f"{module_id}-v{version}"
    sha256, size = write_module(file, tensors)
    key = keys.module_key(run.pk, module_id, version)
    get_blob_store().put_file(key, file)
    publish_module_version(
        run.modules.get(module_id=module_id), version, blob_key=key, sha256=sha256, size=size
    )


def running_run(
    tmp: Path, rounds: int = 10, val_tokens: int = VAL_TOKENS
) -> tuple[Run, list[np.ndarray]]:
    """A running run with version-0 modules and random validation shards per path."""
    config = RunConfig.tiny(model=MODEL, layout=TWO_PATHS, rounds=rounds).model_dump(mode="json")
    del config["name"]
    run = create_run(f"eval-{uuid.uuid4().hex[:8]}", config)
    for module_id, tensors in init_modules(run.run_config).items():
        publish(run, module_id, 0, tensors, tmp)
    rng = np.random.default_rng(0)
    shards, infos = [], []
    for path in run.paths.order_by("index"):
        ids = rng.integers(0, MODEL["vocab_size"], val_tokens).astype("<u2")
        get_blob_store().put_bytes(keys.data_key(run.pk, path.index, "val"), ids.tobytes())
        shards.append(ids.astype(np.int64))
        info = ShardInfo(f"{path.index}/val.bin", val_tokens, 1, "0" * 64)
        infos.append({"train": info, "val": info})
    index = ShardIndex("<u2", MODEL["vocab_size"], 0, 2, "test", infos)
    get_blob_store().put_file(data_index_key(run.pk), index.save(tmp))
    run.paths.update(train_tokens=100_000, val_tokens=val_tokens)
    for state in ("preparing", "ready", "running"):
        transition(run, state)
    return run, shards


def reference_loss(
    run: Run, p: int, modules: dict[str, dict[str, torch.Tensor]], ids: np.ndarray
) -> float:
    """The loss computed independently: every window [iT, (i+1)T] of a shard that holds
    fewer windows than the sample (so the sample is all of them), all targets."""
    config = run.run_config
    model = build_model(config.model, config.seed)
    model.load_state_dict(assemble_path_state(config, p, modules))
    model.eval()
    t = config.model.seq_len
    windows = torch.stack(
        [torch.from_numpy(ids[i * t : i * t + t + 1]) for i in range((len(ids) - 1) // t)]
    )
    with torch.no_grad():
        logits = model(input_ids=windows[:, :-1]).logits  # (N, T, V)
    return float(F.cross_entropy(logits.transpose(1, 2), windows[:, 1:]))


def series(run: Run, name: str) -> dict[tuple[int, int], float]:
    return {
        (point.path.index, point.round): point.value
        for point in MetricPoint.objects.filter(run=run, name=name).select_related("path")
    }


def test_evaluation_records_each_paths_loss_and_perplexity_on_the_runs_sample(
    store: BlobStore, tmp_path: Path
) -> None:
    run, shards = running_run(tmp_path)
    results = evaluate_run(run, 0)

    initial = init_modules(run.run_config)
    losses = series(run, "val_loss")
    for p in (0, 1):
        assert losses[p, 0] == pytest.approx(reference_loss(run, p, initial, shards[p]), rel=1e-5)
        assert series(run, "val_perplexity")[p, 0] == pytest.approx(math.exp(losses[p, 0]))
    every_window = (VAL_TOKENS - 1) // MODEL["seq_len"]
    assert [r.tokens for r in results] == [every_window * MODEL["seq_len"]] * 2
    assert losses[0, 0] != losses[1, 0], "each path is scored on its own shard and modules"

    assert evaluate_run(run, 0) == [], "a round already scored is not scored again"
    assert MetricPoint.objects.filter(run=run).count() == 6  # loss, its error, perplexity


def improve(run: Run, p: int, ids: np.ndarray, version: int, tmp: Path) -> None:
    """Publish `version` of path p's level module after a few Adam steps on its windows."""
    config = run.run_config
    model = build_model(config.model, config.seed)
    model.load_state_dict(assemble_path_state(config, p, init_modules(config)))
    t = config.model.seq_len
    windows = torch.stack([torch.from_numpy(ids[i * t : i * t + t + 1]) for i in range(32)])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(10):
        logits = model(input_ids=windows[:, :-1]).logits  # (N, T, V)
        F.cross_entropy(logits.transpose(1, 2), windows[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()
    level = f"0.{p}"
    trained = split_path_state(config, p, {k: v.detach() for k, v in model.state_dict().items()})
    publish(run, level, version, trained[level], tmp)


def test_a_path_without_improvement_for_patience_rounds_stops_and_gets_no_more_units(
    store: BlobStore, tmp_path: Path
) -> None:
    run, shards = running_run(tmp_path)
    evaluate_run(run, 0, patience=2)
    improve(run, 1, shards[1], version=2, tmp=tmp_path)  # path 1 learns in round 1, path 0 not

    first = evaluate_run(run, 1, patience=2)
    second = evaluate_run(run, 2, patience=2)

    assert [(r.path, r.finished) for r in first] == [(0, False), (1, False)]
    assert [(r.path, r.finished) for r in second] == [(0, True), (1, False)]
    paths = {p.index: p for p in run.paths.all()}
    assert (paths[0].state, paths[0].best_round) == ("finished", 0)
    assert (paths[1].state, paths[1].best_round) == ("active", 1)
    assert series(run, "val_loss")[1, 1] < series(run, "val_loss")[1, 0]

    for t in range(3):
        run.rounds.create(t=t, state="closed")
    next_round = open_round(run, 3)
    assert {u.path.index for u in next_round.units.all()} == {1}
    last = evaluate_run(run, 3, patience=2)
    assert [(r.path, r.finished) for r in last] == [(1, True)], "a finished path is not scored"


def test_the_run_finishes_when_its_last_path_stops(store: BlobStore, tmp_path: Path) -> None:
    run, _ = running_run(tmp_path)
    for t in range(2):
        evaluate_run(run, t, patience=1)
    assert set(run.paths.values_list("state", flat=True)) == {"finished"}
    assert advance_run(run, 1) == "finished"
    run.refresh_from_db()
    assert run.state == Run.State.FINISHED


def test_the_server_the_demo_and_the_simulator_give_the_same_weights_the_same_loss(
    store: BlobStore, tmp_path: Path
) -> None:
    run, shards = running_run(tmp_path, val_tokens=LARGE_VAL_TOKENS)
    config = run.run_config
    modules = init_modules(config)

    evaluate_run(run, 0)  # the server's per-round evaluation
    server = {p: series(run, "val_loss")[p, 0] for p in (0, 1)}
    demo_data = fetch_run_data(run.pk, tmp_path / "demo", units=False)  # the demo's summary
    demo = {}
    for p in (0, 1):
        model = build_model(config.model, config.seed)
        model.load_state_dict(assemble_path_state(config, p, modules))
        demo[p] = path_losses(model, demo_data)[p]
    streams = [torch.from_numpy(ids) for ids in shards]  # what dipaco simulate reads
    windows = sample_streams(streams, config.model.seq_len, SAMPLE_WINDOWS, config.seed)
    simulated = evaluate_paths(config, modules, windows)

    for p in (0, 1):
        assert demo[p] == pytest.approx(server[p], rel=1e-6)
        assert simulated[p].loss == pytest.approx(server[p], rel=1e-6)
    assert [int(w.shape[0]) for w in windows.per_path] == [SAMPLE_WINDOWS // 2] * 2
    assert routed_mean(simulated) == pytest.approx((server[0] + server[1]) / 2, rel=1e-6)
    first = torch.stack([torch.from_numpy(shards[0][i * 16 : i * 16 + 17]) for i in range(512)])
    assert not torch.equal(windows.per_path[0], first), "a random sample, not the first windows"


def test_the_validation_sample_is_seeded_and_spread_by_each_paths_share() -> None:
    tokens = [16 * 3000 + 1, 16 * 1000 + 1, 16 * 2 + 1, 5]  # 3000, 1000, 2 and 0 windows

    plan = sample_plan(tokens, 16, 400, seed=3)

    assert [len(row) for row in plan] == [299, 100, 1, 0]  # shares, >= 1 where any, <= all
    assert sum(len(row) for row in plan) == 400
    assert all(row == sorted(set(row)) and all(0 <= i < 3000 for i in row) for row in plan)
    assert sample_plan(tokens, 16, 400, seed=3) == plan
    assert sample_plan(tokens, 16, 400, seed=4) != plan
    with pytest.raises(ValueError, match="val_fraction"):
        sample_plan([5, 10], 16, 400, seed=0)


def with_patience(run: Run, patience: int) -> Run:
    run.config = {**run.config, "eval": {**run.config["eval"], "patience": patience}}
    run.save(update_fields=["config"])
    return Run.objects.get(pk=run.pk)


def closing(run: Run, t: int) -> None:
    open_round(run, t)
    run.rounds.filter(t=t).update(state="closing")


def test_with_patience_a_held_evaluation_does_not_delay_the_next_rounds_opening(
    store: BlobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round t + 1 opens before round t's evaluation; a path that evaluation stops gives up
    its units of round t + 1 not yet leased, and when none is left the run finishes."""
    run, shards = running_run(tmp_path)
    run = with_patience(run, 1)
    seen: list[tuple[int, str | None]] = []
    real = evaluate_module.evaluate_run

    def held(run: Run, t: int, **kwargs: Any) -> Any:  # what the workers see meanwhile
        seen.append((t, run.rounds.filter(t=t + 1).values_list("state", flat=True).first()))
        return real(run, t, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate_run", held)
    closing(run, 0)
    assert finish_round(run.pk, 0) == "opened"
    improve(run, 1, shards[1], version=2, tmp=tmp_path)  # path 1 learns in round 1, path 0 not
    run.rounds.filter(t=1).update(state="closing")
    assert finish_round(run.pk, 1) == "opened"

    assert seen == [(0, "open"), (1, "open")], "round t + 1 was open while t was evaluated"
    paths = dict(run.paths.values_list("index", "state"))
    assert paths == {0: "finished", 1: "active"}  # stopped by round 1's evaluation
    units = dict(run.rounds.get(t=2).units.values_list("path__index", "state"))
    assert units == {0: "expired", 1: "queued"}, "the stopped path's unit is not leased"

    run.rounds.filter(t=2).update(state="closing")
    assert finish_round(run.pk, 2) == "finished"  # round 2 opened, its evaluation stops path 1
    assert dict(run.rounds.get(t=3).units.values_list("path__index", "state")) == {1: "expired"}
    assert run.rounds.get(t=3).state == "closed", "no unit is out: nothing else closes it"
    run.refresh_from_db()
    assert run.state == Run.State.FINISHED


# --- rotation: a grid too large for the budget scores a group of paths a round ----------------


def test_a_16x16_grid_at_the_150m_budget_rotates_every_path_through_enough_windows() -> None:
    config = RunConfig.paper_150m(layout=LayoutConfig.grid(12, levels=2, modules=16))
    budget, minimum = sample_size(config), config.eval.min_path_windows
    assert (budget, minimum, config.model.seq_len) == (291, 16, 1024)  # eval.flops' windows
    tokens = [1024 * 400 + 1] * 256  # 400 windows of the 150M preset's 1,024 tokens a path

    plan = eval_plan(tokens, 1024, budget, minimum, seed=0)

    assert plan.rotated and plan.every == 15  # 291 // 16 = 18 paths a round at most
    for t in range(3 * plan.every):
        due = plan.paths_at(t)
        assert 17 <= len(due) <= 18
        assert all(len(plan.windows[p]) >= minimum for p in due)
        assert plan.round_windows(t) <= budget
    for start in range(plan.every):  # any K consecutive rounds score every path once
        seen = [p for t in range(start, start + plan.every) for p in plan.paths_at(t)]
        assert sorted(seen) == list(range(256))
    assert plan == eval_plan(tokens, 1024, budget, minimum, seed=0), "seeded: never moves"
    assert all(row == sorted(set(row)) and all(0 <= i < 400 for i in row) for row in plan.windows)


def test_a_rotated_path_with_fewer_windows_than_the_minimum_is_scored_on_all_it_has() -> None:
    tokens = [16 * 3 + 1, 5] + [16 * 100 + 1] * 8  # 3 windows, none, then 100 each

    plan = eval_plan(tokens, 16, 40, 10, seed=1)  # 4 paths a round at most

    assert plan.every == 3  # 9 paths with windows; the one without is in no group
    assert sorted(p for g in plan.groups for p in g) == [0, *range(2, 10)]
    assert len(plan.windows[0]) == 3 and plan.windows[1] == []
    assert all(plan.round_windows(t) <= 40 for t in range(3))


def test_a_grid_that_fits_the_budget_is_scored_as_without_rotation() -> None:
    for tokens, count in (
        ([16 * 3000 + 1, 16 * 1000 + 1, 16 * 2 + 1, 5], 400),  # uneven, one path without text
        ([16 * 500 + 1] * 64, 1024),  # 8x8 at the tiny preset's 1,024 windows: 16 each
    ):
        plan = eval_plan(tokens, 16, count, 16, seed=3)
        assert plan == EvalPlan(sample_plan(tokens, 16, count, 3), [list(range(len(tokens)))])
        assert not plan.rotated
        assert all(plan.paths_at(t) == [p for p in range(len(tokens)) if plan.windows[p]]
                   for t in range(3))  # fmt: skip


def rotated(run: Run) -> Run:
    """The run's two paths scored in turns: no budget holds two paths of 1,000 windows."""
    run.config = {**run.config, "eval": {**run.config["eval"], "min_path_windows": 1000}}
    run.save(update_fields=["config"])
    return Run.objects.get(pk=run.pk)


def test_a_rotated_path_stops_after_patience_of_its_own_evaluations_not_rounds(
    store: BlobStore, tmp_path: Path
) -> None:
    run, _ = running_run(tmp_path, rounds=12)
    run = rotated(run)
    plan = run_plan(run.run_config, [VAL_TOKENS, VAL_TOKENS])
    assert plan.every == 2 and plan.windows[0] and plan.windows[1]

    results = {t: evaluate_run(run, t, patience=2) for t in range(5)}

    # Round t scores path t mod 2 only; neither learns, so its first point stays its best.
    assert {t: [(r.path, r.finished) for r in rs] for t, rs in results.items()} == {
        0: [(0, False)],
        1: [(1, False)],
        2: [(0, False)],  # 2 rounds after its best, but 1 evaluation: not yet
        3: [(1, False)],
        4: [(0, True)],  # its second evaluation without beating round 0's
    }
    assert sorted(series(run, "val_loss")) == [(0, 0), (0, 2), (0, 4), (1, 1), (1, 3)]
    paths = {p.index: p for p in run.paths.all()}
    assert (paths[0].state, paths[0].best_round) == ("finished", 0)
    assert (paths[1].state, paths[1].best_round) == ("active", 1)


def test_each_points_standard_error_is_recorded_and_served_by_the_metrics_api(
    store: BlobStore, tmp_path: Path, client: Any, settings: Any
) -> None:
    from dipaco_server.accounts.services import create_api_token, create_user

    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    run, shards = running_run(tmp_path)
    results = evaluate_run(run, 0)

    config = run.run_config
    t = config.model.seq_len
    for r in results:  # every window of the shard is in the sample (VAL_TOKENS)
        model = build_model(config.model, config.seed)
        model.load_state_dict(assemble_path_state(config, r.path, init_modules(config)))
        ids = shards[r.path]
        windows = torch.stack(
            [torch.from_numpy(ids[i * t : i * t + t + 1]) for i in range((len(ids) - 1) // t)]
        )
        losses = window_losses(model, windows)
        expected = float(losses.std()) / math.sqrt(len(losses))
        assert r.stderr == pytest.approx(expected, rel=1e-4)
        assert series(run, "val_loss_se")[r.path, 0] == pytest.approx(r.stderr)

    user, _ = create_user("ops", staff=True)
    token = create_api_token(user, name="tests")[1]
    served = client.get(
        f"/api/v1/runs/{run.pk}/metrics?name=val_loss_se",
        headers={"Authorization": f"Bearer {token}"},
    ).json()
    assert {(p["path"], p["round"]): p["value"] for p in served["items"]} == {
        (r.path, 0): pytest.approx(r.stderr) for r in results
    }
