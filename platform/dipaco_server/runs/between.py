"""Between the phases (docs/design.md §1): from the dense phase-1 model to the first DiPaCo round.

After phase 1's last round closes, `runs.tasks.prepare_phase2` runs these steps as Celery
tasks, each recording ``Run.progress`` (stage, step/steps, detail) for the API and the
dashboard ("preparing phase 2: 3/8 chunks routed"):

1. `begin`: the run's phase becomes "preparing", phase 1's last weights are written as
   the base model (runs.checkpoint, ``runs/<run>/base/model.safetensors``), and
   `fit_router` fits the (product) k-means router on a seeded sample: the
   ``ROUTER_SAMPLE_DOCS`` training documents with the smallest seeded hash of their id
   (dipaco.data.stream.RouterSample), each cut to the characters routing reads. Their
   base-LM features (the mean last hidden state over the first ``router.prefix_tokens``
   tokens) are computed for the fit and nothing else; the router is saved where phase 2
   and inference read it (``router.safetensors``);
2. `route_chunk` (one task per chunk of documents, in a chord; chunk i is piece i of the
   run's preparation, whose documents it kept, runs.pieces.documents_key): the chunk's
   documents streamed, tokenised, featurised and routed ``BATCH_DOCS`` at a time, and
   appended to the chunk's part of every path's shard (``runs/<run>/phase1/routed/<i>/<p>/<split>.bin``, then its
   ``manifest.json``);
3. `finish`: the parts joined in chunk order into the per-path shards
   (``data/<p>/{train,val}.bin``), version 0 of every phase-2 module copied from the
   base model's layers (dipaco.modular.init_modules_from_base); then the phase is 2 and
   round ``phase1.rounds`` opens.

How it scales. The fit costs what the sample costs, whatever the corpus: one forward pass
of the base model over at most ``ROUTER_SAMPLE_DOCS`` prefixes, then k-means and the
balance biases on those rows. Drawing the sample reads every chunk once (JSON and a hash
per document, no tokenising, one document in memory at a time). Routing is linear in the
documents, batched, and spread over the chunks' tasks; a task holds one batch, not its
chunk. The forward passes run on ``DIPACO_SERVER_DEVICE`` (runs.device: a GPU in bf16
autocast where the Celery worker has one).

What the sample changes. The centroids and biases are the sample's. ``max_imbalance``
holds on the sample, and on the whole corpus only as a sample estimate: with 20,000
documents a path with load p has a standard error of sqrt(p(1-p)/20000), under 0.4
percentage points (with fewer training documents than that, the sample is all of them and
the guarantee is exact). The shards still hold every document, each on its router's path.

Every step is idempotent (blobs are deterministic: the router is fitted once, a chunk with a
manifest is kept, version 0 is never rewritten, the round opens once), so a retried or
resent task is safe, and a resent prepare_phase2 resumes with the chunks not yet routed.
A chunk's part depends on the chunk, the router and the base model alone and the join
reads the parts in chunk order, so the shards are byte for byte the same whatever the
number of Celery workers.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from django.db import transaction
from django.utils import timezone
from torch import Tensor

from dipaco.data.stream import (
    ROUTER_SAMPLE_DOCS,
    PieceResult,
    RouterSample,
    join_parts,
    prefix_chars,
    write_parts,
)
from dipaco.inference import export_state
from dipaco.modular import init_modules_from_base, module_spec
from dipaco.modules_file import read_module
from dipaco.routing.router import Router
from dipaco.tokenizer import RunTokenizer
from dipaco_server.runs import keys, phases, pieces
from dipaco_server.runs.checkpoint import base_model, load_base_state, write_base_model
from dipaco_server.runs.device import autocast, server_device
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

STAGES = ("base", "router", "route", "shards", "modules")
MANIFEST = "manifest.json"


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
    """Phase 1's last weights as the base model, then the router fitted on its sample;
    returns the number of chunks to route."""
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
        del modules
        fit_router(run, store, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _record_routed(run, store)
    return run.phase_chunks


def chunk_key(store: BlobStore, run_id: int, chunk: int) -> str:
    """Where chunk ``chunk``'s documents are: piece ``chunk`` of the run's preparation
    (runs.pieces.documents_key), or the chunk an older preparation wrote whole."""
    pointer = keys.documents_index_key(run_id)
    if not store.exists(pointer):
        return keys.documents_key(run_id, chunk)
    where = json.loads(store.get_bytes(pointer))
    return pieces.documents_key(where["prepared"], where["pieces"][chunk])


def documents(store: BlobStore, run_id: int, chunk: int, work: Path) -> Iterator[tuple[str, str]]:
    """(split, text) of every document of one chunk, in the order preparation wrote them,
    read one line at a time from the downloaded chunk."""
    file = work / f"documents-{chunk}.jsonl"
    store.download_to(chunk_key(store, run_id, chunk), file)
    try:
        with open(file, encoding="utf-8") as lines:
            for line in lines:
                row = json.loads(line)
                yield row["split"], row["text"]
    finally:
        file.unlink(missing_ok=True)


def router_sample(run: Run, store: BlobStore, work: Path, size: int | None = None) -> list[str]:
    """The router's sample (module docstring): the ``size`` training documents with the
    smallest seeded hash of their id ("<chunk>/<line>"), cut to the characters routing
    reads; drawn in one pass over the chunks."""
    config = run.run_config
    sample = RouterSample(
        ROUTER_SAMPLE_DOCS if size is None else size, config.router.seed, prefix_chars(config)
    )
    for chunk in range(run.phase_chunks):
        for line, (split, text) in enumerate(documents(store, run.pk, chunk, work)):
            if split == "train":
                sample.add(f"{chunk}/{line}", text)
    return sample.texts()


def _tokenizer(store: BlobStore, run_id: int, work: Path) -> RunTokenizer:
    file = work / "tokenizer.json"
    store.download_to(keys.tokenizer_key(run_id), file)
    return RunTokenizer.load(file)


def _base(run: Run, store: BlobStore, work: Path) -> tuple[Any, Any]:
    """The base model on the server's device, and that device."""
    config = run.run_config
    device = server_device()
    return base_model(load_base_state(store, run.pk, config, work), config).to(device), device


