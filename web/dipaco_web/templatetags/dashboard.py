"""Number formats of the dashboard: bytes, token counts, durations, perplexities, shares,
and round numbers.

Rounds are numbered from 1 for people; the database and the API keep the 0-based
index (dipaco_web.numbering says why).
"""

from __future__ import annotations

from datetime import datetime

from django import template
from django.utils import timezone

from dipaco_web.numbering import round_number

register = template.Library()

DASH = "—"  # shown where there is no value yet


def _scaled(value: float, units: tuple[str, ...], sep: str) -> str:
    """``value`` in the first unit that keeps it under 1000, with three significant digits."""
    for unit in units[:-1]:
        if abs(value) < 1000:
            return f"{value:.3g}{sep}{unit}" if unit else f"{value:,.0f}"
        value /= 1000
    return f"{value:,.1f}{sep}{units[-1]}"


@register.filter
def round_no(value: int | None) -> str:
    """Round index 0 → "1": the round number people read (dipaco_web.numbering)."""
    if value is None or value == "":
        return DASH
    return str(round_number(int(value)))


@register.filter
def size(value: float | None) -> str:
    """Bytes in decimal units: 1.5 MB, 3.2 GB."""
    if value is None:
        return DASH
    return _scaled(float(value), ("B", "kB", "MB", "GB", "TB", "PB"), " ")


@register.filter
def count(value: float | None) -> str:
    """A large count, short: 950, 12.3k, 4.5M, 1.2B."""
    if value is None:
        return DASH
    return _scaled(float(value), ("", "k", "M", "B", "T"), "")


@register.filter
def ppl(value: float | None) -> str:
    """A perplexity (or loss) with enough digits to compare rounds."""
    if value is None:
        return DASH
    return f"{value:,.2f}" if value < 1000 else f"{value:,.0f}"


@register.filter
def share(value: float | None) -> str:
    """A fraction as a percentage: 0.253 → 25.3 %."""
    if value is None:
        return DASH
    return f"{100 * value:.1f} %"


@register.filter
def seconds(value: float | None) -> str:
    """A duration: 42 s, 3 min 05 s, 2 h 10 min."""
    if value is None:
        return DASH
    total = round(value)
    if total < 60:
        return f"{total} s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


@register.filter
def ago(value: datetime | None) -> str:
    """How long ago: 12 s ago, 4 min 02 s ago; "never" for None."""
    if value is None:
        return "never"
    return f"{seconds((timezone.now() - value).total_seconds())} ago"


@register.filter
def ratio(value: float | None) -> str:
    if value is None:
        return DASH
    return f"{value:,.1f}×"
