"""Running the platform from the browser (headless Chromium, Selenium), end to end.

- A staff member uploads a dataset, creates a run from the form's config editor, prepares
  and starts it from its page; a real `dipaco-worker`, enrolled with a token made on
  /enroll/ and the commands shown there, trains its round 0, which a real Celery worker
  closes (outer step, evaluation). The path page's zip is then byte for byte what
  `dipaco download` writes, and its prompt box continues a text.
- An invalid config shows the schema's error next to its field and creates nothing.
- A contribution the outer step rejects (a real verification, in this process) shows on
  its worker's page with the reason.
- Anonymous visitors reach no staff page or action; a POST without the CSRF token is
  refused even for staff.

The server is pytest-django's live server on the session's database; the Celery worker is
docker-compose.yml's command on the session's embedded broker (the data dir's filesystem
queue, which this session alone uses), consuming the default queue the web app sends to.
Screenshots of every page go to test-artifacts/.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from dipaco.codecs import encode
from dipaco.config import LayoutConfig
from dipaco.modular import init_modules
from dipaco_server.audit.models import AuditEntry
from dipaco_server.env import celery_transport
from dipaco_server.rounds.lifecycle.close import mark_round_closing
from dipaco_server.rounds.lifecycle.open import start_run
from dipaco_server.rounds.models import Contribution, Round
from dipaco_server.rounds.outer.step import step_module
from dipaco_server.rounds.protocol.complete import ContributionReport, complete, upload_key
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.runs import keys
from dipaco_server.runs.models import Dataset, MetricPoint, ModuleVersion, Run
from dipaco_server.runs.services import create_run, transition
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import get_blob_store
from dipaco_server.workers.models import EnrollmentToken, Worker
from tests.browser.test_dashboard_browser import (
    PASSWORD,
    console_errors,
    open_page,
    screenshot,
    text_of,
    wait_for,
)
from tests.conftest import (
    CeleryWorker,
    celery_client,
    compose_command,
    compose_env,
    log_tail,
    session_database_url,
    start_process,
    stop_process,
)
from tests.test_worker_agent_e2e import WorkerProcess
from tests.test_worker_api import new_worker, put_train_shards

pytestmark = pytest.mark.django_db(transaction=True)
MODEL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
         "intermediate_size": 64, "vocab_size": 512, "seq_len": 32}  # fmt: skip
DOCUMENTS = 160
TRAIN_TIMEOUT_S = 180.0


def run_config() -> dict[str, Any]:
    """One path of a micro model, 3 inner steps a unit, 2 rounds: seconds on a busy CPU."""
    return {
        "rounds": 2,
        "model": MODEL,
        "layout": LayoutConfig.grid(2, levels=1, modules=1).model_dump(mode="json"),
        "inner": {"steps": 3, "warmup_steps": 1, "micro_batch_size": 4, "grad_accum_steps": 1},
        "data": {"val_fraction": 0.2},
    }


def corpus(path: Path) -> Path:
    """A JSONL corpus of small made-up Python functions, one document a line."""
    with path.open("w") as out:
        for i in range(DOCUMENTS):
            text = f"def f{i}(x, y):\n    z = x * {i} + y\n    return z - {i % 7}\n"
            out.write(json.dumps({"text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def default_queue_worker(
    django_db_setup: None, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[CeleryWorker]:
    """docker-compose.yml's Celery worker on the session's embedded broker and database,
    on the default queue: the tasks the web app sends (preparation, round closing)."""
    data = Path(os.environ["DIPACO_DATA_DIR"])
    transport = celery_transport(data, None)
    for stale in Path(transport["broker_transport_options"]["data_folder_in"]).glob("*.msg"):
        stale.unlink()  # earlier tests' messages, for rows that no longer exist
    environ = compose_env(
        DIPACO_DATA_DIR=str(data), DATABASE_URL=session_database_url(), CELERY_CONCURRENCY="1"
    )
    tag = f"dipaco-web-test-{uuid.uuid4().hex[:8]}"
    command = [*compose_command("worker", environ), "--queues=celery", f"--hostname={tag}@%h"]
    log_path = tmp_path_factory.mktemp("web-celery") / "worker.log"
    process = start_process(command, environ, log_path)
    app = celery_client(transport, "celery")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Celery worker exited:\n{log_tail(log_path)}")
        if any(tag in name for reply in app.control.ping(timeout=0.5) for name in reply):
            break
    else:
        stop_process(process)
        raise RuntimeError(f"the Celery worker did not answer:\n{log_tail(log_path)}")
    yield CeleryWorker(app=app, queue="celery", process=process, log_path=log_path)
    stop_process(process)
    app.close()


@pytest.fixture
def staff_browser(transactional_db: None, live_server: Any, settings: Any, browser: Any) -> Any:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.DIPACO_DASHBOARD_POLL_S = 1
    settings.DIPACO_PUBLIC_URL = live_server.url
    browser.delete_all_cookies()
    return browser


def sign_in(browser: Any, live_server: Any, next_path: str) -> None:
    from selenium.webdriver.common.by import By

    get_user_model().objects.create_user("operator", password=PASSWORD, is_staff=True)
    open_page(browser, live_server, f"/login/?next={next_path}")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "form.stacked button").click()
    wait_for(browser, f"return location.pathname === '{next_path}'")


def click(browser: Any, selector: str) -> None:
    from selenium.webdriver.common.by import By

    browser.find_element(By.CSS_SELECTOR, selector).click()


def fill(browser: Any, selector: str, text: str) -> None:
    """Set a field's value as a user would (cleared, then typed; long text pasted)."""
    from selenium.webdriver.common.by import By

    element = browser.find_element(By.CSS_SELECTOR, selector)
    element.clear()
    if len(text) > 200:  # typing a whole config key by key takes seconds
        browser.execute_script(
            "arguments[0].value = arguments[1]; arguments[0].dispatchEvent(new Event('input'))",
            element,
            text,
        )
    else:
        element.send_keys(text)


