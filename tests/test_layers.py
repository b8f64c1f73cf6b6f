"""The server's apps in one dependency order, checked so no import points back up.

As healthchecks and readthedocs keep theirs: each layer may import those below it and
never one above, at the top of a file or inside a function alike. From the bottom:

- library: ``dipaco`` and ``worker_agent``, which import nothing of the server;
- shared: what every app builds on and which names no app: the ``dipaco_server``
  package's own modules (``errors`` with ``ServiceError``, ``bounds``, ``patterns``,
  ``celery``, ``settings``...), ``storage``, ``core`` (tokens, the retry policy of tasks,
  the read-only admin) and ``cli.server`` (the stdlib-only launcher whose request-line
  limit ``errors`` documents);
- the apps: accounts, audit, workers, runs, rounds, inference; each app's ``api.py`` is
  part of its app. runs asks rounds to open a round or end a run's leases through
  runs.signals, never by importing it;
- entry: what assembles them (``dipaco_server.api``, ``asgi``, ``wsgi``, the ``cli`` but
  its launcher);
- site: the dashboard (``dipaco_web``), the demo (``dipaco_demo``) and the URL map that
  mounts the dashboard beside the API (``dipaco_server.urls``).

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
    "inference",
    "entry",
    "site",
)
APPS = ("accounts", "audit", "workers", "runs", "rounds", "inference")
ENTRY = ("api", "asgi", "wsgi", "cli")
# Placed by name before their package: the launcher is stdlib-only, the URL map mounts the site.
PLACED = {"dipaco_server.cli.server": "shared", "dipaco_server.urls": "site"}
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
    for name, layer in PLACED.items():
        if module == name or module.startswith(name + "."):
            return layer
    if len(parts) > 1 and parts[1] in APPS:
        return parts[1]
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
        "    from dipaco_server.rounds.open import open_round\n"
    )
    assert violations([("platform/dipaco_server/runs/bad.py", bad)]) == [
        "platform/dipaco_server/runs/bad.py:7: runs -> rounds (dipaco_server.rounds.open)"
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
        ("platform/dipaco_server/api.py", "from dipaco_server.inference.api import router\n"),
        ("web/dipaco_web/views.py", "from dipaco_server.rounds.models import Round\n"),
    ]
    assert violations(fine) == []
