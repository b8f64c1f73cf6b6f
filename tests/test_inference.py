"""Inference end to end: a short real training, published to the control plane, downloaded.

The training is the library's own (tokenizer, router, shards, one outer round of
train_path on every path), done once per session; each test publishes it to a fresh run
on the real database and the local blob store behind a live server, then goes through
HTTP as a user would. Also home of the builders test_inference_api.py shares
(`trained`, `served`, `run_cli`).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import random
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save as safetensors_bytes

import dipaco
from dipaco.cli import download, generate, route
from dipaco.config import LayoutConfig, RunConfig
from dipaco.data.corpus import Document
from dipaco.data.shards import ShardIndex, build_shards
from dipaco.inner import train_path
from dipaco.model import build_model
from dipaco.modular import Modules, assemble_path_state, init_modules, module_ids, paths_through
from dipaco.outer import aggregate, outer_step
from dipaco.routing.router import Router
from dipaco.tokenizer import RunTokenizer, train_tokenizer

_WORDS = {  # four kinds of text, so the router has four clusters to find
    "sea": "ship wave tide harbour sail anchor gull reef storm deck salt current",
    "code": "def return import class self lambda yield print range list dict none",
    "food": "bread butter soup onion garlic oven bake salt pepper cheese apple pie",
    "math": "prime integer proof lemma theorem matrix vector sum limit zero one two",
}
TOPICS = {topic: words.split() for topic, words in _WORDS.items()}


@dataclass
class Trained:
    config: RunConfig
    tokenizer: RunTokenizer
    tokenizer_json: bytes
    router_file: bytes
    shard_dir: Path
    shards: ShardIndex
    train_docs: list[Document]
    versions: list[Modules]  # versions[t]: every module after t outer steps (round t - 1)
    val_loss: list[float]  # per path, of the last version


def _documents(per_topic: int, seed: int) -> list[Document]:
    rng = random.Random(seed)
    docs = []
    for topic, words in TOPICS.items():
        for i in range(per_topic):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(40, 70)))
            docs.append(Document(id=f"{topic}-{seed}-{i}", text=text + ".\n", source=topic))
    return docs


def _val_loss(config: RunConfig, p: int, modules: Modules, shard: Any) -> float:
    model = build_model(config.model, 0)
    model.load_state_dict(assemble_path_state(config, p, modules))
    seq = config.model.seq_len
    tokens = torch.from_numpy(shard.read_window(0, min(len(shard), 4 * seq + 1)).astype(np.int64))
    windows = tokens[: (tokens.numel() - 1) // seq * seq + 1]
    inputs = windows[:-1].view(-1, seq)  # (N, T)
    targets = windows[1:].view(-1, seq)  # (N, T)
    with torch.no_grad():
        logits = model(inputs).logits  # (N, T, V)
    return float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@cache
def trained() -> Trained:
    """Tokenizer, router and shards of a small corpus, and two outer rounds on every path."""
    import tempfile

    train_docs, val_docs = _documents(24, seed=1), _documents(4, seed=2)
    tokenizer = train_tokenizer(train_docs, vocab_size=320)
    config = RunConfig.tiny(
        name="infer",
        rounds=2,
        model={
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 128,
            "vocab_size": tokenizer.vocab_size,
            "seq_len": 32,
        },
        layout=LayoutConfig.grid(2, levels=2, modules=2),
        inner={"steps": 4, "warmup_steps": 1, "micro_batch_size": 4, "grad_accum_steps": 1},
    )
    work = Path(tempfile.mkdtemp(prefix="dipaco-inference-test-"))
    router = Router.fit([d.text for d in train_docs], tokenizer, factors=(2, 2), seed=0)
    shards = build_shards(train_docs, val_docs, tokenizer, router, work / "shards", progress=False)
    tokenizer.save(work / "tokenizer")
    router.save(work / "router")
    versions = [init_modules(config)]
    momentum: Modules = {}
    for t in range(config.rounds):
        deltas: dict[str, list[tuple[dict[str, torch.Tensor], int]]] = {}
        for p in range(config.num_paths):
            source = shards.open(work / "shards", p, "train")
            result = train_path(config, p, versions[t], source, round_index=t)
            for module_id, delta in result.module_deltas.items():
                deltas.setdefault(module_id, []).append((delta, result.tokens))
        after: Modules = {}
        for module_id in module_ids(config):
            through = len(paths_through(config, module_id))
            mean = aggregate(deltas[module_id], config.outer, paths_through=through)
            after[module_id], momentum[module_id] = outer_step(
                versions[t][module_id], mean, momentum.get(module_id), config.outer
            )
        versions.append(after)
    val = [
        _val_loss(config, p, versions[-1], shards.open(work / "shards", p, "val"))
        for p in range(config.num_paths)
    ]
    return Trained(
        config=config,
        tokenizer=tokenizer,
        tokenizer_json=(work / "tokenizer" / "tokenizer.json").read_bytes(),
        router_file=(work / "router" / "router.safetensors").read_bytes(),
        shard_dir=work / "shards",
        shards=shards,
        train_docs=train_docs,
        versions=versions,
        val_loss=val,
    )


def publish(t: Trained, *, versions: int = 3, name: str | None = None) -> Any:
    """A running run holding `t`: tokenizer, router, module versions 0..versions-1 and the
    last round's validation loss (versions - 2: round t's outer step writes version t + 1)."""
    from dipaco_server.runs import keys
    from dipaco_server.runs.services import create_run, record_metric, transition
    from dipaco_server.runs.versions import publish_module_version
    from dipaco_server.storage import get_blob_store

    config = t.config.model_dump(mode="json")
    config["name"] = name or t.config.name
    run = create_run(config["name"], config)
    store = get_blob_store()
    store.put_bytes(keys.tokenizer_key(run.pk), t.tokenizer_json)
    store.put_bytes(keys.router_key(run.pk), t.router_file)
    for module in run.modules.all():
        for v in range(versions):
            data = safetensors_bytes(t.versions[v][module.module_id])
            key = keys.module_key(run.pk, module.module_id, v)
            store.put_bytes(key, data)
            sha256 = hashlib.sha256(data).hexdigest()
            publish_module_version(module, v, blob_key=key, sha256=sha256, size=len(data))
    total = sum(t.shards.info(p, "train").docs for p in range(t.config.num_paths))
    for path in run.paths.all():
        info = t.shards.info(path.index, "train")
        path.routing_share, path.train_tokens = info.docs / total, info.tokens
        if versions == len(t.versions):
            last = versions - 2
            path.best_val_loss, path.best_round = t.val_loss[path.index], last
            record_metric(run, "val_loss", t.val_loss[path.index], path=path, round=last)
        path.save()
    for state in ("preparing", "ready", "running"):
        transition(run, state)
    return run


@pytest.fixture
def served(transactional_db: None, live_server: Any, settings: Any) -> str:
    """The live server's URL; blob URLs point at it too."""
    settings.DIPACO_PUBLIC_URL = live_server.url
    settings.DIPACO_PUBLIC_READ = True
    return str(live_server.url)


