"""A newcomer walks a finished run in headless Chromium, and every page tells the truth.

The run holds real weights: tests/test_inference's `trained()` (tokenizer, router, four
paths of a micro model, two outer rounds, trained in a few seconds on the CPU) published
through the control plane's services, with its two rounds leased, completed and closed as
workers and the outer step would (build_short_run's way), then finished. Its corpus is a
path on this machine, as a real run's is.

The walk: the runs list, the run page, a path page and its Try it box, the workers, the
staff pages signed in, and a 404. On each page: the numbers agree with the API's (rounds
counted from 1 on the pages, the API's 0-based index plus one), no element leaves its card
(bounding boxes, measured in the page), and no public page shows a filesystem path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from dipaco.data.windows import unit_tokens
from dipaco.evaluate import perplexity
from dipaco_server.accounts.services import create_api_token, create_user
from dipaco_server.rounds.lifecycle.close import mark_round_closed, mark_round_closing
from dipaco_server.rounds.lifecycle.open import open_round
from dipaco_server.rounds.models import Contribution
from dipaco_server.rounds.protocol.complete import ContributionReport, complete
from dipaco_server.rounds.protocol.grant import grant_lease
from dipaco_server.runs.models import Run
from dipaco_server.runs.services import record_metric, transition
from dipaco_server.workers.models import Worker
from tests.browser.test_dashboard_browser import (
    PASSWORD,
    console_errors,
    open_page,
    screenshot,
    text_of,
    wait_for,
)
from tests.conftest import ROOT
from tests.test_inference import _val_loss, publish, trained
from tests.test_models import make_worker

# Any absolute path under a directory a server keeps things in.
FILESYSTEM_PATH = re.compile(r"(?<![\w.:/-])/(?:tmp|home|srv|var|work|usr|opt|root|data)/")

# Every element of a card stays inside the card's box (an element inside something that
# scrolls on its own, a <pre> or a chart, counts as that scroller), and no card scrolls
# sideways or reaches past the window. Returns what does not, for the assertion message.
OVERFLOW_JS = """
const out = [];
const name = (el) => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '') +
  (el.className && typeof el.className === 'string' ? '.' + el.className.split(' ').join('.') : '');
const width = document.documentElement.clientWidth;
for (const card of document.querySelectorAll('.card, .stats > div')) {
  const box = card.getBoundingClientRect();
  if (box.width === 0) continue;
  if (card.scrollWidth > card.clientWidth + 1) out.push(name(card) + ' scrolls sideways: ' +
    card.scrollWidth + ' > ' + card.clientWidth);
  if (box.right > width + 1) out.push(name(card) + ' ends past the window');
  for (const el of card.querySelectorAll('*')) {
    let up = el.parentElement, scrolled = false;
    while (up && up !== card) {
      if (getComputedStyle(up).overflowX !== 'visible') { scrolled = true; break; }
      up = up.parentElement;
    }
    if (scrolled) continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 && r.height === 0) continue;
    if (r.right > box.right + 1 || r.left < box.left - 1)
      out.push(name(el) + ' leaves ' + name(card) + ': ' + Math.round(r.left) + '..' +
        Math.round(r.right) + ' outside ' + Math.round(box.left) + '..' + Math.round(box.right));
  }
}
return out;
"""


class Walk:
    """The finished run, the API answers to compare with, and the paths no page may show."""

    def __init__(self, run: Run, corpus: Path, token: str, secrets: list[str]) -> None:
        self.run, self.corpus, self.token, self.secrets = run, corpus, token, secrets

    def api(self, path: str) -> Any:
        response = Client().get(f"/api/v1{path}", HTTP_AUTHORIZATION=f"Bearer {self.token}")
        assert response.status_code == 200, response.content
        return response.json()


def finish_run(run: Run, workers: list[Worker]) -> None:
    """Rounds 0 and 1 of the published run: every unit leased and completed, the Δs
    accepted, the round closed, each path's validation loss recorded; then finished."""
    t_data = trained()
    config = run.run_config
    params = config.module_param_counts()
    start = timezone.now() - timedelta(hours=1)
    for t in range(config.rounds):
        opened = start + timedelta(minutes=10 * t)
        round_ = open_round(run, t, now=opened)
        for i in range(config.num_paths * config.replicas_per_path):
            worker = workers[i % len(workers)]
            grant = grant_lease(worker, now=opened + timedelta(seconds=10 * i))
            assert grant is not None, f"round {t} ran out of units after {i}"
            reports = [
                ContributionReport(m, 2 * params[m], f"{t:02d}{i:02d}".ljust(64, "0"),
                                   unit_tokens(config), {"tokens_per_second": 900.0})
                for m in grant.unit.path.modules
            ]  # fmt: skip
            complete(worker, grant.lease.pk, grant.secret, reports,
                     now=opened + timedelta(seconds=10 * i + 5))  # fmt: skip
        Contribution.objects.filter(unit__round=round_).update(
            status=Contribution.Status.ACCEPTED, verified_at=timezone.now()
        )
        closed = opened + timedelta(minutes=3)
        assert mark_round_closing(round_, now=closed)
        assert mark_round_closed(round_, now=closed)
        if t < config.rounds - 1:  # publish() recorded the last round's losses
            for path in run.paths.order_by("index"):
                shard = t_data.shards.open(t_data.shard_dir, path.index, "val")
                loss = _val_loss(config, path.index, t_data.versions[t + 1], shard)
                record_metric(run, "val_loss", loss, path=path, round=t)
    transition(run, Run.State.FINISHED)
    Worker.objects.filter(pk__in=[w.pk for w in workers]).update(last_seen=timezone.now())


