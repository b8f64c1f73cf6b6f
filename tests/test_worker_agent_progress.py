"""The agent's output in a pipe: plain timestamped lines, without rich's source locations."""

from __future__ import annotations

import io
import logging
import re

from rich.console import Console

from worker_agent.progress import RichReporter

TIME = r"\[\d\d:\d\d:\d\d\]"


def test_piped_lines_carry_their_time_and_no_source_location() -> None:
    out = io.StringIO()
    reporter = RichReporter(Console(file=out, force_terminal=False, width=80))
    reporter.event("lease", "lease 4: run tiny round 1 path 1, 20 steps " + "x" * 60)
    reporter.status(step=20, steps=20, loss=3.25, tokens_per_second=1234.0)
    logger = logging.getLogger("worker_agent.test_progress")
    logger.addHandler(reporter.log_handler())
    logger.propagate = False
    try:
        logger.warning("the server answered 503; trying again in 2 s")
    finally:
        logger.handlers.clear()
        logger.propagate = True
    reporter.close()
    lines = out.getvalue().splitlines()
    assert re.fullmatch(rf"{TIME} lease 4: run tiny round 1 path 1, 20 steps x{{60}}", lines[0])
    assert re.fullmatch(rf"{TIME} step 20/20  loss 3\.2500  1,234 tokens/s", lines[1])
    assert "the server answered 503" in lines[2]
    assert len(lines) == 3, "a long line stays one line in a log"
    assert not re.search(r"\w+\.py:\d+", out.getvalue()), out.getvalue()