def fit_router(run: Run, store: BlobStore, work: Path) -> None:
    """The router, fitted on the sample with the base model's features, stored once (a
    retried task keeps it); nothing with one path."""
    config = run.run_config
    if config.num_paths == 1 or store.exists(keys.router_key(run.pk)):
        return
    chunks = run.phase_chunks
    report_progress(run, "router", 0, chunks, "preparing phase 2: drawing the router's sample")
    texts = router_sample(run, store, work)
    report_progress(
        run, "router", 0, chunks, f"preparing phase 2: fitting the router on {len(texts)} documents"
    )
    tokenizer = _tokenizer(store, run.pk, work)
    model, device = _base(run, store, work)
    with autocast(device):
        router = Router.fit(
            texts,
            tokenizer,
            factors=config.layout.modules_per_level,
            featurizer="base-lm",
            model=model,
            method=config.router.method,
            prefix_tokens=config.router.prefix_tokens,
            max_imbalance=config.router.max_imbalance,
            seed=config.router.seed,
        )
    store.put_file(keys.router_key(run.pk), router.save(work / "router"))


def route_chunk(run: Run, chunk: int, *, store: BlobStore | None = None) -> int:
    """One chunk tokenised, routed and stored as its part of every path's shard, then its
    manifest; a chunk with a manifest is kept. Returns how many documents it holds."""
    store = store or get_blob_store()
    manifest = keys.routed_key(run.pk, chunk, MANIFEST)
    if not store.exists(manifest):
        work = _work(run, f"phase2-route-{chunk}")
        try:
            tokenizer = _tokenizer(store, run.pk, work)
            router, device = None, server_device()
            if run.run_config.num_paths > 1:
                model, device = _base(run, store, work)
                store.download_to(keys.router_key(run.pk), work / "router.safetensors")
                router = Router.load(work / "router.safetensors", tokenizer, model=model)
            result = PieceResult(piece=chunk, name=chunk_key(store, run.pk, chunk))
            out = work / "part"
            with autocast(device):
                write_parts(documents(store, run.pk, chunk, work), out, tokenizer, router, result)
            for part, info in result.parts.items():
                if info["tokens"]:
                    store.put_file(
                        keys.routed_key(run.pk, chunk, f"{part}.bin"), out / info["file"]
                    )
            store.put_bytes(manifest, result.to_json().encode())  # last: the part is whole
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _record_routed(run, store)
    parts = PieceResult.from_json(store.get_bytes(manifest).decode()).parts
    return sum(info["docs"] for info in parts.values())


def _routed(run: Run, store: BlobStore) -> list[int]:
    """The chunks whose part is stored (their manifest exists), from one listing of the
    routed parts, not a request per chunk (every routed chunk counts them, under a lock)."""
    stored = set(store.list(keys.routed_prefix(run.pk)))
    return [i for i in range(run.phase_chunks) if keys.routed_key(run.pk, i, MANIFEST) in stored]


def pending(run: Run, store: BlobStore) -> list[int]:
    """The chunks a (resumed) preparation still routes."""
    return sorted(set(range(run.phase_chunks)) - set(_routed(run, store)))


def _record_routed(run: Run, store: BlobStore) -> None:
    """Progress: chunks routed, counted under a lock on the run row so that chunks
    finishing together never write a smaller count after a larger one."""
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        chunks = locked.phase_chunks
        done = len(_routed(locked, store))
        report_progress(
            locked, "route", done, chunks, f"preparing phase 2: {done}/{chunks} chunks routed"
        )
    run.progress = locked.progress


def finish(run: Run, *, store: BlobStore | None = None) -> str:
    """The routed parts joined into the shards, the phase-2 modules; then phase 2's first round."""
    run.refresh_from_db()
    if run.state in TERMINAL:
        return str(run.state)
    store = store or get_blob_store()
    config = run.run_config
    chunks = run.phase_chunks
    missing = pending(run, store)
    if missing:
        raise RuntimeError(f"run {run.pk}: chunks {missing[:10]} are not routed yet")
    work = _work(run, "phase2-finish")
    try:
        tokenizer = _tokenizer(store, run.pk, work)
        results = [
            PieceResult.from_json(store.get_bytes(keys.routed_key(run.pk, i, MANIFEST)).decode())
            for i in range(chunks)
        ]

        def open_part(result: PieceResult, part: str) -> IO[bytes]:
            return store.open(keys.routed_key(run.pk, result.piece, f"{part}.bin"))

        report_progress(run, "shards", chunks, chunks, "preparing phase 2: joining the shards")
        shard_dir = work / "data"
        index = join_parts(results, open_part, shard_dir, tokenizer, config.num_paths)
        upload_shards(run, store, index, shard_dir, phases.PATHS)
        shutil.rmtree(shard_dir)
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
