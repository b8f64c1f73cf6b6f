"""Corpora as users have them: Parquet, JSON Lines (.gz, .zst), a saved `datasets`
directory and an S3 prefix, read by one streaming preparation (dipaco.data.stream)."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
import zstandard

from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.corpus import CorpusStats, corpus_listing, iter_corpus
from dipaco.data.sources import S3Options
from dipaco.data.stream import (
    ReadOptions,
    RouterSample,
    TokenizerSample,
    prepare_listing,
    scan_corpus,
)
from dipaco.tokenizer import sample_texts
from tests.conftest import S3Server

MODEL = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "vocab_size": 300,
    "seq_len": 16,
}
WORDS = [
    "the",
    "a",
    "model",
    "path",
    "module",
    "router",
    "token",
    "shard",
    "corpus",
    "parquet",
    "arrow",
    "stream",
    "piece",
    "gradient",
    "outer",
    "inner",
    "step",
    "round",
    "worker",
    "server",
    "data",
    "text",
    "record",
    "file",
    "row",
    "byte",
]


def records(files: int = 3, rows: int = 40, seed: int = 0, words: int = 60) -> list[list[str]]:
    """Real-ish text: sentences of a small vocabulary, one topic word per file."""
    rng = random.Random(seed)
    return [
        [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, words))) + f" file{f}"
            for _ in range(rows)
        ]
        for f in range(files)
    ]


def name(f: int, files: int) -> str:
    return f"data-{f:05d}-of-{files:05d}"  # the names datasets.save_to_disk gives


def write_parquet(root: Path, data: list[list[str]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for f, rows in enumerate(data):
        table = pa.table({"id": list(range(len(rows))), "text": rows})
        pq.write_table(table, root / f"{name(f, len(data))}.parquet", row_group_size=16)


def jsonl_bytes(rows: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "n": i}) + "\n" for i, t in enumerate(rows)).encode()


def write_jsonl(root: Path, data: list[list[str]], suffix: str) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for f, rows in enumerate(data):
        raw = jsonl_bytes(rows)
        body = gzip.compress(raw) if suffix == ".gz" else zstandard.compress(raw)
        (root / f"{name(f, len(data))}.jsonl{suffix}").write_bytes(body)


def write_saved_dataset(root: Path, data: list[list[str]]) -> None:
    """The layout `datasets.Dataset.save_to_disk` writes: Arrow IPC streams listed in
    state.json's _data_files, with dataset_info.json beside them."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for f, rows in enumerate(data):
        file = f"{name(f, len(data))}.arrow"
        table = pa.table({"text": rows, "id": list(range(len(rows)))})
        with pa.OSFile(str(root / file), "wb") as sink, ipc.new_stream(sink, table.schema) as w:
            for batch in table.to_batches(max_chunksize=16):
                w.write_batch(batch)
        files.append({"filename": file})
    state = {"_data_files": files, "_fingerprint": "0", "_format_type": None, "_split": None}
    (root / "state.json").write_text(json.dumps(state))
    (root / "dataset_info.json").write_text(json.dumps({"features": {"text": {}}}))


def config() -> RunConfig:
    return RunConfig.tiny(
        model=MODEL,
        layout=LayoutConfig.grid(2, levels=1, modules=2),
        data={"val_fraction": 0.2},
    )


def shards(source: str, out: Path, s3: S3Options | None = None, **kwargs: Any) -> dict[str, Any]:
    listing = corpus_listing(source, s3=s3)
    index, _ = prepare_listing(config(), listing, out, tokenizer_chars=20_000, **kwargs)
    return {f"{p}/{s}": (e[s].tokens, e[s].sha256) for p, e in enumerate(index.paths) for s in e}


