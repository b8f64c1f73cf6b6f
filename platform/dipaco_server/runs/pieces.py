"""A run's data prepared in pieces (dipaco.data.stream): bounded memory, parallel, resumable,
and shared by every run that would prepare the same shards.

`plan` lists the corpus, reads it once (counts, the tokenizer's and the router's samples,
the pieces: a file, or a range of a large file's rows), trains the tokenizer and fits the
router; `write_piece` tokenises, routes and writes one piece's part of every path's shard
and uploads it with its manifest as soon as it is done; `join` concatenates the parts in
piece order into the run's shards. runs.tasks runs the pieces as a Celery chord
(`prepare_piece` tasks, then `finish_preparation`); `prepare_run` (runs.prepare) runs the
same steps in one process.

Everything lives under ``prepared/<key>/`` in the blob store, where ``key`` hashes every
input of the shards: the listing (names and sizes), text field, token budget, validation
fraction, vocabulary size and router settings. So:

- a killed preparation resumes: the plan (``plan.json``, tokenizer, router) and every
  piece whose ``parts/<i>/manifest.json`` exists are kept, and only the rest run (a
  manifest is uploaded after its parts, so a piece killed midway runs again whole);
- the shards are byte for byte the same whatever the number of workers (a piece's bytes
  depend on its records alone; the join reads them in piece order);
- a later run with the same inputs copies the finished shards, tokenizer and router.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from django.db import transaction

from dipaco_server.runs import keys, phases
from dipaco_server.runs.models import Run
from dipaco_server.runs.sources import s3_options
from dipaco_server.runs.stages import report_progress, upload_shards
from dipaco_server.storage import BlobStore, validate_key

logger = logging.getLogger(__name__)

PLAN_VERSION = 2  # bump when a change to dipaco.data.stream changes the shards' bytes


def inputs(run: Run) -> dict[str, Any]:
    """What a run's shards depend on, before the corpus is listed. A run with a dense
    phase 1 is prepared as one path, without a router, and keeps each piece's documents
    (``parts/<i>/documents.jsonl``) for the routing after phase 1 (runs.between)."""
    config = run.run_config
    dataset = run.dataset
    dense = config.phase1 is not None
    return {
        "version": PLAN_VERSION,
        "source": dataset.source if dataset is not None else config.data.corpus,
        "text_field": dataset.text_field if dataset is not None else config.data.text_field,
        "token_budget": dataset.token_budget if dataset is not None else None,
        "val_fraction": config.data.val_fraction,
        "vocab_size": config.model.vocab_size,
        "num_paths": 1 if dense else config.num_paths,
        "dense": dense,
        "factors": list(config.layout.modules_per_level),
        "router": config.router.model_dump(mode="json"),
    }


def prefix(key: str) -> str:
    return validate_key(f"prepared/{key}")


def listing_for(source: str, max_files: int | None) -> Any:
    from dipaco.data.corpus import corpus_listing  # pyarrow, only where a corpus is read

    return corpus_listing(source, s3=s3_options(), max_files=max_files)


def plan_key(run: Run, max_files: int | None) -> tuple[str, Any]:
    """The key of this run's preparation and the corpus listing it hashes."""
    what = inputs(run)
    listing = listing_for(what["source"], max_files)
    what["files"] = [[f.rel, f.size] for f in listing.files]
    digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]
    return digest, listing


