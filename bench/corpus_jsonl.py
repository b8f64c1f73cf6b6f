"""Pack a directory of source files into one JSONL corpus that can travel (to a GPU machine).

    .venv/bin/python bench/corpus_jsonl.py .venv/lib/python3.11/site-packages/torch \\
        --max-chars 120000000 --out /tmp/torch-src.jsonl.gz

One record per file, ``{"text": ..., "source": <path relative to the directory>}``, so
`dipaco.data.corpus` chunks each file and splits train/validation by file, as it does for
the directory itself. Files are read the way the corpus reader reads a directory (its text
suffixes, UTF-8 without NUL bytes, at most 8 MB each, no symlinks; `dipaco.data.corpus`'s
iter_text_files) with the stdlib's excluded folders (tests, bytecode) left out,
and kept in the order of a hash of their path until --max-chars is reached, so a cap
samples the whole tree instead of its first folders. A name ending in .gz is gzipped.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import sys
from pathlib import Path

from dipaco.data.corpus import (
    STDLIB_EXCLUDED_DIRS,
    TEXT_SUFFIXES,
    CorpusStats,
    iter_text_files,
    walk_files,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("directory", type=Path, help="the tree to pack")
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl or .jsonl.gz file")
    parser.add_argument("--max-chars", type=int, default=100_000_000, help="(%(default)s)")
    parser.add_argument(
        "--suffixes", default=".py,.pyi,.rst,.md,.txt",
        help="file suffixes to keep, comma-separated (default %(default)s)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        parser.error(f"{args.directory} is not a directory")
    suffixes = frozenset(s if s.startswith(".") else f".{s}" for s in args.suffixes.split(","))
    unknown = suffixes - TEXT_SUFFIXES
    if unknown:
        parser.error(
            f"--suffixes {sorted(unknown)}: the corpus reader keeps only {sorted(TEXT_SUFFIXES)}"
        )
    root = args.directory.resolve()
    order = sorted(
        walk_files(root, suffixes, STDLIB_EXCLUDED_DIRS),
        key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest(),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.out.name.endswith(".gz") else open
    kept = chars = 0
    stats = CorpusStats()
    with opener(args.out, "wt", encoding="utf-8") as out:
        for name, text in iter_text_files(root, order, stats):
            if not text:
                continue
            if chars + len(text) > args.max_chars:
                break
            out.write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")
            kept, chars = kept + 1, chars + len(text)
    print(f"{kept} files, {chars:,} characters -> {args.out}; skipped: {dict(stats.skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
