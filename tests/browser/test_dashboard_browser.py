"""The dashboard in real headless Chromium (Debian's package, driven by Selenium).

The server is pytest-django's live server holding `build_short_run`'s run: a run
advanced through the control plane's services (rounds, leases, completions,
module versions, metric points) with made-up training numbers, not a trained
one. Screenshots go to test-artifacts/. Without Chromium these tests skip
locally and fail under CI=true.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model

from dipaco_server.runs.models import Run
from dipaco_server.runs.services import record_metric, transition
from dipaco_web.apps import VENDOR_DIR, VENDOR_FILES
from tests.conftest import ROOT, require_service
from tests.test_dashboard import ShortRun, build_short_run, val_loss_of

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
ARTIFACTS = ROOT / "test-artifacts"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)
WAIT_S = 10.0
PASSWORD = "a long test password"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module; every test starts from a blank, signed-out page."""
    require_service(
        "Chromium",
        CHROMIUM.exists() and CHROMEDRIVER.exists(),
        "install it with: apt-get install -y chromium chromium-driver",
    )
    require_service(
        "the dashboard's browser libraries",
        all((VENDOR_DIR / name).is_file() for name in VENDOR_FILES),
        "run `npm ci` in the repository root",
    )
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        require_service("Selenium", False, "install it with: pip install selenium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    ARTIFACTS.mkdir(exist_ok=True)
    yield driver
    driver.quit()


@pytest.fixture
def served(transactional_db: None, live_server: Any, settings: Any, browser: Any) -> ShortRun:
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    settings.DIPACO_DASHBOARD_POLL_S = 1  # the page's own poll interval, shortened for the test
    browser.delete_all_cookies()
    return build_short_run()


def open_page(browser: Any, live_server: Any, path: str) -> None:
    browser.get(f"{live_server.url}{path}")
    wait_for(browser, "return document.readyState === 'complete'")


def wait_for(browser: Any, script: str, timeout: float = WAIT_S) -> Any:
    """Wait until ``script`` returns something truthy in the page; return it."""
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(browser, timeout).until(lambda b: b.execute_script(script))


def text_of(browser: Any, selector: str) -> str:
    from selenium.webdriver.common.by import By

    return str(browser.find_element(By.CSS_SELECTOR, selector).text)


def screenshot(browser: Any, name: str, height: int = 1000) -> None:
    """The whole page (the window grows to its height) as test-artifacts/NAME.png."""
    full = browser.execute_script("return document.documentElement.scrollHeight")
    browser.set_window_size(1400, max(height, full + 60))
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))
    browser.set_window_size(1400, 1000)


def console_errors(browser: Any) -> list[str]:
    return [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]


def sign_in(browser: Any, live_server: Any, next_path: str) -> None:
    from selenium.webdriver.common.by import By

    get_user_model().objects.create_user("operator", password=PASSWORD, is_staff=True)
    open_page(browser, live_server, f"/login/?next={next_path}")
    browser.find_element(By.NAME, "username").send_keys("operator")
    browser.find_element(By.NAME, "password").send_keys(PASSWORD)
    browser.find_element(By.CSS_SELECTOR, "form.stacked button").click()
    wait_for(browser, f"return location.pathname === '{next_path}'")


def test_every_page_renders_with_its_data(browser: Any, live_server: Any, served: ShortRun) -> None:
    run = served.run
    open_page(browser, live_server, "/")
    assert "short-run" in text_of(browser, f'tr[data-run="{run.pk}"]')
    assert "3 / 5" in text_of(browser, f'tr[data-run="{run.pk}"]')
    screenshot(browser, "runs")
    open_page(browser, live_server, f"/runs/{run.pk}/")
    wait_for(browser, "return window.dipacoCharts && window.dipacoCharts.communication")
    assert text_of(browser, ".run-header .state") == "running"
    assert "alpha-box" in text_of(browser, "#run-workers")
    assert "v3" in text_of(browser, '#run-modules [data-module="1.1"]')
    assert len(browser.find_elements("css selector", "#run-paths a.download")) == 4
    assert len(browser.find_elements("css selector", "#run-rounds tr[data-round]")) == 4
    screenshot(browser, "run")
    open_page(browser, live_server, "/workers/")
    assert "offline" in text_of(
        browser, f'#workers-table tr[data-worker="{served.workers["gamma"].pk}"]'
    )
    assert text_of(browser, ".leaderboard li:first-child .name").startswith("alpha-box")
    screenshot(browser, "workers")
    open_page(browser, live_server, "/login/")
    screenshot(browser, "login", height=600)
    assert console_errors(browser) == []


