"""Hypothesis on the two parsers of untrusted input: the codec container and the run config.

Codecs (uploaded Δs come from untrusted workers):
- arbitrary float values (not just randn: extremes, subnormals, zeros, several tensors)
  round trip within each codec's bound, or, only past the codec's range (fp16 beyond
  ±65504, bf16 near fp32's max, int8/int4 past their scale cap), are refused at encode with
  CodecError "bad_input" — never silently clipped;
- arbitrary bytes, and valid containers with bytes flipped, cut, spliced, or a header field
  replaced by an arbitrary JSON value, decode to tensors or raise CodecError: no other
  exception, and never more values than the bytes can hold;
- decoding such a file from disk never allocates more than its size (a hostile header
  that declares gigabytes costs nothing).

Run configs (admins post them as JSON; the worker reads them back):
- an arbitrary JSON object, or a valid config with one field replaced by arbitrary JSON,
  is either a RunConfig or a ValidationError that `config_problems` turns into
  (field, value, rule) with a message, and through `validate_config` a ConfigInvalid whose
  problems serialise to JSON; a config that validates round-trips unchanged and stays
  within the unit and memory limits.

Example counts are bounded (each test well under ten seconds on a loaded core).
"""

from __future__ import annotations

import json
import math
import struct
import tracemalloc
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.codecs.kernels import INT4_QMAX, INT8_QMAX, SCALE_LIMIT
from dipaco.config import (
    MAX_UNITS_PER_ROUND,
    RunConfig,
    config_problems,
    estimate_path_memory,
)
from dipaco_server.runs.errors import ConfigInvalid
from dipaco_server.runs.services import validate_config
from tests.test_codecs import assert_within_bound, join, module, split

FUZZ = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# The largest |value| each codec must accept: fp16 and bf16 by their dtype (bf16 rounds a
# value near fp32's max up to inf), int8/int4 by the scale cap that keeps decoding finite.
RANGE = {
    "fp32": math.inf,
    "bf16": float(torch.finfo(torch.bfloat16).max),
    "fp16": float(torch.finfo(torch.float16).max),
    "int8": SCALE_LIMIT * INT8_QMAX,
    "int4": SCALE_LIMIT * INT4_QMAX,
}

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=12,
)


# --- codecs: round trips -------------------------------------------------------------------


tensor_values = st.lists(
    st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=0, max_size=200
)


@FUZZ
@given(
    tensors=st.dictionaries(
        st.from_regex(r"[a-z][a-z0-9_.]{0,20}", fullmatch=True),
        tensor_values,
        min_size=1,
        max_size=3,
    ),
    codec=st.sampled_from(codecs.CODECS),
    block=st.integers(1, 96),
)
def test_arbitrary_finite_values_round_trip_within_the_codecs_bound_or_are_refused(
    tensors: dict[str, list[float]], codec: str, block: int
) -> None:
    values = {name: torch.tensor(v, dtype=torch.float32) for name, v in tensors.items()}
    top = max((float(t.abs().max()) for t in values.values() if t.numel()), default=0.0)
    try:
        data = codecs.encode(values, codec, block_size=block)
    except CodecError as error:
        # Refused only past the codec's documented range, never below it.
        assert error.code == "bad_input", error
        assert top > RANGE[codec], f"{codec} refused |x| <= {top}: {error}"
        return
    decoded = codecs.decode(data)
    assert list(decoded) == list(values)
    for name, original in values.items():
        assert_within_bound(original, decoded[name], codec, block)


# --- codecs: hostile bytes -----------------------------------------------------------------


def decode_or_refuse(data: bytes) -> None:
    """Decode; only CodecError may escape, and a success holds no more values than bytes allow."""
    try:
        decoded = codecs.decode(data)
    except CodecError as error:
        assert error.code and str(error), "a refusal names its reason"
        return
    values = sum(t.numel() for t in decoded.values())
    assert values <= 2 * len(data), "int4 is the densest codec: two values per byte"
    for tensor in decoded.values():
        assert bool(torch.isfinite(tensor).all()), "decode never returns NaN or Inf"


