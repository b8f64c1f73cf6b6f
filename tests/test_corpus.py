"""Corpora: directories, JSON Lines and the stdlib, with bad inputs counted, not fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dipaco.data.corpus import (
    CorpusStats,
    chunk_text,
    is_validation,
    iter_blob_documents,
    iter_corpus,
    iter_text_files,
    load_corpus,
    split_documents,
    walk_files,
)


def _write_messy_directory(root: Path) -> None:
    (root / "sub").mkdir()
    (root / "good.txt").write_text("plain text\n")
    (root / "sub" / "code.py").write_text("def f():\n    return 1\n")
    (root / "binary.txt").write_bytes(b"GIF89a\x00\x01\x02 not text")
    (root / "latin1.md").write_bytes("café crème".encode("latin-1"))
    (root / "empty.rst").write_bytes(b"")
    (root / "blank.txt").write_text("  \n\n\t\n")
    (root / "huge.txt").write_text("x" * 5000)
    (root / "picture.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    records = [
        json.dumps({"text": "a record"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": "another record"}),
    ]
    (root / "records.jsonl").write_text("\n".join(records) + "\n")


def test_it_skips_and_counts_bad_files(tmp_path: Path) -> None:
    _write_messy_directory(tmp_path)
    stats = CorpusStats()
    docs = list(iter_corpus(str(tmp_path), stats, max_bytes=4096))
    assert [d.id for d in docs] == [
        "good.txt",
        "records:0",
        "records:3",
        "sub/code.py",
    ]
    assert dict(stats.skipped) == {
        "binary": 1,
        "undecodable": 1,
        "empty": 2,
        "too_large": 1,
        "bad_json": 1,
        "no_text_field": 1,
    }
    assert stats.ignored == 1  # picture.png is not text, and not an error either
    assert stats.documents == len(docs)
    assert stats.chars == sum(len(d.text) for d in docs)
    assert any("latin1.md: undecodable" in e for e in stats.skipped_examples)


def test_whole_text_files_are_read_by_the_directory_rules(tmp_path: Path) -> None:
    _write_messy_directory(tmp_path)
    (tmp_path / "sub" / "link.py").symlink_to(tmp_path / "sub" / "code.py")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("x = 1\n")
    files = walk_files(tmp_path, frozenset({".txt", ".md", ".py"}), frozenset({"tests"}))
    stats = CorpusStats()
    texts = dict(iter_text_files(tmp_path, files, stats, max_bytes=4096))
    # No symlink, nothing under an excluded folder, whole files (blank ones too).
    assert list(texts) == ["blank.txt", "good.txt", "sub/code.py"]
    assert texts["sub/code.py"] == "def f():\n    return 1\n"
    assert dict(stats.skipped) == {"binary": 1, "undecodable": 1, "too_large": 1}


def test_a_jsonl_corpus_reads_the_configured_field(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps({"content": "first"}) + "\n" + json.dumps({"content": "second"}))
    split = load_corpus(str(path), text_field="content", val_fraction=0.0)
    assert [d.text for d in split.train] == ["first", "second"]
    assert split.stats.skipped_total == 0


def test_blobs_from_any_store_decode_like_files() -> None:
    stats = CorpusStats()
    blobs = [("a/x.txt", b"hello"), ("b.jsonl", b'{"text": "rec"}\n'), ("c.txt", b"\xff")]
    docs = list(iter_blob_documents(blobs, stats))
    assert [(d.id, d.text, d.source) for d in docs] == [
        ("a/x.txt", "hello", "a/x.txt"),
        ("b.jsonl:1", "rec", "b.jsonl:1"),
    ]
    assert stats.skipped == {"undecodable": 1}


def test_chunks_are_bounded_cut_at_lines_and_lose_no_text() -> None:
    text = "".join(f"def f{i}(x):\n    return x * {i}\n\n" for i in range(200))
    chunks = chunk_text(text, 500)
    assert len(chunks) > 1
    assert all(len(c) <= 500 for c in chunks)
    assert all(c.endswith("\n\n") for c in chunks[:-1])
    assert "".join(chunks) == text


def test_a_single_huge_line_is_cut_hard() -> None:
    assert [len(c) for c in chunk_text("y" * 25, 10)] == [10, 10, 5]


def test_long_files_become_chunk_documents_sharing_their_source(tmp_path: Path) -> None:
    (tmp_path / "long.txt").write_text("line of text\n" * 100)
    split = load_corpus(str(tmp_path), max_chars=300, val_fraction=0.0)
    assert len(split.train) > 1
    assert {d.source for d in split.train} == {"long.txt"}
    assert [d.id for d in split.train] == [f"long.txt#{i}" for i in range(len(split.train))]


def test_the_stdlib_corpus_is_real_sorted_source_without_tests() -> None:
    split = load_corpus("stdlib", max_files=30, val_fraction=0.0)
    sources = [d.source for d in split.train]
    assert sources == sorted(sources)
    assert all(Path(s).suffix in {".py", ".txt", ".rst"} for s in sources)
    assert not any({"test", "tests", "site-packages"} & set(Path(s).parts) for s in sources)
    assert any("import" in d.text for d in split.train)


def test_the_split_is_deterministic_and_keeps_a_files_chunks_together() -> None:
    first = load_corpus("stdlib", max_files=60, max_chars=2000, val_fraction=0.3)
    second = load_corpus("stdlib", max_files=60, max_chars=2000, val_fraction=0.3)
    assert [d.id for d in first.train] == [d.id for d in second.train]
    assert [d.id for d in first.val] == [d.id for d in second.val]
    assert first.val, "60 files at a 0.3 fraction should give validation documents"
    assert not {d.source for d in first.train} & {d.source for d in first.val}


def test_the_validation_fraction_is_respected_on_average() -> None:
    keys = [f"file_{i}.py" for i in range(20_000)]
    fraction = sum(is_validation(k, 0.2) for k in keys) / len(keys)
    assert 0.19 < fraction < 0.21
    train, val = split_documents([], 0.5)
    assert (train, val) == ([], [])


def test_an_unknown_corpus_names_the_setting_to_fix(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"data\.corpus"):
        load_corpus(str(tmp_path / "missing"))


def test_a_corpus_of_only_bad_files_is_an_error_that_says_why(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_bytes(b"\x00\x00")
    with pytest.raises(ValueError, match="no training documents"):
        load_corpus(str(tmp_path))
