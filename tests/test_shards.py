"""Token shards: atomic writes, windows by offset at every edge, and the full build."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dipaco.data.corpus import load_corpus
from dipaco.data.shards import (
    ShardIndex,
    ShardInfo,
    ShardWriter,
    TokenShard,
    build_shards,
    token_dtype,
    window_byte_range,
)
from dipaco.routing.router import Router
from dipaco.tokenizer import train_tokenizer

SEP = 0
DOCS = [[11, 12, 13], [21, 22], [31, 32, 33, 34]]
# The file: every document opened by the separator.
FLAT = [0, 11, 12, 13, 0, 21, 22, 0, 31, 32, 33, 34]


@pytest.fixture
def shard(tmp_path: Path) -> TokenShard:
    writer = ShardWriter(tmp_path / "0" / "train.bin", token_dtype(100), SEP)
    for doc in DOCS:
        writer.add_document(doc)
    info = writer.close(tmp_path)
    assert (info.file, info.tokens, info.docs) == ("0/train.bin", len(FLAT), 3)
    return TokenShard(tmp_path / info.file, "<u2")


def test_the_dtype_is_uint16_while_every_id_fits_and_uint32_after() -> None:
    assert token_dtype(50_257) == np.dtype("<u2")
    assert token_dtype(65_536) == np.dtype("<u2")  # ids 0..65535
    assert token_dtype(65_537) == np.dtype("<u4")


def test_a_uint32_shard_round_trips_large_ids(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "big.bin", token_dtype(200_000), SEP)
    writer.add_document([70_000, 199_999])
    writer.close(tmp_path)
    assert (tmp_path / "big.bin").stat().st_size == 3 * 4
    assert TokenShard(tmp_path / "big.bin", "<u4").read_window(0, 3).tolist() == [
        0,
        70_000,
        199_999,
    ]


def test_the_writer_refuses_ids_its_dtype_cannot_hold(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "x.bin", token_dtype(1000), SEP)
    with pytest.raises(ValueError, match="out of range for uint16"):
        writer.add_document([70_000])


def test_the_file_appears_only_when_the_writer_closes(tmp_path: Path) -> None:
    writer = ShardWriter(tmp_path / "x.bin", token_dtype(100), SEP, flush_tokens=2)
    writer.add_document([1, 2, 3])  # flushed to the temporary file already
    assert not (tmp_path / "x.bin").exists()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_windows_read_the_start_the_end_and_across_documents(shard: TokenShard) -> None:
    assert len(shard) == len(FLAT)
    assert shard.read_window(0, 4).tolist() == FLAT[:4]
    assert shard.read_window(8, 4).tolist() == FLAT[8:]  # exactly up to the end
    assert shard.read_window(2, 5).tolist() == [12, 13, 0, 21, 22]  # across a boundary
    assert shard.read_window(3, 0).tolist() == []
    assert shard.read_window(0, 1).dtype == np.int64


def test_windows_wrap_past_the_end_to_the_start(shard: TokenShard) -> None:
    assert shard.read_window(10, 4).tolist() == [33, 34, 0, 11]
    assert shard.read_window(11, 2 * len(FLAT)).tolist() == [34, *FLAT, *FLAT][: 2 * len(FLAT)]


def test_an_offset_beyond_the_end_is_a_clear_error(shard: TokenShard) -> None:
    with pytest.raises(IndexError, match=r"offset 12 is outside .*\(12 tokens\)"):
        shard.read_window(12, 1)
    with pytest.raises(IndexError, match="outside"):
        shard.read_window(-1, 1)
    with pytest.raises(ValueError, match="length must be >= 0"):
        shard.read_window(0, -1)


def test_batches_hold_overlapping_rows_and_wrap_deterministically(shard: TokenShard) -> None:
    batch = shard.batch(position=5, batch_size=3, seq_len=4)
    assert batch.dtype == torch.int64 and tuple(batch.shape) == (3, 5)
    expected = [[FLAT[(5 + r * 4 + t) % 12] for t in range(5)] for r in range(3)]
    assert batch.tolist() == expected
    assert batch[0, -1] == batch[1, 0]  # the last target of a row starts the next
    assert torch.equal(shard.batch(5 + 10 * 12, 3, 4), batch)  # positions wrap modulo length


def test_an_empty_shard_says_how_to_get_tokens(tmp_path: Path) -> None:
    ShardWriter(tmp_path / "v.bin", token_dtype(100), SEP).close(tmp_path)
    with pytest.raises(ValueError, match="holds no tokens"):
        TokenShard(tmp_path / "v.bin", "<u2").batch(0, 1, 4)


def test_a_truncated_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(b"\x01\x00\x02")
    with pytest.raises(ValueError, match="truncated"):
        TokenShard(tmp_path / "t.bin", "<u2")


def test_window_byte_ranges_match_the_file(shard: TokenShard) -> None:
    start, end = window_byte_range(2, 5, "<u2")
    data = np.frombuffer(shard.path.read_bytes()[start:end], dtype="<u2")
    assert data.tolist() == shard.read_window(2, 5).tolist()


def test_build_shards_puts_each_document_on_the_path_it_routes_to(tmp_path: Path) -> None:
    split = load_corpus("stdlib", max_files=30, max_chars=3000, val_fraction=0.2)
    tokenizer = train_tokenizer(split.train, vocab_size=400, max_chars=200_000)
    texts = [d.text for d in split.train]
    router = Router.fit(texts, tokenizer, factors=(2, 2), method="product-kmeans")
    index = build_shards(split.train, split.val, tokenizer, router, tmp_path, progress=False)

    loaded = ShardIndex.load(tmp_path)
    assert loaded == index
    loaded.verify(tmp_path)
    assert json.loads((tmp_path / "index.json").read_text())["dtype"] == "<u2"
    assert sum(index.info(p, "train").docs for p in range(4)) == len(split.train)
    assert sum(index.info(p, "val").docs for p in range(4)) == len(split.val)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.bin")) == [
        f"{p}/{s}.bin" for p in range(4) for s in ("train", "val")
    ]
    # Rebuild each path's documents from its file and compare with the router.
    routed: dict[int, list[list[int]]] = {p: [] for p in range(4)}
    for doc in split.train:
        routed[router.route(doc.text)].append(tokenizer.encode(doc.text))
    for p in range(4):
        shard = loaded.open(tmp_path, p, "train")
        flat = shard.read_window(0, len(shard)).tolist()
        expected = [t for ids in routed[p] for t in [tokenizer.separator_id, *ids]]
        assert flat == expected
        assert index.info(p, "train").tokens == len(expected)


def test_the_unrouted_copy_is_what_a_build_without_a_router_writes(tmp_path: Path) -> None:
    split = load_corpus("stdlib", max_files=30, max_chars=3000, val_fraction=0.2)
    tokenizer = train_tokenizer(split.train, vocab_size=400, max_chars=200_000)
    router = Router.fit([d.text for d in split.train], tokenizer, factors=(2, 2))
    routed = build_shards(split.train, split.val, tokenizer, router, tmp_path / "paths",
                          progress=False, unrouted_dir=tmp_path / "all")  # fmt: skip
    alone = build_shards(split.train, split.val, tokenizer, None, tmp_path / "alone",
                         progress=False)  # fmt: skip

    assert ShardIndex.load(tmp_path / "all") == alone  # the same bytes, by sha256 and count
    ShardIndex.load(tmp_path / "all").verify(tmp_path / "all")
    assert routed == ShardIndex.load(tmp_path / "paths") and routed.num_paths == 4
    for split_name in ("train", "val"):
        assert alone.info(0, split_name).tokens == sum(
            routed.info(p, split_name).tokens for p in range(4)
        )


def test_without_a_router_everything_goes_to_one_path(tmp_path: Path) -> None:
    split = load_corpus("stdlib", max_files=5, val_fraction=0.0)
    tokenizer = train_tokenizer(split.train, vocab_size=300, max_chars=50_000)
    index = build_shards(split.train, [], tokenizer, None, tmp_path, progress=False)
    assert index.num_paths == 1
    assert index.info(0, "train").docs == len(split.train)
    assert index.info(0, "val").tokens == 0
    with pytest.raises(ValueError, match="num_paths=2"):
        build_shards(split.train, [], tokenizer, None, tmp_path / "x", num_paths=2)


def test_the_index_catches_a_corrupted_file(tmp_path: Path, shard: TokenShard) -> None:
    index = ShardIndex(
        dtype="<u2",
        vocab_size=100,
        separator_id=SEP,
        num_paths=1,
        tokenizer_fingerprint="x",
        paths=[],
    )
    writer = ShardWriter(tmp_path / "1" / "val.bin", token_dtype(100), SEP)
    writer.add_document([5])
    index.paths = [{"train": _info_of(shard, tmp_path), "val": writer.close(tmp_path)}]
    index.verify(tmp_path)
    data = bytearray(shard.path.read_bytes())
    data[2] ^= 0xFF
    shard.path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its sha256"):
        index.verify(tmp_path)


def _info_of(shard: TokenShard, root: Path) -> ShardInfo:
    return ShardInfo(
        file=shard.path.relative_to(root).as_posix(),
        tokens=len(shard),
        docs=3,
        sha256=hashlib.sha256(shard.path.read_bytes()).hexdigest(),
    )
