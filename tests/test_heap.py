"""worker_agent.heap: glibc's mmap threshold, fixed, returns a freed mid-sized tensor's
pages to the system (the dynamic threshold keeps them in the heap)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import sys
    import torch
    from worker_agent.heap import fix_mmap_threshold

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    if sys.argv[1] == "fixed":
        assert fix_mmap_threshold()
    # A freed 16 MiB block raises the dynamic threshold past 4 MiB (up to 32 MiB) ...
    big = torch.ones(4 << 20)
    del big
    before = rss()
    # ... so 64 tensors of 4 MiB come from the heap, and small ones kept between them
    # stop the heap from trimming its top: their freed pages stay counted.
    held, kept = [], []
    for _ in range(64):
        held.append(torch.ones(1 << 20))
        kept.append(torch.ones(1 << 10))
    del held
    print((rss() - before) >> 20)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_fixed_threshold_returns_freed_tensors() -> None:
    def left(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True,
                             text=True, check=True, timeout=120)  # fmt: skip
        return int(out.stdout.split()[-1])

    assert left("fixed") < 16, "a fixed threshold frees the tensors' 256 MiB"
    assert left("dynamic") >= 128, "the default keeps them: the probe would show nothing"
