"""Dashboard pages, their live parts, staff actions and sign-in.

Every page has a ``*_live`` twin that htmx polls every DIPACO_DASHBOARD_POLL_S
seconds (default 5): it returns the page's sections marked ``hx-swap-oob``, so one
request refreshes them all without a reload. Views only pick the queries
(dipaco_web.queries, dipaco_web.curves) and a template.

Who sees what: read-only pages are public unless DIPACO_PUBLIC_DASHBOARD is false,
then only signed-in users see them. Only active staff users see and can press the
run buttons; anyone else's POST is refused with 403.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import views as auth_views
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse, reverse_lazy
from django.views.decorators.http import require_GET, require_POST

from dipaco import __version__
from dipaco_server.audit.services import record
from dipaco_server.errors import ApiError, ServiceError
from dipaco_server.rounds.reports import activity
from dipaco_server.runs.models import Run
from dipaco_web import actions, curves, queries
from dipaco_web.numbering import charts_for_people

View = Callable[..., HttpResponse]
DEFAULT_POLL_S = 5


def poll_seconds() -> float:
    """How often pages refresh their live parts (read per request, never cached)."""
    return float(getattr(settings, "DIPACO_DASHBOARD_POLL_S", DEFAULT_POLL_S))


def is_staff(request: HttpRequest) -> bool:
    user = request.user
    return bool(user.is_authenticated and user.is_active and user.is_staff)


def dashboard_page(*, live: bool = False) -> Callable[[View], View]:
    """A read-only page (or its live part) that a private dashboard shows signed-in users only.

    A page sends anonymous visitors to the sign-in form; a live part answers 403, so
    htmx leaves the page as it was.
    """

    def decorate(view: View) -> View:
        @require_GET
        @wraps(view)
        def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            public = getattr(settings, "DIPACO_PUBLIC_DASHBOARD", True)
            if not public and not request.user.is_authenticated:
                if live:
                    raise PermissionDenied("sign in to see this dashboard")
                return redirect_to_login(request.get_full_path(), reverse("dipaco_web:login"))
            return view(request, *args, **kwargs)

        return wrapper

    return decorate


def render_page(
    request: HttpRequest, template: str, context: dict[str, Any], *, nav: str, live_url: str = ""
) -> HttpResponse:
    extra = {"nav": nav, "live_url": live_url, "poll_ms": round(1000 * poll_seconds())}
    return render(request, template, {**context, **extra, "version": __version__})


# --- runs --------------------------------------------------------------------------------


@dashboard_page()
def runs(request: HttpRequest) -> HttpResponse:
    context = {"rows": queries.run_rows()}
    live = reverse("dipaco_web:runs-live")
    return render_page(request, "dipaco_web/runs.html", context, nav="runs", live_url=live)


@dashboard_page(live=True)
def runs_live(request: HttpRequest) -> HttpResponse:
    context = {"rows": queries.run_rows(), "oob": True}
    return render_page(request, "dipaco_web/runs_live.html", context, nav="runs")


def _run_context(request: HttpRequest, run_id: int) -> dict[str, Any]:
    run = get_object_or_404(Run, pk=run_id)
    communication = curves.communication(run)
    return {
        "run": run,
        "row": queries.run_row(run),
        "config": run.run_config,
        "rounds": queries.round_rows(run),
        "grid": queries.module_grid(run),
        "paths": queries.path_rows(run),
        "leases": queries.active_leases(run),
        "communication": communication,
        "charts": charts_for_people(
            curves.with_phase_boundary(
                run, {**curves.loss_charts(run), "communication": communication.chart()}
            )
        ),
        "actions": queries.run_actions(run) if is_staff(request) else [],
        # A run's error text can name server paths and hosts (a corpus that failed to read,
        # a broker that did not answer): staff read it, everyone else a plain line.
        "error_text": run.error if is_staff(request) else public_error(run),
        # A round open past twice its expected duration is flagged (rounds.reports.activity).
        "round_age": activity.round_age(run) if run.state == Run.State.RUNNING else None,
    }


def public_error(run: Run) -> str:
    if not run.error:
        return ""
    if run.state == Run.State.FAILED:
        return "This run failed. Staff see the reason on this page when signed in."
    return "The server hit a problem with this run; staff see the detail when signed in."


@dashboard_page()
def run(request: HttpRequest, run_id: int) -> HttpResponse:
    live = reverse("dipaco_web:run-live", args=[run_id])
    context = _run_context(request, run_id)
    return render_page(request, "dipaco_web/run.html", context, nav="runs", live_url=live)


@dashboard_page(live=True)
def run_live(request: HttpRequest, run_id: int) -> HttpResponse:
    context = {**_run_context(request, run_id), "oob": True}
    return render_page(request, "dipaco_web/run_live.html", context, nav="runs")


@require_POST
def run_action(request: HttpRequest, run_id: int, action: str) -> HttpResponse:
    """A staff button: apply ``action`` and go back to the run page with what happened."""
    if not is_staff(request):
        raise PermissionDenied(
            "only staff can prepare, start, pause, resume or cancel runs; sign in"
        )
    if action not in actions.ACTIONS:
        raise Http404(f"no action {action!r}; use one of {', '.join(actions.ACTIONS)}")
    run = get_object_or_404(Run, pk=run_id)
    audit: dict[str, Any] = {
        "channel": "dashboard",
        "user": request.user,
        "target_type": "run",
        "target_id": run.pk,
    }
    try:
        actions.perform(run, action)
    except (ServiceError, ApiError) as exc:
        record(request, f"run.{action}", status=exc.status, error_code=exc.code,
               message=exc.message, **audit)  # fmt: skip
        messages.error(request, exc.message)
    else:
        record(request, f"run.{action}", **audit)
        messages.success(request, f"{action}: run {run.name} is now {run.state}")
    return redirect("dipaco_web:run", run_id=run.pk)


# --- workers -----------------------------------------------------------------------------


def _workers_context() -> dict[str, Any]:
    rows = queries.worker_rows()
    return {
        "workers": rows,
        "leaderboard": queries.leaderboard(rows),
        "online": sum(r.online for r in rows),
        "online_minutes": queries.online_window().total_seconds() / 60,
    }


@dashboard_page()
def workers(request: HttpRequest) -> HttpResponse:
    live = reverse("dipaco_web:workers-live")
    context = _workers_context()
    return render_page(request, "dipaco_web/workers.html", context, nav="workers", live_url=live)


@dashboard_page(live=True)
def workers_live(request: HttpRequest) -> HttpResponse:
    context = {**_workers_context(), "oob": True}
    return render_page(request, "dipaco_web/workers_live.html", context, nav="workers")


# --- signing in and out ------------------------------------------------------------------

login = auth_views.LoginView.as_view(
    template_name="dipaco_web/login.html",
    extra_context={"nav": "login", "version": __version__},
    redirect_authenticated_user=True,
    next_page=reverse_lazy("dipaco_web:runs"),
)
logout = auth_views.LogoutView.as_view(next_page=reverse_lazy("dipaco_web:runs"))
