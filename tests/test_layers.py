"""The server's apps, and dipaco's parts, each in one dependency order: no import points up.

As healthchecks and readthedocs keep theirs: each layer may import those below it and
never one above, at the top of a file or inside a function alike. From the bottom:

- library: ``dipaco`` and ``worker_agent``, which import nothing of the server;
- shared: what every app builds on and which names no app: the ``dipaco_server``
  package's own modules (``errors`` with ``ServiceError``, ``bounds``, ``patterns``,
  ``http_limits``, ``error_pages``, ``celery``, ``settings``...), ``storage`` and ``core``
  (tokens, the retry policy of tasks, the read-only admin);
- the apps: accounts, audit, workers, runs, rounds, inference; each app's ``api.py`` is
  part of its app, and its ``apps.py`` (the AppConfig that connects its receivers when
  Django is ready) sits at its top. runs asks rounds to open a round or end a run's leases
  through runs.signals, never by importing it;
- rounds in its parts, from the bottom: its own modules (``models``, ``policy``,
  ``signals``, ``admin``); ``verification`` (the rules, Django-free, and every check of an
  outer step); ``protocol`` (the worker protocol: register, lease, heartbeat, upload,
  complete); ``outer`` (the outer step and publishing); ``lifecycle`` (a round's life:
  open, close, deadlines, the tasks); ``reports`` (what staff and workers read back). The
  protocol tells the round's life that a lease completed through rounds.signals;
- entry: what assembles them (``dipaco_server.api``, ``asgi``, ``wsgi``, ``urls``, the
  ``cli``);
- site: the dashboard (``dipaco_web``) and the demo (``dipaco_demo``). The URL map mounts
  the dashboard by name (``include("dipaco_web.urls")``), which imports nothing.

Every module's layer follows from its name: no module is placed by hand.

Only the ``dipaco*`` and ``worker_agent`` packages are placed; third-party imports are
not checked here (tests/test_boundaries keeps Django out of the library and the agent).

Inside the library, ``dipaco``'s parts (each subpackage, and each module at its top) are
in layers of their own, ``DIPACO_LAYERS``, bottom first. A part imports only parts of the
layers below its own; the parts of one layer are independent (none imports another), so
no two parts can import each other, and a circle among them fails on its own with the
circle named. Every part must be placed, by hand: a new one fails until it is. An import
under ``if TYPE_CHECKING`` counts like any other (a type is read from the module that
defines it, and mypy follows it); a part that only needs the shape of another's object
declares a Protocol instead (``dipaco.codecs.feedback.Comm``,
``dipaco.tokenizer.TextDocument``).
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = (
    "library",
    "shared",
    "accounts",
    "audit",
    "workers",
    "runs",
    "rounds",
    "rounds.verification",
    "rounds.protocol",
    "rounds.outer",
    "rounds.lifecycle",
    "rounds.reports",
    "inference",
    "entry",
    "site",
)
APPS = ("accounts", "audit", "workers", "runs", "rounds", "inference")
# An app's parts, bottom first: packages inside the app whose modules are layers of their own.
PARTS = {"rounds": ("verification", "protocol", "outer", "lifecycle", "reports")}
ENTRY = ("api", "asgi", "wsgi", "urls", "cli")
# dipaco's parts (a subpackage, or a module at its top; "__init__" is the package's own
# module, whose lazy `dipaco.load_path` reads dipaco.client), bottom first. Each may import
# only the parts of the layers below its own, and the parts of one layer are independent.
DIPACO_LAYERS: tuple[tuple[str, ...], ...] = (
    # standalone: the lazy transformers import, the retry policy, safetensors writing, and
    # the codecs (the format of Δs and updates, and the registry of their names)
    ("hf", "retry", "tensorfile", "codecs"),
    # the run's description (its choices of codec from the registry), and the tokenizer
    ("config", "tokenizer"),
    # one path's model, routing documents by their first tokens, FLOPs of a config
    ("model", "routing", "flops"),
    # a path's modules; corpora routed into token shards; evaluation
    ("modular", "data", "evaluate"),
    # the inner loop, the outer step and its updates, module files, paths as HF models,
    # generation on paths
    ("inner", "outer", "updates", "modules_file", "inference", "generation"),
    # the HTTP client of a server's API; a whole training in one process
    ("client", "simulate"),
    ("__init__",),
    ("cli",),
)
# Where each package's modules are, relative to the checkout: their module names start there.
SOURCES = {"dipaco": "", "worker_agent": "", "dipaco_server": "platform",
           "dipaco_demo": "platform", "dipaco_web": "web"}  # fmt: skip


def layer_of(module: str) -> str | None:
    """The layer `module` (a dotted name) belongs to; None for a module of no layer
    (third-party, the standard library, tests)."""
    parts = module.split(".")
    if parts[0] in ("dipaco", "worker_agent"):
        return "library"
    if parts[0] in ("dipaco_web", "dipaco_demo"):
        return "site"
    if parts[0] != "dipaco_server":
        return None
    if len(parts) > 1 and parts[1] in APPS:
        app, inside = parts[1], parts[2:3]
        if inside == ["apps"] and app in PARTS:  # the AppConfig connects the top's receivers
            return f"{app}.{PARTS[app][-1]}"
        if inside and inside[0] in PARTS.get(app, ()):
            return f"{app}.{inside[0]}"
        return app
    if len(parts) > 1 and parts[1] in ENTRY:
        return "entry"
    return "shared"


def module_name(path: str) -> str:
    """The dotted name of the module at `path` (relative to the checkout, with "/")."""
    parts = path.removesuffix(".py").split("/")
    for package, folder in SOURCES.items():
        prefix = folder.split("/") if folder else []
        if parts[: len(prefix)] == prefix and parts[len(prefix) : len(prefix) + 1] == [package]:
            parts = parts[len(prefix) :]
            break
    else:
        raise ValueError(f"{path} is in none of the packages {sorted(SOURCES)}")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def targets(node: ast.AST, package: str, known: set[str]) -> list[str]:
    """The modules of `known` that the import statement `node` loads: `from p import m`
    names module p.m when there is one, else p; relative imports resolved from `package`
    (the importing module's package)."""

    def owner(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        names = [owner(alias.name) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".")
            base = ".".join([*parts[: len(parts) - node.level + 1], *filter(None, [node.module])])
        else:
            base = node.module or ""
        names = [
            f"{base}.{a.name}" if f"{base}.{a.name}" in known else owner(base) for a in node.names
        ]
    else:
        names = []
    return [name for name in names if name]


def imported(tree: ast.AST, module: str, is_package: bool) -> Iterable[tuple[int, str]]:
    """(line, dotted name) of every module `tree` imports, wherever the import statement is
    (top level, a function, ``if TYPE_CHECKING``); relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            yield node.lineno, name
            for alias in node.names:  # `from dipaco_server import runs` imports runs
                yield node.lineno, f"{name}.{alias.name}"


def violations(sources: Iterable[tuple[str, str]]) -> list[str]:
    """``path:line: its layer -> the layer above (the module)`` for each import of a layer
    above the importing module's; `sources` are (path relative to the checkout, text)."""
    found = []
    for path, text in sources:
        module = module_name(path)
        own = layer_of(module)
        assert own is not None, path
        tree = ast.parse(text, filename=path)
        seen = set()
        for line, name in imported(tree, module, path.endswith("__init__.py")):
            other = layer_of(name)
            if other is None or LAYERS.index(other) <= LAYERS.index(own) or (line, other) in seen:
                continue
            seen.add((line, other))
            found.append(f"{path}:{line}: {own} -> {other} ({name})")
    return found


def part_of(module: str) -> str | None:
    """The part of dipaco that `module` (a dotted name) is in: its subpackage, its module
    at the top, or "__init__" for the package itself; None outside dipaco."""
    parts = module.split(".")
    if parts[0] != "dipaco":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def dipaco_imports(sources: Iterable[tuple[str, str]]) -> list[tuple[str, int, str, str, str]]:
    """(path, line, importing part, imported part, imported module) for each import of one
    part of dipaco by another, wherever the statement is (a function, ``if TYPE_CHECKING``);
    `sources` are (path relative to the checkout, text) of every module of dipaco."""
    modules = {module_name(path): (path, text) for path, text in sources}
    known = set(modules)
    found = []
    for module, (path, text) in sorted(modules.items()):
        own = part_of(module)
        if own is None:
            continue
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, filename=path)):
            for target in targets(node, package, known):
                other = part_of(target)
                if other is not None and other != own:
                    found.append((path, getattr(node, "lineno", 0), own, other, target))
    return sorted(set(found))


