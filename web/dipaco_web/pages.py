"""A page per worker and a page per path, and the path page's prompt box.

The worker page is what a volunteer follows (the agent prints its URL when it starts):
its device, measured speed, credit, recent units and every contribution with its verdict
and, when rejected, the outer step's reason. The path page renders the path's model card,
its validation curve, the download of its Hugging Face zip (the inference API's), a
``from_pretrained`` snippet, and a prompt box: the run's router picks a path for the text
(inference.routing) and that path continues it, bounded in tokens and rate-limited per
client address.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.core.cache import caches
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_POST
from markdown_it import MarkdownIt

from dipaco_server.audit.services import client_address
from dipaco_server.errors import ServiceError
from dipaco_server.inference import card, generation
from dipaco_server.inference.selection import select
from dipaco_server.rounds.models import Contribution, Lease
from dipaco_server.rounds.reports import activity
from dipaco_server.runs.models import MetricPoint, Path, Run
from dipaco_server.runs.phases import PATHS
from dipaco_server.workers import probation, trust
from dipaco_server.workers.models import Worker
from dipaco_web import queries
from dipaco_web.numbering import charts_for_people
from dipaco_web.views import dashboard_page, is_staff, render_page

logger = logging.getLogger(__name__)

RECENT_UNITS = 20
RECENT_CONTRIBUTIONS = 100
MAX_PROMPT_CHARS = 2000
DEFAULT_MAX_NEW_TOKENS = 32  # the prompt box's bound (settings.DIPACO_GENERATE_MAX_NEW_TOKENS)
DEFAULT_GENERATE_RATE = (6, 60)  # requests per seconds per client address
REROUTE_CHOICES = (0, 8, 16, 32)  # the prompt box's "re-route every k tokens" (0: once)
DEFAULT_REROUTE = 16


# --- a worker's page -------------------------------------------------------------------


@dataclass(frozen=True)
class UnitRow:
    lease: Lease
    run: Run
    round: int
    path: int
    tokens: int
    steps: int  # the inner steps the scheduler gave this lease (sized to the worker)
    size_reason: str  # why that many (rounds.protocol.sizing.size_unit)
    accepted: int
    rejected: int
    pending: int


def worker_context(worker: Worker) -> dict[str, Any]:
    leases = list(
        Lease.objects.filter(worker=worker)
        .select_related("unit__round__run", "unit__path")
        .order_by("-granted_at", "-pk")[:RECENT_UNITS]
    )
    verdicts: dict[int, dict[str, int]] = {}
    tokens: dict[int, int] = {}
    for lease_id, status, unit_tokens in Contribution.objects.filter(lease__in=leases).values_list(
        "lease_id", "status", "tokens"
    ):
        verdicts.setdefault(lease_id, {}).setdefault(status, 0)
        verdicts[lease_id][status] += 1
        tokens[lease_id] = max(tokens.get(lease_id, 0), unit_tokens)
    units = [
        UnitRow(
            lease=lease,
            run=lease.unit.round.run,
            round=lease.unit.round.t,
            path=lease.unit.path.index,
            tokens=tokens.get(lease.pk, 0),
            # 0: granted before units were sized to the worker's speed, meaning the run's H
            steps=lease.steps or lease.unit.round.run.run_config.inner.steps,
            size_reason=lease.size_reason,
            accepted=verdicts.get(lease.pk, {}).get(queries.ACCEPTED, 0),
            rejected=verdicts.get(lease.pk, {}).get(queries.REJECTED, 0),
            pending=verdicts.get(lease.pk, {}).get(queries.PENDING, 0),
        )
        for lease in leases
    ]
    contributions = list(
        Contribution.objects.filter(lease__worker=worker)
        .select_related("unit__round__run", "unit__path", "module")
        .order_by("-created_at", "-pk")[:RECENT_CONTRIBUTIONS]
    )
    online_since = queries.online_window()

    seen = worker.last_seen
    window = activity.Window.at()
    return {
        "worker": worker,
        "device": queries.device_label(worker.device),
        "device_items": _device_items(worker.device),
        "online": not worker.revoked and seen is not None and seen >= timezone.now() - online_since,
        "units": units,
        "contributions": contributions,
        # the leaderboard's figure: verified useful work (rounds.verification.credit)
        "credit_tokens": worker.tokens_processed,
        "trust": worker.trust,
        "replicas": (worker.replicas_agreed, worker.replicas_disagreed),
        # workers.probation: trust is earned by agreement with several distinct partners
        "standing": _standing(worker),
        # training, idle, stuck... (rounds.reports.activity): stuck is flagged on the page
        "activity": activity.worker_state(worker, window),
        "stuck_after_s": (window.now - window.stuck_since).total_seconds(),
    }


def _standing(worker: Worker) -> dict[str, Any]:
    partners, as_original, as_check = probation.probation_progress(worker.partners)
    return {
        "probation": worker.probation,
        "operator_trusted": worker.operator_trusted,
        "partners": partners,
        "needed": trust.partners_needed(),
        "roles": (as_original, as_check),
        "audits": worker.audits,
        "rate": trust.replication_rate(worker),
        "held_tokens": worker.held_tokens,
        "doubted": worker.doubted,
    }


def _device_items(device: Any) -> list[tuple[str, str]]:
    """The device the worker reported, as short text pairs (untrusted: strings, cut)."""
    if not isinstance(device, dict):
        return []
    return [(str(k)[:40], str(v)[:120]) for k, v in list(device.items())[:16]]


@dashboard_page()
def worker(request: HttpRequest, worker_id: int) -> HttpResponse:
    row = get_object_or_404(Worker, pk=worker_id)
    context = {**worker_context(row), "can_revoke": is_staff(request) and not row.revoked}
    live = reverse("dipaco_web:worker-live", args=[row.pk])
    return render_page(request, "dipaco_web/worker.html", context, nav="workers", live_url=live)


@dashboard_page(live=True)
def worker_live(request: HttpRequest, worker_id: int) -> HttpResponse:
    row = get_object_or_404(Worker, pk=worker_id)
    context = {**worker_context(row), "can_revoke": is_staff(request) and not row.revoked}
    return render_page(
        request, "dipaco_web/worker_live.html", {**context, "oob": True}, nav="workers"
    )


# --- a path's page ---------------------------------------------------------------------

_markdown = MarkdownIt("js-default").enable("table")  # raw HTML in the card is escaped


def path_context(run: Run, path: Path, request: HttpRequest) -> dict[str, Any]:
    losses = list(
        MetricPoint.objects.filter(run=run, path=path, name=queries.VAL_LOSS, round__isnull=False)
        .order_by("round", "pk")
        .values_list("round", "value")
    )
    by_round = dict(losses)
    chart = {
        "x": sorted(by_round),
        "series": [
            {"label": f"path {path.index}", "values": [by_round[t] for t in sorted(by_round)]}
        ],
    }
    ppl = {
        "x": chart["x"],
        "series": [{"label": f"path {path.index}",
                    "values": [queries.perplexity(by_round[t]) for t in sorted(by_round)]}],
    }  # fmt: skip
    context: dict[str, Any] = {
        "run": run,
        "path": path,
        "charts": charts_for_people({"val_loss": chart, "val_perplexity": ppl}),
        "latest": queries.perplexity(losses[-1][1]) if losses else None,
        "best": queries.perplexity(path.best_val_loss),
        "card_html": "",
        "selection": None,
        "not_ready": "",
        "download_url": f"/api/v1/runs/{run.pk}/paths/{path.index}/download",
        "server": settings.DIPACO_PUBLIC_URL.rstrip("/"),
        "max_new_tokens": max_new_tokens(),
        "max_prompt": MAX_PROMPT_CHARS,
        "reroute_choices": REROUTE_CHOICES,
        "reroute_default": DEFAULT_REROUTE,
        "paths": run.paths.filter(phase=PATHS).count(),
    }
    try:
        selection = select(run.pk, path.index)
    except ServiceError as exc:
        context["not_ready"] = exc.message
        return context
    context["selection"] = selection
    text = card.model_card(selection, staff=is_staff(request))
    context["card_html"] = _markdown.render(_without_front_matter(text))
    return context


def _without_front_matter(text: str) -> str:
    """The card without its YAML header (the Hub's metadata: for machines, not this page)."""
    if text.startswith("---\n"):
        end = text.find("\n---\n", 4)
        if end != -1:
            return text[end + 5 :]
    return text


@dashboard_page()
def path_page(request: HttpRequest, run_id: int, path_index: int) -> HttpResponse:
    run = get_object_or_404(Run, pk=run_id)
    path = get_object_or_404(Path, run=run, phase=PATHS, index=path_index)
    context = path_context(run, path, request)
    return render_page(request, "dipaco_web/path.html", context, nav="runs")


def max_new_tokens() -> int:
    return int(getattr(settings, "DIPACO_GENERATE_MAX_NEW_TOKENS", DEFAULT_MAX_NEW_TOKENS))


def _over_rate(request: HttpRequest) -> int | None:
    """Seconds to wait when this address is over the prompt box's limit, else None."""
    requests, seconds = getattr(settings, "DIPACO_GENERATE_RATE", DEFAULT_GENERATE_RATE)
    now = time.time()
    window = int(now // seconds)
    key = f"generate:{client_address(request) or 'unknown'}:{seconds}:{window}"
    cache = caches["ratelimit"]
    try:
        count = 1 if cache.add(key, 1, timeout=seconds + 1) else cache.incr(key)
    except Exception:  # the cache is down: fail open, as the API's limiter does
        logger.warning("the rate-limit cache does not answer; the prompt box is unlimited")
        return None
    if count > requests:
        return max(1, math.ceil((window + 1) * seconds - now))
    return None


@require_POST
def generate_view(request: HttpRequest, run_id: int, path_index: int) -> HttpResponse:
    """The prompt box: route the text, continue it with the routed path (bounded, rate
    limited); answers an HTML fragment (htmx) or, without JS, the path page with it."""
    run = get_object_or_404(Run, pk=run_id)
    get_object_or_404(Path, run=run, phase=PATHS, index=path_index)
    public = getattr(settings, "DIPACO_PUBLIC_DASHBOARD", True)
    if not public and not request.user.is_authenticated:
        return _fragment(request, {"error": "sign in to use the prompt box"}, 403)
    prompt = request.POST.get("prompt", "")
    if not prompt.strip():
        return _fragment(request, {"error": "write the start of a text to continue"}, 422)
    if len(prompt) > MAX_PROMPT_CHARS:
        return _fragment(
            request,
            {"error": f"the prompt has {len(prompt):,} characters; the limit is "
                      f"{MAX_PROMPT_CHARS:,}: give its start"},
            422,
        )  # fmt: skip
    try:
        reroute = int(request.POST.get("reroute_every", DEFAULT_REROUTE))
    except ValueError:
        reroute = -1
    if reroute not in REROUTE_CHOICES:
        return _fragment(
            request, {"error": f"re-route every: choose one of {list(REROUTE_CHOICES)} tokens"},
            422,
        )  # fmt: skip
    wait = _over_rate(request)
    if wait is not None:
        response = _fragment(
            request, {"error": f"too many prompts from your address; try again in {wait} s"}, 429
        )
        response["Retry-After"] = str(wait)
        return response
    try:
        answer = generate_text(run, path_index, prompt, max_new_tokens(), reroute)
    except ServiceError as exc:
        return _fragment(request, {"error": exc.message}, exc.status)
    return _fragment(request, answer, 200)


def _fragment(request: HttpRequest, context: dict[str, Any], status: int) -> HttpResponse:
    response = render_page(request, "dipaco_web/parts/generated.html", context, nav="runs")
    response.status_code = status
    return response


def generate_text(
    run: Run, path_index: int, prompt: str, new_tokens: int, reroute_every: int = 0
) -> dict[str, Any]:
    """The prompt box's answer (inference.generation): the run's router picks the path (a
    run of one path has no router: this path), which continues `prompt` greedily; with
    `reroute_every` k the router picks again from the text so far every k new tokens."""
    answer = generation.generate_text(
        run.pk, prompt, new_tokens, reroute_every=reroute_every, limit=max(new_tokens, 1),
        path=None if run.paths.filter(phase=PATHS).count() > 1 else path_index,
    )  # fmt: skip
    return {**answer, "asked": path_index}