def wait_for_state(browser: Any, state: str, timeout: float = TRAIN_TIMEOUT_S) -> None:
    wait_for(
        browser,
        f"const s = document.querySelector('.run-header .state'); "
        f"return s && s.textContent.trim() === '{state}'",
        timeout,
    )


def wait_until(condition: Any, what: str, log: Path, timeout: float = TRAIN_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; Celery log:\n{log_tail(log)}")
        time.sleep(0.25)


# --- the whole flow ----------------------------------------------------------------------


def test_staff_create_a_dataset_and_a_run_and_an_enrolled_worker_trains_its_first_round(
    staff_browser: Any,
    live_server: Any,
    default_queue_worker: CeleryWorker,
    tmp_path: Path,
) -> None:
    browser, log = staff_browser, default_queue_worker.log_path

    # A dataset, uploaded as JSONL; the Celery worker reads it.
    sign_in(browser, live_server, "/datasets/new/")
    screenshot(browser, "dataset-new")
    fill(browser, "#id_name", "functions")
    click(browser, 'input[name="kind"][value="upload"]')
    browser.find_element("css selector", "#id_file").send_keys(str(corpus(tmp_path / "c.jsonl")))
    click(browser, '[data-submit="dataset"]')
    wait_for(browser, "return location.pathname.startsWith('/datasets/') && "
                      "!location.pathname.endsWith('/new/')")  # fmt: skip
    dataset = Dataset.objects.get(name="functions")
    wait_for(browser, "return document.querySelector('[data-state]').dataset.state === 'ready'",
             TRAIN_TIMEOUT_S)  # fmt: skip
    assert text_of(browser, '[data-stat="documents"]') == str(DOCUMENTS)

    # A run from the form: the editor's JSON box, checked (with its estimate), then created.
    open_page(browser, live_server, "/runs/new/")
    screenshot(browser, "run-new")
    fill(browser, "#id_name", "from-the-browser")
    browser.find_element("css selector", f"#id_dataset option[value='{dataset.pk}']").click()
    browser.execute_script("document.querySelector('details.paste').open = true")
    fill(browser, "#id_config_json", json.dumps(run_config()))
    click(browser, '[data-submit="check"]')
    wait_for(browser, "return document.querySelector('[data-estimate=\"memory\"]')")
    assert Run.objects.count() == 0, "checking creates nothing"
    assert "MiB" not in text_of(browser, '[data-estimate="memory"]')
    assert "per unit on a CPU core" in text_of(browser, '[data-estimate="unit-time"]')
    click(browser, '[data-submit="create"]')
    wait_for_state(browser, "draft", 20)
    run = Run.objects.get(name="from-the-browser")
    assert run.dataset == dataset and run.run_config.model.hidden_size == MODEL["hidden_size"]

    # Prepared by the Celery worker, the page following its progress; then started.
    click(browser, '[data-action="prepare"]')
    wait_for(browser, "return document.querySelector('[data-progress]') || "
                      "document.querySelector('.run-header .state').textContent.trim() === 'ready'",
             TRAIN_TIMEOUT_S)  # fmt: skip
    screenshot(browser, "run-preparing")  # its progress, unless it was done already
    wait_for_state(browser, "ready")
    click(browser, '[data-action="start"]')
    wait_for_state(browser, "running", 20)
    screenshot(browser, "run-running")

    # The dataset's page now shows the run's tokens and how its shards split them.
    open_page(browser, live_server, f"/datasets/{dataset.pk}/")
    shard = run.paths.get(index=0)
    assert shard.train_tokens > 0
    shown = browser.find_element("css selector", f'[data-run="{run.pk}"] [data-tokens]')
    assert shown.get_attribute("data-tokens") == str(shard.train_tokens)
    screenshot(browser, "dataset")
    open_page(browser, live_server, "/datasets/")
    assert "ready" in text_of(browser, f'tr[data-dataset="{dataset.pk}"]')
    screenshot(browser, "datasets")

    # An enrollment token, and the commands the page shows, run as a volunteer would.
    open_page(browser, live_server, "/enroll/")
    fill(browser, "#id_label", "browser test")
    fill(browser, "#id_max_uses", "1")
    click(browser, '[data-submit="enroll"]')
    wait_for(browser, "return document.querySelector('[data-commands]')")  # the POST's answer
    commands = text_of(browser, "[data-commands]").splitlines()
    screenshot(browser, "enroll")
    assert commands[0].startswith("pip install")
    words = shlex.split(commands[1])
    assert words[0] == "dipaco-worker" and words[words.index("--server") + 1] == live_server.url
    token = words[words.index("--enroll") + 1]
    assert EnrollmentToken.objects.get().label == "browser test"
    agent = WorkerProcess(
        live_server.url, tmp_path / "agent", "--enroll", token, "--once", "--name", "volunteer-1"
    )
    try:
        page = agent.wait_for("page")
        assert agent.finish() == 0, agent.output()
    finally:
        agent.kill()
    worker = Worker.objects.get()
    assert page["message"].endswith(f"{live_server.url}/workers/{worker.pk}/")

    # Round 0 closes on the Celery worker: the outer step wrote version 1, round 1 is open.
    wait_until(lambda: Round.objects.filter(run=run, t=1).exists(), "round 1 to open", log)
    assert ModuleVersion.objects.filter(module__run=run, version=1).count() == run.modules.count()
    evaluated = MetricPoint.objects.filter(run=run, name="val_loss", path__index=0, round=0)
    wait_until(evaluated.exists, "round 0's evaluation", log)
    assert set(Contribution.objects.values_list("status", flat=True)) == {"accepted"}

    # The worker's page, at the URL the agent printed.
    browser.get(page["message"].rsplit(" ", 1)[-1])
    wait_for(browser, "return document.readyState === 'complete'")
    assert text_of(browser, "#worker-header h1") == "volunteer-1"
    rows = browser.find_elements("css selector", '#worker-contributions tr[data-status="accepted"]')
    assert len(rows) == run.modules.count()
    assert text_of(browser, "[data-credit]").split()[0] != "0"
    screenshot(browser, "worker")

    # The path page: its download is byte for byte `dipaco download`'s directory.
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    browser.execute_cdp_cmd(
        "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    open_page(browser, live_server, f"/runs/{run.pk}/paths/0/")
    wait_for(browser, "return window.dipacoCharts && window.dipacoCharts.val_loss")
    assert "from_pretrained" in text_of(browser, '[data-snippet="transformers"]')
    assert "Model card" in text_of(browser, "#model-card h2")
    click(browser, "[data-download]")
    zips = wait_for_download(downloads)
    out = tmp_path / "dipaco-download"
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "dipaco"), "download", "--server", live_server.url,
         "--run", str(run.pk), "--path", "0", "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    with zipfile.ZipFile(zips) as archive:
        zipped = {Path(n).name: archive.read(n) for n in archive.namelist()}
    written = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert sorted(zipped) == sorted(written) and "model.safetensors" in zipped
    for name, data in zipped.items():
        assert hashlib.sha256(data).hexdigest() == hashlib.sha256(written[name]).hexdigest(), name

    # The prompt box: a short continuation, bounded in tokens.
    fill(browser, "[data-prompt]", "def f3(x, y):\n")
    click(browser, '[data-submit="generate"]')
    wait_for(browser, "return document.querySelector('[data-continuation]')", 60)
    assert "new token" in text_of(browser, "#generated")
    screenshot(browser, "path")
    actions = set(AuditEntry.objects.filter(channel="dashboard").values_list("action", flat=True))
    assert {"dataset.create", "run.create", "run.prepare", "run.start",
            "enrollment_token.create"} <= actions  # fmt: skip
    assert console_errors(browser) == []


def wait_for_download(folder: Path, timeout: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = [p for p in folder.glob("*.zip")]
        if done and not list(folder.glob("*.crdownload")):
            return done[0]
        time.sleep(0.1)
    raise AssertionError(f"no download in {folder}: {list(folder.iterdir())}")


# --- an invalid config -------------------------------------------------------------------


def test_an_invalid_config_shows_the_fields_error_and_creates_nothing(
    staff_browser: Any, live_server: Any
) -> None:
    browser = staff_browser
    sign_in(browser, live_server, "/runs/new/")
    fill(browser, "#id_name", "not-a-run")
    fill(browser, '[name="model.hidden_size"]', "-8")
    click(browser, '[data-submit="create"]')
    error = wait_for(
        browser,
        "const e = document.querySelector('[data-error-for=\"model.hidden_size\"]'); "
        "return e && e.textContent",
    )
    assert "greater than 0" in error
    field = browser.find_element("css selector", '[data-field="model.hidden_size"]')
    assert "invalid" in field.get_attribute("class").split()
    assert (
        browser.find_element("css selector", '[name="model.hidden_size"]').get_attribute("value")
        == "-8"
    ), "the value typed is kept for fixing"
    assert Run.objects.count() == 0
    refused = AuditEntry.objects.get(action="run.create")
    assert (refused.outcome, refused.channel) == ("refused", "dashboard")
    screenshot(browser, "run-new-invalid")


# --- a rejected contribution ------------------------------------------------------------


def test_a_rejected_contribution_shows_on_its_workers_page_with_the_reason(
    staff_browser: Any, live_server: Any, settings: Any, tmp_path: Path
) -> None:
    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    store = get_blob_store()
    run = create_run("rejecting", {**run_config(), "rounds": 1})
    for module_id, tensors in init_modules(run.run_config).items():
        data = encode(tensors, "fp32")
        key = keys.module_key(run.pk, module_id, 0)
        store.put_bytes(key, data)
        module = run.modules.get(module_id=module_id)
        digest = hashlib.sha256(data).hexdigest()
        publish_module_version(module, 0, blob_key=key, sha256=digest, size=len(data))
    put_train_shards(store, run, 4000)
    transition(run, Run.State.PREPARING)
    transition(run, Run.State.READY)
    start_run(run)
    worker, _ = new_worker("flaky-box")
    grant = grant_lease(worker)
    assert grant is not None
    reports = []
    for module_id in grant.unit.path.modules:  # bytes that are no safetensors file at all
        junk = f"not a delta of {module_id}".encode() * 8
        store.put_bytes(upload_key(grant.lease, module_id), junk)
        digest = hashlib.sha256(junk).hexdigest()
        reports.append(ContributionReport(module_id, len(junk), digest, 384, {"loss": 5.0}))
    complete(worker, grant.lease.pk, grant.secret, reports)
    assert mark_round_closing(Round.objects.get(run=run, t=0))
    for module_id in grant.unit.path.modules:  # the outer step's own verification
        step_module(run.pk, module_id, 0)
    rejected = list(Contribution.objects.filter(status="rejected"))
    assert len(rejected) == len(grant.unit.path.modules) and all(c.reason for c in rejected)

    open_page(staff_browser, live_server, f"/workers/{worker.pk}/")
    rows = staff_browser.find_elements(
        "css selector", '#worker-contributions tr[data-status="rejected"]'
    )
    assert len(rows) == len(rejected)
    shown = {r.find_element("css selector", ".reason").text for r in rows}
    assert shown == {c.reason for c in rejected}
    assert text_of(staff_browser, "[data-credit]").startswith("0")
    screenshot(staff_browser, "worker-rejected")


# --- who may do what --------------------------------------------------------------------

STAFF_PAGES = ("/runs/new/", "/datasets/", "/datasets/new/", "/enroll/")


def test_anonymous_visitors_reach_no_staff_form_and_a_post_without_csrf_is_refused(
    staff_browser: Any, live_server: Any
) -> None:
    browser = staff_browser
    worker, _ = new_worker("someone")
    for page in STAFF_PAGES:
        open_page(browser, live_server, page)
        assert wait_for(browser, "return location.pathname") == "/login/", page
        assert (
            browser.find_elements("css selector", "#id_config_json, #id_file, #id_max_uses") == []
        )
    open_page(browser, live_server, f"/workers/{worker.pk}/")
    assert browser.find_elements("css selector", '[data-action="revoke"]') == []
    open_page(browser, live_server, "/login/")  # a CSRF token: the POSTs get past that check
    token = browser.execute_script(
        "return document.querySelector('[name=csrfmiddlewaretoken]').value"
    )
    posts = {
        "/runs/new/": "name=sneaky&submit=create",
        "/datasets/new/": "name=sneaky&kind=path&source=stdlib",
        "/enroll/": "label=sneaky&max_uses=5",
        "/enroll/1/revoke/": "",
        f"/workers/{worker.pk}/revoke/": "",
    }
    for url, body in posts.items():
        status, text = post(browser, url, body, token)
        assert status == 403 and "CSRF" not in text, (url, status)

    sign_in(browser, live_server, "/enroll/")  # staff, but a forged form without the token
    for url, body in posts.items():
        status, text = post(browser, url, body, None)
        assert status == 403 and "CSRF" in text, (url, status)
    assert Run.objects.count() == Dataset.objects.count() == 0
    assert EnrollmentToken.objects.exclude(pk__in=[worker.enrollment_id]).count() == 0
    worker.refresh_from_db()
    assert not worker.revoked
    screenshot(browser, "enroll-empty")


def post(browser: Any, url: str, body: str, csrf: str | None) -> tuple[int, str]:
    """A form POST from the page's origin, with or without the CSRF header."""
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if csrf:
        headers["X-CSRFToken"] = csrf
    status, text = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch(arguments[0], {method: "POST", headers: arguments[1], body: arguments[2],
                             redirect: "manual"})
          .then(async (r) => done([r.status, await r.text()]));""",
        url,
        headers,
        body,
    )
    return int(status), str(text)
