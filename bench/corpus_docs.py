"""Assemble a prose corpus (manuals, package documentation, READMEs) from this machine's files.

    .venv/bin/python bench/corpus_docs.py --out /tmp/docs.jsonl
    .venv/bin/python bench/corpus_docs.py --out /tmp/mixed.jsonl --code stdlib  # code + prose
    .venv/bin/python bench/quality.py --preset modular \\
        --corpus stdlib=stdlib --corpus docs=/tmp/docs.jsonl --json /tmp/quality_modular.json

Nothing is downloaded: the text is three kinds of local files, each optional (--sources):

  man       manual pages (--man-root, /usr/share/man: the English sections man1..man9 and
            their sub-sections, not the translations), gzipped troff with its markup
            stripped by a small roff reader (not `man`, so the text does not depend on the
            terminal or the installed formatter);
  doc       package documentation (--doc-root, Debian's /usr/share/doc): READMEs, NEWS,
            FAQs and guides as plain text, Markdown, reStructuredText or HTML (tags
            stripped), gzipped or not; copyright files and changelogs are left out, being
            the same licence and release-note boilerplate in every package;
  metadata  the long descriptions (mostly READMEs) in Python packages' *.dist-info/METADATA
            (--site, default this interpreter's site-packages).

--code DIR (or "stdlib") adds DIR's Python sources as bench/corpus_jsonl.py reads them, for
a mixed corpus of code and prose.

One record per file, {"text": ..., "source": "<kind>/<path under its root>"}, the layout
bench/corpus_jsonl.py writes and `dipaco.data.corpus` reads (it chunks each record and
splits train/validation by record). Files are read in the order of a hash of their source
name until --max-chars is reached, so a cap samples every kind and package rather than the
first in the alphabet; a text under --min-chars, or one already kept (the same README under
two packages), is skipped. The same files give the same output, byte for byte. Progress goes
to stderr every --progress files; a name ending in .gz is gzipped.
"""

from __future__ import annotations

import argparse
import email.parser
import gzip
import hashlib
import html.parser
import json
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

from dipaco.data.corpus import (
    STDLIB_EXCLUDED_DIRS,
    CorpusStats,
    iter_text_files,
    stdlib_root,
    walk_files,
)

KINDS = ("man", "doc", "metadata")
MAX_FILE_BYTES = 4_000_000  # after decompression: a bigger file is a data dump, not prose
DOC_SUFFIXES = frozenset({".txt", ".text", ".md", ".rst", ".html", ".htm"})
DOC_STEMS = ("readme", "news", "faq", "usage", "install", "howto", "todo", "thanks")
DOC_EXCLUDED = ("copyright", "changelog", "changes")
MAN_SECTION = re.compile(r"^man[1-9][a-z]*$")  # man1, man3p, ...; not de/, fr/, ...

Reader = Callable[[Path], str | None]


def read_bytes(path: Path) -> bytes | None:
    """The file's bytes, gunzipped if its name ends in .gz; None when unreadable or too big."""
    try:
        if path.is_symlink() or path.stat().st_size > MAX_FILE_BYTES:
            return None
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        else:
            data = path.read_bytes()
    except (OSError, EOFError):
        return None
    return None if len(data) > MAX_FILE_BYTES else data


def decode(data: bytes | None) -> str | None:
    """UTF-8 text without NUL bytes (the corpus reader's own rule), else None."""
    if data is None or b"\0" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# roff escapes: named characters worth keeping, then every other escape dropped.
ROFF_CHARS = {"em": "--", "en": "-", "bu": "*", "aq": "'", "dq": '"', "lq": '"', "rq": '"',
              "oq": "'", "cq": "'", "co": "(c)", "rg": "(R)", "mu": "x", "hy": "-", "ti": "~",
              "ha": "^", "rs": "\\", "lh": "<=", "rh": "=>", "<=": "<=", ">=": ">="}  # fmt: skip
ROFF_ESCAPE = re.compile(
    r"\\(?:f(?:\[[^\]]*\]|\(..|.)|s[+-]?\d+|[*nk](?:\[[^\]]*\]|\(..|.)|\((..)|\[([^\]]*)\]"
    r"|[-e ~0&|^%c:]|.)"
)
ROFF_TEXT_MACROS = frozenset({"SH", "SS", "B", "I", "SM", "SB", "Nm", "Nd", "Sh"})
ROFF_PARAGRAPH = frozenset({"PP", "LP", "P", "sp", "br", "Pp", "TP", "IP"})


