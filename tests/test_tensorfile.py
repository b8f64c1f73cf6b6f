"""dipaco.tensorfile: the streamed safetensors writer and the lazy reader (FileTensors)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dipaco.tensorfile import FileTensors, write_safetensors

TENSORS = {
    "a": torch.randn(3, 4),
    "b": torch.arange(5),
    "empty": torch.zeros(0),
    "half": torch.randn(2).half(),
    "flag": torch.tensor([True, False]),
}


def written(path: Path, tensors: object, **metadata: str) -> Path:
    with open(path, "wb") as handle:
        write_safetensors(handle, tensors, metadata or None)  # type: ignore[arg-type]
    return path


def test_file_tensors_read_back_what_was_written_one_at_a_time(tmp_path: Path) -> None:
    path = written(tmp_path / "t.safetensors", TENSORS, note="x")
    lazy = FileTensors(path)
    assert set(lazy) == set(TENSORS) and len(lazy) == len(TENSORS)
    for name, tensor in TENSORS.items():
        assert lazy.spec(name) == (tensor.dtype, tuple(tensor.shape))
        assert torch.equal(lazy[name], tensor), name
    assert lazy["a"] is not lazy["a"], "each access reads a new tensor: nothing is cached"
    # Any safetensors reader reads the writer's file.
    assert all(torch.equal(v, TENSORS[k]) for k, v in load_file(path).items())


def test_a_lazy_mapping_is_written_under_its_own_names(tmp_path: Path) -> None:
    path = written(tmp_path / "t.safetensors", TENSORS)
    renamed = FileTensors(path, {"moments/a": "a", "moments/half": "half"})
    copy = written(tmp_path / "copy.safetensors", renamed)
    assert load_file(copy).keys() == {"moments/a", "moments/half"}
    assert torch.equal(load_file(copy)["moments/a"], TENSORS["a"])


def test_reopen_keeps_the_mapping_and_the_deleted_file_stays_readable(tmp_path: Path) -> None:
    first = written(tmp_path / "first.safetensors", TENSORS)
    lazy = FileTensors(first, {"x": "a"})
    first.unlink()  # the descriptor keeps the bytes
    assert torch.equal(lazy["x"], TENSORS["a"])
    second = written(tmp_path / "second.safetensors", {"saved/x": TENSORS["a"] * 2})
    same = lazy
    lazy.reopen(second, {"x": "saved/x"})
    assert same is lazy and lazy.path == second
    assert torch.equal(lazy["x"], TENSORS["a"] * 2)
    with pytest.raises(ValueError, match="other tensors"):
        lazy.reopen(second, {"y": "saved/x"})


def test_a_torn_or_foreign_file_is_refused_clearly(tmp_path: Path) -> None:
    path = written(tmp_path / "t.safetensors", TENSORS)
    torn = tmp_path / "torn.safetensors"
    torn.write_bytes(path.read_bytes()[:-8])
    lazy = FileTensors(torn)
    last = max(lazy, key=lambda name: lazy._header[name]["data_offsets"][1])
    with pytest.raises(ValueError, match="torn"):
        lazy[last]
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(b"\xff" * 64)
    with pytest.raises(ValueError, match="not a safetensors file"):
        FileTensors(foreign)
    with pytest.raises(ValueError, match="holds no tensor"):
        FileTensors(path, {"x": "missing"})
