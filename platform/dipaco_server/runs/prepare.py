"""Preparing data and modules: what happens between a run's `start` and its first round.

`prepare_run` takes a run from ``preparing`` to ``ready`` in five stages, each reported in
``Run.progress`` as it starts ({"stage", "step", "steps", "detail", "updated_at"}):

1. ``corpus``     read and split the corpus (the run's dataset, else ``data.corpus``);
2. ``tokenizer``  train the run's BPE tokenizer (``model.vocab_size``);
3. ``router``     fit the tf-idf router over the paths (skipped with one path);
4. ``shards``     tokenise, route and write each path's train/val token files;
5. ``modules``    initialise every module from ``seed`` as version 0;

and uploads everything under docs/design.md §5's keys: ``runs/<run>/tokenizer.json``,
``router.safetensors``, ``data/<path>/{train,val}.bin`` (plus ``data/index.json``, the
shard index: dtype, token counts and sha256 per file), ``modules/<m>/v0.safetensors``.
Each stage is deterministic (seeded), so a retried preparation writes the same blobs;
version 0 of a module that already has one is kept.

With ``phase1`` (docs/design.md §1, runs.phases) the router waits for the dense model: the data is
one shard of every document and the modules are phase 1's, under ``runs/<run>/phase1/``,
and each piece's documents are kept for runs.between. With an uploaded dense
checkpoint (runs.checkpoint) the modules start from it, its tokenizer (when uploaded)
replaces training one, and a "base-lm" router reads its features.

`prepare_dataset` reads a dataset's corpus once and records its statistics, so an
operator sees what a source holds (and whether it is readable) before a run uses it.

Module files (every stored module version and momentum) are written with the library's
one format, dipaco.modules_file.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from dipaco.data.corpus import CorpusStats, iter_corpus
from dipaco_server.runs import keys, phases
from dipaco_server.runs.models import Dataset, Module, ModuleVersion, Run
from dipaco_server.runs.services import transition
from dipaco_server.runs.sources import check_source, s3_options
from dipaco_server.runs.stages import report_progress, upload_shards
from dipaco_server.runs.versions import publish_module_version
from dipaco_server.storage import BlobStore, get_blob_store

if TYPE_CHECKING:
    from torch import Tensor

    from dipaco.config import RunConfig

# torch (dipaco.modules_file, runs.checkpoint) is imported inside the functions that use it:
# every server process imports this module (data_index_key, work_root) at its start.

logger = logging.getLogger(__name__)

RUN_STAGES = ("corpus", "tokenizer", "router", "shards", "modules")
DATASET_PROGRESS_EVERY = 1000  # documents between two progress updates of prepare_dataset


def data_index_key(run_id: int, phase: int = 2) -> str:
    """runs/<run>/data/index.json: the shard index (dtype, tokens and sha256 per file)."""
    return keys.data_index_key(run_id, phase)


def prepare_run(run: Run, *, store: BlobStore | None = None, max_files: int | None = None) -> Run:
    """Data, tokenizer, router and version 0 of every module; then the run is ready.

    A run is prepared in pieces (runs.pieces): the corpus streams, a killed preparation
    resumes, and a later run with the same inputs reuses the work; runs.tasks runs the
    pieces as a Celery chord, this runs them here. With ``phase1`` the data is one shard of
    every document (each piece's documents are kept, for routing after phase 1) and the
    modules are the dense phase's (runs.phases). With an uploaded dense checkpoint
    (runs.checkpoint) it routes with the checkpoint's features when ``router.featurizer``
    is "base-lm", and every module starts from its layers; that reads the corpus into
    memory (`prepare_in_memory`).
    `max_files` reads only the first files of the corpus (sorted), for demos and tests.
    """
    from dipaco_server.runs import pieces  # pieces imports this module

    planned = begin_run(run, store=store, max_files=max_files)
    if planned is None:
        return run
    store = store or get_blob_store()
    for piece in pieces.pending(store, planned):
        pieces.write_piece(store, planned, piece, work_root())
        pieces.record_pieces(run, store, planned)
    return finish_run(run, planned["key"], store=store)


def begin_run(
    run: Run, *, store: BlobStore | None = None, max_files: int | None = None
) -> dict[str, Any] | None:
    """The run's preparation plan (runs.pieces.plan), or None when there is nothing to do
    in pieces: the run is not preparing, or it was prepared whole (`prepare_in_memory`)."""
    from dipaco_server.runs import pieces  # pieces imports this module

    run.refresh_from_db()
    if run.state == Run.State.DRAFT:
        transition(run, Run.State.PREPARING)
    elif run.state != Run.State.PREPARING:
        logger.info("run %s is %s, not preparing; nothing to do", run.pk, run.state)
        return None
    store = store or get_blob_store()
    config = run.run_config
    if config.phase1 is None and store.exists(keys.base_model_key(run.pk)):
        prepare_in_memory(run, store=store, max_files=max_files)
        return None
    _check_router_has_base(config, False)
    corpus = run.dataset.source if run.dataset is not None else config.data.corpus
    check_source(corpus)  # the roots may have changed since the run was created
    steps = len(RUN_STAGES)
    report_progress(run, "corpus", 1, steps, f"reading {corpus}")
    key, listing = pieces.plan_key(run, max_files)
    stage_step = {"corpus": 1, "tokenizer": 2, "router": 3}

    def on_stage(stage: str, detail: str) -> None:
        report_progress(run, stage, stage_step[stage], steps, detail)

    work = Path(tempfile.mkdtemp(prefix=f"prepare-{run.pk}-", dir=work_root()))
    try:
        planned = pieces.plan(run, store, key, listing, work, on_stage)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    pieces.record_pieces(run, store, planned)
    return planned


def finish_run(run: Run, key: str, *, store: BlobStore | None = None) -> Run:
    """After every piece: the shards joined and uploaded, version 0 of every module (the
    dense phase's with ``phase1``); ready."""
    from dipaco_server.runs import pieces  # pieces imports this module

    run.refresh_from_db()
    if run.state != Run.State.PREPARING:
        return run
    store = store or get_blob_store()
    planned = json.loads(store.get_bytes(f"{pieces.prefix(key)}/plan.json"))
    missing = pieces.pending(store, planned)
    if missing:
        raise RuntimeError(f"run {run.pk}: pieces {missing[:10]} are not prepared yet")
    steps = len(RUN_STAGES)
    report_progress(run, "shards", 4, steps, "joining the pieces into the shards")
    work = Path(tempfile.mkdtemp(prefix=f"prepare-{run.pk}-", dir=work_root()))
    try:
        pieces.join(run, store, planned, work)
        report_progress(run, "modules", 5, steps, "initialising modules as version 0")
        config = run.run_config
        phase = phases.PATHS if config.phase1 is None else phases.DENSE
        init_module_versions(run, store, work, _initial_modules(config, None), phase)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _ready(run, steps)
    return run


def _ready(run: Run, steps: int) -> None:
    """READY and the "done" stage in one transaction: a reader never sees a ready run whose
    progress still names the last stage."""
    with transaction.atomic():
        transition(run, Run.State.READY)
        report_progress(run, "done", steps, steps, "ready to start")


def prepare_in_memory(
    run: Run, *, store: BlobStore | None = None, max_files: int | None = None
) -> Run:
    """prepare_run for a run with an uploaded checkpoint: the corpus is read into memory
    (its tokenizer, when uploaded, and its features, for a "base-lm" router)."""
    # torch and the tokenizers: seconds to import, in the task that prepares only (every
    # process that loads the URLs loads this module).
    from dipaco.data.corpus import load_corpus
    from dipaco.data.prepare import prepare_documents
    from dipaco.tokenizer import RunTokenizer

    store = store or get_blob_store()
    config = run.run_config
    # torch: runs.checkpoint imports it (seconds); the URLs load this module (rounds.protocol.api).
    from dipaco_server.runs.checkpoint import base_model, load_base_state

    has_base = store.exists(keys.base_model_key(run.pk))
    _check_router_has_base(config, has_base)
    corpus = run.dataset.source if run.dataset is not None else config.data.corpus
    check_source(corpus)  # the roots may have changed since the run was created
    steps = len(RUN_STAGES)
    work = Path(tempfile.mkdtemp(prefix=f"prepare-{run.pk}-", dir=work_root()))
    try:
        report_progress(run, "corpus", 1, steps, f"reading {corpus}")
        split = load_corpus(
            corpus,
            text_field=run.dataset.text_field if run.dataset else config.data.text_field,
            val_fraction=config.data.val_fraction,
            max_files=max_files,
        )
        counts = f"{len(split.train)} train and {len(split.val)} validation documents"
        given = None
        if has_base and store.exists(keys.base_tokenizer_key(run.pk)):
            # The checkpoint's own tokenizer: its token ids are what its embedding rows mean.
            store.download_to(keys.base_tokenizer_key(run.pk), work / "base-tokenizer.json")
            given = RunTokenizer.load(work / "base-tokenizer.json")
        base_state = load_base_state(store, run.pk, config, work) if has_base else None
        lm = config.router.featurizer == "base-lm" and base_state is not None
        stage_step = {"tokenizer": 2, "router": 3, "shards": 4}

        def on_stage(stage: str, detail: str) -> None:
            if stage == "tokenizer":
                detail = f"{counts}; {detail}"
            report_progress(run, stage, stage_step[stage], steps, detail)

        prepared = prepare_documents(
            config, split.train, split.val, work, tokenizer=given,
            model=base_model(base_state, config) if lm and base_state is not None else None,
            on_stage=on_stage,
        )  # fmt: skip
        store.put_file(keys.tokenizer_key(run.pk), prepared.tokenizer_dir / "tokenizer.json")
        if prepared.router_file is not None:
            store.put_file(keys.router_key(run.pk), prepared.router_file)
        upload_shards(run, store, prepared.shards, prepared.shard_dir, phases.PATHS)
        report_progress(run, "modules", 5, steps, "initialising modules as version 0")
        init_module_versions(run, store, work, _initial_modules(config, base_state), phases.PATHS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _ready(run, steps)
    return run


def _check_router_has_base(config: RunConfig, has_base: bool) -> None:
    """A base-lm router needs a base model: phase 1's, or an uploaded checkpoint."""
    routes_with_base = config.num_paths > 1 and config.router.featurizer == "base-lm"
    if routes_with_base and config.phase1 is None and not has_base:
        raise ValueError(
            "router.featurizer = 'base-lm' routes with a base model, and this run has "
            "none: set phase1 to train one first, upload a dense checkpoint (POST "
            "/api/v1/runs/<id>/checkpoint), or use 'tfidf'"
        )


def _initial_modules(
    config: RunConfig, base_state: Mapping[str, Tensor] | None
) -> dict[str, dict[str, Tensor]]:
    """Version 0 of every module: the dense phase's with phase 1, else the path modules,
    from the uploaded checkpoint's layers when there is one."""
    from dipaco.modular import init_modules, init_modules_from_base  # torch, as above

    if config.phase1 is not None:
        return init_modules(config.dense_phase)
    if base_state is not None:
        return init_modules_from_base(config, base_state)
    return init_modules(config)


def work_root() -> Path:
    """Scratch space for preparation, outer steps and evaluation: on the data dir's disk,
    not in a RAM-backed /tmp (an outer step keeps a round's uploads there)."""
    root = Path(settings.DIPACO_DATA_DIR) / "tmp"
    root.mkdir(parents=True, exist_ok=True)
    return root


def init_module_versions(
    run: Run, store: BlobStore, work: Path, modules: dict[str, dict[str, Tensor]], phase: int
) -> None:
    """Version 0 of every module of one phase, from `modules` (module id -> tensors)."""
    # torch: see the note under the imports
    from dipaco.modules_file import write_module

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
    now = timezone.now()
    Dataset.objects.filter(pk=dataset.pk).update(
        state=Dataset.State.PREPARING, error="", updated_at=now
    )
    check_source(dataset.source)  # the roots may have changed since it was created
    stats = CorpusStats()
    report_progress(dataset, "corpus", 0, 1, f"reading {dataset.source}")
    docs = iter_corpus(dataset.source, stats, text_field=dataset.text_field, s3=s3_options())
    for count, _ in enumerate(docs, start=1):
        if count % DATASET_PROGRESS_EVERY == 0:
            report_progress(dataset, "corpus", 0, 1, f"{count} documents read")
    if stats.documents == 0:
        raise ValueError(
            f"corpus {dataset.source!r} holds no readable text ({stats.files} files, "
            f"skipped {dict(stats.skipped)}); point the dataset at text files or a .jsonl"
        )
    dataset.stats = stats.to_json()
    dataset.state = Dataset.State.READY
    with transaction.atomic():  # READY and "done" seen together, as for a run (_ready)
        Dataset.objects.filter(pk=dataset.pk).update(
            stats=dataset.stats, state=dataset.state, updated_at=timezone.now()
        )
        done = f"{stats.documents} documents, {stats.chars} characters"
        report_progress(dataset, "done", 1, 1, done)
    return dataset


def fail_dataset(dataset: Dataset, error: str) -> None:
    Dataset.objects.filter(pk=dataset.pk).update(
        state=Dataset.State.FAILED, error=error, updated_at=timezone.now()
    )