def test_every_format_with_the_same_records_prepares_identical_shards(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    data = records()
    write_parquet(tmp_path / "parquet", data)
    write_jsonl(tmp_path / "zst", data, ".zst")
    write_jsonl(tmp_path / "gz", data, ".gz")
    write_saved_dataset(tmp_path / "saved", data)
    client = s3_server.client()
    for file in sorted((tmp_path / "parquet").iterdir()):
        client.put_object(Bucket=s3_bucket, Key=f"corpus/en/{file.name}", Body=file.read_bytes())
    s3 = S3Options(s3_server.endpoint_url, s3_server.access_key_id, s3_server.secret_access_key)

    expected = shards(str(tmp_path / "parquet"), tmp_path / "out-parquet")
    assert sum(tokens for tokens, _ in expected.values()) > 1000
    assert all(tokens > 1 for tokens, _ in expected.values())  # both paths, both splits
    for fmt in ("zst", "gz", "saved"):
        assert shards(str(tmp_path / fmt), tmp_path / f"out-{fmt}") == expected, fmt
    assert shards(f"s3://{s3_bucket}/corpus/en", tmp_path / "out-s3", s3) == expected
    glob = shards(f"{tmp_path}/parquet/*.parquet", tmp_path / "out-glob")
    assert glob == expected


def test_a_record_is_named_by_its_file_without_suffixes_and_its_row(tmp_path: Path) -> None:
    data = records(files=2, rows=3)
    write_jsonl(tmp_path / "zst", data, ".zst")
    write_parquet(tmp_path / "parquet", data)
    for fmt in ("zst", "parquet"):
        docs = list(iter_corpus(str(tmp_path / fmt), CorpusStats()))
        assert [d.source for d in docs] == [
            f"{name(f, 2)}:{row}" for f in range(2) for row in range(3)
        ]


def test_a_malformed_parquet_and_a_truncated_zst_are_skipped_and_named(tmp_path: Path) -> None:
    data = records(files=3, rows=200)
    write_parquet(tmp_path / "c", data)
    write_jsonl(tmp_path / "c", data[:1], ".zst")
    good = (tmp_path / "c" / f"{name(0, 1)}.jsonl.zst").read_bytes()
    (tmp_path / "c" / "cut.jsonl.zst").write_bytes(good[: len(good) // 2])
    (tmp_path / "c" / "broken.parquet").write_bytes(b"PAR1 not really a parquet file PAR1")
    listing = corpus_listing(str(tmp_path / "c"))
    scan = scan_corpus(listing, ReadOptions(val_fraction=0.2), tokenizer_chars=5000)
    bad = scan.stats.bad_files
    assert any(b.startswith("broken.parquet: ") for b in bad), bad
    assert any(b.startswith("cut.jsonl.zst: ") for b in bad), bad
    assert len(bad) == 2
    readable = [listing.files[scan.spans[i].file].rel for i in scan.pieces]
    assert "cut.jsonl.zst" not in readable and "broken.parquet" not in readable
    assert len(readable) == 4  # three Parquet files and the whole .zst
    assert scan.stats.skipped["unreadable_file"] == 2


def test_a_corpus_without_the_text_column_fails_naming_the_columns_found(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    pq.write_table(pa.table({"content": ["a b c"], "url": ["x"]}), tmp_path / "c" / "a.parquet")
    with pytest.raises(ValueError, match=r"'text'.*columns found: content, url"):
        list(iter_corpus(str(tmp_path / "c"), CorpusStats()))


def test_the_streaming_tokenizer_sample_is_the_sorted_one() -> None:
    from dipaco.data.corpus import Document

    rng = random.Random(1)
    docs = [Document(f"d{i}", "x" * rng.randint(1, 3000), f"d{i}") for i in range(500)]
    stream = TokenizerSample(40_000)
    for doc in docs:
        stream.add(doc.id, doc.text)
    assert stream.texts() == sample_texts(docs, 40_000)
    halves = TokenizerSample(40_000), TokenizerSample(40_000)
    for i, doc in enumerate(docs):
        halves[i % 2].add(doc.id, doc.text)
    halves[0].merge(halves[1])
    assert halves[0].texts() == sample_texts(docs, 40_000)


def test_the_router_sample_is_seeded_and_bounded() -> None:
    samples = [RouterSample(10, seed, 8) for seed in (0, 0, 1)]
    for sample in samples:
        for i in range(100):
            sample.add(f"d{i}", f"{i:03d} text and more")
    assert samples[0].texts() == samples[1].texts() != samples[2].texts()
    assert len(samples[0].texts()) == 10 and all(len(t) == 8 for t in samples[0].texts())


def test_a_token_budget_keeps_a_seeded_share_of_the_records(tmp_path: Path) -> None:
    write_parquet(tmp_path / "c", records(files=2, rows=200))
    full = shards(str(tmp_path / "c"), tmp_path / "full")
    half = shards(str(tmp_path / "c"), tmp_path / "half", token_budget=6000)
    train = sum(full[f"{p}/train"][0] for p in range(2))
    kept = sum(half[f"{p}/train"][0] for p in range(2))
    assert kept < 0.5 * train
    assert abs(kept - 6000) < 0.3 * 6000


def test_a_large_file_is_cut_into_pieces_with_the_shards_of_the_whole_file(
    tmp_path: Path, s3_server: S3Server, s3_bucket: str
) -> None:
    data = records(files=2, rows=120)
    write_parquet(tmp_path / "parquet", data)  # row groups of 16 rows
    (tmp_path / "jsonl").mkdir()
    client = s3_server.client()
    for f, rows in enumerate(data):
        file = f"{name(f, len(data))}.jsonl"
        (tmp_path / "jsonl" / file).write_bytes(jsonl_bytes(rows))
        client.put_object(Bucket=s3_bucket, Key=f"ranges/{file}", Body=jsonl_bytes(rows))
    s3 = S3Options(s3_server.endpoint_url, s3_server.access_key_id, s3_server.secret_access_key)
    expected = shards(str(tmp_path / "parquet"), tmp_path / "out-whole")
    cases = {
        "parquet": (str(tmp_path / "parquet"), "groups"),
        "jsonl": (str(tmp_path / "jsonl"), "offset"),
        "s3": (f"s3://{s3_bucket}/ranges", "offset"),  # range reads of the object
    }
    for case, (source, ranged) in cases.items():
        listing = corpus_listing(source, s3=s3)
        index, scan = prepare_listing(
            config(), listing, tmp_path / f"out-{case}", tokenizer_chars=20_000, piece_bytes=3000
        )
        assert len(scan.spans) > 2 * len(listing.files), case
        assert {span.file for span in scan.spans} == {0, 1}
        assert all(getattr(span, ranged) is not None for span in scan.spans), case
        starts = [span.start for span in scan.spans if span.file == 1]
        assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(starts)
        cut = {f"{p}/{s}": (e[s].tokens, e[s].sha256) for p, e in enumerate(index.paths) for s in e}
        assert cut == expected, case