def dipaco_part_violations(sources: Iterable[tuple[str, str]]) -> list[str]:
    """What breaks ``DIPACO_LAYERS``: a part in no layer, ``path:line: part -> part above
    (the module)`` for an import up the layers, and ``... (same layer)`` for one of a
    sibling."""
    sources = list(sources)
    layer = {part: i for i, parts in enumerate(DIPACO_LAYERS) for part in parts}
    present = {part_of(module_name(path)) for path, _ in sources} - {None}
    unplaced = sorted(part for part in present if part not in layer)
    found = [f"dipaco.{part} is in no layer of DIPACO_LAYERS" for part in unplaced]
    for path, line, own, other, target in dipaco_imports(sources):
        if own not in layer or other not in layer or layer[other] < layer[own]:
            continue
        where = "a layer above" if layer[other] > layer[own] else "the same layer"
        found.append(f"{path}:{line}: {own} -> {other} ({target}; {where})")
    return found


def dipaco_part_circles(sources: Iterable[tuple[str, str]]) -> list[str]:
    """The circles of imports among dipaco's parts, ``a -> b -> a``: one, then another
    once an import of the first is left out, until none is left."""
    graph: dict[str, set[str]] = {}
    for _, _, own, other, _ in dipaco_imports(sources):
        graph.setdefault(own, set()).add(other)
    found = []
    while True:
        try:
            graphlib.TopologicalSorter(graph).prepare()
        except graphlib.CycleError as error:
            circle = list(reversed(error.args[1]))  # [a, b, ..., a], each importing the next
            found.append(" -> ".join(circle))
            graph[circle[0]].discard(circle[1])
        else:
            return found