def plan(
    run: Run, store: BlobStore, key: str, listing: Any, work: Path, on_stage: Any
) -> dict[str, Any]:
    """Scan, tokenizer and router under prepared/<key>/, once: a stored plan is reused."""
    from dipaco.data import stream  # PIECE_BYTES as it is now (tests set it)
    from dipaco.data.prepare import fit_router_on  # torch, pyarrow: only where a run is prepared
    from dipaco.data.stream import ReadOptions, keep_fraction, prefix_chars, scan_corpus
    from dipaco.tokenizer import train_tokenizer_on

    root = prefix(key)
    if store.exists(f"{root}/plan.json"):
        on_stage("tokenizer", "reusing the tokenizer and router already prepared")
        return dict(json.loads(store.get_bytes(f"{root}/plan.json")))
    config = run.run_config
    what = inputs(run)
    read = ReadOptions(what["text_field"], config.data.val_fraction)

    def on_file(done: int, total: int) -> None:
        if done == total or done % 100 == 0:
            on_stage("corpus", f"read {done}/{total} files")

    scan = scan_corpus(
        listing, read, router_seed=config.router.seed, prefix_chars=prefix_chars(config),
        piece_bytes=stream.PIECE_BYTES, on_file=on_file,
    )  # fmt: skip
    if not scan.pieces or scan.train_chars == 0:
        scan.stats.check_columns(what["source"], what["text_field"])
        raise ValueError(
            f"corpus {what['source']!r} yielded no training documents ({scan.stats.files} "
            f"records, skipped {dict(scan.stats.skipped)}, unreadable {scan.stats.bad_files[:5]}); "
            "point data.corpus or the dataset's source at text"
        )
    on_stage("tokenizer", f"{scan.stats.documents} documents; training the tokenizer")
    tokenizer = train_tokenizer_on(scan.tokenizer_texts, config.model.vocab_size)
    store.put_file(f"{root}/tokenizer.json", tokenizer.save(work / "tokenizer") / "tokenizer.json")
    if what["num_paths"] > 1:
        on_stage(
            "router",
            f"fitting a {config.router.method} router on {len(scan.router_texts)} documents",
        )
        router = fit_router_on(config, scan.router_texts, tokenizer)
        store.put_file(f"{root}/router.safetensors", router.save(work / "router"))
        store.put_file(f"{root}/router.json", work / "router" / "router.json")
    keep = keep_fraction(what["token_budget"], scan.train_chars, tokenizer, scan.tokenizer_texts)
    result = {
        "key": key,
        "source": what["source"],
        "text_field": what["text_field"],
        "val_fraction": config.data.val_fraction,
        "num_paths": what["num_paths"],
        "dense": what["dense"],
        "files": [asdict(f) for f in listing.files],
        "root": listing.root,
        "pieces": scan.pieces,
        "spans": [asdict(span) for span in scan.spans],
        "keep": keep,
        "stats": scan.stats.to_json(),
        "train_chars": scan.train_chars,
    }
    store.put_bytes(f"{root}/plan.json", json.dumps(result).encode())  # last: the plan is whole
    return result


def manifest_key(key: str, piece: int) -> str:
    return f"{prefix(key)}/parts/{piece}/manifest.json"


def part_key(key: str, piece: int, part: str) -> str:
    return validate_key(f"{prefix(key)}/parts/{piece}/{part}.bin")


def documents_key(key: str, piece: int) -> str:
    """A dense plan's piece's documents, JSON Lines of {"split", "text"}, kept for the
    routing after phase 1 (runs.between)."""
    return validate_key(f"{prefix(key)}/parts/{piece}/documents.jsonl")


def pending(store: BlobStore, planned: dict[str, Any]) -> list[int]:
    """Pieces without a manifest: those a resumed preparation still runs (one listing, not
    a request per piece: every finished piece counts them, under the run row's lock)."""
    stored = set(store.list(f"{prefix(planned['key'])}/parts/"))
    return [i for i in planned["pieces"] if manifest_key(planned["key"], i) not in stored]


def _tools(store: BlobStore, planned: dict[str, Any], work: Path) -> tuple[Any, Any]:
    """The stored tokenizer and router, as every piece loads them (so one process or many
    route with the same floats)."""
    from dipaco.routing.router import Router  # torch, pyarrow: only where a run is prepared
    from dipaco.tokenizer import RunTokenizer  # torch, pyarrow: only where a run is prepared

    root = prefix(planned["key"])
    (work / "tok").mkdir(exist_ok=True)
    store.download_to(f"{root}/tokenizer.json", work / "tok" / "tokenizer.json")
    tokenizer = RunTokenizer.load(work / "tok")
    router = None
    if planned["num_paths"] > 1:
        (work / "router").mkdir(exist_ok=True)
        store.download_to(f"{root}/router.safetensors", work / "router" / "router.safetensors")
        store.download_to(f"{root}/router.json", work / "router" / "router.json")
        router = Router.load(work / "router", tokenizer)
    return tokenizer, router


