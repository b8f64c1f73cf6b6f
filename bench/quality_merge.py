"""Merge `bench/quality.py` runs, one corpus each, into one figure of several corpora.

    .venv/bin/python bench/quality_merge.py /tmp/q/stdlib.json /tmp/q/docs.json \\
        --json docs/figures/quality.json

A corpus takes an hour a run on 2 cores, so each is run alone (`--corpus NAME=PATH`) and
the figures merged here, exactly as `--corpus` repeated would have written them:
{"corpora": {name: figures}, "complete", "preset", ...}, plus "runs": each input's command,
wall time, load and machine, since they were separate runs. Every input must be of one
preset, and no corpus name may come twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RUN_KEYS = ("command", "wall_seconds", "load_average_before", "load_average_after", "machine")


def corpora_of(data: dict[str, Any], source: Path) -> dict[str, dict[str, Any]]:
    """The figures by corpus name of one quality.py --json: a named run's "corpora", or an
    unnamed one-corpus run under its corpus's name (stdlib, docs.jsonl -> docs)."""
    if "corpora" in data:
        return dict(data["corpora"])
    if "corpus" not in data:
        raise SystemExit(f"{source}: not a bench/quality.py --json (no 'corpora' or 'corpus' key)")
    name = Path(str(data["corpus"])).name.split(".", 1)[0] or "corpus"
    return {name: data}


def preset_of(data: dict[str, Any]) -> str | None:
    if "preset" in data:
        return data["preset"]
    return (data.get("args") or {}).get("preset")


def merge(sources: list[Path]) -> dict[str, Any]:
    corpora: dict[str, dict[str, Any]] = {}
    runs, presets, complete = [], set(), True
    for source in sources:
        data = json.loads(source.read_text())
        presets.add(preset_of(data))
        for name, figures in corpora_of(data, source).items():
            if name in corpora:
                raise SystemExit(f"{source}: corpus {name!r} is in an earlier input too; "
                                 "give each corpus once")  # fmt: skip
            corpora[name] = figures
        complete = complete and bool(data.get("complete"))
        runs.append({"file": source.name, **{k: data.get(k) for k in RUN_KEYS}})
    if len(presets) > 1:
        raise SystemExit(
            f"inputs of different presets {sorted(map(str, presets))}: merge one preset"
        )
    return {"corpora": corpora, "complete": complete, "preset": presets.pop(), "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("inputs", nargs="+", type=Path, help="bench/quality.py --json files")
    parser.add_argument("--json", type=Path, required=True, help="where the merged figure goes")
    args = parser.parse_args(argv)
    for source in args.inputs:
        if not source.is_file():
            parser.error(f"{source}: no such file (a bench/quality.py --json output)")
    merged = merge(args.inputs)
    tmp = args.json.with_name(f".{args.json.name}.tmp")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    tmp.replace(args.json)
    print(
        f"wrote {args.json}: corpora {', '.join(merged['corpora'])}; complete {merged['complete']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
