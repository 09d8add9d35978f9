"""How big the runtime's rooms are: ``python -m rrfp.testing.code_size [PACKAGE_DIR]``.

Prints the five longest classes, functions and modules of ``rrfp/`` (lines, from a
definition's first line, decorators included, to its last), and whether each is within
the project's limits: no class over ``MAX_CLASS`` lines, no function over
``MAX_FUNCTION``, no module over ``MAX_MODULE``.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import NamedTuple

MAX_CLASS, MAX_FUNCTION, MAX_MODULE = 300, 80, 500


class Sized(NamedTuple):
    lines: int
    where: str
    """``path:line name``."""


def measure(root: Path) -> dict[str, list[Sized]]:
    """Every class, function (methods included) and module under ``root``, longest first."""
    found: dict[str, list[Sized]] = {"class": [], "function": [], "module": []}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        shown = path.relative_to(root.parent)
        found["module"].append(Sized(len(text.splitlines()), str(shown)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                found[kind].append(Sized(node.end_lineno - first + 1,
                                         f"{shown}:{node.lineno} {node.name}"))
    return {kind: sorted(sizes, reverse=True) for kind, sizes in found.items()}


def over_limits(found: dict[str, list[Sized]]) -> list[str]:
    limits = {"class": MAX_CLASS, "function": MAX_FUNCTION, "module": MAX_MODULE}
    return [f"{kind} {s.where}: {s.lines} lines, over {limits[kind]}"
            for kind, sizes in found.items() for s in sizes if s.lines > limits[kind]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path,
                        default=Path(__file__).resolve().parents[1],
                        help="the package folder (default: rrfp)")
    args = parser.parse_args(argv)
    found = measure(args.root)
    for kind, plural, limit in (("class", "classes", MAX_CLASS),
                                ("function", "functions", MAX_FUNCTION),
                                ("module", "modules", MAX_MODULE)):
        print(f"five longest {plural} (limit {limit} lines):")
        for sized in found[kind][:5]:
            print(f"  {sized.lines:4d}  {sized.where}")
    over = over_limits(found)
    for line in over:
        print("over the limit:", line)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