def write_piece(
    store: BlobStore, planned: dict[str, Any], piece: int, work_root: Path
) -> dict[str, Any]:
    """One piece's part of every shard, uploaded, then its manifest; kept if already there."""
    # the corpus readers and the tokenizer: only in the task that writes a piece
    from dipaco.data.sources import Listing, SourceFile, Span, filesystem
    from dipaco.data.stream import PieceResult, ReadOptions
    from dipaco.data.stream import write_piece as write

    key = planned["key"]
    if store.exists(manifest_key(key, piece)):
        return dict(json.loads(store.get_bytes(manifest_key(key, piece))))
    work = Path(tempfile.mkdtemp(prefix=f"piece-{piece}-", dir=work_root))
    try:
        tokenizer, router = _tools(store, planned, work)
        fs = filesystem(planned["source"], s3_options())[0]  # no listing: plan.json has it
        files = [SourceFile(**f) for f in planned["files"]]
        listing = Listing(fs=fs, root=planned["root"], files=files)
        read = ReadOptions(planned["text_field"], planned["val_fraction"])
        out = work / "part"
        span = Span.from_json(planned["spans"][piece])
        docs = work / "documents.jsonl" if planned["dense"] else None
        result: PieceResult = write(
            listing, piece, out, tokenizer, router, read, keep=planned["keep"], span=span,
            documents_out=docs,
        )  # fmt: skip
        for part, info in result.parts.items():
            if info["tokens"]:
                store.put_file(part_key(key, piece, part), out / info["file"])
        if docs is not None:
            store.put_file(documents_key(key, piece), docs)
        store.put_bytes(manifest_key(key, piece), result.to_json().encode())
        return dict(json.loads(result.to_json()))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def record_pieces(run: Run, store: BlobStore, planned: dict[str, Any]) -> None:
    """Run.progress for the run page: pieces done of all, under a lock on the run row so
    pieces finishing together never write a smaller count after a larger one."""
    total = len(planned["pieces"])
    with transaction.atomic():
        locked = Run.objects.select_for_update().get(pk=run.pk)
        done = total - len(pending(store, planned))
        report_progress(locked, "shards", 4, 5, f"{done}/{total} pieces tokenised and routed")
        locked.progress["pieces"] = {"done": done, "total": total}
        Run.objects.filter(pk=run.pk).update(progress=locked.progress)
    run.progress = locked.progress


def join(run: Run, store: BlobStore, planned: dict[str, Any], work: Path) -> Any:
    """The run's shards, index, tokenizer and router: the parts joined in piece order (or
    copied from the run that joined them first). Returns the ShardIndex."""
    from dipaco.data.shards import ShardIndex  # torch, pyarrow: only where a run is prepared
    from dipaco.data.stream import PieceResult, join_parts

    key, root = planned["key"], prefix(planned["key"])
    tokenizer, _ = _tools(store, planned, work)
    results = [
        PieceResult.from_json(store.get_bytes(manifest_key(key, i)).decode())
        for i in planned["pieces"]
    ]

    def open_part(result: PieceResult, part: str) -> IO[bytes]:
        return store.open(part_key(key, result.piece, part))

    shard_dir = work / "shards"
    index: ShardIndex = join_parts(results, open_part, shard_dir, tokenizer, planned["num_paths"])
    store.put_file(keys.tokenizer_key(run.pk), work / "tok" / "tokenizer.json")
    if planned["num_paths"] > 1:
        store.put_file(keys.router_key(run.pk), work / "router" / "router.safetensors")
    if planned["dense"]:  # phase 1's one shard; its documents wait for phase 2's router
        upload_shards(run, store, index, shard_dir, phases.DENSE)
        pointer = {"prepared": key, "pieces": planned["pieces"]}
        store.put_bytes(keys.documents_index_key(run.pk), json.dumps(pointer).encode())
        Run.objects.filter(pk=run.pk).update(phase_chunks=len(planned["pieces"]))
    else:
        upload_shards(run, store, index, shard_dir, phases.PATHS)
    stats = planned["stats"]
    for result in results:
        if result.error:
            stats.setdefault("bad_files", []).append(f"{result.name}: {result.error}")
    logger.info("run %s: shards joined from %d pieces under %s", run.pk, len(results), root)
    return index
