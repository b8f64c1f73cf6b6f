"""Round numbers as people read them: counted from 1.

The database, the services and the API's machine fields (``t``, ``round``, the
``round=`` query parameter, ``current_round``, ``best_round``) keep the 0-based index
they compute with: round t's outer step writes module version t + 1, and every formula
reads more simply that way. People count "round 1 of 10", and the demo's terminal
always has; so every place a person reads a round number (the dashboard's tables,
captions and chart axes, the worker page, the model card, a download's folder name, the
CLI's ``--round``) shows ``t + 1``. This module is the dashboard's one conversion; the
template filter ``round_no`` (templatetags.dashboard) applies it in the pages.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def round_number(t: int) -> int:
    """Round index ``t`` (0-based, as stored) as people count it."""
    return t + 1


def chart_for_people(chart: Mapping[str, Any]) -> dict[str, Any]:
    """A chart (dipaco_web.curves) with its x axis, and phase 2's start, in round numbers."""
    shown = dict(chart)
    shown["x"] = [round_number(t) for t in chart.get("x", [])]
    if chart.get("phase_boundary") is not None:
        shown["phase_boundary"] = round_number(int(chart["phase_boundary"]))
    return shown


def charts_for_people(charts: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: chart_for_people(chart) for name, chart in charts.items()}