@pytest.fixture
def walk(
    transactional_db: None, live_server: Any, settings: Any, browser: Any, tmp_path: Path
) -> Iterator[Walk]:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.DIPACO_PUBLIC_URL = live_server.url
    settings.DIPACO_PUBLIC_READ = True
    settings.DIPACO_GENERATE_MAX_NEW_TOKENS = 6
    settings.DIPACO_DASHBOARD_POLL_S = 60  # the walk reads still pages
    browser.delete_all_cookies()
    run = publish(trained(), name="newcomer-run")
    corpus = tmp_path / "corpora" / "newcomer.jsonl"  # a path on this machine, as in a real run
    Run.objects.filter(pk=run.pk).update(config={**run.config, "data": {
        **run.config["data"], "corpus": str(corpus)}})  # fmt: skip
    run.refresh_from_db()
    finish_run(run, [make_worker("alpha-box"), make_worker("beta-box")])
    run.refresh_from_db()
    user, _ = create_user("operator", staff=True, password=PASSWORD)
    token = create_api_token(user, name="walk")[1]
    secrets = [str(tmp_path), os.environ.get("DIPACO_DATA_DIR", str(ROOT)), str(ROOT)]
    yield Walk(run, corpus, token, secrets)


def check_page(browser: Any, name: str, secrets: list[str] | None) -> str:
    """Nothing leaves its card; on a public page (``secrets`` given) no filesystem path.
    Returns the page's visible text."""
    screenshot(browser, name)
    assert browser.execute_script(OVERFLOW_JS) == [], f"{name}: something leaves its card"
    text = str(browser.execute_script("return document.body.innerText"))
    if secrets is not None:
        source = str(browser.page_source)
        for secret in secrets:
            assert secret not in source, f"{name} shows the server path {secret}"
        assert not FILESYSTEM_PATH.search(text), f"{name}: {FILESYSTEM_PATH.search(text)}"
    return text


