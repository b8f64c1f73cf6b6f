"""Pseudo-gradient codecs: error bounds, the container format, and every malformed input.

Over 500 lines because every malformed-input case lives beside the helpers that craft it
(split/join/reseal/poke); round trips and accumulate come first, hostile files after.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import pickle
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dipaco import codecs
from dipaco.codecs import CodecError

FP32_TINY = 2.0**-149  # smallest fp32 subnormal


def module(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small module-shaped Δ: a matrix, an odd-sized vector, a scalar and an empty tensor."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "layers.0.mlp.up.weight": torch.randn(48, 40, generator=generator) * 1e-3,
        "layers.0.norm.weight": torch.randn(131, generator=generator) * 1e-2,
        "scale": torch.randn((), generator=generator),
        "empty": torch.zeros(0, 7),
    }


def block_bound(values: torch.Tensor, codec: str, block: int) -> torch.Tensor:
    """Per-element bound m/(2Q)(1 + 2**-14) + Q 2**-149 (derivation: dipaco.codecs.kernels)."""
    qmax = {"int8": 127, "int4": 7}[codec]
    flat = values.reshape(-1).float()
    padded = torch.nn.functional.pad(flat, (0, -flat.numel() % block)).view(
        -1, block
    )  # (blocks, B)
    per_block = padded.abs().amax(dim=1) / (2 * qmax) * (1 + 2**-14) + qmax * FP32_TINY  # (blocks,)
    return per_block.repeat_interleave(block)[: flat.numel()].view(values.shape)


def assert_int4_within_bound(original: torch.Tensor, decoded: torch.Tensor, block: int) -> None:
    """int4 picks each block's scale by least squares (kernels._int4_least_squares), so its
    bound is absmax's per block in squared error: sum (x - x')**2 <= n (m/14 (1 + 2**-14) +
    7 * 2**-149)**2 over the block's n values; a single value may be off by more."""
    x = original.reshape(-1).double()
    error = (decoded.reshape(-1).double() - x).square()
    pad = -x.numel() % block
    per_block = torch.nn.functional.pad(error, (0, pad)).view(-1, block).sum(dim=1)  # (blocks,)
    absmax = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, block).amax(dim=1)  # (blocks,)
    count = torch.full_like(absmax, block)  # (blocks,)
    if pad:
        count[-1] = block - pad
    bound = count * (absmax / 14 * (1 + 2**-14) + 7 * FP32_TINY).square()  # (blocks,)
    worst = (per_block - bound).max() if x.numel() else torch.tensor(0.0)
    assert bool((per_block <= bound).all()), f"int4: error exceeds its bound by {float(worst)}"


def assert_within_bound(
    original: torch.Tensor, decoded: torch.Tensor, codec: str, block: int
) -> None:
    assert decoded.dtype == torch.float32 and decoded.shape == original.shape
    if codec == "int4":
        assert_int4_within_bound(original, decoded, block)
        return
    x = original.float()
    error = (decoded - x).abs()
    if codec == "fp32":
        bound = torch.zeros_like(x)
    elif codec == "bf16":
        bound = x.abs() * 2.0**-8 + 2.0**-134  # 8 significant bits; fp32's subnormal range
    elif codec == "fp16":
        bound = x.abs() * 2.0**-11 + 2.0**-25  # 11 significant bits; fp16 subnormal spacing 2**-24
    else:
        bound = block_bound(original, codec, block)
    worst = (error - bound).max() if x.numel() else torch.tensor(0.0)
    assert bool((error <= bound).all()), f"{codec}: error exceeds its bound by {float(worst)}"


# --- helpers that take a valid file apart, so tests can corrupt one thing at a time -------------


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(header: dict[str, Any], region: bytes) -> bytes:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + region


def table(header: dict[str, Any]) -> dict[str, Any]:
    return json.loads(header["__metadata__"]["tensors"])


def set_table(header: dict[str, Any], tensors: dict[str, Any]) -> None:
    header["__metadata__"]["tensors"] = json.dumps(tensors)


