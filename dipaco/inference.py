"""A trained path as an ordinary Hugging Face model directory (docs/design.md §6: inference).

A path directory holds:

    config.json             transformers' LlamaConfig (RunConfig.model.hf_config())
    generation_config.json  the separator as BOS/EOS/PAD, sampling defaults
    model.safetensors       the path's modules assembled, fp32
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    README.md               the model card (run, path, module versions, losses, config)
    dipaco.json             the same facts for programs

so ``AutoModelForCausalLM.from_pretrained(dir)`` and ``AutoTokenizer.from_pretrained(dir)``
open it offline. The server (``dipaco_server.inference``) and ``dipaco download`` both
write model.safetensors with `write_model_file` from the same module tensors and the same
metadata, so the zip the server streams and a directory assembled on the user's machine
hold the same bytes; `dipaco download` checks that against the server's sha256.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dipaco.config import RunConfig

if TYPE_CHECKING:
    from torch import Tensor

# torch, safetensors and transformers are imported inside the functions that use them: the
# server imports this module when it starts, and those take seconds to import.

__all__ = [
    "CARD_FILE",
    "CONFIG_FILE",
    "GENERATION_CONFIG_FILE",
    "MODEL_FILE",
    "MODEL_FORMAT",
    "RUN_FILE",
    "export_state",
    "generation_config_json",
    "hf_config_json",
    "model_metadata",
    "open_path_dir",
    "sha256_file",
    "tokenizer_files",
    "write_model_file",
]

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CARD_FILE = "README.md"
RUN_FILE = "dipaco.json"
# Bump when equal inputs would give other model.safetensors bytes (the server cache key has it).
MODEL_FORMAT = "dipaco-path/1"
# Sampling defaults of generation_config.json: the usual small-LM choice (nanoGPT's sample.py
# uses temperature 0.8, top_k 200; a 32k-vocab model needs fewer candidates).
TEMPERATURE, TOP_K, MAX_NEW_TOKENS = 0.8, 50, 128
CHUNK = 1024 * 1024


def export_state(
    config: RunConfig, p: int, modules: Mapping[str, Mapping[str, Tensor]]
) -> dict[str, Tensor]:
    """Path p's state dict as saved: fp32, contiguous, without a tied LM head.

    transformers re-ties lm_head to the embedding from config.tie_word_embeddings, and
    safetensors refuses two names for one tensor, so the tied head is left out.
    """
    # torch: not when the server starts (the note under the imports)
    import torch

    from dipaco.modular import TIED_HEAD, assemble_path_state

    state = assemble_path_state(config, p, modules)  # checks names and shapes
    return {
        name: t.detach().to("cpu", torch.float32).contiguous()
        for name, t in state.items()
        if not (config.model.tie_embeddings and name == TIED_HEAD)
    }


def model_metadata() -> dict[str, str]:
    """safetensors metadata: only transformers' required format=pt. safetensors writes the
    metadata from a hash map in no fixed order, so a second key would make the bytes differ
    between two writes of the same tensors; what the file is, dipaco.json says."""
    return {"format": "pt"}


def write_model_file(
    config: RunConfig,
    p: int,
    modules: Mapping[str, Mapping[str, Tensor]],
    dest: str | os.PathLike[str],
) -> Path:
    """Write path p's model.safetensors to `dest` atomically; the same inputs give the same
    bytes (safetensors orders the tensors itself, and the metadata has one key)."""
    from safetensors.torch import save_file  # torch: the note under the imports

    dest = Path(dest)
    state = export_state(config, p, modules)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.close(fd)
    try:
        save_file(state, tmp, metadata=model_metadata())
        os.replace(tmp, dest)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return dest


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode("utf-8")


def hf_config_json(config: RunConfig, separator_id: int) -> bytes:
    """config.json: the run's LlamaConfig, ready for inference (KV cache on, fp32)."""
    raw = {
        **config.model.hf_config(),
        "bos_token_id": separator_id,
        "eos_token_id": separator_id,
        "pad_token_id": separator_id,
        "use_cache": True,  # the training config turns it off; generation wants it
        "dtype": "float32",  # transformers 5; 4.x reads torch_dtype
        "torch_dtype": "float32",
    }
    return _json_bytes(raw)


def generation_config_json(separator_id: int) -> bytes:
    """generation_config.json (transformers' GenerationConfig): stop at the document
    separator; sample by default."""
    return _json_bytes(
        {
            "bos_token_id": separator_id,
            "eos_token_id": separator_id,
            "pad_token_id": separator_id,
            "do_sample": True,
            "temperature": TEMPERATURE,
            "top_k": TOP_K,
            "max_new_tokens": MAX_NEW_TOKENS,
        }
    )


def tokenizer_files(tokenizer_json: bytes) -> tuple[dict[str, bytes], int]:
    """The tokenizer files of a path directory from the run's tokenizer.json, and the
    separator id; tokenizer.json is kept byte for byte, the two small files are
    RunTokenizer.save's."""
    # the tokenizers library: not when the server starts (the note under the imports)
    from tokenizers import Tokenizer

    from dipaco.tokenizer import TOKENIZER_FILES, RunTokenizer

    tokenizer = RunTokenizer(Tokenizer.from_str(tokenizer_json.decode("utf-8")))
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save(tmp)
        files = {name: (Path(tmp) / name).read_bytes() for name in TOKENIZER_FILES}
    files["tokenizer.json"] = tokenizer_json
    return files, tokenizer.separator_id


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def open_path_dir(directory: str | os.PathLike[str], *, device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer) of a path directory through transformers' Auto classes, offline."""
    # torch and transformers (seconds): only where a path is opened
    import torch

    from dipaco.hf import transformers

    hf = transformers()
    model: Any = hf.AutoModelForCausalLM.from_pretrained(
        str(directory), dtype=torch.float32, local_files_only=True
    )
    tokenizer = hf.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return model.to(device).eval(), tokenizer