def _roff_escape(match: re.Match[str]) -> str:
    text = match.group(0)
    name = match.group(1) or match.group(2)
    if name is not None:
        return ROFF_CHARS.get(name, "")
    return {"\\-": "-", "\\e": "\\", "\\ ": " ", "\\~": " ", "\\0": " "}.get(text, "")


def roff_to_text(source: str) -> str:
    """The running text of a troff manual page: comments, requests and font changes gone;
    headings, tags and alternating-font macros (.BR, .IR, ...) kept as their words."""
    lines: list[str] = []
    for raw in source.splitlines():
        if raw.startswith(('.\\"', "'\\\"", '.\\"')) or raw.strip() in (".", "'"):
            continue
        if raw.startswith((".", "'")):
            macro, _, rest = raw[1:].strip().partition(" ")
            words = re.findall(r'"([^"]*)"|(\S+)', rest)
            args = [quoted or bare for quoted, bare in words]
            if macro in ROFF_PARAGRAPH:
                lines.append("")
            if macro in ROFF_TEXT_MACROS:
                lines.append(" ".join(args))
            elif macro == "IP" and args:  # .IP tag indent: the tag is text
                lines.append(args[0])
            elif len(macro) == 2 and macro[0] in "BIRS" and macro[1] in "BIR":  # .BR a b
                lines.append("".join(args))
            continue
        lines.append(raw)
    text = ROFF_ESCAPE.sub(_roff_escape, "\n".join(lines))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


class _HtmlText(html.parser.HTMLParser):
    """The text of an HTML page, a line break at every block element, scripts dropped."""

    BLOCKS = frozenset({"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6",
                        "pre", "dt", "dd", "table", "section", "blockquote"})  # fmt: skip

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.hidden += tag in ("script", "style")
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        self.hidden -= tag in ("script", "style") and self.hidden > 0

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def html_to_text(source: str) -> str:
    parser = _HtmlText()
    parser.feed(source)
    parser.close()
    text = re.sub(r"[ \t]+\n", "\n", "".join(parser.parts))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def read_man(path: Path) -> str | None:
    text = decode(read_bytes(path))
    if text is None or text.lstrip().startswith(".so "):  # a pointer to another page
        return None
    return roff_to_text(text)


def read_doc(path: Path) -> str | None:
    text = decode(read_bytes(path))
    if text is None:
        return None
    plain = path.name.removesuffix(".gz").lower()
    return html_to_text(text) if plain.endswith((".html", ".htm")) else text


def read_metadata(path: Path) -> str | None:
    """The long description of a METADATA file: its body, or an old-style Description."""
    text = decode(read_bytes(path))
    if text is None:
        return None
    message = email.parser.Parser().parsestr(text)
    body = message.get_payload()
    if isinstance(body, str) and body.strip():
        return body.strip()
    description = message.get("Description")
    return str(description).strip() if description else None


def is_doc_file(path: Path) -> bool:
    """Prose of /usr/share/doc: by suffix (.txt, .md, .html, ...) or by name (README, NEWS,
    FAQ, ...), never a copyright file or a changelog."""
    name = path.name.removesuffix(".gz").lower()
    if name.startswith(DOC_EXCLUDED):
        return False
    return Path(name).suffix in DOC_SUFFIXES or name.startswith(DOC_STEMS)


def list_files(root: Path, keep: Callable[[Path], bool]) -> list[Path]:
    """Regular files under `root` that `keep` accepts (no symlinks followed); [] if absent."""
    if not root.is_dir():
        return []
    return [p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and keep(p)]


def candidates(args: argparse.Namespace) -> list[tuple[str, Path, Reader]]:
    """(source name, file, reader) for every file of every kind asked for."""
    found: list[tuple[str, Path, Reader]] = []
    if "man" in args.sources:
        root = args.man_root
        for path in list_files(root, lambda p: MAN_SECTION.match(p.parent.name) is not None):
            if path.parent.parent == root:
                found.append((f"man/{path.relative_to(root).as_posix()}", path, read_man))
    if "doc" in args.sources:
        for path in list_files(args.doc_root, is_doc_file):
            found.append((f"doc/{path.relative_to(args.doc_root).as_posix()}", path, read_doc))
    if "metadata" in args.sources:
        for site in args.site:
            for path in sorted(site.glob("*.dist-info/METADATA")):
                name = f"metadata/{path.parent.name}"
                found.append((name, path, read_metadata))
    return found


def code_documents(directory: str) -> list[tuple[str, str]]:
    """(source name, text) of a tree's Python sources, read as bench/corpus_jsonl.py does."""
    root = stdlib_root() if directory == "stdlib" else Path(directory)
    files = walk_files(root, frozenset({".py"}), STDLIB_EXCLUDED_DIRS)
    return [(f"code/{name}", text) for name, text in iter_text_files(root, files, CorpusStats())]