def reseal(header: dict[str, Any], region: bytes) -> bytes:
    """Recompute every tensor's sha256, so only the corruption under test remains."""
    tensors = table(header)
    for name, info in tensors.items():
        digest = hashlib.sha256()
        for key in (name, name + "::scales"):
            if key in header:
                start, end = header[key]["data_offsets"]
                digest.update(region[start:end])
        info["sha256"] = digest.hexdigest()
    set_table(header, tensors)
    return join(header, region)


def poke(data: bytes, key: str, index: int, value: float | int, dtype: torch.dtype) -> bytes:
    """Overwrite element ``index`` of stored array ``key`` and fix the checksums."""
    header, region = split(data)
    start = header[key]["data_offsets"][0]
    size = torch.tensor([], dtype=dtype).element_size()
    raw = torch.tensor([value], dtype=dtype).view(torch.uint8).numpy().tobytes()
    patched = region[: start + index * size] + raw + region[start + (index + 1) * size :]
    return reseal(header, patched)


def expect_error(code: str, action: Callable[[], object], match: str | None = None) -> CodecError:
    with pytest.raises(CodecError, match=match) as caught:
        action()
    assert caught.value.code == code, f"expected {code}, got {caught.value.code}: {caught.value}"
    return caught.value


# --- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("block", [1, 3, 64, 100])
def test_it_round_trips_every_codec_within_its_error_bound(codec: str, block: int) -> None:
    tensors = module()
    data = codecs.encode(tensors, codec, block_size=block)
    decoded = codecs.decode(data, codecs.spec_of(tensors))
    assert list(decoded) == list(tensors)
    for name, original in tensors.items():
        assert_within_bound(original, decoded[name], codec, block)


def test_fp32_is_bit_exact_and_int8_beats_int4() -> None:
    tensors = module()
    exact = codecs.decode(codecs.encode(tensors, "fp32"))
    assert all(torch.equal(exact[name], t) for name, t in tensors.items())
    name = "layers.0.mlp.up.weight"
    error8 = (codecs.decode(codecs.encode(tensors, "int8"))[name] - tensors[name]).norm()
    error4 = (codecs.decode(codecs.encode(tensors, "int4"))[name] - tensors[name]).norm()
    assert 0 < error8 < error4 / 10


def absmax_int4(values: torch.Tensor, block: int) -> torch.Tensor:
    """Plain absmax int4 (scale m/7, q in [-7, 7]): what int4 did before least squares."""
    blocks = values.reshape(-1, block)  # (blocks, B)
    scale = blocks.abs().amax(dim=1, keepdim=True) / 7  # (blocks, 1)
    return ((blocks / scale).round().clamp(-7, 7) * scale).reshape(values.shape)


