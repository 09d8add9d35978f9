"""Measured figures in prose that should hold none: ``python -m rrfp.testing.figures [ROOT]``.

Docstrings and comments say what the code does and why; the user's guide says what rrfp
does. A measured figure, a date, a seed or a commit hash in them goes stale with the next
run, so figures live on the results pages (``benchmarks/results/*.md``) beside the command
that wrote them, and the prose links there. This scanner reads every string statement
(docstrings) and every comment of each ``.py`` under ``rrfp/`` and ``torchtitan_ext/``, and
every line of ``docs/guide/*.md`` outside fenced code blocks. Inline code spans are left
out everywhere: they hold input formats and commands, not claims. So are link targets.

It reports a number with a unit of time, size or ratio (a percent, a speedup factor), a
date, a commit hash (seven to forty hex digits, at least one a letter and one a digit), and
a seed number, one ``path:line: match: text`` line per hit, and exits 1 if there is any.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Iterator, NamedTuple

CODE_FOLDERS = ("rrfp", "torchtitan_ext")
GUIDE = Path("docs") / "guide"

_UNIT = (r"ms|us|µs|ns|s|sec|secs|seconds?|min|mins|minutes?|h|hours?"
         r"|KiB|MiB|GiB|TiB|KB|MB|GB|TB|bytes?")
FIGURE = re.compile(rf"""
    \b\d+(?:[.,]\d+)*\s?(?:{_UNIT})\b(?!\()    # a time or a size (not a call like s(...))
  | \b\d+(?:\.\d+)?\s?%                        # a percentage
  | \b\d+(?:\.\d+)?[x×](?!\w)                 # a speedup factor; "2 x 2" is a topology
  | \b20\d\d-[01]\d(?:-[0-3]\d)?\b             # a date
  | \b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{{7,40}}\b  # a commit hash
  | \bseeds?\s*[=:]?\s*\d+                     # a seed
""", re.VERBOSE)
# A code span may wrap onto the next line, never across a blank one (a paragraph's end).
_CODE_SPAN = re.compile(r"``(?:[^`\n]|\n(?!\s*\n))+?``|`(?:[^`\n]|\n(?!\s*\n))+`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


class Hit(NamedTuple):
    path: str
    line: int
    match: str
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.match}: {self.text.strip()}"


def _prose(text: str) -> list[str]:
    """``text``'s lines with code spans and link targets emptied, line breaks kept."""
    spans_out = _CODE_SPAN.sub(lambda span: "``" + "\n" * span.group(0).count("\n"), text)
    return _LINK_TARGET.sub("]()", spans_out).split("\n")


def python_prose(source: str) -> Iterator[tuple[int, str]]:
    """``(first line, text)`` of every comment and every string statement."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            yield node.lineno, node.value.value


def markdown_prose(text: str) -> Iterator[tuple[int, str]]:
    """``(1, text)`` with the lines of fenced code blocks, fences included, emptied."""
    fenced, lines = False, []
    for line in text.splitlines():
        fence = bool(_FENCE.match(line))
        fenced ^= fence
        lines.append("" if fenced or fence else line)
    yield 1, "\n".join(lines)


def figures_in(path: Path, shown: str) -> list[Hit]:
    text = path.read_text()
    blocks = python_prose(text) if path.suffix == ".py" else markdown_prose(text)
    hits = []
    for first, block in blocks:
        for offset, (line, prose) in enumerate(zip(block.split("\n"), _prose(block))):
            hits += [Hit(shown, first + offset, m.group(0), line)
                     for m in FIGURE.finditer(prose)]
    return hits


def scanned_files(root: Path) -> list[Path]:
    files = [p for folder in CODE_FOLDERS for p in sorted((root / folder).rglob("*.py"))]
    return files + sorted((root / GUIDE).glob("*.md"))


def scan(root: Path) -> list[Hit]:
    """Every hit under ``root``, in file order then line order."""
    hits = []
    for path in scanned_files(root):
        hits += sorted(figures_in(path, str(path.relative_to(root))), key=lambda h: h.line)
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path,
                        default=Path(__file__).resolve().parents[2],
                        help="the repository (default: the one holding this file)")
    args = parser.parse_args(argv)
    if not scanned_files(args.root):
        parser.error(f"{args.root} holds no rrfp/, torchtitan_ext/ or docs/guide/ to scan")
    hits = scan(args.root)
    for hit in hits:
        print(hit)
    if hits:
        print(f"{len(hits)} figures in docstrings, comments or the guide", file=sys.stderr)
        return 1
    print("no figures in docstrings, comments or the guide")
    return 0


if __name__ == "__main__":
    sys.exit(main())