def run_cli(*argv: str) -> int:
    """The download/route/generate commands through their own register() functions."""
    parser = argparse.ArgumentParser(prog="dipaco")
    subparsers = parser.add_subparsers()
    for module in (download, route, generate):
        module.register(subparsers)
    args = parser.parse_args(argv)
    return int(args.func(args))


def library_logits(t: Trained, p: int, version: int, ids: torch.Tensor) -> torch.Tensor:
    model = build_model(t.config.model, 0)
    model.load_state_dict(assemble_path_state(t.config, p, t.versions[version]))
    with torch.no_grad():
        return model.eval()(ids).logits  # (1, T, V)


def sharded_path(t: Trained, doc: Document) -> int:
    """The path whose train shard holds the document's tokens (separator + ids)."""
    dtype = np.dtype(t.shards.dtype)
    needle = np.array([t.tokenizer.separator_id, *t.tokenizer.encode(doc.text)], dtype).tobytes()
    found = []
    for p in range(t.config.num_paths):
        haystack = (t.shard_dir / t.shards.info(p, "train").file).read_bytes()
        at = haystack.find(needle)
        while at >= 0 and at % dtype.itemsize:  # a match must start on a token boundary
            at = haystack.find(needle, at + 1)
        if at >= 0:
            found.append(p)
    assert len(found) == 1, f"document {doc.id} found in shards {found}"
    return found[0]


# --- the done-when tests ----------------------------------------------------------------


def test_a_downloaded_path_loads_with_transformers_and_matches_the_library_logits(
    served: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = trained()
    run = publish(t)
    p = 2
    out = tmp_path / "path2"
    assert (
        run_cli(
            "download",
            "--server",
            served,
            "--run",
            str(run.pk),
            "--path",
            str(p),
            "--out",
            str(out),
        )
        == 0
    )
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = t.train_docs[0].text[:80]
    assert tokenizer.encode(text) == t.tokenizer.encode(text)
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(text)]])  # (1, T)
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    expected = library_logits(t, p, 2, ids)
    assert not torch.equal(expected, library_logits(t, p, 1, ids))  # the last round moved it
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    generated = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert generated.shape == (1, ids.shape[1] + 8)
    assert isinstance(tokenizer.decode(generated[0, ids.shape[1] :]), str)
    card = (out / "README.md").read_text()
    assert f"perplexity {math.exp(t.val_loss[p]):.2f}" in card
    assert "| `0.1` | 2 |" in card  # path 2 = module 1 of level 0, version 2


