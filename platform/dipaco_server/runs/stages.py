"""What the stages of a run's preparation share, whole (runs.prepare) or in pieces
(runs.pieces): recording the stage it is at, and uploading a phase's shards."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from django.utils import timezone

from dipaco_server.runs import keys
from dipaco_server.runs.models import Dataset, Run
from dipaco_server.runs.models import Path as RunPath
from dipaco_server.runs.phases import phase_config
from dipaco_server.storage import BlobStore

logger = logging.getLogger("dipaco_server.runs.prepare")  # the preparation's one log

__all__ = ["report_progress", "upload_rows", "upload_shards"]


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


def upload_shards(run: Run, store: BlobStore, index: Any, shard_dir: Path, phase: int) -> None:
    """One phase's shards and shard index, uploaded, with each path's train split as row
    chunks in the order units read them (`upload_rows`); each Path row gets its token counts
    and routing share (runs.between writes phase 2's after phase 1)."""
    config = phase_config(run.run_config, phase)
    total_docs = sum(entry["train"].docs for entry in index.paths) or 1
    for p, entry in enumerate(index.paths):
        for split in ("train", "val"):
            key = keys.data_key(run.pk, p, split, phase)
            store.put_file(key, shard_dir / entry[split].file)
        upload_rows(store, config, run.pk, p, phase, shard_dir / entry["train"].file, index.dtype)
        RunPath.objects.filter(run=run, phase=phase, index=p).update(
            train_tokens=entry["train"].tokens,
            val_tokens=entry["val"].tokens,
            routing_share=entry["train"].docs / total_docs,
        )
        if entry["val"].tokens <= 1:
            logger.warning("run %s path %d has no validation text: it cannot stop early", run.pk, p)
    store.put_file(keys.data_index_key(run.pk, phase), shard_dir / "index.json")


def upload_rows(
    store: BlobStore, config: Any, run_id: int, path: int, phase: int, train: Path, dtype: str
) -> Any:
    """Path `path`'s train windows as row chunks in the order units read them
    (dipaco.data.rows), written one chunk at a time beside `train` and uploaded, the index
    last (a manifest finds rows only once every chunk is there). A path without one window
    gets none: its manifests say to prepare the data again. Returns the index, or None."""
    # Preparation only (Celery): the web process imports this module, not numpy and torch.
    import shutil

    from dipaco.data.rows import rows_per_chunk, write_rows
    from dipaco.data.shards import TokenShard
    from dipaco.data.windows import path_seed

    shard = TokenShard(train, dtype)
    T = config.model.seq_len
    if len(shard) <= T:
        logger.warning("run %s path %d has no training window: no row chunks", run_id, path)
        return None
    out = train.parent / f".rows-{path}"
    per_chunk = rows_per_chunk(config, shard.dtype.itemsize)

    def upload(done: int, total: int) -> None:
        store.put_file(keys.rows_chunk_key(run_id, path, done - 1, phase), out / f"{done - 1}.bin")
        (out / f"{done - 1}.bin").unlink()

    try:
        rows = write_rows(shard, T, path_seed(config, path), per_chunk, out, on_chunk=upload)
        store.put_bytes(keys.rows_index_key(run_id, path, phase), rows.to_json().encode())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return rows
