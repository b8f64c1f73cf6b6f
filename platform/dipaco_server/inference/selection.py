"""Which weights a download serves: a path's module versions after a given round.

`select` picks, for each module of a path, its version after a given round closed
(round t's outer step writes version t + 1; version 0 is the untrained initial weights).
The files built from a `Selection` are dipaco_server.inference.services' and card's.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Max

from dipaco_server.errors import ServiceError
from dipaco_server.runs.errors import RunNotFound
from dipaco_server.runs.models import ModuleVersion, Path, Run
from dipaco_server.runs.phases import PATHS


class PathNotFound(ServiceError):
    code, status = "path_not_found", 404


class PathNotTrained(ServiceError):
    """No module version to serve yet, or only the initial weights and no round was asked."""

    code, status = "path_not_trained", 409


class RoundNotFound(ServiceError):
    code, status = "round_not_found", 404


@dataclass(frozen=True)
class Selection:
    """The weights one download serves: a path and one version per module, at a round."""

    run: Run
    path: Path
    round: int
    versions: tuple[ModuleVersion, ...]  # in path.modules order

    @property
    def folder(self) -> str:
        """The directory name users see: ``<run>-path-<p>-round-<n>``, with the round
        counted from 1 as every page does (``round`` itself is the API's 0-based index)."""
        return f"{self.run.name}-path-{self.path.index}-round-{self.round + 1}"


def get_run(run_id: int) -> Run:
    run = Run.objects.filter(pk=run_id).first()
    if run is None:
        raise RunNotFound(f"no run with id {run_id}; the dashboard at / lists the runs")
    return run


def select(run_id: int, path_index: int, round: int | None = None) -> Selection:
    """The path's modules after round `round` closed (None: the last round with weights).

    Round t's outer step writes version t + 1, so "after round t" is each module's newest
    version at or before t + 1: the weights the evaluation scored as round t. Version 0,
    the initial weights, is never served: nothing has trained it.
    """
    run = get_run(run_id)
    paths = run.paths.filter(phase=PATHS)  # the DiPaCo paths; phase 1's model is not served
    path = paths.filter(index=path_index).first()
    if path is None:
        raise PathNotFound(
            f"run {run.name!r} has no path {path_index}; its paths are 0..{paths.count() - 1}",
            paths=paths.count(),
        )
    rows = ModuleVersion.objects.filter(
        module__run=run, module__phase=PATHS, module__module_id__in=path.modules
    )
    newest = rows.aggregate(v=Max("version"))["v"]
    if not newest:  # None: not prepared; 0: only the initial weights
        raise PathNotTrained(
            f"path {path_index} of run {run.name!r} has no trained weights yet (the run is "
            f"{run.state}); download it once its first round has closed"
        )
    last = newest - 1  # the last closed round
    if round is not None and round > last:
        raise RoundNotFound(
            f"path {path_index} of run {run.name!r} has weights up to round {last}; "
            f"ask for a round from 0 to {last}, or leave round out for the newest",
            last=last,
        )
    target = last if round is None else round
    chosen: dict[str, ModuleVersion] = {}
    for row in rows.filter(version__lte=target + 1).select_related("module").order_by("version"):
        chosen[row.module.module_id] = row  # ascending: the last one kept is the newest
    missing = [m for m in path.modules if m not in chosen]
    if missing:  # a module added to the path later than its others: not in this layout model
        raise RoundNotFound(f"modules {missing} have no version after round {target}")
    versions = tuple(chosen[m] for m in path.modules)
    return Selection(run=run, path=path, round=target, versions=versions)
