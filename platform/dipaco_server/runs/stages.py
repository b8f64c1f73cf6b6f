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
from dipaco_server.storage import BlobStore

logger = logging.getLogger("dipaco_server.runs.prepare")  # the preparation's one log

__all__ = ["report_progress", "upload_shards"]


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
    store.put_file(keys.data_index_key(run.pk, phase), shard_dir / "index.json")
