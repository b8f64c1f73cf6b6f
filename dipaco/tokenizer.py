"""The run's tokenizer: a byte-level BPE trained with `tokenizers`, or any
Hugging Face tokenizer directory, saved so that
``transformers.AutoTokenizer.from_pretrained(dir)`` opens it offline. Below both the
data pipeline (``dipaco.data``) and the router (``dipaco.routing``), which both tokenise:
it imports neither (tests/test_layers.py).

One special token, ``<|endoftext|>``, separates documents in the token shards and
doubles as BOS, EOS, UNK and PAD (GPT-2's convention). Encoding never adds
special tokens, and the literal text "<|endoftext|>" inside a document encodes
as ordinary text: only the shard writer places separators. So
``decode(encode(text)) == text`` for any string (byte-level BPE, no prefix space,
no clean-up of spaces).

The saved ``tokenizer_config.json`` names the class ``PreTrainedTokenizerFast``,
which transformers 4.x and 5.x both understand, so a downloaded path opens with
whichever version the user has.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
DEFAULT_TRAIN_CHARS = 4_000_000  # ~1 s of BPE training on one core, enough for a 4-16k vocab
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TextDocument(Protocol):
    """What the training sample reads of a document (``dipaco.data.corpus.Document``):
    the tokenizer sits below the data pipeline and the router, and imports neither."""

    @property
    def id(self) -> str: ...

    @property
    def text(self) -> str: ...


class RunTokenizer:
    """The tokenizer stored with a run. Wraps a `tokenizers.Tokenizer` (fast,
    batched, typed) and knows which id separates documents."""

    def __init__(self, backend: Tokenizer, separator: str = EOT) -> None:
        sep_id = backend.token_to_id(separator)
        if sep_id is None:
            raise ValueError(
                f"tokenizer has no {separator!r} token; train one with dipaco "
                "or pick a tokenizer whose EOS token is the document separator"
            )
        # A document that happens to contain the text "<|endoftext|>" must not
        # produce the separator id: only the shard writer places separators.
        backend.encode_special_tokens = True
        self.backend = backend
        self.separator = separator
        self.separator_id: int = sep_id

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (shard dtype depends on it)."""
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    @property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's canonical JSON, minus runtime padding and
        truncation settings. A router records it to refuse a different tokenizer."""
        state = json.loads(self.backend.to_str())
        state.pop("padding", None)
        state.pop("truncation", None)
        canonical = json.dumps(state, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # The Rust backend parallelises over the batch.
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=False)
        return [list(e.ids) for e in encodings]

    def encode_batch_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """encode_batch as uint32 arrays, without offsets or attention masks (the shard
        writer's hot loop: about half the time of encode_batch)."""
        encodings = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=False))

    def save(self, directory: str | os.PathLike[str]) -> Path:
        """Write a Hugging Face tokenizer directory (three JSON files)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        special = {
            "bos_token": self.separator,
            "eos_token": self.separator,
            "unk_token": self.separator,
            "pad_token": self.separator,
        }
        config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "add_bos_token": False,
            "add_eos_token": False,
            # Spaces before punctuation are data, not noise: keep decode exact.
            "clean_up_tokenization_spaces": False,
            # The same as encode_special_tokens above, for transformers users.
            "split_special_tokens": True,
            "model_max_length": 1_000_000,
        }
        _write_atomic(out / "tokenizer.json", self.backend.to_str(pretty=True))
        _write_atomic(out / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
        _write_atomic(out / "special_tokens_map.json", json.dumps(special, indent=2) + "\n")
        return out

    @classmethod
    def load(cls, directory: str | os.PathLike[str]) -> RunTokenizer:
        """Open a Hugging Face tokenizer directory (or a bare tokenizer.json).

        A directory without tokenizer.json (e.g. GPT-2's vocab.json + merges.txt)
        is converted through ``transformers.AutoTokenizer``; the separator is its
        EOS token.
        """
        path = Path(directory)
        file = path if path.is_file() else path / "tokenizer.json"
        if file.is_file():
            separator = EOT
            config_file = file.parent / "tokenizer_config.json"
            if config_file.is_file():
                eos = json.loads(config_file.read_text("utf-8")).get("eos_token")
                if isinstance(eos, dict):  # older configs store an AddedToken dict
                    eos = eos.get("content")
                if isinstance(eos, str):
                    separator = eos
            return cls(Tokenizer.from_file(str(file)), separator)
        if not path.is_dir():
            raise FileNotFoundError(f"no tokenizer at {path}; pass a directory with tokenizer.json")
        from dipaco.hf import transformers  # only for foreign formats: slow import

        hf = transformers().AutoTokenizer.from_pretrained(str(path))
        if hf.eos_token is None or not hasattr(hf, "backend_tokenizer"):
            raise ValueError(f"tokenizer at {path} has no fast backend with an EOS token")
        return cls(hf.backend_tokenizer, str(hf.eos_token))


def sample_texts(
    docs: Iterable[TextDocument], max_chars: int, *, max_doc_chars: int = 20_000
) -> list[str]:
    """A deterministic sample of about ``max_chars`` characters for BPE training:
    documents in order of a hash of their id (so every part of a sorted corpus is
    represented), each cut to ``max_doc_chars``."""
    ordered = sorted(docs, key=lambda d: hashlib.sha256(d.id.encode("utf-8")).digest())
    sample: list[str] = []
    total = 0
    for doc in ordered:
        if total >= max_chars:
            break
        text = doc.text[: min(max_doc_chars, max_chars - total)]
        sample.append(text)
        total += len(text)
    return sample


def train_tokenizer(
    docs: Iterable[TextDocument],
    vocab_size: int,
    *,
    max_chars: int = DEFAULT_TRAIN_CHARS,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> RunTokenizer:
    """Train a byte-level BPE on a bounded sample of ``docs``.

    ``vocab_size`` counts the 256 byte symbols and the separator; it must be at
    least 257 + 1 so that at least one merge is possible.
    """
    if vocab_size < 258:
        raise ValueError(
            f"vocab_size must be at least 258 (256 bytes + {EOT} + 1), got {vocab_size}"
        )
    return train_tokenizer_on(
        sample_texts(docs, max_chars), vocab_size, min_frequency=min_frequency,
        show_progress=show_progress,
    )  # fmt: skip


def train_tokenizer_on(
    texts: list[str], vocab_size: int, *, min_frequency: int = 2, show_progress: bool = False
) -> RunTokenizer:
    """Train the byte-level BPE on a sample already drawn (sample_texts, or the streaming
    pass's, dipaco.data.stream, which draws the same one)."""
    if vocab_size < 258:
        raise ValueError(
            f"vocab_size must be at least 258 (256 bytes + {EOT} + 1), got {vocab_size}"
        )
    if not texts:
        raise ValueError("no text to train the tokenizer on; check data.corpus")
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return RunTokenizer(backend, EOT)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
