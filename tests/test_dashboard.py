"""The dashboard through Django's test client: every page and live part, and who may act.

Also home of `build_short_run`, the run the browser tests (tests/browser) look at.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.db import transaction
from django.test import Client
from django.utils import timezone

from dipaco.data.windows import unit_tokens
from dipaco_server.rounds.lifecycle.close import mark_round_closed, mark_round_closing
from dipaco_server.rounds.lifecycle.open import open_round, start_run
from dipaco_server.rounds.models import Contribution
from dipaco_server.rounds.protocol.complete import ContributionReport, complete
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.rounds.verification.credit import credit
from dipaco_server.runs import keys
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import record_metric, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import get_blob_store
from dipaco_server.workers.models import Worker
from dipaco_web import queries
from tests.test_models import SHARD_TOKENS, make_run, make_worker
from tests.test_worker_api import call, new_worker, running_run, take_lease, upload_fake_deltas

ROUTING_SHARES = (0.4, 0.3, 0.2, 0.1)  # path p's share of documents
VAL_TOKENS = (4000, 3000, 2000, 1000)


def val_loss_of(path: int, t: int) -> float:
    return round(6.0 - 0.45 * t - 0.1 * path, 4)


def train_loss_of(path: int, t: int) -> float:
    return round(6.4 - 0.5 * t - 0.1 * path, 4)


def _sha(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()


@dataclass
class ShortRun:
    run: Run
    workers: dict[str, Worker]
    rounds_done: int
    rejected: int  # Δs rejected in round 0 (every module of gamma's unit)


def build_short_run(name: str = "short-run", rounds_done: int = 3) -> ShortRun:
    """A run advanced through the control plane's services without training.

    Rounds, work units, leases, completions, module versions and metric points all
    go through the real services; what a trainer and the outer step would compute
    (Δ sizes and checksums, losses, the accept/reject verdicts) is made up. Three
    rounds are closed, round 3 is open with alpha training on it, gamma's Δs of
    round 0 were rejected, and gamma was last seen hours ago.
    """
    run = make_run(name, rounds=rounds_done + 2)
    config = run.run_config
    params = config.module_param_counts()
    start = timezone.now() - timedelta(hours=2)
    for module in run.modules.all():
        size = 4 * params[module.module_id]
        key = keys.module_key(run.pk, module.module_id, 0)
        publish_module_version(module, 0, blob_key=key, sha256=_sha(key), size=size)
    for path in run.paths.all():
        path.train_tokens, path.val_tokens = SHARD_TOKENS, VAL_TOKENS[path.index]
        path.routing_share = ROUTING_SHARES[path.index]
        path.save()
    transition(run, Run.State.PREPARING)
    transition(run, Run.State.READY)
    workers = {n: make_worker(f"{n}-box") for n in ("alpha", "beta", "gamma")}
    devices = {
        "alpha": {"gpu": "NVIDIA A100", "memory_gb": 80},
        "beta": {"gpu": "RTX 4090", "memory_gb": 24},
        "gamma": {"gpu": "none", "memory_gb": 16},
    }
    for key, device in devices.items():
        Worker.objects.filter(pk=workers[key].pk).update(device=device)
    start_run(run, now=start)
    rejected = 0
    for t in range(rounds_done):
        opened = start + timedelta(minutes=20 * t)
        round_ = open_round(run, t, now=opened)
        crew = ["alpha", "beta", "gamma"] if t == 0 else ["alpha", "beta"]
        for i in range(config.num_paths * config.replicas_per_path):
            worker = workers[crew[i % len(crew)]]
            grant = grant_lease(worker, now=opened + timedelta(minutes=i))
            assert grant is not None, f"round {t} ran out of units after {i}"
            reports = [
                ContributionReport(
                    m,
                    2 * params[m],
                    _sha(t, i, m),
                    unit_tokens(config),
                    {"tokens_per_second": 900.0},
                )
                for m in grant.unit.path.modules
            ]
            # One second after the grant: the server's own measure of the speed (tokens over
            # the lease's wall time, workers.speed) stays above the 900 tokens/s claimed.
            complete(
                worker,
                grant.lease.pk,
                grant.secret,
                reports,
                now=opened + timedelta(minutes=i, seconds=1),
            )
            # What the worker API records from the completion's metrics (rounds.protocol.api).
            path = grant.unit.path
            record_metric(run, "loss", train_loss_of(path.index, t), path=path, round=t)
        # The outer step's verdicts (its Celery task decides them for real).
        verdicts = Contribution.objects.filter(unit__round=round_)
        verdicts.update(status=Contribution.Status.ACCEPTED, verified_at=timezone.now())
        if t == 0:
            rejected = verdicts.filter(lease__worker=workers["gamma"]).update(
                status=Contribution.Status.REJECTED, reason="non-finite values"
            )
        # ...and the credit it gives for them (the leaderboard shows it).
        with transaction.atomic():  # as in the outer step's commit, which locks the units
            credit(set(verdicts.values_list("unit_id", flat=True)), unit_tokens(config))
        closed = opened + timedelta(minutes=5 + 3 * t)
        assert mark_round_closing(round_, now=closed)
        for module in run.modules.all():
            size = 4 * params[module.module_id]
            key = keys.module_key(run.pk, module.module_id, t + 1)
            publish_module_version(module, t + 1, blob_key=key, sha256=_sha(key), size=size)
        assert mark_round_closed(round_, now=closed)
        routed = 0.0
        for path in run.paths.order_by("index"):
            record_metric(run, "val_loss", val_loss_of(path.index, t), path=path, round=t)
            routed += VAL_TOKENS[path.index] * val_loss_of(path.index, t) / sum(VAL_TOKENS)
        record_metric(run, "routed_val_loss", routed, round=t)
    open_round(run, rounds_done)
    assert grant_lease(workers["alpha"]) is not None  # alpha trains round 3 now
    now = timezone.now()
    Worker.objects.filter(pk__in=[workers["alpha"].pk, workers["beta"].pk]).update(last_seen=now)
    Worker.objects.filter(pk=workers["gamma"].pk).update(last_seen=now - timedelta(hours=3))
    run.refresh_from_db()
    return ShortRun(run=run, workers=workers, rounds_done=rounds_done, rejected=rejected)


def make_user(username: str = "operator", *, staff: bool = True) -> Any:
    return get_user_model().objects.create_user(
        username, password="a long test password", is_staff=staff
    )


def chart_data(html: str) -> dict[str, Any]:
    """The charts' JSON as the page embeds it for dashboard.js."""
    match = re.search(r'<script id="run-charts" type="application/json">(.*?)</script>', html, re.S)
    assert match, "the page has no chart data"
    data: dict[str, Any] = json.loads(match.group(1))
    return data


