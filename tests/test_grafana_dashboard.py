"""deploy/grafana/dipaco.json: every metric its panels and variables query is one /metrics
serves, so the board never shows "No data" for a name that does not exist. The served names
are read from a real scrape (Redis as the broker, so the queue lengths are there too)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from django.test import Client, override_settings

from tests.conftest import ROOT

pytestmark = pytest.mark.django_db
DASHBOARD = ROOT / "deploy" / "grafana" / "dipaco.json"
METRIC = re.compile(r"\bdipaco_[a-z0-9_]+\b")
TOKEN = "grafana-test-token-0123456789"
SAMPLES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def queries(node: Any) -> list[str]:
    """Every PromQL string of the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        query = node.get("query")
        if isinstance(query, dict) and isinstance(query.get("query"), str):
            found.append(query["query"])
        return found + [q for v in node.values() for q in queries(v)]
    if isinstance(node, list):
        return [q for item in node for q in queries(item)]
    return []


def served(client: Client) -> set[str]:
    answer = client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200, answer.content
    names = set()
    for line in answer.content.decode().splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.update(name + suffix for suffix in SAMPLES.get(kind, ("",)))
    return names


def test_every_metric_the_dashboard_queries_is_served_by_metrics(
    client: Client, redis_url: str
) -> None:
    board = json.loads(DASHBOARD.read_text())
    used = {name for query in queries(board) for name in METRIC.findall(query)}
    assert len(used) >= 15, used
    with override_settings(REDIS_URL=redis_url, DIPACO_METRICS_TOKEN=TOKEN):
        names = served(client)
    assert "dipaco_celery_queue_length" in names
    missing = sorted(used - names)
    assert not missing, f"the dashboard queries metrics /metrics does not serve: {missing}"


def test_the_dashboard_has_the_panels_an_operator_needs() -> None:
    board = json.loads(DASHBOARD.read_text())
    text = " ".join(queries(board))
    for needed in ("dipaco_run_round", "dipaco_path_validation_loss", "dipaco_tokens_trained_total",
                   "dipaco_workers", "dipaco_contributions_rejected_total",
                   "dipaco_round_stage_seconds_bucket", "dipaco_celery_queue_length"):  # fmt: skip
        assert needed in text, needed
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
