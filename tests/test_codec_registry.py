"""The codec registry is the one list of codecs: the config, the CLI and the container read it."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from typing import get_args

import pytest
import torch

from dipaco import codecs
from dipaco.cli import simulate as simulate_cli
from dipaco.codecs import kernels
from dipaco.codecs.container import STORED_DTYPES, stored_layout
from dipaco.codecs.registry import CODECS, PAYLOAD_BITS, REGISTRY, UPDATE_CODECS
from dipaco.config import CommConfig


def cli_choices(flag: str) -> tuple[str, ...]:
    parser = argparse.ArgumentParser()
    simulate_cli.register(parser.add_subparsers())
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    simulate = subparsers.choices["simulate"]
    action = next(a for a in simulate._actions if flag in a.option_strings)
    assert action.choices is not None
    return tuple(action.choices)


def test_the_configs_choices_are_the_registrys() -> None:
    fields = CommConfig.model_fields
    assert get_args(fields["codec"].annotation) == CODECS == tuple(REGISTRY)
    assert get_args(fields["download_codec"].annotation) == UPDATE_CODECS
    schema = CommConfig.model_json_schema()["properties"]
    assert schema["codec"]["enum"] == list(CODECS)
    assert schema["download_codec"]["enum"] == list(UPDATE_CODECS)
    for name, codec in REGISTRY.items():
        assert codec.summary in schema["codec"]["description"], name


def test_the_clis_choices_are_the_registrys() -> None:
    assert cli_choices("--codec") == CODECS


def test_the_packages_list_is_the_registrys() -> None:
    assert codecs.CODECS == CODECS
    assert set(UPDATE_CODECS) <= set(CODECS) and "fp32" in UPDATE_CODECS


def test_the_registry_loads_without_torch() -> None:
    """The run config and the CLI read the table; neither may pull in torch."""
    script = (
        "import sys\n"
        "import dipaco.codecs.registry, dipaco.config, dipaco.cli.simulate\n"
        "sys.exit(1 if 'torch' in sys.modules else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_row_names_kernels_that_exist() -> None:
    """The table names its kernels; dipaco.codecs.api calls them by those names."""
    for codec in REGISTRY.values():
        for name in (codec.encoder, codec.decoder):
            assert callable(getattr(kernels, name, None)), (codec.name, name)


def test_every_payload_width_matches_the_containers_dtypes() -> None:
    for name, (_, size) in STORED_DTYPES.items():
        assert PAYLOAD_BITS[name] == 8 * size, name
    for codec in REGISTRY.values():
        assert PAYLOAD_BITS[codec.payload] % codec.bits == 0, codec.name


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 200])
def test_each_codecs_layout_is_what_its_encoder_writes(codec: str, numel: int) -> None:
    block = 16
    data = codecs.encode({"w": torch.randn(numel)}, codec, block_size=block)
    header = codecs.inspect(data)
    layout = stored_layout(codec, numel, block)
    assert [(e.key, e.dtype, e.length) for e in header.entries.values()] == [
        ("w" + suffix, dtype, length) for suffix, dtype, length in layout
    ]
    # `bits` per value: exactly numel values unblocked, whole blocks (int4: pairs) blocked
    spec = REGISTRY[codec]
    (_, payload_dtype, length), *scales = layout
    assert payload_dtype == STORED_DTYPES[spec.payload][0]
    values = length * PAYLOAD_BITS[spec.payload] // spec.bits
    if spec.blocked:
        assert numel <= values < numel + spec.values_per_element * block
        assert scales == [("::scales", torch.float32, -(-numel // block))]
    else:
        assert values == numel and scales == []


def test_a_codec_added_to_the_table_round_trips_with_no_other_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adding a codec is one row: encode, inspect, decode and error feedback follow it."""
    half = dataclasses.replace(REGISTRY["fp16"], name="half", summary="fp16 under another name")
    monkeypatch.setitem(REGISTRY, "half", half)
    tensors = {"w": torch.randn(5, 7), "b": torch.randn(3)}
    data = codecs.encode(tensors, "half")
    assert codecs.inspect(data).codec == "half"
    decoded = codecs.decode(data)
    for name, tensor in tensors.items():
        torch.testing.assert_close(decoded[name], tensor.to(torch.float16).float(), rtol=0, atol=0)
    _, residual = codecs.encode_with_feedback(tensors, "half", None)
    assert set(residual) == set(tensors)


def test_an_unregistered_codec_is_refused_by_name() -> None:
    with pytest.raises(
        codecs.CodecError, match="choose one of fp32, bf16, fp16, int8, int4"
    ) as caught:
        codecs.encode({"w": torch.zeros(2)}, "int3")
    assert caught.value.code == "unknown_codec"