def _checkout_sources() -> list[tuple[str, str]]:
    sources = []
    for package, folder in SOURCES.items():
        for file in sorted((ROOT / folder / package).rglob("*.py")):
            sources.append((file.relative_to(ROOT).as_posix(), file.read_text("utf-8")))
    return sources


def test_no_module_imports_a_layer_above_its_own() -> None:
    sources = _checkout_sources()
    read = {".".join(module_name(path).split(".")[:2]) for path, _ in sources}
    # Every package and app is read (a wrong folder would make the check vacuous).
    packages = ("dipaco.inner", "worker_agent.agent", "dipaco_web.views", "dipaco_demo.cli")
    for expected in (*packages, *(f"dipaco_server.{app}" for app in APPS)):
        assert expected in read, expected
    parts = {".".join(module_name(path).split(".")[:3]) for path, _ in sources}
    for app, inside in PARTS.items():
        for part in inside:
            assert f"dipaco_server.{app}.{part}" in parts, f"{app}.{part}"
    found = violations(sources)
    assert not found, f"imports up the layers ({' < '.join(LAYERS)}):\n" + "\n".join(found)


def test_the_check_names_the_file_line_and_arrow_of_an_import_up_the_layers() -> None:
    bad = (
        "from __future__ import annotations\n"
        "\n"
        "from dipaco_server.errors import ServiceError\n"
        "from dipaco_server.runs.models import Run\n"
        "\n"
        "def f() -> None:\n"
        "    from dipaco_server.rounds.lifecycle.open import open_round\n"
    )
    assert violations([("platform/dipaco_server/runs/bad.py", bad)]) == [
        "platform/dipaco_server/runs/bad.py:7: runs -> rounds.lifecycle "
        "(dipaco_server.rounds.lifecycle.open)"
    ]
    # Inside rounds, each part imports only the parts below it.
    parts = [
        ("platform/dipaco_server/rounds/protocol/x.py", "from ..lifecycle import tasks\n"),
        (
            "platform/dipaco_server/rounds/verification/rules.py",
            "import dipaco_server.rounds.outer\n",
        ),
        ("platform/dipaco_server/rounds/models.py", "from .protocol.leases import x\n"),
    ]
    assert [v.split(" (")[0] for v in violations(parts)] == [
        "platform/dipaco_server/rounds/protocol/x.py:1: rounds.protocol -> rounds.lifecycle",
        "platform/dipaco_server/rounds/verification/rules.py:1: rounds.verification -> rounds.outer",
        "platform/dipaco_server/rounds/models.py:1: rounds -> rounds.protocol",
    ]
    # Relative imports, `from package import module`, and the library importing the server.
    bad_sources = [
        ("platform/dipaco_server/accounts/x.py", "from ..workers import models\n"),
        ("platform/dipaco_server/audit/__init__.py", "from dipaco_server import inference\n"),
        ("platform/dipaco_server/errors.py", "from dipaco_server.runs.errors import X\n"),
        ("worker_agent/x.py", "import dipaco_server.celery\n"),
        ("dipaco/x.py", "def f():\n    import dipaco_web.views\n"),
    ]
    assert [v.split(" (")[0] for v in violations(bad_sources)] == [
        "platform/dipaco_server/accounts/x.py:1: accounts -> workers",
        "platform/dipaco_server/audit/__init__.py:1: audit -> inference",
        "platform/dipaco_server/errors.py:1: shared -> runs",
        "worker_agent/x.py:1: library -> shared",
        "dipaco/x.py:2: library -> site",
    ]
    # Imports down the layers, within a layer, and of other packages pass.
    fine = [
        ("platform/dipaco_server/rounds/x.py", "from dipaco_server.runs import signals\n"),
        ("platform/dipaco_server/rounds/y.py", "from . import models\nimport django\n"),
        ("platform/dipaco_server/rounds/lifecycle/z.py", "from ..protocol import grant\n"),
        ("platform/dipaco_server/rounds/apps.py", "from .lifecycle import receivers\n"),
        ("platform/dipaco_server/api.py", "from dipaco_server.inference.api import router\n"),
        ("web/dipaco_web/views.py", "from dipaco_server.rounds.models import Round\n"),
    ]
    assert violations(fine) == []


