"""What the pages tell a newcomer is true: one round numbering everywhere, counts and
states that mean what they say, site-styled errors, JSON errors under /api/, and no
server path on a public page or download.

The run is `build_short_run`'s (tests/test_dashboard): rounds 0, 1 and 2 (its indices)
closed, round 3 open. People read those as rounds 1-3 closed and round 4 open.
"""

from __future__ import annotations

import io
import json
import re
from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone
from rich.console import Console

from dipaco.cli.download import api_round, round_number
from dipaco.client import _plan_text
from dipaco_demo.display import DemoDisplay
from dipaco_demo.workers import WorkerStatus
from dipaco_server.inference import card
from dipaco_server.inference import selection as inference
from dipaco_server.rounds.models import Round, WorkUnit
from dipaco_server.rounds.verification.replication import CHECK_OFFSET
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.workers.models import EnrollmentToken
from dipaco_server.workers.services import create_enrollment_token
from tests.test_dashboard import ShortRun, build_short_run, chart_data, make_user

SECRET_DIR = "/srv/private-corpora/team-x"


@pytest.fixture
def short_run(db: None) -> ShortRun:
    return build_short_run()


def staff_client() -> Client:
    client = Client()
    client.force_login(make_user())
    return client


def cell_text(html: str) -> str:
    return re.sub(r"<[^>]+>", " ", html)


# --- one round numbering -------------------------------------------------------------------


def test_every_place_a_person_reads_names_the_last_closed_round_the_same(
    client: Client, short_run: ShortRun
) -> None:
    run = short_run.run
    last_index = short_run.rounds_done - 1  # 2: the database's and the API's index
    shown = str(last_index + 1)  # "3": what every page says

    runs_row = client.get("/").content.decode()
    runs_row = runs_row[runs_row.index(f'data-run="{run.pk}"') :].split("</tr>")[0]
    assert f"after round {shown}</span>" in runs_row

    page = client.get(f"/runs/{run.pk}/").content.decode()
    rounds = re.findall(r'<tr data-round="(\d+)">\s*<td class="num">(\d+)</td>', page)
    assert rounds == [(str(t), str(t + 1)) for t in (3, 2, 1, 0)]
    assert chart_data(page)["val_loss"]["x"][-1] == int(shown)
    active = page[page.index('id="run-workers"') : page.index('id="run-paths"')]
    assert re.search(r'<td class="num">\d+</td>\s*<td class="num">4</td>', active), (
        "alpha trains round index 3, the fourth round"
    )

    worker_page = client.get(f"/workers/{short_run.workers['alpha'].pk}/").content.decode()
    unit_rounds = re.findall(
        r'<tr data-lease="\d+">\s*<td>.*?</td>\s*<td class="num">(\d+)</td>', worker_page, re.S
    )
    assert sorted(set(unit_rounds)) == ["1", "2", "3", "4"]

    path_page = client.get(f"/runs/{run.pk}/paths/0/").content.decode()
    assert f"weights after round {shown}</span>" in path_page
    assert f"path 0, after round {shown}</h1>" in path_page  # the model card's title

    selection = inference.select(run.pk, 0)
    assert selection.round == last_index  # the API's machine field is unchanged
    assert selection.folder == f"short-run-path-0-round-{shown}"
    text = card.model_card(selection)
    assert f"| weights | after round {shown} of 5 closed |" in text
    assert "| run | short-run (id" in text and "running, round 4 of 5 |" in text
    assert "| fact | value |" in text, "the facts table has a header row"
    assert json.loads(card.card_files(selection)["dipaco.json"])["round"] == last_index

    assert api_round(round_number(shown)) == last_index  # `dipaco download --round 3`
    assert inference.select(run.pk, 0, api_round(round_number(shown))).folder == selection.folder


def test_the_demo_panel_counts_the_rounds_as_the_dashboard_does() -> None:
    console = Console(file=io.StringIO(), width=160, force_terminal=False)
    display = DemoDisplay(console)
    worker = WorkerStatus(name="worker-1")
    worker.state, worker.round, worker.path = "training", 2, 0
    display.update(rounds=5, round=2, units_total=10, units_done=5, workers=[worker],
                   routed={0: 5.0, 1: 4.5, 2: 4.0})  # fmt: skip
    console.print(display._render())
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "round 3/5" in text  # the stage line
    assert "round 3 path 0" in text  # the worker's row: the same round
    assert "r3: 4.000" in text and "r0:" not in text  # the curve


def test_the_cli_refuses_a_round_below_1() -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="counted from 1"):
        round_number("0")
    assert api_round(None) is None


# --- counts and states -----------------------------------------------------------------------


def test_a_closed_round_counts_the_units_it_needed_not_an_expired_check_copy(
    client: Client, short_run: ShortRun
) -> None:
    round_0 = Round.objects.get(run=short_run.run, t=0)
    original = round_0.units.order_by("replica").first()
    assert original is not None
    WorkUnit.objects.create(
        round=round_0, path=original.path, replica=CHECK_OFFSET + original.replica,
        data_position=original.data_position, data_windows=original.data_windows,
        base_versions=original.base_versions, state=WorkUnit.State.EXPIRED,
    )  # fmt: skip
    page = client.get(f"/runs/{short_run.run.pk}/").content.decode()
    row = page[page.index('<tr data-round="0">') :].split("</tr>")[0]
    assert 'data-units="4/4"' in row and "check" not in row