def test_a_chart_holds_the_points_of_the_run(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    open_page(browser, live_server, f"/runs/{served.run.pk}/")
    data = wait_for(
        browser, "return window.dipacoCharts.val_loss && window.dipacoCharts.val_loss.data"
    )
    labels = browser.execute_script("return window.dipacoCharts.val_loss.series.map(s => s.label)")
    assert labels == ["round", "path 0", "path 1", "path 2", "path 3", "routed mean"]
    assert data[0] == [1, 2, 3]  # rounds counted from 1, as every page counts them
    for p in range(4):
        assert data[1 + p] == pytest.approx([val_loss_of(p, t) for t in range(3)])
    drawn = browser.execute_script("return document.querySelectorAll('[data-chart] canvas').length")
    assert drawn == 4, "every chart draws on a canvas"


def test_each_path_curve_has_its_standard_error_band(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    run = served.run
    for path in run.paths.all():
        for t in range(3):
            record_metric(run, "val_loss_se", 0.2, path=path, round=t)
    open_page(browser, live_server, f"/runs/{run.pk}/")
    wait_for(browser, "return window.dipacoCharts.val_loss && window.dipacoCharts.val_loss.data")
    bands = "return [window.dipacoCharts.val_loss.dipacoBands, window.dipacoCharts.val_perplexity.dipacoBands]"  # fmt: skip
    assert browser.execute_script(bands) == [4, 4], "a band for each path, none for the mean"
    # Just above path 0's point at round 2 (no other line there): its band's colour.
    alpha = browser.execute_script(
        """const u = window.dipacoCharts.val_loss;
        const x = u.valToPos(u.data[0][1], "x", true);
        const y = u.valToPos(u.data[1][1] + 0.1, "y", true);
        return u.ctx.getImageData(Math.round(x), Math.round(y), 1, 1).data[3];"""
    )
    assert alpha > 0, "the band is painted on the canvas"
    screenshot(browser, "run-bands")


def test_staff_pause_and_resume_change_the_run_state(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    from selenium.webdriver.common.by import By

    run, page = served.run, f"/runs/{served.run.pk}/"
    sign_in(browser, live_server, page)
    browser.find_element(By.CSS_SELECTOR, 'button[data-action="pause"]').click()
    wait_for(
        browser, "return document.querySelector('.run-header .state').textContent === 'paused'"
    )
    run.refresh_from_db()
    assert run.state == Run.State.PAUSED
    assert "is now paused" in text_of(browser, ".messages")
    screenshot(browser, "run-paused-by-staff")
    browser.find_element(By.CSS_SELECTOR, 'button[data-action="resume"]').click()
    wait_for(
        browser, "return document.querySelector('.run-header .state').textContent === 'running'"
    )
    run.refresh_from_db()
    assert run.state == Run.State.RUNNING


def test_an_anonymous_visitor_cannot_press_the_buttons(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    run = served.run
    open_page(browser, live_server, "/login/")  # a page with a CSRF token: the POST gets past it
    token = browser.execute_script(
        "return document.querySelector('[name=csrfmiddlewaretoken]').value"
    )
    open_page(browser, live_server, f"/runs/{run.pk}/")
    assert browser.find_elements("css selector", "[data-action]") == []
    status, body = browser.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch(arguments[0], {method: "POST", headers: {"X-CSRFToken": arguments[1]}})
          .then(async (r) => done([r.status, await r.text()]));""",
        f"/runs/{run.pk}/actions/pause/",
        token,
    )
    assert status == 403 and "CSRF" not in body
    run.refresh_from_db()
    assert run.state == Run.State.RUNNING


def test_the_run_page_updates_without_a_reload(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    run = served.run
    open_page(browser, live_server, f"/runs/{run.pk}/")
    wait_for(browser, "return window.dipacoCharts && window.dipacoCharts.val_loss")
    browser.execute_script("window.notReloaded = true")
    transition(run, Run.State.PAUSED)
    for path in run.paths.all():
        record_metric(run, "val_loss", val_loss_of(path.index, 3), path=path, round=3)
    wait_for(
        browser, "return document.querySelector('.run-header .state').textContent === 'paused'"
    )
    x = wait_for(
        browser,
        "const d = window.dipacoCharts.val_loss.data[0]; return d.length === 4 && d",
    )
    assert x == [1, 2, 3, 4]
    assert browser.execute_script("return window.notReloaded") is True


def test_a_stuck_worker_and_a_stalled_round_are_flagged_on_their_pages(
    browser: Any, live_server: Any, served: ShortRun
) -> None:
    from datetime import timedelta

    from django.utils import timezone

    from dipaco_server.rounds.models import Lease, Round

    run, alpha, beta = served.run, served.workers["alpha"], served.workers["beta"]
    # The previous test's run page went on polling its run's live view after that run was
    # flushed (404s in the browser's log): this test counts its own pages' errors only. A
    # blank page first stops that polling, else a poll in flight logs its 404 later.
    browser.get("about:blank")
    browser.get_log("browser")
    open_page(browser, live_server, f"/runs/{run.pk}/")
    assert browser.find_elements("css selector", "[data-round-stalled]") == []
    open_page(browser, live_server, f"/workers/{alpha.pk}/")
    assert text_of(browser, "[data-activity]") == "training"

    # Round t = 3 opened 20 minutes ago (its three predecessors took 5, 8 and 11), and alpha has
    # held its unit since, heartbeating (seen now), with nothing completed: three lease
    # timeouts of 5 minutes are past.
    long_ago = timezone.now() - timedelta(minutes=20)
    Round.objects.filter(run=run, t=served.rounds_done).update(opened_at=long_ago)
    Lease.objects.filter(worker=alpha, state=Lease.State.ACTIVE).update(granted_at=long_ago)

    open_page(browser, live_server, f"/runs/{run.pk}/")
    flag = text_of(browser, "[data-round-stalled]")
    assert "Round 4" in flag and "more than twice the 8 min" in flag, flag  # t = 3, shown 4
    screenshot(browser, "run-stalled")
    open_page(browser, live_server, f"/workers/{alpha.pk}/")
    assert text_of(browser, "[data-activity]") == "stuck"
    assert "three lease timeouts" in text_of(browser, "[data-stuck]")
    screenshot(browser, "worker-stuck")
    open_page(browser, live_server, "/workers/")
    assert text_of(browser, f'#workers-table tr[data-worker="{alpha.pk}"] [data-stuck]') == "stuck"
    open_page(browser, live_server, f"/workers/{beta.pk}/")
    assert text_of(browser, "[data-activity]") == "idle"
    assert browser.find_elements("css selector", "[data-stuck]") == []
    assert console_errors(browser) == []