def test_int4_least_squares_scales_beat_absmax_in_every_block_and_use_the_minus_8_nibble() -> None:
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(64 * 128, generator=generator)  # Gaussian blocks of 128
    data = codecs.encode({"w": values}, "int4", block_size=128)
    decoded = codecs.decode(data)["w"]
    ours = (decoded - values).view(-1, 128).square().sum(dim=1)  # (blocks,)
    absmax = (absmax_int4(values, 128) - values).view(-1, 128).square().sum(dim=1)
    assert bool((ours <= absmax * (1 + 1e-5)).all())
    assert float(ours.sum()) < 0.8 * float(absmax.sum())  # -25% on Gaussian blocks
    stored = safetensors.torch.load(data)
    nibbles = stored["w"].view(torch.int8)
    low, high = (nibbles << 4) >> 4, nibbles >> 4
    assert int(torch.minimum(low.min(), high.min())) == -8  # the nibble absmax never used
    assert bool((stored["w::scales"] > 0).all())


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_it_encodes_other_float_dtypes_and_records_them(codec: str) -> None:
    tensors = {
        "half": torch.randn(70).half(),
        "brain": torch.randn(5, 3).bfloat16(),
        "double": torch.randn(9).double(),
    }
    data = codecs.encode(tensors, codec)
    header = codecs.inspect(data)
    assert header.spec() == {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    decoded = codecs.decode(data, codecs.spec_of(tensors))
    for name, original in tensors.items():
        assert decoded[name].dtype == torch.float32
        assert_within_bound(original.float(), decoded[name], codec, 64)


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_block_codecs_store_one_scale_per_block_and_the_promised_size(codec: str) -> None:
    values = torch.randn(1000)
    stored = safetensors.torch.load(codecs.encode({"w": values}, codec, block_size=64))
    assert stored["w::scales"].shape == (16,)  # ceil(1000 / 64)
    assert stored["w"].numel() == (1024 if codec == "int8" else 512)  # whole blocks, 2 per byte


def test_the_container_is_a_plain_safetensors_file_with_the_documented_metadata(
    tmp_path: Path,
) -> None:
    tensors = module()
    path = tmp_path / "delta.safetensors"
    size = codecs.encode_to_file(tensors, "int8", path)
    assert size == path.stat().st_size == len(codecs.encode(tensors, "int8"))
    with safetensors.safe_open(str(path), "pt") as opened:
        meta = opened.metadata()
        keys = set(opened.keys())
    assert meta["format"] == "dipaco.codec" and meta["version"] == "1"
    assert meta["codec"] == "int8" and meta["block_size"] == "64"
    assert keys == {key for name in tensors for key in (name, name + "::scales")}
    assert json.loads(meta["tensors"])["scale"] == {
        "shape": [],
        "dtype": "float32",
        "sha256": json.loads(meta["tensors"])["scale"]["sha256"],
    }
    decoded = codecs.decode(path)
    for name, original in tensors.items():
        assert_within_bound(original, decoded[name], "int8", 64)


def test_inspect_reads_the_header_of_a_file(tmp_path: Path) -> None:
    path = tmp_path / "delta.safetensors"
    codecs.encode_to_file(module(), "fp16", path)
    header = codecs.inspect(path)
    assert (header.codec, header.block_size, header.version) == ("fp16", 0, 1)
    assert header.num_elements == sum(t.numel() for t in module().values())
    assert header.total_bytes == path.stat().st_size


# --- accumulate -----------------------------------------------------------------------------


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_accumulate_adds_the_weighted_sum_of_decoded_deltas(codec: str) -> None:
    first, second = module(1), module(2)
    a, b = codecs.encode(first, codec, block_size=32), codecs.encode(second, codec, block_size=32)
    start = module(3)
    into = {name: t.clone() for name, t in start.items()}
    stats_a = codecs.accumulate(a, into, 0.25, codecs.spec_of(first))
    codecs.accumulate(b, into, 0.75)
    da, db = codecs.decode(a), codecs.decode(b)
    for name in into:
        torch.testing.assert_close(
            into[name], start[name] + 0.25 * da[name] + 0.75 * db[name], rtol=1e-6, atol=1e-9
        )
    assert stats_a.sq_norm == pytest.approx(
        sum(float(t.double().pow(2).sum()) for t in da.values()), rel=1e-5
    )
    assert stats_a.num_elements == sum(t.numel() for t in first.values())
    assert stats_a.encoded_bytes == len(a) and stats_a.checksum_verified
    assert codecs.verify(a).sq_norm == pytest.approx(stats_a.sq_norm, rel=1e-6)


def test_accumulate_leaves_into_untouched_when_the_upload_is_bad() -> None:
    tensors = {"a": torch.randn(300), "z": torch.randn(300)}
    data = codecs.encode(tensors, "fp32")
    # NaN in the *last* tensor: a streaming decoder would already have added the first one
    bad = poke(data, "z", 5, float("nan"), torch.float32)
    into = {name: torch.zeros_like(t) for name, t in tensors.items()}
    expect_error("non_finite", lambda: codecs.accumulate(bad, into, 1.0))
    corrupt = bytearray(data)
    corrupt[-1] ^= 0xFF
    expect_error("checksum_mismatch", lambda: codecs.accumulate(bytes(corrupt), into, 1.0))
    assert all(not t.any() for t in into.values())


def test_accumulate_refuses_into_of_another_shape_or_dtype() -> None:
    data = codecs.encode({"w": torch.randn(4, 5)}, "int8")
    expect_error(
        "spec_mismatch", lambda: codecs.accumulate(data, {"w": torch.zeros(5, 4)}, 1.0), "module"
    )
    expect_error("spec_mismatch", lambda: codecs.accumulate(data, {"v": torch.zeros(4, 5)}, 1.0))
    with pytest.raises(TypeError, match="float32"):
        codecs.accumulate(data, {"w": torch.zeros(4, 5, dtype=torch.float64)}, 1.0)


# --- property tests --------------------------------------------------------------------------

shapes = st.lists(st.integers(0, 40), min_size=0, max_size=3)
magnitude = st.sampled_from([1e-30, 1e-6, 1e-3, 1.0, 1e4, 1e30])


@settings(max_examples=60, deadline=None)
@given(
    shape=shapes,
    codec=st.sampled_from(codecs.CODECS),
    block=st.integers(1, 130),
    scale=magnitude,
    seed=st.integers(0, 2**31),
)
def test_random_tensors_round_trip_within_the_bound(
    shape: list[int], codec: str, block: int, scale: float, seed: int
) -> None:
    if codec == "fp16":
        scale = min(scale, 1e3)  # randn * 1e4 can exceed ±65504, which encode refuses
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    values.view(-1)[:: max(1, values.numel() // 3)] = 0.0  # zeros and all-zero blocks
    decoded = codecs.decode(codecs.encode({"t": values}, codec, block_size=block))["t"]
    assert_within_bound(values, decoded, codec, block)


# --- malformed input -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def int8_file() -> bytes:
    return codecs.encode(module(), "int8")


def test_codec_error_is_a_value_error() -> None:
    assert issubclass(CodecError, ValueError)


@pytest.mark.parametrize("cut", [0, 5, 8, 20, -1, -100])
def test_it_rejects_truncated_files(int8_file: bytes, cut: int) -> None:
    expect_error("truncated", lambda: codecs.decode(int8_file[:cut]), "cut off")


def test_it_rejects_a_truncated_file_on_disk_without_reading_the_rest(
    tmp_path: Path, int8_file: bytes
) -> None:
    header, region = split(int8_file)
    # a well-formed entry for 128M values (136 MiB of int8 + scales) in a file of a few KiB
    end = len(region) + (1 << 27)
    header["w"] = {"dtype": "I8", "shape": [1 << 27], "data_offsets": [len(region), end]}
    header["w::scales"] = {
        "dtype": "F32",
        "shape": [1 << 21],
        "data_offsets": [end, end + (1 << 23)],
    }
    tensors = table(header)
    tensors["w"] = {"shape": [1 << 27], "dtype": "float32", "sha256": "0" * 64}
    set_table(header, tensors)
    path = tmp_path / "short.safetensors"
    path.write_bytes(join(header, region))
    tracemalloc.start()
    try:
        expect_error("truncated", lambda: codecs.decode(path), "cut off")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


@pytest.mark.parametrize("length", [0, 1, (4 << 20) + 1, 1 << 40, 2**64 - 1])
def test_it_rejects_absurd_header_lengths_without_allocating_them(
    tmp_path: Path, length: int
) -> None:
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", length) + b"{}" + b" " * 100)
    tracemalloc.start()
    try:
        expect_error("bad_header", lambda: codecs.inspect(path), "header length")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_it_refuses_pickles(protocol: int) -> None:
    payload = pickle.dumps({"w": [1.0, 2.0]}, protocol=protocol)
    expect_error("not_safetensors", lambda: codecs.decode(payload), "pickle")


def test_it_refuses_torch_save_files(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    torch.save({"w": torch.randn(3)}, buffer)
    expect_error("not_safetensors", lambda: codecs.decode(buffer.getvalue()), "never loaded")
    path = tmp_path / "delta.pt"
    path.write_bytes(buffer.getvalue())
    expect_error("not_safetensors", lambda: codecs.inspect(path))


def test_it_refuses_plain_safetensors_without_dipaco_metadata() -> None:
    plain = safetensors.torch.save({"w": torch.randn(3)})
    expect_error("bad_header", lambda: codecs.decode(plain), "dipaco.codecs.encode")


@pytest.mark.parametrize(
    "text",
    [
        b"not json at all",
        b'{"a": 1, "a": 2}',
        b"[1, 2]",
        b'{"x": NaN}',
        b"{" * 100_000,
        b"{\xff\xfe}",
    ],
)
def test_it_rejects_headers_that_are_not_a_json_object(text: bytes) -> None:
    data = struct.pack("<Q", len(text)) + text
    expect_error("bad_header", lambda: codecs.decode(data))


def edit_meta(data: bytes, key: str, value: str) -> bytes:
    header, region = split(data)
    header["__metadata__"][key] = value
    return join(header, region)


def test_it_names_unknown_codecs(int8_file: bytes) -> None:
    error = expect_error(
        "unknown_codec", lambda: codecs.decode(edit_meta(int8_file, "codec", "int3"))
    )
    assert "int8" in str(error)  # lists the known ones
    expect_error("unknown_codec", lambda: codecs.encode(module(), "zstd"), "choose one of")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("version", "2", "upgrade"),
        ("version", "one", "decimal"),
        ("block_size", "0", "block_size"),
        ("block_size", "²", "decimal"),
        ("format", "other", "dipaco.codecs.encode"),
        ("tensors", "{}", "non-empty"),
        ("tensors", '{"w": {"shape": [2]}}', "exactly"),
    ],
)
def test_it_rejects_bad_metadata(int8_file: bytes, key: str, value: str, match: str) -> None:
    expect_error("bad_header", lambda: codecs.decode(edit_meta(int8_file, key, value)), match)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("shape", [48, -40], "shape"),
        ("shape", [48.0, 40], "shape"),
        ("shape", [1] * 9, "at most"),
        ("dtype", "int64", "dtype"),
        ("sha256", "xyz", "sha256"),
    ],
)
def test_it_rejects_bad_tensor_entries(
    int8_file: bytes, field: str, value: Any, match: str
) -> None:
    header, region = split(int8_file)
    tensors = table(header)
    tensors["layers.0.mlp.up.weight"][field] = value
    set_table(header, tensors)
    expect_error("bad_header", lambda: codecs.decode(join(header, region)), match)


