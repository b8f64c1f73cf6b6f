"""deploy/prometheus: the alert rules are valid, each alert fires on its case and not on a
healthy series (promtool's unit tests, alerts_test.yml), and the scrape config loads. Needs
Debian's prometheus package (promtool); .ci/run installs it, and under CI=true a missing
promtool fails instead of skipping."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.conftest import ROOT, require_service

PROMETHEUS = ROOT / "deploy" / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    found = shutil.which("promtool")
    require_service("promtool", found is not None, "apt-get install prometheus")
    assert found is not None
    return subprocess.run(
        [found, *args], capture_output=True, text=True, timeout=120, check=False, cwd=PROMETHEUS
    )


def scrape_config(tmp_path: Path, target: str, token: str) -> Path:
    """deploy/prometheus/prometheus.yml pointed at `target`, its token file and rules in
    `tmp_path`: the file operators use, with only the addresses changed."""
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    (tmp_path / "token").write_text(token)
    shutil.copy(PROMETHEUS / "alerts.yml", tmp_path / "alerts.yml")
    job = config["scrape_configs"][0]
    job["authorization"]["credentials_file"] = str(tmp_path / "token")
    job["static_configs"] = [{"targets": [target]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_alert_rules_pass_promtools_check() -> None:
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 6 rules found" in checked.stdout


def test_each_alert_fires_on_its_case_and_not_on_a_healthy_series() -> None:
    tested = promtool("test", "rules", "alerts_test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    cases = yaml.safe_load((PROMETHEUS / "alerts_test.yml").read_text())["tests"]
    rules = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"][0]["rules"]
    for rule in rules:
        checks = [c for case in cases for c in case["alert_rule_test"]
                  if c["alertname"] == rule["alert"]]  # fmt: skip
        assert any(c["exp_alerts"] for c in checks), f"{rule['alert']} never fires"
        assert any(not c["exp_alerts"] for c in checks), f"{rule['alert']} never stays quiet"


def test_a_broken_rule_fails_promtools_unit_tests(tmp_path: Path) -> None:
    """The unit tests can fail: with the stuck-workers threshold raised, its case does."""
    rules = (PROMETHEUS / "alerts.yml").read_text()
    broken = rules.replace(
        'sum(dipaco_workers{state="stuck"}) > 0', 'sum(dipaco_workers{state="stuck"}) > 5'
    )
    assert broken != rules
    (tmp_path / "alerts.yml").write_text(broken)
    shutil.copy(PROMETHEUS / "alerts_test.yml", tmp_path / "alerts_test.yml")
    found = shutil.which("promtool")
    require_service("promtool", found is not None, "apt-get install prometheus")
    assert found is not None
    tested = subprocess.run([found, "test", "rules", "alerts_test.yml"], capture_output=True,
                            text=True, timeout=120, check=False, cwd=tmp_path)  # fmt: skip
    assert tested.returncode != 0 and "DipacoWorkersStuck" in tested.stdout + tested.stderr


def test_the_scrape_config_loads_with_its_rules(tmp_path: Path) -> None:
    path = scrape_config(tmp_path, "127.0.0.1:8000", "x" * 32)
    checked = promtool("check", "config", str(path))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_composes_prometheus_writes_the_token_file_the_scrape_config_reads() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["prometheus"]
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    script = service["entrypoint"][-1]
    assert f"> {job['authorization']['credentials_file']}" in script
    assert "--config.file=/etc/prometheus/dipaco/prometheus.yml" in script
    assert "./deploy/prometheus:/etc/prometheus/dipaco:ro" in service["volumes"]
    web = compose["services"]["web"]["command"]
    port = web[web.index("--bind") + 1].rsplit(":", 1)[1]  # ${DIPACO_PORT:-8000}
    assert job["static_configs"][0]["targets"] == [f"web:{port.removesuffix('}').split('-')[-1]}"]
    assert service["profiles"] == ["monitoring"], "plain `docker compose up` starts no Prometheus"