@pytest.fixture
def short_run(db: None) -> ShortRun:
    return build_short_run()


# --- pages and their live parts ------------------------------------------------------------


def test_the_runs_page_lists_each_run_with_its_figures(client: Client, short_run: ShortRun) -> None:
    make_run("an-empty-draft")
    html = client.get("/").content.decode()
    row = html[html.index(f'data-run="{short_run.run.pk}"') :].split("</tr>")[0]
    assert "short-run" in row and "running" in row
    assert "3 / 5" in row  # rounds done
    assert "4 / 4" in row  # paths active
    best = min(val_loss_of(p, t) for p in range(4) for t in range(3))
    assert f"{math.exp(best):,.2f}" in row
    units = 4 * 3 - 1  # gamma's unit of round 0 was rejected
    tokens = units * unit_tokens(short_run.run.run_config)
    assert f"{tokens / 1000:.3g}k" in row
    assert "an-empty-draft" in html and "/api/v1/docs" in html


def test_the_runs_live_part_swaps_the_table_out_of_band(
    client: Client, short_run: ShortRun
) -> None:
    response = client.get("/live/runs/")
    html = response.content.decode()
    assert response.status_code == 200
    assert 'id="runs-table" class="card" hx-swap-oob="true"' in html
    assert "short-run" in html and 'id="updated"' in html