def test_it_rejects_declared_sizes_beyond_the_hard_cap(int8_file: bytes) -> None:
    header, region = split(int8_file)
    tensors = table(header)
    tensors["layers.0.mlp.up.weight"]["shape"] = [1 << 20, 1 << 20, 1 << 10]
    set_table(header, tensors)
    expect_error("too_large", lambda: codecs.decode(join(header, region)), "limit")


def test_it_rejects_more_values_than_the_module_has(int8_file: bytes) -> None:
    expected = codecs.spec_of(module())
    expected["layers.0.mlp.up.weight"] = ((48, 4), torch.float32)
    expect_error("too_large", lambda: codecs.decode(int8_file, expected), "module has")


def test_it_checks_a_file_against_the_module_before_reading_its_payload(tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    codecs.encode_to_file({"w": torch.zeros(1 << 20)}, "fp32", path)  # 4 MiB
    tracemalloc.start()
    try:
        expect_error("too_large", lambda: codecs.decode(path, {"w": ((16,), torch.float32)}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda e: e.update({"layers.0.norm.weight": ((1, 131), torch.float32)}), "expects"),
        (lambda e: e.update({"layers.0.norm.weight": ((131,), torch.bfloat16)}), "bfloat16"),
        (lambda e: e.pop("scale"), "unexpected \\['scale'\\]"),
        (lambda e: e.update({"extra": ((), torch.float32)}), "missing \\['extra'\\]"),
    ],
)
def test_it_rejects_uploads_that_do_not_match_the_module(
    int8_file: bytes, change: Callable[[dict[str, Any]], object], match: str
) -> None:
    expected: dict[str, Any] = dict(codecs.spec_of(module()))
    change(expected)
    expect_error("spec_mismatch", lambda: codecs.decode(int8_file, expected), match)