def test_enrolment_tokens_read_active_used_up_expired_or_revoked(db: None) -> None:
    now = timezone.now()
    active, _ = create_enrollment_token(label="active", max_uses=2)
    used, _ = create_enrollment_token(label="used", max_uses=2)
    EnrollmentToken.objects.filter(pk=used.pk).update(uses=2)
    expired, _ = create_enrollment_token(label="old", expires_in=timedelta(hours=1))
    EnrollmentToken.objects.filter(pk=expired.pk).update(expires_at=now - timedelta(minutes=1))
    revoked, _ = create_enrollment_token(label="gone", max_uses=2)
    EnrollmentToken.objects.filter(pk=revoked.pk).update(revoked=True, uses=2)
    page = staff_client().get("/enroll/").content.decode()
    states = dict(re.findall(r'data-enrollment="(\d+)" data-state="([^"]+)"', page))
    assert states == {
        str(active.pk): "active",
        str(used.pk): "used up",
        str(expired.pk): "expired",
        str(revoked.pk): "revoked",
    }


def test_the_new_run_form_offers_to_add_a_dataset_only_when_there_is_none(db: None) -> None:
    client = staff_client()
    assert "No dataset yet?" in client.get("/runs/new/").content.decode()
    Dataset.objects.create(name="stdlib-3000000-abc", source="stdlib")
    page = client.get("/runs/new/").content.decode()
    assert "No dataset yet?" not in page and ">stdlib-3000000-abc (" in page


def test_the_download_plan_adds_up() -> None:
    files = {f"f{i}": {} for i in range(8)}
    todo = list(files.values())
    # 7 small files and 3 module blobs fetched; model.safetensors assembled from the blobs.
    assert _plan_text(files, todo, fetches=10, modules=3) == (
        "0 of 8 files already there; 7 to fetch, and model.safetensors to assemble from "
        "3 module blobs (3 to fetch)"
    )
    assert _plan_text(files, todo[:2], fetches=2, modules=0) == (
        "6 of 8 files already there; 2 to fetch"
    )


# --- errors ----------------------------------------------------------------------------------


def test_an_unknown_page_is_a_404_of_the_site_with_its_navigation(db: None) -> None:
    response = Client().get("/no/such/page/")
    html = response.content.decode()
    assert response.status_code == 404
    assert 'class="topbar"' in html and "Page not found" in html and 'href="/workers/"' in html


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "PATCH", "DELETE"])
@pytest.mark.parametrize("url", ["/api/v1/no-such-route", "/api/nope", "/api"])
def test_an_unknown_api_path_answers_the_json_404_for_every_method(
    db: None, method: str, url: str
) -> None:
    client = Client(enforce_csrf_checks=True)  # as a browser or curl: no CSRF token
    response = client.generic(method, url, data=b"{}", content_type="application/json")
    assert response.status_code == 404
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["code"] == "not_found"


def test_a_staff_page_refuses_a_signed_in_non_staff_user_with_a_site_page(db: None) -> None:
    client = Client()
    client.force_login(make_user("visitor", staff=False))
    response = client.get("/enroll/")
    html = response.content.decode()
    assert response.status_code == 403
    assert 'class="topbar"' in html and "Not allowed" in html and "staff account" in html


def test_a_dashboard_form_without_its_csrf_token_gets_a_site_page(db: None) -> None:
    response = Client(enforce_csrf_checks=True).post("/login/", {"username": "x"})
    assert response.status_code == 403
    html = response.content.decode()
    assert 'class="topbar"' in html and "reload the page" in html


def test_a_failing_page_answers_a_500_of_the_site_without_a_stack(
    db: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dipaco_web import queries

    def broken() -> list[Any]:
        raise RuntimeError(f"cannot open {SECRET_DIR}/index")

    monkeypatch.setattr(queries, "run_rows", broken)
    response = Client(raise_request_exception=False).get("/")
    html = response.content.decode()
    assert response.status_code == 500
    assert "Something went wrong" in html and 'class="topbar"' in html
    assert SECRET_DIR not in html and "Traceback" not in html


def test_the_favicon_is_served_at_its_usual_address(db: None) -> None:
    response = Client().get("/favicon.ico")
    assert response.status_code == 200 and response["Content-Type"] == "image/x-icon"
    assert b"".join(response.streaming_content)[:4] == b"\x00\x00\x01\x00"  # an ICO header


# --- no server internals in public ----------------------------------------------------------


def _with_private_corpus(run: Run) -> None:
    config = dict(run.config)
    config["data"] = {**config["data"], "corpus": f"{SECRET_DIR}/code.jsonl"}
    Run.objects.filter(pk=run.pk).update(config=config)
    run.refresh_from_db()


def test_the_public_path_page_and_the_download_show_the_corpus_name_not_its_path(
    client: Client, short_run: ShortRun
) -> None:
    run = short_run.run
    _with_private_corpus(run)
    public = client.get(f"/runs/{run.pk}/paths/0/").content.decode()
    assert SECRET_DIR not in public and "code.jsonl" in public
    files = card.card_files(inference.select(run.pk, 0))
    assert all(SECRET_DIR.encode() not in data for data in files.values())
    staff = staff_client().get(f"/runs/{run.pk}/paths/0/").content.decode()
    assert f"{SECRET_DIR}/code.jsonl" in staff


def test_a_failed_runs_error_text_is_for_staff(client: Client, short_run: ShortRun) -> None:
    run = short_run.run
    detail = f"preparation failed: [Errno 2] No such file or directory: '{SECRET_DIR}/x'"
    Run.objects.filter(pk=run.pk).update(state=Run.State.FAILED, error=detail)
    public = client.get(f"/runs/{run.pk}/").content.decode()
    assert SECRET_DIR not in public and "This run failed" in public
    staff = staff_client().get(f"/runs/{run.pk}/").content.decode()
    assert SECRET_DIR in staff
