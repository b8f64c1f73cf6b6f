"""The run's base model: the dense, path-size model phase 2 starts from (docs/design.md §1).

It is either phase 1's last weights (runs.between writes them) or a checkpoint an operator
uploads before the run starts (POST /api/v1/runs/<id>/checkpoint). Either way it is stored
at ``runs/<run>/base/model.safetensors`` in the format of a downloaded path's
model.safetensors (dipaco.inference.export_state: fp32, a tied LM head left out), and it
does two things: its mean last hidden state over a document's first tokens routes the
document (router.featurizer "base-lm"), and its layers initialise every module
(dipaco.modular.init_modules_from_base).

An uploaded file is untrusted (docs/design.md §7): it is read with safetensors only, never
``torch.load``, and refused unless every tensor's name and shape is the run's model's.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import Tensor

from dipaco.config import RunConfig
from dipaco.inference import model_metadata
from dipaco.model import build_model, state_shapes
from dipaco.modular import TIED_HEAD, TIED_TO
from dipaco.tokenizer import RunTokenizer
from dipaco_server.errors import ServiceError
from dipaco_server.runs import keys
from dipaco_server.storage import BlobStore

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit on the JSON header


class CheckpointInvalid(ServiceError):
    """details["field"]: what does not fit ("file", "tensors", or a tensor's name)."""

    code, status = "checkpoint_invalid", 422


def _refuse(field: str, message: str) -> CheckpointInvalid:
    return CheckpointInvalid(message, field=field)


def expected_shapes(config: RunConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors a dense checkpoint of this run holds (no tied head)."""
    shapes = state_shapes(config.model)
    if config.model.tie_embeddings:
        shapes.pop(TIED_HEAD)
    return shapes


def _header(file: Path) -> dict[str, Any]:
    """The safetensors JSON header, read by hand first: a file that is not safetensors (a
    pickle, say) is refused before any library parses it."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        raw = handle.read(8)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 2 <= length <= min(MAX_HEADER_BYTES, size - 8):
            raise _refuse(
                "file",
                "the checkpoint is not a safetensors file (no valid header); save the "
                "state dict with safetensors.torch.save_file (pickled .pt/.bin files are "
                "refused)",
            )
        try:
            header = json.loads(handle.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _refuse("file", "the checkpoint's safetensors header is not JSON") from None
    if not isinstance(header, dict):
        raise _refuse("file", "the checkpoint's safetensors header is not an object")
    header.pop("__metadata__", None)
    return header


def verify_checkpoint(file: Path, config: RunConfig) -> dict[str, Tensor]:
    """The checkpoint's tensors as fp32, or CheckpointInvalid naming what does not fit.

    Names and shapes must be the run's model's (``model.*`` settings); a tied LM head may
    be present (it must then equal the embedding) or left out; F32, F16 and BF16 are read.
    """
    header = _header(file)
    expected = expected_shapes(config)
    tied_head = config.model.tie_embeddings and TIED_HEAD in header
    names = set(header) - ({TIED_HEAD} if tied_head else set())
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or extra:
        listed = "; ".join(
            part
            for part in (
                f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "",
                f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}" if extra else "",
            )
            if part
        )
        raise _refuse(
            (missing or extra)[0],
            f"the checkpoint's tensors are not those of the run's model ({listed}); upload "
            "the state dict of a LlamaForCausalLM built from the run's model config",
        )
    for name, shape in expected.items():
        entry = header[name]
        given = tuple(entry.get("shape", ())) if isinstance(entry, dict) else ()
        if given != shape:
            raise _refuse(
                name,
                f"tensor {name} has shape {list(given)}, but the run's model needs "
                f"{list(shape)} (model.hidden_size, num_layers, vocab_size... must match)",
            )
        dtype = entry.get("dtype")
        if dtype not in FLOAT_DTYPES:
            raise _refuse(name, f"tensor {name} is {dtype}; use F32, F16 or BF16")
    try:
        with safe_open(str(file), framework="pt") as handle:
            state = {name: handle.get_tensor(name).to(torch.float32) for name in expected}
            head = handle.get_tensor(TIED_HEAD).to(torch.float32) if tied_head else None
    except (SafetensorError, OSError, ValueError) as exc:
        raise _refuse("file", f"the checkpoint could not be read as safetensors: {exc}") from None
    for name, tensor in state.items():
        if not bool(torch.isfinite(tensor).all()):
            raise _refuse(name, f"tensor {name} holds NaN or infinite values")
    if head is not None and not torch.equal(head, state[TIED_TO]):
        raise _refuse(TIED_HEAD, "model.tie_embeddings: lm_head.weight must equal the embedding")
    return state


def verify_tokenizer(data: bytes, config: RunConfig) -> Any:
    """The uploaded tokenizer.json as a RunTokenizer, or CheckpointInvalid (field "tokenizer").

    Parsed by the tokenizers library from JSON (no code runs); it must have the document
    separator and no more ids than the model's embedding rows (``model.vocab_size``).
    """
    try:
        tokenizer = RunTokenizer(Tokenizer.from_str(data.decode("utf-8")))
    except Exception as exc:  # tokenizers raises a plain Exception for JSON it cannot parse
        raise _refuse(
            "tokenizer",
            f"the tokenizer is not a Hugging Face tokenizer.json with the <|endoftext|> "
            f"separator ({exc}); upload the tokenizer.json the checkpoint was trained with",
        ) from None
    if tokenizer.vocab_size > config.model.vocab_size:
        raise _refuse(
            "tokenizer",
            f"the tokenizer has {tokenizer.vocab_size} ids but the model's embedding has "
            f"{config.model.vocab_size} rows (model.vocab_size)",
        )
    return tokenizer


def write_base_model(store: BlobStore, run_id: int, state: dict[str, Tensor], work: Path) -> str:
    """Store the base model (the export_state format) and return its key."""
    file = work / "base-model.safetensors"
    tensors = {name: t.detach().to(torch.float32).contiguous() for name, t in state.items()}
    save_file(tensors, str(file), metadata=model_metadata())
    key = keys.base_model_key(run_id)
    store.put_file(key, file)
    file.unlink()
    return key


def load_base_state(
    store: BlobStore, run_id: int, config: RunConfig, work: Path
) -> dict[str, Tensor]:
    """The stored base model's full state dict (a tied head put back), checked again."""
    file = work / "base-model.safetensors"
    store.download_to(keys.base_model_key(run_id), file)
    try:
        state = verify_checkpoint(file, config)
    finally:
        file.unlink(missing_ok=True)
    if config.model.tie_embeddings:
        state[TIED_HEAD] = state[TIED_TO]
    return state


def base_model(state: dict[str, Tensor], config: RunConfig) -> Any:
    """A LlamaForCausalLM holding `state`, in eval mode (for the base-lm featurizer)."""
    model = build_model(config.model, config.seed)
    model.load_state_dict(state)
    return model.eval()