def layout_edit(
    data: bytes, edit: Callable[[dict[str, Any]], None], region_suffix: bytes = b""
) -> bytes:
    header, region = split(data)
    edit(header)
    return join(header, region + region_suffix)


def shift_offsets(header: dict[str, Any]) -> None:
    entry = header["layers.0.norm.weight"]
    entry["data_offsets"] = [entry["data_offsets"][0] + 1, entry["data_offsets"][1] + 1]


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update({"stowaway": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}}),
        lambda h: h.pop("scale::scales"),
        lambda h: h["scale"].update({"dtype": "U8"}),
        lambda h: h["scale"].update({"shape": [65]}),
        lambda h: h["scale"].update({"data_offsets": [0, 64]}),
        lambda h: h["scale"].update({"data_offsets": "0-64"}),
        shift_offsets,
    ],
)
def test_it_rejects_arrays_that_do_not_tile_the_data_region(
    int8_file: bytes, edit: Callable[[dict[str, Any]], None]
) -> None:
    expect_error("bad_layout", lambda: codecs.decode(layout_edit(int8_file, edit)))


def test_it_rejects_trailing_bytes(int8_file: bytes) -> None:
    expect_error("bad_layout", lambda: codecs.decode(int8_file + b"\0" * 8), "unexpected bytes")


