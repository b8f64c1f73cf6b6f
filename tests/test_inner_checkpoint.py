"""Asynchronous inner-loop checkpoints: the loop waits for the snapshot, not the write; a
write that dies leaves the previous checkpoint whole; time-based checkpoints resume bit for
bit. The writer is slowed or broken by replacing the safetensors call it writes with."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dipaco.inner import InnerResult, StepMetrics, run_inner_loop
from dipaco.inner import checkpoint as inner_checkpoint
from dipaco.model import build_model
from dipaco.tensorfile import FileTensors
from tests.test_inner import CFG, SOURCE

CFG9 = CFG.inner.model_copy(update={"steps": 9})
SaveFile = Callable[..., None]


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run(**kwargs: Any) -> InnerResult:
    model = build_model(CFG.model, 0)
    return run_inner_loop(model, SOURCE, CFG9, seq_len=CFG.model.seq_len, **kwargs)


def saved_step(path: Path) -> int:
    with safe_open(str(path), framework="pt") as handle:
        return int(json.loads(handle.metadata()["dipaco"])["progress"]["step"])


def header_step(kwargs: dict[str, Any]) -> int:
    return int(json.loads(kwargs["metadata"]["dipaco"])["progress"]["step"])


def assert_same_training(a: InnerResult, b: InnerResult) -> None:
    assert a.losses == b.losses and a.position == b.position
    for name, delta in a.delta.items():
        assert torch.equal(b.delta[name], delta), name


def test_on_the_cpu_a_checkpoint_is_the_live_tensors_written_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU's default: no host buffers. Each write ends before the next step, the
    moments handed on are read back from the last checkpoint (not a copy in memory), and
    the unit trains exactly as with buffers and a background write."""
    events: list[tuple[str, int]] = []

    def traced_save_file(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        save_file(tensors, filename, **kwargs)
        events.append(("write done", header_step(kwargs)))

    monkeypatch.setattr(inner_checkpoint, "save_file", traced_save_file)
    ckpt = tmp_path / "direct.safetensors"
    direct = run(checkpoint_path=ckpt, checkpoint_every=2,
                 on_step=lambda m: events.append(("step", m.step)))  # fmt: skip
    assert events.index(("write done", 2)) < events.index(("step", 3))
    assert isinstance(direct.adam, FileTensors) and direct.adam.path == ckpt
    monkeypatch.setattr(inner_checkpoint.CheckpointWriter, "BUFFERED_ON_CPU", True)
    buffered = run(checkpoint_path=tmp_path / "buffered.safetensors", checkpoint_every=2)
    assert_same_training(direct, buffered)
    assert direct.adam.keys() == buffered.adam.keys()
    ckpt.unlink()  # the unit's folder goes after its hand-in: the moments stay readable
    for key in buffered.adam:
        assert torch.equal(direct.adam[key], buffered.adam[key]), key


def test_a_slow_checkpoint_write_does_not_hold_up_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The write of step 2's checkpoint is held until step 3 has run: a loop that waited
    for its writes would never reach step 3 while it is held (the hold gives up after 60 s)."""
    events: list[tuple[str, int]] = []
    release = threading.Event()

    def slow_save_file(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        step = header_step(kwargs)
        events.append(("write started", step))
        if step == 2:
            release.wait(timeout=60)
        save_file(tensors, filename, **kwargs)
        events.append(("write done", step))

    def on_step(metrics: StepMetrics) -> None:
        events.append(("step", metrics.step))
        if metrics.step == 3:
            release.set()

    monkeypatch.setattr(inner_checkpoint, "save_file", slow_save_file)
    monkeypatch.setattr(inner_checkpoint.CheckpointWriter, "BUFFERED_ON_CPU", True)
    ckpt = tmp_path / "unit.safetensors"
    result = run(checkpoint_path=ckpt, checkpoint_every=2, on_step=on_step)
    assert events.index(("write started", 2)) < events.index(("step", 3))
    assert events.index(("step", 3)) < events.index(("write done", 2))
    # One write at a time: step 4's snapshot waited for step 2's write.
    assert events.index(("write done", 2)) < events.index(("write started", 4))
    assert events[-1] == ("write done", 9)  # the last one is on disk when the loop returns
    assert result.checkpoints == 5 and saved_step(ckpt) == 9  # steps 2, 4, 6, 8 and the end
    assert result.checkpoint_block_s > 0 and result.checkpoint_write_s > 0


def test_a_crash_during_a_background_write_leaves_the_previous_checkpoint_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def dying_save_file(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        if header_step(kwargs) < 4:
            save_file(tensors, filename, **kwargs)
            return
        Path(filename).write_bytes(b"\x00" * 4096)  # half a file, then the disk goes away
        raise OSError("the disk went away mid-write")

    uninterrupted = run()
    monkeypatch.setattr(inner_checkpoint, "save_file", dying_save_file)
    ckpt = tmp_path / "unit.safetensors"
    with pytest.raises(OSError, match="mid-write"):
        run(checkpoint_path=ckpt, checkpoint_every=2)
    assert saved_step(ckpt) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["unit.safetensors"]  # no torn temp file
    monkeypatch.undo()
    resumed_at: list[int] = []
    resumed = run(checkpoint_path=ckpt, on_step=lambda m: resumed_at.append(m.step))
    assert resumed_at[0] == 3
    assert_same_training(resumed, uninterrupted)


KILLED_MIDWAY = """
import json, os, signal, sys
from pathlib import Path
import torch
from safetensors.torch import save_file
from dipaco.inner import checkpoint as inner_checkpoint, run_inner_loop
from dipaco.model import build_model
from dipaco.tensorfile import FileTensors
from tests.test_inner import CFG, SOURCE

def killed_midway(tensors, filename, **kwargs):
    if json.loads(kwargs["metadata"]["dipaco"])["progress"]["step"] < 4:
        return save_file(tensors, filename, **kwargs)
    Path(filename).write_bytes(b"\\0" * 4096)
    os.kill(os.getpid(), signal.SIGKILL)

inner_checkpoint.save_file = killed_midway
torch.set_num_threads(1)
cfg = CFG.inner.model_copy(update={"steps": 9})
run_inner_loop(build_model(CFG.model, 0), SOURCE, cfg, seq_len=32,
               checkpoint_path=Path(sys.argv[1]), checkpoint_every=2)
"""


def test_a_process_killed_during_a_background_write_resumes_from_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "unit.safetensors"
    root = Path(__file__).resolve().parent.parent
    killed = subprocess.run([sys.executable, "-c", KILLED_MIDWAY, str(ckpt)], cwd=root,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    torn = [p.name for p in tmp_path.iterdir() if p.name != ckpt.name]
    assert len(torn) == 1 and torn[0].startswith("unit.safetensors.tmp-")
    assert saved_step(ckpt) == 2
    resumed_at: list[int] = []
    resumed = run(checkpoint_path=ckpt, on_step=lambda m: resumed_at.append(m.step))
    assert resumed_at[0] == 3
    assert_same_training(resumed, run())
    assert [p.name for p in tmp_path.iterdir()] == ["unit.safetensors"]  # the torn one is gone


class Crash(Exception):
    pass


def test_a_loop_checkpointed_by_time_resumes_bit_identically_after_a_crash(
    tmp_path: Path,
) -> None:
    """An interval shorter than any step checkpoints after every step; a crash at step 5
    leaves step 4's checkpoint whole on disk (the loop waits for its write before it
    raises)."""
    uninterrupted = run()
    ckpt = tmp_path / "unit.safetensors"
    checkpointed: list[tuple[int, int]] = []

    def crash_at_5(metrics: StepMetrics) -> None:
        checkpointed.append((metrics.step, metrics.checkpointed_step))
        if metrics.step == 5:
            raise Crash

    with pytest.raises(Crash):
        run(checkpoint_path=ckpt, checkpoint_interval_s=1e-9, on_step=crash_at_5)
    assert saved_step(ckpt) == 4
    # What on_step reports as on disk is never ahead of the checkpoints taken.
    assert all(done < step for step, done in checkpointed)
    assert [done for _, done in checkpointed] == sorted(done for _, done in checkpointed)
    resumed = run(checkpoint_path=ckpt, checkpoint_interval_s=1e-9)
    assert resumed.checkpoints == 9 - 4  # after steps 5..8, and at the end
    assert_same_training(resumed, uninterrupted)


def test_a_stopped_loop_has_its_checkpoint_on_disk_when_it_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Salvage on SIGTERM: the agent stops the loop and may exit right after it returns."""
    writes: list[int] = []

    def recording_save_file(tensors: dict[str, torch.Tensor], filename: str, **kwargs: Any) -> None:
        save_file(tensors, filename, **kwargs)
        writes.append(header_step(kwargs))

    monkeypatch.setattr(inner_checkpoint, "save_file", recording_save_file)
    calls = iter(range(100))
    ckpt = tmp_path / "unit.safetensors"
    stopped = run(checkpoint_path=ckpt, checkpoint_interval_s=3600.0,
                  should_stop=lambda: next(calls) == 6)  # fmt: skip
    assert not stopped.completed and writes == [6] and saved_step(ckpt) == 6
    assert stopped.checkpoints == 1


def test_it_refuses_a_checkpoint_interval_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="checkpoint_interval_s"):
        run(checkpoint_interval_s=0.0)
