"""bench/corpus_docs.py: a prose corpus from manual pages, package documentation and METADATA."""

from __future__ import annotations

import gzip
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROSE = "The quick brown fox reads the manual before it jumps over the lazy dog. " * 4


def corpus_docs() -> ModuleType:
    spec = importlib.util.spec_from_file_location("corpus_docs", ROOT / "bench" / "corpus_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("corpus_docs", module)
    spec.loader.exec_module(module)
    return module


def gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode()))


@pytest.fixture()
def roots(tmp_path: Path) -> dict[str, Path]:
    man, doc, site = tmp_path / "man", tmp_path / "doc", tmp_path / "site"
    page = (
        '.\\" a comment that is not text\n.TH GREP 1\n.SH NAME\ngrep \\- print lines that '
        "match\n.SH DESCRIPTION\n.B grep\nsearches \\fIfiles\\fR for \\(lqpatterns\\(rq.\n"
        f'.PP\n{PROSE}\n.TP 7\n.BR \\-e " PATTERN"\nUse PATTERN.\n'
    )
    gz(man / "man1" / "grep.1.gz", page)
    gz(man / "man1" / "egrep.1.gz", ".so man1/grep.1\n")  # a pointer, not a page
    gz(man / "de" / "man1" / "grep.1.gz", page.replace("print", "druckt"))  # a translation
    for i in range(3):
        gz(man / "man3" / f"tool_sub{i}.3.gz", f".SH NAME\ntool {i}\n.PP\n{PROSE}{i}\n")
    gz(doc / "zlib" / "README.gz", f"zlib\n\n{PROSE}")
    (doc / "zlib" / "copyright").write_text(f"Copyright: everyone\n{PROSE}")
    gz(doc / "zlib" / "changelog.Debian.gz", f"zlib (1.0) unstable\n{PROSE}")
    (doc / "web").mkdir()
    (doc / "web" / "guide.html").write_text(
        f"<html><head><style>p {{color: red}}</style><script>var x = 1;</script></head>"
        f"<body><h1>Guide</h1><p>{PROSE}</p><p>a &amp; b</p></body></html>"
    )
    (doc / "web" / "logo.png").write_bytes(b"\x89PNG\0\0")
    (doc / "web" / "README.md").write_text(f"zlib\n\n{PROSE}")  # the same text as zlib's README
    meta = site / "widget-1.0.dist-info" / "METADATA"
    meta.parent.mkdir(parents=True)
    meta.write_text(f"Metadata-Version: 2.1\nName: widget\nVersion: 1.0\n\n# Widget\n\n{PROSE}")
    return {"man": man, "doc": doc, "site": site}


def run(roots: dict[str, Path], out: Path, *extra: str) -> list[dict[str, str]]:
    argv = ["--out", str(out), "--man-root", str(roots["man"]), "--doc-root", str(roots["doc"]),
            "--site", str(roots["site"]), "--min-chars", "100", *extra]  # fmt: skip
    assert corpus_docs().main(argv) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_it_keeps_the_prose_of_each_kind_and_leaves_out_boilerplate(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    records = run(roots, tmp_path / "docs.jsonl")
    by_source = {r["source"]: r["text"] for r in records}

    assert "man/man1/grep.1.gz" in by_source
    assert "doc/web/guide.html" in by_source
    assert "metadata/widget-1.0.dist-info" in by_source
    assert {"doc/zlib/README.gz", "doc/web/README.md"} & set(by_source)  # one of the twins
    assert not {"doc/zlib/README.gz", "doc/web/README.md"} <= set(by_source)
    left_out = ("egrep", "/de/", "copyright", "changelog", "logo.png")
    assert not [s for s in by_source if any(word in s for word in left_out)]
    grep = by_source["man/man1/grep.1.gz"]
    assert "grep - print lines that match" in grep
    assert 'searches files for "patterns".' in grep
    assert "-e PATTERN" in grep and "Use PATTERN." in grep
    assert "\\f" not in grep and ".TH" not in grep and "comment" not in grep and "7" not in grep
    guide = by_source["doc/web/guide.html"]
    assert guide.startswith("Guide") and "a & b" in guide
    assert "<p>" not in guide and "color" not in guide and "var x" not in guide
    assert by_source["metadata/widget-1.0.dist-info"].startswith("# Widget")


def test_the_same_files_give_the_same_bytes_and_a_cap_samples_in_hash_order(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    whole = run(roots, tmp_path / "a.jsonl")
    assert run(roots, tmp_path / "b.jsonl") == whole
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()

    chars = len(whole[0]["text"]) + len(whole[1]["text"])
    capped = run(roots, tmp_path / "c.jsonl", "--max-chars", str(chars))
    assert capped == whole[:2]


def test_it_reads_only_the_kinds_asked_for_and_caps_a_family(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    man = run(roots, tmp_path / "man.jsonl", "--sources", "man", "--max-per-family", "2")
    sources = [r["source"] for r in man]

    assert all(s.startswith("man/") for s in sources)
    assert "man/man1/grep.1.gz" in sources
    assert sum(s.startswith("man/man3/tool_") for s in sources) == 2  # of 3
    gzipped = tmp_path / "docs.jsonl.gz"
    run(roots, tmp_path / "plain.jsonl")
    assert corpus_docs().main(["--out", str(gzipped), "--man-root", str(roots["man"]),
                               "--doc-root", str(roots["doc"]), "--site", str(roots["site"]),
                               "--min-chars", "100"]) == 0  # fmt: skip
    assert gzip.decompress(gzipped.read_bytes()) == (tmp_path / "plain.jsonl").read_bytes()


def test_it_refuses_an_unknown_kind_and_says_which_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        corpus_docs().main(["--out", str(tmp_path / "x.jsonl"), "--sources", "man,wiki"])
    assert "man, doc, metadata" in capsys.readouterr().err


def test_it_fails_when_nothing_is_kept(tmp_path: Path) -> None:
    empty = tmp_path / "nothing"
    argv = ["--out", str(tmp_path / "x.jsonl"), "--man-root", str(empty), "--doc-root",
            str(empty), "--site", str(empty)]  # fmt: skip
    assert corpus_docs().main(argv) == 1


def test_code_mixes_a_trees_python_sources_with_the_prose(
    roots: dict[str, Path], tmp_path: Path
) -> None:
    code = tmp_path / "code" / "pkg"
    code.mkdir(parents=True)
    (code / "tool.py").write_text(f'"""{PROSE}"""\n\ndef tool() -> int:\n    return 1\n')
    (code / "notes.txt").write_text(PROSE + "not python")

    mixed = {
        r["source"] for r in run(roots, tmp_path / "m.jsonl", "--code", str(tmp_path / "code"))
    }
    assert "code/pkg/tool.py" in mixed and "man/man1/grep.1.gz" in mixed
    assert not [s for s in mixed if s.endswith("notes.txt")]