def test_it_detects_a_flipped_payload_byte_by_checksum(int8_file: bytes) -> None:
    header, _ = split(int8_file)
    start = header["layers.0.mlp.up.weight"]["data_offsets"][0]
    corrupt = bytearray(int8_file)
    corrupt[len(int8_file) - len(split(int8_file)[1]) + start] ^= 1
    error = expect_error("checksum_mismatch", lambda: codecs.decode(bytes(corrupt)))
    assert "layers.0.mlp.up.weight" in str(error)
    # the caller that already checked the blob's sha256 may skip the per-tensor digests
    codecs.decode(bytes(corrupt), verify_checksum=False)


@pytest.mark.parametrize(
    ("codec", "key", "value", "dtype", "code"),
    [
        ("fp32", "w", float("nan"), torch.float32, "non_finite"),
        ("fp32", "w", float("-inf"), torch.float32, "non_finite"),
        ("bf16", "w", float("inf"), torch.bfloat16, "non_finite"),
        ("fp16", "w", float("nan"), torch.float16, "non_finite"),
        ("int8", "w::scales", float("nan"), torch.float32, "non_finite"),
        ("int4", "w::scales", float("inf"), torch.float32, "non_finite"),
        ("int8", "w::scales", -1.0, torch.float32, "bad_scales"),
        ("int4", "w::scales", 3e38, torch.float32, "bad_scales"),
    ],
)
def test_it_rejects_non_finite_values_and_bad_scales(
    codec: str, key: str, value: float, dtype: torch.dtype, code: str
) -> None:
    data = poke(codecs.encode({"w": torch.randn(200)}, codec), key, 2, value, dtype)
    expect_error(code, lambda: codecs.decode(data), "'w'")
    expect_error(code, lambda: codecs.verify(data), "'w'")
    expect_error(code, lambda: codecs.accumulate(data, {"w": torch.zeros(200)}, 1.0), "'w'")


def test_extreme_hostile_int8_values_still_decode_to_finite_numbers() -> None:
    data = poke(
        codecs.encode({"w": torch.randn(64)}, "int8"), "w::scales", 0, 3.4e38 / 256, torch.float32
    )
    data = poke(data, "w", 0, -128, torch.int8)
    assert bool(torch.isfinite(codecs.decode(data)["w"]).all())


