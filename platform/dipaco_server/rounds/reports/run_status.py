"""A run's status for staff (GET /api/v1/runs/{id}): its config, current round, paths,
modules with their current versions, and the workers on it. Rounds' records, so a rounds
route; the run's own routes are runs.api's."""

from datetime import datetime
from typing import Any

from django.db.models import Count, F
from django.http import HttpRequest
from ninja import Field, Router, Schema

from dipaco_server.accounts.auth import staff_auth
from dipaco_server.bounds import RunId
from dipaco_server.rounds.models import Lease
from dipaco_server.runs.api import RunOut, find_run, run_out
from dipaco_server.runs.models import ModuleVersion

staff_router = Router(auth=staff_auth)


class ModuleOut(Schema):
    phase: int = Field(description="1: a module of the dense phase-1 model; 2: a DiPaCo module.")
    module_id: str
    level: int | None
    index: int
    current_version: int | None
    blob_key: str | None = Field(description="The current version's blob (fp32 safetensors).")
    sha256: str | None
    size: int | None


class PathOut(Schema):
    phase: int = Field(description="1: the dense phase-1 model's one path; 2: a DiPaCo path.")
    index: int
    choices: list[int]
    modules: list[str]
    state: str
    train_tokens: int
    val_tokens: int
    best_val_loss: float | None
    best_round: int | None
    routing_share: float | None


class RoundOut(Schema):
    t: int
    state: str
    opened_at: datetime
    deadline: datetime | None
    closed_at: datetime | None
    units: dict[str, int] = Field(description="Work units of the round by state.")


class WorkerCounts(Schema):
    active: int = Field(description="Workers holding a live lease of this run now.")
    contributed: int = Field(description="Workers that completed at least one unit of this run.")


class RunStatusOut(RunOut):
    config: dict[str, Any]
    blob_prefix: str
    round: RoundOut | None = Field(description="The current round, once one was opened.")
    paths: list[PathOut]
    modules: list[ModuleOut]
    workers: WorkerCounts


@staff_router.get("/runs/{run_id}", response=RunStatusOut, tags=["admin: runs"])
def get_run(request: HttpRequest, run_id: RunId) -> dict[str, Any]:
    """A run with its config, current round, paths, modules (current versions) and workers."""
    run = find_run(run_id)
    out = run_out(run)
    out.update(config=run.config, blob_prefix=f"runs/{run.pk}")
    round_ = run.rounds.filter(t=run.current_round).first()
    out["round"] = None
    if round_ is not None:
        units = dict(round_.units.values_list("state").annotate(n=Count("pk")).order_by())
        out["round"] = {
            "t": round_.t,
            "state": round_.state,
            "opened_at": round_.opened_at,
            "deadline": round_.deadline,
            "closed_at": round_.closed_at,
            "units": units,
        }
    out["paths"] = list(run.paths.order_by("phase", "index"))
    current = {
        v.module_id: v
        for v in ModuleVersion.objects.filter(module__run=run, version=F("module__current_version"))
    }
    out["modules"] = [
        {
            "phase": m.phase,
            "module_id": m.module_id,
            "level": m.level,
            "index": m.index,
            "current_version": m.current_version,
            "blob_key": getattr(current.get(m.pk), "blob_key", None),
            "sha256": getattr(current.get(m.pk), "sha256", None),
            "size": getattr(current.get(m.pk), "size", None),
        }
        for m in run.modules.order_by("pk")
    ]
    leases = Lease.objects.filter(unit__round__run=run)
    out["workers"] = {
        "active": leases.filter(state=Lease.State.ACTIVE).values("worker").distinct().count(),
        "contributed": leases.filter(state=Lease.State.COMPLETED)
        .values("worker")
        .distinct()
        .count(),
    }
    return out
