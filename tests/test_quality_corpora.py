"""bench/quality.py on several corpora: one run per corpus, its figures under "corpora"."""

from __future__ import annotations

import ast
import json
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

from tests.bench_modules import bench_module

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
         "intermediate_size": 64, "vocab_size": 384, "seq_len": 32}  # fmt: skip


def quality_module() -> ModuleType:
    """bench/quality.py as `quality` (tests.bench_modules): the jobs' spawned processes
    find run_job by the same name."""
    return bench_module("quality")


def prose_corpus(path: Path) -> Path:
    """A .jsonl of the standard library's module docstrings: prose, not code."""
    records = []
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        doc = ast.get_docstring(ast.parse(file.read_text("utf-8", errors="replace")))
        if doc and len(doc) > 400:
            records.append(json.dumps({"text": doc, "source": f"doc/{file.stem}"}))
    path.write_text("\n".join(records[:60]) + "\n")
    return path


def test_corpus_flags_name_each_corpus_and_refuse_two_alike() -> None:
    quality = quality_module()

    args = quality.parse_args(["--corpus", "code=stdlib", "--corpus", "/tmp/docs.jsonl.gz"])
    assert quality.corpus_names(args.corpora) == [
        ("code", "stdlib"),
        ("docs", "/tmp/docs.jsonl.gz"),
    ]
    assert quality.parse_args([]).corpora == [(None, "stdlib")]  # one run, today's layout
    assert quality.corpus_list(["/data/a=b.jsonl"]) == [(None, "/data/a=b.jsonl")]  # a path
    with pytest.raises(SystemExit):
        quality.parse_args(["--corpus", "x=stdlib", "--corpus", "x=/tmp/y.jsonl"])


def test_a_run_on_two_corpora_writes_each_corpus_figures_under_its_name(tmp_path: Path) -> None:
    quality = quality_module()
    out = tmp_path / "quality.json"
    argv = [
        "--corpus", "code=stdlib", "--corpus", f"prose={prose_corpus(tmp_path / 'prose.jsonl')}",
        "--model", json.dumps(SMALL), "--only", "b/dipaco-fp32,b/dense-steps",
        "--rounds", "2", "--inner-steps", "3", "--batch", "2", "--warmup-steps", "1",
        "--base-steps", "3", "--max-docs", "60", "--eval-windows", "8", "--eval-every", "2",
        "--reroute-every", "8", "--no-domains", "--jobs", "1",
        "--work-dir", str(tmp_path / "work"), "--json", str(out),
    ]  # fmt: skip
    assert quality.main(argv) == 0
    data = json.loads(out.read_text())

    assert data["complete"] is True and data["preset"] == "tiny"
    assert list(data["corpora"]) == ["code", "prose"]
    for name, corpus in data["corpora"].items():
        assert corpus["complete"] is True
        assert corpus["corpus"] == dict(code="stdlib", prose=str(tmp_path / "prose.jsonl"))[name]
        assert corpus["dipaco_vs_dense_equal_steps"] == pytest.approx(
            corpus["jobs"]["b/dipaco-fp32"]["perplexity"]
            / corpus["jobs"]["b/dense-steps"]["perplexity"]
        )
        assert corpus["capacity_ratio"] == pytest.approx(
            corpus["dipaco_params"] / corpus["path_params"]
        )
        assert set(corpus["specialisation"]["b/dipaco-fp32"]) >= {
            "oracle_vs_routed",
            "router_agreement",
        }
        assert (tmp_path / "work" / name).is_dir()  # each corpus its own data and base
    code, prose = data["corpora"]["code"], data["corpora"]["prose"]
    assert code["jobs"]["b/dipaco-fp32"]["loss"] != prose["jobs"]["b/dipaco-fp32"]["loss"]


def _merge_module() -> ModuleType:
    return bench_module("quality_merge")


def test_runs_of_one_corpus_each_merge_into_one_figure_and_refuse_a_corpus_twice(
    tmp_path: Path,
) -> None:
    merge = _merge_module()
    named = {"corpora": {"stdlib": {"dipaco_vs_diloco_equal_tokens": 0.9}}, "complete": True,
             "preset": "modular", "command": "python bench/quality.py --corpus stdlib=stdlib"}  # fmt: skip
    unnamed = {"corpus": "/tmp/docs.jsonl", "dipaco_vs_diloco_equal_tokens": 1.02,
               "complete": False, "args": {"preset": "modular"}, "command": "python q"}  # fmt: skip
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    a.write_text(json.dumps(named))
    b.write_text(json.dumps(unnamed))
    assert merge.main([str(a), str(b), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert list(merged["corpora"]) == ["stdlib", "docs"]
    assert merged["corpora"]["docs"]["dipaco_vs_diloco_equal_tokens"] == 1.02
    assert merged["complete"] is False  # one input was cut short
    assert merged["preset"] == "modular"
    assert [r["command"] for r in merged["runs"]] == [named["command"], "python q"]
    with pytest.raises(SystemExit, match="corpus 'stdlib' is in an earlier input"):
        merge.main([str(a), str(a), "--json", str(out)])
    b.write_text(json.dumps({**unnamed, "args": {"preset": "tiny"}}))
    with pytest.raises(SystemExit, match="different presets"):
        merge.main([str(a), str(b), "--json", str(out)])
