"""Between the phases (docs/design.md §1): from the dense phase-1 model to the first DiPaCo round.

After phase 1's last round closes, `runs.tasks.prepare_phase2` runs these steps as Celery
tasks, each recording ``Run.progress`` (stage, step/steps, detail) for the API and the
dashboard ("preparing phase 2: 3/8 chunks embedded"):

1. `begin`: the run's phase becomes "preparing" and phase 1's last weights are written as
   the base model (runs.checkpoint, ``runs/<run>/base/model.safetensors``);
2. `embed_chunk` (one task per chunk, in parallel): the base model's mean last hidden state
   over each document's first ``router.prefix_tokens`` tokens (the "base-lm" featurizer),
   for the document chunks prepare wrote (``runs/<run>/phase1/documents/<i>.jsonl``),
   saved as ``runs/<run>/phase1/features/<i>.safetensors``;
3. `finish`: the (product) k-means router fitted on those features and saved where
   phase 2 and inference read it (``router.safetensors``), the per-path shards written
   by that router (``data/<p>/{train,val}.bin``), version 0 of every phase-2 module
   copied from the base model's layers (dipaco.modular.init_modules_from_base); then the
   phase is 2 and round ``phase1.rounds`` opens.

Every step is idempotent (blobs are deterministic, version 0 is never rewritten, the round
opens once), so a retried or resent task is safe.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from django.db import transaction
from django.utils import timezone
from safetensors.torch import load_file, save_file
from torch import Tensor

from dipaco.data.corpus import Document
from dipaco.data.shards import build_shards
from dipaco.data.tokenizer import RunTokenizer
from dipaco.inference import export_state
from dipaco.modular import init_modules_from_base, module_spec
from dipaco.modules_file import read_module
from dipaco.routing.featurize import BaseLMFeaturizer, PrecomputedFeaturizer
from dipaco.routing.router import Router, prefix_ids
from dipaco_server.runs import keys, phases
from dipaco_server.runs.checkpoint import base_model, load_base_state, write_base_model
from dipaco_server.runs.evaluate import evaluate_start_or_log
from dipaco_server.runs.models import Module, ModuleVersion, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.prepare import (
    init_module_versions,
    report_progress,
    upload_shards,
    work_root,
)
from dipaco_server.runs.services import OPENABLE, TERMINAL
from dipaco_server.runs.signals import open_round
from dipaco_server.storage import BlobStore, get_blob_store

logger = logging.getLogger(__name__)

STAGES = ("base", "embed", "router", "shards", "modules")


def _work(run: Run, what: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"{what}-{run.pk}-", dir=work_root()))


def enter_preparing(run: Run) -> bool:
    """phase 1 -> preparing, once: True for the one caller that should send the tasks."""
    won = Run.objects.filter(pk=run.pk, phase=Run.Phase.DENSE).update(
        phase=Run.Phase.PREPARING,
        updated_at=timezone.now(),  # the stalled-run sweep's clock
    )
    run.refresh_from_db(fields=["phase"])
    return bool(won)


def begin(run: Run, *, store: BlobStore | None = None) -> int:
    """Write phase 1's last weights as the base model; returns the number of chunks."""
    store = store or get_blob_store()
    config = run.run_config
    dense = config.dense_phase
    report_progress(run, "base", 0, run.phase_chunks, "preparing phase 2: the base model")
    work = _work(run, "phase2-base")
    try:
        modules: dict[str, dict[str, Tensor]] = {}
        for module in Module.objects.filter(run=run, phase=phases.DENSE).order_by("pk"):
            row = ModuleVersion.objects.get(module=module, version=module.current_version)
            file = work / f"{module.module_id}.safetensors"
            store.download_to(row.blob_key, file)
            spec = module_spec(dense, module.module_id)
            modules[module.module_id] = read_module(file, spec, row.sha256)
            file.unlink()
        write_base_model(store, run.pk, export_state(dense, 0, modules), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _record_embedded(run, store)
    return run.phase_chunks


def _documents(store: BlobStore, run_id: int, chunk: int, work: Path) -> list[tuple[str, str]]:
    """(split, text) of every document of one chunk, in the order prepare wrote them."""
    file = work / f"documents-{chunk}.jsonl"
    store.download_to(keys.documents_key(run_id, chunk), file)
    with open(file, encoding="utf-8") as lines:
        docs = [(row["split"], row["text"]) for row in map(json.loads, lines)]
    file.unlink()
    return docs


def _tokenizer(store: BlobStore, run_id: int, work: Path) -> Any:
    file = work / "tokenizer.json"
    store.download_to(keys.tokenizer_key(run_id), file)
    return RunTokenizer.load(file)


def _featurizer(run: Run, store: BlobStore, tokenizer: Any, work: Path) -> Any:
    config = run.run_config
    model = base_model(load_base_state(store, run.pk, config, work), config)
    return BaseLMFeaturizer(
        model, tokenizer.separator_id, prefix_tokens=config.router.prefix_tokens
    )


def embed_chunk(run: Run, chunk: int, *, store: BlobStore | None = None) -> int:
    """Base-LM features of one document chunk, stored; returns how many documents."""
    store = store or get_blob_store()
    key = keys.features_key(run.pk, chunk)
    work = _work(run, f"phase2-embed-{chunk}")
    try:
        tokenizer = _tokenizer(store, run.pk, work)
        texts = [text for _, text in _documents(store, run.pk, chunk, work)]
        if not store.exists(key):  # a retried task: the features are written once
            featurizer = _featurizer(run, store, tokenizer, work)
            prefixes = prefix_ids(tokenizer, texts, run.run_config.router.prefix_tokens)
            features = featurizer.features(prefixes)  # (N, hidden_size) float64
            file = work / "features.safetensors"
            save_file({"features": features.contiguous()}, str(file))
            store.put_file(key, file)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _record_embedded(run, store)
    return len(texts)


def _record_embedded(run: Run, store: BlobStore) -> None:
    """Progress: chunks whose features exist, counted under a lock on the run row so that
    chunks finishing together never write a smaller count after a larger one."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        chunks = locked.phase_chunks
        done = sum(store.exists(keys.features_key(run.pk, i)) for i in range(chunks))
        report_progress(
            locked, "embed", done, chunks, f"preparing phase 2: {done}/{chunks} chunks embedded"
        )
    run.progress = locked.progress


def finish(run: Run, *, store: BlobStore | None = None) -> str:
    """Router, shards and phase-2 modules from the features; then phase 2's first round."""
    run.refresh_from_db()
    if run.state in TERMINAL:
        return str(run.state)
    store = store or get_blob_store()
    config = run.run_config
    chunks = run.phase_chunks
    work = _work(run, "phase2-finish")
    try:
        tokenizer = _tokenizer(store, run.pk, work)
        docs: list[tuple[str, str]] = []
        rows: list[Tensor] = []
        for i in range(chunks):
            docs.extend(_documents(store, run.pk, i, work))
            file = work / "features.safetensors"
            store.download_to(keys.features_key(run.pk, i), file)
            rows.append(load_file(str(file))["features"])
            file.unlink()
        features = torch.cat(rows)  # (documents, hidden_size)
        texts = [text for _, text in docs]
        prefixes = prefix_ids(tokenizer, texts, config.router.prefix_tokens)
        table = {tuple(p): x for p, x in zip(prefixes, features, strict=True)}
        train = [Document(str(i), t, "corpus") for i, (s, t) in enumerate(docs) if s == "train"]
        val = [Document(str(i), t, "corpus") for i, (s, t) in enumerate(docs) if s == "val"]
        router = None
        if config.num_paths > 1:
            report_progress(run, "router", chunks, chunks, "preparing phase 2: fitting the router")
            lm = PrecomputedFeaturizer(_featurizer(run, store, tokenizer, work), table)
            router = Router.fit(
                [d.text for d in train],
                tokenizer,
                factors=config.layout.modules_per_level,
                featurizer="base-lm",
                method=config.router.method,
                prefix_tokens=config.router.prefix_tokens,
                max_imbalance=config.router.max_imbalance,
                seed=config.router.seed,
                features=lm,
            )
            store.put_file(keys.router_key(run.pk), router.save(work / "router"))
        report_progress(run, "shards", chunks, chunks, "preparing phase 2: writing the shards")
        shard_dir = work / "data"
        index = build_shards(
            train, val, tokenizer, router, shard_dir, num_paths=config.num_paths, progress=False
        )
        upload_shards(run, store, index, shard_dir, phases.PATHS)
        report_progress(run, "modules", chunks, chunks, "preparing phase 2: modules from phase 1")
        base_state = load_base_state(store, run.pk, config, work)
        modules = init_modules_from_base(config, base_state)
        init_module_versions(run, store, work, modules, phases.PATHS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    RunPath.objects.filter(run=run, phase=phases.DENSE).update(state=RunPath.State.FINISHED)
    Run.objects.filter(pk=run.pk).update(phase=Run.Phase.PATHS)
    run.refresh_from_db()
    report_progress(run, "done", chunks, chunks, "phase 2: DiPaCo rounds")
    evaluate_start_or_log(run, store)  # the curves' phase-2 starting point
    if run.state not in OPENABLE:
        return str(run.state)
    open_round(run, phases.first_round(config))
    logger.info("run %s: phase 2 opened at round %d", run.pk, phases.first_round(config))
    return "opened"