def family(name: str) -> str:
    """What --max-per-family counts: a manual page's command (gcloud_alpha_x.1 -> man/gcloud),
    a documentation folder's package, a distribution's name."""
    kind, _, rest = name.partition("/")
    if kind == "man":
        return "man/" + re.split(r"[_.]", rest.rsplit("/", 1)[-1], maxsplit=1)[0]
    if kind == "metadata":
        return name
    return f"{kind}/{rest.split('/', 1)[0]}"


def documents(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(source name, text or None when unreadable), in the order of a hash of the name."""
    listed: list[tuple[str, Callable[[], str | None]]] = [
        (name, partial(reader, path)) for name, path, reader in candidates(args)
    ]
    if args.code is not None:
        listed += [(name, partial(str, text)) for name, text in code_documents(args.code)]
    for name, load in sorted(listed, key=lambda item: hashlib.sha256(item[0].encode()).digest()):
        yield name, load()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="the .jsonl or .jsonl.gz file")
    parser.add_argument(
        "--max-chars", type=int, default=12_000_000,
        help="stop once this many characters are kept; the default is about the size of the "
        "standard library corpus (12.3M characters in 1,967 documents) (%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--min-chars", type=int, default=200,
        help="skip a text shorter than this: a stub page, a one-line README (%(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--sources", default=",".join(KINDS),
        help="kinds of files to read, comma-separated, of " + ", ".join(KINDS)
        + " (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-per-family", type=int, default=200,
        help="keep at most this many files of one command's manual pages (one SDK can ship "
        "thousands, gcloud_*), of one package's documentation, one code folder (%(default)s)",
    )  # fmt: skip
    parser.add_argument("--man-root", type=Path, default=Path("/usr/share/man"))
    parser.add_argument("--doc-root", type=Path, default=Path("/usr/share/doc"))
    parser.add_argument(
        "--site", type=Path, action="append", default=None, metavar="DIR",
        help="a site-packages directory whose *.dist-info/METADATA to read; repeatable "
        "(default this interpreter's)",
    )  # fmt: skip
    parser.add_argument(
        "--code", default=None, metavar="DIR",
        help='add the Python sources of DIR ("stdlib": the standard library) for a corpus of '
        "code and prose (default: prose only)",
    )  # fmt: skip
    parser.add_argument("--progress", type=int, default=2000, help="files between progress lines")
    args = parser.parse_args(argv)
    args.sources = [kind for kind in args.sources.split(",") if kind]
    unknown = sorted(set(args.sources) - set(KINDS))
    if unknown:
        parser.error(f"--sources {unknown}: give some of {', '.join(KINDS)}")
    if args.site is None:
        args.site = [Path(sysconfig.get_paths()["purelib"])]
    if min(args.max_chars, args.progress, args.max_per_family) < 1 or args.min_chars < 0:
        parser.error(
            "--max-chars, --max-per-family and --progress: 1 or more; --min-chars: 0 or more"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if args.out.name.endswith(".gz") else open
    kept: Counter[str] = Counter()
    skipped: Counter[str] = Counter()
    seen: set[bytes] = set()
    families: Counter[str] = Counter()
    chars = read = 0
    with opener(args.out, "wt", encoding="utf-8") as out:
        for read, (name, text) in enumerate(documents(args), start=1):
            if read % args.progress == 0:
                print(f"read {read:,} files, kept {sum(kept.values()):,} with {chars:,} "
                      "characters", file=sys.stderr, flush=True)  # fmt: skip
            if text is None:
                skipped["unreadable"] += 1
                continue
            text = text.strip()
            digest = hashlib.sha256(text.encode()).digest()
            why = ("short" if len(text) < args.min_chars else "duplicate" if digest in seen
                   else "family_full" if families[family(name)] >= args.max_per_family else "")  # fmt: skip
            if why:
                skipped[why] += 1
                continue
            if chars + len(text) > args.max_chars:
                break
            seen.add(digest)
            families[family(name)] += 1
            out.write(json.dumps({"text": text, "source": name}, ensure_ascii=False) + "\n")
            kept[name.split("/", 1)[0]] += 1
            chars += len(text)
    if not kept:
        print(f"no text kept from {args.sources}: check --man-root, --doc-root and --site",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"{sum(kept.values())} files ({dict(kept)}), {chars:,} characters -> {args.out}; "
          f"read {read:,}, skipped {dict(skipped)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