def test_the_run_page_draws_every_path_and_the_routed_mean(
    client: Client, short_run: ShortRun
) -> None:
    html = client.get(f"/runs/{short_run.run.pk}/").content.decode()
    charts = chart_data(html)
    validation = charts["val_loss"]
    assert validation["x"] == [1, 2, 3]  # rounds counted from 1 (dipaco_web.numbering)
    labels = [s["label"] for s in validation["series"]]
    assert labels == ["path 0", "path 1", "path 2", "path 3", "routed mean"]
    assert validation["series"][2]["values"] == [val_loss_of(2, t) for t in range(3)]
    routed = validation["series"][-1]["values"]
    assert routed == pytest.approx(
        [
            sum(VAL_TOKENS[p] * val_loss_of(p, t) for p in range(4)) / sum(VAL_TOKENS)
            for t in range(3)
        ]
    )
    assert charts["train_loss"]["series"][0]["values"] == [train_loss_of(0, t) for t in range(3)]
    assert charts["val_perplexity"]["series"][0]["values"][0] == pytest.approx(
        math.exp(val_loss_of(0, 0))
    )
    dipaco, data_parallel = (s["values"] for s in charts["communication"]["series"])
    assert len(dipaco) == 3 and all(a < b for a, b in zip(dipaco, data_parallel, strict=True))


def test_the_training_loss_chart_shows_the_losses_workers_report_when_they_complete(
    client: Client, settings: Any, tmp_path: Path, db: None
) -> None:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    store = get_blob_store()
    run = running_run(store)
    reported: dict[int, list[float]] = {}
    for i, loss in enumerate((7.25, 6.5, 7.0)):
        _, token = new_worker(f"box-{i}")
        lease = take_lease(client, token)
        # The metrics worker_agent.agent sends with its completion.
        metrics = {"loss": loss, "tokens_per_second": 900.0, "train_seconds": 12.0}
        body = {
            "contributions": upload_fake_deltas(store, lease),
            "tokens": unit_tokens(run.run_config),
            "metrics": metrics,
        }
        action = f"/lease/{lease['lease_id']}/complete"
        done = call(client, "POST", action, token, body, lease["lease_secret"])
        assert done.status_code == 200, done.content
        reported.setdefault(lease["path"], []).append(loss)

    training = chart_data(client.get(f"/runs/{run.pk}/").content.decode())["train_loss"]
    assert training["x"] == [1]  # round index 0 is round 1 for people
    shown = {s["label"]: s["values"] for s in training["series"]}
    assert shown == {
        f"path {p}": [pytest.approx(sum(losses) / len(losses))] for p, losses in reported.items()
    }


def test_the_run_page_shows_rounds_modules_paths_and_active_workers(
    client: Client, short_run: ShortRun
) -> None:
    html = client.get(f"/runs/{short_run.run.pk}/").content.decode()
    rounds = re.findall(r'<tr data-round="(\d+)">', html)
    assert rounds == ["3", "2", "1", "0"]
    round_0 = html[html.index('data-round="0"') :].split("</tr>")[0]
    assert f'<td class="num bad">{short_run.rejected}</td>' in round_0
    assert "5 min 00 s" in round_0  # opened, then closed 5 minutes later
    for module in ("0.0", "0.1", "1.0", "1.1", "shared"):
        version = re.search(
            rf'data-module="{module}">\s*<code>{module}</code>\s*<span class="version">v(\d+)<',
            html,
        )
        assert version and version.group(1) == "3", module
    run_id = short_run.run.pk
    for p in range(4):
        assert f'href="/api/v1/runs/{run_id}/paths/{p}/download"' in html
    assert "40.0 %" in html  # path 0's routing share
    workers = html[html.index('id="run-workers"') : html.index('id="run-paths"')]
    assert "alpha-box" in workers and "beta-box" not in workers


