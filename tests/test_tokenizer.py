"""The run tokenizer: byte-level BPE trained on the stdlib, saved as a Hugging Face
directory that transformers opens offline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from dipaco.data.corpus import Document, load_corpus
from dipaco.tokenizer import EOT, TOKENIZER_FILES, RunTokenizer, train_tokenizer

VARIED_TEXTS = [
    "",
    "def f(x):\n    return x + 1\n",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nwindows newlines\r\n",
    "unicode: héllo wörld, Καλημέρα, 日本語のテキスト, emoji 😀🧪, combining e\u0301",
    "control \x00\x01\x7f and a lone\nnewline",
    "a document that mentions <|endoftext|> in its text",
    "punctuation spacing : ; , . ! ? ' \"",
]


@pytest.fixture(scope="module")
def stdlib_docs() -> list[Document]:
    return load_corpus("stdlib", max_files=40, val_fraction=0.0).train


@pytest.fixture(scope="module")
def tokenizer(stdlib_docs: list[Document]) -> RunTokenizer:
    return train_tokenizer(stdlib_docs, vocab_size=512, max_chars=300_000)


@pytest.mark.parametrize("text", VARIED_TEXTS)
def test_decode_inverts_encode_on_varied_text(tokenizer: RunTokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_text_that_spells_the_separator_does_not_encode_to_it(tokenizer: RunTokenizer) -> None:
    ids = tokenizer.encode(f"before {EOT} after")
    assert tokenizer.separator_id not in ids


def test_training_reaches_the_vocab_size_and_reserves_the_separator(
    tokenizer: RunTokenizer,
) -> None:
    assert tokenizer.vocab_size == 512
    assert tokenizer.backend.id_to_token(tokenizer.separator_id) == EOT
    code = "import os\nimport sys\n\n\nclass Foo:\n    def __init__(self):\n        pass\n"
    assert len(tokenizer.encode(code)) < 0.75 * len(code.encode())  # merges learned from code


def test_training_is_deterministic(stdlib_docs: list[Document], tokenizer: RunTokenizer) -> None:
    again = train_tokenizer(stdlib_docs, vocab_size=512, max_chars=300_000)
    assert again.fingerprint == tokenizer.fingerprint


def test_a_saved_tokenizer_loads_back_with_the_same_ids(
    tokenizer: RunTokenizer, tmp_path: Path
) -> None:
    tokenizer.save(tmp_path)
    loaded = RunTokenizer.load(tmp_path)
    assert loaded.fingerprint == tokenizer.fingerprint
    assert loaded.separator_id == tokenizer.separator_id
    for text in VARIED_TEXTS:
        assert loaded.encode(text) == tokenizer.encode(text)


def test_auto_tokenizer_opens_the_saved_directory_offline(
    tokenizer: RunTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(TOKENIZER_FILES)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token == EOT
    assert hf.eos_token_id == tokenizer.separator_id
    assert len(hf) == tokenizer.vocab_size
    for text in VARIED_TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text)
        assert hf.decode(ids) == text


def test_it_opens_a_foreign_directory_through_transformers(
    tokenizer: RunTokenizer, tmp_path: Path
) -> None:
    # GPT-2's layout: vocab.json + merges.txt, no tokenizer.json.
    tokenizer.backend.model.save(str(tmp_path))
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": EOT, "bos_token": EOT}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = RunTokenizer.load(tmp_path)
    assert loaded.separator == EOT
    assert loaded.decode(loaded.encode("def f(x):\n    return x\n")) == "def f(x):\n    return x\n"


def test_it_refuses_a_tokenizer_without_the_separator() -> None:
    bare = Tokenizer(models.BPE())
    with pytest.raises(ValueError, match="no '<\\|endoftext\\|>' token"):
        RunTokenizer(bare)


def test_it_refuses_a_vocab_too_small_for_bytes(stdlib_docs: list[Document]) -> None:
    with pytest.raises(ValueError, match="at least 258"):
        train_tokenizer(stdlib_docs, vocab_size=100)