@pytest.mark.parametrize("codec", ["fp32", "bf16"])
def test_huge_finite_values_are_not_mistaken_for_non_finite(codec: str) -> None:
    values = torch.tensor([3e38, 3e38, -1.0])  # their sum and squares overflow fp32
    data = codecs.encode({"w": values}, codec)
    assert bool(torch.isfinite(codecs.decode(data)["w"]).all())
    assert codecs.verify(data).sq_norm == float("inf")  # documented: beyond fp32 range


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_encode_refuses_non_finite_deltas(codec: str) -> None:
    values = torch.randn(100)
    values[37] = float("nan")
    expect_error("non_finite", lambda: codecs.encode({"w": values}, codec), "diverged")


@pytest.mark.parametrize(
    ("tensors", "codec", "block", "match"),
    [
        ({"w": torch.full((3,), 1e5)}, "fp16", 64, "bf16"),
        ({"w": torch.full((3,), 1e38)}, "int4", 64, "diverged"),
        ({"w": torch.arange(3)}, "int8", 64, "float32"),
        ({"a::scales": torch.zeros(3)}, "int8", 64, "'::'"),
        ({"": torch.zeros(3)}, "fp32", 64, "not allowed"),
        ({"w": torch.zeros(3)}, "int8", 0, "block_size"),
        ({}, "int8", 64, "1 to"),
    ],
)
def test_encode_refuses_inputs_it_cannot_represent(
    tensors: dict[str, torch.Tensor], codec: str, block: int, match: str
) -> None:
    expect_error("bad_input", lambda: codecs.encode(tensors, codec, block_size=block), match)


def test_empty_and_zero_dim_tensors_round_trip_in_every_codec() -> None:
    tensors = {"empty": torch.zeros(0), "matrix0": torch.zeros(3, 0), "scalar": torch.tensor(0.5)}
    for codec in codecs.CODECS:
        decoded = codecs.decode(codecs.encode(tensors, codec), codecs.spec_of(tensors))
        assert decoded["empty"].shape == (0,) and decoded["matrix0"].shape == (3, 0)
        assert decoded["scalar"].shape == () and math.isclose(
            float(decoded["scalar"]), 0.5, rel_tol=1e-2
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", codecs.CODECS)
def test_encoding_on_the_gpu_matches_encoding_on_the_cpu(codec: str) -> None:
    tensors = module()
    on_gpu = codecs.decode(codecs.encode({n: t.cuda() for n, t in tensors.items()}, codec))
    on_cpu = codecs.decode(codecs.encode(tensors, codec))
    # abs, amax, tensor-by-tensor division, rounding and casts are exact IEEE operations on
    # both (a CUDA division by a Python scalar is not: kernels._divisor)
    assert all(torch.equal(on_gpu[name], on_cpu[name]) for name in tensors)


def test_error_feedback_carries_int4_rounding_into_the_next_delta() -> None:
    """Over rounds, what was sent sums to what was meant within one round's error."""
    g = torch.Generator().manual_seed(0)
    deltas = [{"w": torch.randn(64, 64, generator=g) * 1e-3} for _ in range(8)]
    residual: dict[str, torch.Tensor] | None = None
    sent_sum, plain_sum = torch.zeros(64, 64), torch.zeros(64, 64)
    for delta in deltas:
        data, residual = codecs.encode_with_feedback(delta, "int4", residual)
        sent_sum += codecs.decode(data)["w"]
        plain_sum += codecs.decode(codecs.encode(delta, "int4"))["w"]
    true_sum = sum(d["w"] for d in deltas)
    assert residual is not None
    # The sum of what was sent differs from the truth by exactly the last residual...
    assert torch.allclose(true_sum - sent_sum, residual["w"], atol=1e-7)
    # ... which is far below the error plain int4 accumulates over the same rounds.
    fed, plain = (true_sum - sent_sum).norm(), (true_sum - plain_sum).norm()
    assert fed < 0.5 * plain, (float(fed), float(plain))


def test_error_feedback_keeps_no_residual_for_exact_codecs() -> None:
    data, residual = codecs.encode_with_feedback({"w": torch.ones(4)}, "fp32", None)
    assert residual == {} and torch.equal(codecs.decode(data)["w"], torch.ones(4))