def test_communication_compares_bytes_moved_with_data_parallel(
    client: Client, short_run: ShortRun
) -> None:
    response = client.get(f"/runs/{short_run.run.pk}/")
    config = short_run.run.run_config
    params = config.module_param_counts()
    path_params = sum(params[m] for m in short_run.run.paths.get(index=0).modules)
    units = 4 * 3
    down = units * 4 * path_params  # fp32 weights of the base versions
    up = units * 2 * path_params  # the Δs as reported (2 bytes a parameter)
    data_parallel = units * config.inner.steps * 2 * 4 * path_params
    communication = response.context["communication"]
    assert communication.total_moved == down + up
    assert communication.total_data_parallel == data_parallel
    assert communication.ratio == pytest.approx(data_parallel / (down + up))
    assert f"{data_parallel / (down + up):,.1f}×" in response.content.decode()


def test_communication_counts_only_the_steps_a_sized_or_salvaged_unit_trained(
    short_run: ShortRun,
) -> None:
    from dipaco_server.rounds.models import Lease
    from dipaco_web.curves import communication

    config = short_run.run.run_config
    params = config.module_param_counts()
    before = communication(short_run.run).total_data_parallel
    lease = Lease.objects.filter(unit__round__run=short_run.run, state="completed").first()
    assert lease is not None
    per_step = config.inner.batch_size * config.model.seq_len
    Contribution.objects.filter(lease=lease).update(tokens=2 * per_step)  # 2 of H steps
    path_params = sum(params[m] for m in lease.unit.path.modules)
    after = communication(short_run.run).total_data_parallel
    assert before - after == (config.inner.steps - 2) * 2 * 4 * path_params


def test_the_run_live_part_carries_every_section_and_the_chart_data(
    client: Client, short_run: ShortRun
) -> None:
    html = client.get(f"/runs/{short_run.run.pk}/live/").content.decode()
    for section in ("run-header", "run-charts-data", "run-communication", "run-workers"):
        assert re.search(rf'id="{section}"[^>]*hx-swap-oob="true"', html), section
    for section in ("run-paths", "run-modules", "run-rounds", "updated"):
        assert re.search(rf'id="{section}"[^>]*hx-swap-oob="true"', html), section
    assert chart_data(html)["val_loss"]["x"] == [1, 2, 3]


def test_pages_poll_their_live_part_at_most_five_seconds_apart(
    client: Client, short_run: ShortRun
) -> None:
    for page, live in (
        ("/", "/live/runs/"),
        (f"/runs/{short_run.run.pk}/", f"/runs/{short_run.run.pk}/live/"),
        ("/workers/", "/workers/live/"),
    ):
        html = client.get(page).content.decode()
        poller = re.search(r'hx-get="([^"]+)" hx-trigger="every (\d+)ms"', html)
        assert poller, page
        assert poller.group(1) == live and int(poller.group(2)) <= 5000


def test_the_workers_page_shows_status_device_and_the_leaderboard(
    client: Client, short_run: ShortRun
) -> None:
    html = client.get("/workers/").content.decode()
    rows = {
        name: html[html.index(f'data-worker="{w.pk}">', html.index('id="workers-table"')) :].split(
            "</tr>"
        )[0]
        for name, w in short_run.workers.items()
    }
    assert "online" in rows["alpha"] and "NVIDIA A100 · 80 GB" in rows["alpha"]
    assert "offline" in rows["gamma"] and "3 h 00 min ago" in rows["gamma"]
    assert "short-run · path" in rows["alpha"]  # training now
    assert "900 tok/s" in rows["beta"]
    assert f'<td class="num bad">{short_run.rejected}</td>' in rows["gamma"]
    board = html[html.index('id="workers-leaderboard"') : html.index('id="workers-table"')]
    ranked = re.findall(r'<span class="name">([\w-]+)', board)
    assert ranked[:2] == ["alpha-box", "beta-box"] and "gamma-box" not in ranked
    assert "2 online of 3" in html


def test_the_workers_live_part_swaps_both_tables(client: Client, short_run: ShortRun) -> None:
    html = client.get("/workers/live/").content.decode()
    assert 'id="workers-table" class="card" hx-swap-oob="true"' in html
    assert 'id="workers-leaderboard" class="card" hx-swap-oob="true"' in html


