"""Inner-loop checkpoints: one safetensors file with a JSON header, written atomically.

A checkpoint holds the weights, θ_old, the AdamW state, the step, the data position and the
RNG; resuming one on the CPU continues bit for bit. Writing is asynchronous, the pattern of
torchtitan's `components/checkpoint.py` with `async_mode = "async_with_pinned_mem"`: the
loop stands still only while the state is copied into host buffers kept from one checkpoint
to the next (pinned on CUDA, so the device-to-host copies run at full speed, and on a side
stream, so they overlap the next step's forward and backward; its optimizer step waits for
them on the device), and a background thread serialises those buffers to a temporary file, fsyncs it and renames it
over the previous checkpoint. One write is in flight at a time: a new snapshot first waits
for the previous write, whose buffers it reuses. A crash during a write leaves the previous
file whole.

On the CPU there is no copy: the state already lives in host memory, and buffers for it
would cost 12 bytes a parameter (weights and moments; 2 GB at 150M) for as long as the
worker runs, more than the write's stall is worth there. The loop then stands still while
the live tensors are written (streamed, dipaco.tensorfile), and the last checkpoint is what
`snapshot_adam` hands the next unit: the moments read back from the file one tensor at a
time (`FileTensors`), not a copy in memory. Δ is made from the live weights.

`torch.distributed.checkpoint.async_save` (what torchtitan calls) is not used: it writes
DCP's directory format (``.distcp`` shards and a pickled ``.metadata``), not one
safetensors file, and the agent reads nothing back that is not safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from dipaco.config import InnerConfig
from dipaco.inner.state import CheckpointMismatch
from dipaco.tensorfile import FileTensors, write_safetensors

CHECKPOINT_FORMAT = "dipaco-inner-checkpoint/1"
log = logging.getLogger(__name__)


@dataclass
class Progress:
    step: int = 0
    position: int = 0
    tokens: int = 0
    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    lrs: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    # sha256 of the weights the unit started from, once a rebase moved θ_old off them
    # (outer.overlap eager): what a resumed checkpoint is checked against then.
    start_digest: str = ""


def checkpoint_identity(
    cfg: InnerConfig, *, seq_len: int, start_position: int, first_step: int, total: int
) -> dict[str, Any]:
    """What a checkpoint must have been written with to be resumed: the work, not its split.

    The micro-batch split (micro_batch_size x grad_accum_steps) is left out, the batch it
    makes kept: checkpoints fall on step boundaries, where the data position is
    step x batch_size sequences and the AdamW state is per parameter whatever the split,
    so a unit resumes under another split of the same batch (the worker agent's
    out-of-memory fallback halves the micro-batch and resumes its last checkpoint).
    """
    inner = cfg.model_dump(mode="json", exclude={"micro_batch_size", "grad_accum_steps"})
    return {
        "inner": {**inner, "batch_size": cfg.batch_size},
        "seq_len": seq_len,
        "start_position": start_position,
        "first_step": first_step,
        "total_steps": total,
    }


def weights_digest(weights: Mapping[str, Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].detach().cpu().contiguous().view(torch.uint8).numpy().data)
    return digest.hexdigest()


class CheckpointWriter:
    """A loop's checkpoints to `path`: a blocking snapshot, then a background write.

    `theta_old` tensors are referenced, not copied: the loop never changes them in place
    (a rebase replaces them). `count`, `block_s` (the loop's time standing still: waiting
    for the previous write, the snapshots, and the last write, which the loop returns
    after) and `write_s` (the background writes) are what InnerResult reports. An error of a background write is raised by the next `save`
    or `wait`; the previous checkpoint is then still the file on disk.
    """

    # Host buffers and a background write on the CPU too (module doc): the loop does not
    # stand still for the write, at 12 bytes a parameter held for good.
    BUFFERED_ON_CPU = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda"
        # CPU: no host buffers, the live tensors written in the loop's thread (module doc).
        self.direct = device.type == "cpu" and not self.BUFFERED_ON_CPU
        self._saved_step = -1  # the step of the last direct write, whole or not
        self._live_weights: dict[str, Tensor] = {}
        # On CUDA the snapshot's copies run on a side stream, overlapping the next step's
        # forward and backward; the optimizer's step waits for them (`before_update`), the
        # host only where it reads the buffers (the writer thread, the Δ).
        self._stream = torch.cuda.Stream(device) if self._pin else None
        self._copied: torch.cuda.Event | None = None  # the last snapshot's copies, done
        self._unsynced = False  # the optimizer has not waited for them yet
        self._buffers: dict[str, Tensor] = {}  # kept across loops: a resident trainer's
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # `wait` from the loop's thread and a caller's
        self.begin(None)

    def begin(self, path: Path | None) -> None:
        """Start a loop's checkpoints to `path` (after the previous loop's last write, which
        may have been left in flight: its failure is logged, its loop having returned), and
        delete the temporary files of writes a killed process left there (whole ones are
        renamed at once, so a temporary file is always a torn one)."""
        try:
            self.wait()
        except Exception as error:
            log.error("the previous unit's last checkpoint could not be written: %s", error)
        if path is not None and path.parent.is_dir():
            for torn in path.parent.iterdir():
                if torn.name.startswith(f"{path.name}.tmp-"):
                    torn.unlink(missing_ok=True)
        self.path = path or Path("checkpoint.safetensors")
        self.count = 0
        self.done_step = 0  # the step of the last checkpoint whole on disk
        self.block_s = 0.0
        self.write_s = 0.0

    def save(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        theta_old: Mapping[str, Tensor],
        progress: Progress,
        identity: dict[str, Any],
    ) -> None:
        started = time.perf_counter()
        self.wait()  # its buffers are about to be overwritten
        tensors = self._snapshot(model, optimizer, theta_old)
        meta = {"format": CHECKPOINT_FORMAT, "identity": identity, "progress": vars(progress)}
        header = json.dumps(meta)  # now: the loop goes on changing `progress`
        if self.direct:
            # Its error is kept for the next `save` or `wait`, as a background write's is.
            self._write(tensors, header, progress.step, None)
            self._saved_step = progress.step
            self.count += 1
            self.block_s += time.perf_counter() - started
            return
        self._thread = threading.Thread(
            target=self._write,
            args=(tensors, header, progress.step, self._copied),
            name="dipaco-checkpoint",
            daemon=True,
        )
        self._thread.start()
        self.count += 1
        self.block_s += time.perf_counter() - started

    def finish(self) -> None:
        """Wait for the loop's last write (the loop returns after it): counted in block_s."""
        started = time.perf_counter()
        try:
            self.wait()
        finally:
            self.block_s += time.perf_counter() - started

    def wait(self) -> None:
        """Until the write in flight (if any) is on disk; raises its error if it failed."""
        with self._lock:
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            if self._error is not None:
                error, self._error = self._error, None
                raise error

    def in_flight(self) -> Callable[[], None]:
        """Waits for the write in flight now (if any) from another thread, without taking
        its error (the writer's own thread raises it at its next `begin`, which logs it):
        what a caller that removes the checkpoint's folder calls first."""
        thread = self._thread
        return (lambda: None) if thread is None else thread.join

    def before_update(self) -> None:
        """Before the weights and moments change in place (the optimizer's step): on CUDA
        the device waits there for the snapshot's copies still in flight (no host sync)."""
        if self._unsynced and self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)
            self._unsynced = False

    def _landed(self) -> None:
        """The host waits for the last snapshot's copies (CUDA)."""
        if self._copied is not None:
            self._copied.synchronize()

    def snapshot_weights(self) -> dict[str, Tensor]:
        """The last snapshot's weights (fp32 host buffers, by parameter name), valid until
        the next `save`."""
        if self.direct:
            return dict(self._live_weights)
        self._landed()
        return {key[8:]: t for key, t in self._buffers.items() if key.startswith("weights/")}

    def snapshot_adam(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> Mapping[str, Tensor]:
        """The last snapshot's AdamW state as ``<parameter name>/<key>`` copies (the
        buffers are reused by the next snapshot), as `adam_by_name` reads it off the device.
        On the CPU: the same names read lazily from the file just written (`FileTensors`,
        its descriptor kept, so the unit's folder may go)."""
        names = {id(p): n for n, p in model.named_parameters()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        if self.direct and self.done_step == self._saved_step:  # else the file is older
            keys = {
                f"{order[index]}/{key}": f"adam/{index}/{key}"
                for index, state in optimizer.state_dict()["state"].items()
                for key in state
            }
            return FileTensors(self.path, keys)
        self._landed()
        out = {}
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                source = value if self.direct else self._buffers[f"adam/{index}/{key}"]
                out[f"{order[index]}/{key}"] = source.detach().clone()
        return out

    def _snapshot(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, theta_old: Mapping[str, Tensor]
    ) -> dict[str, Tensor]:
        live: dict[str, tuple[Tensor, torch.dtype]] = {
            f"weights/{n}": (p.detach(), torch.float32) for n, p in model.named_parameters()
        }
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                live[f"adam/{index}/{key}"] = (value.detach(), value.dtype)
        if self.direct and all(t.dtype == d for t, d in live.values()):
            self._live_weights = {key[8:]: t for key, (t, _) in live.items()
                                  if key.startswith("weights/")}  # fmt: skip
            return self._extras({key: t for key, (t, _) in live.items()}, theta_old)
        self.direct = False  # not fp32 on the CPU: buffers, as on a GPU
        tensors: dict[str, Tensor] = {}
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the step's work
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for key, (value, dtype) in live.items():
                buffer = self._buffers.get(key)
                if buffer is None or buffer.shape != value.shape or buffer.dtype != dtype:
                    buffer = torch.empty(value.shape, dtype=dtype, pin_memory=self._pin)
                    self._buffers[key] = buffer
                buffer.copy_(value, non_blocking=self._pin)
                tensors[key] = buffer
        if stream is not None:
            self._copied = torch.cuda.Event()
            self._copied.record(stream)
            self._unsynced = True
        return self._extras(tensors, theta_old)

    @staticmethod
    def _extras(tensors: dict[str, Tensor], theta_old: Mapping[str, Tensor]) -> dict[str, Tensor]:
        tensors.update({f"theta_old/{n}": t for n, t in theta_old.items()})
        tensors["rng/cpu"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, state in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng/cuda/{i}"] = state
        return tensors

    def _write(
        self,
        tensors: dict[str, Tensor],
        header: str,
        step: int,
        copied: torch.cuda.Event | None,
    ) -> None:
        started = time.perf_counter()
        tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        try:
            if copied is not None:
                copied.synchronize()  # the snapshot's copies have landed in the buffers
            save_file(tensors, str(tmp), metadata={"dipaco": header})
            os.replace(tmp, self.path)
            self.done_step = step
        except Exception as error:  # handed to the loop's thread, which raises it
            self._error = error
            tmp.unlink(missing_ok=True)
        finally:
            self.write_s += time.perf_counter() - started


def save_file(
    tensors: Mapping[str, Tensor], filename: str, metadata: Mapping[str, str] | None = None
) -> None:
    """safetensors.torch.save_file's call, streamed tensor by tensor (dipaco.tensorfile: no
    serialised copy of the checkpoint in memory), and on disk before it returns (fsync)."""
    with open(filename, "wb") as handle:
        write_safetensors(handle, tensors, metadata)
        handle.flush()
        os.fsync(handle.fileno())  # the bytes reach the disk before the name does


def load_checkpoint(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    theta_old: dict[str, Tensor],
    identity: dict[str, Any],
) -> Progress:
    """Model, optimiser and RNG from the checkpoint; `theta_old` too when a rebase had
    moved it (checked then by the digest of the weights the unit started from)."""
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads((handle.metadata() or {}).get("dipaco", "{}"))
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointMismatch(f"{path} is not an inner-loop checkpoint; delete it")
        if meta["identity"] != identity:
            raise CheckpointMismatch(
                f"{path} was written with other settings ({meta['identity']} vs {identity}); "
                "delete it or pass resume=False"
            )
        start_digest = str(meta["progress"].get("start_digest") or "")
        if start_digest:  # rebased: θ_old moved, the weights it started from are its digest
            if weights_digest(theta_old) != start_digest:
                raise CheckpointMismatch(
                    f"{path} started from other weights (their sha256 differs); "
                    "delete it or pass resume=False"
                )
            for name in theta_old:
                theta_old[name] = handle.get_tensor(f"theta_old/{name}")
        for name, old in theta_old.items():
            if not start_digest and not torch.equal(handle.get_tensor(f"theta_old/{name}"), old):
                raise CheckpointMismatch(
                    f"{path} started from other weights ({name} differs); "
                    "delete it or pass resume=False"
                )
        weights = {n: handle.get_tensor(f"weights/{n}") for n, _ in model.named_parameters()}
        state: dict[int, dict[str, Tensor]] = {}
        for key in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if key.startswith("adam/"):
                _, index, name = key.split("/")
                state.setdefault(int(index), {})[name] = handle.get_tensor(key)
        rng = {key: handle.get_tensor(key) for key in handle.keys() if key.startswith("rng/")}  # noqa: SIM118
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(weights[name])
    optimizer_state = optimizer.state_dict()
    optimizer_state["state"] = state
    optimizer.load_state_dict(optimizer_state)
    torch.set_rng_state(rng["rng/cpu"])
    if torch.cuda.is_available():
        cuda = [rng.get(f"rng/cuda/{i}") for i in range(torch.cuda.device_count())]
        if all(t is not None for t in cuda):  # absent when written on a machine without CUDA
            torch.cuda.set_rng_state_all([t for t in cuda if t is not None])
    return Progress(**meta["progress"])
