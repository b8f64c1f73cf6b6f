"""No circle of imports among the modules of one folder.

Two modules of a folder that import each other (or a longer circle: a → b → c → a) can
only be read together, and break at import time as soon as one import moves to the top.
Every import counts, at the top of a file or inside a function; a subpackage is checked
as its own folder. Between folders, tests/test_layers.py keeps the server's order and
dipaco's (where a circle between two of its parts fails too).
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Iterable

from tests.test_layers import _checkout_sources, module_name, targets


def circles(sources: Iterable[tuple[str, str]]) -> list[str]:
    """One circle per folder that has any, as ``folder: a -> b -> a``; `sources` are
    (path relative to the checkout, text)."""
    modules = {module_name(path): (path, text) for path, text in sources}
    known = set(modules)
    graphs: dict[str, dict[str, set[str]]] = {}
    for module, (path, text) in modules.items():
        package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
        folder = module.rpartition(".")[0] if path.endswith("__init__.py") else package
        graph = graphs.setdefault(folder, {})
        graph.setdefault(module, set())
        for node in ast.walk(ast.parse(text, filename=path)):
            for target in targets(node, package, known):
                same = target.rpartition(".")[0] == folder and target != folder
                if same and target != module:
                    graph[module].add(target)
    found = []
    for folder, graph in sorted(graphs.items()):
        try:
            graphlib.TopologicalSorter(graph).prepare()
        except graphlib.CycleError as error:
            found.append(f"{folder}: {' -> '.join(reversed(error.args[1]))}")
    return found


def test_no_folder_has_a_circle_of_imports() -> None:
    sources = _checkout_sources()
    assert len(sources) > 100
    found = circles(sources)
    assert not found, "modules of one folder import each other:\n" + "\n".join(found)


def test_the_check_finds_a_circle_through_an_import_inside_a_function() -> None:
    sources = [
        ("dipaco/a.py", "from dipaco.b import x\n"),
        ("dipaco/b.py", "def f():\n    from dipaco import c\n"),
        ("dipaco/c.py", "from . import a\n"),
        ("dipaco/d.py", "import dipaco.a\n"),
    ]
    (found,) = circles(sources)
    assert found.startswith("dipaco: ") and set(found.split(": ")[1].split(" -> ")) == {
        "dipaco.a",
        "dipaco.b",
        "dipaco.c",
    }
    # Across folders, and a package's own __init__ re-exporting its modules, is no circle.
    fine = [
        ("dipaco/codecs/__init__.py", "from dipaco.codecs.api import encode\n"),
        ("dipaco/codecs/api.py", "from dipaco.config import RunConfig\n"),
        ("dipaco/config.py", "from dipaco.codecs.registry import CODECS\n"),
        ("dipaco/codecs/registry.py", "import json\n"),
    ]
    assert circles(fine) == []
