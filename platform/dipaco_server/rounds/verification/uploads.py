"""One contribution as the checks see it (`Upload`, `Verdict`), and the format check:
each upload fetched, its size and sha256 against what its worker declared, then its
content against the module's spec (header, names, shapes, dtypes, finite values)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from dipaco import codecs
from dipaco.codecs import CodecError
from dipaco.modules_file import Spec
from dipaco_server.rounds.verification import rules
from dipaco_server.storage import BlobNotFound, BlobStore

DOWNLOAD_CHUNK = 1 << 20


@dataclass(frozen=True)
class Upload:
    """One contribution as the outer step sees it: where it is and what its worker declared."""

    contribution_id: int
    worker_id: int
    key: str
    size: int
    sha256: str
    tokens: int
    path: int = 0  # the index of the path its unit trained: the √ rescale counts these
    unit_id: int = 0
    lease_id: int = 0
    position: int = 0  # the unit's data_position: where its training windows start
    replayed: bool = False  # its sha256 was uploaded before in this run (rounds.verification.rules)
    check_of: int | None = None  # a check copy's: the original's contribution (replication)
    partial: bool = False  # salvaged before its lease's steps were done
    # The fraction of a whole unit's H steps it trained: a lease sized down (to the round's
    # deadline, a calibration) or a salvaged Δ is honest work that moves the loss less.
    work: float = 1.0
    # The fraction of a whole unit the server itself sized its lease to (rounds.protocol.leases
    # .size_unit): what it knows without the worker's claim.
    sized: float = 1.0
    # The mean learning rate its lease's steps train at, as a fraction of the peak
    # (rounds.granted.lr_share): late in a phase's cosine decay an honest unit gains less.
    lr_share: float = 1.0
    # (module id, version) of every module of its path: the versions its unit's Δ is
    # relative to (the unit's base, or with outer.overlap eager those it rebased onto,
    # rounds.protocol.rebase); proof of useful work scores it there. (): the unit's base versions.
    delta_base: tuple[tuple[str, int], ...] = ()
    # Its worker's earlier replica differences in this module, newest first: (the other
    # copy's worker, whether its own copy was the check copy, the difference's sketch,
    # rounds.verification.persistence).
    replica_past: tuple[tuple[int, bool, bytes], ...] = ()


@dataclass(eq=False)  # identity: it holds tensors
class Verdict:
    upload: Upload
    file: Path | None = None  # the verified local copy while it is needed
    norm: float | None = None
    reason: str = ""  # "<code>: <message>" when rejected
    cosine: float | None = None  # with the module's outer momentum
    score: rules.Score | None = None  # proof of useful work
    # Its Δ decoded once, to raw fp32 in the spec's order beside its file (`decoded`): the
    # screen, the replica comparison, the peer check and the aggregation read that back
    # one Δ at a time, so each upload is decoded once a step and memory stays bounded.
    raw: Path | None = None
    # Its Δ minus the other copy's of its unit, sketched (rounds.verification.persistence), when
    # the two were compared: kept on its contribution as its worker's evidence.
    sketch: bytes | None = None
    partner: int | None = None  # the other copy's worker
    # The other copy's worker when the two copies agreed (not merely identical bytes): its
    # worker's evidence for leaving probation (workers.probation).
    agreed_with: int | None = None
    # What the check at its completion recorded (rounds.verification.arrival), when the
    # step reuses it instead of checking these bytes again.
    arrival: Mapping[str, Any] | None = None

    def arrival_cosine(self, momentum_version: int | None) -> tuple[bool, float | None]:
        """(whether the check at arrival took its cosine with the momentum of
        `momentum_version`, that cosine)."""
        record = self.arrival
        if record is None or momentum_version is None or "momentum_version" not in record:
            return False, None
        if record["momentum_version"] != momentum_version:
            return False, None
        cosine = record.get("cosine")
        return True, float(cosine) if cosine is not None else None

    @property
    def accepted(self) -> bool:
        return not self.reason

    def decoded(self, spec: Spec) -> dict[str, Tensor]:
        """Its Δ as fp32 tensors: decoded from the verified file the first time, read back
        from the raw copy after. Each call returns a new copy; drop it when done."""
        if self.raw is not None:
            return read_raw(self.raw, spec)
        assert self.file is not None, "decoded after its file was released"
        # Its sha256 was checked as it downloaded (fetch).
        delta = codecs.decode(self.file, spec, verify_checksum=False)
        raw = self.file.with_suffix(".f32")
        with open(raw, "wb") as out:
            for name in spec:
                out.write(delta[name].contiguous().view(torch.uint8).numpy().data)
        self.raw = raw
        return delta

    def release(self) -> None:
        """Delete its local copies (refused, or done with)."""
        for path in (self.file, self.raw):
            if path is not None:
                path.unlink(missing_ok=True)
        self.file = self.raw = None

    def reject(self, code: str, message: str) -> None:
        self.reason = f"{code}: {message}"
        self.release()


# (upload, its decoded Δ) -> its score, or None when it cannot be scored
ScoreFn = Callable[[Upload, Mapping[str, Tensor]], "rules.Score | None"]


def read_raw(path: Path, spec: Spec) -> dict[str, Tensor]:
    """A Δ written by `Verdict.decoded`: fp32 values of each tensor of `spec`, in order."""
    total = sum(math.prod(shape) for shape, _ in spec.values())
    flat = torch.from_file(str(path), size=total, dtype=torch.float32)  # (total,), a copy
    out, start = {}, 0
    for name, (shape, _) in spec.items():
        count = math.prod(shape)
        out[name] = flat[start : start + count].view(shape)
        start += count
    return out


def fetch(store: BlobStore, upload: Upload, directory: Path) -> tuple[Path, bytearray]:
    """Download one upload to a file and to memory (for pass 1, which then drops it),
    refusing it unless its size and sha256 are the ones declared.

    The declared size is bounded by the completion check (an fp32 module plus a header),
    and a larger upload is refused as soon as it passes that size.
    """
    path = directory / f"contribution-{upload.contribution_id}.safetensors"
    digest, size, data = hashlib.sha256(), 0, bytearray(upload.size)
    try:
        stream: BinaryIO = store.open(upload.key)
    except BlobNotFound:
        raise CodecError("missing", "nothing was uploaded under its key") from None
    complete = False
    try:
        with stream, open(path, "wb") as out:
            while chunk := stream.read(DOWNLOAD_CHUNK):
                if size + len(chunk) > upload.size:
                    raise CodecError("size_mismatch", f"larger than the {upload.size} B declared")
                data[size : size + len(chunk)] = chunk
                size += len(chunk)
                digest.update(chunk)
                out.write(chunk)
        if size != upload.size:
            raise CodecError("size_mismatch", f"{size} B uploaded, {upload.size} B declared")
        if digest.hexdigest() != upload.sha256:
            raise CodecError("checksum_mismatch", "its sha256 differs from the one declared")
        complete = True
    finally:
        if not complete:
            path.unlink(missing_ok=True)
    return path, data


def check_upload(store: BlobStore, upload: Upload, spec: Spec, work: Path) -> tuple[Path, float]:
    """Fetch one upload and check it completely: (its file, its norm), or CodecError."""
    path, data = fetch(store, upload, work)
    try:
        # The whole blob's sha256 was checked while it downloaded; the per-tensor digests
        # inside come from the same worker and would add nothing.
        stats = codecs.verify(data, spec, verify_checksum=False)
    except CodecError:
        path.unlink()
        raise
    if not math.isfinite(stats.norm):
        path.unlink()
        raise CodecError("norm_overflow", "its norm overflows fp32")
    return path, stats.norm
