"""The library side of inference, without a server: model files, HF config, the zip stream."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dipaco.config import LayoutConfig, RunConfig
from dipaco.inference import (
    CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    MODEL_FILE,
    generation_config_json,
    hf_config_json,
    open_path_dir,
    tokenizer_files,
    write_model_file,
)
from dipaco.model import build_model
from dipaco.modular import assemble_path_state, init_modules
from dipaco.modules_file import load_module_file
from dipaco_server.inference.zipstream import ZipEntry, stream_zip
from tests.test_inference import trained


def _tied_config(vocab_size: int) -> RunConfig:
    return RunConfig.tiny(
        name="tied",
        model={
            "hidden_size": 32,
            "num_layers": 2,
            "num_heads": 2,
            "num_kv_heads": 1,
            "intermediate_size": 64,
            "vocab_size": vocab_size,
            "seq_len": 16,
            "tie_embeddings": True,
            "rope_theta": 5000.0,
        },
        layout=LayoutConfig.grid(2, levels=2, modules=2, path_specific=("embeddings", "lm_head")),
    )


def test_a_tied_path_written_here_opens_with_transformers_and_gives_the_library_logits(
    tmp_path: Path,
) -> None:
    t = trained()
    config = _tied_config(t.tokenizer.vocab_size)
    modules = init_modules(config, seed=3)
    files, separator_id = tokenizer_files(t.tokenizer_json)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / CONFIG_FILE).write_bytes(hf_config_json(config, separator_id))
    (tmp_path / GENERATION_CONFIG_FILE).write_bytes(generation_config_json(separator_id))
    write_model_file(config, 1, modules, tmp_path / MODEL_FILE)
    model, tokenizer = open_path_dir(tmp_path)
    assert model.config.tie_word_embeddings and model.config.rope_parameters["rope_theta"] == 5000
    assert tokenizer.eos_token_id == separator_id == model.generation_config.eos_token_id
    generation = model.generation_config  # written without transformers: read back by it
    assert (generation.do_sample, generation.top_k, generation.max_new_tokens) == (True, 50, 128)
    assert (model.config.num_key_value_heads, model.config.rms_norm_eps) == (1, 1e-5)
    assert model.config.use_cache and model.dtype == torch.float32
    reference = build_model(config.model, 0)
    reference.load_state_dict(assemble_path_state(config, 1, modules))
    ids = torch.tensor([[separator_id, *t.tokenizer.encode("ship wave tide")]])  # (1, T)
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids).logits, reference.eval()(ids).logits, atol=1e-5, rtol=0
        )


def test_the_same_modules_give_the_same_model_file_bytes(tmp_path: Path) -> None:
    config = _tied_config(300)
    modules, other = init_modules(config, seed=1), init_modules(config, seed=2)
    a = write_model_file(config, 2, modules, tmp_path / "a.safetensors")
    b = write_model_file(config, 2, modules, tmp_path / "b.safetensors")
    c = write_model_file(config, 2, other, tmp_path / "c.safetensors")
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_a_module_file_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    config = _tied_config(300)
    tensors = dict(init_modules(config)["0.1"])
    name = next(iter(tensors))
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match=r"expected torch.float32"):
        load_module_file(tmp_path / "bad.safetensors", config, "0.1")
    with pytest.raises(ValueError, match=r"missing"):
        load_module_file(tmp_path / "bad.safetensors", config, "1.0")


def test_the_zip_stream_is_a_valid_archive_and_the_same_for_the_same_files() -> None:
    payload = bytes(range(256)) * 5000  # 1.28 MB in 64 KiB chunks

    def entries() -> list[ZipEntry]:
        chunks = [payload[i : i + 65536] for i in range(0, len(payload), 65536)]
        return [
            ZipEntry("d/small.json", 2, lambda: iter([b"{}"])),
            ZipEntry("d/big.bin", len(payload), lambda: iter(chunks)),
        ]

    pieces = list(stream_zip(entries()))
    assert max(len(p) for p in pieces) < 2 * 65536  # streamed, never the whole archive
    archive = zipfile.ZipFile(io.BytesIO(b"".join(pieces)))
    assert archive.testzip() is None
    assert archive.read("d/big.bin") == payload and archive.read("d/small.json") == b"{}"
    assert b"".join(stream_zip(entries())) == b"".join(pieces)


def test_the_zip_stream_refuses_an_entry_shorter_than_announced() -> None:
    with pytest.raises(ValueError, match="expected 10 bytes, read 2"):
        list(stream_zip([ZipEntry("x", 10, lambda: iter([b"ab"]))]))


@pytest.mark.parametrize(("tied", "kv_heads"), [(False, 2), (True, 1)])
def test_the_path_model_is_transformers_llama_name_for_name_and_logit_for_logit(
    tied: bool, kv_heads: int
) -> None:
    """dipaco.model is plain torch; a path must still be transformers' LlamaForCausalLM:
    the same state-dict names and shapes, the same logits, the same body output, and with
    right padding (the router's featurizer) the same last hidden state."""
    from transformers import LlamaForCausalLM

    from dipaco.model import state_shapes

    config = _tied_config(300).model.model_copy(
        update={"tie_embeddings": tied, "num_kv_heads": kv_heads}
    )
    ours = build_model(config, seed=5).eval()
    theirs = LlamaForCausalLM(config.to_hf_config()).eval()
    expected = {name: tuple(t.shape) for name, t in theirs.state_dict().items()}
    assert state_shapes(config) == expected
    assert {name: tuple(t.shape) for name, t in ours.state_dict().items()} == expected
    theirs.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 300, (3, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # right padding
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(input_ids=ids).logits)
        torch.testing.assert_close(
            ours.model(input_ids=ids).last_hidden_state,
            theirs.model(input_ids=ids).last_hidden_state,
        )
        a = ours(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        b = theirs(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        assert a is not None and len(a) == len(b) == config.num_layers + 1
        torch.testing.assert_close(a[-1], b[-1])
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied


def test_the_same_seed_builds_the_same_path_model_and_leaves_the_global_rng_alone() -> None:
    config = _tied_config(300).model
    before = torch.random.get_rng_state()
    a, b, c = build_model(config, 1), build_model(config, 1), build_model(config, 2)
    assert torch.equal(torch.random.get_rng_state(), before)
    for name, tensor in a.state_dict().items():
        assert torch.equal(tensor, b.state_dict()[name]), name
    weight = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(a.state_dict()[weight], c.state_dict()[weight])
    assert abs(float(a.state_dict()[weight].std()) - 0.02) < 0.002  # transformers' init
    assert torch.equal(a.state_dict()["model.norm.weight"], torch.ones(config.hidden_size))