@pytest.fixture(scope="module")
def valid_files() -> dict[str, bytes]:
    return {codec: codecs.encode(module(), codec, block_size=16) for codec in codecs.CODECS}


@FUZZ
@given(data=st.binary(max_size=512))
def test_arbitrary_bytes_decode_only_to_a_codec_error(data: bytes) -> None:
    decode_or_refuse(data)


@FUZZ
@given(
    codec=st.sampled_from(codecs.CODECS),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "insert", "length"]), st.integers(0, 2**16)),
        min_size=1,
        max_size=4,
    ),
    filler=st.binary(min_size=1, max_size=16),
)
def test_mutated_containers_decode_only_to_a_codec_error(
    valid_files: dict[str, bytes], codec: str, edits: list[tuple[str, int]], filler: bytes
) -> None:
    data = bytearray(valid_files[codec])
    for kind, n in edits:
        at = n % max(1, len(data))
        if kind == "flip" and data:
            data[at] ^= 1 << (n % 8)
        elif kind == "cut":
            del data[at : at + 1 + n % 64]
        elif kind == "insert":
            data[at:at] = filler
        elif kind == "length" and len(data) >= 8:
            data[:8] = struct.pack("<Q", n * 977)  # a header length that lies
    decode_or_refuse(bytes(data))


def _fields(header: dict[str, Any]) -> list[tuple[str, ...]]:
    """Paths to every value of a container header, including inside the tensors table."""
    paths: list[tuple[str, ...]] = []
    for key, entry in header.items():
        paths.append((key,))
        paths.extend((key, sub) for sub in entry)
    paths.extend(
        ("__metadata__", "tensors", name) for name in json.loads(header["__metadata__"]["tensors"])
    )
    return paths


@FUZZ
@given(
    codec=st.sampled_from(codecs.CODECS),
    pick=st.integers(0, 10_000),
    value=json_values,
    drop=st.booleans(),
)
def test_a_header_field_replaced_by_arbitrary_json_decodes_only_to_a_codec_error(
    valid_files: dict[str, bytes], codec: str, pick: int, value: Any, drop: bool
) -> None:
    header, region = split(valid_files[codec])
    fields = _fields(header)
    field = fields[pick % len(fields)]
    if field[:2] == ("__metadata__", "tensors") and len(field) == 3:
        table = json.loads(header["__metadata__"]["tensors"])
        table[field[2]] = value
        header["__metadata__"]["tensors"] = json.dumps(table)
    else:
        parent = header
        for part in field[:-1]:
            parent = parent[part]
        if drop:
            del parent[field[-1]]
        else:
            parent[field[-1]] = value
    decode_or_refuse(join(header, region))


@settings(max_examples=40, deadline=None)
@given(
    codec=st.sampled_from(codecs.CODECS),
    declared=st.integers(1, 2**40),
    length=st.integers(0, 2**63),
    lie_about_length=st.booleans(),
)
def test_decoding_a_hostile_file_never_allocates_more_than_its_size(
    tmp_path_factory: pytest.TempPathFactory,
    valid_files: dict[str, bytes],
    codec: str,
    declared: int,
    length: int,
    lie_about_length: bool,
) -> None:
    header, region = split(valid_files[codec])
    name = next(k for k in header if k != "__metadata__")
    start = header[name]["data_offsets"][0]
    header[name]["shape"] = [declared]
    header[name]["data_offsets"] = [start, start + declared]
    data = bytearray(join(header, region))
    if lie_about_length:
        data[:8] = struct.pack("<Q", length)
    file = tmp_path_factory.mktemp("hostile") / "upload.safetensors"
    file.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(CodecError):
            codecs.decode(file)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(data) + (1 << 20), f"peak {peak} B for a {len(data)} B file"


# --- run configs -----------------------------------------------------------------------------


