"""The staff pages' edges through Django's test client (the flows run in Chromium in
tests/browser/test_manage_browser.py): upload limits and bad JSONL, a data root's check,
the enrollment token shown once, revocations, the run form's estimate, the prompt box's
bounds and rate limit, and the audit entries every action writes."""

from __future__ import annotations

import json
import re
from html import unescape
from pathlib import Path
from typing import Any

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from dipaco.config import RunConfig
from dipaco_server.audit.models import AuditEntry
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.workers.models import EnrollmentToken, Worker
from dipaco_web import runform
from tests.test_dashboard import build_short_run, make_user
from tests.test_worker_api import new_worker, sent_tasks

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_password_hashing(settings: Any) -> None:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def staff(client: Client) -> Client:
    client.force_login(make_user())
    return client


def jsonl(*texts: str) -> bytes:
    return "".join(json.dumps({"text": t}) + "\n" for t in texts).encode()


def upload(client: Client, name: str, data: bytes, **extra: Any) -> Any:
    file = SimpleUploadedFile(f"{name}.jsonl", data, content_type="application/jsonl")
    body = {"name": name, "kind": "upload", "file": file, "text_field": "text"}
    return client.post("/datasets/new/", body, **extra)


def test_an_uploaded_jsonl_becomes_a_dataset_under_the_data_root_and_is_sent_to_be_read(
    staff: Client,
) -> None:
    sent_tasks()
    response = upload(staff, "small", jsonl("def f(): pass", "x = 1"))
    dataset = Dataset.objects.get(name="small")
    assert response.status_code == 302 and response["Location"] == f"/datasets/{dataset.pk}/"
    source = Path(dataset.source)
    assert source.read_bytes() == jsonl("def f(): pass", "x = 1")
    assert source.parent.name == "uploads"
    assert ("dipaco_server.runs.tasks.prepare_dataset", f"[{dataset.pk}]") in sent_tasks()
    entry = AuditEntry.objects.get(action="dataset.create")
    assert (entry.channel, entry.outcome, entry.target_id) == ("dashboard", "ok", str(dataset.pk))


def test_a_bad_jsonl_line_or_an_oversized_upload_is_refused_naming_the_fix(
    staff: Client, settings: Any
) -> None:
    bad = upload(staff, "broken", jsonl("fine") + b'{"body": "no text field"}\n')
    assert bad.status_code == 422
    assert "line 2 has no string field 'text'" in unescape(bad.content.decode())
    binary = upload(staff, "binary", b"\x80\x81 not utf-8\n")
    assert binary.status_code == 422 and "line 1 is not UTF-8 JSON" in binary.content.decode()
    settings.DIPACO_DATASET_UPLOAD_MAX_BYTES = 10
    big = upload(staff, "big", jsonl("a text longer than ten bytes"))
    assert big.status_code == 400 and "the limit is 10: upload a sample" in big.content.decode()
    huge = upload(staff, "huge", jsonl("x"), CONTENT_LENGTH=str(50 * 1024 * 1024))
    assert huge.status_code == 413, "refused from its Content-Length, before the body is read"
    assert not Dataset.objects.exists()
    outcomes = list(AuditEntry.objects.order_by("pk").values_list("outcome", "status"))
    assert outcomes == [("refused", 422), ("refused", 422), ("refused", 413)]


def test_a_source_outside_the_data_roots_is_refused_next_to_its_field(staff: Client) -> None:
    response = staff.post("/datasets/new/", {"name": "secrets", "kind": "path",
                                             "source": "/etc"})  # fmt: skip
    html = response.content.decode()
    assert response.status_code == 422 and 'data-error-for="source"' in html
    assert not Dataset.objects.exists()


