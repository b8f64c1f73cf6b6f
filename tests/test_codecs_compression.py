"""comm.compression = "zstd": lossless round trips, and every hostile frame refused with a
CodecError before it can cost memory (bombs, cut-off frames, wrong magic, lies about sizes).
The server's own upload check (rounds.outer.step.check_upload) and the worker's encoder
(worker_agent.payload) are exercised with compressed bytes too."""

from __future__ import annotations

import hashlib
import pickle
import struct
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.codecs.compression import DEFAULT_MAX_BYTES, ZSTD_MAGIC
from dipaco.config import RunConfig
from dipaco.modular import module_ids, module_spec


def module(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 48, generator=generator) * 1e-3,
        "b": torch.randn(131, generator=generator) * 1e-2,
        "empty": torch.zeros(0, 3),
    }


SPEC = codecs.spec_of(module())


def expect(code: str, action: Callable[[], object], match: str | None = None) -> CodecError:
    with pytest.raises(CodecError) as info:
        action()
    assert info.value.code == code, (info.value.code, str(info.value))
    if match is not None:
        assert match in str(info.value), str(info.value)
    return info.value


def frame_declaring(size: int) -> bytes:
    """A zstd frame header (single segment, 8-byte content size) claiming `size` bytes,
    followed by one empty raw last block: a tiny file whose frame promises `size`."""
    descriptor = 0b1110_0000  # content size field of 8 bytes, single segment
    last_empty_raw_block = (1).to_bytes(3, "little")
    return ZSTD_MAGIC + bytes([descriptor]) + struct.pack("<Q", size) + last_empty_raw_block


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_zstd_round_trips_bit_for_bit_and_readers_detect_it(codec: str, tmp_path: Path) -> None:
    values = module()
    plain = codecs.encode(values, codec, block_size=32)
    packed = codecs.encode(values, codec, block_size=32, compression="zstd")
    assert packed[:4] == ZSTD_MAGIC and plain[:4] != ZSTD_MAGIC
    header = codecs.inspect(packed, SPEC)
    assert (header.compression, header.wire_bytes, header.total_bytes) == (
        "zstd",
        len(packed),
        len(plain),
    )
    expected = codecs.decode(plain, SPEC)
    for source in (packed, bytearray(packed), memoryview(packed)):
        decoded = codecs.decode(source, SPEC)
        assert all(torch.equal(decoded[k], expected[k]) for k in expected)
    path = tmp_path / "delta.safetensors"
    assert codecs.encode_to_file(values, codec, path, block_size=32, compression="zstd") > 0
    assert path.read_bytes()[:4] == ZSTD_MAGIC
    assert codecs.inspect(path).compression == "zstd"
    from_file = codecs.decode(path, SPEC)
    assert all(torch.equal(from_file[k], expected[k]) for k in expected)
    stats = codecs.verify(packed, SPEC)
    assert stats.encoded_bytes == len(packed)
    assert stats.sq_norm == pytest.approx(codecs.verify(plain, SPEC).sq_norm)
    into = {k: torch.zeros(v.shape) for k, v in values.items()}
    codecs.accumulate(path, into, 0.5, SPEC)
    assert all(torch.equal(into[k], 0.5 * expected[k]) for k in expected)


def test_zstd_shrinks_int8_and_keeps_error_feedback_the_same() -> None:
    values = {"w": torch.randn(256, 256, generator=torch.Generator().manual_seed(1))}
    plain, kept = codecs.encode_with_feedback(values, "int8", None, block_size=512)
    packed, kept_z = codecs.encode_with_feedback(
        values, "int8", None, block_size=512, compression="zstd"
    )
    assert len(packed) < 0.97 * len(plain)  # Gaussian int8 codes: well under 8 bits each
    assert torch.equal(kept["w"], kept_z["w"])
    assert torch.equal(codecs.decode(packed)["w"], codecs.decode(plain)["w"])


def test_encode_refuses_an_unknown_compression() -> None:
    expect("bad_input", lambda: codecs.encode(module(), "int8", compression="gzip"), "zstd")


def bomb(values: int) -> bytes:
    """A real, valid fp32 container of `values` zeros, compressed: ~ values / 30000 bytes."""
    return codecs.encode({"w": torch.zeros(values)}, "fp32", compression="zstd")