def check_config(raw: Any) -> RunConfig | None:
    """Validate both ways; return the RunConfig, or None after checking the refusal's shape."""
    try:
        config = RunConfig.model_validate(raw)
    except ValidationError as error:
        problems = config_problems(error)
        assert problems, "a refusal lists at least one problem"
        for problem in problems:
            assert isinstance(problem.field, str) and isinstance(problem.rule, str) and problem.rule
        with pytest.raises(ConfigInvalid) as refused:
            validate_config(raw)
        assert refused.value.status == 422 and refused.value.message
        json.dumps(refused.value.details, allow_nan=False)  # the API echoes it as JSON
        return None
    again = RunConfig.model_validate_json(config.model_dump_json())
    assert again == config, "a valid config round-trips through JSON unchanged"
    assert validate_config(raw) == config
    assert config.layout.num_paths * config.replicas_per_path <= MAX_UNITS_PER_ROUND
    estimate = estimate_path_memory(config.model, config.inner)
    assert estimate.total_bytes <= config.limits.max_path_memory_bytes
    return config


@FUZZ
@given(raw=st.dictionaries(st.text(max_size=16), json_values, max_size=6))
def test_an_arbitrary_json_object_is_a_run_config_or_a_listed_refusal(raw: dict[str, Any]) -> None:
    check_config(raw)


def _config_fields(config: dict[str, Any]) -> list[tuple[str, ...]]:
    paths: list[tuple[str, ...]] = []
    for key, value in config.items():
        paths.append((key,))
        if isinstance(value, dict):
            paths.extend((key, sub) for sub in value)
    return paths


TINY = RunConfig.tiny().model_dump(mode="json")
TINY_FIELDS = _config_fields(TINY)
numbers = st.one_of(
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 2**31, 2**63, 10**12, 1e308]),
)


@FUZZ
@given(
    edits=st.lists(
        st.tuples(st.sampled_from(TINY_FIELDS), st.one_of(numbers, json_values)),
        min_size=1,
        max_size=3,
    )
)
def test_a_valid_config_with_fields_replaced_by_anything_is_checked_not_crashed(
    edits: list[tuple[tuple[str, ...], Any]],
) -> None:
    raw = json.loads(json.dumps(TINY))
    for field, value in edits:
        parent = raw
        for part in field[:-1]:
            if not isinstance(parent.get(part), dict):
                break
            parent = parent[part]
        else:
            parent[field[-1]] = value
    check_config(raw)


@settings(max_examples=40, deadline=None)
@given(
    hidden=st.integers(1, 2**20),
    layers=st.integers(1, 2**12),
    vocab=st.integers(1, 2**24),
    seq_len=st.integers(1, 2**20),
    micro_batch=st.integers(1, 2**12),
    modules=st.lists(st.integers(1, 2**10), min_size=1, max_size=4),
    replicas=st.integers(1, 2**20),
)
def test_configs_sized_to_exhaust_memory_are_refused_before_anything_is_built(
    hidden: int,
    layers: int,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    modules: list[int],
    replicas: int,
) -> None:
    assume(len(modules) <= layers)
    step = layers // len(modules)
    bounds = [i * step for i in range(len(modules))] + [layers]
    raw = {
        "model": {
            "hidden_size": hidden,
            "num_layers": layers,
            "num_heads": 1,
            "num_kv_heads": 1,
            "intermediate_size": hidden,
            "vocab_size": vocab,
            "seq_len": seq_len,
        },
        "layout": {
            "levels": [
                {"blocks": [bounds[i], bounds[i + 1]], "modules": k} for i, k in enumerate(modules)
            ]
        },
        "inner": {"micro_batch_size": micro_batch},
        "replicas_per_path": replicas,
    }
    config = check_config(raw)
    if config is not None:
        assert math.prod(modules) * replicas <= MAX_UNITS_PER_ROUND
        assert 8 * sum(config.module_param_counts().values()) <= (
            config.limits.max_module_storage_bytes
        )