def test_a_newcomer_walks_a_finished_run_and_every_page_agrees_with_the_api(
    browser: Any, live_server: Any, walk: Walk
) -> None:
    from selenium.webdriver.common.by import By

    run = walk.run
    status = walk.api(f"/runs/{run.pk}")
    losses = walk.api(f"/runs/{run.pk}/metrics?name=val_loss")["items"]  # a page of them
    last = max(point["round"] for point in losses)  # the API's index of the last round
    assert status["state"] == "finished" and last == run.run_config.rounds - 1
    shown = last + 1  # what the pages call it

    # The runs list.
    open_page(browser, live_server, "/")
    row = text_of(browser, f'tr[data-run="{run.pk}"]')
    assert "finished" in row and f"{shown} / {run.run_config.total_rounds}" in row
    assert f"after round {shown}" in row
    check_page(browser, "newcomer-runs", walk.secrets)

    # The run page: its rounds, numbered as people count them, one row per API round.
    open_page(browser, live_server, f"/runs/{run.pk}/")
    wait_for(browser, "return window.dipacoCharts && window.dipacoCharts.val_loss")
    numbers = browser.execute_script(
        "return [...document.querySelectorAll('#run-rounds tr[data-round]')]"
        ".map(r => [Number(r.dataset.round), Number(r.cells[0].textContent)])"
    )
    assert sorted(numbers) == [[t, t + 1] for t in range(last + 1)]
    units = browser.execute_script(
        "return [...document.querySelectorAll('#run-rounds [data-units]')].map(c => c.dataset.units)"
    )
    per_round = run.run_config.num_paths * run.run_config.replicas_per_path
    assert units == [f"{per_round}/{per_round}"] * (last + 1)
    x = browser.execute_script("return window.dipacoCharts.val_loss.data[0]")
    assert x == [t + 1 for t in sorted({p["round"] for p in losses})]
    check_page(browser, "newcomer-run", walk.secrets)

    # A path page: its perplexity is the API's last loss of the path; the snippet's folder
    # and the card's round are the manifest's.
    manifest = Client().get(f"/api/v1/runs/{run.pk}/paths/0/manifest").json()
    assert manifest["round"] == last and manifest["folder"].endswith(f"-round-{shown}")
    open_page(browser, live_server, f"/runs/{run.pk}/paths/0/")
    path_loss = next(p["value"] for p in losses if p["path"] == 0 and p["round"] == last)
    assert f"{perplexity(path_loss):,.2f}" in text_of(browser, ".run-header .stats")
    assert manifest["folder"] in text_of(browser, '[data-snippet="transformers"]')
    assert f"weights after round {shown}" in text_of(browser, "#model-card h2")
    assert walk.corpus.name in text_of(browser, "#model-card")  # its name, not its path

    # Try it, with a long prompt without spaces: the output wraps inside its card.
    prompt = "mergesort" * 40
    browser.find_element(By.CSS_SELECTOR, "[data-prompt]").send_keys(prompt)
    browser.find_element(By.CSS_SELECTOR, '[data-submit="generate"]').click()
    wait_for(browser, "return document.querySelector('#generated[data-status=\"ok\"]')", 60)
    generated = text_of(browser, "#generated")
    assert f"weights after round {shown}" in generated and "new token" in generated
    check_page(browser, "newcomer-path", walk.secrets)

    # The workers, and one worker's units: the rounds they trained, counted from 1.
    open_page(browser, live_server, "/workers/")
    assert "alpha-box" in text_of(browser, "#workers-table")
    check_page(browser, "newcomer-workers", walk.secrets)
    alpha = Worker.objects.get(name="alpha-box")
    open_page(browser, live_server, f"/workers/{alpha.pk}/")
    rounds = browser.execute_script(
        "return [...document.querySelectorAll('#worker-units tr[data-lease]')]"
        ".map(r => Number(r.cells[1].textContent))"
    )
    assert sorted(set(rounds)) == [t + 1 for t in range(last + 1)]
    check_page(browser, "newcomer-worker", walk.secrets)

    # A 404: the site's page, with its navigation.
    open_page(browser, live_server, "/runs/999999/")
    assert "Page not found" in text_of(browser, "main")
    assert browser.find_elements(By.CSS_SELECTOR, "header.topbar nav a")
    check_page(browser, "newcomer-404", walk.secrets)

    # Signed in as staff: the staff pages fit their cards too; staff see the corpus path.
    open_page(browser, live_server, f"/login/?next=/runs/{run.pk}/paths/0/")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "form.stacked button").click()
    wait_for(browser, f"return location.pathname === '/runs/{run.pk}/paths/0/'")
    assert str(walk.corpus) in text_of(browser, "#model-card")
    for page in ("/datasets/", "/enroll/", "/runs/new/", f"/runs/{run.pk}/"):
        open_page(browser, live_server, page)
        check_page(browser, "newcomer-staff" + page.replace("/", "-").rstrip("-"), None)
    # The browser logs the 404 page's status as a failed load; anything else is a fault.
    assert [e for e in console_errors(browser) if "/runs/999999/ " not in e] == []