def test_an_empty_dashboard_says_what_to_do(client: Client, db: None) -> None:
    assert "No runs yet" in client.get("/").content.decode()
    assert "No worker has registered yet" in client.get("/workers/").content.decode()
    draft = make_run("fresh")
    html = client.get(f"/runs/{draft.pk}/").content.decode()
    assert chart_data(html)["val_loss"] == {"x": [], "series": []}
    assert "No round has opened yet" in html


def test_an_unknown_run_is_404(client: Client, db: None) -> None:
    assert client.get("/runs/999999/").status_code == 404
    assert client.get("/runs/999999/live/").status_code == 404


def test_the_routed_mean_weights_path_losses_by_validation_tokens_unless_recorded(
    db: None,
) -> None:
    run = make_run("weighted")
    paths = list(run.paths.order_by("index"))
    for path, tokens in zip(paths, (3000, 1000, 0, 0), strict=True):
        path.val_tokens = tokens
        path.save()
    record_metric(run, "val_loss", 4.0, path=paths[0], round=0)
    record_metric(run, "val_loss", 6.0, path=paths[1], round=0)
    record_metric(run, "val_loss", 5.0, path=paths[1], round=1)
    record_metric(run, "val_loss", 7.0, path=paths[0], round=2)
    record_metric(run, "routed_val_loss", 6.5, round=2)  # the evaluation task's own figure wins
    assert queries.routed_val_losses(run) == {0: 4.5, 1: 5.0, 2: 6.5}
    run.paths.update(val_tokens=0)  # no token counts known: every path alike
    assert queries.routed_val_losses(run)[0] == 5.0


def test_a_rotated_evaluations_routed_mean_carries_each_paths_latest_loss(db: None) -> None:
    # Four paths, two a round (no budget holds four of 512 windows): path p every 2 rounds.
    run = make_run("rotated", eval={"min_path_windows": 512})
    run.paths.update(val_tokens=128 * 600 + 1)
    assert queries.evaluation_every(run) == 2
    paths = list(run.paths.order_by("index"))
    for t, p, loss in ((0, 0, 4.0), (0, 2, 6.0), (1, 1, 5.0), (1, 3, 7.0), (2, 0, 3.0)):
        record_metric(run, "val_loss", loss, path=paths[p], round=t)
    # Round 0 scored half the paths: no routed mean until each has a loss.
    assert queries.routed_val_losses(run) == {1: 5.5, 2: 5.25}


def test_the_validation_charts_carry_each_paths_standard_error_band(db: None) -> None:
    from dipaco_web.curves import loss_charts

    run = make_run("bands")
    path = run.paths.get(index=0)
    for t, loss, se in ((0, 5.0, 0.25), (1, 4.0, None)):
        record_metric(run, "val_loss", loss, path=path, round=t)
        if se is not None:
            record_metric(run, "val_loss_se", se, path=path, round=t)

    charts = loss_charts(run)
    loss = next(s for s in charts["val_loss"]["series"] if s["label"] == "path 0")
    assert (loss["lower"], loss["upper"]) == ([4.75, None], [5.25, None])
    ppl = next(s for s in charts["val_perplexity"]["series"] if s["label"] == "path 0")
    assert ppl.get("lower") == [pytest.approx(math.exp(4.75)), None]
    assert ppl.get("upper") == [pytest.approx(math.exp(5.25)), None]
    routed = next(s for s in charts["val_loss"]["series"] if s["label"] == "routed mean")
    assert "lower" not in routed


@pytest.mark.parametrize(
    ("device", "label"),
    [
        ({"gpu": "NVIDIA H100", "memory_gb": 80}, "NVIDIA H100 · 80 GB"),
        ({"gpu": "none", "memory_gb": 16}, "no GPU · 16 GB"),
        ({"cores": 8, "os": "linux"}, "cores=8 · os=linux"),
        ({}, "unknown"),
        ({"gpu": "x" * 100}, "x" * 59 + "…"),
    ],
)
def test_a_device_reads_as_a_short_label(device: dict[str, Any], label: str) -> None:
    assert queries.device_label(device) == label
