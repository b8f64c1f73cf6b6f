"""Preparing data and modules: what happens between a run's `start` and its first round.

`prepare_run` takes a run from ``preparing`` to ``ready`` in five stages, each reported in
``Run.progress`` as it starts ({"stage", "step", "steps", "detail", "updated_at"}):

1. ``corpus``     read and split the corpus (the run's dataset, else ``data.corpus``);
2. ``tokenizer``  train the run's BPE tokenizer (``model.vocab_size``);
3. ``router``     fit the tf-idf router over the paths (skipped with one path);
4. ``shards``     tokenise, route and write each path's train/val token files;
5. ``modules``    initialise every module from ``seed`` as version 0;

and uploads everything under DESIGN §5's keys: ``runs/<run>/tokenizer.json``,
``router.safetensors``, ``data/<path>/{train,val}.bin`` (plus ``data/index.json``, the
shard index: dtype, token counts and sha256 per file), ``modules/<m>/v0.safetensors``.
Each stage is deterministic (seeded), so a retried preparation writes the same blobs;
version 0 of a module that already has one is kept.

With ``phase1`` (DESIGN §1, runs.phases) the router waits for the dense model: the data is
one shard of every document and the modules are phase 1's, under ``runs/<run>/phase1/``,
and the documents are also kept in chunks there for runs.between. With an uploaded dense
checkpoint (runs.checkpoint) the modules start from it, its tokenizer (when uploaded)
replaces training one, and a "base-lm" router reads its features.

`prepare_dataset` reads a dataset's corpus once and records its statistics, so an
operator sees what a source holds (and whether it is readable) before a run uses it.

Module files, the format of every stored module version (weights and outer momentum),
are defined here too: plain safetensors of fp32 tensors in `module_spec` order, whose
header is a function of the spec alone, so a reader checks it byte for byte instead of
parsing it. `ModuleWriter` and `ModuleReader` stream them in chunks of any size (the
outer step never holds a whole version), hashing as they go; `safetensors.torch.load_file`
and `transformers` read them as they are.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from django.conf import settings
from django.utils import timezone
from torch import Tensor

from dipaco_server.runs import keys, phases
from dipaco_server.runs.checkpoint import base_model, load_base_state
from dipaco_server.runs.models import Dataset, Module, ModuleVersion, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.services import publish_module_version, transition
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)

RUN_STAGES = ("corpus", "tokenizer", "router", "shards", "modules")
# Documents per embedding task after phase 1: at most MAX_CHUNKS tasks, none tiny.
MIN_CHUNK_DOCS, MAX_CHUNKS = 256, 64
DATASET_PROGRESS_EVERY = 1000  # documents between two progress updates of prepare_dataset
Spec = Mapping[str, tuple[tuple[int, ...], torch.dtype]]  # dipaco.modular.module_spec


def data_index_key(run_id: int, phase: int = 2) -> str:
    """runs/<run>/data/index.json: the shard index (dtype, tokens and sha256 per file)."""
    return keys.data_index_key(run_id, phase)


def report_progress(target: Run | Dataset, stage: str, step: int, steps: int, detail: str) -> None:
    """Record what a preparation is doing now, for the API and the dashboard."""
    now = timezone.now()
    progress = {
        "stage": stage,
        "step": step,
        "steps": steps,
        "detail": detail,
        "updated_at": now.isoformat(),
    }
    type(target).objects.filter(pk=target.pk).update(progress=progress, updated_at=now)
    target.progress = progress
    logger.info(
        "%s %s: [%d/%d] %s: %s", type(target).__name__, target.pk, step, steps, stage, detail
    )


def prepare_run(run: Run, *, store: BlobStore | None = None, max_files: int | None = None) -> Run:
    """Data, tokenizer, router and version 0 of every module; then the run is ready.

    With ``phase1`` the data is one shard of every document (plus the documents in chunks,
    for routing after phase 1) and the modules are the dense phase's (runs.phases); with
    an uploaded dense checkpoint (runs.checkpoint) it routes with the checkpoint's features
    when ``router.featurizer`` is "base-lm", and every module starts from its layers.
    `max_files` reads only the first files of the corpus (sorted), for demos and tests.
    """
    from dipaco.data.corpus import load_corpus
    from dipaco.data.shards import build_shards
    from dipaco.data.tokenizer import RunTokenizer, train_tokenizer
    from dipaco.modular import init_modules, init_modules_from_base
    from dipaco.routing.router import Router

    run.refresh_from_db()
    if run.state == Run.State.DRAFT:
        transition(run, Run.State.PREPARING)
    elif run.state != Run.State.PREPARING:
        logger.info("run %s is %s, not preparing; nothing to do", run.pk, run.state)
        return run
    store = store or get_blob_store()
    config = run.run_config
    paths = config.num_paths
    dense = config.phase1 is not None
    has_base = not dense and store.exists(keys.base_model_key(run.pk))
    if paths > 1 and config.router.featurizer == "base-lm" and not (dense or has_base):
        raise ValueError(
            "router.featurizer = 'base-lm' routes with a base model, and this run has none: "
            "set phase1 to train one first, upload a dense checkpoint (POST "
            "/api/v1/runs/<id>/checkpoint), or use 'tfidf'"
        )
    corpus = run.dataset.source if run.dataset is not None else config.data.corpus
    steps = len(RUN_STAGES)
    work = Path(tempfile.mkdtemp(prefix=f"prepare-{run.pk}-", dir=work_root()))
    try:
        report_progress(run, "corpus", 1, steps, f"reading {corpus}")
        split = load_corpus(
            corpus,
            text_field=config.data.text_field,
            val_fraction=config.data.val_fraction,
            max_files=max_files,
        )
        counts = f"{len(split.train)} train and {len(split.val)} validation documents"
        uploaded = has_base and store.exists(keys.base_tokenizer_key(run.pk))
        if uploaded:  # the checkpoint's own: its token ids are what its embedding rows mean
            report_progress(run, "tokenizer", 2, steps, f"{counts}; the checkpoint's tokenizer")
            store.download_to(keys.base_tokenizer_key(run.pk), work / "base-tokenizer.json")
            tokenizer = RunTokenizer.load(work / "base-tokenizer.json")
        else:
            report_progress(run, "tokenizer", 2, steps, f"{counts}; training the tokenizer")
            tokenizer = train_tokenizer(split.train, config.model.vocab_size)
        store.put_file(
            keys.tokenizer_key(run.pk), tokenizer.save(work / "tokenizer") / "tokenizer.json"
        )
        base_state = load_base_state(store, run.pk, config, work) if has_base else None
        router = None
        if dense:
            report_progress(run, "router", 3, steps, "phase 1 first: its model will route")
        elif paths > 1:
            report_progress(run, "router", 3, steps, f"fitting a {config.router.method} router")
            lm = config.router.featurizer == "base-lm"
            router = Router.fit(
                [doc.text for doc in split.train],
                tokenizer,
                factors=config.layout.modules_per_level,
                featurizer=config.router.featurizer,
                method=config.router.method,
                prefix_tokens=config.router.prefix_tokens,
                max_imbalance=config.router.max_imbalance,
                seed=config.router.seed,
                model=base_model(base_state, config) if lm and base_state else None,
            )
            store.put_file(keys.router_key(run.pk), router.save(work / "router"))
        else:
            report_progress(run, "router", 3, steps, "one path: no router")
        report_progress(run, "shards", 4, steps, f"tokenising and routing {counts}")
        shard_dir = work / "data"
        phase = phases.DENSE if dense else phases.PATHS
        shard_paths = 1 if dense else paths
        index = build_shards(
            split.train, split.val, tokenizer, router, shard_dir, num_paths=shard_paths,
            progress=False,
        )  # fmt: skip
        upload_shards(run, store, index, shard_dir, phase)
        if dense:
            write_document_chunks(run, store, split.train, split.val, work)
        report_progress(run, "modules", 5, steps, "initialising modules as version 0")
        if dense:
            modules = init_modules(config.dense_phase)
        elif base_state is not None:
            modules = init_modules_from_base(config, base_state)
        else:
            modules = init_modules(config)
        init_module_versions(run, store, work, modules, phase)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    transition(run, Run.State.READY)
    report_progress(run, "done", steps, steps, "ready to start")
    return run


def work_root() -> Path:
    """Scratch space for preparation, outer steps and evaluation: on the data dir's disk,
    not in a RAM-backed /tmp (an outer step keeps a round's uploads there)."""
    root = Path(settings.DIPACO_DATA_DIR) / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def upload_shards(run: Run, store: BlobStore, index: Any, shard_dir: Path, phase: int) -> None:
    """One phase's shards and shard index, uploaded; each Path row gets its token counts
    and routing share (runs.between writes phase 2's after phase 1)."""
    total_docs = sum(entry["train"].docs for entry in index.paths) or 1
    for p, entry in enumerate(index.paths):
        for split in ("train", "val"):
            key = keys.data_key(run.pk, p, split, phase)
            store.put_file(key, shard_dir / entry[split].file)
        RunPath.objects.filter(run=run, phase=phase, index=p).update(
            train_tokens=entry["train"].tokens,
            val_tokens=entry["val"].tokens,
            routing_share=entry["train"].docs / total_docs,
        )
        if entry["val"].tokens <= 1:
            logger.warning("run %s path %d has no validation text: it cannot stop early", run.pk, p)
    store.put_file(data_index_key(run.pk, phase), shard_dir / "index.json")


def write_document_chunks(
    run: Run, store: BlobStore, train: Sequence[Any], val: Sequence[Any], work: Path
) -> int:
    """The corpus split as JSONL chunks (runs.keys.documents_key), for the router fitted
    after phase 1: each chunk is embedded by its own task. Returns the number of chunks."""
    docs = [("train", d.text) for d in train] + [("val", d.text) for d in val]
    size = max(MIN_CHUNK_DOCS, math.ceil(len(docs) / MAX_CHUNKS))
    chunks = max(1, math.ceil(len(docs) / size))
    for i in range(chunks):
        file = work / f"documents-{i}.jsonl"
        with open(file, "w", encoding="utf-8") as out:
            for split, text in docs[i * size : (i + 1) * size]:
                out.write(json.dumps({"split": split, "text": text}) + "\n")
        store.put_file(keys.documents_key(run.pk, i), file)
        file.unlink()
    Run.objects.filter(pk=run.pk).update(phase_chunks=chunks)
    return chunks


def init_module_versions(
    run: Run, store: BlobStore, work: Path, modules: dict[str, dict[str, Tensor]], phase: int
) -> None:
    """Version 0 of every module of one phase, from `modules` (module id -> tensors)."""
    for module in Module.objects.filter(run=run, phase=phase).order_by("pk"):
        if ModuleVersion.objects.filter(module=module, version=0).exists():
            continue  # a retried preparation: version 0 is immutable
        file = work / f"{module.module_id}.safetensors"
        sha256, size = write_module(file, modules.pop(module.module_id))
        key = keys.module_key(run.pk, module.module_id, 0, phase)
        store.put_file(key, file)
        publish_module_version(module, 0, blob_key=key, sha256=sha256, size=size)
        file.unlink()


def prepare_dataset(dataset: Dataset) -> Dataset:
    """Read the dataset's corpus once: its files, documents and characters, and what was skipped."""
    from dipaco.data.corpus import CorpusStats, iter_corpus

    now = timezone.now()
    Dataset.objects.filter(pk=dataset.pk).update(
        state=Dataset.State.PREPARING, error="", updated_at=now
    )
    stats = CorpusStats()
    report_progress(dataset, "corpus", 0, 1, f"reading {dataset.source}")
    for count, _ in enumerate(iter_corpus(dataset.source, stats), start=1):
        if count % DATASET_PROGRESS_EVERY == 0:
            report_progress(dataset, "corpus", 0, 1, f"{count} documents read")
    if stats.documents == 0:
        raise ValueError(
            f"corpus {dataset.source!r} holds no readable text ({stats.files} files, "
            f"skipped {dict(stats.skipped)}); point the dataset at text files or a .jsonl"
        )
    dataset.stats = {
        "files": stats.files,
        "documents": stats.documents,
        "chars": stats.chars,
        "ignored": stats.ignored,
        "skipped": dict(stats.skipped),
        "skipped_examples": stats.skipped_examples,
    }
    dataset.state = Dataset.State.READY
    Dataset.objects.filter(pk=dataset.pk).update(
        stats=dataset.stats, state=dataset.state, updated_at=timezone.now()
    )
    report_progress(dataset, "done", 1, 1, f"{stats.documents} documents, {stats.chars} characters")
    return dataset


def fail_dataset(dataset: Dataset, error: str) -> None:
    Dataset.objects.filter(pk=dataset.pk).update(
        state=Dataset.State.FAILED, error=error, updated_at=timezone.now()
    )


# --- module files -----------------------------------------------------------------------


class CorruptModule(ValueError):
    """A stored module version that is not what the database says it is."""


def module_header(spec: Spec) -> bytes:
    """The safetensors header of a module file: a function of the spec alone, byte for byte."""
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (shape, _) in spec.items():
        size = 4 * math.prod(shape)
        entries[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors aligns the data to 8 bytes
    return struct.pack("<Q", len(text)) + text


def module_bytes(spec: Spec) -> int:
    return len(module_header(spec)) + 4 * sum(math.prod(shape) for shape, _ in spec.values())


class ModuleWriter:
    """Writes a module file sequentially: the tensors of `spec` in order, in any chunks."""

    def __init__(self, path: Path, spec: Spec) -> None:
        self.path = path
        self._expected = module_bytes(spec)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close or __exit__)
        self._digest = hashlib.sha256()
        self._size = 0
        self._put(memoryview(module_header(spec)))

    def _put(self, data: memoryview) -> None:
        self._digest.update(data)
        self._file.write(data)
        self._size += data.nbytes

    def write(self, values: Tensor) -> None:
        """The next values of the current tensor (flat, any length, cast to fp32)."""
        flat = values.detach().to(torch.float32).contiguous().view(-1)
        self._put(flat.view(torch.uint8).numpy().data)

    def close(self) -> tuple[str, int]:
        """(sha256, size) of the complete file; raises if fewer or more values came."""
        self._file.close()
        if self._size != self._expected:
            raise ValueError(f"{self.path}: wrote {self._size} B of a {self._expected} B module")
        return self._digest.hexdigest(), self._size

    def __enter__(self) -> ModuleWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._file.close()
        if kind is not None:
            self.path.unlink(missing_ok=True)


class ModuleReader:
    """Reads a module file sequentially; `finish` checks it was whole and matched `sha256`."""

    def __init__(self, path: Path, spec: Spec, sha256: str | None = None) -> None:
        self.path, self.sha256 = path, sha256
        header = module_header(spec)
        self._file = open(path, "rb")  # noqa: SIM115 (closed by finish or __exit__)
        self._left = os.fstat(self._file.fileno()).st_size - len(header)
        self._digest = hashlib.sha256()
        if self._left + len(header) != module_bytes(spec) or self._file.read(len(header)) != header:
            self._file.close()
            raise CorruptModule(
                f"{path} is not a module file of this spec (size or header); module versions "
                "are written by runs.prepare.write_module (plain fp32 safetensors)"
            )
        self._digest.update(header)

    def read(self, count: int) -> Tensor:
        values = torch.empty(count, dtype=torch.float32)  # (count,)
        view = values.view(torch.uint8).numpy().data  # the tensor's bytes, written in place
        if 4 * count > self._left or self._file.readinto(view) != 4 * count:
            raise CorruptModule(f"{self.path} ended early")
        self._digest.update(view)
        self._left -= 4 * count
        return values

    def finish(self) -> None:
        self._file.close()
        if self._left:
            raise CorruptModule(f"{self.path}: {self._left} B were left unread")
        if self.sha256 is not None and self._digest.hexdigest() != self.sha256:
            raise CorruptModule(f"{self.path} does not match its recorded sha256")

    def __enter__(self) -> ModuleReader:
        return self

    def __exit__(self, *_: object) -> None:
        self._file.close()


def write_module(path: Path, tensors: Mapping[str, Tensor]) -> tuple[str, int]:
    """Write whole tensors as a module file; returns (sha256, size)."""
    spec = {name: (tuple(t.shape), torch.float32) for name, t in tensors.items()}
    with ModuleWriter(path, spec) as writer:
        for tensor in tensors.values():
            writer.write(tensor)
        return writer.close()


def read_module(path: Path, spec: Spec, sha256: str | None = None) -> dict[str, Tensor]:
    """A whole module file as tensors of the spec's shapes, checked against `sha256`."""
    with ModuleReader(path, spec, sha256) as reader:
        tensors = {
            name: reader.read(math.prod(shape)).view(shape) for name, (shape, _) in spec.items()
        }
        reader.finish()
    return tensors