def test_an_enrollment_token_is_shown_once_with_the_commands_and_can_be_revoked(
    staff: Client, settings: Any
) -> None:
    settings.DIPACO_PUBLIC_URL = "https://dipaco.example.org"
    response = staff.post("/enroll/", {"label": "lab", "max_uses": "3", "expires_in_hours": "2"})
    html = response.content.decode()
    assert response.status_code == 201 and response["Cache-Control"] == "no-store"
    token = re.search(r"<code data-token>(dpe_[\w-]+)</code>", html)
    assert token is not None
    assert f"dipaco-worker --server https://dipaco.example.org --enroll {token[1]}" in html
    row = EnrollmentToken.objects.get()
    assert (row.label, row.max_uses, row.uses) == ("lab", 3, 0) and row.expires_at is not None
    assert token[1] not in staff.get("/enroll/").content.decode(), "shown once"
    assert token[1] not in json.dumps(list(AuditEntry.objects.values("params", "message")))
    staff.post(f"/enroll/{row.pk}/revoke/")
    row.refresh_from_db()
    assert row.revoked
    invalid = staff.post("/enroll/", {"max_uses": "0"})
    assert invalid.status_code == 400 and 'data-error-for="max_uses"' in invalid.content.decode()
    actions = list(AuditEntry.objects.order_by("pk").values_list("action", "outcome"))
    assert actions == [
        ("enrollment_token.create", "ok"),
        ("enrollment_token.revoke", "ok"),
        ("enrollment_token.create", "refused"),
    ]


def test_staff_revoke_a_worker_from_its_page(staff: Client) -> None:
    worker, _ = new_worker("box")
    page = f"/workers/{worker.pk}/"
    assert 'data-action="revoke"' in staff.get(page).content.decode()
    assert staff.post(f"{page}revoke/").status_code == 302
    worker.refresh_from_db()
    assert worker.revoked
    assert 'data-action="revoke"' not in staff.get(page).content.decode()
    assert AuditEntry.objects.get().action == "worker.revoke"
    assert Client().post(f"/workers/{worker.pk}/revoke/").status_code == 403


def test_the_run_form_shows_a_presets_estimate_and_creates_a_draft_from_edited_fields(
    staff: Client,
) -> None:
    page = staff.get("/runs/new/?preset=small").content.decode()
    small = runform.estimate(RunConfig.model_validate(runform.preset("small").config))
    assert "8.62M" in page and f"{small.total_gib:.2f} GiB" in page
    fields = {name: value for name, value in runform.flatten(runform.preset("demo").config)}
    body = {name: json.dumps(v) if not isinstance(v, str) else v for name, v in fields.items()}
    body.update({"name": "edited", "preset": "demo", "submit": "create", "rounds": "7",
                 "model.tie_embeddings": "true", "layout.path_specific": "[]"})  # fmt: skip
    response = staff.post("/runs/new/", body)
    run = Run.objects.get(name="edited")
    assert response.status_code == 302 and response["Location"] == f"/runs/{run.pk}/"
    assert run.state == "draft" and run.config["rounds"] == 7
    assert run.config["model"]["tie_embeddings"] is True
    html = staff.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-action="prepare"' in html
    taken = staff.post("/runs/new/", body)
    assert taken.status_code == 400
    assert "a run named 'edited' exists" in unescape(taken.content.decode())


def test_a_problem_inside_a_list_is_shown_at_the_lists_field(staff: Client) -> None:
    response = staff.post(
        "/runs/new/",
        {
            "name": "r",
            "preset": "demo",
            "submit": "check",
            "layout.levels": '[{"blocks": [0, 3], "modules": 2}]',
        },
    )
    html = response.content.decode()  # fmt: skip
    assert response.status_code == 400
    assert 'data-error-for="layout.levels"' in html and "num_layers" in html


