"""Staff pages: a new run, datasets, enrollment tokens, and revoking a worker.

Every page here is staff-only: an anonymous visitor is sent to the sign-in form, a
signed-in user who is not staff gets 403, and so does any POST by either (CSRF is checked
before that by Django's middleware). Every action is written to the audit log (channel
"dashboard") whether it succeeds or is refused, through the same services as the admin
API: runs.services.create_run, workers.services, the Celery tasks of runs.tasks.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from datetime import datetime, timedelta
from functools import wraps
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.db import IntegrityError, transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.urls import reverse
from django.utils import timezone
from django.views.decorators.http import require_http_methods, require_POST

from dipaco.config import RunConfig
from dipaco_server.audit.services import record
from dipaco_server.env import DEFAULT_WORKER_INSTALL
from dipaco_server.errors import ApiError, ServiceError
from dipaco_server.runs import services as run_services
from dipaco_server.runs.actions import enqueue
from dipaco_server.runs.errors import ConfigInvalid
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.phases import PATHS
from dipaco_server.runs.sources import check_source, data_roots
from dipaco_server.workers import services as worker_services
from dipaco_server.workers.models import EnrollmentToken, Worker
from dipaco_web import forms, runform
from dipaco_web.views import View, is_staff, render_page

logger = logging.getLogger(__name__)


def staff_page(view: View) -> View:
    """Staff only: anonymous GETs go to the sign-in form; anything else not staff is 403."""

    @wraps(view)
    def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
        if not is_staff(request):
            if request.method == "GET" and not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path(), reverse("dipaco_web:login"))
            raise PermissionDenied("only staff can do this; sign in with a staff account")
        return view(request, *args, **kwargs)

    return wrapper


def _audit(request: HttpRequest, action: str, target_type: str, target_id: Any = None,
           **fields: Any) -> None:  # fmt: skip
    record(request, action, channel="dashboard", user=request.user, target_type=target_type,
           target_id=target_id, **fields)  # fmt: skip


# --- runs -----------------------------------------------------------------------------------


@staff_page
@require_http_methods(["GET", "POST"])
def run_new(request: HttpRequest) -> HttpResponse:
    """A run from a preset and the config editor; "Check" validates and estimates only."""
    chosen = runform.preset(request.POST.get("preset") or request.GET.get("preset"))
    datasets = list(Dataset.objects.order_by("-created_at", "-pk"))
    context: dict[str, Any] = {
        "presets": runform.presets(),
        "preset": chosen,
        "datasets": datasets,
        "name": "",
        "dataset_id": "",
        "pasted": "",
        "problems": [],
        "form_errors": {},
    }
    config: dict[str, Any] = chosen.config
    if request.method == "POST":
        context["name"] = name = request.POST.get("name", "").strip()
        context["dataset_id"] = request.POST.get("dataset", "")
        context["pasted"] = pasted = request.POST.get("config_json", "").strip()
        if pasted:
            try:
                loaded = json.loads(pasted)
            except ValueError as exc:
                context["form_errors"]["config_json"] = f"not JSON: {exc}"
                loaded = None
            if isinstance(loaded, dict):
                config = loaded
            elif loaded is not None:
                context["form_errors"]["config_json"] = "the config must be a JSON object"
        if not pasted or "config_json" in context["form_errors"]:
            fields = {k: v for k, v in request.POST.items() if k.startswith(_SECTIONS)}
            config, _ = runform.parse_fields(fields, chosen.config)
        config = {k: v for k, v in config.items() if k != "name"}
        dataset = _dataset(context["dataset_id"], context["form_errors"])
        if not forms.NAME.match(name) or len(name) > 64:
            context["form_errors"]["name"] = (
                "give the run a name: 1-64 letters, digits, '.', '_' or '-'"
            )
        spec = _validate(config, context)
        if spec is not None:
            context["estimate"] = runform.estimate(spec)
        creating = request.POST.get("submit") == "create"
        if creating and spec is not None and not context["form_errors"]:
            created = _create_run(request, name, config, dataset, context)
            if created is not None:
                return redirect("dipaco_web:run", run_id=created.pk)
        elif creating:  # refused before the service was asked: logged as refused too
            named = [str(p.get("field")) for p in context["problems"]]
            named += list(context["form_errors"])
            _audit(request, "run.create", "run", status=422, error_code="config_invalid",
                   message=f"refused: {', '.join(named)}", params={"name": name})  # fmt: skip
    else:
        context["estimate"] = runform.estimate(RunConfig.model_validate(config))
    context["sections"] = runform.editor_sections(config, context["problems"])
    status = 400 if request.method == "POST" and (context["problems"] or
                                                  context["form_errors"]) else 200  # fmt: skip
    response = render_page(request, "dipaco_web/run_new.html", context, nav="runs")
    response.status_code = status
    return response


# Top-level keys of a run config: the editor's inputs are named after them.
_SECTIONS = tuple(RunConfig.model_fields)


def _dataset(raw: str, errors: dict[str, str]) -> Dataset | None:
    if not raw:
        return None
    dataset = Dataset.objects.filter(pk=int(raw)).first() if raw.isdigit() else None
    if dataset is None:
        errors["dataset"] = f"no dataset {raw!r}; choose one from the list"
    return dataset


def _validate(config: dict[str, Any], context: dict[str, Any]) -> RunConfig | None:
    try:
        return run_services.validate_config(config)
    except ConfigInvalid as exc:
        context["problems"] = list(exc.details.get("problems", []))
        return None


def _create_run(
    request: HttpRequest,
    name: str,
    config: dict[str, Any],
    dataset: Dataset | None,
    context: dict[str, Any],
) -> Run | None:
    params = {"name": name, "dataset_id": dataset.pk if dataset else None, "config": config}
    try:
        run = run_services.create_run(name, config, dataset=dataset)
    except ServiceError as exc:
        _audit(request, "run.create", "run", status=exc.status, error_code=exc.code,
               message=exc.message, params=params)  # fmt: skip
        if isinstance(exc, ConfigInvalid):
            context["problems"] = list(exc.details.get("problems", []))
        else:
            context["form_errors"]["name"] = exc.message
        return None
    _audit(request, "run.create", "run", run.pk, params=params)
    messages.success(request, f"created run {run.name}: prepare it to read the data")
    return run


# --- datasets -------------------------------------------------------------------------------


@staff_page
@require_http_methods(["GET", "POST"])
def dataset_new(request: HttpRequest) -> HttpResponse:
    """A dataset from a path under a data root, or an uploaded JSONL file (bounded)."""
    limit = forms.upload_max_bytes()
    too_big = int(request.META.get("CONTENT_LENGTH") or 0) > limit + 1024 * 1024
    if request.method == "POST" and too_big:  # refused before the body is read
        _audit(request, "dataset.create", "dataset", status=413, error_code="upload_too_large",
               message=f"request over {limit} bytes")  # fmt: skip
        error = (
            f"the upload is over the {limit:,}-byte limit: "
            "upload a sample, or put the corpus under a data root and name its path"
        )
        return _dataset_page(request, forms.DatasetForm(), status=413, error=error)  # fmt: skip
    if request.method == "GET":
        return _dataset_page(request, forms.DatasetForm())
    form = forms.DatasetForm(request.POST, request.FILES)
    if not form.is_valid():
        return _dataset_page(request, form, status=400)
    data = form.cleaned_data
    name = data["name"]
    params = {"name": name, "kind": data["kind"], "source": data.get("source") or ""}
    written: Path | None = None
    try:
        if data["kind"] == "upload":
            written = _save_upload(data["file"], name, data.get("text_field") or "text")
            source = check_source(str(written))
        else:
            source = check_source(data["source"])
        with transaction.atomic():
            dataset = Dataset.objects.create(name=name, source=source)
    except (ServiceError, ValueError) as exc:
        if written is not None:
            written.unlink(missing_ok=True)
        field = "file" if data["kind"] == "upload" else "source"
        message = exc.message if isinstance(exc, ServiceError) else str(exc)
        form.add_error(field, message)
        _audit(request, "dataset.create", "dataset", status=422, error_code="dataset_invalid",
               message=message, params=params)  # fmt: skip
        return _dataset_page(request, form, status=422)
    except IntegrityError:
        if written is not None:
            written.unlink(missing_ok=True)
        form.add_error("name", f"a dataset named {name!r} exists; choose another")
        _audit(request, "dataset.create", "dataset", status=409,
               error_code="dataset_name_taken", params=params)  # fmt: skip
        return _dataset_page(request, form, status=409)
    _audit(request, "dataset.create", "dataset", dataset.pk, params=params)
    try:
        enqueue("dipaco_server.runs.tasks.prepare_dataset", dataset.pk)
    except ApiError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"dataset {name} created; reading it now")
    return redirect("dipaco_web:dataset", dataset_id=dataset.pk)


def _save_upload(upload: Any, name: str, text_field: str) -> Path:
    """The upload checked as JSONL, then moved to upload_dir()/<name>.jsonl."""
    folder = forms.upload_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / f"{name}.jsonl"
    if target.exists():
        raise ValueError(f"an uploaded corpus named {name} exists; choose another name")
    handle, staged_name = tempfile.mkstemp(prefix=".upload-", suffix=".jsonl", dir=folder)
    staged = Path(staged_name)
    try:
        with os.fdopen(handle, "wb") as out:
            for chunk in upload.chunks():
                out.write(chunk)
        forms.check_jsonl(staged, text_field)
        os.replace(staged, target)
    finally:
        staged.unlink(missing_ok=True)
    return target


def _dataset_page(
    request: HttpRequest, form: forms.DatasetForm, status: int = 200, error: str = ""
) -> HttpResponse:
    context = {
        "form": form,
        "error": error,
        "roots": data_roots(),
        "limit": forms.upload_max_bytes(),
    }
    response = render_page(request, "dipaco_web/dataset_new.html", context, nav="datasets")
    response.status_code = status
    return response


def dataset_rows(dataset: Dataset) -> list[dict[str, Any]]:
    """Per run prepared from `dataset`: its tokens and how evenly its shards split them."""
    rows = []
    for run in dataset.runs.order_by("-created_at"):
        paths = list(RunPath.objects.filter(run=run, phase=PATHS).order_by("index"))
        tokens = [p.train_tokens for p in paths]
        total = sum(tokens)
        mean = total / len(tokens) if tokens else 0
        rows.append({
            "run": run,
            "tokens": total,
            "val_tokens": sum(p.val_tokens for p in paths),
            "paths": [
                {"index": p.index, "tokens": p.train_tokens, "share": p.routing_share,
                 "percent": round(100 * p.train_tokens / max(tokens), 1) if total else 0}
                for p in paths
            ],
            "imbalance": (max(tokens) / mean) if mean else None,
        })  # fmt: skip
    return rows


# --- enrollment -----------------------------------------------------------------------------


@staff_page
@require_http_methods(["GET", "POST"])
def enroll(request: HttpRequest) -> HttpResponse:
    """Create an enrollment token (shown once, with the volunteer's commands) and list them."""
    created: dict[str, Any] | None = None
    status = 200
    if request.method == "POST":
        form = forms.EnrollmentForm(request.POST)
        params = {k: request.POST.get(k, "") for k in ("label", "max_uses", "expires_in_hours")}
        if form.is_valid():
            data = form.cleaned_data
            hours = data.get("expires_in_hours")
            row, plaintext = worker_services.create_enrollment_token(
                created_by=request.user,
                label=data.get("label") or "",
                max_uses=data.get("max_uses"),
                expires_in=timedelta(hours=hours) if hours else None,
            )
            _audit(request, "enrollment_token.create", "enrollment_token", row.pk,
                   params=params)  # fmt: skip
            created = {"row": row, "token": plaintext, "commands": volunteer_commands(plaintext)}
            form = forms.EnrollmentForm()
            status = 201
        else:
            _audit(request, "enrollment_token.create", "enrollment_token", status=400,
                   error_code="enrollment_invalid", message=form.errors.as_text(),
                   params=params)  # fmt: skip
            status = 400
    else:
        form = forms.EnrollmentForm()
    tokens = list(
        EnrollmentToken.objects.select_related("created_by").order_by("-created_at", "-pk")[:200]
    )
    now = timezone.now()
    rows = [{"token": t, "state": token_state(t, now)} for t in tokens]
    context = {"form": form, "created": created, "tokens": rows}
    response = render_page(request, "dipaco_web/enroll.html", context, nav="enroll")
    response.status_code = status
    response["Cache-Control"] = "no-store"  # the token is on the page once
    return response


def token_state(token: EnrollmentToken, now: datetime) -> str:
    """What an enrollment token can do now, by the rule register_worker applies (workers.
    services): "revoked", "used up" (max_uses reached), "expired", or "active"."""
    if token.revoked:
        return "revoked"
    if token.max_uses is not None and token.uses >= token.max_uses:
        return "used up"
    if token.expires_at is not None and token.expires_at <= now:
        return "expired"
    return "active"


def volunteer_commands(token: str) -> list[str]:
    """What a volunteer pastes: install the agent, then enroll this machine with the token."""
    install = getattr(settings, "DIPACO_WORKER_INSTALL", DEFAULT_WORKER_INSTALL)  # env.py
    server = settings.DIPACO_PUBLIC_URL.rstrip("/")
    return [install, f"dipaco-worker --server {server} --enroll {token}"]


@staff_page
@require_POST
def enroll_revoke(request: HttpRequest, token_id: int) -> HttpResponse:
    row = EnrollmentToken.objects.filter(pk=token_id).first()
    if row is None:
        _audit(request, "enrollment_token.revoke", "enrollment_token", token_id, status=404,
               error_code="enrollment_token_not_found")  # fmt: skip
        messages.error(request, f"no enrollment token {token_id}")
    else:
        worker_services.revoke_enrollment_token(row)
        _audit(request, "enrollment_token.revoke", "enrollment_token", row.pk)
        messages.success(request, f"enrollment token {row.pk} ({row.label or 'no label'}) "
                                  "revoked; workers it registered keep working")  # fmt: skip
    return redirect("dipaco_web:enroll")


# --- workers --------------------------------------------------------------------------------


@staff_page
@require_POST
def worker_revoke(request: HttpRequest, worker_id: int) -> HttpResponse:
    worker = get_object_or_404(Worker, pk=worker_id)
    worker_services.revoke_worker(worker)
    _audit(request, "worker.revoke", "worker", worker.pk)
    messages.success(request, f"worker {worker.name} revoked: its token is refused from now "
                              "on and its leases go back to the queue")  # fmt: skip
    return redirect("dipaco_web:worker", worker_id=worker.pk)


@staff_page
@require_http_methods(["GET"])
def datasets(request: HttpRequest) -> HttpResponse:
    rows = list(Dataset.objects.order_by("-created_at", "-pk"))
    return render_page(request, "dipaco_web/datasets.html", {"datasets": rows}, nav="datasets")


_BUSY = (Dataset.State.PENDING, Dataset.State.PREPARING)


@staff_page
@require_http_methods(["GET"])
def dataset(request: HttpRequest, dataset_id: int) -> HttpResponse:
    """A dataset's state, preparation progress, statistics, and per run its tokens and the
    balance of its path shards (known once a run prepared from it)."""
    row = get_object_or_404(Dataset, pk=dataset_id)
    context = {"dataset": row, "runs": dataset_rows(row), "busy": row.state in _BUSY}
    if request.GET.get("live"):
        context["oob"] = True
        return render_page(request, "dipaco_web/dataset_live.html", context, nav="datasets")
    live = f"{reverse('dipaco_web:dataset', args=[row.pk])}?live=1" if context["busy"] else ""
    return render_page(request, "dipaco_web/dataset.html", context, nav="datasets", live_url=live)