def test_routing_a_training_document_returns_the_path_it_was_sharded_to(served: str) -> None:
    t = trained()
    run = publish(t)
    by_path: dict[int, Document] = {}
    for doc in t.train_docs:
        by_path.setdefault(sharded_path(t, doc), doc)
    assert len(by_path) == t.config.num_paths  # every path got documents
    for p, doc in sorted(by_path.items()):
        answer = httpx.post(f"{served}/api/v1/runs/{run.pk}/route", json={"text": doc.text})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["path"] == p
        assert body["modules"] == list(t.config.path_modules(p))
        assert max(range(len(body["scores"])), key=body["scores"].__getitem__) == p


def test_the_streamed_zip_and_the_cli_download_produce_identical_files(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = trained()
    run = publish(t)
    out = tmp_path / "cli"
    assert (
        run_cli(
            "download", "--server", served, "--run", str(run.pk), "--path", "1", "--out", str(out)
        )
        == 0
    )
    assert "assembled model.safetensors from 3 modules (sha256 verified)" in capsys.readouterr().err
    response = httpx.get(f"{served}/api/v1/runs/{run.pk}/paths/1/download")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(response.content))
    assert archive.testzip() is None
    folder = "infer-path-1-round-2"  # after round index 1: the second round, for people
    zipped = {
        info.filename.removeprefix(f"{folder}/"): archive.read(info) for info in archive.infolist()
    }
    downloaded = {f.name: f.read_bytes() for f in out.iterdir()}
    assert (
        set(zipped)
        == set(downloaded)
        == {
            "README.md",
            "config.json",
            "dipaco.json",
            "generation_config.json",
            "model.safetensors",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        }
    )
    for name, data in zipped.items():
        assert downloaded[name] == data, name


def test_download_again_fetches_only_what_is_missing_or_wrong(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = trained()
    run = publish(t)
    out = tmp_path / "resume"
    argv = ("download", "--server", served, "--run", str(run.pk), "--path", "3", "--out", str(out))
    assert run_cli(*argv) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    model_inode = (out / "model.safetensors").stat().st_ino
    (out / "config.json").unlink()
    (out / "README.md").write_text("edited")
    capsys.readouterr()
    assert run_cli(*argv) == 0
    log = capsys.readouterr().err
    assert "6 of 8 files already there; 2 to fetch" in log
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert (out / "model.safetensors").stat().st_ino == model_inode  # not rewritten
    assert not (out / ".dipaco-modules").exists()


def test_generate_routes_the_prompt_downloads_its_path_once_and_streams_text(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    t = trained()
    run = publish(t)
    doc = t.train_docs[-1]
    prompt = doc.text[:60]
    cache_dir = tmp_path / "cache"
    argv = (
        "generate",
        "--server",
        served,
        "--run",
        str(run.pk),
        prompt,
        "--cache-dir",
        str(cache_dir),
        "--max-new-tokens",
        "6",
        "--temperature",
        "0",
    )
    assert run_cli(*argv) == 0
    captured = capsys.readouterr()
    routed = int(captured.err.split("routed to path ")[1].split()[0])
    assert captured.out.startswith(prompt) and len(captured.out) > len(prompt)
    model, tokenizer = dipaco.load_path(served, run.pk, routed, cache_dir)
    assert "0 to fetch" in capsys.readouterr().err  # the cache served it
    ids = torch.tensor([[tokenizer.bos_token_id, *tokenizer.encode(prompt)]])
    greedy = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False
    )
    assert captured.out.rstrip("\n") == prompt + tokenizer.decode(
        greedy[0, ids.shape[1] :], skip_special_tokens=True
    )


def test_generate_re_routes_a_prompt_that_turns_to_another_topic_and_a_seed_fixes_it(
    served: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.test_generation import crossing

    t = trained()
    run = publish(t)
    prompt, first_path, second_path = crossing(t)
    common = ("generate", "--server", served, "--run", str(run.pk), prompt,
              "--cache-dir", str(tmp_path / "cache"), "--max-new-tokens", "8")  # fmt: skip
    assert run_cli(*common, "--temperature", "0", "--reroute-every", "4") == 0
    err = capsys.readouterr().err
    assert f"routed to path {first_path}" in err
    assert f"re-routed after 4 new tokens: path {first_path} -> {second_path}" in err
    assert f"paths used: {first_path}, {second_path}" in err
    sampled = (*common, "--temperature", "1.5", "--seed", "3", "--reroute-every", "4")
    outputs = []
    for _ in range(2):
        assert run_cli(*sampled) == 0
        outputs.append(capsys.readouterr())
    said = [[line for line in o.err.splitlines() if "path" in line] for o in outputs]
    assert outputs[0].out == outputs[1].out and said[0] == said[1]
    # --path: that downloaded path writes everything on its own
    assert run_cli(*common, "--path", str(first_path), "--reroute-every", "4") == 0
    assert "re-routed" not in capsys.readouterr().err
    assert run_cli(*common, "--reroute-every", "-1") == 2