def test_the_prompt_box_is_bounded_and_rate_limited(client: Client, settings: Any) -> None:
    run = build_short_run().run  # made-up blobs: generation itself is tested in Chromium
    url = f"/runs/{run.pk}/paths/0/generate/"
    assert client.post(url, {"prompt": " "}).status_code == 422
    long = client.post(url, {"prompt": "x" * 2001})
    assert long.status_code == 422 and "the limit is 2,000" in long.content.decode()
    settings.DIPACO_GENERATE_RATE = (2, 60)
    statuses = [client.post(url, {"prompt": "def f():"}).status_code for _ in range(3)]
    assert statuses[2] == 429 and statuses[:2] != [429, 429]
    refused = client.post(url, {"prompt": "def f():"})
    assert refused.status_code == 429 and int(refused["Retry-After"]) >= 1
    assert client.get(url).status_code == 405


def test_a_worker_page_is_public_and_shows_no_staff_button_to_visitors(client: Client) -> None:
    short = build_short_run()
    gamma = short.workers["gamma"]
    html = client.get(f"/workers/{gamma.pk}/").content.decode()
    assert "non-finite values" in html and 'data-status="rejected"' in html
    assert 'data-action="revoke"' not in html
    live = client.get(f"/workers/{gamma.pk}/live/").content.decode()
    assert live.count('hx-swap-oob="true"') == 4 and "non-finite values" in live
    assert client.get("/workers/999999/").status_code == 404
    assert Worker.objects.filter(revoked=True).count() == 0


def test_the_run_page_shows_preparation_progress(staff: Client) -> None:
    from dipaco_server.runs.prepare import report_progress
    from dipaco_server.runs.services import transition
    from tests.test_models import make_run

    run = make_run("preparing-run")
    transition(run, Run.State.PREPARING)
    waiting = staff.get(f"/runs/{run.pk}/").content.decode()
    assert 'data-progress="queued"' in waiting and "waiting for a Celery worker" in waiting
    report_progress(run, "shards", 4, 5, "tokenising and routing 120 documents")
    html = staff.get(f"/runs/{run.pk}/live/").content.decode()
    assert 'data-progress="shards"' in html and 'value="4"' in html
    assert "step 4 of 5, shards" in html and "tokenising and routing 120 documents" in html
    assert "data-pieces" not in html
    run.progress["pieces"] = {"done": 3, "total": 8}  # runs.pieces.record_pieces
    Run.objects.filter(pk=run.pk).update(progress=run.progress)
    html = staff.get(f"/runs/{run.pk}/live/").content.decode()
    assert 'data-pieces="3/8"' in html and "Pieces: 3 of 8 files" in html


def test_the_prompt_box_routes_a_text_to_its_path_and_continues_it(
    client: Client, settings: Any, tmp_path: Path
) -> None:
    """A prepared 2x2 run (tf-idf router): the text goes to the router's path, whichever
    path page it was typed on, and that path's weights continue it, bounded in tokens."""
    from dipaco_server.inference.routing import route_text
    from dipaco_server.runs.prepare import prepare_run
    from dipaco_server.runs.versions import publish_module_version
    from tests.test_two_phases import FILES, new_run

    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_GENERATE_MAX_NEW_TOKENS = 5
    run = new_run()
    prepare_run(run, max_files=FILES)
    for module in run.modules.all():  # "after round 0": version 1, the initial weights again
        v0 = module.versions.get(version=0)
        publish_module_version(module, 1, blob_key=v0.blob_key, sha256=v0.sha256, size=v0.size)
    prompt = "import os\n\ndef main():\n    return os.getcwd()\n"
    routed = route_text(run.pk, prompt)["path"]
    other = (routed + 1) % 4
    response = client.post(f"/runs/{run.pk}/paths/{other}/generate/", {"prompt": prompt})
    html = unescape(response.content.decode())
    assert response.status_code == 200, html
    assert f'data-routed-path="{routed}"' in html and f"not this page's path {other}" in html
    generated = re.search(r"(\d+) new tokens?", html)
    assert generated is not None and 1 <= int(generated[1]) <= 5, "bounded by the setting"
    page = client.get(f"/runs/{run.pk}/paths/{routed}/").content.decode()
    assert "the run's router picks the path" in page and "data-download" in page
