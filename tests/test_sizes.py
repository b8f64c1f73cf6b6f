"""Sizes a reader can hold in mind, and source that says its reasons.

No file under the project's code is over 600 lines (migrations aside, and a file whose
docstring says why: "Over N lines: ..."), and no function is over 80 lines, so each
reads top to bottom in a sitting. The source names no issue number: a reader cannot open
the tracker, so the reason belongs in the text. Outside bench/ and tests/, an import
inside a function says why it is there (a comment on it, or on or above its group):
usually a module that takes seconds to load, or one that needs Django set up first.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("platform", "dipaco", "worker_agent", "web", "bench")
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
SAYS_WHY = re.compile(r"\bover \d[\d,]* lines\b", re.IGNORECASE)
SAYS_WHY_FOLDERS = ("platform", "web", "dipaco", "worker_agent")
ISSUE_NUMBER = re.compile(r"issue ?#?[0-9]+")  # as `grep -rnE "issue ?#?[0-9]+"` finds


def python_files() -> list[Path]:
    return sorted(
        path
        for folder in FOLDERS
        for path in (ROOT / folder).rglob("*.py")
        if "migrations" not in path.parts
    )


def oversized(files: Iterable[tuple[str, str]]) -> list[str]:
    """``path: N lines`` for each file over the limit without a docstring saying why, and
    ``path:line name: N lines`` for each function over its limit; `files` are (path, text)."""
    found = []
    for path, text in files:
        tree = ast.parse(text, filename=path)
        lines = len(text.splitlines())
        docstring = " ".join((ast.get_docstring(tree) or "").split())
        if lines > MAX_FILE_LINES and not SAYS_WHY.search(docstring):
            found.append(f"{path}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path}:{node.lineno} {node.name}: {length} lines")
    return found


def test_no_file_or_function_is_over_its_size() -> None:
    files = python_files()
    assert len(files) > 200
    sources = [(p.relative_to(ROOT).as_posix(), p.read_text("utf-8")) for p in files]
    found = oversized(sources)
    assert not found, (
        f"over {MAX_FILE_LINES} lines a file (say why in its docstring: 'Over N lines: ...') "
        f"or {MAX_FUNCTION_LINES} a function:\n" + "\n".join(found)
    )


def test_the_size_check_counts_files_and_functions() -> None:
    body = "".join(f"    x = {i}\n" for i in range(MAX_FUNCTION_LINES))
    long_function = f"def f():\n{body}"
    assert oversized([("a.py", long_function)]) == [f"a.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
    assert oversized([("a.py", long_function.replace("    x = 0\n", ""))]) == []
    long_file = "x = 0\n" * (MAX_FILE_LINES + 1)
    assert oversized([("b.py", long_file)]) == [f"b.py: {MAX_FILE_LINES + 1} lines"]
    why = '"""A script.\n\nOver 600 lines: one file a GPU machine runs."""\n'
    assert oversized([("c.py", why + long_file)]) == []


def test_no_source_names_an_issue_number() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text("utf-8")
            except UnicodeDecodeError:  # a binary file names nothing
                continue
            for number, line in enumerate(text.splitlines(), 1):
                if ISSUE_NUMBER.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "say the reason instead of the issue number:\n" + "\n".join(found)


def unexplained_imports(files: Iterable[tuple[str, str]]) -> list[str]:
    """``path:line: import`` for each import inside a function with no comment on its line
    nor above the run of import lines it starts or belongs to; `files` are (path, text)."""
    found = []
    for path, text in files:
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text, filename=path)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for statement in ast.walk(node):
                imports = isinstance(statement, ast.Import | ast.ImportFrom)
                if imports and not _commented(lines, statement):
                    found.append(f"{path}:{statement.lineno}: {ast.unparse(statement)}")
    return found


def _commented(lines: list[str], statement: ast.Import | ast.ImportFrom) -> bool:
    end = statement.end_lineno or statement.lineno
    if any("#" in line for line in lines[statement.lineno - 1 : end]):
        return True
    i = statement.lineno - 2  # up through the group of imports it belongs to
    while i >= 0:
        line = lines[i].strip()
        if "#" in line:  # above the group, or on one of its imports: the group's reason
            return True
        if not line.startswith(("import ", "from ", ")")) and line and not line.endswith(","):
            return False
        i -= 1
    return False


def test_every_import_inside_a_server_function_says_why() -> None:
    files = [
        path
        for folder in SAYS_WHY_FOLDERS
        for path in sorted((ROOT / folder).rglob("*.py"))
        if "migrations" not in path.parts
    ]
    sources = [(p.relative_to(ROOT).as_posix(), p.read_text("utf-8")) for p in files]
    found = unexplained_imports(sources)
    assert not found, "say why each import is inside its function:\n" + "\n".join(found)


def test_the_import_check_takes_a_comment_on_the_line_or_above_the_group() -> None:
    text = (
        "def f():\n"
        "    # Django: set up by then\n"
        "    from django.db import connection\n"
        "    from django.db.models import Q\n"
        "\n"
        "    x = 1\n"
        "    import json  # only here, and so is the next\n"
        "    import torch\n"
        "    x = 2\n"
        "    import numpy\n"
    )
    assert unexplained_imports([("a.py", text)]) == ["a.py:10: import numpy"]