def test_dipaco_parts_import_only_the_layers_below_theirs() -> None:
    sources = [(path, text) for path, text in _checkout_sources() if path.startswith("dipaco/")]
    present = {part_of(module_name(path)) for path, _ in sources}
    placed = [part for parts in DIPACO_LAYERS for part in parts]
    assert len(placed) == len(set(placed)), "a part is in two layers"
    assert set(placed) <= present, f"no such part: {sorted(set(placed) - present)}"
    circles = dipaco_part_circles(sources)
    assert not circles, "dipaco's parts import each other in circles:\n" + "\n".join(circles)
    found = dipaco_part_violations(sources)
    order = " < ".join(" | ".join(parts) for parts in DIPACO_LAYERS)
    assert not found, f"imports against dipaco's layers ({order}):\n" + "\n".join(found)


def test_the_dipaco_check_finds_circles_imports_up_and_between_siblings() -> None:
    # data <-> routing through a router and a tokenizer, as before the tokenizer moved
    # below both; the import under TYPE_CHECKING counts.
    circle = [
        ("dipaco/data/__init__.py", ""),
        ("dipaco/data/stream.py", "from dipaco.routing.router import Router\n"),
        ("dipaco/data/tokenizer.py", "import json\n"),
        ("dipaco/routing/__init__.py", ""),
        (
            "dipaco/routing/router.py",
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from ..data import tokenizer\n",
        ),
    ]
    assert dipaco_part_circles(circle) in (
        ["data -> routing -> data"],
        ["routing -> data -> routing"],
    )
    assert dipaco_part_violations(circle) == [
        "dipaco/routing/router.py:3: routing -> data (dipaco.data.tokenizer; a layer above)"
    ]
    # config <-> codecs, and siblings, a function's import, `from dipaco import x`, and a
    # part in no layer.
    bad = [
        ("dipaco/codecs/feedback.py", "def f():\n    from dipaco.config import CommConfig\n"),
        ("dipaco/config/__init__.py", "from dipaco.codecs.registry import CODECS\n"),
        ("dipaco/codecs/registry.py", ""),
        ("dipaco/model.py", "from dipaco import routing, config\n"),
        ("dipaco/routing/__init__.py", ""),
        ("dipaco/newpart.py", "import dipaco.hf\n"),
        ("dipaco/hf.py", ""),
    ]
    assert dipaco_part_circles(bad) in (
        ["codecs -> config -> codecs"],
        ["config -> codecs -> config"],
    )
    assert dipaco_part_violations(bad) == [
        "dipaco.newpart is in no layer of DIPACO_LAYERS",
        "dipaco/codecs/feedback.py:2: codecs -> config (dipaco.config; a layer above)",
        "dipaco/model.py:1: model -> routing (dipaco.routing; the same layer)",
    ]
    # Down the layers, within a part, and the package's own module importing the client.
    fine = [
        ("dipaco/__init__.py", "def load_path():\n    from dipaco.client import load_path\n"),
        ("dipaco/client.py", "from dipaco import config, retry\nfrom dipaco.inference import x\n"),
        ("dipaco/config/__init__.py", "from dipaco.config.rules import Section\n"),
        ("dipaco/config/rules.py", "from .limits import MAX_ROUNDS\n"),
        ("dipaco/data/stream.py", "from dipaco.routing.router import Router\n"),
        ("dipaco/routing/router.py", "from dipaco.tokenizer import RunTokenizer\n"),
        ("dipaco/cli/__init__.py", "import dipaco\n"),
        *((f"dipaco/{name}.py", "") for name in ("inference", "retry", "tokenizer")),
    ]
    assert dipaco_part_circles(fine) == [] and dipaco_part_violations(fine) == []