def test_a_bomb_is_refused_by_the_module_spec_before_it_expands() -> None:
    data = bomb(8 << 20)  # 32 MiB of zeros in a few KiB
    assert len(data) < 64 << 10
    spec = {"w": ((1024,), torch.float32)}
    tracemalloc.start()
    try:
        expect("too_large", lambda: codecs.decode(data, spec), "8388608 values")
        expect("too_large", lambda: codecs.verify(data, max_bytes=1 << 20), "1048576")
        into = {"w": torch.zeros(8 << 20)}
        expect("too_large", lambda: codecs.accumulate(data, into, 1.0, max_bytes=1 << 20))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peaked at {peak} bytes while refusing it"


def test_a_frame_claiming_more_than_the_default_limit_is_refused_without_allocating() -> None:
    data = frame_declaring(1 << 40)
    tracemalloc.start()
    try:
        expect("too_large", lambda: codecs.inspect(data), "refusing to decompress")
        expect("too_large", lambda: codecs.decode(data), "refusing to decompress")
        expect("too_large", lambda: codecs.verify(data), "refusing to decompress")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert DEFAULT_MAX_BYTES < 1 << 40


def test_a_frame_that_lies_about_its_size_is_refused() -> None:
    packed = codecs.encode(module(), "int8", compression="zstd")
    true_size = len(codecs.encode(module(), "int8"))
    params = zstandard.get_frame_parameters(packed)
    assert params.content_size == true_size
    # the frame promises less than the container's header implies
    expect("truncated", lambda: codecs.decode(frame_declaring(100), SPEC))
    small = frame_declaring(len(codecs.encode(module(), "int8")))
    expect("truncated", lambda: codecs.decode(small, SPEC), "cut off")


@pytest.mark.parametrize("cut", [3, 4, 10, 40, 200, -30, -4, -1])
def test_cut_off_frames_are_refused(cut: int, tmp_path: Path) -> None:
    packed = codecs.encode(module(), "int8", compression="zstd")
    short = packed[:cut]
    path = tmp_path / "short.safetensors"
    path.write_bytes(short)
    into = {k: torch.zeros(v.shape) for k, v in module().items()}
    sources: list[bytes | Path] = [short, path]
    for source in sources:
        error = expect_any(
            {"truncated", "bad_compression", "bad_header"}, partial(codecs.decode, source, SPEC)
        )
        assert "cut off" in str(error) or "damaged" in str(error) or "not a dipaco" in str(error)
        expect_any(
            {"truncated", "bad_compression", "bad_header"},
            partial(codecs.accumulate, source, into, 1.0, SPEC),
        )
    assert all(not t.any() for t in into.values()), "accumulate is all-or-nothing"


def expect_any(codes: set[str], action: Callable[[], object]) -> CodecError:
    with pytest.raises(CodecError) as info:
        action()
    assert info.value.code in codes, (info.value.code, str(info.value))
    return info.value


def test_wrong_magic_trailing_bytes_and_other_frames_are_refused() -> None:
    packed = codecs.encode(module(), "int8", compression="zstd")
    flipped = bytes([packed[0] ^ 1]) + packed[1:]
    expect("bad_header", lambda: codecs.decode(flipped, SPEC))
    skippable = b"\x50\x2a\x4d\x18" + struct.pack("<I", 4) + b"abcd" + packed
    expect("bad_header", lambda: codecs.decode(skippable, SPEC))
    expect("bad_compression", lambda: codecs.decode(packed + b"\x00", SPEC), "damaged")
    expect("bad_compression", lambda: codecs.decode(packed + packed, SPEC), "damaged")
    nested = zstandard.ZstdCompressor().compress(packed)  # zstd of a zstd frame
    expect("bad_header", lambda: codecs.decode(nested, SPEC))
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    unsized = no_size.compress(codecs.encode(module(), "int8")) + no_size.flush()
    expect("bad_compression", lambda: codecs.decode(unsized, SPEC), "declare its decompressed")
    pickled = zstandard.ZstdCompressor().compress(pickle.dumps(module(), protocol=4))
    expect("not_safetensors", lambda: codecs.decode(pickled))


