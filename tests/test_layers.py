"""The server's apps in one dependency order, checked so no import points back up.

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
"""

from __future__ import annotations

import ast
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