def test_a_corrupt_byte_inside_the_frame_is_refused() -> None:
    values = {"w": torch.randn(4096, generator=torch.Generator().manual_seed(2))}
    packed = bytearray(codecs.encode(values, "int8", compression="zstd"))
    packed[len(packed) // 2] ^= 0x55  # inside the compressed payload
    expect_any(
        {"bad_compression", "checksum_mismatch", "truncated", "bad_header", "bad_layout"},
        lambda: codecs.decode(bytes(packed)),
    )


def test_the_server_upload_check_accepts_zstd_and_refuses_bad_frames(
    settings, tmp_path: Path
) -> None:
    from dipaco_server.rounds.verification.uploads import Upload, check_upload
    from dipaco_server.storage import get_blob_store

    settings.DIPACO_BLOB_STORE = {"backend": "local", "root": tmp_path / "blobs"}
    settings.DIPACO_PUBLIC_URL = "http://testserver"
    store = get_blob_store()
    config = RunConfig.tiny(comm={"codec": "int8", "download_codec": "int8"})
    assert config.comm.compression == "zstd" and config.comm.block_size == 128
    module_id = module_ids(config)[0]
    spec = module_spec(config, module_id)
    delta = {name: 1e-3 * torch.randn(shape) for name, (shape, _) in spec.items()}
    good = codecs.encode(delta, "int8", block_size=128, compression="zstd")
    # the module's own tensor names, 50x their sizes, all zeros: a few KiB that expand to
    # 50x the module; refused from the header, against the spec, before it expands
    zeros = {name: torch.zeros(50 * torch.Size(shape).numel()) for name, (shape, _) in spec.items()}
    bomb_bytes = codecs.encode(zeros, "fp32", compression="zstd")
    assert len(bomb_bytes) < len(good)
    work = tmp_path / "work"
    work.mkdir()

    def upload(key: str, data: bytes) -> Upload:
        store.put_bytes(key, data)
        return Upload(1, 1, key, len(data), hashlib.sha256(data).hexdigest(), 100)

    path, norm = check_upload(
        store, upload("runs/1/rounds/0/u1/l1/good.safetensors", good), spec, work
    )
    assert norm > 0 and path.read_bytes() == good
    for key, data, code in [
        ("runs/1/rounds/0/u1/l1/short.safetensors", good[:-7], "truncated"),
        ("runs/1/rounds/0/u1/l1/bomb.safetensors", bomb_bytes, "too_large"),
        ("runs/1/rounds/0/u1/l1/tail.safetensors", good + b"junk", "bad_compression"),
    ]:
        with pytest.raises(CodecError) as info:
            check_upload(store, upload(key, data), spec, work)
        assert info.value.code == code, (key, info.value.code, str(info.value))


def test_the_worker_encodes_its_deltas_with_the_runs_compression(tmp_path: Path) -> None:
    from worker_agent.payload import encode_deltas, load_module

    config = RunConfig.tiny(comm={"codec": "int8"})
    module_id = module_ids(config)[0]
    spec = module_spec(config, module_id)
    delta = {name: 1e-3 * torch.randn(shape) for name, (shape, _) in spec.items()}
    encoded, _ = encode_deltas({module_id: delta}, config, tmp_path)
    data = encoded[0].path.read_bytes()
    assert data[:4] == ZSTD_MAGIC and encoded[0].size == len(data)
    assert codecs.inspect(encoded[0].path, spec).compression == "zstd"
    # a module blob that arrives as a zstd-compressed codec container is read too
    weights = {name: torch.randn(shape) for name, (shape, _) in spec.items()}
    blob = tmp_path / "module.safetensors"
    codecs.encode_to_file(weights, "fp32", blob, compression="zstd")
    loaded = load_module(blob, config, module_id)
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    plain = RunConfig.tiny(comm={"codec": "int8", "compression": "none"})
    encoded, _ = encode_deltas({module_id: delta}, plain, tmp_path / "plain")
    assert encoded[0].path.read_bytes()[:4] != ZSTD_MAGIC


PACKED = codecs.encode(module(), "int8", block_size=32, compression="zstd")


@settings(max_examples=300, deadline=None)
@given(
    cut=st.integers(0, len(PACKED)),
    flips=st.lists(st.tuples(st.integers(0, len(PACKED) - 1), st.integers(1, 255)), max_size=4),
)
def test_any_damaged_frame_is_a_codec_error_or_decodes_to_the_spec(
    cut: int, flips: list[tuple[int, int]]
) -> None:
    data = bytearray(PACKED[:cut] if cut else PACKED)
    for index, mask in flips:
        if index < len(data):
            data[index] ^= mask
    try:
        decoded = codecs.decode(bytes(data), SPEC)
    except CodecError as exc:
        assert exc.code and str(exc)
    else:  # only if the damage missed everything that matters (e.g. none at all)
        assert {k: tuple(v.shape) for k, v in decoded.items()} == {
            k: tuple(s) for k, (s, _) in SPEC.items()
        }
